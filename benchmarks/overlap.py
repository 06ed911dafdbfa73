"""The overlapped engine on a GPU against the GPU-resident limit.

For one 1B-8B model (random weights, a real model's shapes), prints the median step of:
  limit        the whole model, fp32 AdamW state and gradients resident on the GPU, per-layer
               torch.utils.checkpoint (the recomputation megatrain does), torch's fused AdamW
               on the GPU: what the same step costs when nothing has to move;
  plain        torch.compile(backend="megatrain") with the engine's parts off: per-tensor
               transfer copies (host_arena=False), synchronous gradient copies
               (overlap_grads=False), logits kept, no fused kernels; HostAdamW after the backward;
  megatrain    the engine as `megatrain train` runs it: host arenas (one copy per layer), gradient
               copies on their own stream overlapping the next layer, LM head + loss fused
               (logits="drop"), Triton kernels; HostAdamW on the host after the backward;
  +overlap fwd the same with HostAdamW(overlap="forward"): the optimizer runs under the next forward;
  +overlap bwd HostAdamW(overlap="backward"): each layer's update starts during the backward as
               its gradients land (speculative, rolled back when the norm is clipped: with
               --max-grad-norm 0, the default here, nothing is clipped; the trainer's default 1.0
               on random weights clips every step and shows the cost of the rollback instead).
For each: step seconds, tokens/s, model TFLOP/s (6 x parameters x tokens; recompute not
counted) and MFU against the hardware profile's dense rate; for megatrain the exposed transfer
time (its forward+backward minus the limit's) and the exposed optimizer time (its step minus
its forward+backward). Medians over --steps after --warmup.

    python benchmarks/overlap.py                          # Llama-3.2-3B shapes, batch 4 x 2048, H200 profile
    python benchmarks/overlap.py --model qwen2.5-7b --layers 28 --batch 2
    python benchmarks/overlap.py --device cpu --model tiny --steps 2   # smoke run of this script
    python benchmarks/overlap.py --device cpu --model cpu-150m --batch 1 --seq 512 --skip-limit
Host RAM needed: about 18 bytes/parameter (3B: ~58 GB; the H200 machine has 128 GiB).
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import signal
import statistics
import time
import traceback

import torch

import megacompile  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM

from megacompile.hardware import load_hardware
from megacompile.runtime.adamw import HostAdamW

from eager_baseline import checkpoint_every_layer   # (benchmarks/, on the path when run as a script)

SHAPES = {
    "llama-3.2-3b": dict(model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768, tie_word_embeddings=False),
    "cpu-150m": dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                     num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                     max_position_embeddings=4096),   # for --device cpu runs of the optimizer modes
    "tiny": dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
}


def build(args, device) -> torch.nn.Module:
    values = dict(SHAPES[args.model])
    if args.layers:
        values["num_hidden_layers"] = args.layers
    cfg = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    model.config.use_cache = False
    return model.train()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(step, args, device) -> dict[str, float]:
    times: dict[str, list[float]] = {}
    for i in range(args.warmup + args.steps):
        parts = step()
        if i == 0:   # (the compile, Inductor's lowering and Triton's autotuning land here)
            print("  first step " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()), flush=True)
        if i >= args.warmup:
            for k, v in parts.items():
                times.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in times.items()}


def limit_step(args, device, data, loss=None):
    """`loss(model, data)`: the step's loss (default: the model's own, whole logits; peers.py
    passes a chunked LM head + loss, as megatrain's fused one keeps no whole logits either)."""
    model = build(args, device)
    checkpoint_every_layer(model)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-5, fused=device.type == "cuda")

    def step():
        sync(device)
        t0 = time.perf_counter()
        (loss(model, data) if loss else model(input_ids=data, labels=data).loss).backward()
        sync(device)
        t1 = time.perf_counter()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
        sync(device)
        t2 = time.perf_counter()
        return {"step": t2 - t0, "fwd_bwd": t1 - t0, "optimizer": t2 - t1}
    return model, step


PLAIN = {"host_arena": False, "overlap_grads": False, "logits": "keep", "kernels": "none"}
ENGINE = {"logits": "drop"}


def megatrain_step(args, device, data, overlap, options: dict):
    # the host store is the model's home; built on the GPU where there is one (random init of
    # billions of parameters is minutes on the host) and moved
    model = build(args, device).cpu()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    cmodel = torch.compile(model, backend="megatrain",
                           options={"device": str(device), "slots": args.slots, "lowering": args.lowering,
                                    "attention": args.attention, **options})
    opt = HostAdamW(model.parameters(), lr=1e-5, overlap=overlap)
    data = data.cpu()   # (the batch lives with the model, on the host: the program moves it)

    def step():
        sync(device)
        t0 = time.perf_counter()
        loss = cmodel(input_ids=data, labels=data, use_cache=False).loss
        t_fwd = time.perf_counter()   # (host time to the loss: no sync, so as not to change the overlap)
        opt.arm()   # (overlap="backward" only)
        loss.backward()
        sync(device)
        t1 = time.perf_counter()
        norm = opt.grad_norm()
        opt.step(grad_scale=min(1.0, args.max_grad_norm / (norm + 1e-6)) if args.max_grad_norm > 0 else 1.0)
        opt.zero_grad(set_to_none=True)
        if not overlap:
            opt.synchronize()
        t2 = time.perf_counter()
        return {"step": t2 - t0, "fwd_bwd": t1 - t0, "optimizer": t2 - t1, "fwd_host": t_fwd - t0}
    return model, step


