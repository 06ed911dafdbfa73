"""What format.py (full checkpoints) and tier.py (moments streamed from the NVMe tier) share
about a checkpoint folder: its name, how it is found and recognised, the error a damaged one
raises and what it advises instead. It imports neither (the format is in format.py's
docstring; the model files a checkpoint holds are written by model/hf_folder.py).

    raise damaged(path, "optimizer.pt", "not a torch file")   # CheckpointError, advising what to resume
    checkpoints(output_dir) -> [.../checkpoint-2, .../checkpoint-4]
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ...errors import MegatrainError

#: the name of a checkpoint folder: checkpoint-N
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
TRAINER = "trainer.json"


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
