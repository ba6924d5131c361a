"""linear_logprobs, every implementation, against a float64 reference that materialises logits."""

import pytest
import torch
from conftest import available_impls, cuda_when_present, impl_device, impl_params

from areal_fast.ops import logprobs as lp_mod
from areal_fast.ops import logprobs_tiled
from areal_fast.ops.logprobs import linear_logprobs

IMPLS = available_impls()


def _reference(hidden, weight, labels, temperature, bias, ignore_index=-100):
    """float64 log-probs and entropy of the tempered distribution (zeros where ignored)."""
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    logp = torch.log_softmax(z / temperature, dim=-1)
    valid = labels != ignore_index
    picked = logp.gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1)
    plogp = logp.exp() * torch.where(torch.isfinite(logp), logp, 0.0)  # 0·(−inf) → 0
    return torch.where(valid, picked, 0.0), torch.where(valid, -plogp.sum(-1), 0.0)


def _rel_err(got, ref):
    """Max abs error normalised by the reference's max abs (at least 1)."""
    got, ref = got.detach().double(), ref.detach()
    return float((got - ref).abs().max() / ref.abs().max().clamp(min=1.0))


def _run(impl, hidden, weight, labels, bias=None, temperature=1.0, g_lp=None, g_ent=None, **kwargs):
    """Forward (logprobs, entropy) and, with upstream grads, the backward; CPU results."""
    device = impl_device(impl)
    leaves = [t.detach().to(device).requires_grad_() for t in (hidden, weight)]
    if bias is not None:
        leaves.append(bias.detach().to(device).requires_grad_())
    logp, ent = linear_logprobs(
        leaves[0],
        leaves[1],
        labels.to(device),
        temperature=temperature,
        return_entropy=True,
        bias=leaves[2] if bias is not None else None,
        impl=impl,
        **kwargs,
    )
    grads = None
    if g_lp is not None:
        ((logp * g_lp.to(device)).sum() + (ent * g_ent.to(device)).sum()).backward()
        grads = [leaf.grad.cpu() for leaf in leaves]
    return logp.cpu(), ent.cpu(), grads


CASES = [  # (T, H, V, dtype, rtol)
    (37, 16, 1003, torch.float32, 1e-5),
    (5, 123, 123, torch.float32, 1e-5),
    (64, 32, 4099, torch.bfloat16, 1e-2),
    (1, 8, 17, torch.float32, 1e-5),
]


