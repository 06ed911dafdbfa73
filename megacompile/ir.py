"""The compile artifacts the compiler (`passes/`) and the runtime (`runtime/`) share.

This module depends on neither side; both import it (tests/test_layering.py checks the
direction of every import). It holds:

- one registry of every metadata key the pipeline uses, node-level (`node.meta[key]`, tags on
  FX nodes) and graph-level (`gm.meta[key]`, results such as the schedule). Pass contracts
  (`passes.graph_pass(reads=..., writes=...)`) name these keys, so the pipeline can check
  before any work that what a pass reads was written by an earlier one:

      SEGMENT    node   call_module node -> {"group", "rank", "outputs"}
      SCHEDULE   graph  gm.meta["mt_schedule"] = Schedule(direction, slots, segments, steps)

- the schedule (`Schedule`, `SegmentInfo`, `Step`) and the memory plan (`MemoryPlan`) as data;
- `RUNTIME_READS`: what the runtime's executor reads from a compiled direction graph, so the
  pipeline can refuse up front a configuration whose output the runtime cannot run;
- the two helpers both sides apply to traced values: `dim_hint` (a symbolic size's hint) and
  `materialize` (random tensors of a node's traced shape, for timing a body or an op).
"""
from __future__ import annotations

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

#: what runtime/executor.py reads from a direction graph (SEGMENT, FLAT_INDEX and WEIGHT_GROUP
#: tags, the schedule); BODY and MEMORY_PLAN are read when present
RUNTIME_READS = (SEGMENT, FLAT_INDEX, WEIGHT_GROUP, SCHEDULE)


# the schedule ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    op: str          # "prefetch" | "wait" | "run" | "evict" | "grad_offload"
    stream: str      # "h2d" | "compute" | "d2h"
    segment: int     # index into Schedule.segments
    nbytes: int = 0


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
    direction: str
    slots: int
    segments: list[SegmentInfo]
    steps: list[Step]
    lookahead: int = 1             # weight-reading segments prefetched ahead of the running one

    def peak_resident_weight_bytes(self) -> int:
        resident, peak = 0, 0
        for s in self.steps:
            if s.op == "prefetch":
                resident += s.nbytes
                peak = max(peak, resident)
            elif s.op == "evict":
                resident -= s.nbytes
        return peak


def segment_calls(top: fx.GraphModule) -> list[fx.Node]:
    """The segment calls of a direction graph, in graph order: segment k of the schedule is
    call k (the executor, the memory plan and the schedule pass index them alike)."""
    return [n for n in top.graph.nodes if n.op == "call_module" and SEGMENT in n.meta]


# liveness --------------------------------------------------------------------------------
@dataclass
class Liveness:
    """When each value of a direction graph dies, for the executor (which frees it then) and the
    memory plan (which counts it until then): one analysis for both.

        last_use["add_8"] == 3        # read last by segment call 3: freed after it runs
        last_use["getitem_4"] == inf  # a graph output: lives to the end
        "t_50" in offloaded           # a gradient: leaves at its grad_offload step
    """
    last_use: dict[str, float]
    offloaded: set[str]


def liveness(top: fx.GraphModule) -> Liveness:
    schedule: Schedule = top.meta[SCHEDULE]
    calls = segment_calls(top)
    offloaded = {name for seg in schedule.segments for _, name in seg.grads}
    last_use: dict[str, float] = {}
    for k, n in enumerate(calls):
        for a in n.all_input_nodes:
            last_use[a.name] = k
    out = next(n for n in top.graph.nodes if n.op == "output")
    for a in out.all_input_nodes:
        if a.name not in offloaded:
            last_use[a.name] = float("inf")
    return Liveness(last_use, offloaded)


# the memory plan -------------------------------------------------------------------------
@dataclass
class MemoryPlan:
    peak_bytes: int
    peak_step: int
    peak_weight_bytes: int
    transient: dict[str, int] = field(default_factory=dict)
    per_step: list[int] = field(default_factory=list)
    largest_segment_weight_bytes: int = 0


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


# the schedule as a program -------------------------------------------------------------
# The transfer ops of a schedule program. They mark where the runtime moves data; the executor
# (runtime/executor.py) runs a direction's schedule steps, so these are never called.
def prefetch(segment: int, *weights):
    """Copy the segment's weights host -> device (the h2d stream); its body may run after wait."""
    raise NotImplementedError("schedule ops are run by runtime/executor.py")


def wait(segment: int):
    """The compute stream waits for the segment's prefetch."""
    raise NotImplementedError("schedule ops are run by runtime/executor.py")


def evict(segment: int):
    """Free the segment's device weights (its slot takes the next prefetch)."""
    raise NotImplementedError("schedule ops are run by runtime/executor.py")


def grad_offload(segment: int, *grads):
    """Send the gradients the segment finalised to the host (the d2h stream) into param.grad."""
    raise NotImplementedError("schedule ops are run by runtime/executor.py")


SCHEDULE_OPS = {"prefetch": prefetch, "wait": wait, "evict": evict, "grad_offload": grad_offload}


def schedule_program(top: fx.GraphModule) -> fx.GraphModule:
    """A direction graph with its schedule written out as one FX program: the weight and
    gradient transfers as explicit nodes around the calls of the (deduplicated) bodies, in the
    order the executor runs them (what `megatrain inspect --show graphs` prints):

        prefetch = prefetch(0, primals_1); prefetch_1 = prefetch(1, primals_2, primals_3)
        wait = wait(0); seg_0 = self.body_0(primals_1, primals_9); getitem = seg_0[0]
        evict = evict(0); ...; grad_offload = grad_offload(3, getitem_12, getitem_13)
    """
    schedule: Schedule = top.meta[SCHEDULE]
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
    for step in schedule.steps:
        k, call = step.segment, calls[step.segment]
        if step.op == "prefetch":
            weights = [env[a.name] for a in call.all_input_nodes if WEIGHT_GROUP in a.meta]
            g.call_function(prefetch, (k, *weights))
        elif step.op in ("wait", "evict"):
            g.call_function(SCHEDULE_OPS[step.op], (k,))
        elif step.op == "run":
            body = call.meta.get(BODY, call.target)
            env[call.name] = g.call_module(body, arg(call.args), arg(call.kwargs))
            env[call.name].name = call.name
            copy_after(k)
        elif step.op == "grad_offload":
            g.call_function(grad_offload, (k, *[env[name] for _, name in schedule.segments[k].grads]))
    out = next(n for n in nodes if n.op == "output")
    g.output(arg(out.args[0]))
    return fx.GraphModule(top, g)
