"""Run each layer's attention one chunk of queries at a time, with the tiles of its tail.

Runs on the Dynamo graph after `tile_mlp`. A layer whose tail tile_mlp tiled still computes its
attention over the whole sequence: q, the attention's output and, in the backward, their
gradients are [tokens, hidden] values each (16 GiB at 2M tokens of Llama-3-8B), and so are the
input norm's output and the q/k/v projections' gradients. Queries are independent of each
other given K and V, so the attention can run per query chunk (`segment_attention`'s `q_start`):

    k = k_path(h0); v = v_path(h0)                       h0: [b, s, h], the layer's input
    out = segment_attention(q_path(h0), k, v, seg)       q_path: norm, q_proj, view, transpose, RoPE
    attn = reshape(transpose(out))                       [b, s, h']; tile_mlp split it for the tail
 ->
    h0_0, .., h0_T-1 = split(h0, sizes, 1)               (tile_mlp's split of h0 where there is one)
    k = cat([k_path(h0_0), .., k_path(h0_T-1)], 2)       phase 1: K and V tile by tile
    v = cat([v_path(h0_0), .., v_path(h0_T-1)], 2)
    attn_i = reshape(transpose(segment_attention(q_path(h0_i), k, v, seg, q_start=start_i)))
                                                         phase 2: just before the tail's tile i
    (with no tail tiles to join: attn = cat([attn_0, .., attn_T-1], 1))

So a layer holds one tile of every [tokens, hidden] value, plus K and V ([tokens, kv_heads x
head_dim]: a quarter of the hidden state for Llama-3-8B) and their gradients. The input norm
runs twice per tile (once per phase), and a fused qkv projection (Phi-3) computes q twice.

What qualifies is checked on the graph: the head (every op between h0 and q, k, v) and the
chain after the attention are sequence-local. The sequence dimension is followed through each op
(views and reshapes, transposes, unsqueezes, indexing and splits of other dimensions, matmuls
against weights, elementwise math with broadcasting, norms over the last dimension); the values
the head reads from outside (RoPE's cos and sin) are split where they carry the sequence and
read whole where they broadcast. A layer whose head reads anything else, or whose values are
read outside the layer, keeps its whole attention. Shape arguments of views, reshapes and
expands are rewritten to the tile's length.

Tile count: the tail's tiles where tile_mlp tiled it; else `mlp_tiles` (an int; "auto" as
tile_mlp's auto count with the hidden size as the intermediate one). Numerics: each query's
output is computed from the same keys; the merged partial softmaxes and the gradients summed
over chunks differ from the whole call by rounding (fp32: within 1e-5 relative).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ir import dim_hint
from . import PassContext, graph_pass, is_megatrain_op, log, module_path
from .tile_mlp import auto_tiles, tile_sizes

_ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.exp, torch.rsqrt, torch.sqrt, torch.sigmoid,
    torch.tanh, torch.pow, torch.square, torch.erf, torch.clamp, torch.abs, torch.relu,
    F.silu, F.gelu, F.relu, F.sigmoid, F.tanh,
}
_ELEMENTWISE_METHODS = {"float", "to", "type_as", "mul", "add", "sub", "div", "neg", "pow", "rsqrt", "sqrt", "sigmoid",
                        "tanh", "exp", "contiguous", "clone", "half", "bfloat16", "abs", "clamp"}
_SHAPED = {"view", "reshape", "expand"}   # (methods whose size arguments name the sequence's length)


def _val(a):
    v = a.meta.get("example_value") if isinstance(a, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _norm(dim: int, nd: int) -> int:
    return dim + nd if dim < 0 else dim


def _is_attention(n: fx.Node) -> bool:
    name = str(n.target)
    return n.op == "call_function" and "megatrain.segment_attention" in name and "backward" not in name


class _Dims:
    """The sequence dimension of each value of a region, followed op by op from its input; and
    how the region reads each value from outside it: split along a dimension, or whole (None)."""

    def __init__(self, seq: int):
        self.seq = seq
        self.of: dict[fx.Node, int] = {}
        self.outside: dict[fx.Node, int | None] = {}

    def read_whole(self, a) -> bool:
        """`a` is read whole (a weight of a matmul or a norm): never a value of the region."""
        if not isinstance(a, fx.Node):
            return True
        return a not in self.of and self._outside(a, None)

    def _outside(self, a: fx.Node, dim: int | None) -> bool:
        if self.outside.setdefault(a, dim) != dim:
            return False   # (read split in one place, whole in another)
        return True

    def broadcast(self, a, out_dim: int, out_nd: int) -> bool:
        """`a`, an operand of an elementwise op whose output has the sequence at out_dim: inside
        the region it must be aligned; outside, it is split where it has the sequence's length
        there, read whole where it broadcasts."""
        v = _val(a)
        if v is None:
            return not (isinstance(a, fx.Node) and a in self.of)
        j = out_dim - (out_nd - v.dim())
        if a in self.of:
            return self.of[a] == j
        if j < 0 or dim_hint(v.shape[j]) == 1:
            return self._outside(a, None)
        return dim_hint(v.shape[j]) == self.seq and self._outside(a, j)

    def follow(self, n: fx.Node) -> bool:
        """Record n's sequence dimension (a multi-output op: its elements'); False where n is not
        sequence-local."""
        out = _val(n)
        tensors = [a for a in n.all_input_nodes if _val(a) is not None or a in self.of]
        inside = [a for a in n.all_input_nodes if a in self.of]
        if not inside:
            return False
        x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else inside[0]
        d, nd = self.of.get(x), _val(x).dim() if _val(x) is not None else None
        name = n.target if n.op == "call_method" else None
        fn = n.target if n.op == "call_function" else None
        if fn in _ELEMENTWISE_FUNCTIONS or name in _ELEMENTWISE_METHODS:
            if out is None:
                return False
            ds = {self.of[a] + out.dim() - _val(a).dim() for a in inside}
            if len(ds) != 1:
                return False
            dim = ds.pop()
            if not all(self.broadcast(a, dim, out.dim()) for a in tensors):
                return False
            return self._set(n, dim)
        if x not in self.of or d is None:
            return False
        others = [a for a in n.all_input_nodes if a is not x]
        if fn in (F.linear, torch._C._nn.linear) or is_megatrain_op(n, "rms_norm"):
            return d < nd - 1 and all(self.read_whole(a) for a in others) and self._set(n, d)
        if fn is F.rms_norm or fn is F.layer_norm:
            return d < nd - len(n.args[1]) and all(self.read_whole(a) for a in others) and self._set(n, d)
        if name in ("view", "reshape") or fn is torch.reshape:
            return out is not None and self._viewed(n, d, _val(x), out)
        if name == "expand":
            return out is not None and self._sized(n, d + out.dim() - nd)
        if name in ("transpose", "swapaxes") or fn is torch.transpose:
            a, b = (_norm(i, nd) for i in n.args[1:3])
            return self._set(n, b if d == a else a if d == b else d)
        if name == "permute":
            order = [_norm(i, nd) for i in (n.args[1] if isinstance(n.args[1], (tuple, list)) else n.args[1:])]
            return self._set(n, order.index(d))
        if name == "unsqueeze" or fn is torch.unsqueeze:
            k = _norm(n.args[1], nd + 1)
            return self._set(n, d + (k <= d))
        if fn is operator.getitem:
            if _val(x) is None:   # (an element of a multi-output op: a split, a norm's (y, rstd))
                return isinstance(n.args[1], int) and self._set(n, d)
            dim = _indexed(n.args[1], nd, d)
            return dim is not None and self._set(n, dim)
        if name in ("split", "chunk") or fn in (torch.split, torch.chunk):
            dim = n.kwargs.get("dim", n.args[2] if len(n.args) > 2 else 0)
            return _norm(dim, nd) != d and self._set(n, d)
        if fn is torch.stack:
            k = _norm(n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0), nd + 1)
            return all(self.of.get(p) == d for p in n.args[0]) and self._set(n, d + (k <= d))
        if name == "flatten" or fn is torch.flatten:
            first = _norm(n.kwargs.get("start_dim", n.args[1] if len(n.args) > 1 else 0), nd)
            last = _norm(n.kwargs.get("end_dim", n.args[2] if len(n.args) > 2 else -1), nd)
            if first <= d <= last and first != last:
                return False
            return self._set(n, d - (last - first) if d > last else d)
        if fn is torch.cat:
            parts = n.args[0]
            dim = _norm(n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0), nd)
            return dim != d and all(self.of.get(p) == d for p in parts) and self._set(n, d)
        if name in ("mean", "sum") or fn in (torch.mean, torch.sum):
            dims = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
            keep = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 else False)
            if dims is None:
                return False
            dims = [_norm(i, nd) for i in (dims if isinstance(dims, (tuple, list)) else (dims,))]
            return d not in dims and self._set(n, d if keep else d - sum(i < d for i in dims))
        return False

    def _set(self, n: fx.Node, dim: int) -> bool:
        self.of[n] = dim
        return True

    def _sized(self, n: fx.Node, dim: int) -> bool:
        """A view/reshape/expand whose size argument at `dim` is the sequence's length (or -1)."""
        sizes = _sizes(n)
        if sizes is None or dim >= len(sizes):
            return False
        size = sizes[dim]
        ok = size == -1 or (isinstance(size, int) and size == self.seq) or (
            isinstance(size, fx.Node) and dim_hint(size.meta.get("example_value", -2)) == self.seq)
        return ok and self._set(n, dim)

    def _viewed(self, n: fx.Node, d: int, x, out) -> bool:
        before = math.prod(dim_hint(s) for s in x.shape[:d])
        for j in range(out.dim()):
            if math.prod(dim_hint(s) for s in out.shape[:j]) == before and dim_hint(out.shape[j]) == self.seq:
                return self._sized(n, j)
        return False


