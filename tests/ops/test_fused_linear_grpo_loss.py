"""fused_linear_grpo_loss equals linear_logprobs + grpo_loss composed (values and gradients)."""

import dataclasses

import pytest
import torch
from conftest import available_impls, impl_device, impl_params

from areal_fast import LossConfig, fused_linear_grpo_loss, grpo_loss, linear_logprobs
from areal_fast.ops import logprobs as lp_mod

IMPLS = available_impls()

CONFIGS = [
    LossConfig(),
    LossConfig(eps_clip=0.1, eps_clip_high=0.28, dual_clip_c=3.0),
    LossConfig(ratio_level="sequence"),
    LossConfig(aggregation="seq_mean_token_mean", entropy_coef=0.01),
    LossConfig(aggregation="seq_mean_token_sum", seq_len_norm=16.0, kl_coef=0.1, kl_estimator="k3"),
    LossConfig(aggregation="token_sum", kl_coef=0.05, kl_estimator="k2"),
    LossConfig(behav_weight_cap=1.05, behav_weight_mode="mask", tis_cap=1.5),
    LossConfig(behav_weight_cap=1.05, behav_weight_mode="clamp", kl_coef=0.1, kl_estimator="k1"),
    LossConfig(surrogate="cispo", eps_clip_high=0.28, entropy_coef=0.01),
    LossConfig(surrogate="sapo", aggregation="seq_mean_token_mean", kl_coef=0.1),
    LossConfig(icepop=True, icepop_low=0.9, icepop_high=1.1),
    LossConfig(surrogate="m2po", m2po_threshold=0.003),
    LossConfig(seq_rejection="ratio", seq_rejection_low=0.9, seq_rejection_high=1.1),
    LossConfig(seq_rejection="ratio", seq_rejection_mode="clamp", seq_rejection_high=1.01),
    LossConfig(surrogate="cispo", seq_rejection="k3", seq_rejection_high=0.02),
]


def config_id(config: LossConfig) -> str:
    """The options a config changes from the defaults, as a test id."""
    changed = [
        f"{f.name}={getattr(config, f.name)}"
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != f.default
    ]
    return ",".join(changed) or "default"


def _batch(T=45, H=24, V=301, dtype=torch.float64):
    """Packed batch with sequences of length 1, prompt tokens masked out, small log-ratios."""
    lengths = [1, 9, 1, 14, 20]
    assert sum(lengths) == T
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    hidden = torch.randn(T, H, dtype=dtype)
    weight = torch.randn(V, H, dtype=dtype) / H**0.5
    labels = torch.randint(0, V, (T,))
    loss_mask = torch.rand(T) > 0.3
    loss_mask[1] = True  # a length-1 sequence with its token trained
    with torch.no_grad():
        logp = linear_logprobs(hidden.double(), weight.double(), labels, temperature=0.8)
    noise = lambda: 0.1 * torch.randn(T, dtype=torch.float64)  # noqa: E731
    old = (logp + noise()).float()
    extras = dict(
        prox_logprobs=(logp + noise()).float(),
        ref_logprobs=(logp + noise()).float(),
        engine_logprobs=(logp + noise()).float(),
    )
    advantages = torch.randn(len(lengths))
    return hidden, weight, labels, old, advantages, loss_mask, cu, extras


def _composed(hidden, weight, labels, old, adv, mask, cu, cfg, extras):
    logp, ent = linear_logprobs(
        hidden, weight, torch.where(mask, labels, -100), temperature=0.8, return_entropy=True
    )
    return grpo_loss(
        logp,
        old.to(logp.dtype),
        adv.to(logp.dtype),
        mask,
        cu,
        cfg,
        entropy=ent if cfg.entropy_coef else None,
        **{k: v.to(logp.dtype) for k, v in extras.items()},
    )


