"""Every code block in README.md and docs/*.md runs as written.

- ```python blocks are executed, each in a fresh namespace, in a temporary working directory,
  on the CPU. A block whose first line is ``# requires: mod1, mod2`` is skipped when one of
  those optional modules is not installed.
- ```bash / ```sh blocks are read command by command (``&&``, ``||``, ``;`` and ``|`` split
  commands; ``\\`` continues a line). ``areal-fast train|eval|sft`` and ``python -m
  areal_fast.launch.ray train`` lines have their config parsed with
  :func:`areal_fast.launch.config.load_config` (YAML file and ``key=value`` overrides) without
  running; ``pip install``, ``pytest`` and ``git clone`` lines are recognised and skipped;
  every other command must be in :data:`ALLOWED` (scripts named there must exist), so a typo
  in a documented command fails.
- ```text blocks are output examples and are not run; ```yaml blocks must parse.
- Relative links must point at files of the repository.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
LANGUAGES = {"python", "bash", "sh", "text", "yaml"}

# Commands other than the configs, installs and test runs that the docs may show:
# (program, first argument or None for any). Scripts named as first argument must exist.
ALLOWED = {
    ("areal-fast", "config"),  # prints every key with its default
    ("areal-fast", "--help"),
    ("areal-fast", "compare"),  # two run directories, nothing written
    ("python", "benches/compare_runs.py"),
    ("python", "examples/data/sft_arith/make.py"),
    ("python", "examples/agents/make_search_corpus.py"),
    ("python", "benches/eval_agent.py"),
    ("python", "benches/bench_async.py"),
    ("python", "benches/bench_logprobs.py"),
    ("bash", "benches/gpu_check.sh"),
    ("bash", "benches/gpu_weight_sync.sh"),
    ("cat", None),
    ("ls", None),
    ("zstdcat", None),
    ("ray", "start"),
}
SKIPPED = {
    ("pip", "install"),
    ("pip", "uninstall"),
    ("pip", "download"),
    ("git", "clone"),
    ("pytest", None),
}
# link targets made by other means: the progress plot of a real run of the default job, and
# the key reference generated from the config dataclasses
NOT_WRITTEN_BY_HAND = {"docs/images/arith_progress.png", "docs/config.md"}


def _blocks() -> list:
    params = []
    for path in DOC_FILES:
        text = path.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            rel = path.relative_to(ROOT).as_posix()
            params.append(
                pytest.param(rel, line, match.group(1), match.group(2), id=f"{rel}:{line}")
            )
    return params


BLOCKS = _blocks()


def test_docs_have_code_blocks():
    assert (ROOT / "README.md").is_file()
    assert any(p.values[0] == "README.md" for p in BLOCKS)
    assert len({p.values[0] for p in BLOCKS}) >= 5  # README and the docs pages


@pytest.mark.parametrize("path,line,lang,code", BLOCKS)
def test_code_block_runs(path, line, lang, code, tmp_path, monkeypatch):
    assert lang in LANGUAGES, (
        f"{path}:{line}: code block language {lang!r}; use one of "
        f"{sorted(LANGUAGES)} (```text for output that is not run)"
    )
    if lang == "text":
        return
    if lang == "yaml":
        import yaml

        yaml.safe_load(code)
        return
    if lang == "python":
        _run_python(path, line, code, tmp_path, monkeypatch)
        return
    for command in _commands(code):
        _check_command(path, line, command)


# ------------------------------------------------------------------------------- python


def _run_python(path: str, line: int, code: str, tmp_path: Path, monkeypatch) -> None:
    first = code.splitlines()[0] if code.strip() else ""
    if first.startswith("# requires:"):
        for module in first.split(":", 1)[1].split(","):
            if importlib.util.find_spec(module.strip()) is None:
                pytest.skip(f"{path}:{line} needs {module.strip()}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))  # `examples.agents...` style imports
    namespace = {"__name__": "__doc_block__"}
    exec(compile(code, f"{path}:{line}", "exec"), namespace)  # noqa: S102 - the docs' own code


# --------------------------------------------------------------------------------- shell


def _commands(code: str) -> list[list[str]]:
    """Shell commands of a block as token lists (comments and line continuations removed)."""
    joined = re.sub(r"\\\n", " ", code)
    commands = []
    for raw in joined.splitlines():
        tokens = shlex.split(raw, comments=True)
        current: list[str] = []
        for token in tokens:
            if token in ("&&", "||", ";", "|", "&"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token)
        if current:
            commands.append(current)
    return commands


def _strip_env(tokens: list[str]) -> list[str]:
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):
        tokens = tokens[1:]
    return tokens


def _check_command(path: str, line: int, tokens: list[str]) -> None:
    where = f"{path}:{line}: `{' '.join(tokens)}`"
    tokens = _strip_env(tokens)
    assert tokens, where
    program, first = tokens[0], tokens[1] if len(tokens) > 1 else None
    if program == "python" and first == "-m" and len(tokens) > 2:
        if tokens[2] == "areal_fast.launch.ray":
            assert len(tokens) > 3 and tokens[3] == "train", f"{where}: expected `train`"
            _check_config(where, tokens[4:])
            return
        if tokens[2] == "pip":
            program, first = "pip", tokens[3] if len(tokens) > 3 else None
    if program == "areal-fast" and first in ("train", "eval", "sft", "submit"):
        _check_config(where, tokens[2:], sft=first == "sft")
        return
    if (program, first) in SKIPPED or (program, None) in SKIPPED:
        if program == "pytest":
            for arg in tokens[1:]:
                if not arg.startswith("-") and "/" in arg or arg == "tests":
                    assert (ROOT / arg.split("::")[0]).exists(), f"{where}: no {arg}"
        return
    if (program, None) in ALLOWED:
        return
    assert (program, first) in ALLOWED, f"{where}: command not in tests/test_docs.py ALLOWED"
    if first is not None and ("/" in first or first.endswith((".py", ".sh"))):
        assert (ROOT / first).is_file(), f"{where}: {first} does not exist"


def _check_config(where: str, args: list[str], sft: bool = False) -> None:
    from areal_fast.launch.config import load_config
    from areal_fast.launch.sft_config import load_sft_config

    config, overrides, i = None, [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--config":
            config, i = args[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            pass  # flags such as --no-progress
        else:
            assert "=" in arg, f"{where}: {arg!r} is not key=value"
            overrides.append(arg)
        i += 1
    assert config is not None, f"{where}: no --config"
    assert (ROOT / config).is_file(), f"{where}: {config} does not exist"
    (load_sft_config if sft else load_config)(str(ROOT / config), overrides)


# --------------------------------------------------------------------------------- links

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as '-'."""
    text = FENCE.sub("", markdown)
    headings = re.findall(r"^#{1,6} (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize(
    "path", [p.relative_to(ROOT).as_posix() for p in DOC_FILES] + ["benches/README.md"]
)
def test_relative_links_exist(path):
    doc = ROOT / path
    missing = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        name, _, anchor = target.partition("#")
        file = (doc.parent / name).resolve() if name else doc
        rel = file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else str(file)
        if not file.exists():
            if rel not in NOT_WRITTEN_BY_HAND:
                missing.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            missing.append(target)
    assert not missing, f"{path}: links to missing files or headings {missing}"


