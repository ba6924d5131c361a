"""Which weights version every rollout worker serves, and how long each update took to reach
all of them (``summary.json``: ``weight_update_latency_seconds``, ``weight_versions``,
``weight_checksums``)."""

from __future__ import annotations

import time

from areal_fast.wire import messages as msg


class WeightTracker:
    """The controller's record of published and acknowledged weight versions.

    Parameters
    ----------
    workers : list[str]
        Rollout worker names.

    Attributes
    ----------
    acked : dict[str, int]
        Worker → the newest version it serves (0 until it acknowledges one).
    latency_seconds : list[float]
        Per published version, seconds from the trainer's :class:`StepDone` (the version is
        in its slot) until every rollout worker serves it or a newer one.
    versions : dict[str, list[int]]
        Worker → every version it acknowledged, in order.
    checksums : dict[int, dict[str, str]]
        Version → ``{"trainer": crc, worker: crc, ...}`` when checksums are on.
    """

    def __init__(self, workers: list[str]):
        self.acked = {name: 0 for name in workers}
        self.versions: dict[str, list[int]] = {name: [] for name in workers}
        self.latency_seconds: list[float] = []
        self.checksums: dict[int, dict[str, str]] = {}
        self._published: dict[int, float] = {}  # version → when its StepDone arrived

    def published(self, done: msg.StepDone) -> None:
        """The trainer published ``done.version``."""
        self._published[done.version] = time.monotonic()
        if done.weights_checksum:
            self.checksums.setdefault(done.version, {})["trainer"] = done.weights_checksum

    def acknowledged(self, worker: str, update: msg.WeightsUpdated) -> None:
        """``worker`` serves ``update.version`` now."""
        self.acked[worker] = max(self.acked[worker], update.version)
        self.versions.setdefault(worker, []).append(update.version)
        if update.checksum:
            self.checksums.setdefault(update.version, {})[worker] = update.checksum
        everyone = min(self.acked.values())
        for version in [v for v in self._published if v <= everyone]:
            self.latency_seconds.append(time.monotonic() - self._published.pop(version))

    def restarted(self, worker: str) -> None:
        """``worker`` was restarted: it serves no version until it acknowledges one."""
        self.acked[worker] = 0

    def summary(self) -> dict:
        """The JSON-able record for ``summary.json``."""
        return {
            "weight_update_latency_seconds": [round(x, 4) for x in self.latency_seconds],
            "weight_versions": self.versions,
            "weight_checksums": {str(v): c for v, c in sorted(self.checksums.items())},
        }