@pytest.mark.parametrize("impl", impl_params(IMPLS))
@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
def test_fused_equals_composed(impl, cfg, fresh_seed):
    hidden, weight, labels, old, adv, mask, cu, extras = _batch()
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_loss, ref_stats = _composed(ref_h, ref_w, labels, old, adv, mask, cu, cfg, extras)
    ref_loss.backward()

    device = impl_device(impl)
    h = hidden.float().to(device).requires_grad_()
    w = weight.float().to(device).requires_grad_()
    loss, stats = fused_linear_grpo_loss(
        h,
        w,
        labels.to(device),
        old.to(device),
        adv.to(device),
        mask.to(device),
        cu.to(device),
        cfg,
        temperature=0.8,
        impl=impl,
        **{k: v.to(device) for k, v in extras.items()},
    )
    (3.0 * loss).backward()  # a non-unit upstream gradient

    scale = float(ref_loss.abs().clamp(min=1.0))
    assert abs(float(loss) - float(ref_loss)) / scale < 1e-5, (impl, float(loss), float(ref_loss))
    for name, got, ref in (("hidden", h.grad, ref_h.grad), ("weight", w.grad, ref_w.grad)):
        ref = 3.0 * ref
        err = float((got.cpu().double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
        assert err < 1e-4, f"{impl} grad {name}: rel err {err:.2e} (seed {fresh_seed})"
        assert ref.abs().max() > 0
    assert set(stats) == set(ref_stats)
    for key in stats:
        assert abs(float(stats[key]) - float(ref_stats[key])) < 1e-4 * max(
            1.0, abs(float(ref_stats[key]))
        ), key


def test_fused_is_exact_in_float64(fresh_seed):
    """With float64 inputs the fused gradient equals the composed one to rounding."""
    hidden, weight, labels, old, adv, mask, cu, extras = _batch()
    cfg = LossConfig(aggregation="seq_mean_token_mean", entropy_coef=0.02, kl_coef=0.1)
    grads = []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            loss, _ = fused_linear_grpo_loss(
                h,
                w,
                labels,
                old.double(),
                adv.double(),
                mask,
                cu,
                cfg,
                temperature=0.8,
                **{k: v.double() for k, v in extras.items()},
            )
        else:
            loss, _ = _composed(h, w, labels, old, adv, mask, cu, cfg, extras)
        loss.backward()
        grads.append((float(loss), h.grad, w.grad))
    assert abs(grads[0][0] - grads[1][0]) < 1e-12
    for a, b in zip(grads[0][1:], grads[1][1:]):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("impl", impl_params(IMPLS))
def test_several_chunks(impl, monkeypatch, fresh_seed):
    monkeypatch.setattr(lp_mod, "_CHUNK_BYTES", 8 * 301 * 4)
    monkeypatch.setattr(lp_mod, "_MIN_CHUNK_ROWS", 1)
    monkeypatch.setenv("AREAL_FAST_LOGITS_CACHE_MB", "0")  # blocks of _CHUNK_BYTES
    test_fused_equals_composed(impl, LossConfig(entropy_coef=0.01), fresh_seed)


def test_no_trained_token_gives_zero_loss_and_zero_grads():
    hidden, weight, labels, old, adv, mask, cu, extras = _batch(dtype=torch.float32)
    mask[:] = False
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    loss, stats = fused_linear_grpo_loss(h, w, labels, old, adv, mask, cu, LossConfig())
    loss.backward()
    assert float(loss) == 0.0 and float(stats["num_tokens"]) == 0
    assert torch.all(h.grad == 0) and torch.all(w.grad == 0)


def test_no_grad_gives_the_same_loss(fresh_seed):
    hidden, weight, labels, old, adv, mask, cu, extras = _batch(dtype=torch.float32)
    cfg = LossConfig(kl_coef=0.1)
    with torch.no_grad():
        plain, _ = fused_linear_grpo_loss(
            hidden, weight, labels, old, adv, mask, cu, cfg, ref_logprobs=extras["ref_logprobs"]
        )
    h = hidden.clone().requires_grad_()
    graded, _ = fused_linear_grpo_loss(
        h, weight, labels, old, adv, mask, cu, cfg, ref_logprobs=extras["ref_logprobs"]
    )
    assert abs(float(plain) - float(graded)) < 1e-6


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(cu=torch.tensor([0, 45], dtype=torch.int64)), "cu_seqlens"),
        (dict(cu=torch.tensor([1, 45], dtype=torch.int32)), "cu_seqlens"),
        (dict(cu=torch.tensor([0, 30, 20, 45], dtype=torch.int32)), "cu_seqlens"),
        (dict(cu=torch.tensor([0, 44], dtype=torch.int32)), "cu_seqlens"),
        (dict(adv=torch.randn(3)), "advantages"),
        (dict(old=torch.randn(44)), "old_logprobs"),
        (dict(mask=torch.ones(45)), "loss_mask"),
        (dict(labels=torch.zeros(45, dtype=torch.int32)), "labels"),
        (dict(weight=torch.randn(301, 23)), "weight"),
    ],
)
def test_bad_input_names_the_tensor(change, match):
    hidden, weight, labels, old, adv, mask, cu, extras = _batch(dtype=torch.float32)
    args = dict(hidden=hidden, weight=weight, labels=labels, old=old, adv=adv, mask=mask, cu=cu)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        fused_linear_grpo_loss(
            args["hidden"],
            args["weight"],
            args["labels"],
            args["old"],
            args["adv"],
            args["mask"],
            args["cu"],
            LossConfig(),
        )


