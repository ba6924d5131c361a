"""The Ray launcher's workers: each rollout worker and trainer rank is a Ray actor.

Ray does placement and process management: one placement group with a bundle per worker
(``scheduler.cpus_per_*`` / ``gpus_per_*``, strategy ``scheduler.placement_strategy``), each
actor pinned to its bundle, on any node of the cluster. The controller stays the driver. Each
actor connects back to the controller over an authenticated socket (``multiprocessing.
connection`` with the job's random key: an HMAC challenge before any data) and then runs the
same worker entry point as a local process, speaking the same msgpack messages
(:mod:`areal_fast.wire.codec`).

Node identity: before the worker starts, each actor sets ``AREAL_FAST_NODE_ID`` (its Ray node
id) and ``AREAL_FAST_NODE_IP`` (its node's IP) in its environment (:mod:`areal_fast._nodes`)
and tells the controller its node IP, which error messages about the worker name. Every server
binds ``scheduler.bind_host``, by default its own node's IP: the controller's listener the
driver's node, each rollout worker's shard server its node (a wildcard bind is advertised as
the node's IP). Trainer ranks meet at rank 0's node: a zero-CPU task on rank 0's bundle finds
that node's IP and a free port there before the ranks start.

The job's key never travels as a task argument (which Ray keeps with each task): it is put
in the object store once, and each actor receives a reference to it, nested in a
list so that Ray does not resolve it into the arguments, and reads it with ``ray.get``. See
docs/scale-out.md for who on a Ray cluster can read what.

A dead actor shows as the end of its socket, so the controller notices a death at once,
exactly as with a local process.

Ray puts the driver's current directory first on every worker's ``sys.path``: with the
``areal-fast`` script started in a source checkout (e.g. the repository root), the actors
would import the source tree, without the compiled extension, while the driver imports the
installed package. The driver therefore starts Ray from the folder that holds the
``areal_fast`` it imported itself, so every actor imports that same package; each actor then
changes to the driver's directory, so relative paths mean the same on both sides, and
appends it to its ``sys.path`` (modules there, such as an agent beside the config, still
import, after the package). ``python -m`` in a checkout makes the driver itself import the
checkout (Python puts the current directory first); the actors then do too, and the native
extension's warning names that folder and the installed package it shadows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Client, Listener
from typing import Optional

import msgpack

from areal_fast._nodes import NODE_ID_ENV, NODE_IP_ENV, reachable_host
from areal_fast.launch.cluster import Cluster, ClusterSpec, free_port, trainer_name
from areal_fast.wire.codec import MessageChannel
from areal_fast.wire.handles import WorkerError, WorkerHandle, _worker_entry


@dataclasses.dataclass
class ActorJob:
    """What a worker actor is asked to run, and how it reaches the controller.

    Attributes
    ----------
    name : str
        The worker's name (``rollout-0``, ``trainer-1``, ...).
    target : callable
        The worker's entry point (as for a local process).
    spec
        The worker's spec; a dataclass with a ``host`` (the shard server's address) gets the
        actor's node IP there unless ``bind_host`` is set.
    address : tuple
        The controller's listener ``(host, port)``.
    secret : list
        ``[ObjectRef]`` of the job's key: a reference, never the key itself, travels in the
        task's arguments (nested in a list, so that Ray does not resolve it).
    cwd : str
        The driver's directory: the actor works there.
    bind_host : str or None
        ``scheduler.bind_host``.
    """

    name: str
    target: object
    spec: object
    address: tuple
    secret: list
    cwd: str
    bind_host: Optional[str] = None


class _WorkerActor:
    """Body of every worker actor: connect to the controller, then serve like a process."""

    def run(self, job: ActorJob) -> None:
        """Work in the driver's directory ``job.cwd``, connect to the controller at
        ``job.address``, say who this is and where, serve until shutdown (Ctrl-C is for the
        driver: it stops the workers).

        ``AREAL_FAST_NODE_ID`` / ``AREAL_FAST_NODE_IP`` name this node; the key is read from
        the object store."""
        import ray

        with contextlib.suppress(ValueError):  # not the main thread: nothing to do
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.chdir(job.cwd)
        if job.cwd not in sys.path:  # modules beside the config (agents) import, after it
            sys.path.append(job.cwd)
        ip = ray.util.get_node_ip_address()
        os.environ[NODE_ID_ENV] = ray.get_runtime_context().get_node_id()
        os.environ[NODE_IP_ENV] = ip
        authkey = ray.get(job.secret[0])
        spec = job.spec
        if job.bind_host is None and dataclasses.is_dataclass(spec) and hasattr(spec, "host"):
            spec = dataclasses.replace(spec, host=ip)
        conn = Client(tuple(job.address), authkey=authkey)
        conn.send_bytes(msgpack.packb({"name": job.name, "pid": os.getpid(), "node_ip": ip}))
        _worker_entry(job.target, conn, job.name, spec, authkey)


def _rendezvous_here(bind_host: Optional[str]) -> tuple[str, int]:
    """``(address, free port)`` on the node this runs on, for the trainer group's rendezvous:
    ``bind_host`` when it names one address, else the node's IP."""
    import ray

    ip = ray.util.get_node_ip_address()
    bind = bind_host or ip
    return reachable_host(bind, ip), free_port(bind)


