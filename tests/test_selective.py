"""Selective recomputation: keep matmul/attention outputs (within a budget), recompute the rest."""
from __future__ import annotations

import copy

import pytest
import torch

import megacompile
from conftest import assert_step_matches_eager, tiny_model
from megacompile.backend import programs_of
from megacompile.cost_model import body_cost
from megacompile.errors import ConfigError


def layer_step():
    """The layer-boundary schedule traced as selective recomputation is (the whole graph, not one
    subgraph per layer kind, whose outer partition keeps other small prologue values: rotary
    tables instead of what they are computed from)."""
    return step(layer_regions=False)


def step(**options):
    torch._dynamo.reset()
    model = tiny_model("llama", layers=3)
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", **options})
    assert_step_matches_eager(model, ref, cmodel, pad_left=1)
    program = programs_of(model)[-1]
    bw = program.runners["backward"]
    saved = sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in bw.graph.graph.nodes
                if n.op == "placeholder" and "mt_weight_group" not in n.meta and not n.name.startswith("tangents")
                and not n.name.startswith("rng_state") and isinstance(n.meta.get("val"), torch.Tensor))
    flops = sum(body_cost(c.body).flops for c in bw.calls)
    stats = megacompile.stats(cmodel)
    return {"saved": saved, "bw_flops": flops, "peak": stats["peak_device_bytes"],
            "bodies": (stats["distinct_layer_bodies"], stats["distinct_backward_layer_bodies"])}


def test_selective_keeps_matmul_outputs_and_skips_their_recompute():
    layer = layer_step()
    selective = step(recompute="selective")
    assert selective["saved"] > layer["saved"]
    # every layer's forward matmuls are no longer recomputed: about a third of the backward FLOPs
    assert selective["bw_flops"] < 0.85 * layer["bw_flops"]
    assert selective["bodies"] == layer["bodies"] == (1, 1)  # identical layers chose alike
    assert selective["peak"] > layer["peak"]


def test_selective_under_a_budget_keeps_only_what_fits():
    layer, full = layer_step(), step(recompute="selective")
    budget = (layer["peak"] + full["peak"]) // 2
    partial = step(recompute="selective", device_budget=budget)
    assert partial["peak"] <= budget
    assert layer["saved"] < partial["saved"] < full["saved"]
    assert full["bw_flops"] < partial["bw_flops"] < layer["bw_flops"]
    # a budget that only the layer-boundary schedule meets keeps nothing extra
    tight = step(recompute="selective", device_budget=layer["peak"])
    assert tight["saved"] == layer["saved"] and tight["peak"] <= layer["peak"]


def test_selective_pass_can_be_disabled_by_name():
    assert step(recompute="selective", disable_passes=["selective_recompute"])["saved"] == layer_step()["saved"]


def test_unknown_recompute_mode_is_a_clear_error():
    with pytest.raises(ConfigError, match="recompute='full'"):
        megacompile.Options.from_mapping({"recompute": "full"})
