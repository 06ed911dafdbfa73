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

import threading
import warnings
from pathlib import Path

import torch

from .store import LOW_PRECISION, _master_entry, entry_of

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
    `c` inside the update (the global-norm clipping factor, without a pass of its own).

    `overlap=True`: `step()` returns at once and a host thread updates the weights in the order
    the forward reads them; the next forward's fetch of a weight waits for that weight's update
    only (`WeightEntry.ready`), so the optimizer runs under the next step's data preparation and
    forward. It is exact, with no rollback: the step starts after the backward, when the global
    norm (clipping factor) and the finiteness of the gradients are known. `synchronize()` waits
    for the step (checkpoint saving, reading weights outside a megatrain forward); `step`,
    `state_dict`, `load_state_dict` and `zero_grad(set_to_none=False)` call it themselves.
    """

    # the store's optimizer hooks leave this optimizer's parameters alone: it reads the fp32
    # masters and writes the transfer copies itself
    updates_transfer_copies = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, overlap: bool = False):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"HostAdamW: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.overlap = overlap
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None

    @staticmethod
    def _buffers(p: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the tensor AdamW updates, the transfer copy to refresh or None)."""
        entry = _master_entry(p)
        if entry is not None:
            return entry.master, entry.transfer
        return p.data, None

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        self.synchronize()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []   # (order, parameter, its gradient, hyper-parameters) captured now
        for group in self.param_groups:
            hyper = (group["lr"], *group["betas"], group["eps"], group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    weights, _ = self._buffers(p)
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(weights, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(weights, memory_format=torch.preserve_format)
                entry = entry_of(p)
                work.append((entry.order if entry is not None else -1, p, p.grad, hyper))
        work.sort(key=lambda w: w[0])   # the order the forward reads the weights
        later = [w for w in work if w[0] >= 0] if self.overlap else []
        for w in work if not later else [w for w in work if w[0] < 0]:   # outside the store: now
            self._update(*w[1:], grad_scale)
        if later:
            for _, p, _, _ in later:
                entry_of(p).ready.clear()
            self._worker = threading.Thread(target=self._run, args=(later, grad_scale), daemon=True,
                                            name="megatrain-optimizer")
            self._worker.start()
        return loss

    def _run(self, work, grad_scale: float) -> None:
        try:
            for _, p, grad, hyper in work:
                try:
                    self._update(p, grad, hyper, grad_scale)
                finally:
                    entry_of(p).ready.set()
        except BaseException as e:  # re-raised by synchronize() in the training thread
            self._error = e
            for _, p, _, _ in work:
                entry_of(p).ready.set()

    def synchronize(self) -> None:
        """Wait for an overlapped step to finish (re-raising its error, if any)."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("megatrain: the overlapped optimizer step failed") from error

    def _update(self, p, grad, hyper, grad_scale: float) -> None:
        lr, beta1, beta2, eps, wd = hyper
        weights, low = self._buffers(p)
        state = self.state[p]
        fast = (weights.device.type == "cpu" and weights.dtype == torch.float32 and weights.is_contiguous()
                and grad.dtype == torch.float32 and grad.is_contiguous() and (low is None or low.dtype in LOW_PRECISION))
        ext = kernel() if fast else None
        if not fast:   # e.g. a VLM's vision tower on the GPU: torch's AdamW, in its dtype
            g = grad if grad_scale == 1.0 else grad * grad_scale
            torch.optim.adamw.adamw(   # (counts the step itself)
                [weights], [g], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]], foreach=False,
                capturable=False, differentiable=False, fused=None, grad_scale=None, found_inf=None, amsgrad=False,
                beta1=beta1, beta2=beta2, lr=lr, weight_decay=wd, eps=eps, maximize=False)
            if low is not None:
                low.copy_(weights)
        elif ext is not None:
            state["step"] += 1
            ext.adamw_step(weights, grad, state["exp_avg"], state["exp_avg_sq"], low, lr, beta1, beta2, eps, wd,
                           int(state["step"].item()), grad_scale)
        else:
            state["step"] += 1
            _fallback(weights, grad, state["exp_avg"], state["exp_avg_sq"], low, state["step"], lr, beta1, beta2,
                      eps, wd, grad_scale)
        if low is not None:
            _master_entry(p).synced_version = p._version

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:   # zeroing in place would race with an overlapped step reading them
            self.synchronize()
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        self.synchronize()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.synchronize()
        super().load_state_dict(state_dict)
        # torch casts state to the parameter's dtype: a bf16 parameter's moments belong to its
        # fp32 master (checkpoint.load shows the masters while loading, so this is a no-op there)
        for p, state in self.state.items():
            weights, _ = self._buffers(p)
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != weights.dtype:
                    state[key] = state[key].to(weights.dtype)
