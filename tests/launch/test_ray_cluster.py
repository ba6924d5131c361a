"""Ray actors import the same ``areal_fast`` as the driver, even when the driver runs in a
source checkout that would shadow it (Ray puts the driver's directory on their path); they
work in the driver's directory and can still import modules from it, read the job's key from
the object store and name their node; the launcher keeps its SIGTERM handler across
``ray.init``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# runs in the checkout, as the `areal-fast` script would (the current directory is not on the
# driver's path); its worker target is a module in that directory (like an agent file)
DRIVER = """
import json, os, secrets, signal, sys, threading
from multiprocessing.connection import Listener
import areal_fast, msgpack, ray
from areal_fast.launch.ray_cluster import (
    ActorJob, _in_package_parent, _remote_actor, _sigterm_kept,
)
sys.path.append(os.getcwd())
import probe
ray.cloudpickle.register_pickle_by_value(probe)  # arguments load before the actor's chdir

def on_sigterm(signum, frame):
    pass

signal.signal(signal.SIGTERM, on_sigterm)
here = os.getcwd()
with _in_package_parent(), _sigterm_kept():
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
assert os.getcwd() == here
assert signal.getsignal(signal.SIGTERM) is on_sigterm  # ray.init sets its own
key = secrets.token_bytes(16)
listener = Listener(("127.0.0.1", 0), authkey=key)
hello = []
threading.Thread(
    target=lambda: hello.append(msgpack.unpackb(listener.accept().recv_bytes())), daemon=True
).start()
actor = _remote_actor().remote()
job = ActorJob("w", probe.target, "seen.json", listener.address, [ray.put(key)], here)
ray.get(actor.run.remote(job))
node = {"id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}
print(json.dumps({"driver": areal_fast.__file__, "hello": hello[0], "node": node,
                  "driver_key": key.hex(),
                  **json.loads(open("seen.json").read())}))
ray.shutdown()
"""

PROBE = """
import json, os, signal, sys

def target(conn, name, spec, authkey):
    import areal_fast
    import beside  # a module in the driver's directory
    with open(spec, "w") as fh:
        json.dump({"actor": areal_fast.__file__, "cwd": os.getcwd(), "beside": beside.VALUE,
                   "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
                   "key": authkey.hex(), "env_node": [os.environ.get("AREAL_FAST_NODE_ID"),
                                                      os.environ.get("AREAL_FAST_NODE_IP")]}, fh)
"""


def test_actors_import_the_drivers_package_not_the_cwd(tmp_path):
    pytest.importorskip("ray")
    checkout = tmp_path / "checkout"  # a source tree: the package without its extension
    shutil.copytree(
        REPO / "areal_fast",
        checkout / "areal_fast",
        symlinks=True,
        ignore=shutil.ignore_patterns("_C*", "__pycache__"),
    )
    (checkout / "probe.py").write_text(PROBE)
    (checkout / "beside.py").write_text("VALUE = 7\n")
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the "installed" package, with _C
    out = subprocess.run(
        [sys.executable, str(tmp_path / "driver.py")],
        cwd=checkout,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    installed = str(REPO / "areal_fast" / "__init__.py")
    node, hello = seen.pop("node"), seen.pop("hello")
    assert seen.pop("key") == seen.pop("driver_key")  # put by the driver, read from the store
    assert seen == {
        "driver": installed,
        "actor": installed,
        "cwd": str(checkout),
        "beside": 7,
        "sigint_ignored": True,
        "env_node": [node["id"], node["ip"]],  # the actor's node: the driver's here
    }
    assert hello["name"] == "w" and hello["node_ip"] == node["ip"] and hello["pid"] > 0
