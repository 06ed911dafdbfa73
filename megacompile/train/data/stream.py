"""`streaming: true`: the training examples are read from the data sets while the run goes, never
held all at once (a pre-training corpus larger than the host RAM left beside the weight store).

    records    datasets.load_dataset(..., streaming=True) per data set (files read lazily; hubs)
      -> encoded per data set, by the same per-record function as the cached path (encode_batch)
      -> mixed (mix_strategy: datasets' concatenate / interleave of iterable data sets)
      -> chunks of preprocessing_batch_size records, each one LLaMA-Factory map batch: stage pt's
         documents concatenated and cut into cutoff_len blocks (or truncated), sft packed by LF's
         knapsack within the chunk (data.examples_of, the non-streaming code)
      -> the first val_size examples held out for evaluation (a number, as LF's streaming split)
      -> datasets' shuffle buffer (buffer_size, seed + epoch), unless disable_shuffling
      -> micro-batches of per_device_train_batch_size (an epoch's incomplete last one dropped)

The data position in a checkpoint is (epoch, examples read in it). Resuming rebuilds the same
seeded stream and reads past that many examples (re-reading and re-tokenizing them, no training),
so a resumed run sees exactly the examples an uninterrupted one would; that costs the time to
tokenize what was already trained on (logged).

As LLaMA-Factory in streaming mode, `max_steps` must be set (the stream's length is unknown) and
`num_samples` is not applied. Differences from LF's order, for the same seed: LF shuffles the
examples before it takes the held-out ones (so its eval set changes with the shuffle); here the
eval set is the stream's first val_size examples, fixed for the run.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

from .examples import Example, Examples
from .registry import DataError


def _load(attr, config):
    """One data set as a datasets.IterableDataset (files and HF hub sets streamed; ModelScope and
    Modelers sets load whole, then iterate)."""
    import datasets

    from .sources import check_source, data_files, data_path, load_source
    datasets.disable_progress_bars()
    check_source(attr, config.dataset_dir, config.allow_outside_dataset_dir)
    try:
        if attr.load_from == "file":
            builder, files = data_files(data_path(attr, config.dataset_dir, config.allow_outside_dataset_dir))
            return datasets.load_dataset(builder, data_files=files, split="train", streaming=True)
        if attr.load_from == "hf_hub":
            return datasets.load_dataset(attr.hf_hub_url, attr.subset, data_dir=attr.folder, split=attr.split,
                                         streaming=True)
    except Exception as e:  # datasets wraps reader and hub errors in several types
        cause = e.__cause__ or e
        raise DataError(f"data set {attr.name!r}: could not stream it ({type(cause).__name__}: "
                        f"{str(cause).splitlines()[0] if str(cause) else ''}).") from None
    return load_source(attr, config.dataset_dir, config.allow_outside_dataset_dir).to_iterable_dataset()


def _columns(ds, name: str) -> list[str]:
    """The column names of a stream (read from its first record when the reader does not know)."""
    if ds.column_names is not None:
        return list(ds.column_names)
    try:
        return list(next(iter(ds)).keys())
    except StopIteration:
        raise DataError(f"data set {name!r} holds no records.") from None


def _chunk_examples(batch: dict[str, list], config, tokenizer) -> dict[str, list]:
    """One chunk of encoded records -> its examples, as one LLaMA-Factory map batch (datasets.map,
    batched; rows out need not match rows in)."""
    import datasets

    from .loader import examples_of
    from .tokenize_cache import features
    table = datasets.Dataset.from_dict(batch, features=features())
    # one map batch: the whole chunk is packed (or cut into pt blocks) on its own
    examples, dropped = examples_of(table, dataclasses.replace(config, preprocessing_num_workers=None), tokenizer)
    rows = [examples[i] for i in range(len(examples))]   # (pt: the pad token's labels already -100)
    return {"input_ids": [e.input_ids for e in rows], "labels": [e.labels for e in rows],
            "position_ids": [e.position_ids or [] for e in rows], "images": [e.images or [] for e in rows]}


def examples_stream(config, tokenizer, template, images=None):
    """The run's examples as one datasets.IterableDataset (rows: input_ids, labels, position_ids,
    images), before the held-out split and the shuffle."""
    from .registry import load_registry
    from .sources import mix, parse_probs
    from .tokenize_cache import encode_batch
    registry = load_registry(config.dataset_dir, config.datasets)
    parts = []
    for name in config.datasets:
        attr = registry[name]
        raw = _load(attr, config)
        parts.append(raw.map(encode_batch, batched=True, batch_size=config.preprocessing_batch_size,
                             remove_columns=_columns(raw, name),
                             fn_kwargs=dict(attr=attr, config=config, tokenizer=tokenizer, template=template,
                                            images=images)))
    mixed = mix(parts, config.mix_strategy, parse_probs(config.interleave_probs, len(parts), config.mix_strategy),
                config.seed)
    return mixed.map(_chunk_examples, batched=True, batch_size=config.preprocessing_batch_size,
                     remove_columns=["input_ids", "labels", "images", "drop"],
                     fn_kwargs=dict(config=config, tokenizer=tokenizer))


def _example(row: dict[str, Any]) -> Example:
    return Example(list(row["input_ids"]), list(row["labels"]), list(row["position_ids"]) or None,
                   list(row["images"]) or None)


def fingerprint(config, tokenizer, template) -> str:
    """What decides a stream's examples, without reading it: the data files' paths, sizes and
    modification times (a hub set's id, subset and split), the registry entries, the tokenizer,
    the template and the data options. A checkpoint's data position is only valid for the same."""
    from .registry import load_registry
    from .sources import data_files, data_path
    from .tokenize_cache import TRAINING_ONLY, tokenizer_digest
    registry = load_registry(config.dataset_dir, config.datasets)
    sources = {}
    for name in config.datasets:
        attr = registry[name]
        if attr.load_from == "file":
            _, files = data_files(data_path(attr, config.dataset_dir, config.allow_outside_dataset_dir))
            stats = [(f, Path(f).stat()) for f in files]
            sources[name] = [(f, st.st_size, st.st_mtime_ns) for f, st in stats]
        else:
            sources[name] = [attr.load_from, attr.hub_id, attr.subset, attr.split, attr.folder]
        sources[name] = [sources[name], repr(attr)]
    options = {k: v for k, v in config.to_dict().items() if k not in TRAINING_ONLY and k not in config.megatrain}
    blob = json.dumps({"sources": sources, "options": options, "template": repr(template),
                       "order": [config.buffer_size, config.val_size],
                       "tokenizer": tokenizer_digest(tokenizer)}, sort_keys=True, default=str)
    return "stream-" + hashlib.sha256(blob.encode()).hexdigest()[:32]


class StreamOrder:
    """The micro-batches of a stream, epoch after epoch; its position is part of a checkpoint.

        order = StreamOrder(train_stream, batch=4, seed=42, shuffle=True, buffer_size=16384)
        order.next_examples(None)    # [Example x 4]
        order.state_dict()           # {"streaming": True, "epoch": 0, "consumed": 4, ...}
    """

    def __init__(self, stream, batch: int, seed: int, shuffle: bool, buffer_size: int):
        self.batch, self.seed, self.shuffle = batch, seed, shuffle
        self._stream = stream.shuffle(seed=seed, buffer_size=buffer_size) if shuffle else stream
        self.epoch, self.consumed = 0, 0
        self._it = None

    def _open(self, skip: int):
        self._stream.set_epoch(self.epoch)   # (datasets' shuffle seeds its buffer with seed + epoch)
        it = iter(self._stream)
        for _ in itertools.islice(it, skip):   # a resumed position: read past what was trained on
            pass
        return it

    def next_examples(self, _examples=None) -> list[Example]:
        for _attempt in range(2):
            if self._it is None:
                self._it = self._open(self.consumed)
            rows = list(itertools.islice(self._it, self.batch))
            if len(rows) == self.batch:
                self.consumed += self.batch
                return [_example(r) for r in rows]
            if self.consumed == 0:   # a whole epoch without one micro-batch
                break
            self.epoch, self.consumed, self._it = self.epoch + 1, 0, None   # (the incomplete one is dropped)
        raise DataError(f"the data stream holds fewer than per_device_train_batch_size={self.batch} examples: add data "
                        "or lower per_device_train_batch_size.")

    def state_dict(self) -> dict[str, Any]:
        return {"streaming": True, "epoch": self.epoch, "consumed": self.consumed, "batch": self.batch,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state.get("streaming"):
            raise DataError("the checkpoint was written by a run that did not stream its data: resume with "
                            "streaming: false.")
        for key, what in (("batch", "per_device_train_batch_size"), ("seed", "seed"),
                          ("shuffle", "disable_shuffling (inverted)")):
            if state[key] != getattr(self, key):
                raise DataError(f"the checkpoint read the stream with {what} = {state[key]}, this run has "
                                f"{getattr(self, key)}: resume with the same value.")
        self.epoch, self.consumed, self._it = state["epoch"], state["consumed"], None


@dataclasses.dataclass
class StreamData:
    order: StreamOrder
    first: Example
    held_out: Examples | list
    fingerprint: str


def open_stream(config, tokenizer, template, images=None) -> StreamData:
    """The streamed training data of a run: its order (micro-batches), its first example (for the
    log), the val_size held-out examples and the data fingerprint."""
    stream = examples_stream(config, tokenizer, template, images)
    held = int(config.val_size)
    head = list(itertools.islice(iter(stream), held + 1))
    if len(head) <= held:
        raise DataError(f"the data stream holds {len(head)} examples, val_size={held} holds them all out: lower "
                        "val_size or add data.")
    held_out = Examples.from_list([_example(r) for r in head[:held]]) if held else []
    train = stream.skip(held) if held else stream
    order = StreamOrder(train, config.per_device_train_batch_size, config.seed, not config.disable_shuffling,
                        config.buffer_size)
    return StreamData(order, _example(head[held]), held_out, fingerprint(config, tokenizer, template))
