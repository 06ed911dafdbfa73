"""Loading the registered data sets as LLaMA-Factory does: files or hubs, `num_samples`,
`max_samples`, and mixing several sets (`mix_strategy`, `interleave_probs`).

    raw = load_source(attr, config)               # a datasets.Dataset of the entry's records
    raw = sample(raw, attr.num_samples, rng)      # LF's permutation (+ oversampling), LF's seed
    raw = raw.select(range(min(max_samples, n)))  # per data set, after sampling, as LF
    mixed = mix([tokenized_a, tokenized_b], ...)  # concat / interleave_under / _over / _once

The sampling draws from one `numpy.random.RandomState(seed)` shared by the data sets in their
configured order: LLaMA-Factory seeds NumPy's global generator with `seed` (transformers.set_seed)
before it loads the data sets one after the other, so the same records are chosen.
"""
from __future__ import annotations

import errno

import os
import socket
from pathlib import Path

import numpy as np

from .registry import DataError, DatasetAttr, env_enabled

# LLaMA-Factory's FILEEXT2TYPE: `.txt` is one text per line (datasets' "text" builder, column "text")
FILE_TYPES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow",
              ".txt": "text"}
# datasets' stopping strategies, as LLaMA-Factory 0.9.5 maps them (interleave_once needs datasets >= 4.1:
# every record of every set exactly once, in a seeded interleaving)
MIX_STRATEGIES = {"interleave_under": "first_exhausted", "interleave_over": "all_exhausted",
                  "interleave_once": "all_exhausted_without_replacement"}


def data_files(path: Path) -> tuple[str, list[str]]:
    """The `datasets` builder and the files of a data set's file or folder (one file type)."""
    files = sorted(p for p in path.iterdir() if p.suffix in FILE_TYPES) if path.is_dir() else [path]
    if not files:
        raise DataError(f"{path} holds no {', '.join(FILE_TYPES)} files.")
    kinds = {FILE_TYPES.get(p.suffix) for p in files}
    if None in kinds:
        raise DataError(f"{path}: unsupported file type; use one of {', '.join(FILE_TYPES)}.")
    if len(kinds) > 1:
        raise DataError(f"{path} mixes file types {sorted(kinds)}; keep one type per data set.")
    return kinds.pop(), [str(p) for p in files]


def data_path(attr: DatasetAttr, dataset_dir: str | Path, allow_outside: bool = False) -> Path:
    """The resolved file or folder of a registered data set. A `file_name` that leads out of
    `dataset_dir` (`../x.json`, an absolute path, a link) is refused unless `allow_outside`: a
    registry copied from elsewhere must not make the trainer read (and print) any file."""
    base = Path(dataset_dir).resolve()
    try:
        path = (base / attr.file_name).resolve()
        if path.is_symlink():   # (resolve leaves a link it cannot follow: a loop or one to nowhere)
            path.stat()
    except FileNotFoundError:   # a link to nowhere: "does not exist" below
        pass
    except (RuntimeError, OSError) as e:   # a symlink loop (RuntimeError before Python 3.13), a bad mount
        if isinstance(e, OSError) and e.errno not in (errno.ELOOP, errno.EACCES, errno.EIO, errno.ENAMETOOLONG):
            raise
        why = "a symbolic link that leads back to itself" if isinstance(e, RuntimeError) or e.errno == errno.ELOOP \
            else (e.strerror or str(e))
        raise DataError(f"data set {attr.name!r}: {base / attr.file_name} cannot be opened ({why}). Point file_name "
                        f"in {base / 'dataset_info.json'} at the data file itself.") from None
    if not allow_outside and not path.is_relative_to(base):
        raise DataError(f"data set {attr.name!r}: file_name {attr.file_name!r} resolves to {path}, outside dataset_dir "
                        f"{base}. Move the file into dataset_dir, or set allow_outside_dataset_dir: true to read it.")
    if not path.exists():
        raise DataError(f"data set {attr.name!r}: {path} does not exist (file_name {attr.file_name!r} in "
                        f"{base / 'dataset_info.json'}).")
    return path


