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

from ...errors import ConfigError
from ...vlm import is_vlm
from ..hparams.finetuning_args import FREEZE_KEYS, METHODS, REFUSED, check_config  # noqa: F401 (API)
from . import freeze as freeze_tuning
from . import lora


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
