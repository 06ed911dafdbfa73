"""Checkpoints of a run whose optimizer keeps its large parameters' state in a state tier
(runtime/state_tier.py: fp32 masters and AdamW moments in files on NVMe): written and read one
tensor or one shard at a time, so a checkpoint never holds more than one shard (MAX_SHARD_SIZE)
of masters or moments in RAM, however large the model.

What differs from format.py's (the atomic protocol, trainer.json and rng.json are the same):
  model.safetensors     the same files, byte for byte, as without the tier: the shard plan is made
                        from names, shapes and dtypes (meta tensors), then each shard's masters are
                        read (through the tier where they live there), checked finite, written, freed
  optimizer.pt          param_groups and state without the tiered parameters' moments (their step
                        kept), and "moments": "optimizer-moments"
  optimizer-moments-0000k-of-0000n.safetensors
                        the tiered parameters' moments, keyed "{index}.exp_avg" / "{index}.exp_avg_sq"
                        (index: the parameter's number in optimizer.pt's param_groups), at most
                        MAX_SHARD_SIZE per file (always numbered, even when there is one)
Reading checks the moment shards tensor by tensor (names, shapes, finite values) and keeps only
their headers; `ShardedMasters` does the same for the weights. Applying writes each tiered
moment into the tier one tensor at a time, or, for an optimizer without a tier (the model fits
in RAM then), puts them into the state dict it loads: a checkpoint saved with the tier resumes
without it, and the reverse.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ...errors import TrainingError
from ...runtime.store import master_entry, master_weight
from ..model.hf_folder import MAX_SHARD_SIZE, WEIGHTS_INDEX
from .files import CheckpointError, damaged, elsewhere, finite

MOMENTS = "optimizer-moments"           # the moment shards' name; optimizer.pt's "moments" says it
MOMENT_NAMES = ("exp_avg", "exp_avg_sq")
_KEY = re.compile(r"^(\d+)\.(exp_avg|exp_avg_sq)$")
_LOW = (torch.bfloat16, torch.float16)


def tier_of(optimizer):
    """The optimizer's state tier, or None (torch's optimizers and a HostAdamW without one)."""
    return getattr(optimizer, "tier", None)


def _split(meta: dict[str, torch.Tensor], prefix: str, numbered: bool = False):
    """huggingface_hub's shard plan of `meta` (meta tensors: sizes only, nothing allocated), as
    save_pretrained makes it; `numbered`: name a single file -00001-of-00001 as well."""
    from huggingface_hub import split_torch_state_dict_into_shards
    split = split_torch_state_dict_into_shards(meta, filename_pattern=prefix + "{suffix}.safetensors",
                                               max_shard_size=MAX_SHARD_SIZE)
    files = dict(split.filename_to_tensors)
    if numbered and not split.is_sharded:
        files = {f"{prefix}-00001-of-00001.safetensors": names for names in files.values()}
    return split, files


def _master_dtype(p: torch.nn.Parameter, tier) -> torch.dtype:
    """The dtype master_weight(p) returns: fp32 for a low-precision weight with a master (in RAM
    or in the tier), else the parameter's own."""
    if p.dtype in _LOW and (master_entry(p) is not None or (tier is not None and p in tier)):
        return torch.float32
    return p.dtype


def _from_tier(step: int, read, *args) -> torch.Tensor:
    """`read(*args)`, a tier I/O error turned into one that says the checkpoint is not written."""
    try:
        return read(*args)
    except OSError as e:   # (tier_io.TierIOError names the file, offset and errno)
        raise CheckpointError(f"checkpoint-{step} is not written: reading the state tier failed ({e}); the previous "
                              "checkpoints are intact. Check the tier's drive, then resume from the last checkpoint."
                              ) from None


