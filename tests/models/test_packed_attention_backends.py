"""Backends of the packed attention: each against explicit per-sequence attention, and the
choice between them (``AREAL_FAST_ATTN``).

On the CPU the varlen kernels cannot run; their callers are checked in float64 against
stand-ins with the signatures of flash-attn's ``flash_attn_varlen_func`` and of torch's
``varlen_attn`` (old and new keywords). On CUDA every available backend is compared in
bfloat16 with per-sequence SDPA.
"""

import pytest
import torch

from areal_fast.models import attention_backends as ab
from areal_fast.models import packed_attention as pa
from areal_fast.models.loading import load_causal_lm
from areal_fast.models.packed_attention import (
    PACKED_ATTENTION,
    host_boundaries,
    packed_attention_forward,
    per_sequence_sdpa,
    register_packed_attention,
)
from areal_fast.rl.batch import Trajectory, pack_trajectories
from areal_fast.train.torch_engine import packed_forward_logprobs

LENGTH_SETS = [[5, 1, 0, 17, 2, 0, 9], [1], [0, 3], [0, 0], []]
CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _cu(lengths, device="cpu"):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0) if lengths else cu[1:]
    return cu.to(device)


def _qkv(lengths, heads=4, kv_heads=2, dim=8, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    shapes = [(1, heads, total, dim), (1, kv_heads, total, dim), (1, kv_heads, total, dim)]
    return [
        torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
        for s in shapes
    ]


def naive_attention(query, key, value, lengths, scale=None):
    """Each sequence alone: softmax(q·kᵀ·scale, causal) · v, key/value heads repeated.
    [1, H, T, D] in, [1, T, H, D] out."""
    groups = query.shape[1] // key.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    pieces, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        scores = query[0, :, sl] @ k[0, :, sl].transpose(-1, -2) * scale
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        pieces.append(scores.masked_fill(future, float("-inf")).softmax(-1) @ v[0, :, sl])
        start += n
    out = torch.cat(pieces, dim=1) if pieces else query[0, :, :0] * 0
    return out.transpose(0, 1)[None]


def _grads(out, inputs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    upstream = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out)
    return torch.autograd.grad(out, inputs, upstream, allow_unused=True)


def _eval_module():
    return torch.nn.Module().eval()


# ---------------------------------------------------------------------------
# Stand-ins for the varlen kernels: [T, H, D] in and out, per-sequence SDPA inside
# ---------------------------------------------------------------------------


def _sdpa_thd(query, key, value, cu, scale=None):
    bounds = cu.tolist()
    out = per_sequence_sdpa(
        *(t.transpose(0, 1)[None] for t in (query, key, value)), bounds, scale=scale
    )
    return out[0].transpose(0, 1)


class Recorder:
    def __init__(self):
        self.calls = []


def make_fake_flash(rec):
    def flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False,
        window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
        return_attn_probs=False, block_table=None,
    ):  # fmt: skip
        assert causal and dropout_p == 0.0 and cu_q is cu_k and max_q == max_k
        rec.calls.append(dict(cu=cu_q, max_q=max_q, scale=softmax_scale, shape=q.shape))
        return _sdpa_thd(q, k, v, cu_q, softmax_scale)

    return flash_attn_varlen_func


def make_fake_varlen_new(rec):
    """torch >= 2.11: keyword-only scale, window_size, enable_gqa."""

    def varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
        window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
        num_splits=None,
    ):  # fmt: skip
        assert window_size == (-1, 0) and isinstance(window_size, tuple)
        assert enable_gqa == (key.shape[1] != query.shape[1])
        rec.calls.append(dict(cu=cu_seq_q, max_q=max_q, scale=scale, shape=query.shape))
        return _sdpa_thd(query, key, value, cu_seq_q, scale)

    return varlen_attn


