"""State on disk and on the wire: models built from their Hugging Face directories, the
weights codec and collective groups of a publication, trainer state files, complete-or-absent
checkpoints, Hugging Face exports, recorded rollouts, and `rl-async prepare-model`.

Imports: `base`, `plan`.
"""
