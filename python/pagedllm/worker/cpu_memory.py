"""Host allocator settings for CPU inference.

glibc's malloc serves every block above M_MMAP_THRESHOLD (128 KiB to 32 MiB, adaptive) with a
fresh mmap and unmaps it on free, so each activation tensor of a step (tens of MB in a prefill)
arrives as untouched pages that the kernel faults in and zeroes one 4 KiB page at a time: a
64 x 128-token prefill of SmolLM2-135M took ~500,000 page faults (~1 s of its ~4.7 s on the 2-core
dev machine). Serving those blocks from the heap instead, and never trimming the heap, lets
freed activation memory be reused by the next layer and the next step (~50,000 faults; PyTorch's
CPU allocator keeps no cache of its own). The cost: the process keeps its peak heap, as with
jemalloc/tcmalloc, which serving stacks commonly preload for the same reason.

Applied once per process by the CPU ModelRunner; PAGEDLLM_CPU_MALLOC_TUNING=0 turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger("pagedllm")

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_applied = False


def tune_glibc_malloc() -> bool:
    """Heap-only, never-trimmed glibc malloc (see the module docstring). Returns whether the
    settings are in effect (False off glibc/Linux or when disabled by the environment)."""
    global _applied
    if _applied:
        return True
    if os.environ.get("PAGEDLLM_CPU_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    ok = (mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
          and mallopt(_M_TOP_PAD, 64 << 20) == 1)
    _applied = ok
    if ok:
        logger.info("glibc malloc: large blocks from the heap, no trimming (PAGEDLLM_CPU_MALLOC_TUNING=0 "
                    "turns this off)")
    return ok
