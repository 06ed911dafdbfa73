"""Sequence tiling of each layer (passes/tile_mlp.py, passes/tile_attention.py): each gated MLP
and the token-wise tail around it run tile by tile over the sequence, the attention per chunk of
queries, with the same losses and gradients within fp32 tolerances; the [tokens, intermediate]
and [tokens, hidden] values exist one tile at a time in the forward and the backward."""
from __future__ import annotations

import copy
import operator
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megacompile
from conftest import batch
from families import tiny_family_model
from megacompile.backend import programs_of
from megacompile.passes.tile_mlp import auto_tiles


def _run(model, tiles, ids, mask, labels):
    torch._dynamo.reset()
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "mlp_tiles": tiles})
    loss = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    loss.backward()
    program = programs_of(model)[-1]
    tiled = program.tile_counts
    return loss, [p.grad for p in model.parameters()], tiled, program


def _same_step(base, tiles, ids, mask, labels, chunks=None):
    """The tiled step's tile counts, after checking it trains as the whole one does (and, with
    `chunks`, that its attentions ran in those query chunks: passes/tile_attention.py)."""
    whole = _run(copy.deepcopy(base), 1, ids, mask, labels)
    tiled = _run(copy.deepcopy(base), tiles, ids, mask, labels)
    torch.testing.assert_close(tiled[0], whole[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(tiled[1], whole[1]):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    assert whole[2] == [] and whole[3].attention_chunks == []
    if chunks is not None:
        assert tiled[3].attention_chunks == chunks
    return tiled[2]


@pytest.mark.parametrize("family,mlps,attentions", [
    ("llama", 2, 2), ("phi3", 2, 2),       # gate/up, fused gate_up (a last-dim chunk); fused qkv_proj
    ("gemma3_text", 3, 3),                 # GELU (tanh), three layers of two kinds (sliding windows)
    ("qwen3_next", 4, 2),                  # an MoE's shared expert ([tokens, h]), hybrid linear attention,
                                           # a gated attention output (its gate computed with q)
    ("nemotron_h", 2, 1),                  # relu^2, the MLP layers of a hybrid stack
    ("qwen3_moe", 0, 2),                   # routed experts: no tail tiles, the chunks' outputs concatenated
    ("glm4", 2, 2),                        # interleaved RoPE (stack + flatten), partial rotary
    ("falcon_h1", 3, 3),                   # attention beside mamba: its mamba gate (a split's part) split per
                                           # tile; the chunks start at the normed input both mixers read
])
def test_tiled_layers_train_like_the_whole_ones(family, mlps, attentions):
    """Tail tiles and attention query chunks (fp32, within 1e-5 of the whole step)."""
    base = tiny_family_model(family)
    ids, mask, labels = batch(2, 16, seed=0, pad_left=2)
    assert _same_step(base, 3, ids, mask, labels, chunks=[3] * attentions) == [3] * mlps


@settings(max_examples=3, deadline=None)   # (each example compiles and runs a step: ~12 s on CI's cores)
@given(tiles=st.integers(2, 7), seq=st.integers(5, 23), pad=st.integers(0, 3))
def test_tile_counts_and_lengths(tiles, seq, pad):
    """Any tile count, including ones that do not divide the sequence (uneven tiles) and more
    tiles than tokens (capped at the sequence length)."""
    base = tiny_family_model("llama")
    ids, mask, labels = batch(2, seq, seed=seq, pad_left=min(pad, seq - 1))
    assert _same_step(base, tiles, ids, mask, labels, chunks=[min(tiles, seq)] * 2) == [min(tiles, seq)] * 2


def test_tiles_lower_the_layer_transients():
    """At 1024 tokens of a tiny Llama with a wide MLP (16x hidden), the planned intermediates of a layer
    body fall with 8 tiles, in the forward and in the backward (recompute + gradients)."""
    base = tiny_family_model("llama", max_position_embeddings=2048, intermediate_size=512)   # (MLP-dominated)
    ids, mask, labels = batch(1, 1024, seed=0)
    transients = {}
    for tiles in (1, 8):
        *_, program = _run(copy.deepcopy(base), tiles, ids, mask, labels)
        transients[tiles] = {d: max(v for k, v in c.plan.transient.items() if c.body_of.index(k) not in
                                    (0, len(c.body_of) - 1)) for d, c in program.compiled.items()}
    for d in ("forward", "backward"):
        assert transients[8][d] < 0.75 * transients[1][d], transients


def test_auto_tile_count():
    """none below 32K tokens; above, ceil(intermediate / hidden), doubled while a tile holds more
    than 64K tokens (Llama-3-8B: 4 tiles at 32K, 16 at 1M)."""
    assert auto_tiles(4096, 4096, 14336) == 1
    assert auto_tiles(32768, 4096, 14336) == 4
    assert auto_tiles(1 << 20, 4096, 14336) == 16
    assert auto_tiles(1 << 21, 4096, 14336) == 32


def test_mlp_tiles_option_is_checked():
    from megacompile.errors import ConfigError
    from megacompile.options import Options
    for bad in (0, -2, 1.5, "many", True):
        with pytest.raises(ConfigError, match="mlp_tiles"):
            Options.from_mapping({"mlp_tiles": bad})
    assert Options.from_mapping({"mlp_tiles": 4}).mlp_tiles == 4
    megacompile.Options()   # (the default: "auto")


def test_tiles_cover_the_token_wise_tail_of_each_layer():
    """The tiled region grows from the MLP over its layer's token-wise ops: the output projection,
    both residual adds and the norm before the MLP run per tile; the attention itself does not."""
    from megacompile.passes.tile_mlp import mlp_regions
    base = tiny_family_model("llama")
    regions = []

    def look(gm, _inputs):
        regions.extend(mlp_regions(gm))
        return gm.forward

    ids, mask, labels = batch(2, 16)
    torch._dynamo.reset()
    torch.compile(base, backend=look)(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    assert len(regions) == 2
    for members, inputs, output in regions:
        paths = {p for n in members for p, _ in (n.meta.get("nn_module_stack") or {}).values()}
        assert any(p.endswith("self_attn.o_proj") for p in paths) and any(p.endswith("post_attention_layernorm")
                                                                          for p in paths)
        assert not any(p.endswith(("q_proj", "input_layernorm")) for p in paths)
        assert len(inputs) == 2   # (the attention's output and the layer's input)
        assert output.target is operator.add   # (the second residual add: the layer's output)


def test_tile_gradients_are_gathered_by_one_cat():
    """The tiles come from one split, whose backward is one cat of their gradients: no full-size
    slice_backward per tile summed into the input's gradient (three [tokens, hidden] values at once)."""
    base = tiny_family_model("llama")
    ids, mask, labels = batch(2, 16, seed=0)
    *_, program = _run(copy.deepcopy(base), 4, ids, mask, labels)
    code = "\n".join(b.code for b in program.compiled["backward"].bodies.values())
    assert "split_with_sizes" in "\n".join(b.code for b in program.compiled["forward"].bodies.values())
    # (rotary's rotate_half still slices the last dimension of [b, heads, s, d])
    assert not re.search(r"slice_backward\.default\(\w+, \[\d+, \d+, \d+\], 1,", code) and "cat" in code


def _long_step(base, ids, options):
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "logits": "drop", **options})
    loss = cmodel(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    program = programs_of(model)[-1]
    tiles = program.tile_counts
    return loss, [p.grad for p in model.parameters()], tiles, program.last_stats["peak_device_bytes"]


def test_a_device_budget_chooses_the_tiles():
    """mlp_tiles "auto" under a device_budget the untiled step does not fit: the backend compiles
    again with 2, 4, ... tiles and keeps the fewest that fit; the step's measured peak is within
    the budget and it trains as the untiled one does (fp32, 1e-5)."""
    base = tiny_family_model("llama", hidden_size=64, intermediate_size=512, max_position_embeddings=4096)
    ids = batch(1, 512, seed=1)[0]
    loss, grads, tiles, peak = _long_step(base, ids, {})
    assert tiles == []   # (auto: none below 32K tokens)
    *_, peak8 = _long_step(base, ids, {"mlp_tiles": 8})
    budget = (peak + peak8) // 2
    tiled_loss, tiled_grads, chosen, tiled_peak = _long_step(base, ids, {"device_budget": budget})
    assert chosen and chosen[0] > 1 and tiled_peak <= budget, (chosen, tiled_peak, budget, peak, peak8)
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(tiled_grads, grads):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


@pytest.mark.slow   # (~40 s: the search compiles 1, 2, 4, 8, ... tiles before it gives up)
def test_a_budget_no_tile_count_meets_is_refused_with_the_lowest_peak():
    base = tiny_family_model("llama", hidden_size=64, intermediate_size=512, max_position_embeddings=2048)
    ids = batch(1, 1024, seed=1)[0]
    *_, peak = _long_step(base, ids, {})
    *_, peak8 = _long_step(base, ids, {"mlp_tiles": 8})
    with pytest.raises(Exception, match="CannotFitError: cannot fit a training step") as refused:
        _long_step(base, ids, {"device_budget": peak8 // 3})
    smallest = int(re.search(r"smallest budget that fits this schedule is (\d+) bytes", str(refused.value))[1])
    assert smallest < peak   # (a tiled schedule's peak: the search's lowest)


_BUDGET_MODEL = {}


def _budget_model():
    """A tiny Llama whose MLP dominates a 512-token layer, and its untiled step's planned peak."""
    if not _BUDGET_MODEL:
        base = tiny_family_model("llama", hidden_size=64, intermediate_size=512, max_position_embeddings=1024)
        ids = batch(1, 512, seed=2)[0]
        *_, peak = _long_step(base, ids, {"overlap_grads": False})
        _BUDGET_MODEL.update(base=base, ids=ids, peak=peak)
    return _BUDGET_MODEL["base"], _BUDGET_MODEL["ids"], _BUDGET_MODEL["peak"]


@settings(max_examples=3, deadline=None)
@given(fraction=st.floats(0.6, 1.0))
def test_under_any_budget_the_plan_bounds_the_measured_peak(fraction):
    """Whatever budget the tiles are chosen under: the step is refused, or its planned peak is
    within the budget, at least what its tensors hold (measured by a dispatch mode, independent
    of the plan) and at most 10% above it."""
    from device_bytes import host_grads, measure_step
    base, ids, untiled = _budget_model()
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    options = {"device": "cpu", "logits": "drop", "overlap_grads": False, "device_budget": int(untiled * fraction)}
    cmodel = torch.compile(model, backend="megatrain", options=options)
    try:
        cmodel(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    except Exception as e:
        assert "CannotFitError" in str(e), e
        return
    program = programs_of(model)[-1]
    planned = max(c.plan.peak_bytes for c in program.compiled.values())
    model.zero_grad(set_to_none=True)
    with measure_step(program) as probe:
        cmodel(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    measured = probe.peak(exclude=host_grads(probe, model))
    assert planned <= options["device_budget"]
    assert measured <= planned <= 1.10 * measured, (planned, measured, fraction)