def _indexed(index, nd: int, d: int) -> int | None:
    """The sequence dimension after `x[index]` (x's at d), or None if the index touches it."""
    index = index if isinstance(index, tuple) else (index,)
    used = sum(1 for e in index if e is not None and e is not Ellipsis)
    at, out = 0, 0
    for e in index:
        if e is Ellipsis:
            span = nd - used
            if at <= d < at + span:
                return out + d - at
            at, out = at + span, out + span
        elif e is None:
            out += 1
        elif isinstance(e, slice):
            if at == d:
                return out if (e.start, e.stop, e.step) == (None, None, None) else None
            at, out = at + 1, out + 1
        elif isinstance(e, int):
            if at == d:
                return None
            at += 1
        else:
            return None   # (a tensor index)
    return out + d - at


def _sizes(n: fx.Node):
    """The size arguments of a view/reshape/expand node (a list), or None."""
    args = n.args[1:]
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return list(args[0])
    if all(isinstance(a, (int, fx.Node)) for a in args) and args:
        return list(args)
    return None


def _resized(n: fx.Node, dim: int, length) -> tuple:
    """n's args with the size at `dim` set to `length` (a tile's), -1 kept."""
    sizes = _sizes(n)
    if sizes[dim] != -1:
        sizes[dim] = length
    if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)):
        return (n.args[0], tuple(sizes))
    return (n.args[0], *sizes)


