"""Data parallelism: step time and scaling, measured on this machine for 1 and 2 ranks, and
planned for 1/2/4/8 H100s and H200s at equal per-device batch.

1. Measured (CPU, gloo): a Llama-shaped fp32 model trained with torch.compile(backend="megatrain")
   + HostAdamW, as one process and as `torchrun --nproc-per-node 2` (each rank at the same
   per-device batch, the node's state in shared memory): median step time after warm-up steps,
   tokens/s of the job and the scaling (tokens/s of 2 ranks over 1). On a machine with fewer
   cores than ranks x threads the ranks share the cores, so the "scaling" is below 1 there and
   says only what the collectives and the shared state cost.
2. Planned: `megatrain plan --gpus N` (plan_model(gpus=N)) for 1/2/4/8 H100s and H200s of one
   node at the same per-device batch: each GPU's step simulated with its part of every fetch over
   PCIe, the all-gathers on their own stream (under the bodies before their segment) and the fp32
   reduce-scatters on the compute stream (as this version runs them) at the profile's `peer_gbps`
   (NVLink 4: 360 GB/s assumed, NCCL's bus bandwidth, not measured), and the node's host optimizer
   doing the one-GPU work during the backward (each rank updates 1/N; they share the host's memory
   bandwidth). Scaling = the node's tokens/s over one
   GPU's.

    python benchmarks/data_parallel.py [--hidden 512 --layers 4 --steps 6] [--model qwen2.5-7b --seq 4096]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def worker(out: str, hidden: int, layers: int, steps: int, batch: int, seq: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from megacompile import HostAdamW, distributed
    topo = distributed.setup(torch.device("cpu"), timeout_s=300)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8000, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                      max_position_embeddings=seq)
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    opt = HostAdamW(model.parameters(), lr=1e-4)
    times = []
    gen = torch.Generator().manual_seed(topo.rank)
    for _ in range(steps):
        ids = torch.randint(0, 8000, (batch, seq), generator=gen)
        distributed.barrier(topo)
        t0 = time.perf_counter()
        cmodel(input_ids=ids, labels=ids).loss.backward()
        opt.grad_norm()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        times.append(time.perf_counter() - t0)
    if topo.writer:
        params = sum(p.numel() for p in model.parameters())
        Path(out).write_text(json.dumps({"world": topo.world, "times": times, "params": params,
                                         "tokens_per_rank": batch * seq}))
    distributed.end(topo)


def measure(args, nproc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, __file__, "--worker", out, "--hidden", str(args.hidden), "--layers", str(args.layers),
               "--steps", str(args.steps + args.warmup), "--batch", str(args.batch), "--seq", str(args.cpu_seq)]
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--monitor-interval",
                   "0.1", *cmd[1:]]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(Path(out).read_text())


def planned(model: str, seq: int, batch: int, gpus=(1, 2, 4, 8), profiles=("h100", "h200")) -> None:
    from megacompile.hardware import BUILTIN
    from megacompile.plan import plan_model
    print(f"\nplanned (megatrain plan --gpus N): {model}, {batch} x {seq} tokens per GPU per step, one node, "
          "the optimizer during the backward")
    print(f"{'gpu':>5} {'N':>2} {'step s':>8} {'collectives s*':>14} {'tokens/s':>10} {'scaling':>8}")
    for name in profiles:
        hw = BUILTIN[name]
        base = None
        for n in gpus:
            plan = plan_model(model, hardware=hw, seq=seq, batch=batch, gpus=n, host_ram=4 * 2**40)
            est = next(b for b in plan.batches if b.batch == batch)
            step = est.overlap_backward_seconds or est.step_seconds
            tokens = n * batch * seq / step
            base = base or tokens
            comm = 0.0 if n == 1 else _collective_seconds(plan, n)
            print(f"{name:>5} {n:>2} {step:>8.3f} {comm:>14.3f} {tokens:>10,.0f} {tokens / base:>7.2f}x")
    print("* the all-gathers and reduce-scatters of one GPU's step in closed form (the step column simulates them)")
    print("goal: >= 3.8x at 4 GPUs (equal per-device batch, optimizer counted)")


def _collective_seconds(plan, n: int) -> float:
    """The all-gathers' and reduce-scatters' time of one GPU's step (closed form, for the table)."""
    hw = plan.hardware
    weights = plan.model["parameters"] * 2          # bf16
    moved = (n - 1) / n * (2 * weights + 2 * weights)   # gathered in the forward and the backward, fp32 grads
    return moved / (hw["peer_gbps"] * 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cpu-seq", "--seq-cpu", dest="cpu_seq", type=int, default=256)
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--gpu-batch", type=int, default=4)
    ap.add_argument("--plan-gpus", default="1,2,4,8", help="GPU counts to plan, comma-separated")
    ap.add_argument("--plan-hardware", default="h100,h200", help="built-in GPU profiles to plan, comma-separated")
    ap.add_argument("--no-plan", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.hidden, args.layers, args.steps, args.batch, args.cpu_seq)
        return
    print(f"measured on this machine ({os.cpu_count()} cores): Llama-shaped fp32 model, hidden {args.hidden}, "
          f"{args.layers} layers, {args.batch} x {args.cpu_seq} tokens per rank, median of {args.steps} steps after "
          f"{args.warmup}")
    rows = {}
    for n in (1, 2):
        r = measure(args, n)
        t = statistics.median(r["times"][args.warmup:])
        rows[n] = (t, n * r["tokens_per_rank"] / t)
        print(f"  {n} rank(s): {r['params'] / 1e6:.1f}M parameters, {t:.3f} s/step, {rows[n][1]:.0f} tokens/s")
    print(f"  scaling 2 ranks / 1: {rows[2][1] / rows[1][1]:.2f}x tokens/s ({os.cpu_count()} cores shared by the "
          "ranks)")
    if not args.no_plan:
        planned(args.model, args.seq, args.gpu_batch, tuple(int(n) for n in args.plan_gpus.split(",")),
                tuple(args.plan_hardware.split(",")))


if __name__ == "__main__":
    main()
