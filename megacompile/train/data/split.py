"""The train/eval split of a run's records (`val_size`): data work, done before tokenization
as LLaMA-Factory's split_dataset does it, so the same records are held out.

    holdout_indices(10, 0.2, seed=42) -> (train indices, eval indices)
"""
from __future__ import annotations

import math

from ...errors import ConfigError


def holdout_indices(n: int, val_size: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, eval indices) of `n` records, as LLaMA-Factory's split_dataset chooses them:
    `datasets.Dataset.train_test_split(test_size=val_size, seed=seed)` (a fraction rounds the eval
    count up; a count above 1 is a number of records). Called on an index column, so the very same
    permutation picks the same rows that LLaMA-Factory holds out of the same records."""
    import datasets
    test_size: float | int = int(val_size) if val_size >= 1 else float(val_size)
    count = test_size if isinstance(test_size, int) else math.ceil(test_size * n)
    if count >= n:
        raise ConfigError(f"val_size={val_size} holds out {count} of the {n} records, leaving none to train on: "
                          "lower val_size.")
    split = datasets.Dataset.from_dict({"i": list(range(n))}).train_test_split(test_size=test_size, seed=seed)
    return list(split["train"]["i"]), list(split["test"]["i"])
