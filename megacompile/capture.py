"""What Dynamo hands the backend, made explicit: the root model, each graph input's role and
name, and the decoder-layer index of every weight.

Dynamo lifts parameters and buffers into graph inputs (`example_inputs` holds the real
`nn.Parameter` objects). We find the root module in the frame being compiled, map inputs to
fully qualified names by `id()`, and find the decoder stack as the `nn.ModuleList` holding the
most parameters. Layer kinds are NOT decided here: they come from the graph (see
`passes/dedupe_bodies.py`); this module only says which stack entry a weight belongs to.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from .errors import GraphBreakError, InternalError, UnsupportedModelError

#: Group ids: 0 = weights used before the first decoder layer (embeddings), 1..N = decoder
#: layers, N+1 = weights used after the last layer (final norm, LM head).
EMBED_GROUP = 0


@dataclass
class GraphInput:
    index: int                  # position in example_inputs == AOT flat-arg position
    kind: str                   # "param" | "buffer" | "input" | "symint"
    name: str                   # FQN for params/buffers, Dynamo source name for inputs
    group: int | None = None    # weight group (params only)
    aliases: tuple[str, ...] = ()  # other FQNs of a tied parameter


@dataclass
class ModelCapture:
    root_ref: "weakref.ref[nn.Module]"  # weak: compiled programs must not keep the model alive
    inputs: list[GraphInput]
    layer_prefix: str
    num_layers: int
    #: group of each alias FQN of a tied weight, by where its module runs (a tied LM head's
    #: `lm_head.weight` belongs to the head even though the parameter's group is the embedding)
    alias_groups: dict[str, int] = field(default_factory=dict)

    @property
    def root(self) -> nn.Module:
        root = self.root_ref()
        if root is None:  # pragma: no cover
            raise RuntimeError("the compiled model no longer exists")
        return root

    @property
    def head_group(self) -> int:
        return self.num_layers + 1

    def module_groups(self) -> dict[str, int]:
        """Module FQN -> weight group, for every module whose weights all share one group."""
        groups: dict[str, set[int]] = {}
        for inp in self.inputs:
            if inp.kind != "param":
                continue
            for name in (inp.name, *inp.aliases):
                parts = name.split(".")
                for k in range(1, len(parts)):
                    groups.setdefault(".".join(parts[:k]), set()).add(self.alias_groups.get(name, inp.group))
        return {m: g.pop() for m, g in groups.items() if len(g) == 1}

    def group_name(self, group: int) -> str:
        if group == EMBED_GROUP:
            return "embed"
        if group == self.head_group:
            return "head"
        return f"{self.layer_prefix}.{group - 1}"


def current_tx():
    """Dynamo's instruction translator for the frame being compiled (None outside a compile)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
    except ImportError:  # pragma: no cover - older torch
        return None
    return InstructionTranslator.current_tx()


def _current_frame_locals() -> dict[str, Any] | None:
    tx = current_tx()
    if tx is None:
        return None
    root_tx = getattr(getattr(tx, "output", None), "root_tx", None) or tx  # the outermost frame
    return root_tx.f_locals


def _compile_reason():
    return getattr(getattr(current_tx(), "output", None), "compile_subgraph_reason", None)


def _modules_in(value: Any, depth: int = 0):
    if isinstance(value, nn.Module):
        yield value
    elif depth < 2 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _modules_in(v, depth + 1)
    elif depth < 2 and isinstance(value, dict):
        for v in value.values():
            yield from _modules_in(v, depth + 1)


def outermost_compiled_module() -> nn.Module | None:
    """The outermost OptimizedModule (what torch.compile returned) being called on the stack."""
    frame, found = sys._getframe(1), None
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch._dynamo.eval_frame.OptimizedModule):
            found = owner
        frame = frame.f_back
    return found


def compiled_model_in_stack() -> nn.Module | None:
    """The model the user passed to torch.compile."""
    compiled = outermost_compiled_module()
    return None if compiled is None else compiled._orig_mod


