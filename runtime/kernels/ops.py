"""The kernels as torch custom ops (`torch.ops.megatrain.*`), so compiled graphs can hold them.

    megatrain::rms_norm(x, weight, eps, offset, cast_before_weight) -> (y, rstd)
    megatrain::rms_norm_backward(dy, x, weight, rstd, offset, cast_before_weight) -> (dx, dweight)
    megatrain::swiglu(gate, up) -> out
    megatrain::swiglu_backward(dout, gate, up) -> (dgate, dup)

AOTAutograd traces a custom op as one node (shapes from its fake implementation, which like the kernels returns contiguous tensors) and its
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
