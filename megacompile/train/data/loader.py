"""Training data: a LLaMA-Factory-style registry, file loading, chat formatting and masking.

`dataset_dir/dataset_info.json` names the data sets:

    {"alpaca_demo": {"file_name": "alpaca_demo.json"},                       # formatting: alpaca
     "chat_demo":   {"file_name": "sharegpt_demo.jsonl", "formatting": "sharegpt"},
     "openai_demo": {"file_name": "messages.parquet", "formatting": "sharegpt",
                     "columns": {"messages": "messages"},
                     "tags": {"role_tag": "role", "content_tag": "content",
                              "user_tag": "user", "assistant_tag": "assistant"}},
     "hub":         {"hf_hub_url": "tatsu-lab/alpaca", "split": "train", "num_samples": 1000}}

`file_name` is a file or a folder of json / jsonl / csv / parquet / arrow / txt files (read with
`datasets`). The registry is read as LLaMA-Factory reads it (registry.py); the sets are loaded,
sampled and mixed as it does (sources.py), tokenized through datasets.map with a cache on disk
(tokenize_cache.py) and held as int32 arrays (examples.py). Alpaca records (instruction, input,
output, optional system and history) and
ShareGPT conversations (user/assistant turns, function_call/observation turns with a tools
column, optional system; system, history and tools columns only when mapped, as LLaMA-Factory)
become chat messages, encoded turn by turn as LLaMA-Factory does
(encode.py) with one of its templates (templates.py) or the tokenizer's own chat template
(jinja_template.py). Labels are -100 on everything but the assistant replies (all of them, or
the last with `mask_history`; everything with `train_on_prompt`); a conversation whose turns do
not alternate or that ends on a prompt is skipped and counted. Pre-training text (`stage: pt`) is
processed as LLaMA-Factory does: each document gets the EOS text appended; with packing (its
default for pt) the documents are concatenated and cut into `cutoff_len` blocks (the remainder
dropped, the first token of each block BOS when the tokenizer has add_bos_token), without it each
document is truncated to `cutoff_len` (BOS first with add_bos_token). As LF's collator for pt
(DataCollatorForLanguageModeling), tokens equal to the pad token are not trained on.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...log import get as _get_logger
# the registry, the loading and the example store live in their own files; their names stay here
from .examples import IGNORE, Example, Examples
from .packing import pack  # noqa: F401 (API: megacompile.train.data.pack)
from .registry import ATTR_KEYS, DataError, DatasetAttr, load_registry  # noqa: F401
from .sources import FILE_TYPES, data_path, hub_reachable  # noqa: F401
from .records import (  # noqa: F401 (API: megacompile.train.data.loader's names)
    alpaca_messages, sharegpt_messages, check_conversation, record_tools, chat_template, encode_chat,
    pretrain_tokens, pt_separator, packs, data_cutoff_len, encode_record, ALPACA_COLUMNS, SHAREGPT_COLUMNS,
    UNMAPPED_IGNORED, SHAREGPT_TAGS, PT_COLUMNS, CHATML)

_log = _get_logger("train")

# registry ---------------------------------------------------------------------------
def check_datasets(config) -> dict[str, str]:
    """Check the configured data sets before anything is loaded: registered, usable by sft/pt,
    their files present inside dataset_dir (or their hub reachable), the mixing options. Returns
    {name: resolved path or hub id} for the log."""
    from .encode import check_options
    from .sources import MIX_STRATEGIES, check_source, parse_probs
    from .tokenize_cache import has_data
    if config.stage == "sft":
        check_options(config)   # template, tool_format and their combinations: no tokenizer needed
    if config.tokenized_path and Path(config.tokenized_path).exists() and not Path(config.tokenized_path).is_dir():
        raise DataError(f"tokenized_path {config.tokenized_path} is a file: give a folder (a new or empty one saves "
                        "the tokenized data there, one holding it loads it).")
    if config.tokenized_path and has_data(Path(config.tokenized_path)):
        return {name: f"tokenized_path {config.tokenized_path}" for name in config.datasets}
    if config.mix_strategy != "concat" and config.mix_strategy not in MIX_STRATEGIES:
        raise DataError(f"mix_strategy={config.mix_strategy!r}: use concat, {', '.join(MIX_STRATEGIES)}.")
    parse_probs(config.interleave_probs, len(config.datasets), config.mix_strategy)
    registry = load_registry(config.dataset_dir, config.datasets)
    return {name: check_source(registry[name], config.dataset_dir, config.allow_outside_dataset_dir)
            for name in config.datasets}


def skip_summary(counts: dict) -> str:
    """How many records were skipped as malformed and why, with the first few named by file and
    record (build_examples' counts["skipped"])."""
    n = counts.get("malformed")
    if not n:
        return ""
    shown = "; ".join(counts.get("skipped", [])[:3])
    return (f"{n} skipped (LLaMA-Factory skips them too: a record must alternate user and assistant turns and end "
            f"on a reply" + (f"; e.g. {shown}" if shown else "") + ")")


def data_template(config, tokenizer):
    """What encodes the records: sft's chat template; stage pt's text between documents (the
    tokenize cache's key and a stream's fingerprint hold it)."""
    from .processor import processor_for
    return processor_for(config.stage).template(config, tokenizer)


def build_examples(config, tokenizer, images=None, say=None) -> tuple[Examples, dict[str, int]]:
    """Every training example of the configured data sets (a compact `Examples` store), and counts
    (samples, dropped, records per data set) for the log. The data sets are loaded, sampled and
    mixed as LLaMA-Factory does (sources.py) and tokenized through datasets.map with a cache on
    disk (tokenize_cache.py). `images` (images.ImageInputs) handles a VLM's images.

    With `val_size`, the mixed records are split first, as LLaMA-Factory's split_dataset does
    (train_test_split(test_size=val_size, seed=seed) before tokenization; a record that gives no
    example still counts in the split), and each side becomes examples on its own (pt blocks and
    packed sequences never mix the two): the held-out examples are counts["held_out"] and
    counts["held_out_records"] the number of records they came from."""
    say = say or _log.info
    from .tokenize_cache import tokenized
    check_datasets(config)
    template = data_template(config, tokenizer)
    table, records = tokenized(config, tokenizer, template, images, say)
    counts = {"samples": len(table), "dropped": 0, "records": {n: records.get(n, "?") for n in config.datasets}}
    held = None
    if config.val_size > 0:
        from .split import holdout_indices
        train_rows, eval_rows = holdout_indices(len(table), config.val_size, config.seed)
        held_table = table.select(eval_rows)
        held, held_dropped = examples_of(held_table, config, tokenizer)
        table = table.select(train_rows)
    examples, dropped = examples_of(table, config, tokenizer)
    if held is not None:
        dropped = dropped + held_dropped
    counts.update(dropped)
    if counts.get("malformed"):
        from .tokenize_cache import skipped
        counts["skipped"] = skipped(table) + (skipped(held_table) if held is not None else [])
    if not examples:
        raise DataError(f"no training examples: {counts['samples']} samples, {counts['dropped']} dropped because "
                        f"cutoff_len={config.cutoff_len} left no reply tokens"
                        + (f", {counts['dropped_images']} because it cut into an image" if "dropped_images" in counts
                           else "")
                        + (f", {skip_summary(counts)}; check the records, or the tags and columns in "
                           "dataset_info.json" if counts.get("malformed") else "")
                        + (f" (stage pt: fewer than cutoff_len={config.cutoff_len} tokens of text)"
                           if config.stage == "pt" else "")
                        + (f" ({len(eval_rows)} records held out by val_size={config.val_size:g})" if held is not None
                           else "") + ".")
    if held is not None:
        if not held:
            raise DataError(f"val_size={config.val_size:g} holds out {len(eval_rows)} records that give no example "
                            f"(dropped, skipped or, for stage pt, fewer than cutoff_len={config.cutoff_len} tokens): "
                            "raise val_size.")
        counts["held_out"], counts["held_out_records"] = held, len(eval_rows)
    if packs(config) and config.stage == "sft":
        counts["packed_from"] = getattr(examples, "packed_from", len(examples))
    return examples, counts


def examples_of(table, config, tokenizer):
    """(Examples, dropped counts) of a tokenized table, by the stage's processor: sft rows as they
    are or packed, pt text in blocks. Packing and pt blocks work within the row ranges
    LLaMA-Factory's datasets.map batches (packing.map_batches)."""
    from .packing import map_batches
    from .processor import processor_for
    batches = map_batches(len(table), config.preprocessing_num_workers, config.preprocessing_batch_size)
    return processor_for(config.stage).examples(table, config, tokenizer, batches)


def fingerprint(examples: list[Example]) -> str:
    """A digest of the examples' tokens, labels, positions and image paths, in order: a resumed
    run must read the same examples (the data position in a checkpoint is an index into them)."""
    import hashlib
    h = hashlib.sha256()
    for ex in examples:
        h.update(json.dumps([ex.input_ids, ex.labels, ex.position_ids, ex.images], separators=(",", ":")).encode())
    return h.hexdigest()[:32]


def show_example(tokenizer, ex: Example) -> str:
    """The example decoded, with the tokens that are not trained on in [[...]]."""
    out, masked, run = [], None, []
    for tok, lab in zip(ex.input_ids, ex.labels):
        m = lab == IGNORE
        if m != masked and run:
            text = tokenizer.decode(run)
            out.append(f"[[{text}]]" if masked else text)
            run = []
        masked = m
        run.append(tok)
    if run:
        text = tokenizer.decode(run)
        out.append(f"[[{text}]]" if masked else text)
    return "".join(out)


# batching ---------------------------------------------------------------------------
#: a batch is padded to a multiple of this many tokens (LLaMA-Factory's collator pads to 8)
PAD_MULTIPLE = 8


def padded_length(length, multiple: int = PAD_MULTIPLE):
    """`length` (an int, or a numpy array of them) rounded up to the padding multiple."""
    return -(-length // multiple) * multiple


def collate(examples: list[Example], pad_id: int, multiple: int = PAD_MULTIPLE, images=None) \
        -> dict[str, torch.Tensor]:
    """Right-padded tensors; padding is masked by position (pad may equal eos). Packed examples
    get `position_ids` instead of an attention mask (the padding is one more packed sample).
    With `images` (images.ImageInputs), a VLM batch also gets its processed images."""
    length = padded_length(max(len(e.input_ids) for e in examples), multiple)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    positions = torch.zeros((len(examples), length), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        mask[row, :n] = 1
        if e.position_ids is not None:
            positions[row, :n] = torch.tensor(e.position_ids)
            positions[row, n:] = torch.arange(length - n)
    if examples[0].position_ids is not None:
        return {"input_ids": ids, "position_ids": positions, "labels": labels}
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if images is not None:
        batch.update(images.batch([p for e in examples for p in e.images or ()], ids))
    return batch


#: the [batch, sequence] inputs of a collated batch, whose sequence length changes between batches
SEQUENCE_INPUTS = ("input_ids", "attention_mask", "labels", "position_ids")


def lengths_vary(examples, batches, multiple: int = PAD_MULTIPLE) -> bool:
    """Whether the collated `batches` (each a list of indices into `examples`, padded to
    `multiple`) differ in length. Examples not held in a store (a stream) are not known ahead:
    False, and the compiler's own rule (static, then dynamic from the second length) applies."""
    lengths = getattr(examples, "lengths", None)
    if lengths is None:
        return False
    lengths = lengths()
    padded = padded_length(lengths, multiple)   # (as collate pads each batch)
    if not len(padded) or padded.min() == padded.max():   # (packed, or all cut to one length: no batch to read)
        return False
    seen = None
    for indices in batches:
        if not len(indices):
            continue
        longest = int(padded[np.asarray(indices, dtype=np.int64)].max())
        if seen is not None and longest != seen:
            return True
        seen = longest
    return False


def run_batches(order, micro_batches: int, world: int):
    """The index lists of the next `micro_batches` global micro-batches `order` gives, each
    rank's part (of `world`) apart, without moving `order` (a copy reads ahead)."""
    if type(order) is not Order:   # (a stream's order reads its data: nothing to read ahead)
        return
    ahead = copy.deepcopy(order)
    per = ahead.batch // world
    for _ in range(micro_batches):
        indices = np.asarray(ahead.next(), dtype=np.int64)
        for r in range(world):
            yield indices[r * per: (r + 1) * per]


def mark_lengths_dynamic(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`batch` with its sequence dimension marked dynamic for Dynamo, so that the first compile
    serves every length: without it the first step compiles for its exact length and the second
    length compiles the model again with a symbolic one (a whole second compile: a few seconds
    for a toy, tens for an 80-layer model). `maybe_`: a family whose trace needs a fixed length
    is specialised by Dynamo instead of refused."""
    for key in SEQUENCE_INPUTS:
        t = batch.get(key)
        if isinstance(t, torch.Tensor) and t.dim() == 2:
            torch._dynamo.maybe_mark_dynamic(t, 1)
    return batch


class Order:
    """The sample order: one seeded permutation per epoch (or the examples as they are, with
    shuffle=False: LLaMA-Factory's disable_shuffling), read micro-batch by micro-batch.
    Its position (epoch, micro-batch) is part of a checkpoint, so a resumed run reads on."""

    def __init__(self, n: int, batch: int, seed: int, shuffle: bool = True):
        self.n, self.batch, self.seed, self.shuffle = n, batch, seed, shuffle
        self.epoch, self.index = 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.batch

    def next(self) -> list[int]:
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self._perm = self._permutation()
        k = self.index * self.batch
        self.index += 1
        return self._perm[k: k + self.batch]

    def next_examples(self, examples) -> list:
        """The next micro-batch's examples (stream.StreamOrder reads its own instead)."""
        return [examples[i] for i in self.next()]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "n": self.n, "batch": self.batch, "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("streaming"):
            raise DataError("the checkpoint was written by a run that streamed its data: resume with streaming: true.")
        if (state["n"], state["batch"]) != (self.n, self.batch):
            raise DataError(f"the checkpoint was written for {state['n']} examples in batches of {state['batch']}, "
                            f"this run has {self.n} in batches of {self.batch}: resume with the same data and "
                            "per_device_train_batch_size.")
        if state.get("shuffle", True) != self.shuffle:   # (checkpoints before disable_shuffling: shuffled)
            raise DataError("the checkpoint read the examples "
                            f"{'shuffled' if state.get('shuffle', True) else 'in order'}"
                            f", this run would read them {'shuffled' if self.shuffle else 'in order'}: resume with "
                            f"disable_shuffling: {str(not state.get('shuffle', True)).lower()}.")
        self.seed, self.epoch, self.index = state["seed"], state["epoch"], state["index"]
        self._perm = self._permutation()
