"""Triton row epilogues of linear_logprobs against a careful float64 reference.

Runs under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors) unless the kernel module
was already compiled for a GPU in this process, in which case it runs on CUDA.
"""

from __future__ import annotations

import importlib

# tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU; on a GPU the kernels compile
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
rows_mod = importlib.import_module("areal_fast.kernels.linear_logprobs")

if type(rows_mod._linear_logprobs_fwd_kernel).__name__ == "InterpretedFunction":
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
LABEL_RTOL = 1e-4  # per element, confident rows
MAX_ERR: dict[str, float] = {}  # largest error seen per quantity (printed with -s)


@pytest.fixture(scope="module", autouse=True)
def _report_max_errors():
    yield
    print("\nmax errors:", {k: f"{v:.2e}" for k, v in sorted(MAX_ERR.items())})


def _note(name: str, err: float) -> float:
    MAX_ERR[name] = max(MAX_ERR.get(name, 0.0), err)
    return err


# ----------------------------------------------------------------------------- reference


def _reference(z, labels, temperature, ignore_index, g, h):
    """float64 logprobs, entropy, lse and d/dz of Σ g·logprob + h·entropy (h may be None).

    Written to stay relatively accurate where a naive float64 version is not: the
    logsumexp keeps the max's 1 apart (log1p of the rest), and the label's 1 − p_y is
    Σ_{v≠y} p_v. Entries with p_v = 0 (x_v = −inf) contribute exactly 0.
    """
    x = z.double() / temperature
    m = x.max(1, keepdim=True).values
    e = (x - m).exp()
    rest = e.scatter(1, x.argmax(1, keepdim=True), 0.0).sum(1, keepdim=True)
    log_s = torch.log1p(rest)
    logp = (x - m) - log_s
    p = logp.exp()
    lse = (m + log_s).squeeze(1)
    valid = labels != ignore_index
    y = torch.where(valid, labels, 0)[:, None]
    ent = -torch.where(p > 0, p * logp, 0.0).sum(1)
    logp_y = logp.gather(1, y).squeeze(1)
    p_y = logp_y.exp()
    s_other = p.scatter(1, y, 0.0).sum(1)

    gd = g.double()
    grad = -p * gd[:, None]
    label_entry = gd * s_other
    if h is not None:
        hd = h.double()
        grad = grad - hd[:, None] * torch.where(p > 0, p * (logp + ent[:, None]), 0.0)
        label_entry = label_entry - hd * torch.where(p_y > 0, p_y * (logp_y + ent), 0.0)
    grad = grad.scatter(1, y, label_entry[:, None]) / temperature
    grad[~valid] = 0.0
    zero = torch.zeros((), dtype=torch.float64)
    return (torch.where(valid, logp_y, zero), torch.where(valid, ent, zero), lse, grad)


def _rel_err(got, ref) -> float:
    scale = ref.abs().max().item()
    diff = (got.double() - ref).abs().max().item()
    return diff / scale if scale > 0 else diff


# ----------------------------------------------------------------------------- harness


def _make_inputs(C, V, *, ignore_index=-100, frac_ignored=0.25, scale=3.0):
    z = torch.randn(C, V) * scale
    labels = torch.randint(0, V, (C,))
    ignored = torch.rand(C) < frac_ignored
    ignored[0] = False  # at least one valid row
    if C > 1 and frac_ignored > 0:
        ignored[-1] = True  # and one ignored row
    labels[ignored] = ignore_index
    return z, labels


def _run(z, labels, temperature, ignore_index, g, h, *, with_entropy=True, block_v=None):
    """Forward + backward through the launchers; z sits in a wider buffer (row stride > V)
    and the [C] outputs are views into NaN-filled buffers, both checked for stray writes."""
    C, V = z.shape
    pad = 5
    buf = torch.full((C, V + pad), float("nan"), device=DEVICE)
    buf[:, :V] = z.to(DEVICE)
    zd = buf[:, :V]
    assert zd.stride(0) == V + pad
    labels_d = labels.to(DEVICE)
    out = torch.full((3 * C + 2,), float("nan"), device=DEVICE)
    logprobs, entropy, lse = out[1 : C + 1], out[C + 1 : 2 * C + 1], out[2 * C + 1 : 3 * C + 1]
    inv_temp = 1.0 / temperature
    rows_mod.rows_forward(
        zd,
        labels_d,
        inv_temp,
        ignore_index,
        logprobs,
        entropy if with_entropy else None,
        lse,
        block_v=block_v,
    )
    assert torch.isnan(out[0]) and torch.isnan(out[-1]), "forward wrote outside its outputs"
    if not with_entropy:
        assert torch.isnan(entropy).all(), "entropy_out=None still wrote entropy"
    assert torch.equal(buf[:, :V].cpu(), z), "forward modified z"

    g_d = g.to(DEVICE)
    h_d = None if h is None else h.to(DEVICE)
    ent_arg = entropy if (with_entropy and h is not None) else None
    rows_mod.rows_backward_(
        zd, labels_d, lse, ent_arg, g_d, h_d, inv_temp, ignore_index, block_v=block_v
    )
    assert torch.isnan(buf[:, V:]).all(), "backward wrote past the end of a row"
    return (logprobs.cpu(), entropy.cpu() if with_entropy else None, lse.cpu(), zd.cpu().clone())