def find_root_module(example_inputs: Sequence[Any]) -> nn.Module:
    """The module whose parameters the graph reads: the `self` of the compiled forward."""
    param_ids = {id(t) for t in example_inputs if isinstance(t, nn.Parameter)}
    f_locals = _current_frame_locals() or {}
    best, best_hits = None, 0
    for mod in _modules_in(f_locals):
        hits = sum(1 for p in mod.parameters() if id(p) in param_ids)
        if hits > best_hits:
            best, best_hits = mod, hits
    if best is None:
        raise UnsupportedModelError(
            "megatrain compiles a whole nn.Module: call torch.compile(model, backend='megatrain') on the "
            "HuggingFace model itself, whose parameters must be read by the compiled forward."
        )
    return best


def find_layer_stack(root: nn.Module, param_ids: set[int] | None = None) -> tuple[str, nn.ModuleList]:
    """The decoder stack: the ModuleList of blocks that holds the most parameters (of those the
    graph reads, when `param_ids` is given: a VLM's vision blocks are not in the language graph)."""
    best_name, best, best_count = None, None, 0
    for name, mod in root.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            count = sum(p.numel() for p in mod.parameters() if param_ids is None or id(p) in param_ids)
            if count > best_count:
                best_name, best, best_count = name, mod, count
    if best is None:
        raise UnsupportedModelError(
            f"could not find the decoder layers of {type(root).__name__}: megatrain streams weights layer "
            "by layer and needs the blocks in an nn.ModuleList (as every HuggingFace decoder-only model "
            "has, e.g. model.layers). Wrap your blocks in an nn.ModuleList."
        )
    return best_name, best


