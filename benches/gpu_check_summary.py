"""The closing table of ``benches/gpu_check.sh``: goal, measured value and verdict per check.

Reads what the sections left in the output folder: ``sections.tsv`` (name, exit code,
seconds, budget per section), ``preflight.json``, ``build_info.json``, the benchmarks' JSON
files, pytest's JUnit XML and budget report, the demo job's ``summary.json``; prints one
markdown table. Verdicts: PASS, FAIL (the check ran and missed its goal, or its section
failed), MISSING (its section did not run, was cut at the deadline, was not selected, lacked
an input, or stopped before its end), "–" (informational).

Goals:

- K1, the fused LM-head loss (``fused_linear_grpo_loss``, forward + backward, bf16, at
  N=16384, H=4096, V=151936): 6·N·H·V / time ≥ 60 % of the bf16 ``torch.mm`` rate of the same
  [N, H] × [H, V] product measured in the same run (3 × mm time / fused time ≥ 0.6); faster
  than the ``torch.compile``'d chunked torch loss and than Liger-Kernel's
  ``LigerFusedLinearGRPOLoss`` (which must have run compiled); less extra peak memory than
  Liger's; not fallen back to a slower path, no materialised logits. torch's
  ``linear_cross_entropy`` is informational (the GPU image's torch may lack it).
- The 1.5B-shaped Qwen2 train step: model FLOP utilisation ≥ 40 % of the bf16 dense peak.
- FSDP2 on one rank, same weights and batch as the plain run: the first gradient norm
  within 2 % and the recomputed behaviour log-probs within 0.05 of the plain engine's (what
  FSDP computes; the step-0 loss is −mean(A) whatever it does).
- The GPU tests: none failed, none left out by the budget; the demo job: exit 0, its steps.

Usage: ``python benches/gpu_check_summary.py --out DIR [--lm-shape T,H,V] [--demo-steps N]
[--rehearse]`` (exit code 1 when a goal failed or a check is missing).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

LM_HEAD_SHAPE = (16384, 4096, 151936)
FUSED_MATMUL_FRACTION = 0.60
TRAIN_MFU = 0.40
FSDP_GRAD_NORM_RTOL = 0.02
FSDP_LOGPROB_ATOL = 0.05
BUILD_ARCHS = "90-real"

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
    """tests / failures / errors / skipped / passed of a JUnit XML file (summed over suites)."""
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


def section_note(sections: dict, name: str) -> str:
    """How a section ended, in words."""
    sec = sections.get(name)
    if sec is None:
        return "did not run"
    notes = {
        124: f"timed out after {sec['budget']} s",
        137: f"killed after {sec['budget']} s",
        125: "skipped at the deadline",
        126: "not selected (GPU_CHECK_ONLY)",
        3: "an input is absent (see its log)",
    }
    return notes.get(sec["rc"], f"exit {sec['rc']} in {sec['seconds']} s")


def absent(sections: dict, name: str) -> str:
    """Verdict of a check whose result is absent: FAIL when its section ran and failed (or
    timed out), MISSING when it did not run, was skipped at the deadline (125), was not
    selected (126) or lacked an input that not every checkout has (3)."""
    sec = sections.get(name)
    return FAIL if sec is not None and sec["rc"] not in (0, 3, 125, 126) else MISSING


def preflight_rows(out: Path, sections: dict) -> list[list[str]]:
    """Versions (informational), the carried packages, the source packages."""
    pre = read_json(out / "preflight.json")
    if pre is None:
        return [["preflight", "ran", section_note(sections, "preflight"), FAIL]]
    v = pre["versions"]
    gpu = v.get("gpu") or "no GPU"
    if v.get("free_gib") is not None:
        gpu += f", {v['free_gib']:.1f} of {v['total_gib']:.1f} GiB free"
    rows = [
        [
            "versions",
            INFO,
            f"python {v['python']}, torch {v['torch']} (CUDA {v['cuda']}), triton "
            f"{v['triton']}, transformers {v['transformers']}; nvidia-smi: "
            f"{v['nvidia_smi'] or 'absent'}; nvcc: {v['nvcc'] or 'absent'}; {gpu}",
            INFO,
        ],
        ["torch linear_cross_entropy", INFO, v["linear_cross_entropy"], INFO],
    ]
    failed = dict(pre["install"]["failed"])
    failed.update({m: err for m, err in pre["imports"].items() if err})
    measured = (
        f"{len(pre['install']['installed'])} wheels installed, every module imports"
        if not failed
        else "; ".join(f"{k}: {v}" for k, v in failed.items())
    )
    rows.append(["carried wheels install and import", "all", measured, FAIL if failed else PASS])
    if pre.get("sources"):
        sec = sections.get("source_pkgs")
        verdict = PASS if sec and sec["rc"] == 0 else absent(sections, "source_pkgs")
        note = f"{', '.join(pre['sources'])}: {section_note(sections, 'source_pkgs')}"
        rows.append(["source packages built", "exit 0", note, verdict])
    return rows


def build_rows(out: Path, sections: dict) -> list[list[str]]:
    info = read_json(out / "build_info.json")
    label, goal = "build with nvcc, sm_90 only", f"cuda: true, archs {BUILD_ARCHS}"
    if info is None:
        return [[label, goal, section_note(sections, "build"), absent(sections, "build")]]
    archs = info.get("cuda_architectures")
    ok = info.get("cuda") is True and archs == BUILD_ARCHS
    return [[label, goal, f"cuda {info.get('cuda')}, archs {archs}", PASS if ok else FAIL]]


def _lm_entry(data: dict | None, shape) -> dict | None:
    for entry in (data or {}).get("results", []):
        if (entry.get("T"), entry.get("H"), entry.get("V")) == tuple(shape):
            return entry
    return None


def _why(modes: dict, mode: str, impl: str) -> str:
    rec = modes.get(mode, {}).get(impl)
    if rec is None:
        return f"{impl} {mode} not measured"
    return rec.get("skipped") or rec.get("error") or f"{impl} {mode}: no time"


def _flags(rec: dict) -> str:
    """ " [FELL BACK: why]", " [materialised logits]", both or nothing."""
    flags = []
    if rec.get("fell_back"):
        flags.append("FELL BACK: " + "; ".join(rec.get("fallback_reasons", [])))
    if rec.get("materialised_logits"):
        flags.append("materialised logits")
    return f" [{' / '.join(flags)}]" if flags else ""


def lm_head_rows(data: dict | None, shape, sections: dict) -> list[list[str]]:
    """K1's goal rows, Liger's compile, then every other case informational."""
    T, H, V = shape
    labels = [
        "K1 fused loss fwd+bwd: model FLOP rate / measured bf16 mm rate",
        "K1 fused loss fwd+bwd time / torch.compile'd chunked loss",
        "K1 fused loss fwd+bwd time / Liger LigerFusedLinearGRPOLoss",
        "K1 fused loss fwd+bwd extra peak memory / Liger's",
        "Liger ran compiled (torch.compile)",
    ]
    goals = [f"≥ {FUSED_MATMUL_FRACTION:.2f}", "< 1", "< 1", "< 1", "yes"]
    entry = _lm_entry(data, shape)
    if entry is None:
        why = f"no T={T}, H={H}, V={V} results" if data else section_note(sections, "lm_head")
        verdict = MISSING if data else absent(sections, "lm_head")
        return [[lab, goal, why, verdict] for lab, goal in zip(labels, goals)]
    modes = entry["modes"]
    fused = modes.get("fwd_bwd", {}).get("fused_loss", {})
    mm = modes.get("fwd", {}).get("matmul", {}).get("median_s")
    f_s = fused.get("median_s")
    rows = []
    if mm and f_s:
        frac = 3 * mm / f_s
        clean = not (fused.get("fell_back") or fused.get("materialised_logits"))
        measured = (
            f"{frac:.3f} ({6 * T * H * V / f_s / 1e12:.1f} TFLOP/s, {f_s * 1e3:.1f} ms; mm "
            f"{2 * T * H * V / mm / 1e12:.1f} TFLOP/s){_flags(fused)}"
        )
        rows.append(
            [
                labels[0],
                goals[0],
                measured,
                PASS if frac >= FUSED_MATMUL_FRACTION and clean else FAIL,
            ]
        )
    else:
        why = _why(modes, "fwd", "matmul") if not mm else _why(modes, "fwd_bwd", "fused_loss")
        rows.append([labels[0], goals[0], why, MISSING])
    for label, goal, impl in (
        (labels[1], goals[1], "compiled_loss"),
        (labels[2], goals[2], "liger_grpo"),
    ):
        other = modes.get("fwd_bwd", {}).get(impl, {})
        if f_s and other.get("median_s"):
            ratio = f_s / other["median_s"]
            measured = f"{ratio:.3f} ({other['median_s'] * 1e3:.1f} ms){_flags(other)}"
            rows.append([label, goal, measured, PASS if ratio < 1 else FAIL])
        else:
            rows.append(
                [label, goal, _why(modes, "fwd_bwd", impl if f_s else "fused_loss"), MISSING]
            )
    liger = modes.get("fwd_bwd", {}).get("liger_grpo", {})
    m_f, m_l = fused.get("extra_peak_mb"), liger.get("extra_peak_mb")
    if m_f is not None and m_l is not None:
        ratio = f"{m_f / m_l:.3f}" if m_l > 0 else "–"
        measured = f"{ratio} ({m_f:.0f} MB vs {m_l:.0f} MB)"
        rows.append([labels[3], goals[3], measured, PASS if m_f < m_l else FAIL])
    else:
        rows.append([labels[3], goals[3], _why(modes, "fwd_bwd", "liger_grpo"), MISSING])
    if "liger_compiled" in liger:
        note = liger.get("note") or "; ".join(liger.get("fallback_reasons", [])) or "compiled"
        rows.append([labels[4], goals[4], note, PASS if liger["liger_compiled"] else FAIL])
    else:
        rows.append([labels[4], goals[4], _why(modes, "fwd_bwd", "liger_grpo"), MISSING])
    return rows + lm_head_info_rows(entry, mm)


def lm_head_info_rows(entry: dict, mm) -> list[list[str]]:
    """Every case of the K1 shape but the goal rows', against the same matmul rate."""
    rows = []
    for mode, cases in entry["modes"].items():
        for impl, rec in cases.items():
            if impl == "matmul" or (mode, impl) == ("fwd_bwd", "fused_loss"):
                continue
            label = f"LM head {impl} {mode}"
            if rec.get("median_s") is None:
                rows.append(
                    [label, INFO, rec.get("skipped") or rec.get("error") or "no time", INFO]
                )
                continue
            scale = 3 if mode == "fwd_bwd" else 1
            rate = f"{scale * mm / rec['median_s']:.3f} × mm rate, " if mm else ""
            variant = rec.get("info", {}).get("variant")
            measured = (
                f"{rate}{rec['median_s'] * 1e3:.1f} ms, extra peak "
                f"{rec.get('extra_peak_mb') or 0:.0f} MB"
                + (f", {variant} path" if variant else "")
                + _flags(rec)
            )
            rows.append([label, INFO, measured, INFO])
    return rows


