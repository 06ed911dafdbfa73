"""Assign every node to the segment (weight group) that computes it, by data flow.

Splitting by `nn_module_stack` alone makes cycles and mislabels CSE'd shared nodes, so data
flow decides what is legal and the module stack only breaks ties. Each weight group has a time
rank: forward runs embed(0), layers 1..N, head(N+1); backward runs them in reverse.

  * A node that depends on weights can run no earlier than the latest-ranked weight-dependent
    value it reads (ASAP) and no later than its earliest consumer (ALAP). Inside that window it
    goes where its module says (layer k+1's input RMSNorm statistics, computed from layer k's
    output, belong to layer k+1). Forward glue of the top-level model (no module) goes ALAP, to
    its consumer; anything else to the ASAP rank.
  * A weight-free node (masks, rotary tables, symbolic sizes, recompute from a saved boundary)
    used by several segments runs in the prologue (rank -1), so that all decoder layers get the
    same structure and identical layers dedupe to one body. Used by one segment, it runs there,
    or earlier if its module belongs to an earlier segment.

Ranks never decrease along an edge, so segments in rank order are a valid schedule.

    ids -> [embed: gather(w_e)] -> [layer 1: rmsnorm, q/k/v, sdpa, o, mlp] -> ... -> [head: lm_head, loss]
"""
from __future__ import annotations

import operator
import re

import torch.fx as fx
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

from ..ir import FLAT_INDEX, GROUP, RANK, WEIGHT_GROUP
from . import PassContext, graph_pass

PROLOGUE = -1
_ROOT = re.compile(r"^L\[[^\]]*\](?:\[[^\]]*\])*\.?")
_INDEX = re.compile(r"\[(\d+)\]")


def group_rank(group: int, ctx: PassContext) -> int:
    if group == PROLOGUE:
        return PROLOGUE
    return group if ctx.direction in ("forward", "joint", "dynamo") else ctx.num_groups - 1 - group


def rank_group(rank: int, ctx: PassContext) -> int:
    return group_rank(rank, ctx)  # the mapping is its own inverse


def module_fqn(path: str) -> str | None:
    """A module path as Dynamo writes it (`L['self'].model.layers[3].mlp`) as an FQN relative to
    the compiled model (`model.layers.3.mlp`)."""
    return _INDEX.sub(r".\1", _ROOT.sub("", path)) or None


def module_path(node: fx.Node) -> str | None:
    """FQN (relative to the compiled model) of the innermost module that produced `node`."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    return module_fqn(list(stack.values())[-1][0])


def _preferred_rank(node: fx.Node, ctx: PassContext) -> int | None:
    group = preferred_group(node, ctx)
    return None if group is None else group_rank(group, ctx)


def call_group(call: fx.Node) -> int | None:
    """The layer (weight group) a layer kind's call (layer_subgraphs.py) belongs to: the one
    whose weights it reads; None if it reads none or several groups' weights."""
    groups = {a.meta[WEIGHT_GROUP] for a in call.all_input_nodes if WEIGHT_GROUP in a.meta}
    return groups.pop() if len(groups) == 1 else None


def preferred_group(node: fx.Node, ctx: PassContext) -> int | None:
    if node.target is invoke_subgraph:
        # a call has no module path of its own (mark_checkpoints reads the groups of its outputs)
        return call_group(node)
    path = module_path(node)
    while path:
        if path in ctx.module_groups:
            return ctx.module_groups[path]
        path = path.rpartition(".")[0]
    return None


@graph_pass("layer_regions", reads=(FLAT_INDEX,), writes=(GROUP, RANK),
            uses=("direction", "module_groups", "num_groups"))
def layer_regions(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    nodes = list(gm.graph.nodes)
    asap: dict[fx.Node, int] = {}   # weight-dependent nodes only
    for n in nodes:
        if n.op == "placeholder":
            if WEIGHT_GROUP in n.meta:
                # a weight is available to every segment that fetches it: a tied weight read by
                # modules of several groups (embedding and LM head) bounds its readers by the
                # earliest of them, not by the group that owns it
                ranks = [group_rank(n.meta[WEIGHT_GROUP], ctx)]
                ranks += [r for u in n.users if (r := _preferred_rank(u, ctx)) is not None]
                asap[n] = min(ranks)
        elif n.op != "output":
            deps = [asap[a] for a in n.all_input_nodes if a in asap]
            if deps:
                asap[n] = max(deps)

    last_rank = ctx.num_groups - 1
    rank: dict[fx.Node, int] = {}
    for n in reversed(nodes):
        if n.op in ("placeholder", "output"):
            continue
        user_ranks = {rank[u] if u.op != "output" else last_rank for u in n.users}
        if n in asap:
            alap = min(user_ranks, default=last_rank)
            pref = _preferred_rank(n, ctx)
            if pref is not None and asap[n] <= pref <= alap:
                rank[n] = pref
            elif (module_path(n) is None and ctx.direction != "backward"
                  or ctx.direction == "backward" and pref is None and alap == last_rank
                  and (module_path(n) is not None or all(u.op == "output" for u in n.users))):
                # top-level forward glue (the model's own forward, e.g. a long skip
                # `x + 0.5 * h_k`): compute it where it is consumed, so the producing layer keeps
                # the shape of its identical siblings. In the backward, the same holds for glue
                # of the model's outer modules on the way to the embedding: a final gradient
                # summed from several groups (a tied embedding's `grad_embed + grad_head`), or a
                # VLM's image-feature scatter (`masked_fill(grad, image_mask, 0)`): the embedding
                # segment finishes it, and the first decoder layer stays like the others.
                rank[n] = alap
            else:
                rank[n] = asap[n]
        elif len(user_ranks) == 1:
            # one consumer segment: run there, or earlier where the module says it belongs
            # (the head's norm backward, computed from values the head saved)
            alap = user_ranks.pop()
            pref = _preferred_rank(n, ctx)
            rank[n] = pref if pref is not None and pref <= alap else alap
        else:
            rank[n] = PROLOGUE
    # Multi-output ops: getitems stay with their producer so tuples never cross segments.
    for n in nodes:
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in rank:
            rank[n] = rank[n.args[0]]
    # ... which may pull a weight-free producer chain earlier.
    for n in reversed(nodes):
        if n in rank and n not in asap:
            rank[n] = min([rank[n]] + [rank[u] for u in n.users if u in rank])
    for n, r in rank.items():
        n.meta[RANK] = r
        n.meta[GROUP] = rank_group(r, ctx)
    return gm
