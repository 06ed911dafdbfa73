"""Give every weight group its own copy of a weight view that several groups read.

Layers that share one module (Zamba2's shared transformer block runs in every hybrid layer)
read the same parameters, and tracing CSEs their views: one `t(w_q)` feeds the q projection of
layer 1 and of layer 3. Left alone, layer 3 would read a value computed in layer 1's segment,
which keeps a view of layer 1's weight buffer alive past its eviction and makes layer 3's body
differ from layer 1's. Views are free, so each group recomputes its own:

    before:  w_q ─ t ─┬─ mm (layer 1)        after:  w_q ─┬─ t ─ mm (layer 1)
                      └─ mm (layer 3)                     └─ t' ─ mm (layer 3)

A node is cloned only if it reads weights alone (a weight-only value: views, casts of weights)
and its users prefer different groups by their module (`layer_regions.preferred_group`).
"""
from __future__ import annotations

import torch.fx as fx

from . import FLAT_INDEX, WEIGHT_GROUP, PassContext, graph_pass
from .layer_regions import preferred_group


@graph_pass("unshare_weight_views", requires=(FLAT_INDEX,), provides=())
def unshare_weight_views(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    changed = False
    for n in reversed(_weight_only_nodes(gm)):  # consumers first, so a cloned view's inputs split in turn
        by_group: dict[int, list[fx.Node]] = {}
        for user in n.users:
            group = preferred_group(user, ctx) if user.op != "output" else None
            if group is not None:
                by_group.setdefault(group, []).append(user)
        if len(by_group) < 2:
            continue
        for group in sorted(by_group)[1:]:  # the first group keeps the original
            users = by_group[group]
            with gm.graph.inserting_after(n):
                clone = gm.graph.node_copy(n)
            clone.meta = dict(n.meta)
            if "nn_module_stack" in users[0].meta:
                clone.meta["nn_module_stack"] = users[0].meta["nn_module_stack"]
            for user in users:
                user.replace_input_with(n, clone)
        changed = True
    if changed:
        # Every weight-only node right before its first reader (consumers first, so chains stay
        # in order): a cloned view then sits where the original sits in its own layer, and the
        # layers' bodies stay identical.
        _sink_weight_only(gm)
        gm.graph.lint()
        gm.recompile()
    return gm


def _weight_only_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Call nodes that read weights and nothing else, in graph order."""
    seen = {n for n in gm.graph.nodes if n.op == "placeholder" and WEIGHT_GROUP in n.meta}
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.all_input_nodes and all(a in seen for a in n.all_input_nodes):
            seen.add(n)
            out.append(n)
    return out


def _sink_weight_only(gm: fx.GraphModule) -> None:
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    for n in reversed(_weight_only_nodes(gm)):
        users = [u for u in n.users if u.op != "output"]
        if users:
            first = min(users, key=lambda u: order[u])
            first.prepend(n)
            order[n] = order[first] - 0.5
