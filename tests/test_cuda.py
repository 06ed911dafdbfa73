"""The same training on CUDA (runs only where a GPU is present; CI has none)."""
from __future__ import annotations

import copy

import pytest
import torch

import megacompile
from conftest import batch, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_training_matches_cpu_eager(family):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(family, layers=3)
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cuda", "debug_residency": True})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(3):
        ids, mask, labels = batch(2, 8 + step, seed=step, pad_left=step)
        loss = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        assert loss.device.type == "cuda"
        loss.backward()
        rloss = ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        rloss.backward()
        torch.testing.assert_close(loss.cpu(), rloss, rtol=1e-4, atol=1e-5)
        for p in model.parameters():
            assert p.device.type == "cpu" and p.grad.device.type == "cpu"   # weights stay on the host
        opt.step(), ropt.step(), opt.zero_grad(), ropt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4)
    s = megacompile.stats(cmodel)
    assert s["device"].startswith("cuda") and 0 < s["peak_device_weight_bytes"] < s["weight_bytes"]


def test_cuda_bf16_model_keeps_fp32_masters():
    model = tiny_model("llama", layers=2, dtype=torch.bfloat16)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cuda"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, mask, labels = batch(2, 8)
    cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    opt.step()
    for p in model.parameters():
        assert p.dtype == torch.bfloat16 and p.is_pinned()   # (host arenas: registered, not copied)
        assert megacompile.master_weight(p).dtype == torch.float32
    s = megacompile.stats(cmodel)
    assert s["arena_weights"] == len(list(model.parameters()))
    assert s["h2d_copies"] <= s["segments"]["forward"] + s["segments"]["backward"]
