"""Data parallelism: step time and scaling, measured on this machine for 1 and 2 ranks, and
planned for 1/2/4/8 H100s and H200s at equal per-device batch.

1. Measured (CPU, gloo): a Llama-shaped fp32 model trained with torch.compile(backend="megatrain")
   + HostAdamW, as one process and as `torchrun --nproc-per-node 2` (each rank at the same
   per-device batch, the node's state in shared memory): median step time after warm-up steps,
   tokens/s of the job and the scaling (tokens/s of 2 ranks over 1). On a machine with fewer
   cores than ranks x threads the ranks share the cores, so the "scaling" is below 1 there and
   says only what the collectives and the shared state cost.
2. Planned: `megatrain plan`'s one-GPU step (compute, H2D, the host optimizer overlapped with the
   backward) at a per-device batch, then for N GPUs of one node: the same compute per GPU, each
   GPU fetching 1/N of every layer over PCIe and all-gathering the rest over NVLink, the gradients
   reduce-scattered in fp32 over NVLink, and the node's host optimizer doing the one-GPU work
   (each rank updates 1/N of the state; the host's memory bandwidth is shared). Two columns:
   "as built" (this version runs the collectives on the compute stream: all exposed) and
   "overlapped" (collectives on their own stream, hidden under the layer's compute when shorter,
   as FSDP2 does: the next slice). The peer bandwidth (NCCL bus bandwidth of an NVLink-4 node,
   ~360 GB/s) is an assumption, not a measurement.

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
PEER_GBPS = 360.0      # NVLink 4 all-gather / reduce-scatter bus bandwidth (assumed)
PEER_LATENCY_S = 15e-6


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


def planned(model: str, seq: int, batch: int, gpus=(1, 2, 4, 8)) -> None:
    from megacompile.hardware import BUILTIN
    from megacompile.plan import plan_model
    print(f"\nplanned: {model}, {batch} x {seq} tokens per GPU, one node, peer links {PEER_GBPS:.0f} GB/s (assumed)")
    print(f"{'gpu':>5} {'N':>2} {'step s':>8} {'as built s':>11} {'scaling':>8} {'overlapped s':>13} {'scaling':>8} "
          f"{'comm s':>7} {'opt s':>6}")
    for name in ("h100", "h200"):
        hw = BUILTIN[name]
        plan = plan_model(model, hardware=hw, seq=seq, batch=batch)
        est = next(b for b in plan.batches if b.batch == batch)
        one = est.step_seconds
        weights = plan.model.get("parameters", 0)
        compute = est.forward_seconds + est.backward_seconds
        for n in gpus:
            frac = (n - 1) / n
            # bf16 weights gathered in the forward and again in the backward (recompute), fp32 gradients
            comm = frac * (2 * 2 * weights + 4 * weights) / (PEER_GBPS * 1e9) + 3 * plan.model.get("layers", 1) * (
                PEER_LATENCY_S if n > 1 else 0)
            built = one + comm
            overlapped = one + max(0.0, comm - compute)
            print(f"{name:>5} {n:>2} {one:>8.3f} {built:>11.3f} {n * one / built:>7.2f}x {overlapped:>13.3f} "
                  f"{n * one / overlapped:>7.2f}x {comm:>7.3f} {est.optimizer_seconds:>6.3f}")
    print("goal: >= 3.8x at 4 GPUs (equal per-device batch, optimizer counted)")


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
    print(f"  scaling 2 ranks / 1: {rows[2][1] / rows[1][1]:.2f}x tokens/s ({os.cpu_count()} cores shared by the ranks)")
    if not args.no_plan:
        planned(args.model, args.seq, args.gpu_batch)


if __name__ == "__main__":
    main()
