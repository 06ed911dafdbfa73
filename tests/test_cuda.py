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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_low_precision_accumulation_over_new_lengths(dtype):
    """Issue 28 on CUDA: micro-batches of new lengths inside an accumulated step (Dynamo recompiles
    with the step's fp32 gradients on the low-precision weights), the optimizer during the backward
    as `megatrain train` runs it there; against an eager fp32-accumulating reference on the CPU."""
    from test_accumulation import LR, STEPS, _Fp32Accumulating, _inputs
    model = tiny_model("llama", layers=2, dtype=dtype)
    ref = _Fp32Accumulating(copy.deepcopy(model))
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cuda"})
    opt = megacompile.HostAdamW(model.parameters(), lr=LR, weight_decay=0.01, overlap="backward")
    seed, ours, theirs = 0, [], []
    for micro in STEPS:
        for k, (rows, length) in enumerate(micro):
            seed += 1
            loss = cmodel(**_inputs(rows, length, seed)).loss
            if k == len(micro) - 1:   # (as the trainer: the last micro-batch's updates start as gradients land)
                opt.arm()
            loss.backward()
            ours.append(loss.item())
            theirs.append(ref.micro(**_inputs(rows, length, seed)))
        norm = opt.grad_norm()
        opt.step(grad_scale=min(1.0, 0.5 / (norm + 1e-6)))
        assert norm == pytest.approx(ref.step(0.5), rel=3e-2)
        opt.zero_grad(set_to_none=True)
    opt.synchronize()
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1.6e-2, atol=1e-2)
    diff = torch.cat([(megacompile.master_weight(p) - m).abs().flatten() for p, m in
                      zip(model.parameters(), ref.masters)])
    assert diff.max() <= 2 * len(STEPS) * LR and diff.mean() < 5e-5, (diff.max(), diff.mean())
    assert megacompile.stats(cmodel)["compiled_graphs"] == 2


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


def _dense_attention(q, k, v, seg, window, scale):
    """Reference: SDPA with the dense mask the segment ids stand for (float32 math)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = seg.shape[1]
    i, j = torch.arange(s, device=q.device)[:, None], torch.arange(s, device=q.device)[None, :]
    allowed = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0) & (j <= i)
    if window > 0:
        allowed &= (i - j) < window
    valid = seg >= 0
    allowed |= (~valid[:, :, None]) & (i == j)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    out = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v.float()
    return out * valid[:, None, :, None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [0, 96])
def test_cuda_segment_attention_equals_the_dense_mask(dtype, window):
    """megatrain::segment_attention's CUDA kernels (bf16: one varlen flash call over the packed
    valid tokens; fp32: fused SDPA per segment) against the dense mask, left padding + packed
    documents + grouped-query heads, forward and gradients."""
    seg = torch.full((2, 512), -1, dtype=torch.int32)
    seg[0, 37:] = 0
    seg[1, :200], seg[1, 200:450] = 0, 1
    seg = seg.cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 512, 64, device="cuda", dtype=dtype, generator=g).requires_grad_()
    k, v = (torch.randn(2, 2, 512, 64, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(2))
    out, lse = torch.ops.megatrain.segment_attention(q, k, v, seg, window, 0.125)
    ref = _dense_attention(q, k, v, seg, window, 0.125)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.float(), ref, **tol)
    w = torch.randn(out.shape, device="cuda", generator=g)
    got = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, e in zip(got, want):
        torch.testing.assert_close(a.float(), e.float(), **tol)


def test_cuda_long_context_step_matches_the_plain_one():
    """A bf16 step at 8192 tokens, left-padded, with the layer checkpoints on the host (offload
    and reload on their copy streams) and the MLP in 4 tiles: the loss of the same step with
    both off, within bf16 rounding (the MLP's weight gradients sum over tiles)."""
    ids = torch.randint(3, 100, (1, 8192))
    mask = torch.ones_like(ids)
    mask[0, :1000] = 0
    labels = ids.masked_fill(mask == 0, -100)
    losses = []
    base = tiny_model("llama", layers=4, dtype=torch.bfloat16, max_position_embeddings=16384)
    for options in ({"offload_checkpoints": "never", "mlp_tiles": 1},
                    {"offload_checkpoints": "always", "mlp_tiles": 4}):
        megacompile.reset()
        model = copy.deepcopy(base)
        cmodel = torch.compile(model, backend="megatrain", options={"device": "cuda", **options})
        loss = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-2)