def make_fake_varlen_old(rec):
    """torch 2.9/2.10: is_causal, no scale, no enable_gqa."""

    def varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None
    ):
        assert is_causal and key.shape[1] == query.shape[1]
        rec.calls.append(dict(cu=cu_seq_q, max_q=max_q, scale=None, shape=query.shape))
        return _sdpa_thd(query, key, value, cu_seq_q)

    return varlen_attn


FAKES = {
    "flash_attn": ("load_flash_attn", make_fake_flash),
    "varlen_new": ("load_torch_varlen", make_fake_varlen_new),
    "varlen_old": ("load_torch_varlen", make_fake_varlen_old),
}


def _force(monkeypatch, name, rec):
    """Route packed_attention_forward to the stand-in ``name`` and forbid host reads."""
    loader, make = FAKES[name]
    fake = make(rec)
    monkeypatch.setattr(ab, loader, lambda: fake)
    backend = "flash_attn" if name == "flash_attn" else "varlen"
    monkeypatch.setattr(pa, "choose_backend", lambda *a: backend)

    def no_host_read(cu):
        raise AssertionError("a varlen backend read the boundaries back")

    monkeypatch.setattr(pa, "host_boundaries", no_host_read)


# ---------------------------------------------------------------------------
# CPU, float64
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", LENGTH_SETS)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_sdpa_path_equals_explicit_attention(lengths, kv_heads, scale, monkeypatch):
    monkeypatch.delenv(ab.ATTN_ENV, raising=False)
    q, k, v = _qkv(lengths, kv_heads=kv_heads)
    out, none = packed_attention_forward(
        _eval_module(), q, k, v, None, scaling=scale, cu_seq_lens_q=_cu(lengths)
    )
    ref = naive_attention(q, k, v, lengths, scale)
    assert none is None and out.shape == (1, sum(lengths), 4, 8) and out.is_contiguous()
    if not out.numel():
        return
    assert (out - ref).abs().max().item() <= 1e-12
    for g, r in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        assert (g - r).abs().max().item() <= 1e-12


@pytest.mark.parametrize("fake", list(FAKES))
@pytest.mark.parametrize("lengths", LENGTH_SETS[:3])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_varlen_callers_equal_explicit_attention(fake, lengths, kv_heads, scale, monkeypatch):
    rec = Recorder()
    _force(monkeypatch, fake, rec)
    q, k, v = _qkv(lengths, kv_heads=kv_heads)
    cu = _cu(lengths).to(torch.int64)  # the caller hands the kernels int32
    out, _ = packed_attention_forward(
        _eval_module(), q, k, v, None, scaling=scale, cu_seq_lens_q=cu, max_length_q=max(lengths)
    )
    ref = naive_attention(q, k, v, lengths, scale)
    assert out.shape == ref.shape and (out - ref).abs().max().item() <= 1e-12
    for g, r in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        assert (g - r).abs().max().item() <= 1e-12
    (call,) = rec.calls
    assert call["max_q"] == max(lengths) and call["cu"].dtype == torch.int32
    assert call["cu"].tolist() == cu.tolist() and call["shape"] == (sum(lengths), 4, 8)
    if fake != "varlen_old":
        assert call["scale"] == scale


def test_varlen_caller_returns_empty_batch_without_a_launch(monkeypatch):
    rec = Recorder()
    _force(monkeypatch, "varlen_new", rec)
    q, k, v = _qkv([0, 0])
    out, _ = packed_attention_forward(
        _eval_module(), q, k, v, None, cu_seq_lens_q=_cu([0, 0]), max_length_q=0
    )
    assert out.shape == (1, 0, 4, 8) and rec.calls == []


