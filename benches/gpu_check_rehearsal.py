"""Stand-ins for ``GPU_CHECK_REHEARSE=1 bash benches/gpu_check.sh``: the GPU check's
orchestration on a machine without a GPU, without network and without the carried wheels.

``standins DIR`` writes:

- ``DIR/bin/nvidia-smi`` and ``DIR/bin/nvcc``: print one line saying they are stand-ins;
- ``DIR/wheels/``: what ``gpu_check_prepare.sh`` lays out, at toy size: a ``MANIFEST``, a
  wheel of a stand-in ``liger_kernel`` whose ``LigerFusedLinearGRPOLoss`` takes the arguments
  of Liger-Kernel 0.8.5's and computes the same token-mean GRPO loss in plain torch (so the
  preflight's install and import checks and the benchmark's Liger row run for real), and
  ``demo_model/``: the config and tokenizer of a 2-layer Llama of width 48 with a
  character-level tokenizer.

``fake-build DIR`` writes into DIR the wheel the build section would have built: one holding
only the compiled extension ``areal_fast._C`` of the installed areal_fast (none when it has
none), so the rehearsal lays the build out without compiling anything.

Usage::

    python benches/gpu_check_rehearsal.py standins /tmp/gpu_check/rehearsal
    python benches/gpu_check_rehearsal.py fake-build /tmp/gpu_check/wheel
"""

from __future__ import annotations

import argparse
import string
import sys
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path

LIGER_STANDIN = '''\
"""Stand-in of Liger-Kernel's chunked GRPO loss (GPU-check rehearsal): same arguments,
the token-mean clipped loss in plain torch, no chunking, no compilation."""

import torch


class LigerFusedLinearGRPOLoss(torch.nn.Module):
    def __init__(self, beta=0.04, compiled=True, use_ref_model=True, chunk_size=1,
                 epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo",
                 max_completion_length=None, importance_sampling_level="token",
                 temperature=1.0, **kwargs):
        super().__init__()
        if beta != 0.0 or use_ref_model or loss_type != "dapo":
            raise NotImplementedError("the stand-in computes beta=0, no reference, dapo only")
        self.compiled = compiled
        self.low, self.high, self.temperature = epsilon_low, epsilon_high, temperature

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages,
                bias=None, ref_per_token_logps=None, old_per_token_logps=None, ref_input=None,
                ref_weight=None, ref_bias=None, vllm_is_ratio=None, num_items_in_batch=None):
        logits = (_input @ lin_weight.t()).float() / self.temperature
        logp = logits.log_softmax(-1).gather(-1, selected_token_ids.unsqueeze(-1)).squeeze(-1)
        old = logp.detach() if old_per_token_logps is None else old_per_token_logps
        ratio = torch.exp(logp - old)
        adv = advantages.unsqueeze(1)
        clipped = ratio.clamp(1.0 - self.low, 1.0 + self.high)
        per_token = torch.maximum(-adv * ratio, -adv * clipped)
        mask = attention_mask.float()
        return (per_token * mask).sum() / mask.sum().clamp_min(1.0), {}
'''

STANDIN_TOOL = "#!/usr/bin/env bash\necho '{line}'\n"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_wheel(path: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal pure-Python wheel at ``path`` (a folder) holding ``files``."""
    dist = f"{name}-{version}.dist-info"
    meta = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpu_check_rehearsal\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    members = {**files, **{k: v.encode() for k, v in meta.items()}}
    record = "".join(f"{member},,\n" for member in [*members, f"{dist}/RECORD"])
    wheel = path / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for member, data in members.items():
            zf.writestr(member, data)
        zf.writestr(f"{dist}/RECORD", record)
    return wheel


def write_demo_model(out: Path) -> None:
    """config.json and a character-level ChatML tokenizer of a 2-layer Llama, width 48."""
    import tokenizers
    import transformers

    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
    chars = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"<\|[a-z_]+\|>|[\s\S]"), "isolated")
    backend.pre_tokenizer = split
    backend.decoder = tokenizers.decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="<|pad|>",
        eos_token="<|im_end|>", bos_token="<|im_start|>",
    )  # fmt: skip
    tok.chat_template = CHAT_TEMPLATE
    config = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    tok.save_pretrained(out)


def standins(root: Path) -> None:
    """The stand-in tools and carried folder described in the module docstring."""
    bin_dir, wheels = root / "bin", root / "wheels"
    bin_dir.mkdir(parents=True, exist_ok=True)
    wheels.mkdir(parents=True, exist_ok=True)
    tools = {
        "nvidia-smi": "CPU rehearsal (stand-in nvidia-smi), none, 0 MiB",
        "nvcc": "Cuda compilation tools, stand-in of the CPU rehearsal (nothing is compiled)",
    }
    for name, line in tools.items():
        (bin_dir / name).write_text(STANDIN_TOOL.format(line=line))
        (bin_dir / name).chmod(0o755)
    liger = write_wheel(
        wheels,
        "liger_kernel",
        "0.0.0",
        {
            "liger_kernel/__init__.py": b'__version__ = "0.0.0"\n',
            "liger_kernel/chunked_loss/__init__.py": LIGER_STANDIN.encode(),
        },
    )
    write_demo_model(wheels / "demo_model")
    manifest = textwrap.dedent(
        f"""\
        # stand-ins of the GPU check's CPU rehearsal (benches/gpu_check_rehearsal.py)
        {liger.name}\tliger_kernel\tlm_head
        demo_model/config.json\t-\tdemo_job
        """
    )
    (wheels / "MANIFEST").write_text(manifest)


def fake_build(out: Path) -> Path:
    """A wheel holding only the installed distribution's ``areal_fast._C`` (or nothing),
    found without importing areal_fast (and torch)."""
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    try:
        installed = metadata.distribution("areal_fast").files or []
    except metadata.PackageNotFoundError:
        installed = []
    for member in installed:
        name = Path(str(member)).name
        if str(member).startswith("areal_fast/_C") and name.endswith(".so"):
            files[f"areal_fast/{name}"] = Path(member.locate()).read_bytes()
    return write_wheel(out, "areal_fast", "0.0.0", files)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("standins").add_argument("root", type=Path)
    sub.add_parser("fake-build").add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "standins":
        standins(args.root)
        print(f"stand-ins of the rehearsal under {args.root}")
    else:
        wheel = fake_build(args.out)
        print(f"rehearsal build (no compiler run): {wheel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
