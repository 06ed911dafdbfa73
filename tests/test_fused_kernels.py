"""passes/fused_kernels.py: RMSNorm modules and SiLU-gated products become megatrain's Triton
kernels (custom ops in runtime/kernels/ops.py), and training is unchanged.

The kernels run under Triton's interpreter here (TRITON_INTERPRET=1); on CUDA `kernels="auto"`
turns the pass on. fp32 parity over 2 AdamW steps against eager: losses rtol 1e-5, weights
1e-4 (the kernels reduce in another order, which AdamW amplifies on near-zero gradients),
gradients of one step 1e-4/1e-5; bf16: one step, loss within 1e-2 relative.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the fused kernels need triton (pip install triton)")
# the interpreter stays on for this module's tests only (tests/conftest.py turns it off for the
# others: a leaked TRITON_INTERPRET=1 would run every fused op of the suite interpreted)
pytestmark = pytest.mark.triton_interpreter

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

import megacompile  # noqa: E402
from conftest import batch  # noqa: E402
from megacompile.backend import programs_of  # noqa: E402
from megacompile.errors import ConfigError  # noqa: E402

FAMILIES = {   # model_type, extra config, (rms_norm, swiglu) replaced for 2 layers
    "llama": ({}, (5, 2)),                                           # 2 per layer + final
    "qwen3": ({"head_dim": 8}, (9, 2)),                              # + q_norm, k_norm
    "gemma3_text": ({"head_dim": 8, "sliding_window": 4}, (13, 0)),  # 4 per layer, (1 + w); GELU MLP
}


def build(family, layers=2, hidden=32, dtype=torch.float32, **extra):
    values = dict(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg = AutoConfig.for_model(family, **{**values, **FAMILIES[family][0], **extra})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(dtype).train()


def replaced(model) -> dict:
    records = programs_of(model)[-1].pass_records["dynamo"]
    return next(counts for name, what, counts in records if name == "fused_kernels" and what == "replaced")


def body_ops(model, direction) -> set[str]:
    runner = programs_of(model)[-1].runners[direction]
    top = runner.graph
    return {str(n.target) for c in top.graph.nodes if c.op == "call_module"
            for n in getattr(top, c.target).graph.nodes if "megatrain" in str(n.target)}


def train(model, call, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        ids, mask, _ = batch(seed=step)
        ids = ids % 64
        labels = ids.masked_fill(mask == 0, -100)
        loss = call(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kernels_replace_norms_and_swiglu_and_train_like_eager(family):
    torch._dynamo.reset()
    model = build(family)
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "kernels": "triton"})
    losses = train(model, cmodel, 2)
    assert losses == pytest.approx(train(ref, ref, 2), rel=1e-5)
    # Adam turns a 1e-7 gradient difference on a near-zero gradient into up to lr (1e-2) of a
    # weight difference in the worst case; observed 2e-5
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4)
    rms, swiglu = FAMILIES[family][1]
    assert replaced(model) == {"rms_norm": rms, "swiglu": swiglu}
    assert "megatrain.rms_norm_backward.default" in body_ops(model, "backward")
    assert ("megatrain.swiglu.default" in body_ops(model, "forward")) == (swiglu > 0)
    assert megacompile.stats(cmodel)["distinct_layer_bodies"] == 1   # still one body per layer kind


def test_bf16_step_with_kernels():
    torch._dynamo.reset()
    model = build("llama", dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "kernels": "triton"})
    assert train(model, cmodel, 1) == pytest.approx(train(ref, ref, 1), rel=1e-2)
    assert replaced(model) == {"rms_norm": 5, "swiglu": 2}


class DoubledNorm(LlamaRMSNorm):
    """Other semantics, built from LlamaRMSNorm: must not become the kernel."""

    def forward(self, hidden_states):
        return super().forward(hidden_states) * 2


def test_only_modules_with_the_kernels_semantics_are_replaced():
    torch._dynamo.reset()
    model = build("llama")
    model.model.norm = DoubledNorm(32, eps=1e-6)
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "kernels": "triton"})
    assert train(model, cmodel, 1) == pytest.approx(train(ref, ref, 1), rel=1e-5)
    assert replaced(model) == {"rms_norm": 4, "swiglu": 2}


def test_kernels_option():
    """auto: only on CUDA; none: never; a wrong value names the choices."""
    from megacompile.options import Options
    assert Options.from_mapping({"device": "cpu"}).kernel_backend == "none"
    assert Options.from_mapping({"device": "cpu", "kernels": "triton"}).kernel_backend == "triton"
    with pytest.raises(ConfigError, match="'auto'"):
        Options.from_mapping({"kernels": "cuda"})
    torch._dynamo.reset()
    model = build("llama", layers=1)
    torch.compile(model, backend="megatrain", options={"device": "cpu"})(
        input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)
    assert not any(name == "fused_kernels" and what == "replaced"
                   for name, what, _ in programs_of(model)[-1].pass_records["dynamo"])


@settings(max_examples=3, deadline=None)
@given(family=st.sampled_from(sorted(FAMILIES)), layers=st.integers(1, 3), hidden=st.sampled_from([16, 24, 40]))
def test_property_the_pass_preserves_the_loss_and_gradients(family, layers, hidden):
    """Random depth and width (non-powers of two): one step's loss and gradients equal eager's."""
    torch._dynamo.reset()
    model = build(family, layers=layers, hidden=hidden, num_attention_heads=2, num_key_value_heads=1)
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "kernels": "triton"})
    ids, mask, _ = batch(seed=layers)
    ids = ids % 64
    for m in (cmodel, ref):
        m(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    assert replaced(model)["rms_norm"] >= 2 * layers + 1
