"""The CPU loop's heap policy (core/device.FreedHeap): freed memory is kept for the next step, and given back once
resident memory has grown past what the first steps held (SFT's changing shapes made it climb)."""
import subprocess
import sys

import pytest

from nanoforge.core.device import resident_bytes

CHILD = """
import torch
from nanoforge.core.device import FREED_HEAP, resident_bytes
FREED_HEAP.keep()
for _ in range(FREED_HEAP.SETTLE):
    FREED_HEAP.after_step()
big = torch.ones(50_000_000)  # 200 MB, freed at once: the heap keeps it (no trim, no mmap)
del big
kept = resident_bytes()
FREED_HEAP.after_step()
print(kept, resident_bytes())
"""


@pytest.mark.skipif(resident_bytes() is None or not sys.platform.startswith("linux"), reason="Linux and glibc only")
def test_the_heap_keeps_freed_memory_until_it_grows_then_gives_it_back():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    kept, after = map(int, out.split())
    assert kept - after > 150e6, f"resident {kept / 1e6:.0f} MB before the step's check, {after / 1e6:.0f} MB after"