def _check_all(got, ref, labels, ignore_index, *, tag, grad_rtol=RTOL):
    logprobs, entropy, lse, grad = got
    r_lp, r_ent, r_lse, r_grad = ref
    for name, a in [("logprobs", logprobs), ("entropy", entropy), ("lse", lse), ("grad", grad)]:
        if a is not None:
            assert not torch.isnan(a).any(), f"{tag}: NaN in {name}"
    assert _note("logprobs", _rel_err(logprobs, r_lp)) <= RTOL, tag
    assert _note("lse", _rel_err(lse, r_lse)) <= RTOL, tag
    if entropy is not None:
        assert _note("entropy", _rel_err(entropy, r_ent)) <= RTOL, tag
    assert (
        _note("grad" if grad_rtol == RTOL else "grad (offset)", _rel_err(grad, r_grad)) <= grad_rtol
    ), tag
    ignored = labels == ignore_index
    assert torch.all(logprobs[ignored] == 0), tag
    if entropy is not None:
        assert torch.all(entropy[ignored] == 0), tag
    assert torch.all(grad[ignored] == 0), tag


# ----------------------------------------------------------------------------- tests


def test_reference_matches_autograd(fresh_seed):
    """The hand-written float64 reference agrees with torch autograd on ordinary rows."""
    C, V, T = 6, 37, 0.7
    z, labels = _make_inputs(C, V)
    g, h = torch.randn(C), torch.randn(C)
    r_lp, r_ent, r_lse, r_grad = _reference(z, labels, T, -100, g, h)

    zz = z.double().requires_grad_()
    logp = torch.log_softmax(zz / T, dim=-1)
    valid = labels != -100
    lp = torch.where(valid, logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1), 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(1), 0.0)
    (lp * g.double() + ent * h.double()).sum().backward()
    torch.testing.assert_close(r_lp, lp.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(r_ent, ent.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(r_lse, torch.logsumexp(zz.detach() / T, -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(r_grad, zz.grad, rtol=1e-10, atol=1e-12)


SHAPES = [  # C, V, block_v, temperature, ignore_index
    (7, 1003, 128, 0.7, -100),  # 8 tiles, ragged tail
    (5, 37, 16, 1.3, -1),  # 3 tiles, custom ignore_index
    (3, 4099, 1024, 1.0, -100),  # tail of 3 columns
    (4, 4099, None, 0.7, -100),  # default tile (4096)
    (1, 37, None, 0.7, -100),  # C = 1, one tile
]
MODES = {  # with entropy_out, with grad_entropy
    "entropy+grad_entropy": (True, True),
    "entropy, grad_entropy=None": (True, False),
    "entropy_out=None": (False, False),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("C,V,block_v,T,ignore_index", SHAPES)
def test_rows_match_float64(C, V, block_v, T, ignore_index, mode, fresh_seed):
    with_entropy, with_h = MODES[mode]
    z, labels = _make_inputs(C, V, ignore_index=ignore_index)
    g = torch.randn(C)
    h = torch.randn(C) if with_h else None
    got = _run(z, labels, T, ignore_index, g, h, with_entropy=with_entropy, block_v=block_v)
    ref = _reference(z, labels, T, ignore_index, g, h)
    _check_all(got, ref, labels, ignore_index, tag=f"seed {fresh_seed}")


@pytest.mark.parametrize("grads", ["logprobs", "entropy", "both"])
@pytest.mark.parametrize("margin", [15.0, 30.0])
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_confident_rows(T, margin, grads, fresh_seed):
    """Label logit `margin` above every other one (p_y ≥ 0.999): the label entry of the
    gradient, the log-prob and the entropy keep a small *relative* error."""
    C, V, block_v = 6, 1003, 128
    z, labels = _make_inputs(C, V, frac_ignored=0.0, scale=1.0)  # keeps |x| < 64
    rows = torch.arange(C)
    z[rows, labels] = z.max(1).values + margin
    g = torch.zeros(C) if grads == "entropy" else torch.randn(C)
    h = None if grads == "logprobs" else torch.randn(C)
    got = _run(z, labels, T, -100, g, h, block_v=block_v)
    ref = _reference(z, labels, T, -100, g, h)
    assert torch.all(ref[0].exp() >= 0.999)
    tag = f"seed {fresh_seed}"
    _check_all(got, ref, labels, -100, tag=tag)

    def per_elem(a, b, scale=None):
        return ((a.double() - b).abs() / (b.abs() if scale is None else scale)).max().item()

    # The label entry is (g·S − h·p_y·(log p_y + H)) / T; its two terms may cancel, so its
    # error is measured against the sum of their magnitudes (= |entry| when one is absent).
    r_lp, r_ent = ref[0], ref[1]
    s_other = -torch.expm1(r_lp)
    term_h = 0.0 if h is None else (h.double() * r_lp.exp() * (r_lp + r_ent)).abs()
    label_scale = ((g.double() * s_other).abs() + term_h) / T
    label_got, label_ref = got[3][rows, labels], ref[3][rows, labels]
    assert (
        _note("confident: label grad (per elem)", per_elem(label_got, label_ref, label_scale))
        <= LABEL_RTOL
    ), tag
    assert _note("confident: logprob (per elem)", per_elem(got[0], ref[0])) <= LABEL_RTOL, tag
    assert _note("confident: entropy (per elem)", per_elem(got[1], ref[1])) <= LABEL_RTOL, tag


def test_neg_inf_entries(fresh_seed):
    """−inf logits (masked vocab): finite outputs, no NaN, exact zero gradient there."""
    C, V, block_v, T = 6, 1003, 64, 0.7
    z, labels = _make_inputs(C, V)
    labels[:5] = torch.randint(3 * block_v, V, (5,))  # valid labels past tile 3
    z[torch.rand(C, V) < 0.3] = float("-inf")
    z[1, : 3 * block_v] = float("-inf")  # m stays −inf for 3 tiles
    z[2] = float("-inf")
    z[2, torch.randint(0, V, (4,))] = torch.randn(4)  # a few finite entries ...
    z[3] = float("-inf")  # only the label is finite:
    rows = torch.arange(C)  # p_y = 1, H = 0
    z[rows, labels.clamp(min=0)] = torch.randn(C)  # labels themselves finite
    g, h = torch.randn(C), torch.randn(C)
    got = _run(z, labels, T, -100, g, h, block_v=block_v)
    ref = _reference(z, labels, T, -100, g, h)
    _check_all(got, ref, labels, -100, tag=f"seed {fresh_seed}")
    assert torch.isfinite(got[1]).all() and torch.isfinite(got[3]).all()
    assert torch.all(got[3][torch.isinf(z)] == 0)
    assert got[0][3] == 0 and got[1][3] == 0 and torch.all(got[3][3] == 0)


def test_tied_logits(fresh_seed):
    """Many entries equal to the row max, within a tile and across tiles (e.g. identical
    padding rows of the LM head): the online sum must count each of them once."""
    C, V, block_v, T = 5, 1003, 32, 0.7
    z, labels = _make_inputs(C, V)
    z = (z / 2).round()  # small integers: ties everywhere
    z[1] = 0.0  # uniform row: H = log V
    z[2, -3:] = z[2].max() + 1.0  # max tied only in the ragged tail
    z[3, ::block_v] = z[3].max() + 2.0  # one max per tile, first column
    g, h = torch.randn(C), torch.randn(C)
    got = _run(z, labels, T, -100, g, h, block_v=block_v)
    ref = _reference(z, labels, T, -100, g, h)
    _check_all(got, ref, labels, -100, tag=f"seed {fresh_seed}")


def test_large_common_offset(fresh_seed):
    """+1e4 on every logit of some rows: the forward stays at fp32 relative accuracy; the
    backward rebuilds p from the fp32 lse, so its error is bounded by ulp(lse)."""
    C, V, block_v, T = 6, 1003, 128, 0.7
    z, labels = _make_inputs(C, V)
    shifted = torch.tensor([True, False, True, False, True, False])
    z[shifted] += 1e4
    g, h = torch.randn(C), torch.randn(C)
    got = _run(z, labels, T, -100, g, h, block_v=block_v)
    ref = _reference(z, labels, T, -100, g, h)
    lse_max = ref[2].abs().max().item()
    ulp = torch.finfo(torch.float32).eps * 2.0 ** torch.tensor(lse_max).log2().floor().item()
    _check_all(got, ref, labels, -100, tag=f"seed {fresh_seed}", grad_rtol=2 * ulp + RTOL)
    # rows without the offset are unaffected by their neighbours
    plain = ~shifted
    assert _rel_err(got[3][plain], ref[3][plain]) <= RTOL


def test_all_rows_ignored(fresh_seed):
    C, V, T = 3, 37, 0.7
    z, labels = _make_inputs(C, V)
    labels[:] = -100
    g, h = torch.randn(C), torch.randn(C)
    got = _run(z, labels, T, -100, g, h, block_v=16)
    ref = _reference(z, labels, T, -100, g, h)
    assert torch.all(got[0] == 0) and torch.all(got[1] == 0) and torch.all(got[3] == 0)
    assert _rel_err(got[2], ref[2]) <= RTOL  # lse is still written


def test_argument_errors():
    z, labels = torch.randn(2, 5), torch.zeros(2, dtype=torch.int64)
    vec = torch.zeros(2)
    with pytest.raises(ValueError, match="entropy"):
        rows_mod.rows_backward_(z, labels, vec, None, vec, vec, 1.0, -100)
    with pytest.raises(ValueError, match="block_v"):
        rows_mod.rows_forward(z, labels, 1.0, -100, vec, vec, vec.clone(), block_v=48)
    with pytest.raises(ValueError, match="z"):
        rows_mod.rows_forward(z.double(), labels, 1.0, -100, vec, vec, vec.clone())
    with pytest.raises(ValueError, match="labels"):
        rows_mod.rows_forward(z, labels.int(), 1.0, -100, vec, vec, vec.clone())
