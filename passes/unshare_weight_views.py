"""Give every segment its own copy of a weight view that several segments read.

Layers that share one module (Zamba2's shared transformer block runs in every hybrid layer)
read the same parameters, and tracing CSEs their views: one `t(w_q)` feeds the q projection of
layer 1 and of layer 3 (in the backward too, where the gradient matmuls read `t(w)`). Left
alone, layer 3 would read a value computed in layer 1's segment, which keeps a view of layer 1's
weight buffer alive past its eviction and makes layer 3's body differ from layer 1's. Views are
free, so each segment recomputes its own from the weight, which it then fetches itself:

    before:  w_q ─ t ─┬─ mm (layer 1)        after:  w_q ─┬─ t ─ mm (layer 1)
                      └─ mm (layer 3)                     └─ t' ─ mm (layer 3)   {mt_rank of layer 3}

A node is cloned when it reads weights alone (views, casts of weights) and its readers run in
different segments (the ranks `layer_regions` gave them). When anything was cloned, every
weight-only node then moves right before its first reader, so the clone sits where the original
sits in its own layer and identical layers keep identical bodies.
"""
from __future__ import annotations

import torch.fx as fx

from ..ir import GROUP, RANK
from . import PassContext, graph_pass, weight_only_nodes


@graph_pass("unshare_weight_views", reads=(RANK, GROUP))
def unshare_weight_views(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    changed = False
    for n in reversed(weight_only_nodes(gm)):  # readers first, so a cloned chain splits in turn
        by_rank: dict[int, list[fx.Node]] = {}
        for user in n.users:
            if user.op != "output" and RANK in user.meta:
                by_rank.setdefault(user.meta[RANK], []).append(user)
        for rank, users in by_rank.items():
            if rank == n.meta.get(RANK):
                continue  # this segment computes the original
            with gm.graph.inserting_after(n):
                clone = gm.graph.node_copy(n)
            clone.meta = {**n.meta, RANK: rank, GROUP: users[0].meta[GROUP]}
            for user in users:
                user.replace_input_with(n, clone)
            changed = True
    if changed:
        order = {n: k for k, n in enumerate(gm.graph.nodes)}
        for n in reversed(weight_only_nodes(gm)):
            readers = [u for u in n.users if u.op != "output"]
            if readers:
                first = min(readers, key=order.__getitem__)
                first.prepend(n)
                order[n] = order[first] - 0.5
        gm.graph.lint()
        gm.recompile()
    return gm
