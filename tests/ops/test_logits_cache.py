"""Logits kept from the forward of linear_logprobs for its backward (AREAL_FAST_LOGITS_CACHE_MB):
the budget's parsing, how many blocks are kept and recomputed, and values and gradients against
float64 with the cache off, partly filled and holding every block."""

import pytest
import torch
from conftest import available_impls, impl_device, impl_params

from areal_fast.ops import logits_cache, logprobs_tiled
from areal_fast.ops import logprobs as lp_mod
from areal_fast.ops.logits_cache import CACHE_ENV, cache_budget_bytes
from areal_fast.ops.logprobs import linear_logprobs

IMPLS = available_impls()
MIB = 1 << 20


@pytest.mark.parametrize(
    "value,expected",
    [("0", 0), ("1", MIB), (" 2.5 ", int(2.5 * MIB)), ("1024", 1024 * MIB), ("", 2048 * MIB)],
)
def test_budget_parsing(monkeypatch, value, expected):
    monkeypatch.setenv(CACHE_ENV, value)
    assert cache_budget_bytes(torch.device("cpu")) == expected


def test_budget_defaults(monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert cache_budget_bytes(torch.device("cpu")) == 2048 * MIB
    assert cache_budget_bytes(torch.device("cuda")) == 0  # only the device type is read
    monkeypatch.setenv(CACHE_ENV, "64")
    assert cache_budget_bytes(torch.device("cuda")) == 64 * MIB


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf", "1e400", "12 MB"])
def test_bad_budget_is_a_one_line_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(CACHE_ENV, value)
    with pytest.raises(ValueError, match=CACHE_ENV) as info:
        cache_budget_bytes(torch.device("cpu"))
    assert "\n" not in str(info.value) and repr(value.strip()) in str(info.value)
    hidden, weight = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4)
    with pytest.raises(ValueError, match=CACHE_ENV):  # also through the public function
        linear_logprobs(hidden, weight, torch.tensor([0, 1, 2]))
    with torch.no_grad(), pytest.raises(ValueError, match=CACHE_ENV):
        linear_logprobs(hidden, weight, torch.tensor([0, 1, 2]))


def test_cache_keeps_blocks_while_they_fit():
    cache = logits_cache.LogitsCache(100 * 4)
    like = torch.empty(0)
    a = cache.new_block("a", 10, 8, like, torch.float32)  # 320 bytes
    assert a is not None and a.shape == (10, 8) and a.dtype == torch.float32
    assert cache.new_block("b", 10, 8, like, torch.float32) is None  # 640 > 400
    c = cache.new_block("c", 4, 5, like, torch.float32)  # 400: fits exactly
    assert c is not None and cache.kept_bytes == 400 and len(cache) == 2
    assert cache.pop("a") is a and cache.pop("a") is None and len(cache) == 1
    assert logits_cache.new_cache(0) is None


def _small_blocks(monkeypatch):
    """Several chunks (the last one ragged) and, on the CPU path, several vocabulary tiles."""
    monkeypatch.setattr(lp_mod, "_CHUNK_BYTES", 4 * 4099 * 3)
    monkeypatch.setattr(lp_mod, "_MIN_CHUNK_ROWS", 1)
    monkeypatch.setattr(logprobs_tiled, "_TILED_ROWS", 16)
    monkeypatch.setattr(logprobs_tiled, "_MIN_TILE", 100)


def _count_logits(monkeypatch):
    """Counts of logits blocks formed by a matmul, by whether grad mode was on (forward) or off
    (the backward runs with grad mode off, and so does the forward under no_grad)."""
    counts = {"formed": 0}
    for module, name in ((logprobs_tiled, "_tile_logits"), (lp_mod, "_chunk_logits")):
        original = getattr(module, name)

        def counted(*args, _original=original, **kwargs):
            counts["formed"] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return counts


def _reference(hidden, weight, bias, labels, temperature, g_lp, g_ent):
    leaves = [t.double().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    z = leaves[0] @ leaves[1].t()
    if bias is not None:
        z = z + leaves[2]
    logp = torch.log_softmax(z / temperature, dim=-1)
    valid = labels != -100
    picked = logp.gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    lp_ref, ent_ref = torch.where(valid, picked, 0.0), torch.where(valid, ent, 0.0)
    ((lp_ref * g_lp.double()).sum() + (ent_ref * g_ent.double()).sum()).backward()
    return lp_ref.detach(), ent_ref.detach(), [leaf.grad for leaf in leaves]


def _rel_err(got, ref):
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1.0))


def _forward_backward(impl, hidden, weight, bias, labels, temperature, g_lp, g_ent):
    device = impl_device(impl)
    leaves = [
        t.detach().to(device).requires_grad_() for t in (hidden, weight, bias) if t is not None
    ]
    logp, ent = linear_logprobs(
        leaves[0],
        leaves[1],
        labels.to(device),
        temperature=temperature,
        return_entropy=True,
        bias=leaves[2] if bias is not None else None,
        impl=impl,
    )
    ((logp * g_lp.to(device)).sum() + (ent * g_ent.to(device)).sum()).backward()
    return logp.detach().cpu(), ent.detach().cpu(), [leaf.grad.cpu() for leaf in leaves]


