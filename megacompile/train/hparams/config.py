"""The training config: LLaMA-Factory's key names where they exist, plus megatrain's own.

    megatrain train examples/quickstart.yaml learning_rate=1e-4 max_steps=20

A YAML file, then `key=value` overrides (values parsed as YAML: `1e-4`, `true`, `[a, b]`).
Every key is checked: the unknown keys of a config are one error (each with the valid key it
most likely meant, if any), a wrong type or an impossible value says what is expected.
LLaMA-Factory's keys that megatrain has no field for are mapped, noted or refused (lf_keys.py).
megatrain's compile options (`device`, `slots`, `recompute`, `device_budget`, `hardware`,
`routed_experts`, ...) are top-level keys too.
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

from ...errors import ConfigError
from ...options import Options
from ...runtime.adamw import OVERLAP_MODES
from ...vlm import VISION_MODES
from . import finetuning_args as finetuning
from . import lf_keys
from . import schedule
from .tier_keys import check_tier_keys

#: the trackers `report_to` can name besides the JSONL log (report.py opens them)
TRACKERS = ("tensorboard", "wandb")
REPORTS = ("none", "jsonl", "all") + TRACKERS

STAGES = ("sft", "pt")
DTYPES = ("auto", "float32", "bfloat16", "float16")
MIX_STRATEGIES = ("concat", "interleave_under", "interleave_over", "interleave_once")
EVAL_STRATEGIES = ("no", "steps", "epoch")
#: keys someone means when they write these (a close spelling is found by difflib)
SYNONYMS = {"lr": "learning_rate", "batch_size": "per_device_train_batch_size",
            "train_batch_size": "per_device_train_batch_size", "micro_batch_size": "per_device_train_batch_size",
            "epochs": "num_train_epochs", "num_epochs": "num_train_epochs", "model": "model_name_or_path",
            "model_path": "model_name_or_path", "model_name": "model_name_or_path", "max_length": "cutoff_len",
            "max_seq_length": "cutoff_len", "max_seq_len": "cutoff_len", "seq_len": "cutoff_len",
            "sequence_len": "cutoff_len", "dtype": "torch_dtype", "precision": "torch_dtype",
            "data": "dataset", "datasets": "dataset", "warmup": "warmup_ratio", "scheduler": "lr_scheduler_type",
            "lr_scheduler": "lr_scheduler_type", "grad_accum": "gradient_accumulation_steps",
            "gradient_accumulation": "gradient_accumulation_steps", "clip_grad_norm": "max_grad_norm",
            "grad_clip": "max_grad_norm", "output": "output_dir", "out_dir": "output_dir", "steps": "max_steps",
            "num_steps": "max_steps", "train_steps": "max_steps", "save_every": "save_steps",
            "log_every": "logging_steps", "resume": "resume_from_checkpoint", "chat_template": "template",
            "system": "default_system", "system_prompt": "default_system", "shuffle": "disable_shuffling"}


def _key(group: str, default: Any, help: str) -> Any:
    """A config key: its default, its group in `megatrain train --help` and its one-line help."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"group": group, "help": help})
    return field(default=default, metadata={"group": group, "help": help})


GROUPS = ("model", "data", "training", "evaluation", "output")


