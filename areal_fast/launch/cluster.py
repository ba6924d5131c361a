"""The workers of one job: rollout workers and the trainer's ranks, started, watched, restarted.

:class:`Cluster` holds what every launcher shares: which workers to start (a
:class:`ClusterSpec`), waiting for each to report ready (within a timeout, naming any that
fails), restarting a dead rollout worker, and stopping everything on exit.
:class:`LocalCluster` starts the workers as ``spawn`` processes on this machine; the Ray
launcher (:mod:`areal_fast.launch.ray_cluster`) starts the same worker entry points
(:func:`rollout_worker_main`, :func:`trainer_worker_main`) as Ray actors.

Trainer rank 0 is named ``trainer`` and talks to the controller; ranks 1.. are
``trainer-1``, ...: they receive the same messages, answer nothing but their readiness, and
are watched so that the death of any rank stops the step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from areal_fast._nodes import LOCAL_NODE, reachable_host
from areal_fast.launch.allocator import loaded_allocator, trainer_environment
from areal_fast.launch.config import LauncherConfig, SchedulerConfig
from areal_fast.sync.config import SyncConfig, choose_transport
from areal_fast.sync.shared_memory import remove_orphaned_buffers
from areal_fast.sync.slot_broadcast import WeightLink
from areal_fast.wire import messages as msg
from areal_fast.wire.handles import WorkerError, WorkerHandle, spawn_worker, wait_messages
from areal_fast.workers.core_share import CoreShareSpec, create_table, remove_table
from areal_fast.workers.rollout_worker import RolloutWorkerSpec, rollout_worker_main
from areal_fast.workers.trainer_worker import TrainerWorkerSpec, trainer_worker_main

log = logging.getLogger("areal_fast.launch")


@dataclass
class ClusterSpec:
    """Which workers to start: ``num_rollout_workers`` copies of ``rollout`` and
    ``scheduler.train_world_size`` trainer ranks built from ``trainer``.

    Attributes
    ----------
    rollout : RolloutWorkerSpec
        Every rollout worker starts with a copy whose ``host`` is :attr:`bind_host`
        (:meth:`rollout_spec`; a Ray actor replaces it by its node's IP unless
        ``scheduler.bind_host`` is set).
    trainer : TrainerWorkerSpec
        Rank 0's spec; the other ranks get copies with their rank (and the trainer
        factory's ``rank`` / ``world_size`` / ``dist_init_method`` / ``dist_timeout`` when it
        has them), see :meth:`trainer_specs`.
    num_rollout_workers : int
        ``rollout.num_workers``.
    scheduler : SchedulerConfig
        ``train_world_size`` (trainer ranks, FSDP2 data parallel; 1: a single process),
        ``bind_host`` (address the job's servers bind) and ``dist_timeout`` (seconds of the
        trainer group's collectives).
    launcher : LauncherConfig
        ``startup_timeout``: seconds for every worker to report ready.
    workers_file : str, optional
        JSON file that receives ``{worker name: pid}`` after every (re)start.
    sync : SyncConfig
        The weight path of each rollout worker (:meth:`Cluster.link_weights`).
    rendezvous : tuple[str, int], optional
        ``(host, port)`` at which the trainer ranks meet (torch.distributed's TCP store,
        served by rank 0); None: a free port of this machine at :attr:`bind_host` (a
        wildcard: 127.0.0.1). The Ray launcher sets rank 0's node here.
    shared_cores : int, optional
        Cores of this machine that the workers share (``launcher.share_cores``): the local
        launcher makes a core table (:mod:`areal_fast.workers.core_share`) with one slot
        per trainer rank and rollout worker, whose shares are the ``threads`` of
        ``trainer`` and ``rollout`` (both must be set). None: fixed threads.
    """

    rollout: RolloutWorkerSpec
    trainer: TrainerWorkerSpec
    num_rollout_workers: int
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    workers_file: Optional[str] = None
    sync: SyncConfig = field(default_factory=SyncConfig)
    rendezvous: Optional[tuple[str, int]] = None
    shared_cores: Optional[int] = None

    def __post_init__(self):
        if self.num_rollout_workers < 1:
            raise ValueError(f"num_rollout_workers = {self.num_rollout_workers} must be >= 1")
        if self.shared_cores is not None and not (
            self.shared_cores >= 1 and self.trainer.threads and self.rollout.threads
        ):
            raise ValueError(
                f"shared_cores = {self.shared_cores} needs >= 1 core and the threads of the "
                f"trainer ({self.trainer.threads}) and of the rollout workers "
                f"({self.rollout.threads}) set"
            )
        if self.sync.transport == "disk" and not self.sync.disk_dir:
            raise ValueError("sync.transport = disk needs sync.disk_dir (a folder every node sees)")

    @property
    def train_world_size(self) -> int:
        """Trainer ranks (``scheduler.train_world_size``)."""
        return self.scheduler.train_world_size

    @property
    def bind_host(self) -> str:
        """Address this machine's servers bind: ``scheduler.bind_host``, 127.0.0.1 when it is
        None."""
        return self.scheduler.bind_host or "127.0.0.1"

    @property
    def startup_timeout(self) -> float:
        """Seconds for every worker to report ready (``launcher.startup_timeout``)."""
        return self.launcher.startup_timeout

    def rollout_spec(self) -> RolloutWorkerSpec:
        """The spec every rollout worker starts with: ``rollout`` on :attr:`bind_host`, with
        this spec's ``sync``.

        Raises
        ------
        ValueError
            ``scheduler.bind_host`` is not an address of this machine (named).
        """
        return _replaced(self.rollout, host=_bindable(self.bind_host), sync=self.sync)

    def trainer_specs(
        self, rendezvous: Optional[tuple[str, int]] = None
    ) -> list[TrainerWorkerSpec]:
        """One spec per trainer rank, each with ``host`` = :attr:`bind_host` (where rank 0's
        weight links listen; a Ray actor puts its node's IP there unless
        ``scheduler.bind_host`` is set) and this spec's ``sync``; with several, all meet at
        ``rendezvous``.

        Parameters
        ----------
        rendezvous : (host, port), optional
            Address of the group's rendezvous, which rank 0 serves; None:
            :attr:`rendezvous`, else a free port of this machine at :attr:`bind_host`
            (for a wildcard, 127.0.0.1).

        Raises
        ------
        ValueError
            ``scheduler.bind_host`` is not an address of this machine (named).
        """
        n = self.train_world_size
        trainer = _replaced(self.trainer, host=self.bind_host, sync=self.sync)
        if n == 1:
            return [trainer]
        host, port = rendezvous or self.rendezvous or (None, None)
        if host is None:
            bind = _bindable(self.bind_host)
            host, port = reachable_host(bind), free_port(bind)
        init_method = f"tcp://{host}:{port}"
        specs = []
        for rank in range(n):
            factory = trainer.trainer_factory
            if dataclasses.is_dataclass(factory) and hasattr(factory, "world_size"):
                group = dict(
                    rank=rank,
                    world_size=n,
                    dist_init_method=init_method,
                    dist_timeout=self.scheduler.dist_timeout,
                )
                factory = dataclasses.replace(
                    factory, **{k: v for k, v in group.items() if hasattr(factory, k)}
                )
            specs.append(
                dataclasses.replace(trainer, trainer_factory=factory, rank=rank, world_size=n)
            )
        return specs


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _replaced(spec, **values):
    """``spec`` with those of ``values`` that are its fields replaced (a worker spec of
    another kind, e.g. a test's stand-in, may lack some)."""
    names = {f.name for f in dataclasses.fields(spec)}
    return dataclasses.replace(spec, **{k: v for k, v in values.items() if k in names})


def _bindable(host: str) -> str:
    """``host`` if a socket of this machine can bind it.

    Raises
    ------
    ValueError
        Naming ``scheduler.bind_host`` and the system's reason.
    """
    try:
        free_port(host)
    except OSError as exc:
        raise ValueError(
            f"scheduler.bind_host = {host!r} cannot be bound on this machine: {exc.strerror or exc}"
        ) from None
    return host


def trainer_name(rank: int) -> str:
    """Worker name of trainer rank ``rank``."""
    return "trainer" if rank == 0 else f"trainer-{rank}"


class Cluster:
    """Context manager: start every worker, hand out their handles, stop them on exit.

    Subclasses implement :meth:`_start_worker` (and may extend :meth:`close`).

    Attributes (after ``__enter__``)
    --------------------------------
    rollout_workers : list[WorkerHandle]
    trainer : WorkerHandle
        Trainer rank 0.
    trainer_ranks : list[WorkerHandle]
        Every trainer rank, rank 0 first.
    weight_buffers : tuple[WeightBufferSpec, WeightBufferSpec]
    trainer_version : int
        Policy version the trainer started at (> 0 when it resumed from a checkpoint).
    authkey : bytes
        Random secret of this job; shard servers and channels accept only peers that know it.
    nodes : dict[str, str]
        Worker name → the node id it reported.
    gpus : dict[str, str]
        Worker name → the GPU UUID it reported (a rollout worker's in-process engine, the
        trainer's CUDA slots; "" for none).
    transports : dict[str, str]
        Rollout worker name → its weight path (``cuda_ipc``, ``shm``, ``broadcast`` or
        ``disk``).

    Raises
    ------
    WorkerError
        A worker failed or did not report ready within ``startup_timeout`` (named).
    """

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.authkey = secrets.token_bytes(32)
        self.rollout_workers: list[WorkerHandle] = []
        self.trainer_ranks: list[WorkerHandle] = []
        self.weight_buffers: tuple = ()
        self.trainer_version = 0
        self.nodes: dict[str, str] = {}
        self.gpus: dict[str, str] = {}
        self.transports: dict[str, str] = {}
        self._host_slots: Optional[bool] = None  # told to a trainer with CUDA slots
        self._sync_address = ""  # trainer rank 0's weight-link store
        self._links = 0  # weight links made, for unique tags
        self._job_tag = secrets.token_hex(4)
        self._cores: Optional[CoreShareSpec] = None  # the core table (LocalCluster)
        self._trainer_env: dict[str, str] = {}  # the trainer processes' allocator (local)

    @property
    def trainer(self) -> Optional[WorkerHandle]:
        """Trainer rank 0 (None before start)."""
        return self.trainer_ranks[0] if self.trainer_ranks else None

    def _start_worker(self, name: str, target, spec, env=None) -> WorkerHandle:
        """Start worker ``name``; ``env``: variables its process starts with (the local
        launcher's trainer allocator, :mod:`areal_fast.launch.allocator`)."""
        raise NotImplementedError

    def __enter__(self) -> "Cluster":
        remove_orphaned_buffers()
        try:  # each handle is kept at once, so a failure part-way stops the started ones
            for rank, spec in enumerate(self.spec.trainer_specs()):
                self.trainer_ranks.append(
                    self._start_worker(
                        trainer_name(rank),
                        trainer_worker_main,
                        self._core_slot(spec, rank),
                        self._trainer_env,
                    )
                )
            rollout = self.spec.rollout_spec()
            for i in range(self.spec.num_rollout_workers):
                self.rollout_workers.append(
                    self._start_worker(
                        f"rollout-{i}", rollout_worker_main, self._rollout_slot(rollout, i)
                    )
                )
            self._wait_ready([*self.trainer_ranks, *self.rollout_workers])
            for worker in self.rollout_workers:
                self.link_weights(worker)
            self._tell_slot_readers()
        except BaseException:
            self.close()
            raise
        self._write_workers_file()
        return self

    def _wait_ready(self, handles: list[WorkerHandle]) -> None:
        waiting = {h.name for h in handles}
        deadline = time.monotonic() + self.spec.startup_timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                name = sorted(waiting)[0]
                raise WorkerError(
                    f"worker {name!r} did not start within startup_timeout = "
                    f"{self.spec.startup_timeout:g} s",
                    name,
                )
            for handle, message in wait_messages(handles, left, "while starting up"):
                if not isinstance(message, msg.WorkerReady):
                    raise WorkerError(
                        f"worker {handle.name!r} sent {type(message).__name__} before it was ready",
                        handle.name,
                    )
                waiting.discard(handle.name)
                self.nodes[handle.name] = message.node_id or LOCAL_NODE
                self.gpus[handle.name] = message.gpu_uuid
                if handle is self.trainer:
                    self.weight_buffers = message.weight_buffers
                    self.trainer_version = message.version
                    self._sync_address = message.sync_address

    def link_weights(self, worker: WorkerHandle) -> None:
        """Choose ``worker``'s weight path (``sync.transport``; ``auto``: the trainer's CUDA
        slots for an engine on its GPU, shared memory elsewhere on trainer rank 0's node, a
        network link on other nodes) and, for a link, tell trainer rank 0 and the worker to
        connect (rank 0 then sends it the newest version).

        Raises
        ------
        WorkerError
            ``cuda_ipc`` forced where it cannot work, or a restarted worker that needs the
            host slots of a trainer that writes its CUDA slots only (both named).
        """
        if self.trainer is None:  # rollout only (evaluation): no weights to send
            return
        sync, trainer = self.spec.sync, self.trainer.name
        try:
            kind = choose_transport(
                sync.transport, self.nodes[worker.name], self.nodes[trainer],
                self.gpus.get(worker.name, ""), self.gpus.get(trainer, ""),
            )  # fmt: skip
        except ValueError as exc:
            raise WorkerError(f"rollout worker {worker.name!r}: {exc}", worker.name) from None
        if self._host_slots is False and kind != "cuda_ipc":
            raise WorkerError(
                f"rollout worker {worker.name!r} needs the trainer's host slots ({kind}), but the "
                "trainer writes its CUDA slots only (sync.transport=shm writes host slots always)",
                worker.name,
            )
        self.transports[worker.name] = kind
        if kind in ("shm", "cuda_ipc"):
            return
        if kind == "broadcast" and not self._sync_address:
            raise WorkerError(
                f"trainer {self.trainer.name!r} serves no weight-link store, so rollout worker "
                f"{worker.name!r} cannot get weights over the network",
                self.trainer.name,
            )
        self._links += 1
        link = WeightLink(
            kind,
            f"{worker.name}-{self._job_tag}-{self._links}",
            address=self._sync_address if kind == "broadcast" else "",
            directory=str(sync.disk_dir) if kind == "disk" else "",
            timeout=sync.timeout,
            bucket_bytes=sync.bucket_bytes,
        )
        connect = msg.ConnectWeights(worker.name, link)
        self.trainer.send(connect)
        worker.send(connect)

    def _tell_slot_readers(self) -> None:
        """Tell a trainer that keeps CUDA slots whether any worker reads its host slots (none:
        it writes each version into its CUDA slots only)."""
        if self.trainer is None or not self.gpus.get(self.trainer.name):
            return
        self._host_slots = any(kind != "cuda_ipc" for kind in self.transports.values())
        self.trainer.send(msg.SlotReaders(host=self._host_slots))

    def restart_rollout(self, name: str) -> WorkerHandle:
        """Replace the (dead) rollout worker ``name`` by a new one; returns its ready handle.

        Raises
        ------
        WorkerError
            The new worker failed or did not start within ``startup_timeout``.
        """
        old = next(h for h in self.rollout_workers if h.name == name)
        old.stop(timeout=1.0)
        index = self.rollout_workers.index(old)  # its core slot: the new one claims it afresh
        new = self._start_worker(
            name, rollout_worker_main, self._rollout_slot(self.spec.rollout_spec(), index)
        )
        self.rollout_workers[index] = new
        self._wait_ready([new])
        self.link_weights(new)
        self._write_workers_file()
        return new

    def _core_slot(self, spec, slot: int):
        """``spec`` with its slot of the core table (unchanged without a table, or for a
        spec of another kind, without ``cores``)."""
        return _replaced(spec, cores=self._cores.for_slot(slot)) if self._cores else spec

    def _rollout_slot(self, spec, index: int):
        """The core slot of rollout worker ``index``: after every trainer rank's."""
        return self._core_slot(spec, self.spec.train_world_size + index)

    def pids(self) -> dict[str, Optional[int]]:
        """``{worker name: process id}`` of every worker."""
        return {h.name: h.pid for h in [*self.trainer_ranks, *self.rollout_workers]}

    def _write_workers_file(self) -> None:
        if self.spec.workers_file:
            path = Path(self.spec.workers_file)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(self.pids(), indent=1) + "\n")
            os.replace(tmp, path)

    def __exit__(self, exc_type, exc, tb) -> None:
        # after a failure, do not wait long for a busy worker to finish its current step
        self.close(grace_seconds=10.0 if exc_type is None else 2.0)

    def close(self, grace_seconds: float = 2.0) -> None:
        """Stop every worker (Shutdown, then kill after ``grace_seconds``) and delete the
        trainer's shared-memory weight files, which a killed trainer cannot delete itself."""
        for handle in [*self.rollout_workers, *self.trainer_ranks]:
            handle.stop(grace_seconds)
        for spec in self.weight_buffers:
            Path(spec.path).unlink(missing_ok=True)


def warn_failed_exits(cluster: Cluster) -> None:
    """Log each worker that exited non-zero after the run itself succeeded (an error while
    shutting down, e.g. closing its agent sessions; its traceback precedes on stderr)."""
    for handle in [*cluster.rollout_workers, *cluster.trainer_ranks]:
        code = getattr(getattr(handle, "process", None), "exitcode", None)
        if code:
            how = "was killed (it did not exit in time)" if code < 0 else f"exited with code {code}"
            log.warning("worker %r %s while shutting down after the run", handle.name, how)


# seconds a local worker outlives a SIGTERM when its launcher does not stop it first: above
# the launcher's wait for a checkpoint in progress (launch.interrupt, 60 s) and its stop;
# AREAL_FAST_WORKER_TERM_GRACE in the launcher's environment sets another
WORKER_TERM_GRACE = 150.0


_grace_over = threading.Event()  # set in a worker when its SIGTERM grace has run out


def _defer_sigterm(signum: int, frame) -> None:
    """SIGTERM handler of a local worker: wait for the launcher to stop it.

    A SIGTERM to the whole job (Slurm's ``scancel``, a requeue or preemption, ``timeout``
    on a process group) reaches the workers as well as the launcher, which first finishes
    the checkpoint in progress, for which it needs the trainer alive, and then stops every
    worker. A worker not stopped within :data:`WORKER_TERM_GRACE` seconds (a SIGTERM sent
    to it alone) exits through Python then; further SIGTERMs change nothing.
    """
    signal.signal(signal.SIGTERM, _after_grace)
    grace = float(os.environ.get("AREAL_FAST_WORKER_TERM_GRACE", WORKER_TERM_GRACE))
    timer = threading.Timer(grace, _end_grace)
    timer.daemon = True
    timer.start()


def _after_grace(signum: int, frame) -> None:
    """SIGTERM handler after the first: exit once the grace has run out, else nothing."""
    if _grace_over.is_set():
        raise SystemExit(128 + signum)


def _end_grace() -> None:
    """The grace ran out (a timer thread): a SIGTERM to itself, handled in the main thread."""
    _grace_over.set()
    os.kill(os.getpid(), signal.SIGTERM)


def worker_main(target, conn, name: str, spec, authkey: bytes) -> None:
    """Run a local worker's ``target(conn, name, spec, authkey)`` with SIGTERM deferred
    (:func:`_defer_sigterm`).

    When it does exit on a SIGTERM, it exits through Python: killed by the default action, a
    worker leaves what multiprocessing made in it, such as the semaphore of tqdm's lock
    that a progress bar creates, for the resource tracker to report as leaked.
    """
    signal.signal(signal.SIGTERM, _defer_sigterm)
    target(conn, name, spec, authkey)


class LocalCluster(Cluster):
    """Every worker as a ``spawn`` process on this machine.

    Each ignores SIGINT: a Ctrl-C in the terminal reaches the whole process group, and only
    the launcher acts on it (it stops the workers), so the workers print no tracebacks. The
    launcher ignores SIGINT while it starts a process (an ignored signal is the one
    disposition that a new interpreter keeps); a Ctrl-C in that moment is lost. A SIGTERM
    leaves the stopping to the launcher too (:func:`worker_main`).

    With ``shared_cores`` it makes the core table of the workers before starting them
    and deletes it when they stop.
    """

    def __enter__(self) -> "LocalCluster":
        s = self.spec
        self._trainer_env = trainer_environment(s.launcher.allocator)
        if s.shared_cores:  # a failed start closes the cluster, which deletes the table
            shares = (s.trainer.threads,) * s.train_world_size
            self._cores = create_table(
                shares + (s.rollout.threads,) * s.num_rollout_workers, s.shared_cores
            )
        super().__enter__()
        if self.trainer is not None:  # an evaluation's cluster has rollout workers only
            log.info(
                "trainer allocator: %s (launcher.allocator = %s)",
                loaded_allocator(self.trainer.pid),
                s.launcher.allocator,
            )
        return self

    def close(self, grace_seconds: float = 2.0) -> None:
        """:meth:`Cluster.close`, then delete the core table."""
        super().close(grace_seconds)
        if self._cores is not None:
            remove_table(self._cores)
            self._cores = None

    def _start_worker(self, name: str, target, spec, env=None) -> WorkerHandle:
        target = functools.partial(worker_main, target)
        if threading.current_thread() is not threading.main_thread():
            return spawn_worker(name, target, spec, self.authkey, env)
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return spawn_worker(name, target, spec, self.authkey, env)
        finally:
            signal.signal(signal.SIGINT, handler)
