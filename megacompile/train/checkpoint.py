"""Checkpoints that survive a kill at any moment.

`output_dir/checkpoint-N/` holds:
  model.safetensors   fp32 master weights by parameter name (exact, not the bf16 copies)
  optimizer.pt        optimizer state (loaded while parameters show their masters, so torch
                      does not cast the fp32 moments to bf16)
  trainer.json        step, scheduler state, data position, token and skip counters, config
  rng.pt              Python, NumPy and torch RNG states
A checkpoint is written into `checkpoint-N.tmp` (every file fsynced), renamed into place and
the directory fsynced, so a kill leaves either the complete new checkpoint or none: the previous
ones are untouched. `save_total_limit` removes the oldest complete ones after a save.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..errors import MegatrainError
from ..runtime.store import master_weight, masters_shown, set_master
from ..vlm import store_parameters

_NAME = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(MegatrainError):
    """A checkpoint is missing, incomplete or does not match this run."""


def checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()
             and (p / "trainer.json").is_file()]
    return [p for _, p in sorted(found)]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(output_dir: str | Path, step: int, model: torch.nn.Module, optimizer, trainer_state: dict[str, Any],
         limit: int | None = None) -> Path:
    out = Path(output_dir)
    final = out / f"checkpoint-{step}"
    tmp = out / f"checkpoint-{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)  # a save killed earlier
    tmp.mkdir(parents=True)
    masters = {name: master_weight(p).detach().contiguous()
               for name, p in model.named_parameters()}  # tied weights: once, under their first name
    save_file(masters, str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        rng["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    torch.save(rng, tmp / "rng.pt")
    (tmp / "trainer.json").write_text(json.dumps({**trainer_state, "step": step}, indent=1))
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    if final.exists():  # the same step saved again (a resumed run): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(out)
    if limit is not None:
        for old in checkpoints(out)[:-limit]:
            shutil.rmtree(old)
    return final


def load(path: str | Path, model: torch.nn.Module, optimizer, pin: bool = False) -> dict[str, Any]:
    """Restore weights, optimizer state and RNG from a checkpoint; returns the trainer state."""
    path = Path(path)
    for name in ("model.safetensors", "optimizer.pt", "trainer.json", "rng.pt"):
        if not (path / name).is_file():
            raise CheckpointError(f"{path} is not a complete checkpoint (no {name}); pick another checkpoint-N "
                                  "folder or set resume_from_checkpoint: true for the latest complete one.")
    masters = load_file(str(path / "model.safetensors"))
    params = dict(model.named_parameters())
    missing, unexpected = set(params) - set(masters), set(masters) - set(params)
    if missing or unexpected:
        raise CheckpointError(f"{path} does not match this model (missing {sorted(missing)[:3]}, unexpected "
                              f"{sorted(unexpected)[:3]}): resume with the same model_name_or_path and num_layers.")
    in_store = {id(p) for p in store_parameters(model)}
    for name, p in params.items():
        if masters[name].shape != p.shape:
            raise CheckpointError(f"{path}: {name} has shape {tuple(masters[name].shape)}, the model {tuple(p.shape)}.")
        if id(p) in in_store:
            set_master(p, masters[name], name, pin)
        else:   # a VLM's vision side: on the device, trained in its own dtype
            with torch.no_grad():
                p.data.copy_(masters[name])
    with masters_shown(params.values()):
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    rng = torch.load(path / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "numpy" in rng:
        import numpy as np
        np.random.set_state(rng["numpy"])
    return json.loads((path / "trainer.json").read_text())
