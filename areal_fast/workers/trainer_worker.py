"""Trainer worker process: fetch a DistributedBatch, take one step, publish the weights.

With several ranks (FSDP2), every rank receives the same messages: each fetches its own part
of the batch (:meth:`DistributedBatch.split`, token-balanced whole groups), all ranks train
and gather the weights in lockstep, and rank 0 alone publishes them and answers.
"""

from __future__ import annotations

import queue
import resource
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from areal_fast._nodes import LOCAL_NODE, node_id, reachable_host
from areal_fast.rl.decoupled import staleness_stats
from areal_fast.sync.config import CUDA_IPC_SETTINGS, SyncConfig
from areal_fast.sync.slot_broadcast import SlotBroadcaster
from areal_fast.sync.trainer_slots import TrainerSlots
from areal_fast.train.config import ActorConfig
from areal_fast.wire import messages as msg
from areal_fast.wire.shards import fetch_packed_batch
from areal_fast.workers.core_hooks import trainer_cores
from areal_fast.workers.core_share import CoreShareSpec, FixedCores


@dataclass
class TrainerWorkerSpec:
    """How to build the trainer inside its process (picklable).

    Attributes
    ----------
    trainer_factory : callable () -> TrainEngine
        Builds the :class:`~areal_fast.train.engine.TrainEngine`; its ``weights_dtype``, when
        it has one, is the dtype the weight slots hold (the engines').
    actor : ActorConfig
        The trained policy's settings; ``actor.adv_mode`` is the advantage estimator
        applied to each fetched batch (the trainer factory gets the same object).
    fetch_timeout : float
        Seconds allowed to fetch one batch's shards from the rollout workers.
    threads : int, optional
        torch CPU threads of this process.
    cores : CoreShareSpec, optional
        This rank's slot of the node's core table (``launcher.share_cores``): each train
        step takes the cores idle rollout workers leave, ``threads`` while they work.
    rank, world_size : int
        This trainer rank and the number of ranks.
    resume_from : str
        Checkpoint directory whose trainer state to load at start ("" for none).
    host : str
        Address rank 0's weight-link rendezvous store binds (rollout workers on other nodes
        connect to it, see :mod:`areal_fast.sync.slot_broadcast`).
    sync : SyncConfig
        ``sync.checksum``: report a CRC-32 of every published version; ``sync.transport``
        auto or cuda_ipc: a trainer on a CUDA device also keeps CUDA slots.
    slots : int
        Rank 0's weight slots (version v in slot v % slots): 2, or η + 1 in a reproducible
        run (a replaced rollout worker loads the version its groups were started under).
    """

    trainer_factory: Callable
    actor: ActorConfig = field(default_factory=ActorConfig)
    fetch_timeout: float = 300.0
    threads: Optional[int] = None
    cores: Optional[CoreShareSpec] = None
    rank: int = 0
    world_size: int = 1
    resume_from: str = ""
    host: str = "127.0.0.1"
    sync: SyncConfig = field(default_factory=SyncConfig)
    slots: int = 2


def trainer_worker_main(conn, name: str, spec: TrainerWorkerSpec, authkey: bytes) -> None:
    """Process entry point: serve TrainStep / SaveCheckpoint until Shutdown.

    A reader thread starts fetching each TrainStep's shards as soon as the message arrives,
    so the next batch downloads while the current one trains; steps run in order.
    """
    if spec.threads:
        torch.set_num_threads(spec.threads)
    trainer = spec.trainer_factory()
    if spec.resume_from:
        from areal_fast.train.checkpoint import load_train_state

        load_train_state(trainer, spec.resume_from)
    cores = trainer_cores(spec.cores, trainer)
    leader = spec.rank == 0
    transport = spec.sync.transport  # auto needs links only on a cluster of several nodes
    buffers = TrainerSlots.start(  # rank 0: the weight slots (host; CUDA twins on a GPU)
        trainer.named_weights(),
        trainer.version,
        leader,
        cuda_twins=transport in CUDA_IPC_SETTINGS,
        dtype=getattr(spec.trainer_factory, "weights_dtype", None),
        count=spec.slots,
    )
    links = None  # rank 0: sends the slots to rollout workers on other nodes
    remote = transport == "auto" and node_id() != LOCAL_NODE
    if leader and (transport in ("broadcast", "disk") or remote):
        listen = transport != "disk"
        links = SlotBroadcaster(spec.host, reachable_host(spec.host), listen=listen)
        if trainer.version > 0:  # resumed: workers load the checkpoint's version (a fresh
            version = int(trainer.version)  # run's: theirs)
            links.publish(version, buffers[version % len(buffers)])
    fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fetch")
    inbox: queue.Queue = queue.Queue()
    threading.Thread(
        target=_read, args=(conn, inbox, fetcher, spec, authkey, links), daemon=True
    ).start()
    try:
        conn.send(
            msg.WorkerReady(
                name,
                weight_buffers=buffers.specs if buffers else (),
                version=int(trainer.version),
                node_id=node_id(),
                sync_address=links.address if links else "",
                gpu_uuid=buffers.gpu_uuid if buffers else "",
            )
        )
        while True:
            message, fetched = inbox.get()
            if isinstance(message, Exception):
                raise message
            reply = _handle(trainer, message, fetched, buffers, spec, links, cores)
            if reply is not None and leader:
                conn.send(reply)
            if isinstance(message, msg.Shutdown):
                return
    finally:
        fetcher.shutdown(wait=False, cancel_futures=True)
        if links is not None:
            links.close()
        buffers.close()
        cores.close()


