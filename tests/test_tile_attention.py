"""Attention in query chunks (passes/tile_attention.py): each chunk runs its queries' input norm,
q projection and RoPE and attends the whole K and V (built tile by tile), just before the tail's
tile that reads it. Parity per family is in test_tile_mlp.py (the tiles and the chunks run
together); here: the op pattern, the memory it saves (planned and measured), what keeps its
whole attention, and the sequence-dimension rule of indexing."""
from __future__ import annotations

import copy
import logging

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import batch
from families import tiny_family_model
from megacompile.backend import programs_of
from megacompile.passes.tile_attention import _indexed


def _step(base, ids, options, measure=False):
    from device_bytes import host_grads, measure_step
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    cmodel = torch.compile(model, backend="megatrain",
                           options={"device": "cpu", "logits": "drop", "overlap_grads": False, **options})
    loss = cmodel(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    program = programs_of(model)[-1]
    grads = [p.grad.clone() for p in model.parameters()]
    measured = None
    if measure:
        model.zero_grad(set_to_none=True)
        with measure_step(program) as probe:
            cmodel(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        measured = probe.peak(exclude=host_grads(probe, model))
    return loss, grads, program, measured


def test_each_chunk_attends_the_whole_keys_with_its_own_queries():
    """In the layer bodies, forward and backward: one attention call per chunk, its queries a
    tile of the sequence and its keys all of it, from its `q_start`; the q projection runs per
    tile, and so do the k and v projections (K and V are concatenated from their tiles)."""
    base = tiny_family_model("llama")
    ids = batch(1, 24, seed=0)[0]
    *_, program, _ = _step(base, ids, {"mlp_tiles": 4})
    assert program.attention_chunks == [4, 4]
    for direction, compiled in program.compiled.items():
        layer = max(compiled.bodies.values(), key=lambda b: len(b.graph.nodes))
        calls = [n for n in layer.graph.nodes if "segment_attention" in str(n.target)
                 and ("backward" in str(n.target)) == (direction == "backward")]   # (the backward also recomputes)
        assert len(calls) == 4, direction
        starts = {}
        for n in calls:
            back = "backward" in str(n.target)
            q, k = n.args[back].meta["val"], n.args[1 + back].meta["val"]
            assert (q.shape[2], k.shape[2]) == (6, 24), direction
            starts[n] = n.args[6 + 3 * back] if len(n.args) > 6 + 3 * back else 0   # (0: the default, dropped)
        assert sorted(starts.values()) == [0, 6, 12, 18], direction
    forward = max(program.compiled["forward"].bodies.values(), key=lambda b: len(b.graph.nodes))
    matmuls = [n for n in forward.graph.nodes if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    # per tile: q, k, v, o, gate, up, down (the input norm runs twice: once for K and V, once for q)
    assert len(matmuls) == 7 * 4


def test_chunks_lower_the_planned_and_measured_backward_peak():
    """At 512 tokens with 8 tiles, the step with the attention in query chunks plans and measures
    a lower peak than with the whole attention (its q, output and their gradients were whole
    [tokens, hidden] values), trains the same (fp32, 1e-5), and the plan bounds the measure."""
    base = tiny_family_model("llama", hidden_size=64, intermediate_size=128, max_position_embeddings=1024)
    ids = batch(1, 512, seed=3)[0]
    options = {"mlp_tiles": 8, "offload_checkpoints": "always"}
    whole = _step(base, ids, {**options, "disable_passes": ["tile_attention"]}, measure=True)
    chunked = _step(base, ids, options, measure=True)
    assert whole[2].attention_chunks == [] and chunked[2].attention_chunks == [8, 8]
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(chunked[1], whole[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    planned = {name: max(c.plan.peak_bytes for c in run[2].compiled.values())
               for name, run in (("whole", whole), ("chunked", chunked))}
    layer = {name: max(c.plan.transient[b] for b in c.body_of[1:-1]) for name, run in
             (("whole", whole), ("chunked", chunked)) for c in [run[2].compiled["backward"]]}
    assert planned["chunked"] < planned["whole"] and layer["chunked"] < 0.8 * layer["whole"], (planned, layer)
    assert chunked[3] < whole[3], (chunked[3], whole[3])
    assert chunked[3] <= planned["chunked"] <= 1.10 * chunked[3], (planned, chunked[3])


def test_keys_written_in_place_keep_the_whole_attention(caplog):
    """DeepSeek-V3's attention builds its keys by copying into slices of a new tensor (in-place
    writes are not sequence-local ops): its layers keep their whole attention, say why in the
    debug log, and still train like the untiled step."""
    base = tiny_family_model("deepseek_v3")
    ids, mask, labels = batch(2, 16, seed=0, pad_left=2)
    with caplog.at_level(logging.DEBUG, logger="megatrain.passes"):
        *_, program, _ = _step(base, ids, {"mlp_tiles": 3})
    assert program.attention_chunks == [] and program.tile_counts
    assert "keeps its whole attention" in caplog.text and "read outside the attention" in caplog.text


@settings(max_examples=60, deadline=None)
@given(data=st.data(), nd=st.integers(1, 5))
def test_indexing_moves_the_sequence_dimension_as_torch_does(data, nd):
    """_indexed(index, nd, d): where x[index] has x's sequence dimension d, or None when the
    index cuts into it; checked against torch on a tensor whose sequence dimension alone has
    length 13."""
    d = data.draw(st.integers(0, nd - 1))
    shape = [13 if i == d else data.draw(st.integers(2, 5)) for i in range(nd)]
    entry = st.one_of(st.none(), st.just(slice(None)), st.just(slice(1, None)), st.just(slice(None, None, 2)),
                      st.integers(0, 1))
    index = data.draw(st.lists(entry, max_size=nd))
    if data.draw(st.booleans()):
        index.insert(data.draw(st.integers(0, len(index))), Ellipsis)
    index = tuple(index)
    if sum(e is not None and e is not Ellipsis for e in index) > nd:
        return
    out = torch.empty(shape)[index]
    want = list(out.shape).index(13) if list(out.shape).count(13) == 1 else None
    assert _indexed(index, nd, d) == want, (shape, index, out.shape)
