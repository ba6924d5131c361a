"""On-policy distillation advantages against a float64 reference on fresh random inputs."""

import pytest
import torch

from areal_fast.rl.distill import distill_advantages


def _reference(adv, student, teacher, mask, coef, task_reward):
    """Token by token in float64: kl = student − teacher on trained tokens."""
    out, kls = [], []
    for a, s, t, m in zip(adv.tolist(), student.tolist(), teacher.tolist(), mask.tolist()):
        kl = (s - t) if m else 0.0
        kls.append(kl)
        out.append((a if task_reward else 0.0) + (-coef * kl if m else 0.0))
    return torch.tensor(out, dtype=torch.float64), torch.tensor(kls, dtype=torch.float64)


def _inputs(num_tokens: int):
    adv = torch.randn(num_tokens)
    student = -torch.rand(num_tokens) * 6
    teacher = -torch.rand(num_tokens) * 6
    mask = torch.rand(num_tokens) < 0.7
    return adv, student, teacher, mask


@pytest.mark.parametrize("task_reward", [True, False])
@pytest.mark.parametrize("num_tokens,coef", [(1, 1.0), (123, 0.3), (1003, 2.5)])
def test_matches_the_float64_reference(fresh_seed, num_tokens, coef, task_reward):
    adv, student, teacher, mask = _inputs(num_tokens)
    out, kl = distill_advantages(adv, student, teacher, mask, coef, task_reward)
    want, want_kl = _reference(adv, student, teacher, mask, coef, task_reward)
    assert out.dtype == kl.dtype == torch.float32 and out.shape == kl.shape == (num_tokens,)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kl.double(), want_kl, rtol=1e-6, atol=1e-6)
    assert (kl[~mask] == 0).all()


def test_teacher_equal_to_student_gives_exactly_zero(fresh_seed):
    adv, student, _, mask = _inputs(257)
    out, kl = distill_advantages(adv, student, student.clone(), mask, 0.7, task_reward=True)
    assert (kl == 0).all() and torch.equal(out, adv)
    out, kl = distill_advantages(adv, student, student.clone(), mask, 0.7, task_reward=False)
    assert (kl == 0).all() and (out == 0).all()


def test_the_signal_favours_tokens_the_teacher_prefers():
    adv = torch.zeros(3)
    student = torch.tensor([-2.0, -1.0, -1.0])
    teacher = torch.tensor([-1.0, -2.0, -1.0])  # likelier, less likely, the same
    out, kl = distill_advantages(adv, student, teacher, torch.ones(3, dtype=torch.bool), 0.5)
    assert out.tolist() == [0.5, -0.5, 0.0] and kl.tolist() == [-1.0, 1.0, 0.0]


def test_inputs_are_detached():
    student = torch.full((4,), -1.0, requires_grad=True)
    out, kl = distill_advantages(
        torch.zeros(4), student, torch.full((4,), -2.0), torch.ones(4, dtype=torch.bool), 1.0
    )
    assert not out.requires_grad and not kl.requires_grad


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(coef=0.0), "coef = 0.0 must be a finite number > 0"),
        (dict(coef=float("nan")), "coef = nan"),
        (dict(coef=True), "coef = True"),
        (dict(teacher_logprobs=torch.zeros(5)), "teacher_logprobs must be [T=4], got (5,)"),
        (dict(loss_mask=torch.ones(4)), "loss_mask must be bool"),
    ],
)
def test_bad_inputs_are_refused(kwargs, needle):
    args = dict(
        advantages=torch.zeros(4),
        student_logprobs=torch.zeros(4),
        teacher_logprobs=torch.zeros(4),
        loss_mask=torch.ones(4, dtype=torch.bool),
        coef=1.0,
    )
    args.update(kwargs)
    with pytest.raises(ValueError) as info:
        distill_advantages(**args)
    assert needle in str(info.value)
