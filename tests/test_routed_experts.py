"""Routing-aware expert transfer (`options={"routed_experts": True}`, passes/routed_experts.py).

Only the experts the router picked cross the link, in the forward and in the backward, and
only their gradients come back; training is unchanged: every MoE family of the matrix matches
eager over 3 AdamW steps, and the bytes moved are exactly the full transfer minus the rows of
the experts that got no tokens.
"""
from __future__ import annotations

import copy

import pytest
import torch

import megacompile
from conftest import batch, run_steps
from families import FAMILIES, tiny_family_model

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
MOE = sorted(name for name, fam in FAMILIES.items() if any(k in fam.overrides for k in EXPERT_KEYS))
# experts computed densely: every token goes through every expert, so every row is read
DENSE_EXPERTS = {"llama4_text": "Llama4TextExperts runs a bmm over all experts for every token"}
# CI runs one family of each routing style; the others are marked slow (pytest -m slow)
# (CI: one softmax-top-k and one grouped sigmoid router; GPT-OSS and Qwen3-Next, 40 and 70 s
# here, run with -m slow; both families train like eager in CI in test_families)
IN_CI = {"qwen3_moe", "deepseek_v3"}
SHAPES = [(1, 6, 0), (2, 5, 1), (1, 6, 2)]   # few tokens: most of the 16 experts stay idle


def many_experts(name, dtype=torch.float32):
    key = next(k for k in EXPERT_KEYS if k in FAMILIES[name].overrides)
    return tiny_family_model(name, dtype=dtype, **{key: 16})


def compiled(model, routed=True, **options):
    return torch.compile(model, backend="megatrain",
                         options={"device": "cpu", "routed_experts": routed, "debug_residency": True, **options})


def test_every_moe_family_is_covered():
    assert {"qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "qwen3_next", "qwen3_5_moe_text"} <= set(MOE)


@pytest.mark.parametrize("name", [n if n in IN_CI else pytest.param(n, marks=pytest.mark.slow) for n in MOE])
def test_routed_experts_train_like_eager(name):
    model = many_experts(name)
    ref = copy.deepcopy(model)
    cmodel = compiled(model)
    ours = run_steps(model, cmodel, torch.optim.AdamW(model.parameters(), lr=1e-3), 3, SHAPES)
    theirs = run_steps(ref, ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), 3, SHAPES)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=0)
    for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=lambda m: f"{pname}: {m}")
    s = megacompile.stats(cmodel)
    if name in DENSE_EXPERTS:
        assert s["routed_weights"] == 0   # nothing to skip: the pass leaves them alone
    else:
        assert s["routed_weights"] >= 2   # at least one layer's stacked projections
        assert s["h2d_bytes"] < 2 * s["weight_bytes"]


def active_experts_per_layer(model, ids, mask):
    """The experts each MoE layer routes tokens to, observed on an eager forward."""
    seen = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(set(args[1].flatten().tolist())))
             for m in model.modules() if type(m).__name__.endswith("Experts")]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for h in hooks:
        h.remove()
    return seen


def test_bytes_moved_are_the_routed_rows_exactly():
    model = many_experts("qwen3_moe")
    full_model = copy.deepcopy(model)
    ids, mask, labels = batch(1, 6)
    active = active_experts_per_layer(copy.deepcopy(model), ids, mask)
    assert len(active) == 2 and all(len(a) < 16 for a in active)

    figures = {}
    for routed, m in ((False, full_model), (True, model)):
        torch._dynamo.reset()
        cm = compiled(m, routed)
        cm(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
        figures[routed] = megacompile.stats(cm)
    # per layer two stacked weights (gate_up_proj, down_proj) of 16 expert rows, fp32
    layer = model.model.layers[0].mlp.experts
    row_bytes = sum(w[0].numel() * 4 for w in (layer.gate_up_proj, layer.down_proj))
    idle_rows = sum(16 - len(a) for a in active)
    full, ours = figures[False], figures[True]
    assert ours["routed_weights"] == 4
    assert ours["h2d_bytes"] == full["h2d_bytes"] - 2 * idle_rows * row_bytes   # forward + backward
    assert ours["d2h_bytes"] == full["d2h_bytes"] - idle_rows * row_bytes
    for p, q in zip(model.parameters(), full_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_routed_experts_in_bf16_match_the_full_transfer():
    model = many_experts("gpt_oss", torch.bfloat16)   # expert biases stay fully transferred
    full_model = copy.deepcopy(model)
    losses = {}
    for routed, m in ((False, full_model), (True, model)):
        torch._dynamo.reset()
        losses[routed] = run_steps(m, compiled(m, routed), torch.optim.AdamW(m.parameters(), lr=1e-3), 2, SHAPES)
    assert losses[True] == losses[False]
    for p, q in zip(model.parameters(), full_model.parameters()):
        assert torch.equal(megacompile.master_weight(p), megacompile.master_weight(q))


def test_dense_models_are_untouched():
    model = tiny_family_model("llama")
    cmodel = compiled(model)
    ids, mask, labels = batch(2, 8)
    cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    assert megacompile.stats(cmodel)["routed_weights"] == 0
