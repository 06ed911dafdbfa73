"""Selective recomputation: keep the activations that are expensive to recompute and cheap to
store, within a device memory budget.

Runs on the joint graph after `recompute_boundaries` (option `recompute="selective"`). By
default every in-layer forward node is recomputed in the backward. Here the outputs of the
FLOP-heavy ops inside layers (matmuls, attention, grouped expert matmuls) are candidates for
saving instead: saving one skips its recompute (the elementwise ops around it are still
recomputed from it). Candidates are grouped by signature (op, output shape, dtype), so identical
layers make identical choices and still share one body, and taken greedily by recompute FLOPs
per saved byte while the extra saved bytes fit `ctx.selective_bytes` (None: take all).

    before:  mm_q (MUST_RECOMPUTE) ... sdpa (MUST_RECOMPUTE) ... mm_down (MUST_RECOMPUTE)
    after:   mm_q (MUST_SAVE)      ... sdpa (MUST_SAVE)      ... mm_down (MUST_RECOMPUTE)
             (bwd recomputes only the elementwise ops between saved values and boundaries)
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..cost_model import logical_bytes, node_flops
from ..ir import AC_GRAPH_ID, RECOMPUTE, SELECTIVE
from . import PassContext, graph_pass
from .recompute_boundaries import forward_nodes



def candidates(gm: fx.GraphModule) -> dict[tuple, list[tuple[list[fx.Node], int, int]]]:
    """signature -> [(nodes to save, flops saved, bytes kept)] over all layers."""
    fwd = forward_nodes(gm)
    out: dict[tuple, list] = defaultdict(list)
    for n in gm.graph.nodes:
        if n not in fwd or "ac_graph_id" not in n.meta or n.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE:
            continue
        flops = node_flops(n)
        if not flops:
            continue
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            nodes = [n]
        else:  # multi-output (attention: output, logsumexp, ...): save the tensor outputs
            nodes = [u for u in n.users if u.target is operator.getitem and isinstance(u.meta.get("val"), torch.Tensor)
                     and u.meta["val"].is_floating_point()]
        if not nodes:
            continue
        nbytes = sum(logical_bytes(u.meta["val"]) for u in nodes)
        shapes = tuple((tuple(u.meta["val"].shape), u.meta["val"].dtype) for u in nodes)
        out[(str(n.target), shapes)].append((nodes, flops, nbytes))
    return out


@graph_pass("selective_recompute", reads=(AC_GRAPH_ID, RECOMPUTE), may_write=(SELECTIVE,),
            uses=("recompute", "selective_bytes"))
def selective_recompute(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.recompute != "selective":
        return gm
    groups = candidates(gm)
    # best value first: recompute FLOPs avoided per byte kept, over all layers with that signature
    ranked = sorted(groups.items(), key=lambda kv: -sum(f for _, f, _ in kv[1]) / max(1, sum(b for *_, b in kv[1])))
    left = ctx.selective_bytes
    for _, items in ranked:
        cost = sum(b for *_, b in items)
        if left is not None and cost > left:
            continue
        for nodes, _, _ in items:
            for n in nodes:
                n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                n.meta[SELECTIVE] = True
        if left is not None:
            left -= cost
    return gm
