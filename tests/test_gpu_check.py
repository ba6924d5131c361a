"""benches/gpu_check.sh without a GPU: its CPU rehearsal end to end (every section's entry
point at toy sizes, the summary, the $OUT copies), the preflight's refusal without the carried
folder, the deadline, the GPU test selection and the pytest budget plugin; every Python part
it runs (``--help``), the 1.5B-shaped Qwen2 config and one train step of that structure at a
tiny width on the CPU. The summary's verdicts: tests/test_gpu_check_summary.py."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCHES = REPO / "benches"
SCRIPT = BENCHES / "gpu_check.sh"
sys.path.insert(0, str(BENCHES))

import bench_train_step  # noqa: E402
import gpu_check_preflight as preflight  # noqa: E402


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
        "gpu_check_preflight.py",
        "gpu_check_rehearsal.py",
        "bench_logprobs.py",
        "bench_train_step.py",
        "bench_weight_sync.py",
        "bench_attention.py",
        "gpu_check_summary.py",
        "demo_model_stub.py",
    ):
        assert name in parts
    assert not [p for p in parts if not (BENCHES / p).is_file()]


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


@pytest.mark.parametrize(
    "path", ["benches/wheels/liger_kernel-0.8.5-py3-none-any.whl", "areal_fast/kernels"]
)
def test_carried_folder_and_kernels_link_are_ignored(path):
    # the kernels link the script makes must never be committed (the wheel maps kernels/)
    proc = _run(["git", "check-ignore", "-q", path])
    assert proc.returncode == 0, f"{path} must be git-ignored"


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
    argv = ["--device", "cpu", "--tiny", "--layers", "2", "--steps", "1", "--warmup", "0"]
    record = bench_train_step.main([*argv, "--json", str(out)])
    assert json.loads(out.read_text())["losses"] == record["losses"]
    assert record["engine"] == "TorchTrainEngine" and record["tiny"]
    assert record["precision"] == "fp32"
    assert record["config"]["num_hidden_layers"] == 2
    assert record["config"]["num_attention_heads"] == 12  # the 1.5B's heads, 1/16 of the width
    sample = record["behav_logprobs_sample"]
    trained = record["batch"]["trained_tokens"]
    assert len(sample["positions"]) == len(sample["values"]) == min(256, trained)
    assert all(v < 0 for v in sample["values"])
    assert math.isfinite(record["weights_checksum"])
    assert all(math.isfinite(v) for v in record["losses"])
    assert record["grad_norms"][0] > 0 and math.isfinite(record["grad_norms"][0])
    assert record["zero_grad_params"] == []
    assert all(record["checks"].values())
    assert 0 < record["batch"]["trained_tokens"] < record["batch"]["tokens"]
    assert record["tokens_per_s"] > 0 and record["mfu_vs_peak"] > 0


@pytest.mark.parametrize(
    "argv",
    [["--fsdp", "nccl"], ["--precision", "bf16"], ["--precision", "mixed"], ["--layers", "0"]],
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


def test_mixed_precision_model_has_float32_master_weights():
    pytest.importorskip("areal_fast.train.precision")
    config = bench_train_step.tiny_config(
        bench_train_step.load_config(bench_train_step.DEFAULT_CONFIG)
    )
    model = bench_train_step.build_model(config, "cpu", "mixed")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.areal_compute_dtype == torch.bfloat16


# --------------------------------------------------------------------- the GPU test selection


def _script_gpu_tests() -> list[str]:
    match = re.search(r'gpu_tests="([^"]*)"', SCRIPT.read_text())
    assert match, 'gpu_check.sh lists its GPU tests in gpu_tests="..."'
    return match.group(1).split()


def test_every_cuda_test_is_in_the_script_selection():
    """A test marked ``cuda`` (directly, through ``impl_params`` or ``cuda_when_present``) in
    a file the script does not list would never run on the GPU."""
    listed = set(_script_gpu_tests())
    assert "tests/models/test_packed_attention_backends.py" in listed
    assert all((REPO / path).is_file() for path in listed), listed
    marked = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        text = path.read_text()
        if re.search(r"mark\.cuda\b|impl_params\(|cuda_when_present|DEVICE == \"cuda\"", text):
            marked.add(path.relative_to(REPO).as_posix())
    marked.discard("tests/test_gpu_check.py")
    assert marked <= listed, sorted(marked - listed)
    assert "-m cuda" in SCRIPT.read_text() and "-W error::RuntimeWarning" in SCRIPT.read_text()
    # no xdist (-n N): the suite has never run under it
    run_tests = SCRIPT.read_text().split("run_tests() {", 1)[1].split("\n}\n", 1)[0]
    assert "pytest" in run_tests and not re.search(r"\s-n\s+(\d+|auto)\b", run_tests)


def test_cuda_marker_is_registered():
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'"cuda: ', text)


# --------------------------------------------------------------------- the pytest budget plugin


def _budget_pytest(tmp_path, *args, timeout_s=None):
    (tmp_path / "test_sleepy.py").write_text(
        "import time\nimport pytest\n\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_sleep(i):\n    time.sleep(1.0)\n"
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_pytest_budget"]
    cmd += ["--junitxml", str(tmp_path / "x.xml"), "--budget-report", str(tmp_path / "r.json")]
    cmd += [*args, "test_sleepy.py"]
    if timeout_s is not None:
        cmd = ["timeout", "-k", "10", str(timeout_s), *cmd]
    env = dict(os.environ, PYTHONPATH=str(BENCHES))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    report = json.loads((tmp_path / "r.json").read_text())
    xml = (tmp_path / "x.xml").read_text()
    return proc, report, int(re.search(r'tests="(\d+)"', xml).group(1))


def test_budget_plugin_stops_starting_tests_and_writes_the_xml(tmp_path):
    proc, report, in_xml = _budget_pytest(tmp_path, "--stop-after", "2.5")
    assert report["stopped"] and not report["interrupted"]
    assert report["collected"] == 6 and 1 <= report["started"] < 6
    assert in_xml == report["started"]
    assert "budget reached" in proc.stdout


def test_budget_plugin_turns_sigterm_into_an_interrupt_with_the_xml(tmp_path):
    proc, report, in_xml = _budget_pytest(tmp_path, timeout_s=3)
    assert proc.returncode == 124  # `timeout`'s SIGTERM
    assert report["interrupted"] and not report["stopped"]
    assert report["started"] < 6 and in_xml <= report["started"]


# --------------------------------------------------------------------- the preflight


def _manifest(folder: Path, lines: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "MANIFEST").write_text("# a comment\n" + "\n".join(lines) + "\n")
    return folder


def test_preflight_names_what_was_not_carried(tmp_path):
    with pytest.raises(preflight.Refused, match="nowhere/ was not carried"):
        preflight.read_manifest(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(preflight.Refused, match="MANIFEST is missing"):
        preflight.read_manifest(tmp_path / "empty")
    wheels = _manifest(tmp_path / "w", ["a-1-py3-none-any.whl\ta\tlm_head", "b.tar.gz\tb\tdemo"])
    (wheels / "b.tar.gz").write_bytes(b"")
    with pytest.raises(preflight.Refused, match="lacks a-1-py3-none-any.whl "):
        preflight.read_manifest(wheels)
    _manifest(wheels, ["a-1-py3-none-any.whl lm_head"])
    with pytest.raises(preflight.Refused, match="MANIFEST:2: expected FILE<TAB>MODULE<TAB>"):
        preflight.read_manifest(wheels)


def test_preflight_installs_the_good_wheels_when_one_is_broken(tmp_path):
    from gpu_check_rehearsal import write_wheel

    wheels = tmp_path / "w"
    wheels.mkdir()
    good = write_wheel(wheels, "probe_good", "1.0", {"probe_good/__init__.py": b"X = 1\n"})
    broken = wheels / "probe_broken-1.0-py3-none-any.whl"
    broken.write_bytes(b"not a zip file")
    entries = [
        {"file": good.name, "module": "probe_good", "section": "x"},
        {"file": broken.name, "module": "probe_broken", "section": "x"},
    ]
    result = preflight.install_wheels(wheels, entries, tmp_path / "site")
    assert result["installed"] == [good.name] and list(result["failed"]) == [broken.name]
    imports = preflight.import_check(["probe_good", "probe_broken"], tmp_path / "site")
    assert imports["probe_good"] is None and "ModuleNotFoundError" in imports["probe_broken"]


def test_preflight_reads_the_form_of_linear_cross_entropy():
    from types import SimpleNamespace

    def fake(**functional):
        return SimpleNamespace(nn=SimpleNamespace(functional=SimpleNamespace(**functional)))

    assert preflight.lce_variant(fake()) == "absent"

    def reference(input, linear_weight, target, *, reduction="mean"):
        return None

    assert preflight.lce_variant(fake(linear_cross_entropy=reference)) == "reference"
    assert preflight.lce_variant(torch) in ("absent", "reference", "chunked")


# --------------------------------------------------------------------- the script end to end


def _env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK_", "OUT"))}
    env.pop("PYTHONPATH", None)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env.update(GPU_CHECK_DIR=str(tmp_path / "work"), OUT=str(tmp_path / "out"), **extra)
    (tmp_path / "out").mkdir(exist_ok=True)
    return env


def test_preflight_refuses_in_one_line_without_the_carried_folder(tmp_path):
    """benches/wheels not carried: one line naming it, exit 2, within 20 s, nothing run."""
    env = _env(tmp_path, GPU_CHECK_WHEELS=str(tmp_path / "wheels"))
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert time.monotonic() - start < 20
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "wheels/ was not carried" in lines[0], proc.stdout
    assert "gpu_check_prepare.sh" in lines[0]
    assert (tmp_path / "out" / "gpu_check.log").read_text().strip() == lines[0]
    rows = (tmp_path / "work" / "sections.tsv").read_text().splitlines()
    assert rows == [rows[0]] and rows[0].startswith("preflight\t2\t")


@pytest.mark.parametrize(
    ("knobs", "says"),
    [
        ({"GPU_CHECK_ONLY": "lm-head tests"}, "GPU_CHECK_ONLY: no section 'lm-head'"),
        ({"GPU_CHECK_DEADLINE": "5s"}, "GPU_CHECK_DEADLINE must be a positive whole number"),
        ({"GPU_CHECK_DEADLINE": "-10"}, "GPU_CHECK_DEADLINE must be a positive whole number"),
        ({"GPU_CHECK_BUDGET_SCALE": "0.5"}, "GPU_CHECK_BUDGET_SCALE must be a positive whole"),
        ({"GPU_CHECK_REHEARSE": "yes"}, "GPU_CHECK_REHEARSE must be 0 or 1"),
    ],
)
def test_bad_knobs_are_refused_before_anything_runs(tmp_path, knobs, says):
    """A typo in a knob: one line naming it, exit 2, the work folder neither made nor
    emptied (a section name that matched nothing once skipped K1 without a word)."""
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=_env(tmp_path, **knobs),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr
    assert not (tmp_path / "work").exists()


def test_a_work_folder_the_script_did_not_make_is_not_emptied(tmp_path):
    """GPU_CHECK_DIR naming an existing folder without the script's marker: refused, kept."""
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "mine.txt").write_text("keep me")
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=_env(tmp_path),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "was not made by gpu_check.sh" in proc.stderr, proc.stderr
    assert (tmp_path / "work" / "mine.txt").read_text() == "keep me"


