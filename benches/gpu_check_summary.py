"""The closing table of ``benches/gpu_check.sh``: goal, measured value and pass/fail per check.

Reads what the sections left in the output folder (``sections.tsv``: name, exit code, seconds,
budget per section; pytest's JUnit XML files; the benchmarks' JSON files; the demo job's
``summary.json``) and prints one markdown table. A check whose input is missing reads
MISSING (its section failed, timed out or never ran), informational rows read "–".

Goals (the fused LM-head loss and the training step):

- ``fused_linear_grpo_loss`` forward + backward at N=16384, H=4096, V=151936 bf16:
  6·N·H·V / time ≥ 60 % of the bf16 ``torch.mm`` rate of the same [N, H] × [H, V] product
  measured in the same run (3 × mm time / fused time ≥ 0.6); faster than Liger-Kernel's
  ``LigerFusedLinearGRPOLoss`` and than torch's ``linear_cross_entropy`` (forward + backward);
  lower extra peak memory than Liger's.
- The 1.5B-shaped Qwen2 train step: model FLOP utilisation ≥ 40 % of the bf16 dense peak.

Usage: ``python benches/gpu_check_summary.py --out DIR`` (exit code 1 when a goal failed or
a check is missing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

LM_HEAD_SHAPE = (16384, 4096, 151936)
FUSED_MATMUL_FRACTION = 0.60
TRAIN_MFU = 0.40
FSDP_LOSS_RTOL = 1e-2

PASS, FAIL, MISSING, INFO = "PASS", "FAIL", "MISSING", "–"


def read_json(path: Path):
    """The parsed JSON file, or None when it is absent or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_sections(path: Path) -> dict[str, dict]:
    """``sections.tsv`` rows by name: rc (int), seconds (int), budget (int)."""
    sections = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return sections
    for line in lines:
        parts = line.split("\t")
        if len(parts) < 4:
            continue
        name, rc, seconds, budget = parts[:4]
        try:
            sections[name] = {"rc": int(rc), "seconds": int(seconds), "budget": int(budget)}
        except ValueError:
            continue
    return sections


