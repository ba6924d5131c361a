"""Embedded inference engine on top of transformers generation (CPU or GPU)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Iterable, Optional

import torch

from areal_fast.rl.batch import Trajectory
from areal_fast.rollout.config import HF_BATCHING
from areal_fast.rollout.decode_batch import DecodeBatch, Sequence, check_model
from areal_fast.rollout.engine import (
    GenOutput,
    GenRequest,
    SamplingParams,
    check_requests,
    sample_seed,
)
from areal_fast.rollout.lora_merge import AdapterMerger
from areal_fast.rollout.static_batch import generate_rows
from areal_fast.sync.adapter import is_adapter_update

# prompt tokens prefilled in one step at most (at least one sequence is always admitted)
MAX_PREFILL_TOKENS = 8192


class HFEngine:
    """The embedded inference engine over a transformers causal LM, batch and request-level APIs.

    The batch API (:meth:`generate`, an
    :class:`~areal_fast.rollout.engine.InferenceEngine`) generates in the caller's thread.
    The request-level API (:meth:`start`, :meth:`submit`, :meth:`get_outputs`,
    :meth:`pause`, :meth:`resume`, :meth:`close`, an
    :class:`~areal_fast.rollout.engine.AsyncInferenceEngine`) runs requests in an engine
    thread. Both APIs batch the same way, chosen by ``batching``:

    - ``"continuous"`` (default): up to ``max_batch_size`` sequences decode together
      (:class:`~areal_fast.rollout.decode_batch.DecodeBatch`, one forward pass a step over a
      per-slot KV cache); a queued request joins at the next step, a finished one leaves at
      once and its slot takes the next, and requests with any sampling settings share a
      batch. Identical prompts (a GRPO group) are prefilled once. :meth:`pause` aborts the
      running requests at the next step.
    - ``"static"``: up to ``max_batch_size`` queued requests that share (temperature, top_p),
      oldest first, are left-padded into one ``model.generate``, which runs until its longest
      row ends (:func:`~areal_fast.rollout.static_batch.generate_rows`); :meth:`pause` cuts it
      short at the next token.

    Sampling uses temperature and top-p only: top-k, repetition penalties and every other
    logits processor that a model's ``generation_config.json`` may set are switched off. The
    behaviour log-prob of each generated token is ``log_softmax(logits / temperature)`` of the
    raw logits, i.e. the tempered full distribution that the trainer recomputes, so the PPO
    ratio is exactly 1 on-policy; with top_p < 1 the tokens are drawn from the nucleus of that
    distribution (the convention of vLLM's default logprobs). Greedy decoding (temperature 0)
    reports log-probs at temperature 1.

    Seeded sampling (:meth:`generate` with ``seeds``, and every sampled request) draws each
    token with :class:`~areal_fast.rollout.sampling.SeededSampler`, so a sample's tokens do
    not depend on the batch it runs in nor on interruptions; unseeded sampling uses the torch
    random generator.

    Parameters
    ----------
    model : transformers PreTrainedModel
        A causal LM; the engine owns it (weights change through :meth:`update_weights`).
    tokenizer : transformers tokenizer
        Supplies ``pad_token_id`` and ``eos_token_id``.
    max_batch_size : int
        Sequences generated together.
    batching : str
        "continuous" or "static" (see above).

    Raises
    ------
    ValueError
        If ``max_batch_size`` < 1 or ``batching`` is unknown, or continuous batching cannot
        run the model (soft-capping, sliding-window layers).
    """

    def __init__(self, model, tokenizer, max_batch_size: int = 64, batching: str = "continuous"):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size = {max_batch_size} must be >= 1")
        if batching not in HF_BATCHING:
            raise ValueError(f"batching = {batching!r}: expected one of {', '.join(HF_BATCHING)}")
        if batching == "continuous":
            check_model(model)
        from transformers import GenerationConfig

        self.model = model.eval()
        # transformers fills unset sampling options from the model's own generation config;
        # a neutral one keeps a model's repetition penalty etc. out of the sampling.
        self.model.generation_config = GenerationConfig(
            bos_token_id=model.config.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id
        self.max_batch_size = max_batch_size
        self.batching = batching
        self._version = 0
        # Held while the model generates or changes weights (both APIs, any thread).
        self._model_lock = threading.Lock()
        # Request-level state, guarded by _cond.
        self._cond = threading.Condition()
        self._queue: deque[GenRequest] = deque()
        self._outputs: list[GenOutput] = []
        self._thread: Optional[threading.Thread] = None
        self._paused = False
        self._busy = False
        self._closing = False
        self._error: Optional[BaseException] = None
        self._abort = threading.Event()
        # Why the weights are not a complete version (a bucketed update failed part-way);
        # while set, the engine refuses to generate or resume.
        self._incomplete: Optional[str] = None
        self._updating = False  # a receive_weights transfer is running
        self._adapter = AdapterMerger(self.model)  # LoRA updates: base copies, merge

    @property
    def version(self) -> int:
        """Policy version of the weights currently served."""
        return self._version

    @property
    def device(self) -> torch.device:
        """Device of the served weights."""
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ batch API

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: Optional[list[int]] = None
    ) -> list[Trajectory]:
        """Sample ``params.n`` completions per prompt; prompt-major order.

        ``group_id`` of each trajectory is the index of its prompt in ``prompts``. May be
        called while the engine thread runs; the two take turns on the model.

        Parameters
        ----------
        prompts : list[list[int]]
            Prompt token ids, each non-empty.
        params : SamplingParams
        seeds : list[int], optional
            One seed per prompt. Sample i of prompt g is then drawn with
            ``sample_seed(seeds[g], i)``, so its tokens do not depend on batching. Without
            seeds, sampling uses the torch random generator. Ignored when greedy.

        Returns
        -------
        list[Trajectory]
            ``len(prompts) * params.n`` trajectories.

        Raises
        ------
        ValueError
            If a prompt is empty or ``seeds`` does not hold one seed per prompt.
        """
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompts[{i}] is empty")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(
                f"seeds has {len(seeds)} entries, expected one per prompt ({len(prompts)})"
            )
        expanded = [
            (gid, p, None if seeds is None else sample_seed(seeds[gid], i))
            for gid, p in enumerate(prompts)
            for i in range(params.n)
        ]
        if self.batching == "continuous":
            return self._generate_continuous(expanded, params)
        out: list[Trajectory] = []
        for start in range(0, len(expanded), self.max_batch_size):
            chunk = expanded[start : start + self.max_batch_size]
            with self._model_lock:
                self._check_complete()
                version = self._version
                rows = generate_rows(
                    self.model, self.pad_id, self.eos_id,
                    [p for _, p, _ in chunk],
                    [params.max_new_tokens] * len(chunk),
                    params.temperature,
                    params.top_p,
                    seeds=None if seeds is None else [s for _, _, s in chunk],
                )  # fmt: skip
            out.extend(
                Trajectory(
                    prompt_ids=list(p),
                    completion_ids=r.tokens,
                    logprobs=r.logprobs,
                    versions=[version] * len(r.tokens),
                    stop_reason=r.stop_reason,
                    group_id=gid,
                )
                for (gid, p, _), r in zip(chunk, rows)
            )
        return out

    def _generate_continuous(self, expanded, params: SamplingParams) -> list[Trajectory]:
        """The batch API on a :class:`DecodeBatch` of its own, holding the model throughout."""
        waiting = deque(
            Sequence(i, list(p), params.max_new_tokens, params.temperature, params.top_p, seed)
            for i, (_, p, seed) in enumerate(expanded)
        )
        done: list[Sequence] = [None] * len(expanded)
        with self._model_lock:
            self._check_complete()
            batch = DecodeBatch(self.model, self.max_batch_size, self.eos_id)
            while waiting or batch.running or batch.pending:
                batch.add(_admit(waiting, batch.free))
                for seq in batch.step(self._version):
                    done[seq.key] = seq
        return [
            Trajectory(
                prompt_ids=list(p),
                completion_ids=seq.tokens,
                logprobs=seq.logprobs,
                versions=seq.versions,
                stop_reason=seq.stop_reason,
                group_id=gid,
            )
            for (gid, p, _), seq in zip(expanded, done)
        ]

    # ------------------------------------------------------------ request-level API

    def start(self) -> None:
        """Start the engine thread (not paused; a stored engine-thread error is cleared).

        Raises
        ------
        RuntimeError
            If the engine thread is already running.
        """
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("HFEngine: the engine thread is already running")
            self._error = None
            self._paused = False
            self._closing = False
            self._abort.clear()
            self._thread = threading.Thread(target=self._serve, name="HFEngine", daemon=True)
            self._thread.start()

    def submit(self, requests: list[GenRequest], front: bool = False) -> None:
        """Queue requests; they start once the engine is running, not paused and has capacity.

        Parameters
        ----------
        requests : list[GenRequest]
        front : bool
            Put them ahead of every queued request (resumed samples go first, so an
            interruption does not push the oldest samples behind newer ones).

        Raises
        ------
        ValueError
            If a request has empty ``input_ids``, ``max_new_tokens`` < 1, a negative
            ``temperature`` or ``offset``, or ``top_p`` outside (0, 1].
        BaseException
            The stored exception of a failed engine thread.
        """
        check_requests(requests)
        with self._cond:
            self._raise_error()
            if front:
                self._queue.extendleft(reversed(requests))
            else:
                self._queue.extend(requests)
            self._cond.notify_all()

    def get_outputs(self, timeout: float) -> list[GenOutput]:
        """Finished or aborted requests, waiting up to ``timeout`` seconds for the first.

        Parameters
        ----------
        timeout : float
            Seconds to wait (>= 0) when no output is ready.

        Returns
        -------
        list[GenOutput]
            Every output not yet returned, in completion order; empty after a timeout.

        Raises
        ------
        ValueError
            If ``timeout`` < 0.
        BaseException
            The exception that stopped the engine thread (re-raised on every call).
        """
        if timeout < 0:
            raise ValueError(f"timeout = {timeout} must be >= 0")
        with self._cond:
            self._cond.wait_for(lambda: self._outputs or self._error is not None, timeout)
            self._raise_error()
            out, self._outputs = self._outputs, []
            return out

    def pause(self, timeout: float, keep: Optional[bool] = None) -> None:
        """Abort the running batch, keep queued requests queued, and wait until idle
        (``keep=True`` is refused: ``generate`` has no in-place pause).

        The running requests come back from :meth:`get_outputs` with their partial tokens
        and stop_reason "abort" (or "stop"/"length" if they finished in the same step).

        Parameters
        ----------
        timeout : float
            Seconds to wait for the engine thread to finish its current step (>= 0).

        Raises
        ------
        ValueError
            If ``timeout`` < 0.
        TimeoutError
            If the engine thread is still generating after ``timeout`` seconds (the engine
            stays paused).
        BaseException
            The exception that stopped the engine thread.
        """
        if timeout < 0:
            raise ValueError(f"timeout = {timeout} must be >= 0")
        if keep:
            raise ValueError("HFEngine has no in-place pause (rollout.pause_mode=keep)")
        with self._cond:
            self._paused = True
            self._abort.set()
            idle = self._cond.wait_for(lambda: not self._busy or self._error is not None, timeout)
            self._raise_error()
            if not idle:
                raise TimeoutError(
                    f"HFEngine: engine thread still generating {timeout} s after pause"
                )

    def resume(self) -> None:
        """Start generating queued requests again.

        Raises
        ------
        RuntimeError
            The weights are incomplete after a failed update (the engine stays paused until
            a complete update arrives).
        """
        with self._cond:
            self._check_complete()
            self._paused = False
            self._abort.clear()
            self._cond.notify_all()

    def drop_queued(self) -> int:
        """Forget queued (not yet running) requests; returns how many were dropped."""
        with self._cond:
            dropped = len(self._queue)
            self._queue.clear()
            return dropped

    def close(self) -> None:
        """Stop the running batch, stop and join the engine thread; drop queued requests and
        unread outputs. Safe to call repeatedly or without :meth:`start`."""
        with self._cond:
            thread = self._thread
            self._closing = True
            self._abort.set()
            self._cond.notify_all()
        if thread is not None:
            thread.join()
        with self._cond:
            self._thread = None
            self._closing = False
            self._paused = False
            self._abort.clear()
            self._queue.clear()
            self._outputs = []

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _take_batch(self) -> list[GenRequest]:
        """Remove and return up to ``max_batch_size`` queued requests sharing the sampling
        settings of the oldest one, in queue order."""
        key = self._sampling_key(self._queue[0])
        batch, rest = [], deque()
        for request in self._queue:
            if len(batch) < self.max_batch_size and self._sampling_key(request) == key:
                batch.append(request)
            else:
                rest.append(request)
        self._queue = rest
        return batch

    @staticmethod
    def _sampling_key(request: GenRequest) -> tuple[float, float]:
        return (0.0, 1.0) if request.temperature == 0 else (request.temperature, request.top_p)

    def _serve(self) -> None:
        """Engine-thread loop (static or continuous batches); stores any exception."""
        try:
            if self.batching == "continuous":
                self._serve_continuous()
            else:
                self._serve_static()
        except BaseException as exc:  # surfaced by get_outputs / pause / submit
            with self._cond:
                self._error = exc
                self._busy = False
                self._cond.notify_all()

    def _serve_static(self) -> None:
        """Run one ``model.generate`` batch of queued requests at a time while not paused."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closing or (not self._paused and self._queue))
                if self._closing:
                    return
                batch = self._take_batch()
                self._busy = True
            outputs = self._run_requests(batch)
            with self._cond:
                self._outputs.extend(outputs)
                self._busy = False
                self._cond.notify_all()

    def _serve_continuous(self) -> None:
        """Step a :class:`DecodeBatch` while it holds sequences, admitting queued requests
        into free slots before every step; on pause, abort the running ones and forget the
        kept prefixes (the weights may change before the resume)."""
        batch = DecodeBatch(self.model, self.max_batch_size, self.eos_id)
        while True:
            with self._cond:
                if self._abort.is_set():  # a pause: running sequences and kept prefixes end
                    self._outputs.extend(map(_output, batch.abort()))
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(
                    lambda: (
                        self._closing
                        or (not self._paused and (self._queue or batch.running or batch.pending))
                    )
                )
                if self._closing:
                    return
                batch.add([_sequence(r) for r in _admit(self._queue, batch.free)])
                self._busy = True
            with self._model_lock:
                self._check_complete()
                ended = batch.step(self._version)
            if ended:
                with self._cond:
                    self._outputs.extend(map(_output, ended))
                    self._cond.notify_all()

    def _run_requests(self, batch: list[GenRequest]) -> list[GenOutput]:
        first = batch[0]
        with self._model_lock:
            self._check_complete()
            version = self._version
            rows = generate_rows(
                self.model, self.pad_id, self.eos_id,
                [r.input_ids for r in batch],
                [r.max_new_tokens for r in batch],
                first.temperature,
                first.top_p,
                seeds=[r.seed for r in batch],
                offsets=[r.offset for r in batch],
                abort=self._abort,
            )  # fmt: skip
        return [
            GenOutput(
                rid=r.rid,
                output_ids=row.tokens,
                logprobs=row.logprobs,
                versions=[version] * len(row.tokens),
                stop_reason=row.stop_reason,
            )
            for r, row in zip(batch, rows)
        ]

    # ----------------------------------------------------------------- weights

    @torch.no_grad()
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Install a complete set of new weights (in-process copy) and their version.

        All names, shapes are checked before any parameter changes, so a bad update leaves
        the previous weights served intact. Tensors are cast to the engine's dtype and copied to
        its device (a CUDA-IPC slot on the engine's GPU: device to device); on CUDA the call
        returns once the copies are done, so the caller may then let the source be rewritten.
        Tied parameters (e.g. input/output embeddings) are updated once and stay aliased.

        An update of LoRA adapter tensors only (``<module>.lora_A`` [r, in] and the scaled
        ``<module>.lora_B`` [out, r], :func:`areal_fast.train.lora.adapter_weights`) is
        merged instead: each adapted weight becomes base + B A, the base being the weight
        as it was before the first adapter update (kept aside,
        :class:`~areal_fast.rollout.lora_merge.AdapterMerger`); the other weights stay.

        Raises
        ------
        RuntimeError
            If the engine thread is running and not paused and idle (see :meth:`pause`).
        ValueError
            An unknown parameter name, a shape mismatch, or a parameter missing from the
            update (each message names the tensor).
        """
        with self._cond:
            self._require_idle("update_weights")
            with self._model_lock:
                self._install(named_tensors, version)

    def receive_weights(self, receiver) -> int:
        """Receive one bucketed update (:mod:`areal_fast.sync`) straight into the parameters.

        The plan is checked against the parameters before any byte arrives (a rejection
        leaves the served version intact). Buckets are then unpacked in place, cast to the
        engine's dtype; tied parameters stay aliased. A plan of LoRA adapter tensors only is
        received into temporaries and merged (as in :meth:`update_weights`). If the update
        fails part-way, the engine refuses to generate or resume until a complete update
        arrives (never a mix of two versions).

        Parameters
        ----------
        receiver : areal_fast.sync.receiver.WeightReceiver

        Returns
        -------
        int
            The version now served.

        Raises
        ------
        RuntimeError
            If the engine thread is running and not paused, or is still busy with a batch, or
            another ``receive_weights`` is running.
        areal_fast.sync.transports.WeightSyncError
            Rejected (unknown name, shape or dtype — the engine is unchanged) or failed
            part-way (the engine is then marked incomplete); ``WeightSyncTimeout`` when a
            step exceeds the receiver's timeout.
        """
        with self._cond:
            self._require_idle("receive_weights")
            if self._updating:
                raise RuntimeError("HFEngine: receive_weights while another update runs")
            self._updating = True  # resume() and generation refuse while it is set
        try:
            with self._model_lock:
                return self._receive(receiver)
        finally:
            with self._cond:
                self._updating = False

    def _receive(self, receiver) -> int:
        from areal_fast.sync.transports import WeightSyncError

        params = dict(self.model.named_parameters())
        session = receiver.start(accept=lambda plan: self._check_plan(plan, params))
        self._incomplete = f"an update to v{session.version} is in progress"
        error, failure = "", None
        specs = session.plan.specs
        adapter = is_adapter_update(spec.name for spec in specs)
        try:
            if adapter:  # into temporaries, then merged
                targets = self._adapter.receive_targets(specs)
                session.unpack_into(targets)
                self._adapter.install(zip((spec.name for spec in specs), targets))
            else:
                session.unpack_into([params.get(spec.name) for spec in specs])
                self._adapter.forget()
        except Exception as exc:  # reported to the sender, then re-raised below
            error, failure = f"{type(exc).__name__}: {exc}", exc
        try:
            session.finish(error)
        except WeightSyncError as exc:
            if not error:  # the weights are complete; only the closing report was lost
                self._incomplete, self._version = None, session.version
                raise
            failure = exc
        if error or failure is not None:
            self._incomplete = (
                f"the update to v{session.version} failed part-way "
                f"({(error or str(failure)).splitlines()[0][:200]})"
            )
            raise WeightSyncError(f"HFEngine: {self._incomplete}") from failure
        self._incomplete, self._version = None, session.version
        return self._version

    def _check_plan(self, plan, params) -> str:
        """'' if ``plan`` is a complete update of the parameters or an adapter update
        that fits the model, else a one-line reason."""
        from areal_fast.sync.receiver import check_against

        if is_adapter_update(spec.name for spec in plan.specs):
            return self._adapter.check({spec.name: tuple(spec.shape) for spec in plan.specs})
        return check_against(plan, params)

    def _require_idle(self, what: str) -> None:
        """Raise unless no engine thread runs, or it is paused and idle (caller holds _cond)."""
        if self._thread is not None and (not self._paused or self._busy):
            raise RuntimeError(
                f"HFEngine: {what} while the engine thread is generating; call pause() first"
            )

    def _check_complete(self) -> None:
        if self._updating:
            raise RuntimeError("HFEngine: a weight update is being received; not serving")
        if self._incomplete is not None:
            raise RuntimeError(
                f"HFEngine: weights incomplete, not serving until a complete "
                f"update arrives: {self._incomplete}"
            )

    def _install(self, named_tensors, version: int) -> None:
        params = dict(self.model.named_parameters())
        incoming = dict(named_tensors)
        if is_adapter_update(incoming):
            self._adapter.install(incoming.items())
            self._installed(version)
            return
        for name, tensor in incoming.items():
            if name not in params:
                raise ValueError(f"weight update: engine has no parameter named {name!r}")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"weight update: {name!r} has shape {tuple(tensor.shape)}, "
                    f"engine expects {tuple(params[name].shape)}"
                )
        missing = sorted(set(params) - set(incoming))
        if missing:
            raise ValueError(
                f"weight update: missing {len(missing)} parameters, first {missing[0]!r}"
            )
        for name, tensor in incoming.items():
            params[name].copy_(tensor)
        self._adapter.forget()  # new base weights
        self._installed(version)

    def _installed(self, version: int) -> None:
        if self.device.type == "cuda":  # the copies are done before the source may change
            torch.cuda.synchronize(self.device)
        self._incomplete, self._version = None, int(version)


def _admit(waiting: deque, free: int) -> list:
    """Pop queued items (requests or sequences) for ``free`` slots, oldest first, while their
    distinct prompts stay within :data:`MAX_PREFILL_TOKENS` (at least one is admitted)."""
    taken, prompts, tokens = [], set(), 0
    while waiting and len(taken) < free:
        ids = waiting[0].input_ids
        key = tuple(ids)
        cost = 0 if key in prompts else len(ids)
        if taken and tokens + cost > MAX_PREFILL_TOKENS:
            break
        prompts.add(key)
        tokens += cost
        taken.append(waiting.popleft())
    return taken


def _sequence(request: GenRequest) -> Sequence:
    return Sequence(
        request.rid, list(request.input_ids), request.max_new_tokens,
        request.temperature, request.top_p, request.seed, request.offset,
    )  # fmt: skip


def _output(seq: Sequence) -> GenOutput:
    return GenOutput(
        rid=seq.key,
        output_ids=seq.tokens,
        logprobs=seq.logprobs,
        versions=seq.versions,
        stop_reason=seq.stop_reason,
        first_token_time=seq.first_token_time,
    )
