"""`megatrain plan MODEL --compare`: what to buy. One plan per built-in GPU profile
(hardware.BUILTIN) x host RAM size (COMPARE_RAM), plus, where the RAM alone does not hold the
store, the same box with the AdamW state (and the masters if need be) on NVMe drives (the state
tier, tier_plan.py; profile COMPARE_NVME unless --nvme names another). Each row is what
`megatrain plan MODEL --gpu G --host-ram R [--nvme P]` says: fits or what is short, the best
batch, its step time and tokens/s, the time 1B tokens take, and the resource that binds the step.

The model enters only through its captures (the first layers compiled on the meta device, at a
few batch sizes: seconds each) and its meta model; the hardware only through the simulation. So
one PlanMemo serves every plan of the sweep: a capture is compiled once per batch size and
reused on every profile whose prefetch lookahead (the one choice the compile makes from the
profile, passes/schedule.py) is the same, with its bodies' seconds re-costed on that profile.
The sweep costs about what one plan costs, plus a capture per distinct largest batch (the GPUs'
memory differs).
"""
from __future__ import annotations

import os
import textwrap
import time
from dataclasses import dataclass

from .errors import CannotFitError
from .units import GivenBytes, fmt_bytes, parse_bytes
from .hardware import BUILTIN, Hardware
from .plan import Plan, plan_model
from .plan_capture import Capture, capture_prefix, lookaheads, recosted

#: the host RAM sizes compared (as --host-ram spells them: decimal units)
COMPARE_RAM = ("256G", "512G", "1T", "2T")
#: the NVMe drives of the rows where the RAM alone does not fit (ssd.SSD_BUILTIN: 4 x PCIe 4 in RAID0)
COMPARE_NVME = "gen4x4"
#: simulate.py's streams as resources a buyer can pick, and the host optimizer and the NVMe drives
RESOURCES = {"compute": "GPU compute", "h2d": "H2D link", "d2h": "D2H link", "comm": "peer links",
             "optimizer": "host optimizer", "ssd": "NVMe"}
#: rows within this fraction of a GPU's best tokens/s count as its best speed (the cheapest is marked)
SAME_SPEED = 0.01


class PlanMemo:
    """What plans of one model on several machines share (plan_model's `memo`): the meta model
    (with `prepare`, a train config's finetuning, applied once) and the captures."""

    def __init__(self, prepare=None, progress=None):
        self.prepare, self.progress = prepare, progress
        self.started = time.monotonic()
        self.compiled = self.reused = 0
        self._meta: dict = {}
        self._captures: dict[tuple, list[tuple[Capture, Hardware]]] = {}

    def meta_model(self, source, layers, dtype):
        from .meta_model import build_meta_model
        key = (os.fspath(source) if isinstance(source, (str, os.PathLike)) else id(source), layers, dtype)
        if key not in self._meta:
            model, config = build_meta_model(source, layers, dtype)
            if self.prepare is not None:
                self.prepare(model)
            self._meta[key] = model, config
        return self._meta[key]

    def capture(self, config, layers: int, batch: int, seq: int, slots: int, dtype, hw: Hardware,
                options: dict) -> Capture:
        """plan.capture_prefix's answer for `hw`: a capture made on another profile whose schedule
        chose the lookahead `hw` would choose, re-costed on `hw`; else a new capture."""
        key = (id(config), layers, batch, seq, slots, dtype, hw.name == "cpu", repr(sorted(options.items())))
        found = self._captures.setdefault(key, [])
        # (a capture read from the disk cache keeps its bodies' costs, not the bodies timing needs)
        usable = [(cap, on) for cap, on in found
                  if not hw.measure_ops or all(d.bodies for d in cap.directions.values())]
        if usable:
            want = lookaheads(usable[0][0], hw, slots)
            for cap, on in usable:
                if all(d.lookahead == want[name] for name, d in cap.directions.items()):
                    self.reused += 1
                    return cap if on == hw else recosted(cap, hw)
        def announce():
            self.progress(f"[megatrain] plan --compare: compiling the first {layers} layer(s) at batch {batch} x "
                          f"seq {seq} ({time.monotonic() - self.started:.0f} s so far) ...")
        cap = capture_prefix(config, layers, batch, seq, slots, dtype, hw, options,
                             announce if self.progress is not None else None)
        self.compiled += 1
        found.append((cap, hw))
        return cap