@pytest.mark.parametrize(
    "code",
    [
        "areal-fast trian --config examples/arith.yaml",  # misspelt command
        "areal-fast train --config examples/arith.yaml actor.optim.lrr=1",  # unknown key
        "areal-fast train --config examples/arth.yaml",  # missing file
        "areal-fast train examples/arith.yaml",  # no --config
        "python benches/compare_run.py RUN",  # unknown script
        "pip install . && pytest tests/no_such_test.py",  # missing test file
        "python -m areal_fast.launch.ray trian --config examples/arith.yaml",
    ],
)
def test_command_check_catches_typos(code):
    with pytest.raises(Exception):  # noqa: B017 - AssertionError or the config's ValueError
        for command in _commands(code):
            _check_command("doc.md", 1, command)


def test_command_check_accepts_documented_forms():
    code = (
        "AREAL_FAST_CUDA=0 pip install . && pytest tests  # comment\n"
        "python -m areal_fast.launch.ray train --config examples/arith.yaml \\\n"
        "    scheduler.train_world_size=2 checkpoint.every_steps=5\n"
        "areal-fast train --config examples/arith.yaml --no-progress total_steps=1\n"
    )
    commands = _commands(code)
    assert [c[0] for c in commands] == ["AREAL_FAST_CUDA=0", "pytest", "python", "areal-fast"]
    for command in commands:
        _check_command("doc.md", 1, command)