def test_wrong_length_engine_logprobs_is_named():
    hidden, weight, labels, old, adv, mask, cu, extras = _batch(dtype=torch.float32)
    with pytest.raises(ValueError, match="engine_logprobs"):
        fused_linear_grpo_loss(
            hidden.requires_grad_(),
            weight,
            labels,
            old,
            adv,
            mask,
            cu,
            LossConfig(tis_cap=2.0),
            engine_logprobs=torch.zeros(3),
        )


# ---------------------------------------------------------------------------------------
# what a trainer logs: entropy, per-token outputs, proximal log-probs from the pass itself
# ---------------------------------------------------------------------------------------


def _loglinear_fn(behav, alpha):
    """A prox_fn: the loglinear interpolation behav + α·(logprobs − behav) at ``pos``."""

    def prox_fn(logprobs, pos):
        base = behav[pos].to(logprobs.dtype)
        return base + alpha[pos].to(logprobs.dtype) * (logprobs - base)

    return prox_fn


def _reference_prox(kind, logp, behav, alpha, mask):
    if kind == "recompute":
        return torch.where(mask, logp, 0.0)
    return torch.where(mask, behav + alpha * (logp - behav), 0.0)


@pytest.mark.parametrize("kind", ["recompute", "loglinear"])
@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(behav_weight_cap=1.05, kl_coef=0.1),
        LossConfig(aggregation="seq_mean_token_mean", entropy_coef=0.02, behav_weight_cap=1.1),
        LossConfig(ratio_level="sequence", behav_weight_cap=1.1),
    ],
    ids=["token_mean-kl", "seq_mean-entropy", "gspo"],
)
@pytest.mark.parametrize("chunked", [False, True])
def test_prox_fn_and_per_token_outputs_equal_composed(kind, cfg, chunked, monkeypatch, fresh_seed):
    """float64: prox from the chunk's own log-probs, the logged entropy (entropy_coef 0 too)
    and the per-token outputs equal the composition with those log-probs given explicitly."""
    if chunked:
        monkeypatch.setattr(lp_mod, "_CHUNK_BYTES", 8 * 301 * 8)
        monkeypatch.setattr(lp_mod, "_MIN_CHUNK_ROWS", 1)
        monkeypatch.setenv("AREAL_FAST_LOGITS_CACHE_MB", "0")  # blocks of _CHUNK_BYTES
    hidden, weight, labels, old, adv, mask, cu, extras = _batch()
    old, adv = old.double(), adv.double()
    ref_lp = extras["ref_logprobs"].double()
    alpha = torch.rand(hidden.shape[0], dtype=torch.float64)
    prox_fn = None if kind == "recompute" else _loglinear_fn(old, alpha)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, stats, tokens = fused_linear_grpo_loss(
        h,
        w,
        labels,
        old,
        adv,
        mask,
        cu,
        cfg,
        temperature=0.8,
        ref_logprobs=ref_lp,
        prox_fn=(lambda lp, pos: lp) if kind == "recompute" else prox_fn,
        with_entropy=True,
        return_per_token=True,
    )
    loss.backward()

    rh, rw = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = linear_logprobs(
        rh, rw, torch.where(mask, labels, -100), temperature=0.8, return_entropy=True
    )
    prox = _reference_prox(kind, logp.detach(), old, alpha, mask)
    ref_loss, ref_stats = grpo_loss(
        logp,
        old,
        adv,
        mask,
        cu,
        cfg,
        prox_logprobs=prox,
        ref_logprobs=ref_lp,
        entropy=ent if cfg.entropy_coef else ent.detach(),
    )
    ref_loss.backward()

    assert abs(float(loss) - float(ref_loss)) < 1e-12
    assert set(stats) == set(ref_stats) and "entropy_mean" in stats
    for key in stats:
        assert float(stats[key]) == pytest.approx(float(ref_stats[key]), rel=1e-10, abs=1e-13), key
    assert torch.allclose(tokens.logprobs, logp.detach(), rtol=1e-12, atol=1e-14)
    assert torch.allclose(tokens.entropy, ent.detach(), rtol=1e-12, atol=1e-14)
    assert torch.allclose(tokens.prox_logprobs, prox, rtol=1e-12, atol=1e-14)
    assert not tokens.logprobs.requires_grad and not tokens.prox_logprobs.requires_grad
    for got, want in ((h.grad, rh.grad), (w.grad, rw.grad)):
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-13), (got - want).abs().max()


