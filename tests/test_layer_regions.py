"""Layer regions (passes/layer_subgraphs.py): AOTAutograd traces each layer kind once, and the
program that comes out is the one the whole-graph trace gives.

"The program" here is what the runtime runs per decoder layer, embedding and head: the segments
in order with the weights each fetches and the gradients it finalises, which layers share a
lowered body, and the schedule's transfer ops (prefetch/wait/evict/grad_offload and checkpoint
offload/reload) with their bytes. The prologue (weight-free values every layer reads: rotary
tables, masks) may differ: the whole-graph partition may keep the concatenated rotary
frequencies and recompute cos/sin from them in the backward's prologue, the regional one keeps
cos/sin, which each layer call reads.
"""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from families import COMMON, FAMILIES
from random_stacks import VOCAB, RandomStack, stack_specs

from megacompile.backend import programs_of
from megacompile.errors import ConfigError
from megacompile.inspect import build_model_from_config, capture_program
from megacompile.options import Options

FLAT = {"disable_passes": ["layer_subgraphs"]}
REGIONS = {"layer_regions": "always"}


def layout(program) -> dict:
    """Per direction: the layer/embedding/head segments (group, weights, grads), which of them
    share a body, and the schedule ops on them, in order."""
    out = {}
    for direction, done in program.compiled.items():
        segs = done.schedule.segments
        kept = [k for k, seg in enumerate(segs) if seg.group >= 0]
        bodies: dict[str, int] = {}
        out[direction] = {
            "segments": [(segs[k].group, tuple(segs[k].weights), segs[k].weight_nbytes,
                          tuple(sorted(i for i, _ in segs[k].grads))) for k in kept],
            "shared_bodies": [bodies.setdefault(done.body_of[k], len(bodies)) for k in kept],
            "steps": [(s.op, s.stream, segs[s.segment].group, s.nbytes) for s in done.schedule.steps
                      if segs[s.segment].group >= 0 and s.op != "run"],
        }
    return out


def capture(name: str, options: dict | None = None, **overrides):
    fam = FAMILIES[name]
    config = AutoConfig.for_model(fam.model_type, **{**COMMON, **fam.overrides, **overrides})
    config.use_cache = False
    model = build_model_from_config(config, None, torch.float32)
    return capture_program(model, batch=2, seq=16, slots=2, options=options)


#: the families whose graph is traced whole, and why (every other family forms its layer kinds)
STAYS_FLAT = {"zamba2": "a shared block", "jamba": "functorch transforms", "recurrent_gemma": "a graph of its own"}


def check_family(name: str) -> None:
    regional, flat = capture(name, REGIONS), capture(name, FLAT)
    assert flat.layer_regions is None   # (the pass disabled: no record)
    assert layout(regional) == layout(flat), name
    regions = regional.layer_regions
    if name in STAYS_FLAT:
        assert STAYS_FLAT[name] in regions.off, regions
    else:
        assert not regions.off, regions
        assert len(regions.kinds) == FAMILIES[name].layer_kinds, regions
        assert sorted(g for gs in regions.kinds.values() for g in gs) == list(range(1, regional.capture.num_layers + 1))


# one per shape of layer stack: dense, two kinds (own rotary tables), hybrid linear attention +
# MoE, a shared block (stays flat, with its reason)
CI_FAMILIES = ["llama", "gemma3_text", "qwen3_next", "zamba2"]


@pytest.mark.parametrize("name", CI_FAMILIES)
def test_the_regional_trace_gives_the_whole_graph_program(name):
    check_family(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(FAMILIES) - set(CI_FAMILIES)))
def test_the_regional_trace_gives_the_whole_graph_program_for_every_family(name):
    check_family(name)


def test_why_a_graph_stays_flat_is_recorded():
    assert "recompute='selective'" in capture("llama", {"recompute": "selective", **REGIONS}).layer_regions.off
    assert capture("llama", {"layer_regions": False}).layer_regions.off == "option layer_regions='never'"
    # "auto" (the default) forms them where they save 3 layer traces or more
    assert capture("llama").layer_regions.off == ("layer_regions='auto': 2 decoder layer(s) of 1 kind(s) save fewer "
                                                  "than 3 traces")
    assert "3 decoder layer(s) of 2 kind(s)" in capture("gemma3_text").layer_regions.off
    deep = capture("llama", num_hidden_layers=4).layer_regions
    assert deep.off == "" and list(deep.kinds.values()) == [[1, 2, 3, 4]]
    # (True and False, its values before "auto", still mean always and never)
    assert [Options.from_mapping({"layer_regions": v}).layer_regions for v in (True, False)] == ["always", "never"]
    with pytest.raises(ConfigError, match=r"option layer_regions='sometimes' \(str\): expected 'auto' \(when"):
        Options.from_mapping({"layer_regions": "sometimes"})


def _step(model, ids, labels, options):
    torch._dynamo.reset()
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "slots": 2, **options})
    loss = cmodel(ids, labels)
    loss.backward()
    return loss, programs_of(model)[-1]


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=stack_specs(max_layers=4), seed=st.integers(0, 2**16))
def test_random_stacks_give_the_same_program_and_numbers_either_way(spec, seed):
    torch.manual_seed(seed)
    model = RandomStack(spec)
    flat_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 6), generator=g)
    labels = torch.randint(0, VOCAB, (2, 6), generator=g)
    loss, regional = _step(model, ids, labels, REGIONS)
    flat_loss, flat = _step(flat_model, ids, labels, FLAT)
    torch.testing.assert_close(loss, flat_loss, rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(model.named_parameters(), flat_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert layout(regional) == layout(flat)


def test_a_long_skip_lets_the_regional_backward_share_more_bodies():
    """Found in review (a Hypothesis example): with a long skip the whole-graph trace's CSE merges
    the skip glue into one layer's backward, so alike layers lower distinct backward bodies; the
    regional trace keeps them alike. Everything else in the program is the same."""
    from random_stacks import BlockSpec, StackSpec, compiled_step, stack_and_batch
    spec = StackSpec(8, (BlockSpec("mlp", 8, -1), BlockSpec("mlp", 8, -1), BlockSpec("mlp", 8, 0)), False, False)
    model, ids, labels = stack_and_batch(spec, 0)
    flat_model = copy.deepcopy(model)
    compiled_step(model, ids, labels, {"slots": 2, **REGIONS})
    compiled_step(flat_model, ids, labels, {"slots": 2, **FLAT})
    regional, flat = layout(programs_of(model)[-1]), layout(programs_of(flat_model)[-1])
    assert regional["forward"] == flat["forward"]
    for key in ("segments", "steps"):
        assert regional["backward"][key] == flat["backward"][key]
    assert regional["backward"]["shared_bodies"] == [0, 1, 2, 1, 3]
    assert flat["backward"]["shared_bodies"] == [0, 1, 2, 3, 4]