def check_source(attr: DatasetAttr, dataset_dir: str | Path, allow_outside: bool = False) -> str:
    """Where a selected data set is read from (a path or hub://id), checked without loading it:
    a file inside dataset_dir, or a hub this machine can use."""
    kind = attr.load_from
    if kind == "file":
        return str(data_path(attr, dataset_dir, allow_outside))
    if kind == "script":
        raise DataError(f"data set {attr.name!r}: script_url {attr.script_url!r} is a dataset loading script; "
                        "datasets 4 and later no longer run them (and a registry should not make the trainer run "
                        "code). Convert the data to json/jsonl/parquet and register it with file_name.")
    if kind == "cloud_file":
        raise DataError(f"data set {attr.name!r}: cloud_file_name {attr.cloud_file_name!r} (s3:// or gs://) needs "
                        "cloud credentials and the network; download the file into dataset_dir and register it with "
                        "file_name.")
    if kind in ("ms_hub", "om_hub"):
        hub, package, switch, host = (("ModelScope", "modelscope", "USE_MODELSCOPE_HUB", "www.modelscope.cn")
                                      if kind == "ms_hub" else ("OpenMind", "openmind", "USE_OPENMIND_HUB",
                                                                "modelers.cn"))
        why = f"{switch} is set" if env_enabled(switch) else "the entry has no hf_hub_url"
        import importlib.util
        if importlib.util.find_spec(package) is None or not _resolves(host):
            missing = (f"the {package} package is not installed" if importlib.util.find_spec(package) is None
                       else f"{host} cannot be reached (offline)")
            raise DataError(f"data set {attr.name!r} is read from {hub} ({attr.hub_id!r}, because {why}), but "
                            f"{missing}. "
                            + (f"Unset {switch} to read its hf_hub_url, or d" if attr.hf_hub_url and
                               env_enabled(switch) else "D")
                            + "ownload the data and register it with file_name.")
        return f"{package}://{attr.hub_id}"
    if not hub_reachable():
        raise DataError(f"data set {attr.name!r}: {attr.hf_hub_url!r} is on the Hugging Face Hub, which this "
                        "machine cannot reach (offline). Download it elsewhere and register it with file_name "
                        "instead, or set HF_HUB_OFFLINE=1 to read it from the local datasets cache.")
    return f"hf://{attr.hf_hub_url}"


def load_source(attr: DatasetAttr, dataset_dir: str | Path, allow_outside: bool = False, num_proc: int | None = None,
                fresh: bool = False):
    """The raw records of a registered data set, as a datasets.Dataset (Arrow, memory-mapped).
    `fresh`: convert a data file again instead of reusing datasets' cache of it (which trusts a
    file's size and mtime: an edit that keeps both would read the old records)."""
    import datasets
    datasets.disable_progress_bars()
    check_source(attr, dataset_dir, allow_outside)
    kind = attr.load_from
    if kind == "file":
        path = data_path(attr, dataset_dir, allow_outside)
        builder, files = data_files(path)
        if all(Path(f).stat().st_size == 0 for f in files):
            raise DataError(f"data set {attr.name!r}: {path} is empty. Put records in it ({builder}) or remove "
                            f"{attr.name!r} from dataset.")
        try:
            ds = datasets.load_dataset(builder, data_files=files, split="train",
                                       download_mode="force_redownload" if fresh else None)
        except Exception as e:  # datasets wraps parser errors in several exception types
            cause = e.__cause__ or e
            if isinstance(cause, StopIteration) or "corresponds to no data" in str(cause):
                raise DataError(f"data set {attr.name!r}: {path} holds no records. Put records in it or remove "
                                f"{attr.name!r} from dataset.") from None
            raise DataError(f"data set {attr.name!r}: could not read {path} as {builder} "
                            f"({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}). "
                            "Check that the file is complete and in that format.") from None
    else:
        try:
            if kind == "ms_hub":   # as LLaMA-Factory: MsDataset, converted to a datasets.Dataset
                from modelscope import MsDataset
                ds = MsDataset.load(dataset_name=attr.hub_id, subset_name=attr.subset, data_dir=attr.folder,
                                    split=attr.split)
                ds = ds.to_hf_dataset() if isinstance(ds, MsDataset) else ds
            elif kind == "om_hub":
                from openmind import OmDataset
                ds = OmDataset.load_dataset(path=attr.hub_id, name=attr.subset, data_dir=attr.folder,
                                            split=attr.split)
            else:
                ds = datasets.load_dataset(attr.hf_hub_url, attr.subset, data_dir=attr.folder, split=attr.split,
                                           num_proc=num_proc)
        except Exception as e:
            raise DataError(f"data set {attr.name!r}: could not load {attr.hub_id!r} from the hub "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Offline, download "
                            "it elsewhere and register it with file_name instead.") from None
    if len(ds) == 0:
        raise DataError(f"data set {attr.name!r} holds no records.")
    return ds


