"""The closing table of benches/gpu_check.sh (benches/gpu_check_summary.py) on made-up
results: every goal met, every goal missed, the FSDP comparison, fallen-back and
materialising cases, Liger not compiled, a test run cut at its budget, missing sections."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

import gpu_check_summary as summary  # noqa: E402

SECTIONS = (
    "preflight", "build", "lm_head_warmup", "lm_head", "train_1p5b", "fsdp_nccl", "attention",
    "ipc_sync", "tests", "source_pkgs", "demo_job",
)  # fmt: skip
K1 = "K1 fused loss fwd+bwd: model FLOP rate / measured bf16 mm rate"
VS_COMPILED = "K1 fused loss fwd+bwd time / torch.compile'd chunked loss"
VS_LIGER = "K1 fused loss fwd+bwd time / Liger LigerFusedLinearGRPOLoss"
MEMORY = "K1 fused loss fwd+bwd extra peak memory / Liger's"
LIGER_COMPILED = "Liger ran compiled (torch.compile)"
MFU = "1.5B Qwen2 train step: MFU vs bf16 dense peak"
GRAD = "FSDP2 one rank: first gradient norm / plain engine's"
LOGPROBS = "FSDP2 one rank: recomputed behaviour log-probs vs plain engine's"
TESTS = "GPU tests (pytest -m cuda, -W error::RuntimeWarning)"


def _case(seconds, mb=100.0, **extra):
    return {"median_s": seconds, "extra_peak_mb": mb, "fell_back": False, **extra}


def _lm_head(fused_s=0.1, compiled_s=0.15, liger_s=0.2, mm_s=0.04, fused_mb=500.0, **fused):
    T, H, V = summary.LM_HEAD_SHAPE
    return {
        "results": [
            {
                "T": T,
                "H": H,
                "V": V,
                "modes": {
                    "fwd": {"matmul": _case(mm_s), "fused_loss": _case(mm_s * 1.2)},
                    "fwd_bwd": {
                        "fused_loss": _case(fused_s, fused_mb, **fused),
                        "compiled_loss": _case(compiled_s, 700.0),
                        "liger_grpo": _case(liger_s, 900.0, liger_compiled=True),
                        "torch_lce": {"impl": "torch_lce", "skipped": "torch 2.11 has none"},
                        "naive": _case(0.5, 30000.0, materialised_logits=True),
                    },
                },
            }
        ]
    }


def _train(mfu=0.45, grad_norm=3.5, values=(-11.9, -12.1), checksum=123.0):
    return {
        "mfu_vs_peak": mfu,
        "mfu_vs_measured_matmul": mfu * 1.25,
        "matmul_tflops_measured": 790.0,
        "model_tflops_per_s": mfu * 989.4,
        "peak_tflops": 989.4,
        "tokens_per_s": 50000.0,
        "median_step_s": 0.3,
        "precision": "mixed",
        "losses": [-0.01, 0.012],
        "grad_norms": [grad_norm, 3.1],
        "weights_checksum": checksum,
        "behav_logprobs_sample": {"positions": [3, 70], "values": list(values)},
        "checks": {"finite_loss": True},
    }


def _write(out: Path, lm_head=None, plain=None, fsdp=None, rows=None, budget=None) -> Path:
    out.mkdir()
    (out / "sections.tsv").write_text(
        "".join(f"{name}\t{(rows or {}).get(name, 0)}\t10\t60\n" for name in SECTIONS)
    )
    versions = {
        "python": "3.12.3", "torch": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0",
        "transformers": "5.17.0", "nvidia_smi": "NVIDIA H200, 580.159.04, 143771 MiB",
        "nvcc": "Build cuda_13.0", "gpu": "NVIDIA H200", "free_gib": 139.0, "total_gib": 140.4,
        "linear_cross_entropy": "absent",
    }  # fmt: skip
    pre = {"versions": versions, "install": {"installed": ["a.whl"], "failed": {}}}
    pre.update(imports={"liger_kernel": None}, sources=["pycosat-0.6.6.tar.gz"])
    (out / "preflight.json").write_text(json.dumps(pre))
    (out / "build_info.json").write_text(
        json.dumps({"cuda": True, "cuda_architectures": "90-real"})
    )
    (out / "bench_logprobs_cuda.json").write_text(json.dumps(lm_head or _lm_head()))
    (out / "train_step_1p5b.json").write_text(json.dumps(plain or _train()))
    (out / "train_step_fsdp.json").write_text(json.dumps(fsdp or _train(grad_norm=3.51)))
    (out / "weight_sync_ipc.json").write_text(
        json.dumps(
            {
                "models": {
                    "1.5b": {"transport": "cuda-ipc", "seconds": {"bucketed": 0.02}, "gbytes": 3.09}
                }
            }
        )
    )
    attn = {"rows": [{"backend": "varlen", "mode": "fwd", "speedup": 4.2}]}
    (out / "bench_attention.json").write_text(json.dumps(attn))
    (out / "tests.xml").write_text(
        '<testsuites><testsuite tests="10" failures="0" errors="0" skipped="2"/></testsuites>'
    )
    (out / "tests_budget.json").write_text(
        json.dumps(
            budget or {"stopped": False, "interrupted": False, "started": 10, "collected": 10}
        )
    )
    (out / "demo_summary.json").write_text(
        json.dumps({"steps": 3, "weight_update_latency_seconds": [0.05, 0.04, 0.06]})
    )
    return out


def _verdicts(out: Path) -> tuple[dict[str, str], str, bool]:
    table, ok = summary.summarize(out)
    verdicts = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] != "check":
            verdicts[cells[0]] = cells[3]
    return verdicts, table, ok


def test_every_goal_met(tmp_path):
    # fused 0.1 s against mm 0.04 s: 3·0.04/0.1 = 1.2 ≥ 0.6
    verdicts, table, ok = _verdicts(_write(tmp_path / "o"))
    assert ok, table
    for label in (K1, VS_COMPILED, VS_LIGER, MEMORY, LIGER_COMPILED, MFU, GRAD, LOGPROBS, TESTS):
        assert verdicts[label] == "PASS", label
    assert verdicts["build with nvcc, sm_90 only"] == "PASS"
    assert verdicts["demo main job, 3 steps"] == "PASS"
    # torch's linear_cross_entropy is informational, absent or not
    assert verdicts["LM head torch_lce fwd_bwd"] == "–" and "torch 2.11 has none" in table
    assert "materialised logits" in table  # the naive case is marked
    assert "median 0.0500 s over 3 updates" in table
    assert summary.main(["--out", str(tmp_path / "o")]) == 0


def test_every_goal_missed(tmp_path):
    # slower than both baselines, more memory than Liger, under 60 % of mm, MFU under 40 %
    lm = _lm_head(fused_s=0.3, compiled_s=0.25, liger_s=0.2, fused_mb=950.0)
    verdicts, _, ok = _verdicts(_write(tmp_path / "o", lm_head=lm, plain=_train(mfu=0.3)))
    assert not ok
    for label in (K1, VS_COMPILED, VS_LIGER, MEMORY, MFU):
        assert verdicts[label] == "FAIL", label


@pytest.mark.parametrize(
    "fused",
    [{"fell_back": True, "fallback_reasons": ["RuntimeWarning: x"]}, {"materialised_logits": True}],
)
def test_a_fused_case_on_a_slower_path_fails_k1(tmp_path, fused):
    verdicts, table, _ = _verdicts(_write(tmp_path / "o", lm_head=_lm_head(**fused)))
    assert verdicts[K1] == "FAIL"
    assert "FELL BACK: RuntimeWarning: x" in table or "materialised logits" in table


def test_liger_not_compiled_is_a_failed_check(tmp_path):
    lm = _lm_head()
    liger = lm["results"][0]["modes"]["fwd_bwd"]["liger_grpo"]
    liger.update(liger_compiled=False, note="Liger ran compiled=False: warm-up: boom")
    verdicts, table, ok = _verdicts(_write(tmp_path / "o", lm_head=lm))
    assert verdicts[LIGER_COMPILED] == "FAIL" and "warm-up: boom" in table and not ok


@pytest.mark.parametrize(
    "fsdp, failed",
    [
        (_train(grad_norm=3.8), GRAD),  # 8.6 % off
        (_train(grad_norm=3.51, values=(-11.9, -12.3)), LOGPROBS),  # 0.2 off
        (_train(grad_norm=3.5, checksum=124.0), GRAD),  # not the same weights
    ],
)
def test_fsdp_is_compared_on_what_it_computes(tmp_path, fsdp, failed):
    verdicts, _, _ = _verdicts(_write(tmp_path / "o", fsdp=fsdp))
    assert verdicts[failed] == "FAIL"


def test_a_test_run_cut_at_its_budget_is_missing(tmp_path):
    budget = {"stopped": True, "interrupted": False, "started": 7, "collected": 30}
    verdicts, table, ok = _verdicts(_write(tmp_path / "o", budget=budget))
    assert verdicts[TESTS] == "MISSING" and "7 of 30 started" in table and not ok


def test_missing_results(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "sections.tsv").write_text(
        "preflight\t0\t9\t20\nbuild\t1\t30\t95\nlm_head\t124\t75\t75\ndemo_job\t3\t1\t45\n"
        "fsdp_nccl\t125\t0\t35\nipc_sync\t126\t0\t20\n"
    )
    verdicts, table, ok = _verdicts(out)
    assert not ok
    # ran and failed: FAIL; an absent input, skipped at the deadline, never ran: MISSING
    assert verdicts["build with nvcc, sm_90 only"] == "FAIL"
    assert verdicts[K1] == "FAIL" and "timed out after 75 s" in table
    assert verdicts["demo main job, 3 steps"] == "MISSING"
    assert verdicts[GRAD] == "MISSING" and "skipped at the deadline" in table
    assert "not selected (GPU_CHECK_ONLY)" in table
    assert verdicts[MFU] == "MISSING"
    assert set(verdicts.values()) <= {"MISSING", "FAIL", "–"}
    assert summary.main(["--out", str(out)]) == 1
