"""The kernels as torch custom ops (`torch.ops.megatrain.*`), so compiled graphs can hold them.

    megatrain::rms_norm(x, weight, eps, offset, cast_before_weight) -> (y, rstd)
    megatrain::rms_norm_backward(dy, x, weight, rstd, offset, cast_before_weight) -> (dx, dweight)
    megatrain::swiglu(gate, up) -> out
    megatrain::swiglu_backward(dout, gate, up) -> (dgate, dup)
    megatrain::linear_cross_entropy(hidden, weight, labels, ignore_index, reduction,
                                    grad_hidden, grad_weight) -> (loss, dhidden, dweight)

AOTAutograd traces a custom op as one node (shapes from its fake implementation, which like the
kernels returns contiguous tensors) and its
registered backward as the backward op's node, so megatrain's passes place both in layer
bodies like any aten op, and the min-cut partitioner saves `rstd` (one float per row) rather
than the fp32 upcast eager autograd keeps. Each op runs the Triton kernel on CUDA tensors (and
on CPU tensors under TRITON_INTERPRET=1, for tests); otherwise the same math in torch ops
(`passes/fused_kernels.py` only inserts these ops where the kernels will run, but a graph that
holds them stays runnable anywhere).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor


def triton_runs(t: Tensor) -> bool:
    """Whether the Triton kernels run for a tensor: on CUDA, or on the CPU under the interpreter."""
    if not (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# -- RMSNorm --------------------------------------------------------------------------------
@torch.library.custom_op("megatrain::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float, cast_before_weight: bool) -> tuple[Tensor, Tensor]:
    if triton_runs(x):
        from .rmsnorm import rmsnorm_forward
        return rmsnorm_forward(x, weight, eps, offset, cast_before_weight)
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1) + eps)
    xhat = h * rstd.unsqueeze(-1)
    if cast_before_weight:
        y = (weight + offset if offset else weight) * xhat.to(x.dtype)
    else:
        y = (xhat * (offset + weight.float())).to(x.dtype)
    return y.contiguous(), rstd.contiguous()


@rms_norm.register_fake
def _(x, weight, eps, offset, cast_before_weight):
    dtype = torch.promote_types(x.dtype, weight.dtype) if cast_before_weight else x.dtype
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("megatrain::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, offset: float,
                      cast_before_weight: bool) -> tuple[Tensor, Tensor]:
    if triton_runs(x):
        from .rmsnorm import rmsnorm_backward
        return rmsnorm_backward(dy, x, weight, rstd, offset, cast_before_weight)
    g = dy.float()
    xhat = x.float() * rstd.unsqueeze(-1)
    scaled = xhat.to(x.dtype).float() if cast_before_weight else xhat
    dweight = (g * scaled).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    dxhat = g * (weight.float() + offset)
    dx = rstd.unsqueeze(-1) * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype).contiguous(), dweight


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
    if triton_runs(gate):
        from .swiglu import swiglu_forward
        return swiglu_forward(gate, up)
    return torch.nn.functional.silu(gate.float()).mul(up.float()).to(gate.dtype).contiguous()


@swiglu.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("megatrain::swiglu_backward", mutates_args=())
def swiglu_backward(dout: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    if triton_runs(gate):
        from .swiglu import swiglu_backward as kernel
        return kernel(dout, gate, up)
    g, u, d = gate.float(), up.float(), dout.float()
    s = torch.sigmoid(g)
    return (d * u * s * (1 + g * (1 - s))).to(gate.dtype).contiguous(), (d * g * s).to(up.dtype).contiguous()


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
# One op computes the loss AND its gradients ("gradient in the forward", chunked_ce.py): the
# gradients are extra outputs that only the backward reads (scaled by the loss's incoming
# gradient), so AOTAutograd saves them instead of the [N, V] logits. A gradient that is not
# wanted is an empty tensor.
@torch.library.custom_op("megatrain::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, reduction: str,
                         grad_hidden: bool, grad_weight: bool) -> tuple[Tensor, Tensor, Tensor]:
    from .chunked_ce import loss_and_grads, torch_chunk
    chunk_fn = torch_chunk
    if triton_runs(hidden):
        from .linear_cross_entropy import _loss_and_grad_chunk as chunk_fn
    loss, dh, dw = loss_and_grads(hidden, weight, labels, reduction, ignore_index, grad_hidden, grad_weight,
                                  chunk_fn)
    # (one empty tensor each: outputs of a custom op may not alias each other, which a no-grad
    # call, wanting neither gradient, would otherwise make them)
    return (loss, dh.contiguous() if dh is not None else hidden.new_empty(0),
            dw if dw is not None else hidden.new_empty(0))


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
    from .chunked_ce import DEFAULT_CHUNK_BYTES, chunk_rows
    itemsize = dtype.itemsize
    rows = chunk_rows(n_rows, vocab, itemsize, None, DEFAULT_CHUNK_BYTES)
    total = rows * vocab * (itemsize + (0 if triton or dtype == torch.float32 else 4))   # (+ fp32 upcast)
    if grad_weight and rows < n_rows:   # several chunks: fp32 accumulator (+ product on the CPU)
        total += vocab * n_hidden * (4 + (itemsize if dtype != torch.float32 and not triton else 0))
    return int(total)
