"""On-policy distillation: the teacher's per-token reverse KL as a per-token advantage."""

from __future__ import annotations

import math

import torch


def distill_advantages(
    advantages: torch.Tensor,
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    coef: float,
    task_reward: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages of on-policy distillation and the per-token reverse KL.

    The student samples y ~ π_student; the teacher scores the student's own tokens. The
    per-token reverse KL estimate (the single-sample k1 estimate of
    KL(π_student ‖ π_teacher) at token t)::

        kl_t     = log π_student(y_t) − log π_teacher(y_t)
        signal_t = −coef · kl_t = coef · (log π_teacher(y_t) − log π_student(y_t))
        A'_t     = A_t + signal_t     (task_reward True: added to the task advantages)
        A'_t     = signal_t           (task_reward False: distillation alone)

    With the policy-gradient loss, A' pushes up tokens the teacher finds likelier than the
    student does and down those it finds less likely; minimising the reverse KL on the
    student's own samples is mode-seeking and needs no teacher samples. The student
    log-probs are constants here (detached): the signal is a reward, not a loss term.
    Teacher = student gives kl_t = 0 and A' = A (or 0) exactly.

    Sources: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes" (GKD), ICLR 2024 (on-policy student samples, reverse KL);
    Lu & Thinking Machines Lab 2025, "On-Policy Distillation" (A_t = −(log π_student(y_t) −
    log π_teacher(y_t)) per token with the policy-gradient loss).

    Parameters
    ----------
    advantages : Tensor [T] float
        Task advantages per token (already normalised, e.g. GRPO's).
    student_logprobs : Tensor [T] float
        Log-prob of each sampled token under the student that sampled it (the behaviour
        log-probs).
    teacher_logprobs : Tensor [T] float
        Log-prob of the same tokens under the teacher, at the same temperature.
    loss_mask : Tensor [T] bool
        True on trained (completion) tokens; elsewhere kl_t = 0 and A'_t = A_t (or 0).
    coef : float
        Weight of the signal, finite and > 0.
    task_reward : bool
        Keep the task advantages (True) or replace them by the signal (False).

    Returns
    -------
    advantages : Tensor [T] float32
        A', detached.
    reverse_kl : Tensor [T] float32
        kl_t on trained tokens, 0 elsewhere, detached.

    Raises
    ------
    ValueError
        Tensors not all [T]; ``loss_mask`` not bool; ``coef`` not a finite number > 0.
    """
    named = dict(
        advantages=advantages,
        student_logprobs=student_logprobs,
        teacher_logprobs=teacher_logprobs,
        loss_mask=loss_mask,
    )
    for name, tensor in named.items():
        if tensor.shape != advantages.shape or tensor.dim() != 1:
            raise ValueError(f"{name} must be [T={len(advantages)}], got {tuple(tensor.shape)}")
    if loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be bool, got {loss_mask.dtype}")
    if isinstance(coef, bool) or not (coef > 0 and math.isfinite(coef)):
        raise ValueError(f"coef = {coef!r} must be a finite number > 0")
    student = student_logprobs.detach().float()
    teacher = teacher_logprobs.detach().to(student.device).float()
    reverse_kl = torch.where(loss_mask, student - teacher, 0.0)
    signal = -coef * reverse_kl
    base = advantages.detach().float()
    out = base + signal if task_reward else torch.where(loss_mask, signal, 0.0)
    return out, reverse_kl