# -- the rows -----------------------------------------------------------------------------------

@dataclass
class Row:
    gpu: str
    host_ram: int                    # cli.GivenBytes: says back "512G"
    nvme: str | None                 # the SSD profile of the state tier (None: everything in RAM)
    plan: Plan | None                # None: refused before planning (`problems` says why)
    problems: list[str]
    pick: bool = False               # the cheapest box of its GPU at that GPU's best tokens/s

    @property
    def fits(self) -> bool:
        return self.plan is not None and not self.problems

    @property
    def best(self):
        return self.plan.best if self.fits else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.plan.tokens_per_s(self.best) if self.best else None

    @property
    def overlap_tokens_per_s(self) -> float | None:
        """With the optimizer during the backward (megatrain train's default on CUDA; norm not clipped)."""
        b = self.best
        if b is None or b.overlap_backward_seconds is None:
            return None
        return self.plan.gpus * b.batch * b.accum * self.plan.seq / b.overlap_backward_seconds

    @property
    def placement(self) -> str:
        return self.plan.host.placement if self.plan is not None else "none"

    def busy(self) -> dict[str, float]:
        """Seconds each resource works per optimizer step at the best batch."""
        b = self.best
        if b is None:
            return {}
        out = {RESOURCES[k]: b.accum * v for k, v in b.busy.items() if k in RESOURCES}
        out[RESOURCES["optimizer"]] = b.optimizer_seconds
        if b.ssd_seconds:
            out[RESOURCES["ssd"]] = b.ssd_seconds
        return out

    def bound(self) -> tuple[str, float] | None:
        """(the resource busiest per step, the fraction of the step it works)."""
        busy = self.busy()
        if not busy:
            return None
        name = max(busy, key=busy.get)
        return name, busy[name] / self.best.step_seconds

    def short(self) -> list[str]:
        """What is short, one phrase per problem."""
        p = self.plan
        if p is None:   # (refused before planning: plan._check_floor)
            return ["GPU memory: the layer boundary alone does not fit at this --seq"]
        out = []
        for problem in self.problems:
            what = problem.split(":", 1)[0]
            if what == "host RAM":
                extra = 0 if p.host.total > p.host_ram else min(b.host_checkpoint_bytes for b in p.batches)
                out.append(f"host RAM: needs {fmt_bytes(p.host.total + extra)}")
            elif what == "NVMe":
                out.append(f"NVMe: needs {fmt_bytes(p.host.ssd_total)} of disk")
            elif what == "device memory" and p.max_batch < 1:
                out.append(f"GPU memory: batch 1 needs {fmt_bytes(p.batches[0].device_peak_bytes)} of "
                           f"{fmt_bytes(p.device_capacity)}")
            elif what == "device memory":
                out.append(f"GPU memory: batch {p.requested_batch} > {p.max_batch}")
            else:
                out.append(problem.split(". ")[0])
        return out

    def to_dict(self) -> dict:
        b, bound = self.best, self.bound()
        tps = self.tokens_per_s
        return {"gpu": self.gpu, "host_ram": int(self.host_ram), "host_ram_given": _ram(self),
                "nvme": self.nvme, "placement": self.placement, "fits": self.fits, "short": self.short(),
                "problems": self.problems, "pick": self.pick,
                "host_bytes": self.plan.host.total if self.plan else None,
                "nvme_bytes": self.plan.host.ssd_total if self.plan else None,
                "max_batch": self.plan.max_batch if self.plan else None,
                "batch": b.batch if b else None, "accum": b.accum if b else None,
                "seq": self.plan.seq if self.plan else None,
                "device_peak_bytes": b.device_peak_bytes if b else None,
                "step_seconds": b.step_seconds if b else None, "tokens_per_s": tps,
                "overlap_backward_seconds": b.overlap_backward_seconds if b else None,
                "overlap_tokens_per_s": self.overlap_tokens_per_s,
                "seconds_per_billion_tokens": 1e9 / tps if tps else None,
                "bound": bound[0] if bound else None, "bound_fraction": bound[1] if bound else None,
                "busy_seconds": self.busy()}


