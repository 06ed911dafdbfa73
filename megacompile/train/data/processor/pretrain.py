"""Stage pt: raw text, as LLaMA-Factory's pretrain processor. Each document gets the separator
(the EOS text) appended and is tokenized without special tokens; with packing (LF's default for
pt) each map batch's documents are concatenated and cut into cutoff_len blocks (the remainder
dropped, each block's first token BOS with add_bos_token), without it each document is one
example, BOS first and truncated to cutoff_len. Tokens equal to the pad token get no label (LF's
DataCollatorForLanguageModeling).

    encode: one row per document (labels = ids)
    examples: blocks, or one truncated example per document
"""
from __future__ import annotations

from ..registry import DataError
from .base import DatasetProcessor, bos_id, drops, dropped_counts, flat


class PretrainProcessor(DatasetProcessor):
    stage = "pt"

    @staticmethod
    def template(config, tokenizer):
        from ..records import pt_separator
        return pt_separator(tokenizer, config.template)

    @staticmethod
    def encode(batch: dict[str, list], indices, attr, config, tokenizer, template, images=None) -> dict[str, list]:
        from ..records import PT_COLUMNS, pretrain_tokens
        column = {**PT_COLUMNS, **attr.columns}["prompt"]
        if column not in batch:
            raise DataError(f"data set {attr.name!r} (pt): records have no {column!r} column (has {list(batch)}); set "
                            "columns.prompt.")
        out = {"input_ids": [], "labels": [], "images": [], "drop": []}
        for text in batch[column]:
            ids = pretrain_tokens(tokenizer, text, template)   # (template: the separator text)
            out["input_ids"].append(ids), out["labels"].append(ids), out["images"].append([]), out["drop"].append("")
        return out

    @staticmethod
    def examples(table, config, tokenizer, batches):
        import numpy as np

        from ..examples import Examples
        from ..records import data_cutoff_len, packs
        cutoff_len, bos, pad_id = data_cutoff_len(config), bos_id(tokenizer), tokenizer.pad_token_id
        table = table.flatten_indices() if table._indices is not None else table
        ids, offsets = flat(table, "input_ids")
        dropped = dropped_counts(drops(table))
        if packs(config):
            pieces = []
            for first, last in batches if batches is not None else [(0, len(offsets) - 1)]:
                s, e = offsets[first], offsets[last]
                pieces.append(ids[s: s + (e - s) // cutoff_len * cutoff_len])   # the batch's remainder is not kept
            stream = np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)   # (a copy)
            starts = np.arange(len(stream) // cutoff_len, dtype=np.int64) * cutoff_len
            if bos is not None:
                stream[starts] = bos
            return Examples(stream, stream, starts, starts + cutoff_len, unlabelled=pad_id), dropped
        lengths = np.diff(offsets)
        if bos is not None:   # BOS before each document, then the truncation
            stream = np.insert(ids, offsets[:-1], bos).astype(np.int32)
            offsets = offsets + np.arange(len(offsets))
            lengths = lengths + 1
        else:
            stream = ids
        keep = np.flatnonzero(lengths > 0)
        starts = offsets[:-1][keep]
        return Examples(stream, stream, starts, starts + np.minimum(lengths[keep], cutoff_len),
                        unlabelled=pad_id), dropped
