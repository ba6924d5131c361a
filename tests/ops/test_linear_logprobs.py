"""linear_logprobs against a float64 reference that materialises the logits."""

import pytest
import torch

from areal_fast.ops import logprobs as lp_mod
from areal_fast.ops.logprobs import linear_logprobs


def _reference(hidden, weight, labels, temperature, bias):
    h, w = hidden.double(), weight.double()
    z = h @ w.t()
    if bias is not None:
        z = z + bias.double()
    logp = torch.log_softmax(z / temperature, dim=-1)
    valid = labels != -100
    picked = logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, picked, 0.0), torch.where(valid, ent, 0.0)


CASES = [  # (T, H, V, dtype, rtol)
    (37, 16, 1003, torch.float32, 1e-5),
    (5, 123, 123, torch.float32, 1e-5),
    (64, 32, 4099, torch.bfloat16, 2e-2),
    (1, 8, 17, torch.float32, 1e-5),
]


@pytest.mark.parametrize("T,H,V,dtype,rtol", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("small_chunks", [False, True])
def test_values_and_grads_match_float64(T, H, V, dtype, rtol, with_bias, small_chunks,
                                        fresh_seed, monkeypatch):
    if small_chunks:  # force several chunks, the last one ragged
        monkeypatch.setattr(lp_mod, "_CHUNK_BYTES", 4 * V * 3)
    hidden = (torch.randn(T, H) * 2).to(dtype).requires_grad_()
    weight = (torch.randn(V, H) / H**0.5).to(dtype).requires_grad_()
    bias = torch.randn(V).to(dtype).requires_grad_() if with_bias else None
    labels = torch.randint(0, V, (T,))
    labels[torch.rand(T) < 0.25] = -100
    temperature = 0.7
    g_lp, g_ent = torch.randn(T), torch.randn(T)  # per-token upstream gradients

    logp, ent = linear_logprobs(hidden, weight, labels, temperature=temperature,
                                return_entropy=True, bias=bias)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    ((logp * g_lp).sum() + (ent * g_ent).sum()).backward()
    got = [hidden.grad, weight.grad] + ([bias.grad] if with_bias else [])
    leaves = [hidden, weight] + ([bias] if with_bias else [])

    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_lp, ref_ent = _reference(ref_leaves[0], ref_leaves[1], labels, temperature,
                                 ref_leaves[2] if with_bias else None)
    ((ref_lp * g_lp.double()).sum() + (ref_ent * g_ent.double()).sum()).backward()

    def close(a, b, name):
        scale = b.abs().max().clamp(min=1.0)
        err = (a.double() - b).abs().max() / scale
        assert err <= rtol, f"{name}: rel err {err:.2e} > {rtol} (seed {fresh_seed})"

    close(logp, ref_lp, "logprobs")
    close(ent, ref_ent, "entropy")
    for name, g, r in zip(["hidden", "weight", "bias"], got, ref_leaves):
        close(g, r.grad, f"grad {name}")
    ignored = labels == -100
    assert torch.all(logp[ignored] == 0) and torch.all(ent[ignored] == 0)
    assert torch.all(hidden.grad[ignored] == 0)


def test_confident_rows_keep_true_class_gradient(fresh_seed):
    """Target probability ≥ 0.999: the gradient p − 1 must stay accurate."""
    T, H, V = 16, 64, 257
    hidden = torch.randn(T, H)
    weight = torch.randn(V, H) * 0.01
    labels = torch.randperm(V)[:T]
    # label logit = 14 exactly, others ≈ 0 (±2 for other tokens' label rows): p ≈ 0.9995
    weight[labels] = hidden * 14.0 / (hidden**2).sum(1, keepdim=True)
    hidden.requires_grad_()
    weight.requires_grad_()
    logp = linear_logprobs(hidden, weight, labels)
    assert torch.all(logp.exp() > 0.999)
    logp.sum().backward()
    ref_h = hidden.detach().double().requires_grad_()
    ref_lp, _ = _reference(ref_h, weight.detach().double(), labels, 1.0, None)
    ref_lp.sum().backward()
    err = (hidden.grad.double() - ref_h.grad).abs().max() / ref_h.grad.abs().max()
    assert err < 1e-3, f"relative gradient error {err:.2e} (seed {fresh_seed})"


def test_all_ignored_gives_zero_and_intact_graph():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    labels = torch.full((4,), -100)
    logp, ent = linear_logprobs(hidden, weight, labels, return_entropy=True)
    (logp.sum() + ent.sum()).backward()
    assert torch.all(logp == 0) and torch.all(hidden.grad == 0) and torch.all(weight.grad == 0)


def test_large_offset_is_stable(fresh_seed):
    hidden = torch.randn(9, 8)
    weight = torch.randn(31, 8)
    bias = torch.full((31,), 1e4)
    labels = torch.randint(0, 31, (9,))
    logp = linear_logprobs(hidden, weight, labels, bias=bias)
    ref, _ = _reference(hidden, weight, labels, 1.0, None)  # softmax is shift-invariant
    assert torch.isfinite(logp).all()
    assert torch.allclose(logp.double(), ref, atol=2e-3)


def test_custom_ignore_index(fresh_seed):
    hidden, weight = torch.randn(5, 8), torch.randn(13, 8)
    labels = torch.tensor([3, -1, 7, -1, 0])
    logp = linear_logprobs(hidden, weight, labels, ignore_index=-1)
    ref, _ = _reference(hidden, weight, torch.where(labels == -1, -100, labels), 1.0, None)
    assert torch.allclose(logp.double(), ref, atol=1e-5) and logp[1] == 0


def test_no_grad_path_matches():
    hidden, weight = torch.randn(6, 8), torch.randn(13, 8)
    labels = torch.randint(0, 13, (6,))
    with torch.no_grad():
        logp = linear_logprobs(hidden, weight, labels)
    assert torch.allclose(logp.double(), _reference(hidden, weight, labels, 1.0, None)[0],
                          atol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden=torch.randn(2, 3, 4)), "hidden"),
    (dict(weight=torch.randn(7, 5)), "weight"),
    (dict(labels=torch.zeros(3, dtype=torch.int64)), "labels"),
    (dict(labels=torch.zeros(4, dtype=torch.int32)), "labels"),
    (dict(labels=torch.full((4,), 7)), "labels"),
    (dict(temperature=0.0), "temperature"),
    (dict(bias=torch.randn(3)), "bias"),
])
def test_bad_input_names_the_tensor(kwargs, match):
    args = dict(hidden=torch.randn(4, 6), weight=torch.randn(7, 6),
                labels=torch.zeros(4, dtype=torch.int64), temperature=1.0, bias=None)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        linear_logprobs(args["hidden"], args["weight"], args["labels"],
                        temperature=args["temperature"], bias=args["bias"])