def test_varlen_caller_checks_sliding_window_on_host_length(monkeypatch):
    _force(monkeypatch, "flash_attn", Recorder())
    q, k, v = _qkv([3, 7])
    kwargs = dict(cu_seq_lens_q=_cu([3, 7]), max_length_q=7)
    out, _ = packed_attention_forward(_eval_module(), q, k, v, None, sliding_window=7, **kwargs)
    assert out.shape == (1, 10, 4, 8)
    with pytest.raises(ValueError, match="7 tokens exceeds the model's sliding window of 6"):
        packed_attention_forward(_eval_module(), q, k, v, None, sliding_window=6, **kwargs)
    with pytest.raises(ValueError, match="soft-capping"):
        packed_attention_forward(_eval_module(), q, k, v, None, softcap=30.0, **kwargs)


def test_hf_model_passes_host_max_length_to_the_kernel(tiny_model_dir, monkeypatch):
    """Through a transformers decoder: the kernel receives PackedBatch.max_seqlen, nothing
    is read back, and the log-probs equal those of the per-sequence SDPA (float64)."""
    model = load_causal_lm(str(tiny_model_dir)).double()
    model.set_attn_implementation(register_packed_attention())
    gen = torch.Generator().manual_seed(0)
    lengths = [6, 2, 13, 1]
    trajs = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
        p = 1
        trajs.append(Trajectory(ids[:p], ids[p:], [0.0] * (n - p), [0] * (n - p), "stop", i))
    batch = pack_trajectories(trajs, torch.zeros(len(trajs)))
    assert batch.max_seqlen == 13
    with torch.no_grad():
        monkeypatch.delenv(ab.ATTN_ENV, raising=False)
        ref, _ = packed_forward_logprobs(model, batch, 1.0, with_entropy=False)
        rec = Recorder()
        _force(monkeypatch, "varlen_new", rec)
        got, _ = packed_forward_logprobs(model, batch, 1.0, with_entropy=False)
    assert len(rec.calls) == model.config.num_hidden_layers
    assert all(c["max_q"] == 13 for c in rec.calls)
    assert (got - ref).abs().max().item() <= 1e-10


def test_host_boundaries_read_once_per_tensor():
    cu = _cu([3, 0, 5])
    reads = []
    real = cu.tolist
    cu.tolist = lambda: reads.append(1) or real()
    assert host_boundaries(cu) == ([0, 3, 3, 8], 5)
    assert host_boundaries(cu) == ([0, 3, 3, 8], 5) and len(reads) == 1
    cu[3] = 4  # an in-place change is seen
    assert host_boundaries(cu) == ([0, 3, 3, 4], 3) and len(reads) == 2
    other = _cu([3, 0, 5])
    assert host_boundaries(other) == ([0, 3, 3, 8], 5)
    assert host_boundaries(_cu([])) == ([0], 0)


# ---------------------------------------------------------------------------
# Dispatch (CPU, availability monkeypatched)
# ---------------------------------------------------------------------------

GPU = torch.device("cuda", 0)
BF16 = torch.bfloat16


def _available(monkeypatch, flash=True, varlen=True, varlen_fake=make_fake_varlen_new):
    rec = Recorder()
    monkeypatch.setattr(ab, "load_flash_attn", lambda: make_fake_flash(rec) if flash else None)
    monkeypatch.setattr(ab, "load_torch_varlen", lambda: varlen_fake(rec) if varlen else None)
    monkeypatch.setattr(ab, "cuda_capability_ok", lambda index: True)
    monkeypatch.delenv(ab.ATTN_ENV, raising=False)


def test_auto_prefers_flash_attn_then_varlen_then_sdpa(monkeypatch):
    _available(monkeypatch)
    assert ab.choose_backend(GPU, BF16, 64, 0.0) == "flash_attn"
    assert ab.choose_backend(GPU, torch.float16, 128, 0.1) == "flash_attn"
    _available(monkeypatch, flash=False)
    assert ab.choose_backend(GPU, BF16, 64, 0.0) == "varlen"
    assert ab.choose_backend(GPU, BF16, 64, 0.1) == "sdpa"  # varlen_attn has no dropout
    _available(monkeypatch, flash=False, varlen_fake=make_fake_varlen_old)
    assert ab.choose_backend(GPU, BF16, 64, 0.0) == "varlen"
    _available(monkeypatch, flash=False, varlen=False)
    assert ab.choose_backend(GPU, BF16, 64, 0.0) == "sdpa"


