"""First-step (compile) time of a tiny Llama at several depths, and Dynamo's share of it.

    python benchmarks/compile_time.py                  # 2, 8, 32, 64 layers
    python benchmarks/compile_time.py --layers 2 8

For each depth: the seconds of the first forward + backward through
torch.compile(backend="megatrain") on the CPU (Dynamo capture, AOTAutograd, the passes, the
lowering, the step itself), of which Dynamo's own frame compile (torch._dynamo's
`compile_time` counters); the median over --repeat fresh runs. Identical layers are compiled
once, so the time should grow with the graph Dynamo and AOTAutograd trace, not with lowering.
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


def first_step(layers: int) -> tuple[float, float]:
    megacompile.reset()
    from torch._dynamo.utils import compilation_time_metrics
    compilation_time_metrics.clear()
    model = tiny_model("llama", layers=layers)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ids, mask, labels = batch(2, 16)
    t0 = time.perf_counter()
    cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    total = time.perf_counter() - t0
    # Dynamo's own: its frame compile minus the backend it calls (AOTAutograd, passes, lowering)
    metric = {k: sum(v) for k, v in compilation_time_metrics.items()}
    dynamo = metric.get("_compile.compile_inner", 0.0) - metric.get("OutputGraph.call_user_compiler", 0.0)
    return total, dynamo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32, 64])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'layers':>6} {'first step s':>13} {'dynamo s':>9}   (median of {args.repeat}; torch {torch.__version__})")
    for n in args.layers:
        runs = [first_step(n) for _ in range(args.repeat)]
        print(f"{n:>6} {statistics.median(r[0] for r in runs):>13.2f} {statistics.median(r[1] for r in runs):>9.2f}",
              flush=True)


if __name__ == "__main__":
    main()
