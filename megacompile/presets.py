"""Built-in model presets: the published configs of well-known models, by name.

`megatrain inspect llama-3-70b` builds the model from this config on the meta device (no
weights allocated). Values follow each model's released `config.json`.
"""
from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from .errors import ConfigError

PRESETS: dict[str, dict] = {
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
    "llama-3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
    "qwen3-32b": dict(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                      num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=40960, tie_word_embeddings=False),
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
                               intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
                               num_key_value_heads=2, head_dim=256, num_experts=512, num_experts_per_tok=10,
                               moe_intermediate_size=512, shared_expert_intermediate_size=512,
                               linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                               linear_value_head_dim=128, full_attention_interval=4,
                               max_position_embeddings=262144, tie_word_embeddings=False),
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096,
                            intermediate_size=12288, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=1536, max_position_embeddings=40960,
                            tie_word_embeddings=False),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, tie_word_embeddings=False),
    "gpt-oss-120b": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                         num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                         num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
                         max_position_embeddings=131072, tie_word_embeddings=False),
    "deepseek-v3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
                        num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        max_position_embeddings=163840, tie_word_embeddings=False),
}


def load_config(source: str) -> PretrainedConfig:
    """A preset name, a `config.json` path, or a model directory holding one."""
    if source in PRESETS:
        values = dict(PRESETS[source])
        return AutoConfig.for_model(values.pop("model_type"), **values)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{source!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json "
                          "file or a model directory containing one.")
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if "model_type" not in values:
        raise ConfigError(f"{path} has no 'model_type'; is it a HuggingFace config.json?")
    return AutoConfig.for_model(values.pop("model_type"), **values)
