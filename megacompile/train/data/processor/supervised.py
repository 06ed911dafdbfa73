"""Stage sft: chat records (alpaca or sharegpt) encoded turn by turn with the run's template, as
LLaMA-Factory's supervised processor; with packing, whole examples packed into cutoff_len
sequences, each map batch on its own (packing.py), positions restarting per example.

    encode: one row per record: ids and labels (-100 but on the replies), its images, or the
            reason it gives none (malformed, dropped: cutoff_len left no reply, dropped_images)
    examples: one example per row that gives one; packed when the config packs
"""
from __future__ import annotations

from ..registry import DataError
from .base import DatasetProcessor, drops, dropped_counts, flat


class SupervisedProcessor(DatasetProcessor):
    stage = "sft"

    @staticmethod
    def template(config, tokenizer):
        from ..records import chat_template
        return chat_template(tokenizer, config.template, config)

    @staticmethod
    def encode(batch: dict[str, list], indices, attr, config, tokenizer, template, images=None) -> dict[str, list]:
        from ..records import encode_record
        records = [dict(zip(batch, values)) for values in zip(*batch.values())]
        out = {"input_ids": [], "labels": [], "images": [], "drop": []}
        where = attr.file_name or attr.hf_hub_url or attr.name
        for k, record in enumerate(records):
            ex, reason = encode_record(record, attr, config, tokenizer, template, images)
            if reason and "|" in reason:   # (record numbers count from 1, as an editor's lines do)
                kind, why = reason.split("|", 1)
                number = f"record {indices[k] + 1}" if indices is not None else "a record"
                reason = f"{kind}|{where} {number}{' (of the sampled ones)' if attr.num_samples else ''}: {why}"
            out["input_ids"].append(ex.input_ids if ex else [])
            out["labels"].append(ex.labels if ex else [])
            out["images"].append(list(ex.images or []) if ex else [])
            out["drop"].append(reason or "")
        return out

    @staticmethod
    def examples(table, config, tokenizer, batches):
        import numpy as np

        from ..examples import Examples
        from ..packing import pack
        from ..records import data_cutoff_len, packs
        table = table.flatten_indices() if table._indices is not None else table
        ids, offsets = flat(table, "input_ids")
        reasons = drops(table)
        labels, _ = flat(table, "labels")
        idx = np.flatnonzero(np.array([not d for d in reasons], dtype=bool))
        images = None
        if "images" in table.column_names:
            paths = table.data.column("images").to_pylist()
            images = [paths[k] or None for k in idx] if any(paths) else None
        examples = Examples(ids, labels, offsets[:-1][idx], offsets[1:][idx], None, images)
        examples.rows = idx
        if packs(config) and examples:
            if examples.images:
                raise DataError("packing: true with image data: packed samples would share image positions. "
                                "Set packing: false.")
            n = len(examples)
            batch_of = np.searchsorted([end for _, end in batches], examples.rows, side="right")
            groups = [np.flatnonzero(batch_of == b).tolist() for b in range(len(batches))]
            examples = pack(examples, data_cutoff_len(config), [g for g in groups if g])
            examples.packed_from = n
        return examples, dropped_counts(reasons)