def _closure_up(starts, stop) -> set[fx.Node]:
    seen, todo = set(), list(starts)
    while todo:
        n = todo.pop()
        if n in seen or n is stop:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen


def _between(source: fx.Node, targets, order: dict) -> list[fx.Node]:
    """The nodes on a path from `source` to one of `targets` (targets included, source not), in
    graph order."""
    up = _closure_up(targets, source)
    reached = {source}
    for n in sorted(up, key=order.__getitem__):
        if any(a in reached for a in n.all_input_nodes):
            reached.add(n)
    return sorted(reached - {source}, key=order.__getitem__)


class Head:
    """A layer's attention whose queries can run in chunks (see the module docstring)."""

    def __init__(self, attention, q, k, v, phase1, phase2, chain, attn, h0, dims):
        self.attention, self.q, self.kv, self.attn, self.h0 = attention, q, (k, v), attn, h0
        self.phase1, self.phase2, self.chain, self.dims = phase1, phase2, chain, dims


def find_head(gm: fx.GraphModule, attn: fx.Node, h0: fx.Node, dim: int,
              order: dict) -> tuple[Head | None, str, fx.Node | None]:
    """The chunkable attention that makes `attn` (the attention block's [b, s, h'] output, before
    the output projection) from the layer input `h0` (sequence at `dim`), or (None, why not, the
    head's value that another branch of the layer reads too, if that is why)."""
    a = attn
    while not _is_attention(a):
        if not a.all_input_nodes:
            return None, "no attention on its first inputs", None
        a = a.all_input_nodes[0]
    if len(a.args) > 6 and a.args[6] != 0:
        return None, "already a chunk", None
    q, k, v = a.args[:3]
    chain = _between(a, [attn], order)
    # (the chain may read values the head computes besides q: Qwen3-Next's output gate)
    reads = [i for c in chain for i in c.all_input_nodes if i not in chain and i is not a]
    head = _between(h0, [q, k, v, *reads], order)
    if not {q, k, v} <= set(head):
        return None, f"q, k and v are not all computed from {h0.name}", None
    inside = set(head) | set(chain) | {a}
    escaping = next((n for n in head + chain[:-1] + [a] if any(u not in inside for u in n.users)), None)
    if escaping is not None:
        readers = [u.name for u in escaping.users if u not in inside]
        return None, f"{escaping.name} is read outside the attention (by {readers})", escaping
    dims = _Dims(dim_hint(_val(h0).shape[dim]))
    dims.of[h0] = dim
    for n in head:
        if not dims.follow(n):
            return None, f"{n.name} ({n.target}) is not sequence-local", None
    if not (dims.of.get(q) == dims.of.get(k) == dims.of.get(v) == 2 and _val(q).dim() == 4):
        return None, "q, k and v are not [b, heads, s, d]", None
    dims.of[a] = 2
    for n in chain:
        if not dims.follow(n):
            return None, f"{n.name} ({n.target}) is not sequence-local", None
    if dims.of[attn] != dim:
        return None, f"{attn.name} does not keep the sequence at dimension {dim}", None
    inside = set(head)
    phase1 = [n for n in head if n in _closure_up([k, v], h0)]
    phase2 = [n for n in head if n in _closure_up([q] + [i for i in reads if i in inside], h0)]
    return Head(a, q, k, v, phase1, phase2, chain, attn, h0, dims), "", None


