"""``areal-fast compare RUN_A RUN_B``: the first place where two run directories differ.

Three kinds of output are compared, each on its own: ``metrics.jsonl`` step by step (every
field but those in :data:`TIMING_FIELDS`), each ``eval_*.jsonl`` problem by problem, and the
final weights in ``checkpoint/*.safetensors`` tensor by tensor (one tensor of each run in
memory at a time). :func:`compare_runs` returns one :class:`Finding` per kind;
:func:`run_compare` prints them and gives the exit code. Nothing of the controller or the
workers is imported: the field names below are kept in step with ``STEP_METRICS``
(``controller/step_record.py``) by ``tests/launch/test_compare.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

# metrics.jsonl fields that differ between two runs of the same computation (see STEP_METRICS
# in controller/step_record.py and docs/async.md#metrics); compare skips them
TIMING_FIELDS = frozenset(
    {
        # wall-clock durations, seconds
        "fetch_seconds",
        "fetch_wait_seconds",
        "train_seconds",
        "publish_seconds",
        "trainer_wait_seconds",
        "step_seconds",
        "elapsed_seconds",
        "agent/finish_seconds",
        # rates: tokens per wall-clock second
        "train_tokens_per_s",
        "trained_tokens_per_s_cumulative",
        "gen_tokens_per_s_cumulative",
        # memory: peak resident set size
        "trainer_peak_rss_mb",
        # time-weighted over train_seconds: follows when the rollout workers happened to idle
        "train_threads_mean",
        # the rollout ledger at the wall-clock moment the record was written
        "rollouts_running",
        "rollouts_ready",
        # which record carries a held-out result depends on when that evaluation finished;
        # the results themselves are compared in eval_step_<k>.jsonl
        "eval_accuracy",
        "eval_step",
    }
)
METRICS_FILE = "metrics.jsonl"
SHOWN_TENSORS = 5  # differing tensors named in the one-line report (the JSON lists all)
_CHUNK = 1 << 22  # elements per float64 chunk of max |a - b|


class CompareError(ValueError):
    """Bad input to ``areal-fast compare``: a path that is not a run directory, or a file that
    cannot be read (the message is one line naming the file, and the line where there is one)."""


@dataclass
class Finding:
    """What one kind of output (``section``) showed: ``difference`` is the first difference as
    one line, ``None`` when there is none (``note`` then says what was compared); ``details``
    holds the same difference as data for ``--json``."""

    section: str
    difference: str | None = None
    note: str = "identical"
    details: dict = field(default_factory=dict)

    @property
    def line(self) -> str:
        """The report's line for this section: ``section: difference`` or ``section: note``."""
        return f"{self.section}: {self.difference or self.note}"

    def as_dict(self) -> dict:
        """``identical``, ``summary`` (the line without the section) and the details."""
        return {
            "identical": self.difference is None,
            "summary": self.difference or self.note,
            **self.details,
        }


# --------------------------------------------------------------------------- reading


def check_run(path: Path) -> None:
    """Raises :class:`CompareError` unless ``path`` is a run directory (holds ``config.yaml``,
    as every run directory does from its start)."""
    if path.exists() and not path.is_dir():
        raise CompareError(f"{path} is a file, not a run directory (give the folder)")
    if not path.is_dir():
        raise CompareError(f"{path}: no such directory")
    if not (path / "config.yaml").is_file():
        raise CompareError(f"{path} is not an areal-fast run directory (no config.yaml)")


