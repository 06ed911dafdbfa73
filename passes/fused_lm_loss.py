"""Compute the causal-LM loss without the logits: the LM head and the cross entropy become one
chunked op, and the graph returns no logits (option `logits="drop"`).

Runs on the Dynamo graph. HuggingFace's `*ForCausalLM.forward` with `labels` traces to

    logits = linear(h, lm_head.weight)                      [B, S, V]   (bf16: 2 B/elem)
    loss   = cross_entropy(logits.float().view(-1, V), shift_labels, ignore_index, reduction)
    output (loss, logits)

and this pass rewrites it to

    loss, dh, dW = megatrain.linear_cross_entropy(h, lm_head.weight, shift_labels, ignore_index,
                                                  reduction, grad_hidden, grad_weight)
    output (loss, None)

Why: at a 150k vocabulary the logits, their fp32 upcast and its gradient are ~10 bytes x tokens x
V (10 GiB at 8k tokens x 128k): the largest tensors of the step and what limits the batch size
once the weights are streamed. The op (megacompile/ir_ops.py; its kernels runtime/kernels/ops.py,
chunked_ce.py) works through [chunk, V] blocks (Triton where it runs, torch math otherwise),
computes the gradients in the same sweep and saves dh [tokens, H] and dW [V, H] for the backward
instead of the logits.
Anything computed after the cross entropy (HF's division by `num_items_in_batch` with
reduction="sum") is untouched. Numerics equal eager's: the same bf16 logits, fp32 softmax,
gradient rounded to the logits dtype.

The contract with the caller: the compiled model's output has `logits=None`. So the pass is
off by default (`logits="keep"`) and on in `megatrain train`, which only reads the loss. It
leaves graphs alone where the logits feed anything but the loss and the output (Gemma's logit
softcapping, a user's extra term), and records why.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from . import PassContext, graph_pass

from ..ir import FUSED_LM_LOSS as REPLACED  # (node.meta tag on the fused op and its loss)


def _is_call(n, op: str, *targets) -> bool:
    return isinstance(n, fx.Node) and n.op == op and n.target in targets


def _upcast_source(n: fx.Node) -> fx.Node | None:
    """`x` for `x.float()` / `x.to(torch.float32)`, else None."""
    if _is_call(n, "call_method", "float") and len(n.args) == 1 and not n.kwargs:
        return n.args[0]
    if _is_call(n, "call_method", "to") and len(n.args) == 2 and n.args[1] == torch.float32 and not n.kwargs:
        return n.args[0]
    return None


def _flatten_source(n: fx.Node, vocab: int) -> fx.Node | None:
    """`x` for `x.view(-1, V)` / `x.reshape(-1, V)`, else None."""
    if _is_call(n, "call_method", "view", "reshape") and not n.kwargs:
        shape = n.args[1:] if len(n.args) > 2 else n.args[1] if len(n.args) == 2 else None
        if tuple(shape or ()) == (-1, vocab):
            return n.args[0]
    return None


def _match(loss: fx.Node):
    """(hidden, weight, labels, ignore_index, reduction, logits) of an LM-head cross entropy, or
    a reason it does not match."""
    ce = (torch.nn.functional.cross_entropy,)
    if not _is_call(loss, "call_function", *ce):
        return None
    kw = dict(loss.kwargs)
    args = list(loss.args)
    if len(args) != 2 or set(kw) - {"ignore_index", "reduction"}:
        return "cross_entropy with class weights, label smoothing or positional options"
    reduction = kw.get("reduction", "mean")
    ignore_index = kw.get("ignore_index", -100)
    if reduction not in ("mean", "sum") or not isinstance(ignore_index, int):
        return f"cross_entropy reduction={reduction!r}"
    flat, labels = args
    ev = flat.meta.get("example_value") if isinstance(flat, fx.Node) else None
    if not isinstance(ev, torch.Tensor) or ev.dim() != 2:
        return "cross_entropy input is not a [tokens, vocab] tensor"
    upcast = _flatten_source(flat, ev.shape[-1])
    logits = _upcast_source(upcast) if upcast is not None else None
    if logits is None:
        return "cross_entropy input is not the fp32 upcast of the logits"
    if not _is_call(logits, "call_function", torch.nn.functional.linear, torch._C._nn.linear):
        return "other ops between the LM head and the loss (e.g. logit softcapping)"
    if len(logits.args) < 2 or (len(logits.args) > 2 and logits.args[2] is not None) or logits.kwargs:
        return "an LM head with a bias"
    hidden, weight = logits.args[:2]
    if weight.op != "placeholder":
        return "LM head weight is computed, not a parameter"
    if len(flat.users) != 1 or len(upcast.users) != 1:
        return "the fp32 logits are used besides the loss"
    if any(u.op != "output" and u is not upcast for u in logits.users):
        return "the logits are used besides the loss (e.g. softcapping)"
    return hidden, weight, labels, ignore_index, reduction, logits


def _requires_grad(n: fx.Node) -> bool:
    ev = n.meta.get("example_value")
    return bool(torch.is_grad_enabled() and isinstance(ev, torch.Tensor) and ev.requires_grad)


def _without(value, dropped: fx.Node):
    """The output structure with `dropped` replaced by None."""
    if value is dropped:
        return None
    if isinstance(value, (tuple, list)):
        return type(value)(_without(v, dropped) for v in value)
    if isinstance(value, dict):
        return {k: _without(v, dropped) for k, v in value.items()}
    return value


@graph_pass("fused_lm_loss", may_write=(REPLACED,), uses=("logits",))
def fused_lm_loss(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.logits != "drop":
        return gm
    from .. import ir_ops  # noqa: F401  (defines torch.ops.megatrain.*)
    reasons = []
    replaced = 0
    for loss in list(gm.graph.nodes):
        found = _match(loss)
        if found is None:
            continue
        if isinstance(found, str):
            reasons.append(found)
            continue
        hidden, weight, labels, ignore_index, reduction, logits = found
        upcast = next(iter(logits.users.keys() - {u for u in logits.users if u.op == "output"}))
        flat = next(iter(upcast.users))
        with gm.graph.inserting_before(loss):
            call = gm.graph.call_function(torch.ops.megatrain.linear_cross_entropy, (
                hidden, weight, labels, ignore_index, reduction, _requires_grad(hidden), _requires_grad(weight)))
            new_loss = gm.graph.call_function(operator.getitem, (call, 0))
        for new in (call, new_loss):
            new.meta.update({k: v for k, v in logits.meta.items() if k in ("nn_module_stack", "source_fn_stack",
                                                                         "stack_trace")})
            new.meta[REPLACED] = True
        if "example_value" in loss.meta:
            new_loss.meta["example_value"] = loss.meta["example_value"]
        loss.replace_all_uses_with(new_loss)
        output = next(n for n in gm.graph.nodes if n.op == "output")
        output.args = _without(output.args, logits)
        for n in (loss, flat, upcast, logits):
            gm.graph.erase_node(n)
        replaced += 1
    if not replaced:
        import warnings
        why = "; ".join(dict.fromkeys(reasons)) or "the model computes no loss in the graph (call it with labels)"
        warnings.warn(f"megatrain option logits='drop': no LM head + cross entropy to fuse ({why}); the logits "
                      "are computed and returned as usual.", stacklevel=2)
    gm.graph.lint()
    gm.recompile()
    ctx.records.append(("fused_lm_loss", "replaced", {"lm_head_cross_entropy": replaced, "not_matched": reasons}))
    return gm
