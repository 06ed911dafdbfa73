"""Put megatrain's fused Triton kernels where the model computes RMSNorm and SwiGLU.

Runs on the Dynamo graph (torch-level ops, before AOTAutograd), where a module's ops are still
one contiguous run tagged with the module in `nn_module_stack`:

    x ─to(f32)─pow(2)─mean(-1)─add(eps)─rsqrt─mul─to(dtype)─mul(weight)─▶      (LlamaRMSNorm)
    x ──────── rms_norm(x, weight, eps, offset=0, cast_before_weight=True)[0] ─▶

    silu(gate) * up   ─▶   swiglu(gate, up)                                     (gated MLPs)

AOTAutograd then traces each custom op (megacompile/ir_ops.py; kernels in runtime/kernels/ops.py)
as one node and its backward as one node, and the layer passes treat them like any op. Which RMSNorm modules qualify is
decided by their code, not their name: a module class whose `forward` is, statement for
statement, transformers' LlamaRMSNorm (offset 0, cast to the input dtype before the weight) or
Gemma3RMSNorm (`1 + weight`, cast after), so every "Copied from Llama" norm (Qwen, Mistral,
OLMo, ...) is replaced and a norm with other semantics (Qwen3-Next's gated norm, a norm without
weight) is left alone. The graph's own `eps` constant and weight input are used.

On with option `kernels="triton"` (`"auto"`, the default: on CUDA when triton is installed);
a no-op otherwise. Numerics: the kernels compute in fp32 and round once, as the eager code
does for RMSNorm; for SwiGLU in bf16 the eager code rounds `silu(gate)` to bf16 before the
product, so results can differ by one bf16 step per element (exact in fp32).
"""
from __future__ import annotations

import ast
import functools
import inspect
import operator
import textwrap

import torch
import torch.fx as fx

from . import PassContext, graph_pass

from ..ir import FUSED_KERNEL as REPLACED  # (node.meta tag: which kernel a node calls)


def _code_signature(cls: type) -> str | None:
    """The forward (and `_norm`) of a class as an AST dump without docstrings, or None."""
    parts = []
    for name in ("forward", "_norm"):
        fn = cls.__dict__.get(name)
        if fn is None:
            if name == "forward":
                return None
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):
            return None
        body = tree.body[0].body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
            body = body[1:]   # docstring
        parts.append(name + ":" + "".join(ast.dump(stmt) for stmt in body))
    return "|".join(parts)


@functools.cache
def _rmsnorm_templates() -> dict[str, tuple[float, bool]]:
    """Code signature -> (offset, cast_before_weight) of the RMSNorm forms the kernel implements."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    return {_code_signature(LlamaRMSNorm): (0.0, True), _code_signature(Gemma3RMSNorm): (1.0, False)}


@functools.cache
def _rmsnorm_form(cls: type) -> tuple[float, bool] | None:
    return _rmsnorm_templates().get(_code_signature(cls))


def _module(node: fx.Node) -> tuple[str, type] | None:
    stack = node.meta.get("nn_module_stack")
    return tuple(list(stack.values())[-1]) if stack else None


def _runs(gm: fx.GraphModule):
    """Maximal runs of consecutive call nodes computed by the same (innermost) module call."""
    run, key = [], None
    for n in gm.graph.nodes:
        k = _module(n) if n.op in ("call_function", "call_method") else None
        if k is not None and k == key:
            run.append(n)
            continue
        if run:
            yield key, run
        run, key = ([n], k) if k is not None else ([], None)
    if run:
        yield key, run


def _replace_rmsnorm(gm: fx.GraphModule, key, run: list[fx.Node]) -> bool:
    form = _rmsnorm_form(key[1])
    if form is None:
        return False
    inside = set(run)
    external = [a for n in run for a in n.all_input_nodes if a not in inside]
    weights = [a for a in external if a.op == "placeholder" and "parameters_weight" in a.name]
    xs = [a for a in dict.fromkeys(external) if a not in weights]
    # eps: the constant added to the mean of squares (Gemma's `1.0 + weight` is another add)
    eps = [a for n in run if n.target in (operator.add, torch.add)
           and any(isinstance(b, fx.Node) and b.target in ("mean", torch.mean) for b in n.args)
           for a in n.args if isinstance(a, float)]
    out = run[-1]
    if len(set(weights)) != 1 or len(xs) != 1 or len(eps) != 1:
        return False
    if any(u not in inside for n in run[:-1] for u in n.users):
        return False   # an intermediate value is used outside the norm
    offset, cast_before_weight = form
    with gm.graph.inserting_before(out):
        call = gm.graph.call_function(torch.ops.megatrain.rms_norm,
                                      (xs[0], weights[0], eps[0], offset, cast_before_weight))
        y = gm.graph.call_function(operator.getitem, (call, 0))
    for new in (call, y):
        new.meta.update({k: v for k, v in out.meta.items()
                         if k in ("nn_module_stack", "source_fn_stack", "stack_trace")})
        new.meta[REPLACED] = "rms_norm"
    if "example_value" in out.meta:
        y.meta["example_value"] = out.meta["example_value"]
    out.replace_all_uses_with(y)
    for n in reversed(run):
        gm.graph.erase_node(n)
    return True


def _is_silu(n: fx.Node) -> bool:
    return (n.op == "call_function" and n.target in (torch.nn.functional.silu, torch.ops.aten.silu.default)
            and not n.kwargs.get("inplace", False) and len(n.args) == 1)


def _replace_swiglu(gm: fx.GraphModule, mul: fx.Node) -> bool:
    if mul.op != "call_function" or mul.target not in (operator.mul, torch.mul) or len(mul.args) != 2 or mul.kwargs:
        return False
    a, b = mul.args
    silu, up = (a, b) if isinstance(a, fx.Node) and _is_silu(a) else (b, a)
    if not (isinstance(silu, fx.Node) and _is_silu(silu) and isinstance(up, fx.Node)) or len(silu.users) != 1:
        return False
    gate = silu.args[0]
    g, u = gate.meta.get("example_value"), up.meta.get("example_value")
    if not (isinstance(g, torch.Tensor) and isinstance(u, torch.Tensor)) or g.shape != u.shape or g.dtype != u.dtype:
        return False   # the kernel takes equal shapes and dtypes (no broadcasting)
    with gm.graph.inserting_before(mul):
        new = gm.graph.call_function(torch.ops.megatrain.swiglu, (gate, up))
    new.meta.update({k: v for k, v in mul.meta.items() if k in ("nn_module_stack", "source_fn_stack", "stack_trace",
                                                                "example_value")})
    new.meta[REPLACED] = "swiglu"
    mul.replace_all_uses_with(new)
    gm.graph.erase_node(mul)
    gm.graph.erase_node(silu)
    return True


@graph_pass("fused_kernels", may_write=(REPLACED,), uses=("kernels",))
def fused_kernels(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.kernels != "triton":
        return gm
    from .. import ir_ops  # noqa: F401  (defines torch.ops.megatrain.*)
    counts = {"rms_norm": 0, "swiglu": 0}
    for key, run in list(_runs(gm)):
        counts["rms_norm"] += _replace_rmsnorm(gm, key, run)
    for n in list(gm.graph.nodes):
        counts["swiglu"] += _replace_swiglu(gm, n)
    gm.graph.lint()
    gm.recompile()
    ctx.records.append(("fused_kernels", "replaced", counts))
    return gm