def check_model(root: nn.Module, training: bool, use_cache: Any) -> None:
    """Refuse models and calls megatrain cannot train, before any work is done."""
    config = getattr(root, "config", None)
    model_type = getattr(config, "model_type", type(root).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(root).__name__} (model_type={model_type!r}) is an encoder-decoder model; megatrain trains "
            "decoder-only causal LMs (Llama, Qwen, Mistral, Gemma, Mixtral, DeepSeek, ...). "
            "Use a *ForCausalLM model."
        )
    # Decoder-only LMs mark their attention causal; an encoder's attention is bidirectional
    # (BERT, RoBERTa, ModernBERT ...). Hybrid layers without attention modules carry no flag.
    flags = [m.is_causal for m in root.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    if flags and not any(flags) and not getattr(config, "is_decoder", False):
        raise UnsupportedModelError(
            f"{type(root).__name__} (model_type={model_type!r}) is an encoder-only model (bidirectional "
            "attention); megatrain trains decoder-only causal LMs (Llama, Qwen, Mistral, Gemma, Mixtral, "
            "DeepSeek, ...) and the language stack of VLMs. Use a *ForCausalLM model."
        )
    if training and use_cache:
        raise UnsupportedModelError(
            "use_cache=True during training: the KV cache would keep every layer's keys and values on the "
            "device and is only useful for generation. Pass use_cache=False to the model call "
            "(or set model.config.use_cache = False)."
        )


def _effective_use_cache(root: nn.Module, f_locals: dict[str, Any]) -> Any:
    kwargs = f_locals.get("kwargs") if isinstance(f_locals.get("kwargs"), dict) else {}
    if "use_cache" in f_locals:
        value = f_locals["use_cache"]
    else:
        value = kwargs.get("use_cache", None)
    if value is None:
        config = getattr(root, "config", None)
        value = getattr(config, "use_cache", None)
        if value is None and hasattr(config, "get_text_config"):  # VLMs: the language model's config
            value = getattr(config.get_text_config(decoder=True), "use_cache", False)
    return bool(value)


_READ_UP_TO: list = [None]   # the newest Dynamo compilation record an error has read


def _mark_records_read() -> None:
    records = getattr(torch._dynamo.utils, "_compilation_metrics", ())
    _READ_UP_TO[0] = records[-1] if records else None


def _break_site(model: nn.Module) -> tuple[str, str, str]:
    """(reason, "file:line", place) of the graph break Dynamo recorded for this model."""
    records = list(getattr(torch._dynamo.utils, "_compilation_metrics", ()))
    # The records are process-wide: those up to the last one an earlier error read are an
    # earlier model's (a stale break site would point the user at the wrong code).
    if _READ_UP_TO[0] is not None and any(r is _READ_UP_TO[0] for r in records):
        records = records[next(i for i, r in enumerate(records) if r is _READ_UP_TO[0]) + 1:]
    failures = [r for r in records if getattr(r, "fail_user_frame_filename", None)]
    owners = {}
    for name, mod in model.named_modules():
        fn = mod.__dict__.get("forward") or type(mod).forward
        code = getattr(fn, "__code__", None)
        if code is not None:
            owners.setdefault(code.co_filename, []).append((name, code))

    def owners_of(rec):
        lines = []
        for name, code in owners.get(rec.fail_user_frame_filename, []):
            last = max((ln for _, _, ln in code.co_lines() if ln is not None), default=code.co_firstlineno)
            if code.co_firstlineno <= rec.fail_user_frame_lineno <= last:
                lines.append(name)
        return lines

    rec, names = next(((r, n) for r in reversed(failures) if (n := owners_of(r))),
                      (failures[-1], []) if failures else (None, []))
    if rec is None:
        return "Dynamo split the model into several graphs", "", ""
    reason = (rec.fail_reason or "").split("\n")[0]
    site = f"{rec.fail_user_frame_filename}:{rec.fail_user_frame_lineno}"
    try:
        prefix, _ = find_layer_stack(model)
    except UnsupportedModelError:
        prefix = None
    layers = sorted({n for n in names if prefix and n.startswith(prefix + ".")})
    if layers:
        idx = sorted({n[len(prefix) + 1:].split(".")[0] for n in layers}, key=int)
        which = f"{prefix}.{idx[0]}" if len(idx) == 1 else f"{prefix}.{{{','.join(idx)}}}"
        place = f"inside decoder layer {which} ({', '.join(layers[:3])}{', ...' if len(layers) > 3 else ''})"
    elif names:
        place = f"in {names[0] or type(model).__name__}"
    else:
        place = ""
    return reason, site, place


def raise_graph_break(model: nn.Module, reason=None, facts: dict | None = None, prepared: bool = False) -> None:
    """Raise the error for a graph break in `model`: the user's GraphBreakError saying what to
    change, or an InternalError (`facts`: the compile's, for the report) when the break is in
    something megatrain prepared. `prepared`: the compile began with megatrain's start callback
    (compile_start.prepared_this_compile), which lifts low-precision parameters' fp32 gradients."""
    try:
        _raise_graph_break(model, reason, facts, prepared)
    finally:
        _mark_records_read()


#: Dynamo's reason for wrapping a tensor whose .grad has another dtype
GRAD_DTYPE_BREAK = "dtype mismatch between tensor and its gradient"


def _our_source_dirs() -> tuple[Path, ...]:
    """The folders of megatrain's own Python files (front end, passes, runtime)."""
    from . import passes, runtime
    return tuple(Path(d).resolve() for m in (sys.modules[__package__], passes, runtime) for d in m.__path__)


def _megatrain_made(why: str, site: str, prepared: bool) -> str | None:
    """What megatrain made that a graph break is in, or None when it is in the user's model."""
    if GRAD_DTYPE_BREAK in why:
        if prepared:   # (else the user's torch._dynamo.reset() dropped the callbacks)
            return ("a low-precision parameter whose fp32 gradient megatrain keeps on it (the compile-start callback "
                    "should have lifted it for the trace: megacompile/compile_start.py)")
    file = site.rsplit(":", 1)[0] if site else ""
    if file and any(Path(file).resolve().is_relative_to(d) for d in _our_source_dirs()):
        return f"megatrain's own code ({site})"
    return None


def _raise_graph_break(model: nn.Module, reason=None, facts: dict | None = None, prepared: bool = False) -> None:
    if reason is not None and getattr(reason, "user_stack", None):
        frame = reason.user_stack[-1]
        why = str(getattr(reason, "reason", "")).split("\n")[0]
        site = f"{frame.filename}:{frame.lineno}"
        _, _, place = _break_site(model)
    else:
        why, site, place = _break_site(model)
    # A VLM always needs megacompile.vlm, whatever broke: checked first, since the site comes from
    # Dynamo's failure records, which may still hold an earlier model's failure.
    from .vlm import is_vlm
    if is_vlm(model):
        raise GraphBreakError(
            f"{type(model).__name__} is a vision-language model: its vision tower and multimodal positions cannot "
            f"be captured in one graph (graph break {place}{' at ' + site if site else ''}: {why}). Compile it with "
            "megacompile.vlm.compile(model, vision='frozen' or 'train', options=...): the language stack is "
            "compiled by megatrain and the vision tower runs eagerly on the device (after a failed compile call "
            "torch._dynamo.reset()).")
    if "torch/utils/hooks.py" in (site or ""):
        from .output_hooks import install_requested_hooks
        if install_requested_hooks(model):
            raise GraphBreakError(
                f"{type(model).__name__}: transformers' output-capturing hooks (router logits, hidden states or "
                "attentions, asked for by the config) were not installed before Dynamo traced the model, most "
                "likely because torch._dynamo.reset() ran after megacompile was imported. megatrain has installed "
                "them now: call torch._dynamo.reset() (Dynamo keeps the split frames otherwise) and call the model "
                "again.")
        raise GraphBreakError(
            f"{type(model).__name__} asked for router logits, hidden states or attentions "
            "(output_router_logits / output_hidden_states / output_attentions), which transformers collects "
            "with forward hooks it registers on the first call that asks for them; Dynamo cannot trace that "
            "registration (graph break at " + site + "). megatrain installs them before tracing when the model's "
            "config asks for them: set e.g. model.config.output_router_logits = True instead of passing the flag "
            "in the call, or run the model once eagerly before compiling it (e.g. one forward under "
            "torch.no_grad()); after a failed compile also call torch._dynamo.reset().")
    ours = _megatrain_made(why, site, prepared)
    if ours is not None:
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
        raise InternalError(f"Dynamo could not capture {type(model).__name__} as one graph: graph break {place}"
                            f"{' at ' + site if site else ''} ({why}), in {ours}",
                            {"model": type(model).__name__, "dtypes": ",".join(dtypes), **(facts or {})})
    if GRAD_DTYPE_BREAK in why:
        raise GraphBreakError(
            f"Dynamo could not capture {type(model).__name__} as one graph ({why}{' at ' + site if site else ''}): "
            "torch._dynamo.reset() dropped megatrain's compile callbacks, which keep the fp32 gradients of bf16/fp16 "
            "weights out of Dynamo's way while it traces. Call megacompile.reset() instead of torch._dynamo.reset() "
            "(or megacompile.compile_start.register() after it).")
    raise GraphBreakError(
        f"Dynamo could not capture {type(model).__name__} as one graph: graph break {place}"
        f"{' at ' + site if site else ''} ({why}). megatrain needs the whole forward in one graph to schedule "
        "weight transfers; replace the op Dynamo cannot trace (e.g. .item(), .tolist(), print, "
        "data-dependent Python control flow, torch._dynamo.graph_break()) or wrap it in a "
        "torch.library.custom_op. TORCH_LOGS=graph_breaks shows every break."
    )


_LAYER_RE_CACHE: dict[str, re.Pattern] = {}


def _layer_group(name: str, prefix: str) -> int | None:
    """Weight group of a parameter FQN inside the decoder stack `prefix` (layer k -> k + 1)."""
    layer_re = _LAYER_RE_CACHE.setdefault(prefix, re.compile(rf"^{re.escape(prefix)}\.(\d+)\."))
    m = layer_re.match(name)
    return int(m.group(1)) + 1 if m else None


def capture_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], facts: dict | None = None,
                   prepared: bool = False) -> tuple[ModelCapture, dict[int, nn.Parameter]]:
    """Map each graph input to its role, name and weight group; also return the parameters
    by flat index (for the weight store, which holds them weakly). `facts`: what a bug report of
    a graph break megatrain caused should say (the compile options); `prepared`: raise_graph_break's."""
    top = compiled_model_in_stack()
    if top is not None:
        check_model(top, training=False, use_cache=False)
    params_here = any(isinstance(t, nn.Parameter) for t in example_inputs)
    root = find_root_module(example_inputs) if params_here or top is None else None
    if top is not None and root is not top:
        raise_graph_break(top, facts=facts, prepared=prepared)  # Dynamo is compiling a frame nested inside the model
    reason = _compile_reason()
    if getattr(reason, "graph_break", False):
        raise_graph_break(root, reason, facts, prepared)
    f_locals = _current_frame_locals() or {}
    check_model(root, training=root.training and torch.is_grad_enabled(),
                use_cache=_effective_use_cache(root, f_locals))
    prefix, stack = find_layer_stack(root, {id(t) for t in example_inputs if isinstance(t, nn.Parameter)})
    num_layers = len(stack)

    param_names: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        param_names.setdefault(id(p), []).append(name)
    buffer_names = {id(b): n for n, b in root.named_buffers(remove_duplicate=False)}

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs: list[GraphInput] = []
    params: dict[int, nn.Parameter] = {}
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(value, nn.Parameter) and id(value) in param_names:
            names = param_names[id(value)]
            group = next((g for n in names if (g := _layer_group(n, prefix)) is not None), None)
            inputs.append(GraphInput(i, "param", names[0], group, tuple(names[1:])))
            params[i] = value
        elif isinstance(value, torch.Tensor) and id(value) in buffer_names:
            inputs.append(GraphInput(i, "buffer", buffer_names[id(value)]))
        elif isinstance(value, torch.Tensor):
            inputs.append(GraphInput(i, "input", node.name))
        else:
            inputs.append(GraphInput(i, "symint", node.name))

    capture = ModelCapture(weakref.ref(root), inputs, prefix, num_layers)
    _assign_outer_groups(capture, gm, placeholders)
    return capture, params


