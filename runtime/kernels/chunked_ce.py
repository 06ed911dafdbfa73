"""The chunk loop of the fused LM head + cross entropy, without Triton.

    for each chunk of rows:  logits = h_chunk @ W.T          [chunk, V], input dtype
                             chunk_fn(logits, ...)           row losses; logits := dlogits
                             dh_chunk = dlogits @ W;  dW += dlogits.T @ h_chunk   (fp32 accumulator)

or, where the fp32 [V, H] accumulator would outweigh the logits (few tokens: ir_ops.
weight_grad_block decides), the weight's gradient in a pass of its own over vocabulary blocks,
from each row's logsumexp (recovered from the first pass's row loss and label logit):

    for each block of vocabulary rows:  g = softmax(h @ W[block].T - lse) - onehot   [N, block]
                                        dW[block] = g.T @ h                      (one matmul)

`chunk_fn` is the Triton kernel (`linear_cross_entropy.py`) where Triton runs, else
`torch_chunk` below: the same math in torch ops, one [chunk, V] fp32 block at a time. Both
give HF's numerics: logits in the input dtype, upcast to fp32, loss and softmax in fp32, the
gradient rounded back to the logits dtype (what autograd of `logits.float()` does).
Only one [chunk, V] block is alive at a time, so the [N, V] logits never exist.
"""
from __future__ import annotations

from typing import Callable

import torch

# (the sizing the memory plan counts)
from ...ir_ops import DEFAULT_CHUNK_BYTES, block_like_rows, chunk_rows, weight_grad_block

IGNORE_INDEX = -100

ChunkFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], None]


def torch_chunk(logits: torch.Tensor, labels: torch.Tensor, loss_rows: torch.Tensor, scale: torch.Tensor,
                ignore_index: int) -> None:
    """Write each row's loss into `loss_rows` and overwrite `logits` with d(loss)/d(logits)."""
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0).unsqueeze(1)
    # torch's log_softmax, as cross_entropy computes it: each row's loss is bit for bit the value
    # nll_loss reads (logsumexp - logit rounds differently on some CPUs' vector widths)
    log_probs = torch.log_softmax(logits.float(), dim=1)
    loss_rows.copy_(torch.where(valid, -log_probs.gather(1, safe).squeeze(1), 0.0))
    grad = log_probs.exp_()                            # softmax, in place
    grad.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=grad.dtype))
    grad.mul_(torch.where(valid, scale, 0.0).unsqueeze(1))
    logits.copy_(grad)


def _accumulate_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc fp32 and a, b possibly low precision."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if acc.is_cuda:   # cuBLAS writes the low-precision product straight into fp32: no temporary
        try:
            torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, out=acc)
            return
        except (RuntimeError, TypeError):   # older torch: no out_dtype matmul
            pass
    acc.add_(torch.matmul(a, b))


def _weight_grad_in_blocks(h2: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                           row_scale: torch.Tensor, block: int) -> torch.Tensor:
    """d loss/d weight [V, H] one block of vocabulary rows at a time: the logits slice
    recomputed in the input dtype, its fp32 softmax from the row's logsumexp, minus the one-hot
    label, times the row's scale, rounded to the input dtype (as autograd of `logits.float()`),
    then one matmul per block (as eager's single matmul, no accumulation across blocks)."""
    vocab = weight.shape[0]
    grad_weight = torch.empty_like(weight)
    rows = torch.arange(h2.shape[0], device=h2.device)
    for v0 in range(0, vocab, block):
        v1 = min(v0 + block, vocab)
        logits = torch.matmul(h2, weight[v0:v1].t())            # [N, block], input dtype
        g = logits.float().sub_(lse.unsqueeze(1)).exp_()       # softmax slice, fp32
        hit = (labels >= v0) & (labels < v1)
        g[rows[hit], labels[hit] - v0] -= 1.0
        g.mul_(row_scale.unsqueeze(1))
        logits.copy_(g)                                          # rounded to the logits dtype
        del g
        torch.matmul(logits.t(), h2, out=grad_weight[v0:v1])
    return grad_weight


