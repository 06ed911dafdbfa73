"""Long context: the longest sequence each model fits on each GPU (the planner), and on the CPU
the measured peak and step of a small model at several lengths.

    python benchmarks/long_context.py                                   # both parts, defaults below
    python benchmarks/long_context.py --models llama-3-8b --gpus h200 --cpu-seqs 0
    python benchmarks/long_context.py --models none --cpu-seqs 4096 16384 32768
    python benchmarks/long_context.py --models none --cpu-seqs 16384 32768 65536 --cpu-budget 96

Plan part, for each model x GPU profile (batch 1, --host-ram of host memory): the sequence is
doubled from --start until `megatrain plan` no longer fits it; printed are the longest that
fits, its planned device peak, how much the peak grew at most over one doubling
(peak(2S)/peak(S): 2.0 is linear in the sequence, 4.0 quadratic), the planned tokens/s and the MFU, with the model
FLOPs counted as 6 x parameters x tokens plus causal attention, 6 x layers x seq^2 x heads x
head_dim per sequence (forward QK^T and AV, halved for causality, times 3 for the backward).

CPU part, for each --cpu-seqs length: a small Llama (batch 1) trained by megatrain on the CPU
("device" = host; its layer checkpoints kept on the host as a GPU run past its memory would:
offload_checkpoints="always", MLP tiles "auto"; with --cpu-budget, under that device_budget
instead: megatrain chooses the offload and the sequence tiles, printed) and by eager PyTorch with per-layer
checkpointing: median step seconds over --steps after a warm-up, and the peak of the bytes the
step's ops allocate (a dispatch mode, as tests/device_bytes.py counts it: for megatrain what its
executor allocates, streamed weights included, its host checkpoint copies left out; for eager
every op of the step; gradients left out, they live on the host).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import megacompile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from device_bytes import LiveStorages, host_grads, measure_step  # noqa: E402
from eager_baseline import checkpoint_every_layer  # noqa: E402

from megacompile.backend import programs_of  # noqa: E402
from megacompile.errors import CannotFitError  # noqa: E402
from megacompile.hardware import load_hardware  # noqa: E402
from megacompile.inspect import build_meta_model  # noqa: E402
from megacompile.plan import plan_model  # noqa: E402

GIB = 2**30


def attention_shape(config) -> tuple[int, int]:
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, heads * head_dim


def step_flops(params: int, layers: int, attn_width: int, seq: int, batch: int = 1) -> float:
    """Model FLOPs of a training step: dense 6 N T plus causal attention (recompute not counted)."""
    return 6.0 * params * seq * batch + 6.0 * layers * seq * seq * attn_width * batch


def plan_at(model: str, gpu: str, seq: int, host_ram: int):
    """The batch-1 plan, or None when it does not fit."""
    try:
        plan = plan_model(model, hardware=load_hardware(gpu), host_ram=host_ram, seq=seq, batch=1)
    except CannotFitError:
        return None
    return plan if plan.fits and plan.batches else None


def longest(model: str, gpu: str, start: int, limit: int, host_ram: int) -> dict:
    """Double the sequence from `start` while the plan fits: the last that fits and its figures."""
    _, config = build_meta_model(model, 1, torch.bfloat16)
    _, width = attention_shape(config)
    seq, last, previous_peak, growth = start, None, None, None
    while seq <= limit:
        t = time.perf_counter()
        plan = plan_at(model, gpu, seq, host_ram)
        if plan is None:
            print(f"  {model} on {gpu}: seq {seq}: does not fit ({time.perf_counter() - t:.0f} s to plan)", flush=True)
            break
        estimate = plan.batches[0]
        print(f"  {model} on {gpu}: seq {seq}: fits, {estimate.device_peak_bytes / GIB:.2f} GiB"
              + (f" ({estimate.device_peak_bytes / previous_peak:.2f}x the last)" if previous_peak else "")
              + f" ({time.perf_counter() - t:.0f} s to plan)", flush=True)
        if previous_peak:   # (the largest growth over any doubling: 2.0 is linear in the sequence)
            growth = max(growth or 0.0, estimate.device_peak_bytes / previous_peak)
        previous_peak = estimate.device_peak_bytes
        params = plan.model.get("parameters") or 0
        flops = step_flops(params, plan.model["layers"], width, seq)   # (the full depth, not the 1-layer build)
        last = {"seq": seq, "peak_gib": estimate.device_peak_bytes / GIB, "growth": growth,
                "tokens_per_s": seq / estimate.step_seconds,
                "mfu": flops / estimate.step_seconds / (plan.hardware["compute_tflops"] * 1e12)}
        seq *= 2
    return last or {"seq": 0}


def cpu_step(seq: int, steps: int, layers: int, hidden: int, compiled: bool,
             budget: int | None = None) -> tuple[float, int, int]:
    """(median step seconds, peak bytes, sequence tiles) of one configuration at `seq` tokens;
    `budget`: megatrain's device_budget in bytes (it then chooses the tiles and the checkpoint
    offload itself)."""
    from conftest import tiny_model
    model = tiny_model("llama", layers=layers, hidden=hidden, max_position_embeddings=seq)
    ids = torch.randint(0, 100, (1, seq))
    if compiled:
        megacompile.reset()
        fixed = {"device_budget": budget} if budget else {"offload_checkpoints": "always"}
        run = torch.compile(model, backend="megatrain", options={"device": "cpu", **fixed})
    else:
        checkpoint_every_layer(model)
        run = model
    times = []
    for i in range(steps + 1):   # (the first step compiles)
        t = time.perf_counter()
        run(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        if i:
            times.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    # one more step, measured (not timed: the probe costs time): for megatrain what its executor
    # allocates, for eager every op of the step
    probe, copies, host = LiveStorages(), [], set()
    if compiled:   # (its checkpoints' host copies are host memory: left out, as the gradients are)
        mover = programs_of(model)[-1].checkpoints
        offload = mover.offload
        mover.offload = lambda value: copies.append(offload(value)) or copies[-1]
    with measure_step(programs_of(model)[-1]) if compiled else probe as measured:
        run(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        measured = measured or probe
        host = measured.allocations_of(copies)
    copies.clear()
    peak = measured.peak(exclude=host_grads(measured, model) | host)
    model.zero_grad(set_to_none=True)
    tiles = max(programs_of(model)[-1].tile_counts, default=1) if compiled else 1
    return statistics.median(times), peak, tiles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama-3-8b", "qwen2.5-7b", "qwen2.5-32b"],
                    help="presets to plan ('none': skip the plan part)")
    ap.add_argument("--gpus", nargs="+", default=["h100", "h200", "gh200"])
    ap.add_argument("--start", type=int, default=4096)
    ap.add_argument("--limit", type=int, default=4 * 2**20, help="longest sequence tried")
    ap.add_argument("--host-ram", type=float, default=2.0, help="host RAM in TiB for the plans")
    ap.add_argument("--cpu-seqs", nargs="+", type=int, default=[4096, 16384, 32768],
                    help="sequence lengths of the CPU part (0: skip it)")
    ap.add_argument("--cpu-layers", type=int, default=2)
    ap.add_argument("--cpu-hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cpu-budget", type=float, default=None,
                    help="megatrain's device_budget in MiB for the CPU part (it chooses tiles and offload); "
                         "default: none, layer checkpoints on the host and tiles auto")
    args = ap.parse_args()
    models = [m for m in args.models if m != "none"]
    if models:
        rows = []
        for model in models:
            for gpu in args.gpus:
                rows.append((model, gpu, longest(model, gpu, args.start, args.limit, int(args.host_ram * 2**40))))
        print(f"\nlongest sequence that fits (batch 1, {args.host_ram:g} TiB host RAM; doubling from {args.start})")
        print(f"{'model':<14} {'gpu':<6} {'seq':>9} {'peak GiB':>9} {'x per 2x seq':>12} {'tok/s':>9} {'MFU':>6}")
        for model, gpu, r in rows:
            if not r["seq"]:
                print(f"{model:<14} {gpu:<6} {'none':>9}")
                continue
            growth = f"{r['growth']:.2f}" if r["growth"] else "-"
            print(f"{model:<14} {gpu:<6} {r['seq']:>9} {r['peak_gib']:>9.2f} {growth:>12} {r['tokens_per_s']:>9.0f} "
                  f"{r['mfu']:>6.1%}")
    seqs = [s for s in args.cpu_seqs if s > 0]
    if seqs:
        budget = int(args.cpu_budget * 2**20) if args.cpu_budget else None
        print(f"\nCPU, small Llama ({args.cpu_layers} layers, hidden {args.cpu_hidden}), batch 1, "
              f"median of {args.steps} steps; torch {torch.__version__}; megatrain "
              + (f"under device_budget {args.cpu_budget:g} MiB" if budget else "with its checkpoints on the host"))
        print(f"{'seq':>7} {'megatrain s':>12} {'peak MiB':>9} {'tiles':>6} {'eager+ckpt s':>13} {'peak MiB':>9} "
              f"{'peak ratio':>10}")
        for seq in seqs:
            try:
                ours = cpu_step(seq, args.steps, args.cpu_layers, args.cpu_hidden, compiled=True, budget=budget)
            except Exception as e:   # (a budget too small for this length: say so, go on)
                if "CannotFitError" not in str(e):
                    raise
                print(f"{seq:>7} {'does not fit the budget':>29}", flush=True)
                continue
            eager = cpu_step(seq, args.steps, args.cpu_layers, args.cpu_hidden, compiled=False)
            print(f"{seq:>7} {ours[0]:>12.2f} {ours[1] / 2**20:>9.1f} {ours[2]:>6} {eager[0]:>13.2f} "
                  f"{eager[1] / 2**20:>9.1f} {ours[1] / max(eager[1], 1):>10.2f}", flush=True)


if __name__ == "__main__":
    main()