def read_jsonl(path: Path, key: str) -> list[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line of ``path``, each object holding
    ``key``. Raises :class:`CompareError` naming the file (and line) if the file cannot be
    read or a line is not a JSON object with ``key``."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CompareError(f"{path}: cannot be read ({exc})") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CompareError(f"{path} line {number}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or key not in record:
            raise CompareError(f"{path} line {number}: not a JSON object with {key!r}")
        records.append((number, record))
    return records


def _steps(path: Path) -> dict[int, dict]:
    """Step → record of a ``metrics.jsonl``; raises :class:`CompareError` on a bad file, a
    step that is not an integer or one that appears twice."""
    steps: dict[int, dict] = {}
    for number, record in read_jsonl(path, "step"):
        step = record["step"]
        if not isinstance(step, int) or isinstance(step, bool):
            raise CompareError(f"{path} line {number}: step {step!r} is not an integer")
        if step in steps:
            raise CompareError(f"{path} line {number}: step {step} appears twice")
        steps[step] = record
    return steps


# --------------------------------------------------------------------------- records


def same_value(a, b) -> bool:
    """Whether two JSON values are equal: same type (``1``, ``1.0`` and ``true`` differ), NaN
    equal to NaN, lists and objects element by element."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list):
        return len(a) == len(b) and all(map(same_value, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


def first_field_difference(a: dict, b: dict, skip: frozenset = frozenset()) -> dict | None:
    """The first difference between two records, fields in ``skip`` left out: fields that only
    one has (``{"fields_only_in_a": [...], "fields_only_in_b": [...]}``), else the first field
    in ``a``'s order whose values differ (``{"field", "a", "b"}``); ``None`` when equal."""
    only_a = [k for k in a if k not in b and k not in skip]
    only_b = [k for k in b if k not in a and k not in skip]
    if only_a or only_b:
        return {"fields_only_in_a": only_a, "fields_only_in_b": only_b}
    for name in a:
        if name not in skip and not same_value(a[name], b[name]):
            return {"field": name, "a": a[name], "b": b[name]}
    return None


def _shown(value, limit: int = 60) -> str:
    """A value as JSON text, cut to ``limit`` characters."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _uid(uid) -> str:
    """A uid as it is when it is a string, else as JSON."""
    return uid if isinstance(uid, str) else _shown(uid)


def describe(difference: dict) -> str:
    """One line for a :func:`first_field_difference` result, e.g. ``reward 0.25 != 0.5``."""
    if "field" in difference:
        a, b = _shown(difference["a"]), _shown(difference["b"])
        return f"{difference['field']} {a} != {b}"
    parts = [
        f"fields only in run {side.upper()}: {', '.join(names)}"
        for side in ("a", "b")
        if (names := difference[f"fields_only_in_{side}"])
    ]
    return "; ".join(parts)


def _presence(section: str, a: Path, b: Path) -> Finding | None:
    """The finding when ``a`` or ``b`` is not a file (absent in both: not a difference);
    ``None`` when both are."""
    has_a, has_b = a.is_file(), b.is_file()
    if has_a and has_b:
        return None
    if not has_a and not has_b:
        return Finding(section, note="absent in both runs")
    side = "a" if has_a else "b"
    return Finding(section, f"only in run {side.upper()}", details={"only_in": side})


# --------------------------------------------------------------------------- sections


def compare_metrics(
    run_a: Path, run_b: Path, skip: frozenset, ignore: tuple[str, ...] = ()
) -> Finding:
    """The first step (in order) at which the ``metrics.jsonl`` of two runs differ: a step
    only one has, or its first differing field (fields in ``skip`` left out). Raises
    :class:`CompareError` on a malformed file, or when a name in ``ignore`` is a field of
    neither file (a misspelt ``--ignore``)."""
    absent = _presence(METRICS_FILE, run_a / METRICS_FILE, run_b / METRICS_FILE)
    if absent:
        return absent
    a, b = _steps(run_a / METRICS_FILE), _steps(run_b / METRICS_FILE)
    fields = {key for records in (a, b) for record in records.values() for key in record}
    unknown = sorted(set(ignore) - fields)
    if unknown:
        raise CompareError(
            f"--ignore {', '.join(unknown)}: no such field in {METRICS_FILE} of either run"
        )
    for step in sorted(a.keys() | b.keys()):
        if step not in a or step not in b:
            side = "a" if step in a else "b"
            details = {"step": step, "only_in": side}
            return Finding(
                METRICS_FILE, f"step {step}: only in run {side.upper()}", details=details
            )
        difference = first_field_difference(a[step], b[step], skip)
        if difference:
            details = {"step": step, **difference}
            return Finding(METRICS_FILE, f"step {step}: {describe(difference)}", details=details)
    return Finding(METRICS_FILE, note=f"identical ({len(a)} steps)")


def _eval_order(name: str) -> tuple:
    """Sort key of eval file names: before, step 1, 2, ..., after, then any other."""
    step = re.fullmatch(r"eval_step_(\d+)\.jsonl", name)
    if name == "eval_before.jsonl":
        return (0, 0, name)
    if step:
        return (1, int(step.group(1)), name)
    return (2 if name == "eval_after.jsonl" else 3, 0, name)


def eval_files(run_a: Path, run_b: Path) -> list[str]:
    """The names of the ``eval_*.jsonl`` files of either run: before, steps, after."""
    names = {p.name for run in (run_a, run_b) for p in run.glob("eval_*.jsonl")}
    return sorted(names, key=_eval_order)


def compare_eval(name: str, run_a: Path, run_b: Path) -> Finding:
    """The first problem (in file order) at which the eval file ``name`` of two runs differs:
    another uid at the same place, a differing field, or problems only one file has. Raises
    :class:`CompareError` on a malformed file."""
    absent = _presence(name, run_a / name, run_b / name)
    if absent:
        return absent
    a, b = read_jsonl(run_a / name, "uid"), read_jsonl(run_b / name, "uid")
    for (line, record_a), (_, record_b) in zip(a, b):
        uid_a, uid_b = record_a["uid"], record_b["uid"]
        if not same_value(uid_a, uid_b):
            details = {"line": line, "field": "uid", "a": uid_a, "b": uid_b}
            return Finding(
                name, f"line {line}: uid {_uid(uid_a)} != {_uid(uid_b)}", details=details
            )
        difference = first_field_difference(record_a, record_b)
        if difference:
            details = {"uid": uid_a, **difference}
            return Finding(name, f"uid {_uid(uid_a)}: {describe(difference)}", details=details)
    if len(a) != len(b):
        side, extra = ("a", a[len(b)][1]) if len(a) > len(b) else ("b", b[len(a)][1])
        text = (
            f"{len(a)} problems in run A, {len(b)} in run B; first extra uid {_uid(extra['uid'])}"
        )
        return Finding(name, text, details={"uid": extra["uid"], "only_in": side})
    return Finding(name, note=f"identical ({len(a)} problems)")


# --------------------------------------------------------------------------- weights


def checkpoint_files(run: Path) -> list[Path]:
    """The safetensors files of a run's final model (``checkpoint/model.safetensors`` or its
    shards ``model-0000i-of-0000n.safetensors``); empty when it saved none."""
    return sorted((run / "checkpoint").glob("*.safetensors"))


def _open_tensors(files: list[Path], stack: ExitStack) -> dict:
    """Tensor name → the open safetensors file that holds it (closed with ``stack``). Raises
    :class:`CompareError` on a file that is not safetensors or a name in two files."""
    from safetensors import SafetensorError, safe_open

    where: dict = {}
    for path in files:
        try:
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
        except (OSError, SafetensorError) as exc:
            raise CompareError(f"{path}: not a readable safetensors file ({exc})") from None
        for name in handle.keys():
            if name in where:
                raise CompareError(f"{path}: tensor {name} is also in another shard")
            where[name] = handle
    return where


def max_abs_diff(a, b) -> float:
    """max |a - b| over two tensors of one shape, in float64, a chunk at a time (NaN if any
    element difference is NaN)."""
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    worst = 0.0
    for start in range(0, flat_a.numel(), _CHUNK):
        piece = slice(start, start + _CHUNK)
        diff = (flat_a[piece].double() - flat_b[piece].double()).abs().max().item()
        if math.isnan(diff):
            return math.nan
        worst = max(worst, diff)
    return worst


def _layout(tensor) -> str:
    """``dtype [d0, d1, ...]`` of a tensor."""
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"


def tensor_differences(a: dict, b: dict) -> dict:
    """Compares the tensors of two :func:`_open_tensors` maps one pair at a time: returns
    ``tensors`` (names in both), ``only_in_a``, ``only_in_b``, ``mismatched`` (shape or dtype:
    name, a, b) and ``differing`` (bitwise, by ``torch.equal``: name, max_abs_diff)."""
    import torch

    found: dict = {
        "tensors": len(a.keys() & b.keys()),
        "only_in_a": sorted(a.keys() - b.keys()),
        "only_in_b": sorted(b.keys() - a.keys()),
        "mismatched": [],
        "differing": [],
    }
    for name in sorted(a.keys() & b.keys()):
        tensor_a, tensor_b = a[name].get_tensor(name), b[name].get_tensor(name)
        if tensor_a.shape != tensor_b.shape or tensor_a.dtype != tensor_b.dtype:
            found["mismatched"].append(
                {"name": name, "a": _layout(tensor_a), "b": _layout(tensor_b)}
            )
        elif not torch.equal(tensor_a, tensor_b):
            diff = max_abs_diff(tensor_a, tensor_b)
            found["differing"].append({"name": name, "max_abs_diff": diff})
    return found


def _weights_line(found: dict) -> str | None:
    """One line for a :func:`tensor_differences` result; ``None`` when there is no difference."""
    parts = [
        f"{len(names)} tensors only in run {side.upper()} ({', '.join(names[:SHOWN_TENSORS])})"
        for side in ("a", "b")
        if (names := found[f"only_in_{side}"])
    ]
    if found["mismatched"]:
        shown = [f"{m['name']} {m['a']} vs {m['b']}" for m in found["mismatched"][:SHOWN_TENSORS]]
        parts.append(f"{len(found['mismatched'])} differ in shape or dtype ({'; '.join(shown)})")
    differing = found["differing"]
    if differing:
        shown = [f"{d['name']} {d['max_abs_diff']:.3g}" for d in differing[:SHOWN_TENSORS]]
        more = f", +{len(differing) - SHOWN_TENSORS} more" if len(differing) > SHOWN_TENSORS else ""
        parts.append(
            f"{len(differing)} of {found['tensors']} tensors differ, max |a-b|: "
            f"{', '.join(shown)}{more}"
        )
    return "; ".join(parts) or None


def compare_weights(run_a: Path, run_b: Path) -> Finding:
    """The final weights of two runs, tensor by tensor (one pair in memory at a time). No
    checkpoint in either run is no difference; in one only, it is. Raises
    :class:`CompareError` on an unreadable safetensors file."""
    from safetensors import SafetensorError

    files_a, files_b = checkpoint_files(run_a), checkpoint_files(run_b)
    if not files_a and not files_b:
        return Finding("weights", note="no checkpoint in either run")
    if not files_a or not files_b:
        side = "a" if files_a else "b"
        return Finding(
            "weights", f"checkpoint only in run {side.upper()}", details={"only_in": side}
        )
    try:
        with ExitStack() as stack:
            found = tensor_differences(_open_tensors(files_a, stack), _open_tensors(files_b, stack))
    except (OSError, SafetensorError) as exc:
        raise CompareError(
            f"{run_a} or {run_b}: a checkpoint tensor cannot be read ({exc})"
        ) from None
    line = _weights_line(found)
    if line is None:
        return Finding("weights", note=f"identical ({found['tensors']} tensors)", details=found)
    return Finding("weights", line, details=found)


# --------------------------------------------------------------------------- the command


def compare_runs(run_a: Path, run_b: Path, ignore: tuple[str, ...] = ()) -> list[Finding]:
    """One :class:`Finding` per kind of output of two run directories: metrics (without
    :data:`TIMING_FIELDS` and ``ignore``), each eval file, the weights. Raises
    :class:`CompareError` when either is not a run directory or a file is malformed."""
    run_a, run_b = Path(run_a), Path(run_b)
    check_run(run_a)
    check_run(run_b)
    skip = TIMING_FIELDS | frozenset(ignore)
    evals = [compare_eval(name, run_a, run_b) for name in eval_files(run_a, run_b)]
    return [compare_metrics(run_a, run_b, skip, ignore), *evals, compare_weights(run_a, run_b)]


def as_json(run_a: Path, run_b: Path, findings: list[Finding]) -> dict:
    """The ``--json`` object: ``run_a``, ``run_b``, ``identical``, then ``metrics``,
    ``evals`` (file name → section) and ``weights``, each with ``identical`` and ``summary``."""
    metrics, *evals, weights = findings
    return {
        "run_a": str(run_a),
        "run_b": str(run_b),
        "identical": all(f.difference is None for f in findings),
        "metrics": metrics.as_dict(),
        "evals": {f.section: f.as_dict() for f in evals},
        "weights": weights.as_dict(),
    }


def run_compare(
    run_a: str, run_b: str, ignore: tuple[str, ...] = (), json_output: bool = False
) -> int:
    """Prints the comparison of two run directories (one line per kind, or one JSON object)
    and returns the exit code: 0 when identical in everything compared, 1 otherwise. Raises
    :class:`CompareError` on bad input (the command turns it into exit code 2)."""
    findings = compare_runs(Path(run_a), Path(run_b), ignore)
    if Path(run_a).resolve() == Path(run_b).resolve():
        print(f"warning: {run_a} and {run_b} are the same directory", file=sys.stderr)
    if json_output:
        report = json.dumps(as_json(run_a, run_b, findings), indent=2)
    else:
        report = "\n".join(f.line for f in findings)
    try:
        print(report)
    except BrokenPipeError:  # `areal-fast compare ... | head -1`: the exit code still holds
        sys.stdout = open(os.devnull, "w")
    return 0 if all(f.difference is None for f in findings) else 1
