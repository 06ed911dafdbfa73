"""Dynamo traces each decoder-layer kind once (option `dynamo_regions`).

Dynamo unrolls the model's `for layer in self.layers` loop and traces every layer's Python again:
at 64 layers of a tiny Llama that is most of the first step. Before the trace, each decoder layer's
`forward` is wrapped in torch's `nested_compile_region` with a `reuse_hash_fn` that returns the
layer's kind key, so Dynamo traces the first layer of a kind and stamps out the others as calls
of the same subgraph (torch's `invoke_subgraph`):

    for layer in self.layers:             h1 = invoke_subgraph(subgraph_0, "subgraph_0", h0, w_q0, ...)
        h = layer(h, cos, sin, mask)  ==>  h2 = invoke_subgraph(subgraph_0, "subgraph_0", h1, w_q1, ...)

passes/inline_dynamo_regions.py puts every call's nodes back in line, under its own layer's module
path, before any other pass: the rest of the pipeline sees the graph the whole-depth trace gives.

The kind key replaces Dynamo's own guards for the stamped-out layers (torch's automatic reuse
refuses transformers' layers: the hub-kernel wrapper writes a global around attention), so it
holds everything a layer's trace can read that differs between layers: its class and every
submodule's class, each parameter's and buffer's shape, dtype and requires_grad, and every plain
attribute (sliding or full attention, NoPE, layer type, MoE or dense). Two things it cannot see
are checked after the trace, and the frame is traced again without regions when either fails:
an attribute it leaves out (`layer_idx`, which differs in every layer) read by the trace (a
guard on it), and a call whose tensor inputs differ in shape or stride from the ones its
subgraph was traced with (the pass compares them; whether an input needs a gradient, its dtype
and rank are part of the call's reuse key).

The wrappers stay on the model's layers (Dynamo's guards check them; removing them would make
every later call recompile). Outside torch.compile `nested_compile_region` calls the forward
unchanged.
"""
from __future__ import annotations

import hashlib
import logging
import re
import types
import weakref

import torch
from torch import nn

log = logging.getLogger(__name__)

#: attributes left out of the kind key because they differ in every layer; a trace that reads one
#: (a guard on it) is not reused (`read_per_layer_attributes`)
PER_LAYER = ("layer_idx",)
_PLAIN = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_MARK = "__megatrain_region_key__"
_MODULE_STATE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
          "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")

#: the fewest decoder layers `dynamo_regions: auto` forms regions for: below it they cost about
#: what they save (a tiny Llama: 1.7 s at 2 layers either way; Kimi-Linear's 4 layers of 3 kinds
#: trace slower with them)
AUTO_MIN_LAYERS = 8

#: the most layer kinds one model may have (torch's default of 8 refuses e.g. a 12-layer stack whose
#: layers all differ)
_MAX_KINDS = 1 << 16

#: models whose regions were found unsound: traced whole from then on (weakly held)
_OFF: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def _value(value, depth: int = 0) -> str:
    """A value's part of the kind key: plain values by value, containers by their items, other
    objects by their type and attributes (two levels), or by identity."""
    if isinstance(value, _PLAIN):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, torch.Tensor):   # (not a parameter or buffer: a constant the trace bakes in)
        return f"tensor@{id(value)}"
    if isinstance(value, nn.Module):   # (not a submodule: transformers' per-layer kernel wrappers)
        return f"module({_digest(value)})" if depth < 3 else f"module@{id(value)}"
    if depth < 3 and isinstance(value, (tuple, list, set, frozenset)):
        items = sorted(map(_value, value)) if isinstance(value, (set, frozenset)) else [_value(v, depth + 1)
                                                                                          for v in value]
        return f"{type(value).__name__}({','.join(items)})"
    if depth < 3 and isinstance(value, dict):
        return "{" + ",".join(f"{k!r}:{_value(v, depth + 1)}" for k, v in sorted(value.items(), key=repr)) + "}"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}@{id(value)}"
    if depth < 2 and type(value).__module__.split(".")[0] != "transformers" and hasattr(value, "__dict__"):
        return f"{type(value).__qualname__}({_value(vars(value), depth + 1)})"
    return f"{type(value).__qualname__}@{id(value)}"   # (a config: one object every layer shares)


