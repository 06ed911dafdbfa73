"""LLaMA-Factory's freeze tuning (`finetuning_type: freeze`): which parameters train.

    select(model, trainable_layers=2, modules="all", extra=None)
      -> Selection(layers=range(2, 4), patterns=(".2.", ".3."), trainable=("model.layers.2...", ...))
    freeze(model, 2, "mlp", "embed_tokens")   sets requires_grad, returns a one-line summary

The selection is LLaMA-Factory 0.9.5's (model/adapter.py, _setup_freeze_tuning), checked against
its own output in tests/test_freeze.py:
  - freeze_trainable_layers n > 0 trains the last n decoder layers, n < 0 the first -n; more
    than the model has means all of them (LF clamps, it does not refuse);
  - freeze_trainable_modules: `all`, or names of modules inside a layer (the name after the layer
    index: self_attn, mlp, input_layernorm, ...), comma-separated;
  - freeze_extra_modules: names of modules outside the layers (embed_tokens, norm, lm_head).
A parameter trains when one of the patterns `.{i}.{module}` (`.{i}.` for all) or an extra
module's name is a substring of its name, exactly as LF matches. So `norm` in
freeze_extra_modules also trains every layer's input_layernorm / post_attention_layernorm, as in
LF. Unknown module names are ConfigErrors that list the valid ones; they are checked on the
meta model, before any weight loads.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ...errors import ConfigError
from ..hparams.finetuning_args import split_names

_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class Selection:
    layers: range                 # the decoder layers that train (some or all of their modules)
    patterns: tuple[str, ...]     # substrings of the names of the parameters that train
    trainable: tuple[str, ...]    # the names of the parameters that train, in the model's order


def num_layers(model: nn.Module) -> int:
    """The decoder layers of the model (the text config's, for a composite model), as LF counts them."""
    config = getattr(model.config, "text_config", None) or model.config
    for key in ("num_hidden_layers", "num_layers", "n_layer"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    raise ConfigError(f"finetuning_type: freeze: {model.config.model_type} has no num_hidden_layers in its config, "
                      "so its decoder layers cannot be chosen; use finetuning_type: full.")


def module_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """(inside, outside): the module names freeze_trainable_modules and freeze_extra_modules may
    give. Inside: the name right after the index `.0.` (or `.1.`, a model whose first layer has
    none) of a parameter name; outside: the module owning a parameter whose name has no index."""
    inside, outside = set(), set()
    for name, _ in model.named_parameters():
        for index in (".0.", ".1."):   # (LF looks at layer 0, else layer 1, of the first `.N.` it splits on)
            if index in name:
                inside.add(name.split(index)[-1].split(".")[0])
                break
        if not _INDEX.search(name):
            outside.add(name.split(".")[-2] if "." in name else name)
    return sorted(inside), sorted(outside)


def _check_names(key: str, given: list[str], valid: list[str], allow_all: bool) -> None:
    for name in given:
        if not (allow_all and name == "all") and name not in valid:
            shown = repr(name) if name else "an empty name"
            raise ConfigError(f"{key}: {shown} is not a module of this model; choose from "
                              f"{', '.join((['all'] if allow_all else []) + valid)} (comma-separated).")


def select(model: nn.Module, trainable_layers: int, modules: str, extra: str | None) -> Selection:
    """The parameters LF's freeze tuning trains (see the module docstring); ConfigError for a
    module name the model does not have."""
    n = num_layers(model)
    layers = range(max(0, n - trainable_layers), n) if trainable_layers > 0 else range(min(-trainable_layers, n))
    inside, outside = module_names(model)
    wanted, extra_names = split_names(modules), split_names(extra)
    _check_names("freeze_trainable_modules", wanted, inside, allow_all=True)
    _check_names("freeze_extra_modules", extra_names, outside, allow_all=False)
    patterns = [f".{i}." + ("" if name == "all" else name) for name in wanted for i in layers] + extra_names
    trainable = tuple(name for name, _ in model.named_parameters() if any(p in name for p in patterns))
    return Selection(layers, tuple(patterns), trainable)


def _span(layers: range) -> str:
    if not layers:
        return "no decoder layer"
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"


def freeze(model: nn.Module, trainable_layers: int, modules: str, extra: str | None) -> str:
    """Freeze every parameter of `model` but LF's selection (requires_grad); returns the line the
    trainer prints. ConfigError when nothing would train."""
    chosen = select(model, trainable_layers, modules, extra)
    if not chosen.trainable:
        raise ConfigError(f"finetuning_type: freeze with freeze_trainable_layers={trainable_layers} and "
                          f"freeze_extra_modules={extra!r} trains no parameter: give freeze_trainable_layers other "
                          "than 0, or name modules in freeze_extra_modules (e.g. embed_tokens).")
    keep = set(chosen.trainable)
    for name, p in model.named_parameters():
        p.requires_grad_(name in keep)
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n = num_layers(model)
    asked = (f" (freeze_trainable_layers={trainable_layers}: the model has {n})"
             if abs(trainable_layers) > n else "")
    return (f"[megatrain] freeze: trains {_span(chosen.layers)} of {n}{asked}, modules {modules}"
            + (f", and {extra}" if extra else "") + f": {trained / 1e6:.2f}M of {total / 1e6:.2f}M parameters "
            f"({100 * trained / max(total, 1):.1f}%); the others stream without masters, moments or gradients")
