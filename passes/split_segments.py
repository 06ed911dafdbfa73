"""Split a graph into per-segment submodules, in execution (rank) order.

Requires every node to carry `mt_rank` (from `layer_regions`). Produces a top-level graph that
calls one submodule per segment; values crossing segments become submodule inputs/outputs.
Submodule inputs are ordered by first use, so structurally identical layers get identical
signatures (which `dedupe_bodies` relies on).

    before:  placeholder* -> n1 .. nK (ranks mixed) -> output
    after:   placeholder* -> seg0(...) -> getitem* -> seg1(...) -> getitem* ... -> output
             seg_k: GraphModule holding exactly the nodes of rank k
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from ..ir import GROUP, RANK, SEGMENT, lazy_graph_module
from . import PassContext, graph_pass



def _extract(gm: fx.GraphModule, members: list[fx.Node], member_set: set[fx.Node]):
    """Build a GraphModule for `members`; return (module, input nodes, output nodes)."""
    graph = fx.Graph()
    root = torch.nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []
    for n in members:  # inputs in first-use order: identical layers get identical signatures
        for a in n.all_input_nodes:
            if a not in member_set and a not in env:
                env[a] = graph.placeholder(a.name)
                env[a].meta = dict(a.meta)
                inputs.append(a)
    for n in members:
        if n.op == "get_attr":
            setattr(root, n.target, getattr(gm, n.target))
        env[n] = graph.node_copy(n, lambda a: env[a])
        env[n].meta = dict(n.meta)
    outputs = [n for n in members if any(u not in member_set for u in n.users)]
    graph.output(tuple(env[o] for o in outputs))
    return lazy_graph_module(root, graph), inputs, outputs


@graph_pass("split_segments", reads=(RANK, GROUP), writes=(SEGMENT,))
def split_segments(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    by_rank: dict[int, list[fx.Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "output"):
            by_rank[n.meta[RANK]].append(n)

    top = fx.Graph()
    top_root = torch.nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = top.node_copy(n, lambda a: env[a])
            env[n].meta = dict(n.meta)
    for k, rank in enumerate(sorted(by_rank)):
        members = by_rank[rank]
        module, inputs, outputs = _extract(gm, members, set(members))
        name = f"seg{k}"
        top_root.add_module(name, module)
        call = top.call_module(name, tuple(env[i] for i in inputs))
        call.meta[SEGMENT] = {"group": members[0].meta[GROUP], "rank": rank,
                              "outputs": [o.name for o in outputs]}
        for j, o in enumerate(outputs):
            item = top.call_function(operator.getitem, (call, j))
            item.name = o.name
            item.meta = dict(o.meta)
            env[o] = item
    out = next(n for n in gm.graph.nodes if n.op == "output")
    top.output(fx.map_arg(out.args[0], lambda a: env[a]))
    top.lint()
    new = lazy_graph_module(top_root, top)
    new.meta.update(gm.meta)
    return new
