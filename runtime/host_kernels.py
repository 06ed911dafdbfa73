"""The host's C++ passes over flat fp32 buffers (`csrc/adamw.cpp`), loaded once per process.

    kernel().adamw_step(master, grad, m, v, low, ...)   AdamW + transfer copy, one pass (runtime/adamw.py)
    land(dst, src, add)                                 dst (+)= src, returns sum(dst ** 2): a gradient
                                                        landing with its squared norm (runtime/store.py)
    squared_norm(t)                                     sum(t ** 2) alone

The module is compiled on first use with torch's C++ extension builder and cached under
~/.cache/torch_extensions (about 10 s: its functions take buffer addresses, which `HostKernels`
checks and passes, so it needs no torch headers). Without a compiler `kernel()` is None (a
warning says so once) and the callers use torch ops instead: the same values, more passes over
memory.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

_KERNEL: list = []   # [HostKernels or None]: a cache of the loaded module, not state that changes
#: the codes adamw.cpp takes for a low-precision copy or a landing gradient's dtype
_KINDS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_LANDS = (torch.float32, torch.bfloat16, torch.float16)


def _fits(t: torch.Tensor, n: int, dtypes=(torch.float32,)) -> bool:
    """Whether the kernels can take `t`: a contiguous CPU tensor of n elements of one of `dtypes`."""
    return t.device.type == "cpu" and t.dtype in dtypes and t.is_contiguous() and t.numel() == n


def _flat(t: torch.Tensor, name: str, n: int, dtypes=(torch.float32,)) -> int:
    """t's data pointer, once `_fits` says the kernels can take it."""
    if not _fits(t, n, dtypes):
        kinds = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise RuntimeError(f"{name} must be a contiguous CPU {kinds} tensor with {n} elements")
    return t.data_ptr()


def _threads(threads: int) -> int:
    return threads if threads > 0 else torch.get_num_threads()


class HostKernels:
    """The compiled passes (csrc/adamw.cpp) behind tensor arguments: each tensor is checked here
    and handed over as its data pointer (so the C++ needs no torch headers); `threads` 0 means
    torch's intra-op thread count. The module's functions run without the GIL."""

    def __init__(self, module):
        self.module = module

    def adamw_step(self, param, grad, exp_avg, exp_avg_sq, low, lr, beta1, beta2, eps, weight_decay, step,
                   grad_scale, threads=0) -> int:
        n = param.numel()
        addresses = [_flat(t, name, n) for t, name in ((param, "param"), (grad, "grad"), (exp_avg, "exp_avg"),
                                                        (exp_avg_sq, "exp_avg_sq"))]
        at, kind = (0, 0) if low is None else (_flat(low, "low", n, (torch.bfloat16, torch.float16)), _KINDS[low.dtype])
        return self.module.adamw_step(*addresses, at, kind, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                                      _threads(threads))

    def sum_squares(self, t, threads=0) -> float:
        return self.module.sum_squares(_flat(t, "t", t.numel()), t.numel(), _threads(threads))

    def stream_update(self, a, b, scale, threads=0) -> None:
        self.module.stream_update(_flat(a, "a", a.numel()), _flat(b, "b", a.numel()), a.numel(), scale,
                                  _threads(threads))

    def land(self, dst, src, add, threads=0) -> float:
        n = dst.numel()
        return self.module.land(_flat(dst, "dst", n), _flat(src, "src", n, _LANDS), _KINDS[src.dtype], n, add,
                                _threads(threads))


def kernel():
    """The compiled C++ kernels (HostKernels), or None when they cannot be built here."""
    if not _KERNEL:
        try:
            from torch.utils.cpp_extension import load
            _KERNEL.append(HostKernels(load(
                name="megatrain_adamw", sources=[str(Path(__file__).with_name("csrc") / "adamw.cpp")],
                extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)))
        except Exception as e:  # no compiler / ninja: torch's fused kernel + a copy
            warnings.warn(f"megatrain: the fused host AdamW kernel could not be built ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); using torch's fused AdamW and a separate "
                          "copy (install ninja and a C++ compiler for the fused kernel).", stacklevel=2)
            _KERNEL.append(None)
    return _KERNEL[0]


def squared_norm(t: torch.Tensor, threads: int = 0) -> float:
    """sum(t ** 2) in double: the C++ kernel over a host fp32 gradient (all cores; torch's
    vector_norm there runs on one), torch elsewhere. `threads` > 0: that many OpenMP threads of
    the calling thread's own (a worker next to the training thread), 0: torch's intra-op pool."""
    ext = kernel() if _fits(t, t.numel()) else None
    if ext is not None:
        return ext.sum_squares(t, threads)
    return float(torch.linalg.vector_norm(t, 2.0, dtype=torch.float64)) ** 2


def land(dst: torch.Tensor, src: torch.Tensor, add: bool, threads: int = 0) -> float | None:
    """`dst.add_(src)` (add) or `dst.copy_(src)`, and the squared norm of the new `dst` taken in
    the same pass (as `squared_norm(dst)` computes it, bit for bit). None when the kernel cannot
    take these tensors (not on the CPU, not contiguous, no compiler): then torch's op ran and the
    norm is left to whoever needs it. The version counter of `dst` moves as torch's op moves it."""
    ext = None
    if dst.shape == src.shape and _fits(dst, dst.numel()) and _fits(src, dst.numel(), _LANDS):
        ext = kernel()
    if ext is None:
        dst.add_(src) if add else dst.copy_(src)
        return None
    squares = ext.land(dst, src, add, threads)
    torch.autograd.graph.increment_version(dst)   # (written through its pointer: tell autograd)
    return squares