def train_rows(plain: dict | None, sections: dict) -> list[list[str]]:
    label, goal = "1.5B Qwen2 train step: MFU vs bf16 dense peak", f"≥ {TRAIN_MFU:.2f}"
    if not plain or plain.get("mfu_vs_peak") is None:
        return [[label, goal, section_note(sections, "train_1p5b"), absent(sections, "train_1p5b")]]
    mfu = plain["mfu_vs_peak"]
    checks_ok = all(plain.get("checks", {}).values())
    measured = (
        f"{mfu:.3f} ({plain['model_tflops_per_s']:.1f} of {plain['peak_tflops']} TFLOP/s, "
        f"{plain.get('precision', '?')}; {plain['tokens_per_s']:.0f} tokens/s, "
        f"{plain['median_step_s']:.3f} s/step)"
    )
    rows = [[label, goal, measured, PASS if mfu >= TRAIN_MFU and checks_ok else FAIL]]
    if plain.get("mfu_vs_measured_matmul") is not None:
        measured = (
            f"{plain['mfu_vs_measured_matmul']:.3f} (mm {plain['matmul_tflops_measured']:.0f} "
            "TFLOP/s)"
        )
        rows.append(["1.5B train step: MFU vs measured bf16 mm rate", INFO, measured, INFO])
    if not checks_ok:
        rows.append(["1.5B train step checks", "all true", str(plain.get("checks")), FAIL])
    return rows


