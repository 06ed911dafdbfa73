"""Recompute a cheap value next to its late readers instead of holding it across the backward.

A layer's backward recomputes its forward first, then differentiates it. A value that the
recomputed forward reads and the backward reads again much later is held all that time: the
input norm's output feeds the q/k/v projections at the start and their weight gradients at
the very end, so it is live through the MLP's and the attention's backward, the peak of a long
sequence (one [tokens, hidden] value: 16 GiB at 2M tokens of Llama-3-8B). When it is cheap to
make again (a norm, elementwise ops, views: no matmul, no random numbers) from values that are
live at its late readers anyway (the layer checkpoint, kept for the norm's backward; resident
weights), its chain is copied right before the first late reader, and the late readers read
the copy:

    n, rstd = rms_norm(x, w); q = mm(view(n), wq) ... (MLP and attention backward) ... dwq = mm(dq', view(n))
 ->
    n, rstd = rms_norm(x, w); q = mm(view(n), wq) ... n', _ = rms_norm(x, w); dwq = mm(dq', view(n'))

The same op on the same inputs gives the same bits, so numerics are unchanged. Readers are
split at the gap between consecutive readers in which the most bytes are allocated; a value
is recomputed only when that gap allocates at least twice its own bytes, and only within one
segment (its readers and its chain carry one `mt_rank`). It runs on the backward graph, after
`layer_regions` and before `split_segments`; the tiles of `tile_mlp` get the same treatment
(a tile's SwiGLU output is recomputed for its down projection's weight gradient).
"""
from __future__ import annotations

import bisect
import collections
import operator

import torch
import torch.fx as fx

from ..ir import GROUP, RANK, WEIGHT_GROUP
from . import PassContext, graph_pass
from .memory_plan import value_bytes

#: at most this many ops are copied for one value (a norm written as torch ops is ~8)
MAX_CHAIN = 12
#: fused ops that are as cheap as elementwise ones (by name: their namespace is registered lazily)
_CHEAP_FUSED = {"megatrain::rms_norm", "megatrain::swiglu"}
#: reductions over the last dimension (a norm written as torch ops)
_LAST_DIM_REDUCTIONS = {torch.ops.aten.mean.dim, torch.ops.aten.sum.dim_IntList}


def _name(n: fx.Node) -> str:
    return getattr(n.target, "name", lambda: "")() if n.op == "call_function" else ""


def _is_view(n: fx.Node) -> bool:
    return n.op == "call_function" and (getattr(n.target, "is_view", False)
                                        or n.target is torch.ops.aten._unsafe_view.default)


def _cheap(n: fx.Node) -> bool:
    """An op worth recomputing rather than holding: elementwise, a view, a norm, a cast."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem or _is_view(n) or _name(n) in _CHEAP_FUSED:
        return True
    target = n.target
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    if torch.Tag.pointwise in target.tags or target in (torch.ops.aten._to_copy.default,
                                                        torch.ops.aten.native_layer_norm.default):
        return True
    if target.overloadpacket in {r.overloadpacket for r in _LAST_DIM_REDUCTIONS} and len(n.args) > 1:
        val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        dims = n.args[1] if isinstance(n.args[1], (list, tuple)) else [n.args[1]]
        return isinstance(val, torch.Tensor) and all(d in (-1, val.dim() - 1) for d in dims)
    return False


class _Order:
    """Positions of a graph's nodes, and per segment (`mt_rank`) the bytes its ops allocate and
    the last reader of each value in it, kept current as chains are copied. Only what happens
    inside the segment counts, so identical layers make identical choices (and keep one body)
    whatever later segments read."""

    def __init__(self, graph: fx.Graph):
        nodes = list(graph.nodes)
        self.pos = {n: float(i) for i, n in enumerate(nodes)}
        self.root: dict[fx.Node, fx.Node] = {}   # a view -> the value owning its bytes
        for n in nodes:
            if (_is_view(n) or n.target is operator.getitem and n.args[0] in self.root) \
                    and isinstance(n.args[0], fx.Node):
                self.root[n] = self.root.get(n.args[0], n.args[0])
        self.last: dict[tuple, float] = {}   # (value, rank) -> its last reader in that segment
        self.made: dict[object, tuple[list[float], list[int]]] = {}   # rank -> (positions, prefix bytes)
        for n in nodes:
            rank = n.meta.get(RANK)
            for a in n.all_input_nodes:
                key = (self.root.get(a, a), rank)
                self.last[key] = max(self.last.get(key, -1.0), self.pos[n])
            if n.op == "call_function" and not _is_view(n) and n.target is not operator.getitem:
                positions, prefix = self.made.setdefault(rank, ([], [0]))
                positions.append(self.pos[n])
                prefix.append(prefix[-1] + value_bytes(n.meta.get("val")))

    def between(self, a: float, b: float, rank) -> int:
        """Bytes allocated by the segment's ops strictly between positions a and b."""
        positions, prefix = self.made.get(rank, ([], [0]))
        lo, hi = bisect.bisect_right(positions, a), bisect.bisect_left(positions, b)
        return prefix[hi] - prefix[lo] if hi > lo else 0

    def live_at(self, n: fx.Node, at: float, rank) -> bool:
        if n.op == "placeholder" and WEIGHT_GROUP in n.meta or n.op == "get_attr":
            return True   # (a resident weight of the segment)
        return self.last.get((self.root.get(n, n), rank), -1.0) >= at