def sample_indices(n: int, num_samples: int, rng: np.random.RandomState) -> np.ndarray:
    """LLaMA-Factory's `num_samples`: a random permutation cut to num_samples; when it asks for
    more than there are, every record once plus random picks (with replacement) for the rest."""
    indexes = rng.permutation(n)[:num_samples]
    if num_samples > len(indexes):
        indexes = np.concatenate((indexes, rng.choice(n, num_samples - len(indexes))), axis=0)
    return indexes


def select_records(ds, attr: DatasetAttr, max_samples: int | None, rng: np.random.RandomState):
    """`num_samples` (sampled with `rng`), then `max_samples` (the first ones), as LLaMA-Factory."""
    if attr.num_samples is not None:
        ds = ds.select(sample_indices(len(ds), attr.num_samples, rng))
    if max_samples is not None:
        ds = ds.select(range(min(max_samples, len(ds))))
    return ds


def parse_probs(text: str | None, count: int, strategy: str) -> list[float] | None:
    """`interleave_probs` ("0.7,0.3") checked: one per data set, non-negative, summing to 1."""
    if text is None:
        return None
    if strategy not in MIX_STRATEGIES:
        raise DataError(f"interleave_probs={text!r} is only used with mix_strategy interleave_under, "
                        f"interleave_over or interleave_once (mix_strategy is {strategy!r}).")
    try:
        probs = [float(p) for p in str(text).split(",")]
    except ValueError:
        raise DataError(f"interleave_probs={text!r}: write comma-separated numbers, e.g. 0.7,0.3.") from None
    if len(probs) != count:
        raise DataError(f"interleave_probs has {len(probs)} values for {count} data sets: give one per data set.")
    if any(not np.isfinite(p) or p < 0 for p in probs) or abs(sum(probs) - 1) > 1e-6:
        raise DataError(f"interleave_probs={text!r}: the probabilities must be non-negative and sum to 1.")
    return probs


def mix(parts: list, strategy: str, probs: list[float] | None, seed: int):
    """LLaMA-Factory's merge_dataset: one part as is; concat; or interleave with `seed`, stopping
    when the first set is exhausted (interleave_under) or when all are, repeating the shorter
    ones (interleave_over), or each record of every set exactly once (interleave_once)."""
    import datasets
    if len(parts) == 1:
        return parts[0]
    if strategy == "concat":
        return datasets.concatenate_datasets(parts)
    if strategy not in MIX_STRATEGIES:
        raise DataError(f"mix_strategy={strategy!r}: use concat, {', '.join(MIX_STRATEGIES)}.")
    return datasets.interleave_datasets(parts, probabilities=probs, seed=seed,
                                        stopping_strategy=MIX_STRATEGIES[strategy])


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False


def hub_reachable() -> bool:
    """False when the Hub's name does not resolve (offline): datasets would retry for ~25 s first."""
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return True   # datasets reads its cache
    return _resolves(os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("//")[-1].split("/")[0])
