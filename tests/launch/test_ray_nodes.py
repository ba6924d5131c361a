"""Workers on several nodes: the address every server binds (``scheduler.bind_host``) and the
one it tells its peers, the trainer group's rendezvous at rank 0's node, node names in error
messages, and the job's key kept out of Ray's task arguments.

The last tests run the Ray launcher's cluster on the two-node test cluster
(:mod:`two_node_ray`), with stand-in workers that do what the real ones do with the network:
the trainer ranks join one gloo group at the rendezvous and sum a tensor, the rollout workers
serve a shard store that the driver connects to with the job's key.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing import Pipe
from pathlib import Path

import pytest
from two_node_ray import NODE2_IP, two_node_ray  # noqa: F401 - the fixture

from areal_fast._nodes import NODE_IP_ENV, reachable_host
from areal_fast.launch.cluster import ClusterSpec
from areal_fast.launch.config import ConfigError, SchedulerConfig, load_config
from areal_fast.wire.codec import MessageChannel
from areal_fast.wire.handles import WorkerError, WorkerHandle, wait_messages
from areal_fast.wire.messages import WorkerFailed
from areal_fast.wire.shards import ShardStore
from areal_fast.workers.trainer_worker import TrainerWorkerSpec

REPO = Path(__file__).resolve().parents[2]
NOT_HERE = "203.0.113.9"  # TEST-NET-3: never an address of this machine


@pytest.mark.parametrize(
    "value, words",
    [
        ("localhost", "scheduler.bind_host = 'localhost' is not an IPv4 address"),
        ("fe80::1", "IPv6 is not supported: 0.0.0.0 binds every interface"),
        ("10.0.0.300", "scheduler.bind_host = '10.0.0.300' is not an IPv4 address"),
    ],
)
def test_bad_bind_host_is_named(value, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"scheduler.bind_host={value}"])
    assert words in str(info.value) and "\n" not in str(info.value)


def test_ipv6_wildcard_is_refused():
    with pytest.raises(ValueError, match="bind_host = '::' is not an IPv4 address .*IPv6"):
        SchedulerConfig(bind_host="::")


def test_bind_host_defaults_and_wildcards(monkeypatch):
    assert load_config(None, []).scheduler.bind_host is None
    assert load_config(None, ["scheduler.bind_host=0.0.0.0"]).scheduler.bind_host == "0.0.0.0"
    monkeypatch.delenv(NODE_IP_ENV, raising=False)
    assert reachable_host("0.0.0.0") == "127.0.0.1"  # a local process: loopback
    assert reachable_host("10.1.2.3") == "10.1.2.3"
    assert reachable_host("0.0.0.0", "10.9.9.9") == "10.9.9.9"
    monkeypatch.setenv(NODE_IP_ENV, "127.0.0.2")  # set by the Ray actor
    assert reachable_host("0.0.0.0") == reachable_host("::") == "127.0.0.2"


@dataclass
class _GroupFactory:
    """Stands in for the trainer factory: only the group fields matter here."""

    rank: int = 0
    world_size: int = 1
    dist_init_method: str = ""
    dist_timeout: float = 600.0


def _spec(bind_host=None, ranks=2, **kwargs) -> ClusterSpec:
    from areal_fast.workers.rollout_worker import RolloutWorkerSpec

    return ClusterSpec(
        rollout=RolloutWorkerSpec(engine_factory=print, reward_fn=print),
        trainer=TrainerWorkerSpec(_GroupFactory()),
        num_rollout_workers=1,
        scheduler=SchedulerConfig(train_world_size=ranks, bind_host=bind_host, dist_timeout=42),
        **kwargs,
    )


def _init_methods(specs) -> list[str]:
    return [s.trainer_factory.dist_init_method for s in specs]


def test_trainer_specs_meet_at_the_given_rendezvous():
    specs = _spec().trainer_specs(rendezvous=("10.0.0.7", 29512))
    assert [(s.rank, s.world_size) for s in specs] == [(0, 2), (1, 2)]
    assert [(s.trainer_factory.rank, s.trainer_factory.world_size) for s in specs] == [
        (0, 2),
        (1, 2),
    ]
    assert _init_methods(specs) == ["tcp://10.0.0.7:29512"] * 2
    assert [s.trainer_factory.dist_timeout for s in specs] == [42, 42]
    # the spec's own rendezvous (what the Ray launcher sets), and the argument over it
    spec = _spec(rendezvous=("10.0.0.8", 29513))
    assert _init_methods(spec.trainer_specs()) == ["tcp://10.0.0.8:29513"] * 2
    assert _init_methods(spec.trainer_specs(("10.0.0.9", 1))) == ["tcp://10.0.0.9:1"] * 2


@pytest.mark.parametrize("bind_host, host", [(None, "127.0.0.1"), ("0.0.0.0", "127.0.0.1")])
def test_local_rendezvous_on_a_reachable_address(bind_host, host):
    (first, second) = _init_methods(_spec(bind_host).trainer_specs())
    assert first == second and first.startswith(f"tcp://{host}:")
    assert 0 < int(first.rsplit(":", 1)[1]) < 65536
    assert _spec(bind_host).rollout_spec().host == (bind_host or "127.0.0.1")


def test_unbindable_bind_host_is_named():
    for call in (lambda s: s.trainer_specs(), lambda s: s.rollout_spec()):
        with pytest.raises(ValueError, match=f"scheduler.bind_host = '{NOT_HERE}' cannot be"):
            call(_spec(NOT_HERE))
    assert _spec(NOT_HERE, ranks=1).trainer_specs()[0].trainer_factory.dist_init_method == ""


def test_shard_server_on_a_wildcard_tells_the_node_address(monkeypatch):
    monkeypatch.delenv(NODE_IP_ENV, raising=False)
    store = ShardStore(b"k" * 32, "0.0.0.0")
    try:
        assert store.address.startswith("127.0.0.1:")
    finally:
        store.close()
    monkeypatch.setenv(NODE_IP_ENV, "127.0.0.2")
    store = ShardStore(b"k" * 32, "0.0.0.0")
    try:
        host, port = store.address.split(":")
        assert host == "127.0.0.2" and int(port) > 0
    finally:
        store.close()


class _Handle(WorkerHandle):
    def __init__(self, name, conn, node):
        self.name, self.conn, self.node = name, MessageChannel(conn), node

    @property
    def pid(self):
        return 4321

    def exit_status(self):
        return "actor ended: RayActorError"


def test_messages_name_the_workers_node():
    ours, theirs = Pipe()
    handle = _Handle("trainer-1", ours, "127.0.0.2")
    assert handle.died_message("while training") == (
        "worker 'trainer-1' (pid 4321, node 127.0.0.2) died with actor ended: RayActorError "
        "while training"
    )
    MessageChannel(theirs).send(WorkerFailed("trainer-1", "RuntimeError: gloo timed out"))
    with pytest.raises(WorkerError) as info:
        wait_messages([handle], 5.0, "while training")
    assert str(info.value) == (
        "worker 'trainer-1' (node 127.0.0.2) failed while training: RuntimeError: gloo timed out"
    )
    theirs.close()
    with pytest.raises(WorkerError, match=r"\(pid 4321, node 127.0.0.2\) died"):
        wait_messages([handle], 5.0, "while training")
    local = _Handle("rollout-0", Pipe()[0], None)  # a local process: no node named
    assert local.died_message("x") == (
        "worker 'rollout-0' (pid 4321) died with actor ended: RayActorError x"
    )


# stand-in workers, shipped to the actors by value
PROBE = """
import datetime, json, os
from dataclasses import dataclass
from areal_fast.wire.messages import Shutdown, WorkerReady


