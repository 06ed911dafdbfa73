"""Kernels of `megatrain::segment_attention` (megacompile/ir_ops.py) that work tile by tile:
causal attention within the segments of each row, from int32 segment ids, never a [s, s] mask.

    row:  seg = [-1, -1, 0, 0, 0, 1, 1, 1, 1]     (left padding, then two packed documents)
    tiles:      q = k = tokens 2..4  (causal)     q = k = tokens 5..8  (causal)

Each tile is one call of a fused attention kernel on the gathered tokens of one segment
(`is_causal`, its own backward), so memory stays O(tile x d); a windowed segment longer than the
window is cut into query blocks of `window` tokens against their band of keys (a
[window, 2 x window] band mask). Grouped-query attention expands K/V per tile and sums their
gradients back. The CPU kernel is torch's flash attention for the CPU; CUDA's fallback tiles
(segment_attention_cuda.py) use the same loop. The host reads the segment ids once per tensor:
the tiles are memoized on the `seg` tensor itself (every layer, forward and backward, reads the
same prologue tensor), keyed by its version and the window.

Layouts: the output is [b, h, s, dv] viewed from a [b, s, h, dv] buffer (what the attention
module transposes back to, for free); gradients have their inputs' layouts.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ...ir_ops import lse_dtype, segment_attention, segment_attention_backward

Tile = tuple[int, Tensor, Tensor, "Tensor | None", int]


def _tiles(seg: Tensor, window: int, start: int, length: int) -> list[Tile]:
    out = []
    for b, row in enumerate(seg.cpu()):
        valid = (row >= 0).nonzero().flatten()
        if valid.numel() == 0:
            continue
        _, counts = torch.unique_consecutive(row[valid], return_counts=True)
        for toks in valid.split(counts.tolist()):
            q = toks[(toks >= start) & (toks < start + length)]
            if q.numel() == 0:
                continue
            if window <= 0 or int(q[-1] - toks[0]) < window:   # (every query's window reaches the segment's start)
                before = toks[toks < q[0]]
                out.append((b, q - start, torch.cat([before, q]), None, before.numel()))
                continue
            for i in range(0, q.numel(), window):
                qb = q[i:i + window]
                k = toks[(toks > qb[0] - window) & (toks <= qb[-1])]
                out.append((b, qb - start, k, (k[None, :] <= qb[:, None]) & (k[None, :] > qb[:, None] - window), 0))
    return out


def memoized(seg: Tensor, key, build: Callable[[], object]):
    """`build()` cached on the `seg` tensor object under `key` and seg's version (an in-place
    change of the ids rebuilds it); dies with the tensor."""
    cache = getattr(seg, "_megatrain_layouts", None)
    if cache is None or cache[0] != seg._version:
        cache = (seg._version, {})
        seg._megatrain_layouts = cache
    if key not in cache[1]:
        cache[1][key] = build()
    return cache[1][key]


def tiles(seg: Tensor, window: int, start: int = 0, length: int | None = None) -> list[Tile]:
    """(row, query indices within the chunk, key token indices, band mask or None, prefix) over
    each segment's valid tokens (host tensors) for the queries at positions [start, start +
    length) of each row (a query chunk; the whole row by default): causal among them, after
    `prefix` keys every query of the tile sees (the segment's tokens before the chunk); banded
    query blocks where a window cuts it."""
    length = seg.shape[1] - start if length is None else length
    return memoized(seg, ("tiles", window, start, length), lambda: _tiles(seg, window, start, length))


def additive(band: Tensor | None, dtype: torch.dtype, device=None) -> Tensor | None:
    if band is None:
        return None
    return torch.zeros(band.shape, dtype=dtype).masked_fill_(~band, float("-inf")).to(device)


def prefix_band(n_queries: int, prefix: int) -> Tensor:
    """The mask of a tile whose queries see `prefix` keys, then each other causally."""
    causal = torch.ones(n_queries, n_queries, dtype=torch.bool).tril()
    return torch.cat([torch.ones(n_queries, prefix, dtype=torch.bool), causal], 1)


def padded(*tensors: Tensor, size: int) -> list[Tensor]:
    """Zero-padded to head size `size`: fused kernels want one head size for Q, K and V (MLA's V
    differs). Exact: zero columns of Q and K add nothing to the scores (the scale is explicit),
    zero columns of V give zero output columns, dropped afterwards."""
    return [t if t.shape[-1] == size else torch.nn.functional.pad(t, (0, size - t.shape[-1])) for t in tensors]


def expander(q: Tensor, k: Tensor):
    groups = q.shape[1] // k.shape[1]
    return (lambda t: t.repeat_interleave(groups, dim=1)) if groups > 1 else (lambda t: t), groups


def new_output(q: Tensor, v: Tensor) -> Tensor:
    """The op's output buffer: [b, h, s, dv] over [b, s, h, dv] memory (the fake's layout)."""
    b, h, s, _ = q.shape
    return q.new_zeros((b, s, h, v.shape[-1])).transpose(1, 2)


# A tile kernel pair: forward(q, k, v, causal, bias, scale) -> (out, lse) on [1, h, n, d] tiles;
# backward(dout, q, k, v, out, lse, causal, bias, scale) -> (dq, dk, dv). `merge`: the backward
# takes any tile's (out, lse) (flash attention's contract), so a tile whose queries see a prefix
# runs as two calls, the prefix without a mask and the rest causal, their outputs merged by their
# log-sum-exps (no [queries, keys] mask); otherwise it runs as one call under a prefix mask.
def tiled_forward(q: Tensor, k: Tensor, v: Tensor, seg: Tensor, window: int, scale: float, forward, start: int = 0,
                  merge: bool = True):
    dv = v.shape[-1]
    out = new_output(q, v)
    lse = torch.zeros(q.shape[:-1], dtype=lse_dtype(q.dtype), device=q.device)
    expand, _ = expander(q, k)
    qp, kp, vp = padded(q, k, v, size=max(q.shape[-1], dv))
    for b, qi, ki, band, prefix in tiles(seg, window, start, q.shape[2]):
        qi, ki, n = qi.to(q.device), ki.to(q.device), qi.numel()
        qt, kt, vt = qp[b:b + 1, :, qi], expand(kp[b:b + 1, :, ki]), expand(vp[b:b + 1, :, ki])
        if prefix and merge:
            o1, l1 = forward(qt, kt[:, :, :prefix], vt[:, :, :prefix], False, None, scale)
            o2, l2 = forward(qt, kt[:, :, prefix:], vt[:, :, prefix:], True, None, scale)
            l1, l2 = l1[..., :n].to(lse.dtype), l2[..., :n].to(lse.dtype)
            lse_tile = torch.logaddexp(l1, l2)
            o = (o1 * (l1 - lse_tile).exp().unsqueeze(-1) + o2 * (l2 - lse_tile).exp().unsqueeze(-1)).to(q.dtype)
        else:
            band = prefix_band(n, prefix) if prefix else band
            o, lse_tile = forward(qt, kt, vt, band is None, additive(band, q.dtype, q.device), scale)
        out[b:b + 1, :, qi] = o[..., :dv]
        lse[b:b + 1, :, qi] = lse_tile[..., :n].to(lse.dtype)
    return out, lse


def tiled_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seg: Tensor,
                   window: int, scale: float, backward, start: int = 0, merge: bool = True):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    expand, groups = expander(q, k)
    qp, kp, vp, outp, doutp = padded(q, k, v, out, dout, size=max(q.shape[-1], v.shape[-1]))
    for b, qi, ki, band, prefix in tiles(seg, window, start, q.shape[2]):
        qi, ki = qi.to(q.device), ki.to(q.device)
        args = (doutp[b:b + 1, :, qi].contiguous(), qp[b:b + 1, :, qi])
        kt, vt = expand(kp[b:b + 1, :, ki]), expand(vp[b:b + 1, :, ki])
        ot, lt = outp[b:b + 1, :, qi], lse[b:b + 1, :, qi]
        if prefix and merge:
            g1 = backward(*args, kt[:, :, :prefix], vt[:, :, :prefix], ot, lt, False, None, scale)
            g2 = backward(*args, kt[:, :, prefix:], vt[:, :, prefix:], ot, lt, True, None, scale)
            gq, gk, gv = g1[0] + g2[0], torch.cat([g1[1], g2[1]], 2), torch.cat([g1[2], g2[2]], 2)
        else:
            band = prefix_band(qi.numel(), prefix) if prefix else band
            gq, gk, gv = backward(*args, kt, vt, ot, lt, band is None, additive(band, q.dtype, q.device), scale)
        gq, gk, gv = gq[..., :q.shape[-1]], gk[..., :k.shape[-1]], gv[..., :v.shape[-1]]
        if groups > 1:   # (the expanded K/V's gradients summed back per K/V head)
            gk = gk.unflatten(1, (k.shape[1], groups)).sum(2)
            gv = gv.unflatten(1, (k.shape[1], groups)).sum(2)
        dq[b:b + 1, :, qi] += gq
        dk[b:b + 1, :, ki] += gk
        dv[b:b + 1, :, ki] += gv
    return dq, dk, dv


def _cpu_forward(q, k, v, causal, bias, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                      scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, causal, bias, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)


@segment_attention.register_kernel("cpu")
def _forward(q: Tensor, k: Tensor, v: Tensor, seg: Tensor, window: int, scale: float, q_start: int = 0):
    return tiled_forward(q, k, v, seg, window, scale, _cpu_forward, q_start)


@segment_attention_backward.register_kernel("cpu")
def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seg: Tensor, window: int,
              scale: float, q_start: int = 0):
    return tiled_backward(dout, q, k, v, out, lse, seg, window, scale, _cpu_backward, q_start)
