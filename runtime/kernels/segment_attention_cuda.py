"""The CUDA kernels of `megatrain::segment_attention` (megacompile/ir_ops.py).

bf16/fp16 (training's dtypes): one variable-length flash attention call for all segments of the
batch. The valid tokens are gathered into one packed [tokens, heads, d] tensor, each segment a
run of it (`cu_seqlens`), padding dropped (it costs no FLOPs):

    seg  = [[-1, 0, 0, 0], [0, 0, 1, 1]]     ->  rows 1..3 | 4, 5 | 6, 7   cu_seqlens = [0, 3, 5, 7]
    out, lse = aten._flash_attention_forward(q[rows], k[rows], v[rows], cu, cu, max_len, max_len,
                                             is_causal, window_size_left = window - 1)

A query chunk (`q_start`: q holds the queries at [q_start, q_start + q_len) only) packs that
chunk's valid queries and, per segment, the keys up to its last query: flash aligns the causal
mask of runs of unequal length at their ends, which is where those queries sit in their run.

Grouped-query K/V go in with their own head count (flash reads them per group). The packing is
read from `seg` on the host once per segment-id tensor (one small device-to-host copy per step:
every layer and the backward reuse it, segment_attention.memoized).

fp32, head sizes over 256, and windows over a row with holes in its attention mask (flash counts
the window in packed tokens, HF in positions) use the tile loop of segment_attention.py with
torch's fused SDPA per tile; its backward recomputes each tile's forward under autograd (a
chunk's tile that sees keys before the chunk then runs under a [queries, keys] prefix mask).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...ir_ops import segment_attention, segment_attention_backward
from .segment_attention import memoized, new_output, padded, tiled_backward, tiled_forward

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _packing(seg: Tensor, start: int, length: int):
    """(q rows [Tq] long, k rows [Tk] long, cu_seqlens of q and of k [n+1] int32, max q run,
    max k run: on seg's device; holes) for the queries at positions [start, start + length) of
    each row: the flat index of each valid query (into the [b, length] chunk) and key (into
    [b, s]) in segment order. A segment's key run is its tokens up to its last query in the
    chunk, so its queries are the last ones of its key run (flash aligns the causal mask of
    unequal runs at their ends). `holes`: some segment has padding between its first and last
    token."""
    host = seg.cpu()
    b, s = host.shape
    flat = host.flatten()
    rows = (flat >= 0).nonzero().flatten()
    pos = rows % s
    ids = flat[rows].long() + torch.div(rows, s, rounding_mode="floor") * (int(flat.max()) + 1 if rows.numel() else 1)
    _, counts = torch.unique_consecutive(ids, return_counts=True)
    ends = counts.cumsum(0)
    holes = bool(((rows[ends - 1] - rows[ends - counts] + 1) != counts).any()) if counts.numel() else False
    in_q = (pos >= start) & (pos < start + length)
    in_k = torch.isin(ids, ids[in_q]) & (pos < start + length)
    q_rows = torch.div(rows[in_q], s, rounding_mode="floor") * length + pos[in_q] - start
    runs = []
    for keep in (in_q, in_k):
        _, n = torch.unique_consecutive(ids[keep], return_counts=True)
        cu = torch.zeros(n.numel() + 1, dtype=torch.int32)
        cu[1:] = n.cumsum(0)
        runs.append((cu.to(seg.device, non_blocking=True), int(n.max()) if n.numel() else 0))
    return (q_rows.to(seg.device, non_blocking=True), rows[in_k].to(seg.device, non_blocking=True), runs[0][0],
            runs[1][0], runs[0][1], runs[1][1], holes)


def _layout(seg: Tensor, start: int = 0, length: int | None = None):
    """_packing(seg, ...), read from the host once per segment-id tensor and query chunk (every
    layer shares it)."""
    length = seg.shape[1] - start if length is None else length
    return memoized(seg, ("packing", start, length), lambda: _packing(seg, start, length))


def _flash_size(q: Tensor, v: Tensor) -> int:
    size = max(q.shape[-1], v.shape[-1])
    return -(-size // 8) * 8   # flash wants head sizes in multiples of 8 (zero columns are exact)


def _use_flash(q: Tensor, v: Tensor, seg: Tensor, window: int) -> bool:
    if q.dtype not in _FLASH_DTYPES or _flash_size(q, v) > 256:
        return False
    return not (window > 0 and _layout(seg)[-1])


def _packed(t: Tensor, rows: Tensor, size: int) -> Tensor:
    """[b, h, s, d] -> [T, h, size]: the valid tokens, head size zero-padded to `size`."""
    b, h, s, d = t.shape
    return padded(t.transpose(1, 2).reshape(b * s, h, d).index_select(0, rows), size=size)[0]


def _scatter(into: Tensor, packed: Tensor, rows: Tensor) -> Tensor:
    """Write packed [T, h, >=d] rows into `into` [b, h, s, d] (any layout); returns `into`."""
    b, h, s, d = into.shape
    view = into.transpose(1, 2)
    if view.is_contiguous():
        view.view(b * s, h, d).index_copy_(0, rows, packed[..., :d].to(into.dtype))
    else:
        full = into.new_zeros((b * s, h, d)).index_copy_(0, rows, packed[..., :d].to(into.dtype))
        into.copy_(full.view(b, s, h, d).transpose(1, 2))
    return into


def _window(window: int) -> tuple[int, int]:
    return (window - 1, 0) if window > 0 else (-1, -1)


def _flash_forward(q, k, v, seg, window, scale, start=0):
    q_rows, k_rows, cu_q, cu_k, max_q, max_k, _ = _layout(seg, start, q.shape[2])
    out = new_output(q, v)
    lse = torch.zeros(q.shape[:-1], dtype=torch.float32, device=q.device)
    if q_rows.numel() == 0:
        return out, lse
    size = _flash_size(q, v)
    left, right = _window(window)
    o, lse_p, *_ = torch.ops.aten._flash_attention_forward(
        _packed(q, q_rows, size), _packed(k, k_rows, size), _packed(v, k_rows, size), cu_q, cu_k, max_q, max_k, 0.0,
        True, False, scale=scale, window_size_left=left, window_size_right=right)
    _scatter(out, o, q_rows)
    b, h, s = lse.shape   # (flash's lse is [h, T])
    full = lse_p.new_zeros((b * s, h), dtype=torch.float32).index_copy_(0, q_rows, lse_p.t().float())
    lse.copy_(full.view(b, s, h).transpose(1, 2))
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, seg, window, scale, start=0):
    q_rows, k_rows, cu_q, cu_k, max_q, max_k, _ = _layout(seg, start, q.shape[2])
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if q_rows.numel() == 0:
        return dq, dk, dv
    size = _flash_size(q, v)
    left, right = _window(window)
    b, h, s = lse.shape
    lse_p = lse.transpose(1, 2).reshape(b * s, h).index_select(0, q_rows).t().contiguous()
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)   # (no dropout: never read)
    unused = torch.empty(0, device=q.device)
    gq, gk, gv = torch.ops.aten._flash_attention_backward(
        _packed(dout, q_rows, size), _packed(q, q_rows, size), _packed(k, k_rows, size), _packed(v, k_rows, size),
        _packed(out, q_rows, size), lse_p, cu_q, cu_k, max_q, max_k, 0.0, True, rng, unused, scale=scale,
        window_size_left=left, window_size_right=right)
    return _scatter(dq, gq, q_rows), _scatter(dk, gk, k_rows), _scatter(dv, gv, k_rows)


def _tile_forward(q, k, v, causal, bias, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal,
                                                                          scale=scale)
    return out, lse   # (lse may be padded past the tile's length; tiled_forward slices it)


def _tile_backward(dout, q, k, v, out, lse, causal, bias, scale):
    # recompute the tile under autograd: the public SDPA's own backward, whatever kernel it picks
    with torch.enable_grad():
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, attn_mask=bias, is_causal=causal,
                                                             scale=scale)
        return torch.autograd.grad(o, (q_, k_, v_), dout)


@segment_attention.register_kernel("cuda")
def _forward(q: Tensor, k: Tensor, v: Tensor, seg: Tensor, window: int, scale: float, q_start: int = 0):
    if _use_flash(q, v, seg, window):
        return _flash_forward(q, k, v, seg, window, scale, q_start)
    return tiled_forward(q, k, v, seg, window, scale, _tile_forward, q_start)


@segment_attention_backward.register_kernel("cuda")
def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seg: Tensor, window: int,
              scale: float, q_start: int = 0):
    if _use_flash(q, v, seg, window):
        return _flash_backward(dout, q, k, v, out, lse, seg, window, scale, q_start)
    # (its tiles recompute under autograd: a tile that sees a prefix runs under a prefix mask)
    return tiled_backward(dout, q, k, v, out, lse, seg, window, scale, _tile_backward, q_start, merge=False)