def _num_blocks(impl, T, V):
    """Logits blocks one call forms with _small_blocks in place."""
    if impl == "native":
        rows, tile = logprobs_tiled.tile_shape(T, V, lp_mod._CHUNK_BYTES)
        return -(-T // rows) * -(-V // tile)
    return -(-T // lp_mod._chunk_size(T, V))


@pytest.mark.parametrize("impl", impl_params(IMPLS))
@pytest.mark.parametrize("mode", ["off", "partial", "full"])
@pytest.mark.parametrize(
    "T,H,V,with_bias", [(37, 16, 1003, False), (45, 23, 777, True), (1, 8, 17, True)]
)
def test_values_and_grads_match_float64_with_the_cache(
    impl, mode, T, H, V, with_bias, fresh_seed, monkeypatch
):
    _small_blocks(monkeypatch)
    hidden = torch.randn(T, H) * 2
    weight = torch.randn(V, H) / H**0.5
    bias = torch.randn(V) if with_bias else None
    labels = torch.randint(0, V, (T,))
    labels[torch.rand(T) < 0.2] = -100
    labels[0] = V - 1  # the last column (the ragged tile)
    kept_tokens = int((labels != -100).sum())
    blocks = _num_blocks(impl, kept_tokens, V)
    # half of all logits: with two blocks or more, some are kept and some are not
    budget = {"off": 0.0, "partial": 4 * V * kept_tokens / MIB / 2, "full": 1024.0}[mode]
    monkeypatch.setenv(CACHE_ENV, repr(budget))
    g_lp, g_ent = torch.randn(T), torch.randn(T)
    counts = _count_logits(monkeypatch)

    logp, ent, grads = _forward_backward(impl, hidden, weight, bias, labels, 0.8, g_lp, g_ent)

    recomputed = counts["formed"] - blocks
    if mode == "off" or blocks == 1 and mode == "partial":
        assert recomputed == blocks
    elif mode == "full":
        assert recomputed == 0
    else:
        assert 0 < recomputed < blocks, (recomputed, blocks)
    ref_lp, ref_ent, ref_grads = _reference(hidden, weight, bias, labels, 0.8, g_lp, g_ent)
    for name, got, ref in [("logprobs", logp, ref_lp), ("entropy", ent, ref_ent)] + [
        (f"grad {n}", g, r) for n, g, r in zip(["hidden", "weight", "bias"], grads, ref_grads)
    ]:
        err = _rel_err(got, ref)
        assert err <= 1e-5, f"{impl} {mode} {name}: rel err {err:.2e} (seed {fresh_seed})"
    ignored = labels == -100
    assert torch.all(logp[ignored] == 0) and torch.all(grads[0][ignored] == 0)


@pytest.mark.parametrize("impl", impl_params(IMPLS))
def test_nothing_is_kept_without_a_backward(impl, fresh_seed, monkeypatch):
    _small_blocks(monkeypatch)
    monkeypatch.setenv(CACHE_ENV, "1024")
    made = []
    monkeypatch.setattr(lp_mod, "new_cache", lambda b: made.append(b) or None)
    device = impl_device(impl)
    hidden = torch.randn(20, 8, device=device, requires_grad=True)
    weight = torch.randn(300, 8, device=device, requires_grad=True)
    labels = torch.randint(0, 300, (20,), device=device)
    with torch.no_grad():
        linear_logprobs(hidden, weight, labels, impl=impl)
    linear_logprobs(hidden.detach(), weight.detach(), labels, impl=impl)
    assert made == [0, 0]
    linear_logprobs(hidden, weight, labels, impl=impl)
    assert made == [0, 0, 1024 * MIB]


@pytest.mark.parametrize("impl", impl_params(IMPLS))
def test_kept_blocks_are_freed_and_a_second_backward_recomputes(impl, fresh_seed, monkeypatch):
    _small_blocks(monkeypatch)
    monkeypatch.setenv(CACHE_ENV, "1024")
    caches = []
    monkeypatch.setattr(
        lp_mod, "new_cache", lambda b: caches.append(logits_cache.LogitsCache(b)) or caches[-1]
    )
    device = impl_device(impl)
    hidden = torch.randn(40, 12, device=device, requires_grad=True)
    weight = (torch.randn(500, 12, device=device) / 12**0.5).requires_grad_()
    labels = torch.randint(0, 500, (40,), device=device)
    grad_out = torch.randn(40, device=device)
    logp = linear_logprobs(hidden, weight, labels, impl=impl)
    assert len(caches) == 1 and len(caches[0]) == _num_blocks(impl, 40, 500) > 1
    counts = _count_logits(monkeypatch)
    logp.backward(grad_out, retain_graph=True)
    assert len(caches[0]) == 0 and counts["formed"] == 0  # every block used, none recomputed
    first = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None
    logp.backward(grad_out)  # the kept blocks are gone: recomputed, same gradients
    assert counts["formed"] == _num_blocks(impl, 40, 500)
    torch.testing.assert_close(hidden.grad, first[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weight.grad, first[1], rtol=1e-6, atol=1e-7)


def test_frozen_head_keeps_blocks_for_the_hidden_gradient(fresh_seed, monkeypatch):
    """Only hidden requires grad: blocks are still kept, and grad_hidden matches float64."""
    monkeypatch.setenv(CACHE_ENV, "1024")
    hidden = torch.randn(33, 16, requires_grad=True)
    weight = torch.randn(1001, 16) / 4
    labels = torch.randint(0, 1001, (33,))
    counts = _count_logits(monkeypatch)
    logp = linear_logprobs(hidden, weight, labels)
    formed = counts["formed"]
    g = torch.randn(33)
    logp.backward(g)
    assert counts["formed"] == formed  # nothing recomputed
    ref_h = hidden.detach().double().requires_grad_()
    ref = torch.log_softmax(ref_h @ weight.double().t(), -1).gather(1, labels[:, None])
    (ref.squeeze(1) * g.double()).sum().backward()
    assert _rel_err(hidden.grad, ref_h.grad) <= 1e-5
