"""The host optimizer step against torch's AdamW and the machine's memory bandwidth.

One flat fp32 parameter of N elements (its gradient, both moments; for the bf16 rows also the
bf16 transfer copy the step must refresh), stepped by:
  - megatrain HostAdamW kernel (runtime/csrc/adamw.cpp): AdamW + bf16 copy in one pass
    (30 bytes/param), and without the copy (28);
  - torch.optim.AdamW fused=True (torch's fused CPU kernel), then the bf16 copy (28 + 6);
  - torch.optim.AdamW foreach=True (the default multi-tensor path), then the bf16 copy.
The limit is measured in the same run on the same threads (megacompile/host_probe.py): a copy
(c = a, 8 B/element), a triad (c = a + s*b, 12) and an in-place update (c += s*b, 12; in place as
AdamW's buffers are, so no write-allocate reads go uncounted); the memory bandwidth is the best
of the three. GB/s counts the bytes an update must move (reads + writes). Medians.

The host's whole pass per step, before and after the landing kernel: a bf16 gradient landing
from the device is added into the fp32 gradient (torch's mixed-dtype add_ against the kernel's
`land`, which also takes the squared norm), then the clipping norm (a pass of its own before;
none now), then AdamW.

Per tensor or flat: HostAdamW steps each parameter with one kernel call (no flat buffer that
would tie the optimizer's layout to the store's). The last rows measure what that costs:
`HostAdamW.step()` over one decoder layer's 12 tensors (Qwen2.5-7B's shapes, hidden size scaled
so the layer has N parameters; fp32 masters with bf16 transfer copies) against the same step
over one flat tensor of the same size.

The last line is `host adamw: <X> GB/s, <F> of the measured memory bandwidth (<B> GB/s)`.

    python benchmarks/cpu_adam.py [--params 64e6 --repeat 7 --threads N]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megacompile.host_probe import interleaved_medians, stream_ops, usable_cores
from megacompile.runtime.host_kernels import kernel, land, squared_norm


def median_seconds(fn, repeat: int) -> float:
    fn()  # warm up (first touch of the pages, thread pool start)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=64e6, help="parameters in the flat buffer (default 64e6)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None,
                    help="threads (default: the cores this process may use: affinity and cgroup quota)")
    args = ap.parse_args()
    cores, why = (args.threads, "--threads") if args.threads else usable_cores()
    torch.set_num_threads(cores)
    n = int(args.params)
    ext = kernel()
    if ext is None:
        raise SystemExit("the fused kernel could not be built here (see the warning): nothing to compare")
    print(f"{n / 1e6:.0f}M parameters, {cores} threads ({why}), torch {torch.__version__}")

    g = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(n, generator=g))
    param.grad = torch.randn(n, generator=g) * 1e-3
    low = torch.empty(n, dtype=torch.bfloat16)
    m, v = torch.zeros(n), torch.zeros(n)
    step = [0]

    def ours(copy: bool):
        def run():
            step[0] += 1
            ext.adamw_step(param.data, param.grad, m, v, low if copy else None,  # noqa: F821
                           1e-4, 0.9, 0.999, 1e-8, 0.01, step[0], 1.0, 0)
        return run

    def torch_opt(**kw):
        opt = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01, **kw)  # noqa: F821

        def run(copy: bool):
            def step_fn():
                opt.step()
                if copy:
                    low.copy_(param.data)  # noqa: F821
            return step_fn
        return run

    fused, foreach = torch_opt(fused=True), torch_opt(foreach=True)
    arriving = torch.randn(n, generator=g).to(torch.bfloat16)   # a bf16 gradient from the device
    rows = [("megatrain HostAdamW + bf16 copy (one pass)", ours(True), 30),
            ("megatrain HostAdamW, no copy", ours(False), 28),
            ("torch AdamW fused + bf16 copy", fused(True), 34),
            ("torch AdamW fused, no copy", fused(False), 28),
            ("torch AdamW foreach + bf16 copy", foreach(True), 34),
            ("landing: torch grad.add_(bf16)", lambda: param.grad.add_(arriving), 10),  # noqa: F821
            ("landing: land(grad, bf16) + its norm", lambda: land(param.grad, arriving, True), 10),  # noqa: F821
            ("norm pass (what the landing now takes)", lambda: squared_norm(param.grad), 4)]  # noqa: F821
    # every row and the bandwidth probes in turn, round after round (host_probe.interleaved_medians)
    streams, stream_bytes = stream_ops(n)
    results = interleaved_medians({**streams, **{name: fn for name, fn, _ in rows}}, args.repeat)
    copy, triad, update = (stream_bytes[k] / results[k] / 1e9 for k in ("copy", "triad", "update"))
    bandwidth = max(copy, triad, update)
    print(f"\nmemory bandwidth: copy {copy:.1f} GB/s, triad {triad:.1f} GB/s, in-place update {update:.1f} GB/s "
          f"-> {bandwidth:.1f} GB/s\n")
    print(f"{'step':<44} {'ms':>8} {'Mparam/s':>10} {'GB/s':>8} {'of bw':>8}")
    for name, _, bytes_per_param in rows:
        s = results[name]
        gbps = bytes_per_param * n / s / 1e9
        print(f"{name:<44} {s * 1e3:>8.1f} {n / s / 1e6:>10.0f} {gbps:>8.1f} {gbps / bandwidth:>7.0%}")
    del streams
    del param, low, m, v, fused, foreach, arriving

    layer_s, flat_s, total = per_tensor_vs_flat(n, args.repeat)
    for name, s in (("HostAdamW.step(), a layer's 12 tensors", layer_s), ("HostAdamW.step(), one flat tensor", flat_s)):
        gbps = 30 * total / s / 1e9
        print(f"{name:<44} {s * 1e3:>8.1f} {total / s / 1e6:>10.0f} {gbps:>8.1f} {gbps / bandwidth:>7.0%}")
    ours_s = results["megatrain HostAdamW + bf16 copy (one pass)"]
    before = (results["landing: torch grad.add_(bf16)"] + results["norm pass (what the landing now takes)"]
              + results["torch AdamW fused + bf16 copy"])
    after = results["landing: land(grad, bf16) + its norm"] + ours_s
    print(f"\nspeed-up of the bf16 step over torch fused + copy: "
          f"{results['torch AdamW fused + bf16 copy'] / ours_s:.2f}x,"
          f" over torch foreach + copy: {results['torch AdamW foreach + bf16 copy'] / ours_s:.2f}x")
    print(f"the host's pass per step (landing + norm + AdamW + copy): torch {before * 1e3:.1f} ms, "
          f"megatrain {after * 1e3:.1f} ms ({before / after:.2f}x)")
    print(f"per-tensor steps over a layer vs one flat tensor: {layer_s / flat_s:.3f}x the time")
    gbps = 30 * n / ours_s / 1e9
    print(f"host adamw: {gbps:.1f} GB/s, {gbps / bandwidth:.2f} of the measured memory bandwidth "
          f"({bandwidth:.1f} GB/s)")


def layer_shapes(n: int) -> list[tuple[int, ...]]:
    """A Qwen2.5-7B decoder layer's tensors (hidden 3584, kv 512, MLP 18944, q/k/v biases, two
    norms) with the hidden size scaled so that they hold about n parameters."""
    h = int((n / (2 + 2 / 7 + 3 * 18944 / 3584)) ** 0.5)
    kv, mlp = max(1, h // 7), int(h * 18944 / 3584)
    return [(h, h), (h,), (kv, h), (kv,), (kv, h), (kv,), (h, h), (mlp, h), (mlp, h), (h, mlp), (h,), (h,)]


def per_tensor_vs_flat(n: int, repeat: int) -> tuple[float, float, int]:
    """Median seconds of HostAdamW.step() (bf16 parameters, fp32 masters in the store) over one
    layer's tensors and over one flat tensor of the same total size, and that size."""
    from megacompile.runtime import store
    from megacompile.runtime.adamw import HostAdamW

    def step_seconds(shapes):
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in shapes]
        entries = store.register(dict(enumerate(params)), {i: f"p{i}" for i in range(len(params))}, pin=False)
        for p, entry in zip(params, entries.values()):
            entry.add_host_grad(torch.randn(p.shape, generator=g) * 1e-3)   # fp32, as the backward delivers it
        opt = HostAdamW(params, lr=1e-4, weight_decay=0.01)
        return median_seconds(opt.step, repeat)

    shapes = layer_shapes(n)
    total = sum(torch.Size(s).numel() for s in shapes)
    return step_seconds(shapes), step_seconds([(total,)]), total


if __name__ == "__main__":
    main()
