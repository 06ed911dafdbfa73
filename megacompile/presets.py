"""Built-in model presets: the published configs of well-known models, by name.

`megatrain inspect llama-3-70b` builds the model from this config on the meta device (no
weights allocated). Values follow each model's released `config.json`.
"""
from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from .errors import ConfigError

_QWEN_VL_TEXT_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                        rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
                        tie_word_embeddings=False)
_QWEN_VL_TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                       vision_end_token_id=151653)


def _qwen_vl_vision(out_hidden_size: int) -> dict:
    """Qwen2.5-VL's 0.67B window-attention vision tower (the same in every size but its output)."""
    return dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=out_hidden_size,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", in_chans=3, tokens_per_second=2)


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
    # more dense models
    # SmolLM2-135M-Instruct, `megatrain train`'s embedded quickstart model (model_name_or_path: embedded:smollm2)
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    "llama-3.1-405b": dict(model_type="llama", vocab_size=128256, hidden_size=16384, intermediate_size=53248,
                           num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                           max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False),
    # a 175B-class dense model for planning (no released weights): GPT-3 175B's shape (hidden 12288,
    # 96 layers, 96 heads, vocab 50257) as a llama, whose gated MLP of 32768 has GPT-3's 4 x 12288
    # MLP's parameters: 96 x 1.81B + 1.24B embeddings = 175.2B
    "dense-175b": dict(model_type="llama", vocab_size=50257, hidden_size=12288, intermediate_size=32768,
                       num_hidden_layers=96, num_attention_heads=96, num_key_value_heads=96,
                       max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen2.5-14b": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=13824,
                        num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                        max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen2.5-32b": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen2.5-72b": dict(model_type="qwen2", vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, tie_word_embeddings=False),
    "qwen3-14b": dict(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=17408,
                      num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=40960, tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=32768, rope_theta=1000000.0, sliding_window=None,
                       tie_word_embeddings=False),
    "mistral-small-24b": dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                              num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              max_position_embeddings=32768, rope_theta=100000000.0, sliding_window=None,
                              tie_word_embeddings=False),
    "gemma-2-27b": dict(model_type="gemma2", vocab_size=256000, hidden_size=4608, intermediate_size=36864,
                        num_hidden_layers=46, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                        sliding_window=4096, query_pre_attn_scalar=144, max_position_embeddings=8192),
    "gemma-3-27b": dict(model_type="gemma3_text", vocab_size=262208, hidden_size=5376, intermediate_size=21504,
                        num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                        sliding_window=1024, query_pre_attn_scalar=168, max_position_embeddings=131072),
    "phi-4": dict(model_type="phi3", vocab_size=100352, hidden_size=5120, intermediate_size=17920,
                  num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10,
                  max_position_embeddings=16384, rope_theta=250000.0, tie_word_embeddings=False),
    # vision-language models (the language stack is trained by megatrain, the vision tower runs
    # eagerly on the device: see megacompile/vlm.py)
    "qwen2.5-vl-7b": dict(model_type="qwen2_5_vl", text_config=_QWEN_VL_TEXT_7B, vision_config=_qwen_vl_vision(3584),
                          **_QWEN_VL_TOKENS, tie_word_embeddings=False),
    "qwen2.5-vl-72b": dict(model_type="qwen2_5_vl", text_config=dict(
        _QWEN_VL_TEXT_7B, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8), vision_config=_qwen_vl_vision(8192), **_QWEN_VL_TOKENS, tie_word_embeddings=False),
    "llava-1.5-7b": dict(model_type="llava", text_config=dict(
        model_type="llama", vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, tie_word_embeddings=False),
        vision_config=dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
                           num_hidden_layers=24, num_attention_heads=16, image_size=336, patch_size=14,
                           projection_dim=768),
        image_token_id=32000, vision_feature_layer=-2, vision_feature_select_strategy="default",
        projector_hidden_act="gelu", tie_word_embeddings=False),
    # more mixtures of experts
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          max_position_embeddings=40960, tie_word_embeddings=False),
    "mixtral-8x22b": dict(model_type="mixtral", vocab_size=32768, hidden_size=6144, intermediate_size=16384,
                          num_hidden_layers=56, num_attention_heads=48, num_key_value_heads=8,
                          num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=65536,
                          rope_theta=1000000.0, tie_word_embeddings=False),
    "gpt-oss-20b": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                        max_position_embeddings=131072, tie_word_embeddings=False),
}

