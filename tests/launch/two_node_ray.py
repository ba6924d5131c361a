"""A Ray cluster of two separate nodes on this machine, for tests of multi-node runs.

The head node is started as usual; the second node joins it with ``--node-ip-address
127.0.0.2`` inside its own mount namespace, with a private tmpfs on ``/dev/shm``
(``unshare -m``, then ``mount -t tmpfs``), so a process there cannot open the head node's
shared memory, as on a separate machine. Both nodes share this machine's network and the rest
of its file system.

Use the module-scoped fixture :func:`two_node_ray` by importing it into a test module
(``from two_node_ray import two_node_ray``; pytest puts this folder on the import path).
Drivers run as subprocesses with ``two_node_ray.env`` (token authentication, which Ray turns
on at ``ray start``, and this cluster's token) and connect to ``two_node_ray.address``.

Each node has 2 CPUs. A job of 2 trainer ranks and 2 rollout workers of 0.5 CPU each takes
half of them; with ``scheduler.placement_strategy=SPREAD`` Ray puts the two trainer ranks on
different nodes and the two rollout workers on different nodes (which node gets rank 0
varies). The other half leaves room for the tests' own actors. Every port is chosen free, the
cluster's files live in a fresh temporary directory (so ``ray.init()`` elsewhere on this
machine never finds this cluster), and teardown stops both ``ray start --block`` processes
and kills whatever of theirs is left (never another Ray instance of this machine).

Needs root (for the mount namespace) and ``unshare``; the fixture skips, saying which is
missing, where either is not there.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

NODE2_IP = "127.0.0.2"
CPUS_PER_NODE = 2
OBJECT_STORE_BYTES = 200 * 1024 * 1024  # per node: the tests move little through Ray
START_TIMEOUT_S = 120.0

# run by a driver: wait until both nodes are alive, then describe them (head first)
_NODES_PROBE = """
import json, sys, time
import ray
ray.init(address=sys.argv[1], log_to_driver=False)
deadline = time.monotonic() + float(sys.argv[2])
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= 2 or time.monotonic() > deadline:
        break
    time.sleep(0.5)
