"""Fused SwiGLU activation: out = silu(gate) * up, forward and backward.

This is the elementwise part of the gated MLP (LlamaMLP & co: `act_fn(gate_proj(x)) * up_proj(x)`
with act_fn = SiLU). Math in fp32 inside the kernel, one rounding to the input dtype on store.
With s = sigmoid(gate):
    out   = gate * s * up
    dgate = dout * up * s * (1 + gate * (1 - s))
    dup   = dout * gate * s

Why fused: eager runs silu and mul as two kernels and autograd keeps silu(gate) alive for the
backward (an extra [tokens, intermediate] activation); here the forward is one read of gate/up
and one write, and the backward recomputes the sigmoid from the saved inputs in the same pass
that writes both gradients.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import emulate_rtne, to_dtype

BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(G, U, OUT, n_elements, EMULATE_RTNE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(-tl.abs(g))  # stable sigmoid: exp never overflows
    s = tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    tl.store(OUT + offs, to_dtype(g * s * u, OUT.dtype.element_ty, EMULATE_RTNE), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DO, G, U, DG, DU, n_elements, EMULATE_RTNE: tl.constexpr,
                       BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(-tl.abs(g))  # stable sigmoid: exp never overflows
    s = tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    silu = g * s
    dg = do * u * s * (1.0 + g * (1.0 - s))
    du = do * silu
    tl.store(DG + offs, to_dtype(dg, DG.dtype.element_ty, EMULATE_RTNE), mask=mask)
    tl.store(DU + offs, to_dtype(du, DU.dtype.element_ty, EMULATE_RTNE), mask=mask)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)}/{gate.dtype} and up {tuple(up.shape)}/{up.dtype} "
                         "must have the same shape and dtype")
    gate_c, up_c = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate_c)
    n = gate_c.numel()
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate_c, up_c, out, n, EMULATE_RTNE=emulate_rtne(out.device),
                                                    BLOCK=BLOCK, num_warps=4)
    return out


def swiglu_backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate_c, up_c, dout = gate.contiguous(), up.contiguous(), dout.contiguous()
    dgate, dup = torch.empty_like(gate_c), torch.empty_like(up_c)
    n = gate_c.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](dout, gate_c, up_c, dgate, dup, n,
                                                     EMULATE_RTNE=emulate_rtne(dout.device), BLOCK=BLOCK, num_warps=4)
    return dgate, dup


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        out = swiglu_forward(gate, up)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        return swiglu_backward(dout, gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Fused `silu(gate) * up` (same shape and dtype), differentiable in both inputs."""
    return SwiGLUFunction.apply(gate, up)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain torch, as in LlamaMLP: `act_fn(gate_proj(x)) * up_proj(x)` with act_fn = SiLU."""
    return torch.nn.functional.silu(gate) * up
