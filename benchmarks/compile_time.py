"""First-step (compile) time of a tiny Llama at several depths, and Dynamo's share of it.

    python benchmarks/compile_time.py                  # 2, 8, 32, 64 layers
    python benchmarks/compile_time.py --layers 2 8
    python benchmarks/compile_time.py --layers 8 --lowering inductor --cold-warm

For each depth: the seconds of the first forward + backward through
torch.compile(backend="megatrain") on the CPU (Dynamo capture, AOTAutograd, the passes, the
lowering, the step itself), of which Dynamo's own frame compile (torch._dynamo's
`compile_time` counters); the median over --repeat fresh runs. Identical layers are compiled
once, so the time should grow with the graph Dynamo and AOTAutograd trace, not with lowering.

`--lowering inductor` compiles each distinct body with Inductor (runtime/lowering.py);
`--cold-warm` runs the first step twice, each in a fresh process, with one new Inductor cache
directory (TORCHINDUCTOR_CACHE_DIR): the first run compiles cold, the second finds Inductor's
FX graph cache on disk, as a user's second `megatrain train` of the same model does.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import batch, tiny_model  # noqa: E402

import megacompile  # noqa: E402,F401  (registers the backend)


def first_step(layers: int, lowering: str = "eager") -> tuple[float, float]:
    megacompile.reset()
    from torch._dynamo.utils import compilation_time_metrics
    compilation_time_metrics.clear()
    model = tiny_model("llama", layers=layers)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "lowering": lowering})
    ids, mask, labels = batch(2, 16)
    t0 = time.perf_counter()
    cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    total = time.perf_counter() - t0
    # Dynamo's own: its frame compile minus the backend it calls (AOTAutograd, passes, lowering)
    metric = {k: sum(v) for k, v in compilation_time_metrics.items()}
    dynamo = metric.get("_compile.compile_inner", 0.0) - metric.get("OutputGraph.call_user_compiler", 0.0)
    return total, dynamo


def cold_warm(layers: int, lowering: str) -> None:
    """The first step in two fresh processes sharing one new Inductor cache directory."""
    import os
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for label in ("cold", "warm"):
            out = subprocess.run([sys.executable, __file__, "--layers", str(layers), "--repeat", "1", "--lowering",
                                  lowering, "--quiet"], env=env, capture_output=True, text=True, check=True).stdout
            total, dynamo = out.split()[-2:]
            print(f"{layers:>6} {float(total):>13.2f} {float(dynamo):>9.2f}   {label} ({lowering} lowering)",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32, 64])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lowering", default="eager", choices=["eager", "inductor"])
    ap.add_argument("--cold-warm", action="store_true", help="first step cold, then warm from Inductor's disk cache")
    ap.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.quiet:
        print(f"{'layers':>6} {'first step s':>13} {'dynamo s':>9}   (median of {args.repeat}; torch "
              f"{torch.__version__})")
    for n in args.layers:
        if args.cold_warm:
            cold_warm(n, args.lowering)
            continue
        runs = [first_step(n, args.lowering) for _ in range(args.repeat)]
        print(f"{n:>6} {statistics.median(r[0] for r in runs):>13.2f} {statistics.median(r[1] for r in runs):>9.2f}",
              flush=True)


if __name__ == "__main__":
    main()