head = ray.get_runtime_context().get_node_id()
alive.sort(key=lambda n: n["NodeID"] != head)
print(json.dumps([[n["NodeID"], n["NodeManagerAddress"]] for n in alive]))
"""


@dataclass
class TwoNodeRay:
    """A running two-node Ray cluster.

    Attributes
    ----------
    address : str
        ``"ip:port"`` of the head's GCS: ``ray.init(address=...)`` or
        ``scheduler.ray_address``.
    head_ip, node2_ip : str
        Node IP of the head (this machine's address as Ray sees it) and of the second node
        (``127.0.0.2``).
    node_ids : tuple[str, str]
        Ray node ids, head first.
    env : dict[str, str]
        Environment for driver subprocesses: this process's, plus token authentication
        (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``).
    temp_dir : str
        The cluster's Ray temporary directory (logs under ``session_latest/logs``).
    """

    address: str
    head_ip: str
    node2_ip: str
    node_ids: tuple[str, str]
    env: dict
    temp_dir: str


def _free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that are free on every interface now."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket()
            sock.bind(("0.0.0.0", 0))
            socks.append(sock)
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


def _node_ports(ports: list[int]) -> list[str]:
    """Flags giving one node's Ray services the free ``ports`` (6 of them)."""
    names = (
        "node-manager-port",
        "object-manager-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
        "metrics-export-port",
    )
    return [f"--{name}={port}" for name, port in zip(names, ports, strict=True)] + [
        "--min-worker-port=0",  # workers take ports the system picks
        "--max-worker-port=0",
    ]


def _client_port(port: int) -> list[str]:
    """The flag moving the Ray Client server off its fixed default port, where it runs
    (it needs ``ray[client]``)."""
    try:
        from ray._private.utils import get_ray_client_dependency_error
    except ImportError:
        return []
    return [] if get_ray_client_dependency_error() else [f"--ray-client-server-port={port}"]


def _ray_executable() -> str:
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


def _skip_reason() -> str:
    """Why the cluster cannot be started here ("" when it can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a second Ray node needs its own mount namespace: run as root"
    if shutil.which("unshare") is None:
        return "a second Ray node needs its own mount namespace: `unshare` is not installed"
    return ""


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM a ``ray start --block`` process (it stops its node's services), then SIGKILL
    its whole process group."""
    if proc.poll() is None:
        with _no_error():
            proc.send_signal(signal.SIGTERM)
        with _no_error():
            proc.wait(timeout)
    with _no_error():
        os.killpg(proc.pid, signal.SIGKILL)
    with _no_error():
        proc.wait(5.0)


class _no_error:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return exc_type is not None and issubclass(exc_type, (OSError, subprocess.TimeoutExpired))


def _kill_leftovers(marker: str) -> None:
    """SIGKILL every process whose command line names ``marker`` (this cluster's temporary
    directory; Ray's services carry it in their arguments)."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            with _no_error():
                os.kill(int(entry.name), signal.SIGKILL)


def _log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


@pytest.fixture(scope="module")
def two_node_ray():
    """Start the two-node cluster (module scope), yield a :class:`TwoNodeRay`, stop it.

    Raises
    ------
    RuntimeError
        A node did not start or join within 120 s (the message has the end of its log).
    """
    pytest.importorskip("ray")
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    temp_dir = tempfile.mkdtemp(prefix="af2n-", dir="/tmp")  # short: Ray's socket paths
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    env.pop("RAY_ADDRESS", None)
    ports = _free_ports(14)
    address_port, client_port = ports[0], ports[1]
    ray_exe = _ray_executable()
    common = [
        f"--num-cpus={CPUS_PER_NODE}",
        "--num-gpus=0",
        f"--object-store-memory={OBJECT_STORE_BYTES}",
        "--disable-usage-stats",
        "--block",
    ]
    head_log, node2_log = Path(temp_dir, "head.out"), Path(temp_dir, "node2.out")
    procs: list[subprocess.Popen] = []
    try:
        with head_log.open("wb") as out:
            procs.append(
                subprocess.Popen(
                    [
                        ray_exe,
                        "start",
                        "--head",
                        f"--port={address_port}",
                        *_client_port(client_port),
                        f"--temp-dir={temp_dir}",
                        "--include-dashboard=false",
                        *_node_ports(ports[2:8]),
                        *common,
                    ],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        address = _wait_head(temp_dir, procs[0], head_log)
        with node2_log.open("wb") as out:
            procs.append(
                subprocess.Popen(
                    [
                        "unshare",
                        "-m",
                        "sh",
                        "-c",
                        'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"',
                        ray_exe,
                        "start",
                        f"--address={address}",
                        f"--node-ip-address={NODE2_IP}",
                        *_node_ports(ports[8:14]),
                        *common,
                    ],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        nodes = _wait_two_nodes(address, env, procs, node2_log)
        (head_id, head_ip), (node2_id, node2_ip) = nodes
        yield TwoNodeRay(address, head_ip, node2_ip, (head_id, node2_id), env, temp_dir)
    finally:
        for proc in reversed(procs):  # the second node first, then the head
            _stop(proc, timeout=30.0)
        _kill_leftovers(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_head(temp_dir: str, proc: subprocess.Popen, log: Path) -> str:
    """The head's GCS address (``ray start`` writes it to ``ray_current_cluster`` in its
    temporary directory once the node is up), once it accepts connections."""
    deadline = time.monotonic() + START_TIMEOUT_S
    written = Path(temp_dir, "ray_current_cluster")
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the Ray head node exited at start:\n{_log_tail(log)}")
        address = written.read_text().strip() if written.exists() else ""
        if address:
            host, port = address.rsplit(":", 1)
            with _no_error(), socket.create_connection((host, int(port)), timeout=1.0):
                return address
        time.sleep(0.5)
    raise RuntimeError(
        f"the Ray head node did not start within {START_TIMEOUT_S:g} s:\n{_log_tail(log)}"
    )


def _wait_two_nodes(address: str, env: dict, procs: list, log: Path) -> list:
    """``[[node id, node ip], ...]`` of the two alive nodes, head first."""
    done = subprocess.run(
        [sys.executable, "-c", _NODES_PROBE, address, str(START_TIMEOUT_S)],
        env=env,
        text=True,
        capture_output=True,
        timeout=START_TIMEOUT_S + 60,
    )
    nodes = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else []
    if len(nodes) != 2:
        raise RuntimeError(
            f"the second Ray node did not join the head at {address} within "
            f"{START_TIMEOUT_S:g} s (alive: {nodes}; exit {procs[-1].poll()}):\n"
            f"{done.stderr[-2000:]}\n{_log_tail(log)}"
        )
    return nodes
