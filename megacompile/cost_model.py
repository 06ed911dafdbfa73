"""Cost model of a lowered body: what it computes and moves, and how long that takes on a profile.

A body's time is estimated op by op from its traced shapes:
  * matmul-like ops (mm, addmm, bmm, baddbmm, scaled-dot-product attention, grouped expert
    matmuls) are compute bound: FLOPs / `compute_tflops`;
  * every other op that materialises a tensor (elementwise, norms, softmax, reductions, copies)
    is memory bound: bytes read + written / `device_memory_gbps`;
  * every dispatched op pays `op_overhead_us` (kernel launch, dispatcher).
Views and getitems are free. Everything here is linear in the batch size at a fixed sequence
length, which `megatrain plan` relies on to extrapolate from two traced batch sizes.

On a profile with `measure_ops` (the measured `cpu` profile, where the machine running the
planner is the machine that will train), rooflines are too crude: CPU kernels for log-softmax,
attention or zero-filled allocations run far below the memory bandwidth. There each distinct
op (target, shapes, strides, dtypes) is run once on random inputs of its traced shapes and
timed (`measured_body_seconds`); ops too large to run cheaply, or that fail on random inputs,
fall back to the roofline.
"""
from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass

import torch
import torch.fx as fx

from .hardware import Hardware
from .ir import dim_hint, materialize as _materialize  # noqa: F401 (dim_hint: re-exported)
from .ir_ops import fetch_expert_rows

aten = torch.ops.aten
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_FREE = {operator.getitem, aten.view.default, aten._unsafe_view.default, aten.alias.default,
         aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default,
         aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor, aten.select.int,
         aten.detach.default, aten.as_strided.default, aten.split.Tensor, aten.split_with_sizes.default,
         fetch_expert_rows}  # (its copies are link time: the schedule's transfers)


@dataclass(frozen=True)
class BodyCost:
    flops: int           # matmul/attention FLOPs
    memory_bytes: int    # bytes read + written by memory-bound ops
    ops: int             # dispatched ops

    def seconds(self, hw: Hardware) -> float:
        return (self.flops / (hw.compute_tflops * 1e12) + self.memory_bytes / (hw.device_memory_gbps * 1e9)
                + self.ops * hw.op_overhead_us * 1e-6)


def _numel(val) -> int:
    return math.prod(dim_hint(d) for d in val.shape)


