"""Graph passes: each file holds one transform, a pure function `(gm, ctx) -> gm` with a declared
contract (the node tags it requires and provides). Tags in `node.meta` are the only interface
between passes. The pipeline checks contracts, can skip any pass by name
(`options={"disable_passes": [...]}`) for bisecting, and in debug mode prints op counts.
"""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch.fx as fx

#: node.meta keys written by passes (the interface between them)
WEIGHT_GROUP = "mt_weight_group"   # placeholder -> weight group of the parameter it carries
FLAT_INDEX = "mt_flat_index"       # placeholder -> position in the AOT flat args
GROUP = "mt_group"                 # node -> weight group whose segment computes it (-1 = prologue)
RANK = "mt_rank"                   # node -> position of its segment in execution order


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
    disabled: tuple[str, ...] = ()
    debug: bool = False
    records: list = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class GraphPass:
    name: str
    fn: Callable[[fx.GraphModule, PassContext], fx.GraphModule]
    requires: tuple[str, ...] = ()      # node.meta tags that must be present on some node
    provides: tuple[str, ...] = ()      # tags it guarantees afterwards
    numerics_preserving: bool = True

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        return self.fn(gm, ctx)


def graph_pass(name: str, requires=(), provides=(), numerics_preserving=True):
    """Decorator declaring a pass and its contract."""
    def wrap(fn):
        return GraphPass(name, fn, tuple(requires), tuple(provides), numerics_preserving)
    return wrap


def _tags_present(gm: fx.GraphModule) -> set[str]:
    tags = set()
    for n in gm.graph.nodes:
        tags.update(k for k in n.meta if k.startswith("mt_") or k in ("recompute", "ac_graph_id"))
    return tags


def _op_counts(gm: fx.GraphModule) -> collections.Counter:
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


class ContractError(RuntimeError):
    pass


def run_pipeline(gm: fx.GraphModule, passes: list[GraphPass], ctx: PassContext) -> fx.GraphModule:
    """Run passes in order, checking each contract; skipped passes are recorded, not silent."""
    provided = _tags_present(gm)
    for p in passes:
        if p.name in ctx.disabled:
            ctx.records.append((p.name, "disabled", None))
            continue
        missing = [t for t in p.requires if t not in provided]
        if missing:
            raise ContractError(
                f"pass {p.name!r} requires node tags {missing} that no earlier pass provided "
                f"(disabled: {list(ctx.disabled)})."
            )
        before = _op_counts(gm) if ctx.debug else None
        gm = p(gm, ctx)
        provided = _tags_present(gm) | provided
        lost = [t for t in p.provides if t not in provided]
        if lost:
            raise ContractError(f"pass {p.name!r} promised tags {lost} but did not set them.")
        if ctx.debug:
            after = _op_counts(gm)
            delta = {k: after[k] - before[k] for k in set(before) | set(after) if after[k] != before[k]}
            ctx.records.append((p.name, "ran", delta))
            print(f"[megatrain] {ctx.direction} pass {p.name}: {sum(after.values())} ops, delta {delta}")
        else:
            ctx.records.append((p.name, "ran", None))
    return gm