def junit_counts(path: Path) -> dict | None:
    """tests / failures / errors / skipped of a pytest JUnit XML file (summed over suites)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def _section_note(sections: dict, name: str) -> str:
    sec = sections.get(name)
    if sec is None:
        return "did not run"
    if sec["rc"] in (124, 137):
        return f"timed out after {sec['budget']} s"
    if sec["rc"] == 125:
        return "skipped at the deadline"
    if sec["rc"] == 126:
        return "not selected (GPU_CHECK_ONLY)"
    if sec["rc"] == 3:
        return "an input is absent (see its log)"
    return f"exit {sec['rc']} in {sec['seconds']} s"


def _absent(sections: dict, name: str) -> str:
    """Verdict of a check whose result is absent: FAIL when its section ran and failed (or
    timed out), MISSING when it did not run, was skipped at the deadline (exit 125) or not
    selected (126), or lacked an input that not every checkout has (exit 3)."""
    sec = sections.get(name)
    return FAIL if sec is not None and sec["rc"] not in (0, 3, 125, 126) else MISSING


def suite_rows(out: Path, sections: dict) -> list[list[str]]:
    rows = []
    for name, label in (
        ("tests_ops_rl", "tests/ops + tests/rl on CUDA (Triton compiled, large shapes)"),
        ("tests_sync", "tests/sync, CUDA parts (CUDA pack kernel, CUDA IPC)"),
        ("tests_train", "tests/models/test_packed_attention.py + tests/train on CUDA"),
    ):
        counts = junit_counts(out / f"{name}.xml")
        if counts is None:
            note = f"no report ({_section_note(sections, name)})"
            rows.append([label, "0 failed", note, _absent(sections, name)])
            continue
        bad = counts["failures"] + counts["errors"]
        measured = (
            f"{counts['passed']} passed, {bad} failed, {counts['skipped']} skipped "
            f"({_section_note(sections, name)})"
        )
        rows.append([label, "0 failed", measured, PASS if bad == 0 else FAIL])
    return rows


def lm_head_rows(data: dict | None) -> list[list[str]]:
    """Goal rows of the fused LM-head loss from bench_logprobs.py --device cuda's JSON."""
    labels = [
        "fused loss fwd+bwd: model FLOP rate / measured bf16 mm rate",
        "fused loss fwd+bwd time / Liger LigerFusedLinearGRPOLoss",
        "fused loss fwd+bwd time / torch linear_cross_entropy fwd+bwd",
        "fused loss fwd+bwd extra peak memory / Liger",
    ]
    goals = [f"≥ {FUSED_MATMUL_FRACTION:.2f}", "< 1", "< 1", "< 1"]
    entry = None
    for e in (data or {}).get("results", []):
        if (e.get("T"), e.get("H"), e.get("V")) == LM_HEAD_SHAPE:
            entry = e
    if entry is None:
        why = (
            "no N=16384, H=4096, V=151936 shape in the results"
            if data
            else "no bench_logprobs_cuda.json"
        )
        return [[lab, goal, why, MISSING] for lab, goal in zip(labels, goals)]
    modes = entry.get("modes", {})

    def median(mode, impl):
        return modes.get(mode, {}).get(impl, {}).get("median_s")

    def why_missing(mode, impl):
        rec = modes.get(mode, {}).get(impl)
        if rec is None:
            return f"{impl} {mode} not measured"
        return rec.get("skipped") or rec.get("error") or f"{impl} {mode}: no time"

    T, H, V = LM_HEAD_SHAPE
    mm, fused = median("fwd", "matmul"), median("fwd_bwd", "fused_loss")
    rows = []
    if mm and fused:
        frac = 3 * mm / fused
        measured = (
            f"{frac:.3f} ({6 * T * H * V / fused / 1e12:.0f} TFLOP/s, {fused * 1e3:.1f} ms; "
            f"mm {2 * T * H * V / mm / 1e12:.0f} TFLOP/s)"
        )
        rows.append(
            [labels[0], goals[0], measured, PASS if frac >= FUSED_MATMUL_FRACTION else FAIL]
        )
    else:
        missing = why_missing("fwd", "matmul") if not mm else why_missing("fwd_bwd", "fused_loss")
        rows.append([labels[0], goals[0], missing, MISSING])
    for label, goal, (mode, impl) in (
        (labels[1], goals[1], ("fwd_bwd", "liger_grpo")),
        (labels[2], goals[2], ("fwd_bwd", "torch_lce")),
    ):
        other = median(mode, impl)
        if fused and other:
            ratio = fused / other
            rows.append(
                [label, goal, f"{ratio:.3f} ({other * 1e3:.1f} ms)", PASS if ratio < 1 else FAIL]
            )
        else:
            missing = why_missing(mode, impl) if fused else why_missing("fwd_bwd", "fused_loss")
            rows.append([label, goal, missing, MISSING])
    mem_fused = modes.get("fwd_bwd", {}).get("fused_loss", {}).get("extra_peak_mb")
    mem_liger = modes.get("fwd_bwd", {}).get("liger_grpo", {}).get("extra_peak_mb")
    if mem_fused is not None and mem_liger:
        ratio = mem_fused / mem_liger
        rows.append(
            [
                labels[3],
                goals[3],
                f"{ratio:.3f} ({mem_fused:.0f} MB vs {mem_liger:.0f} MB)",
                PASS if ratio < 1 else FAIL,
            ]
        )
    else:
        rows.append([labels[3], goals[3], why_missing("fwd_bwd", "liger_grpo"), MISSING])
    # informational: every other row of that shape against the same matmul rate
    for mode, impl in (
        ("fwd", "fused_loss"),
        ("fwd", "ours"),
        ("fwd_bwd", "ours"),
        ("fwd", "torch_lce"),
        ("fwd_bwd", "torch_lce"),
        ("fwd_bwd", "liger_grpo"),
    ):
        t = median(mode, impl)
        if not (t and mm):
            continue
        scale = 3 if mode == "fwd_bwd" else 1
        mem = modes[mode][impl].get("extra_peak_mb")
        rows.append(
            [
                f"LM head {impl} {mode}: model FLOP rate / mm rate",
                INFO,
                f"{scale * mm / t:.3f} ({t * 1e3:.1f} ms, extra peak {mem:.0f} MB)",
                INFO,
            ]
        )
    return rows


def train_rows(plain: dict | None, fsdp: dict | None, sections: dict) -> list[list[str]]:
    rows = []
    label = "1.5B Qwen2 train step: MFU vs bf16 dense peak"
    goal = f"≥ {TRAIN_MFU:.2f}"
    if plain and plain.get("mfu_vs_peak") is not None:
        mfu = plain["mfu_vs_peak"]
        ok = mfu >= TRAIN_MFU and all(plain.get("checks", {}).values())
        measured = (
            f"{mfu:.3f} ({plain['model_tflops_per_s']:.0f} of {plain['peak_tflops']} TFLOP/s, "
            f"{plain.get('precision', '?')}; "
            f"{plain['tokens_per_s']:.0f} tokens/s, {plain['median_step_s']:.3f} s/step)"
        )
        rows.append([label, goal, measured, PASS if ok else FAIL])
        vs_mm = plain.get("mfu_vs_measured_matmul")
        if vs_mm is not None:
            rows.append(
                [
                    "1.5B train step: MFU vs measured bf16 mm rate",
                    INFO,
                    f"{vs_mm:.3f} (mm {plain['matmul_tflops_measured']:.0f} TFLOP/s)",
                    INFO,
                ]
            )
        if not all(plain.get("checks", {}).values()):
            rows.append(["1.5B train step checks", "all true", str(plain["checks"]), FAIL])
    else:
        note = _section_note(sections, "train_1p5b")
        rows.append([label, goal, note, _absent(sections, "train_1p5b")])
    label = "FSDP2, one NCCL rank: finite loss, step-0 loss = plain engine's"
    if fsdp and fsdp.get("losses"):
        checks_ok = all(fsdp.get("checks", {}).values())
        ref = (plain or {}).get("losses") or []
        same = None
        if ref:
            same = abs(fsdp["losses"][0] - ref[0]) <= FSDP_LOSS_RTOL * max(abs(ref[0]), 1e-6)
        measured = (
            f"losses {', '.join(f'{v:.5f}' for v in fsdp['losses'])}"
            + (f" vs plain {ref[0]:.5f}" if ref else " (no plain run to compare)")
            + (
                f"; {fsdp['tokens_per_s']:.0f} tokens/s, MFU {fsdp['mfu_vs_peak']:.3f}"
                if fsdp.get("mfu_vs_peak") is not None
                else ""
            )
        )
        ok = checks_ok and same is not False
        rows.append([label, "runs, equal", measured, PASS if ok else FAIL])
    else:
        note = _section_note(sections, "fsdp_nccl")
        rows.append([label, "runs, equal", note, _absent(sections, "fsdp_nccl")])
    return rows


