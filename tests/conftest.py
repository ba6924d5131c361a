"""Shared fixtures: a tiny randomly initialised Llama / Qwen2 with a small offline tokenizer."""

from __future__ import annotations

import os
import string
from pathlib import Path

import pytest
import torch

# Triton kernels run through Triton's CPU interpreter when there is no GPU (must be set
# before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]


def pytest_sessionstart(session):
    """With ``AREAL_FAST_REQUIRE_NATIVE=1`` (CI), a missing ``areal_fast._C`` ends the run at
    once with the reason, instead of turning every native test into a skip."""
    from areal_fast._native import load_native, native_required

    if not native_required():
        return
    try:
        native = load_native()
    except ImportError as exc:
        pytest.exit(str(exc), returncode=1)
    if native is None:  # AREAL_FAST_DISABLE_NATIVE is set as well
        pytest.exit("AREAL_FAST_REQUIRE_NATIVE=1 but AREAL_FAST_DISABLE_NATIVE disables it", 1)


GSM8K_DIR = REPO.parent / "shared" / "data" / "gsm8k"

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tiny_tokenizer():
    """Character-level fast tokenizer with ChatML specials, built offline."""
    import tokenizers
    import transformers

    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
    chars = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    pre = tokenizers.pre_tokenizers
    backend.pre_tokenizer = pre.Split(tokenizers.Regex(r"<\|[a-z_]+\|>|[\s\S]"), "isolated")
    backend.decoder = tokenizers.decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
    )
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def make_tiny_model_dir(path: Path, arch: str = "llama", tie: bool = True) -> Path:
    """Save a tiny random causal LM (Llama or Qwen2) and its tokenizer under ``path``."""
    import transformers

    torch.manual_seed(1234)
    tok = _tiny_tokenizer()
    common = dict(
        vocab_size=len(tok),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
    else:
        config = transformers.Qwen2Config(**common)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def swapped_vocab_copy(model_dir: Path, out: Path, a: str, b: str) -> dict:
    """Copy the model folder ``model_dir`` to ``out`` with tokens ``a`` and ``b`` swapped in its
    tokenizer (another vocabulary, same size); returns the copy's token → id dict."""
    import json
    import shutil

    shutil.copytree(model_dir, out)
    path = out / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tok))
    return vocab


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", tie=False)


@pytest.fixture
def fresh_seed() -> int:
    """A new seed every run (printed on failure), so kernels meet fresh random inputs."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


def available_impls() -> list[str]:
    """Implementations of the log-prob row epilogue that can run in this process."""
    import importlib.util

    from areal_fast.ops import _dispatch

    impls = ["torch"]
    if _dispatch.native_has("logprob_rows_forward"):
        impls.append("native")
    if importlib.util.find_spec("triton") is not None and (
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    ):
        impls.append("triton")
    return impls


def impl_device(impl: str) -> str:
    """Device the tests run ``impl`` on: CUDA for Triton when a GPU exists, else the CPU."""
    return "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"


def impl_params(impls: list[str]) -> list:
    """``impls`` as ``parametrize`` values, those that run on a CUDA device marked ``cuda``
    (``pytest -m cuda`` selects them; benches/gpu_check.sh runs those)."""
    return [
        pytest.param(i, marks=pytest.mark.cuda) if impl_device(i) == "cuda" else i for i in impls
    ]


def cuda_when_present(test):
    """Decorator of a test that runs on a CUDA device where one exists and on the CPU
    elsewhere: marked ``cuda`` only on a machine with a GPU."""
    return pytest.mark.cuda(test) if torch.cuda.is_available() else test
