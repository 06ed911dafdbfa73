"""The custom ops a compiled graph holds (the IR layer, with megacompile/ir.py): their schemas,
shapes (fake implementations), autograd formulas and the sizes the memory plan needs. Passes
insert them; the runtime registers the kernels that run them (runtime/kernels/ops.py, imported
by the backend) and fills `fetch_expert_rows`' rows (runtime/expert_rows.py). Neither side
imports the other for them.

    megatrain::rms_norm(x, weight, eps, offset, cast_before_weight) -> (y, rstd)
    megatrain::rms_norm_backward(dy, x, weight, rstd, offset, cast_before_weight) -> (dx, dweight)
    megatrain::swiglu(gate, up) -> out
    megatrain::swiglu_backward(dout, gate, up) -> (dgate, dup)
    megatrain::linear_cross_entropy(hidden, weight, labels, ignore_index, reduction,
                                    grad_hidden, grad_weight) -> (loss, dhidden, dweight)
    fetch_expert_rows(W, offs) -> W        (a Python call: its rows are copied when it runs)

AOTAutograd traces a custom op as one node (shapes from its fake implementation, which like the
kernels returns contiguous tensors) and its registered backward as the backward op's node, so
megatrain's passes place both in layer bodies like any aten op, and the min-cut partitioner
saves `rstd` (one float per row) rather than the fp32 upcast eager autograd keeps.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

#: the LM head + loss works through the rows in chunks of about this many logits bytes
DEFAULT_CHUNK_BYTES = 256 * 2**20


def triton_runs(t: Tensor) -> bool:
    """Whether the Triton kernels run for a tensor: on CUDA, or on the CPU under the interpreter."""
    if not (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def chunk_rows(n_rows: int, vocab: int, itemsize: int, chunk_size: int | None, chunk_bytes: int) -> int:
    """Rows per chunk of the LM head + loss: `chunk_size`, or as many as fit `chunk_bytes` of logits."""
    if chunk_size is None:
        chunk_size = chunk_bytes // max(1, vocab * itemsize)
    return max(1, min(int(chunk_size), max(n_rows, 1)))


def block_like_rows(rows: int, vocab: int, n_rows: int) -> int:
    """Vocabulary rows per block holding as many logits as a chunk of `rows` rows."""
    return max(1, min(vocab, rows * vocab // max(n_rows, 1)))


def weight_grad_block(n_rows: int, vocab: int, n_hidden: int, itemsize: int, rows: int,
                      chunk_size: int | None, chunk_bytes: int) -> int | None:
    """Vocabulary rows per block of the LM head's weight gradient when it is computed in a
    pass of its own (runtime/kernels/chunked_ce.py), or None when it is accumulated over the
    row chunks. Accumulating needs an fp32 [V, H] buffer beside the [V, H] result; the pass of
    its own recomputes the logits one [N, block] slice at a time (one more head matmul) and
    needs no accumulator. It runs when there are several row chunks and that accumulator
    (4 B x V x H) would outweigh all of the logits (itemsize x N x V): at N below 4H / itemsize
    (8K tokens for a 4K-wide bf16 model), where keeping the logits would otherwise take less
    memory than dropping them."""
    if rows >= n_rows or 4 * n_hidden <= n_rows * itemsize:
        return None
    if chunk_size is not None:
        return block_like_rows(rows, vocab, n_rows)
    return max(1, min(vocab, chunk_bytes // max(1, n_rows * (itemsize + 4))))


def _needs_kernel(*_args):
    raise NotImplementedError("no kernel registered for this megatrain op on this device: the runtime registers "
                              "them (import megacompile, which loads megacompile.runtime.kernels.ops)")


# -- RMSNorm --------------------------------------------------------------------------------
@torch.library.custom_op("megatrain::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float, cast_before_weight: bool) -> tuple[Tensor, Tensor]:
    _needs_kernel()


@rms_norm.register_fake
def _(x, weight, eps, offset, cast_before_weight):
    dtype = torch.promote_types(x.dtype, weight.dtype) if cast_before_weight else x.dtype
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("megatrain::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, offset: float,
                      cast_before_weight: bool) -> tuple[Tensor, Tensor]:
    _needs_kernel()


@rms_norm_backward.register_fake
def _(dy, x, weight, rstd, offset, cast_before_weight):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_setup(ctx, inputs, output):
    x, weight, _eps, offset, cast_before_weight = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset, ctx.cast_before_weight = offset, cast_before_weight


def _rms_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = torch.ops.megatrain.rms_norm_backward(dy, x, weight, rstd, ctx.offset, ctx.cast_before_weight)
    return dx, dweight, None, None, None


rms_norm.register_autograd(_rms_backward, setup_context=_rms_setup)


# -- SwiGLU ---------------------------------------------------------------------------------
@torch.library.custom_op("megatrain::swiglu", mutates_args=())
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    _needs_kernel()


@swiglu.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("megatrain::swiglu_backward", mutates_args=())
def swiglu_backward(dout: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    _needs_kernel()


@swiglu_backward.register_fake
def _(dout, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dout):
    gate, up = ctx.saved_tensors
    return torch.ops.megatrain.swiglu_backward(dout, gate, up)


swiglu.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


# -- LM head + cross entropy ----------------------------------------------------------------
# One op computes the loss AND its gradients ("gradient in the forward", runtime/kernels/
# chunked_ce.py): the gradients are extra outputs that only the backward reads (scaled by the
# loss's incoming gradient), so AOTAutograd saves them instead of the [N, V] logits. A gradient
# that is not wanted is an empty tensor.
@torch.library.custom_op("megatrain::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, reduction: str,
                         grad_hidden: bool, grad_weight: bool) -> tuple[Tensor, Tensor, Tensor]:
    _needs_kernel()


@linear_cross_entropy.register_fake
def _(hidden, weight, labels, ignore_index, reduction, grad_hidden, grad_weight):
    return (hidden.new_empty((), dtype=torch.float32),
            hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(0),
            weight.new_empty(weight.shape) if grad_weight else hidden.new_empty(0))


def _lce_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(output[1], output[2])
    ctx.grad_hidden, ctx.grad_weight = inputs[5], inputs[6]


def _lce_backward(ctx, dloss, _ddh, _ddw):
    dh, dw = ctx.saved_tensors
    return (dh * dloss.to(dh.dtype) if ctx.grad_hidden else None,
            dw * dloss.to(dw.dtype) if ctx.grad_weight else None, None, None, None, None, None)


linear_cross_entropy.register_autograd(_lce_backward, setup_context=_lce_setup)


def linear_cross_entropy_workspace(n_rows: int, vocab: int, n_hidden: int, dtype: torch.dtype,
                                   triton: bool, grad_weight: bool) -> int:
    """Device bytes the op allocates beyond its outputs (for passes/memory_plan.py): one
    [chunk, V] logits block (plus its fp32 copy in the torch math) and, over several chunks, the
    fp32 d_weight accumulator (plus a low-precision product off CUDA)."""
    itemsize = dtype.itemsize
    rows = chunk_rows(n_rows, vocab, itemsize, None, DEFAULT_CHUNK_BYTES)
    total = rows * vocab * (itemsize + (0 if triton or dtype == torch.float32 else 4))   # (+ fp32 upcast)
    block = weight_grad_block(n_rows, vocab, n_hidden, itemsize, rows, None, DEFAULT_CHUNK_BYTES) \
        if grad_weight else None
    if block is not None:   # its own pass: an [N, block] logits slice and its fp32 softmax
        total = max(total, n_rows * block * (itemsize + 4))
    elif grad_weight and rows < n_rows:   # several chunks: fp32 accumulator (+ product on the CPU)
        total += vocab * n_hidden * (4 + (itemsize if dtype != torch.float32 and not triton else 0))
    return int(total)


# -- routed expert rows ---------------------------------------------------------------------
@dataclass
class PendingRows:
    """Where a registered expert weight view's rows come from (set by the runtime's pool)."""
    source: torch.Tensor        # the host transfer copy [E, ...]
    index: int                  # flat index of the weight
    pool: object                # what owns the view: record_rows(index, experts, nbytes) counts the copy


#: the attribute of a registered expert weight view (the very tensor object the executor passes
#: to the body) that holds its PendingRows: the pool that owns the view owns this too
PENDING_ROWS = "_megatrain_pending_rows"


def active_experts(offs: torch.Tensor) -> list[int]:
    """Experts owning at least one row, from cumulative row counts (one device-to-host read)."""
    ends = offs.tolist()
    return [e for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)) if end > start]


def fetch_expert_rows(weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Inside a body, an identity on W (the memory plan treats it as an alias) that first copies
    from the host the rows of the experts that received tokens, when W is a registered view
    (runtime/expert_rows.py); an unregistered tensor (a body timed on random inputs by the cost
    model) passes through untouched."""
    pending = getattr(weight, PENDING_ROWS, None)
    if pending is None:
        return weight
    active = active_experts(offs)
    src = pending.source
    cuda = weight.device.type == "cuda"
    for e in active:
        weight[e].copy_(src[e], non_blocking=cuda)  # pinned host rows: asynchronous on CUDA
    pending.pool.record_rows(pending.index, active, len(active) * src[0].numel() * src.element_size())
    return weight