@pytest.mark.parametrize(
    "device,dtype,head_dim",
    [
        (torch.device("cpu"), BF16, 64),
        (torch.device("cpu"), torch.float64, 64),
        (GPU, torch.float32, 64),
        (GPU, BF16, 12),
        (GPU, BF16, 512),
    ],
)
def test_auto_falls_back_to_sdpa_where_no_kernel_fits(monkeypatch, device, dtype, head_dim):
    _available(monkeypatch)
    assert ab.choose_backend(device, dtype, head_dim, 0.0) == "sdpa"


def test_auto_on_old_gpu_is_sdpa(monkeypatch):
    _available(monkeypatch)
    monkeypatch.setattr(ab, "cuda_capability_ok", lambda index: False)
    assert ab.choose_backend(GPU, BF16, 64, 0.0) == "sdpa"


@pytest.mark.parametrize(
    "wanted,flash,varlen,device,dtype,dropout,message",
    [
        ("flash_attn", False, True, GPU, BF16, 0.0, "flash_attn package does not import"),
        ("varlen", True, False, GPU, BF16, 0.0, "has no torch.nn.attention.varlen"),
        ("varlen", True, True, GPU, BF16, 0.1, "no attention dropout"),
        ("varlen", True, True, torch.device("cpu"), BF16, 0.0, "CUDA only"),
        ("flash_attn", True, True, GPU, torch.float32, 0.0, "float16 or bfloat16"),
    ],
)
def test_forced_backend_that_cannot_run_raises(
    monkeypatch, wanted, flash, varlen, device, dtype, dropout, message
):
    _available(monkeypatch, flash=flash, varlen=varlen)
    monkeypatch.setenv(ab.ATTN_ENV, wanted)
    with pytest.raises(ValueError, match=f"AREAL_FAST_ATTN={wanted} cannot run: .*{message}"):
        ab.choose_backend(device, dtype, 64, dropout)


def test_forced_backends_that_can_run(monkeypatch):
    _available(monkeypatch)
    for wanted in ("flash_attn", "varlen", "sdpa"):
        monkeypatch.setenv(ab.ATTN_ENV, f" {wanted.upper()} ")
        assert ab.choose_backend(GPU, BF16, 64, 0.0) == wanted
    monkeypatch.setenv(ab.ATTN_ENV, "sdpa")
    assert ab.choose_backend(torch.device("cpu"), torch.float32, 12, 0.5) == "sdpa"


def test_varlen_without_a_causal_keyword_is_unavailable(monkeypatch):
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        raise AssertionError("not causal, never called")

    _available(monkeypatch, flash=False)
    monkeypatch.setattr(ab, "load_torch_varlen", lambda: varlen_attn)
    assert ab.choose_backend(GPU, BF16, 64, 0.0) == "sdpa"
    monkeypatch.setenv(ab.ATTN_ENV, "varlen")
    with pytest.raises(ValueError, match="neither window_size nor is_causal"):
        ab.choose_backend(GPU, BF16, 64, 0.0)


def test_bad_env_value_and_forced_kernel_on_cpu_tensors(monkeypatch):
    q, k, v = _qkv([2, 3])
    cu = _cu([2, 3])
    monkeypatch.setenv(ab.ATTN_ENV, "xformers")
    with pytest.raises(ValueError, match="AREAL_FAST_ATTN = 'xformers' is not one of"):
        packed_attention_forward(_eval_module(), q, k, v, None, cu_seq_lens_q=cu)
    monkeypatch.setenv(ab.ATTN_ENV, "flash_attn")
    with pytest.raises(ValueError, match="AREAL_FAST_ATTN=flash_attn cannot run"):
        packed_attention_forward(_eval_module(), q, k, v, None, cu_seq_lens_q=cu)


