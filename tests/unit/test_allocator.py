"""cluster.cpu_allocator = reuse: a CPU process keeps freed tensor memory for reuse instead of
mapping fresh pages for every tensor of a few MiB (rl_async/base/allocator.py)."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys

import pytest

from rl_async.plan.checks import validate
from rl_async.plan.load import load_config

GLIBC = platform.libc_ver()[0] == "glibc"

# A fresh process (malloc's settings are per process): bytes newly mapped by glibc for one
# 8 MiB tensor, read from mallinfo2's hblkhd (memory in mmapped blocks).
PROBE = """
import ctypes, sys
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
import torch
from rl_async.base.allocator import reuse_freed_memory
state = reuse_freed_memory() if sys.argv[1] == "reuse" else "system"
before = libc.mallinfo2().hblkhd
tensor = torch.empty(2 * 1024 * 1024)  # 8 MiB of float32
print(state, libc.mallinfo2().hblkhd - before)
"""


def mapped_bytes(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC or not hasattr(ctypes.CDLL(None), "mallinfo2"),
                    reason="glibc >= 2.33 (mallinfo2) only")
def test_reuse_serves_tensors_from_the_heap_not_fresh_mappings():
    state, mapped = mapped_bytes("system")
    assert state == "system" and mapped >= 8 * 1024 * 1024  # glibc's default: a fresh mmap
    state, mapped = mapped_bytes("reuse")
    assert state == "on" and mapped == 0  # from the heap, whose freed blocks are reused


def test_reuse_says_on_or_why_not_in_a_process_of_its_own():
    # a subprocess: mallopt is process-wide and would change every later test's allocator
    probe = ("from rl_async.base import allocator as a; first = a.reuse_freed_memory(); "
             "print(first == a.reuse_freed_memory(), first)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split(maxsplit=1)
    assert out[0] == "True"
    assert out[1].strip() == "on" if GLIBC else out[1].startswith("unavailable: ")


def test_rss_bytes_is_this_process_resident_memory():
    import psutil

    from rl_async.base.allocator import rss_bytes

    import mmap

    before = rss_bytes()
    # A fresh anonymous mapping, every page written: heap memory freed earlier in this
    # process (kept resident by the reuse allocator) cannot serve it.
    block = mmap.mmap(-1, 64 * 1024 * 1024)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    grown = rss_bytes()
    assert grown - before > 60 * 1024 * 1024
    assert abs(grown - psutil.Process().memory_info().rss) < 8 * 1024 * 1024
    block.close()


def test_cpu_allocator_key_is_validated_and_named_where_unused():
    with pytest.raises(Exception, match="cpu_allocator"):
        load_config("cluster_configs/local.toml", ["cluster.cpu_allocator=jemalloc"])
    gpu = load_config("cluster_configs/local.toml", [
        "cluster.cpu_allocator=system", "cluster.inference_gpus=1", "cluster.trainer_gpus=1"])
    assert any(w.code == "UNUSED_KEY" and "cluster.cpu_allocator" in w.message
               for w in validate(gpu).warnings)
