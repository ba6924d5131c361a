"""Typed records that flow from rollout to training: trajectories and packed batches."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from areal_fast.ops.packing import cu_seqlens_from_lengths, position_ids_from_cu_seqlens

IGNORE_INDEX = -100


@dataclass
class Trajectory:
    """One sampled completion of one prompt, as the inference engine produced it.

    Attributes
    ----------
    prompt_ids : list[int]
        Prompt token ids (chat template applied), length P.
    completion_ids : list[int]
        Generated token ids, length C (includes the stop token when generation stopped).
    logprobs : list[float]
        Behaviour log-prob of each completion token (fp32 nats, at the sampling
        temperature), length C.
    versions : list[int]
        Policy version that generated each completion token, length C.
    stop_reason : str
        "stop" (end-of-sequence token) or "length" (max_new_tokens reached).
    group_id : int
        GRPO group (one per prompt).
    reward : float
        Scalar reward, filled in after scoring.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str
    group_id: int = 0
    reward: float = 0.0
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("prompt_ids must hold at least one token")
        if not (len(self.completion_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(f"completion_ids ({len(self.completion_ids)}), logprobs "
                             f"({len(self.logprobs)}) and versions ({len(self.versions)}) "
                             f"must have equal lengths")

    @property
    def num_tokens(self) -> int:
        """Prompt plus completion length."""
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class PackedBatch:
    """Sequences concatenated without padding (the packed-batch data contract).

    Position t holds token ``input_ids[t]``; the label there is the next token of the same
    sequence, so ``labels``, ``loss_mask``, ``behav_logprobs``, ``versions`` and
    ``advantages`` at t all describe the prediction of token t + 1.

    Attributes
    ----------
    input_ids : Tensor [T] int64
    position_ids : Tensor [T] int64, restarting at 0 per sequence
    cu_seqlens : Tensor [B+1] int32, cu_seqlens[0] = 0, cu_seqlens[-1] = T
    max_seqlen : int
    labels : Tensor [T] int64, -100 at each sequence's last token and on prompt positions
    loss_mask : Tensor [T] bool, True where the label is a completion token
    behav_logprobs : Tensor [T] float32, engine log-prob of the label (0 where masked out)
    versions : Tensor [T] int32, policy version of the label token (-1 where masked out)
    advantages : Tensor [T] float32
    rewards : Tensor [B] float32
    group_ids : Tensor [B] int64
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    labels: torch.Tensor
    loss_mask: torch.Tensor
    behav_logprobs: torch.Tensor
    versions: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """T, the packed token count."""
        return int(self.input_ids.numel())

    @property
    def num_seqs(self) -> int:
        """B, the number of sequences."""
        return int(self.cu_seqlens.numel()) - 1

    def to(self, device) -> "PackedBatch":
        """Copy every tensor to ``device``."""
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                 for k, v in self.__dict__.items()}
        return PackedBatch(**moved)


def pack_trajectories(trajectories: list[Trajectory], advantages: torch.Tensor) -> PackedBatch:
    """Pack trajectories into one :class:`PackedBatch` (no padding).

    Parameters
    ----------
    trajectories : list[Trajectory], length B
    advantages : Tensor [B] float32
        Per-sequence advantage, broadcast to every completion position.

    Returns
    -------
    PackedBatch
    """
    if advantages.shape != (len(trajectories),):
        raise ValueError(f"advantages must be [B={len(trajectories)}], "
                         f"got {tuple(advantages.shape)}")
    ids, labels, mask, behav, versions, adv = [], [], [], [], [], []
    for traj, seq_adv in zip(trajectories, advantages.tolist()):
        seq = traj.prompt_ids + traj.completion_ids
        num_prompt, num_completion = len(traj.prompt_ids), len(traj.completion_ids)
        ids.extend(seq)
        # position t predicts token t + 1; completion token j sits at t = P + j.
        labels.extend([IGNORE_INDEX] * (num_prompt - 1) + traj.completion_ids + [IGNORE_INDEX])
        mask.extend([False] * (num_prompt - 1) + [True] * num_completion + [False])
        behav.extend([0.0] * (num_prompt - 1) + traj.logprobs + [0.0])
        versions.extend([-1] * (num_prompt - 1) + traj.versions + [-1])
        adv.extend([0.0] * (num_prompt - 1) + [seq_adv] * num_completion + [0.0])
    lengths = [t.num_tokens for t in trajectories]
    cu_seqlens = cu_seqlens_from_lengths(lengths)
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        position_ids=position_ids_from_cu_seqlens(cu_seqlens),
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lengths, default=0),
        labels=torch.tensor(labels, dtype=torch.int64),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        behav_logprobs=torch.tensor(behav, dtype=torch.float32),
        versions=torch.tensor(versions, dtype=torch.int32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        group_ids=torch.tensor([t.group_id for t in trajectories], dtype=torch.int64),
    )


def select_sequences(batch: PackedBatch, indices: list[int]) -> PackedBatch:
    """A new :class:`PackedBatch` holding sequences ``indices`` of ``batch``, in that order.

    Raises
    ------
    ValueError
        If an index is outside [0, B).
    """
    bounds = batch.cu_seqlens.tolist()
    for i in indices:
        if not 0 <= i < batch.num_seqs:
            raise ValueError(f"sequence index {i} outside [0, {batch.num_seqs})")
    token_index = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in indices]) \
        if indices else torch.zeros(0, dtype=torch.int64)
    lengths = [bounds[i + 1] - bounds[i] for i in indices]
    cu_seqlens = cu_seqlens_from_lengths(lengths)
    seq_index = torch.tensor(indices, dtype=torch.int64)
    per_token = {name: getattr(batch, name)[token_index] for name in
                 ("input_ids", "labels", "loss_mask", "behav_logprobs", "versions", "advantages")}
    return PackedBatch(position_ids=position_ids_from_cu_seqlens(cu_seqlens),
                       cu_seqlens=cu_seqlens, max_seqlen=max(lengths, default=0),
                       rewards=batch.rewards[seq_index], group_ids=batch.group_ids[seq_index],
                       **per_token)
