"""Data parallelism: turn a schedule program's transfers into sharded transfers and collectives.

With `ranks` > 1 ranks sharing one host copy of the state (a node, megacompile/distributed.py),
each rank owns a part of every weight (its slice of the segment's arena row; the loose weights
it was given whole: runtime/host_arena.py) and updates only that part. So each fetch brings
this rank's part and a collective assembles the rest, and each gradient is summed over the
ranks and only the owned part goes back to the host:

    prefetch(3, [w...])               ->  prefetch_shard(3, [w...])    (h2d: this rank's part)
                                          all_gather(3)                (comm: the whole segment)
    grad_offload(7, [g...])           ->  reduce_scatter(7, [g...])    (comm: fp32 sum, own part kept)
                                          grad_offload(7, [g...])      (d2h: the owned part only)

The runtime's handlers (runtime/executor.py) run them over the node's process group; the
memory plan counts a sharded fetch as the whole segment (the gathered buffer is whole) and the
simulator times them (the collectives as free in this version). Disabled, or with one rank,
the program is unchanged: every rank would then fetch whole weights it does not own, which the
runtime refuses under data parallelism.
"""
from __future__ import annotations

import torch.fx as fx

from ..ir import SCHEDULE, SCHEDULE_OPS, SEGMENT, STEP, Step, op_of
from . import PassContext, graph_pass


@graph_pass("data_parallel", reads=(SEGMENT, SCHEDULE), writes=(SCHEDULE,), uses=("data_parallel",))
def data_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.data_parallel <= 1:
        return gm
    schedule = gm.meta[SCHEDULE]
    graph = schedule.program.graph
    fetches = collectives = 0
    for node in list(graph.nodes):
        op = op_of(node)
        step = node.meta.get(STEP)
        if op == "prefetch":
            node.target = SCHEDULE_OPS["prefetch_shard"]
            node.meta[STEP] = Step("prefetch_shard", step.stream, step.segment, step.nbytes)
            with graph.inserting_after(node):
                gather = graph.call_function(SCHEDULE_OPS["all_gather"], (step.segment,))
            gather.meta[STEP] = Step("all_gather", "comm", step.segment, step.nbytes)
            fetches += 1
        elif op == "grad_offload":
            seg = schedule.segments[step.segment]
            with graph.inserting_before(node):
                rs = graph.call_function(SCHEDULE_OPS["reduce_scatter"], (step.segment, list(node.args[1])))
            rs.meta[STEP] = Step("reduce_scatter", "comm", step.segment, sum(seg.grad_nbytes.values()))
            collectives += 1
    schedule.program.recompile()
    ctx.records.append(f"data parallel over {ctx.data_parallel} ranks: {fetches} sharded fetches, "
                       f"{collectives} reduce-scatters")
    return gm