@pytest.mark.parametrize("impl", impl_params(IMPLS))
@pytest.mark.parametrize("T,H,V,dtype,rtol", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("small_chunks", [False, True])
def test_values_and_grads_match_float64(
    impl, T, H, V, dtype, rtol, with_bias, small_chunks, fresh_seed, monkeypatch
):
    if small_chunks:  # several chunks, the last one ragged
        monkeypatch.setattr(lp_mod, "_CHUNK_BYTES", 4 * V * 3)
        monkeypatch.setattr(lp_mod, "_MIN_CHUNK_ROWS", 1)
        monkeypatch.setattr(logprobs_tiled, "_TILED_ROWS", 16)
        monkeypatch.setattr(logprobs_tiled, "_MIN_TILE", 100)
    hidden = (torch.randn(T, H) * 2).to(dtype)
    weight = (torch.randn(V, H) / H**0.5).to(dtype)
    bias = torch.randn(V).to(dtype) if with_bias else None
    labels = torch.randint(0, V, (T,))
    labels[torch.rand(T) < 0.25] = -100
    temperature = 0.7
    g_lp, g_ent = torch.randn(T), torch.randn(T)  # per-token upstream gradients

    logp, ent, grads = _run(impl, hidden, weight, labels, bias, temperature, g_lp, g_ent)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32

    ref_leaves = [t.double().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    ref_lp, ref_ent = _reference(
        ref_leaves[0], ref_leaves[1], labels, temperature, ref_leaves[2] if with_bias else None
    )
    ((ref_lp * g_lp.double()).sum() + (ref_ent * g_ent.double()).sum()).backward()

    for name, got, ref in [("logprobs", logp, ref_lp), ("entropy", ent, ref_ent)] + [
        (f"grad {n}", g, r.grad) for n, g, r in zip(["hidden", "weight", "bias"], grads, ref_leaves)
    ]:
        err = _rel_err(got, ref)
        assert err <= rtol, f"{impl} {name}: rel err {err:.2e} > {rtol} (seed {fresh_seed})"
    ignored = labels == -100
    assert torch.all(logp[ignored] == 0) and torch.all(ent[ignored] == 0)
    assert torch.all(grads[0][ignored] == 0)


@pytest.mark.parametrize("impl", impl_params(IMPLS))
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 3e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("with_entropy", [0.0, 1.0])
def test_confident_rows_keep_true_class_gradient(impl, dtype, rtol, with_entropy, fresh_seed):
    """Target probability ≥ 0.999: the true-class gradient p − 1 must stay accurate."""
    T, H, V = 16, 256, 257
    hidden = torch.randn(T, H).to(dtype)
    labels = torch.randperm(V)[:T]
    weight = torch.randn(V, H) * 0.01
    # label logit ≈ 14, others ≈ 0 (std ≈ 0.9): 1 − p_y ≈ 2e-4
    h64 = hidden.double()
    weight[labels] = (h64 * 14.0 / (h64**2).sum(1, keepdim=True)).float()
    weight = weight.to(dtype)
    g_lp, g_ent = torch.randn(T), torch.randn(T) * with_entropy
    logp, ent, grads = _run(impl, hidden, weight, labels, g_lp=g_lp, g_ent=g_ent)
    assert torch.all(logp.exp() > 0.999)
    # the logit gradient at the label is g·(1 − p_y) (+ the entropy term): check it through
    # the hidden and weight gradients
    ref_h = hidden.double().requires_grad_()
    ref_w = weight.double().requires_grad_()
    ref_lp, ref_ent = _reference(ref_h, ref_w, labels, 1.0, None)
    ((ref_lp * g_lp.double()).sum() + (ref_ent * g_ent.double()).sum()).backward()
    # log-probs ≈ −2e-4 and entropies keep their relative accuracy (log1p of the rest)
    for name, got, ref in (("logprobs", logp, ref_lp), ("entropy", ent, ref_ent)):
        rel = float(((got.double() - ref.detach()) / ref.detach()).abs().max())
        assert rel < rtol, f"{impl} {name}: per-element rel err {rel:.2e} (seed {fresh_seed})"
    for name, got, ref in (("hidden", grads[0], ref_h.grad), ("weight", grads[1], ref_w.grad)):
        err = float((got.double() - ref).abs().max() / ref.abs().max())
        assert err < rtol, f"{impl} grad {name}: rel err {err:.2e} (seed {fresh_seed})"
    # rows of the label entries of the weight gradient are the true-class terms
    label_rows = (grads[1][labels].double() - ref_w.grad[labels]).abs().max()
    assert label_rows / ref_w.grad[labels].abs().max() < rtol


@pytest.mark.parametrize("impl", impl_params(IMPLS))
def test_masked_vocabulary_gives_finite_entropy_and_grads(impl, fresh_seed):
    """Logits of −inf (a masked vocabulary, via the bias) must not produce NaN."""
    T, H, V = 12, 16, 300
    hidden, weight = torch.randn(T, H), torch.randn(V, H) / 4
    bias = torch.zeros(V)
    bias[torch.randperm(V)[:100]] = float("-inf")
    allowed = torch.nonzero(torch.isfinite(bias)).squeeze(1)
    labels = allowed[torch.randint(0, allowed.numel(), (T,))]
    g_lp, g_ent = torch.randn(T), torch.randn(T)
    logp, ent, grads = _run(impl, hidden, weight, labels, bias, 1.3, g_lp, g_ent)
    for t in [logp, ent] + grads:
        assert torch.isfinite(t).all()
    ref_leaves = [t.double().requires_grad_() for t in (hidden, weight)]
    ref_lp, ref_ent = _reference(ref_leaves[0], ref_leaves[1], labels, 1.3, bias.double())
    ((ref_lp * g_lp.double()).sum() + (ref_ent * g_ent.double()).sum()).backward()
    assert _rel_err(logp, ref_lp) < 1e-5 and _rel_err(ent, ref_ent) < 1e-5
    assert _rel_err(grads[0], ref_leaves[0].grad) < 1e-5
    assert _rel_err(grads[1], ref_leaves[1].grad) < 1e-5
    assert torch.all(grads[2][~torch.isfinite(bias)] == 0)


@pytest.mark.parametrize("impl", impl_params(IMPLS))
def test_all_ignored_gives_zero_and_intact_graph(impl):
    hidden, weight = torch.randn(4, 8), torch.randn(11, 8)
    labels = torch.full((4,), -100)
    logp, ent, grads = _run(impl, hidden, weight, labels, g_lp=torch.randn(4), g_ent=torch.randn(4))
    assert torch.all(logp == 0) and torch.all(ent == 0)
    assert torch.all(grads[0] == 0) and torch.all(grads[1] == 0)


@pytest.mark.parametrize("impl", impl_params(IMPLS))
def test_large_common_offset_is_stable(impl, fresh_seed):
    """+1e4 on every logit: softmax is shift-invariant, so results match the unshifted ones
    up to the fp32 rounding of logits near 1e4 (ulp ≈ 1e-3)."""
    T, H, V = 9, 8, 31
    hidden, weight = torch.randn(T, H), torch.randn(V, H)
    labels = torch.randint(0, V, (T,))
    logp, ent, grads = _run(
        impl,
        hidden,
        weight,
        labels,
        torch.full((V,), 1e4),
        g_lp=torch.randn(T),
        g_ent=torch.randn(T),
    )
    ref_lp, ref_ent = _reference(hidden, weight, labels, 1.0, None)
    for t in [logp, ent] + grads:
        assert torch.isfinite(t).all()
    assert (logp.double() - ref_lp).abs().max() < 5e-3
    assert (ent.double() - ref_ent).abs().max() < 5e-3


@pytest.mark.parametrize("impl", impl_params(IMPLS))
def test_temperature_applies_to_logprobs_and_entropy(impl, fresh_seed):
    T, H, V = 7, 8, 50
    hidden, weight = torch.randn(T, H), torch.randn(V, H)
    labels = torch.randint(0, V, (T,))
    for temperature in (0.5, 2.0):
        logp, ent, _ = _run(impl, hidden, weight, labels, temperature=temperature)
        # same as temperature 1 on logits scaled by 1/temperature
        ref_lp, ref_ent = _reference(hidden / temperature, weight, labels, 1.0, None)
        assert _rel_err(logp, ref_lp) < 1e-5 and _rel_err(ent, ref_ent) < 1e-5
    plain, _, _ = _run(impl, hidden, weight, labels)
    assert (plain - logp).abs().max() > 1e-2  # temperature really changed the values


@pytest.mark.parametrize("impl", impl_params(IMPLS))
def test_custom_ignore_index(impl, fresh_seed):
    hidden, weight = torch.randn(5, 8), torch.randn(13, 8)
    labels = torch.tensor([3, -1, 7, -1, 0])
    logp, _, _ = _run(impl, hidden, weight, labels, ignore_index=-1)
    ref, _ = _reference(hidden, weight, labels, 1.0, None, ignore_index=-1)
    assert _rel_err(logp, ref) < 1e-5 and logp[1] == 0


def test_no_grad_path_matches(fresh_seed):
    hidden, weight = torch.randn(6, 8), torch.randn(13, 8)
    labels = torch.randint(0, 13, (6,))
    with torch.no_grad():
        logp = linear_logprobs(hidden, weight, labels)
    assert not logp.requires_grad
    assert _rel_err(logp, _reference(hidden, weight, labels, 1.0, None)[0]) < 1e-5


@cuda_when_present
def test_impls_agree_and_env_var_forces_one(monkeypatch, fresh_seed):
    hidden, weight = torch.randn(20, 16), torch.randn(99, 16)
    labels = torch.randint(0, 99, (20,))
    results = {impl: _run(impl, hidden, weight, labels)[0] for impl in IMPLS}
    for impl, values in results.items():
        assert torch.allclose(values, results["torch"], atol=1e-5), impl
    monkeypatch.setenv("AREAL_FAST_IMPL", "bogus")
    with pytest.raises(ValueError, match="AREAL_FAST_IMPL"):
        linear_logprobs(hidden, weight, labels)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_more_than_2_to_31_logits_on_gpu(fresh_seed):
    """T·V > 2³¹: 32-bit index arithmetic would overflow in the kernels."""
    T, H, V = 16384, 64, 151936  # 2.49e9 logits
    hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(V, H, device="cuda") / 8).to(torch.bfloat16)
    labels = torch.randint(0, V, (T,), device="cuda")
    rows = torch.arange(T - 64, T, device="cuda")  # the tail, where offsets are largest
    logp = linear_logprobs(hidden, weight, labels)
    ref, _ = _reference(hidden[rows].cpu(), weight.cpu(), labels[rows].cpu(), 1.0, None)
    assert _rel_err(logp[rows].cpu(), ref) < 1e-2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(hidden=torch.randn(2, 3, 4)), "hidden must be"),
        (dict(hidden=torch.randint(0, 3, (4, 6))), "hidden must be"),
        (dict(weight=torch.randn(7, 5)), "weight must be"),
        (dict(weight=torch.randn(7, 6, dtype=torch.float64)), "weight must have"),
        (dict(labels=torch.zeros(3, dtype=torch.int64)), "labels must be"),
        (dict(labels=torch.zeros(4, dtype=torch.int32)), "labels must be int64"),
        (dict(labels=torch.full((4,), 7)), "labels hold values outside"),
        (dict(labels=torch.full((4,), -5)), "labels hold values outside"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(bias=torch.randn(3)), "bias must be"),
        (dict(impl="cuda-magic"), "impl"),
    ],
)
def test_bad_input_names_the_tensor(kwargs, match):
    args = dict(
        hidden=torch.randn(4, 6),
        weight=torch.randn(7, 6),
        labels=torch.zeros(4, dtype=torch.int64),
        temperature=1.0,
        bias=None,
        impl=None,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        linear_logprobs(
            args["hidden"],
            args["weight"],
            args["labels"],
            temperature=args["temperature"],
            bias=args["bias"],
            impl=args["impl"],
        )


def test_impl_is_checked_for_float64_too():
    hidden, weight = torch.randn(4, 6, dtype=torch.float64), torch.randn(7, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="impl"):
        linear_logprobs(hidden, weight, torch.zeros(4, dtype=torch.int64), impl="bogus")


@pytest.mark.parametrize("impl", impl_params(IMPLS))
def test_non_contiguous_labels(impl, fresh_seed):
    hidden, weight = torch.randn(10, 8), torch.randn(30, 8)
    labels = torch.randint(0, 30, (10, 3))[:, 1]  # stride 3
    logp, _, _ = _run(impl, hidden, weight, labels)
    assert _rel_err(logp, _reference(hidden, weight, labels, 1.0, None)[0]) < 1e-5


def test_label_range_check_can_be_skipped():
    """validate=False skips the host-synchronising range check (the GPU default)."""
    hidden, weight = torch.randn(4, 6), torch.randn(7, 6)
    labels = torch.tensor([0, 1, 2, 3])
    assert linear_logprobs(hidden, weight, labels, validate=False).shape == (4,)
