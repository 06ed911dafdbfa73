"""Which samples LLaMA-Factory 0.9.5 packs together, computed the same way here.

LF packs inside its tokenization call: `datasets.map(batched=True, batch_size=
preprocessing_batch_size, num_proc=preprocessing_num_workers)`, so each map batch is packed on
its own (sft: PackedSupervisedDatasetProcessor's greedy knapsack; pt: the batch's documents
concatenated and cut into blocks, the batch's remainder dropped). megatrain tokenizes once per
record (and caches that), then packs with the same batches:

    map_batches(10, workers=4, batch_size=2)   # [(0, 2), (2, 3), (3, 5), (5, 6), (6, 8), (8, 10)]
    knapsacks([5, 3, 5, 2], capacity=8)        # [[2, 1], [0, 3]]: lengths 5+3, then 5+2
"""
from __future__ import annotations

import bisect

import numpy as np

from .examples import IGNORE, Example, Examples


def map_batches(n: int, workers: int | None, batch_size: int) -> list[tuple[int, int]]:
    """The row ranges datasets.map gives its function for `n` rows: one contiguous shard per
    process (datasets lowers num_proc to n; shard i starts at i * (n // p) + min(i, n % p)), each
    cut into batches of `batch_size` rows from the shard's start."""
    procs = max(1, min(workers or 1, n))
    size, extra = divmod(n, procs)
    out = []
    for i in range(procs):
        start = size * i + min(i, extra)
        end = start + size + (1 if i < extra else 0)
        out += [(s, min(s + batch_size, end)) for s in range(start, end, batch_size)]
    return out


def knapsacks(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into packs of at most `capacity` tokens, as LF's greedy
    knapsack groups them: each pack starts empty and takes the longest remaining sample that still
    fits until none does; among samples of equal length the later one goes first (LF takes the last
    index it saw for a length). Returns the packs in the order they were made, each in the order
    its samples were taken."""
    if any(n > capacity for n in lengths):   # (encoding truncates to cutoff_len first: never here)
        raise ValueError(f"a sample of {max(lengths)} tokens cannot be packed into {capacity}")
    pending = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    sizes = [lengths[i] for i in pending]
    packs = []
    while pending:
        room, pack = capacity, []
        while True:
            k = bisect.bisect_right(sizes, room) - 1   # the longest that fits (the last of its length)
            if k < 0:
                break
            room -= sizes.pop(k)
            pack.append(pending.pop(k))
        packs.append(pack)
    return packs


def pack(examples: list[Example] | Examples, cutoff_len: int, batches: list[list[int]] | None = None) -> Examples:
    """Samples packed into sequences of at most `cutoff_len` tokens as LLaMA-Factory packs them:
    its greedy knapsack (packing.knapsacks) within each of `batches` (lists of example indices: the
    map batches LF packs separately; None: one batch of all), the packs in LF's order.

    Samples do not see each other: positions restart at every sample, which makes transformers
    build a block-diagonal causal mask (no 2-D attention mask is passed; LF's neat_packing), and
    the first token of each sample is not a target (it would be predicted from the previous
    sample's last token; LF leaves that label as the data has it, which is a prompt token's IGNORE
    unless train_on_prompt). Works on the int32 store: no example is materialised as Python lists.
    """
    store = examples if isinstance(examples, Examples) else Examples.from_list(examples)
    lengths = store.lengths().tolist()
    bins = [[batch[k] for k in group]
            for batch in (batches if batches is not None else [list(range(len(store)))])
            for group in knapsacks([lengths[i] for i in batch], cutoff_len)]
    members = np.array([i for b in bins for i in b], dtype=np.int64)
    sizes = store.lengths()[members]
    firsts = np.cumsum(sizes) - sizes                     # where each sample starts in the packed stream
    ids = np.concatenate([store.ids[store.starts[i]:store.ends[i]] for i in members])
    labels = np.concatenate([store.labels[store.starts[i]:store.ends[i]] for i in members])
    labels[firsts] = IGNORE
    positions = (np.arange(len(ids)) - np.repeat(firsts, sizes)).astype(np.int32)
    bin_ends = np.cumsum([sum(lengths[i] for i in b) for b in bins], dtype=np.int64)
    return Examples(ids, labels, np.concatenate(([0], bin_ends[:-1])), bin_ends, positions)
