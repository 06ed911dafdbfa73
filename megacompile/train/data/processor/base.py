"""What a stage's data processor does, in two steps (LLaMA-Factory's DatasetProcessor shape):

    encode(batch, indices, ...)     -> {"input_ids": [...], "labels": [...], "images": [...], "drop": [...]}
        a batch of records to token rows, in datasets.map's worker processes (tokenize_cache.py
        caches the rows on disk); a record that gives no example keeps an empty row and its
        reason in "drop", so mixing and the train/eval split see every record
    examples(table, config, ...)    -> (Examples, Counter of dropped records by reason)
        the rows of a tokenized table to the run's examples (blocks, packed or single sequences)

and `template(config, tokenizer)`: what encodes the records (a chat encoder, a separator text),
which the cache key and a stream's fingerprint hold. The processors hold no state: datasets.map
pickles only the function and its arguments.
"""
from __future__ import annotations

from collections import Counter


class DatasetProcessor:
    stage: str = ""

    @staticmethod
    def template(config, tokenizer):
        raise NotImplementedError

    @staticmethod
    def encode(batch: dict[str, list], indices: list[int] | None, attr, config, tokenizer, template,
               images=None) -> dict[str, list]:
        """`batch`: datasets.map's columns (name -> values); `indices`: the records' row numbers."""
        raise NotImplementedError

    @staticmethod
    def examples(table, config, tokenizer, batches: list[tuple[int, int]]):
        raise NotImplementedError


def flat(table, column: str):
    """(values as int32, offsets) of a list column of a datasets table, without a copy per row."""
    import numpy as np
    import pyarrow as pa
    col = table.data.column(column)
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if isinstance(arr, pa.ChunkedArray):   # no chunks at all
        arr = pa.array([], type=col.type)
    values = arr.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    return values, arr.offsets.to_numpy().astype(np.int64)


def drops(table) -> list[str]:
    """Each row's reason for giving no example ("" where it gives one)."""
    return table.data.column("drop").to_pylist() if "drop" in table.column_names else [""] * len(table)


def dropped_counts(reasons: list[str]) -> Counter:
    """Dropped rows by reason kind (`malformed|where: why` counts as malformed)."""
    return Counter(d.split("|", 1)[0] for d in reasons if d)


def bos_id(tokenizer) -> int | None:
    """The BOS id LLaMA-Factory puts first (a tokenizer with add_bos_token), else None."""
    return tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", False) else None
