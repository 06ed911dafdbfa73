"""The training config: LLaMA-Factory's key names where they exist, plus megatrain's own.

    megatrain train examples/quickstart.yaml learning_rate=1e-4 max_steps=20

A YAML file, then `key=value` overrides (values parsed as YAML: `1e-4`, `true`, `[a, b]`).
Every key is checked: an unknown key is an error naming the closest valid one, a wrong type or
an impossible value says what is expected. megatrain's compile options (`device`, `slots`,
`recompute`, `device_budget`, `hardware`, `routed_experts`, ...) are top-level keys too.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from ..options import Options
from ..runtime.adamw import OVERLAP_MODES
from ..vlm import VISION_MODES

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
STAGES = ("sft", "pt")
DTYPES = ("auto", "float32", "bfloat16", "float16")
REPORTS = ("none", "jsonl", "tensorboard")


@dataclass
class TrainConfig:
    # model
    model_name_or_path: str = ""            # HF id/folder, or "embedded:smollm2" (offline quickstart model)
    trust_remote_code: bool = False
    torch_dtype: str = "auto"               # auto: the checkpoint's dtype on CUDA, float32 on the CPU
    num_layers: int | None = None           # keep only the first N decoder layers (smoke runs)
    vision: str = "frozen"                  # a vision-language model's vision tower: frozen or train
    # data
    stage: str = "sft"                      # sft: chat/instruction data; pt: raw text, concatenated and chunked
    dataset: str = ""                       # comma-separated names from dataset_dir/dataset_info.json
    dataset_dir: str = "data"
    # a file_name outside dataset_dir (`../x.json`, an absolute path, a link that leads out) is refused
    # unless this is true (LLaMA-Factory joins the paths without checking)
    allow_outside_dataset_dir: bool = False
    media_dir: str | None = None            # where the images column's paths start (default: dataset_dir)
    image_max_pixels: int = 768 * 768       # larger images are scaled down to this many pixels
    image_min_pixels: int = 32 * 32         # smaller ones scaled up
    template: str | None = None             # None: the tokenizer's chat_template; or a built-in name
    cutoff_len: int = 1024
    max_samples: int | None = None
    packing: bool = False
    train_on_prompt: bool = False
    mask_history: bool = False
    default_system: str | None = None       # the system prompt of conversations without one (LLaMA-Factory)
    enable_thinking: bool = True            # reasoning templates (qwen3): False renders an empty think block
    tool_format: str | None = None          # tool-calling data: the tool format (None: the template's)
    mix_strategy: str = "concat"            # several data sets: concat | interleave_under | interleave_over
    interleave_probs: str | None = None     # comma-separated sampling probabilities for interleaving
    disable_shuffling: bool = False         # read the examples in order instead of a seeded permutation
    preprocessing_num_workers: int | None = None   # processes for tokenization (datasets.map)
    tokenized_path: str | None = None       # save the tokenized examples there, or load them if they exist
    overwrite_cache: bool = False           # tokenize again instead of reading the cache
    streaming: bool = False                 # stream a large stage: pt corpus instead of loading it
    # evaluation (no-grad loss through the compiled model; LLaMA-Factory / HF Trainer keys)
    do_eval: bool = False
    val_size: float = 0.0                   # a fraction in [0, 1) or a number of examples held out
    eval_dataset: str | None = None         # comma-separated names, instead of val_size
    eval_strategy: str = "no"               # no | steps | epoch
    eval_steps: float | None = None         # every N steps (a fraction < 1: of the run's steps); None: logging_steps
    per_device_eval_batch_size: int = 8
    # optimisation
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    num_train_epochs: float = 3.0
    max_steps: int = -1                     # > 0 overrides num_train_epochs
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0                   # > 0 overrides warmup_ratio
    seed: int = 42
    # a run whose loss or gradient norm is non-finite this many steps in a row stops (exit 4): it is
    # diverging, and skipping more steps would train nothing
    max_consecutive_skipped_steps: int = 10
    # AdamW on host threads: false | true/forward (under the next forward) | backward (each layer's
    # update starts during the backward, exact by rollback; runtime/adamw.py). None: backward on CUDA
    overlap_optimizer: bool | str | None = None
    # output
    output_dir: str = ""
    logging_steps: int = 10
    save_steps: int = 500
    save_total_limit: int | None = None
    resume_from_checkpoint: str | bool | None = None   # a checkpoint folder, or true: the latest in output_dir
    overwrite_output_dir: bool = False
    report_to: str = "jsonl"                # none | jsonl | tensorboard (the JSONL log is always written)
    # megatrain compile options (megacompile.options.Options), flattened
    megatrain: dict = field(default_factory=dict)

    # ------------------------------------------------------------------------------
    @property
    def datasets(self) -> list[str]:
        return [d.strip() for d in self.dataset.split(",") if d.strip()]

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)
        need(bool(self.model_name_or_path), "model_name_or_path is required (a Hugging Face id, a local folder, "
                                            "or embedded:smollm2 for the offline quickstart model).")
        need(bool(self.output_dir), "output_dir is required: where checkpoints, logs and the final model go.")
        need(bool(self.datasets), "dataset is required: comma-separated names registered in "
                                  f"{self.dataset_dir}/dataset_info.json.")
        need(self.stage in STAGES, f"stage={self.stage!r}: use one of {', '.join(STAGES)}.")
        need(self.torch_dtype in DTYPES, f"torch_dtype={self.torch_dtype!r}: use one of {', '.join(DTYPES)}.")
        need(self.lr_scheduler_type in SCHEDULERS,
             f"lr_scheduler_type={self.lr_scheduler_type!r}: use one of {', '.join(SCHEDULERS)}.")
        need(self.vision in VISION_MODES, f"vision={self.vision!r}: use one of {', '.join(VISION_MODES)}.")
        need(self.report_to in REPORTS, f"report_to={self.report_to!r}: use one of {', '.join(REPORTS)}.")
        need(self.overlap_optimizer is None or self.overlap_optimizer in OVERLAP_MODES,
             f"overlap_optimizer={self.overlap_optimizer!r}: use false, forward (true) or backward.")
        for f in dataclasses.fields(self):   # an inf or NaN hyper-parameter passes every comparison below
            value = getattr(self, f.name)
            need(not isinstance(value, float) or math.isfinite(value),
                 f"{f.name}={value}: must be a finite number.")
        need(self.cutoff_len >= 2, f"cutoff_len={self.cutoff_len}: needs at least 2 tokens.")
        for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps", "save_steps",
                    "max_consecutive_skipped_steps"):
            need(getattr(self, key) >= 1, f"{key}={getattr(self, key)}: must be at least 1.")
        need(self.num_layers is None or self.num_layers >= 1,
             f"num_layers={self.num_layers}: keep at least 1 decoder layer (or leave it unset for all of them).")
        need(self.learning_rate > 0, f"learning_rate={self.learning_rate}: must be positive.")
        need(self.weight_decay >= 0, f"weight_decay={self.weight_decay}: must be 0 or more.")
        need(self.adam_epsilon > 0, f"adam_epsilon={self.adam_epsilon}: must be positive (e.g. 1e-8).")
        need(self.max_grad_norm >= 0, f"max_grad_norm={self.max_grad_norm}: must be 0 (no clipping) or more.")
        need(0 <= self.warmup_ratio < 1, f"warmup_ratio={self.warmup_ratio}: must be in [0, 1).")
        need(self.warmup_steps >= 0, f"warmup_steps={self.warmup_steps}: must be 0 or more.")
        need(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "adam_beta1/adam_beta2 must be in [0, 1).")
        need(self.num_train_epochs >= 0, f"num_train_epochs={self.num_train_epochs}: must be 0 or more.")
        need(self.max_steps > 0 or self.num_train_epochs > 0, "set max_steps > 0 or num_train_epochs > 0.")
        need(self.max_samples is None or self.max_samples > 0, f"max_samples={self.max_samples}: must be positive.")
        for key in ("image_min_pixels", "image_max_pixels"):   # (max wins where they cross, as in LLaMA-Factory)
            need(getattr(self, key) >= 1, f"{key}={getattr(self, key)}: must be at least 1.")
        need(0 <= self.seed < 2**32, f"seed={self.seed}: must be in [0, 2**32) (NumPy takes no other seed).")
        need(self.save_total_limit is None or self.save_total_limit >= 1,
             f"save_total_limit={self.save_total_limit}: keep at least 1 checkpoint (or leave it unset).")
        # a bad compile option is an error now; whether the device exists is checked when training
        # starts (a config for a GPU run may be planned on a laptop)
        Options.from_mapping({k: v for k, v in self.megatrain.items() if k != "device"})
        device = str(self.megatrain.get("device", "cpu"))
        need(device == "cpu" or device.split(":")[0] == "cuda", f"device={device!r}: use cpu or cuda.")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(out.pop("megatrain"))
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig) if f.name != "megatrain"}
_OPTION_FIELDS = {f.name for f in dataclasses.fields(Options)}


def _check_type(key: str, value: Any) -> Any:
    hint = typing.get_type_hints(TrainConfig)[key]
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    if value is None and type(None) in allowed:
        return None
    if value is None:   # `key:` or `key=` with nothing after it
        raise ConfigError(f"{key} has no value: give one (e.g. {key}={_FIELDS[key].default!r}) or leave the key out.")
    if isinstance(value, str) and (float in allowed or int in allowed):
        try:  # YAML 1.1 reads `5e-5` (no dot) as a string
            number = float(value)
            value = int(number) if int in allowed and float not in allowed and number.is_integer() else number
        except ValueError:
            pass
    for t in allowed:
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t in (str, bool) and isinstance(value, t):
            return value
    names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise ConfigError(f"{key}={value!r} ({type(value).__name__}): expected {names}.")


def from_mapping(mapping: dict[str, Any]) -> TrainConfig:
    values, compile_options = {}, {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise ConfigError(f"config key {key!r} ({type(key).__name__}): keys are names such as learning_rate "
                              "(a YAML key like `1: x` or `true: x` is not one).")
        if key in _FIELDS:
            values[key] = _check_type(key, value)
        elif key in _OPTION_FIELDS:
            compile_options[key] = value
        else:
            close = difflib.get_close_matches(key, sorted(set(_FIELDS) | _OPTION_FIELDS), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {key!r}.{hint} See the README's training section for the keys.")
    config = TrainConfig(**values, megatrain=compile_options)
    config.validate()
    return config


def parse_overrides(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: write key=value (e.g. learning_rate=1e-4).")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({e}).") from None
    return out


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    mapping: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist.")
        try:
            mapping = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from None
        if not isinstance(mapping, dict):
            raise ConfigError(f"{path} must hold a mapping of keys to values, not {type(mapping).__name__}.")
    mapping.update(parse_overrides(list(overrides)))
    return from_mapping(mapping)
