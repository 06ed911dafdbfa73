"""`megatrain inspect`: run the real capture and passes on a model built on the meta device and
report graphs, pass records, the schedule (with estimated times) and the memory plan.

No weights are allocated: the model is built under `torch.device("meta")`, Dynamo and
AOTAutograd trace it with meta inputs, and the megatrain backend compiles both directions
without executing them. Each body's time comes from the cost model (`cost_model.py`) and the
schedule's times from the discrete-event simulation of its three streams (`simulate.py`)
against a hardware profile (`hardware.py`).

JSON output (stable; `version` bumps on incompatible change):
    {"version": 2, "model": {...}, "hardware": {...}, "batch": B, "seq": S,
     "directions": {"forward"|"backward": {
         "segments": [{"index", "name", "group", "body", "weights_bytes", "grad_bytes", "flops",
                       "memory_bytes", "ops", "seconds", "recompute_fraction", "transient_bytes"}],
         "steps": [{"op", "stream", "segment", "group", "bytes", "start_s", "end_s"}],
             op: prefetch | wait | forward | recompute | backward | grad_offload | evict | optimizer
             stream: h2d | compute | d2h | host (the optimizer: after the backward, segment -1,
                     or with overlap_optimizer one update per grad_offload under the backward /
                     per prefetch under the forward)
         "peak_resident_weight_bytes", "saved_activation_bytes", "lookahead",
         "passes": [[name, status], ...]}},
     "forward_backward_seconds", "step_seconds": estimated seconds (step = with the optimizer),
     "overlap_optimizer": null | "backward" | "forward"}
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .ir import Compiled
from .cost_model import body_cost, optimizer_seconds
from .hardware import Hardware
from .passes.memory_plan import value_bytes
from .passes.schedule import segment_costs
from .units import fmt_bytes
from .simulate import SegmentCost, TimedStep, makespan, optimizer_bytes, simulate
from .vlm import store_parameters
from . import meta_model
from .meta_model import (build_meta_model, build_model_from_config, capture_program,  # noqa: F401 (API)
                         check_decoder_only, check_positive, meta_outputs, text_positions)

@dataclass
class DirectionReport:
    segments: list[dict]
    steps: list[TimedStep]
    peak_resident_weight_bytes: int
    saved_activation_bytes: int
    passes: list
    lookahead: int = 1
    code: dict[str, str] = field(default_factory=dict)
    program: str = ""              # the schedule as one FX program (ir.schedule_program)
    host_checkpoint_bytes: int = 0   # layer checkpoints kept on the host (offload_checkpoints)


def segment_report(done: Compiled, capture, hw: Hardware) -> tuple[list[dict], list[SegmentCost]]:
    """Per segment: what it reads, computes and moves (cost model), and its simulator cost."""
    schedule = done.schedule
    costs = segment_costs(done.graph, schedule.segments, hw)
    transient = done.transient
    segs = []
    for k, (seg, cost) in enumerate(zip(schedule.segments, costs)):
        body = body_cost(done.body(k))
        replay = body_cost(done.body(k), recompute_only=True)
        total = body.seconds(hw)
        segs.append({"index": k, "name": capture.group_name(seg.group) if seg.group >= 0 else "prologue",
                     "group": seg.group, "body": done.body_of[k], "weights_bytes": seg.weight_nbytes,
                     "grad_bytes": cost.grad_bytes, "flops": body.flops, "memory_bytes": body.memory_bytes,
                     "ops": body.ops, "seconds": cost.seconds,
                     "recompute_fraction": replay.seconds(hw) / total if total else 0.0,
                     "transient_bytes": transient[done.body_of[k]]})
    return segs, [SegmentCost(s["name"], c.weight_bytes, c.grad_bytes, c.seconds) for s, c in zip(segs, costs)]


def label_runs(steps: list[TimedStep], direction: str, segs: list[dict]) -> list[TimedStep]:
    """Name each body run by what it does: "forward"; in the backward, "recompute" (the forward
    ops it replays, by their cost share) then "backward"."""
    out = []
    for s in steps:
        if s.op != "run":
            out.append(s)
        elif direction == "forward":
            out.append(TimedStep("forward", s.stream, s.segment, s.group, s.nbytes, s.start, s.end))
        else:
            split = s.start + (s.end - s.start) * segs[s.segment]["recompute_fraction"]
            if split > s.start:
                out.append(TimedStep("recompute", s.stream, s.segment, s.group, s.nbytes, s.start, split))
            out.append(TimedStep("backward", s.stream, s.segment, s.group, s.nbytes, split, s.end))
    return out


def inspect_model(source: str, *, layers: int | None = None, batch: int = 1, seq: int = 4096,
                  slots: int = 2, hardware: Hardware, dtype: torch.dtype = torch.bfloat16,
                  options: dict | None = None, overlap_optimizer: str | None = None, ssd=None,
                  placement: str = "all") -> dict[str, Any]:
    """`overlap_optimizer` (simulate.py's host stream) "backward": the host optimizer updates
    each segment's weights during the backward, as soon as its gradient offload lands (HostAdamW
    overlap="backward", norm not clipped; `megatrain train`'s default on CUDA); "forward": the
    last step's updates run under this forward, each before its segment's prefetch
    (overlap="forward", or a clipped step under "backward"); None: after the backward.
    `ssd` (an ssd.SSD) with `placement` ("moments" or "all"): the NVMe state tier's reads and
    writes of each update, on simulate.py's `ssd` stream."""
    from .errors import ConfigError
    if overlap_optimizer not in (None, "backward", "forward"):
        raise ConfigError(f"overlap_optimizer={overlap_optimizer!r}: None, 'backward' or 'forward'")
    check_positive(batch=batch, seq=seq, slots=slots, layers=layers)
    t_start = time.perf_counter()
    model, config = meta_model.build_meta_model(source, layers, dtype)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    in_store = sum(p.numel() for p in store_parameters(model) if p.requires_grad)
    program = meta_model.capture_program(model, batch, seq, slots, hardware, options)
    tiered = 0   # masters/moments bytes on NVMe, read and written once per step
    if ssd is not None:
        from .host_store import host_bytes
        placed = host_bytes(model, "cuda", placement)
        tiered = placed.ssd_masters + placed.ssd_optimizer_state
    directions, t, after = {}, 0.0, trainable
    for direction in ("forward", "backward"):
        done = program.compiled[direction]
        segs, costs = segment_report(done, program.capture, hardware)
        per_byte, tier = None, None
        if direction == overlap_optimizer and (nbytes := optimizer_bytes(done.schedule.steps, costs, direction)):
            per_byte, after = optimizer_seconds(in_store, hardware) / nbytes, trainable - in_store
            if tiered:   # (each update's share of the tier's bytes, as its share of the optimizer's)
                tier = (ssd.read_gbps, ssd.write_gbps, tiered / nbytes)
        steps = label_runs(simulate(done.schedule.steps, costs, hardware, t, optimizer_s_per_byte=per_byte,
                                    optimizer=direction, ssd=tier), direction, segs)
        t = makespan(steps, t)
        saved = 0
        if direction == "backward":   # (on the device: the checkpoints kept on the host are counted apart)
            from .ir import host_values
            from .passes import WEIGHT_GROUP
            host = host_values(done.schedule.program)
            for n in done.graph.graph.nodes:
                val = n.meta.get("val")
                if (n.op == "placeholder" and WEIGHT_GROUP not in n.meta and not n.name.startswith("tangents")
                        and isinstance(val, torch.Tensor) and n.name not in host):
                    saved += value_bytes(val)
        directions[direction] = DirectionReport(
            segs, steps, done.schedule.peak_resident_weight_bytes(), saved,
            program.pass_records.get(direction, []), done.schedule.lookahead,
            {name: body.code for name, body in done.bodies.items()}, done.schedule.program.code,
            done.plan.host_checkpoint_bytes if done.plan else 0)
    # (with the optimizer overlapped, t already holds its updates; what is left runs after)
    forward_backward = max((s.end for d in directions.values() for s in d.steps if s.stream not in ("host", "ssd")),
                           default=t)
    opt_end = t + optimizer_seconds(after, hardware)
    if tiered and overlap_optimizer is None:   # the tier streams under the update: reads, then writes
        read_end = t + tiered / (ssd.read_gbps * 1e9)
        directions["backward"].steps.append(TimedStep("tier_read", "ssd", -1, "all", tiered, t, read_end))
        opt_end = max(opt_end, read_end)
        directions["backward"].steps.append(TimedStep("tier_write", "ssd", -1, "all", tiered, read_end,
                                                      read_end + tiered / (ssd.write_gbps * 1e9)))
    if opt_end > t:
        directions["backward"].steps.append(TimedStep("optimizer", "host", -1, "all", after, t, opt_end))
    return {
        "version": 2,
        "model": {"source": source, "model_type": config.model_type,
                  "layers": config.get_text_config(decoder=True).num_hidden_layers,
                  "parameters": params, "dtype": str(dtype).replace("torch.", ""),
                  "distinct_layer_bodies": program.stats_now()["distinct_layer_bodies"]},
        "hardware": hardware.to_dict(),
        "batch": batch, "seq": seq, "slots": slots,
        "directions": directions,
        "step_seconds": opt_end,
        "forward_backward_seconds": forward_backward,
        "overlap_optimizer": overlap_optimizer,
        "nvme": ({"profile": ssd.name, "placement": placement, "bytes_per_step": tiered} if ssd is not None else None),
        "mlp_tiles": program.tile_counts,
        "attention_chunks": program.attention_chunks,
        "inspect_seconds": time.perf_counter() - t_start,
    }


# -- output formats -------------------------------------------------------------------------

def to_json(report: dict) -> str:
    def conv(d: DirectionReport) -> dict:
        return {"segments": d.segments,
                "steps": [{"op": s.op, "stream": s.stream, "segment": s.segment, "group": s.group,
                           "bytes": s.nbytes, "start_s": s.start, "end_s": s.end} for s in d.steps],
                "peak_resident_weight_bytes": d.peak_resident_weight_bytes,
                "saved_activation_bytes": d.saved_activation_bytes,
                "host_checkpoint_bytes": d.host_checkpoint_bytes,
                "lookahead": d.lookahead,
                "passes": [[name, status] for name, status, _ in d.passes]}
    out = {k: v for k, v in report.items() if k not in ("directions", "inspect_seconds")}
    out["directions"] = {k: conv(v) for k, v in report["directions"].items()}
    return json.dumps(out, indent=2)


def to_chrome_trace(report: dict) -> str:
    """Chrome trace-event JSON (open in Perfetto or chrome://tracing): one track per stream."""
    tids = {"compute": 1, "h2d": 2, "d2h": 3, "host": 4}
    if report.get("nvme"):   # the state tier's drive
        tids["ssd"] = 5
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
              for name, tid in tids.items()]
    for direction, d in report["directions"].items():
        for s in d.steps:
            if s.end > s.start:
                events.append({"name": f"{s.op} {s.group}", "cat": direction, "ph": "X", "pid": 0,
                               "tid": tids[s.stream], "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6,
                               "args": {"bytes": s.nbytes, "segment": s.segment}})
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})


