"""Step-time overhead of megatrain on the CPU against eager PyTorch.

Prints the median training-step time (forward + backward + AdamW) of a small Llama for:
  eager            the model as is (all activations kept)
  eager+ckpt       per-decoder-layer torch.utils.checkpoint (the same recomputation megatrain does)
  megatrain        torch.compile(backend="megatrain") on the CPU (weights streamed through the
                   device pool, layer-boundary recomputation)
and the ratios. Goal: megatrain within 1.15x of eager+ckpt on the CPU. Two megatrain variants
show what the gradient offload thread (`overlap_grads=False`: synchronous) and the fused LM
head + loss (`logits="drop"`, as `megatrain train` runs) change.

    python benchmarks/step_overhead.py [--layers 8 --hidden 256 --batch 4 --seq 256 --steps 12]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import megacompile

from eager_baseline import checkpoint_every_layer   # (benchmarks/, on the path when run as a script)


def build(args) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                      num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                      num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=4096)
    return AutoModelForCausalLM.from_config(cfg)


def time_interleaved(steps_by_name: dict, steps: int, warmup: int) -> dict[str, list[float]]:
    """Round-robin one step of each configuration at a time, so drift in the machine's speed
    (other processes, thermal) hits all of them alike."""
    times = {name: [] for name in steps_by_name}
    for i in range(warmup + steps):
        for name, step in steps_by_name.items():
            t0 = time.perf_counter()
            step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def make_step(model, call):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, model.config.vocab_size, (ARGS.batch, ARGS.seq))

    def step():
        loss = call(input_ids=data, labels=data, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    global ARGS
    ARGS = p.parse_args()
    base = build(ARGS)
    print(f"model: Llama {ARGS.layers} layers, hidden {ARGS.hidden}, vocab {ARGS.vocab}, "
          f"{sum(q.numel() for q in base.parameters()) / 1e6:.1f}M params; batch {ARGS.batch} x seq {ARGS.seq}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    eager = copy.deepcopy(base).train()
    ckpt = copy.deepcopy(base).train()
    checkpoint_every_layer(ckpt)
    mt = copy.deepcopy(base).train()
    cmodel = torch.compile(mt, backend="megatrain", options={"device": "cpu"})
    configs = {"eager": make_step(eager, eager), "eager+ckpt": make_step(ckpt, ckpt),
               "megatrain": make_step(mt, cmodel)}
    # variants: synchronous gradient offload; the loss fused with the LM head (as megatrain train)
    for name, options in (("mt sync-grads", {"overlap_grads": False}), ("mt logits=drop", {"logits": "drop"})):
        model = copy.deepcopy(base).train()
        configs[name] = make_step(model, torch.compile(model, backend="megatrain",
                                                       options={"device": "cpu", **options}))
    results = time_interleaved(configs, ARGS.steps, ARGS.warmup)

    med = {k: statistics.median(v) for k, v in results.items()}
    tokens = ARGS.batch * ARGS.seq
    for k, v in med.items():
        print(f"{k:>12}: median step {v * 1e3:8.1f} ms  ({tokens / v:8.0f} tokens/s)")
    print(f"ratio megatrain / eager+ckpt = {med['megatrain'] / med['eager+ckpt']:.3f}  (goal <= 1.15)")
    print(f"ratio megatrain / eager      = {med['megatrain'] / med['eager']:.3f}")
    print(f"ratio eager+ckpt / eager     = {med['eager+ckpt'] / med['eager']:.3f}")
    print(f"ratio megatrain / mt sync-grads  = {med['megatrain'] / med['mt sync-grads']:.3f}  (overlapped "
          "gradient offload)")
    print(f"ratio mt logits=drop / megatrain = {med['mt logits=drop'] / med['megatrain']:.3f}  (fused LM head + loss)")
    s = megacompile.stats(cmodel)
    print(f"megatrain: peak device bytes {s['peak_device_bytes'] / 2**20:.1f} MiB, peak weight bytes "
          f"{s['peak_device_weight_bytes'] / 2**20:.1f} MiB of {s['weight_bytes'] / 2**20:.1f} MiB, "
          f"h2d {s['h2d_bytes'] / 2**20:.1f} MiB, d2h {s['d2h_bytes'] / 2**20:.1f} MiB per step, "
          f"distinct layer bodies {s['distinct_layer_bodies']}")


if __name__ == "__main__":
    main()
