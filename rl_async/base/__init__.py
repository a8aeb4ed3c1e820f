"""The ground floor: the types every room passes around (`Group`, `Sample`), the clock the
simulator swaps for a virtual one, two asyncio helpers (the micro-batcher and
cancellation-safe waiters), and the process facts of `allocator.py`: glibc's allocator
setting (`cluster.cpu_allocator`, process-wide: only the actor shells that own a process
apply it, never a core class) and a process's resident memory.

Imports: nothing from rl_async. Everything else may import it.
"""