def test_tour_opens_at_most_eight_files():
    text = (ROOT / "README.md").read_text()
    tour = text.split("## Follow one step", 1)[1].split("\n## ", 1)[0]
    files = set(re.findall(r"`(areal_fast/[\w/]+\.py)`", tour))
    assert 6 <= len(files) <= 8, sorted(files)
    assert all((ROOT / f).is_file() for f in files), sorted(files)
    # each item says which process its file runs in
    items = re.findall(r"^\d+\. `(areal_fast/[\w/]+\.py)` \(([^)]*)\)", tour, flags=re.M)
    assert {f for f, _ in items} == files, items
    processes = ("launcher", "rollout worker", "trainer")
    assert all(any(p in where for p in processes) for _, where in items), items


def test_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_bytes()) <= 15_000


def test_benches_readme_is_compact():
    """One current table per benchmark; earlier runs live in benches/results/ and CHANGELOG.md."""
    assert len((ROOT / "benches" / "README.md").read_bytes()) <= 25_000


def _config_keys() -> tuple[set[str], set[str], set[str]]:
    """Every config key, the dataclass sections, and the free-form mapping keys (task_kwargs),
    of ``areal-fast train`` and ``areal-fast sft`` together."""
    from omegaconf import DictConfig, OmegaConf

    from areal_fast.launch.config import ExperimentConfig
    from areal_fast.launch.sft_config import SftConfig

    keys, sections, free = set(), set(), set()

    def walk(node: DictConfig, prefix: str = "") -> None:
        for key in node:
            name, child = prefix + str(key), node._get_node(key)
            keys.add(name)
            if isinstance(child, DictConfig):
                if OmegaConf.get_type(child) is dict:
                    free.add(name)
                else:
                    sections.add(name)
                    walk(child, name + ".")

    walk(OmegaConf.structured(ExperimentConfig))
    walk(OmegaConf.structured(SftConfig))
    return keys, sections, free


def test_config_keys_named_in_the_docs_exist():
    keys, sections, free = _config_keys()
    unknown = []
    for path in DOC_FILES:
        for name in re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)(?:=[^`]*)?`", path.read_text()):
            if name.split(".")[0] not in sections or name in keys or name.endswith(".py"):
                continue  # not a config key (a module path, a file, a metric), or a known one
            if not any(name.startswith(m + ".") for m in free):
                unknown.append(f"{path.relative_to(ROOT)}: {name}")
    assert not unknown, unknown


def test_every_step_metric_is_documented():
    """docs/async.md's metrics table lists every key of STEP_METRICS, and no other."""
    from areal_fast.controller.step_record import STEP_METRICS

    section = (ROOT / "docs" / "async.md").read_text().split("## Metrics", 1)[1]
    table = section.split("\n\n| key |", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"^\| ([^|]+) \|", table, flags=re.M)) - {"---"}
    documented = {k.strip("` ") for cell in documented for k in cell.split(",")}
    in_code = {k.strip() for key in STEP_METRICS for k in key.replace(" and ", " / ").split(" / ")}
    assert documented == in_code


# ------------------------------------------------------------------------- module index

MODULES_DOC = ROOT / "docs" / "modules.md"


def _defines_code(path: Path) -> bool:
    """A function or method anywhere in the file, a module ``__getattr__`` (lazy re-export) aside."""
    import ast

    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and not (path.name == "__init__.py" and node.name == "__getattr__")
        for node in ast.walk(tree)
    )


def _source_modules(root: Path) -> set[str]:
    """Every ``.py`` under areal_fast/ and kernels/; an ``__init__.py`` only if it defines code."""
    found = set()
    for top in ("areal_fast", "kernels"):
        for path in (root / top).rglob("*.py"):
            if path.name != "__init__.py" or _defines_code(path):
                found.add(path.relative_to(root).as_posix())
    return found


def _documented_modules(markdown: str) -> set[str]:
    """``- `name.py` — ...`` items, each joined to the folder of the heading above it."""
    named, folder = set(), None
    for line in markdown.splitlines():
        heading = re.match(r"#{2,6} `([\w/]+/)`", line)
        if heading:
            folder = heading.group(1)
        elif line.startswith("#"):
            folder = None
        item = re.match(r"- `(\w+\.py)` — \S", line)
        if item and folder is not None:
            named.add(folder + item.group(1))
    return named


