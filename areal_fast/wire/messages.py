"""Typed messages between the controller and its worker processes (small: metadata only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from areal_fast.rollout.engine import SamplingParams
from areal_fast.sync.shared_memory import WeightBufferSpec
from areal_fast.sync.slot_broadcast import WeightLink
from areal_fast.wire.shards import DistributedBatch, ShardMetadata


@dataclass
class GroupRequest:
    """One rollout: a prompt sampled ``params.n`` times (a GRPO group).

    ``seed`` is the group's sampling seed (sample i uses ``sample_seed(seed, i)``);
    ``answer`` is what the worker's reward function compares completions with; ``data`` is
    what an agent's ``run_agent_return_reward`` receives (question, answer, uid).
    """

    group_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    answer: str = ""
    uid: str = ""
    data: dict = field(default_factory=dict)


# controller → rollout worker
@dataclass
class SubmitGroups:
    """Start these rollouts (prompt groups) on the worker."""

    groups: list[GroupRequest]


@dataclass
class UpdateWeights:
    """Pause, load weights ``version`` from the trainer's slot ``buffer`` (shared memory, or
    its CUDA twin for an engine on the trainer's GPU), resume."""

    version: int
    buffer: WeightBufferSpec


@dataclass
class ConnectWeights:
    """Sent to trainer rank 0 and to rollout worker ``worker``: from now on the worker gets
    every new version over ``link`` (a :class:`~areal_fast.sync.slot_broadcast.WeightLink`)
    instead of mapping the trainer's slots; rank 0 sends it the newest version at once."""

    worker: str
    link: WeightLink


@dataclass
class DropShards:
    """Forget these finished groups (filtered, stale or unused)."""

    shard_ids: list[int]


@dataclass
class Evaluate:
    """Run these greedy evaluation groups; answer with :class:`EvalDone`.

    With ``version`` set, they run on weights ``version``: the worker starts them once it
    serves that version and installs no newer one until they are done (newer updates wait).
    """

    groups: list[GroupRequest]
    version: Optional[int] = None


@dataclass
class CancelAll:
    """Abort and forget every running rollout (end of training)."""


@dataclass
class Shutdown:
    """Exit the worker process."""


# rollout worker → controller
@dataclass
class WorkerReady:
    """A worker finished starting; rollout workers give their shard-server address,
    the trainer its two weight slots."""

    name: str
    node_addr: str = ""
    weight_buffers: tuple = ()  # trainer: its two WeightBufferSpec slots
    version: int = 0  # trainer: the policy version it starts at (> 0 after a resume)
    node_id: str = ""  # the node it runs on (areal_fast._nodes)
    sync_address: str = ""  # trainer rank 0: ip:port of its weight-link rendezvous store
    # rollout worker: the GPU (UUID) of its in-process engine; trainer: that of its CUDA slots
    gpu_uuid: str = ""


@dataclass
class GroupDone:
    """A finished rollout: shard metadata plus the scalars the controller needs.

    An agent group whose sessions were all dropped has ``shard`` None and no rewards; so has
    a group the worker dropped itself, with ``drop_reason`` (``reward_error``,
    ``reward_timeout``: its reward failed, ``reward.on_error = drop``) and the error.
    """

    shard: Optional[ShardMetadata]
    group_id: int
    rewards: list[float]
    completion_lengths: list[int]  # trained (model-generated) tokens per sequence
    stop_reasons: list[str]
    interruptions: int  # times a sample of the group was aborted and resumed
    agent_stats: dict = field(default_factory=dict)  # AgentWorkload.finish's counters
    errors: list = field(default_factory=list)  # why each dropped agent session was dropped
    drop_reason: str = ""  # the worker dropped the group (its ledger reason)


@dataclass
class WeightsUpdated:
    """A rollout worker serves weights ``version`` now (took ``seconds``)."""

    version: int
    seconds: float
    checksum: str = ""  # CRC-32 of the weights installed (sync.checksum)


@dataclass
class EvalDone:
    """One record per evaluation group (uid, answer, completion, correct, reward);
    ``version`` repeats the :class:`Evaluate`'s, ``served`` is the weights version the
    groups ran on."""

    records: list[dict]
    version: Optional[int] = None
    served: int = 0


@dataclass
class Cancelled:
    """Reply to :class:`CancelAll`: how many training groups were dropped."""

    groups: int


@dataclass
class WorkerFailed:
    """A worker caught an exception; the controller stops with this message, or replaces the
    worker when ``restartable`` (its inference engine failed: a new worker builds a new one)."""

    name: str
    message: str
    restartable: bool = False


# controller → trainer
@dataclass
class SlotReaders:
    """Sent to trainer rank 0 with CUDA slots once every rollout worker has its weight path:
    whether any reads the host slots (shared memory or a weight link). With ``host`` False the
    trainer writes each version into its CUDA slots only."""

    host: bool


@dataclass
class TrainStep:
    """Fetch ``batch``, take one training step, publish the weights into ``slot``."""

    batch: DistributedBatch
    slot: int  # weight buffer to publish the new version into


@dataclass
class SaveCheckpoint:
    """Write a HF checkpoint directory at ``path``; answer with :class:`Saved`."""

    path: str


@dataclass
class SaveState:
    """Write the trainer state (weights, optimizer, LR schedule, RNG, version) into the
    directory ``path``; every rank takes part; rank 0 answers with :class:`StateSaved`."""

    path: str


# trainer → controller
@dataclass
class StateSaved:
    """The trainer state of policy ``version`` is complete in ``path``."""

    path: str
    version: int


@dataclass
class StepDone:
    """A finished training step: new version, the trainer's metrics and timings."""

    version: int
    stats: dict
    group_ids: list[int] = field(default_factory=list)
    trained_tokens: int = 0
    fetch_seconds: float = 0.0
    train_seconds: float = 0.0
    publish_seconds: float = 0.0
    weights_checksum: str = ""  # CRC-32 of the published weights (sync.checksum)


@dataclass
class Saved:
    """The checkpoint at ``path`` is written."""

    path: str
