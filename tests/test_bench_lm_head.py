"""The LM-head benchmark's parts (benches/bench_logprobs.py and its _lm_head_* modules) on
the CPU: paired per-round ratios, the baselines against areal_fast's fused loss, the
warm-up's effect on the compiled baselines, and the marks of a case that fell back or
materialised the logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

import _lm_head_baselines as baselines  # noqa: E402
import _lm_head_inprocess as inprocess  # noqa: E402
import _lm_head_ops as ops  # noqa: E402
import bench_logprobs  # noqa: E402


def test_paired_ratios_are_computed_round_by_round():
    # the README's example: one timed call per round, ours / naive = 1.05, 0.90, 0.94
    ours = {"round_times_s": [[10.5], [9.0], [9.4]]}
    naive = {"round_times_s": [[10.0], [10.0], [10.0]]}
    paired = ops.paired_time_ratios(ours, naive)
    assert paired["per_round"] == pytest.approx([1.05, 0.90, 0.94])
    assert paired["median"] == pytest.approx(0.94)
    assert (paired["min"], paired["max"]) == pytest.approx((0.90, 1.05))
    # a failed round is left out; fewer than two paired rounds give none
    assert ops.paired_time_ratios({"round_times_s": [[1.0], None, [2.0]]}, naive)["per_round"] == [
        0.1,
        0.2,
    ]
    assert ops.paired_time_ratios({"round_times_s": [[1.0], None]}, naive) is None
    assert ops.paired_time_ratios({"times_s": [1.0]}, naive) is None


def test_rounds_keep_their_times_and_the_table_shows_paired_ratios():
    rec = {"times_s": [10.5], "round_times_s": [[10.5]], "loadavg_rounds": [[0, 0]]}
    for later in ([9.0], [9.4]):
        bench_logprobs._merge_round(rec, {"times_s": later})
    bench_logprobs._merge_round(rec, {"error": "killed"})
    assert rec["round_times_s"] == [[10.5], [9.0], [9.4], None]
    assert rec["times_s"] == [10.5, 9.0, 9.4] and rec["round_errors"] == ["killed"]
    entry = ops.shape_entry((64, 16, 101), "float32", grad_bytes=4)
    naive = {"round_times_s": [[10.0], [10.0], [10.0], [10.0]], "times_s": [10.0] * 4}
    for record in (rec, naive):
        record.update(hx_summary(record["times_s"]), extra_peak_mb=1.0, extra_peak_mb_warm=1.0)
    entry["modes"]["fwd_bwd"] = {"ours": rec, "naive": naive}
    ops.add_ratios(entry, (64, 16, 101), "fwd_bwd")
    assert rec["time_ratio_vs_naive"] == pytest.approx(0.94)
    assert rec["paired_time_ratio_vs_naive"]["per_round"] == pytest.approx([1.05, 0.9, 0.94])
    data = {"metadata": {"date": "2026-12-04", "torch": "x", "device": "cpu"}, "results": [entry]}
    table = bench_logprobs.render_table(data)
    assert "paired / naive(_loss)" in table and "0.94 [0.9–1.05]" in table


def hx_summary(times):
    import _harness

    return _harness.summarize_times(times)


def _inputs():
    return ops.make_inputs((64, 16, 101), "float32", "cpu", 0, with_loss=True)


@pytest.mark.parametrize("impl", ["compiled_loss", "ours_loss"])
def test_baselines_compute_the_fused_loss(impl):
    inputs = _inputs()
    fused, reset = ops.build_op("fused_loss", "fwd_bwd", inputs)
    want = fused()
    grads = (inputs["hidden"].grad.clone(), inputs["weight"].grad.clone())
    reset()
    options = ops.OpOptions(compile_backend="eager", chunk_tokens=24)  # 3 chunks, one short
    fn, reset = ops.build_op(impl, "fwd_bwd", inputs, options)
    got = fn()
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(inputs["hidden"].grad, grads[0], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(inputs["weight"].grad, grads[1], rtol=1e-4, atol=1e-7)


def test_torch_linear_cross_entropy_in_the_form_this_torch_has():
    inputs = _inputs()
    try:
        fn, variant = baselines.torch_lce_logprobs_fn(
            inputs["hidden"], inputs["weight"], inputs["labels"]
        )
    except baselines.Skip as exc:
        assert "has no torch.nn.functional.linear_cross_entropy" in str(exc)
        return
    assert variant in ("chunked", "reference")
    with torch.no_grad():
        naive = ops._naive_logprobs(inputs["hidden"], inputs["weight"], inputs["labels"])
        torch.testing.assert_close(fn(), naive, rtol=1e-5, atol=1e-5)


def test_clip_bounds_take_eps_clip_high_or_eps_clip():
    import areal_fast as af

    assert baselines.clip_bounds(af.LossConfig()) == pytest.approx((0.8, 1.2))
    assert baselines.clip_bounds(af.LossConfig(eps_clip_high=0.28)) == pytest.approx((0.8, 1.28))


class _Args:
    compile_backend = "inductor"


def test_the_warm_up_decides_how_the_compiled_baselines_run():
    # no warm-up run: both compile in the timed run
    options, note = inprocess.options_for("liger_grpo", _Args(), None)
    assert options.liger_compiled and note is None
    ok = {"impls": {"liger_grpo": {"compiled": True}, "compiled_loss": {"compiled": True}}}
    assert inprocess.options_for("liger_grpo", _Args(), ok)[0].liger_compiled
    assert inprocess.options_for("compiled_loss", _Args(), ok)[1] is None
    # the warm-up failed or never finished: Liger eager, said so; compiled_loss not timed
    failed = {"impls": {"liger_grpo": {"compiled": True, "error": "RuntimeError: boom"}}}
    options, note = inprocess.options_for("liger_grpo", _Args(), failed)
    assert not options.liger_compiled and "compiled=False" in note and "boom" in note
    unfinished = inprocess.read_warmup("/nonexistent/warmup.json")
    assert unfinished["finished"] is False
    with pytest.raises(baselines.Skip, match="did not run or did not finish"):
        inprocess.options_for("compiled_loss", _Args(), unfinished)
    # other implementations ignore the warm-up
    assert inprocess.options_for("fused_loss", _Args(), unfinished)[1] is None


def test_a_case_is_marked_when_it_fell_back_or_materialised_the_logits():
    entry = {"grad_buffers_mb": 10.0, "logits_mb": 100.0}
    rec = {"extra_peak_mb": 105.0, "info": {"path": "triton"}}
    inprocess.mark_case(rec, entry, "fwd", ["UserWarning: something else"], cuda=True)
    assert not rec["fell_back"] and rec["materialised_logits"]
    assert rec["warnings"] == ["UserWarning: something else"]
    rec = {"extra_peak_mb": 105.0, "info": {"path": "torch"}}  # gradients discounted
    inprocess.mark_case(rec, entry, "fwd_bwd", [], cuda=True)
    assert rec["fell_back"] and not rec["materialised_logits"]
    assert rec["fallback_reasons"] == ["areal_fast ran its torch row path, not Triton"]
    rec = {"info": {"path": "native"}}  # the CPU's fast path is not Triton: no mark there
    messages = ["RuntimeWarning: areal_fast segment_sum CUDA kernel failed (x); using torch"]
    inprocess.mark_case(rec, entry, "fwd", messages, cuda=False)
    assert rec["fell_back"] and rec["fallback_reasons"] == messages
    rec = {"info": {"fallback": "compiled=True raised RuntimeError: x"}}
    inprocess.mark_case(rec, entry, "fwd_bwd", [], cuda=True)
    assert rec["fell_back"]


def test_fallback_reasons_read_the_warnings():
    messages = [
        "UserWarning: linear_cross_entropy falls back to the reference implementation",
        "RuntimeWarning: areal_fast native extension is unavailable",
        "UserWarning: TensorFloat32 tensor cores are available but not enabled",
    ]
    assert baselines.fallback_reasons(messages) == messages[:2]


def test_in_process_run_on_the_cpu(tmp_path):
    """The CUDA run's orchestration on the CPU: every case recorded, the JSON written."""
    out = tmp_path / "lm.json"
    argv = ["--device", "cpu", "--in-process", "--shape", "64,16,101", "--repeats", "2"]
    argv += ["--impls", "matmul,fused_loss,compiled_loss,naive", "--compile-backend", "eager"]
    assert bench_logprobs.main([*argv, "--json", str(out)]) == 0
    data = bench_logprobs.json.loads(out.read_text())
    modes = data["results"][0]["modes"]
    assert set(modes["fwd"]) == {"matmul", "fused_loss", "naive"}
    assert set(modes["fwd_bwd"]) == {"fused_loss", "compiled_loss", "naive"}
    for cases in modes.values():
        for rec in cases.values():
            assert rec["n"] >= 1 and "fell_back" in rec and rec["first_call_s"] > 0
    assert data["metadata"]["orchestration"] == "in_process"


def test_warmup_only_takes_the_compiled_baselines():
    with pytest.raises(SystemExit):
        bench_logprobs.parse_args(
            ["--device", "cpu", "--in-process", "--warmup-only", "--impls", "naive"]
        )
    with pytest.raises(SystemExit):  # in CPU children there is no warm-up to share
        bench_logprobs.parse_args(["--device", "cpu", "--warmup-only"])
    args = bench_logprobs.parse_args(["--device", "cpu", "--in-process", "--warmup-only"])
    assert args.impls == ["compiled_loss", "liger_grpo"]
