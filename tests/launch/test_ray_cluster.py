"""Ray actors import the same ``areal_fast`` as the driver, even when the driver runs in a
source checkout that would shadow it (Ray puts the driver's directory on their path)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

DRIVER = """
import json, os, sys
import areal_fast, ray
from areal_fast.launch.ray_cluster import _in_package_parent

here = os.getcwd()
with _in_package_parent():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
assert os.getcwd() == here

@ray.remote
def where():
    import areal_fast
    return areal_fast.__file__

print(json.dumps({"driver": areal_fast.__file__, "actor": ray.get(where.remote())}))
ray.shutdown()
"""


def test_actors_import_the_drivers_package_not_the_cwd(tmp_path):
    pytest.importorskip("ray")
    checkout = tmp_path / "checkout"  # a source tree: the package without its extension
    shutil.copytree(REPO / "areal_fast", checkout / "areal_fast", symlinks=True,
                    ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the "installed" package, with _C
    out = subprocess.run([sys.executable, str(script)], cwd=checkout, env=env, text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["driver"] == str(REPO / "areal_fast" / "__init__.py")
    assert seen["actor"] == seen["driver"]
