"""Put the layer calls Dynamo stamped out (megacompile/dynamo_regions.py) back in line, each under
its own layer's module path, so every later pass sees the graph a whole-depth trace gives.

Runs first on the Dynamo graph. Dynamo traced each layer kind once, as the subgraph of the first
layer of that kind, and called it for every layer of the kind:

    r = invoke_subgraph(subgraph_0, "subgraph_0", h1, w_q1, ...)      y = linear(h1, w_q1)  (layers.1.self_attn.q_proj)
    h2 = r[0]                                                  ==>    ...
                                                                      h2 = add(...)

A subgraph's module paths are its first layer's (`model.layers.0.forward.__self__.self_attn`):
each copy is written under its call's layer (`model.layers.1.self_attn`), as the whole trace
writes it.

The kind key that let Dynamo reuse a subgraph cannot see a call's tensor inputs; a call whose
inputs differ from those the subgraph was traced with (shape, stride, dtype, device,
requires_grad) is not put in line, and the record says why (DYNAMO_REGIONS.retrace): the
backend then has Dynamo trace the model again without regions.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

from ..ir import DYNAMO_REGIONS, DynamoRegions
from . import PassContext, graph_pass, inline_call

_SELF = ".forward.__self__"   # (a forward wrapped on the instance: Dynamo reaches the layer through it)


def _meta(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad)
    if isinstance(value, torch.SymInt):
        return ("symint", str(value.node.expr))
    return (type(value).__name__, value)


def _mismatch(call: fx.Node, body: fx.GraphModule) -> str | None:
    """Why `call`'s inputs are not those its subgraph was traced with, or None."""
    params = [n for n in body.graph.nodes if n.op == "placeholder"]
    operands = call.args[2:]
    if len(params) != len(operands):
        return f"{call.name} passes {len(operands)} inputs to a subgraph of {len(params)}"
    for p, a in zip(params, operands):
        got = _meta(a.meta.get("example_value")) if isinstance(a, fx.Node) else _meta(a)
        want = _meta(p.meta.get("example_value"))
        if got != want:
            return f"{call.name} input {p.name}: {got} where its subgraph was traced with {want}"
    return None


def _nested(body: fx.GraphModule) -> str | None:
    """A layer whose trace holds a graph of its own (RecurrentGemma's RG-LRU autograd.Function):
    put in line, its calls would share that graph where the whole trace has one per layer, and
    AOTAutograd then partitions them differently; such a model is traced whole."""
    for n in body.graph.nodes:
        if n.op == "get_attr":
            return (f"a layer's trace calls a graph of its own ({n.target}: a higher-order op such as an "
                    "autograd.Function)")
    return None


def _layer_entry(node: fx.Node) -> tuple[str, tuple]:
    """The innermost entry of a call's module stack: its decoder layer (key, (path, type))."""
    return list((node.meta.get("nn_module_stack") or {"": ("", None)}).items())[-1]


def _stack(body_stack: dict | None, call: fx.Node, first: str) -> dict:
    """A body node's module stack under `call`'s layer: the call's own stack (the model down to
    its layer), then the body's entries below the first layer (`first`) written under the call's
    layer, and those outside it as they are (transformers' hub-kernel functions, which Dynamo
    records as modules of their own)."""
    out = dict(call.meta.get("nn_module_stack") or {})
    _key, (layer, _type) = _layer_entry(call)
    for key, (path, kind) in (body_stack or {}).items():
        path = path.replace(_SELF, "")
        if path.startswith(first + "."):
            path = layer + path[len(first):]
            out[path] = (path, kind)
        elif not (first == path or first.startswith(path + ".")):   # (not the model down to the layer)
            out[key] = (path, kind)
    return out


def _unread(n: fx.Node) -> bool:
    """A value no one reads that a whole trace never makes: an output of a layer call no one
    reads (dynamo_regions' stand-in for a None the layer returns, torch.empty) or an element of
    a tuple no one reads (torch leaves them where it put a kind called once back in line)."""
    return not n.users and n.op == "call_function" and (n.target is operator.getitem or n.target is torch.empty)


def _strip_self(gm: fx.GraphModule) -> None:
    """Module paths through a wrapped forward (`layers.2.forward.__self__.mlp`) as the layer's own
    (`layers.2.mlp`)."""
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        if stack and any(_SELF in path for path, _ in stack.values()):
            n.meta["nn_module_stack"] = {k: (path.replace(_SELF, ""), kind) for k, (path, kind) in stack.items()}


def _inline(gm: fx.GraphModule, call: fx.Node, body: fx.GraphModule, first: str) -> None:
    outer_fn = list(call.meta.get("source_fn_stack") or [])[:-1]

    def retag(n: fx.Node, new: fx.Node) -> None:
        new.meta = dict(n.meta)
        new.meta["nn_module_stack"] = _stack(n.meta.get("nn_module_stack"), call, first)
        fn_stack = list(n.meta.get("source_fn_stack") or [])
        if fn_stack and fn_stack[0][1] is invoke_subgraph:
            fn_stack = fn_stack[1:]
        new.meta["source_fn_stack"] = outer_fn + fn_stack
    inline_call(gm, call, body, retag)


@graph_pass("inline_dynamo_regions", writes=(DYNAMO_REGIONS,))
def inline_dynamo_regions(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    record = gm.meta[DYNAMO_REGIONS] = DynamoRegions()
    _strip_self(gm)   # (torch itself puts a kind called once back in line, paths unchanged)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is invoke_subgraph
             and n.args[0].op == "get_attr"]
    first: dict[str, str] = {}   # subgraph attribute -> the module path of the layer it was traced as
    for call in calls:
        attr = call.args[0].target
        why = _mismatch(call, getattr(gm, attr))
        if attr not in first:
            first[attr] = _layer_entry(call)[1][0]
            why = why or _nested(getattr(gm, attr))
        if why:
            record.retrace = why
            return gm
    attrs = {call.args[0] for call in calls}   # (one get_attr node per call, several of one subgraph)
    for call in calls:
        _inline(gm, call, getattr(gm, call.args[0].target), first[call.args[0].target])
    for attr in attrs:
        gm.graph.erase_node(attr)
    for name in first:
        delattr(gm, name)
    # what no one reads: the stand-ins for a None a layer returns, and the tuple elements torch
    # leaves where it put a kind called once back in line (users first: chains go too)
    unread = 0
    for n in list(reversed(gm.graph.nodes)):   # (each node checked when reached: after its users)
        if _unread(n):
            gm.graph.erase_node(n)
            unread += 1
    record.calls, record.kinds = len(calls), len(first)
    if calls or unread:
        gm.graph.lint()
        gm.recompile()
    return gm
