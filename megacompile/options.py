"""Backend options: `torch.compile(model, backend="megatrain", options={...})`.

Every key is declared here with its type and meaning; unknown keys are rejected with the
closest valid key suggested, so a typo never silently falls back to a default, and every value is
type-checked (`_checked`): booleans are True/False only, `disable_passes` names real passes
(`pass_names()`), each error reads `option NAME=VALUE (TYPE): expected ...`.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError, ContractError
from .units import parse_bytes  # noqa: F401 (API: megacompile.options.parse_bytes)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.lru_cache(maxsize=None)
def pass_names() -> tuple[str, ...]:
    """Every graph pass the backend runs, by name, in pipeline order (what `disable_passes` takes):
    passes/pipelines.py's DYNAMO_PASSES, JOINT_PASSES and DIRECTION_PASSES."""
    from .passes import pipelines
    return pipelines.pass_names()


_BOOL_OPTIONS = ("debug_residency", "recompute_head", "routed_experts", "overlap_grads", "host_arena", "debug_passes")
#: string options: each accepted value and what it means (None: nothing to add)
_CHOICES = {
    "recompute": {"layer": "least memory", "selective": "keep matmul/attention outputs, recompute only "
                                                        "elementwise ops"},
    "kernels": {"auto": "Triton kernels on CUDA", "triton": None, "none": None},
    "logits": {"keep": "return the logits", "drop": "fused LM head + loss, logits=None in the output"},
    "lowering": {"auto": "measured per body on CUDA", "eager": None, "inductor": None},
    "dynamo_regions": {"auto": "when the decoder has 8 layers or more", "always": None, "never": None},
    "layer_regions": {"auto": "when the decoder has at least 3 more layers than layer kinds", "always": None,
                      "never": None},
    "offload_checkpoints": {"auto": "when the step does not fit device_budget with them on the device",
                            "always": None, "never": None},
    "reload_checkpoints": {"auto": "ahead, unless the step does not fit device_budget otherwise",
                           "ahead": "one segment ahead of the backward that reads it (overlapped)",
                           "late": "just before that backward: one checkpoint less on the device"},
    "attention": {"segments": "no seq x seq mask; transformers' attention where it cannot run",
                  "transformers": "the model's own attention implementation, as set"},
    "data_parallel": {"auto": "when torch.distributed is initialised with more than one rank", "off": None},
    "grad_reduce": {"mean": "gradients averaged over the ranks (DDP, FSDP)",
                    "sum": "summed (a loss already divided by the global token count)"},
}


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _bad(name: str, value, expected: str) -> ConfigError:
    return ConfigError(f"option {name}={_short(value)} ({type(value).__name__}): expected {expected}.")


def _one_of(choices: dict) -> str:
    items = [repr(v) + (f" ({why})" if why else "") for v, why in choices.items()]
    return ", ".join(items[:-1]) + " or " + items[-1]