# -- segment-aware attention (issue 17: no seq x seq mask) ------------------------------------
# Causal attention within segments of a row, described by int32 segment ids [b, s] (-1: a token
# nobody attends, e.g. padding) instead of a dense [b, 1, s, s] mask: packed documents are
# segments, padding is -1, a sliding window (`window` > 0) limits each query to the last
# `window` positions. Returns the output [b, h, s, dv] and the log-sum-exp [b, h, s] the backward
# needs (fp32; fp64 for fp64 inputs), as flash attention does; a padding query's output is zero.
# `q_start`: q holds the queries at positions [q_start, q_start + q_len) of each row only (a query
# chunk: passes/tile_attention.py runs a layer's attention one chunk of queries at a time against the
# whole K and V); out and lse then cover those queries, dk and dv all of K and V.
@torch.library.custom_op("megatrain::segment_attention", mutates_args=())
def segment_attention(q: Tensor, k: Tensor, v: Tensor, seg: Tensor, window: int, scale: float,
                      q_start: int = 0) -> tuple[Tensor, Tensor]:
    _needs_kernel()


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype: fp32, fp64 for fp64 inputs (as torch's flash attention keeps it)."""
    return torch.promote_types(dtype, torch.float32)


@segment_attention.register_fake
def _(q, k, v, seg, window, scale, q_start=0):
    # the output has V's head size (MLA's differs from Q's), laid out [b, s, h, dv] in memory:
    # the attention module's transpose back to [b, s, h, dv] is then free
    b, h, s, _ = q.shape
    out = q.new_empty((b, s, h, v.shape[-1])).transpose(1, 2)
    return out, q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("megatrain::segment_attention_backward", mutates_args=())
def segment_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seg: Tensor,
                               window: int, scale: float, q_start: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    _needs_kernel()


@segment_attention_backward.register_fake
def _(dout, q, k, v, out, lse, seg, window, scale, q_start=0):   # (each gradient in its input's layout)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _seg_setup(ctx, inputs, output):
    q, k, v, seg, window, scale, *start = inputs
    ctx.save_for_backward(q, k, v, seg, *output)
    ctx.window, ctx.scale, ctx.q_start = window, scale, start[0] if start else 0


def _seg_backward(ctx, dout, _dlse):
    q, k, v, seg, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.megatrain.segment_attention_backward(dout.contiguous(), q, k, v, out, lse, seg,
                                                                ctx.window, ctx.scale, ctx.q_start)
    return dq, dk, dv, None, None, None, None


segment_attention.register_autograd(_seg_backward, setup_context=_seg_setup)
