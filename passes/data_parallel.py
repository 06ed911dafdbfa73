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

With more than one node (`nodes`), a rank's reduced part is also all-reduced with the same
rank of the other nodes (their replicas). The runtime's handlers (runtime/executor.py) run them
over the node's process group; the memory plan counts a sharded fetch as the whole segment (the
gathered buffer is whole) and the simulator times them on the peer links (megacompile/simulate.py).
With one rank on one node the program is unchanged. Disabling the pass under data parallelism is
refused (backend._check_data_parallel): every rank would fetch and update weights it does not own.
"""
from __future__ import annotations

import torch.fx as fx

from ..ir import SCHEDULE, SCHEDULE_OPS, SEGMENT, STEP, Step, op_of
from . import PassContext, graph_pass


def sharded(step: Step, ranks: int, fp32_grad_bytes: int = 0, nodes: int = 1) -> list[Step]:
    """The steps that replace one schedule step with `ranks` ranks (the pass's rewrite, as data:
    `megatrain plan --gpus` simulates these). A fetch keeps the whole slot (`nbytes`, what the
    memory plan counts) but moves 1/ranks of it over PCIe and (ranks-1)/ranks over the peer
    links; a gradient offload becomes an fp32 reduce-scatter ((ranks-1)/ranks of the fp32 bytes
    over the peer links; with `nodes` > 1 then an all-reduce of the part across the nodes) and
    the offload of this rank's fp32 part."""
    if ranks * nodes <= 1:
        return [step]
    if step.op == "prefetch":
        return [Step("prefetch_shard", step.stream, step.segment, step.nbytes, moved=-(-step.nbytes // ranks)),
                Step("all_gather", "comm", step.segment, step.nbytes * (ranks - 1) // ranks)]
    if step.op == "grad_offload":
        return [Step("reduce_scatter", "comm", step.segment, fp32_grad_bytes * (ranks - 1) // ranks),
                Step("grad_offload", step.stream, step.segment, -(-fp32_grad_bytes // ranks))]
    return [step]


def _fp32_bytes(values) -> int:
    return sum(4 * v.meta["val"].numel() for v in values if isinstance(v, fx.Node) and "val" in v.meta)


@graph_pass("data_parallel", reads=(SEGMENT, SCHEDULE), writes=(SCHEDULE,),
            uses=("data_parallel", "data_parallel_nodes"))
def data_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    ranks, nodes = ctx.data_parallel, ctx.data_parallel_nodes
    if ranks * nodes <= 1:
        return gm
    schedule = gm.meta[SCHEDULE]
    graph = schedule.program.graph
    fetches = collectives = 0
    for node in list(graph.nodes):
        op = op_of(node)
        if op not in ("prefetch", "grad_offload"):
            continue
        step = node.meta[STEP]
        steps = sharded(step, ranks, _fp32_bytes(node.args[1]) if op == "grad_offload" else 0, nodes)
        if op == "prefetch":
            node.target = SCHEDULE_OPS["prefetch_shard"]
            node.meta[STEP] = steps[0]
            with graph.inserting_after(node):
                gather = graph.call_function(SCHEDULE_OPS["all_gather"], (step.segment,))
            gather.meta[STEP] = steps[1]
            fetches += 1
        else:
            with graph.inserting_before(node):
                rs = graph.call_function(SCHEDULE_OPS["reduce_scatter"], (step.segment, list(node.args[1])))
            rs.meta[STEP], node.meta[STEP] = steps
            collectives += 1
    schedule.program.recompile()
    ctx.records.append(("data_parallel", "sharded", {"ranks": ranks, "nodes": nodes, "fetches": fetches,
                                                      "reduce_scatters": collectives}))
    return gm
