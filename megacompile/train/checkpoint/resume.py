"""What a resumed run may change: the config stored in the checkpoint against this run's.

    changes(saved, config)  -> (refused, applied)   lines saying which key changed, from what to what

Refused (the run would no longer continue the one it resumes): the sample order and batch
(`per_device_train_batch_size`, `gradient_accumulation_steps`, `seed`,
`disable_shuffling`), what is trained
(`stage`, `torch_dtype`, `num_layers`, `vision`, `finetuning_type`, the freeze_* and lora keys) and,
when the checkpoint has no data fingerprint, the data keys. The data keys (`dataset`, `dataset_dir`,
`template`, `cutoff_len`,
...) and `model_name_or_path` are otherwise judged by content: a moved folder is fine when the
examples' tokens are the same (the fingerprint, compared by the trainer) and the weights' names
and shapes match (checked when the checkpoint loads). Everything else (learning rate and
schedule, optimizer hyper-parameters, max_steps, logging, saving, compile options) is applied
from the step the run resumes at, and logged.
"""
from __future__ import annotations

from typing import Any

#: changing these breaks the equivalence with the run being resumed
REFUSED = ("per_device_train_batch_size", "gradient_accumulation_steps", "seed", "stage", "torch_dtype", "num_layers",
           "vision", "disable_shuffling", "finetuning_type", "freeze_trainable_layers", "freeze_trainable_modules",
           "freeze_extra_modules", "lora_rank", "lora_alpha", "lora_dropout", "lora_target", "additional_target",
           "use_rslora")
#: these decide the examples; compared by the examples' fingerprint when the checkpoint has one
DATA = ("dataset", "dataset_dir", "template", "cutoff_len", "max_samples", "packing", "train_on_prompt", "mask_history",
        "media_dir", "image_max_pixels", "image_min_pixels", "allow_outside_dataset_dir", "default_system",
        "enable_thinking", "tool_format", "mix_strategy", "interleave_probs", "streaming", "val_size",
        "buffer_size")
#: where the run lives or reads from: not a change of the training itself
IGNORED = ("output_dir", "resume_from_checkpoint", "overwrite_output_dir", "model_name_or_path", "trust_remote_code")


def _diff(saved: dict[str, Any], now: dict[str, Any], keys) -> list[str]:
    return [f"{k}: {saved[k]!r} -> {now.get(k)!r}" for k in keys if k in saved and saved[k] != now.get(k)]


def changes(saved: dict[str, Any], now: dict[str, Any], has_fingerprint: bool, saved_world: int = 1,
            world: int = 1) -> tuple[list[str], list[str]]:
    """(refused, applied) changes from the checkpoint's config `saved` to this run's `now`
    (both TrainConfig.to_dict()). With data parallelism the batch that decides the sample order
    is the global micro-batch (per_device_train_batch_size x ranks): a checkpoint of 2 ranks x 2
    resumes in 1 process x 4 and the other way round."""
    import dataclasses

    from ..hparams.config import TrainConfig
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    key = "per_device_train_batch_size"
    refused = _diff(saved, now, REFUSED) + ([] if has_fingerprint else _diff(saved, now, DATA))
    applied_world = []
    if saved_world != world and key in saved:
        refused = [r for r in refused if not r.startswith(key + ":")]
        before, after = saved[key] * saved_world, now.get(key, 0) * world
        if before != after:
            refused.insert(0, f"the global micro-batch ({key} x ranks): {saved[key]} x {saved_world} = {before} -> "
                              f"{now.get(key)} x {world} = {after}")
        else:
            applied_world.append(f"ranks: {saved_world} -> {world} (global micro-batch {before} kept)")
    # (a config key the checkpoint's megatrain did not have yet is not a change; a compile option
    # is stored only when set)
    rest = sorted(k for k in set(saved) | set(now) if k not in REFUSED + DATA + IGNORED
                  and (k in saved or k not in fields))
    unset = "(unset)"
    applied = applied_world + [f"{k}: {saved.get(k, unset)!r} -> {now.get(k, unset)!r}" for k in rest
                               if saved.get(k, unset) != now.get(k, unset)]
    return refused, applied


def data_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The data keys that changed (to explain a fingerprint that differs)."""
    return _diff(saved, now, DATA)
