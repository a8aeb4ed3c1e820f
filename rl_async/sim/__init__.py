"""The simulator (`rl-async simulate`): the real Ray-free core on a virtual clock.

Imports: everything in rl_async (it runs the loop with synthetic engines and trainer).
"""
