"""`megatrain plan`: host RAM, device memory, the best batch size and the expected speed of a
model on a machine, without allocating the model.

How it is derived (nothing here is a hand formula for a particular architecture):
  1. The full model is built on the meta device; its parameters give the host store's bytes.
  2. Each decoder layer gets a kind: its parameters' names, shapes and dtypes plus its
     `layer_types` entry (sliding/full/linear attention). A model is captured with the shortest
     prefix of layers that holds every kind, at two batch sizes, through the real Dynamo capture,
     AOTAutograd partition and passes (as `megatrain inspect` does).
  3. From those captures, per segment: weight and gradient bytes, body cost (`cost_model.py`),
     the bytes each layer saves for the backward, and the memory plan's peak. All of these are
     linear in the batch size at a fixed sequence length, so two captures give every batch size.
  4. The full-depth schedule (every layer mapped to its kind's segments) is built by the same
     `build_steps` the schedule pass uses and simulated on the hardware profile
     (`simulate.py`); the CPU optimizer step follows it. With `overlap_optimizer=backward` and an
     unclipped norm it overlaps the backward instead: the backward is simulated again with a
     host stream that updates each segment's weights once its gradient offload has landed
     (runtime/adamw.py), giving `overlap_backward_seconds`; under the next forward (clipped
     steps, or overlap_optimizer=forward) the forward is simulated with each segment's prefetch
     waiting for its update: `overlap_forward_seconds`.
  5. Device peak = the captured plan's peak + the saved bytes of the layers the prefix left out
     (exact when the peak is where every saved activation is live: end of forward/start of
     backward; an upper bound otherwise).

Host bytes per trainable parameter of a bf16/fp16 model: fp32 master 4 + AdamW m and v 8 +
bf16 transfer copy 2 (pinned on CUDA) + fp32 gradient 4 = 18. An fp32 model's parameter is its
own master and transfer copy: 16. With an SSD profile (`ssd=`, `megatrain plan --nvme`) the
AdamW moments (placement "moments": 10 B/param in RAM) or the masters too ("all": 6) go to the
NVMe state tier; tier_plan.py has the placement classes and the exposed SSD time per step.
"""
from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .cost_model import optimizer_seconds
from .errors import CannotFitError
from .hardware import Hardware
from .host_probe import host_bound
from .ssd import SSD
from .passes.data_parallel import sharded
from .passes.schedule import build_steps, choose_lookahead
from .simulate import busy_seconds, makespan, optimizer_bytes, simulate
from .units import fmt_bytes
from .tier_plan import (PLACEMENTS, TIER_READ_AHEAD, nvme_lines, nvme_summary,
                        ssd_capacity, ssd_seconds)
from .plan_capture import Capture, PrefixModel, capture_prefix, layer_kinds
from .plan_memory import choose_memory, mlp_tiles
from .vlm import store_parameters
from .host_store import (PROCESS_OVERHEAD, HostBytes, host_bytes, tier_placement,  # noqa: F401 (API)
                         vision_device_bytes)

GiB = 2**30
#: device bytes not available to the schedule (CUDA context, allocator fragmentation)
DEVICE_RESERVE_FRACTION, DEVICE_RESERVE_BYTES = 0.05, 1 * GiB


class CannotPlanError(CannotFitError):
    """The model cannot train on this machine as asked; the message says what would fit."""


def _given(n: int) -> str:
    """A size the user gave (the CLI's --host-ram keeps their spelling: cli.GivenBytes) in their
    unit and in ours: "1T (931.32 GiB)"; a size they did not give, in ours."""
    given = getattr(n, "given", None)
    return f"{given} ({fmt_bytes(n)})" if given else fmt_bytes(n)


# -- layer kinds ----------------------------------------------------------------------------

