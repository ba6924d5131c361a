"""CUDA only: the compiled Triton paths of linear_logprobs and fused_linear_grpo_loss at the
shapes where index arithmetic and launch grids break first.

- T·V > 2³¹ logits (T = 16384, V = 151936, small H): 32-bit row offsets would wrap. Checked
  against a chunked float32 reference on every row (log-probs, entropy, the loss, gradients of
  hidden and weight) and a float64 reference on a few rows at both ends.
- One sequence of T = 70 000 tokens with small H and V: a [T, V] chunk is a single launch of
  70 000 row programs, past the 65 535 that grid axes 1 and 2 allow (axis 0 allows 2³¹ − 1);
  checked against float64 autograd through materialised logits, for the row kernels alone,
  for linear_logprobs and for the fused loss.
"""

from __future__ import annotations

import os

import pytest
import torch

from areal_fast.ops.logprobs import linear_logprobs
from areal_fast.rl.config import LossConfig
from areal_fast.rl.fused_loss import fused_linear_grpo_loss
from areal_fast.rl.objectives import grpo_loss

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BIG = (16384, 64, 151936)  # T, H, V: 2.49e9 logits
LONG = (70_000, 32, 128)  # T, H, V: one launch of 70 000 row programs
GRID_YZ_LIMIT = 65_535


