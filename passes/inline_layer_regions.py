"""Put the nodes of each layer-kind subgraph call back in line (the forward's and the backward's).

AOTAutograd hands the backend forward and backward graphs in which each decoder layer cut out by
layer_subgraphs.py is one `invoke_subgraph` call of its kind's partitioned subgraph. Every later
pass reads per-node tags (weight group, segment, recompute, memory), so each call is replaced by
a copy of its subgraph's nodes, and the module paths the subgraph carries for "this layer"
(`<layer>.self_attn`, written by layer_subgraphs.py) become the calling layer's own
(`model.layers.7.self_attn`); the layer is the weight group of the weights the call reads.

    r = invoke_subgraph(partitioned_bw_subgraph_0_0, "bw_mt_kind_0_0", h6, cos, sin, w_q7, ..., g7)
    dh6 = r[0]; dw_q7 = r[1]; ...
        ==>  mm_3 = mm(h6, t(w_q7)) {model.layers.7.self_attn.q_proj}; ...; dh6 = ...; dw_q7 = ...

Graphs without such calls are returned unchanged.
"""
from __future__ import annotations

import operator

import torch.fx as fx
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

from ..errors import InternalError
from ..ir import LAYER_SENTINEL, WEIGHT_GROUP, lazy_graph_module
from . import PassContext, graph_pass, inline_call
from .layer_regions import call_group
from .layer_subgraphs import layer_fqn

_STACK_KEYS = ("nn_module_stack", "fwd_nn_module_stack")


def _own_stack(stack: dict | None, layer: str) -> dict | None:
    if not stack:
        return stack
    return {k.replace(LAYER_SENTINEL, layer): (path.replace(LAYER_SENTINEL, layer), kind)
            for k, (path, kind) in stack.items()}


def _layer_of(call: fx.Node, module_groups: dict[str, int]) -> str:
    group = call_group(call)
    layer = layer_fqn(module_groups, group) if group is not None else None
    if layer is None:
        groups = sorted({a.meta[WEIGHT_GROUP] for a in call.all_input_nodes if WEIGHT_GROUP in a.meta})
        raise InternalError(f"layer subgraph call {call.name} reads the weights of groups {groups}, not one layer's")
    return layer


@graph_pass("inline_layer_regions", reads=(WEIGHT_GROUP,), uses=("module_groups",))
def inline_layer_regions(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is invoke_subgraph]
    if not calls:
        return gm
    attrs = set()
    for call in calls:
        attr = call.args[0]
        sub = getattr(gm, attr.target)
        attrs.add(attr)
        layer = _layer_of(call, ctx.module_groups)

        def retag(_original: fx.Node, copy: fx.Node, layer=layer) -> None:
            for key in _STACK_KEYS:
                if key in copy.meta:
                    copy.meta[key] = _own_stack(copy.meta[key], layer)
        inline_call(gm, call, sub, retag)
    for attr in attrs:
        target = attr.target
        gm.graph.erase_node(attr)
        gm.delete_submodule(target)
    gm.graph.lint()
    # (code written when first needed: split_segments replaces this graph without running it)
    inlined = lazy_graph_module(gm, gm.graph)
    inlined.meta.update(gm.meta)
    return inlined


@graph_pass("layer_region_inputs", uses=())
def layer_region_inputs(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """On the joint graph: a layer kind's backward call reads its layer's inputs (weights, the
    boundary hidden state, rotary tables) where the forward call reads them, not as the forward
    call's pass-through outputs. The partitioned forward subgraph returns them as "saved" values
    (they are all its backward keeps); read through the call, each weight would be a value the
    forward saves for the backward, kept alive on the device in between.

        r = invoke_subgraph(fw_kind_0, ..., h0, w_q0); w = r[5]      (r[5] is fw_kind_0's input w_q0)
        invoke_subgraph(bw_kind_0, ..., w, g1)   ==>   invoke_subgraph(bw_kind_0, ..., w_q0, g1)
    """
    changed = False
    for call in gm.graph.find_nodes(op="call_function", target=invoke_subgraph):
        for arg in call.args[2:]:
            if not (isinstance(arg, fx.Node) and arg.target is operator.getitem
                    and isinstance(src := arg.args[0], fx.Node) and src.target is invoke_subgraph):
                continue
            sub = getattr(gm, src.args[0].target)
            out = sub.graph.find_nodes(op="output")[0].args[0][arg.args[1]]
            if isinstance(out, fx.Node) and out.op == "placeholder":
                position = sub.graph.find_nodes(op="placeholder").index(out)
                call.replace_input_with(arg, src.args[2 + position])
                changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