def _handle(trainer, message, fetched, buffers, spec: TrainerWorkerSpec, links, cores):
    """Carry out one controller message on this rank; returns rank 0's reply (or None)."""
    if isinstance(message, msg.TrainStep):
        done = _train_step(trainer, message, fetched, buffers, links, cores)
        if links is not None:  # rank 0: remote workers get it while the next step trains
            links.publish(done.version, buffers[message.slot])
        if spec.sync.checksum and buffers:  # rank 0
            done.weights_checksum = buffers.checksum(message.slot)
        return done
    if isinstance(message, msg.SlotReaders):  # rank 0, before the first step
        buffers.host_readers = message.host
        return None
    if isinstance(message, msg.SaveCheckpoint):
        trainer.save(message.path)
        return msg.Saved(message.path)
    if isinstance(message, msg.SaveState):
        from areal_fast.train.checkpoint import save_train_state

        save_train_state(trainer, message.path)
        return msg.StateSaved(message.path, int(trainer.version))
    return None


def _read(
    conn, inbox: queue.Queue, fetcher, spec: TrainerWorkerSpec, authkey: bytes, links
) -> None:
    """Forward controller messages to the main thread; start each batch's fetch at once;
    connect weight links at once (rank 0; the other ranks ignore them)."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the controller is gone
            inbox.put((msg.Shutdown(), None))
            return
        except Exception as exc:  # noqa: BLE001 - e.g. an undecodable message
            inbox.put((exc, None))
            return
        if isinstance(message, msg.ConnectWeights):
            if links is not None:
                links.add_peer(message.worker, message.link)
            continue
        fetched = None
        if isinstance(message, msg.TrainStep):
            fetched = fetcher.submit(_fetch, message.batch, authkey, spec)
        inbox.put((message, fetched))


def _fetch(batch, authkey: bytes, spec: TrainerWorkerSpec):
    start = time.perf_counter()
    if spec.world_size > 1:
        batch = batch.split(spec.world_size)[spec.rank]
    packed = fetch_packed_batch(batch, authkey, spec.actor.adv_mode, spec.fetch_timeout)
    return packed, time.perf_counter() - start


def _train_step(
    trainer, message: msg.TrainStep, fetched: Future, buffers, links=None, cores=None
) -> msg.StepDone:
    """One TrainStep: wait for its batch, train (inside a working block of ``cores``, a
    :class:`~.core_share.CoreShare` or :class:`~.core_share.FixedCores`), publish."""
    start = time.perf_counter()
    batch, fetch_seconds = fetched.result()
    waited = time.perf_counter()
    version = trainer.version
    staleness = version - batch.versions[batch.loss_mask].long()
    if staleness.numel() and int(staleness.min()) < 0:  # checked before any update
        raise RuntimeError(
            f"trainer at version {version} got tokens generated by "
            f"a newer version {int(batch.versions.max())}"
        )
    with (cores or FixedCores()).working() as threads:
        stats = trainer.train_step(batch)
    stats["train_threads_mean"] = threads.mean
    # staleness distribution: trained tokens per (trainer version − generating version)
    hist = torch.bincount(staleness, minlength=version + 1)
    trained_tokens = torch.tensor([int(batch.loss_mask.sum())])
    if _distributed():  # over every rank's part of the batch (on NCCL's device on GPU)
        device = getattr(trainer, "comm_device", torch.device("cpu"))
        hist, trained_tokens = hist.to(device), trained_tokens.to(device)
        torch.distributed.all_reduce(hist)
        torch.distributed.all_reduce(trained_tokens)
        hist, trained_tokens = hist.cpu(), trained_tokens.cpu()
    nonzero = torch.nonzero(hist)
    stats["staleness_hist"] = hist[: int(nonzero.max()) + 1].tolist() if len(nonzero) else []
    if staleness.numel() and not _distributed():  # trainers without decoupled PPO
        for key, value in staleness_stats(batch.versions, batch.loss_mask, version).items():
            stats.setdefault(key, value)
    trained = time.perf_counter()
    if links is not None:  # a link still sending this slot's old version will not install it
        links.rewriting(buffers[message.slot])
    buffers.publish(trainer.named_weights(), message.slot)  # a gather on every rank
    published = time.perf_counter()
    stats["fetch_wait_seconds"] = waited - start
    stats["weight_update_bytes"] = buffers.update_bytes
    if hasattr(trainer, "trainable_parameters"):
        stats["trainable_parameters"] = trainer.trainable_parameters
    stats["trainer_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return msg.StepDone(
        version=int(trainer.version),
        stats=stats,
        group_ids=[s.shard_id for s in message.batch.shards],
        trained_tokens=int(trained_tokens),
        fetch_seconds=fetch_seconds,
        train_seconds=trained - waited,
        publish_seconds=published - trained,
    )


def _distributed() -> bool:
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )
