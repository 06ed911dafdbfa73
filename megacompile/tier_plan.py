"""The planner's side of the NVMe state tier (issue 18): what goes to disk, how much disk it
needs, and how much SSD time a step cannot hide.

Placement classes (the same for every tiered parameter):
    none     everything in RAM (18 B/param for a bf16 model)
    moments  AdamW's exp_avg and exp_avg_sq on NVMe (RAM: 10 B/param)
    all      the fp32 master too (RAM: 6 B/param). Only a bf16/fp16 trainable parameter has a
             master apart from its transfer copy; an fp32 model's parameter is both, so there
             "all" places what "moments" does.
Tiered parameters: the trainable store parameters with at least `min_numel()` elements (norms
and biases stay in RAM: few bytes, many small requests). The tier keeps two slots of every extent
on disk (a speculative update writes the other slot, so rollback is exact): the disk needed is
twice the state placed there.

Exposed SSD time per optimizer step (design §5.3), with R = W = the tiered bytes (each read and
written once per step, whatever the accumulation), t_r = R / read rate, t_w = W / write rate,
F and B one micro-batch's forward and backward, k micro-batches per step, M the state read ahead
(TIER_READ_AHEAD):

    exposed_read       = max(0, t_r - M / r - (B + F))   # the last layer's update is needed by the
                                                         # next forward's first fetch: the reads not
                                                         # already in the pool land in one micro-batch
    exposed_throughput = max(0, t_r + t_w - k (F + B))   # one set of drives does all the I/O per step
    exposed            = max(exposed_read, exposed_throughput)

It leaves out the host optimizer's own time as a window for I/O (conservative).
"""
from __future__ import annotations

import os

GiB = 2**30
PLACEMENTS = ("none", "moments", "all")
#: RAM of the tier's pool of 4 KiB-aligned bounce buffers (runtime/state_tier.py's default
#: pool_bytes), counted in the host total
TIER_POOL_BYTES = 256 * 2**20
#: M of the exposed-time bound: the state read ahead before it is needed. The runtime reads ahead
#: while at least half the pool is free (the other half takes the writes in flight).
TIER_READ_AHEAD = TIER_POOL_BYTES // 2


def min_numel() -> int:
    """Elements a trainable parameter needs to be tiered (the runtime's StateTier rule)."""
    from .runtime.state_tier import MIN_NUMEL
    return MIN_NUMEL


def ssd_seconds(tiered_bytes: int, read_gbps: float, write_gbps: float, read_ahead: int, forward: float,
                backward: float, accum: int) -> tuple[float, float]:
    """(SSD seconds per step, of which exposed) for `tiered_bytes` read and written once per
    step, at one micro-batch's `forward` / `backward` seconds and `accum` micro-batches.

        >>> ssd_seconds(100 * 10**9, 10.0, 5.0, 10 * 10**9, 2.0, 3.0, 4)   # t_r 10 s, t_w 20 s
        (30.0, 10.0)
    """
    if not tiered_bytes:
        return 0.0, 0.0
    t_r, t_w = tiered_bytes / (read_gbps * 1e9), tiered_bytes / (write_gbps * 1e9)
    exposed_read = max(0.0, t_r - min(read_ahead, tiered_bytes) / (read_gbps * 1e9) - (backward + forward))
    exposed_throughput = max(0.0, t_r + t_w - accum * (forward + backward))
    return t_r + t_w, max(exposed_read, exposed_throughput)


def ssd_capacity(ssd) -> tuple[int, str]:
    """(bytes the tier may use on `ssd`'s drives, where the figure comes from); 0: not known
    (a plan-only profile without paths or capacity_gib: not checked)."""
    from .errors import ConfigError
    from .ssd import free_bytes
    if ssd.capacity_gib:
        return int(ssd.capacity_gib * GiB), f"capacity_gib of profile {ssd.name}"
    if not ssd.paths:
        return 0, "not stated (give capacity_gib or paths in the profile to check it)"
    for p in ssd.paths:
        if not os.path.isdir(p):
            raise ConfigError(f"SSD profile {ssd.name}: path {p} is not an existing directory: create it or fix "
                              "the profile's paths.")
    return free_bytes(ssd.paths), f"free on {', '.join(ssd.paths)}"


def nvme_summary(plan) -> dict | None:
    """The NVMe block of a plan as plain values (to_dict's "nvme"; to_text prints it); None
    without a tier."""
    h = plan.host
    if plan.ssd is None:
        return None
    per_step = h.ssd_masters + h.ssd_optimizer_state
    seconds = per_step / (plan.ssd["read_gbps"] * 1e9) + per_step / (plan.ssd["write_gbps"] * 1e9)
    return {"profile": plan.ssd, "placement": h.placement, "masters": h.ssd_masters,
            "optimizer_state": h.ssd_optimizer_state, "disk_needed": h.ssd_total, "capacity": plan.ssd_capacity,
            "capacity_source": plan.ssd_capacity_source, "read_per_step": per_step, "written_per_step": per_step,
            "seconds_per_step": seconds, "tb_written_per_1000_steps": per_step * 1000 / 1e12,
            "pool": h.tier_pool, "read_ahead": TIER_READ_AHEAD, "accum": plan.accum}


def nvme_lines(plan, fmt) -> list[str]:
    """The plan's NVMe block as text lines (`fmt` formats bytes)."""
    s = nvme_summary(plan)
    if s is None:
        return []
    p = s["profile"]
    if s["placement"] == "none":
        return [f"NVMe state tier: profile {p['name']} (read {p['read_gbps']:.3g} GB/s, write {p['write_gbps']:.3g} "
                "GB/s): not used, everything fits in RAM (placement none)"]
    cap = s["capacity"]
    fits = "" if not cap else " (fits)" if s["disk_needed"] <= cap else " (DOES NOT FIT)"
    return [f"NVMe state tier: profile {p['name']} (read {p['read_gbps']:.3g} GB/s, write {p['write_gbps']:.3g} "
            f"GB/s), placement {s['placement']}",
            f"  fp32 master weights     {fmt(s['masters']):>12}   on NVMe",
            f"  optimizer state (AdamW) {fmt(s['optimizer_state']):>12}   on NVMe",
            f"  disk needed             {fmt(s['disk_needed']):>12}   2 slots per extent (exact rollback)"
            + (f" of {fmt(cap)} {s['capacity_source']}{fits}" if cap else f"; capacity {s['capacity_source']}"),
            f"  per step                read {s['read_per_step'] / 1e9:,.1f} GB + write "
            f"{s['written_per_step'] / 1e9:,.1f} GB = {s['seconds_per_step']:.1f} s of SSD time (once per optimizer "
            f"step, accum {s['accum']})",
            f"  endurance               {s['tb_written_per_1000_steps']:,.1f} TB written per 1000 steps"]
