"""`finetuning_type` and its keys, checked when the config is read (LLaMA-Factory's
FinetuningArguments): which method, and that a method's keys are not set for another (they would
do nothing). model/finetuning.py applies the method to the model; lora.py and freeze.py do the work.

    check_config(config)   # ConfigError: "lora_rank=16 configures finetuning_type: lora, but ..."
"""
from __future__ import annotations

from ...errors import ConfigError

#: the LoRA keys and their defaults (LLaMA-Factory's)
LORA_KEYS = {"lora_rank": 8, "lora_alpha": None, "lora_dropout": 0.0, "lora_target": "all",
             "additional_target": None, "use_rslora": False, "merge_lora": False}

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
    check_lora(config)   # (the lora_* keys: set only for lora, valid, peft installed)
    if method != "freeze":
        changed = [f"{k}={getattr(config, k)!r}" for k, default in FREEZE_KEYS.items() if getattr(config, k) != default]
        if changed:
            raise ConfigError(f"{', '.join(changed)} configure finetuning_type: freeze, but this config has "
                              f"finetuning_type: {method}: remove them or set finetuning_type: freeze.")
        return
    modules = split_names(config.freeze_trainable_modules)
    extra = split_names(config.freeze_extra_modules)
    for key, names in (("freeze_trainable_modules", modules), ("freeze_extra_modules", extra)):
        if "" in names:
            raise ConfigError(f"{key}={getattr(config, key)!r} has an empty name: give comma-separated module names "
                              "(e.g. mlp,self_attn).")
    if config.freeze_trainable_layers == 0 and not extra:
        raise ConfigError("finetuning_type: freeze with freeze_trainable_layers=0 and no freeze_extra_modules trains "
                          "nothing: give the last n (n > 0) or first n (n < 0) layers to train.")


def split_names(value) -> list[str]:
    """'q_proj, v_proj' -> ['q_proj', 'v_proj'] (a list passes through), as LF's split_arg."""
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",")]
    return [str(v).strip() for v in value]


def check_lora(config) -> None:
    """LoRA keys only with finetuning_type: lora; their values are possible; peft is installed."""
    if config.finetuning_type != "lora":
        changed = [f"{k}={getattr(config, k)!r}" for k, default in LORA_KEYS.items() if getattr(config, k) != default]
        if changed:
            one = len(changed) == 1
            raise ConfigError(f"{', '.join(changed)} {'configures' if one else 'configure'} finetuning_type: lora, but "
                              f"this config has finetuning_type: {config.finetuning_type}: remove "
                              f"{'it' if one else 'them'} or set finetuning_type: lora.")
        return
    if not isinstance(config.lora_rank, int) or isinstance(config.lora_rank, bool) or config.lora_rank < 1:
        raise ConfigError(f"lora_rank={config.lora_rank!r}: give a positive integer (LLaMA-Factory's default is 8).")
    if config.lora_alpha is not None and (isinstance(config.lora_alpha, bool)
                                          or not isinstance(config.lora_alpha, (int, float)) or config.lora_alpha <= 0):
        raise ConfigError(f"lora_alpha={config.lora_alpha!r}: give a positive number, or leave it unset for "
                          "2 * lora_rank.")
    if not isinstance(config.lora_dropout, (int, float)) or not 0 <= config.lora_dropout < 1:
        raise ConfigError(f"lora_dropout={config.lora_dropout!r}: give a probability in [0, 1).")
    for key in ("lora_target", "additional_target"):
        names = split_names(getattr(config, key))
        if "" in names or (key == "lora_target" and not names):
            raise ConfigError(f"{key}={getattr(config, key)!r} has an empty name: give comma-separated module names "
                              "(e.g. q_proj,v_proj" + (", or all)." if key == "lora_target" else ")."))
    if "all" in split_names(config.lora_target) and len(split_names(config.lora_target)) > 1:
        raise ConfigError(f"lora_target={config.lora_target!r}: all means every linear layer; give it alone.")
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigError("finetuning_type: lora needs peft: pip install 'megatrain[lora]' (or pip install peft).") \
            from None