def _index_mismatch(root: Path, markdown: str) -> tuple[list[str], list[str]]:
    """(modules without a line, lines naming no module)."""
    on_disk, named = _source_modules(root), _documented_modules(markdown)
    return sorted(on_disk - named), sorted(named - on_disk)


def test_every_module_has_a_line_in_docs_modules():
    missing, extra = _index_mismatch(ROOT, MODULES_DOC.read_text())
    assert not missing, f"docs/modules.md: add one line for each of {missing}"
    assert not extra, f"docs/modules.md names modules that do not exist: {extra}"


def test_module_index_check_catches_a_new_module(tmp_path):
    (tmp_path / "areal_fast" / "wire").mkdir(parents=True)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "areal_fast" / "__init__.py").write_text("from areal_fast.cli import main\n")
    (tmp_path / "areal_fast" / "wire" / "__init__.py").write_text('"""Wire."""\n')
    (tmp_path / "areal_fast" / "cli.py").write_text("def main():\n    pass\n")
    (tmp_path / "areal_fast" / "wire" / "codec.py").write_text("X = 1\n")
    (tmp_path / "kernels" / "op.py").write_text("")
    doc = (
        "## `areal_fast/` (top level)\n\n- `cli.py` — the command\n\n"
        "## `areal_fast/wire/` — wire\n\n- `codec.py` — msgpack\n\n"
        "## `kernels/` — Triton\n\n- `op.py` — a kernel\n"
    )
    assert _index_mismatch(tmp_path, doc) == ([], [])
    (tmp_path / "areal_fast" / "wire" / "shards.py").write_text("")  # added, no line
    assert _index_mismatch(tmp_path, doc) == (["areal_fast/wire/shards.py"], [])
    (tmp_path / "areal_fast" / "wire" / "codec.py").unlink()  # removed, line kept
    assert _index_mismatch(tmp_path, doc)[1] == ["areal_fast/wire/codec.py"]
    # an __init__.py that defines code of its own needs a line too
    (tmp_path / "areal_fast" / "wire" / "__init__.py").write_text("def helper():\n    pass\n")
    assert "areal_fast/wire/__init__.py" in _index_mismatch(tmp_path, doc)[0]


