"""Weight residency: the device never holds more than the slot budget of weights."""
from __future__ import annotations

import pytest
import torch

import megacompile
from conftest import batch, tiny_model
from megacompile.runtime.weight_pool import DeviceWeightPool


def train_step(layers, slots=2, family="llama"):
    model = tiny_model(family, layers=layers)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "slots": slots,
                                                                 "debug_residency": True})
    ids, mask, labels = batch(2, 8, pad_left=1)
    cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    return model, megacompile.stats(cmodel)


def nbytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_peak_weight_bytes_do_not_grow_with_depth():
    model3, s3 = train_step(3)
    model12, s12 = train_step(12)
    assert s3["peak_device_weight_bytes"] == s12["peak_device_weight_bytes"]
    layer = max(nbytes(layer) for layer in model12.model.layers)
    outer = max(nbytes(model12.model.embed_tokens), nbytes(model12.lm_head) + nbytes(model12.model.norm))
    assert s12["peak_device_weight_bytes"] <= (2 + 1) * layer + outer
    assert s12["peak_device_weight_bytes"] < sum(p.numel() * 4 for p in model12.parameters()) / 3
    # every weight crosses the link in the forward; all but the embedding again in the backward
    total = sum(p.numel() * 4 for p in model12.parameters())
    assert total < s12["h2d_bytes"] <= 2 * total
    assert s12["d2h_bytes"] == total  # one fp32 gradient per weight


@pytest.mark.parametrize("slots", [1, 3])
def test_slot_budget_is_respected(slots):
    model, s = train_step(4, slots=slots)
    layer = max(nbytes(layer) for layer in model.model.layers)
    outer = max(nbytes(model.model.embed_tokens), nbytes(model.lm_head) + nbytes(model.model.norm))
    assert s["slots"] == slots
    assert s["peak_device_weight_bytes"] <= slots * max(layer, outer)


def test_embedding_and_head_stream_like_layers():
    """Embedding and head are fetched and evicted, not silently kept resident."""
    model, s = train_step(2)
    total = sum(p.numel() * 4 for p in model.parameters())
    assert s["peak_device_weight_bytes"] < total


def test_residency_check_catches_use_after_evict():
    pool = DeviceWeightPool(torch.device("cpu"), slots=1)

    class Entry:
        name = "w"

        def source(self):
            return torch.ones(4)

    pool.fetch(0, {7: Entry()})
    with pytest.raises(megacompile.ResidencyError, match="a body reads its weights while its weights are copying"):
        pool.views(0)   # (the schedule's wait comes before the body: its copy may be in flight)
    pool.wait(0)
    view = pool.views(0)[7]
    pool.check_resident(0, 7, view, "w")
    pool.evict(0)
    with pytest.raises(megacompile.ResidencyError, match="not resident"):
        pool.check_resident(0, 7, view, "w")
    with pytest.raises(megacompile.ResidencyError, match="slots=1"):
        pool.fetch(1, {1: Entry()})
        pool.fetch(2, {2: Entry()})


def test_stats_has_the_documented_keys():
    _, s = train_step(2)
    for key in ("peak_device_bytes", "peak_device_weight_bytes", "h2d_bytes", "d2h_bytes",
                "distinct_layer_bodies", "layers"):
        assert key in s
    assert s["layers"] == 2 and s["peak_device_bytes"] >= s["peak_device_weight_bytes"] > 0
