"""The CPU kernel of `megatrain::segment_attention` (megacompile/ir_ops.py): causal attention
within the segments of each row, from int32 segment ids, never a [s, s] mask.

    row:  seg = [-1, -1, 0, 0, 0, 1, 1, 1, 1]     (left padding, then two packed documents)
    tiles:      q = k = tokens 2..4  (causal)     q = k = tokens 5..8  (causal)

Each tile is one call of torch's flash attention for the CPU (`is_causal`, its own backward)
on the gathered tokens of one segment, so memory stays O(tile x d); a windowed segment longer
than the window is cut into query blocks of `window` tokens against their band of keys (a
[window, 2 x window] band mask). Grouped-query attention expands K/V per tile and sums their
gradients back. The segment boundaries are read on the host once per call (one [b, s] copy).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...ir_ops import lse_dtype, segment_attention, segment_attention_backward


def tiles(seg: Tensor, window: int):
    """(row, query token indices, key token indices, band mask or None) over each segment's
    valid tokens; causal among them; banded query blocks where a window cuts the segment."""
    for b, row in enumerate(seg.cpu()):
        valid = (row >= 0).nonzero().flatten()
        if valid.numel() == 0:
            continue
        _, counts = torch.unique_consecutive(row[valid], return_counts=True)
        for toks in valid.split(counts.tolist()):
            if window <= 0 or int(toks[-1] - toks[0]) < window:
                yield b, toks, toks, None
                continue
            for start in range(0, toks.numel(), window):
                q = toks[start:start + window]
                k = toks[(toks > q[0] - window) & (toks <= q[-1])]
                yield b, q, k, (k[None, :] <= q[:, None]) & (k[None, :] > q[:, None] - window)


def _additive(band: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if band is None else torch.zeros(band.shape, dtype=dtype).masked_fill_(~band, float("-inf"))


def _padded(*tensors: Tensor, size: int) -> list[Tensor]:
    """Zero-padded to head size `size`: torch's CPU flash attention wants one head size for Q, K
    and V (MLA's V differs). Exact: zero columns of Q and K add nothing to the scores (the scale
    is explicit), zero columns of V give zero output columns, dropped afterwards."""
    return [t if t.shape[-1] == size else torch.nn.functional.pad(t, (0, size - t.shape[-1])) for t in tensors]


def _expand(q: Tensor, k: Tensor):
    groups = q.shape[1] // k.shape[1]
    return (lambda t: t.repeat_interleave(groups, dim=1)) if groups > 1 else (lambda t: t), groups


@segment_attention.register_kernel("cpu")
def _forward(q: Tensor, k: Tensor, v: Tensor, seg: Tensor, window: int, scale: float):
    dv = v.shape[-1]
    out = q.new_zeros((*q.shape[:-1], dv))
    lse = torch.zeros(q.shape[:-1], dtype=lse_dtype(q.dtype))
    expand, _ = _expand(q, k)
    qp, kp, vp = _padded(q, k, v, size=max(q.shape[-1], dv))
    for b, qi, ki, band in tiles(seg, window):
        o, lse_tile = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qp[b:b + 1, :, qi], expand(kp[b:b + 1, :, ki]), expand(vp[b:b + 1, :, ki]), 0.0, band is None,
            attn_mask=_additive(band, q.dtype), scale=scale)
        out[b:b + 1, :, qi] = o[..., :dv]
        lse[b:b + 1, :, qi] = lse_tile
    return out, lse


@segment_attention_backward.register_kernel("cpu")
def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seg: Tensor, window: int,
              scale: float):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    expand, groups = _expand(q, k)
    size = max(q.shape[-1], v.shape[-1])
    qp, kp, vp, outp, doutp = _padded(q, k, v, out, dout, size=size)
    for b, qi, ki, band in tiles(seg, window):
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            doutp[b:b + 1, :, qi].contiguous(), qp[b:b + 1, :, qi], expand(kp[b:b + 1, :, ki]),
            expand(vp[b:b + 1, :, ki]), outp[b:b + 1, :, qi], lse[b:b + 1, :, qi], 0.0, band is None,
            attn_mask=_additive(band, q.dtype), scale=scale)
        gq, gk, gv = gq[..., :q.shape[-1]], gk[..., :k.shape[-1]], gv[..., :v.shape[-1]]
        if groups > 1:   # (the expanded K/V's gradients summed back per K/V head)
            gk = gk.unflatten(1, (k.shape[1], groups)).sum(2)
            gv = gv.unflatten(1, (k.shape[1], groups)).sum(2)
        dq[b:b + 1, :, qi] += gq
        dk[b:b + 1, :, ki] += gk
        dv[b:b + 1, :, ki] += gv
    return dq, dk, dv
