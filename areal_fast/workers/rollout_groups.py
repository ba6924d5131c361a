"""A rollout worker's plain (non-agent) groups: their samples while they generate, and the
records a finished group becomes (a :class:`~areal_fast.wire.messages.GroupDone`, or
an evaluation record)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from areal_fast.wire import messages as msg
from areal_fast.wire.shards import ShardMetadata


@dataclass
class Sample:
    """One sample of a group: its prompt, seed, token budget and what it generated so far
    (tokens, their log-probs and policy versions), across interruptions."""

    group_id: int
    index: int
    prompt_ids: list[int]
    seed: int
    budget: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop_reason: str = ""
    interruptions: int = 0


@dataclass
class Group:
    """A running group: its request, its samples and how many have finished."""

    request: msg.GroupRequest
    samples: list[Sample]
    done: int = 0
    evaluation: bool = False


def sample_dicts(request: msg.GroupRequest) -> list[dict]:
    """What a user reward receives for each of the group's samples: the request's ``data``
    (the dataset row) with ``"uid"`` and ``"answer"`` (the request's, where the row has
    none); one copy per sample, so a reward that changes its dict changes no other."""
    row = {"uid": request.uid, "answer": request.answer, **request.data}
    return [dict(row) for _ in range(request.params.n)]


def seams(versions: list[int]) -> int:
    """Weight updates a sample spans (where its token versions step up).

    Raises
    ------
    RuntimeError
        The versions decrease (an engine bug).
    """
    if any(b < a for a, b in zip(versions, versions[1:])):
        raise RuntimeError(f"a sample's versions decrease: {versions}")
    return sum(a < b for a, b in zip(versions, versions[1:]))


def group_done(
    group: Group,
    rewards: list[float],
    shard: Optional[ShardMetadata],
    drop_reason: str = "",
    error: str = "",
) -> msg.GroupDone:
    """The :class:`GroupDone` of a finished group: ``shard`` None with a ``drop_reason``
    (its reward failed, ``reward.on_error = drop``), then with no rewards and ``error``."""
    samples = group.samples
    return msg.GroupDone(
        shard,
        group.request.group_id,
        [] if drop_reason else rewards,
        [len(s.tokens) for s in samples],
        [s.stop_reason for s in samples],
        sum(max(s.interruptions, seams(s.versions)) for s in samples),
        errors=[error] if error else [],
        drop_reason=drop_reason,
    )


def eval_record(request: msg.GroupRequest, completion: str, reward: float, error: str) -> dict:
    """One held-out record: uid, answer, completion, reward and ``correct`` (reward >= 1.0);
    a failed reward scores 0 and adds ``error``."""
    record = {
        "uid": request.uid,
        "answer": request.answer,
        "completion": completion,
        "correct": reward >= 1.0,
        "reward": reward,
    }
    if error:
        record["error"] = error
    return record
