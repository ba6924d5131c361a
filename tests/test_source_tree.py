"""The checkout on ``sys.path`` shadows no installed distribution.

``python -m ...``, ``python -c`` and Ray actors started from the repository root put the
checkout first on ``sys.path``. The top-level ``kernels/`` folder (the Triton sources, shipped
as ``areal_fast.kernels``) must then never stand in for the PyPI package ``kernels``, which
transformers imports when it loads a model: the folder has no ``__init__.py``, so a regular
package of that name anywhere on the path wins over it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run_from_checkout(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # the checkout's own areal_fast has no compiled extension: this is not a native test
    env.pop("AREAL_FAST_REQUIRE_NATIVE", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_kernels_folder_is_no_regular_package():
    assert (REPO / "kernels" / "grpo_loss.py").is_file()
    assert not (REPO / "kernels" / "__init__.py").exists(), (
        "kernels/__init__.py would make the checkout's kernels/ shadow the PyPI 'kernels'"
    )


def test_a_model_loads_with_the_checkout_first_on_sys_path(tiny_model_dir):
    proc = _run_from_checkout(
        f"""
        import importlib.util, sys
        from pathlib import Path
        repo = Path({str(REPO)!r}).resolve()
        assert Path(sys.path[0] or ".").resolve() == repo, sys.path[:3]
        import areal_fast
        assert Path(areal_fast.__file__).resolve().parent == repo / "areal_fast"
        from areal_fast.models.loading import load_causal_lm
        from transformers import AutoTokenizer
        model = load_causal_lm({str(tiny_model_dir)!r})
        tok = AutoTokenizer.from_pretrained({str(tiny_model_dir)!r})
        print("params", sum(p.numel() for p in model.parameters()), "vocab", len(tok))
        from importlib import metadata
        try:
            metadata.distribution("kernels")
        except metadata.PackageNotFoundError:
            print("kernels: not installed")
        else:
            # the installed distribution, not the checkout's folder
            origin = importlib.util.find_spec("kernels").origin
            assert origin is not None and repo not in Path(origin).parents, origin
            print("kernels", origin)
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "params " in proc.stdout and "vocab " in proc.stdout
