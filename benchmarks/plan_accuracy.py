"""How well `megatrain plan` predicts a real step on this machine (the CPU playing the device).

For each model size: the planner's predicted step time (measured `cpu` profile, the model's
config, same batch and sequence) against the median measured step time of the same model
trained with torch.compile(backend="megatrain") on the CPU (forward + backward + AdamW), and
the ratio predicted / measured. Goal: within +-25%. The planner times bodies by their fastest
run (load from other processes only adds time), so the ratio is also given against the fastest
measured step (`pred/min`), the figure least disturbed by a busy machine.

    python benchmarks/plan_accuracy.py [--steps 6]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import megacompile  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig

#: two sizes: (name, hidden, layers, vocab, batch, seq)
SIZES = [("llama-h384-l4", 384, 4, 4096, 4, 256), ("llama-h512-l6", 512, 6, 8192, 4, 256)]


def config(hidden: int, layers: int, vocab: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64,
                       num_key_value_heads=max(1, hidden // 128), max_position_embeddings=4096,
                       tie_word_embeddings=False)


def predicted(cfg: LlamaConfig, batch: int, seq: int) -> float:
    from megacompile.hardware import measure_cpu
    from megacompile.plan import plan_model
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        cfg.to_json_file(path)
        plan = plan_model(str(path), hardware=measure_cpu(torch.float32), seq=seq, batch=batch,
                          dtype=torch.float32, options={"device": "cpu", "logits": "drop"})
    est = next(b for b in plan.batches if b.batch == batch)
    return est.step_seconds


def measured(cfg: LlamaConfig, batch: int, seq: int, steps: int) -> tuple[float, float]:
    """(median, fastest) step seconds."""
    megacompile.reset()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).train()
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "logits": "drop"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, cfg.vocab_size, (batch, seq))
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        cmodel(input_ids=data, labels=data, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def run(steps: int = 6) -> list[dict]:
    rows = []
    for name, hidden, layers, vocab, batch, seq in SIZES:
        cfg = config(hidden, layers, vocab)
        real, fastest = measured(cfg, batch, seq, steps)
        pred = predicted(cfg, batch, seq)
        rows.append({"model": name, "batch": batch, "seq": seq, "measured_s": real, "fastest_s": fastest,
                     "predicted_s": pred, "ratio": pred / real, "ratio_to_fastest": pred / fastest})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from megacompile.hardware import measure_cpu
    print(f"cpu profile: {json.dumps(measure_cpu(torch.float32).to_dict())}", file=sys.stderr)
    rows = run(args.steps)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'model':<16} {'batch x seq':>12} {'median':>10} {'fastest':>10} {'predicted':>10} {'pred/med':>9} "
          f"{'pred/min':>9}")
    for r in rows:
        print(f"{r['model']:<16} {r['batch']:>5} x {r['seq']:<5} {r['measured_s'] * 1e3:>8.1f}ms "
              f"{r['fastest_s'] * 1e3:>8.1f}ms {r['predicted_s'] * 1e3:>8.1f}ms {r['ratio']:>9.2f} "
              f"{r['ratio_to_fastest']:>9.2f}")


if __name__ == "__main__":
    main()
