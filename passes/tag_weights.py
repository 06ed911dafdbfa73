"""Tag each graph placeholder with its AOT flat-arg index and, for parameters, its weight group.

AOTAutograd names primal inputs `primals_<k>` (1-based flat position) in the joint, forward and
backward graphs alike, so the name is a stable key across the partition; inference graphs
(traced under no_grad) name them `arg<k>_1` (0-based). Dynamo's own graph (direction "dynamo",
before AOTAutograd) has its inputs in flat-arg order under their source names: there the position
is the index.

    primals_7  --tag-->  primals_7 {mt_flat_index: 6, mt_weight_group: 2}
"""
from __future__ import annotations

import re

import torch.fx as fx

from ..ir import FLAT_INDEX, WEIGHT_GROUP
from . import PassContext, graph_pass

_PRIMAL = re.compile(r"^primals_(\d+)$")
_INFERENCE_ARG = re.compile(r"^arg(\d+)_1$")


@graph_pass("tag_weights", writes=(FLAT_INDEX,), may_write=(WEIGHT_GROUP,), uses=("flat_groups", "direction"))
def tag_weights(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for position, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        if ctx.direction == "dynamo":
            index = position
        elif m := _PRIMAL.match(node.name):
            index = int(m.group(1)) - 1
        elif m := _INFERENCE_ARG.match(node.name):
            index = int(m.group(1))
        else:
            continue
        node.meta[FLAT_INDEX] = index
        if index in ctx.flat_groups:
            node.meta[WEIGHT_GROUP] = ctx.flat_groups[index]
    return gm
