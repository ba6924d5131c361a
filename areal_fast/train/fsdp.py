"""Data-parallel training with FSDP2: the trainer process group, sharding, a rank-aware engine.

Every rank holds a shard of each parameter (``torch.distributed.fsdp.fully_shard``: one unit
per decoder layer, the root unit holds embeddings, final norm and LM head) and trains on its
own part of the global batch (whole GRPO groups, split by ``DistributedBatch.split``).
:class:`FSDPTrainEngine` makes one step on N ranks equal one
:class:`~areal_fast.train.torch_engine.TorchTrainEngine` step on the whole batch:

- loss weights of the micro-batches divide by GLOBAL counts (trained tokens, sequences,
  trained sequences all-reduced over the ranks), and gradients are SUMMED over ranks
  (FSDP's default averaging is turned off: ``set_gradient_divide_factor(1.0)``);
- all ranks run the same number of micro-batches (FSDP's all-gathers and reduce-scatters must
  pair up): the largest local count is agreed on and smaller ranks re-partition to it, or pad
  with zero-weight passes when they hold too few sequences;
- the gradient norm is clipped globally (DTensor gradients) and the returned statistics are
  global, identical on every rank.

Every public method of the engine is collective: all ranks call it, in the same order.
"""

from __future__ import annotations

import datetime
import functools
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from areal_fast.ops.packing import partition_balanced
from areal_fast.rl.batch import PackedBatch
from areal_fast.train.config import ActorConfig
from areal_fast.train.lora import adapter_weights, apply_lora
from areal_fast.train.torch_engine import (
    SHARDED_FORWARD,
    SHARDED_LOSS,
    BatchTotals,
    TorchTrainEngine,
    _num_trained_seqs,
    unsharded_forward_logprobs,
    unsharded_forward_loss,
)

BACKENDS = ("gloo", "nccl")


