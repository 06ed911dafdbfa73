"""Chunked fused LM head + cross entropy (runtime/kernels/linear_cross_entropy.py) against
`F.cross_entropy((hidden @ weight.T).float(), labels)`, loss and both gradients, with ignored
labels, chunks smaller than N, all-ignored chunks, and a check that no [N, V] tensor is ever
allocated. Interpreter setup and tolerances: see test_kernels.py (same `assert_matches`); the loss
itself is fp32 in both dtypes and is compared at rtol 1e-5 (fp32) / 2**-8 (bf16: a chunked bf16
matmul may round a logit one ulp differently from the full one).
"""
from __future__ import annotations

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
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from megacompile.runtime.kernels.linear_cross_entropy import (  # noqa: E402
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from test_kernels import DEVICE, DTYPES, assert_matches  # noqa: E402

LOSS_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8}


def _inputs(n, h, v, dtype, seed, ignore_frac=0.0, shape=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / max(1, h) ** 0.5 * 2).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = -100
    if shape is not None:
        hidden, labels = hidden.reshape(*shape, h), labels.reshape(shape)
    return (hidden.to(DEVICE).requires_grad_(), weight.to(DEVICE).requires_grad_(), labels.to(DEVICE))


def _check(hidden, weight, labels, reduction, dtype, grad_scale=1.0, **kw):
    loss = linear_cross_entropy(hidden, weight, labels, reduction=reduction, **kw)
    ref = linear_cross_entropy_reference(hidden, weight, labels, reduction=reduction)
    assert loss.dtype == ref.dtype == torch.float32 and loss.shape == ref.shape == ()
    if torch.isnan(ref):
        assert torch.isnan(loss)
    else:
        torch.testing.assert_close(loss, ref, rtol=LOSS_RTOL[dtype], atol=LOSS_RTOL[dtype])
    dh, dw = torch.autograd.grad(loss * grad_scale, (hidden, weight))
    dh_ref, dw_ref = torch.autograd.grad(ref * grad_scale, (hidden, weight))
    assert_matches(dh, dh_ref, dtype, "d_hidden")
    assert_matches(dw, dw_ref, dtype, "d_weight")
    return loss


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 33), h=st.integers(1, 48), v=st.integers(1, 300),
       chunk=st.one_of(st.none(), st.integers(1, 40)), reduction=st.sampled_from(["sum", "mean"]),
       ignore_frac=st.sampled_from([0.0, 0.3, 1.0]), grad_scale=st.sampled_from([1.0, 0.37]),
       seed=st.integers(0, 2**16))
def test_linear_ce_matches_reference(dtype, n, h, v, chunk, reduction, ignore_frac, grad_scale, seed):
    hidden, weight, labels = _inputs(n, h, v, dtype, seed, ignore_frac)
    _check(hidden, weight, labels, reduction, dtype, grad_scale, chunk_size=chunk)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_linear_ce_all_ignored_chunk(dtype, reduction):
    """Chunk 2 of 4 (rows 5..9) is entirely ignored; vocab spans several kernel blocks."""
    hidden, weight, labels = _inputs(17, 12, 259, dtype, 11, 0.2)
    labels[5:10] = -100
    _check(hidden, weight, labels, reduction, dtype, 2.5, chunk_size=5)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_linear_ce_everything_ignored(reduction):
    """torch: mean over zero tokens is nan, sum is 0; the gradients are zero either way."""
    hidden, weight, labels = _inputs(6, 8, 50, torch.float32, 12)
    labels[:] = -100
    loss = _check(hidden, weight, labels, reduction, torch.float32, chunk_size=4)
    assert torch.isnan(loss) if reduction == "mean" else loss.item() == 0.0


def test_linear_ce_batched_input_and_chunk_budget():
    """[B, S, H] hidden with [B, S] labels, chunk rows derived from a byte budget (3 rows)."""
    hidden, weight, labels = _inputs(2 * 9, 16, 130, torch.float32, 13, 0.2, shape=(2, 9))
    _check(hidden, weight, labels, "mean", torch.float32, chunk_bytes=3 * 130 * 4)


def test_linear_ce_frozen_weight_and_no_grad():
    hidden, weight, labels = _inputs(10, 8, 40, torch.float32, 14)
    weight.requires_grad_(False)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=3)
    (dh,) = torch.autograd.grad(loss, hidden)
    (dh_ref,) = torch.autograd.grad(linear_cross_entropy_reference(hidden, weight, labels), hidden)
    assert_matches(dh, dh_ref, torch.float32, "d_hidden")
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=3)
        assert not loss.requires_grad
        torch.testing.assert_close(loss, linear_cross_entropy_reference(hidden, weight, labels))


