"""Weight links (sync/slot_broadcast.py): trainer rank 0's slots reach subscribers bit for bit
over gloo pair groups and over disk; each link sends the newest version only; a subscriber
that dies inside an update fails its own link within the timeout, named, while the other
installs the update."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import pytest
import torch

from areal_fast.sync.shared_memory import SharedWeightBuffer
from areal_fast.sync.slot_broadcast import (
    SlotBroadcaster,
    SlotSubscriber,
    WeightLink,
    buffer_checksum,
)

BUCKET = 4 << 10  # small buckets: many per update, one tensor split over several


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("embed", torch.randn(97, 24, generator=gen)),
        ("odd", torch.randn(5, 123, generator=gen).to(torch.bfloat16)),
        ("vec", torch.randn(1003, generator=gen)),
        ("big", torch.randn(3001, generator=gen)),
        ("one", torch.randn(1, generator=gen).half()),
    ]


def _slots(seed: int):
    named = _weights(seed)
    slots = [SharedWeightBuffer.create(named) for _ in range(2)]
    return named, slots


def _subscribe(link: WeightLink, out: queue.Queue, name: str) -> SlotSubscriber:
    def deliver(version, buffer, seconds):
        out.put((name, version, {n: t.clone() for n, t in buffer.named_tensors()}))

    sub = SlotSubscriber(link, "127.0.0.1", deliver, lambda exc: out.put((name, "fail", exc)))
    sub.start()
    return sub


def _link(kind: str, tag: str, broadcaster: SlotBroadcaster, tmp_path, timeout=20.0):
    return WeightLink(
        kind,
        tag,
        address=broadcaster.address if kind == "broadcast" else "",
        directory=str(tmp_path / "links") if kind == "disk" else "",
        timeout=timeout,
        bucket_bytes=BUCKET,
    )


@pytest.mark.parametrize("kind", ["broadcast", "disk"])
def test_two_links_get_each_version_bit_exact(kind, tmp_path):
    seed = int(torch.randint(0, 2**31, (1,)))
    named, slots = _slots(seed)
    broadcaster = SlotBroadcaster("127.0.0.1")
    out: queue.Queue = queue.Queue()
    subs = {}
    try:
        for name in ("w1", "w2"):
            link = _link(kind, f"{name}-t", broadcaster, tmp_path)
            subs[name] = _subscribe(link, out, name)
            broadcaster.add_peer(name, link)
        for version in (1, 2):
            weights = _weights(seed + version)
            slots[version % 2].write(weights)
            broadcaster.publish(version, slots[version % 2])
            for _ in subs:
                name, got, tensors = out.get(timeout=60)
                assert got == version, tensors
                for key, expected in weights:
                    assert torch.equal(tensors[key].view(torch.uint8), expected.view(torch.uint8))
                assert buffer_checksum(subs[name].buffer) == buffer_checksum(slots[version % 2])
                subs[name].installed()
        assert broadcaster.errors == {}
        deadline = time.monotonic() + 10  # the sender records an update after its last round
        while len(broadcaster.sent("w1")) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [s.version for s in broadcaster.sent("w1")] == [1, 2]
        sent = broadcaster.sent("w1")[0]
        assert sent.num_buckets >= 6  # "big" alone spans 3
        if kind == "broadcast":  # the slot's bytes go out as they are, bucket by bucket
            assert sent.direct_buckets == sent.num_buckets
    finally:
        for sub in subs.values():
            sub.close()
        broadcaster.close()
        for slot in slots:
            slot.close()
    if kind == "disk":  # each link's folder (updates and notices) goes with it
        assert list((tmp_path / "links").iterdir()) == []


def test_a_busy_worker_gets_the_newest_version_next(tmp_path):
    """While a worker installs v1, v2 and v3 are published: it gets v3, whole."""
    seed = int(torch.randint(0, 2**31, (1,)))
    _, slots = _slots(seed)
    extra = SharedWeightBuffer.create(_weights(seed))
    broadcaster = SlotBroadcaster("127.0.0.1")
    out: queue.Queue = queue.Queue()
    link = _link("broadcast", "busy", broadcaster, tmp_path)
    sub = _subscribe(link, out, "w")
    try:
        broadcaster.add_peer("w", link)
        slots[1].write(_weights(seed + 1))
        broadcaster.publish(1, slots[1])
        assert out.get(timeout=60)[1] == 1  # delivered, not yet installed
        slots[0].write(_weights(seed + 2))
        broadcaster.publish(2, slots[0])
        extra.write(_weights(seed + 3))
        broadcaster.publish(3, extra)
        time.sleep(0.5)
        sub.installed()
        _, version, tensors = out.get(timeout=60)
        assert version == 3
        for key, expected in _weights(seed + 3):
            assert torch.equal(tensors[key].view(torch.uint8), expected.view(torch.uint8))
        deadline = time.monotonic() + 10
        while len(broadcaster.sent("w")) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [s.version for s in broadcaster.sent("w")] == [1, 3]
    finally:
        sub.close()
        broadcaster.close()
        for slot in [*slots, extra]:
            slot.close()


def _dying_subscriber(address: str, after_buckets: int) -> None:
    """A worker process that joins its link and exits inside the first update."""
    import os

    from areal_fast.sync.transports import TorchDistTransport

    original = TorchDistTransport.start_recv_into
    calls = [0]

    def counting(self, out, index):
        calls[0] += 1
        if calls[0] > after_buckets:
            os._exit(3)
        return original(self, out, index)

    TorchDistTransport.start_recv_into = counting
    TorchDistTransport.start_recv = lambda self, nbytes, index: counting(
        self, torch.empty(nbytes, dtype=torch.uint8), index
    )
    link = WeightLink("broadcast", "dying", address, timeout=5.0, bucket_bytes=BUCKET)
    sub = SlotSubscriber(link, "127.0.0.1", lambda *a: None, lambda exc: None)
    sub.start()
    time.sleep(120)


def test_a_worker_dying_inside_the_broadcast_fails_only_its_link(tmp_path):
    seed = int(torch.randint(0, 2**31, (1,)))
    _, slots = _slots(seed)
    broadcaster = SlotBroadcaster("127.0.0.1")
    out: queue.Queue = queue.Queue()
    healthy = _link("broadcast", "healthy", broadcaster, tmp_path, timeout=5.0)
    sub = _subscribe(healthy, out, "w-ok")
    dying = WeightLink("broadcast", "dying", broadcaster.address, timeout=5.0, bucket_bytes=BUCKET)
    proc = mp.get_context("spawn").Process(
        target=_dying_subscriber, args=(broadcaster.address, 3), daemon=True
    )
    proc.start()
    try:
        broadcaster.add_peer("w-ok", healthy)
        broadcaster.add_peer("rollout-dead", dying)
        weights = _weights(seed + 1)
        slots[1].write(weights)
        start = time.monotonic()
        broadcaster.publish(1, slots[1])
        name, version, tensors = out.get(timeout=60)
        assert (name, version) == ("w-ok", 1)
        for key, expected in weights:
            assert torch.equal(tensors[key].view(torch.uint8), expected.view(torch.uint8))
        proc.join(30)
        assert proc.exitcode == 3  # it died inside the update
        while "rollout-dead" not in broadcaster.errors and time.monotonic() - start < 30:
            time.sleep(0.05)
        elapsed = time.monotonic() - start
        error = broadcaster.errors["rollout-dead"]
        assert "rollout worker 'rollout-dead'" in error and "gloo via 127.0.0.1:" in error
        assert elapsed < 5.0 * 3 + 5  # within the link's per-step timeout, not a hang
        # the healthy link goes on: the next version arrives too
        sub.installed()
        slots[0].write(_weights(seed + 2))
        broadcaster.publish(2, slots[0])
        assert out.get(timeout=60)[:2] == ("w-ok", 2)
        assert "w-ok" not in broadcaster.errors
    finally:
        proc.kill()
        sub.close()
        broadcaster.close()
        for slot in slots:
            slot.close()


def test_a_link_nobody_joins_fails_within_its_timeout():
    broadcaster = SlotBroadcaster("127.0.0.1")
    link = WeightLink("broadcast", "absent", broadcaster.address, timeout=1.0)
    try:
        start = time.monotonic()
        broadcaster.add_peer("rollout-7", link)
        while "rollout-7" not in broadcaster.errors and time.monotonic() - start < 20:
            time.sleep(0.05)
        assert (
            "rollout worker 'rollout-7' did not join its weight link within 1 s"
            in (broadcaster.errors["rollout-7"])
        )
        assert time.monotonic() - start < 10
    finally:
        broadcaster.close()


def test_a_slot_rewritten_under_its_send_is_not_installed(tmp_path, monkeypatch):
    """The trainer starts rewriting the slot a link is sending (a worker that joined while two
    steps were in training): the worker drops that update and installs the next one."""
    import areal_fast.sync.slot_broadcast as sb

    seed = int(torch.randint(0, 2**31, (1,)))
    _, slots = _slots(seed)
    broadcaster = SlotBroadcaster("127.0.0.1")
    original = sb.WeightSender.send

    def send(self, source, version):
        if version == 1:  # the trainer begins to overwrite the slot mid-send
            broadcaster.rewriting(slots[1])
        return original(self, source, version)

    monkeypatch.setattr(sb.WeightSender, "send", send)
    out: queue.Queue = queue.Queue()
    link = _link("broadcast", "torn", broadcaster, tmp_path)
    sub = _subscribe(link, out, "w")
    try:
        broadcaster.add_peer("w", link)
        slots[1].write(_weights(seed + 1))
        broadcaster.publish(1, slots[1])
        with pytest.raises(queue.Empty):
            out.get(timeout=2)  # v1 went out but was not delivered
        weights = _weights(seed + 2)
        slots[0].write(weights)
        broadcaster.publish(2, slots[0])
        _, version, tensors = out.get(timeout=60)
        assert version == 2
        for key, expected in weights:
            assert torch.equal(tensors[key].view(torch.uint8), expected.view(torch.uint8))
        assert [s.version for s in broadcaster.sent("w")] == [1, 2]
    finally:
        sub.close()
        broadcaster.close()
        for slot in slots:
            slot.close()