_COLORS = {"prefetch": "#4e79a7", "forward": "#59a14f", "recompute": "#edc948", "backward": "#76b7b2",
           "grad_offload": "#e15759", "optimizer": "#b07aa1", "wait": "#bab0ac", "tier_read": "#9c755f",
           "tier_write": "#ff9da7"}


def to_svg(report: dict, width: int = 1400) -> str:
    """A timeline of the three streams (compute, h2d, d2h), forward then backward."""
    steps = [(direction, s) for direction, d in report["directions"].items() for s in d.steps if s.end > s.start]
    total = max((s.end for _, s in steps), default=0.0) or 1.0
    lanes = {"compute": 0, "h2d": 1, "d2h": 2, "host": 3, **({"ssd": 4} if report.get("nvme") else {})}
    left, lane_h, top = 90, 36, 40
    scale = (width - left - 20) / total
    height = top + lane_h * len(lanes) + 40
    m = report["model"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           'font-size="11">',
           f'<text x="10" y="20" font-size="13">{m["source"]}: {m["layers"]} layers, batch {report["batch"]} x seq '
           f'{report["seq"]}, {report["hardware"]["name"]}; estimated step {report["step_seconds"] * 1e3:.1f} ms'
           '</text>']
    for name, lane in lanes.items():
        y = top + lane * lane_h
        out.append(f'<text x="10" y="{y + lane_h / 2 + 4}">{name}</text>')
        out.append(f'<line x1="{left}" y1="{y + lane_h}" x2="{width - 20}" y2="{y + lane_h}" stroke="#ddd"/>')
    for direction, s in steps:
        x, w = left + s.start * scale, max((s.end - s.start) * scale, 0.5)
        y = top + lanes[s.stream] * lane_h + 4
        out.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{lane_h - 8}" '
                   f'fill="{_COLORS.get(s.op, "#999")}" '
                   f'opacity="{0.95 if direction == "forward" else 0.7}"><title>{direction} {s.op} {s.group}: '
                   f'{(s.end - s.start) * 1e3:.3f} ms, {s.nbytes} bytes</title></rect>')
    y = top + lane_h * len(lanes) + 25
    for i, (op, color) in enumerate(_COLORS.items()):
        out.append(f'<rect x="{left + i * 120}" y="{y - 10}" width="12" height="12" fill="{color}"/>'
                   f'<text x="{left + i * 120 + 16}" y="{y}">{op}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _gib(n: float) -> str:   # (a report's sizes in one unit, column by column)
    return fmt_bytes(n, unit="GiB")