class _RecordSizes(TorchDispatchMode):
    """Records (shape, bytes) of every tensor any aten op returns, allocations included (the
    Triton interpreter's host copies of kernel arguments show up as uint8 byte views)."""

    def __init__(self):
        super().__init__()
        self.shapes, self.nbytes = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
                self.nbytes.append(t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_ce_never_allocates_full_logits(dtype):
    n, h, v, chunk = 64, 8, 257, 4
    hidden, weight, labels = _inputs(n, h, v, dtype, 15, 0.1)
    with _RecordSizes() as rec:
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
        loss.backward()
    logits_like = [s for s in rec.shapes if len(s) == 2 and s[1] == v and s != (h, v)]  # not weight.t()
    assert max(s[0] for s in logits_like) == chunk, logits_like
    # largest legitimate buffer: the fp32 d_weight accumulator, far below one [N, V] logits tensor
    budget = v * h * 4
    assert n * v * hidden.element_size() > 2 * budget
    assert max(rec.nbytes) <= budget, sorted(zip(rec.nbytes, rec.shapes))[-3:]
    # the recorder does see the reference's [N, V] logits
    with _RecordSizes() as rec_ref:
        linear_cross_entropy_reference(hidden, weight, labels).backward()
    assert (n, v) in rec_ref.shapes


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,h,v,chunk", [(200, 64, 5003, 64), (512, 128, 2048, None), (48, 96, 32000, 16)])
def test_linear_ce_large(dtype, n, h, v, chunk):
    hidden, weight, labels = _inputs(n, h, v, dtype, 16, 0.25)
    _check(hidden, weight, labels, "mean", dtype, chunk_size=chunk)
    _check(hidden, weight, labels, "sum", dtype, 0.5, chunk_size=chunk)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_custom_op_runs_the_kernel(dtype, monkeypatch):
    """torch.ops.megatrain.linear_cross_entropy (what passes/fused_lm_loss.py puts in graphs)
    runs this kernel where Triton runs, and its autograd scales the saved gradients."""
    from megacompile.runtime.kernels import linear_cross_entropy as module
    from megacompile.runtime.kernels import ops  # noqa: F401
    calls = []
    kernel = module.loss_and_grad_chunk
    monkeypatch.setattr(module, "loss_and_grad_chunk", lambda *a: calls.append(1) or kernel(*a))
    hidden, weight, labels = _inputs(19, 24, 200, dtype, seed=3, ignore_frac=0.3, shape=(1, 19))
    loss, _, _ = torch.ops.megatrain.linear_cross_entropy(hidden, weight, labels, -100, "mean", True, True)
    ref = linear_cross_entropy_reference(hidden, weight, labels)
    torch.testing.assert_close(loss, ref, rtol=LOSS_RTOL[dtype], atol=LOSS_RTOL[dtype])
    dh, dw = torch.autograd.grad(loss * 3, (hidden, weight))
    dh_ref, dw_ref = torch.autograd.grad(ref * 3, (hidden, weight))
    assert calls
    assert_matches(dh, dh_ref, dtype, "d_hidden")
    assert_matches(dw, dw_ref, dtype, "d_weight")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weight_pass", ["accumulate", "blocks"])
def test_both_ways_to_the_weight_gradient_match_the_reference(dtype, weight_pass):
    """Over row chunks with an fp32 accumulator, or in a pass of its own over vocabulary blocks
    (few tokens: no [V, H] fp32 buffer), with ignored rows and both reductions."""
    from megacompile.runtime.kernels.chunked_ce import loss_and_grads, torch_chunk
    hidden, weight, labels = _inputs(40, 24, 210, dtype, seed=3, ignore_frac=0.3)
    for reduction in ("mean", "sum"):
        loss, dh, dw = loss_and_grads(hidden.detach(), weight.detach(), labels, reduction, -100, True, True,
                                      torch_chunk, chunk_size=7, weight_pass=weight_pass)
        ref = linear_cross_entropy_reference(hidden, weight, labels, reduction=reduction)
        dh_ref, dw_ref = torch.autograd.grad(ref, (hidden, weight))
        torch.testing.assert_close(loss, ref.detach(), rtol=LOSS_RTOL[dtype], atol=LOSS_RTOL[dtype])
        assert_matches(dh, dh_ref, dtype, "d_hidden")
        assert_matches(dw, dw_ref, dtype, "d_weight")


def test_dropping_the_logits_never_costs_more_device_memory_than_keeping_them():
    """The head's planned workspace at Llama-3-8B's shapes (V 128256, H 4096, bf16): with few
    tokens the weight gradient takes its own pass (no fp32 [V, H] accumulator, 1.96 GiB), so the
    fused op's workspace stays under the logits and their fp32 upcast that keeping them costs
    (both produce the [V, H] weight gradient itself); with many tokens the accumulator is the
    cheaper one and stays."""
    from megacompile.ir_ops import DEFAULT_CHUNK_BYTES, chunk_rows, linear_cross_entropy_workspace, weight_grad_block
    vocab, hidden = 128256, 4096
    for tokens in (2048, 4096):
        rows = chunk_rows(tokens, vocab, 2, None, DEFAULT_CHUNK_BYTES)
        assert weight_grad_block(tokens, vocab, hidden, 2, rows, None, DEFAULT_CHUNK_BYTES) is not None
        for triton in (True, False):
            fused = linear_cross_entropy_workspace(tokens, vocab, hidden, torch.bfloat16, triton, True)
            assert fused < tokens * vocab * (2 + 4) / 1.9, (tokens, triton)
    rows = chunk_rows(65536, vocab, 2, None, DEFAULT_CHUNK_BYTES)
    assert weight_grad_block(65536, vocab, hidden, 2, rows, None, DEFAULT_CHUNK_BYTES) is None
