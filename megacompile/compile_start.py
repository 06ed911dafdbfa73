"""What must change on a model before Dynamo traces it, done by a Dynamo compile-start callback.

Dynamo calls its start callbacks before it traces a frame. For the outermost module compiled with
`backend="megatrain"` this one
  * installs transformers' output-capturing hooks the config asks for (output_hooks.py): their
    registration cannot be traced, and the router logits' auxiliary loss needs them;
  * selects megatrain's segment attention (attention.py) unless the compile options say
    `attention="transformers"`: transformers' SDPA path builds a [batch, 1, seq, seq] mask under
    tracing; the segment path never does. A model segment attention cannot run keeps its own.

`torch._dynamo.reset()` drops Dynamo's callbacks; `register()` runs on import of megacompile and
again in the backend. A compile right after a reset misses both: the backend then installs the
hooks itself when it meets their graph break, and warns that the graph in hand keeps
transformers' attention (`late`; Dynamo does not guard on the implementation, so selecting it
then would not recompile the graph).
"""
from __future__ import annotations

import logging

import torch

from . import attention, output_hooks
from .capture import outermost_compiled_module

log = logging.getLogger(__name__)


def _megatrain_wrapper(compiled):
    """torch.compile's wrapper of the backend when it is megatrain's (it holds the options), else None."""
    obj = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None)
    for _ in range(8):
        if obj is None:
            return None
        name = getattr(obj, "compiler_name", None)
        if isinstance(name, str):
            return obj if name == "megatrain" else None
        obj = getattr(obj, "_torchdynamo_orig_backend", None)
    return None


def _attention_option(wrapper) -> str:
    options = (getattr(wrapper, "kwargs", None) or {}).get("options") or {}
    value = options.get("attention", "segments") if isinstance(options, dict) else "segments"
    return value if isinstance(value, str) else "segments"   # (a wrong value is refused by the backend)


def prepare(model: torch.nn.Module, attention_choice: str = "segments") -> None:
    """Make `model` ready to be traced by megatrain: hooks, and the attention implementation."""
    output_hooks.install_requested_hooks(model)
    if attention_choice == "segments":
        why = attention.select(model)
        if why:
            log.info("megatrain: %s keeps transformers' attention (%s)", type(model).__name__, why)


def late(model: torch.nn.Module, attention_choice: str) -> None:
    """From the backend: warn when the compile-start callback could not select segment attention
    for a model it would have selected it for (a compile right after `torch._dynamo.reset()`)."""
    if attention_choice != "segments" or attention.why_not(model) is not None:
        return
    if model.config.get_text_config(decoder=True)._attn_implementation != attention.NAME:
        log.warning("megatrain: %s was traced before megatrain could select its segment attention (a compile right "
                    "after torch._dynamo.reset(), which drops megatrain's compile-start callback): it keeps "
                    "transformers' attention, whose mask grows with seq x seq. Use "
                    "megacompile.reset() instead of torch._dynamo.reset() (or call "
                    "megacompile.compile_start.register() after it), before compiling.",
                    type(model).__name__)


def _on_compile_start(_args) -> None:
    compiled = outermost_compiled_module()
    wrapper = _megatrain_wrapper(compiled) if compiled is not None else None
    if wrapper is not None:
        prepare(compiled._orig_mod, _attention_option(wrapper))


def register() -> None:
    """Register the compile-start callback if it is not registered (idempotent)."""
    handler = getattr(torch._dynamo, "callback_handler", None)
    if handler is not None and _on_compile_start not in handler.start_callbacks:
        handler.register_start_callback(_on_compile_start)


def unregister() -> None:
    """Remove the callback (torch._dynamo.reset() does the same)."""
    handler = getattr(torch._dynamo, "callback_handler", None)
    if handler is not None and _on_compile_start in handler.start_callbacks:
        handler.remove_start_callback(_on_compile_start)
