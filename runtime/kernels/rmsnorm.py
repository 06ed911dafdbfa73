"""Fused RMSNorm: y = w' * x / sqrt(mean(x^2) + eps), forward and backward in one kernel each.

Computes, row-wise over the last dimension, in fp32 whatever the input dtype:
    rstd = rsqrt(mean(x.float()^2) + eps),  xhat = x.float() * rstd,  w' = weight + offset
and then one of the two HuggingFace cast orders:
  - Llama (`cast_before_weight=True`, default when offset == 0, transformers' LlamaRMSNorm):
        y = w' * xhat.to(x.dtype)          (dtype: promote(weight.dtype, x.dtype))
  - Gemma (`cast_before_weight=False`, default when offset != 0, Gemma3RMSNorm with offset=1):
        y = (xhat * w'.float()).to(x.dtype)

Why fused: eager PyTorch runs ~6 elementwise/reduction kernels, each a full pass over the
activation in global memory, and autograd saves the fp32 upcast; here the forward is one pass
(saving only x and the per-row rstd, N floats) and the backward is one pass that produces dx and
per-program partial sums of dweight (a two-stage, atomics-free reduction: the partials
[programs, H] are summed by torch, so the result is deterministic).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import add, emulate_rtne, to_dtype

MAX_FUSED_HIDDEN = 65536


@triton.jit
def _rmsnorm_fwd_kernel(X, W, Y, RSTD, n_rows, n_cols, stride_x, stride_y, eps, offset,
                        CAST_BEFORE_WEIGHT: tl.constexpr, EMULATE_RTNE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)

    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.reduce(x * x, 1, add) / n_cols + eps)
    xhat = x * rstd[:, None]
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    if CAST_BEFORE_WEIGHT:
        # Llama: round the normalised activations to the input dtype, then scale
        xhat = to_dtype(xhat, X.dtype.element_ty, EMULATE_RTNE).to(tl.float32)
    y = xhat * w[None, :]
    y = to_dtype(y, Y.dtype.element_ty, EMULATE_RTNE)
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y, mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _rmsnorm_bwd_kernel(DY, X, W, RSTD, DX, DW_PARTIAL, n_rows, n_cols, stride_dy, stride_x,
                        stride_dx, offset, rows_per_program,
                        CAST_BEFORE_WEIGHT: tl.constexpr, EMULATE_RTNE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw_acc = tl.full([BLOCK_N], 0.0, tl.float32)
    first_row = pid * rows_per_program
    # rows_per_program is a multiple of BLOCK_M, so programs own disjoint row ranges
    for start in range(0, rows_per_program, BLOCK_M):
        rows = first_row + start + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        xhat = x * rstd[:, None]
        if CAST_BEFORE_WEIGHT:
            xhat_rounded = to_dtype(xhat, X.dtype.element_ty, EMULATE_RTNE).to(tl.float32)
            dw_acc += tl.reduce(dy * xhat_rounded, 0, add)
        else:
            dw_acc += tl.reduce(dy * xhat, 0, add)
        # d xhat = dy * w';  dx = rstd * (dxhat - xhat * mean(dxhat * xhat))
        dxhat = dy * w[None, :]
        proj = tl.reduce(dxhat * xhat, 1, add) / n_cols
        dx = rstd[:, None] * (dxhat - xhat * proj[:, None])
        dx = to_dtype(dx, DX.dtype.element_ty, EMULATE_RTNE)
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx, mask=mask)
    tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=col_mask)


def _blocks(n_cols: int) -> tuple[int, int, int]:
    if n_cols > MAX_FUSED_HIDDEN:
        raise ValueError(f"rmsnorm kernel supports a last dimension up to {MAX_FUSED_HIDDEN}, "
                         f"got {n_cols}")
    block_n = triton.next_power_of_2(n_cols)
    block_m = max(1, min(16, 4096 // block_n))
    num_warps = max(1, min(16, block_m * block_n // 512))
    return block_m, block_n, num_warps


def _num_programs(device: torch.device, row_blocks: int) -> int:
    if device.type == "cuda":
        cap = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:  # Triton interpreter: programs run serially, fewer is faster (and with 2, small tests
        cap = 2  # already give a program several row blocks to loop over)
    return max(1, min(row_blocks, cap))


def rmsnorm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                    cast_before_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): the normalised output and the per-row fp32 rstd the backward needs."""
    shape = x.shape
    n_cols = shape[-1]
    if weight.shape != (n_cols,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match last dim {n_cols}")
    x2 = x.reshape(-1, n_cols).contiguous()
    weight = weight.contiguous()
    n_rows = x2.shape[0]
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if cast_before_weight else x.dtype
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block_m, block_n, num_warps = _blocks(n_cols)
    if n_rows > 0:
        _rmsnorm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
            x2, weight, y, rstd, n_rows, n_cols, x2.stride(0), y.stride(0), float(eps),
            float(offset), CAST_BEFORE_WEIGHT=bool(cast_before_weight),
            EMULATE_RTNE=emulate_rtne(x.device), BLOCK_M=block_m,
            BLOCK_N=block_n, num_warps=num_warps)
    return y.reshape(shape), rstd.reshape(shape[:-1])