@dataclass
class TrainConfig:
    # model
    model_name_or_path: str = _key("model", "", "a Hugging Face id or folder, or embedded:smollm2 (offline "
                                                "quickstart model)")
    trust_remote_code: bool = _key("model", False, "allow the model's own Python code (Hub models with auto_map)")
    torch_dtype: str = _key("model", "auto", "compute dtype: auto (the checkpoint's on CUDA, float32 on the CPU), "
                                             "float32, bfloat16 or float16")
    num_layers: int | None = _key("model", None, "keep only the first N decoder layers (smoke runs)")
    vision: str = _key("model", "frozen", "a vision-language model's vision tower: frozen or train")
    # data
    stage: str = _key("data", "sft", "sft: chat/instruction data; pt: raw text, concatenated and chunked")
    dataset: str = _key("data", "", "comma-separated names from dataset_dir/dataset_info.json")
    dataset_dir: str = _key("data", "data", "the folder of dataset_info.json and the data files")
    # (LLaMA-Factory joins the paths without checking)
    allow_outside_dataset_dir: bool = _key("data", False, "allow a file_name outside dataset_dir (../x.json, an "
                                                          "absolute path, a link that leads out)")
    media_dir: str | None = _key("data", None, "where the images column's paths start (default: dataset_dir)")
    image_max_pixels: int = _key("data", 768 * 768, "larger images are scaled down to this many pixels")
    image_min_pixels: int = _key("data", 32 * 32, "smaller images are scaled up to this many pixels")
    template: str | None = _key("data", None, "chat template: a built-in name, or none for the tokenizer's "
                                              "chat_template")
    cutoff_len: int = _key("data", 1024, "tokens per example; longer ones are cut")
    max_samples: int | None = _key("data", None, "use at most this many samples of each data set")
    packing: bool | None = _key("data", None, "pack samples into cutoff_len sequences (sft: positions restart per "
                                              "sample, no attention across samples; pt: text cut into blocks); "
                                              "none: true for stage pt, false for sft (LLaMA-Factory's default)")
    train_on_prompt: bool = _key("data", False, "train on the prompts too, not only on the replies")
    mask_history: bool = _key("data", False, "train only on the last reply of a conversation")
    default_system: str | None = _key("data", None, "the system prompt of conversations without one")
    enable_thinking: bool = _key("data", True, "reasoning templates (qwen3): false renders an empty think block")
    preserve_thinking: bool = _key("data", False, "reasoning templates with mask_history: keep the earlier replies' "
                                                  "thoughts instead of removing them")
    tool_format: str | None = _key("data", None, "tool-calling data: the tool format (none: the template's)")
    mix_strategy: str = _key("data", "concat", "several data sets: concat, interleave_under, interleave_over or "
                                                    "interleave_once")
    interleave_probs: str | None = _key("data", None, "comma-separated sampling probabilities for interleaving")
    disable_shuffling: bool = _key("data", False, "read the examples in order instead of a seeded permutation")
    preprocessing_num_workers: int | None = _key("data", None, "processes for tokenization")
    preprocessing_batch_size: int = _key("data", 1000, "records per tokenization batch: packing (and stage pt's "
                                                       "blocks) stay within one, as LLaMA-Factory packs")
    tokenized_path: str | None = _key("data", None, "save the tokenized examples there, or load them if they exist")
    overwrite_cache: bool = _key("data", False, "tokenize again instead of reading the cache")
    streaming: bool = _key("data", False, "read the data sets while training instead of tokenizing them first "
                                          "(a corpus larger than RAM; needs max_steps)")
    buffer_size: int = _key("data", 16384, "streaming: examples in the shuffle buffer")
    # evaluation (no-grad loss through the compiled model; LLaMA-Factory / HF Trainer keys)
    do_eval: bool = _key("evaluation", False, "evaluate the loss on held-out data")
    val_size: float = _key("evaluation", 0.0, "hold out a fraction in [0, 1) or a number of examples for evaluation")
    eval_dataset: str | None = _key("evaluation", None, "comma-separated data set names to evaluate on, instead of "
                                                        "val_size")
    eval_strategy: str = _key("evaluation", "no", "when to evaluate: no, steps or epoch")
    eval_steps: float | None = _key("evaluation", None, "evaluate every N steps (a fraction < 1: of the run's "
                                                        "steps); none: logging_steps")
    per_device_eval_batch_size: int = _key("evaluation", 8, "examples per evaluation batch")
    eval_on_each_dataset: bool = _key("evaluation", False, "with eval_dataset: one eval_<name>_loss per data set (as "
                                                           "HF/LLaMA-Factory log it) instead of one eval_loss")
    # fine-tuning method (finetuning.py; LLaMA-Factory's keys)
    finetuning_type: str = _key("training", "full", "full: every weight trains; freeze: only the freeze_* selection "
                                                    "(LLaMA-Factory's freeze tuning); lora: LoRA adapters (peft)")
    freeze_trainable_layers: int = _key("training", 2, "freeze: train the last n decoder layers (n < 0: the first -n)")
    freeze_trainable_modules: str = _key("training", "all", "freeze: the modules of those layers that train: all, or "
                                                            "comma-separated names (e.g. mlp,self_attn)")
    freeze_extra_modules: str | None = _key("training", None, "freeze: modules outside the layers that train too, "
                                                              "comma-separated (e.g. embed_tokens,norm)")
    lora_rank: int = _key("training", 8, "lora: the rank of the LoRA matrices")
    lora_alpha: float | None = _key("training", None, "lora: the LoRA scale factor; none: 2 * lora_rank")
    lora_dropout: float = _key("training", 0.0, "lora: dropout on the LoRA path's input")
    lora_target: str = _key("training", "all", "lora: comma-separated module names to adapt, or all (every linear "
                                               "layer but the LM head)")
    additional_target: str | None = _key("training", None, "lora: modules trained in full besides the adapters, "
                                                           "comma-separated (e.g. embed_tokens,lm_head)")
    use_rslora: bool = _key("training", False, "lora: rank-stabilised scaling alpha / sqrt(rank) instead of "
                                               "alpha / rank")
    merge_lora: bool = _key("output", False, "lora: also write the merged full model to output_dir/merged")
    # optimisation
    per_device_train_batch_size: int = _key("training", 1, "examples per micro-batch")
    gradient_accumulation_steps: int = _key("training", 1, "micro-batches per optimizer step")
    learning_rate: float = _key("training", 5e-5, "peak learning rate of AdamW")
    weight_decay: float = _key("training", 0.0, "AdamW weight decay (not on biases and norms)")
    adam_beta1: float = _key("training", 0.9, "AdamW beta1")
    adam_beta2: float = _key("training", 0.999, "AdamW beta2")
    adam_epsilon: float = _key("training", 1e-8, "AdamW epsilon")
    max_grad_norm: float = _key("training", 1.0, "clip the global gradient norm to this (0: no clipping)")
    num_train_epochs: float = _key("training", 3.0, "epochs over the examples (a fraction is allowed)")
    max_steps: int = _key("training", -1, "optimizer steps; > 0 overrides num_train_epochs")
    lr_scheduler_type: str = _key("training", "linear", "learning-rate schedule (Hugging Face's): "
                                                        + ", ".join(schedule.SCHEDULERS))
    lr_scheduler_kwargs: dict = _key("training", {}, "the schedule's own arguments, e.g. {min_lr_rate: 0.1} for "
                                                     "cosine_with_min_lr")
    warmup_ratio: float = _key("training", 0.0, "warmup as a fraction of the steps")
    warmup_steps: int | float = _key("training", 0, "warmup steps (a number < 1: a fraction of the steps), instead "
                                                    "of warmup_ratio")
    seed: int = _key("training", 42, "seed of the sample order and of every random generator")
    # a run diverging: skipping more steps would train nothing
    max_consecutive_skipped_steps: int = _key("training", 10, "stop (exit 4) after this many steps in a row with a "
                                                              "non-finite loss or gradient norm")
    # (runtime/adamw.py: backward is exact by rollback)
    overlap_optimizer: bool | str | None = _key("training", None, "AdamW on host threads: false, forward (true: "
                                                                  "under the next forward) or backward; none: "
                                                                  "backward on CUDA")
    # data parallelism (torchrun: megacompile/distributed.py)
    ddp_timeout: int | float = _key("training", 1800, "seconds a rank waits for the others in a collective before the "
                                                      "run stops with an error (a peer that hangs or died)")
    # the NVMe state tier (issue 18; tier_keys.py): fp32 masters / AdamW moments on disk
    nvme: str | None = _key("training", None, "SSD profile of the state tier: gen4x1, gen4x4, gen5x1, gen5x4, a JSON "
                                              "profile or measure:DIR[,DIR...]; null: all state in RAM")
    nvme_paths: list | None = _key("training", None, "nvme: the directories of the tier's files, one per drive "
                                                     "(default: the profile's paths)")
    nvme_placement: str = _key("training", "auto", "nvme: what goes to disk: auto (the least that fits the host "
                                                   "RAM), moments (AdamW state) or all (fp32 masters too)")
    # output
    output_dir: str = _key("output", "", "where checkpoints, logs and the final model go")
    logging_steps: int = _key("output", 10, "log every N steps")
    save_steps: int = _key("output", 500, "checkpoint every N steps (and at the end)")
    save_total_limit: int | None = _key("output", None, "keep at most this many checkpoints")
    resume_from_checkpoint: str | bool | None = _key("output", None, "a checkpoint folder, or true: the latest in "
                                                                     "output_dir")
    overwrite_output_dir: bool = _key("output", False, "delete a previous run in output_dir")
    report_to: str | list = _key("output", "jsonl", "trackers besides the JSONL log: none, jsonl, tensorboard, "
                                                    "wandb, all, or a list")
    run_name: str | None = _key("output", None, "the run's name in wandb (none: output_dir's folder name)")
    # megatrain compile options (megacompile.options.Options), flattened
    megatrain: dict = field(default_factory=dict)
    #: one line per LLaMA-Factory key megatrain accepts and ignores (lf_keys.py), said at the start of a run
    notes: typing.ClassVar[list[str]] = []

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
        need(self.vision in VISION_MODES, f"vision={self.vision!r}: use one of {', '.join(VISION_MODES)}.")
        self._check_report_to()
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
        need(self.ddp_timeout > 0, f"ddp_timeout={self.ddp_timeout}: must be a positive number of seconds.")
        need(self.learning_rate > 0, f"learning_rate={self.learning_rate}: must be positive.")
        need(self.weight_decay >= 0, f"weight_decay={self.weight_decay}: must be 0 or more.")
        need(self.adam_epsilon > 0, f"adam_epsilon={self.adam_epsilon}: must be positive (e.g. 1e-8).")
        need(self.max_grad_norm >= 0, f"max_grad_norm={self.max_grad_norm}: must be 0 (no clipping) or more.")
        need(0 <= self.warmup_ratio < 1, f"warmup_ratio={self.warmup_ratio}: must be in [0, 1).")
        # (transformers 5.0-5.1, LLaMA-Factory's, let warmup_ratio replace warmup_steps; later ones have no
        # warmup_ratio: which one a config means is not clear)
        need(not (self.warmup_ratio and self.warmup_steps),
             f"warmup_ratio={self.warmup_ratio} and warmup_steps={self.warmup_steps}: set one of them (warmup_steps "
             "below 1 is a fraction too).")
        need(self.warmup_steps >= 0, f"warmup_steps={self.warmup_steps}: must be 0 or more (a number < 1 is a "
                                     "fraction of the steps).")
        need(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "adam_beta1/adam_beta2 must be in [0, 1).")
        need(self.num_train_epochs >= 0, f"num_train_epochs={self.num_train_epochs}: must be 0 or more.")
        need(self.max_steps > 0 or self.num_train_epochs > 0, "set max_steps > 0 or num_train_epochs > 0.")
        need(self.max_samples is None or self.max_samples > 0, f"max_samples={self.max_samples}: must be positive.")
        for key in ("image_min_pixels", "image_max_pixels"):   # (max wins where they cross, as in LLaMA-Factory)
            need(getattr(self, key) >= 1, f"{key}={getattr(self, key)}: must be at least 1.")
        need(0 <= self.seed < 2**32, f"seed={self.seed}: must be in [0, 2**32) (NumPy takes no other seed).")
        need(self.save_total_limit is None or self.save_total_limit >= 1,
             f"save_total_limit={self.save_total_limit}: keep at least 1 checkpoint (or leave it unset).")
        self._check_data_and_eval()
        check_tier_keys(self)
        finetuning.check_config(self)
        need(all(isinstance(k, str) for k in self.lr_scheduler_kwargs),
             f"lr_scheduler_kwargs={self.lr_scheduler_kwargs!r}: the keys are argument names (e.g. min_lr_rate).")
        schedule.check(self)
        # a bad compile option is an error now; whether the device exists is checked when training
        # starts (a config for a GPU run may be planned on a laptop)
        Options.from_mapping({k: v for k, v in self.megatrain.items() if k != "device"})
        device = str(self.megatrain.get("device", "cpu"))
        need(device == "cpu" or device.split(":")[0] == "cuda", f"device={device!r}: use cpu or cuda.")

    def _check_report_to(self) -> None:
        """report_to: one name or a list of them; none goes alone."""
        names = [self.report_to] if isinstance(self.report_to, str) else self.report_to
        for name in names:
            if name not in REPORTS:
                raise ConfigError(f"report_to={self.report_to!r}: {name!r} is not one of {', '.join(REPORTS)}.")
        if "none" in names and len(names) > 1:
            raise ConfigError(f"report_to={self.report_to!r}: none means no tracker; give it alone.")

    def _check_data_and_eval(self) -> None:
        """LLaMA-Factory's data and evaluation keys: choices, ranges and the combinations it refuses."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)
        need(self.mix_strategy in MIX_STRATEGIES,
             f"mix_strategy={self.mix_strategy!r}: use one of {', '.join(MIX_STRATEGIES)}.")
        if self.interleave_probs is not None:
            need(self.mix_strategy != "concat", "interleave_probs is only for mix_strategy: interleave_under or "
                                                "interleave_over / interleave_once (concat reads every data set "
                                                "whole).")
            try:
                probs = [float(p) for p in str(self.interleave_probs).split(",")]
            except ValueError:
                raise ConfigError(f"interleave_probs={self.interleave_probs!r}: give comma-separated numbers, "
                                  "e.g. 0.7,0.3.") from None
            need(len(probs) == len(self.datasets), f"interleave_probs={self.interleave_probs!r}: give one "
                                                   f"probability per data set ({len(self.datasets)} in dataset).")
            need(all(p >= 0 and math.isfinite(p) for p in probs) and abs(sum(probs) - 1) < 1e-6,
                 f"interleave_probs={self.interleave_probs!r}: probabilities must be >= 0 and sum to 1.")
        need(not (self.mask_history and self.train_on_prompt),
             "mask_history and train_on_prompt cannot both be true: one trains on the last reply only, the other on "
             "the prompts too.")
        need(self.stage == "sft" or not (self.train_on_prompt or self.mask_history),
             "train_on_prompt and mask_history are for stage: sft (stage: pt trains on every token).")
        need(self.preprocessing_batch_size >= 1,
             f"preprocessing_batch_size={self.preprocessing_batch_size}: must be at least 1.")
        need(self.preprocessing_num_workers is None or self.preprocessing_num_workers >= 1,
             f"preprocessing_num_workers={self.preprocessing_num_workers}: must be at least 1 (or unset).")
        need(self.val_size >= 0, f"val_size={self.val_size}: must be 0 or more (a fraction < 1 or a number of "
                                 "examples).")
        need(self.val_size < 1 or float(self.val_size).is_integer(),
             f"val_size={self.val_size}: a number of examples (>= 1) must be whole; a fraction must be < 1.")
        need(not (self.eval_dataset and self.val_size > 0),
             "set val_size or eval_dataset, not both: val_size holds out part of dataset, eval_dataset names other "
             "data.")
        need(not (self.streaming and 0 < self.val_size < 1),
             f"val_size={self.val_size} with streaming: true: give a number of examples (the stream's length is not "
             "known in advance).")
        need(not (self.streaming and self.max_samples is not None),
             "max_samples with streaming: true: not supported (as in LLaMA-Factory); remove one of them.")
        need(not self.streaming or self.max_steps > 0,
             "streaming: true needs max_steps (the stream's length is not known in advance, as in LLaMA-Factory): "
             "set max_steps.")
        need(not (self.streaming and self.tokenized_path),
             "tokenized_path with streaming: true: a stream is tokenized as it is read and saves nothing (as in "
             "LLaMA-Factory); remove one of them.")
        need(not (self.streaming and self.eval_strategy == "epoch"),
             "eval_strategy: epoch with streaming: true: a stream's epochs are not known in advance; use "
             "eval_strategy: steps with eval_steps.")
        need(self.buffer_size >= 1, f"buffer_size={self.buffer_size}: must be at least 1.")
        need(self.eval_strategy in EVAL_STRATEGIES,
             f"eval_strategy={self.eval_strategy!r}: use one of {', '.join(EVAL_STRATEGIES)}.")
        need(self.eval_steps is None or self.eval_steps > 0, f"eval_steps={self.eval_steps}: must be positive.")
        need(self.eval_steps is None or self.eval_steps < 1 or float(self.eval_steps).is_integer(),
             f"eval_steps={self.eval_steps}: a number of steps (>= 1) must be whole; a fraction must be < 1.")
        need(not self.eval_on_each_dataset or bool(self.eval_dataset),
             "eval_on_each_dataset: true needs eval_dataset (data set names, each evaluated on its own); "
             "val_size holds out one set.")
        need(self.per_device_eval_batch_size >= 1,
             f"per_device_eval_batch_size={self.per_device_eval_batch_size}: must be at least 1.")
        need(self.eval_strategy == "no" or self.val_size > 0 or bool(self.eval_dataset),
             f"eval_strategy: {self.eval_strategy} needs evaluation data: set val_size (e.g. 0.1) or eval_dataset.")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(out.pop("megatrain"))
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig) if f.name != "megatrain"}
_OPTION_FIELDS = {f.name for f in dataclasses.fields(Options)}


#: keys with no default worth showing: what a value looks like (the "has no value" message)
_EXAMPLES = {"output_dir": "saves/llama3-8b/full/sft", "model_name_or_path": "meta-llama/Meta-Llama-3-8B-Instruct",
             "dataset": "alpaca_en_demo", "template": "llama3", "dataset_dir": "data",
             "eval_dataset": "alpaca_en_demo", "tokenized_path": "saves/tokenized",
             "resume_from_checkpoint": "saves/run/checkpoint-500", "media_dir": "data"}
_REQUIRED = ("output_dir", "model_name_or_path", "dataset")


def _check_type(key: str, value: Any) -> Any:
    hint = typing.get_type_hints(TrainConfig)[key]
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    if value is None and type(None) in allowed:
        return None
    if value is None:   # `key:` or `key=` with nothing after it
        default = _FIELDS[key].default
        if default in ("", None) or isinstance(default, (dict, list)):   # (no default worth showing: an example)
            example = _EXAMPLES.get(key)
            raise ConfigError(f"{key} has no value: give one" + (f" (e.g. {key}: {example})" if example else "")
                              + (" or leave the key out" if default not in ("", None) or key not in _REQUIRED
                                 else "") + ".")
        raise ConfigError(f"{key} has no value: give one (e.g. {key}: {default!r}) or leave the key out.")
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
        if t in (dict, list) and isinstance(value, t):
            return value
    names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise ConfigError(f"{key}={value!r} ({type(value).__name__}): expected {names}.")


def _suggest(key: str, valid: list[str]) -> str | None:
    """The valid key `key` most likely meant: a synonym (lr -> learning_rate) or a close spelling
    (difflib at a high cutoff, so deepspeed suggests nothing rather than seed)."""
    if key.lower() in SYNONYMS:
        return SYNONYMS[key.lower()]
    close = difflib.get_close_matches(key.lower(), valid, n=1, cutoff=0.8)
    return close[0] if close else None


def _unknown_keys_error(unknown: list[str], refused: list[str]) -> ConfigError:
    """One error for all the keys of a config megatrain cannot take: unknown ones, then refused ones."""
    valid = sorted(set(_FIELDS) | _OPTION_FIELDS)
    parts = []
    if unknown:
        named = []
        for key in unknown:
            close = _suggest(key, valid)
            named.append(f"{key!r}" + (f" (Did you mean {close!r}?)" if close else ""))
        parts.append(f"unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(named)}: see "
                     "`megatrain train --help` or docs/train.md for the keys")
    if refused:
        parts.append(f"not supported: {'; '.join(refused)}")
    return ConfigError(". ".join(parts) + ".")


def from_mapping(mapping: dict[str, Any]) -> TrainConfig:
    """A checked TrainConfig from a config's keys: megatrain's own, LLaMA-Factory's (lf_keys.py:
    mapped, noted in `config.notes`, or refused) and compile options."""
    for key in mapping:
        if not isinstance(key, str):
            raise ConfigError(f"config key {key!r} ({type(key).__name__}): keys are names such as learning_rate "
                              "(a YAML key like `1: x` or `true: x` is not one).")
    sorted_keys = lf_keys.translate(mapping, set(_FIELDS) | _OPTION_FIELDS)
    if sorted_keys.unknown or sorted_keys.refused:
        raise _unknown_keys_error(sorted_keys.unknown, sorted_keys.refused)
    values, compile_options = {}, {}
    for key, value in sorted_keys.values.items():
        if key in _FIELDS:
            values[key] = _check_type(key, value)
        else:
            compile_options[key] = value
    config = TrainConfig(**values, megatrain=compile_options)
    config.validate()
    config.notes = sorted_keys.notes + schedule.notes(config)
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


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping (plain YAML keeps the
    last one silently: two `output_dir:` lines would train into the second folder)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise ConfigError(f"config key {key!r} is given twice (line {key_node.start_mark.line + 1}): "
                                  "keep one of them.")
            if isinstance(key, (str, int, float, bool)):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    mapping: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist.")
        try:
            mapping = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}): save it as UTF-8 YAML.") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from None
        if not isinstance(mapping, dict):
            raise ConfigError(f"{path} must hold a mapping of keys to values, not {type(mapping).__name__}.")
    mapping.update(parse_overrides(list(overrides)))
    return from_mapping(mapping)
