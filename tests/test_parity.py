"""Training parity with eager PyTorch: same model, same data, AdamW steps."""
from __future__ import annotations

import copy

import pytest
import torch

import megacompile
from conftest import Fp32MasterReference, batch, tiny_model
from conftest import run_steps as _run_steps

SHAPES = [(2, 8, 0), (2, 8, 2), (3, 11, 3), (2, 9, 1), (3, 7, 0)]  # (batch, seq, left padding)


def run_steps(model, call, opt, steps, shapes=SHAPES):
    return _run_steps(model, call, opt, steps, shapes)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp32_training_matches_eager(family):
    model = tiny_model(family, layers=3)
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "debug_residency": True})
    ours = run_steps(model, cmodel, torch.optim.AdamW(model.parameters(), lr=1e-3), 5)
    theirs = run_steps(ref, ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), 5)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
    assert megacompile.stats(cmodel)["layers"] == 3


def test_gradients_match_eager_before_any_step():
    model = tiny_model("llama", layers=2)
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ids, mask, labels = batch(2, 10, pad_left=3)
    cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_gradient_accumulation_adds_into_param_grad():
    model = tiny_model("llama", layers=2)
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    for seed in (1, 2):
        ids, mask, labels = batch(2, 8, seed=seed)
        cmodel(input_ids=ids, labels=labels, use_cache=False).loss.backward()
        ref(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_bf16_gradients_are_fp32_and_accumulate():
    model = tiny_model("llama", layers=2, dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    expected = [torch.zeros(p.shape) for p in ref.parameters()]
    for seed in (1, 2):
        ids, _, labels = batch(2, 8, seed=seed)
        cmodel(input_ids=ids, labels=labels, use_cache=False).loss.backward()
        ref(input_ids=ids, labels=labels, use_cache=False).loss.backward()
        for e, q in zip(expected, ref.parameters()):
            e += q.grad.float()
            q.grad = None
    for p, e in zip(model.parameters(), expected):
        assert p.dtype == torch.bfloat16 and p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, e, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_model_trains_with_fp32_masters(family):
    model = tiny_model(family, layers=2, dtype=torch.bfloat16)
    ref = Fp32MasterReference(copy.deepcopy(model), lr=1e-3)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ours = run_steps(model, cmodel, opt, 4)
    theirs = run_steps(ref.model, ref, ref, 4)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1.6e-2, atol=1e-2)
    diffs = []
    for p, m in zip(model.parameters(), ref.masters):
        assert p.dtype == torch.bfloat16                     # what Dynamo traced stays as it was
        master = megacompile.master_weight(p)
        assert master.dtype == torch.float32                  # updates land in fp32 masters
        diffs.append((master - m).detach().abs().flatten())
        torch.testing.assert_close(p.float(), master.bfloat16().float())  # transfer copy is fresh
    # bf16 rounding can flip the sign of an Adam update where the gradient is ~0; one update
    # moves a weight by at most ~lr, so elementwise the bound is 2 * steps * lr, and over the
    # whole model the masters must agree far more tightly.
    diff = torch.cat(diffs)
    assert diff.max() <= 2 * 4 * 1e-3 and diff.mean() < 2e-5, (diff.max(), diff.mean())
    state = next(iter(opt.state.values()))
    assert state["exp_avg"].dtype == torch.float32


def test_inference_under_no_grad_matches_eager():
    model = tiny_model("llama", layers=2)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ids, mask, _ = batch(2, 8, pad_left=2)
    with torch.no_grad():
        ours = cmodel(input_ids=ids, attention_mask=mask, use_cache=False).logits
        theirs = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_frozen_embeddings_get_no_grad():
    model = tiny_model("llama", layers=2)
    model.model.embed_tokens.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ids, _, labels = batch(2, 8)
    cmodel(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    ref(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    assert model.model.embed_tokens.weight.grad is None
    for p, q in zip(model.parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_shape_changes_recompile_at_most_once():
    model = tiny_model("llama", layers=2)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shapes = [(2, 8, 0), (3, 12, 1), (2, 9, 0), (4, 5, 2), (3, 16, 0), (2, 7, 1)]
    run_steps(model, cmodel, opt, len(shapes), shapes)
    # one graph for the first shape, one dynamic graph for every later one
    assert megacompile.stats(cmodel)["compiled_graphs"] == 2


def test_weights_loaded_between_steps_reach_masters_and_device():
    """load_state_dict between steps: the next forward sees the new weights, the masters follow."""
    model = tiny_model("llama", layers=2, dtype=torch.bfloat16)
    other = tiny_model("llama", layers=2, dtype=torch.bfloat16, seed=7)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, _, labels = batch(2, 8)
    cmodel(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    opt.step()
    opt.zero_grad()
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        ours = cmodel(input_ids=ids, use_cache=False).logits
        theirs = other(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(ours, theirs)
    cmodel(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    opt.step()
    for p, q in zip(model.parameters(), other.parameters()):
        # one Adam step away from the loaded weights, not from the old masters
        assert (megacompile.master_weight(p) - q.float()).abs().max() <= 1.5e-3