@pytest.fixture
def compiled():
    """The Triton kernel modules, compiled for the GPU (skip when interpreted)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: these shapes need the compiled kernels")
    from areal_fast.kernels import grpo_loss as loss_kernels
    from areal_fast.kernels import linear_logprobs as row_kernels

    for fn in (row_kernels._linear_logprobs_fwd_kernel, loss_kernels._grpo_token_loss_kernel):
        if type(fn).__name__ == "InterpretedFunction":
            pytest.skip("the Triton kernels were built for the interpreter in this process")
    return row_kernels


def _norm_err(got, ref) -> float:
    """‖got − ref‖ / ‖ref‖ in float64."""
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).norm() / ref.norm().clamp(min=1e-30))


def _max_err(got, ref) -> float:
    """max |got − ref| / max(max |ref|, 1) in float64."""
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max().clamp(min=1.0))


def _inputs(T, H, V, dtype=torch.bfloat16):
    hidden = torch.randn(T, H, device="cuda").to(dtype).requires_grad_()
    weight = (torch.randn(V, H, device="cuda") / H**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (T,), device="cuda")
    return hidden, weight, labels


def _chunked_reference(hidden, weight, labels, g_lp, g_ent, chunk=1024):
    """float32 log-probs, entropy and the gradients of Σ g_lp·logp + g_ent·entropy w.r.t.
    hidden and weight (inputs upcast), 1024 tokens at a time: no [T, V] tensor."""
    w = weight.detach().float()
    T = hidden.shape[0]
    f32 = dict(device=hidden.device, dtype=torch.float32)
    logp, ent = torch.empty(T, **f32), torch.empty(T, **f32)
    grad_h = torch.empty(hidden.shape, **f32)
    grad_w = torch.zeros(weight.shape, **f32)
    for s in range(0, T, chunk):
        sl = slice(s, min(s + chunk, T))
        h = hidden[sl].detach().float()
        y = labels[sl][:, None]
        lsm = torch.log_softmax(h @ w.t(), dim=-1)
        p = lsm.exp()
        logp[sl] = lsm.gather(1, y).squeeze(1)
        ent[sl] = -(p * lsm).sum(1)
        gl = g_lp[sl].float()[:, None]
        grad_z = -p * gl
        grad_z.scatter_add_(1, y, gl)  # d logp_y / dz = onehot(y) − p
        if g_ent is not None:  # dH / dz = −p ⊙ (log p + H)
            grad_z -= g_ent[sl].float()[:, None] * p * (lsm + ent[sl][:, None])
        grad_h[sl] = grad_z @ w
        grad_w += grad_z.t() @ h
        del lsm, p, grad_z
    return logp, ent, grad_h, grad_w


def _rows_float64(hidden, weight, labels, rows):
    """float64 log-probs and entropy of a few rows."""
    lsm = torch.log_softmax(hidden[rows].detach().double() @ weight.detach().double().t(), -1)
    return lsm.gather(1, labels[rows][:, None]).squeeze(1), -(lsm.exp() * lsm).sum(1)


def test_linear_logprobs_beyond_2_to_31_logits(compiled, fresh_seed):
    T, H, V = BIG
    assert T * V > 2**31
    hidden, weight, labels = _inputs(T, H, V)
    g_lp, g_ent = torch.randn(T, device="cuda"), torch.randn(T, device="cuda")
    logp, ent = linear_logprobs(hidden, weight, labels, return_entropy=True, impl="triton")
    ((logp * g_lp).sum() + (ent * g_ent).sum()).backward()
    ref_lp, ref_ent, ref_gh, ref_gw = _chunked_reference(hidden, weight, labels, g_lp, g_ent)
    assert _max_err(logp, ref_lp) < 1e-4
    assert _max_err(ent, ref_ent) < 1e-4
    assert _norm_err(hidden.grad, ref_gh) < 1e-2
    assert _norm_err(weight.grad, ref_gw) < 1e-2
    tail = (T - 1) * V  # offset of the last row's first logit in a [T, V] layout
    assert tail > 2**31
    rows = torch.cat([torch.arange(4), torch.arange(T - 8, T)]).cuda()
    lp64, ent64 = _rows_float64(hidden, weight, labels, rows)
    assert _max_err(logp[rows], lp64) < 1e-4
    assert _max_err(ent[rows], ent64) < 1e-4


def test_fused_loss_beyond_2_to_31_logits(compiled, fresh_seed):
    T, H, V = BIG
    B = 8
    hidden, weight, labels = _inputs(T, H, V)
    cu = torch.arange(0, T + 1, T // B, dtype=torch.int32, device="cuda")
    mask = torch.rand(T, device="cuda") < 0.9
    adv = torch.randn(B, device="cuda")
    config = LossConfig(entropy_coef=0.01)
    zeros = torch.zeros(T, device="cuda")
    ref_lp0, ref_ent0, _, _ = _chunked_reference(hidden, weight, labels, zeros, None)
    old = (ref_lp0 + 0.1 * torch.randn(T, device="cuda")).contiguous()
    loss, _ = fused_linear_grpo_loss(
        hidden, weight, labels, old, adv, mask, cu, config, impl="triton"
    )
    loss.backward()

    # the composed reference: float64 loss of the float32 reference log-probs and entropy,
    # its gradient w.r.t. them, chained through the LM head chunk by chunk
    lp_leaf = ref_lp0.double().requires_grad_()
    ent_leaf = ref_ent0.double().requires_grad_()
    ref_loss, _ = grpo_loss(lp_leaf, old.double(), adv.double(), mask, cu, config, entropy=ent_leaf)
    g_lp, g_ent = torch.autograd.grad(ref_loss, (lp_leaf, ent_leaf))
    _, _, ref_gh, ref_gw = _chunked_reference(hidden, weight, labels, g_lp, g_ent)
    assert abs(float(loss) - float(ref_loss)) < 1e-4 * (1.0 + abs(float(ref_loss)))
    assert _norm_err(hidden.grad, ref_gh) < 1e-2
    assert _norm_err(weight.grad, ref_gw) < 1e-2
    assert float(hidden.grad[~mask].abs().max()) == 0.0  # untrained tokens: no gradient


def _float64_autograd(hidden, weight, labels):
    """float64 leaves and their log-probs / entropy through materialised logits."""
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    lsm = torch.log_softmax(h64 @ w64.t(), dim=-1)
    logp = lsm.gather(1, labels[:, None]).squeeze(1)
    ent = -(lsm.exp() * lsm).sum(1)
    return h64, w64, logp, ent


def test_row_kernels_one_launch_past_grid_axis_limit(compiled, fresh_seed):
    T, _, V = LONG
    assert T > GRID_YZ_LIMIT
    z = torch.randn(T, V, device="cuda") * 3
    labels = torch.randint(0, V, (T,), device="cuda")
    labels[::7] = -100
    f32 = dict(device="cuda", dtype=torch.float32)
    logp, ent, lse = (torch.full((T,), float("nan"), **f32) for _ in range(3))
    compiled.rows_forward(z, labels, 1.0, -100, logp, ent, lse)
    valid = labels != -100
    lsm = torch.log_softmax(z.double(), -1)
    safe = torch.where(valid, labels, 0)[:, None]
    ref_lp = torch.where(valid, lsm.gather(1, safe).squeeze(1), 0.0)
    ref_ent = torch.where(valid, -(lsm.exp() * lsm).sum(1), 0.0)
    assert _max_err(logp, ref_lp) < 1e-5
    assert _max_err(ent, ref_ent) < 1e-5
    assert _max_err(lse, torch.logsumexp(z.double(), -1)) < 1e-5

    g = torch.randn(T, **f32)
    grad = z.clone()
    compiled.rows_backward_(grad, labels, lse, None, g, None, 1.0, -100)
    p = lsm.exp()
    ref = -p * g.double()[:, None]
    ref.scatter_add_(1, safe, g.double()[:, None])
    ref[~valid] = 0.0
    assert _max_err(grad, ref) < 1e-5


def test_linear_logprobs_long_sequence(compiled, fresh_seed):
    T, H, V = LONG
    hidden, weight, labels = _inputs(T, H, V, dtype=torch.float32)
    g_lp, g_ent = torch.randn(T, device="cuda"), torch.randn(T, device="cuda")
    logp, ent = linear_logprobs(hidden, weight, labels, return_entropy=True, impl="triton")
    ((logp * g_lp).sum() + (ent * g_ent).sum()).backward()
    h64, w64, ref_lp, ref_ent = _float64_autograd(hidden, weight, labels)
    ((ref_lp * g_lp.double()).sum() + (ref_ent * g_ent.double()).sum()).backward()
    assert _max_err(logp, ref_lp) < 1e-5
    assert _max_err(ent, ref_ent) < 1e-5
    # fp32 GEMMs may run as tf32 where a build enables it: a looser bound for the gradients
    assert _norm_err(hidden.grad, h64.grad) < 1e-3
    assert _norm_err(weight.grad, w64.grad) < 1e-3


def test_fused_loss_long_sequence(compiled, fresh_seed):
    T, H, V = LONG
    hidden, weight, labels = _inputs(T, H, V, dtype=torch.float32)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    mask = torch.ones(T, dtype=torch.bool, device="cuda")
    mask[:1000] = False  # the prompt
    mask[-1] = False
    adv = torch.randn(1, device="cuda")
    config = LossConfig(entropy_coef=0.01)
    h64, w64, ref_lp, ref_ent = _float64_autograd(hidden, weight, labels)
    old = (ref_lp.detach().float() + 0.1 * torch.randn(T, device="cuda")).contiguous()
    loss, _ = fused_linear_grpo_loss(
        hidden, weight, labels, old, adv, mask, cu, config, impl="triton"
    )
    loss.backward()
    ref_loss, _ = grpo_loss(ref_lp, old.double(), adv.double(), mask, cu, config, entropy=ref_ent)
    ref_loss.backward()
    assert abs(float(loss) - float(ref_loss)) < 1e-4 * (1.0 + abs(float(ref_loss)))
    assert _norm_err(hidden.grad, h64.grad) < 1e-3
    assert _norm_err(weight.grad, w64.grad) < 1e-3
