"""Checkpoints that survive a kill at any moment and are read back without running any code.

`output_dir/checkpoint-N/` is a Hugging Face model folder, so
`AutoModelForCausalLM.from_pretrained("checkpoint-N")` loads it, and it holds:
  model.safetensors   fp32 master weights by parameter name (exact, not the bf16 copies) and the
                      persistent buffers; above 5 GB sharded as save_pretrained does
                      (model-0000k-of-0000n.safetensors + model.safetensors.index.json, the shard
                      plan by huggingface_hub's split_torch_state_dict_into_shards)
  config.json, generation_config.json, the tokenizer's (or processor's) files
  optimizer.pt        optimizer state: tensors and plain containers only (read with weights_only=True;
                      loaded while parameters show their masters, so torch keeps the moments fp32)
  rng.json            Python, NumPy, torch (and CUDA) generator states as JSON (rng_state.py)
  trainer.json        written last: step, scheduler state, data position, counters, config, the
                      data fingerprint and the size of every other file
config.json keeps the model's dtype: from_pretrained loads the fp32 masters into it (bf16 for a
bf16 model), as the final export holds it.
A LoRA run (finetuning_type: lora, model/lora.py) saves only what trains: model.safetensors holds the
adapters' (and additional_target's) fp32 masters by parameter name, next to the adapter as peft
writes it (adapter_model.safetensors, adapter_config.json; no config.json: it is no full model),
and trainer.json says "weights": "trainable"; a resume takes the frozen base from
model_name_or_path.

Writing (`save`): into `checkpoint-N.tmp`, every file fsynced, renamed into place, the folder
fsynced: a kill leaves either the complete new checkpoint or none. Saving a step that exists
moves the old one to `checkpoint-N.prev` first and deletes it after the rename (`recover` puts
back a `.prev` whose rename never happened), so no moment holds neither copy. Before writing, the
checkpoint's size is compared with the free space; with `save_total_limit`, checkpoints this save
would prune anyway are pruned first when the space is needed, never leaving less than one
complete checkpoint.

Reading (`read`): every file is parsed and checked (sizes against trainer.json, formats, finite
weights and moments) before anything in the model changes; `apply` then sets the masters, the
optimizer state and the generators.

An optimizer with a state tier (HostAdamW(tier=...): masters and moments in files on NVMe) saves
and loads through tier.py, one shard at a time: the same model files, the tiered
moments in optimizer-moments-0000k-of-0000n.safetensors beside optimizer.pt. Either format
resumes with the tier on or off.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ...errors import CannotFitError, TrainingError
from ...units import fmt_bytes as _fmt
from ...runtime.store import master_weight, masters_shown, set_master
from ...vlm import store_parameters
from . import rng_state
from ..model.hf_folder import MAX_SHARD_SIZE, WEIGHTS, WEIGHTS_INDEX, write_model_files, write_weights  # noqa: F401
from .files import (CHECKPOINT_NAME, TRAINER, CheckpointError, checkpoints, damaged, elsewhere,  # noqa: F401 (API)
                    finite, is_megatrain, step_of, trainer_shaped)

if TYPE_CHECKING:
    from .tier import Moments

_PREV = re.compile(r"^checkpoint-(\d+)\.prev$")
FILES = (WEIGHTS, "optimizer.pt", "rng.json")   # (sharded weights: the index instead of model.safetensors)


class DiskSpaceError(CheckpointError, CannotFitError):
    """A checkpoint does not fit the free space of its file system (exit code 3)."""


def recover(output_dir: str | Path) -> list[str]:
    """Finish re-saves a kill interrupted: a `checkpoint-N.prev` whose new `checkpoint-N` never
    arrived is put back; one whose replacement is in place is deleted. Returns what it did."""
    out, done = Path(output_dir), []
    if not out.is_dir():
        return done
    for p in sorted(out.iterdir()):
        if (m := _PREV.match(p.name)) and p.is_dir() and is_megatrain(p):   # (never another tool's folder)
            final = out / f"checkpoint-{m.group(1)}"
            if is_megatrain(final):
                shutil.rmtree(p)
                done.append(f"removed {p.name} (replaced by a complete {final.name})")
            elif not final.exists():
                os.replace(p, final)
                done.append(f"restored {final.name} from {p.name} (a re-save was interrupted)")
    return done


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def estimate_bytes(model: torch.nn.Module, optimizer) -> int:
    """What a checkpoint of this model and optimizer takes on disk (fp32 masters + optimizer
    tensors + a little for the headers and JSON files)."""
    masters = sum(4 * p.numel() if p.dtype in (torch.bfloat16, torch.float16) else p.numel() * p.element_size()
                  for p in {id(p): p for p in model.parameters()}.values())
    from ..model.lora import is_lora
    if is_lora(model):   # the adapter's masters, twice (model.safetensors and adapter_model.safetensors)
        masters = 2 * sum(4 * p.numel() for p in model.parameters() if p.requires_grad)
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    from .tier import estimate_tiered_bytes
    state += estimate_tiered_bytes(optimizer)   # (a tier's moments are not in optimizer.state)
    if not optimizer.state:   # before the first step: AdamW's two fp32 moments per trainable weight
        state = sum(8 * p.numel() for g in optimizer.param_groups for p in g["params"])
    return masters + state + 2**20


def _make_room(out: Path, step: int, need: int, limit: int | None) -> None:
    free = shutil.disk_usage(out).free
    pruned = []
    if free < need and limit is not None:
        # these would be pruned after this save anyway; keep at least one complete checkpoint
        complete = [p for p in checkpoints(out) if step_of(p) != step]
        for old in complete[:max(0, len(complete) - max(limit - 1, 1))]:
            if free >= need:
                break
            shutil.rmtree(old)
            pruned.append(old.name)
            free = shutil.disk_usage(out).free
    if free < need:
        done = f" after removing {', '.join(pruned)} (save_total_limit)" if pruned else ""
        raise DiskSpaceError(
            f"checkpoint-{step} needs about {_fmt(need)} but the file system of {out} has {_fmt(free)} free{done}: "
            f"free {_fmt(need - free)} there, or set save_total_limit to keep fewer checkpoints (the "
            "oldest are then removed before a save that needs their space). The previous checkpoints are intact.")


def _weights_to_save(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Parameter name -> fp32 master (tied weights once, under their first name), and the
    persistent buffers, so from_pretrained finds every tensor of the state dict. `trainable_only`
    (LoRA): the parameters that train, nothing else (the rest is model_name_or_path's)."""
    if trainable_only:
        return {name: master_weight(p).detach().contiguous() for name, p in model.named_parameters()
                if p.requires_grad}
    tensors = {name: master_weight(p).detach().contiguous() for name, p in model.named_parameters()}
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)}   # (a tied LM head's too)
    for name, t in model.state_dict().items():
        if name not in aliases:
            tensors[name] = t.detach().contiguous()
    return tensors


