"""The one-node Slurm cluster of tests/launch/slurm (:mod:`slurm_cluster`), started once per session.

Where it cannot start (Slurm not installed, not root) its tests are skipped with the reason;
with ``AREAL_FAST_REQUIRE_SLURM=1`` (CI) they fail instead.
"""

from __future__ import annotations

import os

import pytest
import slurm_cluster


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A running :class:`slurm_cluster.SlurmCluster`."""
    try:
        cluster = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    except slurm_cluster.Unavailable as exc:
        if os.environ.get("AREAL_FAST_REQUIRE_SLURM"):
            pytest.fail(f"AREAL_FAST_REQUIRE_SLURM=1 but {exc}")
        pytest.skip(str(exc))
    yield cluster
    slurm_cluster.stop(cluster)
