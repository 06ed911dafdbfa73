"""Tag each graph placeholder with its AOT flat-arg index and, for parameters, its weight group.

AOTAutograd names primal inputs `primals_<k>` (1-based flat position) in the joint, forward and
backward graphs alike, so the name is a stable key across the partition.

    primals_7  --tag-->  primals_7 {mt_flat_index: 6, mt_weight_group: 2}
"""
from __future__ import annotations

import re

import torch.fx as fx

from . import FLAT_INDEX, WEIGHT_GROUP, PassContext, graph_pass

_PRIMAL = re.compile(r"^primals_(\d+)$")


@graph_pass("tag_weights", provides=(FLAT_INDEX,))
def tag_weights(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        m = _PRIMAL.match(node.name)
        if not m:
            continue
        index = int(m.group(1)) - 1
        node.meta[FLAT_INDEX] = index
        if index in ctx.flat_groups:
            node.meta[WEIGHT_GROUP] = ctx.flat_groups[index]
    return gm
