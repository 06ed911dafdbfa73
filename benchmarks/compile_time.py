"""First-step (compile) time of a tiny Llama at several depths, and Dynamo's share of it.

    python benchmarks/compile_time.py                  # 2, 8, 32, 64 layers
    python benchmarks/compile_time.py --layers 2 8
    python benchmarks/compile_time.py --layers 8 --lowering inductor --cold-warm
    python benchmarks/compile_time.py --phases --layers 2 64 128   # where the first step's time goes
    python benchmarks/compile_time.py --phases --dynamo-regions always   # Dynamo traces each layer kind once
    python benchmarks/compile_time.py --phases --layers 2 4 --layer-regions always   # (or never; default auto)
    python benchmarks/compile_time.py --two-lengths --layers 2 16   # two sequence lengths: one compile or two

For each depth: the seconds of the first forward + backward through
torch.compile(backend="megatrain") on the CPU (Dynamo capture, AOTAutograd, the passes, the
lowering, the step itself), of which Dynamo's own frame compile (torch._dynamo's
`compile_time` counters); the median over --repeat fresh runs. Identical layers are compiled
once, so the time should grow with the graph Dynamo and AOTAutograd trace, not with lowering.

`--two-lengths` runs two steps of different sequence lengths (16 then 12 tokens), each depth
twice: as given (the first step compiles for its length, the second compiles again with a
symbolic length) and with the length marked dynamic up front (`maybe_mark_dynamic`, what
`megatrain train` does when its examples differ in length: one compile).

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


class _Timed:
    """Seconds spent in a function of the backend module, summed over its calls."""

    def __init__(self, module, name: str):
        self.module, self.name, self.fn, self.seconds = module, name, getattr(module, name), 0.0

    def __enter__(self):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return self.fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        setattr(self.module, self.name, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.fn)


def phases(layers: int, lowering: str = "eager", dynamo_regions: str = "never",
           layer_regions: str = "auto") -> dict[str, float]:
    """The first step's seconds by phase: Dynamo's own tracing, AOTAutograd's metadata pass and
    joint trace, torch's min-cut partition, megatrain's pass pipelines (joint + forward +
    backward), the rest of the compile (AOT's wrappers, the store, the program), and the step."""
    from megacompile import backend
    megacompile.reset()
    from torch._dynamo.utils import compilation_time_metrics
    compilation_time_metrics.clear()
    model = tiny_model("llama", layers=layers)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "lowering": lowering,
                                                                "dynamo_regions": dynamo_regions,
                                                                "layer_regions": layer_regions})
    ids, mask, labels = batch(2, 16)
    with _Timed(backend, "run_pipeline") as passes, _Timed(backend, "min_cut_rematerialization_partition") as cut:
        t0 = time.perf_counter()
        cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
        total = time.perf_counter() - t0
    m = {k: sum(v) for k, v in compilation_time_metrics.items()}
    backend_s = m.get("OutputGraph.call_user_compiler", 0.0)
    out = {"dynamo": m.get("_compile.compile_inner", 0.0) - backend_s,
           "aot metadata": m.get("aot_collect_metadata", 0.0), "aot joint trace": m.get("aot_trace_joint_graph", 0.0),
           "partition": cut.seconds, "passes": passes.seconds}
    out["compile rest"] = backend_s - sum(out[k] for k in ("aot metadata", "aot joint trace", "partition", "passes"))
    out["step"] = total - m.get("_compile.compile_inner", 0.0)
    out["total"] = total
    return out


def two_lengths(layers: int, marked: bool, dynamo_regions: str = "auto") -> tuple[float, float]:
    """Seconds of a first step at 16 tokens and a second at 12, the length marked dynamic or not."""
    megacompile.reset()
    model = tiny_model("llama", layers=layers)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "dynamo_regions": dynamo_regions})
    seconds = []
    for length in (16, 12):
        ids, mask, labels = batch(2, length)
        if marked:
            for t in (ids, mask, labels):
                torch._dynamo.maybe_mark_dynamic(t, 1)
        t0 = time.perf_counter()
        cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
        seconds.append(time.perf_counter() - t0)
    return seconds[0], seconds[1]


def first_step(layers: int, lowering: str = "eager", dynamo_regions: str = "never",
               layer_regions: str = "auto") -> tuple[float, float]:
    p = phases(layers, lowering, dynamo_regions, layer_regions)
    return p["total"], p["dynamo"]


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
    ap.add_argument("--phases", action="store_true", help="the first step's seconds by phase, per depth")
    ap.add_argument("--dynamo-regions", default="never", choices=["never", "always", "auto"],
                    help="Dynamo traces each decoder-layer kind once (option dynamo_regions; default never here, "
                         "to show the whole trace)")
    ap.add_argument("--layer-regions", default="auto", choices=["never", "always", "auto"],
                    help="AOTAutograd traces each decoder-layer kind once (option layer_regions)")
    ap.add_argument("--two-lengths", action="store_true",
                    help="two steps of different lengths: as given (two compiles) and marked dynamic (one)")
    ap.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.two_lengths:
        print(f"{'layers':>6} {'lengths':>8} {'step 1 s':>9} {'step 2 s':>9} {'both s':>7}   (median of {args.repeat}; "
              f"dynamo_regions {args.dynamo_regions})")
        for n in args.layers:
            for marked in (False, True):
                runs = [two_lengths(n, marked, args.dynamo_regions) for _ in range(args.repeat)]
                a, b = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
                both = statistics.median(r[0] + r[1] for r in runs)
                print(f"{n:>6} {'marked' if marked else 'as given':>8} {a:>9.2f} {b:>9.2f} {both:>7.2f}", flush=True)
        return
    if args.phases:
        names = None
        for n in args.layers:
            runs = [phases(n, args.lowering, args.dynamo_regions, args.layer_regions) for _ in range(args.repeat)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            if names is None:
                names = list(med)
                print(f"{'layers':>6} " + " ".join(f"{k:>15}" for k in names) + f"   (median of {args.repeat})")
            print(f"{n:>6} " + " ".join(f"{med[k]:>15.2f}" for k in names), flush=True)
        return
    if not args.quiet:
        print(f"{'layers':>6} {'first step s':>13} {'dynamo s':>9}   (median of {args.repeat}; torch "
              f"{torch.__version__})")
    for n in args.layers:
        if args.cold_warm:
            cold_warm(n, args.lowering)
            continue
        runs = [first_step(n, args.lowering, args.dynamo_regions, args.layer_regions) for _ in range(args.repeat)]
        print(f"{n:>6} {statistics.median(r[0] for r in runs):>13.2f} {statistics.median(r[1] for r in runs):>9.2f}",
              flush=True)


if __name__ == "__main__":
    main()