def _readers(v: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(reader, the alias of v it reads) for every non-view reader of v or of a view of v."""
    out, todo = [], [v]
    while todo:
        a = todo.pop()
        for u in a.users:
            if _is_view(u) and u.args[0] is a:
                todo.append(u)
            else:
                out.append((u, a))
    return out


def _chain(v: fx.Node, order: _Order, at: float, rank) -> list[fx.Node] | None:
    """The ops to copy to make v again at position `at` from values live there anyway, in
    graph order; None if that needs anything costly or not live there."""
    chain: list[fx.Node] = []
    done: set[fx.Node] = set()
    entered = [0]   # (ops looked at: bounds the search, and so its recursion, to MAX_CHAIN)

    def visit(n: fx.Node) -> bool:
        if n in done:
            return True
        if n is not v and order.live_at(n, at, rank):
            done.add(n)
            return True
        entered[0] += 1
        if not _cheap(n) or n.meta.get(RANK) != rank or entered[0] > MAX_CHAIN:
            return False
        if not all(visit(a) for a in n.all_input_nodes):
            return False
        done.add(n)
        chain.append(n)
        return True

    return chain if visit(v) else None


def _late_readers(v: fx.Node, order: _Order) -> list[tuple[fx.Node, fx.Node]] | None:
    readers = sorted(_readers(v), key=lambda ra: ra[0])   # (graph order: copies share a position in `order`)
    if len(readers) < 2 or any(r.op == "output" or r.meta.get(RANK) != v.meta.get(RANK) for r, _ in readers):
        return None
    gaps = [order.between(order.pos[a], order.pos[b], v.meta.get(RANK)) for (a, _), (b, _) in zip(readers, readers[1:])]
    split = max(range(len(gaps)), key=gaps.__getitem__)
    if gaps[split] < 2 * value_bytes(order.root.get(v, v).meta.get("val")):
        return None
    return readers[split + 1:]


@graph_pass("rematerialize", reads=(RANK, GROUP), uses=("direction",))
def rematerialize(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.direction != "backward":
        return gm
    graph = gm.graph
    order = _Order(graph)
    copied: dict[str, int] = {}   # the op making each recomputed value -> how many
    # Views are left out (a view's bytes are its base's: recomputing it frees nothing). A value
    # and each copy made of it go back on the list: its readers before the split, and the
    # copy's after it, may hold another gap worth a copy, as a tile's normalized input read by
    # its own backward, by the norm weight's gradient and again after the whole attention's.
    todo = collections.deque(v for v in graph.nodes if v.op == "call_function" and not _is_view(v)
                             and v not in order.root and _cheap(v) and RANK in v.meta)
    while todo:   # (in graph order: a value's chain is looked at after the values it is made from)
        v = todo.popleft()
        late = _late_readers(v, order)
        if late is None:
            continue
        first = late[0][0]
        chain = _chain(v, order, order.pos[first], v.meta[RANK])
        if not chain:
            continue
        env: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(first):
            for n in chain:
                env[n] = graph.node_copy(n, lambda a: env.get(a, a))
                env[n].meta = dict(n.meta)
            for reader, alias in late:
                path = []   # the views from v to what this reader reads, copied on the recomputed v
                while alias not in env:
                    path.append(alias)
                    alias = alias.args[0]
                for view in reversed(path):
                    env[view] = graph.node_copy(view, lambda a: env.get(a, a))
                    env[view].meta = dict(view.meta)
        for reader, alias in late:
            reader.replace_input_with(alias, env[alias])
            while alias is not v and not alias.users:   # (a view only the late readers read: gone)
                base = alias.args[0]
                graph.erase_node(alias)
                alias = base
        # the original now dies at its last early reader; the copies sit just before `first`
        early = [order.pos[r] for r, _ in _readers(v)]
        order.last[order.root.get(v, v), v.meta[RANK]] = max(early, default=order.pos[v])
        for n in env.values():
            order.pos[n] = order.pos[first] - 0.5
        order.last[env[v], v.meta[RANK]] = max(order.pos[r] for r, _ in late)
        todo += [v, env[v]]
        maker = chain[-1].args[0] if chain[-1].target is operator.getitem else chain[-1]
        copied[str(maker.target)] = copied.get(str(maker.target), 0) + 1
    if copied:
        graph.lint()
        gm.recompile()
    ctx.records.append(("rematerialize", "recomputed", copied))
    return gm