def fsdp_rows(plain: dict | None, fsdp: dict | None, sections: dict) -> list[list[str]]:
    """FSDP2 against the plain engine on the same weights and batch: what FSDP computes."""
    labels = [
        "FSDP2 one rank: first gradient norm / plain engine's",
        "FSDP2 one rank: recomputed behaviour log-probs vs plain engine's",
    ]
    goals = [f"within {FSDP_GRAD_NORM_RTOL:.0%}", f"max abs diff ≤ {FSDP_LOGPROB_ATOL}"]
    if not fsdp or not fsdp.get("grad_norms"):
        why, verdict = section_note(sections, "fsdp_nccl"), absent(sections, "fsdp_nccl")
        return [[lab, goal, why, verdict] for lab, goal in zip(labels, goals)]
    if not plain or not plain.get("grad_norms"):
        why = f"no plain run to compare ({section_note(sections, 'train_1p5b')})"
        return [[lab, goal, why, MISSING] for lab, goal in zip(labels, goals)]
    same_start = plain.get("weights_checksum") == fsdp.get("weights_checksum")
    start = "" if same_start else " (the runs started from different weights)"
    g_p, g_f = plain["grad_norms"][0], fsdp["grad_norms"][0]
    rel = abs(g_f - g_p) / max(abs(g_p), 1e-12)
    ok = rel <= FSDP_GRAD_NORM_RTOL and same_start and all(fsdp.get("checks", {}).values())
    rows = [
        [
            labels[0],
            goals[0],
            f"{g_f:.6g} vs {g_p:.6g} (rel {rel:.2e}){start}",
            PASS if ok else FAIL,
        ]
    ]
    a, b = plain.get("behav_logprobs_sample"), fsdp.get("behav_logprobs_sample")
    if not a or not b or a["positions"] != b["positions"]:
        rows.append([labels[1], goals[1], "no comparable samples (different batches?)", FAIL])
        return rows
    diff = max(abs(x - y) for x, y in zip(a["values"], b["values"]))
    measured = f"{diff:.2e} over {len(a['values'])} trained tokens{start}"
    rows.append(
        [labels[1], goals[1], measured, PASS if diff <= FSDP_LOGPROB_ATOL and same_start else FAIL]
    )
    return rows


