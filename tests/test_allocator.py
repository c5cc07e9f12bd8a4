"""keep_freed_memory really changes where glibc puts a large block (checked in fresh processes)."""

import ctypes
import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys
from pipeplan.hardware_profiles.allocator import keep_freed_memory

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = libc.mallinfo2().hblkhd
p = libc.malloc(int(sys.argv[2]) << 20)
print(libc.mallinfo2().hblkhd - before)
"""


def mmapped_bytes_of_a_malloc(mode: str, mib: int) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(mib)], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc >= 2.33 (mallinfo2)")
def test_large_blocks_come_from_the_reusable_heap():
    # glibc's default: a fresh process mmaps a 16 MiB block (threshold 128 KiB), and unmaps it on free
    assert mmapped_bytes_of_a_malloc("default", 16) >= 16 << 20
    # with the fixed 32 MiB threshold it comes from the heap, whose freed memory is kept for the next one
    assert mmapped_bytes_of_a_malloc("keep", 16) == 0


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc >= 2.33 (mallinfo2)")
def test_blocks_above_the_largest_threshold_come_from_the_heap_too():
    """A 64 MiB block (a 32 x 128-token microbatch's logits over a 4,000-word vocabulary are 65 MB) is above
    the 32 MiB that the threshold can be raised to: mapped by default, from the heap with mmap off."""
    assert mmapped_bytes_of_a_malloc("default", 64) >= 64 << 20
    assert mmapped_bytes_of_a_malloc("keep", 64) == 0
