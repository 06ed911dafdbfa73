"""How many bytes of host RAM (and of NVMe, with the state tier) megatrain's store needs for a
model, by part: fp32 masters, AdamW moments, transfer copies, gradients, the process itself.

    host_bytes(llama_3_70b_on_meta, "cuda").total        # 18 B/param in RAM
    host_bytes(llama_3_70b_on_meta, "cuda", "moments")   # 10 B/param in RAM, 8 on NVMe

Counted from the model's parameters (on the meta device: nothing allocated). The planner
(plan.py), `inspect` and the trainer's preflight read it; it reads neither of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .ssd import SSD
from .tier_plan import PLACEMENTS, TIER_POOL_BYTES, min_numel
from .vlm import store_parameters

GiB = 2**30
#: host bytes the process needs besides the store (torch, CUDA context, model code, tokenizer)
PROCESS_OVERHEAD = {"cuda": 4 * GiB, "cpu": 1 * GiB}


@dataclass
class HostBytes:
    masters: int           # fp32 masters in RAM
    optimizer_state: int   # AdamW moments in RAM
    transfer_copy: int
    grads: int
    pinned: int            # part of transfer_copy (pinned on CUDA so copies are asynchronous)
    process_overhead: int
    ssd_masters: int = 0            # fp32 masters on NVMe (one copy)
    ssd_optimizer_state: int = 0    # AdamW moments on NVMe (one copy)
    tier_pool: int = 0              # RAM: the tier's bounce buffers (reads ahead, writes in flight)
    placement: str = "none"         # what went to NVMe (tier_plan.PLACEMENTS)

    @property
    def total(self) -> int:
        """Bytes of host RAM."""
        return (self.masters + self.optimizer_state + self.transfer_copy + self.grads + self.process_overhead
                + self.tier_pool)

    @property
    def ssd_total(self) -> int:
        """Bytes of disk: two slots of every extent (exact rollback of a speculative update)."""
        return 2 * (self.ssd_masters + self.ssd_optimizer_state)


def vision_device_bytes(model: torch.nn.Module, vision: str) -> int:
    """Device bytes of a VLM's vision side: its weights, and with `vision="train"` also its
    gradients and AdamW moments (updated on the device, in the weights' dtype)."""
    from .vlm import is_vlm, vision_modules
    if not is_vlm(model):
        return 0
    weights = sum(p.numel() * p.element_size() for m in vision_modules(model).values() for p in m.parameters())
    return weights * (4 if vision == "train" else 1)


def host_bytes(model: torch.nn.Module, device_type: str, placement: str = "none") -> HostBytes:
    """Host bytes of the store by part, with `placement`'s share of the tiered parameters'
    masters and moments on NVMe instead (tier_plan.py). RAM + NVMe bytes are the all-in-RAM bytes
    (plus the tier's bounce buffers). For llama-3-70b in bf16 on CUDA: "none" 18 B/param in RAM;
    "moments" 10 in RAM, 8 on NVMe; "all" 6 in RAM, 12 on NVMe (`ssd_total`: 24, two slots)."""
    from .errors import ConfigError
    if placement not in PLACEMENTS:
        raise ConfigError(f"placement={placement!r}: use one of {', '.join(PLACEMENTS)}.")
    masters = opt = transfer = grads = ssd_masters = ssd_opt = 0
    smallest = min_numel()
    for p in store_parameters(model):
        n = p.numel()
        low = p.dtype in (torch.bfloat16, torch.float16)
        tiered = placement != "none" and p.requires_grad and n >= smallest
        transfer += n * p.element_size() if low else 0
        if p.requires_grad or not low:
            # (an fp32 parameter is its own transfer copy: it stays in RAM under any placement)
            if tiered and low and placement == "all":
                ssd_masters += 4 * n
            else:
                masters += 4 * n
        if p.requires_grad:
            if tiered:
                ssd_opt += 8 * n
            else:
                opt += 8 * n
            grads += 4 * n
    if not transfer:  # fp32 model: the parameter is master and transfer copy
        pinned = masters if device_type == "cuda" else 0
    else:
        pinned = transfer if device_type == "cuda" else 0
    pool = min(TIER_POOL_BYTES, ssd_masters + ssd_opt)
    return HostBytes(masters, opt, transfer, grads, pinned, PROCESS_OVERHEAD.get(device_type, GiB),
                     ssd_masters, ssd_opt, pool, placement if ssd_masters + ssd_opt else "none")


def tier_placement(model: torch.nn.Module, device_type: str, host_ram: int, ssd: SSD | None,
                   want: str = "auto") -> str:
    """What goes to NVMe: "none" without an SSD profile; an explicit `want` as asked; for "auto"
    the first of none / moments / all whose host RAM total fits `host_ram` ("all" when none
    does: the caller's fit check then says by how much it misses)."""
    from .errors import ConfigError
    if want != "auto" and want not in PLACEMENTS:
        raise ConfigError(f"nvme placement {want!r}: use one of auto, {', '.join(PLACEMENTS)}.")
    if ssd is None:
        return "none"
    if want != "auto":
        return want
    return next((p for p in PLACEMENTS if host_bytes(model, device_type, p).total <= host_ram), "all")
