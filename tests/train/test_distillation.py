"""On-policy distillation in the trainer: teacher = student is a no-op, the teacher's
reverse KL reaches the gradients as the advantages and the step's ``distill_kl``."""

import dataclasses

import pytest
import torch

from areal_fast.models.loading import load_causal_lm
from areal_fast.rl.batch import Trajectory, pack_trajectories
from areal_fast.train.config import ActorConfig, DistillConfig, OptimizerConfig
from areal_fast.train.torch_engine import TorchTrainEngine, packed_forward_logprobs

TEMPERATURE = 0.9


def _batch(vocab: int, seed: int):
    """8 sequences (4 groups of 2) of random tokens; behaviour log-probs filled in later."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(8):
        p, c = (
            int(torch.randint(2, 7, (1,), generator=g)),
            int(torch.randint(3, 10, (1,), generator=g)),
        )
        ids = torch.randint(0, vocab, (p + c,), generator=g).tolist()
        trajs.append(Trajectory(ids[:p], ids[p:], [0.0] * c, [0] * c, "stop", group_id=i // 2))
    return pack_trajectories(trajs, torch.randn(8, generator=g))


def _sampled_by(model, batch):
    """``batch`` with behaviour log-probs as ``model`` gives them on the trainer's path."""
    with torch.no_grad():
        logprobs, _ = packed_forward_logprobs(model, batch, TEMPERATURE, with_entropy=False)
    return dataclasses.replace(batch, behav_logprobs=torch.where(batch.loss_mask, logprobs, 0.0))


def _engine(model_dir, distill: DistillConfig, teacher=None, lr=1e-3, fused_loss=True):
    actor = ActorConfig(optim=OptimizerConfig(lr=lr), distill=distill, keep_groups=False)
    if distill.enabled and teacher is None:
        teacher = load_causal_lm(distill.teacher_path)
    model = load_causal_lm(str(model_dir))
    return TorchTrainEngine(
        model, actor, temperature=TEMPERATURE, teacher_model=teacher, fused_loss=fused_loss
    )


def _perturbed(model_dir, seed: int):
    teacher = load_causal_lm(str(model_dir))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return teacher


def test_teacher_equal_to_student_is_exactly_zero_and_moves_nothing(tiny_model_dir, fresh_seed):
    distill = DistillConfig(teacher_path=str(tiny_model_dir), coef=1.0, task_reward=False)
    engine = _engine(tiny_model_dir, distill)
    batch = _sampled_by(engine.model, _batch(engine.model.config.vocab_size, fresh_seed % 997))
    # the signal of every token is exactly 0: the advantages come back unchanged
    kept = _engine(tiny_model_dir, dataclasses.replace(distill, task_reward=True))
    shifted, stats = kept._distill(batch)
    assert torch.equal(shifted.advantages, batch.advantages) and float(stats["distill_kl"]) == 0
    before = [p.detach().clone() for p in engine.model.parameters()]
    step = engine.train_step(batch)
    assert step["distill_kl"] == 0.0 and step["grad_norm"] == 0.0
    largest = max(
        float((p.detach() - b).abs().max()) for p, b in zip(engine.model.parameters(), before)
    )
    assert largest < 1e-9, largest  # AdamW with zero gradients (weight_decay 0): no move
    # the same step with the task reward kept does move them (the check above can fail)
    before = [p.detach().clone() for p in kept.model.parameters()]
    kept.train_step(batch)
    moved = max(
        float((p.detach() - b).abs().max()) for p, b in zip(kept.model.parameters(), before)
    )
    assert moved > 1e-4, moved


@pytest.mark.parametrize(
    "task_reward,fused_loss", [(False, True), (True, True), (False, False)], ids=str
)
def test_the_teacher_signal_is_the_advantage(tiny_model_dir, fresh_seed, task_reward, fused_loss):
    """Distillation's gradients equal plain GRPO's on the advantages A + coef·(teacher −
    behav) (or the signal alone), and distill_kl is the mean reverse KL of the trained tokens."""
    coef = 0.7
    teacher = _perturbed(tiny_model_dir, fresh_seed)
    distill = DistillConfig(teacher_path=str(tiny_model_dir), coef=coef, task_reward=task_reward)
    engine = _engine(tiny_model_dir, distill, teacher=teacher, fused_loss=fused_loss)
    batch = _sampled_by(engine.model, _batch(engine.model.config.vocab_size, fresh_seed % 991))
    with torch.no_grad():
        teacher_lp, _ = packed_forward_logprobs(teacher, batch, TEMPERATURE, with_entropy=False)
    mask = batch.loss_mask
    kl = torch.where(mask, batch.behav_logprobs - teacher_lp, 0.0)
    signal = -coef * kl
    manual = dataclasses.replace(
        batch, advantages=batch.advantages + signal if task_reward else signal
    )
    plain = _engine(tiny_model_dir, DistillConfig(), fused_loss=fused_loss)
    stats = engine.accumulate_gradients(batch)
    plain.accumulate_gradients(manual)
    assert stats["distill_kl"] == pytest.approx(float(kl.sum() / mask.sum()), rel=1e-5, abs=1e-7)
    # random tokens, not the student's samples: the mean has no sign, but the teacher differs
    assert kl.abs().max() > 1e-2
    got = torch.cat([p.grad.flatten() for p in engine.model.parameters()])
    want = torch.cat([p.grad.flatten() for p in plain.model.parameters()])
    assert want.abs().max() > 1e-4
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_a_teacher_needs_the_key_and_the_key_a_teacher(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir))
    with pytest.raises(ValueError, match="teacher_model is given but actor.distill.teacher_path"):
        TorchTrainEngine(model, ActorConfig(), temperature=1.0, teacher_model=model)
    actor = ActorConfig(distill=DistillConfig(teacher_path=str(tiny_model_dir)))
    with pytest.raises(ValueError, match="teacher_path is set but no teacher_model is given"):
        TorchTrainEngine(model, actor, temperature=1.0)
