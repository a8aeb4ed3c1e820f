"""Trainer backends: torch (DDP), megatron-core, and the synthetic trainer of dry runs.

Imports: `base`, `algo`, `state`, `engine` (the synthetic trainer shares the synthetic
engine's timing); never the loop.
"""
