"""The backend's three pass pipelines, registered here beside the passes (not in backend.py), so
the front end can list them, check them and validate `disable_passes` without importing the
backend (options.py did, and backend.py imports options.py: a cycle).

    Dynamo graph ──DYNAMO──> (one subgraph per layer kind) AOTAutograd joint ──JOINT──> min-cut partition
        ──> forward graph, backward graph ──DIRECTION (each)──> the runtime's program

Each pass has an identity (`identities()`): a hash of its source file and its declared
contract and options, the part of a cache key that says "this pass, as it is now".
"""
from __future__ import annotations

from ..ir import RUNTIME_READS
from . import ContractError, GraphPass, check_pipeline
from .data_parallel import data_parallel
from .dedupe_bodies import dedupe_bodies
from .fused_kernels import fused_kernels
from .fused_lm_loss import fused_lm_loss
from .inline_dynamo_regions import inline_dynamo_regions
from .inline_layer_regions import inline_layer_regions, layer_region_inputs
from .layer_regions import layer_regions
from .layer_subgraphs import layer_subgraphs
from .memory_plan import memory_plan
from .offload_checkpoints import offload_checkpoints
from .recompute_boundaries import recompute_boundaries
from .rematerialize import rematerialize
from .retarget_device import retarget_device
from .routed_experts import routed_experts
from .schedule import schedule
from .selective_recompute import selective_recompute
from .split_segments import split_segments
from .tag_weights import tag_weights
from .tile_attention import tile_attention
from .tile_mlp import tile_mlp
from .unshare_weight_views import unshare_weight_views

# These run on the Dynamo graph itself (torch-level ops, before AOTAutograd): the first puts the
# layer calls Dynamo traced once per kind back in line (option dynamo_regions), the last three cut
# each decoder layer out into one call of its layer kind's subgraph (traced once per kind).
DYNAMO_PASSES = [inline_dynamo_regions, fused_kernels, fused_lm_loss, tile_mlp, tile_attention, retarget_device,
                 tag_weights, layer_regions, layer_subgraphs]
# On the joint forward + backward graph, before the partitioner.
JOINT_PASSES = [layer_region_inputs, tag_weights, layer_regions, unshare_weight_views, recompute_boundaries,
                selective_recompute]
# On the forward and on the backward graph after the partition.
DIRECTION_PASSES = [tag_weights, inline_layer_regions, routed_experts, layer_regions, unshare_weight_views,
                    rematerialize, split_segments, dedupe_bodies, schedule, offload_checkpoints, data_parallel,
                    memory_plan]


def all_passes() -> list[GraphPass]:
    """Every pass once, in pipeline order."""
    return list({p.name: p for p in (*DYNAMO_PASSES, *JOINT_PASSES, *DIRECTION_PASSES)}.values())


def pass_names() -> tuple[str, ...]:
    """Every pass by name, in pipeline order (what the `disable_passes` option takes)."""
    return tuple(p.name for p in all_passes())


def identities() -> dict[str, str]:
    """{pass name: its identity} (GraphPass.identity)."""
    return {p.name: p.identity for p in all_passes()}


def check_pipelines(disabled: tuple[str, ...]) -> None:
    """The contracts of the three pipelines with `disabled` switched off, and what the runtime
    reads from a direction graph: a ContractError before any work, naming the reader, the key
    and the disabled pass that writes it."""
    for p in all_passes():
        off = [later for later in p.needs_later if later in disabled]
        if p.name not in disabled and off:
            raise ContractError(f"pass {p.name!r} makes graphs that pass {off[0]!r} must handle later, and it is "
                                f"disabled (disable_passes={list(disabled)}): disable {p.name!r} too, or enable "
                                f"{off[0]!r}.")
    check_pipeline(DYNAMO_PASSES, disabled)
    check_pipeline(JOINT_PASSES, disabled)
    check_pipeline(DIRECTION_PASSES, disabled, then_reads=RUNTIME_READS, reader="the runtime's executor")
