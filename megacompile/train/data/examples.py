"""Tokenized examples, stored compactly.

An `Example` is one training sequence as Python lists (what encoding returns and a batch reads).
`Examples` holds many of them in flat int32 arrays (tokens, labels, optional packed positions)
with start/end offsets: 8 bytes per token (4 for `stage: pt`, whose labels are its tokens)
instead of a Python int list's 8-byte slot plus a 28-byte int object per token, which competed
with the host weight store. Indexing gives an `Example` built on the fly:

    examples = Examples.from_list([Example([1, 2, 3], [-100, 2, 3])])
    examples[0].input_ids        # [1, 2, 3]
    examples.nbytes              # what the store holds
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

IGNORE = -100


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] | None = None   # packed examples: positions restart at each sample
    images: list[str] | None = None         # image files of a VLM example (see images.py)

    @property
    def trained_tokens(self) -> int:
        return sum(1 for t in self.labels[1:] if t != IGNORE)   # labels are shifted by the model


class Examples(Sequence):
    """A read-only sequence of Examples over flat int32 arrays; `starts[i]:ends[i]` is example i."""

    def __init__(self, ids: np.ndarray, labels: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                 positions: np.ndarray | None = None, images: list | None = None, unlabelled: int | None = None):
        self.ids, self.labels, self.positions, self.images = ids, labels, positions, images
        # a token id whose labels are IGNORE when read (stage pt: the pad token, as LLaMA-Factory's
        # collator masks it), so the labels can share the tokens' array
        self.unlabelled = unlabelled
        self.starts, self.ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)

    @classmethod
    def from_list(cls, examples: Sequence[Example]) -> Examples:
        """The store of a list of Examples (all packed or none; images kept)."""
        lengths = np.array([len(e.input_ids) for e in examples], dtype=np.int64)
        ends = np.cumsum(lengths)
        starts = ends - lengths

        def flat(rows) -> np.ndarray:
            return np.fromiter((t for row in rows for t in row), dtype=np.int32, count=int(lengths.sum()))
        positioned = bool(examples) and examples[0].position_ids is not None
        images = [e.images for e in examples] if any(e.images for e in examples) else None
        return cls(flat(e.input_ids for e in examples), flat(e.labels for e in examples), starts, ends,
                   flat(e.position_ids for e in examples) if positioned else None, images)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.select(range(len(self))[i])
        s, e = int(self.starts[i]), int(self.ends[i])
        labels = self.labels[s:e]
        if self.unlabelled is not None:
            labels = np.where(self.ids[s:e] == self.unlabelled, IGNORE, labels)
        return Example(self.ids[s:e].tolist(), labels.tolist(),
                       None if self.positions is None else self.positions[s:e].tolist(),
                       None if self.images is None else (list(self.images[i]) if self.images[i] else None))

    def select(self, indices) -> Examples:
        """The examples at `indices`, sharing this store's arrays."""
        idx = np.asarray(list(indices), dtype=np.int64)
        return Examples(self.ids, self.labels, self.starts[idx], self.ends[idx], self.positions,
                        None if self.images is None else [self.images[k] for k in idx], self.unlabelled)

    def lengths(self) -> np.ndarray:
        return self.ends - self.starts

    @property
    def nbytes(self) -> int:
        """Bytes held by the store (arrays shared between the tokens and labels counted once)."""
        arrays = {id(a): a for a in (self.ids, self.labels, self.positions, self.starts, self.ends) if a is not None}
        return sum(a.nbytes for a in arrays.values())

    @property
    def tokens(self) -> int:
        return int(self.lengths().sum())