def loss_and_grads(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str,
                   ignore_index: int, need_hidden: bool, need_weight: bool, chunk_fn: ChunkFn,
                   chunk_size: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                   weight_pass: str = "auto"):
    """(loss, d loss/d hidden or None, d loss/d weight or None) of
    `cross_entropy((hidden @ weight.T).float(), labels, reduction)`; hidden [..., H], weight [V, H].
    `weight_pass`: "auto" (ir_ops.weight_grad_block decides), "accumulate" or "blocks" (tests)."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    n_hidden = hidden.shape[-1]
    vocab = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != n_hidden:
        raise ValueError(f"weight must be [V, {n_hidden}], got {tuple(weight.shape)}")
    h2 = hidden.reshape(-1, n_hidden).contiguous()
    n_rows = h2.shape[0]
    labels = labels.reshape(-1).to(device=h2.device, dtype=torch.int64).contiguous()
    if labels.shape[0] != n_rows:
        raise ValueError(f"{labels.shape[0]} labels for {n_rows} hidden rows")

    n_valid = (labels != ignore_index).sum().to(torch.float32)
    scale = torch.ones((), dtype=torch.float32, device=h2.device) if reduction == "sum" else 1.0 / n_valid
    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=h2.device)
    grad_hidden = torch.empty_like(h2) if need_hidden else None
    rows = chunk_rows(n_rows, vocab, h2.element_size(), chunk_size, chunk_bytes)
    # one chunk: d_weight is one matmul in the weight's dtype, as eager computes it; several: an
    # fp32 accumulator, so the chunking adds no rounding, or a pass over vocabulary blocks
    single = rows >= n_rows
    block = weight_grad_block(n_rows, vocab, n_hidden, h2.element_size(), rows, chunk_size, chunk_bytes)
    if weight_pass != "auto" and not single:
        block = None if weight_pass == "accumulate" else (block or block_like_rows(rows, vocab, n_rows))
    in_blocks = need_weight and block is not None
    grad_weight = None
    if need_weight and not single and not in_blocks:
        grad_weight = torch.zeros((vocab, n_hidden), dtype=torch.float32, device=h2.device)
    label_logits = torch.zeros(n_rows, dtype=torch.float32, device=h2.device) if in_blocks else None
    safe = torch.where(labels != ignore_index, labels, 0)
    w_t = weight.t()
    for start in range(0, n_rows, rows):
        end = min(start + rows, n_rows)
        h_chunk = h2[start:end]
        logits = torch.matmul(h_chunk, w_t)   # [chunk, V], overwritten with its gradient
        if in_blocks:   # (the label's logit, before it is overwritten: lse = row loss + label logit)
            label_logits[start:end] = logits.gather(1, safe[start:end].unsqueeze(1)).squeeze(1).float()
        chunk_fn(logits, labels[start:end], loss_rows[start:end], scale, ignore_index)
        if need_hidden:
            torch.matmul(logits, weight, out=grad_hidden[start:end])
        if need_weight and not in_blocks:
            if single:
                grad_weight = torch.matmul(logits.t(), h_chunk)
            else:
                _accumulate_fp32(grad_weight, logits.t(), h_chunk)
        del logits
    if in_blocks:
        valid = labels != ignore_index
        row_scale = torch.where(valid, scale, 0.0).to(torch.float32)
        lse = torch.where(valid, loss_rows + label_logits, float("inf"))   # (an ignored row's softmax: 0)
        grad_weight = _weight_grad_in_blocks(h2, weight, torch.where(valid, labels, -1), lse, row_scale, block)

    # reduced by nll_loss over the row losses: its summation order and division are cross_entropy's
    # (a plain .sum() / n_valid differs from it by an ulp where the vector width changes the order)
    targets = torch.where(labels != ignore_index, 0, ignore_index)
    loss = torch.nn.functional.nll_loss(-loss_rows.unsqueeze(1), targets, reduction=reduction,
                                        ignore_index=ignore_index)
    if grad_hidden is not None:
        grad_hidden = grad_hidden.reshape(hidden.shape)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return loss, grad_hidden, grad_weight
