"""Tokenization through `datasets.map`, cached on disk, read back as compact `Examples`.

    table, records = tokenized(config, tokenizer, template, images)   # records: {data set: records}
    examples, dropped = examples_of(table, config, tokenizer)   # (loader.py: the stage's processor)

Each selected data set is loaded (sources.py), sampled (`num_samples`, `max_samples`),
tokenized by `datasets.map` over `preprocessing_num_workers` processes (the per-record function
is `encode_batch`, module-level so the workers can unpickle it), and the sets are mixed
(`mix_strategy`). The result, an Arrow table of int32 token and label lists and a `drop` reason
per record, is saved under `<cache>/tokenized/<key>`, where the key digests everything that
decides the examples: the data files' contents (a hub set's datasets fingerprint), the registry
entries, the tokenizer (its vocabulary, merges, special tokens and chat template), the template,
the data options of the config (every key but the training-only ones listed below) and the
source of the encoding code. A later run with the same key reads the table instead of
tokenizing; `overwrite_cache: true` rebuilds it, reading the data files again. `<cache>` is
$MEGATRAIN_CACHE, else ~/.cache/megatrain. Entries are not evicted: delete the folder to
reclaim the space. The data files are hashed (SHA-256 of their bytes) at every start, never
trusted by size and mtime: `cp -p`, `rsync -t` and `tar x` keep both across an edit. Hashing
reads a file at disk speed, which is small next to tokenizing it. datasets' own cache of a
file's Arrow conversion does key on size and mtime, so a file whose digest changed since it was
last read (tokenized/file_digests.json) is converted again (download_mode="force_redownload").

`tokenized_path` works as in LLaMA-Factory: when it holds a tokenized set (ours, or one saved by
LLaMA-Factory: a DatasetDict whose "train" split has input_ids and labels), it is loaded and the
other data options are ignored (said in the log); otherwise the examples are built and saved
there. Image data (a VLM) is tokenized in this process and not cached: its token counts depend on
image files the key does not digest.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

from ...disk_cache import cache_root
from ...log import get as _get_logger
from .registry import DataError, DatasetAttr

_log = _get_logger("train")

FORMAT = "megatrain-tokenized-v1"
META = "megatrain_tokenized.json"
# config keys that do not change the examples (everything else is part of the cache key, so a key
# added later is safe by default)
TRAINING_ONLY = {
    "model_name_or_path", "trust_remote_code", "torch_dtype", "num_layers", "vision", "disable_shuffling",
    "preprocessing_num_workers", "preprocessing_batch_size", "tokenized_path", "overwrite_cache", "do_eval",
    "val_size", "eval_dataset", "eval_on_each_dataset",
    "eval_strategy", "eval_steps", "per_device_eval_batch_size", "per_device_train_batch_size",
    "gradient_accumulation_steps", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
    "max_grad_norm", "num_train_epochs", "max_steps", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_ratio",
    "warmup_steps",
    "max_consecutive_skipped_steps", "overlap_optimizer", "output_dir", "logging_steps", "save_steps",
    "save_total_limit", "resume_from_checkpoint", "overwrite_output_dir", "report_to", "megatrain", "buffer_size",
}
# the code that turns records into tokens: a change to it must not read stale examples
_CODE = ("loader.py", "packing.py", "processor/__init__.py", "processor/base.py", "processor/supervised.py",
         "processor/pretrain.py", "records.py", "split.py", "templates.py", "encode.py", "jinja_template.py",
         "tool_formats.py", "images.py", "registry.py", "sources.py", "tokenize_cache.py", "examples.py")


def features():
    import datasets
    ints = datasets.List(datasets.Value("int32"))
    return datasets.Features({"input_ids": ints, "labels": ints, "images": datasets.List(datasets.Value("string")),
                              "drop": datasets.Value("string")})


# the per-record function ------------------------------------------------------------
def encode_batch(batch: dict[str, list], indices: list[int] | None = None, attr: DatasetAttr = None, config=None,
                 tokenizer=None, template=None, images=None) -> dict:
    """Token and label lists of a batch of records (datasets.map, batched, with_indices), by the
    stage's processor (processor/). A record that gives no example keeps an empty row with its
    reason in `drop`, so mixing chooses the same records as LLaMA-Factory (it mixes before
    tokenizing) and the reasons can be counted: `reason` or `reason|where: why` (a skipped
    record, named by file and number)."""
    from .processor import processor_for
    return processor_for(config.stage).encode(batch, indices, attr, config, tokenizer, template, images)


# the cache key ----------------------------------------------------------------------
def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """The tokenizer's vocabulary, merges, normalisation, special tokens and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None
             else json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([type(tokenizer).__name__, tokenizer.all_special_tokens, tokenizer.bos_token_id,
                         tokenizer.eos_token_id, getattr(tokenizer, "chat_template", None),
                         getattr(tokenizer, "add_bos_token", None)], default=str).encode())
    return h.hexdigest()