def kind_key(layer: nn.Module, path: str | None = None) -> int:
    """The layer's kind: equal for two layers exactly when nothing a trace of their forward can
    read differs between them, `PER_LAYER` attributes aside (module docstring). `path`: the
    layer's own module path (`layers.3`), which strings may name (peft's `target_name`:
    `model.layers.3.self_attn.q_proj`); there it stands for "this layer"."""
    return int(_digest(layer, path), 16)


def _digest(layer: nn.Module, path: str | None = None) -> str:
    parts = []
    for name, mod in layer.named_modules(remove_duplicate=False):
        parts.append(f"[{name}]{type(mod).__module__}.{type(mod).__qualname__}")
        for pname, p in mod._parameters.items():
            parts.append(f"p {pname} " + ("None" if p is None else
                                          f"{tuple(p.shape)}{p.stride()}{p.dtype}{p.device}{p.requires_grad}"))
        for bname, b in mod._buffers.items():
            parts.append(f"b {bname} " + ("None" if b is None else f"{tuple(b.shape)}{b.stride()}{b.dtype}{b.device}"))
        for attr, value in sorted(vars(mod).items()):
            if attr in _MODULE_STATE or attr in PER_LAYER:
                continue
            if attr in _HOOKS:   # (the layer's own hooks run outside its forward, in the outer trace)
                if name and value:
                    parts.append(f"h {attr} {_value(list(value.values()))}")
                continue
            parts.append(f"a {attr} {_value(value)}")
    text = "\n".join(parts)
    if path:
        text = re.sub(rf"\b{re.escape(path)}\b", "<layer>", text)
    return hashlib.sha256(text.encode()).hexdigest()[:15]


def wanted(option: str, num_layers: int, disabled=()) -> bool:
    """Whether option dynamo_regions (auto/always/never) forms regions for `num_layers` layers,
    with the passes `disabled` (`auto` forms none without inline_dynamo_regions; `always` with it
    disabled is refused by the options' check)."""
    if option == "always":
        return True
    return option == "auto" and num_layers >= AUTO_MIN_LAYERS and "inline_dynamo_regions" not in disabled


def _wrapped(layer: nn.Module) -> bool:
    return hasattr(vars(layer).get("forward"), _MARK)


#: a None among a layer's outputs crosses the region as this (torch reuses a subgraph only when
#: it returns tensors: Bamba's layer returns (hidden_states, None)); shape (0, 13) uint8, which no
#: layer returns, and read back statically (its shape and dtype are not data)
_NONE_SHAPE, _NONE_DTYPE = (0, 13), torch.uint8