def _assign_outer_groups(capture: ModelCapture, gm: torch.fx.GraphModule, placeholders) -> None:
    """Weights outside the stack go to the embed group if first used before layer 0, else head."""
    order = {n: k for k, n in enumerate(gm.graph.nodes)}

    def first_use(node) -> int:
        return min((order[u] for u in node.users), default=len(order))

    layer0 = [placeholders[inp.index] for inp in capture.inputs if inp.kind == "param" and inp.group == 1]
    layer0_start = min((first_use(n) for n in layer0), default=len(order))
    for inp in capture.inputs:
        if inp.kind == "param" and inp.group is None:
            before = first_use(placeholders[inp.index]) < layer0_start
            inp.group = EMBED_GROUP if before else capture.head_group
    # aliases of tied weights: the group of the module that uses them under that name
    from .passes.layer_regions import module_path
    for inp in capture.inputs:
        if inp.kind != "param" or not inp.aliases:
            continue
        for alias in inp.aliases:
            layer = _layer_group(alias, capture.layer_prefix)
            if layer is not None:
                capture.alias_groups[alias] = layer
                continue
            module = alias.rpartition(".")[0]
            uses = [order[u] for u in placeholders[inp.index].users
                    if (module_path(u) or "") == module or (module_path(u) or "").startswith(module + ".")]
            if uses:
                capture.alias_groups[alias] = EMBED_GROUP if min(uses) < layer0_start else capture.head_group
