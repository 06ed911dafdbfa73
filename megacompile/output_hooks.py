"""transformers' output-capturing hooks, installed before Dynamo traces a megatrain model.

transformers collects router logits (the MoE load-balancing loss), hidden states and attentions
with forward hooks that it registers on the first call asking for them. Dynamo cannot trace that
registration (`register_forward_hook` breaks the graph), so a model whose config enables
`output_router_logits` would split into several graphs on its first compiled call. The Dynamo
compile-start callback (compile_start.py) installs those hooks first, for models compiled with
`backend="megatrain"` whose config asks for any captured output; the graph then holds the hooks
like any other module code and the auxiliary loss trains as in eager mode.

A flag passed only in the call (`model(..., output_router_logits=True)` with the config flag
off) is not visible here; that case keeps the error with its recipe (`capture.raise_graph_break`),
as does a compile right after `torch._dynamo.reset()` (which drops Dynamo's callbacks; the
backend registers this one again, and installs the hooks itself when it meets the break, so
after another `torch._dynamo.reset()` the next call compiles as one graph).
"""
from __future__ import annotations

import torch


def install_requested_hooks(model: torch.nn.Module) -> int:
    """Install the capturing hooks of every transformers (sub)model whose config asks for one of
    its capturable outputs; returns how many (sub)models ask (all of them hooked now)."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, maybe_install_capturing_hooks
    except ImportError:  # pragma: no cover - transformers without output capturing
        return 0
    count = 0
    for module in model.modules():
        config = getattr(module, "config", None)
        flags = _CAN_RECORD_REGISTRY.get(module) if config is not None else {}
        if flags and any(getattr(config, f"output_{k}", False) for k in flags):
            maybe_install_capturing_hooks(module)  # (a no-op when installed)
            count += 1
    return count
