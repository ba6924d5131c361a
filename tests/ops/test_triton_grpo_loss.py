"""Triton per-token GRPO-family loss/gradient kernel against torch autograd of ``token_terms``.

The reference is torch autograd of :func:`areal_fast.rl.objectives.token_terms` in float64 on
the same (fp32) inputs. Runs under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors)
unless the kernel module was already compiled for a GPU in this process.
"""

from __future__ import annotations

import importlib

# tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU; on a GPU the kernels compile
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from areal_fast.rl.config import LossConfig  # noqa: E402
from areal_fast.rl.objectives import aggregation_weights, grpo_loss, token_terms  # noqa: E402

pytest.importorskip("triton")
mod = importlib.import_module("areal_fast.kernels.grpo_loss")

INTERPRETED = type(mod._grpo_token_loss_kernel).__name__ == "InterpretedFunction"
if INTERPRETED:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip(
        "Triton kernels are compiled (TRITON_INTERPRET unset) and there is no GPU",
        allow_module_level=True,
    )

# compiled for the GPU, every test here runs on CUDA (benches/gpu_check.sh: -m cuda)
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []

RTOL = 1e-5  # normalised by the reference's max |value|
MAX_ERR: dict[str, float] = {}
EXTRAS = ("prox_logprobs", "ref_logprobs", "engine_logprobs", "entropy")


@pytest.fixture(scope="module", autouse=True)
def _report_max_errors():
    yield
    print("\nmax errors:", {k: f"{v:.2e}" for k, v in sorted(MAX_ERR.items())})


def _note(name: str, err: float) -> float:
    MAX_ERR[name] = max(MAX_ERR.get(name, 0.0), err)
    return err


