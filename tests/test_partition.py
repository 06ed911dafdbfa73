"""Layer-boundary recomputation: the backward receives only boundary activations and weights."""
from __future__ import annotations

import pytest
import torch

from conftest import batch, tiny_model
from megacompile.backend import programs_of
from megacompile.passes import WEIGHT_GROUP


def saved_for_backward(layers, b=2, s=8, family="llama", **options):
    torch._dynamo.reset()  # static shapes for each model, so sizes below are plain ints
    model = tiny_model(family, layers=layers)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", **options})
    ids, mask, labels = batch(b, s, pad_left=1)
    cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    graph = programs_of(model)[0].runners["backward"].graph
    phs = [n for n in graph.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    weights = [n for n in phs if WEIGHT_GROUP in n.meta]
    activations = [n for n in phs if WEIGHT_GROUP not in n.meta]
    return model, weights, activations


#: two depths compared must take the same path: layer_regions="auto" traces a 2-layer model whole
#: and a 5-layer one by layer kind, whose prologues may keep different rotary values
#: (test_layer_regions.py)
REGIONS = {"layer_regions": "always"}


def is_rng_state(n) -> bool:
    """A saved RNG state (to replay a dropout mask): its size is an unbacked symbol. The whole-graph
    partition names it rng_state_output_*, a layer kind's subgraph returns it as a getitem."""
    return any(not isinstance(d, int) for d in n.meta["val"].shape)


def test_only_boundary_hidden_states_are_saved():
    model, weights, activations = saved_for_backward(layers=4, recompute_head=True)
    hidden = [n for n in activations if isinstance(n.meta.get("val"), torch.Tensor)
              and tuple(n.meta["val"].shape) == (2, 8, 32)]
    # the embedding output and each layer's output: nothing from inside a layer
    assert len(hidden) == 4 + 1
    # (attention's RNG state is saved so the recompute replays the same dropout mask)
    big = [n for n in activations if isinstance(n.meta.get("val"), torch.Tensor)
           and n.meta["val"].numel() >= 2 * 8 * 32 and n not in hidden and not is_rng_state(n)]
    assert not big, [n.name for n in big]


def test_head_saves_do_not_depend_on_depth():
    """By default the min-cut decides what the head keeps; that set must not grow with depth."""
    _, _, a2 = saved_for_backward(layers=2, **REGIONS)
    _, _, a5 = saved_for_backward(layers=5, **REGIONS)
    non_layer = lambda acts: sorted(str(tuple(n.meta["val"].shape)) for n in acts  # noqa: E731
                                    if isinstance(n.meta.get("val"), torch.Tensor)
                                    and tuple(n.meta["val"].shape) != (2, 8, 32)
                                    and not is_rng_state(n))
    assert non_layer(a2) == non_layer(a5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: tied embedding / LM head
def test_weights_are_saved_as_primals_not_derived_views(family):
    model, weights, activations = saved_for_backward(layers=2, b=3, family=family)  # 24 tokens: no shape clash
    shapes = {tuple(str(d) for d in p.shape) for p in model.parameters() if p.dim() == 2}
    transposed = {s[::-1] for s in shapes} | shapes
    for n in activations:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = tuple(str(d) for d in val.shape)
            assert shape not in transposed, f"{n.name} looks like a transposed weight"
    assert all(n.name.startswith("primals_") for n in weights)


def test_saved_activations_grow_by_one_boundary_per_layer():
    _, _, a3 = saved_for_backward(layers=3, **REGIONS)
    _, _, a9 = saved_for_backward(layers=9, **REGIONS)

    rng_bytes = torch.get_rng_state().numel()  # RNG state sizes are unbacked symbols in the graph

    def nbytes(nodes):
        return sum(rng_bytes if is_rng_state(n) else
                   n.meta["val"].numel() * n.meta["val"].element_size() for n in nodes
                   if isinstance(n.meta.get("val"), torch.Tensor))
    per_layer = (nbytes(a9) - nbytes(a3)) / 6
    boundary = 2 * 8 * 32 * 4
    # one hidden state (segment attention is deterministic: no RNG state saved for its recompute,
    # as SDPA's dropout path saves; with attention="transformers" the RNG state is saved too)
    assert per_layer == boundary
    _, _, t3 = saved_for_backward(layers=3, attention="transformers", **REGIONS)
    _, _, t9 = saved_for_backward(layers=9, attention="transformers", **REGIONS)
    assert (nbytes(t9) - nbytes(t3)) / 6 == boundary + rng_bytes