@dataclass
class BatchEstimate:
    batch: int
    device_peak_bytes: int
    forward_seconds: float
    backward_seconds: float
    optimizer_seconds: float
    captured: bool = False       # device peak from a capture at this batch (else interpolated)
    # the step with HostAdamW overlapped (simulate.py's host stream), None where nothing moves:
    overlap_backward_seconds: float | None = None   # each segment updated as its gradients land
                                                    # (overlap_optimizer=backward, norm not clipped)
    overlap_forward_seconds: float | None = None    # the update under the next forward (overlap_optimizer=
                                                    # forward, or a clipped step under backward)
    host_checkpoint_bytes: int = 0   # layer checkpoints kept in host RAM between forward and backward
    accum: int = 1                   # micro-batches per optimizer step (forward/backward are one's)
    ssd_seconds: float = 0.0         # the NVMe tier's reads + writes per optimizer step
    ssd_exposed_seconds: float = 0.0   # of which not hidden under the compute (tier_plan.py)
    busy: dict[str, float] = field(default_factory=dict)   # seconds each stream works in one forward + backward

    @property
    def step_seconds(self) -> float:
        """One optimizer step: `accum` forwards and backwards, the optimizer, the exposed SSD time."""
        return (self.accum * (self.forward_seconds + self.backward_seconds) + self.optimizer_seconds
                + self.ssd_exposed_seconds)


@dataclass
class Plan:
    model: dict
    hardware: dict
    seq: int
    slots: int
    lookahead: dict[str, int]
    host: HostBytes
    host_ram: int
    device_capacity: int
    device_weight_bytes: int           # resident weights at the peak
    batches: list[BatchEstimate]       # estimates for batch 1, 2, 4, ... up to the largest that fits
    max_batch: int                     # largest batch that fits (0: none)
    best: BatchEstimate | None         # highest tokens/s among those that fit
    requested_batch: int | None = None
    problems: list[str] = field(default_factory=list)
    vision: str | None = None          # a VLM: how its vision side is trained (frozen / train)
    vision_bytes: int = 0              # device bytes of the VLM's vision side (outside the store)
    checkpoints_on_host: bool = False  # layer checkpoints offloaded (offload_checkpoints)
    mlp_tiles: int = 1                 # sequence tiles of each MLP (tile_mlp)
    attention_chunks: int = 0          # query chunks of each chunked attention (tile_attention; 0: none)
    late_reload: bool = False          # checkpoints reloaded just before their backward (reload_checkpoints)
    ssd: dict | None = None            # the SSD profile of the NVMe state tier (None: no tier asked)
    ssd_capacity: int = 0              # bytes the tier may use on it (0: not known, not checked)
    ssd_capacity_source: str = ""
    accum: int = 1                     # micro-batches per optimizer step
    gpus: int = 1                      # data parallel ranks on the node (the estimates are one GPU's)
    host_measured: str = ""            # the host's measured rates the plan used (host_probe.py), if any

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def shm_bytes(self) -> int:
        """/dev/shm the node's shared state needs with more than one GPU (0 with one)."""
        h = self.host
        return h.masters + h.optimizer_state + h.transfer_copy + h.grads if self.gpus > 1 else 0

    def tokens_per_s(self, b: BatchEstimate) -> float:
        """Tokens per second of the node (all its GPUs)."""
        return self.gpus * b.batch * b.accum * self.seq / b.step_seconds

    def to_dict(self) -> dict:
        d = {"version": 1, "model": self.model, "hardware": self.hardware, "seq": self.seq, "slots": self.slots,
             "lookahead": self.lookahead,
             "host": {**asdict(self.host), "total": self.host.total, "ssd_total": self.host.ssd_total},
             "host_ram": self.host_ram, "device_capacity": self.device_capacity,
             "device_weight_bytes": self.device_weight_bytes, "max_batch": self.max_batch,
             "vision": self.vision, "vision_bytes": self.vision_bytes,
             "checkpoints_on_host": self.checkpoints_on_host, "mlp_tiles": self.mlp_tiles,
             "attention_chunks": self.attention_chunks,
             "late_reload": self.late_reload,
             "accum": self.accum, "gpus": self.gpus, "shm_bytes": self.shm_bytes, "nvme": nvme_summary(self),
             "fits": self.fits, "problems": self.problems, "host_measured": self.host_measured or None,
             "host_bound": host_bound(self.best) if self.best else None,
             "batches": [{**asdict(b), "step_seconds": b.step_seconds, "tokens_per_s": self.tokens_per_s(b)}
                         for b in self.batches]}
        d["best_batch"] = self.best.batch if self.best else None
        return d


