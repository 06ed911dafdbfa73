"""Routing-aware expert transfer: fetch only the experts the router picked for this batch.

A transformers MoE layer keeps each expert projection as one 3-D parameter `W[E, out, in]`
and runs it with a grouped matmul whose `offs` (cumulative tokens per expert, from the
router's top-k) says which experts own which rows. An expert with no tokens is never read.
This pass makes the stacked weight's rows a function of the routing:

    before:  W ──transpose──> grouped_mm(x, ·, offs)
    after:   W ──fetch_expert_rows(·, offs)──transpose──> grouped_mm(x, ·, offs)
             W {mt_routed_experts}: the prefetch allocates its device buffer but copies nothing

At run time `fetch_expert_rows` copies from the host only the rows of experts with tokens
(`megacompile/ir_ops.py`, filled by `runtime/expert_rows.py`), after the router has run; the
backward (whose recompute replays the router) does the same, and the gradient, zero for every
expert without tokens, leaves the device for the routed rows only. Exact: the rows that were not fetched are never read.

A weight is routed only when every use is a grouped-matmul weight operand reached through
transposes/permutes that keep the expert dimension first, all with the same `offs`; anything
else (a dense gather of expert rows, a bias indexed by expert id) keeps the full transfer.
Active only with `options={"routed_experts": True}`: it costs one device-to-host read of
`offs` per MoE layer, which pays off when a batch leaves experts idle (small batches, many
experts), not when every expert gets tokens.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..ir_ops import fetch_expert_rows
from ..ir import FLAT_INDEX, ROUTED, WEIGHT_GROUP
from . import PassContext, graph_pass



def grouped_mm_ops() -> set:
    """(input, weight[E, ...], offs, ...) grouped matmuls: torch's and transformers' fp32 fallback."""
    ops = {torch.ops.aten._grouped_mm.default}
    ns = getattr(torch.ops, "transformers", None)
    for name in ("grouped_mm_fallback", "grouped_mm_fallback_backward"):
        try:
            ops.add(getattr(getattr(ns, name), "default"))
        except (AttributeError, RuntimeError):
            pass  # transformers' op not registered in this process
    return ops


def _keeps_expert_dim(node: fx.Node) -> bool:
    if node.target is torch.ops.aten.transpose.int:
        ndim = node.args[0].meta["val"].dim()
        return 0 not in {d % ndim for d in node.args[1:3]}
    if node.target is torch.ops.aten.permute.default:
        return list(node.args[1])[0] % node.args[0].meta["val"].dim() == 0
    return False


def _routed_uses(weight: fx.Node, ops: set) -> list[tuple[fx.Node, list[fx.Node]]] | None:
    """[(grouped mm, view chain from the weight)] if every use of `weight` is a grouped-mm weight
    operand (through expert-preserving views), else None."""
    uses, stack = [], [(weight, [])]
    while stack:
        value, chain = stack.pop()
        for user in value.users:
            if user.op == "output" and value is weight:
                continue  # saved for the backward: the executor hands back the host parameter
            if user.op == "call_function" and user.target in ops and len(user.args) > 2 and user.args[1] is value \
                    and user.args[0] is not value:
                uses.append((user, chain))
            elif user.op == "call_function" and _keeps_expert_dim(user):
                stack.append((user, chain + [user]))
            else:
                return None
    return uses or None


@graph_pass("routed_experts", reads=(FLAT_INDEX,), may_write=(ROUTED,), uses=("direction", "routed_experts"))
def routed_experts(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not ctx.routed_experts or ctx.direction == "joint":
        return gm
    ops = grouped_mm_ops()
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    for weight in [n for n in gm.graph.nodes if n.op == "placeholder" and WEIGHT_GROUP in n.meta]:
        val = weight.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() != 3:
            continue
        uses = _routed_uses(weight, ops)
        if uses is None or len({mm.args[2] for mm, _ in uses}) != 1:
            continue
        offs = uses[0][0].args[2]
        first = min((mm for mm, _ in uses), key=order.__getitem__)
        with gm.graph.inserting_before(first):
            fetched = gm.graph.call_function(fetch_expert_rows, (weight, offs))
        fetched.meta = {"val": val, "nn_module_stack": first.meta.get("nn_module_stack", {}), ROUTED: True}
        clones: dict[fx.Node, fx.Node] = {}
        anchor = fetched
        for mm, chain in uses:
            value = fetched
            for view in chain:
                if view not in clones:
                    with gm.graph.inserting_after(anchor):
                        clones[view] = gm.graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))
                    clones[view].meta = dict(view.meta)
                    anchor = clones[view]
                value = clones[view]
            mm.update_arg(1, value)
        for view in sorted(clones, key=order.__getitem__, reverse=True):
            if not view.users:
                gm.graph.erase_node(view)
        weight.meta[ROUTED] = True
    gm.graph.lint()
    gm.recompile()
    return gm
