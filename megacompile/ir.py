"""The compile artifacts the compiler (`passes/`) and the runtime (`runtime/`) share.

This module depends on neither side; both import it (tests/test_layering.py checks the
direction of every import). It holds:

- one registry of every metadata key the pipeline uses, node-level (`node.meta[key]`, tags on
  FX nodes) and graph-level (`gm.meta[key]`, results such as the schedule). Pass contracts
  (`passes.graph_pass(reads=..., writes=...)`) name these keys, so the pipeline can check
  before any work that what a pass reads was written by an earlier one:

      SEGMENT    node   call_module node -> {"group", "rank", "outputs"}
      SCHEDULE   graph  gm.meta["mt_schedule"] = Schedule(direction, slots, segments, program)

- the schedule as a program (`schedule_program`): the direction graph with its transfers as
  `torch.ops.megatrain.prefetch / wait / evict / grad_offload` nodes (custom ops defined here)
  around the body calls, and what walks it: `op_of` (a node's op, the key of a table of per-op
  handlers), `walk`, and one `liveness` analysis. The executor runs it, the memory plan counts
  its bytes, the simulator times its steps, `inspect --show graphs` prints it; a pass that adds
  a capability (activation offload, collectives, SSD swaps) adds ops to it and their handlers;
- the schedule's data (`Schedule`, `SegmentInfo`, `Step`) and the memory plan (`MemoryPlan`);
- `RUNTIME_READS`: what the runtime's executor reads from a compiled direction graph, so the
  pipeline can refuse up front a configuration whose output the runtime cannot run;
- the two helpers both sides apply to traced values: `dim_hint` (a symbolic size's hint) and
  `materialize` (random tensors of a node's traced shape, for timing a body or an op).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx


@dataclass(frozen=True)
class MetaKey:
    name: str
    level: str       # "node" (node.meta) or "graph" (gm.meta)
    doc: str


#: every metadata key of the pipeline, by name
KEYS: dict[str, MetaKey] = {}


def _key(name: str, level: str, doc: str) -> str:
    KEYS[name] = MetaKey(name, level, doc)
    return name


# node-level tags -------------------------------------------------------------------------
FLAT_INDEX = _key("mt_flat_index", "node", "placeholder -> position in the AOT flat args")
WEIGHT_GROUP = _key("mt_weight_group", "node", "placeholder -> weight group of the parameter it carries")
GROUP = _key("mt_group", "node", "node -> weight group whose segment computes it (-1 = prologue)")
RANK = _key("mt_rank", "node", "node -> position of its segment in execution order")
RECOMPUTE = _key("recompute", "node", "joint-graph node -> torch CheckpointPolicy for the min-cut partitioner")
AC_GRAPH_ID = _key("ac_graph_id", "node", "joint-graph node -> activation-checkpoint region (its weight group)")
SELECTIVE = _key("mt_selective_save", "node", "joint-graph node -> True where selective recompute saves it")
ROUTED = _key("mt_routed_experts", "node", "weight placeholder -> its expert rows are fetched by routing")
SEGMENT = _key("mt_segment", "node", "call_module node -> {'group', 'rank', 'outputs'} of a segment")
BODY = _key("mt_body", "node", "segment call -> name of the deduplicated body it runs")
FUSED_KERNEL = _key("mt_fused_kernel", "node", "node -> which fused Triton kernel it calls")
FUSED_LM_LOSS = _key("mt_fused_lm_loss", "node", "the fused LM head + loss op and its loss")

# graph-level results ---------------------------------------------------------------------
SCHEDULE = _key("mt_schedule", "graph", "direction graph -> Schedule (when weights and gradients move)")
MEMORY_PLAN = _key("mt_memory_plan", "graph", "direction graph -> MemoryPlan (device bytes at every step)")
LAYER_REGIONS = _key("mt_layer_regions", "graph", "Dynamo graph -> LayerRegions: the decoder layers that run as one "
                     "invoke_subgraph call per layer, one subgraph per layer kind, and the layers left flat (why)")
DYNAMO_REGIONS = _key("mt_dynamo_regions", "graph", "Dynamo graph -> DynamoRegions: the layer calls Dynamo traced once "
                      "per kind and inline_dynamo_regions put back in line, or why they could not be")
CHECKPOINTS = _key("mt_checkpoints", "graph", "forward graph -> output positions of the layer checkpoints to keep "
                   "on the host; backward graph -> their placeholder positions (set when the joint graph is "
                   "partitioned)")

#: what runtime/executor.py reads from a direction graph (SEGMENT, FLAT_INDEX and WEIGHT_GROUP
#: tags, the schedule); BODY and MEMORY_PLAN are read when present
RUNTIME_READS = (SEGMENT, FLAT_INDEX, WEIGHT_GROUP, SCHEDULE)


#: the sentinel that stands for "the decoder layer this body runs as" in the module paths
#: (`nn_module_stack`) of a layer-kind subgraph: one subgraph serves every layer of its kind,
#: and inlining it writes each call's own layer in its place (passes/inline_layer_regions.py)
LAYER_SENTINEL = "<layer>"


@dataclass
class LayerRegions:
    """What passes/layer_subgraphs.py did to a Dynamo graph (graph key LAYER_REGIONS)."""
    kinds: dict[str, list[int]] = field(default_factory=dict)   # subgraph attribute -> its layers' groups
    flat: dict[int, str] = field(default_factory=dict)          # group -> why it stayed flat
    off: str = ""                                               # why no layer became a region


@dataclass
class DynamoRegions:
    """What passes/inline_dynamo_regions.py did to a Dynamo graph (graph key DYNAMO_REGIONS)."""
    calls: int = 0        # layer calls put back in line
    kinds: int = 0        # subgraphs Dynamo traced (one per layer kind)
    retrace: str = ""     # why the model is traced again whole (a call that cannot reuse its kind's subgraph)


# the schedule ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    op: str          # "prefetch" | "wait" | "run" | "evict" | "grad_offload" | "offload" | "reload"
                     # (data parallel: "prefetch_shard" | "all_gather" | "reduce_scatter")
    stream: str      # "h2d" | "compute" | "d2h" | "comm"
    segment: int     # index into Schedule.segments
    nbytes: int = 0
    moved: int | None = None   # bytes over its link when not nbytes (prefetch_shard: this rank's part)


@dataclass
class SegmentInfo:
    name: str                      # submodule name in the top graph
    group: int                     # weight group (-1 prologue)
    weights: list[int]             # flat indices of the parameters it reads
    grads: list[tuple[int, str]] = field(default_factory=list)  # (flat index, value) finalised here
    weight_nbytes: int = 0
    body: str = ""                 # the deduplicated body it runs ("" = its own submodule)
    grad_nbytes: dict[int, int] = field(default_factory=dict)     # flat index -> gradient bytes
    routed: list[int] = field(default_factory=list)  # weights whose expert rows are fetched by routing


@dataclass
class Schedule:
    """A direction's schedule: its segments and the program that runs them (`program`, built by
    `schedule_program`); `steps` are the program's schedule ops in order, as data."""
    direction: str
    slots: int
    segments: list[SegmentInfo]
    program: fx.GraphModule
    lookahead: int = 1             # weight-reading segments prefetched ahead of the running one

    @property
    def steps(self) -> list[Step]:
        return program_steps(self.program)

    def peak_resident_weight_bytes(self) -> int:
        resident, peak = 0, 0
        for s in self.steps:
            if s.op in ("prefetch", "prefetch_shard"):
                resident += s.nbytes
                peak = max(peak, resident)
            elif s.op == "evict":
                resident -= s.nbytes
        return peak


