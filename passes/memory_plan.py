"""Memory plan: predicted device bytes at every step of a schedule, and the budget check.

Reads the split graph and its schedule. Device bytes at a step are the resident weights (from
the schedule's prefetch/evict), the live values between segments (each freed after its last
reader, as the executor does) and, while a body runs, its intermediates (liveness over the
body's traced shapes; symbolic sizes use their hints). `check_budget` refuses a step whose
planned peak (over forward and backward) exceeds `device_budget`, naming the smallest budget
that fits and what to change.

    gm.meta["mt_memory_plan"] = MemoryPlan(peak_bytes, peak_step, transient={body: bytes}, ...)
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ..errors import CannotFitError  # (re-exported: the schedule's peak exceeds the device budget)
from ..ir import BODY, MEMORY_PLAN, SCHEDULE, SEGMENT, WEIGHT_GROUP, MemoryPlan, dim_hint, liveness, segment_calls
from ..runtime.expert_rows import fetch_expert_rows
from . import PassContext, graph_pass
# fetch_expert_rows returns the (resident) weight it fills
_ALIASING = {torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default, fetch_expert_rows}


def _tensor_bytes(v: torch.Tensor) -> int:
    # the whole storage, as the allocator holds it (a view keeps its base alive)
    try:
        return dim_hint(v.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # e.g. tensors without storage
        return math.prod(dim_hint(d) for d in v.shape) * v.element_size()


def value_bytes(val) -> int:
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(_tensor_bytes(v) for v in vals if isinstance(v, torch.Tensor))


def _workspace(n: fx.Node, triton: bool) -> int:
    """Bytes an op allocates internally beyond its outputs (our fused ops; 0 for aten ops)."""
    if n.op == "call_function" and getattr(n.target, "name", lambda: "")() == "megatrain::linear_cross_entropy":
        from ..runtime.kernels.ops import linear_cross_entropy_workspace, triton_runs
        hidden, weight = (a.meta.get("val") for a in n.args[:2])
        if isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor):
            vocab, n_hidden = (dim_hint(d) for d in weight.shape)
            n_rows = math.prod(dim_hint(d) for d in hidden.shape) // max(1, n_hidden)
            return linear_cross_entropy_workspace(n_rows, vocab, n_hidden, hidden.dtype,
                                                  triton or triton_runs(hidden), bool(n.args[6]))
    return 0


def body_transient_bytes(body: fx.GraphModule, triton: bool = False) -> int:
    """Peak bytes of a body's intermediates (and fused ops' workspaces, with `triton` as on a
    GPU); views and getitems alias their producer."""
    def size(n: fx.Node) -> int:
        if n.target is operator.getitem or n.target in _ALIASING or getattr(n.target, "is_view", False):
            return 0
        return value_bytes(n.meta.get("val"))

    nodes = list(body.graph.nodes)
    last = {a: i for i, n in enumerate(nodes) for a in n.all_input_nodes}
    live, peak, sizes = 0, 0, {}
    for i, n in enumerate(nodes):
        if n.op in ("call_function", "call_method", "call_module"):
            sizes[n] = size(n)
            live += sizes[n]
            peak = max(peak, live + _workspace(n, triton))
        for a in n.all_input_nodes:
            if last.get(a) == i and a in sizes:
                live -= sizes.pop(a)
    return peak


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"




def check_budget(plans: dict[str, MemoryPlan], budget: int | None, slots: int) -> None:
    """Refuse a step (all compiled directions) whose planned peak exceeds `budget`."""
    if budget is None or not plans:
        return
    direction, plan = max(plans.items(), key=lambda kv: kv[1].peak_bytes)
    if plan.peak_bytes <= budget:
        return
    peak, weights = plan.peak_bytes, plan.peak_weight_bytes
    with_one_slot = max(p.peak_bytes - p.peak_weight_bytes + p.largest_segment_weight_bytes for p in plans.values())
    raise CannotFitError(
        f"cannot fit a training step in device_budget={_fmt(budget)}: the {direction} pass peaks at {_fmt(peak)} "
        f"(resident weights {_fmt(weights)} with slots={slots}, the rest activations and intermediates). "
        f"The smallest budget that fits this schedule is {peak} bytes"
        + (f"; with slots=1 about {_fmt(with_one_slot)}" if slots > 1 else "")
        + ". Or lower the batch size or sequence length, or set recompute_head=True.")


@graph_pass("memory_plan", reads=(SEGMENT, SCHEDULE), writes=(MEMORY_PLAN,), uses=("device", "hardware"))
def memory_plan(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    schedule = gm.meta[SCHEDULE]
    calls = segment_calls(gm)
    transient = {}
    # fused ops' workspaces as they run on a GPU (Triton), also when planning one from here
    triton = getattr(ctx.device, "type", None) == "cuda" or getattr(ctx.hardware, "name", "cpu") != "cpu"
    for n in calls:
        name = n.meta.get(BODY, n.target)
        if name not in transient:
            transient[name] = body_transient_bytes(gm.get_submodule(name), triton)
    lives = liveness(gm)   # (the executor frees by the same analysis)
    last_use, offloaded = lives.last_use, lives.offloaded
    sizes = {n.name: value_bytes(n.meta.get("val")) for n in gm.graph.nodes}
    live = {n.name for n in gm.graph.nodes if n.op == "placeholder" and WEIGHT_GROUP not in n.meta}
    resident = peak = peak_weights = 0
    per_step, peak_step = [], 0

    def live_bytes() -> int:
        return sum(sizes[v] for v in live) + resident

    for i, step in enumerate(schedule.steps):
        k = step.segment
        if step.op == "prefetch":
            resident += step.nbytes
            peak_weights = max(peak_weights, resident)
            now = live_bytes()
        elif step.op == "evict":
            resident -= step.nbytes
            now = live_bytes()
        elif step.op == "run":
            n = calls[k]
            before = live_bytes()
            live.update(n.meta[SEGMENT]["outputs"])
            now = max(before + transient[n.meta.get(BODY, n.target)], live_bytes())
            live.difference_update([a.name for a in n.all_input_nodes if last_use.get(a.name) == k])
            live.difference_update([o for o in n.meta[SEGMENT]["outputs"]
                                    if o not in last_use and o not in offloaded])
        elif step.op == "grad_offload":
            live.difference_update([name for _, name in schedule.segments[k].grads
                                    if last_use.get(name, -1) <= k])
            now = live_bytes()
        else:
            now = live_bytes()
        per_step.append(now)
        if now > peak:
            peak, peak_step = now, i
    gm.meta[MEMORY_PLAN] = MemoryPlan(peak, peak_step, peak_weights, transient, per_step,
                                      max((seg.weight_nbytes for seg in schedule.segments), default=0))
    return gm
