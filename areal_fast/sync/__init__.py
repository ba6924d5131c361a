"""Weight sync from trainers to inference engines.

What ``areal-fast train`` uses: the trainer writes policy version v into one of two slots
(``trainer_slots``): host shared memory (``shared_memory``), and on a GPU trainer also their
CUDA twins (``cuda_slots``). Every rollout worker on the node reads its slot in place at its
next pause (:class:`~areal_fast.wire.messages.UpdateWeights`): an engine on the
trainer's GPU copies from the CUDA slot device to device, any other from shared memory;
workers on other nodes get each version over a weight link (``slot_broadcast``). ``config``
chooses the path of each worker (``sync.transport``). With LoRA a version is the adapter alone,
its tensors named as ``adapter`` says (the trainer and the engines both read it there).

The rest is a library for engines outside the training loop (vLLM, SGLang, other nodes), used
by the receivers and the benchmarks (``benches/_vllm_offline.py``: a ``vllm.LLM`` on a sync
group):

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
