"""The preflight of ``benches/gpu_check.sh``: what was carried, what installs, what runs here.

1. The carried folder (``benches/wheels/`` unless ``--wheels``) and its ``MANIFEST`` (written
   by ``gpu_check_prepare.sh``: one entry per line, ``FILE<TAB>MODULE<TAB>SECTION``) must be
   there with every file it lists; otherwise one line naming what is missing goes to stdout
   and the exit status is 2: nothing else is worth running without them.
2. The wheels (``*.whl``) install into ``--site`` in one ``pip install --no-deps --no-index``;
   if that call fails, each wheel is installed alone, so one bad wheel costs only the
   sections that need it. Source packages (``*.tar.gz``, built with the machine's compiler)
   are left to ``--install-sources``, which ``gpu_check.sh`` runs in the background.
3. Every manifest module is imported in a child process (``--site`` first on its path).
4. The versions: Python, torch, Triton, CUDA, driver, GPU name and free memory, transformers,
   nvcc, and which ``torch.nn.functional.linear_cross_entropy`` this torch has ("absent";
   "reference": no ``options=``, it materialises the logits; "chunked").

Everything goes to ``--out``/preflight.json and a few lines of stdout. Every subprocess has a
timeout. ``--rehearse``: a machine without a GPU is accepted (``gpu_check.sh``'s CPU
rehearsal), the rest is the same.

Usage::

    python benches/gpu_check_preflight.py --wheels benches/wheels --site DIR --out DIR
    python benches/gpu_check_preflight.py --wheels benches/wheels --site DIR --install-sources
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PIP_TIMEOUT_S = 120
PROBE_TIMEOUT_S = 60
MANIFEST = "MANIFEST"


class Refused(Exception):
    """Something that had to be carried is not there (the message is the one line)."""


def read_manifest(wheels: Path) -> list[dict]:
    """The manifest's entries: ``{"file", "module", "section"}`` (module "-" for none).

    Raises
    ------
    Refused
        The folder, its MANIFEST or a listed file is missing, or a line is malformed.
    """
    hint = "run bash benches/gpu_check_prepare.sh where PyPI is reachable, then carry it along"
    if not wheels.is_dir():
        raise Refused(f"{wheels}/ was not carried ({hint})")
    path = wheels / MANIFEST
    if not path.is_file():
        raise Refused(f"{path} is missing ({hint})")
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            raise Refused(f"{path}:{number}: expected FILE<TAB>MODULE<TAB>SECTION, got {line!r}")
        entries.append(dict(zip(("file", "module", "section"), parts)))
    missing = [e["file"] for e in entries if not (wheels / e["file"]).exists()]
    if missing:
        raise Refused(f"{wheels}/ lacks {', '.join(missing)} ({hint})")
    return entries


def _pip_install(paths: list[Path], site: Path, build: bool = False) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    cmd += ["--no-compile", "--no-cache-dir", "--disable-pip-version-check", "--target"]
    cmd += [str(site), "--upgrade"] + (["--no-build-isolation"] if build else [])
    try:
        proc = subprocess.run(
            cmd + [str(p) for p in paths], capture_output=True, text=True, timeout=PIP_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return False, f"pip timed out after {PIP_TIMEOUT_S} s"
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    return proc.returncode == 0, last[:300]


def install_wheels(wheels: Path, entries: list[dict], site: Path) -> dict:
    """Install the manifest's wheels into ``site``: all in one pip call, else one by one.
    Returns ``{"installed": [files], "failed": {file: pip's last line}}``."""
    files = [wheels / e["file"] for e in entries if e["file"].endswith(".whl")]
    site.mkdir(parents=True, exist_ok=True)
    if not files:
        return {"installed": [], "failed": {}}
    ok, _ = _pip_install(files, site)
    if ok:
        return {"installed": [f.name for f in files], "failed": {}}
    result = {"installed": [], "failed": {}}
    for path in files:
        ok, why = _pip_install([path], site)
        if ok:
            result["installed"].append(path.name)
        else:
            result["failed"][path.name] = why
    return result


def install_sources(wheels: Path, site: Path) -> int:
    """Build and install each source package of the manifest into ``site``, one at a time;
    prints one line per package; 0 when all installed."""
    entries = read_manifest(wheels)
    status = 0
    for entry in entries:
        if not entry["file"].endswith((".tar.gz", ".zip")):
            continue
        start = time.monotonic()
        ok, why = _pip_install([wheels / entry["file"]], site, build=True)
        took = time.monotonic() - start
        print(f"{entry['file']}: {'installed' if ok else 'FAILED: ' + why} ({took:.0f} s)")
        status = status or (0 if ok else 1)
    return status


_IMPORT_PROBE = """
import importlib, json, sys
result = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        result[name] = None
    except BaseException as exc:
        result[name] = f"{type(exc).__name__}: {exc}"[:300]
print(json.dumps(result))
"""


def start_import_check(modules: list[str], site: Path) -> subprocess.Popen | None:
    """Import each module in a child process whose path starts with ``site`` (started now,
    read by :func:`finish_import_check`; it runs while this process reads the versions)."""
    if not modules:
        return None
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.Popen(
        [sys.executable, "-c", _IMPORT_PROBE, *modules],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def finish_import_check(proc: subprocess.Popen | None, modules: list[str]) -> dict:
    """``{module: None or the error}`` from :func:`start_import_check`'s child."""
    if proc is None:
        return {}
    try:
        out, _ = proc.communicate(timeout=PROBE_TIMEOUT_S)
        return json.loads(out.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        proc.kill()
        return {m: f"the import probe failed: {type(exc).__name__}" for m in modules}


def import_check(modules: list[str], site: Path) -> dict:
    """``{module: None or the error}`` of importing each module with ``site`` first."""
    return finish_import_check(start_import_check(modules, site), modules)


def _run(cmd: list[str], last: bool = False) -> str | None:
    """First (``last``: last) line of a command's stdout, None when the command is absent or
    fails (10 s timeout)."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[-1 if last else 0].strip() if proc.returncode == 0 and lines else None


def lce_variant(torch) -> str:
    """Which ``linear_cross_entropy`` this torch has: "absent", "reference" or "chunked"."""
    import inspect

    F = torch.nn.functional
    if not hasattr(F, "linear_cross_entropy"):
        return "absent"
    params = inspect.signature(F.linear_cross_entropy).parameters
    chunked = "options" in params and hasattr(torch.nn, "LinearCrossEntropyOptions")
    return "chunked" if chunked else "reference"


def versions() -> dict:
    """Python, torch, Triton, CUDA, driver, GPU, memory, transformers, nvcc (None: absent)."""
    import platform

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__}
    info["cuda"] = torch.version.cuda
    info["linear_cross_entropy"] = lce_variant(torch)
    for dist in ("triton", "transformers"):
        try:
            info[dist] = __import__(dist).__version__
        except Exception:
            info[dist] = None
    smi = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    info["nvidia_smi"] = _run(smi)
    info["nvcc"] = _run([shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc", "--version"], True)
    info["gpu_available"] = torch.cuda.is_available()
    if info["gpu_available"]:
        free, total = torch.cuda.mem_get_info()
        info.update(gpu=torch.cuda.get_device_name(), free_gib=free / 2**30)
        info.update(total_gib=total / 2**30, capability=list(torch.cuda.get_device_capability()))
    return info


def preflight(args) -> dict:
    """Steps 1-4 of the module docstring; the record written to preflight.json.

    Raises
    ------
    Refused
        Step 1 failed, or (without ``--rehearse``) torch sees no CUDA device.
    """
    start = time.monotonic()
    entries = read_manifest(args.wheels)
    record = {"wheels_dir": str(args.wheels), "manifest": entries}
    record["install"] = install_wheels(args.wheels, entries, args.site)
    record["sources"] = [e["file"] for e in entries if e["file"].endswith((".tar.gz", ".zip"))]
    wheel_modules = [
        e["module"] for e in entries if e["module"] != "-" and e["file"].endswith(".whl")
    ]
    probe = start_import_check(wheel_modules, args.site)
    record["versions"] = versions()
    record["imports"] = finish_import_check(probe, wheel_modules)
    if not (args.rehearse or record["versions"]["gpu_available"]):
        raise Refused(
            f"torch {record['versions']['torch']} sees no CUDA device "
            f"(nvidia-smi: {record['versions']['nvidia_smi'] or 'absent or failed'})"
        )
    record["seconds"] = time.monotonic() - start
    return record


def _print(record: dict) -> None:
    v = record["versions"]
    print(
        f"python {v['python']} | torch {v['torch']} (CUDA {v['cuda']}) | triton {v['triton']} | "
        f"transformers {v['transformers']} | nvcc: {v['nvcc'] or 'absent'}"
    )
    print(
        f"GPU: {v.get('gpu') or 'none'}; nvidia-smi: {v['nvidia_smi'] or 'absent or failed'}"
        + (f"; free {v['free_gib']:.1f} of {v['total_gib']:.1f} GiB" if v.get("gpu") else "")
    )
    print(f"torch.nn.functional.linear_cross_entropy: {v['linear_cross_entropy']}")
    inst = record["install"]
    print(f"carried wheels: {len(inst['installed'])} installed, {len(inst['failed'])} failed")
    for name, why in inst["failed"].items():
        print(f"  wheel {name} did not install: {why}")
    for module, err in record["imports"].items():
        if err:
            print(f"  module {module} does not import: {err}")
    if record["sources"]:
        print(f"source packages, built in the background: {', '.join(record['sources'])}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path("benches/wheels"))
    parser.add_argument("--site", type=Path, required=True, help="install target folder")
    parser.add_argument("--out", type=Path, help="folder for preflight.json")
    parser.add_argument("--rehearse", action="store_true", help="accept a machine without GPU")
    parser.add_argument("--install-sources", action="store_true", help="only step 2's sources")
    args = parser.parse_args(argv)
    try:
        if args.install_sources:
            return install_sources(args.wheels, args.site)
        record = preflight(args)
    except Refused as exc:
        print(f"gpu_check: preflight refused: {exc}", flush=True)
        return 2
    if args.out:
        (args.out / "preflight.json").write_text(json.dumps(record, indent=1) + "\n")
    _print(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
