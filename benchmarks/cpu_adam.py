"""The host optimizer step against torch's AdamW and the machine's copy bandwidth.

One flat fp32 parameter of N elements (its gradient, both moments; for the bf16 rows also the
bf16 transfer copy the step must refresh), stepped by:
  - megatrain HostAdamW kernel (runtime/csrc/adamw.cpp): AdamW + bf16 copy in one pass
    (30 bytes/param), and without the copy (28);
  - torch.optim.AdamW fused=True (torch's fused CPU kernel), then the bf16 copy (28 + 6);
  - torch.optim.AdamW foreach=True (the default multi-tensor path), then the bf16 copy.
The limit is a STREAM-style copy measured in the same run (`dst.copy_(src)` on 4N-byte fp32
buffers: 8N bytes moved). GB/s counts the bytes an update must move (reads + writes), so the
ratio to the copy bandwidth says how close a step is to the memory system's limit. Medians.

Per tensor or flat: HostAdamW steps each parameter with one kernel call (no flat buffer that
would tie the optimizer's layout to the store's). The last rows measure what that costs:
`HostAdamW.step()` over one decoder layer's 12 tensors (Qwen2.5-7B's shapes, hidden size scaled
so the layer has N parameters; fp32 masters with bf16 transfer copies) against the same step
over one flat tensor of the same size.

    python benchmarks/cpu_adam.py [--params 64e6 --repeat 7 --threads N]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megacompile.runtime.adamw import kernel


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
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = int(args.params)
    ext = kernel()
    if ext is None:
        raise SystemExit("the fused kernel could not be built here (see the warning): nothing to compare")
    print(f"{n / 1e6:.0f}M parameters, {torch.get_num_threads()} threads, torch {torch.__version__}")

    src, dst = torch.rand(n), torch.empty(n)
    copy_s = median_seconds(lambda: dst.copy_(src), args.repeat)  # noqa: F821
    copy_gbps = 8 * n / copy_s / 1e9
    del src, dst

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
    rows = [("megatrain HostAdamW + bf16 copy (one pass)", ours(True), 30),
            ("megatrain HostAdamW, no copy", ours(False), 28),
            ("torch AdamW fused + bf16 copy", fused(True), 34),
            ("torch AdamW fused, no copy", fused(False), 28),
            ("torch AdamW foreach + bf16 copy", foreach(True), 34)]
    print(f"\ncopy bandwidth (STREAM-style dst.copy_(src)): {copy_gbps:.1f} GB/s\n")
    print(f"{'step':<44} {'ms':>8} {'Mparam/s':>10} {'GB/s':>8} {'of copy':>8}")
    results = {}
    for name, fn, bytes_per_param in rows:
        s = median_seconds(fn, args.repeat)
        results[name] = s
        gbps = bytes_per_param * n / s / 1e9
        print(f"{name:<44} {s * 1e3:>8.1f} {n / s / 1e6:>10.0f} {gbps:>8.1f} {gbps / copy_gbps:>7.0%}")
    del param, low, m, v, fused, foreach

    layer_s, flat_s, total = per_tensor_vs_flat(n, args.repeat)
    for name, s in (("HostAdamW.step(), a layer's 12 tensors", layer_s), ("HostAdamW.step(), one flat tensor", flat_s)):
        gbps = 30 * total / s / 1e9
        print(f"{name:<44} {s * 1e3:>8.1f} {total / s / 1e6:>10.0f} {gbps:>8.1f} {gbps / copy_gbps:>7.0%}")
    ours_s = results["megatrain HostAdamW + bf16 copy (one pass)"]
    print(f"\nspeed-up of the bf16 step over torch fused + copy: "
          f"{results['torch AdamW fused + bf16 copy'] / ours_s:.2f}x,"
          f" over torch foreach + copy: {results['torch AdamW foreach + bf16 copy'] / ours_s:.2f}x")
    print(f"per-tensor steps over a layer vs one flat tensor: {layer_s / flat_s:.3f}x the time")


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
