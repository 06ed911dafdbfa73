"""Each decoder layer of the Dynamo graph becomes one call of its layer kind's subgraph, so
AOTAutograd traces and partitions every kind once, not every layer.

Runs last on the Dynamo graph (after tag_weights and layer_regions have given every node its
weight group). The nodes of layer g are cut out into a GraphModule; layers whose cut-out graphs
are equal (same code after renaming, same input shapes, dtypes and strides) share one, and each
layer calls it through torch's `invoke_subgraph` higher-order op:

    h1 = layer_0(h0, cos, sin, w_q0, ...)          r = invoke_subgraph(mt_layer_kind_0, "mt_kind_0_<hash>",
    h2 = layer_1(h1, cos, sin, w_q1, ...)   ==>                         h0, cos, sin, w_q0, ...)
                                                   h1 = r[0]; r2 = invoke_subgraph(mt_layer_kind_0, ...)

AOTAutograd then traces each kind's joint once (torch caches it by the identifier) and hands
its joint to the backend's partition function once (which recomputes the whole layer in the
backward: the layer-boundary policy of recompute_boundaries.py); the forward and backward graphs
it returns call the partitioned subgraphs, and inline_layer_regions.py puts their nodes back in
line, each under its own layer's module path (the subgraph's paths say `<layer>` there).

The graph stays flat (traced whole, as before, with the reason in the LAYER_REGIONS record and
the compile log) when any layer cannot be cut out without changing what runs (all or none: a
graph of cut and in-line layers would dedupe its bodies differently): a random op (torch's
subgraph op does not replay RNG state), an in-place write to a value the layer reads, a value
the layer computes that the graph reads before the layer's last node, no weights, or another
layer's weights (Zamba2's shared block: the inline pass names a call's layer by the weights it
reads). The whole graph stays flat under selective recomputation (it keeps in-layer values the
region partition recomputes) and where the graph switches grad mode, autocast or a functorch
transform level such as vmap's (a subgraph would not see the switch). With option
layer_regions="auto" it also stays flat where the regions would save fewer than AUTO_MIN_SAVED
layer traces (a tiny test model: a region's own trace costs about two layers').
"""
from __future__ import annotations

import hashlib
import operator
from collections import defaultdict

import torch
import torch.fx as fx
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

from ..ir import GROUP, LAYER_REGIONS, LAYER_SENTINEL, WEIGHT_GROUP, LayerRegions
from . import PassContext, graph_pass
from .layer_regions import module_fqn

#: Dynamo graph targets whose position relative to a layer's nodes changes what the layer computes
_MODE_SWITCHES = {"set_grad_enabled", "enter_autocast", "exit_autocast", "set_autocast_enabled", "inference_mode"}
#: option layer_regions="auto" forms regions when they save at least this many layer traces (layers
#: less kinds): a region's own trace costs about what two or three layers' do (tiny Llama, first
#: step with regions against without, `benchmarks/compile_time.py --phases --layer-regions
#: always|never`, median of 3: 2 layers 2.51 s / 2.31 s, 3 layers 2.72 / 2.53, 4 layers 2.91-3.68 /
#: 3.33-3.76 in two runs, 6 layers 3.43 / 4.89, 8 layers 3.68 / 5.26)
AUTO_MIN_SAVED = 3
_RANDOM = ("dropout", "rand", "bernoulli", "normal", "uniform", "multinomial", "poisson")


def regions_pay(layers: int, kinds: int) -> bool:
    """Whether layer_regions="auto" forms regions for `layers` decoder layers of `kinds` kinds."""
    return layers - kinds >= AUTO_MIN_SAVED


def _switch(target) -> bool:
    """A grad-mode or autocast switch, or a functorch transform level (vmap's batch dims: Mamba's
    scan): a subgraph cut out from between them would run outside them."""
    return (_name(target).lstrip("_") in _MODE_SWITCHES
            or getattr(target, "__module__", "") == "torch._functorch.predispatch")


def _name(target) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _random(n: fx.Node) -> bool:
    name = _name(n.target).lower()
    if not any(r in name for r in _RANDOM):
        return False
    p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else None)
    training = n.kwargs.get("training", n.args[2] if len(n.args) > 2 else True)
    return not ("dropout" in name and (p == 0 or training is False))   # (a dropout of p=0 is the identity)