def compare_plans(source, *, gpus: int = 1, ssd=None, placement: str = "auto", prepare=None, progress=None,
                  profiles=tuple(BUILTIN), ram_sizes=COMPARE_RAM, **plan_options) -> list[Row]:
    """A row per profile x host RAM size (and with the NVMe tier where the RAM alone does not
    hold the store: `ssd`, else COMPARE_NVME; none with `placement` "none" or `gpus` > 1,
    where the tier does not run), each from plan_model with `plan_options` (seq, batch, slots,
    dtype, options, vision, accum). Ordered by GPU, then RAM; the NVMe row after its RAM row."""
    from .ssd import load_ssd
    tier = None if placement == "none" or gpus > 1 else load_ssd(ssd if ssd is not None else COMPARE_NVME)
    memo = PlanMemo(prepare, progress)
    rows = []
    for name in profiles:
        hw = BUILTIN[name]
        for size in ram_sizes:
            ram = GivenBytes(parse_bytes(size), size)
            row = _row(source, hw, ram, None, "auto", memo, gpus, plan_options)
            rows.append(row)
            if tier is not None and row.plan is not None and row.plan.host.total > ram:   # (the store does not fit)
                rows.append(_row(source, hw, ram, tier, placement, memo, gpus, plan_options))
    _mark(rows)
    return rows


def _row(source, hw: Hardware, ram: int, tier, placement: str, memo: PlanMemo, gpus: int, options: dict) -> Row:
    nvme = tier.name if tier is not None else None
    try:
        plan = plan_model(source, hardware=hw, host_ram=ram, ssd=tier, placement=placement, gpus=gpus, memo=memo,
                          **options)
    except CannotFitError as e:   # (a sequence whose layer boundary alone overflows this GPU: plan._check_floor)
        return Row(hw.name, ram, nvme, None, [str(e)])
    return Row(hw.name, ram, nvme, plan, list(plan.problems))


def _mark(rows: list[Row]) -> None:
    """Mark, per GPU, the first row (the least RAM) within SAME_SPEED of its best tokens/s."""
    for gpu in dict.fromkeys(r.gpu for r in rows):
        fitting = [r for r in rows if r.gpu == gpu and r.fits]
        if fitting:
            top = max(r.tokens_per_s for r in fitting)
            next(r for r in fitting if r.tokens_per_s >= top * (1 - SAME_SPEED)).pick = True


def smallest(rows: list[Row], gpu: str) -> tuple[Row | None, Row | None]:
    """(the least RAM that fits `gpu` alone, the least that fits it with the NVMe tier if less)."""
    fitting = [r for r in rows if r.gpu == gpu and r.fits]
    alone = next((r for r in fitting if r.nvme is None), None)
    tiered = next((r for r in fitting if r.nvme is not None), None)
    if tiered is not None and alone is not None and tiered.host_ram >= alone.host_ram:
        tiered = None
    return alone, tiered


# -- output ---------------------------------------------------------------------------------------

def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _ram(row: Row) -> str:
    return getattr(row.host_ram, "given", None) or fmt_bytes(row.host_ram)


def rows_json(rows: list[Row]) -> list[dict]:
    return [r.to_dict() for r in rows]