# ------------------------------------------------------------------------ test-file rule
#
# A module with logic of its own (a function or method whose body is more than a docstring,
# ``...``, ``pass`` or ``raise NotImplementedError``) has tests/<package>/test_<module>.py
# (top level: tests/test_<module>.py; a leading underscore dropped: _checks.py ->
# test_checks.py). Scenario files (test_<scenario>.py) sit beside them. The exceptions below
# are tested elsewhere, in the file named (docs/modules.md gives the counts).
TESTED_ELSEWHERE = {
    "areal_fast/_nodes.py": "tests/launch/test_ray_nodes.py",
    "areal_fast/launch/slurm/config.py": "tests/launch/slurm/test_submit.py",
    "areal_fast/launch/slurm/ray_nodes.py": "tests/launch/slurm/test_slurm_job.py",
    "areal_fast/agent/bridge.py": "tests/agent/test_session.py",
    "areal_fast/agent/chat_format.py": "tests/agent/test_session.py",
    "areal_fast/agent/client.py": "tests/agent/test_session.py",
    "areal_fast/agent/protocol.py": "tests/agent/test_server.py",
    "areal_fast/controller/checkpoint_manager.py": "tests/controller/test_recovery.py",
    "areal_fast/controller/config.py": "tests/controller/test_async_loop.py",
    "areal_fast/controller/fixed_dispatch.py": "tests/launch/test_reproducible.py",
    "areal_fast/controller/held_rollouts.py": "tests/launch/test_reproducible.py",
    "areal_fast/controller/requests.py": "tests/controller/test_async_loop_eta0.py",
    "areal_fast/controller/step_evals.py": "tests/launch/test_step_evals.py",
    "areal_fast/controller/step_record.py": "tests/controller/test_async_loop.py",
    "areal_fast/controller/weight_tracker.py": "tests/controller/test_async_loop.py",
    "areal_fast/data/config.py": "tests/data/test_user_data.py",
    "areal_fast/data/gsm8k.py": "tests/data/test_data.py",
    "areal_fast/data/problems.py": "tests/data/test_data.py",
    "areal_fast/data/rewards.py": "tests/data/test_data.py",
    "areal_fast/data/tasks.py": "tests/data/test_data.py",
    "areal_fast/launch/checkpoints.py": "tests/launch/test_experiment.py",
    "areal_fast/launch/cluster.py": "tests/launch/test_components.py",
    "areal_fast/launch/command_line.py": "tests/test_cli.py",
    "areal_fast/launch/config_keys.py": "tests/launch/test_config.py",
    "areal_fast/launch/config_reference.py": "tests/launch/test_config.py",
    "areal_fast/launch/console.py": "tests/launch/test_interrupt.py",
    "areal_fast/launch/evaluation.py": "tests/test_cli.py",
    "areal_fast/launch/factories.py": "tests/launch/test_components.py",
    "areal_fast/launch/held_out.py": "tests/launch/test_step_evals.py",
    "areal_fast/launch/inputs.py": "tests/launch/test_config.py",
    "areal_fast/launch/ray.py": "tests/launch/test_multi_node.py",
    "areal_fast/launch/reporter.py": "tests/launch/test_experiment.py",
    "areal_fast/launch/sft_config.py": "tests/launch/test_sft.py",
    "areal_fast/launch/sft_evals.py": "tests/launch/test_sft.py",
    "areal_fast/launch/sft_ranks.py": "tests/launch/test_sft.py",
    "areal_fast/launch/sft_reports.py": "tests/launch/test_sft.py",
    "areal_fast/launch/summary.py": "tests/test_cli.py",
    "areal_fast/launch/worker_specs.py": "tests/launch/test_components.py",
    "areal_fast/models/attention_backends.py": "tests/models/test_packed_attention_backends.py",
    "areal_fast/models/config.py": "tests/models/test_loading.py",
    "areal_fast/ops/fused_pass.py": "tests/ops/test_fused_linear_grpo_loss.py",
    "areal_fast/ops/logprob_rows.py": "tests/ops/test_triton_rows.py",
    "areal_fast/ops/logprobs.py": "tests/ops/test_linear_logprobs.py",
    "areal_fast/ops/logprobs_tiled.py": "tests/ops/test_linear_logprobs.py",
    "areal_fast/rl/batch.py": "tests/wire/test_shards.py",
    "areal_fast/rl/config.py": "tests/rl/test_objectives.py",
    "areal_fast/rl/fused_loss.py": "tests/ops/test_fused_linear_grpo_loss.py",
    "areal_fast/rollout/config.py": "tests/rollout/test_vllm_config.py",
    "areal_fast/rollout/engine.py": "tests/rollout/test_hf_engine.py",
    "areal_fast/rollout/http_json.py": "tests/rollout/test_sglang_server.py",
    "areal_fast/rollout/kv_slots.py": "tests/rollout/test_decode_batch.py",
    "areal_fast/rollout/sampling.py": "tests/rollout/test_hf_engine.py",
    "areal_fast/rollout/simulated.py": "tests/controller/test_async_loop.py",
    "areal_fast/rollout/static_batch.py": "tests/rollout/test_hf_engine.py",
    "areal_fast/sync/config.py": "tests/sync/test_cuda_slots.py",
    "areal_fast/sync/receiver.py": "tests/sync/test_sender.py",
    "areal_fast/sync/shared_memory.py": "tests/sync/test_buckets.py",
    "areal_fast/sync/sources.py": "tests/sync/test_sender.py",
    "areal_fast/sync/trainer_slots.py": "tests/sync/test_cuda_slots.py",
    "areal_fast/sync/transports.py": "tests/sync/test_sender.py",
    "areal_fast/train/config.py": "tests/train/test_torch_engine.py",
    "areal_fast/train/simulated.py": "tests/controller/test_async_loop.py",
    "areal_fast/wire/shard_io.py": "tests/wire/test_shards.py",
    "areal_fast/workers/core_hooks.py": "tests/workers/test_core_share.py",
    "areal_fast/workers/reward_pool.py": "tests/data/test_user_reward.py",
    "areal_fast/workers/rollout_weights.py": "tests/launch/test_step_evals.py",
    "areal_fast/workers/rollout_worker.py": "tests/workers/test_reward_worker.py",
    "areal_fast/workers/trainer_worker.py": "tests/controller/test_async_loop.py",
    "kernels/grpo_loss.py": "tests/ops/test_triton_grpo_loss.py",
    "kernels/linear_logprobs.py": "tests/ops/test_triton_rows.py",
}


