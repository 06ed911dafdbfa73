"""Checkpoints: the folder format (format.py: save, read, apply, recover), what a checkpoint
folder is and how a damaged one is refused (files.py), the optimizer state streamed from the
NVMe tier (tier.py), the generators' states (rng_state.py) and the checks of a resumed config
(resume.py).

`megacompile.train.checkpoint`'s names are format.py's (the module this package was).
"""
from .format import (  # noqa: F401
    CHECKPOINT_NAME, MAX_SHARD_SIZE, TRAINER, WEIGHTS, WEIGHTS_INDEX, CheckpointError, checkpoints, damaged,
    elsewhere, finite, is_megatrain, step_of, trainer_shaped, write_model_files, write_weights, FILES,
    DiskSpaceError, recover, estimate_bytes, save, Loaded, read, apply, load)
