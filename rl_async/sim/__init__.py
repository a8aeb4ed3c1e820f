"""The simulator (`rl-async simulate`): the real Ray-free core on a virtual clock."""
