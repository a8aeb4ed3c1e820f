"""What a run shows: metrics sinks (W&B, console, memory), the completed-queue metrics of
SPEC §7, the calibration a run measures for the simulator, and `rl-async compare`.

Imports: `base`.
"""
