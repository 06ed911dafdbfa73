"""Identical decoder layers lower one forward and one backward body, whatever the depth."""
from __future__ import annotations

import torch

import megacompile
from conftest import batch, tiny_model
from megacompile.backend import programs_of
from megacompile.ir import BODY


def compile_and_step(layers, family="llama"):
    model = tiny_model(family, layers=layers)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ids, _, labels = batch(2, 8)
    cmodel(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    return model, cmodel


def test_twelve_identical_layers_lower_one_body_each_way():
    _, cmodel = compile_and_step(12)
    s = megacompile.stats(cmodel)
    assert s["distinct_layer_bodies"] == 1
    assert s["distinct_backward_layer_bodies"] == 1
    # prologue (masks, rotary tables) + embedding + layer + head
    assert s["distinct_bodies"] == {"forward": 4, "backward": 4}
    assert s["segments"]["forward"] == 12 + 3


def test_segments_a_shared_body_stands_in_for_never_write_their_code():
    """split_segments builds lazy modules: a segment whose body is another's is never called, so
    its Python code is never generated (at 80 layers, generating it was 9 s of 15 s of passes)."""
    model, _ = compile_and_step(6)
    program = programs_of(model)[0]
    for direction, done in program.compiled.items():
        calls = [n for n in done.graph.graph.nodes if n.op == "call_module"]
        stand_ins = [done.graph.get_submodule(n.target) for n in calls if n.meta[BODY] != n.target]
        assert len(stand_ins) == 5     # layers 1-5 run layer 0's body
        assert all(type(m)._needs_recompile() for m in stand_ins)
        # what ran: each distinct body once, as its boxed copy (runtime/lowering.py)
        runs = program.runners[direction].runs
        assert runs.keys() == done.bodies.keys()
        assert all(r._boxed_call for r in runs.values())


def test_depth_does_not_change_the_number_of_bodies():
    _, c3 = compile_and_step(3, "qwen3")
    _, c12 = compile_and_step(12, "qwen3")
    assert megacompile.stats(c3)["distinct_bodies"] == megacompile.stats(c12)["distinct_bodies"]
    # tied embedding/LM head: the tied gradient is summed in the embedding's backward segment,
    # so the first layer's backward stays identical to the others
    for c in (c3, c12):
        s = megacompile.stats(c)
        assert (s["distinct_layer_bodies"], s["distinct_backward_layer_bodies"]) == (1, 1)


def test_layers_of_different_shape_are_not_merged():
    model = tiny_model("llama", layers=3)
    # make layer 1 wider in its MLP: structurally different, must get its own body
    import torch.nn as nn
    mlp = model.model.layers[1].mlp
    mlp.gate_proj = nn.Linear(32, 96, bias=False)
    mlp.up_proj = nn.Linear(32, 96, bias=False)
    mlp.down_proj = nn.Linear(96, 32, bias=False)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ids, _, labels = batch(2, 8)
    cmodel(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    s = megacompile.stats(cmodel)
    assert s["distinct_layer_bodies"] == 2 and s["distinct_backward_layer_bodies"] == 2


def test_disabling_dedupe_lowers_one_body_per_segment():
    model = tiny_model("llama", layers=3)
    cmodel = torch.compile(model, backend="megatrain",
                           options={"device": "cpu", "disable_passes": ["dedupe_bodies"]})
    ids, _, labels = batch(2, 8)
    cmodel(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    assert megacompile.stats(cmodel)["distinct_layer_bodies"] == 3
    assert ("dedupe_bodies", "disabled", None) in programs_of(model)[0].pass_records["forward"]
