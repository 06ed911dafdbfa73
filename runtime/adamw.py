"""The host optimizer: AdamW over each parameter's fp32 buffers in one pass that also writes
its low-precision transfer copy.

    HostAdamW.step(grad_scale=c)       per trainable parameter p, one kernel call:
        master, grad, exp_avg, exp_avg_sq  --(AdamW, grads scaled by c)-->  master, exp_avg, exp_avg_sq
                                                                        └-> transfer copy (bf16/fp16)

Why not torch.optim.AdamW: with megatrain's store, a bf16 model's optimizer step is AdamW on the
fp32 masters (28 bytes/param of memory traffic in torch's fused CPU kernel) then a copy of each
master into its bf16 transfer copy (6 more), then a clipping pass over the gradients before it
(8 more). Here the clipping factor and the copy are fused into the update: 30 bytes/param in
one pass (`csrc/adamw.cpp`, compiled on first use with torch's C++ extension builder and cached
under ~/.cache/torch_extensions; `benchmarks/cpu_adam.py` measures it against torch).

The update follows torch.optim.AdamW's formulas in its operation order (tested against it), and
the state has AdamW's keys and dtypes (step, exp_avg, exp_avg_sq in fp32), so checkpoints are
interchangeable with torch's AdamW. Parameters the kernel cannot take (not fp32 on the CPU,
e.g. a VLM's vision tower trained on the GPU) are updated by torch's functional AdamW, with
state in their own dtype as torch.optim.AdamW would keep it. Without a C++ compiler the kernel
falls back to torch's fused AdamW plus a copy (a warning says so once).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from .store import LOW_PRECISION, _master_entry

_KERNEL: list = []   # [module or None], loaded once


def kernel():
    """The compiled C++ kernel module, or None when it cannot be built here."""
    if not _KERNEL:
        try:
            from torch.utils.cpp_extension import load
            _KERNEL.append(load(name="megatrain_adamw", sources=[str(Path(__file__).with_name("csrc") / "adamw.cpp")],
                                extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"],
                                extra_ldflags=["-fopenmp"], verbose=False))
        except Exception as e:  # no compiler / ninja: torch's fused kernel + a copy
            warnings.warn(f"megatrain: the fused host AdamW kernel could not be built ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); using torch's fused AdamW and a separate "
                          "copy (install ninja and a C++ compiler for the fused kernel).", stacklevel=2)
            _KERNEL.append(None)
    return _KERNEL[0]


def _fallback(master, grad, exp_avg, exp_avg_sq, low, step_t, lr, beta1, beta2, eps, weight_decay, grad_scale):
    g = grad if grad_scale == 1.0 else grad * grad_scale
    torch._fused_adamw_([master], [g], [exp_avg], [exp_avg_sq], [], [step_t], lr=lr, beta1=beta1, beta2=beta2,
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    if low is not None:
        low.copy_(master)


class HostAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) for megatrain's host store. Same arguments as
    torch.optim.AdamW (no amsgrad/maximize); `step(grad_scale=c)` multiplies the gradients by
    `c` inside the update (the global-norm clipping factor, without a pass of its own)."""

    # the store's optimizer hooks leave this optimizer's parameters alone: it reads the fp32
    # masters and writes the transfer copies itself
    updates_transfer_copies = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"HostAdamW: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @staticmethod
    def _buffers(p: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the tensor AdamW updates, the transfer copy to refresh or None)."""
        entry = _master_entry(p)
        if entry is not None:
            return entry.master, entry.transfer
        return p.data, None

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ext = kernel()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                weights, low = self._buffers(p)
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(weights, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(weights, memory_format=torch.preserve_format)
                grad = p.grad
                fast = (weights.device.type == "cpu" and weights.dtype == torch.float32 and weights.is_contiguous()
                        and grad.dtype == torch.float32 and grad.is_contiguous()
                        and (low is None or low.dtype in LOW_PRECISION))
                if not fast:   # e.g. a VLM's vision tower on the GPU: torch's AdamW, in its dtype
                    g = grad if grad_scale == 1.0 else grad * grad_scale
                    torch.optim.adamw.adamw(   # (counts the step itself)[weights], [g], [state["exp_avg"]], [state["exp_avg_sq"]], [],
                                            [state["step"]], foreach=False, capturable=False, differentiable=False,
                                            fused=None, grad_scale=None, found_inf=None, amsgrad=False,
                                            beta1=beta1, beta2=beta2, lr=lr, weight_decay=wd, eps=eps, maximize=False)
                    if low is not None:
                        low.copy_(weights)
                elif ext is not None:
                    state["step"] += 1
                    ext.adamw_step(weights, grad, state["exp_avg"], state["exp_avg_sq"], low, lr, beta1, beta2, eps,
                                   wd, int(state["step"].item()), grad_scale)
                else:
                    state["step"] += 1
                    _fallback(weights, grad, state["exp_avg"], state["exp_avg_sq"], low, state["step"], lr, beta1,
                              beta2, eps, wd, grad_scale)
                if low is not None:
                    _master_entry(p).synced_version = p._version
        return loss

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        # torch casts state to the parameter's dtype: a bf16 parameter's moments belong to its
        # fp32 master (checkpoint.load shows the masters while loading, so this is a no-op there)
        for p, state in self.state.items():
            weights, _ = self._buffers(p)
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != weights.dtype:
                    state[key] = state[key].to(weights.dtype)