@dataclass
class RolloutProbe:
    out: str
    host: str = "127.0.0.1"


@dataclass
class TrainerProbe:
    out: str
    rank: int = 0
    world_size: int = 1
    dist_init_method: str = ""
    dist_timeout: float = 600.0


def _record(out, name, seen):
    seen["env"] = [os.environ.get("AREAL_FAST_NODE_ID"), os.environ.get("AREAL_FAST_NODE_IP")]
    with open(os.path.join(out, name + ".json"), "w") as fh:
        json.dump(seen, fh)


def _serve(conn):
    while not isinstance(conn.recv(), Shutdown):
        pass


def rollout(conn, name, spec, authkey):
    from areal_fast.wire.shards import ShardStore
    store = ShardStore(authkey, spec.host)
    store.start()
    _record(spec.out, name, {"host": spec.host, "address": store.address})
    conn.send(WorkerReady(name, node_addr=store.address))
    _serve(conn)
    store.close()


def trainer(conn, name, spec, authkey):
    import torch
    import torch.distributed as dist
    f = spec.trainer_factory
    dist.init_process_group("gloo", init_method=f.dist_init_method, rank=f.rank,
                            world_size=f.world_size,
                            timeout=datetime.timedelta(seconds=f.dist_timeout))
    total = torch.tensor([float(f.rank + 1)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    _record(f.out, name, {"init": f.dist_init_method, "sum": total.item()})
    conn.send(WorkerReady(name))
    _serve(conn)
"""

# a driver: the Ray launcher's cluster with the stand-ins, on the two-node cluster
DRIVER = """
import json, os, sys
from multiprocessing.connection import Client
import ray, ray.actor
sys.path.insert(0, os.getcwd())
import probe
ray.cloudpickle.register_pickle_by_value(probe)  # arguments load before the actor's chdir
import areal_fast.launch.cluster as cluster_module
cluster_module.trainer_worker_main, cluster_module.rollout_worker_main = probe.trainer, probe.rollout
from areal_fast.workers.trainer_worker import TrainerWorkerSpec
from areal_fast.wire.handles import WorkerError, wait_messages
from areal_fast.launch.cluster import ClusterSpec
from areal_fast.launch.config import SchedulerConfig
from areal_fast.launch.ray_cluster import RayCluster

address, bind_host = sys.argv[1], (sys.argv[2] or None)
out = os.getcwd()
calls = []  # the arguments of every actor method call the launcher makes
remote = ray.actor.ActorMethod.remote
def spy(self, *args, **kwargs):
    calls.append(args)
    return remote(self, *args, **kwargs)
ray.actor.ActorMethod.remote = spy

scheduler = SchedulerConfig(
    type="ray", ray_address=address, train_world_size=2, bind_host=bind_host,
    cpus_per_trainer_rank=0.5, cpus_per_rollout_worker=0.5, placement_strategy="SPREAD",
    dist_timeout=60,
)
spec = ClusterSpec(
    rollout=probe.RolloutProbe(out), trainer=TrainerWorkerSpec(probe.TrainerProbe(out)),
    num_rollout_workers=2, scheduler=scheduler,
)
result = {}
with RayCluster(spec, scheduler) as cluster:
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    on_node = ray.util.placement_group_table(cluster.pg)["bundles_to_node_id"]
    handles = {h.name: h for h in [*cluster.trainer_ranks, *cluster.rollout_workers]}
    key = cluster.authkey
    result["bundle_ip"] = {n: ips[on_node[i]] for n, i in cluster._bundles.items()}
    result["bundle_node"] = {n: on_node[i] for n, i in cluster._bundles.items()}
    result["handle_ip"] = {n: h.node_ip for n, h in handles.items()}
    result["rendezvous"] = list(cluster.spec.rendezvous)
    result["listener"] = [list(cluster._address), list(cluster.listener.address)]
    result["driver_ip"] = ray.util.get_node_ip_address()
    result["calls"] = len(calls)
    result["key_in_args"] = [key in ray.cloudpickle.dumps(args) for args in calls]
    # each call's one argument is the ActorJob; its secret a [ObjectRef], never the key
    result["secret_refs"] = [
        type(a[0].secret).__name__ == "list" and isinstance(a[0].secret[0], ray.ObjectRef)
        for a in calls
    ]
    result["secret_values"] = [ray.get(a[0].secret[0]) == key for a in calls]
    reached = {}
    for name in ("rollout-0", "rollout-1"):
        seen = json.load(open(os.path.join(out, name + ".json")))
        host, port = seen["address"].rsplit(":", 1)
        with Client((host, int(port)), authkey=key):  # the key's HMAC challenge passes
            reached[name] = seen["address"]
    result["reached"] = reached
    victim = next(h for h in handles.values() if h.node_ip != result["driver_ip"])
    ray.kill(victim.actor, no_restart=True)
    try:
        wait_messages([victim], 60.0, "in the test")
        result["died"] = [victim.name, ""]
    except WorkerError as exc:
        result["died"] = [victim.name, str(exc)]
with open(os.path.join(out, "result.json"), "w") as fh:
    json.dump(result, fh)
"""


@pytest.mark.parametrize("bind_host", [None, "0.0.0.0"])
def test_ray_cluster_across_two_nodes(two_node_ray, tmp_path, bind_host):  # noqa: F811
    cluster = two_node_ray
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**cluster.env, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(tmp_path / "driver.py"), cluster.address, bind_host or ""],
        cwd=tmp_path,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    result = json.loads((tmp_path / "result.json").read_text())
    bundle_ip, names = result["bundle_ip"], sorted(result["bundle_ip"])
    assert names == ["rollout-0", "rollout-1", "trainer", "trainer-1"]
    assert set(bundle_ip.values()) == {cluster.head_ip, NODE2_IP}  # both nodes have workers
    assert result["handle_ip"] == bundle_ip  # each worker names the node it runs on
    seen = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in names}
    for name in names:
        assert seen[name]["env"] == [result["bundle_node"][name], bundle_ip[name]], name
    # the controller listens on the driver's node and is reached there
    driver_ip = result["driver_ip"]
    assert driver_ip == cluster.head_ip
    assert result["listener"][0][0] == driver_ip
    assert result["listener"][1][0] == (bind_host or driver_ip)
    # the trainer ranks met at rank 0's node and summed 1 + 2
    host, port = result["rendezvous"]
    assert host == bundle_ip["trainer"] and port > 0
    for name in ("trainer", "trainer-1"):
        assert seen[name]["init"] == f"tcp://{host}:{port}" and seen[name]["sum"] == 3.0
    # each shard server binds its node (or the wildcard) and is reached at its node's IP
    for name in ("rollout-0", "rollout-1"):
        assert seen[name]["host"] == (bind_host or bundle_ip[name])
        assert seen[name]["address"].rsplit(":", 1)[0] == bundle_ip[name]
        assert result["reached"][name] == seen[name]["address"]
    # the key is in no task's arguments: a reference to it is, which resolves to it
    assert result["calls"] == 4
    assert result["key_in_args"] == [False] * 4
    assert result["secret_refs"] == [True] * 4 and result["secret_values"] == [True] * 4
    # a worker on the second node that dies is named with its node
    victim, message = result["died"]
    assert bundle_ip[victim] == NODE2_IP
    assert f"worker {victim!r} (pid " in message and f", node {NODE2_IP}) died" in message