def to_text(report: dict, show: str) -> str:
    m, lines = report["model"], []
    lines.append(f"{m['source']} ({m['model_type']}): {m['layers']} layers, {m['parameters'] / 1e9:.2f}B params, "
                 f"{m['dtype']}; batch {report['batch']} x seq {report['seq']}; slots {report['slots']}; "
                 f"hardware {report['hardware']['name']}; distinct layer bodies {m['distinct_layer_bodies']}"
                 + (f"; layer tails (MLP, norms, output projection) in {max(report['mlp_tiles'])} sequence tiles"
                    if report.get("mlp_tiles") else "")
                 + (f"; attention (input norm, q/k/v, attention) in {max(report['attention_chunks'])} query chunks"
                    if report.get("attention_chunks") else ""))
    for direction, d in report["directions"].items():
        lines.append(f"\n== {direction}")
        if show == "graphs":
            lines.append("-- schedule program (transfers as prefetch/wait/evict/grad_offload/offload/reload ops)\n"
                         + d.program.strip())
            for name, code in d.code.items():
                lines.append(f"-- body {name}\n{code.strip()}")
        elif show == "passes":
            for name, status, delta in d.passes:
                lines.append(f"  {name:<24} {status}{'' if not delta else ' ' + str(delta)}")
        elif show == "memory":
            lines.append(f"  peak resident weights   {_gib(d.peak_resident_weight_bytes)}")
            if direction == "backward":
                lines.append(f"  saved activations       {_gib(d.saved_activation_bytes)}")
            if d.host_checkpoint_bytes:
                lines.append(f"  layer checkpoints kept on the host {_gib(d.host_checkpoint_bytes)} "
                             "(offload_checkpoints: megatrain.offload / megatrain.reload in the program)")
            biggest = max(d.segments, key=lambda s: s["transient_bytes"])
            lines.append(f"  largest body transient  {_gib(biggest['transient_bytes'])} ({biggest['name']})")
            for s in d.segments:
                lines.append(f"  seg {s['index']:>3} {s['name']:<20} body {s['body']:<6} weights "
                             f"{_gib(s['weights_bytes'])}  transient {_gib(s['transient_bytes'])}")
        else:  # schedule
            lines.append(f"  {'start ms':>10} {'end ms':>10}  {'stream':<8} {'op':<13} {'segment':<22} bytes")
            for s in d.steps:
                lines.append(f"  {s.start * 1e3:10.3f} {s.end * 1e3:10.3f}  {s.stream:<8} {s.op:<13} "
                             f"{s.group:<22} {s.nbytes}")
    overlap = {"backward": " (updating each segment during the backward)",
               "forward": " (the last step's updates under this forward)"}.get(report.get("overlap_optimizer"), "")
    lines.append(f"\nestimated step: forward + backward {report['forward_backward_seconds'] * 1e3:.1f} ms, "
                 f"with the CPU optimizer {report['step_seconds'] * 1e3:.1f} ms" + overlap)
    if report.get("nvme"):
        n = report["nvme"]
        ssd_steps = [s for d in report["directions"].values() for s in d.steps if s.stream == "ssd"]
        lines.append(f"NVMe state tier ({n['profile']}, placement {n['placement']}): {_gib(n['bytes_per_step'])} "
                     f"read and written per step; the ssd stream's tier_read / tier_write ops "
                     f"({sum(s.end - s.start for s in ssd_steps) * 1e3:.1f} ms busy)")
    return "\n".join(lines)