def _copy(graph: fx.Graph, nodes: list[fx.Node], env: dict, dims: _Dims, length) -> None:
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env.get(a, a))
        env[n].meta = {k: v for k, v in n.meta.items() if k != "example_value"}
        if n.target in _SHAPED or n.target is torch.reshape:
            env[n].args = _resized(env[n], dims.of[n], length)


def _meta(node: fx.Node, like: fx.Node, value=None) -> fx.Node:
    node.meta = {k: v for k, v in like.meta.items() if k != "example_value"}
    if value is not None:
        node.meta["example_value"] = value
    return node


def _tile_split(head: Head, dim: int) -> fx.Node | None:
    """tile_mlp's split of `attn` (its tail's tiles), if it made one."""
    for u in head.attn.users:
        if u.target is torch.split and u.kwargs.get("dim") == dim and \
                all(g.target is operator.getitem for g in u.users):
            return u
    return None


def chunk(gm: fx.GraphModule, head: Head, dim: int, tiles: int) -> None:
    """Rewrite `head`'s attention into `tiles` query chunks (see the module docstring)."""
    graph, a = gm.graph, head.attention
    order = _order(graph)
    split_attn = _tile_split(head, dim)
    if split_attn is not None:   # (tile i of the tail reads getitem i: its chunk goes just before)
        getitems = sorted(split_attn.users, key=lambda g: g.args[1])
        firsts = [min(g.users, key=order.__getitem__) if g.users else g for g in getitems]
    else:
        firsts = [head.attn] * tiles
    with graph.inserting_before(firsts[0]):
        sizes = list(split_attn.args[1]) if split_attn is not None else tile_sizes(graph, head.h0, dim, tiles)
        tiles = len(sizes)
        starts = [0]
        for s in sizes[:-1]:
            starts.append(starts[-1] + s if isinstance(s, int) and isinstance(starts[-1], int)
                          else graph.call_function(operator.add, (starts[-1], s)))
        parts = {}
        for x, at in [(head.h0, dim)] + [(o, j) for o, j in head.dims.outside.items() if j is not None]:
            split = next((u for u in x.users if u.target is torch.split and u.kwargs.get("dim") == at
                          and list(u.args[1]) == sizes), None) if split_attn is not None else None
            split = split or _meta(graph.call_function(torch.split, (x, sizes), {"dim": at}), a)
            have = {g.args[1]: g for g in split.users if g.target is operator.getitem}
            parts[x] = [have.get(i) or _meta(graph.call_function(operator.getitem, (split, i)), a)
                        for i in range(tiles)]
        kv = {}
        for i in range(tiles):   # phase 1: K and V tile by tile
            env = {x: parts[x][i] for x in parts}
            _copy(graph, head.phase1, env, head.dims, sizes[i])
            for t in dict.fromkeys(head.kv):
                kv.setdefault(t, []).append(env[t])
        whole = {t: _meta(graph.call_function(torch.cat, (kv[t],), {"dim": 2}), t, _val(t)) for t in kv}
    outs = []
    for i in range(tiles):   # phase 2: each chunk of queries
        with graph.inserting_before(firsts[i]):
            env = {x: parts[x][i] for x in parts}
            _copy(graph, head.phase2, env, head.dims, sizes[i])
            k, v = (whole[t] for t in head.kv)
            env[a] = _meta(graph.call_function(a.target, (env[head.q], k, v, *a.args[3:6], starts[i]), a.kwargs), a)
            _copy(graph, head.chain, env, head.dims, sizes[i])
        outs.append(env[head.attn])
    if split_attn is not None:
        for g, out in zip(getitems, outs):
            g.replace_all_uses_with(out)
            graph.erase_node(g)
        graph.erase_node(split_attn)
    else:
        with graph.inserting_before(head.attn):
            cat = _meta(graph.call_function(torch.cat, (outs,), {"dim": dim}), head.attn, _val(head.attn))
        head.attn.replace_all_uses_with(cat)
    for n in sorted(set(head.phase1) | set(head.phase2) | {a} | set(head.chain), key=order.__getitem__,
                    reverse=True):
        if n.users:
            raise AssertionError(f"tile_attention: {n} is still read by {list(n.users)}")
        graph.erase_node(n)