def init_trainer_group(
    rank: int,
    world_size: int,
    init_method: str,
    backend: Optional[str] = None,
    timeout_s: float = 600.0,
) -> DeviceMesh:
    """Join the trainers' default process group and return its 1-D data-parallel mesh.

    Parameters
    ----------
    rank, world_size : int
        This trainer's rank in [0, world_size).
    init_method : str
        Rendezvous address, e.g. ``"tcp://127.0.0.1:29500"`` or ``"file:///tmp/rdzv"``.
    backend : {"gloo", "nccl"} or None
        None: nccl when CUDA is available (device ``cuda:rank % device_count``), else gloo.
    timeout_s : float
        Timeout of the rendezvous and of every collective, seconds.

    Returns
    -------
    DeviceMesh
        Over all ranks, one dimension named ``"dp"``.

    Raises
    ------
    ValueError
        Bad rank/world size, empty init_method, unknown backend, timeout <= 0.
    RuntimeError
        torch.distributed already initialised, or the rendezvous failed (one line).
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    _check_group_args(rank, world_size, init_method, backend, timeout_s)
    if dist.is_initialized():
        raise RuntimeError("init_trainer_group: torch.distributed is already initialised")
    device_type = "cuda" if backend == "nccl" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RuntimeError(
            f"trainer rank {rank}/{world_size} could not join the {backend} "
            f"group at {init_method}: {first_line}"
        ) from exc
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))


def _check_group_args(rank, world_size, init_method, backend, timeout_s) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size = {world_size!r} must be an int >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank = {rank!r} must be an int in [0, {world_size})")
    if not init_method:
        raise ValueError("init_method is empty (e.g. tcp://127.0.0.1:29500)")
    if backend not in BACKENDS:
        raise ValueError(f"backend = {backend!r} is not one of {BACKENDS}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s = {timeout_s!r} must be > 0")


def shard_model(model, mesh: DeviceMesh):
    """Shard a HF decoder-only causal LM in place with FSDP2 over ``mesh``.

    One ``fully_shard`` unit per decoder layer, then the root (embeddings, final norm, LM
    head; a tied LM head shares the embedding's parameter and stays tied). Gradients are
    summed over ranks, not averaged (the engine's loss weights already divide by global
    counts). The packed log-prob computation and the packed forward into a loss on the LM
    head are registered as FSDP forward methods (``SHARDED_FORWARD``, ``SHARDED_LOSS``), so
    :func:`~areal_fast.train.torch_engine.packed_forward_logprobs` and
    :func:`~areal_fast.train.torch_engine.packed_forward_loss` gather the root parameters
    around them (the fused loss hands its precomputed LM-head weight gradient to the
    gathered weight, and FSDP reduce-scatters it).

    Parameters
    ----------
    model : transformers causal LM whose ``get_decoder().layers`` are its decoder layers,
        already on the mesh's device
    mesh : DeviceMesh, 1-D

    Returns
    -------
    The same model object, now an ``FSDPModule`` whose parameters are DTensors.

    Raises
    ------
    ValueError
        The model has no ``get_decoder().layers``.
    """
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"shard_model: {type(model).__name__}.get_decoder() has no .layers")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    setattr(model, SHARDED_FORWARD, functools.partial(unsharded_forward_logprobs, model))
    register_fsdp_forward_method(model, SHARDED_FORWARD)
    setattr(model, SHARDED_LOSS, functools.partial(unsharded_forward_loss, model))
    register_fsdp_forward_method(model, SHARDED_LOSS)
    return model


class FSDPTrainEngine(TorchTrainEngine):
    """:class:`~areal_fast.train.torch_engine.TorchTrainEngine` on one data-parallel rank.

    Shards ``model`` (and ``ref_model``, ``teacher_model``) with :func:`shard_model`.
    :meth:`train_step` takes THIS rank's part of the global batch; the step's gradients,
    optimizer update and statistics equal those of one single-process step on the whole
    batch, for every loss aggregation, up to float rounding (micro-batch weights divide by
    global totals, so how the batch is cut into micro-batches does not matter). ``num_micro_batches`` in the stats
    is the per-rank count (the same on every rank).

    With ``ppo_n_minibatches > 1`` each rank splits its own part into that many minibatches,
    and minibatch i of the step is the union of the ranks' i-th parts: a different split
    from the single-process one (so results differ from a 1-rank run, though each update is
    still exact for its own minibatch).

    Every method is collective: call it on all ranks, in the same order, with each rank's
    own batch part (at least one sequence, and at least ``ppo_n_minibatches`` items).

    Parameters
    ----------
    model : transformers causal LM, on this rank's device
    actor : ActorConfig
        As for TorchTrainEngine.
    mesh : DeviceMesh
        The 1-D data-parallel mesh (:func:`init_trainer_group`).
    ref_model, teacher_model : causal LM, optional
        Sharded too (their forwards are collectives as well).
    **kwargs
        The other keyword arguments of TorchTrainEngine (``temperature`` among them).

    Attributes
    ----------
    mesh, group, rank, world_size
        The data-parallel mesh, its process group, this rank and the number of ranks.
    comm_device : torch.device
        Where small collectives (counts, statistics) run: CPU for gloo, this GPU for nccl.
    """

    def __init__(
        self,
        model,
        actor: ActorConfig,
        *,
        mesh: DeviceMesh,
        ref_model=None,
        teacher_model=None,
        **kwargs,
    ):
        if mesh.ndim != 1:
            raise ValueError(f"mesh must be 1-D (data parallel), got {mesh.ndim} dimensions")
        self.mesh = mesh
        self.group = mesh.get_group()
        self.rank = dist.get_rank(self.group)
        self.world_size = mesh.size()
        self.comm_device = (
            torch.device("cpu")
            if mesh.device_type == "cpu"
            else torch.device(mesh.device_type, torch.cuda.current_device())
        )
        if actor.lora.enabled:  # adapters first: they are sharded with their layers
            apply_lora(model, actor.lora)
        shard_model(model, mesh)
        for frozen in (ref_model, teacher_model):
            if frozen is not None:
                shard_model(frozen.eval().requires_grad_(False), mesh)
        super().__init__(model, actor, ref_model=ref_model, teacher_model=teacher_model, **kwargs)

    def accumulate_gradients(
        self, batch: PackedBatch, prox_logprobs: Optional[torch.Tensor] = None
    ) -> dict[str, float]:
        stats = super().accumulate_gradients(batch, prox_logprobs)
        for frozen in (self.ref_model, self.teacher_model):
            if frozen is not None:
                frozen.reshard()  # no backward reshards the no-grad root: free it here
        return stats

    accumulate_gradients.__doc__ = TorchTrainEngine.accumulate_gradients.__doc__

    @torch.no_grad()
    def recompute_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        out = super().recompute_logprobs(batch)
        # FSDP2 keeps the root's parameters gathered after a forward (for the backward that
        # usually follows); after a no-grad pass nothing would reshard them.
        self.model.reshard()
        return out

    recompute_logprobs.__doc__ = TorchTrainEngine.recompute_logprobs.__doc__

    # ---------------------------------------------------------------- collectives
    def _all_reduce(self, values: list, dtype: torch.dtype, op=dist.ReduceOp.SUM) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=dtype, device=self.comm_device)
        dist.all_reduce(tensor, op=op, group=self.group)
        return tensor.cpu()

    def batch_totals(self, batch: PackedBatch) -> BatchTotals:
        """Counts of the global batch: this rank's counts summed over the ranks."""
        local = [int(batch.loss_mask.sum()), batch.num_seqs, _num_trained_seqs(batch)]
        return BatchTotals(*self._all_reduce(local, torch.int64).tolist())

    def _micro_batch_parts(self, batch: PackedBatch) -> list[list[int]]:
        """This rank's micro-batches, as many as on the rank with the most.

        Ranks with fewer re-partition with Karmarkar–Karp and ``min_num_mbs`` = that count
        (more, smaller micro-batches, still under the budget); when they hold fewer items
        than that, empty parts ``[]`` pad the list (zero-weight passes, see
        ``_padding_pass``). Repeats until every rank agrees (a re-partition may need one
        more micro-batch than asked to fit the budget).
        """
        if batch.num_seqs == 0:
            raise ValueError(f"FSDP rank {self.rank} got an empty batch part")
        parts = super()._micro_batch_parts(batch)
        while True:
            most, minus_fewest = self._all_reduce(
                [len(parts), -len(parts)], torch.int64, dist.ReduceOp.MAX
            ).tolist()
            if most == -minus_fewest:
                return parts
            if len(parts) < most:
                parts = self._repartition(batch, most)

    def _repartition(self, batch: PackedBatch, count: int) -> list[list[int]]:
        lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
        parts = partition_balanced(
            lengths,
            self.max_tokens_per_mb,
            method="kk",
            group_ids=batch.group_ids if self.keep_groups else None,
            min_num_mbs=count,
        )
        return parts + [[] for _ in range(count - len(parts))]

    def _reduce_stats(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Sum the micro-batch shares (weighted by global counts) over the ranks; one
        all-reduce and one read-back."""
        keys = sorted(sums)
        values = torch.stack([sums[k] for k in keys]).to(self.comm_device)
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
        return dict(zip(keys, values.tolist()))

    def _staleness_stats(self, batch: PackedBatch) -> dict[str, float]:
        stale = self.version - batch.versions[batch.loss_mask].to(torch.float64)
        total, count = self._all_reduce([float(stale.sum()), stale.numel()], torch.float64)
        local_max = float(stale.max()) if stale.numel() else float("-inf")
        (most,) = self._all_reduce([local_max], torch.float64, dist.ReduceOp.MAX).tolist()
        if count == 0:
            return {"staleness_mean": 0.0, "staleness_max": 0.0}
        return {"staleness_mean": float(total / count), "staleness_max": most}

    def _clip_gradients(self) -> float:
        """Clip the global norm of the sharded (DTensor) gradients; the pre-clip norm."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, self.optim.grad_clip, norm)
        return float(norm)

    # ---------------------------------------------------------------- weights out
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) parameters, tied ones once, in the same order on every rank.

        Each ``full_tensor()`` is an all-gather: every rank must iterate the generator to
        its end in lockstep with the others (and before the next train_step). With
        ``actor.lora``: the adapter alone, as for the single-process engine.
        """
        if self.actor.lora.enabled:
            yield from adapter_weights(self.model)
            return
        for name, param in self.model.named_parameters():
            tensor = param.detach()
            yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    def save(self, path: str) -> None:
        """Write a HF ``save_pretrained`` directory at ``path`` from the full state dict.

        All ranks take part in the gather; rank 0 writes; all return after it has written.
        The gather returns a separate copy of each name of a tied parameter (e.g.
        ``lm_head.weight`` tied to ``model.embed_tokens.weight``); those names are pointed
        back at one tensor, so ``save_pretrained`` writes it once, as for the unsharded model
        (the same tensor names as :meth:`TorchTrainEngine.save`). With ``actor.lora``: the
        merged model and ``path/adapter``, as :meth:`TorchTrainEngine.save` writes them.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from areal_fast.train.checkpoint import _tied_aliases

        state = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank == 0:
            for alias, name in _tied_aliases(self.model).items():
                if alias in state and name in state:
                    state[alias] = state[name]
            if self.actor.lora.enabled:  # the merged model and the adapter
                self._save_merged(path, state)
            else:
                self.model.save_pretrained(path, state_dict=state)
        dist.barrier(group=self.group)