#: Hugging Face Hub ids of the presets (so `megatrain plan` takes a train config's model id)
HUB_IDS = {
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3-8b", "meta-llama/Llama-3.3-70B-Instruct": "llama-3-70b",
    "meta-llama/Llama-3.1-405B-Instruct": "llama-3.1-405b", "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b",
    "Qwen/Qwen2.5-14B-Instruct": "qwen2.5-14b", "Qwen/Qwen2.5-32B-Instruct": "qwen2.5-32b",
    "Qwen/Qwen2.5-72B-Instruct": "qwen2.5-72b", "Qwen/Qwen3-8B": "qwen3-8b", "Qwen/Qwen3-14B": "qwen3-14b",
    "Qwen/Qwen3-32B": "qwen3-32b", "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b", "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b",
    "Qwen/Qwen3-Next-80B-A3B-Instruct": "qwen3-next-80b-a3b", "mistralai/Mistral-7B-Instruct-v0.3": "mistral-7b",
    "mistralai/Mistral-Small-24B-Instruct-2501": "mistral-small-24b", "google/gemma-2-27b-it": "gemma-2-27b",
    "google/gemma-3-27b-it": "gemma-3-27b", "microsoft/phi-4": "phi-4",
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b", "mistralai/Mixtral-8x22B-Instruct-v0.1": "mixtral-8x22b",
    "openai/gpt-oss-20b": "gpt-oss-20b", "openai/gpt-oss-120b": "gpt-oss-120b",
    "deepseek-ai/DeepSeek-V3": "deepseek-v3", "Qwen/Qwen2.5-VL-7B-Instruct": "qwen2.5-vl-7b",
    "Qwen/Qwen2.5-VL-72B-Instruct": "qwen2.5-vl-72b", "llava-hf/llava-1.5-7b-hf": "llava-1.5-7b",
}


def keep_layers(config: PretrainedConfig, num_layers: int) -> PretrainedConfig:
    """Keep the first `num_layers` decoder layers of `config` (in place; a VLM's language stack):
    the layer count and, for hybrid models, their per-layer types."""
    text = config.get_text_config(decoder=True)
    text.num_hidden_layers = num_layers
    if getattr(text, "layer_types", None) is not None:   # hybrid configs list one type per layer
        text.layer_types = list(text.layer_types)[:num_layers]
    return config


#: model sources that name a preset in another way (the embedded quickstart model of `megatrain train`)
ALIASES = {"embedded:smollm2": "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m"}


def _looks_like_path(source: str) -> bool:
    """A source the user meant as a file or folder (not a preset name or an `org/name` Hub id)."""
    return (source.startswith(("/", "./", "../", "~", "\\")) or source in (".", "..") or source.count("/") > 1
            or source.lower().endswith((".json", ".yaml", ".yml", ".safetensors", ".bin", ".gguf"))
            or "\\" in source or (len(source) > 1 and source[1] == ":"))


def _suggest(source: str) -> str:
    """ "Did you mean 'x'? " for the closest preset name or Hub id, or ""."""
    import difflib
    names = {n.lower(): n for n in [*PRESETS, *HUB_IDS, *ALIASES]}
    key = source.lower().strip()
    squash = {n.replace("-", "").replace("_", "").replace(".", ""): n for n in names}
    s = key.replace("-", "").replace("_", "").replace(".", "")
    close = [names[key]] if key in names else [names[squash[s]]] if s in squash else \
        [names[n] for n in difflib.get_close_matches(key, names, n=1, cutoff=0.75)]
    return f"Did you mean {close[0]!r}? " if close else ""