def logical_bytes(val) -> int:
    """Bytes of a value's elements (views count their own extent, not their base)."""
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(_numel(v) * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def _causal_pairs(n: int, window: int) -> float:
    """(query, key) pairs the first `n` queries of a causal row attend, within `window` if > 0."""
    return n * n / 2 if not window or window >= n else n * window - window * window / 2


def node_flops(n: fx.Node) -> int:
    """FLOPs of a matmul-like node (0 for anything else)."""
    val = n.meta.get("val")
    name = str(n.target)
    if n.target in _MATMULS and isinstance(val, torch.Tensor):
        a = n.args[1] if n.target in (aten.addmm.default, aten.baddbmm.default) else n.args[0]
        return 2 * _numel(val) * dim_hint(a.meta["val"].shape[-1])
    if "scaled_dot_product" in name and isinstance(n.args[0], fx.Node):
        q, k = n.args[0].meta["val"], n.args[1].meta["val"]
        b_h = math.prod(dim_hint(d) for d in q.shape[:-2])
        sq, sk, d = dim_hint(q.shape[-2]), dim_hint(k.shape[-2]), dim_hint(q.shape[-1])
        factor = 2.5 if "backward" in name else 1.0   # backward ~ 2.5x the forward matmuls
        return int(factor * 4 * b_h * sq * sk * d)
    if "attention_estimate" in name:  # meta_attention.py: a fused kernel; causal skips half
        q, k = n.args[1 if "backward" in name else 0].meta["val"], n.args[2 if "backward" in name else 1].meta["val"]
        b_h = math.prod(dim_hint(d) for d in q.shape[:-2])
        flops = 4 * b_h * dim_hint(q.shape[-2]) * dim_hint(k.shape[-2]) * dim_hint(q.shape[-1])
        causal = n.args[-1] is True
        return int(flops * (2.5 if "backward" in name else 1.0) * (0.5 if causal else 1.0))
    if "segment_attention" in name:  # attention.py: causal within a row (one segment), windowed
        back = "backward" in name
        q, k, v = (n.args[i + back].meta["val"] for i in range(3))
        s, window = dim_hint(q.shape[-2]), n.args[4 + 3 * back]
        start = n.args[6 + 3 * back] if len(n.args) > 6 + 3 * back else n.kwargs.get("q_start", 0)
        start = dim_hint(start) if not isinstance(start, fx.Node) else dim_hint(start.meta["val"])
        pairs = _causal_pairs(start + s, window) - _causal_pairs(start, window)   # (a query chunk: q_start)
        b_h = math.prod(dim_hint(d) for d in q.shape[:-2])
        return int(2 * b_h * pairs * (dim_hint(q.shape[-1]) + dim_hint(v.shape[-1])) * (2.5 if back else 1.0))
    if "linear_cross_entropy" in name and isinstance(n.args[0], fx.Node):   # the fused LM head + loss (ir_ops)
        from .ir_ops import DEFAULT_CHUNK_BYTES, chunk_rows, weight_grad_block
        h, w = n.args[0].meta["val"], n.args[1].meta["val"]
        hidden = dim_hint(h.shape[-1])
        rows, vocab = _numel(h) // max(1, hidden), dim_hint(w.shape[0])
        grad_hidden, grad_weight = bool(n.args[5]), bool(n.args[6])
        # the logits, then d_hidden and d_weight from them; d_weight in a pass of its own
        # recomputes the logits (runtime/kernels/chunked_ce.py)
        chunk = chunk_rows(rows, vocab, h.dtype.itemsize, None, DEFAULT_CHUNK_BYTES)
        again = grad_weight and weight_grad_block(rows, vocab, hidden, h.dtype.itemsize, chunk, None,
                                                  DEFAULT_CHUNK_BYTES) is not None
        return 2 * rows * vocab * hidden * (1 + grad_hidden + grad_weight + again)
    if "grouped_mm" in name and isinstance(n.args[0], fx.Node):
        x, w = n.args[0].meta["val"], n.args[1].meta["val"]
        rows, k, out = dim_hint(x.shape[0]), dim_hint(w.shape[-2]), dim_hint(w.shape[-1])
        return (4 if "backward" in name else 2) * rows * k * out
    return 0


def dispatched_ops(body: fx.GraphModule):
    """The nodes of a body that run a kernel (views and getitems are free)."""
    return [n for n in body.graph.nodes
            if n.op == "call_function" and n.target not in _FREE and not getattr(n.target, "is_view", False)]


def node_bytes(n: fx.Node) -> int:
    """Bytes a node reads and writes."""
    return logical_bytes(n.meta.get("val")) + sum(logical_bytes(a.meta.get("val")) for a in n.all_input_nodes)


def body_cost(body: fx.GraphModule, recompute_only: bool = False) -> BodyCost:
    """Cost of a body; `recompute_only`: just the forward ops a backward body recomputes (the
    partitioner tags them `partitioner_tag="is_forward"`)."""
    flops = memory = ops = 0
    for n in dispatched_ops(body):
        if recompute_only and n.meta.get("partitioner_tag") != "is_forward":
            continue
        ops += 1
        f = node_flops(n)
        if f:
            flops += f
        else:
            memory += node_bytes(n)
    return BodyCost(flops, memory, ops)


#: host bytes the optimizer step streams per parameter: read master, m, v, grad (16), write
#: master, m, v (12), refresh the transfer copy (4)
OPTIMIZER_BYTES_PER_PARAM = 32


def optimizer_seconds(trainable_params: int, hw: Hardware) -> float:
    """The CPU AdamW step over fp32 masters: the measured rate where the profile has one
    (`optimizer_gparams`: host_probe.py), else host-memory bound at the profile's bandwidth."""
    if hw.optimizer_gparams:
        return trainable_params / (hw.optimizer_gparams * 1e9)
    return trainable_params * OPTIMIZER_BYTES_PER_PARAM / hw.optimizer_bytes_per_s


# -- measured op times (profiles with measure_ops) ----------------------------------------------

#: ops above these sizes are not run (their roofline estimate is used): keeps planning fast
MEASURE_MAX_FLOPS, MEASURE_MAX_BYTES = 4e10, 2**28
_measured: dict[tuple, float] = {}   # (op or body code, shapes) -> fastest seconds seen in this process


def forget_measured() -> None:
    """Time ops and bodies again on the next plan (a benchmark repeating its prediction)."""
    _measured.clear()


def _key(n: fx.Node) -> tuple:
    def sig(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("T", tuple(dim_hint(d) for d in v.shape), tuple(dim_hint(d) for d in v.stride()), v.dtype)
            return ("V", str(v))
        if isinstance(a, (list, tuple)):
            return tuple(sig(x) for x in a)
        return repr(a)
    return (str(n.target), sig(n.args), sig(tuple(sorted(n.kwargs.items()))))


def _measure(n: fx.Node) -> float | None:
    """Median of three timed runs of one op on random inputs of its traced shapes (the
    meta_attention ops run the CPU's fused attention kernels); None if it cannot run."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        args, kwargs = _materialize(n.args), {k: _materialize(v) for k, v in n.kwargs.items()}
        try:
            n.target(*args, **kwargs)   # warm up (and first-touch pages, as a real step has them)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                n.target(*args, **kwargs)
                times.append(time.perf_counter() - t0)
        except Exception:   # an op that random inputs cannot drive: use the roofline
            return None
    return sorted(times)[1]


def _op_level_seconds(body: fx.GraphModule, hw: Hardware) -> float:
    """Body time from measured op times (roofline for ops too large or not runnable)."""
    total = 0.0
    for n in dispatched_ops(body):
        key = _key(n)
        if key not in _measured:
            f = node_flops(n)
            nbytes = node_bytes(n)
            t = _measure(n) if f <= MEASURE_MAX_FLOPS and nbytes <= MEASURE_MAX_BYTES else None
            if t is None:
                t = BodyCost(f, 0 if f else nbytes, 1).seconds(hw)
            _measured[key] = t
        total += _measured[key] + hw.op_overhead_us * 1e-6
    return total


def _on_cpu(body: fx.GraphModule) -> fx.GraphModule:
    """A copy of a meta-traced body whose factory ops (arange, zeros, full...) create CPU tensors."""
    graph = fx.Graph()
    graph.graph_copy(body.graph, {})
    meta = torch.device("meta")
    for n in graph.nodes:
        if n.kwargs.get("device") in (meta, "meta"):
            n.kwargs = {**n.kwargs, "device": torch.device("cpu")}
    return fx.GraphModule(body, graph)


def measured_body_seconds(body: fx.GraphModule, hw: Hardware) -> float:
    """Time one call of the whole body on random inputs of its traced shapes (allocation, cache
    and interpreter effects included); op by op when the body is too large or cannot run."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    cost = body_cost(body)
    key = (body.code, tuple(_key(n)[1] for n in placeholders))
    if key in _measured:
        return _measured[key]
    t = None
    if cost.flops <= 10 * MEASURE_MAX_FLOPS and cost.memory_bytes <= 10 * MEASURE_MAX_BYTES:
        with unset_fake_temporarily():
            try:
                inputs = [_materialize(n) for n in placeholders]
                body = _on_cpu(body)
                body(*inputs)   # warm up
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    body(*inputs)
                    times.append(time.perf_counter() - t0)
                t = min(times)  # other load on the machine only ever adds time
            except Exception:   # random inputs cannot drive it: time it op by op
                t = None
    if t is None:
        t = _op_level_seconds(body, hw)
    _measured[key] = t
    return t


def body_seconds(body: fx.GraphModule, hw: Hardware) -> float:
    """Estimated time of one call of `body` on `hw`."""
    if hw.measure_ops:
        return measured_body_seconds(body, hw)
    return body_cost(body).seconds(hw)
