"""The data set registry: `dataset_dir/dataset_info.json`, read the way LLaMA-Factory reads it.

Every key of LLaMA-Factory's own registry is known (its data/dataset_info.json loads unchanged),
and only the data sets a run selects are checked, so a malformed or unusable entry that is not
selected is ignored, as in LLaMA-Factory:

    {"alpaca_en": {"hf_hub_url": "llamafactory/alpaca_en", "ms_hub_url": "llamafactory/alpaca_en"},
     "wiki_demo": {"file_name": "wiki_demo.txt", "columns": {"prompt": "text"}},
     "dpo_demo":  {"file_name": "dpo.json", "ranking": true, ...}}      # refused only when selected

Where an entry comes from follows LLaMA-Factory: a Hub URL first (ModelScope's when
USE_MODELSCOPE_HUB is set or there is no hf_hub_url, OpenMind's likewise with USE_OPENMIND_HUB,
else the Hugging Face Hub), then script_url, cloud_file_name, and file_name last.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import MegatrainError

SOURCE_KEYS = ("file_name", "hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
ATTR_KEYS = set(SOURCE_KEYS) | {"formatting", "ranking", "subset", "split", "folder", "num_samples", "columns",
                                "tags"}
COLUMN_NAMES = ("prompt", "query", "response", "history", "messages", "system", "tools", "images", "videos",
                "audios", "chosen", "rejected", "kto_tag")
TAG_NAMES = ("role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag", "function_tag", "system_tag")
FORMATTINGS = ("alpaca", "sharegpt")
_TYPES = {**{k: str for k in SOURCE_KEYS}, "formatting": str, "ranking": bool, "subset": str, "split": str,
          "folder": str, "num_samples": int, "columns": dict, "tags": dict}


class DataError(MegatrainError, ValueError):
    """A data set is missing, malformed or does not fit the chosen format."""


def env_enabled(name: str) -> bool:
    """LLaMA-Factory's reading of a switch such as USE_MODELSCOPE_HUB: true, y or 1."""
    return os.environ.get(name, "0").lower() in ("true", "y", "1")


@dataclass
class DatasetAttr:
    name: str
    file_name: str | None = None
    hf_hub_url: str | None = None
    ms_hub_url: str | None = None
    om_hub_url: str | None = None
    script_url: str | None = None
    cloud_file_name: str | None = None
    formatting: str = "alpaca"
    ranking: bool = False
    columns: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)
    split: str = "train"
    num_samples: int | None = None
    subset: str | None = None
    folder: str | None = None

    @property
    def load_from(self) -> str:
        """file, hf_hub, ms_hub, om_hub, script or cloud_file, chosen as LLaMA-Factory's parser does."""
        if self.ms_hub_url and (env_enabled("USE_MODELSCOPE_HUB") or not self.hf_hub_url):
            return "ms_hub"
        if self.om_hub_url and (env_enabled("USE_OPENMIND_HUB") or not self.hf_hub_url):
            return "om_hub"
        if self.hf_hub_url:
            return "hf_hub"
        if self.script_url:
            return "script"
        if self.cloud_file_name:
            return "cloud_file"
        return "file"

    @property
    def hub_id(self) -> str | None:
        """The repository id on the hub this entry is read from (None for a file)."""
        return {"hf_hub": self.hf_hub_url, "ms_hub": self.ms_hub_url, "om_hub": self.om_hub_url}.get(self.load_from)


class Registry(Mapping):
    """The entries of one dataset_info.json by name; an entry is checked when it is looked up."""

    def __init__(self, path: Path, raw: dict):
        self.path, self._raw = path, raw

    def __getitem__(self, name: str) -> DatasetAttr:
        if name not in self._raw:
            raise KeyError(name)
        return _attr(self.path, name, self._raw[name])

    def __iter__(self):
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