def test_deadline_cuts_a_hung_section_and_skips_the_rest(tmp_path):
    """Stand-in tools (python3 does nothing, except the LM-head benchmark, which hangs, and
    the summary), on the rehearsal's copy of the checkout: the hung section is cut at the
    deadline, later ones are skipped, the files come back under $OUT and the summary table
    comes last."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "python3").write_text(
        "#!/usr/bin/env bash\n"
        'case "$*" in\n'
        '  benches/gpu_check_summary.py*) exec "$REAL_PYTHON" "$@" ;;\n'
        "  *--warmup-only*) exit 0 ;;\n"
        "  benches/bench_logprobs.py*) sleep 60 ;;\n"
        "esac\n"
        "exit 0\n"
    )
    for name in ("nvcc", "nvidia-smi"):
        (stubs / name).write_text("#!/usr/bin/env bash\nexit 0\n")
    for tool in stubs.iterdir():
        tool.chmod(0o755)
    env = _env(tmp_path, REAL_PYTHON=sys.executable, GPU_CHECK_DEADLINE="12")
    env.update(GPU_CHECK_REHEARSE="1", GPU_CHECK_BUDGET_SCALE="1")
    env["PATH"] = f"{stubs}:/usr/bin:/bin"
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = (tmp_path / "work" / "sections.tsv").read_text().splitlines()
    rc = {line.split("\t")[0]: int(line.split("\t")[1]) for line in rows}
    assert list(rc) == [
        "preflight", "build", "lm_head_warmup", "lm_head", "train_1p5b", "fsdp_nccl",
        "attention", "ipc_sync", "tests", "source_pkgs", "demo_job",
    ]  # fmt: skip
    assert rc["preflight"] == 0 and rc["lm_head_warmup"] == 0
    assert rc["lm_head"] == 124  # cut at the deadline
    assert all(rc[name] == 125 for name in ("train_1p5b", "tests", "demo_job"))  # no time left
    out = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"gpu_check.log", "summary.md", "gpu_check_results.tar.gz"} <= out and len(out) <= 8
    lines = proc.stdout.rstrip().splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("## gpu_check summary"))
    table = lines.index("| check | goal | measured | pass |", header)
    assert lines[header + 1].startswith("CPU rehearsal")  # a rehearsal's note, then the table
    assert all(line.startswith("|") or not line or "sections" in line for line in lines[table:])
    assert "lm_head" in lines[-1] and "(exit 124)" in lines[-1]


def _ignored_and_untracked(path: Path) -> str:
    return _run(["git", "status", "--porcelain", "--ignored", "--", str(path)]).stdout


def test_cpu_rehearsal_runs_every_section(tmp_path):
    """GPU_CHECK_REHEARSE=1: every section's entry point with the GPU run's arguments at toy
    sizes on the CPU, the summary and the $OUT copies; the caller's checkout is untouched."""
    before = _ignored_and_untracked(REPO / "areal_fast")
    env = _env(tmp_path, GPU_CHECK_REHEARSE="1")
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400
    )
    work, out = tmp_path / "work", tmp_path / "out"
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    rows = [line.split("\t") for line in (work / "sections.tsv").read_text().splitlines()]
    assert {name: int(rc) for name, rc, *_ in rows} == {
        name: 0
        for name in (
            "preflight", "build", "lm_head_warmup", "lm_head", "train_1p5b", "fsdp_nccl",
            "attention", "ipc_sync", "tests", "source_pkgs", "demo_job",
        )
    }, log  # fmt: skip
    assert proc.returncode == 1, log  # speed goals fail on the CPU, as they should
    verdicts = {}
    for line in (work / "summary.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4:
            verdicts[cells[0]] = cells[3]
    for label in (
        "carried wheels install and import",
        "Liger ran compiled (torch.compile)",
        "FSDP2 one rank: first gradient norm / plain engine's",
        "FSDP2 one rank: recomputed behaviour log-probs vs plain engine's",
        "varlen attention vs per-sequence SDPA (bench_attention.py)",
        "weight update into an engine (bench_weight_sync.py, bucketed)",
        "GPU tests (pytest -m cuda, -W error::RuntimeWarning)",
        "demo main job, 1 steps",
    ):
        assert verdicts.get(label) == "PASS", (label, verdicts)
    k1 = [label for label in verdicts if label.startswith("K1 ")]
    assert len(k1) == 4 and all(verdicts[label] in ("PASS", "FAIL") for label in k1), verdicts
    lm = json.loads((work / "bench_logprobs_cuda.json").read_text())
    cases = lm["results"][0]["modes"]["fwd_bwd"]
    assert cases["compiled_loss"]["checks"]["loss"] == pytest.approx(
        cases["fused_loss"]["checks"]["loss"], rel=1e-4
    )
    assert cases["liger_grpo"]["liger_compiled"] is True
    # on the CPU the extra peak is the process's resident-set high-water mark, which earlier
    # cases may already have raised: the flag is recorded, its logic is tested on made-up
    # records (tests/test_bench_lm_head.py); on CUDA the allocator's peak is reset per case
    assert isinstance(cases["naive"]["materialised_logits"], bool)
    names = {p.name for p in out.iterdir()}
    assert {"gpu_check.log", "summary.md", "preflight.json", "gpu_check_results.tar.gz"} <= names
    assert {"bench_logprobs_cuda.json", "train_step_1p5b.json", "train_step_fsdp.json"} <= names
    assert len(names) <= 8
    assert proc.stdout.rstrip().splitlines()[-1].startswith("sections (seconds used / budget)")
    assert _ignored_and_untracked(REPO / "areal_fast") == before


def _tiny_llama_gguf(path: Path) -> Path:
    """A GGUF file of a 2-layer Llama with a byte-level BPE tokenizer and one tensor."""
    import gguf
    import numpy as np

    tokens = ["<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens += ["Ġ", "ab", "Ġa"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_block_count(2)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * 29)
    writer.add_token_merges(["a b", "Ġ a"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_demo_model_from_gguf_metadata_without_tensors(tmp_path):
    """gpu_check_prepare.sh without a demo cache: the GGUF's metadata, no tensors, carried;
    demo_model_stub.py builds the random-weight model and tokenizer from it."""
    import demo_model_stub
    import gguf
    import gguf_metadata

    src = _tiny_llama_gguf(tmp_path / "full.gguf")
    (tmp_path / "meta").mkdir()
    meta = tmp_path / "meta" / "tiny.metadata.gguf"
    assert gguf_metadata.write_metadata_gguf(src, meta) > 10
    full, only = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(meta))
    assert len(full.tensors) == 1 and len(only.tensors) == 0
    assert set(full.fields) == set(only.fields)
    out = demo_model_stub.make_stub(tmp_path / "meta", tmp_path / "model")
    from areal_fast.models.loading import load_causal_lm, load_tokenizer

    model = load_causal_lm(str(out))
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (32, 2)
    assert model.config.tie_word_embeddings  # no output.weight: tied, as the demo is
    assert load_tokenizer(str(out))("ab a")["input_ids"]
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        gguf_metadata.write_metadata_gguf(tmp_path / "nowhere.gguf", tmp_path / "x.gguf")
