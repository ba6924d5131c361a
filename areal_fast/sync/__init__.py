"""Weight sync from trainers to inference engines.

=================  ==========================================================================
module             holds
=================  ==========================================================================
``buckets``        bucket planner (native), pack / unpack with dtype cast (C++ threads, CUDA)
``transports``     ``Transport`` interface; NCCL / gloo, CUDA IPC, shared memory, disk
``sources``        what a trainer sends: a module's parameters (plain or FSDP2), name hook
``sender``         ``WeightSender``: header → accept round → double-buffered buckets → acks
``receiver``       ``WeightReceiver`` / ``ReceiveSession``: the engine side
``receivers/``     vLLM weight-transfer backend, SGLang HTTP client
``shared_memory``  the asynchronous controller's two shared-memory weight slots
``inprocess``      in-process copy (the synchronous reference loop)
=================  ==========================================================================

The embedded engine receives with :meth:`areal_fast.rollout.hf_engine.HFEngine.receive_weights`.
"""