def lazy_graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule that writes its Python code on its first call or first `.code` read, not
    when built or changed (torch's _LazyGraphModule, which Dynamo builds its own graphs with).
    A program's segment modules that a shared body stands in for are never called: generating
    their code was most of split_segments' time (80 layers: 9 s of the 15 s of passes)."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:   # (a torch without it: eager code generation, the same program)
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def segment_calls(top: fx.GraphModule) -> list[fx.Node]:
    """The segment calls of a direction graph, in graph order: segment k of the schedule is
    call k (the schedule pass and the program index them alike)."""
    return [n for n in top.graph.nodes if n.op == "call_module" and SEGMENT in n.meta]


# the schedule as a program ---------------------------------------------------------------
# The transfer ops of a schedule program: torch custom ops (as torch's own activation offloading
# marks offload/reload/wait), side-effecting so that no dead-code elimination drops them. Their
# implementations are the runtime's handlers (runtime/executor.py); called directly they refuse.
def _handled_by_runtime(*_args) -> None:
    raise RuntimeError("megatrain schedule ops are run by the runtime's executor (runtime/executor.py), "
                       "which binds them to a program's weight pool and gradient worker")


@torch.library.custom_op("megatrain::prefetch", mutates_args=())
def prefetch(segment: int, weights: list[torch.Tensor]) -> None:
    """Copy the segment's weights host -> device (the h2d stream); its body may run after wait."""
    _handled_by_runtime()


@torch.library.custom_op("megatrain::wait", mutates_args=())
def wait(segment: int) -> None:
    """The compute stream waits for the segment's prefetch."""
    _handled_by_runtime()


@torch.library.custom_op("megatrain::evict", mutates_args=())
def evict(segment: int) -> None:
    """Free the segment's device weights (its slot takes the next prefetch)."""
    _handled_by_runtime()


@torch.library.custom_op("megatrain::grad_offload", mutates_args=())
def grad_offload(segment: int, grads: list[torch.Tensor]) -> None:
    """Send the gradients the segment finalised to the host (the d2h stream) into param.grad."""
    _handled_by_runtime()


@torch.library.custom_op("megatrain::prefetch_shard", mutates_args=())
def prefetch_shard(segment: int, weights: list[torch.Tensor]) -> None:
    """Data parallel: copy this rank's part of the segment's weights host -> device (its slice of
    the arena row, the loose weights it owns); `all_gather` completes them."""
    _handled_by_runtime()


@torch.library.custom_op("megatrain::all_gather", mutates_args=())
def all_gather(segment: int) -> None:
    """Data parallel: assemble the segment's weights from every rank's part (the comm stream)."""
    _handled_by_runtime()


@torch.library.custom_op("megatrain::reduce_scatter", mutates_args=())
def reduce_scatter(segment: int, grads: list[torch.Tensor]) -> None:
    """Data parallel: sum the segment's gradients over the node's ranks in fp32, leaving each
    rank the part it owns (the comm stream); its grad_offload sends only that part."""
    _handled_by_runtime()


for _op in (prefetch, wait, evict, grad_offload, prefetch_shard, all_gather, reduce_scatter):
    _op.register_fake(lambda *args: None)
    fx.node.has_side_effect(_op._opoverload)


@torch.library.custom_op("megatrain::offload", mutates_args=())
def offload(segment: int, value: torch.Tensor) -> torch.Tensor:
    """A host copy of a device value the backward needs (the d2h stream; pinned on CUDA): the
    device copy dies after its last reader in this direction."""
    _handled_by_runtime()


@torch.library.custom_op("megatrain::reload", mutates_args=())
def reload(segment: int, value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy of an offloaded host value (the h2d stream), for the run of `segment`,
    which waits for it."""
    _handled_by_runtime()


@offload.register_fake
def _(segment, value):
    return torch.empty_like(value, device="cpu")


@reload.register_fake
def _(segment, value, device):
    return torch.empty_like(value, device=device)


for _op in (offload, reload):
    fx.node.has_side_effect(_op._opoverload)

#: schedule op name -> its torch op (program nodes call these)
SCHEDULE_OPS = {"prefetch": torch.ops.megatrain.prefetch.default, "wait": torch.ops.megatrain.wait.default,
                "evict": torch.ops.megatrain.evict.default, "grad_offload": torch.ops.megatrain.grad_offload.default,
                "offload": torch.ops.megatrain.offload.default, "reload": torch.ops.megatrain.reload.default,
                "prefetch_shard": torch.ops.megatrain.prefetch_shard.default,
                "all_gather": torch.ops.megatrain.all_gather.default,
                "reduce_scatter": torch.ops.megatrain.reduce_scatter.default}
STEP = _key("mt_step", "node", "schedule program node -> its Step (schedule ops and segment runs)")


def op_of(node: fx.Node) -> str:
    """What a program node is, for a table of per-op handlers: a schedule op ("prefetch",
    "wait", "evict", "grad_offload", "offload", "reload"; data parallel: "prefetch_shard",
    "all_gather", "reduce_scatter"), "run" (a segment's body), "output_of" (an element of a
    body's result, bound when the body ran), "value" (any other op), "placeholder" or "output"."""
    step = node.meta.get(STEP)
    if step is not None:
        return step.op
    if node.op in ("placeholder", "output"):
        return node.op
    if node.op == "call_function" and node.target is operator.getitem and STEP in node.args[0].meta:
        return "output_of"
    return "value"


def host_values(program: fx.GraphModule) -> set[str]:
    """The values of a program that live on the host, not the device: offloaded copies, and
    placeholders read only by reloads (the forward's offloaded checkpoints, as the backward
    receives them)."""
    nodes = program.graph.nodes
    made = {n.name for n in nodes if op_of(n) == "offload"}
    read = {n.name for n in nodes if n.op == "placeholder" and n.users
            and all(op_of(u) == "reload" for u in n.users)}
    return made | read


def program_steps(program: fx.GraphModule) -> list[Step]:
    """The schedule ops and runs of a program, in order."""
    return [n.meta[STEP] for n in program.graph.nodes if STEP in n.meta]


def dispatch(program: fx.GraphModule, handlers: dict) -> list[tuple[int, fx.Node, object]]:
    """(position, node, its handler) for every node of `program`, in order; an op without a
    handler is refused before any node runs (a pass added an op this walker does not know: the
    executor, the memory plan and the simulator each declare theirs)."""
    nodes = list(program.graph.nodes)
    missing = {op_of(n) for n in nodes} - set(handlers)
    if missing:
        raise KeyError(f"no handler for schedule op(s) {sorted(missing)} (handlers for {sorted(handlers)})")
    return [(i, n, handlers[op_of(n)]) for i, n in enumerate(nodes)]


def walk(program: fx.GraphModule, handlers: dict) -> None:
    """Call `handlers[op_of(node)](position, node)` for every node of `program`, in order."""
    for i, n, handler in dispatch(program, handlers):
        handler(i, n)


def schedule_program(top: fx.GraphModule, segments: list[SegmentInfo], steps: list[Step]) -> fx.GraphModule:
    """A direction graph with its schedule `steps` written out as one FX program: the weight
    and gradient transfers as explicit nodes around the calls of the (deduplicated) bodies, in
    the order they run. The executor, the memory plan and the simulator walk this program; it
    is what `megatrain inspect --show graphs` prints:

        prefetch = torch.ops.megatrain.prefetch.default(0, [primals_1]); ...
        wait = torch.ops.megatrain.wait.default(0); seg0 = self.body_0(primals_1, primals_9)
        getitem = seg0[0]; evict = torch.ops.megatrain.evict.default(0); ...
        grad_offload = torch.ops.megatrain.grad_offload.default(3, [getitem_12, getitem_13])

    Each schedule node carries its Step (`node.meta[STEP]`); a run node also the segment's
    SEGMENT and BODY tags.
    """
    nodes = list(top.graph.nodes)
    calls = segment_calls(top)
    index = {n: k for k, n in enumerate(calls)}
    after: dict[int, list[fx.Node]] = {}   # other nodes, emitted after the segment run before them
    current = -1
    for n in nodes:
        if n in index:
            current = index[n]
        elif n.op not in ("placeholder", "output"):
            after.setdefault(current, []).append(n)
    g, env = fx.Graph(), {}

    def arg(a):
        return fx.map_arg(a, lambda x: env[x.name])

    def copy_after(k: int) -> None:
        for n in after.get(k, []):
            env[n.name] = g.node_copy(n, lambda x: env[x.name])
    for n in nodes:
        if n.op == "placeholder":
            env[n.name] = g.node_copy(n)
    copy_after(-1)
    out = next(n for n in nodes if n.op == "output")
    for step in steps:
        k, call = step.segment, calls[step.segment]
        if step.op == "prefetch":
            weights = [env[a.name] for a in call.all_input_nodes if WEIGHT_GROUP in a.meta]
            node = g.call_function(SCHEDULE_OPS["prefetch"], (k, weights))
        elif step.op in ("wait", "evict"):
            node = g.call_function(SCHEDULE_OPS[step.op], (k,))
        elif step.op == "run":
            body = call.meta.get(BODY, call.target)
            node = env[call.name] = g.call_module(body, arg(call.args), arg(call.kwargs))
            node.name = call.name
            node.meta.update({key: call.meta[key] for key in (SEGMENT, BODY) if key in call.meta})
            node.meta["val"] = call.meta.get("val")
            copy_after(k)
        elif step.op == "grad_offload":
            node = g.call_function(SCHEDULE_OPS["grad_offload"], (k, [env[name] for _, name in segments[k].grads]))
        else:
            raise ValueError(f"unknown schedule op {step.op!r}")
        node.meta[STEP] = step
    g.output(arg(out.args[0]))
    return fx.GraphModule(top, g)


# one direction's compile result ------------------------------------------------------------
@dataclass
class Compiled:
    """What compiling one direction produced, as plan, inspect and the runtime read it: the split
    graph (SEGMENT-tagged body calls; its meta holds the SCHEDULE, with the program, and the
    MEMORY_PLAN when that pass ran) and its distinct bodies. No runtime object is needed to read
    it (`megatrain plan` and `inspect` compile on the meta device and stop here)."""
    direction: str
    graph: fx.GraphModule
    bodies: dict[str, fx.GraphModule]   # body name -> its graph (deduplicated: shared by segments)
    body_of: list[str]                  # segment -> the body it runs

    @property
    def schedule(self) -> Schedule:
        return self.graph.meta[SCHEDULE]

    @property
    def plan(self) -> "MemoryPlan | None":
        return self.graph.meta.get(MEMORY_PLAN)

    @property
    def transient(self) -> dict[str, int]:
        """Planned intermediate bytes per body (0 when the memory plan did not run)."""
        plan = self.plan
        return {name: plan.transient.get(name, 0) if plan else 0 for name in self.bodies}

    def body(self, k: int) -> fx.GraphModule:
        return self.bodies[self.body_of[k]]


def compiled(direction: str, top: fx.GraphModule) -> Compiled:
    bodies: dict[str, fx.GraphModule] = {}
    body_of = []
    for n in segment_calls(top):
        name = n.meta.get(BODY, n.target)
        bodies.setdefault(name, top.get_submodule(name))
        body_of.append(name)
    return Compiled(direction, top, bodies, body_of)


# liveness --------------------------------------------------------------------------------
@dataclass
class Liveness:
    """When each value of a schedule program dies, for the executor (which frees it then) and
    the memory plan (which counts it until then): one analysis for both.

        frees[12] == ["add_8", "getitem_3"]   # dead once program node 12 has run
        "t_50" in offloaded                   # a gradient: leaves at its grad_offload node, and
                                              # the program's output gives None in its place
    A value nobody reads dies where it is made (an element of a body's result: at the run);
    the output keeps what it returns alive to the end.
    """
    frees: dict[int, list[str]]
    offloaded: set[str]


def liveness(program: fx.GraphModule) -> Liveness:
    nodes = list(program.graph.nodes)
    offloaded = {a.name for n in nodes if op_of(n) == "grad_offload" for a in n.all_input_nodes}
    position = {n: i for i, n in enumerate(nodes)}
    last: dict[str, float] = {}
    for i, n in enumerate(nodes):
        if n.op == "output":
            for a in n.all_input_nodes:
                if a.name not in offloaded:
                    last[a.name] = float("inf")
            continue
        for a in n.all_input_nodes:
            last[a.name] = max(last.get(a.name, -1), i)
        if n.op != "placeholder":   # (made here; an element of a body's result where the body ran)
            last.setdefault(n.name, position[n.args[0]] if op_of(n) == "output_of" else i)
    frees: dict[int, list[str]] = {}
    for name, i in last.items():
        if i != float("inf"):
            frees.setdefault(int(i), []).append(name)
    return Liveness(frees, offloaded)


# the memory plan -------------------------------------------------------------------------
@dataclass
class MemoryPlan:
    peak_bytes: int
    peak_step: int
    peak_weight_bytes: int
    transient: dict[str, int] = field(default_factory=dict)
    per_step: list[int] = field(default_factory=list)
    largest_segment_weight_bytes: int = 0
    host_checkpoint_bytes: int = 0   # layer checkpoints this direction keeps on the host
    # segment -> its body's bytes while it runs, the inputs it frees (its last reader) included
    run_transient: dict[int, int] = field(default_factory=dict)


# traced values ---------------------------------------------------------------------------
def dim_hint(d) -> int:
    """A size as an int (symbolic sizes: the hint they were traced with)."""
    if isinstance(d, torch.SymInt):
        return int(d.node.hint) if d.node.has_hint() else 1
    return int(d)


def materialize(a):
    """A node's traced value as a real CPU value of the same shape and strides: floats random
    (N(0, 0.02)), bools True, integers 0 (valid indices for embeddings, gathers and targets);
    symbolic sizes their hints; lists and tuples element by element; anything else as is."""
    if isinstance(a, fx.Node):
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            shape, stride = [dim_hint(d) for d in v.shape], [dim_hint(d) for d in v.stride()]
            extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
            base = torch.empty(extent, dtype=v.dtype, device="cpu")
            if v.dtype.is_floating_point:
                base.normal_(0, 0.02)
            elif v.dtype == torch.bool:
                base.fill_(True)
            else:
                base.zero_()
            return base.as_strided(shape, stride)
        if isinstance(v, torch.SymInt):
            return dim_hint(v)
        return v
    if isinstance(a, (list, tuple)):
        return type(a)(materialize(x) for x in a)
    return a