def plan_model(source, *, hardware: Hardware, host_ram: int | None = None, seq: int = 4096,
               batch: int | None = None, slots: int = 2, dtype: torch.dtype = torch.bfloat16,
               max_batch: int = 4096, options: dict | None = None, vision: str = "frozen",
               prepare=None, ssd: SSD | None = None, placement: str = "auto", accum: int = 1,
               gpus: int = 1, progress=None, memo=None) -> Plan:
    """Plan training `source` (preset, config.json, model directory or a transformers config) on
    `hardware`, with megatrain compile `options` (default as `megatrain train` compiles: the
    loss fused with the LM head, `logits="drop"`). For a VLM, `vision` says whether its vision
    tower is frozen or trained (megacompile/vlm.py). `prepare(meta_model)`, if given, runs before
    anything is counted: a train config's finetuning_type freezing weights (train/finetuning.py).
    `ssd` (ssd.load_ssd) plans the NVMe state tier: `placement` auto picks the first of
    none / moments / all that fits the host RAM (tier_placement); every batch then carries the
    SSD seconds of an optimizer step of `accum` micro-batches and the part of them exposed.
    `gpus` > 1 plans data parallelism on one node (passes/data_parallel.py): every estimate is
    one GPU's step at its per-device batch, with its part of each fetch over PCIe, the
    all-gathers and fp32 reduce-scatters over the peer links (`peer_gbps`), the node's host
    optimizer doing the one-GPU work; the host holds one copy of the state and a process per GPU.
    `progress(text)`, if given, hears each capture as it starts compiling (the CLI: on stderr),
    since a long sequence's captures take tens of seconds (one read from the compile cache,
    disk_cache.py, is not said). `memo` (plan_compare.PlanMemo) shares the meta model and the
    captures between plans of one model on several machines."""
    options = {"logits": "drop", **(options or {})}
    started = time.monotonic()

    def capture(b: int, opts: dict, why: str) -> Capture:
        if memo is not None:
            return memo.capture(config, prefix_len, b, seq, slots, dtype, hardware, opts)
        def announce():
            progress(f"[megatrain] plan: compiling the first {prefix_len} layer(s) at batch {b} x seq {seq}{why} "
                     f"({time.monotonic() - started:.0f} s so far) ...")
        return capture_prefix(config, prefix_len, b, seq, slots, dtype, hardware, opts,
                              announce if progress is not None else None)
    from .errors import ConfigError
    from .meta_model import build_meta_model, check_positive
    from .vlm import VISION_MODES, is_vlm
    if vision not in VISION_MODES:
        raise ConfigError(f"vision={vision!r}: use one of {', '.join(VISION_MODES)}.")
    check_positive(seq=seq, batch=batch, slots=slots, max_batch=max_batch, accum=accum, gpus=gpus)
    if host_ram is not None and (not isinstance(host_ram, int) or host_ram < 1):
        raise ConfigError(f"host_ram={host_ram!r}: give the host RAM in bytes (a positive integer).")
    if placement != "auto" and placement not in PLACEMENTS:
        raise ConfigError(f"nvme placement {placement!r}: use one of auto, {', '.join(PLACEMENTS)}.")
    if ssd is None and placement in ("moments", "all"):
        raise ConfigError(f"nvme placement {placement!r} needs an SSD profile (--nvme PROFILE, e.g. gen5x4).")
    if ssd is not None:
        from .ssd import load_ssd
        ssd = load_ssd(ssd)   # (checked)
    model, config = (memo.meta_model if memo is not None else build_meta_model)(source, None, dtype)
    if prepare is not None:
        prepare(model)
    device_type = "cpu" if hardware.name == "cpu" else "cuda"
    if host_ram is None:
        from .hardware import host_memory_bytes
        host_ram = host_memory_bytes()
    host = host_bytes(model, device_type, tier_placement(model, device_type, host_ram, ssd, placement))
    if gpus > 1:
        if ssd is not None:
            raise ConfigError("--gpus with --nvme: the state tier does not run with more than one GPU yet.")
        # one copy of the state per node (in shared memory), one process per GPU
        host = dataclasses.replace(host, process_overhead=gpus * host.process_overhead)
    capacity_ssd, capacity_source = ssd_capacity(ssd) if ssd is not None else (0, "")
    vlm = is_vlm(model)
    if vision == "train" and not vlm:
        raise ConfigError(f"vision='train' (--vision train): {source if isinstance(source, str) else 'the model'} "
                          "is a text-only model, it has no vision tower to train; leave --vision out.")
    vision_bytes = vision_device_bytes(model, vision)
    params = sum(p.numel() for p in model.parameters())
    # what an optimizer updates: the store's weights, and a trained vision tower's
    updated = model.parameters() if vision == "train" else store_parameters(model)
    trainable = sum(p.numel() for p in updated if p.requires_grad)
    # the store's weights can be updated during the backward; the rest (a trained vision tower)
    # only after it
    in_store = sum(p.numel() for p in store_parameters(model) if p.requires_grad)
    _, kinds = layer_kinds(model, config)
    del model
    if "layer_regions" not in options:
        # the prefix takes the path the whole model's compile takes (layer_subgraphs' auto rule):
        # the whole-graph partition may keep other rotary values than the regional one, and at 1M
        # tokens cos and sin (tokens x head dim each) are hundreds of MiB
        from .passes.layer_subgraphs import regions_pay
        options = {**options, "layer_regions": "always" if regions_pay(len(kinds), len(set(kinds))) else "never"}
    prefix_len = max(min(2, len(kinds)), max(kinds.index(k) for k in set(kinds)) + 1)
    if device_type == "cpu":  # the CPU plays the device: its bytes come out of the same RAM
        capacity = max(0, host_ram - host.total)
    else:
        capacity = int(hardware.device_memory_gib * GiB * (1 - DEVICE_RESERVE_FRACTION)) - DEVICE_RESERVE_BYTES
    capacity = max(0, capacity - vision_bytes)   # a VLM's vision side stays on the device
    _check_floor(config, seq, dtype, capacity, source)   # (before the compile: seconds, not minutes)
    m = one_batch = None
    if batch is not None and max_batch == batch:
        # A plan of one batch (the train preflight): captured at that batch, exact there and with
        # nothing to extrapolate. Where it fits as it is, the memory choices (which act only when
        # batch 1 does not fit) choose nothing; otherwise the plan goes on from batch 2 and 4, so a
        # refusal says what would fit exactly as a whole plan does.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            at = capture(batch, options, "")
        one_batch = PrefixModel(kinds, prefix_len, at, at, hardware)
        if one_batch.device_peak(batch) <= capacity:
            m, checkpoints_on_host = one_batch, options.get("offload_checkpoints") == "always"
            m.checked[batch] = m.device_peak(batch)
    if m is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            caps = [capture(b, options, "") for b in (2, 4)]
        m = PrefixModel(kinds, prefix_len, caps[0], caps[1], hardware)
        m, options, checkpoints_on_host = choose_memory(m, options, capacity, capture, config, seq)

    lookahead, weights_at_peak = {}, 0
    for direction in ("forward", "backward"):
        infos, costs = m.expand(direction, 1)
        lookahead[direction] = choose_lookahead(infos, costs, hardware, slots) if slots > 1 else 0
        resident = sorted((s.weight_nbytes for s in infos), reverse=True)[:lookahead[direction] + 1]
        weights_at_peak = max(weights_at_peak, sum(resident))

    def estimate(b: int) -> BatchEstimate:
        times, sims, busy = {}, {}, {}
        for direction in ("forward", "backward"):
            infos, costs = m.expand(direction, b)
            steps = m.with_checkpoints(direction, build_steps(infos, lookahead[direction]), infos, b)
            if gpus > 1:   # (the data_parallel pass's rewrite; gradients reduced in fp32)
                widen = 4 // dtype.itemsize
                steps = [t for s in steps for t in sharded(s, gpus, widen * sum(infos[s.segment].grad_nbytes.values()))]
            sims[direction] = steps, costs
            timed = simulate(steps, costs, hardware)
            times[direction] = makespan(timed)
            for stream, seconds in busy_seconds(timed).items():
                busy[stream] = busy.get(stream, 0.0) + seconds
        opt, after = optimizer_seconds(trainable, hardware), optimizer_seconds(trainable - in_store, hardware)
        overlapped = {}
        for mode, (steps, costs) in sims.items():   # the optimizer beside this direction, the other as is
            if moved := optimizer_bytes(steps, costs, mode):
                per_byte = optimizer_seconds(in_store, hardware) / moved
                overlapped[mode] = times["forward"] + times["backward"] - times[mode] + after + makespan(
                    simulate(steps, costs, hardware, optimizer_s_per_byte=per_byte, optimizer=mode))
        tiered = host.ssd_masters + host.ssd_optimizer_state
        io, exposed = ssd_seconds(tiered, ssd.read_gbps, ssd.write_gbps, TIER_READ_AHEAD, times["forward"],
                                  times["backward"], accum) if tiered else (0.0, 0.0)
        # (the overlap runs on the last micro-batch; the ones before it are plain forwards + backwards)
        before = (accum - 1) * (times["forward"] + times["backward"]) + exposed
        return BatchEstimate(b, m.device_peak(b), times["forward"], times["backward"], opt,
                             captured=b in (m.a.batch, m.b.batch) or b in m.checked,
                             overlap_backward_seconds=_plus(overlapped.get("backward"), before),
                             overlap_forward_seconds=_plus(overlapped.get("forward"), before),
                             host_checkpoint_bytes=m.host_checkpoints(b), accum=accum, ssd_seconds=io,
                             ssd_exposed_seconds=exposed, busy=busy)

    p1 = m.device_peak(1)
    slope = max(1, m.device_peak(2) - p1)
    if m is one_batch:   # (captured at that batch, and it fits: its figures hold there alone)
        fit, candidates = batch, [batch]
    else:
        fit, slope = _largest_batch(m, capacity, max_batch, p1, slope,
                                    lambda b: capture(b, options, ", to check the largest batch"))
        candidates = sorted({b for b in [2**i for i in range(13)] + [fit, batch or 1] if 1 <= b <= max(fit, 1)})
    batches = [estimate(b) for b in candidates]
    fitting = [b for b in batches if b.device_peak_bytes <= capacity
               and host.total + b.host_checkpoint_bytes <= host_ram]
    best = max(fitting, key=lambda b: b.batch / b.step_seconds) if fitting else None

    name = source if isinstance(source, str) else getattr(source, "_name_or_path", "") or "model"
    plan = Plan(model={"source": name, "model_type": config.model_type, "layers": len(kinds),
                       "layer_kinds": len(set(kinds)), "parameters": params, "trainable": trainable,
                       "dtype": str(dtype).replace("torch.", ""), "captured_layers": prefix_len},
                hardware=hardware.to_dict(), seq=seq, slots=slots, lookahead=lookahead, host=host,
                host_ram=host_ram, device_capacity=capacity, device_weight_bytes=weights_at_peak,
                batches=batches, max_batch=fit, best=best, requested_batch=batch,
                vision=vision if vlm else None, vision_bytes=vision_bytes, checkpoints_on_host=checkpoints_on_host,
                mlp_tiles=mlp_tiles(config, options, seq), late_reload=m.late_reload,
                attention_chunks=max(m.b.attention_chunks, default=0),
                ssd=ssd.to_dict() if ssd is not None else None,
                ssd_capacity=capacity_ssd, ssd_capacity_source=capacity_source, accum=accum, gpus=gpus)
    _check(plan, m, p1, slope)
    return plan


