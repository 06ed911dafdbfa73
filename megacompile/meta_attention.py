"""Flash-style attention for models traced on the meta device (`inspect`, `plan`).

On the meta device `F.scaled_dot_product_attention` decomposes into math attention, which
materialises batch x heads x seq x seq scores: at seq 4096 that is gigabytes per sample that no
real run allocates (CUDA and CPU SDPA kernels are fused and blocked). Models built for
estimation use this attention instead: one opaque op per direction whose outputs are what a
fused kernel produces (the output and a float32 logsumexp per query), so the memory plan and
the cost model see a fused kernel. On real CPU tensors they run the CPU's fused attention
kernels, which is how the measured `cpu` profile times bodies.

    out, lse = megatrain::attention_estimate(q, k, v, mask, is_causal)
    dq, dk, dv = megatrain::attention_estimate_backward(grad_out, q, k, v, out, lse, mask, is_causal)
"""
from __future__ import annotations

import torch

NAME = "megatrain_estimate"


def _float_mask(mask, q):
    if mask is not None and mask.dtype == torch.bool:  # the CPU kernel takes an additive mask
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
    return mask


def _expand_kv(q, k, v):
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    return k, v


@torch.library.custom_op("megatrain::attention_estimate", mutates_args=())
def attention_estimate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # timing stand-in on real CPU tensors (see the module docstring): the CPU fused kernel
    k, v = _expand_kv(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal,
                                                                          attn_mask=_float_mask(mask, q))
    return out.contiguous(), lse.float().contiguous()   # the layouts the fake promises


@attention_estimate.register_fake
def _(q, k, v, mask, is_causal):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return out, lse


@torch.library.custom_op("megatrain::attention_estimate_backward", mutates_args=())
def attention_estimate_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None,
                                is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # timing stand-in on real CPU tensors: the CPU fused backward kernel (gradients of grouped
    # k/v heads are summed, as a grouped-query kernel does)
    ke, ve = _expand_kv(q, k, v)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, ke, ve, out, lse, 0.0, is_causal, attn_mask=_float_mask(mask, q))
    if dk.shape != k.shape:
        dk = dk.unflatten(-3, (k.shape[-3], -1)).sum(-3)
        dv = dv.unflatten(-3, (v.shape[-3], -1)).sum(-3)
    return tuple(torch.empty_like(ref).copy_(g) for ref, g in ((q, dq), (k, dk), (v, dv)))


@attention_estimate_backward.register_fake
def _(grad, q, k, v, out, lse, mask, is_causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, mask, is_causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mask, ctx.is_causal = mask, is_causal


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_estimate_backward(grad_out, q, k, v, out, lse, ctx.mask, ctx.is_causal)
    return dq, dk, dv, None, None


attention_estimate.register_autograd(_backward, setup_context=_setup)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """A transformers attention function (q, k, v: batch x heads x seq x dim; k/v may have fewer
    heads, as grouped-query kernels read them)."""
    causal = attention_mask is None and query.shape[2] > 1 and (
        is_causal if is_causal is not None else getattr(module, "is_causal", True))
    out, _ = attention_estimate(query, key, value, attention_mask, bool(causal))
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the estimate attention with transformers; returns its `attn_implementation` name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    AttentionInterface.register(NAME, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME
