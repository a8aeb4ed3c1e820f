"""CPU tensors on reused memory: keep glibc's malloc from handing freed blocks back to the OS.

glibc serves a block above its mmap threshold (128 KiB at start, raised as blocks are freed)
with a fresh mapping and unmaps it on free, and trims freed memory off the top of its heaps.
Torch's CPU allocator has no cache of its own, so a process that allocates tensors of a few
MiB every step (the embedded engine re-packs its KV cache whenever rows join or leave the
batch; a trainer's activations) pays a page fault per 4 KiB page on every first touch.
Measured (2 shared cores, 2026-12-07): writing a 1 MiB KV slice into a fresh buffer took
1.8 ms against 0.1-0.35 ms into reused memory; the embedded engine at 512 running requests of
the time-to-reward model spent a third of its time there (31.5 -> 17.5 us per generated
token with this on; docs/benchmarks.md, "Engine").

`reuse_freed_memory()` fixes the mmap threshold at 32 MiB (the largest glibc accepts on 64-bit)
and the trim threshold at 1 GiB, so blocks up to 32 MiB come from the heap and freed ones are
reused. The cost: freed heap stays with the process, up to the trim threshold per malloc arena
(glibc keeps one arena per allocating thread) instead of being returned. Measured
(benchmarks/allocator_memory.py, against glibc's defaults): 3 MB more resident in the demo's
engine over 2,000 updates, 55-136 MB (4%) in the SmolLM2 engine, no growth over a run. A process-wide setting, so the actor shells (the processes' owners) apply it on
CPU (`cluster.cpu_allocator`), never the core's classes. No-op off glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's maximum: HEAP_MAX_SIZE / 2 on 64-bit
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024

_applied: str | None = None


def applies_to(cfg, side: str) -> bool:
    """Whether `cluster.cpu_allocator` concerns this side's processes ("engine" or
    "trainer"): embedded engines and real trainers on CPU. `cfg` is a RunConfig (not imported:
    the base layer knows no configs)."""
    c = cfg.cluster
    if side == "engine":
        return cfg.engine.backend == "embedded" and not c.inference_gpus
    return cfg.train.backend != "synthetic" and not c.trainer_gpus


def apply_for(cfg, side: str) -> str:
    """What an actor shell of `side` runs at start: "on", "unavailable: ..." or "system"."""
    if applies_to(cfg, side) and cfg.cluster.cpu_allocator == "reuse":
        return reuse_freed_memory()
    return "system"


def reuse_freed_memory() -> str:
    """Apply the setting to this process once; returns "on" or "unavailable: <why>"."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> str:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 -- glibc only: mallopt's numbers are glibc's
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return f"unavailable: not glibc ({name!r})"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        return "unavailable: mallopt(M_MMAP_THRESHOLD) refused"
    if not mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES):
        return "unavailable: mallopt(M_TRIM_THRESHOLD) refused"
    return "on"


def rss_bytes() -> float:
    """This process's resident memory now (bytes, /proc/self/statm), for the per-process
    `engine/<i>/rss_bytes` and `trainer/rss_bytes` metrics; the peak where /proc is absent."""
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except OSError:  # not Linux: ru_maxrss is the peak (KiB on Linux, bytes on macOS)
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
