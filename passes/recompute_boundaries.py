"""Layer-boundary recomputation: only the hidden states that cross a segment boundary are saved.

Runs on AOTAutograd's joint graph before the min-cut partitioner. Every forward node of segment
g is tagged MUST_RECOMPUTE with `ac_graph_id = g`; the partitioner's own cleanup turns a tagged
node whose user lies in a later id into MUST_SAVE, so what is saved is exactly the boundary
tensors (plus weight-free prologue values such as rotary tables and masks, which the min-cut
decides). The head (final norm, LM head, loss) is left to the min-cut unless
`recompute_head` is set: recomputing the logits costs a vocabulary-sized matmul per step, keeping
them costs batch x sequence x vocabulary bytes. Weights are primals, so the backward reads them
as primals and re-derives transposes (`t(w)`) itself instead of keeping a transposed copy alive.

    fwd:  h_i = layer_i(h_{i-1}, W_i)       bwd:  recompute layer_i from h_{i-1}, W_i
          [save h_{i-1}]                           then grad of layer_i
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..ir import AC_GRAPH_ID, GROUP, RECOMPUTE
from . import PassContext, graph_pass, weight_only_nodes
from .layer_regions import PROLOGUE


def forward_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Joint-graph nodes that do not depend on any tangent."""
    backward: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name.startswith("tangents"):
            backward.add(n)
        elif any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    return {n for n in gm.graph.nodes if n not in backward and n.op not in ("placeholder", "output")}


@graph_pass("recompute_boundaries", reads=(GROUP,), writes=(RECOMPUTE, AC_GRAPH_ID),
            uses=("num_groups", "recompute_head"))
def recompute_boundaries(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    fwd = forward_nodes(gm)
    weight_only = set(weight_only_nodes(gm, fwd))
    for n in fwd:
        if n.target is torch.ops.higher_order.invoke_subgraph:
            # A layer kind's call (layer_subgraphs.py): its own partition already recomputes the
            # layer inside its backward call, so the outer backward never re-runs the forward call.
            # Its getitems are what the backward reads; the partitioner never bans a getitem
            # (tagging one MUST_SAVE does nothing) and a MUST_RECOMPUTE call would let the
            # min-cut recompute every layer from the embedding in one segment. Banning the call
            # makes the getitems the backward needs (each layer's input) the saved boundaries.
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            continue
        if n.target is operator.getitem and n.args[0].target is torch.ops.higher_order.invoke_subgraph:
            continue   # left to the min-cut: saved where the backward reads it, never recomputed
        if n in weight_only:
            # t(w), w.view(...), w.to(dtype): never saved, so no derived copy of a weight stays
            # alive between forward and backward (no ac_graph_id: the partitioner's boundary
            # cleanup must not turn it into a save either)
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            continue
        group = n.meta.get(GROUP, PROLOGUE)
        if group == PROLOGUE and any(u.target is torch.ops.higher_order.invoke_subgraph for u in n.users):
            # A prologue value the layer calls read (rotary tables, masks). The min-cut bans
            # recomputing what a non-fusible op reads in the backward (the backward calls), so
            # it would keep cos and sin themselves, not their one common input as it does for
            # the whole graph (at 1M tokens of Llama-3-8B: 1 GiB on the device instead of 0.5).
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            continue
        if group == PROLOGUE or (group == ctx.num_groups - 1 and not ctx.recompute_head):
            continue
        n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        n.meta["ac_graph_id"] = group
        # A value read by a later segment is that segment's boundary input: save it, so every
        # segment's backward recomputes from its own inputs only (and identical layers stay
        # identical even when the head is not recomputed).
        if any(u in fwd and u.meta.get(GROUP, PROLOGUE) > group for u in n.users):
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return gm


def recompute_whole_layer(joint: fx.GraphModule) -> fx.GraphModule:
    """A layer kind's own joint graph (AOTAutograd partitions each layer_subgraphs.py subgraph
    apart): every forward node MUST_RECOMPUTE, so the backward recomputes the layer from its
    inputs, which the outer partition saves as the layer's boundary (what recompute_boundaries
    does to a layer inside the whole joint graph)."""
    for n in forward_nodes(joint):
        n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return joint