def write_weights(model: torch.nn.Module, tier, folder: Path, step: int, trainable_only: bool = False) -> None:
    """model.safetensors (or its shards and index) as model/hf_folder.write_weights writes them for
    the same model, holding one shard of masters at a time; non-finite weights raise TrainingError
    (the caller removes the partial folder)."""
    sources: dict[str, torch.nn.Parameter | torch.Tensor] = {
        name: p for name, p in model.named_parameters() if p.requires_grad or not trainable_only}
    if not trainable_only:   # persistent buffers, for from_pretrained (small: kept as they are)
        aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        sources.update({name: t.detach().contiguous() for name, t in model.state_dict().items()
                        if name not in aliases})
    meta = {name: torch.empty(s.shape, dtype=_master_dtype(s, tier), device="meta")
            if isinstance(s, torch.nn.Parameter) else s for name, s in sources.items()}
    split, files = _split(meta, "model")
    for filename, names in files.items():
        shard = {}
        for name in names:
            s = sources[name]
            shard[name] = (_from_tier(step, master_weight, s).detach().contiguous()
                           if isinstance(s, torch.nn.Parameter) else s)
        if bad := finite(shard):   # never write a checkpoint that cannot be trained from
            raise TrainingError(
                f"step {step}: the weights {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} are not finite, so "
                f"checkpoint-{step} is not written; the previous checkpoints are intact. Lower learning_rate (or "
                "raise warmup_steps) and resume from the last checkpoint.")
        save_file(shard, str(folder / filename))
        del shard
    if split.is_sharded:
        index = {"metadata": {"total_parameters": sum(t.numel() for t in meta.values()), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _by_index(saved_groups: list, optimizer) -> dict[int, torch.nn.Parameter]:
    """A state dict's parameter numbers -> this optimizer's parameters (as torch's load_state_dict
    pairs them: group by group, in order)."""
    saved = [i for g in saved_groups for i in g.get("params", ())]
    ours = [p for g in optimizer.param_groups for p in g["params"]]
    return dict(zip(saved, ours))


def write_optimizer(optimizer, folder: Path, step: int) -> None:
    """optimizer.pt without the tiered parameters' moments, and the moment shards, one shard of
    moments in RAM at a time (read from the tier, checked finite)."""
    tier = tier_of(optimizer)
    state = optimizer.state_dict(moments=False)
    by_index = _by_index(state["param_groups"], optimizer)
    # the tiered parameters that have been updated (an untouched one has no state and zero moments)
    tiered = {i: p for i, p in by_index.items() if p in tier and i in state["state"]}
    meta = {f"{i}.{n}": torch.empty(p.shape, dtype=torch.float32, device="meta")
            for i, p in tiered.items() for n in MOMENT_NAMES}
    if meta:
        _, files = _split(meta, MOMENTS, numbered=True)
        for filename, keys in files.items():
            shard = {}
            for key in keys:
                i, name = key.split(".", 1)
                shard[key] = _from_tier(step, tier.read, tiered[int(i)], name).contiguous()
            if bad := finite(shard):
                raise TrainingError(
                    f"step {step}: the optimizer state {', '.join(bad[:3])} is not finite, so checkpoint-{step} is not "
                    "written; the previous checkpoints are intact. Lower learning_rate (or raise warmup_steps) and "
                    "resume from the last checkpoint.")
            save_file(shard, str(folder / filename))
            del shard
        state["moments"] = MOMENTS
    torch.save(state, folder / "optimizer.pt")


def estimate_tiered_bytes(optimizer) -> int:
    """The bytes of the tiered moments a checkpoint writes (not in optimizer.state: two fp32
    tensors per updated tiered parameter)."""
    tier = tier_of(optimizer)
    if tier is None:
        return 0
    return sum(8 * p.numel() for p, s in optimizer.state.items() if s and p in tier)


# -- reading --------------------------------------------------------------------------------------

def _open(path: Path, name: str):
    try:
        return safe_open(str(path / name), framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise damaged(path, name, str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def _tensor(path: Path, name: str, f, key: str) -> torch.Tensor:
    try:
        return f.get_tensor(key)
    except (SafetensorError, OSError, ValueError) as e:
        raise damaged(path, name, f"{key}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


class ShardedMasters(Mapping):
    """A checkpoint's weights, checked tensor by tensor and read again when asked: name -> tensor
    (one read per lookup), `shape(name)` from the headers, `items()` in file order (one tensor in
    RAM at a time). `read(stream=True)` returns it instead of a dict of every weight."""

    def __init__(self, path: Path, files: list[str]):
        self.path, self.files = path, files
        self._where: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name in files:
            with _open(path, name) as f:
                for key in f.keys():
                    t = _tensor(path, name, f, key)
                    if bad := finite({key: t}):
                        raise CheckpointError(f"{path / name}: the weights {bad[0]} are not finite (NaN or inf), so "
                                              "training from it would train nothing. " + elsewhere(path))
                    self._where[key] = (name, tuple(t.shape))
                    del t

    def shape(self, key: str) -> tuple[int, ...]:
        return self._where[key][1]

    def __getitem__(self, key: str) -> torch.Tensor:
        name, _ = self._where[key]
        with _open(self.path, name) as f:
            return _tensor(self.path, name, f, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def items(self):   # file by file: each file opened once
        for name in self.files:
            with _open(self.path, name) as f:
                for key in f.keys():
                    yield key, _tensor(self.path, name, f, key)


@dataclass
class Moments:
    """The moment shards of a checkpoint saved with a tier, checked: their files and, per key
    ("{index}.exp_avg"), the file and shape. No tensor is kept."""
    path: Path
    files: list[str]
    where: dict[str, tuple[str, tuple[int, ...]]]

    def read(self, keys) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, tensor) for `keys`, one tensor at a time, each file opened once."""
        wanted = set(keys)
        for name in self.files:
            todo = [k for k, (f, _) in self.where.items() if f == name and k in wanted]
            if todo:
                with _open(self.path, name) as f:
                    for key in todo:
                        yield key, _tensor(self.path, name, f, key)


def moment_files(path: Path, prefix) -> list[str]:
    """The moment shards optimizer.pt's "moments" names: prefix-0000k-of-0000n, every k present."""
    if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix) or prefix.startswith("."):
        raise damaged(path, "optimizer.pt", f"its moments entry {prefix!r} is not a file name of the checkpoint")
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d{{5}})-of-(\d{{5}})\.safetensors$")
    found = sorted((int(m.group(1)), int(m.group(2)), f.name) for f in path.iterdir() if (m := pattern.match(f.name)))
    counts = {n for _, n, _ in found}
    if not found or len(counts) != 1 or [k for k, _, _ in found] != list(range(1, counts.pop() + 1)):
        raise CheckpointError(f"{path} is not a complete checkpoint (the moment shards {prefix}-0000k-of-0000n."
                              f"safetensors are missing or do not match: found {[f for _, _, f in found][:4]}). "
                              + elsewhere(path))
    return [f for _, _, f in found]


def read_moments(path: Path, optimizer: dict) -> Moments:
    """Check the moment shards of optimizer.pt's state dict tensor by tensor: known keys of
    parameters with a state, no moment twice, fp32, finite; every parameter's moments somewhere."""
    files = moment_files(path, optimizer["moments"])
    state, where = optimizer["state"], {}
    for name in files:
        with _open(path, name) as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    raise damaged(path, name, f"it holds {key!r}, not a moment of the optimizer state")
                index, moment = int(m.group(1)), m.group(2)
                if not isinstance(state.get(index), dict) or moment in state[index] or key in where:
                    raise damaged(path, name, f"{key}: no such parameter in optimizer.pt's state, or its moment "
                                               "is there twice")
                t = _tensor(path, name, f, key)
                if t.dtype != torch.float32:
                    raise damaged(path, name, f"{key} is {t.dtype}, not float32")
                if bad := finite({key: t}):
                    raise CheckpointError(f"{path / name}: the optimizer state {bad[0]} is not finite. "
                                          + elsewhere(path))
                where[key] = (name, tuple(t.shape))
                del t
    for index, s in state.items():
        lost = [n for n in MOMENT_NAMES if isinstance(s, dict) and n not in s and f"{index}.{n}" not in where]
        if lost:
            raise damaged(path, "optimizer.pt", f"parameter {index}'s {lost[0]} is neither in it nor in {files[0]}")
    return Moments(path, files, where)


# -- applying -------------------------------------------------------------------------------------

@dataclass
class OptimizerLoad:
    """What `apply` loads into an optimizer, split by where it goes: `state_dict` for
    load_state_dict (with every moment of a parameter not in this run's tier), and the tiered
    parameters' moments, still in the checkpoint (`from_files`) or already read (`in_ram`, from
    an optimizer.pt that holds them all)."""
    state_dict: dict
    in_ram: dict[torch.nn.Parameter, dict[str, torch.Tensor]]
    from_files: dict[str, torch.nn.Parameter]
    untouched: list[torch.nn.Parameter]   # tiered, with no state in the checkpoint: zero moments


def plan_optimizer(saved: dict, moments: Moments | None, optimizer, where: Path) -> OptimizerLoad:
    """Split a checkpoint's optimizer state for this run's optimizer (tier or not), checking the
    moment shards' parameters and shapes before anything is set. Reads the moment tensors of
    parameters outside the tier (all of them without one: the model fits in RAM then)."""
    tier = tier_of(optimizer)
    by_index = _by_index(saved["param_groups"], optimizer)
    state = {k: dict(s) if isinstance(s, dict) else s for k, s in saved["state"].items()}
    in_ram, from_files = {}, {}
    if tier is not None:   # (optimizer.pt of a run without the tier: the tiered moments are in it)
        for k, s in state.items():
            p = by_index.get(k)
            if p is not None and p in tier and isinstance(s, dict):
                in_ram[p] = {n: s.pop(n) for n in MOMENT_NAMES if n in s}
    if moments is not None:
        to_state = []
        for key, (_, shape) in moments.where.items():
            index, name = key.split(".", 1)
            p = by_index.get(int(index))
            if p is None or tuple(p.shape) != shape:
                raise CheckpointError(f"{where} does not fit this run's optimizer ({key} has shape {shape}, "
                                      f"the parameter {tuple(p.shape) if p is not None else 'does not exist'}).")
            if tier is not None and p in tier:
                from_files[key] = p
            else:
                to_state.append(key)
        for key, t in moments.read(to_state):
            index, name = key.split(".", 1)
            state[int(index)][name] = t
    untouched = [p for k, p in by_index.items() if tier is not None and p in tier and k not in state]
    return OptimizerLoad({"state": state, "param_groups": saved["param_groups"]}, in_ram, from_files, untouched)


def write_tier(plan: OptimizerLoad, moments: Moments | None, tier) -> None:
    """The tiered parameters' moments into the tier, one tensor at a time (after load_state_dict,
    which leaves the tier's moments alone when the state dict lacks them)."""
    for p, values in plan.in_ram.items():
        tier.write(p, **values)
    if moments is not None:
        for key, t in moments.read(plan.from_files):
            tier.write(plan.from_files[key], **{key.split(".", 1)[1]: t})
            del t
    for p in plan.untouched:   # no update yet: AdamW's zero moments, whatever the tier held
        zero = torch.zeros(p.shape, dtype=torch.float32)
        tier.write(p, exp_avg=zero, exp_avg_sq=zero)
    tier.synchronize()