def _from_values(values: dict, where: str) -> PretrainedConfig:
    """A transformers config from `values` (a config.json's mapping); errors say what to change."""
    model_type = values.pop("model_type")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        import difflib

        import transformers
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=1, cutoff=0.75)
        raise ConfigError(f"{where}: model_type {model_type!r} is not a model type transformers "
                          f"{transformers.__version__} knows" + (f"; did you mean {close[0]!r}?" if close else
                          " (a newer transformers may have it, or the model needs trust_remote_code, which "
                          "`megatrain plan` and `inspect` do not run)."))
    try:   # transformers' config validation raises huggingface_hub's strict-dataclass errors
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        StrictDataclassError = ValueError
    try:
        return AutoConfig.for_model(model_type, **values)
    except (ValueError, TypeError, StrictDataclassError) as e:
        detail = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise ConfigError(f"{where}: not a valid {model_type} config: {detail}") from None


def load_config(source: str | PretrainedConfig) -> PretrainedConfig:
    """A preset name or Hub id of one, a `config.json` path, a model directory holding one, or a
    config object (a copy of it). Errors (ConfigError) say what is wrong with `source`: a path
    that does not exist, a folder without config.json, a file that is not a config, a preset name
    with a typo (with the closest name)."""
    if isinstance(source, PretrainedConfig):
        import copy
        return copy.deepcopy(source)
    if not isinstance(source, str) or not source.strip():
        raise ConfigError(f"model {source!r}: give a preset name (e.g. llama-3-8b), a config.json path or a "
                          "model directory.")
    source = ALIASES.get(source, source)
    name = HUB_IDS.get(source, source)
    if name in PRESETS:
        values = dict(PRESETS[name])
        return AutoConfig.for_model(values.pop("model_type"), **values)
    path = Path(source).expanduser()
    if not path.exists():
        if _looks_like_path(source):
            missing = next((p for p in [path, *path.parents] if not p.exists() and p.parent.exists()), path)
            where = "" if missing == path else f" (nor does {missing.absolute()})"
            raise ConfigError(f"model path {source} does not exist{where}: give a config.json file or a model "
                              "directory holding one, or a preset name (e.g. llama-3-8b).")
        if "/" in source:   # org/name: a Hub id megatrain has no preset for; try the local Hub cache
            try:
                return AutoConfig.from_pretrained(source, local_files_only=True)
            except (OSError, ValueError):   # not cached, or not a config transformers can read
                pass
            raise ConfigError(f"model {source!r}: no such path exists, and it is not the Hub id of a preset "
                              f"(nor in the local Hugging Face cache). {_suggest(source)}`megatrain plan` and "
                              "`inspect` work offline: download the model's config.json and pass its path, or use "
                              f"a preset: {', '.join(PRESETS)}.")
        raise ConfigError(f"model {source!r} is neither a preset nor an existing config.json file or model "
                          f"directory. {_suggest(source)}Presets: {', '.join(PRESETS)}.")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model directory {source} has no config.json: point MODEL at a Hugging Face model "
                              "directory (with config.json) or at the config.json file itself.")
        path = path / "config.json"
    if path.suffix.lower() in (".yaml", ".yml"):
        raise ConfigError(f"{path} is a YAML file: a model is a config.json, a model directory or a preset "
                          "(`megatrain plan` takes a `megatrain train` YAML config; `megatrain inspect` does not).")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file: give the model's config.json (a JSON file).") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}.") from None
    if not text.strip():
        raise ConfigError(f"{path} is empty: give the model's config.json (a JSON object with 'model_type').")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} holds a JSON {type(values).__name__}, not an object: is it a HuggingFace "
                          "config.json?")
    if "model_type" not in values:
        raise ConfigError(f"{path} has no 'model_type'; is it a HuggingFace config.json?")
    return _from_values(values, str(path))
