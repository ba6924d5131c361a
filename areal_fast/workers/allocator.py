"""The C allocator of a worker process: large freed blocks go back to the system.

glibc's malloc serves a request of at least ``M_MMAP_THRESHOLD`` bytes with a mapping of its
own, unmapped when freed. The threshold starts at 128 KiB, but each mapped block freed raises
it to that block's size (up to 32 MiB on 64-bit), so from a trainer's first step on its
activation, gradient and logits blocks below 32 MiB come from the heap, and once freed stay
there, fragmented: the resident set between steps stays near the step's peak and the next
step's peak grows on top of it. Setting the threshold turns that adjustment off
(``mallopt(3)``, the same as the ``MALLOC_MMAP_THRESHOLD_`` environment variable).

Measured on the default job's trainer alone (one thread, two micro-batches a step,
``benches/README.md``, LoRA section): peak resident set over four steps 10.3 → 7.1 GB (full
fine-tuning) and 12.3 → 5.2 GB (LoRA r16); between steps 9.7 → 2.5 GB and 8.0 → 1.1 GB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
DEFAULT_THRESHOLD = 128 * 1024  # bytes: glibc's own starting value, kept fixed


def return_large_blocks(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Serve every allocation of at least ``threshold`` bytes with its own mapping, released
    when freed, for the rest of this process (glibc's ``mallopt(M_MMAP_THRESHOLD, …)``).

    Parameters
    ----------
    threshold : int
        Bytes; glibc accepts 0 … 32 MiB.

    Returns
    -------
    bool
        Whether it took effect: False where the C library is not glibc (musl, macOS) or
        refused the value.

    Raises
    ------
    ValueError
        ``threshold`` < 0.
    """
    if threshold < 0:
        raise ValueError(f"return_large_blocks: threshold = {threshold} must be >= 0")
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(threshold)))
