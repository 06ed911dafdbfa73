"""Reference parameter selection of LLaMA-Factory 0.9.5's freeze tuning for tests/test_freeze.py.

Run with LLaMA-Factory's own environment (not a test dependency):

    /work/lfenv/bin/python tests/data/lf_reference/freeze_generate.py

It writes freeze_selection.json: for a tiny Llama and a tiny Qwen3-MoE (their config.json
values are stored too, so the test builds the same models), and each case of
freeze_trainable_layers / freeze_trainable_modules / freeze_extra_modules, the names of the
parameters LLaMA-Factory leaves trainable (llamafactory.model.adapter._setup_freeze_tuning on
the model built on the meta device), or the message of the error it raises.
"""
import json
from pathlib import Path

import torch
from llamafactory.hparams import FinetuningArguments
from llamafactory.model.adapter import _setup_freeze_tuning
from transformers import AutoConfig, AutoModelForCausalLM

OUT = Path(__file__).with_name("freeze_selection.json")
COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
MODELS = {
    "llama": dict(model_type="llama", **COMMON),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      **COMMON),
}
# (freeze_trainable_layers, freeze_trainable_modules, freeze_extra_modules)
CASES = [
    (2, "all", None),
    (-1, "all", None),
    (1, "mlp", None),
    (-2, "self_attn,mlp", None),
    (2, "all", "embed_tokens,norm"),
    (-1, "self_attn", "lm_head"),
    (8, "all", None),              # more than the model has
    (-8, "mlp", None),
    (0, "all", "embed_tokens"),
    (1, "all,mlp", None),
    (1, "post_attention_layernorm", None),
    (1, "attn", None),             # not a module name
    (1, "mlp, ", None),            # an empty name
    (1, "all", "embed"),           # not a module outside the layers
    (1, "all", "layers"),
]


def main() -> None:
    results = {"models": MODELS, "cases": []}
    for model_name, values in MODELS.items():
        values = dict(values)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        for layers, modules, extra in CASES:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            args = FinetuningArguments(finetuning_type="freeze", freeze_trainable_layers=layers,
                                       freeze_trainable_modules=modules, freeze_extra_modules=extra)
            case = {"model": model_name, "freeze_trainable_layers": layers, "freeze_trainable_modules": modules,
                    "freeze_extra_modules": extra}
            try:
                _setup_freeze_tuning(model, args, is_trainable=True, cast_trainable_params_to_fp32=False)
            except ValueError as e:
                case["error"] = str(e)
            else:
                case["trainable"] = [n for n, p in model.named_parameters() if p.requires_grad]
            results["cases"].append(case)
    OUT.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {OUT}: {len(results['cases'])} cases")


if __name__ == "__main__":
    main()