def _largest_batch(m: PrefixModel, capacity: int, max_batch: int, p1: int, slope: int,
                   capture: Callable[[int], Capture]) -> tuple[int, int]:
    """(the largest batch up to max_batch whose peak fits `capacity`, the slope of the peak per
    sample it was found with), from the peaks at batch 1 (`p1`) and 2 (`slope` apart).

    Device bytes are linear in the batch within each step, but the peak is the max over steps,
    which can move to a step whose bytes grow faster: a convex function, which the chord from
    batch 2 to 4 under-estimates beyond 4. So the largest batch is checked by capturing it, and
    the chord refitted through the checked point until the check passes."""
    fit = 0 if p1 > capacity else min(max_batch, 1 + (capacity - p1) // slope)
    anchor_b, anchor_p = 4, m.device_peak(4)
    for _ in range(4):
        if fit <= anchor_b:
            break
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cap = capture(fit)
        measured = max(d.peak for d in cap.directions.values()) + int(m.extra_saved(fit))
        m.checked[fit] = measured
        if measured <= capacity:
            break
        slope = max(1, (measured - anchor_p) // (fit - anchor_b))
        # (fit > 4 was reached only because batch 4 fits, so it stays a safe lower bound)
        fit = max(anchor_b, min(fit - 1, anchor_b + (capacity - anchor_p) // slope))
    return fit, slope


def _plus(seconds: float | None, more: float) -> float | None:
    return None if seconds is None else seconds + more


def _check_floor(config, seq: int, dtype: torch.dtype, capacity: int, source) -> None:
    """Refuse, before any compile, a sequence whose layer boundary alone cannot fit: a decoder
    layer's input and output hidden states ([seq, hidden] each) are on the device together
    whatever is tiled or offloaded. (The compile of a 100M-token plan would unroll thousands of
    MLP tiles per layer and take minutes to say the same.)"""
    hidden = getattr(config.get_text_config(decoder=True), "hidden_size", None)
    if not isinstance(hidden, int) or hidden < 1:
        return
    floor = 2 * seq * hidden * dtype.itemsize
    longest = max(0, capacity // (2 * hidden * dtype.itemsize))
    if floor > capacity and longest >= 1:   # (no room at all: the plan's own report says what does not fit)
        name = source if isinstance(source, str) else type(config).__name__
        raise CannotPlanError(f"{name} at seq {seq}: the two hidden states at a layer boundary alone need "
                              f"{fmt_bytes(floor)} ([{seq}, {hidden}] x 2, {dtype}), "
                              f"more than the {fmt_bytes(capacity)} of "
                              f"usable device memory, whatever is tiled or offloaded. Sequences shorter than "
                              f"{longest} tokens have room to be planned: try a shorter --seq, or a device with "
                              "more memory.")


def _check(plan: Plan, m: PrefixModel, p1: int, slope: int) -> None:
    """Fill `plan.problems`, each saying what would make the model fit."""
    need = plan.host.total
    if need > plan.host_ram:
        plan.problems.append(
            f"host RAM: the store needs {fmt_bytes(need)} ({need / max(1, plan.model['parameters']):.1f} B/param) but "
            f"{_given(plan.host_ram)} is available: add at least {fmt_bytes(need - plan.host_ram)} of host RAM "
            f"(--host-ram {math.ceil(need / 1e9)}G), {_nvme_advice(plan)}or train a smaller model.")
    if plan.host.ssd_total and plan.ssd_capacity and plan.host.ssd_total > plan.ssd_capacity:
        plan.problems.append(
            f"NVMe: the state tier needs {fmt_bytes(plan.host.ssd_total)} of disk (2 slots of "
            f"{fmt_bytes(plan.host.ssd_total // 2)} of {plan.host.placement}) but {fmt_bytes(plan.ssd_capacity)} is "
            f"{plan.ssd_capacity_source}: add drives or free space"
            + (", or --nvme-placement moments with more host RAM" if plan.host.placement == "all" else "") + ".")
    if plan.max_batch < 1:
        hints = [f"batch 1 at --seq {plan.seq} peaks at {fmt_bytes(p1)} on the device "
                 f"but {fmt_bytes(plan.device_capacity)} is usable"]
        if plan.slots > 1:
            hints.append(f"--slots 1 frees about {fmt_bytes(plan.device_weight_bytes / (plan.slots))} of weights "
                         "(no prefetch overlap)")
        hints.append(f"a shorter --seq (activations grow at least linearly with it: {fmt_bytes(slope)} per sample now)")
        hints.append("recompute_head=True when the logits dominate")
        plan.problems.append("device memory: " + "; ".join(hints) + ".")
    elif plan.best is None and need <= plan.host_ram:
        b = min(plan.batches, key=lambda b: b.batch)
        plan.problems.append(
            f"host RAM: batch {b.batch} at --seq {plan.seq} keeps {fmt_bytes(b.host_checkpoint_bytes)} "
            f"of layer checkpoints "
            f"on the host beside the store's {fmt_bytes(need)}, but {_given(plan.host_ram)} is available: add host RAM "
            f"(--host-ram {math.ceil((need + b.host_checkpoint_bytes) / 1e9)}G) or use a shorter --seq.")
    elif plan.requested_batch and plan.requested_batch > plan.max_batch:
        plan.problems.append(
            f"device memory: batch {plan.requested_batch} at --seq {plan.seq} needs "
            f"{fmt_bytes(p1 + slope * (plan.requested_batch - 1))} but {fmt_bytes(plan.device_capacity)} is usable: "
            f"the largest batch that fits is {plan.max_batch}; use gradient accumulation for a larger effective batch.")


def _nvme_advice(plan: Plan) -> str:
    """What the NVMe tier would still free, for the host RAM message ("" when it is all out)."""
    if plan.ssd is None:
        return "or put optimizer state on NVMe with --nvme PROFILE (moments: 10 B/param in RAM, all: 6), "
    if plan.host.placement != "all":
        return "or --nvme-placement all (6 B/param in RAM), "
    return ""


def to_text(plan: Plan) -> str:
    m, hw = plan.model, plan.hardware
    h = plan.host

    def where(on_disk: int) -> str:
        return "" if not plan.ssd else f"   in RAM (+ {fmt_bytes(on_disk)} on NVMe)" if on_disk else "   in RAM"
    tier = bool(h.ssd_total)
    lines = [f"{m['source']} ({m['model_type']}): {m['parameters'] / 1e9:.2f}B parameters "
             f"({m['trainable'] / 1e9:.2f}B trainable), {m['layers']} layers of {m['layer_kinds']} kind(s), "
             f"{m['dtype']}; seq {plan.seq}; slots {plan.slots} (prefetch lookahead forward "
             f"{plan.lookahead['forward']}, backward {plan.lookahead['backward']}); hardware {hw['name']}",
             "",
             "host RAM" + (f" (NVMe placement {h.placement})" if plan.ssd else ""),
             f"  fp32 master weights     {fmt_bytes(h.masters):>12}{where(h.ssd_masters)}",
             f"  optimizer state (AdamW) {fmt_bytes(h.optimizer_state):>12}{where(h.ssd_optimizer_state)}",
             f"  transfer copy           {fmt_bytes(h.transfer_copy):>12}",
             f"  gradients (fp32)        {fmt_bytes(h.grads):>12}",
             *([f"  NVMe bounce buffers     {fmt_bytes(h.tier_pool):>12}"] if h.tier_pool else []),
             f"  process overhead        {fmt_bytes(h.process_overhead):>12}",
             f"  total                   {fmt_bytes(h.total):>12}   of {_given(plan.host_ram)} "
             f"({'fits' if h.total <= plan.host_ram else 'DOES NOT FIT'})",
             f"  of which pinned         {fmt_bytes(h.pinned):>12}",
             *([f"  layer checkpoints       {fmt_bytes(plan.best.host_checkpoint_bytes if plan.best else 0):>12}   "
                "per step at the best batch, beside the total (offload_checkpoints: they wait in pinned host "
                "memory between the forward and the backward)"] if plan.checkpoints_on_host else []),
             *([f"long sequence: each layer's MLP, norms, output projection and residuals run in {plan.mlp_tiles} "
                "sequence tiles (mlp_tiles)" + (f"; its input norm, q/k/v projections and attention in "
                                                f"{plan.attention_chunks} query chunks against the whole K and V"
                                                if plan.attention_chunks else "")]
               if plan.mlp_tiles > 1 else []),
             *(["each layer checkpoint comes back just before its layer's backward, not a segment ahead "
                "(reload_checkpoints: late; one [seq, hidden] value less on the device, its copy not overlapped)"]
               if plan.late_reload else []),
             *(["", *nvme_lines(plan, fmt_bytes)] if plan.ssd else []),
             "",
             f"device memory (usable {fmt_bytes(plan.device_capacity)}; "
             f"resident weights {fmt_bytes(plan.device_weight_bytes)})",
             *([f"  vision tower ({plan.vision}) {fmt_bytes(plan.vision_bytes)} on the device "
                "(taken out of the usable figure); "
                "its activations (which grow with the images per batch) are not counted"] if plan.vision else []),
             f"  {'batch':>6} {'peak':>12} {'forward':>10} {'backward':>10} {'optimizer':>10} "
             + (f"{'ssd exposed':>12} " if tier else "") + f"{'step':>10} {'tokens/s':>10}"]
    for b in plan.batches:
        mark = " <- best" if plan.best is b else ""
        lines.append(f"  {b.batch:>6} {fmt_bytes(b.device_peak_bytes):>11}{'*' if b.captured else ' '} "
                     f"{b.forward_seconds:>9.3f}s "
                     f"{b.backward_seconds:>9.3f}s {b.optimizer_seconds:>9.3f}s "
                     + (f"{b.ssd_exposed_seconds:>11.3f}s " if tier else "")
                     + f"{b.step_seconds:>9.3f}s {plan.tokens_per_s(b):>10.0f}{mark}")
    lines.append("  (* captured at that batch; other peaks interpolated from batch 2 and 4)")
    if plan.accum > 1 or tier:
        lines.append(f"  (forward and backward are one micro-batch's; step = {plan.accum} x (forward + backward) + "
                     "optimizer" + (" + the SSD time the compute does not hide" if tier else "") + ")")
    lines.append("")
    lines.append(f"largest batch that fits: {plan.max_batch}")
    if plan.best:
        b = plan.best
        lines.append(f"best: batch {b.batch} x seq {plan.seq}" + (f" x accum {b.accum}" if b.accum > 1 else "")
                     + f" -> {b.step_seconds:.3f} s/step, {plan.tokens_per_s(b):,.0f} tokens/s with the optimizer "
                     "after the backward"
                     + (f"; SSD exposed {b.ssd_exposed_seconds:.3f} s ({b.ssd_exposed_seconds / b.step_seconds:.1%} "
                        f"of the step) of {b.ssd_seconds:.1f} s of I/O" if tier else ""))
        tokens = plan.gpus * b.batch * b.accum * plan.seq
        for seconds, how in ((b.overlap_backward_seconds, "during the backward (overlap_optimizer=backward, "
                                                          "norm not clipped)"),
                             (b.overlap_forward_seconds, "under the next forward (overlap_optimizer=forward, or "
                                                         "backward with a clipped norm)")):
            if seconds is not None:
                lines.append(f"      {seconds:.3f} s/step, {tokens / seconds:,.0f} tokens/s with it {how}")
    if plan.host_measured:
        lines.append(plan.host_measured)
    if plan.best and (note := host_bound(plan.best)):
        lines.append(f"WARNING: {note}")
    if plan.gpus > 1:
        lines += ["", f"data parallel: {plan.gpus} GPUs on one node, each at the batch above (tokens/s are the "
                      f"node's); /dev/shm holds the state once: {fmt_bytes(plan.shm_bytes)}; "
                      f"each GPU fetches 1/{plan.gpus} "
                      f"of every layer over PCIe and all-gathers the rest, reduce-scatters the gradients in fp32 over "
                      f"the peer links ({hw.get('peer_gbps', 0):.0f} GB/s): the all-gathers under the bodies before "
                      "them, the reduce-scatters on the compute stream"]
    for p in plan.problems:
        lines.append(f"CANNOT FIT: {p}")
    return "\n".join(lines)