def _mutates(n: fx.Node, inputs: set[fx.Node]) -> bool:
    name = _name(n.target)
    inplace = name.endswith("_") and not name.endswith("__") or name.startswith("__i")
    return inplace and bool(n.args) and n.args[0] in inputs


def layer_fqn(module_groups: dict[str, int], group: int) -> str | None:
    """The module of weight group `group` (its shortest FQN: the decoder layer itself)."""
    names = [m for m, g in module_groups.items() if g == group]
    return min(names, key=len) if names else None


def _relative_stack(stack: dict | None, layer: str) -> dict | None:
    """`nn_module_stack` with the layer's own path replaced by the sentinel (`<layer>.mlp`)."""
    if not stack:
        return stack
    out = {}
    for _key, (path, kind) in stack.items():
        fqn = module_fqn(path) or ""
        if fqn == layer or fqn.startswith(layer + "."):
            fqn = LAYER_SENTINEL + fqn[len(layer):]
        out[fqn] = (fqn, kind)
    return out


def _signature(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{tuple(value.stride())}{value.dtype}{value.device}{value.requires_grad}"
    return f"{type(value).__name__}:{value!r}"


def _inputs(nodes: list[fx.Node]) -> list[fx.Node]:
    """The values `nodes` read from outside them, in order of first use."""
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    return inputs


def _outputs(nodes: list[fx.Node]) -> list[fx.Node]:
    inside = set(nodes)
    return [n for n in nodes if any(u not in inside for u in n.users)]


def _refusal(nodes: list[fx.Node], group: int, order: dict[fx.Node, int]) -> str | None:
    """Why layer `group` (its `nodes`) cannot be cut out, or None."""
    inputs = _inputs(nodes)
    groups = {a.meta[WEIGHT_GROUP] for a in inputs if WEIGHT_GROUP in a.meta}
    if not groups:
        return "it reads no weights"
    if groups != {group}:
        return f"it reads the weights of other layers too (groups {sorted(groups - {group})}: a shared block)"
    outputs = _outputs(nodes)
    for value in [*inputs, *outputs]:
        example = value.meta.get("example_value")
        if value.op == "get_attr":
            return f"it calls a graph of its own ({value.target}: a higher-order op such as an autograd.Function)"
        if not isinstance(example, (torch.Tensor, int, torch.SymInt, torch.Generator)):
            return (f"it reads or returns {value.name}, a {type(example).__name__} (torch's subgraph op passes "
                    "tensors and ints)")
    read = set(inputs)
    for n in nodes:
        if _random(n):
            return f"it draws random numbers ({_name(n.target)})"
        if _mutates(n, read):
            return f"it writes in place to a value it reads ({_name(n.target)})"
    inside, last = set(nodes), order[nodes[-1]]
    if any(order[u] < last for o in outputs for u in o.users if u not in inside):
        return "the graph reads one of its values before its last node"
    return None


def _cut(gm: fx.GraphModule, nodes: list[fx.Node], layer: str):
    """(subgraph's graph, its inputs, its outputs, kind key) of `nodes`."""
    inputs, outputs = _inputs(nodes), _outputs(nodes)
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, a in enumerate(inputs):
        env[a] = sub.placeholder(f"x{i}")
        env[a].meta.update({k: v for k, v in a.meta.items() if k in ("example_value", "val")})
    for n in nodes:
        env[n] = sub.node_copy(n, lambda x: env[x])
        env[n].meta["nn_module_stack"] = _relative_stack(n.meta.get("nn_module_stack"), layer)
        for key in (GROUP, "mt_rank", "stack_trace", "source_fn_stack"):
            env[n].meta.pop(key, None)
    sub.output(tuple(env[o] for o in outputs))
    for i, node in enumerate(n for n in sub.nodes if n.op not in ("output", "placeholder")):
        node._rename(f"v{i}")   # (equal layers give equal code)
    stacks = repr([n.meta.get("nn_module_stack") and list(n.meta["nn_module_stack"]) for n in sub.nodes])
    signature = [_signature(a.meta.get("example_value")) for a in inputs]
    code = sub.python_code(root_module="self").src   # (a module is built only for a new kind)
    key = hashlib.sha256((code + repr(signature) + stacks).encode()).hexdigest()[:16]
    return sub, inputs, outputs, key


@graph_pass("layer_subgraphs", reads=(GROUP,), writes=(LAYER_REGIONS,),
            uses=("num_groups", "module_groups", "recompute", "layer_regions"),
            needs_later=("layer_region_inputs", "inline_layer_regions"))
def layer_subgraphs(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    record = gm.meta[LAYER_REGIONS] = LayerRegions()
    if ctx.layer_regions == "never":
        record.off = "option layer_regions='never'"
        return gm
    if ctx.recompute != "layer":
        record.off = f"recompute={ctx.recompute!r} keeps chosen in-layer values, which needs the whole joint graph"
        return gm
    switches = sorted({_name(n.target) for n in gm.graph.nodes if n.op == "call_function" and _switch(n.target)})
    if switches:
        record.off = f"the graph switches grad mode, autocast or functorch transforms ({', '.join(switches)})"
        return gm
    by_group: dict[int, list[fx.Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module") and isinstance(n.meta.get(GROUP), int):
            by_group[n.meta[GROUP]].append(n)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for group in range(1, ctx.num_groups - 1):
        nodes = by_group.get(group)
        if not nodes or layer_fqn(ctx.module_groups, group) is None:
            why = "no nodes" if not nodes else "no module holds its weights alone"
        else:
            why = _refusal(nodes, group, order)
        if why:
            record.flat[group] = why
    if record.flat:   # all or none: a graph of cut and in-line layers dedupes its bodies differently
        group, why = min(record.flat.items())
        record.off = f"decoder layer {group - 1} cannot be cut out: {why}"
        return gm
    cuts = {group: _cut(gm, by_group[group], layer_fqn(ctx.module_groups, group))
            for group in range(1, ctx.num_groups - 1)}
    distinct = len({cut[3] for cut in cuts.values()})
    if ctx.layer_regions == "auto" and not regions_pay(len(cuts), distinct):
        record.off = (f"layer_regions='auto': {len(cuts)} decoder layer(s) of {distinct} kind(s) save fewer than "
                      f"{AUTO_MIN_SAVED} traces")
        return gm
    kinds: dict[str, str] = {}   # kind key -> subgraph attribute
    replaced: dict[fx.Node, fx.Node] = {}   # an earlier layer's output -> the call's item that replaced it
    for group, (sub, inputs, outputs, key) in cuts.items():
        nodes, inputs = by_group[group], [replaced.get(a, a) for a in inputs]
        if key not in kinds:
            kinds[key] = f"mt_layer_kind_{len(kinds)}"
            gm.add_submodule(kinds[key], fx.GraphModule(gm, sub))
            record.kinds[kinds[key]] = []
        attr_name = kinds[key]
        record.kinds[attr_name].append(group)
        with gm.graph.inserting_after(nodes[-1]):
            attr = gm.graph.get_attr(attr_name)
        with gm.graph.inserting_after(attr):
            # torch caches a traced subgraph by this identifier for the whole Dynamo compile, so
            # it names the content: a recompile of the graph with other passes' choices (more
            # sequence tiles under a device budget) must not find the first trace
            identifier = f"{attr_name.replace('layer_kind', 'kind')}_{key[:12]}"
            call = gm.graph.call_function(invoke_subgraph, (attr, identifier, *inputs))
        call.meta[GROUP] = group
        at = call
        inside = set(nodes)
        for k, out in enumerate(outputs):
            with gm.graph.inserting_after(at):
                at = gm.graph.call_function(operator.getitem, (call, k))
            at.meta.update({key_: v for key_, v in out.meta.items() if key_ in ("example_value", "val", GROUP)})
            replaced[out] = at
            for user in [u for u in out.users if u not in inside]:
                user.replace_input_with(out, at)
        for n in reversed(nodes):
            gm.graph.erase_node(n)
    if record.kinds:
        gm.graph.lint()
        gm.recompile()
    return gm