def save(output_dir: str | Path, step: int, model: torch.nn.Module, optimizer, trainer_state: dict[str, Any],
         limit: int | None = None, saver=None) -> Path:
    """Write checkpoint-N (see the module docstring); `saver`: the tokenizer or processor whose
    files go with it."""
    out = Path(output_dir)
    final = out / f"checkpoint-{step}"
    tmp = out / f"checkpoint-{step}.tmp"
    from . import tier as checkpoint_tier
    from ..model.lora import is_lora, save_adapter
    adapter = is_lora(model)   # (LoRA: the adapter's weights only; the base model is model_name_or_path)
    tier = checkpoint_tier.tier_of(optimizer)
    # with a tier the masters are read one shard at a time while writing (never all in RAM)
    masters = _weights_to_save(model, trainable_only=adapter) if tier is None else {}
    bad = [name for name, t in masters.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:   # never write a checkpoint that cannot be trained from
        raise TrainingError(f"step {step}: the weights {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} are not "
                            f"finite, so checkpoint-{step} is not written; the previous checkpoints are intact. Lower "
                            "learning_rate (or raise warmup_steps) and resume from the last checkpoint.")
    if tmp.exists():
        shutil.rmtree(tmp)  # a save killed earlier
    need = estimate_bytes(model, optimizer)
    _make_room(out, step, need, limit)
    try:
        tmp.mkdir(parents=True)
        if tier is None:
            write_weights(masters, tmp)
        else:
            checkpoint_tier.write_weights(model, tier, tmp, step, trainable_only=adapter)
        if adapter:   # as LLaMA-Factory's LoRA checkpoints: PeftModel.from_pretrained(base, checkpoint-N)
            save_adapter(model, tmp)
            if saver is not None:
                saver.save_pretrained(tmp)
        else:
            write_model_files(model, saver, tmp)
        if tier is None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        else:
            checkpoint_tier.write_optimizer(optimizer, tmp, step)
        (tmp / "rng.json").write_text(json.dumps(rng_state.capture()))
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        (tmp / TRAINER).write_text(json.dumps({**trainer_state, "step": step, "files": files,
                                               **({"weights": "trainable"} if adapter else {})}, indent=1))
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
    except (TrainingError, CheckpointError):   # non-finite values or a tier I/O error, met while streaming
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except (OSError, SafetensorError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or "No space" in reason
        kind = DiskSpaceError if full else CheckpointError
        raise kind(f"writing checkpoint-{step} to {out} failed ({reason}); a checkpoint needs about {_fmt(need)}, "
                   f"{_fmt(shutil.disk_usage(out).free)} is free. The previous checkpoints are intact.") from None
    if final.exists():   # the same step saved again (a resumed run): keep the old one until the new is in place
        aside = out / f"checkpoint-{step}.prev"
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(final, aside)
        os.replace(tmp, final)
        _fsync(out)
        shutil.rmtree(aside)
    else:
        os.replace(tmp, final)
        _fsync(out)
    if limit is not None:
        for old in checkpoints(out)[:-limit]:
            shutil.rmtree(old)
    return final


# -- reading --------------------------------------------------------------------------------------

@dataclass
class Loaded:
    """A checkpoint read and checked, nothing applied yet. `masters`: a dict of every weight, or
    (read(stream=True)) a checkpoint_tier.ShardedMasters that reads them from the files when
    applied; `moments`: the checked moment shards of a checkpoint saved with a state tier (the
    tiered moments are not in `optimizer` then), else None."""
    path: Path
    masters: Mapping[str, torch.Tensor]
    optimizer: dict
    rng: dict
    trainer: dict
    moments: Moments | None = None

    @property
    def step(self) -> int:
        return self.trainer["step"]


def read(path: str | Path, stream: bool | None = None) -> Loaded:
    """Parse and check every file of a checkpoint; raises CheckpointError naming the file.
    `stream`: check the weights tensor by tensor and keep none of them (Loaded.masters reads
    them again when applied) and map optimizer.pt instead of reading it, for a run whose
    optimizer has a state tier; None: stream when the checkpoint was saved with a tier."""
    from . import tier as checkpoint_tier
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder: resume_from_checkpoint takes a checkpoint-N folder, or true "
                              "for the latest in output_dir.")
    if not (path / TRAINER).is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {TRAINER}, which is written last). "
                              + elsewhere(path))
    try:
        trainer = json.loads((path / TRAINER).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise damaged(path, TRAINER, f"not valid JSON: {e}") from None
    if not trainer_shaped(trainer):
        raise damaged(path, TRAINER, "it lacks step, scheduler, data or state")
    _check_steps(path, trainer)
    legacy_rng = not (path / "rng.json").exists() and (path / "rng.pt").is_file()   # an earlier megatrain's
    names = [n for n in FILES if not (legacy_rng and n == "rng.json")] + (["rng.pt"] if legacy_rng else [])
    if (path / WEIGHTS_INDEX).is_file():   # sharded weights: the index names the shards
        names = [WEIGHTS_INDEX if n == WEIGHTS else n for n in names]
    for name in names:
        if not (path / name).is_file():
            raise CheckpointError(f"{path} is not a complete checkpoint (no {name}). " + elsewhere(path))
    for name, size in (trainer.get("files") or {}).items():
        if not (path / name).is_file():
            raise CheckpointError(f"{path} is not a complete checkpoint (no {name}). " + elsewhere(path))
        actual = (path / name).stat().st_size
        if actual != size:
            raise damaged(path, name, f"{actual} bytes where the checkpoint wrote {size}: truncated or changed")
    if stream is None:   # (a tier's optimizer.pt names its moment shards: nothing to map)
        stream = any(f.name.startswith(checkpoint_tier.MOMENTS + "-") for f in path.iterdir())
    try:
        # (streamed: mapped, so an optimizer.pt holding a large model's moments is never read whole)
        optimizer = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu", mmap=bool(stream))
    except Exception as e:   # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ...
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise damaged(path, "optimizer.pt", f"{type(e).__name__}: {why[:300]}") from None
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("state"), dict) or \
            not isinstance(optimizer.get("param_groups"), list):
        raise damaged(path, "optimizer.pt", "not an optimizer state_dict")
    _check_optimizer_steps(path, trainer, optimizer)
    moments = {f"state[{k}].{n}": v for k, s in optimizer["state"].items() if isinstance(s, dict)
               for n, v in s.items() if isinstance(v, torch.Tensor)}
    if bad := finite(moments):
        raise CheckpointError(f"{path / 'optimizer.pt'}: the optimizer state {', '.join(bad[:3])} is not finite. "
                              + elsewhere(path))
    tiered = checkpoint_tier.read_moments(path, optimizer) if "moments" in optimizer else None
    masters = checkpoint_tier.ShardedMasters(path, _shards(path)) if stream else _read_weights(path)
    try:
        rng = rng_state.from_legacy(path / "rng.pt") if legacy_rng else json.loads((path / "rng.json").read_text())
        rng_state.check(rng)
    except (json.JSONDecodeError, UnicodeDecodeError, rng_state.RNGStateError) as e:
        raise damaged(path, "rng.pt" if legacy_rng else "rng.json", str(e)) from None
    except Exception as e:   # noqa: BLE001 - a legacy pickle that weights_only refuses
        raise damaged(path, "rng.pt",
                       f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}") from None
    return Loaded(path, masters, optimizer, rng, trainer, tiered)


