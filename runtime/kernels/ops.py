"""The kernels of megatrain's custom ops (defined in the IR layer, megacompile/ir_ops.py), for
the CPU and CUDA: the Triton kernel on CUDA tensors (and on CPU tensors under TRITON_INTERPRET=1,
for tests), otherwise the same math in torch ops (`passes/fused_kernels.py` only inserts these
ops where the kernels will run, but a graph that holds them stays runnable anywhere). Imported by
the backend, which is what registers them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...ir_ops import linear_cross_entropy, rms_norm, rms_norm_backward, swiglu, swiglu_backward, triton_runs
from . import segment_attention, segment_attention_cuda  # noqa: F401  (their kernels)

DEVICES = ("cpu", "cuda")


@rms_norm.register_kernel(DEVICES)
def _rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float, cast_before_weight: bool):
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


@rms_norm_backward.register_kernel(DEVICES)
def _rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, offset: float, cast_before_weight: bool):
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


@swiglu.register_kernel(DEVICES)
def _swiglu(gate: Tensor, up: Tensor):
    if triton_runs(gate):
        from .swiglu import swiglu_forward
        return swiglu_forward(gate, up)
    return torch.nn.functional.silu(gate.float()).mul(up.float()).to(gate.dtype).contiguous()


@swiglu_backward.register_kernel(DEVICES)
def _swiglu_backward(dout: Tensor, gate: Tensor, up: Tensor):
    if triton_runs(gate):
        from .swiglu import swiglu_backward as kernel
        return kernel(dout, gate, up)
    g, u, d = gate.float(), up.float(), dout.float()
    s = torch.sigmoid(g)
    return (d * u * s * (1 + g * (1 - s))).to(gate.dtype).contiguous(), (d * g * s).to(up.dtype).contiguous()


@linear_cross_entropy.register_kernel(DEVICES)
def _linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, reduction: str,
                          grad_hidden: bool, grad_weight: bool):
    from .chunked_ce import loss_and_grads, torch_chunk
    chunk_fn = torch_chunk
    if triton_runs(hidden):
        from .linear_cross_entropy import loss_and_grad_chunk as chunk_fn
    loss, dh, dw = loss_and_grads(hidden, weight, labels, reduction, ignore_index, grad_hidden, grad_weight,
                                  chunk_fn)
    # (one empty tensor each: outputs of a custom op may not alias each other, which a no-grad
    # call, wanting neither gradient, would otherwise make them)
    return (loss, dh.contiguous() if dh is not None else hidden.new_empty(0),
            dw if dw is not None else hidden.new_empty(0))