def _checked(name: str, value):
    """`value` for option `name`, normalized (disable_passes -> tuple, a torch.device -> str), or a
    ConfigError: `option NAME=VALUE (TYPE): expected ...`."""
    if name in _BOOL_OPTIONS:
        if not isinstance(value, bool):
            raise _bad(name, value, "True or False")
        return value
    if name == "layer_regions" and isinstance(value, bool):   # (its values before "auto")
        value = "always" if value else "never"
    if name in _CHOICES:
        if not isinstance(value, str) or value not in _CHOICES[name]:
            raise _bad(name, value, _one_of(_CHOICES[name]))
        return value
    if name == "mlp_tiles":
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise _bad(name, value, "'auto' or an integer >= 1 (1: no tiling)")
    if name == "slots":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _bad(name, value, "an integer >= 1 (2 overlaps one transfer with compute)")
        return value
    if name == "plan_ranks":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _bad(name, value, "an integer >= 1 (ranks per node to plan for)")
        return value
    if name == "device":
        expected = "'cuda', 'cuda:N' or 'cpu' (a string or a torch.device)"
        if isinstance(value, torch.device):
            value = str(value)
        if not isinstance(value, str):
            raise _bad(name, value, expected)
        try:
            dev = torch.device(value)
        except (RuntimeError, ValueError, TypeError):
            raise _bad(name, value, expected) from None
        if dev.type not in ("cpu", "cuda"):
            raise _bad(name, value, expected + ": megatrain runs on CUDA or the CPU")
        return value
    if name == "device_budget":
        expected = "None, a positive int of bytes or a size string such as '80GiB', '75GB' or '1.5T'"
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 1:
                raise _bad(name, value, expected)
            return value
        if not isinstance(value, str):
            raise _bad(name, value, expected)
        try:
            nbytes = parse_bytes(value)
        except ConfigError:
            raise _bad(name, value, f"{expected} ({value!r} is not a byte size)") from None
        if nbytes < 1:
            raise _bad(name, value, f"{expected} ({value!r} is less than one byte)")
        return value
    if name == "hardware":
        from .hardware import NAMES, Hardware, load_hardware
        expected = f"None, one of {', '.join(map(repr, NAMES))}, the path of a JSON hardware profile, or a Hardware"
        if value is None:
            return None
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, str) and value in NAMES:
            return value
        if isinstance(value, Hardware) or (isinstance(value, str) and Path(value).is_file()):
            try:
                load_hardware(value)   # a profile's keys and rates are checked now, not at the first step
            except ConfigError as e:
                raise ConfigError(f"option hardware={_short(value)}: {e}") from None
            return value
        if isinstance(value, str) and Path(value).is_dir():
            raise _bad(name, value, f"{expected} ({value!r} is a directory)")
        raise _bad(name, value, expected)
    if name == "disable_passes":
        items = (value,) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(p, str) for p in items):
            raise _bad(name, value, "a pass name or a list of pass names (strings), e.g. ['dedupe_bodies']")
        valid = pass_names()
        for p in items:
            if p not in valid:
                close = difflib.get_close_matches(p, valid, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise _bad(name, value, f"pass names; {p!r} is not one: {hint}the passes are {', '.join(valid)}")
        from .passes.pipelines import check_pipelines
        try:
            check_pipelines(tuple(items))   # a later pass or the runtime reads what one of them writes
        except ContractError as e:
            raise ContractError(f"option disable_passes={list(items)!r}: {e}") from None
        return tuple(items)
    return value


@dataclass(frozen=True)
class Options:
    #: Where layer bodies run. "cuda" when available, else "cpu" (the CPU then plays the
    #: accelerator: same schedule, store and byte accounting, synchronous copies).
    device: str = field(default_factory=_default_device)
    #: Number of decoder-layer weight slots on the device (the running layer + prefetched ones).
    slots: int = 2
    #: Verify before every body that each weight it reads is resident (catches use-after-evict,
    #: which on a real accelerator would read freed memory).
    debug_residency: bool = False
    #: Recompute the head (final norm, LM head, loss) in the backward instead of keeping what the
    #: min-cut partitioner saves (typically the logits: batch x seq x vocab). Saves device memory
    #: at large vocabularies for one more LM-head matmul per step.
    recompute_head: bool = False
    #: "layer": the backward recomputes every layer from its saved input (least memory).
    #: "selective": also keep the outputs of in-layer matmuls and attention, so the backward only
    #: recomputes cheap elementwise ops; with `device_budget`, only as many as fit (those with
    #: the most recompute FLOPs per byte first).
    recompute: str = "layer"
    #: Device bytes the schedule may use (int bytes, or a string like "80GiB"/"75GB"); a schedule
    #: whose planned peak exceeds it is refused with the smallest budget that fits.
    device_budget: int | str | None = None
    #: Hardware profile for the schedule's cost model ("h200", "h100", "gh200", "a100", "cpu" =
    #: measured here, a JSON profile path, or a `hardware.Hardware`). It picks how far ahead
    #: weights are prefetched (at most slots - 1). None: on CUDA, the GPU's profile
    #: (`hardware.gpu_profile`: the built-in one whose name is a whole word of the device name, so
    #: a GH200 is never an H200; another GPU's rates measured on it); on the CPU, no cost model
    #: (always prefetch slots - 1 ahead, as the accelerator would).
    hardware: Any = None
    #: MoE: copy to the device only the experts the router picked for the batch (forward and
    #: backward), and only their gradients back. Exact. Costs one device-to-host read of the
    #: routing per MoE layer; pays off when batches leave experts idle.
    routed_experts: bool = False
    #: Fused Triton kernels for RMSNorm and SwiGLU (passes/fused_kernels.py): "triton" always,
    #: "none" never, "auto" on CUDA when triton is installed. On the CPU "triton" needs
    #: TRITON_INTERPRET=1 (Triton's interpreter, for tests); without it the ops run torch math.
    kernels: str = "auto"
    #: "keep": the compiled model returns its logits, as eager does. "drop": when the model
    #: computes its loss (called with `labels`), the LM head and the cross entropy run as one
    #: chunked op that never materialises the [tokens, vocab] logits (passes/fused_lm_loss.py),
    #: and the output's `logits` is None. `megatrain train` uses "drop".
    logits: str = "keep"
    #: Move each segment's gradients to the host and add them into `param.grad` off the compute
    #: path (D2H stream + one host thread, runtime/grad_offload.py), overlapping the next
    #: segment's backward. Exact either way; False does it synchronously (for bisecting).
    overlap_grads: bool = True
    #: How segment bodies run (runtime/lowering.py): "eager" (their aten ops one by one),
    #: "inductor" (compiled by Inductor: Triton on CUDA, C++ on the CPU), "auto" (on CUDA each
    #: distinct body is compiled and timed both ways and the faster kept; on the CPU eager).
    lowering: str = "auto"
    #: Keep each segment's host transfer copies in one arena row per layer, laid out as its device
    #: slot buffer (runtime/host_arena.py): one copy per fetch, and on CUDA one pinned
    #: registration per layer kind instead of pinning every tensor. False: per-tensor (bisecting).
    host_arena: bool = True
    #: "segments": select megatrain's segment attention (megacompile/attention.py) before Dynamo
    #: traces the model, so padding and packed documents never build a [batch, seq, seq] mask;
    #: models it cannot run (logit softcapping, attention sinks) keep their own attention.
    #: "transformers": keep the implementation the model was loaded with.
    attention: str = "segments"
    #: Sequence tiles of each layer's token-wise tail (passes/tile_mlp.py): the output projection,
    #: the residual adds, the norm before the MLP and the MLP run tile by tile, so their
    #: [tokens, intermediate] and [tokens, hidden] values exist one tile at a time, in the forward
    #: and the backward. An int (1: none), or "auto": none below a sequence of 32K tokens, else
    #: about intermediate/hidden tiles (more while a tile spans over 64K tokens); with
    #: `device_budget`, a step that does not fit is compiled again with 2x, 4x, ... the tiles and
    #: the fewest that fit are kept.
    mlp_tiles: Any = "auto"
    #: Layer checkpoints (the hidden states each layer's backward recomputes from) kept in host
    #: memory between the forward and the backward (passes/offload_checkpoints.py): each leaves
    #: the device after the next layer's forward has read it and comes back one segment before
    #: its backward, on the copy streams. "auto": only when the step would not fit
    #: `device_budget` with them on the device; "always"; "never".
    offload_checkpoints: str = "auto"
    #: When an offloaded layer checkpoint comes back (passes/offload_checkpoints.py): "ahead", one
    #: segment before the backward that reads it, its copy under that segment's compute (two
    #: checkpoints on the device during a layer's backward); "late", just before that backward
    #: (one: a [seq, hidden] value less at the peak, its copy not hidden: 16 GiB at 2M tokens of
    #: Llama-3-8B, ~0.3 s on PCIe 5 beside a layer backward of minutes); "auto": ahead, and late
    #: only when the step does not fit `device_budget` otherwise (after more sequence tiles).
    reload_checkpoints: str = "auto"
    #: Data parallelism over torch.distributed (megacompile/distributed.py): "auto" when a process
    #: group of more than one rank is initialised (torchrun): the node's ranks share one host copy
    #: of the state, each fetches its part of every layer and all-gathers the rest, gradients are
    #: reduce-scattered and each rank updates its part (use megacompile.HostAdamW). "off": none.
    data_parallel: str = "auto"
    #: How gradients combine over the ranks: "mean" (as DDP/FSDP: each rank's loss is a mean over
    #: its own batch) or "sum" (the loss is already divided by the global token count: megatrain
    #: train).
    grad_reduce: str = "mean"
    #: Compile as for this many data-parallel ranks per node without running (megatrain plan and
    #: inspect --gpus: the schedule shows the sharded fetches and the collectives). A run takes
    #: its ranks from the process group; setting this for a run is refused.
    plan_ranks: int = 1
    #: Trace each decoder-layer kind once (passes/layer_subgraphs.py): AOTAutograd differentiates
    #: and partitions one subgraph per kind instead of the whole depth (tiny Llama at 64 layers:
    #: first step 37 s -> 17 s). Where a region cannot be formed (shared blocks, mode switches,
    #: random ops, recompute: selective) the whole graph is traced, and the log says why. "auto":
    #: when the decoder has at least 3 more layers than it has kinds (below that a region's own
    #: trace costs what the layers it saves would: a 2-layer Llama's first step takes 2.5 s with
    #: them and 2.3 s without, an 8-layer one 3.7 s and 5.3 s); "always", "never" (True and False
    #: mean these two).
    layer_regions: str = "auto"
    #: Dynamo traces each decoder-layer kind once (megacompile/dynamo_regions.py): each layer's
    #: forward becomes a compile region keyed by its kind, and passes/inline_dynamo_regions.py puts
    #: the calls back in line, so the passes see the whole-depth graph. Where a layer's trace reads
    #: what differs between layers of one kind, the model is traced again whole (logged). "auto":
    #: for a decoder of 8 layers or more (below that the regions cost about what they save), and
    #: never with pass inline_dynamo_regions disabled.
    dynamo_regions: str = "auto"
    #: Graph passes to skip, by name (for bisecting a numerical or scheduling problem).
    disable_passes: tuple[str, ...] = ()
    #: Print each pass's before/after op counts.
    debug_passes: bool = False

    @classmethod
    def from_mapping(cls, mapping: Mapping | None) -> "Options":
        """Options from `torch.compile(..., options=mapping)` or a training config's compile keys.
        Every key and value is checked: a ConfigError names the option, what was given and what
        it accepts."""
        if mapping is None:
            mapping = {}
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"options={_short(mapping)} ({type(mapping).__name__}): expected a dict of option "
                              "names to values, e.g. options={'device': 'cpu', 'slots': 2}. Valid options: "
                              f"{', '.join(sorted(_FIELD_NAMES))}.")
        values = {}
        for key, value in mapping.items():
            if not isinstance(key, str):
                raise ConfigError(f"option name {_short(key)} ({type(key).__name__}): option names are strings. "
                                  f"Valid options: {', '.join(sorted(_FIELD_NAMES))}.")
            if key not in _FIELD_NAMES:
                close = difflib.get_close_matches(key, sorted(_FIELD_NAMES), n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"unknown megatrain option {key!r}.{hint} Valid options: {', '.join(sorted(_FIELD_NAMES))}."
                )
            values[key] = _checked(key, value)
        opts = cls(**values)
        opts.validate()
        return opts

    @property
    def device_budget_bytes(self) -> int | None:
        return parse_bytes(self.device_budget) if self.device_budget is not None else None

    def validate(self) -> None:
        """Check every field's type and value (ConfigError), and that a CUDA device exists."""
        for f in dataclasses.fields(self):
            _checked(f.name, getattr(self, f.name))
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"option device={self.device!r}: no CUDA device is available here; use device='cpu'.")
        if self.dynamo_regions == "always" and "inline_dynamo_regions" in self.disable_passes:
            raise ConfigError("option dynamo_regions='always' needs pass 'inline_dynamo_regions' (it puts the layer "
                              "calls Dynamo traced once per kind back in line): set dynamo_regions='auto' or "
                              "'never', or enable the pass.")

    def hardware_profile(self):
        """The Hardware the cost model uses: the `hardware` option's profile; without it, on CUDA
        the GPU's (`hardware.gpu_profile`: its built-in profile, matched by whole words of the
        device name, else its rates measured, else h100), on the CPU None (no cost model)."""
        from .hardware import gpu_profile, load_hardware
        if self.hardware is not None:
            return load_hardware(self.hardware, torch.float32 if self.torch_device.type == "cpu" else torch.bfloat16)
        if self.torch_device.type == "cuda":
            profile, why = gpu_profile(self.torch_device, torch.bfloat16)
            logging.getLogger("megacompile").info("schedule cost model: %s", why)   # which profile is assumed
            return profile
        return None

    @property
    def kernel_backend(self) -> str:
        """"triton" or "none": what `kernels` resolves to on this device."""
        if self.kernels != "auto":
            return self.kernels
        if self.torch_device.type != "cuda":
            return "none"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "none"
        return "triton"

    @property
    def torch_device(self) -> torch.device:
        dev = torch.device(self.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(Options))
