"""Small @triton.jit helpers shared by the kernels (interpreter-safe).

- Reductions call the builtin `tl.reduce` with the combine functions below, not `tl.sum` /
  `tl.max` / `tl.zeros`: those are @jit library functions, decorated when triton is first
  imported, so under TRITON_INTERPRET=1 they only work if the variable was set before that import
  (and torch._dynamo imports triton early). Builtins (`tl.reduce`, `tl.full`, `tl.exp`, ...) work
  either way; a combine function is only compared by identity on the interpreter's fast path.
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
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


# Combine functions for tl.reduce. Prefer triton's own (the ones tl.sum / tl.max reduce with when
# compiled): the interpreter recognises those by identity and reduces with numpy, while it applies
# any other combine function element by element in Python (about 100x slower on a 1k-wide row).
add = getattr(tl.standard, "_sum_combine", _add)
maximum = getattr(tl.standard, "_elementwise_max", _maximum)


@triton.jit
def to_dtype(x, dtype: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    # cast an fp32 block to `dtype`, rounding to nearest even for bf16 also under the interpreter
    if EMULATE_RTNE:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(dtype)


def emulate_rtne(device: torch.device) -> bool:
    """CPU tensors only run under the interpreter, whose bf16 casts truncate."""
    return device.type == "cpu"
