"""benches/gpu_check.sh without a GPU: its syntax, every Python part it runs (imports and
``--help``), the 1.5B-shaped Qwen2 config, one train step of that structure at a tiny width on
the CPU, and the closing summary's verdicts on made-up results."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCHES = REPO / "benches"
SCRIPT = BENCHES / "gpu_check.sh"
sys.path.insert(0, str(BENCHES))

import bench_train_step  # noqa: E402
import gpu_check_summary as summary  # noqa: E402


def _run(cmd, timeout=120):
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_check_prepare.sh"])
def test_scripts_parse(script):
    proc = _run(["bash", "-n", str(BENCHES / script)])
    assert proc.returncode == 0, proc.stderr


def _python_parts() -> list[str]:
    """The benches/*.py files gpu_check.sh runs."""
    return sorted(set(re.findall(r"benches/(\w+\.py)", SCRIPT.read_text())))


def test_script_runs_the_expected_python_parts():
    parts = _python_parts()
    for name in (
        "bench_logprobs.py",
        "bench_train_step.py",
        "bench_weight_sync.py",
        "gpu_check_summary.py",
        "demo_model_stub.py",
        "bench_attention.py",
    ):
        assert name in parts
    # every part the script needs is in the repository; bench_attention.py is tolerated
    # (the script notes its absence)
    missing = [p for p in parts if not (BENCHES / p).is_file() and p != "bench_attention.py"]
    assert not missing


@pytest.mark.parametrize("name", _python_parts())
def test_python_part_help_without_gpu(name):
    if not (BENCHES / name).is_file():
        pytest.skip(f"benches/{name} is not in this checkout")
    proc = _run([sys.executable, str(BENCHES / name), "--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower()


def test_job_cli_help_without_gpu():
    proc = _run([sys.executable, "-m", "areal_fast.cli", "train", "--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--no-progress" in proc.stdout


def test_wheels_are_ignored():
    proc = _run(["git", "check-ignore", "-q", "benches/wheels/liger_kernel-0.8.5-py3-none-any.whl"])
    assert proc.returncode == 0, "benches/wheels/ must be git-ignored"


# --------------------------------------------------------------------- the 1.5B config


def test_qwen2_1p5b_config_builds():
    config = bench_train_step.load_config(bench_train_step.DEFAULT_CONFIG)
    assert type(config).__name__ == "Qwen2Config"
    assert (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
        config.vocab_size,
    ) == (1536, 28, 12, 2, 8960, 151936)
    model = bench_train_step.build_model(config, "meta", torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    # 28 layers of (q, k, v with biases, o, gate/up/down, 2 norms), tied 151936 x 1536 head
    layer = (1536 * 1536 + 1536) + 2 * (1536 * 256 + 256) + 1536 * 1536 + 3 * 1536 * 8960
    layer += 2 * 1536
    assert n == 28 * layer + 151936 * 1536 + 1536
    assert bench_train_step.matmul_params(model) == n  # tied head: the embedding counts once


def test_load_config_rejects_other_models(tmp_path):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="llama.json.*qwen2"):
        bench_train_step.load_config(path)
    with pytest.raises(ValueError, match="missing.json"):
        bench_train_step.load_config(tmp_path / "missing.json")


def test_tiny_config_keeps_the_layer_structure():
    config = bench_train_step.load_config(bench_train_step.DEFAULT_CONFIG)
    tiny = bench_train_step.tiny_config(config)
    assert tiny.num_hidden_layers == 28
    assert (tiny.num_attention_heads, tiny.num_key_value_heads) == (12, 2)
    assert tiny.hidden_size == 96 and tiny.hidden_size % (2 * 12) == 0
    assert (tiny.intermediate_size, tiny.vocab_size) == (560, 9496)
    assert tiny.tie_word_embeddings and tiny.eos_token_id < tiny.vocab_size


def test_step_flops_formula():
    config = bench_train_step.load_config(bench_train_step.DEFAULT_CONFIG)
    lens = [1000, 500]
    got = bench_train_step.step_flops(config, 10, lens)
    assert got == 6 * 10 * 1500 + 6 * 28 * 12 * 128 * (1000**2 + 500**2)


def test_tiny_train_step_on_cpu(tmp_path):
    out = tmp_path / "step.json"
    record = bench_train_step.main(
        ["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "0", "--json", str(out)]
    )
    assert json.loads(out.read_text())["losses"] == record["losses"]
    assert record["engine"] == "TorchTrainEngine" and record["tiny"]
    assert record["precision"] == "fp32"
    assert record["config"]["num_hidden_layers"] == 28
    assert all(math.isfinite(v) for v in record["losses"])
    assert record["grad_norms"][0] > 0 and math.isfinite(record["grad_norms"][0])
    assert record["zero_grad_params"] == []
    assert all(record["checks"].values())
    assert 0 < record["batch"]["trained_tokens"] < record["batch"]["tokens"]
    assert record["tokens_per_s"] > 0 and record["mfu_vs_peak"] > 0


@pytest.mark.parametrize(
    "argv", [["--fsdp-nccl"], ["--precision", "bf16"], ["--precision", "mixed"]]
)
def test_cuda_only_options_refused_on_cpu(argv):
    with pytest.raises(SystemExit):
        bench_train_step.parse_args(["--device", "cpu", *argv])


def test_precision_choice():
    assert bench_train_step.resolve_precision("auto", "cpu") == "fp32"
    assert bench_train_step.resolve_precision("auto", "cuda") in ("mixed", "bf16")
    assert bench_train_step.resolve_precision("bf16", "cuda") == "bf16"


# --------------------------------------------------------------------- the demo stub


def test_demo_model_stub(tmp_path):
    import demo_model_stub
    from conftest import make_tiny_model_dir

    src = make_tiny_model_dir(tmp_path / "src", "llama")
    for weights in src.glob("*.safetensors"):
        weights.unlink()
    out = demo_model_stub.make_stub(src, tmp_path / "out")
    from areal_fast.models.loading import load_causal_lm, load_tokenizer

    model = load_causal_lm(str(out))
    tok = load_tokenizer(str(out))
    assert model.config.hidden_size == 48
    assert tok("1+2=")["input_ids"]
    with pytest.raises(ValueError, match="config.json"):
        demo_model_stub.make_stub(tmp_path / "nowhere", tmp_path / "x")


# --------------------------------------------------------------------- bench_logprobs on CUDA


def test_bench_logprobs_fused_forward_row_is_cuda_only():
    import bench_logprobs as bl

    assert bl.modes_of("fused_loss") == ("fwd_bwd",)
    assert bl.modes_of("fused_loss", "cuda") == ("fwd", "fwd_bwd")
    assert bl.modes_of("liger_grpo", "cuda") == ("fwd_bwd",)
    assert bl.modes_of("ours", "cuda") == bl.MODES


def test_bench_logprobs_fused_forward_op():
    import bench_logprobs as bl

    inputs = bl.make_inputs((64, 16, 101), "float32", "cpu", 0, with_loss=True)
    fwd, _ = bl.build_op("fused_loss", "fwd", inputs)
    value = fwd()["loss"]
    assert math.isfinite(value) and inputs["hidden"].grad is None
    both, reset = bl.build_op("fused_loss", "fwd_bwd", inputs)
    assert both()["loss"] == pytest.approx(value, rel=1e-5, abs=1e-6)
    assert inputs["hidden"].grad is not None
    reset()


# --------------------------------------------------------------------- the summary


def _lm_head_results(fused_s, liger_s, lce_s, mm_s, fused_mb, liger_mb):
    T, H, V = summary.LM_HEAD_SHAPE
    rec = lambda s, mb=100.0: {"median_s": s, "extra_peak_mb": mb}  # noqa: E731
    return {
        "results": [
            {
                "T": T,
                "H": H,
                "V": V,
                "modes": {
                    "fwd": {"matmul": rec(mm_s), "fused_loss": rec(mm_s * 1.2)},
                    "fwd_bwd": {
                        "fused_loss": rec(fused_s, fused_mb),
                        "liger_grpo": rec(liger_s, liger_mb),
                        "torch_lce": rec(lce_s),
                    },
                },
            }
        ]
    }


def _write_outputs(out: Path, lm_head: dict, mfu: float):
    out.mkdir()
    (out / "sections.tsv").write_text(
        "".join(
            f"{name}\t0\t10\t60\n"
            for name in (
                "build",
                "tests_ops_rl",
                "tests_sync",
                "tests_train",
                "lm_head",
                "attention",
                "train_1p5b",
                "fsdp_nccl",
                "ipc_sync",
                "demo_job",
            )
        )
    )
    (out / "build_info.json").write_text(json.dumps({"cuda": True, "cuda_architectures": "90"}))
    for name in ("tests_ops_rl", "tests_sync", "tests_train"):
        (out / f"{name}.xml").write_text(
            '<testsuites><testsuite tests="10" failures="0" errors="0" skipped="2"/></testsuites>'
        )
    (out / "bench_logprobs_cuda.json").write_text(json.dumps(lm_head))
    train = {
        "mfu_vs_peak": mfu,
        "mfu_vs_measured_matmul": mfu * 1.25,
        "matmul_tflops_measured": 790.0,
        "model_tflops_per_s": mfu * 989.4,
        "peak_tflops": 989.4,
        "tokens_per_s": 50000.0,
        "median_step_s": 0.3,
        "losses": [0.01, 0.012],
        "checks": {"finite_loss": True},
    }
    (out / "train_step_1p5b.json").write_text(json.dumps(train))
    (out / "train_step_fsdp.json").write_text(json.dumps({**train, "losses": [0.01, 0.0121]}))
    (out / "weight_sync_cuda_ipc.json").write_text(
        json.dumps({"models": {"1.5b": {"seconds": {"bucketed": 0.02}, "gbytes": 3.09}}})
    )
    (out / "bench_attention.json").write_text("{}")
    (out / "demo_summary.json").write_text(
        json.dumps({"steps": 3, "weight_update_latency_seconds": [0.05, 0.04, 0.06]})
    )


def _verdicts(table: str) -> dict[str, str]:
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ")]
    return {r[0].lstrip("| "): r[-1].rstrip(" |") for r in rows[1:] if len(r) >= 4}


def test_summary_all_goals_met(tmp_path):
    # fused 0.1 s against mm 0.04 s: 3·0.04/0.1 = 1.2 ≥ 0.6
    _write_outputs(tmp_path / "o", _lm_head_results(0.1, 0.2, 0.15, 0.04, 500.0, 900.0), 0.45)
    table, ok = summary.summarize(tmp_path / "o")
    verdicts = _verdicts(table)
    assert ok, table
    assert verdicts["fused loss fwd+bwd: model FLOP rate / measured bf16 mm rate"] == "PASS"
    assert verdicts["1.5B Qwen2 train step: MFU vs bf16 dense peak"] == "PASS"
    assert verdicts["demo main job, 3 steps on CUDA"] == "PASS"
    assert "median 0.0500 s over 3 updates" in table
    assert summary.main(["--out", str(tmp_path / "o")]) == 0


def test_summary_failed_goals(tmp_path):
    # fused slower than Liger and torch, more memory, under 60 % of mm, MFU under 40 %
    _write_outputs(tmp_path / "o", _lm_head_results(0.3, 0.2, 0.25, 0.04, 950.0, 900.0), 0.3)
    table, ok = summary.summarize(tmp_path / "o")
    verdicts = _verdicts(table)
    assert not ok
    for label in (
        "fused loss fwd+bwd: model FLOP rate / measured bf16 mm rate",
        "fused loss fwd+bwd time / Liger LigerFusedLinearGRPOLoss",
        "fused loss fwd+bwd time / torch linear_cross_entropy fwd+bwd",
        "fused loss fwd+bwd extra peak memory / Liger",
        "1.5B Qwen2 train step: MFU vs bf16 dense peak",
    ):
        assert verdicts[label] == "FAIL", label


def test_summary_missing_results(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "sections.tsv").write_text(
        "build\t1\t30\t95\ntests_ops_rl\t124\t75\t75\ndemo_job\t3\t1\t45\n"
        "fsdp_nccl\t125\t0\t35\nipc_sync\t126\t0\t20\n"
    )
    table, ok = summary.summarize(out)
    assert not ok
    verdicts = _verdicts(table)
    # ran and failed: FAIL; an absent input, skipped at the deadline, never ran: MISSING
    assert verdicts["build with nvcc (areal_fast._C with CUDA kernels)"] == "FAIL"
    assert verdicts["tests/ops + tests/rl on CUDA (Triton compiled, large shapes)"] == "FAIL"
    assert "timed out after 75 s" in table
    assert verdicts["demo main job, 3 steps on CUDA"] == "MISSING"
    assert verdicts["FSDP2, one NCCL rank: finite loss, step-0 loss = plain engine's"] == "MISSING"
    assert "skipped at the deadline" in table
    assert "not selected (GPU_CHECK_ONLY)" in table
    assert verdicts["1.5B Qwen2 train step: MFU vs bf16 dense peak"] == "MISSING"
    assert set(verdicts.values()) <= {"MISSING", "FAIL", "–"}
    assert summary.main(["--out", str(out)]) == 1


# --------------------------------------------------------------------- the script's control flow


def test_script_sections_deadline_and_outputs(tmp_path):
    """gpu_check.sh with stand-in tools (python3, nvcc, nvidia-smi that do nothing; the LM-head
    benchmark hangs): every section is recorded, the hung one times out at the deadline, the
    later ones are skipped, the files come back under $OUT and the summary table comes last."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "python3").write_text(
        "#!/usr/bin/env bash\n"
        'case "$1" in\n'
        '  benches/gpu_check_summary.py) exec "$REAL_PYTHON" "$@" ;;\n'
        "  benches/bench_logprobs.py) sleep 60 ;;\n"
        "esac\n"
        "exit 0\n"
    )
    for name in ("nvcc", "nvidia-smi"):
        (stubs / name).write_text("#!/usr/bin/env bash\nexit 0\n")
    for tool in stubs.iterdir():
        tool.chmod(0o755)
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    env = {
        "PATH": f"{stubs}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "REAL_PYTHON": sys.executable,
        "GPU_CHECK_DIR": str(work),
        "GPU_CHECK_DEADLINE": "12",
        "OUT": str(out),
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("\t") for line in (work / "sections.tsv").read_text().splitlines()]
    rc = {name: int(code) for name, code, *_ in rows}
    assert list(rc) == [
        "build",
        "tests_ops_rl",
        "tests_sync",
        "tests_train",
        "lm_head",
        "attention",
        "train_1p5b",
        "fsdp_nccl",
        "ipc_sync",
        "demo_job",
    ]
    assert rc["build"] == 1  # the stand-in python3 names no built module
    assert rc["tests_ops_rl"] == 0
    assert rc["lm_head"] == 124  # cut at the deadline
    assert rc["demo_job"] == 125  # skipped: no time left
    assert {"gpu_check.log", "summary.md", "gpu_check_results.tar.gz"} <= {
        p.name for p in out.iterdir()
    }
    assert len(list(out.iterdir())) <= 8
    lines = proc.stdout.rstrip().splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("## gpu_check summary"))
    assert lines[header + 1] == "| check | goal | measured | pass |"
    assert all(
        line.startswith("|") or not line or "sections" in line for line in lines[header + 1 :]
    )
    assert "lm_head" in lines[-1] and "(exit 124)" in lines[-1]


def test_mixed_precision_model_has_float32_master_weights():
    pytest.importorskip("areal_fast.train.precision")
    config = bench_train_step.tiny_config(
        bench_train_step.load_config(bench_train_step.DEFAULT_CONFIG)
    )
    model = bench_train_step.build_model(config, "cpu", "mixed")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.areal_compute_dtype == torch.bfloat16
