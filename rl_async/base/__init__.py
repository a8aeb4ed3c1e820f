"""The ground floor: the types every room passes around (`Group`, `Sample`), the clock the
simulator swaps for a virtual one, and two asyncio helpers (the micro-batcher and
cancellation-safe waiters).

Imports: nothing from rl_async. Everything else may import it.
"""
