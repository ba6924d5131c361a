"""The two-node test cluster (:mod:`tests.launch.two_node_ray`) is what it claims: two Ray
nodes with different ids and IPs, whose shared memory is not shared."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

from two_node_ray import NODE2_IP, two_node_ray  # noqa: F401 - the fixture

# one actor pinned to each node: where it runs, and which /dev/shm files it sees
PLACE_ONE_PER_NODE = """
import json, os, sys
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

address, head_id, node2_id, name = sys.argv[1:5]
ray.init(address=address, log_to_driver=False)

@ray.remote(num_cpus=0.5)
class Probe:
    def where(self):
        return [ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()]

    def touch(self, path):
        with open(path, "w") as fh:
            fh.write("x")

    def sees(self, path):
        return os.path.exists(path)

    def remove(self, path):
        os.unlink(path)

head, node2 = (
    Probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
    for n in (head_id, node2_id)
)
on_head, on_node2 = f"/dev/shm/{name}-head", f"/dev/shm/{name}-node2"
ray.get([head.touch.remote(on_head), node2.touch.remote(on_node2)])
seen = {
    "head": ray.get(head.where.remote()),
    "node2": ray.get(node2.where.remote()),
    "node2_sees_head_file": ray.get(node2.sees.remote(on_head)),
    "head_sees_head_file": ray.get(head.sees.remote(on_head)),
    "head_sees_node2_file": ray.get(head.sees.remote(on_node2)),
    "node2_sees_node2_file": ray.get(node2.sees.remote(on_node2)),
    "driver_sees_head_file": os.path.exists(on_head),
}
ray.get(node2.remove.remote(on_node2))
os.unlink(on_head)
print(json.dumps(seen))
"""


def test_one_actor_per_node_and_private_shared_memory(two_node_ray, tmp_path):  # noqa: F811
    cluster = two_node_ray
    assert cluster.node_ids[0] != cluster.node_ids[1]
    assert cluster.node2_ip == NODE2_IP and cluster.head_ip != NODE2_IP
    name = f"two-node-{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [sys.executable, "-c", PLACE_ONE_PER_NODE, cluster.address, *cluster.node_ids, name],
        env=cluster.env,
        cwd=tmp_path,
        text=True,
        capture_output=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["head"] == [cluster.node_ids[0], cluster.head_ip]
    assert seen["node2"] == [cluster.node_ids[1], NODE2_IP]
    assert seen["head_sees_head_file"] and seen["node2_sees_node2_file"]
    assert seen["driver_sees_head_file"]  # the head node's /dev/shm is this machine's
    assert not seen["node2_sees_head_file"]
    assert not seen["head_sees_node2_file"]
    assert not Path(f"/dev/shm/{name}-node2").exists()
