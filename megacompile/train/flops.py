"""Model FLOPs of a training step, for the log's TFLOP/s and MFU.

    counter = FlopCounter(model)        from the model's config and parameter counts, once
    counter.example(ex)                 training FLOPs (forward + backward) of one example

Per example of real (non-padding) tokens, split into its packed samples of lengths s_i:

    dense      6 * N * T                 T = sum s_i, N = the weights a token multiplies: every
                                         trainable and frozen parameter except the input
                                         embedding table (a lookup, not a matmul; counted once
                                         when tied to the LM head, which does multiply), routed
                                         expert weights scaled by experts_per_token / experts
    attention  12 * L * d_attn * P       P = sum over samples of the causal (query, key) pairs
                                         s(s+1)/2 (min(i, window) keys per query for sliding-window
                                         layers), d_attn = heads * head_dim, L = attention layers

2 FLOPs per multiply-add, forward 1x and backward 2x (the usual 6 = 3 x 2). Attention is counted
causal (half of the s^2 score matrix) and padding is excluded, so the figure is the model's useful
work, not what the kernels executed: megatrain recomputes each layer's forward during the backward
(about 8 N T in all), which, as in PaLM's MFU, is not counted. The vision tower of a
vision-language model is not counted.
"""
from __future__ import annotations

from ..vlm import is_vlm

_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_LINEAR_LAYERS = ("linear_attention", "mamba", "conv", "recurrent")


def _text_config(config):
    return getattr(config, "text_config", None) or config


class FlopCounter:
    def __init__(self, model):
        cfg = _text_config(model.config)
        params = dict(model.named_parameters())
        embed = model.get_input_embeddings()
        embed_weight = getattr(embed, "weight", None)
        head = model.get_output_embeddings()
        tied = head is not None and embed_weight is not None and getattr(head, "weight", None) is embed_weight
        vision = {n for n in params if is_vlm(model) and ("visual" in n or "vision" in n)}
        experts = getattr(cfg, "num_experts_per_tok", None)
        count = next((getattr(cfg, k) for k in _EXPERT_COUNT_KEYS if getattr(cfg, k, None)), None)
        routed = experts / count if experts and count else 1.0
        n = 0.0
        for name, p in params.items():
            if name in vision or (p is embed_weight and not tied):
                continue
            share = routed if ".experts." in name and "shared" not in name else 1.0
            n += p.numel() * share
        self.dense_params = n
        heads = getattr(cfg, "num_attention_heads", None) or 0   # (a model without attention: dense FLOPs only)
        head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else 0)
        self.d_attn = heads * head_dim
        layers = getattr(cfg, "num_hidden_layers", None) or 0
        layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * layers)
        # the layers actually built (num_layers keeps the first N)
        layer_types = layer_types[:layers]
        self.windows = [getattr(cfg, "sliding_window", None) if t == "sliding_attention" else None
                        for t in layer_types if not any(k in t for k in _LINEAR_LAYERS)]

    @staticmethod
    def _pairs(s: int, window: int | None) -> int:
        """Causal (query, key) pairs of a sample of `s` tokens, each query seeing at most `window` keys."""
        if window is None or window >= s:
            return s * (s + 1) // 2
        return window * (window + 1) // 2 + (s - window) * window

    def sample_lengths(self, ex) -> list[int]:
        """The real tokens of each sample of an example (packed: positions restart at each one)."""
        if ex.position_ids is None:
            return [len(ex.input_ids)]
        starts = [i for i, p in enumerate(ex.position_ids) if p == 0] or [0]
        return [b - a for a, b in zip(starts, starts[1:] + [len(ex.input_ids)])]

    def example(self, ex) -> float:
        """Training FLOPs (forward and backward) of one example."""
        lengths = self.sample_lengths(ex)
        dense = 6.0 * self.dense_params * sum(lengths)
        attention = sum(12.0 * self.d_attn * self._pairs(s, w) for s in lengths for w in self.windows)
        return dense + attention


def device_peak(config, device, dtype) -> tuple[float, str]:
    """(TFLOP/s, which profile) that MFU is measured against: the compute rate of the profile the
    run's plan uses (preflight.hardware_for: the `hardware` option, else the GPU's built-in or
    measured profile, else, on the CPU, the matmul rate measured on this machine: a 1024^3
    matmul in the model's dtype, best of 5)."""
    from .preflight import hardware_for
    hw, why = hardware_for(config, device, dtype)
    return hw.compute_tflops, f"{hw.name} profile, {hw.compute_tflops:.3g} TFLOP/s ({why})"
