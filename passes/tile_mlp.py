"""Tile each layer's token-wise tail over the sequence (its MLP and what surrounds it), so its
[tokens, intermediate] and [tokens, hidden] values exist one tile at a time, in the forward and
in the backward's recompute.

Runs on the Dynamo graph (torch-level ops, before AOTAutograd). A gated MLP module of any
family (`down(act(gate(x)) * up(x))`, Phi-3's fused `gate_up`, biases, GELU or SiLU, the fused
`swiglu` op) is, for a long sequence, the largest set of values a layer holds: three
[tokens, intermediate] tensors (3.5x the hidden size for Llama-3-8B: 84 GiB at 1M tokens). Every
op of it is token-wise, so it can run on slices of the sequence. The region then grows over the
token-wise ops of its decoder layer around it (`_grow`): the residual add after it, the norm
before it (torch ops or the fused `rms_norm`), the residual add before that and the attention's
output projection; Gemma's extra norms too. It stops at the attention, which reads every token:

    h1 = h0 + o_proj(attn); y = h1 + mlp(norm(h1))          attn, h0: [b, s, *]
 ->
    a0, .., aT-1 = split(attn, sizes, dim=1); g0, .., gT-1 = split(h0, sizes, dim=1)
    y0 = tail(a0, g0); y1 = tail(a1, g1); ...    (the region's ops copied per tile, in order)
    y = cat([y0, .., yT-1], dim=1)               sizes = [(s + T-1) // T, (s + T-2) // T, .., s // T]

The tiles are tensor_split's (the first s mod T one token longer; the sizes sum to s for any s,
symbolic too), but made by one `split`: its backward is one `cat` of the tiles' gradients.
tensor_split's slices each differentiate to a full-size `slice_backward`, summed one by one:
three [tokens, hidden] tensors at once at the backward's peak instead of one (32 GiB more at 2M
tokens of Llama-3-8B).

The forward then holds one tile's intermediates at a time; AOTAutograd's backward recomputes
and differentiates tile by tile as well (each tile's ops are their own chain: the partitioner's
autograd-engine order runs one tile's recompute and backward before the next), with the weight
gradients summed over tiles. What qualifies is checked on the graph, not by name: one output
[b, s, h'], only token-wise ops (matmuls against weights, elementwise math, last-dimension
splits and means), every input a [b, s, *] activation (split), a value computed from
parameters alone, or one every token reads whole ([h], [1, 1, h]).

Tile count (option `mlp_tiles`): an int, or "auto": none below a sequence of 32K tokens (the
matmuls stay whole: nothing to save at ordinary lengths), else enough tiles that a tile's
intermediate value is no larger than the layer's hidden state (ceil(intermediate / hidden)),
doubled while a tile still spans more than 64K tokens of the sequence. Under a device budget
the backend (and `megatrain plan`) doubles "auto"'s count until the step fits
(MAX_BUDGET_TILES, TILE_GAIN). Numerics: each token's values are computed as before; the
weight gradients are sums over tiles (fp32: within 1e-5 relative).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ..ir import dim_hint
from . import PassContext, graph_pass, in_module, is_megatrain_op

#: ops that act on each token alone (elementwise, matmul against weights, last-dim splits)
_TOKENWISE = {
    torch._C._nn.linear, torch.nn.functional.linear, torch.nn.functional.silu, torch.nn.functional.gelu,
    torch.nn.functional.relu, torch.sigmoid, torch.tanh, torch.pow, torch.mul, torch.add, torch.sub, torch.div,
    torch.neg, torch.exp, torch.erf, torch.clamp, torch.nn.functional.relu6, torch.square, torch.relu, torch.rsqrt,
    operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow, operator.getitem,
}
_TOKENWISE_METHODS = {"float", "to", "type_as", "mul", "add", "sigmoid", "tanh", "pow", "chunk", "split", "contiguous",
                      "rsqrt", "mean"}
AUTO_MIN_TOKENS = 32 * 1024
AUTO_MAX_TILE_TOKENS = 64 * 1024
#: the most tiles a search under a device budget tries (the backend, the planner): each tile is a
#: copy of the region's ops in the graph
MAX_BUDGET_TILES = 256
#: ... and it stops once a doubling lowers the planned peak by less than this fraction
TILE_GAIN = 0.02


def _last_dim_split(n: fx.Node) -> bool:
    """chunk/split along the last dimension only (Phi-3's gate_up)."""
    dim = n.kwargs.get("dim", n.args[2] if len(n.args) > 2 else 0)
    val = n.args[0].meta.get("example_value") if isinstance(n.args[0], fx.Node) else None
    return isinstance(val, torch.Tensor) and dim in (-1, val.dim() - 1)


def _last_dim_mean(n: fx.Node) -> bool:
    """mean over the last dimension that keeps it (a norm's variance): one value per token."""
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    keep = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 else False)
    val = n.args[0].meta.get("example_value") if isinstance(n.args[0], fx.Node) else None
    dims = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
    return keep is True and isinstance(val, torch.Tensor) and len(dims) == 1 and dims[0] in (-1, val.dim() - 1)


def _tokenwise(n: fx.Node) -> bool:
    if n.op == "call_method":
        if n.target == "mean":
            return _last_dim_mean(n)
        return n.target in _TOKENWISE_METHODS and (n.target not in ("chunk", "split") or _last_dim_split(n))
    if n.op == "call_function":
        if n.target is torch.mean:
            return _last_dim_mean(n)
        if n.target is operator.getitem:
            return isinstance(n.args[1], int)   # (an element of a split's result)
        if is_megatrain_op(n, "swiglu") or is_megatrain_op(n, "rms_norm"):   # (fused_kernels' ops: per token)
            return True
        return n.target in _TOKENWISE
    return False


def mlp_regions(gm: fx.GraphModule) -> list[tuple[list[fx.Node], list[fx.Node], fx.Node]]:
    """(the region's nodes in graph order, its activation inputs, its output) for each MLP module
    of the graph that qualifies (see the module docstring), grown to the token-wise part of its
    decoder layer around it (`_grow`)."""
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
    order = {n: i for i, n in enumerate(nodes)}
    constant = _constants(nodes)
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
        y = _grow(inside, y, tuple(xv.shape[:-1]), path.rsplit(".", 1)[0], constant)
        region = sorted(inside, key=order.__getitem__)
        acts = [a for a in dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside)
                if a not in constant and _token_shaped(a.meta.get("example_value"), tuple(xv.shape[:-1]))]
        out.append((region, acts, y))
    return out


def _constants(nodes: list[fx.Node]) -> set[fx.Node]:
    """The values that depend on no activation: parameters and what is computed from them alone
    (a norm weight's `.float()`). Tiles read them whole, whatever their shape (a [h, h] weight
    has the shape of a [tokens, h] activation when tokens == h)."""
    out: set[fx.Node] = set()
    for n in nodes:
        if n.op == "placeholder":
            if _is_parameter(n):
                out.add(n)
        elif n.op == "get_attr" or (n.op != "output" and all(a in out for a in n.all_input_nodes)):
            out.add(n)
    return out


def _token_shaped(v, tokens: tuple) -> bool:
    """A value with one row per token ([b, s, *] or [tokens, *]): the tiles split it."""
    return isinstance(v, torch.Tensor) and v.dim() == len(tokens) + 1 and tuple(v.shape[:-1]) == tokens


def _shared(v, tokens: tuple) -> bool:
    """A value every token reads whole (a norm's weight, a scale): each tile reads it as it is. A
    split's tuple of token-shaped parts is not (Falcon-H1's mamba gate: `gate = split(..)[1]`)."""
    if isinstance(v, (list, tuple)):
        return all(_shared(x, tokens) for x in v)
    return not isinstance(v, torch.Tensor) or all(dim_hint(d) == 1 for d in v.shape[:-1]) and v.dim() <= len(tokens) + 1


def _joinable(n: fx.Node, region: set, tokens: tuple, layer: str, constant: set) -> bool:
    """`n` may join the region: a token-wise op of the same decoder layer, one row per token in
    and out, whose other inputs are token-shaped activations, constants or shared."""
    if is_megatrain_op(n, "rms_norm"):   # (fused_kernels' norm returns a tuple: its first input is the activation)
        shaped = isinstance(x := n.args[0], fx.Node) and (x in region or _token_shaped(x.meta.get("example_value"),
                                                                                     tokens))
    else:
        shaped = _token_shaped(n.meta.get("example_value"), tokens)
    if not (n.op in ("call_function", "call_method") and _tokenwise(n) and shaped and n not in constant
            and in_module(n, layer)):
        return False
    return all(a in region or a in constant or _token_shaped(v := a.meta.get("example_value"), tokens)
               or _shared(v, tokens) for a in n.all_input_nodes)


