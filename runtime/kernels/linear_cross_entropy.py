"""Chunked fused LM head + cross entropy: loss = CE(hidden @ weight.T, labels), never
materialising the [N, V] logits.

Computes the same value as `F.cross_entropy((hidden @ weight.T).float(), labels,
ignore_index=-100, reduction=...)`, i.e. HuggingFace's `lm_head` followed by its causal-LM loss
(which upcasts the logits to fp32), with `reduction` "sum" or "mean" (mean over non-ignored
tokens; all tokens ignored gives nan, like torch; for HF's `num_items_in_batch` normalisation use
"sum" and divide). Labels are already aligned with `hidden` (the
caller does the causal shift); valid labels must lie in [0, V).

Why fused: for a 128k vocabulary the fp32 logits, their softmax and their gradient are each
N * 128k * 4 bytes, the largest activation of the whole model. Here rows are processed in chunks
of `chunk_size` rows (by default as many as fit `chunk_bytes` of logits), so only one
[chunk, V] logits buffer exists at a time.

"Gradient in the forward": for each chunk
  1. logits = hidden_chunk @ weight.T                    (torch matmul, input dtype)
  2. one Triton kernel, per row: online (streaming) max / sum-exp over V in blocks gives the
     logsumexp and the row loss lse - logit[label]; a second sweep over the same row overwrites
     the logits IN PLACE with the gradient (softmax - onehot(label)) * scale, where scale is 1
     ("sum") or 1 / n_valid ("mean"), and 0 for ignored rows;
  3. d_hidden_chunk = dlogits @ weight, and d_weight += dlogits.T @ hidden_chunk (fp32
     accumulator).
The loss is a scalar, so the true gradients are these times grad_output: the backward only
scales the stored d_hidden / d_weight, with no second pass over the vocabulary and no recompute
of the matmul. Gradients are skipped for inputs that do not require them (and entirely under
no_grad). Costs: d_hidden [N, H] and d_weight [V, H] (fp32 while accumulating) live from the
forward to the backward, which is what the loss's backward would allocate anyway.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import add, emulate_rtne, maximum, to_dtype
from .chunked_ce import DEFAULT_CHUNK_BYTES, IGNORE_INDEX, loss_and_grads

# Vocabulary block off-GPU (Triton interpreter): small, so that tests with a few hundred classes
# already run the multi-block online logsumexp.
INTERPRETER_BLOCK_V = 128


@triton.jit
def _ce_loss_grad_kernel(LOGITS, LABELS, LOSS, SCALE, n_rows, n_cols, stride_logits, ignore_index,
                         EMULATE_RTNE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    labels = tl.load(LABELS + rows, mask=row_mask, other=ignore_index)
    valid = row_mask & (labels != ignore_index)
    row_ptr = LOGITS + rows.to(tl.int64)[:, None] * stride_logits

    # sweep 1: online logsumexp over the vocabulary
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s = tl.full([BLOCK_M], 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        col_mask = cols < n_cols
        x = tl.load(row_ptr + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        x = tl.where(col_mask[None, :], x.to(tl.float32), float("-inf"))
        m_new = tl.maximum(m, tl.reduce(x, 1, maximum))
        s = s * tl.exp(m - m_new) + tl.reduce(tl.exp(x - m_new[:, None]), 1, add)
        m = m_new
    lse = m + tl.log(s)

    safe_labels = tl.where(valid, labels, 0)
    x_label = tl.load(row_ptr + safe_labels[:, None], mask=valid[:, None], other=0.0).to(tl.float32)
    x_label = tl.reduce(x_label, 1, add)
    tl.store(LOSS + rows, tl.where(valid, lse - x_label, 0.0), mask=row_mask)

    # sweep 2: overwrite the logits with d loss / d logits
    scale = tl.load(SCALE)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(row_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse[:, None])
        g = p - tl.where(cols[None, :] == labels[:, None], 1.0, 0.0)
        g = tl.where(valid[:, None], g * scale, 0.0)
        g = to_dtype(g, LOGITS.dtype.element_ty, EMULATE_RTNE)
        tl.store(row_ptr + cols[None, :], g, mask=mask)


def _kernel_config(device: torch.device, n_cols: int) -> tuple[int, int, int]:
    block_v = triton.next_power_of_2(n_cols)
    block_v = min(block_v, 4096 if device.type == "cuda" else INTERPRETER_BLOCK_V)
    # GPU: one row per program (the vocabulary loop is the parallel work); interpreter: a few
    # rows per program, since programs run serially in Python there.
    block_m = 1 if device.type == "cuda" else 8
    num_warps = 8 if block_v >= 2048 else 4
    return block_m, block_v, num_warps


def loss_and_grad_chunk(logits: torch.Tensor, labels: torch.Tensor, loss_rows: torch.Tensor,
                         scale: torch.Tensor, ignore_index: int) -> None:
    """The Triton `chunk_fn` of chunked_ce.loss_and_grads."""
    n_rows, n_cols = logits.shape
    block_m, block_v, num_warps = _kernel_config(logits.device, n_cols)
    _ce_loss_grad_kernel[(triton.cdiv(n_rows, block_m),)](
        logits, labels, loss_rows, scale, n_rows, n_cols, logits.stride(0), ignore_index,
        EMULATE_RTNE=emulate_rtne(logits.device), BLOCK_M=block_m, BLOCK_V=block_v,
        num_warps=num_warps)


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, reduction, chunk_size, chunk_bytes, ignore_index,
                compute_grads):
        loss, grad_hidden, grad_weight = loss_and_grads(
            hidden, weight, labels, reduction, ignore_index, compute_grads and ctx.needs_input_grad[0],
            compute_grads and ctx.needs_input_grad[1], loss_and_grad_chunk, chunk_size, chunk_bytes)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        dh = dw = None
        if ctx.needs_input_grad[0]:
            dh = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if ctx.needs_input_grad[1]:
            dw = grad_weight * grad_loss.to(grad_weight.dtype)
        return dh, dw, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         reduction: str = "mean", chunk_size: int | None = None,
                         chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Fused `cross_entropy(hidden @ weight.T, labels)` for hidden [..., H], weight [V, H], labels
    [...] (int, `ignore_index` = ignored); fp32 scalar. `chunk_size` rows per logits chunk, or
    (None) as many rows as fit `chunk_bytes`."""
    compute_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return LinearCrossEntropyFunction.apply(hidden, weight, labels, reduction, chunk_size,
                                            chunk_bytes, ignore_index, compute_grads)


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   reduction: str = "mean",
                                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Plain torch, as HF's lm_head + ForCausalLMLoss: logits in the input dtype, upcast to fp32,
    then cross entropy (materialises [N, V])."""
    logits = torch.matmul(hidden.reshape(-1, hidden.shape[-1]), weight.t()).float()
    return torch.nn.functional.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index,
                                             reduction=reduction)