def rows_text(rows: list[Row]) -> str:
    planned = next((r.plan for r in rows if r.plan is not None), None)
    lines = []
    if planned is not None:
        m = planned.model
        lines += [f"{m['source']} ({m['model_type']}): {m['parameters'] / 1e9:.2f}B parameters "
                  f"({m['trainable'] / 1e9:.2f}B trainable), {m['dtype']}; seq {planned.seq}"
                  + (f", accum {planned.accum}" if planned.accum > 1 else "")
                  + (f", {planned.gpus} GPUs data parallel (tokens/s: the node's)" if planned.gpus > 1 else "")
                  + f"; {len(rows)} machines", ""]
    head = (f"  {'gpu':<6} {'host RAM':<9} {'NVMe':<16} {'fits':<4} {'batch':>5} {'step':>9} {'tokens/s':>9} "
            f"{'overlap':>9} {'1B tokens':>10}  {'bound (busy)':<22} what is short")
    lines.append(head)
    for r in rows:
        nvme = f"{r.nvme} ({r.placement})" if r.nvme else "-"
        if r.fits:
            b, (bound, share) = r.best, r.bound()
            over = r.overlap_tokens_per_s
            lines.append(f"{'*' if r.pick else ' '} {r.gpu:<6} {_ram(r):<9} {nvme:<16} {'yes':<4} {b.batch:>5} "
                         f"{b.step_seconds:>8.2f}s {r.tokens_per_s:>9,.0f} "
                         f"{f'{over:,.0f}' if over else '-':>9} {_duration(1e9 / r.tokens_per_s):>10}  "
                         f"{bound} ({share:.0%})")
        else:
            lines.append(f"  {r.gpu:<6} {_ram(r):<9} {nvme:<16} {'no':<4} {'-':>5} {'-':>9} {'-':>9} {'-':>9} "
                         f"{'-':>10}  {'-':<22} {'; '.join(r.short())}")
    notes = ["tokens/s: at the best batch with the optimizer after the backward (as `megatrain plan` says it); "
             "overlap: with it during the backward (overlap_optimizer=backward, norm not clipped); 1B tokens: the "
             "time they take at tokens/s; bound: the resource busiest per step, and the share of the step it works.",
             "* the cheapest box of each GPU at that GPU's best tokens/s (within 1%)."]
    if planned is not None and planned.gpus > 1:
        notes.append("No NVMe rows: the state tier does not run with more than one GPU yet.")
    elif any(r.nvme for r in rows):
        notes.append(f"NVMe rows: where the RAM alone does not hold the store, the AdamW state (moments) or the "
                     f"masters too (all) on {next(r.nvme for r in rows if r.nvme)} drives (--nvme picks others).")
    lines += ["", *(line for note in notes for line in textwrap.wrap(note, 108, initial_indent="  ",
                                                                     subsequent_indent="    "))]
    lines.append("smallest host RAM that fits: " + "; ".join(_smallest_text(rows, gpu)
                                                              for gpu in dict.fromkeys(r.gpu for r in rows)))
    return "\n".join(lines)


def _smallest_text(rows: list[Row], gpu: str) -> str:
    alone, tiered = smallest(rows, gpu)
    if alone is None and tiered is None:
        return f"{gpu} none"
    parts = [_ram(alone)] if alone is not None else []
    if tiered is not None:
        speed = f" at {tiered.tokens_per_s / alone.tokens_per_s:.2f}x the tokens/s" if alone is not None else ""
        parts.append(f"{_ram(tiered)} + {tiered.nvme} NVMe ({tiered.placement}){speed}")
    return f"{gpu} " + ", or ".join(parts)


def none_fits(rows: list[Row], source) -> str:
    """The one error line when no row fits: the biggest box and what it is short of."""
    last = rows[-1] if rows else None
    biggest = max((r for r in rows if r.gpu == rows[0].gpu), key=lambda r: (r.host_ram, r.nvme is not None),
                  default=last)
    where = f"{biggest.gpu} with {_ram(biggest)} host RAM" + (f" and {biggest.nvme} NVMe" if biggest.nvme else "")
    return (f"{source} fits none of the {len(rows)} machines compared; {where} is short of: "
            f"{'; '.join(biggest.short())}.")