def _grow(region: set, y: fx.Node, tokens: tuple, layer: str, constant: set) -> fx.Node:
    """Grow `region` (in place) over the token-wise ops of its layer around it, and return its new
    output. Forward: the output's only reader (a residual add) joins and becomes the output.
    Backward: a producer all of whose readers are in the region joins (the norm before the MLP, the
    residual add before it, the attention's output projection). The region keeps one output, and
    whatever it reads from outside is computed before it, so its tiles can run where it ended.

        attn = attention(...)                        region: o_proj -> + residual -> norm -> MLP
        h1 = h0 + o_proj(attn)                               -> + residual, inputs attn and h0
        h2 = h1 + mlp(norm(h1))
    """
    grown = True
    while grown:
        grown = False
        users = list(y.users)
        if len(users) == 1 and _joinable(users[0], region, tokens, layer, constant):
            region.add(users[0])
            y, grown = users[0], True
        for a in list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in region)):
            if all(u in region for u in a.users) and _joinable(a, region, tokens, layer, constant):
                region.add(a)
                grown = True
    return y


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


def tile_sizes(graph: fx.Graph, x: fx.Node, dim: int, tiles: int) -> list:
    """tensor_split's tile lengths of `x` along `dim`: (n + tiles - 1 - i) // tiles (Hermite's
    identity: they sum to n); graph nodes where the length is symbolic."""
    n = x.meta["example_value"].shape[dim]
    if isinstance(n, int):
        return [(n + tiles - 1 - i) // tiles for i in range(tiles)]
    size = graph.call_method("size", (x, dim))
    return [graph.call_function(operator.floordiv, (graph.call_function(operator.add, (size, tiles - 1 - i)), tiles))
            for i in range(tiles)]


def _tile(gm: fx.GraphModule, members: list[fx.Node], inputs: list[fx.Node], y: fx.Node, tiles: int) -> fx.Node:
    graph = gm.graph
    dim = inputs[0].meta["example_value"].dim() - 2   # (the sequence: 1 of [b, s, h], 0 of [tokens, h])
    with graph.inserting_before(y.next):   # (after everything the region reads: see _grow)
        parts = {}
        sizes = tile_sizes(graph, inputs[0], dim, tiles)   # (every input has the region's tokens)
        for x in inputs:
            split = graph.call_function(torch.split, (x, sizes), {"dim": dim})
            parts[x] = [graph.call_function(operator.getitem, (split, i)) for i in range(tiles)]
        outs = []
        for i in range(tiles):
            env = {x: parts[x][i] for x in inputs}
            for n in members:
                env[n] = graph.node_copy(n, lambda a: env.get(a, a))
                env[n].meta = {k: v for k, v in n.meta.items() if k != "example_value"}
            outs.append(env[y])
        cat = graph.call_function(torch.cat, (outs,), {"dim": dim})
    cat.meta = {k: v for k, v in y.meta.items()}
    y.replace_all_uses_with(cat)
    for n in reversed(members):
        graph.erase_node(n)
    return cat


@graph_pass("tile_mlp", uses=("mlp_tiles",))
def tile_mlp(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    regions = mlp_regions(gm)
    # "auto" follows the sequence length (a row's tokens), not the batch: a long sequence is what
    # tiling is for, and a step's memory then stays linear in the batch at a given length (an
    # MoE's shared expert sees [tokens, h]: it takes the sequence of the 3-D MLPs if there are any)
    seqs = [dim_hint(xs[0].meta["example_value"].shape[1]) for _, xs, _ in regions
            if xs[0].meta["example_value"].dim() == 3]
    counts = []
    replaced: dict[fx.Node, fx.Node] = {}   # a region's output -> its tiles' cat (the next layer's input)
    for members, xs, y in regions:
        xs = [replaced.get(x, x) for x in xs]
        xv = xs[0].meta["example_value"]
        seq = dim_hint(xv.shape[1]) if xv.dim() == 3 else max(seqs, default=dim_hint(xv.shape[0]))
        tiles = ctx.mlp_tiles if isinstance(ctx.mlp_tiles, int) else auto_tiles(
            seq, dim_hint(xv.shape[-1]), _intermediate(members))
        tiles = min(tiles, dim_hint(xv.shape[-2]))
        if tiles > 1:
            replaced[y] = _tile(gm, members, xs, y, tiles)
            counts.append(tiles)
    if counts:
        gm.graph.lint()
        gm.recompile()
    ctx.records.append(("tile_mlp", "tiled", counts))
    return gm
