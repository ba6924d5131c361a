"""Logging sinks besides ``metrics.jsonl`` and ``progress.png``: TensorBoard and Weights & Biases.

Both get what ``metrics.jsonl`` gets, at the training step as global step: every numeric key
of each step's record as a scalar (so a key added to the record later is logged with no
change here), each list key ending in ``_hist`` (``staleness_hist``: trained tokens per
staleness 0, 1, 2, ...) as a histogram of counts per integer value, and the held-out
accuracies ``eval_before`` (step 0) and ``eval_after`` (the last step). The packages are
optional: :func:`~areal_fast.launch.packages.check_packages` refuses an enabled sink whose
package is missing, before anything is written.

A resumed run writes to the same places: TensorBoard to the same folder, hiding the events
of the steps that are trained again (``SummaryWriter(purge_step=...)``); wandb resumes the
same run id, kept in ``<run dir>/wandb/run_id`` (online, wandb ignores the steps it already
has; offline, each attempt is its own ``offline-run-*`` folder of that run id, uploaded in
order by ``wandb sync``).
"""

from __future__ import annotations

import logging
import numbers
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from areal_fast.launch.config import ConfigError

if TYPE_CHECKING:
    from areal_fast.launch.config import ExperimentConfig

log = logging.getLogger("areal_fast.launch")

TENSORBOARD_FOLDER = "tensorboard"  # under the run directory
WANDB_ID_FILE = Path("wandb") / "run_id"  # under the run directory


def split_record(record: dict) -> tuple[int, dict[str, float], dict[str, list[int]]]:
    """A step record as (step, scalars, histograms).

    Parameters
    ----------
    record : dict
        One line of ``metrics.jsonl`` (``step`` plus any keys).

    Returns
    -------
    step : int
        ``record["step"]``.
    scalars : dict of str to float
        Every other key whose value is a real number (booleans as 0 / 1).
    histograms : dict of str to list of int
        Every key ending in ``_hist`` whose value is a list: counts per value 0, 1, 2, ...
    """
    scalars, histograms = {}, {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, numbers.Real):
            scalars[key] = float(value)
        elif key.endswith("_hist") and isinstance(value, list):
            histograms[key] = [int(c) for c in value]
    return int(record["step"]), scalars, histograms


class _TensorBoard:
    """Event files of one attempt (``torch.utils.tensorboard.SummaryWriter``)."""

    def __init__(self, folder: Path, purge_step: Optional[int]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder), purge_step=purge_step)

    def log(self, step: int, scalars: dict, histograms: dict) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        for key, counts in histograms.items():
            seen = [k for k, c in enumerate(counts) if c]
            if not seen:
                continue
            self.writer.add_histogram_raw(
                key,
                min=seen[0],
                max=seen[-1],
                num=sum(counts),
                sum=sum(k * c for k, c in enumerate(counts)),
                sum_squares=sum(k * k * c for k, c in enumerate(counts)),
                # bucket k holds (k - 0.5, k + 0.5]: the integer k
                bucket_limits=[k + 0.5 for k in range(len(counts))],
                bucket_counts=counts,
                global_step=step,
            )
        self.writer.flush()

    def close(self, exit_code: int) -> None:
        self.writer.close()


class _Wandb:
    """One attempt's wandb run (the same run id across resumes)."""

    def __init__(self, cfg: "ExperimentConfig", run_dir: Path, resume: bool):
        import wandb

        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else ""
        if not run_id:
            run_id = uuid.uuid4().hex[:8]
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id + "\n")
        self.wandb = wandb
        try:
            self.run = self._init(wandb, cfg, run_dir, run_id)
        except Exception as exc:  # e.g. no API key for mode online: one line, not a traceback
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(
                f"logging.wandb.mode = {cfg.logging.wandb.mode!r}: wandb could not start the "
                f"run ({why}); log in with `wandb login` or WANDB_API_KEY, or use "
                f"logging.wandb.mode=offline"
            ) from exc

    @staticmethod
    def _init(wandb, cfg: "ExperimentConfig", run_dir: Path, run_id: str):
        from omegaconf import OmegaConf

        w = cfg.logging.wandb
        return wandb.init(
            project=w.project or cfg.experiment_name,
            name=w.name or cfg.trial_name,
            entity=w.entity,
            group=w.group,
            tags=list(cfg.tags) or None,
            mode=w.mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True),
            # the console stays ours (progress bar); no code or git state is uploaded
            settings=wandb.Settings(console="off", save_code=False, disable_git=True),
        )

    def log(self, step: int, scalars: dict, histograms: dict) -> None:
        data: dict = dict(scalars)
        for key, counts in histograms.items():
            if any(counts):
                edges = [k - 0.5 for k in range(len(counts) + 1)]
                data[key] = self.wandb.Histogram(np_histogram=(counts, edges))
        self.run.log(data, step=step)

    def close(self, exit_code: int) -> None:
        self.run.finish(exit_code=exit_code)


class LogSinks:
    """The enabled sinks of one attempt of a run. A context manager: ``with LogSinks(...)``
    closes (flushes) them at the end, also when the body raises or is interrupted.

    Parameters
    ----------
    cfg : ExperimentConfig
        ``cfg.logging`` says which sinks; the wandb run gets the whole config.
    run_dir : Path
        The run directory: TensorBoard writes ``tensorboard/``, wandb ``wandb/``.
    resume_step : int, optional
        None for a new run; else the step the attempt continues after (the steps after it,
        and step 0's held-out evaluation when it is 0, are logged again).

    Raises
    ------
    ConfigError
        The wandb run cannot start (e.g. mode ``online`` without a login); one line.
    """

    def __init__(self, cfg: "ExperimentConfig", run_dir: Path, resume_step: Optional[int]):
        self.sinks: list = []
        try:
            if cfg.logging.tensorboard:
                purge = None if resume_step is None else (resume_step + 1 if resume_step else 0)
                self.sinks.append(_TensorBoard(Path(run_dir) / TENSORBOARD_FOLDER, purge))
            if cfg.logging.wandb.mode != "disabled":
                self.sinks.append(_Wandb(cfg, Path(run_dir), resume_step is not None))
        except BaseException:
            self.close(exit_code=1)
            raise

    def __enter__(self) -> "LogSinks":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.close(exit_code=0 if kind is None else 1)

    def log_step(self, record: dict) -> None:
        """Log one step's record (a line of ``metrics.jsonl``) at its ``step``."""
        if self.sinks:
            step, scalars, histograms = split_record(record)
            for sink in self.sinks:
                sink.log(step, scalars, histograms)

    def log_eval(self, key: str, step: int, accuracy: float) -> None:
        """Log a held-out accuracy (a fraction) as scalar ``key`` at ``step``."""
        for sink in self.sinks:
            sink.log(step, {key: float(accuracy)}, {})

    def close(self, exit_code: int = 0) -> None:
        """Flush and close every sink (``exit_code`` != 0: wandb marks the run failed); a sink
        that fails to close is logged, the others still close."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close(exit_code)
            except Exception as exc:  # closing must not hide the run's own outcome
                log.warning("closing the %s sink failed: %s", type(sink).__name__[1:], exc)