def _check_steps(path: Path, trainer: dict) -> None:
    """The step a checkpoint says it is, everywhere it says it: trainer.json's step, its
    trainer state's step, the scheduler's count and the folder's name (a hand-edited or
    mixed-up checkpoint resumes at the wrong place, or reports an untrained run finished)."""
    step = trainer["step"]
    said = {"the folder's name": step_of(path) if CHECKPOINT_NAME.match(path.name) else step,
            "its trainer state": trainer["state"].get("step", step),
            "its scheduler": trainer["scheduler"].get("last_epoch", step)}
    wrong = [f"{where} says {value}" for where, value in said.items() if value != step]
    if step < 0 or wrong:
        raise damaged(path, TRAINER, f"its step is {step} but {'; '.join(wrong) or 'a step is never negative'}: "
                                      "its parts disagree (edited, or files of two checkpoints mixed)")


def _check_optimizer_steps(path: Path, trainer: dict, optimizer: dict) -> None:
    """AdamW counts its own steps per weight: the most any weight took is the run's steps less
    the ones skipped (non-finite), or the optimizer state is another checkpoint's."""
    counts = [s["step"] for s in optimizer["state"].values() if isinstance(s, dict) and "step" in s]
    counts = [int(c.item()) if isinstance(c, torch.Tensor) and c.numel() == 1 else c for c in counts]
    if not counts or not all(isinstance(c, (int, float)) for c in counts):
        return
    expected = trainer["step"] - int(trainer["state"].get("skipped_steps", 0) or 0)
    if int(max(counts)) != expected:
        raise damaged(path, "optimizer.pt", f"its AdamW state took {int(max(counts))} steps where {TRAINER} says "
                                             f"{expected} ({trainer['step']} steps less the skipped): it is another "
                                             "checkpoint's optimizer state")


