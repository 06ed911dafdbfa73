"""Will the run fit this machine? Asked of the model's architecture (meta device) before its
weights are loaded, so a run that cannot fit stops in seconds, not after loading 100 GB.

    choose_tier(model, device, config)     the NVMe state tier's placement and SSD profile (nvme keys)
    preflight(model, device, vision,       host RAM the store needs against what this process can use
              placement, ssd)              (MemAvailable or the cgroup limit of a container / Slurm job),
                                           with `placement`'s state on the SSD, whose free space is checked
    plan_check(model, config, device)      the step's device peak (megatrain plan) against the usable
                                           device memory: the GPU's free memory, or the RAM left on the CPU
Both refuse with a PreflightError (exit code 3) that says what to change.
"""
from __future__ import annotations

import dataclasses

import torch

from ..errors import CannotFitError
from ..ssd import SSD
from ..options import Options


class PreflightError(CannotFitError):
    """The run cannot fit this machine; the message says what to change."""


def choose_tier(model, device: torch.device, config) -> tuple[str, SSD | None]:
    """(placement, SSD profile) of the NVMe state tier: ("none", None) without `nvme`; else the
    profile (a `measure:` one measured now) with its paths set to the directories the tier's
    files go into, and `nvme_placement` (auto: the least that fits this process's host RAM)."""
    if config.nvme is None:
        return "none", None
    from ..hardware import host_memory_limit
    from ..ssd import load_ssd
    from ..host_store import tier_placement
    from .hparams.tier_keys import tier_dirs
    ssd = load_ssd(config.nvme)
    ssd = dataclasses.replace(ssd, paths=tier_dirs(config, ssd.paths))
    return tier_placement(model, device.type, host_memory_limit()[0], ssd, config.nvme_placement), ssd


def preflight(model, device: torch.device, vision: str = "frozen", placement: str = "none",
              ssd: SSD | None = None) -> str:
    """Host RAM the store needs with `placement`'s state on `ssd` against what the machine has,
    and the SSD bytes against the free space of its paths (refuses a run that cannot fit)."""
    from ..hardware import host_memory_limit
    from ..ssd import free_bytes
    from ..host_store import host_bytes, vision_device_bytes
    from ..units import fmt_bytes
    if placement != "none" and ssd is None:
        raise ValueError(f"preflight: placement {placement!r} needs the SSD profile (choose_tier's)")
    need = host_bytes(model, device.type, placement)
    have, why = host_memory_limit()
    params = sum(p.numel() for p in model.parameters())
    on_device = vision_device_bytes(model, vision)
    on_ssd = ""
    if need.ssd_total:
        on_ssd = (f"; NVMe ({ssd.name}, placement {need.placement}): masters {fmt_bytes(need.ssd_masters)}, AdamW "
                  f"{fmt_bytes(need.ssd_optimizer_state)}, {fmt_bytes(need.ssd_total)} on disk with the 2 slots, in "
                  f"{', '.join(ssd.paths)}")
    elif ssd is not None:
        on_ssd = f"; NVMe ({ssd.name}) not needed: everything fits in RAM"
    text = (f"[megatrain] {params / 1e6:.1f}M parameters; host RAM needed {fmt_bytes(need.total)} "
            f"(masters {fmt_bytes(need.masters)}, AdamW {fmt_bytes(need.optimizer_state)}, transfer copies "
            f"{fmt_bytes(need.transfer_copy)}, grads {fmt_bytes(need.grads)}"
            + (f", tier buffers {fmt_bytes(need.tier_pool)}" if need.tier_pool else "")
            + f") of {fmt_bytes(have)} usable ({why}){on_ssd}; device {device}"
            + (f" (vision tower, {vision}: {fmt_bytes(on_device)} on it)" if on_device else ""))
    if need.total > have:
        advice = ("put optimizer state on NVMe (nvme: gen5x4 or measure:DIR, nvme_paths: [DIR])" if ssd is None
                  else "nvme_placement: all" if need.placement != "all" else "")
        raise PreflightError(f"{text}: not enough host RAM. Free or add {fmt_bytes(need.total - have)}, "
                             + (f"{advice}, " if advice else "") + "train a smaller model, or freeze part of it.")
    if need.ssd_total:
        free = free_bytes(ssd.paths)
        if free < need.ssd_total:
            raise PreflightError(f"{text}: not enough free disk for the state tier: it needs "
                                 f"{fmt_bytes(need.ssd_total)} but {fmt_bytes(free)} is free in "
                                 f"{', '.join(ssd.paths)}. Free "
                                 f"{fmt_bytes(need.ssd_total - free)}, add drives to nvme_paths, or use more host RAM "
                                 "(nvme_placement: moments keeps the masters in RAM).")
    return text


def hardware_for(config, device: torch.device, dtype: torch.dtype):
    """(profile, sentence): what the plan simulates. The `hardware` option, else this machine's:
    the CPU's measured rates, or the GPU's exact built-in profile (or its measured rates), with
    the GPU's real free memory and this host's measured bandwidth and AdamW rate on the cores the
    process may use (host_probe.py: a pod's cgroup quota is not the datasheet's socket)."""
    from ..hardware import gpu_profile, load_hardware
    from ..host_probe import probed_host, with_host
    spec = config.megatrain.get("hardware")
    if spec is not None:
        hw = load_hardware(spec, dtype)
        return hw, f"hardware option: {hw.name} profile"
    if device.type == "cpu":   # memory figures only: rooflines instead of timing every body
        return dataclasses.replace(load_hardware("cpu", dtype), measure_ops=False), "this CPU, measured"
    profile, why = gpu_profile(device, dtype)
    free, _ = torch.cuda.mem_get_info(device)
    host = probed_host()
    return (dataclasses.replace(with_host(profile, host), device_memory_gib=free / 2**30),
            f"{why}; {host.describe()}")


