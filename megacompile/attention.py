"""Segment-aware attention for transformers models: the attention implementation "megatrain_segment".

Under torch.compile transformers cannot prove that a batch is unpadded and unpacked (its packed-
sequence check reads `position_ids`; an attention mask's values cannot be read while tracing),
so its SDPA path builds a dense [batch, 1, seq, seq] mask, which grows with the square of the
sequence. This implementation describes the same mask by one int32 segment id per token instead:

    mask function (AttentionMaskInterface)   HF's mask rule, probed at O(batch x seq) pairs:
        valid[i] = rule(i, i)                   the token attends itself: not padding
        prev[i]  = the last valid token before i
        same[i]  = rule(i, prev[i])             it attends that one: same segment
        seg[i]   = cumsum(not same)[i] if valid[i] else -1
    attention function (AttentionInterface)  torch.ops.megatrain.segment_attention(q, k, v, seg, window)

Because the ids come from HF's own mask function (causal, padding, packed documents from
`position_ids`, chunked attention's chunks), its decisions carry over; a sliding window is the
attention call's `sliding_window`. A token starts a new segment exactly when it cannot see the
previous valid token, which holds for every mask that is causal within contiguous groups.
Masks of another kind (a VLM's bidirectional image tokens, `use_vmap`) and decoding with a
cache fall back to transformers' dense SDPA mask, as do modules with softcapping or attention
sinks (their attention is not segment attention).

megatrain's backend selects it itself before Dynamo traces (compile_start.py; the backend option
`attention="transformers"` keeps the model's own); by hand:

    from megacompile import attention
    attention.use(model)            # before torch.compile; refuses a model it cannot run
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (ALL_MASK_ATTENTION_FUNCTIONS, and_masks, padding_mask_function,
                                        prepare_padding_mask, sdpa_mask)

from . import ir_ops  # noqa: F401  (defines torch.ops.megatrain.segment_attention)
from .errors import UnsupportedModelError

NAME = "megatrain_segment"


def segment_ids(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                attention_mask: torch.Tensor | None = None, local_size: int | None = None, use_vmap: bool = False,
                device="cpu", **kwargs):
    """The AttentionMaskInterface entry: int32 segment ids [batch, seq] (-1: nobody attends the
    token), or transformers' dense SDPA mask where the rule is not causal-within-segments."""
    if use_vmap or kv_length != q_length or not (isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0):
        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                         local_size=local_size, use_vmap=use_vmap, device=device, **kwargs)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        mask_function = and_masks(mask_function, padding_mask_function(padding))
    b = torch.arange(batch_size, device=device)[:, None]
    h = torch.zeros((), dtype=torch.long, device=device)
    i = torch.arange(q_length, device=device)[None, :]
    valid = mask_function(b, h, i, i).expand(batch_size, q_length)
    index = torch.where(valid, i.expand(batch_size, q_length), -1)
    prev = torch.cat([index.new_full((batch_size, 1), -1), index.cummax(-1).values[:, :-1]], 1)
    same = mask_function(b, h, i, prev.clamp(min=0)) & (prev >= 0)
    seg = (~same).to(torch.int32).cumsum(-1, dtype=torch.int32)
    return torch.where(valid, seg, torch.full_like(seg, -1))


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """The AttentionInterface entry: segment attention for segment ids, transformers' SDPA for a
    dense mask or None. Returns (output [b, s, h, d], None) as transformers' functions do."""
    if attention_mask is None or attention_mask.dim() != 2:   # transformers' own dense mask (or none)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if softcap is not None or s_aux is not None or dropout > 0.0 or not getattr(module, "is_causal", True):
        raise NotImplementedError(f"megatrain segment attention: {type(module).__name__} uses softcapping, "
                                  "attention sinks, dropout or bidirectional attention, which it does not support")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out, _ = torch.ops.megatrain.segment_attention(query, key, value, attention_mask, int(sliding_window or 0),
                                                   float(scale))
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the implementation with transformers (idempotent); returns its name."""
    AttentionInterface.register(NAME, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, segment_ids)
    return NAME


def unsupported(model) -> str | None:
    """Why segment attention cannot run `model` (None: it can): logit softcapping (Gemma2) and
    attention sinks (GPT-OSS) change the softmax, which the segment kernel does not do yet."""
    config = _text_config(model)
    if getattr(config, "attn_logit_softcapping", None):
        return f"{config.model_type} softcaps its attention logits"
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        return f"{config.model_type} uses attention sinks"
    return None


# implementations segment attention replaces (same semantics, no dense mask; "megatrain_estimate":
# meta_attention.py's, for models built on the meta device); a custom one is kept
_REPLACEABLE = (None, "eager", "sdpa", "flash_attention_2", "flash_attention_3", "megatrain_estimate", NAME)


def _text_config(model):
    return model.config.get_text_config(decoder=True)


def why_not(model) -> str | None:
    """Why segment attention would not be selected for `model` (None: it would be)."""
    if not hasattr(model, "set_attn_implementation") or getattr(model, "config", None) is None:
        return "not a transformers model"
    why = unsupported(model)
    if why:
        return why
    config = _text_config(model)
    if config._attn_implementation not in _REPLACEABLE:
        return f"it uses the attention implementation {config._attn_implementation!r}"
    if getattr(config, "output_attentions", False):
        return "its config asks for attention weights (output_attentions)"
    top = model.config
    if config is not top and not any(getattr(top, k, None) is config for k in top.sub_configs):
        return "its language config is not one of its sub-configs"
    return None


def select(model) -> str | None:
    """Select segment attention for `model`'s language stack where it can run it; returns None
    when selected, else why not (the model then keeps its attention). A vision-language model's
    vision tower keeps its own (bidirectional, not segment) attention."""
    why = why_not(model)
    if why:
        return why
    register()
    config, top = _text_config(model), model.config
    model.set_attn_implementation(NAME if config is top else
                                  {k: NAME for k in top.sub_configs if getattr(top, k, None) is config})
    if config._attn_implementation != NAME:
        return "transformers did not accept the implementation"
    return None


def use(model) -> None:
    """Select segment attention for `model` (before torch.compile traces it); refuses a model it
    cannot run with an UnsupportedModelError."""
    why = select(model)
    if why:
        raise UnsupportedModelError(f"segment attention cannot run this model: {why}; keep transformers' attention "
                                    "for it")