def _shards(path: Path) -> list[str]:
    """The weight files of a checkpoint: model.safetensors, or the shards its index names."""
    if not (path / WEIGHTS_INDEX).is_file():
        return [WEIGHTS]
    try:
        weight_map = json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise damaged(path, WEIGHTS_INDEX, f"not a safetensors index ({type(e).__name__})") from None
    for name in shards:   # plain names in this folder: an index cannot point elsewhere
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise damaged(path, WEIGHTS_INDEX, f"its weight_map names {name!r}, not a file of the checkpoint")
        if not (path / name).is_file():
            raise CheckpointError(f"{path} is not a complete checkpoint (no {name}, a shard its index names). "
                                  + elsewhere(path))
    return shards


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's weight files, checked finite."""
    masters: dict[str, torch.Tensor] = {}
    for name in _shards(path):
        try:
            part = load_file(str(path / name))
        except (SafetensorError, OSError, ValueError) as e:
            raise damaged(path, name, str(e).splitlines()[0] if str(e) else type(e).__name__) from None
        masters.update(part)
        if bad := finite(part):
            raise CheckpointError(f"{path / name}: the weights {', '.join(bad[:3])} are not finite (NaN or inf), so "
                                  "training from it would train nothing. " + elsewhere(path))
    return masters


def apply(loaded: Loaded, model: torch.nn.Module, optimizer, pin: bool = False) -> dict[str, Any]:
    """Set weights, optimizer state and generators from a checkpoint that `read` checked;
    returns its trainer.json. Everything that can mismatch is compared before anything is set.
    With a state tier (or a checkpoint saved with one) the masters and tiered moments go in one
    tensor at a time (checkpoint_tier.py)."""
    from . import tier as checkpoint_tier
    path, masters = loaded.path, loaded.masters
    params = dict(model.named_parameters())
    if loaded.trainer.get("weights") == "trainable":   # (LoRA: the frozen rest came from model_name_or_path)
        params = {name: p for name, p in params.items() if p.requires_grad}
    buffers = set(model.state_dict()) - {n for n, _ in model.named_parameters(remove_duplicate=False)}
    # (persistent buffers are saved for from_pretrained; training does not change them)
    missing, unexpected = set(params) - set(masters), set(masters) - set(params) - buffers
    if missing or unexpected:
        raise CheckpointError(f"{path} does not match this model (missing {sorted(missing)[:3]}, unexpected "
                              f"{sorted(unexpected)[:3]}): resume with the same model_name_or_path and num_layers.")
    streamed = isinstance(masters, checkpoint_tier.ShardedMasters)
    for name, p in params.items():
        shape = masters.shape(name) if streamed else tuple(masters[name].shape)
        if tuple(shape) != tuple(p.shape):
            raise CheckpointError(f"{path}: {name} has shape {tuple(shape)}, the model {tuple(p.shape)}.")
    saved_groups = loaded.optimizer["param_groups"]
    if [len(g["params"]) for g in optimizer.param_groups] != [len(g.get("params", ())) for g in saved_groups]:
        raise CheckpointError(f"{path / 'optimizer.pt'}: its parameter groups do not match this run's optimizer "
                              "(another model, num_layers or set of trainable weights).")
    tier = checkpoint_tier.tier_of(optimizer)
    split = None   # the optimizer state split by where it goes (into the tier or load_state_dict)
    if tier is not None or loaded.moments is not None:
        split = checkpoint_tier.plan_optimizer(loaded.optimizer, loaded.moments, optimizer, path / "optimizer.pt")
    in_store = {id(p) for p in store_parameters(model)}
    for name, value in masters.items():   # (streamed: one tensor read at a time)
        p = params.get(name)
        if p is None:   # a persistent buffer
            continue
        if id(p) in in_store:
            set_master(p, value, name, pin)   # (routed into the tier for a tiered weight)
        else:   # a VLM's vision side: on the device, trained in its own dtype
            with torch.no_grad():
                p.data.copy_(value)
    try:
        with masters_shown(params.values()):
            optimizer.load_state_dict(loaded.optimizer if split is None else split.state_dict)
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{path / 'optimizer.pt'} does not fit this run's optimizer ({e}).") from None
    if tier is not None:
        checkpoint_tier.write_tier(split, loaded.moments, tier)
    rng_state.restore(loaded.rng)
    return loaded.trainer


def load(path: str | Path, model: torch.nn.Module, optimizer, pin: bool = False) -> dict[str, Any]:
    """Restore weights, optimizer state and RNG from a checkpoint; returns the trainer state."""
    return apply(read(path), model, optimizer, pin)