def _is_stub(function) -> bool:
    import ast

    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return all(
        isinstance(s, ast.Pass)
        or (isinstance(s, ast.Expr) and getattr(s.value, "value", None) is Ellipsis)
        or (isinstance(s, ast.Raise) and "NotImplementedError" in ast.unparse(s.exc or s))
        for s in body
    )


def _has_logic(path: Path) -> bool:
    import ast

    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and not _is_stub(node)
        and not (path.name == "__init__.py" and node.name == "__getattr__")
        for node in ast.walk(tree)
    )


def _own_test_file(module: str) -> str:
    """areal_fast/sync/receivers/vllm.py -> tests/sync/receivers/test_vllm.py."""
    parts = module.split("/")
    folders = parts[1:-1] if parts[0] == "areal_fast" else parts[:-1]
    return "/".join(["tests", *folders, "test_" + parts[-1].lstrip("_")])


def _test_file_rule(root: Path, exceptions: dict) -> dict[str, list[str]]:
    """Modules with logic and neither an own test file nor an exception; exceptions that are
    stale (no such module, it has its own test file now, no logic) or name a missing file."""
    logic = {m for m in _source_modules(root) if _has_logic(root / m)}
    own = {m for m in logic if (root / _own_test_file(m)).is_file()}
    return {
        "no test file": sorted(logic - own - set(exceptions)),
        "stale exception": sorted(set(exceptions) - (logic - own)),
        "missing test file": sorted(m for m, f in exceptions.items() if not (root / f).is_file()),
    }


def _rule_counts(root: Path) -> tuple[int, int, int]:
    """(modules, modules with logic, modules with logic and an own test file)."""
    modules = _source_modules(root)
    logic = {m for m in modules if _has_logic(root / m)}
    own = {m for m in logic if (root / _own_test_file(m)).is_file()}
    return len(modules), len(logic), len(own)


def test_every_module_with_logic_has_a_test_file():
    problems = {k: v for k, v in _test_file_rule(ROOT, TESTED_ELSEWHERE).items() if v}
    assert not problems, (
        f"{problems}: add tests/<package>/test_<module>.py (or, for a module tested only "
        "through a scenario, an entry in TESTED_ELSEWHERE)"
    )


def test_docs_modules_states_the_measured_counts():
    modules, logic, own = _rule_counts(ROOT)
    text = MODULES_DOC.read_text()
    stated = f"{own} of the {logic} modules with logic (of {modules} modules)"
    assert stated in text, f"docs/modules.md should say {stated!r}"


def test_test_file_rule_catches_a_module_without_tests(tmp_path):
    (tmp_path / "areal_fast" / "wire").mkdir(parents=True)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "tests" / "wire").mkdir(parents=True)
    src = tmp_path / "areal_fast" / "wire"
    (src / "messages.py").write_text("class Done:\n    x: int = 0\n")  # no logic
    (src / "iface.py").write_text('def f():\n    """Doc."""\n    raise NotImplementedError\n')
    (src / "codec.py").write_text("def encode(x):\n    return x\n")
    (tmp_path / "tests" / "wire" / "test_codec.py").write_text("")
    assert not any(_test_file_rule(tmp_path, {}).values())
    (src / "_shards.py").write_text("def split(b):\n    return [b]\n")
    assert _test_file_rule(tmp_path, {})["no test file"] == ["areal_fast/wire/_shards.py"]
    elsewhere = {"areal_fast/wire/_shards.py": "tests/wire/test_codec.py"}
    assert not any(_test_file_rule(tmp_path, elsewhere).values())
    (tmp_path / "tests" / "wire" / "test_shards.py").write_text("")  # leading _ dropped
    assert _test_file_rule(tmp_path, elsewhere)["stale exception"] == ["areal_fast/wire/_shards.py"]
    assert _test_file_rule(tmp_path, {"areal_fast/wire/codec.py": "tests/x.py"}) == {
        "no test file": [],
        "stale exception": ["areal_fast/wire/codec.py"],
        "missing test file": ["areal_fast/wire/codec.py"],
    }
    assert _rule_counts(tmp_path) == (4, 2, 2)
