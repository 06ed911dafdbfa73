"""passes/fused_lm_loss.py + megatrain::linear_cross_entropy: with logits="drop" the LM head and
the loss run as one chunked op, the output's logits is None, and training is unchanged.

Tolerances on the same model and data over 2 AdamW steps: fp32 against eager, losses rel 1e-5,
gradients 1e-5 absolute; bf16 against megatrain with the logits kept (which keeps fp32 masters,
as eager bf16 AdamW does not), losses and gradients bit-identical: the op rounds the logits and
their gradient exactly where eager does. The op itself (torch math here; the Triton kernel in
test_kernels_linear_ce.py) is checked against plain `cross_entropy(logits.float())` over random
shapes, chunkings, reductions and ignored tokens.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM

import megacompile
from conftest import batch
from families import COMMON
from megacompile.backend import programs_of
from megacompile.errors import ConfigError
from megacompile.runtime.kernels import ops  # noqa: F401  (registers torch.ops.megatrain.*)
from megacompile.runtime.kernels.chunked_ce import loss_and_grads, torch_chunk


def build(model_type: str, dtype=torch.float32, **extra):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **extra})
    return AutoModelForCausalLM.from_config(cfg).to(dtype).train()


def fresh():
    torch._dynamo.reset()
    megacompile.compile_start.register()  # reset() drops Dynamo's compile-start callbacks


def fused_count(model) -> int:
    records = programs_of(model)[-1].pass_records["dynamo"]
    return next(c["lm_head_cross_entropy"] for name, what, c in records
                if name == "fused_lm_loss" and what == "replaced")


def grads(model):
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type,dtype,extra", [
    ("llama", torch.bfloat16, {}),
    ("qwen3", torch.float32, {"tie_word_embeddings": True}),       # the head's weight is the embedding
    ("qwen3_moe", torch.float32, {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                  "output_router_logits": True}),  # loss = CE + aux loss
])
def test_training_matches_eager_without_logits(model_type, dtype, extra):
    model = build(model_type, dtype, **extra)
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"logits": "drop"})
    cref = torch.compile(ref, backend="megatrain") if dtype == torch.bfloat16 else ref
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    for step in range(2):
        ids, mask, labels = batch(2, 8, seed=step, pad_left=3)
        out = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        expect = cref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        assert out.logits is None
        out.loss.backward()
        expect.loss.backward()
        exact = dtype == torch.bfloat16
        # the loss is cross_entropy's bit for bit in both dtypes (row losses by log_softmax, reduced by
        # nll_loss); fp32 gradients differ in the last bits: the chunked head matmuls sum in another order
        torch.testing.assert_close(out.loss, expect.loss, rtol=0, atol=0)
        got, want = grads(model), grads(ref)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0 if exact else 1e-4,
                                       atol=0 if exact else 1e-5, msg=name)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert fused_count(model) == 1


def test_num_items_in_batch_sum_reduction():
    """HF's gradient-accumulation normalisation: reduction='sum', then / num_items_in_batch."""
    model = build("llama")
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"logits": "drop"})
    ids, mask, labels = batch(2, 8, pad_left=2)
    n = torch.tensor(23)
    out = cmodel(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n, use_cache=False)
    expect = ref(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n, use_cache=False)
    torch.testing.assert_close(out.loss, expect.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward(), expect.loss.backward()
    torch.testing.assert_close(model.lm_head.weight.grad, ref.lm_head.weight.grad, rtol=1e-4, atol=1e-6)
    assert fused_count(model) == 1


def test_device_peak_no_longer_scales_with_the_vocabulary():
    """At vocab 8192 x 512 tokens the logits path (bf16 logits, fp32 upcast, its gradient)
    dominates the step; without logits the planned peak falls by more than half."""
    peaks = {}
    for logits in ("keep", "drop"):
        fresh()
        model = build("llama", torch.bfloat16, vocab_size=8192)
        cmodel = torch.compile(model, backend="megatrain", options={"logits": logits})
        ids = torch.randint(0, 8192, (2, 256))
        cmodel(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        peaks[logits] = megacompile.stats(model)["peak_device_bytes"]
    logits_bytes = 512 * 8192 * 2
    assert peaks["keep"] > 4 * logits_bytes
    assert peaks["drop"] < peaks["keep"] / 2, peaks


def test_softcapped_logits_are_left_alone_with_a_warning():
    """Gemma2 caps the logits (tanh) before the loss: not the pattern, so nothing is fused."""
    model = build("gemma2", sliding_window=4)
    cmodel = torch.compile(model, backend="megatrain", options={"logits": "drop"})
    ids, mask, labels = batch(2, 8)
    with pytest.warns(UserWarning, match="softcapping"):
        out = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    assert out.logits is not None and fused_count(model) == 0


def test_without_labels_the_logits_stay():
    model = build("llama")
    cmodel = torch.compile(model, backend="megatrain", options={"logits": "drop"})
    ids, mask, _ = batch(2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cmodel(input_ids=ids, attention_mask=mask, use_cache=False)
    assert out.logits.shape == (2, 8, COMMON["vocab_size"])
    assert any("computes no loss" in str(w.message) for w in caught)


def test_default_keeps_the_logits_and_bad_value_is_refused():
    model = build("llama")
    out = torch.compile(model, backend="megatrain")(*batch(2, 8)[:1], labels=batch(2, 8)[2], use_cache=False)
    assert out.logits is not None
    with pytest.raises(ConfigError, match="logits='none'.*'keep'"):
        megacompile.Options.from_mapping({"logits": "none"})


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), vocab=st.integers(2, 300), hidden=st.integers(1, 24),
       chunk=st.one_of(st.none(), st.integers(1, 17)), reduction=st.sampled_from(["mean", "sum"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), ignored=st.floats(0, 0.9), seed=st.integers(0, 99))
def test_chunked_op_matches_cross_entropy(rows, vocab, hidden, chunk, reduction, dtype, ignored, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[torch.rand(rows, generator=g) < ignored] = -100
    labels[0] = 0   # at least one token counts ("mean" over none is nan, as in torch)
    loss, dh, dw = loss_and_grads(h.detach(), w.detach(), labels, reduction, -100, True, True, torch_chunk,
                                  chunk_size=chunk)
    ref = torch.nn.functional.cross_entropy((h @ w.t()).float(), labels, reduction=reduction)
    ref.backward()
    exact = dtype == torch.bfloat16 and chunk is None   # one chunk: the same matmuls as eager
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss, ref, **tol)
    torch.testing.assert_close(dh, h.grad, **({"rtol": 0, "atol": 0} if exact else tol))
    torch.testing.assert_close(dw.float(), w.grad.float(), **tol)
