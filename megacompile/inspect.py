"""`megatrain inspect`: run the real capture and passes on a model built on the meta device and
report graphs, pass records, the schedule (with estimated times) and the memory plan.

No weights are allocated: the model is built under `torch.device("meta")`, Dynamo and
AOTAutograd trace it with meta inputs, and the megatrain backend compiles both directions
without executing them. The schedule's times come from a small discrete-event model of three
streams (h2d, compute, d2h) against a hardware profile (`hardware.py`): a prefetch starts when
the link is free, a run starts when its weights have arrived and the previous run ended, a
gradient offload starts when the run that produced it ended.

JSON output (stable; `version` bumps on incompatible change):
    {"version": 1, "model": {...}, "hardware": {...}, "batch": B, "seq": S,
     "directions": {"forward"|"backward": {
         "segments": [{"index", "name", "group", "body", "weights_bytes", "flops", "transient_bytes"}],
         "steps": [{"op", "stream", "segment", "group", "bytes", "start_s", "end_s"}],
         "peak_resident_weight_bytes", "saved_activation_bytes", "passes": [[name, status], ...]}},
     "step_seconds": estimated forward+backward seconds}
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .backend import Program, megatrain_backend, programs_of
from .hardware import Hardware
from .passes.memory_plan import dim_hint, value_bytes
from .presets import load_config

aten = torch.ops.aten
_MATMULS = {aten.mm.default: "mm", aten.addmm.default: "addmm", aten.bmm.default: "bmm",
            aten.baddbmm.default: "baddbmm"}


def body_flops(body: fx.GraphModule) -> int:
    """Matmul and attention FLOPs of a body, from the traced shapes."""
    total = 0
    for n in body.graph.nodes:
        if n.op != "call_function":
            continue
        val = n.meta.get("val")
        if n.target in _MATMULS and isinstance(val, torch.Tensor):
            a = n.args[1] if n.target in (aten.addmm.default, aten.baddbmm.default) else n.args[0]
            k = dim_hint(a.meta["val"].shape[-1])
            total += 2 * math.prod(dim_hint(d) for d in val.shape) * k
        elif "scaled_dot_product" in str(n.target) and isinstance(n.args[0], fx.Node):
            q, k_ = n.args[0].meta["val"], n.args[1].meta["val"]
            b_h = math.prod(dim_hint(d) for d in q.shape[:-2])
            sq, sk, d = dim_hint(q.shape[-2]), dim_hint(k_.shape[-2]), dim_hint(q.shape[-1])
            factor = 2.5 if "backward" in str(n.target) else 1.0   # bwd ~ 2.5x the fwd matmuls
            total += int(factor * 4 * b_h * sq * sk * d)
    return total


@dataclass
class TimedStep:
    op: str
    stream: str
    segment: int
    group: str
    nbytes: int
    start: float
    end: float


@dataclass
class DirectionReport:
    segments: list[dict]
    steps: list[TimedStep]
    peak_resident_weight_bytes: int
    saved_activation_bytes: int
    passes: list
    code: dict[str, str] = field(default_factory=dict)


def simulate(runner, program: Program, hw: Hardware, t0: float = 0.0) -> tuple[list[TimedStep], list[dict]]:
    schedule = runner.schedule
    cap = program.capture
    segs = []
    for k, seg in enumerate(schedule.segments):
        body = runner.calls[k].body
        grad_bytes = sum(program.entries[i].nbytes for i, _ in seg.grads)
        segs.append({"index": k, "name": cap.group_name(seg.group) if seg.group >= 0 else "prologue",
                     "group": seg.group, "body": runner.body_of[k], "weights_bytes": seg.weight_nbytes,
                     "grad_bytes": grad_bytes, "flops": body_flops(body),
                     "transient_bytes": runner.transient[runner.body_of[k]]})
    clock = {"h2d": t0, "compute": t0, "d2h": t0}
    arrived: dict[int, float] = {}
    ran: dict[int, float] = {}
    out = []
    for step in schedule.steps:
        k, info = step.segment, segs[step.segment]
        if step.op == "prefetch":
            start = max(clock["h2d"], clock["compute"] if k > 0 else t0)
            end = start + step.nbytes / (hw.h2d_gbps * 1e9)
            clock["h2d"] = arrived[k] = end
        elif step.op == "wait":
            start = clock["compute"]
            end = clock["compute"] = max(start, arrived[k])
        elif step.op == "run":
            start = clock["compute"]
            end = clock["compute"] = start + info["flops"] / (hw.compute_tflops * 1e12)
            ran[k] = end
        elif step.op == "grad_offload":
            start = max(clock["d2h"], ran[k])
            end = clock["d2h"] = start + info["grad_bytes"] / (hw.d2h_gbps * 1e9)
        else:  # evict: instantaneous, on the compute stream's clock
            start = end = clock["compute"]
        out.append(TimedStep(step.op, step.stream, k, info["name"], step.nbytes or (
            info["grad_bytes"] if step.op == "grad_offload" else 0), start, end))
    return out, segs


def build_meta_model(source: str, layers: int | None, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    config = load_config(source)
    if layers is not None:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train(), config


def capture_program(model, batch: int, seq: int, slots: int) -> Program:
    """Compile forward and backward for meta inputs without running megatrain's runtime."""
    def capture(gm, example_inputs, **_):
        megatrain_backend(gm, example_inputs, options={"device": "cpu", "slots": slots})
        return gm.forward  # meta execution: shapes only

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=capture)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    compiled(input_ids=ids, labels=ids, use_cache=False)
    return programs_of(model)[-1]