def test_prox_fn_is_called_per_chunk_with_trained_positions(monkeypatch, fresh_seed):
    monkeypatch.setattr(lp_mod, "_CHUNK_BYTES", 8 * 301 * 4)
    monkeypatch.setattr(lp_mod, "_MIN_CHUNK_ROWS", 1)
    monkeypatch.setenv("AREAL_FAST_LOGITS_CACHE_MB", "0")  # blocks of _CHUNK_BYTES
    hidden, weight, labels, old, adv, mask, cu, _ = _batch(dtype=torch.float32)
    calls = []

    def prox_fn(logprobs, pos):
        calls.append(pos.clone())
        return logprobs - 0.01

    fused_linear_grpo_loss(
        hidden.requires_grad_(), weight, labels, old, adv, mask, cu, LossConfig(), prox_fn=prox_fn
    )
    assert len(calls) > 1 and all(len(c) <= 8 for c in calls)
    assert torch.equal(torch.cat(calls), mask.nonzero().squeeze(1))


def test_with_entropy_does_not_change_loss_or_gradients(fresh_seed):
    hidden, weight, labels, old, adv, mask, cu, _ = _batch(dtype=torch.float32)
    results = []
    for with_entropy in (False, True):
        h = hidden.clone().requires_grad_()
        loss, stats = fused_linear_grpo_loss(
            h, weight, labels, old, adv, mask, cu, LossConfig(), with_entropy=with_entropy
        )
        loss.backward()
        results.append((float(loss), h.grad, stats))
    assert "entropy_mean" not in results[0][2] and "entropy_mean" in results[1][2]
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("scale", [1.0, 0.37, 0.0])
def test_upstream_grad_prescales_the_gradients(scale, fresh_seed):
    hidden, weight, labels, old, adv, mask, cu, _ = _batch()
    cfg = LossConfig(entropy_coef=0.01)
    grads = []
    for upstream in (None, scale):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, _ = fused_linear_grpo_loss(
            h, w, labels, old.double(), adv.double(), mask, cu, cfg, upstream_grad=upstream
        )
        (loss * scale).backward()
        grads.append((float(loss), h.grad, w.grad))
    assert grads[0][0] == grads[1][0]  # the loss value is not scaled
    for a, b in zip(grads[0][1:], grads[1][1:]):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-15)
    if scale == 0.0:
        assert torch.all(grads[1][2] == 0)


def test_upstream_grad_mismatch_is_an_error_on_cpu():
    hidden, weight, labels, old, adv, mask, cu, _ = _batch(dtype=torch.float32)
    loss, _ = fused_linear_grpo_loss(
        hidden.requires_grad_(), weight, labels, old, adv, mask, cu, LossConfig(), upstream_grad=0.5
    )
    with pytest.raises(RuntimeError, match="upstream_grad = 0.5"):
        (loss * 2.0).backward()


def test_scaled_backward_runs_once(fresh_seed):
    """Without upstream_grad the stored gradients are scaled in place: a second backward
    through a retained graph is refused instead of scaling them twice."""
    hidden, weight, labels, old, adv, mask, cu, _ = _batch(dtype=torch.float32)
    loss, _ = fused_linear_grpo_loss(
        hidden.requires_grad_(), weight, labels, old, adv, mask, cu, LossConfig()
    )
    (2.0 * loss).backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        (2.0 * loss).backward()