def _rel_err(got, ref) -> float:
    ref = ref.double()
    return float((got.cpu().double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


# ----------------------------------------------------------------------------- inputs


def _away(log_values: torch.Tensor, bounds, width=1e-4, step=3e-4) -> torch.Tensor:
    """Shift log-values lying within ``width`` of log(bound) by ``step`` (the loss has a
    kink there: fp32 and float64 may fall on different sides)."""
    for bound in bounds:
        close = (log_values - float(np.log(bound))).abs() < width
        log_values = torch.where(close, log_values + step, log_values)
    return log_values


def _make_batch(cfg: LossConfig, T=160, spread=0.7):
    """A packed batch (6 sequences, ~25% of tokens masked out) in fp32.

    Log-ratios are uniform in ±spread (r ∈ [0.5, 2.0]: clipped on both sides, past the dual
    clip), advantages of both signs with a few exact zeros, behaviour and TIS weights around
    their caps, KL log-ratios from 1e-6 to 2 in magnitude. Log-ratios are kept away from the
    kinks (clip bounds, dual clip, mask cap) by more than 1e-4 in log space.
    """
    lengths = torch.tensor([1, 40, 3, 50, 1, 65])
    assert int(lengths.sum()) == T
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    loss_mask = torch.rand(T) > 0.25
    loss_mask[1] = True
    old = -3.0 * torch.rand(T)
    behav_cap = cfg.behav_weight_cap if cfg.behav_weight_cap is not None else 1.05
    d_prox = _away(0.1 * torch.randn(T).double(), [behav_cap]).float()
    prox = old + d_prox
    lr = (2 * torch.rand(T) - 1) * spread
    bounds = [1 - cfg.eps_clip, 1 + cfg.clip_high] + (
        [cfg.dual_clip_c] if cfg.dual_clip_c is not None else []
    )
    logprobs = (old + lr).float()
    for _ in range(3):  # the exact fp32 log-ratio, against either base (old, or prox when
        for b in (old, prox):  # passed), away from every kink
            actual = _away(logprobs.double() - b.double(), bounds)
            logprobs = (b.double() + actual).float()
    adv = torch.randn(T)
    adv[torch.rand(T) < 0.1] = 0.0
    magnitude = 10.0 ** (-6 + 6.3 * torch.rand(T))  # KL log-ratios 1e-6 ... 2
    ref = (logprobs.double() - magnitude * torch.sign(torch.randn(T))).float()
    engine = old + 0.1 * torch.randn(T)
    entropy = 3.0 * torch.rand(T)
    extras = dict(prox_logprobs=prox, ref_logprobs=ref, engine_logprobs=engine, entropy=entropy)
    return logprobs, old, adv, loss_mask, cu, extras


def _reference(logprobs, old, adv, weights, cfg, extras):
    """float64 c·ℓ, c·dℓ/dlogp, c·dℓ/dentropy (or None) and clip_hit by torch autograd."""
    lp = logprobs.double().requires_grad_()
    kw = {k: (None if v is None else v.double()) for k, v in extras.items()}
    if kw.get("entropy") is not None:
        kw["entropy"] = kw["entropy"].requires_grad_()
    mask = torch.ones(lp.shape[0], dtype=torch.bool)
    terms = token_terms(lp, old.double(), adv.double(), mask, cfg, **kw)
    weighted = terms.per_token * weights.double()
    inputs = (lp,) if kw.get("entropy") is None else (lp, kw["entropy"])
    grads = torch.autograd.grad(weighted.sum(), inputs)
    return (weighted.detach(), grads[0], grads[1] if len(grads) > 1 else None, terms.clip_hit)


def _run(logprobs, old, adv, weights, cfg, extras, **kw):
    dev = {k: (None if v is None else v.to(DEVICE)) for k, v in extras.items()}
    out = mod.token_loss_grads(
        logprobs.to(DEVICE), old.to(DEVICE), adv.to(DEVICE), weights.to(DEVICE), cfg, **dev, **kw
    )
    return mod.TokenLossGrads(*(None if t is None else t.cpu() for t in out))


def _check(got, ref, *, tag, clip_hit=True):
    loss, g_lp, g_ent, hit = got
    r_loss, r_lp, r_ent, r_hit = ref
    for name, a in (("loss", loss), ("grad_logprobs", g_lp), ("grad_entropy", g_ent)):
        if a is not None:
            assert torch.isfinite(a).all(), f"{tag}: non-finite {name}"
    assert _note("loss", _rel_err(loss, r_loss)) <= RTOL, tag
    assert _note("grad_logprobs", _rel_err(g_lp, r_lp)) <= RTOL, tag
    assert (g_ent is None) == (r_ent is None), tag
    if g_ent is not None:
        assert _note("grad_entropy", _rel_err(g_ent, r_ent)) <= RTOL, tag
    if clip_hit:
        assert torch.equal(hit.bool(), r_hit), f"{tag}: clip_hit"


# ----------------------------------------------------------------------------- tests

CASES = {  # id: (LossConfig kwargs, extras passed)
    "plain": (dict(), ()),
    "agg=seq_mean_token_mean": (dict(aggregation="seq_mean_token_mean"), ()),
    "agg=seq_mean_token_sum": (dict(aggregation="seq_mean_token_sum", seq_len_norm=64.0), ()),
    "agg=token_sum": (dict(aggregation="token_sum"), ()),
    "clip-higher": (dict(eps_clip=0.1, eps_clip_high=0.28), ()),
    "dual-clip": (dict(dual_clip_c=1.3), ()),
    "dual-clip+clip-higher": (dict(eps_clip=0.1, eps_clip_high=0.28, dual_clip_c=1.6), ()),
    "decoupled, no cap": (dict(), ("prox_logprobs",)),
    "decoupled, mask cap": (
        dict(behav_weight_cap=1.05, behav_weight_mode="mask"),
        ("prox_logprobs",),
    ),
    "decoupled, clamp cap": (
        dict(behav_weight_cap=1.05, behav_weight_mode="clamp"),
        ("prox_logprobs",),
    ),
    "cap without prox": (dict(behav_weight_cap=1.05), ()),
    "tis": (dict(tis_cap=1.05), ("engine_logprobs",)),
    "engine without tis_cap": (dict(), ("engine_logprobs",)),
    "kl k1": (dict(kl_coef=0.1, kl_estimator="k1"), ("ref_logprobs",)),
    "kl k2": (dict(kl_coef=0.1, kl_estimator="k2"), ("ref_logprobs",)),
    "kl k3": (dict(kl_coef=0.1, kl_estimator="k3"), ("ref_logprobs",)),
    "ref with kl_coef=0": (dict(kl_coef=0.0), ("ref_logprobs",)),
    "entropy": (dict(entropy_coef=0.01), ("entropy",)),
    "entropy with coef 0": (dict(), ("entropy",)),
    "everything, mask": (
        dict(
            eps_clip=0.15,
            eps_clip_high=0.25,
            dual_clip_c=1.4,
            aggregation="seq_mean_token_mean",
            kl_coef=0.05,
            kl_estimator="k3",
            entropy_coef=0.02,
            behav_weight_cap=1.05,
            behav_weight_mode="mask",
            tis_cap=1.05,
        ),
        EXTRAS,
    ),
    "everything, clamp, k2": (
        dict(
            dual_clip_c=2.0,
            aggregation="token_sum",
            kl_coef=0.2,
            kl_estimator="k2",
            entropy_coef=0.1,
            behav_weight_cap=1.02,
            behav_weight_mode="clamp",
            tis_cap=1.02,
        ),
        EXTRAS,
    ),
    "cispo": (dict(surrogate="cispo", eps_clip=0.1, eps_clip_high=0.28), ()),
    "cispo, no lower bound, decoupled": (
        dict(surrogate="cispo", eps_clip=1.0, eps_clip_high=0.2, behav_weight_cap=1.05),
        ("prox_logprobs",),
    ),
    "sapo": (dict(surrogate="sapo"), ()),
    "sapo, steep, tis, kl": (
        dict(surrogate="sapo", sapo_tau_pos=4.0, sapo_tau_neg=8.0, tis_cap=1.05, kl_coef=0.1),
        ("engine_logprobs", "ref_logprobs"),
    ),
    "icepop on the engine ratio": (
        dict(icepop=True, icepop_low=0.9, icepop_high=1.1),
        ("engine_logprobs", "prox_logprobs"),
    ),
    "icepop on the decoupled weight": (
        dict(icepop=True, icepop_low=0.9, icepop_high=1.1),
        ("prox_logprobs",),
    ),
    "cispo, icepop, everything": (
        dict(
            surrogate="cispo",
            aggregation="seq_mean_token_mean",
            icepop=True,
            icepop_low=0.95,
            icepop_high=1.05,
            kl_coef=0.05,
            entropy_coef=0.02,
        ),
        EXTRAS,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_autograd_float64(case, fresh_seed):
    kwargs, passed = CASES[case]
    cfg = LossConfig(**kwargs)
    logprobs, old, adv, mask, cu, extras = _make_batch(cfg)
    extras = {k: (v if k in passed else None) for k, v in extras.items()}
    weights = aggregation_weights(mask, cu, cfg)  # [T] fp32, 0 off the mask
    kept = mask.nonzero().squeeze(1)
    pick = lambda t: None if t is None else t[kept]  # noqa: E731
    args = (
        pick(logprobs),
        pick(old),
        pick(adv),
        pick(weights),
        cfg,
        {k: pick(v) for k, v in extras.items()},
    )
    tag = f"{case}, seed {fresh_seed}"
    got = _run(*args, clip_hit_dtype=torch.int8)
    ref = _reference(*args)
    _check(got, ref, tag=tag)
    assert got.clip_hit.dtype == torch.int8
    # the test inputs exercise both sides of every clip (SAPO clips nothing)
    if cfg.surrogate != "sapo":
        assert 0 < int(ref[3].sum()) < kept.numel(), tag

    # Σ c_t ℓ_t is the aggregated loss of grpo_loss on the full (masked) batch
    full, _ = grpo_loss(
        logprobs.double(),
        old.double(),
        adv.double(),
        mask,
        cu,
        cfg,
        **{k: (None if v is None else v.double()) for k, v in extras.items()},
    )
    assert (
        _note(
            "Σ loss vs grpo_loss",
            abs(float(got.loss.double().sum()) - float(full))
            / max(1e-30, float(ref[0].abs().sum())),
        )
        <= RTOL
    ), tag


@pytest.mark.parametrize("C,block", [(1, None), (100, 16), (1500, None), (333, 128)])
def test_ragged_tiles_and_output_options(C, block, fresh_seed):
    """Several programs with a ragged tail; float32 clip_hit; loss/clip_hit switched off."""
    cfg = LossConfig(
        eps_clip_high=0.28,
        dual_clip_c=1.5,
        kl_coef=0.1,
        entropy_coef=0.05,
        behav_weight_cap=1.05,
        tis_cap=1.1,
    )
    T = 160
    reps = (C + T - 1) // T
    parts = [_make_batch(cfg) for _ in range(reps)]
    cat = lambda i: torch.cat([p[i] for p in parts])[:C]  # noqa: E731
    logprobs, old, adv = cat(0), cat(1), cat(2)
    extras = {k: torch.cat([p[5][k] for p in parts])[:C] for k in EXTRAS}
    weights = torch.rand(C)
    tag = f"C={C}, block={block}, seed {fresh_seed}"
    ref = _reference(logprobs, old, adv, weights, cfg, extras)
    got = _run(logprobs, old, adv, weights, cfg, extras, clip_hit_dtype=torch.float32, block=block)
    _check(got, ref, tag=tag)
    assert got.clip_hit.dtype == torch.float32
    assert set(got.clip_hit.unique().tolist()) <= {0.0, 1.0}
    bare = _run(
        logprobs, old, adv, weights, cfg, extras, with_loss=False, clip_hit_dtype=None, block=block
    )
    assert bare.loss is None and bare.clip_hit is None
    assert torch.equal(bare.grad_logprobs, got.grad_logprobs), tag
    assert torch.equal(bare.grad_entropy, got.grad_entropy), tag


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_per_token_relative_accuracy(estimator, fresh_seed):
    """With A = 0 the loss is kl_coef·KL alone: every token's value and gradient keep a
    per-element relative error ≤ 1e-5 for |logp − ref| from 1e-6 to 5 (k3 is ≈ x²/2 for
    small x, where exp(−x) − 1 + x would cancel to a few ulps of 1)."""
    C = 300
    cfg = LossConfig(kl_coef=0.3, kl_estimator=estimator)
    logprobs = -3.0 * torch.rand(C)
    x = 10.0 ** (-6 + 6.7 * torch.rand(C)) * torch.sign(torch.randn(C))
    ref = (logprobs.double() - x).float()
    old = logprobs - 0.1 * torch.randn(C)
    adv, weights = torch.zeros(C), torch.rand(C) + 0.5
    extras = dict(ref_logprobs=ref)
    r_loss, r_lp, _, _ = _reference(logprobs, old, adv, weights, cfg, extras)
    got = _run(logprobs, old, adv, weights, cfg, extras)
    tag = f"{estimator}, seed {fresh_seed}"
    for name, a, b in (("loss", got.loss, r_loss), ("grad", got.grad_logprobs, r_lp)):
        nz = b != 0
        err = float(((a.double() - b).abs()[nz] / b.abs()[nz]).max())
        assert _note(f"kl {estimator} {name} (per elem)", err) <= RTOL, tag
        assert torch.all(a[~nz] == 0), tag


def _fp32_reference(logprobs, old, adv, weights, cfg, extras):
    """torch autograd of token_terms in float32 on the very same inputs (exact ties)."""
    lp = logprobs.clone().requires_grad_()
    terms = token_terms(lp, old, adv, torch.ones_like(lp, dtype=torch.bool), cfg, **extras)
    (grad,) = torch.autograd.grad((terms.per_token * weights).sum(), (lp,))
    return (terms.per_token * weights).detach(), grad, terms.clip_hit


def test_exact_ties_follow_torch_subgradients(fresh_seed):
    """Ties torch resolves half/half: A = 0 (both branches equal, loss and gradient 0) and
    r = 1 exactly (logp == base: the branches tie inside the clip range, full gradient)."""
    C = 64
    cfg = LossConfig(dual_clip_c=1.5, eps_clip_high=0.3)
    old = -3.0 * torch.rand(C)
    logprobs = old + 0.5 * torch.randn(C)
    logprobs[::3] = old[::3]  # r = 1 exactly
    adv = torch.randn(C)
    adv[1::4] = 0.0  # A = 0
    weights = torch.rand(C)
    r_loss, r_lp, r_hit = _fp32_reference(logprobs, old, adv, weights, cfg, {})
    got = _run(logprobs, old, adv, weights, cfg, {})
    tag = f"seed {fresh_seed}"
    assert _note("ties: grad_logprobs", _rel_err(got.grad_logprobs, r_lp)) <= RTOL, tag
    assert _note("ties: loss", _rel_err(got.loss, r_loss)) <= RTOL, tag
    assert torch.equal(got.clip_hit.bool(), r_hit), tag
    tie = slice(0, None, 3)
    expected = -adv[tie] * weights[tie]  # d(−A·r)/dlogp at r = 1
    torch.testing.assert_close(got.grad_logprobs[tie], expected, rtol=1e-6, atol=0)
    assert torch.all(got.grad_logprobs[adv == 0] == 0)


def _exact_log(target: float, base: float) -> float:
    """A float32 log-prob ``logp`` with ``logp − base`` exact and exp(logp − base) rounding
    to float32(target) in both torch and numpy (the interpreter's ``tl.exp``)."""
    t32 = np.float32(target)
    x = np.float32(np.log(target))
    best = None
    for _ in range(40):
        x = np.nextafter(x, np.float32(-np.inf))
    for _ in range(80):
        x = np.nextafter(x, np.float32(np.inf))
        lp = np.float32(x + np.float32(base))
        if np.float32(lp - np.float32(base)) != x:
            continue
        xs = np.array([lp - np.float32(base)], dtype=np.float32)
        if np.exp(xs)[0] == t32 and float(torch.exp(torch.from_numpy(xs))[0]) == float(t32):
            # the exact value closest to the middle of target's ulp
            dist = abs(np.exp(np.float64(xs[0])) - np.float64(t32))
            if best is None or dist < best[0]:
                best = (dist, float(lp))
    assert best is not None, target
    return best[1]


@pytest.mark.skipif(
    not INTERPRETED,
    reason="needs the interpreter's exp (numpy) to land "
    "exactly on a clip bound; a GPU exp may round differently",
)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_exact_clip_boundaries(sign, fresh_seed):
    """r exactly 1 − ε, 1 + ε_h, the dual-clip c and 1, and w exactly the mask cap: clamp
    passes the gradient on the closed interval and max/min split it half/half, as torch does.
    A last token has r one ulp above 1 + ε_h and an |A| for which −A·r and −A·(1 + ε_h)
    round to the same float32: a tie outside the clip range, where only half the gradient
    (the unclipped branch's half) reaches logp."""
    cfg = LossConfig(
        eps_clip=0.2,
        eps_clip_high=0.28,
        dual_clip_c=1.5,
        behav_weight_cap=1.1,
        behav_weight_mode="mask",
    )
    base = 0.0  # lp − base is then exact for every float32 lp
    high = np.float32(1 + cfg.clip_high)
    above = float(np.nextafter(high, np.float32(np.inf)))
    targets = [1 - cfg.eps_clip, 1 + cfg.clip_high, cfg.dual_clip_c, 1.0, above]
    lps = torch.tensor([_exact_log(t, base) for t in targets], dtype=torch.float32)
    C = lps.numel()
    prox = torch.full((C,), base)
    old = torch.full((C,), -_exact_log(cfg.behav_weight_cap, -base))  # w = cap exactly
    adv = sign * (0.5 + torch.rand(C))
    for k in range(1000):  # |A| with fl(|A|·r) == fl(|A|·(1 + ε_h)) for r one ulp above
        a = np.float32(1.5 + 1e-3 * k + 1e-4 * float(torch.rand(())))
        if a * np.float32(above) == a * high:
            adv[4] = sign * float(a)
            break
    else:
        pytest.fail("no colliding advantage found")
    weights = torch.rand(C) + 0.5
    extras = dict(prox_logprobs=prox)
    ratio = torch.exp(lps - prox)
    assert torch.equal(ratio, torch.tensor(targets, dtype=torch.float32))
    assert torch.equal(torch.exp(prox - old), torch.full((C,), cfg.behav_weight_cap))
    r_loss, r_lp, r_hit = _fp32_reference(lps, old, adv, weights, cfg, extras)
    got = _run(lps, old, adv, weights, cfg, extras)
    tag = f"sign {sign}, seed {fresh_seed}"
    torch.testing.assert_close(got.grad_logprobs, r_lp, rtol=1e-6, atol=0, msg=tag)
    torch.testing.assert_close(got.loss, r_loss, rtol=1e-6, atol=0, msg=tag)
    assert torch.equal(got.clip_hit.bool(), r_hit), tag
    # on a bound the two branches tie (no clip); r = c > 1 + ε_h is clipped when A > 0
    assert r_hit.tolist() == [False, False, sign > 0, False, False], tag
    w = cfg.behav_weight_cap
    unclipped = -adv * ratio * w * weights
    torch.testing.assert_close(got.grad_logprobs[[0, 1, 3]], unclipped[[0, 1, 3]])
    torch.testing.assert_close(got.grad_logprobs[4], 0.5 * unclipped[4])
    if sign > 0:  # c is above 1 + ε_h: clipped
        assert got.grad_logprobs[2] == 0
    else:  # r = c: min(pg, −c·A) ties → half
        torch.testing.assert_close(got.grad_logprobs[2], 0.5 * unclipped[2])


def test_argument_errors():
    v = torch.zeros(4)
    with pytest.raises(ValueError, match="needs per-token losses"):
        mod.token_loss_grads(v, v, v, v, LossConfig(ratio_level="sequence"))
    with pytest.raises(ValueError, match="needs per-token losses"):
        mod.token_loss_grads(v, v, v, v, LossConfig(surrogate="m2po"))
    with pytest.raises(ValueError, match="icepop needs engine_logprobs or prox_logprobs"):
        mod.token_loss_grads(v, v, v, v, LossConfig(icepop=True))
    with pytest.raises(ValueError, match="advantages"):
        mod.token_loss_grads(v, v, torch.zeros(3), v, LossConfig())
    with pytest.raises(ValueError, match="weights"):
        mod.token_loss_grads(v, v, v, torch.zeros(4, dtype=torch.int32), LossConfig())
    with pytest.raises(ValueError, match="ref_logprobs"):
        mod.token_loss_grads(v, v, v, v, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        mod.token_loss_grads(v, v, v, v, LossConfig(), entropy=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="block"):
        mod.token_loss_grads(v, v, v, v, LossConfig(), block=48)
    with pytest.raises(ValueError, match="logprobs"):
        mod.token_loss_grads(torch.zeros(2, 2), v, v, v, LossConfig())
    empty = mod.token_loss_grads(v[:0], v[:0], v[:0], v[:0], LossConfig(), entropy=v[:0])
    assert empty.grad_logprobs.shape == (0,) and empty.grad_entropy.shape == (0,)