def cache_key(config, tokenizer, template, sources: dict[str, str]) -> str:
    """The digest of everything that decides the examples (see the module docstring).
    `sources` maps each data set to its files' or hub set's digest."""
    from dataclasses import asdict

    from .registry import load_registry
    registry = load_registry(config.dataset_dir, config.datasets)
    here = Path(__file__).parent
    code = {name: _file_digest(here / name) for name in _CODE if (here / name).exists()}
    options = {k: v for k, v in config.to_dict().items() if k not in TRAINING_ONLY and k not in config.megatrain}
    if config.mix_strategy == "concat" and all(registry[n].num_samples is None for n in config.datasets):
        options.pop("seed", None)   # the seed chooses no records then
    # the template as its fields (a dataclass repr: no object addresses, so equal runs share a key)
    blob = json.dumps({"format": FORMAT, "code": code, "options": options, "template": repr(template),
                       "tokenizer": tokenizer_digest(tokenizer),
                       "sets": {n: [asdict(registry[n]), registry[n].load_from, sources[n]] for n in config.datasets}},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def source_digest(attr: DatasetAttr, config, raw=None) -> str:
    """A data set's contents: each file's SHA-256 of its bytes (and name), or a hub set's
    datasets fingerprint."""
    from .sources import data_files, data_path
    if attr.load_from == "file":
        path = data_path(attr, config.dataset_dir, config.allow_outside_dataset_dir)
        _, files = data_files(path)
        try:
            digests = [[Path(f).name, _file_digest(Path(f))] for f in files]
        except OSError as e:   # (a file that cannot be read: the user's to fix)
            raise DataError(f"data set {attr.name!r}: cannot read {e.filename or path} ({e.strerror or e}).") from None
        return hashlib.sha256(json.dumps(digests).encode()).hexdigest()
    return str(getattr(raw, "_fingerprint", None))


def _digest_book() -> Path:
    """{data path: the digest of its contents when it was last read}: a change means that
    datasets' Arrow conversion of it (keyed on size and mtime) may be stale."""
    return cache_root() / "tokenized" / "file_digests.json"


def _known_digests() -> dict:
    try:
        known = json.loads(_digest_book().read_text())
        return known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        return {}


def _stale_conversions(config, attrs: dict[str, DatasetAttr], digests: dict[str, str]) -> set[str]:
    """The file data sets whose contents changed since they were last read (or all of them,
    with overwrite_cache): datasets must convert them again rather than reuse its cache."""
    from .sources import data_path
    known, stale = _known_digests(), set()
    for name, digest in digests.items():
        attr = attrs[name]
        if attr.load_from != "file":
            continue
        where = str(data_path(attr, config.dataset_dir, config.allow_outside_dataset_dir))
        if config.overwrite_cache or known.get(where) != digest:
            stale.add(name)
        known[where] = digest
    _remember_digests(known)
    return stale


def _remember_digests(known: dict) -> None:
    """Writes the book in one rename; a run that cannot write it just hashes again next time."""
    book = _digest_book()
    try:
        book.parent.mkdir(parents=True, exist_ok=True)
        tmp = book.with_name(f".{book.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, book)
    except OSError:
        pass


# build / load -----------------------------------------------------------------------
def has_data(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())   # LLaMA-Factory's has_tokenized_data


def tokenized(config, tokenizer, template, images=None, say=None):
    """The mixed, tokenized table of the configured data sets and {data set: records}, from the
    cache or tokenized_path when they hold it, else built (and saved there)."""
    say = say or _log.info
    import datasets
    datasets.disable_progress_bars()
    if config.tokenized_path and has_data(Path(config.tokenized_path)):
        return _load_tokenized_path(Path(config.tokenized_path), say)
    raws, digests, attrs = {}, {}, {name: _attr(config, name) for name in config.datasets}
    for name, attr in attrs.items():
        raws[name] = None if attr.load_from == "file" else _load(attr, config)
        digests[name] = source_digest(attr, config, raws[name])
    fresh = _stale_conversions(config, attrs, digests)
    key = cache_key(config, tokenizer, template, digests)
    entry = cache_root() / "tokenized" / key
    target = Path(config.tokenized_path) if config.tokenized_path else None
    tmp = entry.parent / f".tmp-{key}-{os.getpid()}"
    try:
        loaded = None if config.overwrite_cache or images is not None else _cached(entry, say)
        if loaded is None:
            try:
                _build(config, tokenizer, template, images, raws, tmp, key, say, fresh)
                if images is None:   # image data: see the module docstring
                    _publish(tmp, entry)
                else:
                    loaded = _load_entry(tmp, in_memory=True)
                    if target is not None:
                        _copy_into(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        if images is None:
            loaded = loaded or _load_entry(entry)
            if target is not None:
                _copy_into(entry, target)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise
        raise DataError(f"could not write the tokenized data to {e.filename or entry.parent} ({e.strerror}): free "
                        "space there, or set MEGATRAIN_CACHE (the cache) or tokenized_path to a writable folder with "
                        "room.") from None
    if target is not None:
        say(f"[megatrain] tokenized data saved to {target}: runs with tokenized_path: {target} read it back.")
    return loaded


def _cached(entry: Path, say):
    """The cache entry's (table, records), or None when there is none or it cannot be read
    (then it is removed, and rebuilt by the caller)."""
    if not (entry / META).is_file():
        return None
    try:
        return _load_entry(entry)
    except Exception as e:  # a damaged entry (files deleted or truncated) is a miss, not an error
        say(f"[megatrain] the tokenized cache {entry} cannot be read ({type(e).__name__}); tokenizing again.")
        shutil.rmtree(entry, ignore_errors=True)
        return None


def _copy_into(src: Path, target: Path) -> None:
    if target.is_dir():
        target.rmdir()   # empty: one with data was loaded instead
    shutil.copytree(src, target)


def _attr(config, name) -> DatasetAttr:
    from .registry import load_registry
    return load_registry(config.dataset_dir, [name])[name]


def _load(attr: DatasetAttr, config, fresh: bool = False):
    from .sources import load_source
    return load_source(attr, config.dataset_dir, config.allow_outside_dataset_dir, config.preprocessing_num_workers,
                       fresh=fresh)


def _say_unmapped(raw, attr: DatasetAttr, say) -> None:
    """Says which of a data set's system/history/tools columns are not read because
    dataset_info.json does not map them (LLaMA-Factory reads them only when mapped too)."""
    from .records import UNMAPPED_IGNORED
    if attr.formatting not in ("alpaca", "sharegpt"):
        return
    unread = [c for c in UNMAPPED_IGNORED if c in raw.column_names and c not in attr.columns]
    if unread:
        say(f"[megatrain] data set {attr.name!r}: column{'s' if len(unread) > 1 else ''} "
            f"{', '.join(map(repr, unread))} not read (as in LLaMA-Factory, only columns mapped in dataset_info.json "
            f"are): set columns: {{{', '.join(f'{c}: {c}' for c in unread)}}} there to use them.")


#: records a tokenization process must have to be worth starting (a forked process costs about
#: as much as tokenizing this many chat records in this one)
RECORDS_PER_PROCESS = 2000


def _processes(workers: int | None, records: int) -> int | None:
    """datasets.map's num_proc for `records` records with preprocessing_num_workers `workers`:
    at most one process per RECORDS_PER_PROCESS records and per CPU this process may use, None
    (this process) below two. The result does not depend on it: each record is tokenized on its
    own, and packing recomputes LLaMA-Factory's shards from `workers` itself (packing.py). Fewer
    forks also mean fewer chances to fork a process that already runs threads (a second run in
    one process forked 12 workers for LLaMA-Factory's 12-record mllm_demo with workers: 16, and
    hung in one of them)."""
    if not workers or workers < 2:
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = min(workers, cpus, records // RECORDS_PER_PROCESS)
    return n if n >= 2 else None


def _build(config, tokenizer, template, images, raws, tmp: Path, key: str, say=None, fresh=frozenset()) -> None:
    """Loads, samples, tokenizes and mixes the data sets into `tmp` (see _save)."""
    say = say or _log.info
    import numpy as np

    from .sources import mix, parse_probs, select_records
    tmp.mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(config.seed)   # LLaMA-Factory: transformers.set_seed, then the loads in order
    parts, records = [], {}
    workers = config.preprocessing_num_workers if images is None else None   # see the module docstring
    for k, name in enumerate(config.datasets):
        attr = _attr(config, name)
        raw = raws[name] if raws.get(name) is not None else _load(attr, config, name in fresh)
        _say_unmapped(raw, attr, say)
        raw = select_records(raw, attr, config.max_samples, rng)
        records[name] = len(raw)
        part = raw.map(encode_batch, batched=True, with_indices=True, remove_columns=raw.column_names,
                       features=features(),
                       fn_kwargs=dict(attr=attr, config=config, tokenizer=tokenizer, template=template, images=images),
                       num_proc=_processes(workers, len(raw)),
                       new_fingerprint=f"{key}-{k}", cache_file_name=str(tmp / f"part-{k}.arrow"),
                       load_from_cache_file=False)
        parts.append(part)
    probs = parse_probs(config.interleave_probs, len(parts), config.mix_strategy)
    table = mix(parts, config.mix_strategy, probs, config.seed)
    _save(table, records, key, tmp)


def _save(table, records: dict, key: str, folder: Path) -> None:
    """`folder`/data (the Arrow table) and `folder`/megatrain_tokenized.json (what it was made from)."""
    table.save_to_disk(str(folder / "data"))
    (folder / META).write_text(json.dumps({"format": FORMAT, "key": key, "records": records}))


def _publish(tmp: Path, entry: Path) -> None:
    """Moves a built entry into place in one rename, replacing an old one (overwrite_cache); a
    concurrent run that made the same entry first is fine: it holds the same data."""
    for part in tmp.glob("part-*.arrow"):
        part.unlink()
    if (entry / META).is_file():
        shutil.rmtree(entry)
    try:
        os.rename(tmp, entry)
    except OSError:
        if not (entry / META).is_file():
            raise


def _load_entry(entry: Path, in_memory: bool = False):
    import datasets
    meta = json.loads((entry / META).read_text())
    return datasets.load_from_disk(str(entry / "data"), keep_in_memory=in_memory), meta["records"]


def _load_tokenized_path(path: Path, say):
    """A tokenized set saved by megatrain or by LLaMA-Factory, read as LLaMA-Factory does: as is."""
    import datasets
    if (path / META).is_file():
        table, records = _load_entry(path)
    else:
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as e:
            raise DataError(f"tokenized_path {path} holds files but no tokenized data set ({type(e).__name__}): "
                            "point it at an empty or new folder to save one there.") from None
        table = loaded["train"] if isinstance(loaded, datasets.DatasetDict) and "train" in loaded else loaded
        if isinstance(table, datasets.DatasetDict) or not {"input_ids", "labels"} <= set(table.column_names):
            raise DataError(f"tokenized_path {path} is not a tokenized training set (it needs a train split with "
                            "input_ids and labels columns).")
        records = {}
    say(f"[megatrain] reading tokenized data from tokenized_path {path}: the other data options (dataset, template, "
        "cutoff_len, ...) are ignored, as in LLaMA-Factory. Empty the folder to tokenize again.")
    return table, records


def skipped(table, limit: int = 3) -> list[str]:
    """The first `limit` skipped records of a tokenized table, each "file record N: why"."""
    found = []
    if "drop" in table.column_names:
        for d in table.data.column("drop").to_pylist():
            if d and "|" in d:
                found.append(d.split("|", 1)[1])
                if len(found) == limit:
                    break
    return found
