"""`finetuning_type`: which weights a run trains, decided on the model before it is compiled.

    check_config(config)          at config time: the method is one megatrain has, its keys fit it
    apply_finetuning(model, config) -> "[megatrain] freeze: trains layers 2-3 of 4 ..." (or None)

The trainer calls apply_finetuning twice: on the meta model, before the preflight (so the host
RAM and the plan count only what trains, and a bad module name fails before any weight loads),
and on the loaded model, before torch.compile (the store creates fp32 masters, and the backward
delivers gradients, only for parameters that require grad; HostAdamW gets only those).
  full     every weight trains (a VLM's vision side as `vision` says: megacompile/vlm.py)
  freeze   LLaMA-Factory's freeze tuning (freeze.py)
  lora     LLaMA-Factory's LoRA through peft (lora.py)
"""
from __future__ import annotations

from torch import nn

from ..errors import ConfigError
from ..vlm import is_vlm
from . import freeze as freeze_tuning
from . import lora

#: the methods megatrain trains with
METHODS = ("full", "freeze", "lora")
#: LLaMA-Factory's other methods, and why they are refused
REFUSED = {"oft": "OFT (orthogonal fine-tuning) is not supported yet"}
#: the freeze method's keys and their defaults (LLaMA-Factory's)
FREEZE_KEYS = {"freeze_trainable_layers": 2, "freeze_trainable_modules": "all", "freeze_extra_modules": None}


def check_config(config) -> None:
    """The method exists, and a method's keys are not set for another (they would do nothing)."""
    method = config.finetuning_type
    if method in REFUSED:
        raise ConfigError(f"finetuning_type: {method}: {REFUSED[method]}; use {' or '.join(METHODS)}.")
    if method not in METHODS:
        raise ConfigError(f"finetuning_type={method!r}: use one of {', '.join(METHODS)}.")
    lora.check_config(config)   # (the lora_* keys: set only for lora, valid, peft installed)
    if method != "freeze":
        changed = [f"{k}={getattr(config, k)!r}" for k, default in FREEZE_KEYS.items() if getattr(config, k) != default]
        if changed:
            raise ConfigError(f"{', '.join(changed)} configure finetuning_type: freeze, but this config has "
                              f"finetuning_type: {method}: remove them or set finetuning_type: freeze.")
        return
    modules = freeze_tuning.split_names(config.freeze_trainable_modules)
    extra = freeze_tuning.split_names(config.freeze_extra_modules)
    for key, names in (("freeze_trainable_modules", modules), ("freeze_extra_modules", extra)):
        if "" in names:
            raise ConfigError(f"{key}={getattr(config, key)!r} has an empty name: give comma-separated module names "
                              "(e.g. mlp,self_attn).")
    if config.freeze_trainable_layers == 0 and not extra:
        raise ConfigError("finetuning_type: freeze with freeze_trainable_layers=0 and no freeze_extra_modules trains "
                          "nothing: give the last n (n > 0) or first n (n < 0) layers to train.")


def apply_finetuning(model: nn.Module, config) -> str | None:
    """Set which parameters of `model` (meta or loaded) train, as `config.finetuning_type` says;
    returns a line for the log, or None when every weight trains as loaded."""
    method = config.finetuning_type
    if method == "full":
        return None
    if method == "freeze":
        if is_vlm(model):   # (LF's freeze of a VLM also picks the vision side; megatrain's vision key does that)
            raise ConfigError(f"finetuning_type: freeze with the vision-language model {model.config.model_type} is "
                              "not supported yet: use finetuning_type: full (vision: frozen trains the language "
                              "model only).")
        return freeze_tuning.freeze(model, config.freeze_trainable_layers, config.freeze_trainable_modules,
                                    config.freeze_extra_modules)
    if method == "lora":
        return lora.apply_lora(model, config)
    raise ConfigError(f"finetuning_type={method!r}: use one of {', '.join(METHODS)}.")   # (check_config refused it)
