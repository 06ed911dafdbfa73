"""Fused Triton kernels (runtime/kernels) against their plain-torch references, forward and
backward: RMSNorm and SwiGLU here, the chunked linear + cross entropy in test_kernels_linear_ce.py.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set below before
the kernel modules are imported: triton reads it when a kernel is decorated). With a GPU and no
TRITON_INTERPRET the same tests run the compiled kernels on it.

Tolerances (`assert_matches`, elementwise |k - r| <= tol * (max(1, max|r|) + |r|)):
- fp32: tol = 1e-5. Both sides compute in fp32 and differ only in summation order (observed
  worst over a random sweep: 5e-7).
- bf16: tol = 2**-7, i.e. two unit roundoffs of bf16 (8 significant bits, u = 2**-8): one ulp of
  an element, relative to itself. The kernels round once from fp32 (round-to-nearest-even), while
  the torch references also round intermediates to bf16 (silu(gate) before the product, dy * w in
  RMSNorm's backward, the logits gradient before the matmuls), so single elements legitimately
  differ by one ulp (observed worst over a random sweep: 0.98 u). Under the interpreter that
  relies on the round-to-nearest-even emulation in runtime/kernels/_common.py: the interpreter's
  own fp32 -> bf16 cast truncates, and without the emulation the worst error seen was 1.9 u.
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

from megacompile.runtime.kernels.rmsnorm import rmsnorm, rmsnorm_reference  # noqa: E402
from megacompile.runtime.kernels.swiglu import swiglu, swiglu_reference  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str,
                   terms: float = 0.0) -> None:
    """Close within TOL[dtype], absolute error scaled by the largest of 1, |expected| and `terms`
    (the size of the summands that cancel into `expected`, where that is larger)."""
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    tol = TOL[dtype]
    scale = max(1.0, terms, expected.detach().abs().max().item() if expected.numel() else 1.0)
    torch.testing.assert_close(actual.detach().float(), expected.detach().float(), rtol=tol,
                               atol=tol * scale, msg=lambda m: f"{what} ({dtype}): {m}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _check_rmsnorm(shape, dtype, offset, cast_before_weight, eps, seed, weight_dtype=None):
    g = _gen(seed)
    hidden = shape[-1]
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE).requires_grad_()
    w = 0.5 * torch.randn(hidden, generator=g) + (0.0 if offset else 1.0)  # Gemma's is near 0
    w = w.to(weight_dtype or dtype).to(DEVICE).requires_grad_()

    y = rmsnorm(x, w, eps=eps, offset=offset, cast_before_weight=cast_before_weight)
    y_ref = rmsnorm_reference(x, w, eps=eps, offset=offset, cast_before_weight=cast_before_weight)
    assert_matches(y, y_ref, dtype, "y")
    dy = torch.randn(y_ref.shape, generator=g).to(y_ref.dtype).to(DEVICE)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), dy)
    # dx = w*dy*r - x*r^3*mean(x*w*dy): the two terms cancel (fully as hidden -> 1), so its rounding
    # error follows the terms' size, not dx's (seen on the H200: hidden=1, 1.2e-5 on a 0.06 element)
    r = torch.rsqrt(x.detach().float().pow(2).mean(-1, keepdim=True) + eps)
    w_eff = w.detach().float() + offset
    terms = (w_eff * dy.float() * r).abs().max().item() if x.numel() else 0.0
    assert_matches(dx, dx_ref, dtype, "dx", terms)
    # dweight sums dy * x_hat over the rows, and the bf16 reference rounds each product and its
    # running sum: its error follows the summands' total size, not the sum's (seen: 6 rows,
    # hidden 4, 0.0107 off on a 0.149 element, 1.4 bf16 steps)
    dw_terms = ((dy.float() * x.detach().float() * r).abs().reshape(-1, hidden).sum(0).max().item()
                if x.numel() else 0.0)
    assert_matches(dw, dw_ref, dtype, "dweight", dw_terms)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 33), hidden=st.integers(1, 96), three_d=st.booleans(),
       variant=st.sampled_from(["llama", "gemma", "llama+offset", "gemma-no-offset"]),
       eps=st.sampled_from([1e-6, 1e-5]), seed=st.integers(0, 2**16))
def test_rmsnorm_matches_reference(dtype, rows, hidden, three_d, variant, eps, seed):
    offset = 1.0 if variant in ("gemma", "llama+offset") else 0.0
    cast_before_weight = variant.startswith("llama")
    shape = (1, rows, hidden) if three_d else (rows, hidden)
    _check_rmsnorm(shape, dtype, offset, cast_before_weight, eps, seed)


def test_rmsnorm_default_cast_order_follows_offset():
    """offset=0 defaults to the Llama order, offset=1 to Gemma's; both match transformers."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = _gen(1)
    x = torch.randn(5, 40, generator=g).to(torch.bfloat16).to(DEVICE)
    llama, gemma = LlamaRMSNorm(40, eps=1e-6), Gemma3RMSNorm(40, eps=1e-6)
    with torch.no_grad():
        llama.weight.copy_(1 + 0.3 * torch.randn(40, generator=g))
        gemma.weight.copy_(0.3 * torch.randn(40, generator=g))
    llama, gemma = llama.to(torch.bfloat16).to(DEVICE), gemma.to(torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        assert_matches(rmsnorm(x, llama.weight, 1e-6), llama(x), torch.bfloat16, "llama")
        assert_matches(rmsnorm(x, gemma.weight, 1e-6, offset=1.0), gemma(x), torch.bfloat16, "gemma")


def test_rmsnorm_fp32_weight_bf16_input_promotes_like_llama():
    """LlamaRMSNorm with an fp32 weight and bf16 activations returns fp32 (weight * x.to(bf16))."""
    _check_rmsnorm((9, 24), torch.bfloat16, 0.0, True, 1e-6, 3, weight_dtype=torch.float32)


def test_rmsnorm_rows_spanning_several_blocks_per_program():
    """More row blocks than programs: the backward loops and the dweight partials are summed."""
    _check_rmsnorm((70, 33), torch.float32, 0.0, True, 1e-6, 4)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(257, 1000), (64, 4096), (3, 8, 5000)])
