"""Host memory that stays mapped: the allocator setting every timed local process runs with.

glibc returns freed memory to the kernel: blocks above a threshold that adapts as the
program runs are mmapped and unmapped one by one, and free space at the top of the
heap is trimmed. A pipeline stage frees a microbatch's activations and allocates the
next one's moments later, so in a run each activation lands on fresh pages and pays
a page fault and a page clear per 4 KiB; when the tracer times one layer over and
over its memory is reused and it pays none of that. On the GPT example this made
the stages compute 5-10% slower inside `pipeplan run` than traced (A/B runs here:
GPipe 257/230 ms default vs 229/216 ms with this setting; 1F1B 237/244 vs 212/211).

So the tracer, `profiles calibrate` and the runtime's ranks all call
`keep_freed_memory()` first: no trimming below 2 GiB, and no block of its own mapping
at any size (`M_MMAP_MAX` 0; the threshold alone stops at 32 MiB, glibc's maximum).
Blocks above 32 MiB matter too: a 4-layer Llama config (transformers, 32 x 128 tokens
per microbatch, 4,000-word vocabulary: logits and their gradients of 65 MB) page-faulted
118k times a step, and its ranks in `pipeplan run` computed 437 and 842 ms forward and
backward where the tracer, whose heap had grown past them, timed 378 and 743 (the
plan's iteration +12%); with its heap grown first a process faulted 0 times a step and
ran 377-380 and 749-755. The cost is that a process keeps its peak heap until
it exits, which training does anyway.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_MAX, M_MMAP_THRESHOLD = -1, -4, -3  # glibc's <malloc.h>
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's upper limit for the threshold on 64-bit
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Tell glibc to keep freed memory for reuse; False where the C library has no mallopt (macOS, musl)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), (M_MMAP_MAX, 0))
    return all([bool(mallopt(option, value)) for option, value in settings])  # a list: every one is set