_REMOTE_ACTOR = None


@contextlib.contextmanager
def _in_package_parent():
    """Run the block in the folder holding the imported ``areal_fast`` package (Ray adds the
    current directory to the workers' ``sys.path``; see the module docstring)."""
    import areal_fast

    here = os.getcwd()
    os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(areal_fast.__file__))))
    try:
        yield
    finally:
        os.chdir(here)


@contextlib.contextmanager
def _sigterm_kept():
    """Keep the launcher's SIGTERM handler (a clean stop, see
    :mod:`areal_fast.launch.interrupt`): ``ray.init`` replaces it with ``sys.exit``."""
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def _remote_actor():
    global _REMOTE_ACTOR
    if _REMOTE_ACTOR is None:
        import ray

        _REMOTE_ACTOR = ray.remote(max_restarts=0)(_WorkerActor)
    return _REMOTE_ACTOR


_REMOTE_RENDEZVOUS = None


def _remote_rendezvous():
    global _REMOTE_RENDEZVOUS
    if _REMOTE_RENDEZVOUS is None:
        import ray

        _REMOTE_RENDEZVOUS = ray.remote(num_cpus=0, max_retries=0)(_rendezvous_here)
    return _REMOTE_RENDEZVOUS


class RayHandle(WorkerHandle):
    """A worker running in a Ray actor (its ``run`` call lasts as long as the worker).

    Attributes
    ----------
    node_ip : str or None
        IP of the node the actor runs on, as the actor reported it (also ``node``, which
        messages about the worker name).
    """

    def __init__(
        self,
        name: str,
        conn: MessageChannel,
        actor,
        run_ref,
        pid: int,
        node_ip: Optional[str] = None,
    ):
        self.name, self.conn, self.actor, self.run_ref, self._pid = name, conn, actor, run_ref, pid
        self.node_ip = self.node = node_ip

    @property
    def pid(self) -> Optional[int]:
        return self._pid

    def exit_status(self) -> str:
        import ray

        done, _ = ray.wait([self.run_ref], timeout=0)
        if not done:
            return "still running"
        try:
            ray.get(self.run_ref)
        except Exception as exc:  # noqa: BLE001 - RayActorError, the worker's own error
            return f"actor ended: {type(exc).__name__}"
        return "exit code 0"

    def reap(self, timeout: float) -> None:
        import ray

        ray.wait([self.run_ref], timeout=timeout)

    def stop(self, timeout: float = 10.0) -> None:
        import ray

        from areal_fast.wire.messages import Shutdown

        try:
            self.conn.send(Shutdown())
            ray.wait([self.run_ref], timeout=timeout)
        except (OSError, ValueError):
            pass
        ray.kill(self.actor, no_restart=True)
        self.conn.close()


def _check_resources(bundles: list[dict], available: dict) -> None:
    """Fail at once when the workers need more CPUs/GPUs than the whole Ray cluster has.

    Raises
    ------
    WorkerError
        Naming the resource, what the workers need and the ``scheduler.*`` keys.
    """
    for resource, keys in (("CPU", "cpus"), ("GPU", "gpus")):
        need = sum(b.get(resource, 0) for b in bundles)
        have = available.get(resource, 0)
        if need > have:
            raise WorkerError(
                f"the {len(bundles)} workers need {need:g} {resource}s "
                f"(scheduler.{keys}_per_trainer_rank, scheduler.{keys}_per_rollout_"
                f"worker), the Ray cluster has {have:g}"
            )


