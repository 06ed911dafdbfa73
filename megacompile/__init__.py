"""megatrain: train LLMs far larger than accelerator memory with `torch.compile`.

    import torch, megacompile
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ...
    print(megacompile.stats(cmodel))
"""
from .backend import megatrain_backend, stats
from .errors import (CannotFitError, ConfigError, GraphBreakError, InternalError, MegatrainError, ResidencyError,
                     TrainingError, UnsupportedModelError)
from .options import Options
from .runtime.adamw import HostAdamW
from .runtime.store import master_weight
from . import compile_start

compile_start.register()


def reset() -> None:
    """torch._dynamo.reset(), keeping megatrain's compile callbacks (which Dynamo's reset drops:
    compile_start.py): use it between compiles of megatrain models."""
    import torch
    torch._dynamo.reset()
    compile_start.register()

__all__ = [
    "reset", "megatrain_backend", "stats", "Options", "master_weight", "HostAdamW",
    "MegatrainError", "UnsupportedModelError", "GraphBreakError", "ConfigError", "ResidencyError", "CannotFitError",
    "TrainingError", "InternalError",
]
__version__ = "0.1.0"