def bench_rows(out: Path, sections: dict) -> list[list[str]]:
    """Attention (speed-ups over per-sequence SDPA) and the CUDA-IPC weight update."""
    rows = []
    attn = read_json(out / "bench_attention.json")
    label = "varlen attention vs per-sequence SDPA (bench_attention.py)"
    if attn is None:
        rows.append(
            [label, "runs", section_note(sections, "attention"), absent(sections, "attention")]
        )
    else:
        parts, errors = [], []
        for r in attn.get("rows", []):
            if r.get("error"):
                errors.append(f"{r['backend']} {r['mode']}: {r['error']}")
            elif r.get("speedup") is not None and r["backend"] != "sdpa_loop":
                parts.append(f"{r['backend']} {r['mode']} {r['speedup']:.2f}×")
        measured = "; ".join(errors or parts) or "no backend measured"
        rows.append([label, "runs", measured, FAIL if errors else PASS])
    ipc = read_json(out / "weight_sync_ipc.json")
    label = "weight update into an engine (bench_weight_sync.py, bucketed)"
    models = (ipc or {}).get("models", {})
    if not models:
        rows.append(
            [label, "runs", section_note(sections, "ipc_sync"), absent(sections, "ipc_sync")]
        )
    else:
        parts = []
        for name, rec in models.items():
            secs = rec.get("seconds", {}).get("bucketed")
            gb = rec.get("gbytes", 0.0)
            if secs:
                parts.append(
                    f"{name} over {rec.get('transport')}: {secs * 1e3:.1f} ms for {gb:.2f} GB ({gb / secs:.0f} GB/s)"
                )
        rows.append([label, "runs", "; ".join(parts) or "no time", PASS if parts else FAIL])
    return rows