class RayCluster(Cluster):
    """Every worker as a Ray actor in one placement group (see the module docstring).

    Parameters
    ----------
    spec : ClusterSpec
    scheduler : SchedulerConfig
        ``ray_address`` (None starts a local Ray instance unless one is already
        initialised in this process), resources per worker, placement strategy,
        ``bind_host`` (None: each process binds its own node's IP).

    Raises
    ------
    WorkerError
        The placement group cannot be placed within ``startup_timeout`` (the resources are
        named), the controller cannot listen on ``scheduler.bind_host``, no rendezvous
        address was found on trainer rank 0's node, or a worker did not connect or start in
        time.
    """

    def __init__(self, spec: ClusterSpec, scheduler):
        super().__init__(spec)
        self.scheduler = scheduler
        self.pg = None
        self.listener: Optional[Listener] = None
        self._started_ray = False
        self._bundles: dict[str, int] = {}
        # connected, not yet claimed: name -> (conn, pid, node IP)
        self._pending: dict[str, tuple] = {}
        self._arrivals: queue.Queue = queue.Queue()
        self._closing = False
        self._secret: Optional[list] = None  # [ObjectRef of the job's key], kept for restarts
        self._address: Optional[tuple[str, int]] = None  # the listener, as actors reach it

    def __enter__(self) -> "RayCluster":
        import ray
        from ray.util.placement_group import placement_group

        if not ray.is_initialized():
            local = self.scheduler.ray_address is None
            with _in_package_parent(), _sigterm_kept():
                ray.init(  # "local": never join another instance `ray start` left running
                    address="local" if local else self.scheduler.ray_address,
                    include_dashboard=False,
                    log_to_driver=True,
                    num_cpus=self.scheduler.ray_num_cpus if local else None,
                )
            self._started_ray = True
        try:
            bundles = self._bundle_specs()
            _check_resources(bundles, ray.cluster_resources())
            self.pg = placement_group(bundles, strategy=self.scheduler.placement_strategy)
            ready, _ = ray.wait([self.pg.ready()], timeout=self.spec.startup_timeout)
            if not ready:
                raise WorkerError(
                    f"Ray cannot place {len(bundles)} workers ({bundles[0]} per "
                    f"trainer rank, {bundles[-1]} per rollout worker) within "
                    f"startup_timeout = {self.spec.startup_timeout:g} s; cluster "
                    f"resources: {ray.cluster_resources()}"
                )
            self._secret = [ray.put(self.authkey)]
            self._listen(ray.util.get_node_ip_address())
            threading.Thread(target=self._accept_loop, daemon=True, name="ray-accept").start()
            if self.spec.train_world_size > 1:
                self.spec = dataclasses.replace(self.spec, rendezvous=self._rendezvous())
        except BaseException:
            self.close()
            raise
        return super().__enter__()

    def _listen(self, driver_ip: str) -> None:
        """Open the listener the actors connect to: ``scheduler.bind_host``, by default the
        driver node's IP.

        Raises
        ------
        WorkerError
            The address cannot be bound here (naming ``scheduler.bind_host``).
        """
        bind = self.scheduler.bind_host or driver_ip
        try:
            self.listener = Listener((bind, 0), authkey=self.authkey)
        except OSError as exc:
            key = "scheduler.bind_host" if self.scheduler.bind_host else "the driver's node IP"
            raise WorkerError(
                f"the controller cannot listen on {bind!r} ({key}): {exc.strerror or exc}"
            ) from None
        self._address = (reachable_host(bind, driver_ip), self.listener.address[1])

    def _rendezvous(self) -> tuple[str, int]:
        """``(address, port)`` for the trainer group, on trainer rank 0's node: found by a
        zero-CPU task pinned to rank 0's bundle.

        Raises
        ------
        WorkerError
            The task failed or did not answer within ``startup_timeout`` (trainer rank 0
            named).
        """
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=self._bundles[trainer_name(0)]
        )
        ref = (
            _remote_rendezvous()
            .options(scheduling_strategy=strategy)
            .remote(self.scheduler.bind_host)
        )
        ready, _ = ray.wait([ref], timeout=self.spec.startup_timeout)
        if not ready:
            ray.cancel(ref, force=True)
            raise WorkerError(
                f"no address for the trainer group's rendezvous on trainer rank 0's node "
                f"within startup_timeout = {self.spec.startup_timeout:g} s",
                trainer_name(0),
            )
        try:
            host, port = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - named in the message
            raise WorkerError(
                f"no address for the trainer group's rendezvous on trainer rank 0's node: "
                f"{str(exc).splitlines()[0]}",
                trainer_name(0),
            ) from None
        return str(host), int(port)

    def _bundle_specs(self) -> list[dict]:
        s, n = self.scheduler, self.spec.train_world_size
        names = [trainer_name(r) for r in range(n)] + [
            f"rollout-{i}" for i in range(self.spec.num_rollout_workers)
        ]
        self._bundles = {name: i for i, name in enumerate(names)}
        trainer = {"CPU": s.cpus_per_trainer_rank, "GPU": s.gpus_per_trainer_rank}
        rollout = {"CPU": s.cpus_per_rollout_worker, "GPU": s.gpus_per_rollout_worker}
        return [
            {k: v for k, v in (trainer if i < n else rollout).items() if v > 0}
            for i in range(len(names))
        ]

    def _start_worker(self, name: str, target, spec, env=None) -> WorkerHandle:
        # env (the local launcher's trainer allocator) is not applied: an actor keeps its
        # node's allocator (LD_PRELOAD through Ray's runtime_env, docs/lora.md)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self._bundles[name]
        resources = self._bundle_specs()[bundle]
        actor = (
            _remote_actor()
            .options(
                num_cpus=resources.get("CPU", 0),
                num_gpus=resources.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=bundle
                ),
            )
            .remote()
        )
        job = ActorJob(
            name, target, spec, self._address, self._secret, os.getcwd(), self.scheduler.bind_host
        )
        run_ref = actor.run.remote(job)
        conn, pid, node_ip = self._accept(name, run_ref)
        return RayHandle(name, MessageChannel(conn), actor, run_ref, pid, node_ip)

    def _accept(self, name: str, run_ref) -> tuple:
        """``(connection, pid, node IP)`` of worker ``name`` (others that arrive first are
        kept)."""
        import ray

        deadline = time.monotonic() + self.spec.startup_timeout
        while name not in self._pending:
            done, _ = ray.wait([run_ref], timeout=0)
            if done:  # the actor ended before connecting: report its error
                try:
                    ray.get(run_ref)
                except Exception as exc:  # noqa: BLE001 - named in the message
                    raise WorkerError(
                        f"worker {name!r} failed to start in Ray: {str(exc).splitlines()[0]}",
                        name,
                        died=True,
                    ) from None
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(
                    f"worker {name!r} did not connect within startup_timeout = "
                    f"{self.spec.startup_timeout:g} s",
                    name,
                )
            try:
                peer, *arrival = self._arrivals.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            self._pending[peer] = tuple(arrival)
        return self._pending.pop(name)

    def _accept_loop(self) -> None:
        """Accept worker connections until the listener closes; each sends its name first."""
        while True:
            try:
                conn = self.listener.accept()
            except Exception:  # noqa: BLE001 - a peer without the key, a reset handshake
                if self._closing:
                    return
                continue
            try:
                if not conn.poll(30.0):
                    raise TimeoutError("no hello")
                hello = msgpack.unpackb(conn.recv_bytes(), raw=False)
                ip = hello.get("node_ip")
                self._arrivals.put(
                    (str(hello["name"]), conn, int(hello["pid"]), str(ip) if ip else None)
                )
            except Exception:  # noqa: BLE001 - not a worker of this job: drop it
                conn.close()

    def close(self, grace_seconds: float = 2.0) -> None:
        """Stop the workers, remove the placement group, shut down a Ray instance this
        cluster started."""
        import ray

        try:
            super().close(grace_seconds)
        finally:
            if self.listener is not None:
                self._closing = True
                self.listener.close()
            if self.pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.pg)
            self._secret = None
            if self._started_ray:
                ray.shutdown()
