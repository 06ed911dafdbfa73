"""Graph passes: each file holds one transform `(gm, opts) -> gm` with a declared contract: the
metadata keys (megacompile/ir.py: node tags in `node.meta`, results in `gm.meta`) it reads and
writes, and the options it uses (PassContext fields: the pipeline hands it those alone). Those
keys are the only interface between passes, and with the runtime. A pass may
rewrite the graph it is given in place (the backend hands a copy to a trial run). The pipeline
checks the contracts of all its passes before the first runs, can skip any pass by name
(`options={"disable_passes": [...]}`) for bisecting, and with debug_passes logs op counts.

    @graph_pass("schedule", reads=(SEGMENT, FLAT_INDEX), writes=(SCHEDULE,), uses=("slots", "hardware", ...))
    def schedule(gm, opts): ...   # opts.slots; opts.kernels would be an AttributeError
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import inspect
import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch.fx as fx

# the metadata keys (the interface between passes, and with the runtime) live in ir.py
from ..errors import ContractError, InternalError  # noqa: F401 (ContractError re-exported)
from ..ir import FLAT_INDEX, GROUP, KEYS, RANK, WEIGHT_GROUP  # noqa: F401 (re-exported)
from .fx_args import plain_arg_walk

log = logging.getLogger("megatrain.passes")


def weight_only_nodes(gm: fx.GraphModule, within: set[fx.Node] | None = None) -> list[fx.Node]:
    """Nodes computed from weights alone (views, transposes, casts of parameters), in graph order;
    with `within`, only among those nodes."""
    seen = {n for n in gm.graph.nodes if n.op == "placeholder" and WEIGHT_GROUP in n.meta}
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and (within is None or n in within) and n.all_input_nodes \
                and all(a in seen for a in n.all_input_nodes):
            seen.add(n)
            out.append(n)
    return out


def module_path(n: fx.Node) -> str | None:
    """The innermost module whose call computed `n` (Dynamo's `nn_module_stack`), or None."""
    stack = n.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else None


def in_module(n: fx.Node, path: str) -> bool:
    """`n` was computed inside the module at `path` (or one of its children)."""
    return any(p == path or p.startswith(path + ".") for p, _ in (n.meta.get("nn_module_stack") or {}).values())


def inline_call(gm: fx.GraphModule, call: fx.Node, body: fx.GraphModule,
                retag: Callable[[fx.Node, fx.Node], None]) -> dict[fx.Node, Any]:
    """Replace `call` (an `invoke_subgraph` of `body`, read through `getitem`s) with a copy of
    `body`'s nodes in its place; `retag(original, copy)` writes each copy's metadata. Returns the
    map from body nodes to what replaced them (the operands for its placeholders).

        r = invoke_subgraph(body, "id", h, w); y = r[0]   ==>   t = mm(h, w); y = relu(t)
    """
    env: dict[fx.Node, Any] = dict(zip(body.graph.find_nodes(op="placeholder"), call.args[2:], strict=True))
    results = None
    with gm.graph.inserting_before(call):
        for n in body.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                results = fx.map_arg(n.args[0], lambda x: env[x])
                continue
            env[n] = gm.graph.node_copy(n, lambda x: env[x])
            retag(n, env[n])
    for user in list(call.users):
        if user.target is not operator.getitem:
            raise InternalError(f"subgraph call {call.name} is read whole by {user.name}")
        user.replace_all_uses_with(results[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(call)
    return env


def is_megatrain_op(n: fx.Node, name: str) -> bool:
    """`n` calls our custom op `megatrain::<name>` (fused_kernels' rms_norm, swiglu, ...)."""
    return n.op == "call_function" and f"megatrain.{name}" in str(n.target)


@dataclass
class PassContext:
    """What passes may read besides the graph. Passes never mutate it, except `records`."""
    direction: str                      # "forward" | "backward" | "joint"
    num_groups: int                     # number of weight groups (layers + embed + head)
    flat_groups: dict[int, int]         # AOT flat-arg index -> weight group (params only)
    device: Any = None                  # torch.device the bodies run on
    weight_nbytes: dict[int, int] = dataclasses.field(default_factory=dict)  # flat index -> bytes moved
    slots: int = 2                      # weight groups resident on the device at once
    module_groups: dict[str, int] = dataclasses.field(default_factory=dict)  # module FQN -> weight group
    recompute_head: bool = False        # also recompute the head (logits) in the backward
    device_budget: int | None = None    # bytes the schedule may use on the device (None: unchecked)
    hardware: Any = None                # megacompile.hardware.Hardware for the cost model (None: none)
    recompute: str = "layer"            # "layer": recompute whole layers; "selective": keep costly ops
    selective_bytes: int | None = None  # extra bytes selective recompute may keep (None: no limit)
    routed_experts: bool = False        # fetch only the experts the router picked (MoE)
    kernels: str = "none"               # "triton": fused kernels replace RMSNorm / SwiGLU (fused_kernels)
    logits: str = "keep"                # "drop": LM head + loss fused, no logits returned (fused_lm_loss)
    mlp_tiles: Any = "auto"             # MLP sequence tiles: an int, or "auto" (tile_mlp)
    reload_checkpoints: str = "ahead"   # offloaded checkpoints back "ahead" or "late" (offload_checkpoints)
    layer_regions: str = "auto"         # one subgraph per layer kind: auto/always/never (layer_subgraphs)
    data_parallel: int = 1              # ranks sharing one host copy of the state (data_parallel)
    data_parallel_nodes: int = 1        # nodes holding a replica each (data_parallel)
    disabled: tuple[str, ...] = ()
    debug: bool = False
    records: list = dataclasses.field(default_factory=list)

    def view(self, name: str, uses: tuple[str, ...]) -> PassOptions:
        """What pass `name` declared it uses (and `records`, where passes note what they did)."""
        return PassOptions(name, {f: getattr(self, f) for f in uses}, self.records)


class PassOptions:
    """The options one pass receives: the PassContext fields it declared (`uses`), nothing else.

        opts = ctx.view("schedule", ("slots", "hardware"))
        opts.slots          # 2
        opts.kernels        # AttributeError: pass 'schedule' reads option 'kernels' it does not declare
    """

    def __init__(self, name: str, values: dict[str, Any], records: list):
        self.__dict__.update(values)
        self._name, self.records = name, records

    def __getattr__(self, field: str):   # (only for names not set above)
        raise AttributeError(f"pass {self._name!r} reads option {field!r} it does not declare: add it to its "
                             "graph_pass(uses=...)")


@dataclass(frozen=True)
class GraphPass:
    """A pass and its contract, in metadata keys of ir.KEYS (node tags and graph results):
    `reads` must be present before it runs (written by an earlier pass), `writes` are there after
    it, `may_write` only in some configurations (e.g. fused_kernels with kernels="triton"). What a
    pass reads only when present (e.g. BODY: a segment without a shared body runs its own) is
    not a contract."""
    name: str
    fn: Callable[[fx.GraphModule, PassContext], fx.GraphModule]
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    may_write: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()           # the PassContext fields (options) it reads
    # passes of a later pipeline that must run on what this one makes (layer_subgraphs' calls are
    # rewired by layer_region_inputs on the joint, put back in line by inline_layer_regions): the
    # graph keys of one pipeline do not reach the next (AOTAutograd re-traces), so this is said
    # here and checked up front by pipelines.check_pipelines
    needs_later: tuple[str, ...] = ()

    def __call__(self, gm: fx.GraphModule, ctx: PassContext | PassOptions) -> fx.GraphModule:
        return self.fn(gm, ctx)

    @functools.cached_property
    def identity(self) -> str:
        """A stable hash of this pass as it is now: the source of its file, its name, contract
        and the options it declares. With the values of those options it keys a cached result."""
        source = inspect.getsource(inspect.getmodule(self.fn))
        contract = repr((self.name, self.reads, self.writes, self.may_write, self.uses, self.needs_later))
        return hashlib.sha256((source + contract).encode()).hexdigest()[:16]

    def identity_with(self, opts: PassOptions | PassContext) -> str:
        """`identity` and the values of the options it uses: equal only when the pass would do
        the same to the same graph."""
        values = repr(sorted((u, repr(getattr(opts, u))) for u in self.uses))
        return hashlib.sha256((self.identity + values).encode()).hexdigest()[:16]


def graph_pass(name: str, reads=(), writes=(), may_write=(), uses=(), needs_later=()):
    """Decorator declaring a pass and its contract (keys from megacompile/ir.py) and the options
    it uses (PassContext fields; the pipeline hands it those alone)."""
    for key in (*reads, *writes, *may_write):
        if key not in KEYS:
            raise ValueError(f"pass {name!r}: {key!r} is not a metadata key of megacompile/ir.py")
    fields = {f.name for f in dataclasses.fields(PassContext)}
    if not set(uses) <= fields:
        raise ValueError(f"pass {name!r}: uses {sorted(set(uses) - fields)}, which are not PassContext fields")

    def wrap(fn):
        return GraphPass(name, fn, tuple(reads), tuple(writes), tuple(may_write), tuple(uses), tuple(needs_later))
    return wrap


def _keys_present(gm: fx.GraphModule) -> set[str]:
    keys = {k for k in gm.meta if k in KEYS}
    for n in gm.graph.nodes:
        keys.update(k for k in n.meta if k in KEYS)
    return keys


def _op_counts(gm: fx.GraphModule) -> collections.Counter:
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def check_pipeline(passes: list[GraphPass], disabled=(), then_reads=(), reader: str = "the runtime",
                   available=()) -> None:
    """Before any work: every key an enabled pass reads is written by an earlier enabled pass
    (or `available` in the input graph), and `then_reads` (what runs on the result, e.g.
    ir.RUNTIME_READS) is there at the end. A ContractError names the reader, the key and the
    disabled pass that would have written it."""
    have = set(available)
    writers: dict[str, str] = {}   # key -> the first pass that writes it (a later one may rewrite it)
    for p in passes:
        for k in (*p.writes, *p.may_write):
            writers.setdefault(k, p.name)

    def refuse(who: str, key: str) -> None:
        writer = writers.get(key)
        why = (f"which pass {writer!r} writes, and it is disabled (disable_passes={list(disabled)})"
               if writer in disabled else "which no earlier pass writes")
        raise ContractError(f"{who} reads {KEYS[key].level} key {key!r} ({KEYS[key].doc}), {why}.")
    for p in passes:
        if p.name in disabled:
            continue
        for key in p.reads:
            if key not in have:
                refuse(f"pass {p.name!r}", key)
        have.update(p.writes, p.may_write)
    for key in then_reads:
        if key not in have:
            refuse(reader, key)


def run_pipeline(gm: fx.GraphModule, passes: list[GraphPass], ctx: PassContext) -> fx.GraphModule:
    """Run passes in order (the pipeline checked first: check_pipeline); skipped passes are
    recorded, not silent; each pass's `writes` are verified after it."""
    check_pipeline(passes, ctx.disabled, available=_keys_present(gm))
    with plain_arg_walk():   # (fx_args.py: torch's own walk is most of a node copy)
        return _run(gm, passes, ctx)


def _run(gm: fx.GraphModule, passes: list[GraphPass], ctx: PassContext) -> fx.GraphModule:
    for p in passes:
        if p.name in ctx.disabled:
            ctx.records.append((p.name, "disabled", None))
            continue
        before = _op_counts(gm) if ctx.debug else None
        gm = p(gm, ctx.view(p.name, p.uses))
        present = _keys_present(gm) if p.writes else set()
        lost = [k for k in p.writes if k not in present]
        if lost:
            raise ContractError(f"pass {p.name!r} promised {lost} but did not write them.")
        if ctx.debug:
            after = _op_counts(gm)
            delta = {k: after[k] - before[k] for k in set(before) | set(after) if after[k] != before[k]}
            ctx.records.append((p.name, "ran", delta))
            log.info("%s pass %s: %d ops, delta %s", ctx.direction, p.name, sum(after.values()), delta)
        else:
            ctx.records.append((p.name, "ran", None))
    return gm