def profile(step, name: str, folder: str) -> None:
    """One more step under torch.profiler: its ops' table by host and by device time, and its
    trace (chrome://tracing, Perfetto), into `folder`."""
    from pathlib import Path
    from torch.profiler import ProfilerActivity
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    stem = "".join(c if c.isalnum() else "_" for c in name.split(" (")[0])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=activities) as prof:
        parts = step()
    averages = prof.key_averages()
    with open(out / f"profile_{stem}.txt", "w") as f:
        f.write(f"{name}: {parts}\n")
        for key in ("cpu_time_total", "self_cpu_time_total", "device_time_total"):
            f.write(f"\nsorted by {key}\n")
            f.write(averages.table(sort_by=key, row_limit=45, max_name_column_width=70))
    prof.export_chrome_trace(str(out / f"trace_{stem}.json.gz"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-3b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="keep this many layers (default: all)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hardware", default="h200", help="profile for MFU (h200, h100, ... or a JSON path)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-grad-norm", type=float, default=0.0, help="clip (0: no clipping)")
    ap.add_argument("--skip-limit", action="store_true", help="skip the GPU-resident limit (e.g. it does not fit)")
    ap.add_argument("--lowering", default="auto", choices=["auto", "eager", "inductor"],
                    help="how segment bodies run (auto: Inductor-compiled and timed per body on CUDA, which adds "
                         "compile time to the first step; eager: their aten ops)")
    ap.add_argument("--attention", default="segments", choices=["segments", "transformers"],
                    help="megatrain's segment attention (default) or the model's own (SDPA)")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="profile one more step of each config: op tables and a trace into DIR")
    ap.add_argument("--only", default="", help="comma-separated config names to run, in that order (default: all)")
    args = ap.parse_args()
    # (`timeout -s USR1 ...` in benchmarks/gpu_session.sh: a run cut short shows where it was)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    device = torch.device(args.device)
    peak_tflops = load_hardware(args.hardware).compute_tflops if device.type == "cuda" else None
    data = torch.randint(0, SHAPES[args.model]["vocab_size"], (args.batch, args.seq), device=device)
    tokens = args.batch * args.seq
    results, params = {}, 0
    configs = ([] if args.skip_limit else
               [("limit (GPU-resident, per-layer ckpt)", lambda: limit_step(args, device, data))])
    configs += [("megatrain plain", lambda: megatrain_step(args, device, data, False, PLAIN)),
                ("megatrain", lambda: megatrain_step(args, device, data, False, ENGINE)),
                ("megatrain +overlap fwd", lambda: megatrain_step(args, device, data, "forward", ENGINE)),
                ("megatrain +overlap bwd", lambda: megatrain_step(args, device, data, "backward", ENGINE))]
    if args.only:
        named = {n.split(" (")[0]: (n, m) for n, m in configs}   # (run in the order given)
        configs = [named[w.strip()] for w in args.only.split(",") if w.strip() in named]
    print(f"{args.model}: batch {args.batch} x seq {args.seq} = {tokens} tokens, {args.dtype}, device {device}, "
          f"torch {torch.__version__}")
    print(f"{'config':<40} {'step s':>8} {'fwd+bwd':>8} {'opt s':>7} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6}",
          flush=True)
    for name, make in configs:   # each row printed as it is measured: a run cut short keeps its rows
        try:
            t = time.perf_counter()
            model, step = make()
            print(f"  {name}: built in {time.perf_counter() - t:.1f} s", flush=True)
            params = sum(p.numel() for p in model.parameters())
            r = results[name] = run(step, args, device)
            if args.profile:
                profile(step, name, args.profile)
        except Exception:   # (one failing config must not hide the others' figures)
            traceback.print_exc()
            print(f"{name:<40} FAILED", flush=True)
            continue
        finally:
            model = step = None
            megacompile.reset()
            gc.collect()   # (the compiled program and its runners form cycles that hold the host store)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        tflops = 6 * params * tokens / r["step"] / 1e12
        mfu = f"{tflops / peak_tflops:.1%}" if peak_tflops else "-"
        print(f"{name:<40} {r['step']:>8.3f} {r['fwd_bwd']:>8.3f} {r['optimizer']:>7.3f} {tokens / r['step']:>9.0f} "
              f"{tflops:>8.1f} {mfu:>6}", flush=True)
    print(f"{params / 1e9:.2f}B parameters")
    limit = next((r for n, r in results.items() if n.startswith("limit")), None)
    for name in ("megatrain plain", "megatrain", "megatrain +overlap fwd", "megatrain +overlap bwd"):
        if name not in results:
            continue
        r = results[name]
        exposed_transfer = r["fwd_bwd"] - limit["fwd_bwd"] if limit else float("nan")
        print(f"{name}: exposed transfer {exposed_transfer:.3f} s, exposed optimizer {r['step'] - r['fwd_bwd']:.3f} s"
              + (f", step {r['step'] / limit['step']:.2f}x the limit" if limit else ""))
    plain = results.get("megatrain plain")
    engines = [results[n] for n in ("megatrain +overlap fwd", "megatrain +overlap bwd") if n in results]
    if plain is None or not engines:
        return
    engine = min(engines, key=lambda r: r["step"])
    print(f"engine speed-up over plain: {plain['step'] / engine['step']:.2f}x per step")


if __name__ == "__main__":
    main()
