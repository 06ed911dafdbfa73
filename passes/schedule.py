"""Build the transfer schedule of a split graph: when each segment's weights are fetched,
waited on, evicted, and when its gradients leave the device.

The schedule is a program (`gm.meta["mt_schedule"].program`, megacompile/ir.py): the direction
graph with the transfers written out as `torch.ops.megatrain.prefetch / wait / evict /
grad_offload` nodes around the body calls; the runtime runs it, the memory plan and the
simulator walk it, tools print it.
With `slots` weight slots, up to `slots` weight-reading segments are resident: the running one
and up to `slots - 1` prefetched ahead of it. A prefetch is issued right after an evict frees a
slot, so residency never exceeds the budget. How far ahead to prefetch (the lookahead) comes
from the cost model when a hardware profile is known (`ctx.hardware`): the schedule is
simulated for every lookahead the slots allow and the smallest one within 1% of the fastest
wins, in the forward and in the backward (whose bodies include the recompute). Without a
profile the lookahead is `slots - 1`. In the backward, each parameter's gradient is offloaded
right after the segment that finalises it.

    prefetch s0, prefetch s1 | wait s0, run s0, [grad_offload s0], evict s0, prefetch s2 |
    wait s1, run s1, ...
"""
from __future__ import annotations

import torch.fx as fx

from ..cost_model import logical_bytes
from ..ir import (BODY, FLAT_INDEX, ROUTED, SCHEDULE, SEGMENT, WEIGHT_GROUP, Schedule, SegmentInfo,  # noqa: F401
                  Step, schedule_program, segment_calls)
from . import PassContext, graph_pass



def _segment_infos(gm: fx.GraphModule, ctx: PassContext) -> list[SegmentInfo]:
    infos, where = [], {}
    for n in segment_calls(gm):
        weights = sorted({a.meta[FLAT_INDEX] for a in n.all_input_nodes
                          if a.op == "placeholder" and WEIGHT_GROUP in a.meta})
        routed = sorted({a.meta[FLAT_INDEX] for a in n.all_input_nodes
                         if a.op == "placeholder" and a.meta.get(ROUTED)})
        infos.append(SegmentInfo(n.target, n.meta[SEGMENT]["group"], weights,
                                 weight_nbytes=sum(ctx.weight_nbytes.get(i, 0) for i in weights),
                                 body=n.meta.get(BODY, ""), routed=routed))
        where[n] = len(infos) - 1
    if ctx.direction == "backward":
        out = next(n for n in gm.graph.nodes if n.op == "output")
        for flat_index, value in enumerate(out.args[0]):
            if isinstance(value, fx.Node) and flat_index in ctx.flat_groups and value.op == "call_function":
                seg = infos[where[value.args[0]]]
                seg.grads.append((flat_index, value.name))
                seg.grad_nbytes[flat_index] = logical_bytes(value.meta.get("val"))
    return infos


def build_steps(segments: list[SegmentInfo], lookahead: int) -> list[Step]:
    """The step list for `segments` in execution order, keeping `lookahead` weight-reading
    segments prefetched ahead of the running one (so `lookahead + 1` resident)."""
    fetching = [k for k, s in enumerate(segments) if s.weights]
    steps: list[Step] = []
    issued = 0

    def prefetch_next():
        nonlocal issued
        k = fetching[issued]
        steps.append(Step("prefetch", "h2d", k, segments[k].weight_nbytes))
        issued += 1

    while issued < min(lookahead + 1, len(fetching)):
        prefetch_next()
    for k, seg in enumerate(segments):
        if seg.weights:
            steps.append(Step("wait", "compute", k))
        steps.append(Step("run", "compute", k))
        if seg.grads:
            steps.append(Step("grad_offload", "d2h", k))
        if seg.weights:
            steps.append(Step("evict", "compute", k, seg.weight_nbytes))
            if issued < len(fetching):
                prefetch_next()
    return steps


def choose_lookahead(segments: list[SegmentInfo], costs, hw, slots: int) -> int:
    """The smallest lookahead (<= slots - 1) whose simulated time is within 1% of the best.

    Prefetching further ahead only helps while transfers are exposed (bytes / link bandwidth
    above the compute they can hide behind); every extra slot costs a segment of device memory.
    """
    from ..simulate import makespan, simulate
    times = [makespan(simulate(build_steps(segments, d), costs, hw)) for d in range(slots)]
    best = min(times)
    return next(d for d, t in enumerate(times) if t <= best * 1.01)


def segment_costs(gm: fx.GraphModule, segments: list[SegmentInfo], hw) -> list:
    """Per-segment cost (body time on `hw`, bytes moved) for the simulator."""
    from ..cost_model import body_seconds
    from ..simulate import SegmentCost
    costs, cache = [], {}
    for seg in segments:
        body = gm.get_submodule(seg.body or seg.name)
        if id(body) not in cache:
            cache[id(body)] = body_seconds(body, hw)
        grad_bytes = sum(seg.grad_nbytes.values())
        costs.append(SegmentCost(seg.name, seg.weight_nbytes, grad_bytes, cache[id(body)]))
    return costs


@graph_pass("schedule", reads=(SEGMENT, FLAT_INDEX), writes=(SCHEDULE,),
            uses=("direction", "flat_groups", "hardware", "slots", "weight_nbytes"))
def schedule(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    segments = _segment_infos(gm, ctx)
    lookahead = ctx.slots - 1
    if ctx.hardware is not None and ctx.slots > 1:
        lookahead = choose_lookahead(segments, segment_costs(gm, segments, ctx.hardware), ctx.hardware, ctx.slots)
    program = schedule_program(gm, segments, build_steps(segments, lookahead))
    gm.meta[SCHEDULE] = Schedule(ctx.direction, ctx.slots, segments, program, lookahead)
    return gm
