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
    # (AdamW's first steps move each weight by about lr * sign(grad): an element whose gradient is
    # within rounding of 0 can move differently on the GPU than on the CPU; the losses above are
    # the tight check)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=5e-4)
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


def test_cuda_optimizer_during_the_backward_is_exact():
    """HostAdamW(overlap="backward") with the gradient copies on their own stream: updates that
    start while the GPU runs the earlier layers' backward equal the plain step's, kept (no
    clipping) or rolled back (clipped)."""
    from megacompile.runtime.adamw import HostAdamW
    runs = {}
    for overlap in (False, "backward"):
        torch._dynamo.reset()
        megacompile.compile_start.register()   # (reset drops it)
        model = tiny_model("llama", layers=4, dtype=torch.bfloat16)
        # eager bodies: lowering="auto" picks eager or Inductor per body by timing, which could
        # differ between the two runs and round differently
        cmodel = torch.compile(model, backend="megatrain",
                               options={"device": "cuda", "logits": "drop", "lowering": "eager"})
        opt = HostAdamW(model.parameters(), lr=1e-3, overlap=overlap)
        losses = []
        for step, max_norm in enumerate([1e9, 1e-3, 1e9]):
            ids, mask, labels = batch(2, 16, seed=step)
            loss = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            opt.arm()
            loss.backward()
            norm = opt.grad_norm()
            opt.step(grad_scale=min(1.0, max_norm / (norm + 1e-6)))
            opt.zero_grad()
            losses.append(loss.item())
        opt.synchronize()
        runs[overlap] = (losses, [megacompile.master_weight(p).clone() for p in model.parameters()], opt.counters)
    assert runs["backward"][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs["backward"][1], runs[False][1]))
    assert runs["backward"][2]["kept"] > 0 and runs["backward"][2]["rolled_back"] > 0
