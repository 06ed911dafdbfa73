"""Speed of megatrain's fused kernels (torch.ops.megatrain.*) against the eager torch code they
replace, and against the device's copy bandwidth (the limit for these memory-bound ops).

For each op, forward + backward at a real model's shapes (Llama-3-8B: hidden 4096, FFN 14336,
vocab 128256), median milliseconds over --repeat runs after --warmup:
  rmsnorm        megatrain::rms_norm + rms_norm_backward  vs  LlamaRMSNorm's torch code + autograd
  swiglu         megatrain::swiglu + swiglu_backward      vs  silu(gate) * up + autograd
  lm head + CE   megatrain::linear_cross_entropy (loss and both gradients in one op, no logits)
                 vs  cross_entropy(hidden @ W.T) + autograd (the [tokens, vocab] logits held)
with the bytes each must move at least (inputs read, outputs written, once) as GB/s, the
fraction of the measured copy bandwidth, the speed-up over eager, and the peak device memory
of each (the LM head's point is the logits it never holds).

    python benchmarks/kernel_speed.py                                 # on CUDA, 8192 tokens, bf16
    python benchmarks/kernel_speed.py --device cpu --tokens 64 --hidden 64 --ffn 128 --vocab 256 --repeat 1  # smoke
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from megacompile.runtime.kernels import ops  # noqa: F401  (registers torch.ops.megatrain.*)
from megacompile.runtime.kernels.rmsnorm import rmsnorm_reference


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, warmup: int, repeat: int) -> tuple[float, int]:
    """(median seconds, peak device bytes above the start) of fn()."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    return statistics.median(times), peak


def copy_bandwidth(nbytes: int, device, warmup: int, repeat: int) -> float:
    """GB/s of a device copy of `nbytes` (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds, _ = timed(lambda: dst.copy_(src), device, warmup, repeat)
    return 2 * nbytes / seconds / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    dev = torch.device(a.device)
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=1.0, dtype=dt):
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * scale).to(dtype)
    n, h, f, v, item = a.tokens, a.hidden, a.ffn, a.vocab, dt.itemsize

    copy_gbps = copy_bandwidth(n * f * 4, dev, a.warmup, a.repeat)
    print(f"{n} tokens, {a.dtype}, device {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}; copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    print(f"{'op':<14} {'impl':<10} {'ms':>9} {'GB/s':>8} {'of copy':>8} {'peak MiB':>9} {'speed-up':>9}")

    x, w, dy = rand(n, h), rand(h, scale=0.1) + 1, rand(n, h)
    gate, up, dout = rand(n, f), rand(n, f), rand(n, f)
    hid, W = rand(n, h), rand(v, h, scale=0.02)
    labels = torch.randint(0, v, (n,), generator=g, device=dev)

    def norm_ours():
        y, rstd = torch.ops.megatrain.rms_norm(x, w, 1e-6, 0.0, True)
        torch.ops.megatrain.rms_norm_backward(dy, x, w, rstd, 0.0, True)

    def norm_eager():
        xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
        torch.autograd.grad(rmsnorm_reference(xr, wr, 1e-6), (xr, wr), dy)

    def glu_ours():
        torch.ops.megatrain.swiglu(gate, up)
        torch.ops.megatrain.swiglu_backward(dout, gate, up)

    def glu_eager():
        gr, ur = gate.detach().requires_grad_(), up.detach().requires_grad_()
        torch.autograd.grad(F.silu(gr) * ur, (gr, ur), dout)

    def ce_ours():
        torch.ops.megatrain.linear_cross_entropy(hid, W, labels, -100, "mean", True, True)

    def ce_eager():
        hr, wr = hid.detach().requires_grad_(), W.detach().requires_grad_()
        loss = F.cross_entropy((hr @ wr.t()).float(), labels)
        torch.autograd.grad(loss, (hr, wr))

    rows = [("rmsnorm", norm_ours, norm_eager, (3 * n * h + 2 * h) * item),                 # x, dy in; y, dx out
            ("swiglu", glu_ours, glu_eager, 6 * n * f * item),                               # g, u, dout in; o, dg, du
            ("lm head + CE", ce_ours, ce_eager, (2 * n * h + 2 * v * h) * item + 8 * n)]     # h, W in; dh, dW out
    for name, ours, eager, nbytes in rows:
        results = {impl: timed(fn, dev, a.warmup, a.repeat) for impl, fn in (("megatrain", ours), ("eager", eager))}
        for impl, (s, peak) in results.items():
            gbps = nbytes / s / 1e9
            speed = f"{results['eager'][0] / s:.2f}x" if impl == "megatrain" else ""
            print(f"{name:<14} {impl:<10} {s * 1e3:>9.3f} {gbps:>8.0f} {gbps / copy_gbps:>8.0%} {peak / 2**20:>9.0f} "
                  f"{speed:>9}", flush=True)


if __name__ == "__main__":
    main()
