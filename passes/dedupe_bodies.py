"""Structural dedupe: segments with the same structure share one lowered body.

The key is the segment graph with names erased: each node's op, target, constant arguments,
argument wiring (as local indices) and, for inputs, shape/dtype. Layers whose weights differ in
shape, or that run different ops (sliding-window vs global attention, MoE vs dense), hash
differently and are never merged; identical decoder layers collapse to one body, so lowering
cost is O(distinct layer kinds), not O(depth).

    seg1 (layer 0) ─┐
    seg2 (layer 1) ─┼─>  body1        (call sites keep their own inputs)
    seg3 (layer 2) ─┘
"""
from __future__ import annotations

import hashlib

import torch
import torch.fx as fx

from ..ir import BODY, SEGMENT
from . import PassContext, graph_pass



def _val_sig(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"T{tuple(str(s) for s in val.shape)}{val.dtype}{tuple(str(s) for s in val.stride())}"
    if isinstance(val, torch.SymInt):
        return "SymInt"
    return type(val).__name__


def structural_key(module: fx.GraphModule) -> str:
    index: dict[fx.Node, int] = {}
    parts = []

    def norm(a):
        if isinstance(a, fx.Node):
            return f"%{index[a]}"
        if isinstance(a, (list, tuple)):
            return "(" + ",".join(norm(x) for x in a) + ")"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}:{norm(v)}" for k, v in sorted(a.items())) + "}"
        if isinstance(a, torch.Tensor):
            return f"tensor{tuple(a.shape)}{a.dtype}"
        return repr(a)

    for i, n in enumerate(module.graph.nodes):
        index[n] = i
        if n.op == "placeholder":
            parts.append(f"in:{_val_sig(n.meta.get('val'))}")
        elif n.op == "get_attr":
            value = getattr(module, n.target)
            # constants are hashed by content: two layers may only share a body if equal
            digest = (hashlib.sha1(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
                                   .tobytes()).hexdigest() + str(value.dtype) + str(tuple(value.shape))
                      if isinstance(value, torch.Tensor) else repr(value))
            parts.append(f"attr:{digest}")
        else:
            parts.append(f"{n.op}:{n.target}:{norm(n.args)}:{norm(n.kwargs)}")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


@graph_pass("dedupe_bodies", reads=(SEGMENT,), writes=(BODY,))
def dedupe_bodies(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    bodies: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op != "call_module" or SEGMENT not in n.meta:
            continue
        key = structural_key(gm.get_submodule(n.target))
        if key not in bodies:
            bodies[key] = n.target
        n.meta[BODY] = bodies[key]
    return gm
