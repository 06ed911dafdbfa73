"""Memory plan: predicted device bytes at every step of a schedule, and the budget check.

Reads the split graph and its schedule. Device bytes at a step are the resident weights (from
the schedule's prefetch/evict), the live values between segments (each freed after its last
reader, as the executor does) and, while a body runs, its intermediates (liveness over the
body's traced shapes; symbolic sizes use their hints). `check_budget` refuses a step whose
planned peak (over forward and backward) exceeds `device_budget`, naming the smallest budget
that fits and what to change.

    gm.meta["mt_memory_plan"] = MemoryPlan(peak_bytes, peak_step, transient={body: bytes}, ...)
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import CannotFitError  # (re-exported: the schedule's peak exceeds the device budget)
from ..ir import (BODY, MEMORY_PLAN, SCHEDULE, SEGMENT, STEP, WEIGHT_GROUP, MemoryPlan, dim_hint, host_values,
                  liveness, op_of, segment_calls, walk)
from ..units import fmt_bytes as _fmt
from ..ir_ops import fetch_expert_rows, linear_cross_entropy_workspace, triton_runs
from . import PassContext, graph_pass
# fetch_expert_rows returns the (resident) weight it fills
_ALIASING = {torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default, fetch_expert_rows}


def _tensor_bytes(v: torch.Tensor) -> int:
    # the whole storage, as the allocator holds it (a view keeps its base alive)
    try:
        return dim_hint(v.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # e.g. tensors without storage
        return math.prod(dim_hint(d) for d in v.shape) * v.element_size()


def value_bytes(val) -> int:
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(_tensor_bytes(v) for v in vals if isinstance(v, torch.Tensor))


def storage_key(val):
    """What a value's bytes belong to: views of one tensor (a sequence split's tiles, saved for
    the backward each on its own) share one storage, held once by the allocator; None for
    anything without one."""
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def _workspace(n: fx.Node, triton: bool) -> int:
    """Bytes an op allocates internally beyond its outputs (our fused ops; 0 for aten ops)."""
    if n.op == "call_function" and getattr(n.target, "name", lambda: "")() == "megatrain::linear_cross_entropy":
        hidden, weight = (a.meta.get("val") for a in n.args[:2])
        if isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor):
            vocab, n_hidden = (dim_hint(d) for d in weight.shape)
            n_rows = math.prod(dim_hint(d) for d in hidden.shape) // max(1, n_hidden)
            return linear_cross_entropy_workspace(n_rows, vocab, n_hidden, hidden.dtype,
                                                  triton or triton_runs(hidden), bool(n.args[6]))
    return 0


def body_transient_bytes(body: fx.GraphModule, triton: bool = False,
                         consumed: tuple[tuple[tuple[int, ...], int], ...] = ()) -> int:
    """Peak bytes of a body's intermediates (and fused ops' workspaces, with `triton` as on a
    GPU). A view adds no bytes and keeps its base's alive until its own last reader; an op with
    several outputs allocates them together, and each dies with the last reader of its getitem.
    `consumed` names inputs the caller no longer holds (boxed call, runtime/lowering.py), as
    (placeholder positions sharing one storage, its bytes): counted from the start, and freed
    at their last reader in the body.

        mm_4 = mm(x, w); v = _unsafe_view(mm_4, [1, s, i]); y = silu(v)
        (mm_4's bytes live until silu reads v, not until the view is made)
        dq, dk, dv = segment_attention_backward(...)      (three values, each freed on its own)
        body([checkpoint, grad_out, ...])   (grad_out's bytes are freed after the tail's backward)
    """
    def view(n: fx.Node) -> bool:
        return n.target in _ALIASING or getattr(n.target, "is_view", False)

    nodes = list(body.graph.nodes)
    root: dict[fx.Node, fx.Node] = {}    # a view (or an element of a view op's list) -> what owns its bytes
    placeholders = [n for n in nodes if n.op == "placeholder"]
    live, sizes = 0, {}
    for positions, nbytes in consumed:
        owner = placeholders[positions[0]]
        root.update((placeholders[p], owner) for p in positions[1:])
        sizes[owner] = nbytes
        live += nbytes
    for n in nodes:
        if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
            continue
        if view(n) or (n.target is operator.getitem and n.args[0] in root):
            root[n] = root.get(n.args[0], n.args[0])
    last = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[root.get(a, a)] = i
    for owner in list(sizes):   # (an input nothing reads)
        if owner not in last:
            live -= sizes.pop(owner)
    peak = live
    for i, n in enumerate(nodes):
        if n.op in ("call_function", "call_method", "call_module") and n not in root \
                and n.target is not operator.getitem:
            val = n.meta.get("val")
            live += value_bytes(val)
            peak = max(peak, live + _workspace(n, triton))
            if isinstance(val, (list, tuple)):   # (each output is owned by its getitem; unread ones die now)
                taken = {g.args[1]: g for g in n.users if g.target is operator.getitem}
                for k, v in enumerate(val):
                    if k in taken:
                        sizes[taken[k]] = value_bytes(v)
                    else:
                        live -= value_bytes(v)
            else:
                sizes[n] = value_bytes(val)
        for a in {root.get(a, a) for a in n.all_input_nodes} | ({n} if n in sizes else set()):
            if last.get(a, i) <= i and a in sizes:
                live -= sizes.pop(a)
    return peak


def check_budget(plans: dict[str, MemoryPlan], budget: int | None, slots: int) -> None:
    """Refuse a step (all compiled directions) whose planned peak exceeds `budget`."""
    if budget is None or not plans:
        return
    direction, plan = max(plans.items(), key=lambda kv: kv[1].peak_bytes)
    if plan.peak_bytes <= budget:
        return
    peak, weights = plan.peak_bytes, plan.peak_weight_bytes
    with_one_slot = max(p.peak_bytes - p.peak_weight_bytes + p.largest_segment_weight_bytes for p in plans.values())
    raise CannotFitError(
        f"cannot fit a training step in device_budget={_fmt(budget)}: the {direction} pass peaks at {_fmt(peak)} "
        f"(resident weights {_fmt(weights)} with slots={slots}, the rest activations and intermediates"
        + ("; layer checkpoints already on the host" if any(p.host_checkpoint_bytes for p in plans.values()) else "")
        + "). "
        f"The smallest budget that fits this schedule is {peak} bytes"
        + (f"; with slots=1 about {_fmt(with_one_slot)}" if slots > 1 else "")
        + ". Or lower the batch size or sequence length, or set recompute_head=True.")


def _alias_key(n: fx.Node):
    """Which program values share their bytes: those on one (fake) storage that one run made,
    or that one run reads first (a backward's saved values). The fake storage alone does not
    say it: the layers of one kind are traced once (passes/layer_subgraphs.py), so the values
    of all of them carry the same fake tensors."""
    key = storage_key(n.meta.get("val"))
    if key is None:
        return None
    if op_of(n) == "output_of":
        return n.args[0].name, key
    runs = [u.name for u in n.users if op_of(u) == "run"]
    return (runs[0] if runs else n.name), key


class _Account:
    """Device bytes while walking a schedule program: one handler per program op, each freeing
    what dies at its node (`frees`, the executor's liveness) where the executor frees it."""

    def __init__(self, program: fx.GraphModule, transient, frees: dict[int, list[str]]):
        self.transient, self.frees = transient, frees   # transient(run node, consumed inputs) -> bytes
        self.run_transient: dict[int, int] = {}         # segment -> its body's bytes as it ran here
        host = host_values(program)   # (offloaded checkpoints: host bytes, not device bytes)
        self.sizes = {n.name: 0 if n.name in host else value_bytes(n.meta.get("val")) for n in program.graph.nodes}
        # views of one storage (the tiles of a split, saved one by one) hold its bytes once
        self.storage = {n.name: _alias_key(n) for n in program.graph.nodes}
        self.live = {n.name for n in program.graph.nodes if n.op == "placeholder" and WEIGHT_GROUP not in n.meta}
        self.host_bytes = sum(value_bytes(n.meta.get("val")) for n in program.graph.nodes if n.name in host)
        self.resident = self.peak_weights = 0
        self.per_step: list[int] = []

    def bytes(self) -> int:
        seen, total = set(), self.resident
        for v in self.live:
            key = self.storage[v]
            if key is None or key not in seen:
                seen.add(key)
                total += self.sizes[v]
        return total

    def free(self, i: int, n: fx.Node = None) -> None:
        self.live.difference_update(self.frees.get(i, ()))

    def prefetch(self, i: int, n: fx.Node) -> None:
        self.resident += n.meta[STEP].nbytes
        self.peak_weights = max(self.peak_weights, self.resident)
        self.step(i, n)

    def evict(self, i: int, n: fx.Node) -> None:
        self.resident -= n.meta[STEP].nbytes
        self.step(i, n)

    def run(self, i: int, n: fx.Node) -> None:
        """Counted while its body runs, then its dead values go. The inputs it reads last are the
        body's to free (boxed call) unless another live value shares their storage."""
        dead = {a.name for a in n.args if isinstance(a, fx.Node) and a.name in self.live} & set(self.frees.get(i, ()))
        kept = {self.storage[v] for v in self.live - dead}
        groups: dict[object, list[int]] = {}
        for position, a in enumerate(n.args):
            if isinstance(a, fx.Node) and a.name in dead and (self.storage[a.name] is None
                                                               or self.storage[a.name] not in kept):
                groups.setdefault(self.storage[a.name] or a.name, []).append(position)
        consumed = tuple((tuple(ps), max(self.sizes[n.args[p].name] for p in ps)) for ps in groups.values())
        self.live.difference_update(n.args[p].name for ps in groups.values() for p in ps)
        before, body = self.bytes(), self.transient(n, consumed)
        self.run_transient[n.meta[STEP].segment] = body
        self.live.update(n.meta[SEGMENT]["outputs"])   # (its getitems: bound as it returns)
        self.per_step.append(max(before + body, self.bytes()))
        self.free(i)

    def step(self, i: int, n: fx.Node) -> None:   # wait, grad_offload, ...: what is live once it is done
        self.free(i)
        self.per_step.append(self.bytes())

    def value(self, i: int, n: fx.Node) -> None:
        self.live.add(n.name)
        self.free(i)

    def reload(self, i: int, n: fx.Node) -> None:   # a device copy from here to its last reader
        self.live.add(n.name)
        self.step(i, n)


@graph_pass("memory_plan", reads=(SEGMENT, SCHEDULE), writes=(MEMORY_PLAN,), uses=("device", "hardware"))
def memory_plan(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    schedule = gm.meta[SCHEDULE]
    transient = {}
    # fused ops' workspaces as they run on a GPU (Triton), also when planning one from here
    triton = getattr(ctx.device, "type", None) == "cuda" or getattr(ctx.hardware, "name", "cpu") != "cpu"
    for n in segment_calls(gm):
        name = n.meta.get(BODY, n.target)
        if name not in transient:
            transient[name] = body_transient_bytes(gm.get_submodule(name), triton)
    bodies = [n.meta.get(BODY, n.target) for n in segment_calls(gm)]   # (segment k is call k)
    with_inputs: dict[tuple, int] = {}

    def run_transient(run: fx.Node, consumed) -> int:   # (once per body and consumed inputs)
        name = bodies[run.meta[STEP].segment]
        if not consumed:
            return transient[name]
        if (name, consumed) not in with_inputs:
            with_inputs[name, consumed] = body_transient_bytes(gm.get_submodule(name), triton, consumed)
        return with_inputs[name, consumed]

    program = schedule.program
    account = _Account(program, run_transient, liveness(program).frees)   # (the executor frees by the same analysis)
    walk(program, {"prefetch": account.prefetch, "evict": account.evict, "run": account.run, "wait": account.step,
                   "grad_offload": account.step, "offload": account.step, "reload": account.reload,
                   # data parallelism: a sharded fetch fills a whole buffer, as a fetch does; the
                   # reduce-scatter's fp32 buffer is not counted yet
                   "prefetch_shard": account.prefetch, "all_gather": account.step, "reduce_scatter": account.step,
                   "value": account.value, "output_of": account.free,
                   "placeholder": account.free, "output": account.free})
    per_step = account.per_step
    peak_step = max(range(len(per_step)), key=lambda i: (per_step[i], -i)) if per_step else 0
    gm.meta[MEMORY_PLAN] = MemoryPlan(per_step[peak_step] if per_step else 0, peak_step, account.peak_weights,
                                      transient, per_step,
                                      max((seg.weight_nbytes for seg in schedule.segments), default=0),
                                      account.host_bytes, account.run_transient)
    return gm