def test_rmsnorm_large(dtype, shape):
    _check_rmsnorm(shape, dtype, 0.0, True, 1e-6, 5)
    _check_rmsnorm(shape, dtype, 1.0, False, 1e-6, 6)


def _check_swiglu(shape, dtype, seed):
    g = _gen(seed)
    gate = (torch.randn(shape, generator=g) * 4).to(dtype).to(DEVICE).requires_grad_()
    up = torch.randn(shape, generator=g).to(dtype).to(DEVICE).requires_grad_()
    out, out_ref = swiglu(gate, up), swiglu_reference(gate, up)
    assert_matches(out, out_ref, dtype, "out")
    dout = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    grads = torch.autograd.grad(out, (gate, up), dout)
    grads_ref = torch.autograd.grad(out_ref, (gate, up), dout)
    assert_matches(grads[0], grads_ref[0], dtype, "dgate")
    assert_matches(grads[1], grads_ref[1], dtype, "dup")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 33), cols=st.integers(1, 96), batch=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_swiglu_matches_reference(dtype, rows, cols, batch, seed):
    _check_swiglu((batch, rows, cols), dtype, seed)


def test_swiglu_extreme_gates_stay_finite():
    gate = torch.tensor([-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0], device=DEVICE, requires_grad=True)
    up = torch.ones(7, device=DEVICE, requires_grad=True)
    out = swiglu(gate, up)
    dgate, dup = torch.autograd.grad(out, (gate, up), torch.ones(7, device=DEVICE))
    out_ref = swiglu_reference(gate, up)
    dgate_ref, dup_ref = torch.autograd.grad(out_ref, (gate, up), torch.ones(7, device=DEVICE))
    for a, b, what in ((out, out_ref, "out"), (dgate, dgate_ref, "dgate"), (dup, dup_ref, "dup")):
        assert torch.isfinite(a).all(), what
        assert_matches(a, b, torch.float32, what)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_large(dtype):
    _check_swiglu((2, 129, 2753), dtype, 7)
