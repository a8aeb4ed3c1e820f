"""The simulator (`rl-async simulate`): the real Ray-free core on a virtual clock.

Imports: `base`, `observe`, `plan`, `engine`, `loop` (it runs the loop with synthetic
engines and a synthetic trainer).
"""