def load_registry(dataset_dir: str | Path, names: Iterable[str] | None = None) -> Registry:
    """The registry of `dataset_dir`. The entries in `names` (all of them when None) are checked
    now: a DataError names the first bad one; the others are checked only if looked up."""
    if str(dataset_dir).startswith("REMOTE:"):   # (LLaMA-Factory reads the registry from a Hub repo)
        repo = str(dataset_dir)[len("REMOTE:"):]
        raise DataError(f"dataset_dir: {dataset_dir} (LLaMA-Factory's registry in the Hub repo {repo}) is not "
                        f"supported: download the repo (huggingface-cli download --repo-type dataset {repo} "
                        "--local-dir DIR) and set dataset_dir: DIR.")
    path = Path(dataset_dir) / "dataset_info.json"
    if not path.is_file():
        raise DataError(f"{path} does not exist: dataset_dir must hold a dataset_info.json registry "
                        "(see examples/data/dataset_info.json).")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path} holds a JSON {type(raw).__name__}: it must be one object of data set entries, "
                        '{"name": {"file_name": "data.json"}, ...}.')
    registry = Registry(path, raw)
    for name in raw if names is None else names:
        if name not in raw:
            raise DataError(f"data set {name!r} is not in {path} (registered: {', '.join(sorted(raw)) or 'none'}).")
        registry[name]   # checks it
    return registry


def _attr(path: Path, name: str, spec) -> DatasetAttr:
    """One entry, checked: known keys of the right types, a source, and usable by sft/pt."""
    where = f"{path}: entry {name!r}"
    if not isinstance(spec, dict):
        raise DataError(f"{where} must be an object with file_name or hf_hub_url.")
    unknown = set(spec) - ATTR_KEYS
    if unknown:
        raise DataError(f"{where} has unknown keys {sorted(unknown)}; valid: {sorted(ATTR_KEYS)}.")
    for key, kind in _TYPES.items():
        value = spec.get(key)
        if value is not None and not (isinstance(value, kind) and (kind is bool or not isinstance(value, bool))):
            raise DataError(f"{where} has {key}={value!r} ({type(value).__name__}); expected "
                            f"{'an object' if kind is dict else 'true or false' if kind is bool else kind.__name__}.")
    for key, valid in (("columns", COLUMN_NAMES), ("tags", TAG_NAMES)):
        entries = spec.get(key) or {}
        bad = {k: v for k, v in entries.items() if not isinstance(v, str)}
        if bad:
            raise DataError(f"{where}: {key} must map names to column/tag strings, not {bad!r}.")
        wrong = sorted(set(entries) - set(valid))
        if wrong:   # LLaMA-Factory ignores them: a typo would silently read the default column
            raise DataError(f"{where}: {key} has unknown names {wrong}; valid: {', '.join(valid)}.")
    if not any(spec.get(k) for k in SOURCE_KEYS):
        raise DataError(f"{where} names no data: give it a file_name (a file or folder in dataset_dir) or an "
                        "hf_hub_url.")
    if spec.get("num_samples") is not None and spec["num_samples"] < 1:
        raise DataError(f"{where} has num_samples={spec['num_samples']}; it must be at least 1.")
    if spec.get("formatting", "alpaca") not in FORMATTINGS:
        raise DataError(f"{where} has formatting={spec['formatting']!r}; use alpaca or sharegpt (an OpenAI-style "
                        "messages list is sharegpt with tags role_tag: role, content_tag: content, user_tag: user, "
                        "assistant_tag: assistant, system_tag: system).")
    if spec.get("ranking"):
        raise DataError(f"{where} is preference data (ranking: true, chosen/rejected replies) for LLaMA-Factory's "
                        "stage dpo or rm, which megatrain does not train: select an sft or pt data set.")
    media = [k for k in ("videos", "audios") if (spec.get("columns") or {}).get(k)]
    if media:
        raise DataError(f"{where} maps {' and '.join(media)} columns: megatrain trains text and image models only. "
                        f"Remove columns.{media[0]} (the records' {media[0]} would be dropped) or select another "
                        "data set.")
    return DatasetAttr(name, **spec)
