"""Backend options: `torch.compile(model, backend="megatrain", options={...})`.

Every key is declared here with its type and meaning; unknown keys are rejected with the
closest valid key suggested, so a typo never silently falls back to a default.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field

import torch

from .errors import ConfigError


_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MIB": 2**20,
          "G": 1e9, "GB": 1e9, "GIB": 2**30, "T": 1e12, "TB": 1e12, "TIB": 2**40}


def parse_bytes(value) -> int:
    """1024, "80GiB", "75GB", "1.5T" -> bytes."""
    if isinstance(value, (int, float)) and value > 0:
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{value!r} is not a byte size; write e.g. 80GiB, 75GB or 1.5T.")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


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
    #: measured here, or a JSON profile path). It picks how far ahead weights are prefetched
    #: (at most slots - 1). None: on CUDA, the built-in profile matching the GPU's name, if any;
    #: on the CPU, no cost model (always prefetch slots - 1 ahead, as the accelerator would).
    hardware: str | None = None
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
    #: Graph passes to skip, by name (for bisecting a numerical or scheduling problem).
    disable_passes: tuple[str, ...] = ()
    #: Print each pass's before/after op counts.
    debug_passes: bool = False

    @classmethod
    def from_mapping(cls, mapping: dict | None) -> "Options":
        mapping = dict(mapping or {})
        names = {f.name for f in dataclasses.fields(cls)}
        for key in mapping:
            if key not in names:
                close = difflib.get_close_matches(key, sorted(names), n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"unknown megatrain option {key!r}.{hint} Valid options: {', '.join(sorted(names))}."
                )
        if "disable_passes" in mapping:
            dp = mapping["disable_passes"]
            mapping["disable_passes"] = (dp,) if isinstance(dp, str) else tuple(dp)
        opts = cls(**mapping)
        opts.validate()
        return opts

    @property
    def device_budget_bytes(self) -> int | None:
        return parse_bytes(self.device_budget) if self.device_budget is not None else None

    def validate(self) -> None:
        if self.device_budget is not None:
            self.device_budget_bytes  # raises ConfigError when malformed
        if self.hardware is not None:
            from pathlib import Path

            from .hardware import NAMES, Hardware
            if not isinstance(self.hardware, Hardware) and self.hardware not in NAMES and not Path(self.hardware).is_file():
                raise ConfigError(f"option hardware={self.hardware!r}: use one of {', '.join(NAMES)} "
                                  "or the path of a JSON hardware profile.")
        if self.kernels not in ("auto", "triton", "none"):
            raise ConfigError(f"option kernels={self.kernels!r}: use 'auto' (Triton kernels on CUDA), 'triton' or "
                              "'none'.")
        if self.lowering not in ("auto", "eager", "inductor"):
            raise ConfigError(f"option lowering={self.lowering!r}: use 'auto' (measured per body on CUDA), 'eager' "
                              "or 'inductor'.")
        if self.logits not in ("keep", "drop"):
            raise ConfigError(f"option logits={self.logits!r}: use 'keep' (return the logits) or 'drop' (fused LM "
                              "head + loss, logits=None in the output).")
        if self.recompute not in ("layer", "selective"):
            raise ConfigError(f"option recompute={self.recompute!r}: use 'layer' (least memory) or 'selective' "
                              "(keep matmul/attention outputs, recompute only elementwise ops).")
        if not isinstance(self.slots, int) or self.slots < 1:
            raise ConfigError(f"option slots={self.slots!r}: need an integer >= 1 (2 overlaps one transfer with compute).")
        try:
            dev = torch.device(self.device)
        except RuntimeError as e:
            raise ConfigError(f"option device={self.device!r} is not a torch device: {e}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("option device='cuda' but no CUDA device is available; use device='cpu'.")
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"option device={self.device!r}: megatrain runs on 'cuda' or 'cpu'.")

    def hardware_profile(self):
        """The Hardware the cost model uses, or None."""
        from .hardware import BUILTIN, load_hardware
        if self.hardware is not None:
            return load_hardware(self.hardware, torch.float32 if self.torch_device.type == "cpu" else torch.bfloat16)
        if self.torch_device.type == "cuda":
            gpu = torch.cuda.get_device_name(self.torch_device).lower()
            return next((hw for name, hw in BUILTIN.items() if name in gpu), None)
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
