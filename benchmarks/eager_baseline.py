"""What the benchmarks compare megatrain with: the eager model with per-layer checkpointing."""
from __future__ import annotations

import torch


def checkpoint_every_layer(model: torch.nn.Module) -> None:
    """Non-reentrant torch.utils.checkpoint around each decoder layer (the recomputation megatrain
    does), under the name the installed transformers gives it (the old name warns from 5.2x on)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