def _order(graph: fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


@graph_pass("tile_attention", uses=("mlp_tiles",))
def tile_attention(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    attentions = [n for n in gm.graph.nodes if _is_attention(n)]
    layers = _layer_nodes(gm, attentions)
    counts = []
    order = _order(gm.graph)   # (made again only after a chunk adds nodes: one walk per layer was O(depth^2))
    for a in attentions:
        head = _head_of(gm, a, layers.get(a, set()), order)
        if head is None:
            continue
        h0, dim = head.h0, head.dims.of[head.h0]
        seq = dim_hint(_val(h0).shape[dim])
        split = _tile_split(head, dim)
        if split is not None:
            tiles = len(split.args[1])
        elif isinstance(ctx.mlp_tiles, int):
            tiles = ctx.mlp_tiles
        else:
            hidden = dim_hint(_val(h0).shape[-1])
            tiles = auto_tiles(seq, hidden, hidden)
        if min(tiles, seq) > 1:
            chunk(gm, head, dim, min(tiles, seq))
            counts.append(min(tiles, seq))
            order = _order(gm.graph)
    if counts:
        gm.graph.lint()
        gm.recompile()
    ctx.records.append(("tile_attention", "chunked", counts))
    return gm


def _layer_nodes(gm: fx.GraphModule, attentions: list[fx.Node]) -> dict[fx.Node, set[fx.Node]]:
    """Each attention's decoder layer (its module's parent) -> that layer's nodes."""
    layer_of = {a: p.rsplit(".", 1)[0] for a in attentions if (p := module_path(a)) and "." in p}
    members: dict[str, set[fx.Node]] = {p: set() for p in layer_of.values()}
    for n in gm.graph.nodes:
        for path, _ in (n.meta.get("nn_module_stack") or {}).values():
            if path in members:
                members[path].add(n)
    return {a: members[p] for a, p in layer_of.items()}


def _head_of(gm: fx.GraphModule, a: fx.Node, layer: set[fx.Node], order: dict) -> Head | None:
    """The Head of attention `a`: its chain runs (one reader each) to the [b, s, h'] value an
    output projection (or tile_mlp's split for one) reads; its head starts at the layer's input,
    one of the [b, s, h] values the layer reads from outside."""
    attn = a
    while len(attn.users) == 1:
        nxt = next(iter(attn.users))
        if nxt.target in (F.linear, torch._C._nn.linear) or nxt.target is torch.split:
            break
        attn = nxt
    if attn is a or _val(attn) is None or _val(attn).dim() != 3:
        log.debug("tile_attention: %s keeps its whole attention: no [b, s, h'] value after it", a.name)
        return None
    rows = tuple(_val(attn).shape[:2])
    outside = {x for n in layer for x in n.all_input_nodes if x not in layer}
    why = "it reads no [b, s, h] value from outside its layer"
    starts = [h0 for h0 in sorted(outside, key=order.__getitem__, reverse=True)
              if (v := _val(h0)) is not None and v.dim() == 3 and tuple(v.shape[:2]) == rows
              and not isinstance(v, torch.nn.Parameter)]
    while starts:
        head, why, shared = find_head(gm, attn, starts.pop(0), 1, order)
        if head is not None:
            return head
        # a head value another branch reads too (Falcon-H1's normed input, read by its mamba
        # mixer as well): the chunks start from it, and it stays whole for the other reader
        if shared is not None and shared in layer and (v := _val(shared)) is not None and v.dim() == 3 \
                and tuple(v.shape[:2]) == rows:
            starts.insert(0, shared)
    log.debug("tile_attention: %s keeps its whole attention: %s", a.name, why)
    return None