def test_trained_positions_give_the_same_result(fresh_seed):
    hidden, weight, labels, old, adv, mask, cu, _ = _batch(dtype=torch.float32)
    out = []
    for positions in (None, mask.nonzero().squeeze(1)):
        h = hidden.clone().requires_grad_()
        loss, _ = fused_linear_grpo_loss(
            h, weight, labels, old, adv, mask, cu, LossConfig(), trained_positions=positions
        )
        loss.backward()
        out.append((float(loss), h.grad))
    assert out[0][0] == out[1][0] and torch.equal(out[0][1], out[1][1])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(prox_fn=lambda lp, pos: lp, prox_logprobs=torch.zeros(45)), ValueError, "not both"),
        (dict(prox_fn="recompute"), TypeError, "prox_fn must be callable"),
        (dict(prox_fn=lambda lp, pos: lp[:-1]), ValueError, "prox_fn must return"),
        (dict(prox_fn=lambda lp, pos: pos), ValueError, "floating"),
        (dict(upstream_grad=float("nan")), ValueError, "upstream_grad"),
        (dict(upstream_grad=True), ValueError, "upstream_grad"),
        (dict(trained_positions=torch.arange(3)), ValueError, "trained_positions"),
        (dict(trained_positions=torch.arange(3, dtype=torch.int32)), ValueError, "int64"),
    ],
)
def test_bad_options_are_named(kwargs, error, match):
    hidden, weight, labels, old, adv, mask, cu, _ = _batch(dtype=torch.float32)
    with pytest.raises(error, match=match):
        fused_linear_grpo_loss(
            hidden.requires_grad_(), weight, labels, old, adv, mask, cu, LossConfig(), **kwargs
        )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_on_cuda(fresh_seed):
    """With trained_positions and upstream_grad the loss, its stats and its backward make
    no device→host synchronisation."""
    hidden, weight, labels, old, adv, mask, cu, extras = _batch(dtype=torch.float32)
    dev = [t.cuda() for t in (hidden, weight, labels, old, adv, mask, cu)]
    positions = mask.nonzero().squeeze(1).cuda()
    cfg = LossConfig(aggregation="seq_mean_token_mean", entropy_coef=0.01, behav_weight_cap=2.0)
    for check in (False, True):  # the first call compiles the kernels
        h = dev[0].clone().requires_grad_()
        torch.cuda.set_sync_debug_mode("error" if check else "default")
        try:
            loss, stats, tokens = fused_linear_grpo_loss(
                h,
                *dev[1:],
                cfg,
                prox_fn=lambda lp, pos: lp,
                with_entropy=True,
                return_per_token=True,
                upstream_grad=0.5,
                trained_positions=positions,
            )
            (0.5 * loss).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(h.grad).all() and float(stats["entropy_mean"]) > 0


def test_fused_chunk_rows_follow_the_logits_budget_on_the_cpu(monkeypatch):
    from areal_fast.ops.fused_pass import fused_chunk_rows

    cpu, vocab = torch.device("cpu"), 70_000
    monkeypatch.setenv("AREAL_FAST_LOGITS_CACHE_MB", "0")
    assert fused_chunk_rows(600, vocab, 4, cpu) == 256  # the 64 MiB block, at least 256 rows
    monkeypatch.setenv("AREAL_FAST_LOGITS_CACHE_MB", "100")
    assert fused_chunk_rows(600, vocab, 4, cpu) == 100 * 2**20 // (4 * vocab)  # 374
    monkeypatch.delenv("AREAL_FAST_LOGITS_CACHE_MB")
    assert fused_chunk_rows(600, vocab, 4, cpu) == 600  # 2048 MiB: the whole call
    assert fused_chunk_rows(10_000, 20_000, 4, cpu) == 4096  # at most 4096 rows from the budget
    assert fused_chunk_rows(600, vocab, 4, torch.device("meta")) == 256  # budget 0 off the CPU


def test_fused_loss_is_the_same_whatever_its_blocks(monkeypatch):
    """One block (the default CPU budget) or three (no budget): the same loss and gradients
    to rounding, on fresh random inputs."""
    T, H, V = 600, 16, 70_000
    cu = torch.tensor([0, 100, 350, 600], dtype=torch.int32)
    hidden = torch.randn(T, H)
    weight = torch.randn(V, H) / H**0.5
    labels = torch.randint(0, V, (T,))
    mask = torch.rand(T) > 0.2
    with torch.no_grad():
        old = linear_logprobs(hidden, weight, labels) + 0.1 * torch.randn(T)
    adv = torch.randn(3)
    results = []
    for budget in ("0", None):
        if budget is None:
            monkeypatch.delenv("AREAL_FAST_LOGITS_CACHE_MB", raising=False)
        else:
            monkeypatch.setenv("AREAL_FAST_LOGITS_CACHE_MB", budget)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss, _ = fused_linear_grpo_loss(h, w, labels, old, adv, mask, cu, LossConfig())
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
