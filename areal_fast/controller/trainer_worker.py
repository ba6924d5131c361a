"""Trainer worker process: fetch a DistributedBatch, take one step, publish the weights."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from areal_fast.controller import messages as msg
from areal_fast.controller.batch import fetch_packed_batch
from areal_fast.sync.shared_memory import SharedWeightBuffer


@dataclass
class TrainerWorkerSpec:
    """How to build the trainer inside its process (picklable).

    Attributes
    ----------
    trainer_factory : callable () -> TrainEngine
        Builds the :class:`~areal_fast.train.engine.TrainEngine`.
    adv_mode : str
        Advantage estimator applied to each fetched batch.
    fetch_timeout : float
        Seconds allowed to fetch one batch's shards from the rollout workers.
    threads : int, optional
        torch CPU threads of this process.
    """

    trainer_factory: Callable
    adv_mode: str = "grpo"
    fetch_timeout: float = 300.0
    threads: Optional[int] = None


def trainer_worker_main(conn, name: str, spec: TrainerWorkerSpec, authkey: bytes) -> None:
    """Process entry point: serve TrainStep / SaveCheckpoint until Shutdown.

    A reader thread starts fetching each TrainStep's shards as soon as the message arrives,
    so the next batch downloads while the current one trains; steps run in order.
    """
    if spec.threads:
        torch.set_num_threads(spec.threads)
    trainer = spec.trainer_factory()
    buffers = [SharedWeightBuffer.create(trainer.named_weights()) for _ in range(2)]
    fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fetch")
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_read, args=(conn, inbox, fetcher, spec, authkey),
                     daemon=True).start()
    try:
        conn.send(msg.WorkerReady(name, weight_buffers=tuple(b.spec for b in buffers)))
        while True:
            message, fetched = inbox.get()
            if isinstance(message, msg.TrainStep):
                conn.send(_train_step(trainer, message, fetched, buffers))
            elif isinstance(message, msg.SaveCheckpoint):
                trainer.save(message.path)
                conn.send(msg.Saved(message.path))
            elif isinstance(message, msg.Shutdown):
                return
    finally:
        fetcher.shutdown(wait=False, cancel_futures=True)
        for buffer in buffers:
            buffer.close()


def _read(conn, inbox: queue.Queue, fetcher, spec: TrainerWorkerSpec, authkey: bytes) -> None:
    """Forward controller messages to the main thread; start each batch's fetch at once."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            inbox.put((msg.Shutdown(), None))
            return
        fetched = None
        if isinstance(message, msg.TrainStep):
            fetched = fetcher.submit(_fetch, message.batch, authkey, spec)
        inbox.put((message, fetched))


def _fetch(batch, authkey: bytes, spec: TrainerWorkerSpec):
    start = time.perf_counter()
    packed = fetch_packed_batch(batch, authkey, spec.adv_mode, spec.fetch_timeout)
    return packed, time.perf_counter() - start


def _train_step(trainer, message: msg.TrainStep, fetched: Future, buffers) -> msg.StepDone:
    start = time.perf_counter()
    batch, fetch_seconds = fetched.result()
    waited = time.perf_counter()
    staleness = trainer.version - batch.versions[batch.loss_mask].long()
    stats = trainer.train_step(batch)
    # staleness distribution: trained tokens per (trainer version − generating version)
    stats["staleness_hist"] = torch.bincount(staleness.clamp(min=0)).tolist()
    trained = time.perf_counter()
    buffers[message.slot].write(trainer.named_weights())
    published = time.perf_counter()
    stats["fetch_wait_seconds"] = waited - start
    return msg.StepDone(
        version=int(trainer.version), stats=stats,
        group_ids=[s.shard_id for s in message.batch.shards],
        trained_tokens=int(batch.loss_mask.sum()), fetch_seconds=fetch_seconds,
        train_seconds=trained - waited, publish_seconds=published - trained)
