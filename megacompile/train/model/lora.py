"""`finetuning_type: lora`: LLaMA-Factory's LoRA through peft, on the model megatrain compiles.

    check_config(config)           the lora_* keys: valid, and set only with finetuning_type: lora
    apply_lora(model, config)      -> "[megatrain] lora: rank 8, alpha 16, dropout 0 on q_proj,v_proj: trains ..."
    is_lora(model)                 the model carries adapters (checkpoints then hold only what trains)
    save_adapter(model, folder)    adapter_model.safetensors + adapter_config.json (PeftModel.save_pretrained)
    merged_state_dict(model)       base weights + scaling * B @ A under the base model's names

`get_peft_model` injects the adapters into `model` itself (its Linear layers become lora.Linear),
so the trainer keeps compiling the HF model it loaded: its parameter names gain `.base_layer.` and
`.lora_A.default.` parts, the decoder stack is still `model.layers`, and identical layers still
lower to one body. The PeftModel wrapper is kept next to the model only to save the adapter as
LLaMA-Factory's output_dir holds it (loadable with `PeftModel.from_pretrained(base, output_dir)`).
As LLaMA-Factory: lora_alpha defaults to 2 * lora_rank, lora_target "all" is every Linear layer
but the LM head (an MoE's 3-D expert parameters and its router are no Linear layers in
transformers 5: on Qwen3-MoE "all" is q,k,v,o_proj, the experts stay frozen, as in LF), and
additional_target names modules trained in full (peft's modules_to_save). The trainable
parameters are upcast to fp32 (LF does so unless pure_bf16; megatrain keeps fp32 masters anyway).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ...errors import ConfigError
from ..hparams.finetuning_args import LORA_KEYS, split_names  # noqa: F401 (API)
from ..hparams.finetuning_args import check_lora as check_config  # noqa: F401 (API)

#: LLaMA-Factory's default forbidden target of lora_target: all (the output layer)
_NOT_ALL = ("lm_head",)
_ADAPTER = "default"
_WRAPPER = "_megatrain_peft_model"   # (a plain attribute: assigned through object, not as a submodule)


def target_modules(model: nn.Module, lora_target) -> list[str]:
    """The module names LoRA goes on: the given names, or for "all" the last name part of every
    Linear layer but the LM head (as LLaMA-Factory's find_all_linear_modules)."""
    names = split_names(lora_target)
    if names != ["all"]:
        return names
    found = set()
    for name, module in model.named_modules():
        if any(part in name for part in _NOT_ALL):
            continue
        kind = type(module).__name__
        if "Linear" in kind and "Embedding" not in kind:
            found.add(name.rsplit(".", 1)[-1])
    return sorted(found)


def _check_names(model: nn.Module, key: str, names: list[str]) -> None:
    """Every name must match some module as peft matches it (the module's name or its end after a
    dot, e.g. q_proj or self_attn.q_proj): peft's own error for a typo is a traceback."""
    modules = [n for n, _ in model.named_modules()]
    missing = [t for t in names if not any(n == t or n.endswith(f".{t}") for n in modules)]
    if missing:
        known = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(f"{key}: {', '.join(missing)} is no module of {model.config.model_type} (its linear "
                          f"layers: {', '.join(known)}); fix the name.")


def apply_lora(model: nn.Module, config) -> str:
    """Inject LoRA adapters into `model` (meta or loaded) in place, as LLaMA-Factory configures
    them; only the adapters (and additional_target) train. Returns a line for the log."""
    from peft import LoraConfig, get_peft_model
    from ...vlm import is_vlm
    if is_vlm(model):   # (LF's VLM LoRA skips the vision tower and projector by name: not mirrored yet)
        raise ConfigError(f"finetuning_type: lora with the vision-language model {model.config.model_type} is not "
                          "supported yet: use finetuning_type: full.")
    if getattr(model, "peft_config", None):
        raise ConfigError("this model already carries LoRA adapters: apply finetuning_type: lora once.")
    targets = target_modules(model, config.lora_target)
    additional = split_names(config.additional_target) or None
    _check_names(model, "lora_target", targets)
    if additional:
        _check_names(model, "additional_target", additional)
    alpha = config.lora_alpha if config.lora_alpha is not None else 2 * config.lora_rank
    peft_config = LoraConfig(task_type="CAUSAL_LM", inference_mode=False, r=config.lora_rank, lora_alpha=alpha,
                             lora_dropout=float(config.lora_dropout), target_modules=targets,
                             use_rslora=bool(config.use_rslora), modules_to_save=additional)
    if getattr(config, "seed", None) is not None:
        # lora_A's init and then lora_dropout's masks draw from torch's generator: seeded here, so
        # they depend on `seed` only, not on what loading the data and the model drew before; LF
        # draws the init right after its set_seed too, so the adapters start as LF's
        # (tests/test_lora.py: LF's own losses for its LoRA run)
        torch.manual_seed(config.seed)
    wrapper = get_peft_model(model, peft_config)   # (injects into `model`; the wrapper only saves)
    object.__setattr__(model, _WRAPPER, wrapper)
    trained = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():   # fp32 adapters in a bf16 model, as LF unless pure_bf16
        for p in trained:
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.to(torch.float32)
    count = sum(p.numel() for p in trained)
    total = sum(p.numel() for p in model.parameters())
    extra = f"; {','.join(additional)} in full" if additional else ""
    return (f"[megatrain] lora: rank {config.lora_rank}, alpha {alpha:g}{' (rslora)' if config.use_rslora else ''}, "
            f"dropout {config.lora_dropout:g} on {','.join(targets)}{extra}: trains {count} of {total} parameters "
            f"({100 * count / max(total, 1):.3f}%)")


def is_lora(model: nn.Module) -> bool:
    """Whether `model` carries LoRA adapters applied by apply_lora."""
    return getattr(model, _WRAPPER, None) is not None


def _masters_shown(model: nn.Module):
    """The trainable parameters showing their fp32 masters while peft reads them."""
    from ...runtime.store import masters_shown
    return masters_shown([p for p in model.parameters() if p.requires_grad])


def save_adapter(model: nn.Module, folder: Path) -> None:
    """adapter_model.safetensors + adapter_config.json in `folder`, as PeftModel.save_pretrained
    writes them (the trained values: the fp32 masters)."""
    with _masters_shown(model):
        getattr(model, _WRAPPER).save_pretrained(str(folder))


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged (W + scaling * B @ A, computed in
    fp32, stored in W's dtype) and additional_target modules' trained copies, under the names
    of the model without adapters: what `merge_and_unload().state_dict()` holds, without
    changing the live model."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad(), _masters_shown(model):
        replaced: dict[str, nn.Module] = {}
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):
                replaced[name] = module
            elif isinstance(module, ModulesToSaveWrapper):
                replaced[name] = module
        for name, module in replaced.items():
            if isinstance(module, LoraLayer):
                base = module.get_base_layer()
                delta = module.get_delta_weight(_ADAPTER).float()
                for key, t in base.state_dict().items():
                    out[f"{name}.{key}"] = (t.float() + delta).to(t.dtype) if key == "weight" else t.clone()
            else:
                for key, t in module.modules_to_save[_ADAPTER].state_dict().items():
                    out[f"{name}.{key}"] = t.detach().clone()
        inside = tuple(f"{n}." for n in replaced)
        for key, t in model.state_dict().items():
            if not key.startswith(inside):
                out[key] = t.detach().clone()
    return out


def save_merged(model: nn.Module, folder: Path, saver=None) -> None:
    """A Hugging Face model folder with the adapters merged (merge_lora: true), loadable with
    AutoModelForCausalLM.from_pretrained like a full fine-tune's output; `saver`: the tokenizer."""
    from .hf_folder import write_model_files, write_weights
    folder.mkdir(parents=True)
    tensors = merged_state_dict(model)
    tied = getattr(model.config, "tie_word_embeddings", False) and getattr(model, "_tied_weights_keys", None)
    untie = False
    if tied and "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors:
        if torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            del tensors["lm_head.weight"]   # (a tied head is stored once, as save_pretrained does)
        else:   # additional_target trained one of the two: from_pretrained must not tie them again
            untie = True
    write_weights({k: v.contiguous() for k, v in tensors.items()}, folder)
    write_model_files(model, saver, folder)
    if untie:
        saved = json.loads((folder / "config.json").read_text())
        saved["tie_word_embeddings"] = False
        (folder / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