def rmsnorm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float,
                     cast_before_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) from the output gradient, the input, the weight and the forward's rstd."""
    shape = x.shape
    n_cols = shape[-1]
    x2 = x.reshape(-1, n_cols).contiguous()
    rstd = rstd.reshape(-1).contiguous()
    weight = weight.contiguous()
    n_rows = x2.shape[0]
    dy2 = dy.reshape(-1, n_cols).contiguous()
    dx = torch.empty_like(x2)
    block_m, block_n, num_warps = _blocks(n_cols)
    row_blocks = triton.cdiv(n_rows, block_m)
    programs = _num_programs(x2.device, row_blocks)
    rows_per_program = triton.cdiv(row_blocks, programs) * block_m
    programs = triton.cdiv(n_rows, rows_per_program) if n_rows else 0
    partial = torch.zeros((max(programs, 1), n_cols), dtype=torch.float32, device=x2.device)
    if programs:
        _rmsnorm_bwd_kernel[(programs,)](
            dy2, x2, weight, rstd, dx, partial, n_rows, n_cols, dy2.stride(0), x2.stride(0),
            dx.stride(0), float(offset), rows_per_program,
            CAST_BEFORE_WEIGHT=bool(cast_before_weight),
            EMULATE_RTNE=emulate_rtne(x2.device), BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps)
    return dx.reshape(shape), partial.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, cast_before_weight):
        y, rstd = rmsnorm_forward(x, weight, eps, offset, cast_before_weight)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = float(offset)
        ctx.cast_before_weight = bool(cast_before_weight)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = rmsnorm_backward(dy, x, weight, rstd, ctx.offset, ctx.cast_before_weight)
        return dx, dweight, None, None, None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0,
            cast_before_weight: bool | None = None) -> torch.Tensor:
    """Fused RMSNorm over the last dim. `offset=1.0` gives Gemma's `(1 + weight)`;
    `cast_before_weight` defaults to the Llama order when offset == 0, the Gemma order otherwise."""
    if cast_before_weight is None:
        cast_before_weight = offset == 0.0
    return RMSNormFunction.apply(x, weight, eps, offset, cast_before_weight)


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0,
                      cast_before_weight: bool | None = None) -> torch.Tensor:
    """Plain torch, exactly LlamaRMSNorm.forward (cast_before_weight) or Gemma3RMSNorm.forward."""
    if cast_before_weight is None:
        cast_before_weight = offset == 0.0
    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if cast_before_weight:
        w = weight + offset if offset != 0.0 else weight
        return w * h.to(input_dtype)
    return (h * (offset + weight.float())).to(input_dtype)