#: plan_check's answers in this process, by everything they depend on (_plan_key): a resumed
#: run, or a second run of the same config in a notebook, does not plan again (a plan compiles
#: the model's first layers twice: on a small model, about a third of a short run's time)
_PLANNED: dict[str, str] = {}
#: config keys that do not change the plan (and differ between a run and its resume)
_NOT_PLANNED = ("output_dir", "resume_from_checkpoint", "overwrite_output_dir", "max_steps", "num_train_epochs",
                "save_steps", "save_total_limit", "logging_steps", "report_to", "seed")


def _plan_key(model, config, device: torch.device, placement, ssd) -> str:
    import json

    from ..hardware import host_memory_limit
    keys = {k: v for k, v in config.to_dict().items() if k not in _NOT_PLANNED}
    return json.dumps([model.config.to_json_string(), keys, str(device), placement, repr(ssd),
                       host_memory_limit()[0] >> 32], sort_keys=True, default=str)


def plan_check(model, config, device: torch.device, placement: str | None = None, ssd: SSD | None = None) -> str:
    """The device half of the preflight, from `megatrain plan`: the step's device peak at
    per_device_train_batch_size x cutoff_len against the usable device memory (on the CPU, the
    RAM left after the host store). Refuses a run that cannot fit, saying what to change. The
    step time counts gradient_accumulation_steps and the NVMe tier's exposed SSD time
    (`placement`, `ssd`: choose_tier's, which it calls when they are not given)."""
    if placement is None:
        placement, ssd = choose_tier(model, device, config)
    key = _plan_key(model, config, device, placement, ssd)
    if key not in _PLANNED:
        _PLANNED[key] = _plan_check(model, config, device, placement, ssd)
    return _PLANNED[key]


def _plan_check(model, config, device: torch.device, placement: str, ssd: SSD | None) -> str:
    from ..host_probe import host_bound
    from ..plan import plan_model
    from ..units import fmt_bytes
    from .model.finetuning import apply_finetuning
    dtype = next(model.parameters()).dtype
    batch = config.per_device_train_batch_size
    options = {k: v for k, v in config.megatrain.items()
               if k in ("recompute", "recompute_head", "logits", "mlp_tiles", "offload_checkpoints",
                        "reload_checkpoints", "attention")}
    hardware, why = hardware_for(config, device, dtype)
    plan = plan_model(model.config, hardware=hardware, seq=config.cutoff_len, batch=batch,
                      slots=config.megatrain.get("slots", 2), dtype=dtype, max_batch=batch, options=options,
                      vision=config.vision, prepare=lambda meta: apply_finetuning(meta, config), ssd=ssd,
                      placement=placement if ssd is not None else "auto", accum=config.gradient_accumulation_steps)
    est = next((b for b in plan.batches if b.batch == batch), None)   # None: not even batch 1 fits
    if est is None or est.device_peak_bytes > plan.device_capacity:
        raise PreflightError(f"[megatrain] plan: batch {batch} x cutoff_len {config.cutoff_len} does not fit the "
                             f"{fmt_bytes(plan.device_capacity)} usable on {device} ({why}). "
                             + " ".join(plan.problems) + " In the config: lower per_device_train_batch_size (raise "
                             "gradient_accumulation_steps to keep the effective batch) or cutoff_len.")
    host = plan.host.total + est.host_checkpoint_bytes
    if est.host_checkpoint_bytes and host > plan.host_ram:
        raise PreflightError(f"[megatrain] plan: batch {batch} x cutoff_len {config.cutoff_len} keeps "
                             f"{fmt_bytes(est.host_checkpoint_bytes)} of layer checkpoints in host RAM beside the "
                             f"store's {fmt_bytes(plan.host.total)}, {fmt_bytes(host)} in all, but "
                             f"{fmt_bytes(plan.host_ram)} is available. "
                             "In the config: lower per_device_train_batch_size or cutoff_len.")
    moved = (f"; layer checkpoints on the host: {fmt_bytes(est.host_checkpoint_bytes)}" if est.host_checkpoint_bytes
             else "")
    exposed = (f", of which {est.ssd_exposed_seconds:.2f} s waiting for the NVMe tier ({est.ssd_seconds:.2f} s of "
               "I/O)" if est.ssd_seconds else "")
    bound = host_bound(est)
    return (f"[megatrain] plan: device peak {fmt_bytes(est.device_peak_bytes)} at batch {batch} x cutoff_len "
            f"{config.cutoff_len} of {fmt_bytes(plan.device_capacity)} usable on {device} (resident weights "
            f"{fmt_bytes(plan.device_weight_bytes)}{moved}); about "
            f"{est.step_seconds:.2f} s/step{exposed} ({why})"
            + (f"\n[megatrain] plan: WARNING: {bound}" if bound and device.type != "cpu" else ""))


def check_device(config) -> torch.device:
    """The device the run trains on, refused now when it is not there."""
    return Options.from_mapping(config.megatrain).torch_device
