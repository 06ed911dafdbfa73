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
