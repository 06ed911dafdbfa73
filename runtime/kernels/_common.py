"""Small @triton.jit helpers shared by the kernels (interpreter-safe).

- Reductions use `tl.reduce` with the combine functions below, not `tl.sum` / `tl.max` /
  `tl.zeros`: those are @jit library functions, decorated when triton is first imported, so under
  TRITON_INTERPRET=1 they only work if the variable was set before that import (and torch._dynamo
  imports triton early). Builtins (`tl.reduce`, `tl.full`, `tl.exp`, ...) work either way.
- `to_dtype`: Triton's interpreter (3.x) truncates fp32 -> bf16 casts (round toward zero, even
  with fp_downcast_rounding="rtne"), where GPUs and torch round to nearest even. With
  `EMULATE_RTNE` (the wrappers set it for CPU tensors, i.e. under the interpreter) bf16 results
  are first rounded to nearest even by integer arithmetic, so that the last bit matches a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def add(a, b):
    return a + b


@triton.jit
def maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def to_dtype(x, dtype: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """Cast an fp32 block to `dtype` (round to nearest even for bf16 also under the interpreter)."""
    if EMULATE_RTNE:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(dtype)


def emulate_rtne(device: torch.device) -> bool:
    """CPU tensors only run under the interpreter, whose bf16 casts truncate."""
    return device.type == "cpu"