def test_cpu_tensors_under_auto_run_sdpa_even_with_kernels_present(monkeypatch):
    _available(monkeypatch)
    monkeypatch.setattr(pa, "flash_attn_packed", None)  # would fail if called
    monkeypatch.setattr(pa, "torch_varlen_packed", None)
    q, k, v = _qkv([4, 1])
    out, _ = packed_attention_forward(_eval_module(), q, k, v, None, cu_seq_lens_q=_cu([4, 1]))
    assert (out - naive_attention(q, k, v, [4, 1])).abs().max().item() <= 1e-12


def test_registered_name():
    assert register_packed_attention() == PACKED_ATTENTION


# ---------------------------------------------------------------------------
# CUDA, bfloat16
# ---------------------------------------------------------------------------

GPU_LENGTHS = [1, 0, 37, 129, 3, 0, 64, 255, 2]


def _gpu_case(heads=8, kv_heads=2, dim=64):
    q, k, v = _qkv(GPU_LENGTHS, heads, kv_heads, dim, dtype=BF16, device="cuda")
    cu = _cu(GPU_LENGTHS, "cuda")
    return q, k, v, cu


def _skip_unless_runs(backend, dim=64, dropout=0.0):
    if backend == "flash_attn" and ab.load_flash_attn() is None:
        pytest.skip("flash_attn does not import")
    reason = ab.unavailable_reason(backend, torch.device("cuda"), BF16, dim, dropout)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("backend", ["flash_attn", "varlen", "sdpa"])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_cuda_backend_equals_per_sequence_sdpa_bf16(backend, kv_heads, monkeypatch):
    _skip_unless_runs(backend)
    monkeypatch.setenv(ab.ATTN_ENV, backend)
    q, k, v, cu = _gpu_case(kv_heads=kv_heads)
    out, _ = packed_attention_forward(
        _eval_module(), q, k, v, None, cu_seq_lens_q=cu, max_length_q=max(GPU_LENGTHS)
    )
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    bounds = cu.tolist()
    ref = per_sequence_sdpa(*ref_inputs, bounds).transpose(1, 2)
    assert out.dtype == BF16 and out.shape == ref.shape
    assert (out.float() - ref).abs().max().item() <= 2e-2
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).cuda()
    grads = torch.autograd.grad(out, (q, k, v), upstream.to(BF16))
    ref_grads = torch.autograd.grad(ref, ref_inputs, upstream)
    for g, r in zip(grads, ref_grads):
        assert (g.float() - r).abs().max().item() <= 3e-2 * r.abs().max().item()


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("backend", ["flash_attn", "varlen"])
def test_cuda_varlen_backends_never_synchronise(backend, monkeypatch):
    _skip_unless_runs(backend)
    monkeypatch.setenv(ab.ATTN_ENV, backend)
    q, k, v, cu = _gpu_case()

    def step():
        out, _ = packed_attention_forward(
            _eval_module(), q, k, v, None, cu_seq_lens_q=cu, max_length_q=max(GPU_LENGTHS)
        )
        out.float().square().sum().backward()

    step()  # warm-up (lazy initialisation may synchronise)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.cuda
@requires_cuda
def test_cuda_auto_picks_the_first_runnable_varlen_kernel(monkeypatch):
    monkeypatch.delenv(ab.ATTN_ENV, raising=False)
    device = torch.device("cuda")
    runnable = [
        b for b in ab.VARLEN_BACKENDS if ab.unavailable_reason(b, device, BF16, 128, 0.0) is None
    ]
    assert ab.choose_backend(device, BF16, 128, 0.0) == (runnable + ["sdpa"])[0]
    if ab.load_torch_varlen() is not None and ab.cuda_capability_ok(None):
        assert runnable, "torch has varlen_attn but no varlen kernel was found runnable"
    assert ab.choose_backend(device, torch.float32, 128, 0.0) == "sdpa"
