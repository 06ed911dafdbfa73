"""The files of a checkpoint folder, shared by checkpoint.py (full checkpoints),
checkpoint_tier.py (moments streamed from the NVMe tier) and lora.py (adapters): their names,
the error a damaged one raises and what it advises, and the writers of the weights and the
model files. It imports none of the three (the format itself is in checkpoint.py's docstring).

    write_weights({"model.embed_tokens.weight": t, ...}, folder)   # model.safetensors, or shards + index
    raise damaged(path, "optimizer.pt", "not a torch file")           # CheckpointError, advising what to resume
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import MegatrainError

#: the name of a checkpoint folder: checkpoint-N
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TRAINER = "trainer.json"
MAX_SHARD_SIZE = "5GB"   # save_pretrained's shard size before transformers 5 (5.x writes 50 GB shards)

class CheckpointError(MegatrainError):
    """A checkpoint is missing, damaged or does not match this run."""


def step_of(path: Path) -> int:
    m = CHECKPOINT_NAME.match(Path(path).name)
    if m is None:
        raise CheckpointError(f"{path} is not a checkpoint-N folder.")
    return int(m.group(1))


def checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `output_dir` (their trainer.json is written last), oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if (m := CHECKPOINT_NAME.match(p.name)) and p.is_dir()
             and is_megatrain(p)]
    return [p for _, p in sorted(found)]


def write_weights(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """`tensors` as save_pretrained writes them: one model.safetensors, or shards of at most
    MAX_SHARD_SIZE and their index (huggingface_hub plans the shards, as for save_pretrained)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    split = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=MAX_SHARD_SIZE)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, str(folder / filename))
    if split.is_sharded:
        index = {"metadata": {"total_parameters": sum(t.numel() for t in tensors.values()), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_model_files(model: torch.nn.Module, saver, folder: Path) -> None:
    """config.json (with the model's architecture, as save_pretrained writes it), the generation
    config and the tokenizer's or processor's files: what from_pretrained needs besides weights."""
    import copy
    config = copy.deepcopy(model.config)   # (the live model's config is not changed)
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(folder)
    if saver is not None:
        saver.save_pretrained(folder)


def damaged(path: Path, name: str, why: str) -> CheckpointError:
    return CheckpointError(f"{path / name} is damaged ({why}). " + elsewhere(path))


def elsewhere(path: Path) -> str:
    """What to resume from instead of a damaged checkpoint."""
    older = [p for p in checkpoints(path.parent) if CHECKPOINT_NAME.match(path.name) and step_of(p) < step_of(path)]
    if older:
        return (f"The previous complete checkpoint is {older[-1]}: set resume_from_checkpoint: {older[-1]} "
                "(or true, which falls back to the newest checkpoint that loads).")
    return "There is no earlier checkpoint in this folder: start the run again in a new output_dir."


def finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def trainer_shaped(trainer) -> bool:
    return isinstance(trainer, dict) and type(trainer.get("step")) is int \
        and all(isinstance(trainer.get(k), dict) for k in ("scheduler", "data", "state"))


def is_megatrain(path: Path) -> bool:
    """Whether `path` is a checkpoint folder megatrain wrote: its trainer.json has megatrain's
    fields (a Hugging Face Trainer's checkpoint-N holds trainer_state.json, never this)."""
    try:
        return trainer_shaped(json.loads((Path(path) / TRAINER).read_text()))
    except (OSError, ValueError):
        return False