def _latency_text(values) -> str | None:
    if isinstance(values, (int, float)):
        return f"{values:.4f} s"
    if isinstance(values, list) and values and all(isinstance(v, (int, float)) for v in values):
        return (
            f"median {statistics.median(values):.4f} s over {len(values)} updates "
            f"(max {max(values):.4f} s)"
        )
    return None


def sync_and_job_rows(out: Path, sections: dict) -> list[list[str]]:
    rows = []
    ipc = read_json(out / "weight_sync_cuda_ipc.json")
    models = (ipc or {}).get("models", {})
    if models:
        parts = []
        for name, rec in models.items():
            secs = rec.get("seconds", {}).get("bucketed")
            if secs is not None:
                parts.append(f"{name}: {secs * 1e3:.1f} ms ({rec.get('gbytes', 0):.2f} GB)")
        rows.append(["CUDA-IPC weight update into an engine (bench)", INFO, "; ".join(parts), INFO])
    else:
        rows.append(
            [
                "CUDA-IPC weight update into an engine (bench)",
                INFO,
                _section_note(sections, "ipc_sync"),
                _absent(sections, "ipc_sync"),
            ]
        )
    attn = sections.get("attention")
    label = "varlen attention vs per-sequence SDPA (bench_attention.py)"
    if (out / "bench_attention.absent").exists():
        rows.append([label, "runs", "benches/bench_attention.py is not in this checkout", MISSING])
    elif attn is not None and attn["rc"] == 0 and (out / "bench_attention.json").exists():
        rows.append([label, INFO, "see attention.log and bench_attention.json", INFO])
    else:
        note = _section_note(sections, "attention")
        rows.append([label, "runs", note, _absent(sections, "attention")])
    summary = read_json(out / "demo_summary.json")
    label = "demo main job, 3 steps on CUDA"
    if summary is not None and sections.get("demo_job", {}).get("rc") == 0:
        steps = summary.get("steps")
        latency = _latency_text(summary.get("weight_update_latency_seconds"))
        measured = f"steps {steps}; weight_update_latency_seconds {latency or 'absent'}"
        rows.append([label, "exit 0, 3 steps", measured, PASS if steps in (3, None) else FAIL])
    else:
        note = _section_note(sections, "demo_job")
        rows.append([label, "exit 0, 3 steps", note, _absent(sections, "demo_job")])
    return rows


def build_rows(out: Path, sections: dict) -> list[list[str]]:
    info = read_json(out / "build_info.json")
    label = "build with nvcc (areal_fast._C with CUDA kernels)"
    if info is None:
        return [[label, "cuda: true", _section_note(sections, "build"), _absent(sections, "build")]]
    measured = f"cuda {info.get('cuda')}, archs {info.get('cuda_architectures')}"
    return [[label, "cuda: true", measured, PASS if info.get("cuda") is True else FAIL]]


def summarize(out: Path) -> tuple[str, bool]:
    """The markdown table and whether every goal passed (no FAIL, no MISSING)."""
    sections = read_sections(out / "sections.tsv")
    rows = build_rows(out, sections)
    rows += suite_rows(out, sections)
    rows += lm_head_rows(read_json(out / "bench_logprobs_cuda.json"))
    rows += train_rows(
        read_json(out / "train_step_1p5b.json"), read_json(out / "train_step_fsdp.json"), sections
    )
    rows += sync_and_job_rows(out, sections)
    lines = ["| check | goal | measured | pass |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    timing = ", ".join(
        f"{name} {s['seconds']}/{s['budget']} s" + ("" if s["rc"] == 0 else f" (exit {s['rc']})")
        for name, s in sections.items()
    )
    if timing:
        lines += ["", f"sections (seconds used / budget): {timing}"]
    ok = all(row[3] not in (FAIL, MISSING) for row in rows)
    return "\n".join(lines), ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="gpu_check.sh's output folder")
    args = parser.parse_args(argv)
    table, ok = summarize(args.out)
    print(table, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