def inspect_model(source: str, *, layers: int | None = None, batch: int = 1, seq: int = 4096,
                  slots: int = 2, hardware: Hardware, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    t_start = time.perf_counter()
    model, config = build_meta_model(source, layers, dtype)
    program = capture_program(model, batch, seq, slots)
    directions, t = {}, 0.0
    for direction in ("forward", "backward"):
        runner = program.runners[direction]
        steps, segs = simulate(runner, program, hardware, t)
        t = max((s.end for s in steps), default=t)
        saved = 0
        if direction == "backward":
            from .passes import WEIGHT_GROUP
            for n in runner.graph.graph.nodes:
                val = n.meta.get("val")
                if (n.op == "placeholder" and WEIGHT_GROUP not in n.meta and not n.name.startswith("tangents")
                        and isinstance(val, torch.Tensor)):
                    saved += value_bytes(val)
        directions[direction] = DirectionReport(
            segs, steps, runner.schedule.peak_resident_weight_bytes(), saved,
            program.pass_records.get(direction, []),
            {name: body.code for name, body in runner.bodies.items()})
    params = sum(p.numel() for p in model.parameters())
    return {
        "version": 1,
        "model": {"source": source, "model_type": config.model_type, "layers": config.num_hidden_layers,
                  "parameters": params, "dtype": str(dtype).replace("torch.", ""),
                  "distinct_layer_bodies": program.stats_now()["distinct_layer_bodies"]},
        "hardware": hardware.to_dict(),
        "batch": batch, "seq": seq, "slots": slots,
        "directions": directions,
        "step_seconds": t,
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
                "passes": [[name, status] for name, status, _ in d.passes]}
    out = {k: v for k, v in report.items() if k not in ("directions", "inspect_seconds")}
    out["directions"] = {k: conv(v) for k, v in report["directions"].items()}
    return json.dumps(out, indent=2)


def to_chrome_trace(report: dict) -> str:
    """Chrome trace-event JSON (open in Perfetto or chrome://tracing): one track per stream."""
    tids = {"compute": 1, "h2d": 2, "d2h": 3}
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
              for name, tid in tids.items()]
    for direction, d in report["directions"].items():
        for s in d.steps:
            if s.end > s.start:
                events.append({"name": f"{s.op} {s.group}", "cat": direction, "ph": "X", "pid": 0,
                               "tid": tids[s.stream], "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6,
                               "args": {"bytes": s.nbytes, "segment": s.segment}})
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})


_COLORS = {"prefetch": "#4e79a7", "run": "#59a14f", "grad_offload": "#e15759", "wait": "#bab0ac"}


def to_svg(report: dict, width: int = 1400) -> str:
    """A timeline of the three streams (compute, h2d, d2h), forward then backward."""
    steps = [(direction, s) for direction, d in report["directions"].items() for s in d.steps if s.end > s.start]
    total = max((s.end for _, s in steps), default=0.0) or 1.0
    lanes = {"compute": 0, "h2d": 1, "d2h": 2}
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
        out.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{lane_h - 8}" fill="{_COLORS.get(s.op, "#999")}" '
                   f'opacity="{0.95 if direction == "forward" else 0.7}"><title>{direction} {s.op} {s.group}: '
                   f'{(s.end - s.start) * 1e3:.3f} ms, {s.nbytes} bytes</title></rect>')
    y = top + lane_h * len(lanes) + 25
    for i, (op, color) in enumerate(_COLORS.items()):
        out.append(f'<rect x="{left + i * 120}" y="{y - 10}" width="12" height="12" fill="{color}"/>'
                   f'<text x="{left + i * 120 + 16}" y="{y}">{op}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def to_text(report: dict, show: str) -> str:
    m, lines = report["model"], []
    lines.append(f"{m['source']} ({m['model_type']}): {m['layers']} layers, {m['parameters'] / 1e9:.2f}B params, "
                 f"{m['dtype']}; batch {report['batch']} x seq {report['seq']}; slots {report['slots']}; "
                 f"hardware {report['hardware']['name']}; distinct layer bodies {m['distinct_layer_bodies']}")
    for direction, d in report["directions"].items():
        lines.append(f"\n== {direction}")
        if show == "graphs":
            for name, code in d.code.items():
                lines.append(f"-- body {name}\n{code.strip()}")
        elif show == "passes":
            for name, status, delta in d.passes:
                lines.append(f"  {name:<24} {status}{'' if not delta else ' ' + str(delta)}")
        elif show == "memory":
            lines.append(f"  peak resident weights   {_gib(d.peak_resident_weight_bytes)}")
            if direction == "backward":
                lines.append(f"  saved activations       {_gib(d.saved_activation_bytes)}")
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
    lines.append(f"\nestimated step (forward + backward, optimizer not included): "
                 f"{report['step_seconds'] * 1e3:.1f} ms")
    return "\n".join(lines)
