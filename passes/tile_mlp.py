"""Tile each layer's MLP over the sequence, so its [tokens, intermediate] values exist one tile
at a time, in the forward and in the backward's recompute.

Runs on the Dynamo graph (torch-level ops, before AOTAutograd). A gated MLP module of any
family (`down(act(gate(x)) * up(x))`, Phi-3's fused `gate_up`, biases, GELU or SiLU, the fused
`swiglu` op) is, for a long sequence, the largest set of values a layer holds: three
[tokens, intermediate] tensors (3.5x the hidden size for Llama-3-8B: 84 GiB at 1M tokens). Every
op of it is token-wise, so it can run on slices of the sequence:

    y = mlp(x)                                    x: [b, s, h]
 ->
    x0, x1, .., xT-1 = tensor_split(x, T, dim=1)
    y0 = mlp(x0); y1 = mlp(x1); ...               (the module's ops copied per tile, in order)
    y = cat([y0, .., yT-1], dim=1)

The forward then holds one tile's intermediates at a time; AOTAutograd's backward recomputes
and differentiates tile by tile as well (each tile's ops are their own chain: the partitioner's
autograd-engine order runs one tile's recompute and backward before the next), with the weight
gradients summed over tiles. Which modules qualify is checked on the graph, not the name: one
activation input [b, s, h] besides parameters, one output [b, s, h'], only token-wise ops
(matmuls against weights, elementwise math, splits of the last dimension).

Tile count (option `mlp_tiles`): an int, or "auto": none below a sequence of 32K tokens (the
matmuls stay whole: nothing to save at ordinary lengths), else enough tiles that a tile's
intermediate value is no larger than the layer's hidden state (ceil(intermediate / hidden)),
doubled while a tile still spans more than 64K tokens of the sequence. Numerics: each token's values are computed
as before; the weight gradients are sums over tiles (fp32: within 1e-5 relative).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ..ir import dim_hint
from . import PassContext, graph_pass

#: ops that act on each token alone (elementwise, matmul against weights, last-dim splits)
_TOKENWISE = {
    torch._C._nn.linear, torch.nn.functional.linear, torch.nn.functional.silu, torch.nn.functional.gelu,
    torch.nn.functional.relu, torch.sigmoid, torch.tanh, torch.pow, torch.mul, torch.add, torch.sub, torch.div,
    torch.neg, torch.exp, torch.erf, torch.clamp, torch.nn.functional.relu6, torch.square, torch.relu,
    operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow, operator.getitem,
}
_TOKENWISE_METHODS = {"float", "to", "type_as", "mul", "add", "sigmoid", "tanh", "pow", "chunk", "split", "contiguous"}
AUTO_MIN_TOKENS = 32 * 1024
AUTO_MAX_TILE_TOKENS = 64 * 1024


def _module_path(node: fx.Node, depth: int) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack or len(stack) <= depth:
        return None
    return list(stack.values())[depth][0]


def _last_dim_split(n: fx.Node) -> bool:
    """chunk/split along the last dimension only (Phi-3's gate_up)."""
    dim = n.kwargs.get("dim", n.args[2] if len(n.args) > 2 else 0)
    val = n.args[0].meta.get("example_value") if isinstance(n.args[0], fx.Node) else None
    return isinstance(val, torch.Tensor) and dim in (-1, val.dim() - 1)


def _tokenwise(n: fx.Node) -> bool:
    if n.op == "call_method":
        return n.target in _TOKENWISE_METHODS and (n.target not in ("chunk", "split") or _last_dim_split(n))
    if n.op == "call_function":
        if n.target is operator.getitem:
            return isinstance(n.args[1], int)   # (an element of a split's result)
        if getattr(n.target, "__name__", "") == "swiglu" or "megatrain.swiglu" in str(n.target):
            return True
        return n.target in _TOKENWISE
    return False


def mlp_regions(gm: fx.GraphModule) -> list[tuple[list[fx.Node], fx.Node, fx.Node]]:
    """(the module's nodes in graph order, its activation input, its output) for each MLP module
    of the graph that qualifies (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    by_module: dict[str, list[fx.Node]] = {}
    for n in nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        stack = n.meta.get("nn_module_stack") or {}
        for path, cls in stack.values():
            name = getattr(cls, "__name__", str(cls)).lower()
            if name.endswith("mlp"):
                by_module.setdefault(path, []).append(n)
                break
    out = []
    for path, members in by_module.items():
        inside = set(members)
        if not all(_tokenwise(n) for n in members):
            continue
        external = list(dict.fromkeys(a for n in members for a in n.all_input_nodes if a not in inside))
        acts = [a for a in external if not (a.op == "placeholder" and _is_parameter(a))]
        leaving = [n for n in members if any(u not in inside for u in n.users)]
        if len(acts) != 1 or len(leaving) != 1:
            continue
        x, y = acts[0], leaving[0]
        xv, yv = x.meta.get("example_value"), y.meta.get("example_value")
        if not (isinstance(xv, torch.Tensor) and isinstance(yv, torch.Tensor) and xv.dim() in (2, 3)
                and yv.dim() == xv.dim() and xv.shape[:-1] == yv.shape[:-1]):
            continue   # ([b, s, h] tiled along s; [tokens, h] (an MoE's shared expert) along tokens)
        if members != [n for n in nodes if n in inside]:
            continue
        out.append((members, x, y))
    return out


def _is_parameter(n: fx.Node) -> bool:
    v = n.meta.get("example_value")
    return isinstance(v, torch.nn.Parameter) or "parameters_" in n.name or "_parameters" in n.name


def auto_tiles(tokens: int, hidden: int, intermediate: int) -> int:
    """The "auto" tile count for a sequence of `tokens`."""
    if tokens < AUTO_MIN_TOKENS:
        return 1
    tiles = max(1, math.ceil(intermediate / max(1, hidden)))
    while tokens / tiles > AUTO_MAX_TILE_TOKENS:
        tiles *= 2
    return tiles


def _intermediate(members: list[fx.Node]) -> int:
    widths = [dim_hint(v.shape[-1]) for n in members
              if isinstance(v := n.meta.get("example_value"), torch.Tensor) and v.dim() >= 2]
    return max(widths, default=1)


def _tile(gm: fx.GraphModule, members: list[fx.Node], x: fx.Node, y: fx.Node, tiles: int) -> None:
    graph = gm.graph
    dim = x.meta["example_value"].dim() - 2   # (the sequence: 1 of [b, s, h], 0 of [tokens, h])
    with graph.inserting_before(members[0]):
        split = graph.call_function(torch.tensor_split, (x, tiles), {"dim": dim})
        parts = [graph.call_function(operator.getitem, (split, i)) for i in range(tiles)]
    outs = []
    with graph.inserting_before(y.next):
        for part in parts:
            env = {x: part}
            for n in members:
                env[n] = graph.node_copy(n, lambda a: env.get(a, a))
                env[n].meta = {k: v for k, v in n.meta.items() if k != "example_value"}
            outs.append(env[y])
        cat = graph.call_function(torch.cat, (outs,), {"dim": dim})
    cat.meta = {k: v for k, v in y.meta.items()}
    y.replace_all_uses_with(cat)
    for n in reversed(members):
        graph.erase_node(n)


@graph_pass("tile_mlp", uses=("mlp_tiles",))
def tile_mlp(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    regions = mlp_regions(gm)
    # "auto" follows the sequence length (a row's tokens), not the batch: a long sequence is what
    # tiling is for, and a step's memory then stays linear in the batch at a given length (an
    # MoE's shared expert sees [tokens, h]: it takes the sequence of the 3-D MLPs if there are any)
    seqs = [dim_hint(x.meta["example_value"].shape[1]) for _, x, _ in regions if x.meta["example_value"].dim() == 3]
    counts = []
    for members, x, y in regions:
        xv = x.meta["example_value"]
        seq = dim_hint(xv.shape[1]) if xv.dim() == 3 else max(seqs, default=dim_hint(xv.shape[0]))
        tiles = ctx.mlp_tiles if isinstance(ctx.mlp_tiles, int) else auto_tiles(
            seq, dim_hint(xv.shape[-1]), _intermediate(members))
        tiles = min(tiles, dim_hint(xv.shape[-2]))
        if tiles > 1:
            _tile(gm, members, x, y, tiles)
            counts.append(tiles)
    if counts:
        gm.graph.lint()
        gm.recompile()
    ctx.records.append(("tile_mlp", "tiled", counts))
    return gm