def test_rows(out: Path, sections: dict, rehearsal: bool) -> list[list[str]]:
    label, goal = "GPU tests (pytest -m cuda, -W error::RuntimeWarning)", "0 failed, all ran"
    counts = junit_counts(out / "tests.xml")
    if counts is None:
        return [
            [
                label,
                goal,
                f"no report ({section_note(sections, 'tests')})",
                absent(sections, "tests"),
            ]
        ]
    budget = read_json(out / "tests_budget.json") or {}
    bad = counts["failures"] + counts["errors"]
    measured = (
        f"{counts['passed']} passed, {bad} failed, {counts['skipped']} skipped "
        f"({section_note(sections, 'tests')})"
    )
    cut = budget.get("stopped") or budget.get("interrupted")
    if cut:
        measured += (
            f"; cut at the budget: {budget.get('started')} of {budget.get('collected')} started"
        )
    if bad:
        verdict = FAIL
    elif cut or (counts["passed"] == 0 and not rehearsal):
        verdict = MISSING
    else:
        verdict = PASS
    return [[label, goal, measured, verdict]]


def demo_rows(out: Path, sections: dict, steps: int) -> list[list[str]]:
    label, goal = f"demo main job, {steps} steps", f"exit 0, {steps} steps"
    summary = read_json(out / "demo_summary.json")
    if summary is None or sections.get("demo_job", {}).get("rc") != 0:
        return [[label, goal, section_note(sections, "demo_job"), absent(sections, "demo_job")]]
    latency = summary.get("weight_update_latency_seconds")
    if isinstance(latency, list) and latency:
        latency = f"median {sorted(latency)[len(latency) // 2]:.4f} s over {len(latency)} updates"
    measured = f"steps {summary.get('steps')}; weight_update_latency_seconds {latency}"
    return [[label, goal, measured, PASS if summary.get("steps") == steps else FAIL]]


def summarize(out: Path, lm_shape=LM_HEAD_SHAPE, demo_steps: int = 3, rehearsal: bool = False):
    """The markdown table and whether every goal passed (no FAIL, no MISSING)."""
    sections = read_sections(out / "sections.tsv")
    rows = preflight_rows(out, sections) + build_rows(out, sections)
    rows += lm_head_rows(read_json(out / "bench_logprobs_cuda.json"), lm_shape, sections)
    plain = read_json(out / "train_step_1p5b.json")
    rows += train_rows(plain, sections)
    rows += fsdp_rows(plain, read_json(out / "train_step_fsdp.json"), sections)
    rows += bench_rows(out, sections) + test_rows(out, sections, rehearsal)
    rows += demo_rows(out, sections, demo_steps)
    lines = []
    if rehearsal:
        lines += [
            "CPU rehearsal at toy sizes: the verdicts on speed and precision mean nothing.",
            "",
        ]
    lines += ["| check | goal | measured | pass |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
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
    parser.add_argument("--lm-shape", default=",".join(map(str, LM_HEAD_SHAPE)), metavar="T,H,V")
    parser.add_argument("--demo-steps", type=int, default=3)
    parser.add_argument("--rehearse", action="store_true", help="a CPU rehearsal's folder")
    args = parser.parse_args(argv)
    try:
        shape = tuple(int(x) for x in args.lm_shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3:
        parser.error(f"--lm-shape takes T,H,V, got {args.lm_shape!r}")
    table, ok = summarize(args.out, shape, args.demo_steps, args.rehearse)
    print(table, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