def _none_mark(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(_NONE_SHAPE, dtype=_NONE_DTYPE, device=like.device)


def _is_none_mark(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == _NONE_DTYPE and tuple(value.shape) == _NONE_SHAPE


def _leaf(value) -> bool:
    return value is None or isinstance(value, (torch.Tensor, torch.SymInt, bool, int, float, str))


def _flatten(args: tuple, kwargs: dict) -> tuple[str, list] | None:
    """A layer call's arguments as (spec, leaves), or None where torch cannot pass them into a
    reused region (a KV cache object, which the layer writes into). torch flattens a call with
    keyword or nested arguments by tracing pytree (a third of a stamped-out layer's cost); flat
    leaves take its fast path. The spec is one string constant ("aN0:;kT2:position_embeddings":
    an argument, then a keyword argument that is a tuple of two), read back while Dynamo traces."""
    spec, flat = [], []
    for where, name, value in [*(("a", "", v) for v in args), *(("k", k, v) for k, v in kwargs.items())]:
        if isinstance(value, (tuple, list)) and all(_leaf(v) for v in value):
            spec.append(f"{where}{'T' if isinstance(value, tuple) else 'L'}{len(value)}:{name}")
            flat.extend(value)
        elif _leaf(value):
            spec.append(f"{where}N0:{name}")
            flat.append(value)
        else:
            return None
    return ";".join(spec), flat


def _unflatten(spec: str, flat: tuple) -> tuple[list, dict]:
    args, kwargs, i = [], {}, 0
    for item in spec.split(";") if spec else []:
        head, name = item.split(":", 1)
        kind, n = head[1], int(head[2:])
        if kind == "N":
            value, i = flat[i], i + 1
        else:
            value, i = (tuple(flat[i:i + n]) if kind == "T" else list(flat[i:i + n])), i + n
        if head[0] == "a":
            args.append(value)
        else:
            kwargs[name] = value
    return args, kwargs


def _reuse_key(key: int):
    """The region's reuse key: the layer's kind, the call's argument structure, its constant
    arguments (which the trace bakes in) and whether each tensor argument needs a gradient and
    its dtype and rank (a frozen embedding's output into layer 0 makes that call a kind of its
    own; shapes and strides are compared after the trace)."""
    def reuse_key(_self, spec, *flat):
        return hash((key, spec, tuple(v for v in flat if v is None or isinstance(v, (bool, int, float, str))),
                     tuple((v.requires_grad, str(v.dtype), v.dim()) for v in flat if isinstance(v, torch.Tensor))))
    return reuse_key


def _region(forward, key: int):
    """`forward` as a compile region whose reuse key is `key`. A function of its own per layer:
    torch keeps the region's options on the function it wraps, so wrapping the class's forward
    itself would give every layer (and every model of that class) the last layer's key."""
    def tensors_only(self, spec, *flat):
        args, kwargs = _unflatten(spec, flat)
        out = forward(self, *args, **kwargs)
        if isinstance(out, tuple):
            like = next(o for o in out if isinstance(o, torch.Tensor))
            return tuple(_none_mark(like) if o is None else o for o in out)
        return out
    # (torch counts the kinds of all layers against one limit, as they share this code: 8 by
    # default, an error beyond it; every layer may be a kind of its own)
    region = torch.compiler.nested_compile_region(tensors_only, reuse_hash_fn=_reuse_key(key),
                                                  max_reuse_entries=_MAX_KINDS)

    def layer_forward(self, *args, **kwargs):
        flat = _flatten(args, kwargs)   # (decided while Dynamo traces: the structure is static)
        if flat is None:
            return forward(self, *args, **kwargs)
        out = region(self, flat[0], *flat[1])
        if isinstance(out, tuple):
            return tuple(None if _is_none_mark(o) else o for o in out)
        return out
    setattr(layer_forward, _MARK, key)
    return layer_forward


def install(model: nn.Module, layers: nn.ModuleList, prefix: str) -> str | None:
    """Wrap each decoder layer's forward in a compile region keyed by its kind (idempotent);
    `prefix`: the stack's path in `model` (`model.layers`). Returns why not, or None."""
    if model in _OFF:
        return _OFF[model]
    for layer in layers:
        if "forward" in vars(layer) and not _wrapped(layer):
            return f"{type(layer).__name__} has a forward of its own on the instance"
    owner: dict[int, int] = {}
    for k, layer in enumerate(layers):
        for p in layer.parameters():
            if owner.setdefault(id(p), k) != k:
                return (f"decoder layers {owner[id(p)]} and {k} share weights (a shared block: each call reaches "
                        "them by its own layer's path)")
    name = prefix.rpartition(".")[2]
    keys = [kind_key(layer, f"{name}.{k}" if name else None) for k, layer in enumerate(layers)]
    for layer, key in zip(layers, keys):
        if _wrapped(layer) and getattr(vars(layer)["forward"], _MARK) == key:
            continue
        layer.forward = types.MethodType(_region(type(layer).forward, key), layer)
    log.debug("megatrain: Dynamo traces %d layer kinds of %d decoder layers once each", len(set(keys)), len(layers))
    return None


def uninstall(model: nn.Module, layers: nn.ModuleList, why: str | None = None) -> None:
    """Take the wrappers off; with `why`, the model is traced whole from now on."""
    for layer in layers:
        if _wrapped(layer):
            del layer.forward
    if why:
        _OFF[model] = why


def read_per_layer_attributes(guard_names, layer_prefix: str) -> list[str]:
    """The `PER_LAYER` attributes of decoder layers the trace read (Dynamo's guards on them, by
    source name such as `L['self'].model.layers[0].self_attn.layer_idx`)."""
    stack = layer_prefix.rpartition(".")[2]
    return [name for name in guard_names
            if any(name.endswith(f".{attr}") or name.endswith(f"'{attr}']") for attr in PER_LAYER)
            and (f".{stack}[" in name or f"'{stack}'" in name)]
