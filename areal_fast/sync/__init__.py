"""Weight sync from trainers to inference engines.

What ``areal-fast train`` uses today: only ``shared_memory``. The trainer writes policy version
v into one of two shared-memory slots, and every rollout worker on the node reads it in place
at its next pause (:class:`~areal_fast.controller.messages.UpdateWeights`).

The rest is a library for engines outside the training loop (vLLM, SGLang, other nodes), used
by ``rollout/vllm_engine.py``, the receivers and the benchmarks:

=================  ==========================================================================
module             holds
=================  ==========================================================================
``buckets``        bucket planner (native), pack / unpack with dtype cast (C++ threads, CUDA)
``transports``     ``Transport`` interface; NCCL / gloo, CUDA IPC, shared memory, disk
``sources``        what a trainer sends: a module's parameters (plain or FSDP2), name hook
``sender``         ``WeightSender``: header → accept round → double-buffered buckets → acks
``receiver``       ``WeightReceiver`` / ``ReceiveSession``: the engine side
``receivers/``     vLLM weight-transfer backend, SGLang HTTP client
=================  ==========================================================================

The embedded engine receives with :meth:`areal_fast.rollout.hf_engine.HFEngine.receive_weights`.
"""
