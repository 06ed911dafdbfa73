"""The supported decoder-only families, as tiny random configs built from their config classes.

Adding a family is one entry: the transformers `model_type`, the config overrides that make it
tiny (and exercise what is special about it), and the number of structurally distinct decoder
layers it has (found from the graph by the compiler; stated here from the architecture).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)


@dataclass(frozen=True)
class Family:
    model_type: str
    overrides: dict = field(default_factory=dict)
    layer_kinds: int = 1           # structurally distinct decoder layers
    why: str = ""                  # what the entry exercises
    name: str = ""                 # the matrix key when one model_type has several entries
    backward_layer_kinds: int | None = None   # when the backward lowers more bodies (a known gap)


FAMILIES: dict[str, Family] = {f.name or f.model_type: f for f in [
    # dense
    Family("llama"),
    Family("mistral", {"sliding_window": 4}, why="sliding-window attention"),
    Family("qwen2", why="q/k/v biases"),
    Family("qwen3", {"tie_word_embeddings": True}, why="q/k norms, tied embeddings"),
    Family("gemma2", {"sliding_window": 4, "num_hidden_layers": 4}, 1,
           why="alternating sliding/global layers that differ only in the mask they read (one body), "
               "logit softcapping"),
    Family("gemma3_text", {"sliding_window": 4, "num_hidden_layers": 3, "sliding_window_pattern": 2}, 2,
           why="sliding + global layers with their own rotary tables (two layer kinds in the graph)"),
    Family("phi3", why="fused qkv and gate_up projections"),
    Family("olmo2", why="post-norms, q/k norms"),
    Family("glm4", why="partial rotary, post-attention/-MLP norms"),
    Family("smollm3", {"no_rope_layer_interval": 2, "num_hidden_layers": 4}, 2,
           why="layers without rotary embedding (NoPE) every other layer: two layer kinds"),
    # hybrid linear + full attention
    Family("qwen3_next", {"num_hidden_layers": 4, "full_attention_interval": 2, "num_experts": 4,
                          "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                          "shared_expert_intermediate_size": 16, "linear_num_key_heads": 2,
                          "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                          "linear_conv_kernel_dim": 2}, 2,
           why="Gated DeltaNet linear attention + gated full attention, MoE with a shared expert"),
    Family("qwen3_5_text", {"num_hidden_layers": 4, "full_attention_interval": 2, "linear_num_key_heads": 2,
                            "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                            "linear_conv_kernel_dim": 2}, 2,
           why="Qwen3.5: Gated DeltaNet + full attention"),
    Family("qwen3_5_moe_text", {"num_hidden_layers": 4, "full_attention_interval": 2, "linear_num_key_heads": 2,
                                "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                "linear_conv_kernel_dim": 2, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}, 2,
           why="Qwen3.5-MoE: hybrid attention with experts"),
    Family("lfm2", {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
                    "block_ff_dim": 64, "conv_L_cache": 3}, 2, why="short convolutions + attention"),
    Family("jamba", {"num_hidden_layers": 2, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                     "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 8,
                     "mamba_d_conv": 2, "mamba_expand": 2, "use_mamba_kernels": False}, 2,
           why="Mamba + attention layers, experts every other layer"),
    Family("bamba", {"num_hidden_layers": 2, "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 16,
                     "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_chunk_size": 4}, 2, why="Mamba2 + attention"),
    Family("minimax", {"num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                       "layer_types": ["linear_attention", "full_attention"], "block_size": 4}, 2,
           why="lightning linear attention + softmax attention, experts"),
    Family("falcon_h1", {"num_hidden_layers": 3, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1,
                         "mamba_d_ssm": 64, "mamba_d_state": 8, "mamba_chunk_size": 4}, 1,
           why="attention and Mamba2 in parallel inside every layer, muP multipliers (the embedding "
               "multiplier's gradient is finished in the embedding's backward: one backward layer body)"),
    Family("nemotron_h", {"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"],
                          "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8, "chunk_size": 4,
                          "n_groups": 1,
                          "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                          "moe_shared_expert_intermediate_size": 16, "n_group": 1, "topk_group": 1}, 4,
           why="Nemotron-H: Mamba2, MoE, attention and MLP blocks, one per layer (four layer kinds)"),
    Family("granitemoehybrid", {"num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2,
                                "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_chunk_size": 4,
                                "num_local_experts": 4, "shared_intermediate_size": 32}, 2,
           why="Granite 4: Mamba2 + attention layers, every layer with experts and a shared MLP"),
    Family("kimi_linear", {"num_hidden_layers": 4, "num_key_value_heads": 4,
                           # (the dense layer is an MLA one here, so only one layer kind holds KDA:
                           # its reference chunk loop, 63 steps, is most of the family's compile)
                           "layer_types": ["full_attention", "linear_attention"] * 2,
                           "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "num_experts": 4,
                           "num_experts_per_token": 2, "moe_intermediate_size": 16, "linear_head_dim": 8,
                           "linear_num_heads": 4, "linear_conv_kernel_dim": 2, "q_lora_rank": None,
                           "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}, 3,
           why="Kimi Linear: KDA linear attention + MLA, a dense first layer then experts (three layer kinds)"),
    Family("bailing_hybrid", {"num_hidden_layers": 4, "num_key_value_heads": 4,
                              "layer_types": ["full_attention", "linear_attention"] * 2,   # (as kimi_linear's)
                              "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "num_experts": 4,
                              "num_experts_per_token": 2, "num_expert_group": 1, "topk_group": 1,
                              "moe_intermediate_size": 16, "linear_head_dim": 8, "linear_num_heads": 4,
                              "linear_conv_kernel_dim": 2, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                              "v_head_dim": 8, "kv_lora_rank": 16, "q_lora_rank": None, "layer_group_size": 2,
                              "num_nextn_predict_layers": 0}, 3,
           why="Ling hybrid: linear attention + MLA, a dense first layer then experts (three layer kinds)"),
    Family("lfm2_moe", {"num_hidden_layers": 4, "num_dense_layers": 1, "num_experts": 4, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 16, "layer_types": ["conv", "full_attention"] * 2,
                        "conv_L_cache": 3}, 3,
           why="LFM2-MoE: short convolutions + attention, a dense first layer then experts"),
    Family("olmo_hybrid", {"num_hidden_layers": 4}, 2,
           why="OLMo hybrid: Gated DeltaNet layers + one full-attention layer"),
    Family("recurrent_gemma", {"num_hidden_layers": 3, "lru_width": 32, "attention_window_size": 4,
                               "conv1d_width": 2}, 2,
           why="RecurrentGemma: RG-LRU recurrent blocks + local attention"),
    Family("zamba2", {"num_hidden_layers": 4, "layers_block_type": ["mamba", "hybrid"] * 2, "hybrid_layer_ids": [1, 3],
                      "mamba_d_state": 8, "n_mamba_heads": 4, "mamba_headdim": 16, "chunk_size": 4}, 2,
           why="Zamba2: Mamba2 layers + hybrid layers that share one transformer block (the same weights in "
               "two layers; passes/unshare_weight_views.py keeps their forward bodies identical)",
           # known gap: in the backward, the first hybrid layer also sums the shared block's gradient
           # over the layers that use it, and the first layer also sums the gradient of the
           # embeddings that every hybrid layer re-reads: each lowers its own body
           backward_layer_kinds=4),
    # more dense
    Family("olmo3", {"sliding_window": 4, "num_hidden_layers": 4}, 2, why="sliding + full attention layers"),
    Family("exaone4", {"sliding_window": 4, "num_hidden_layers": 4, "sliding_window_pattern": 2}, 2,
           why="sliding + full attention layers"),
    Family("ernie4_5"),
    Family("hunyuan_v1_dense", why="q/k norms after rotary"),
    # mixture of experts
    Family("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
           why="stacked 3-D expert weights"),
    Family("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    Family("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4}, 2,
           why="attention sinks, expert biases, alternating sliding/full attention"),
    Family("deepseek_v3", {"num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 4,
                           "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                           "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                           "v_head_dim": 8, "num_key_value_heads": 4, "n_group": 1, "topk_group": 1}, 2,
           why="MLA attention, shared experts, a first dense layer"),
    Family("glm4_moe", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}, 2,
           why="sigmoid-routed experts after a dense layer"),
    Family("llama4_text", {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 64,
                           "num_hidden_layers": 4, "interleave_moe_layer_step": 2, "attention_chunk_size": 4,
                           "no_rope_layers": [1, 1, 1, 0]}, 3,
           why="interleaved MoE/dense layers, chunked attention, a NoPE global layer"),
]}


def tiny_family_model(name: str, dtype=torch.float32, seed: int = 0, **overrides):
    fam = FAMILIES[name]
    cfg = AutoConfig.for_model(fam.model_type, **{**COMMON, **fam.overrides, **overrides})
    cfg.use_cache = False
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).to(dtype).train()
