"""The state tier (fp32 masters and AdamW moments on NVMe) on this machine, against the disk's
own bandwidth and against the all-in-RAM run.

1. The limit: the file bandwidth of the disk under --dir, measured with the tier's own engine
   (runtime/tier_io.measure_ssd: O_DIRECT, 1 MiB requests, 8 in flight; median of 3).
2. One Llama-shaped bf16 model (default ~110M parameters: 1.3 GB of masters and moments, read and
   written once per step) trained with HostAdamW, all in RAM and with the tier (placement "all",
   files under --dir): the median step time of each after warm-up steps, their ratio, and the
   tier's achieved read and write bandwidth (bytes / seconds with a request in flight, from the
   engine's counters) against the limit. The two runs' masters and moments are compared bit for
   bit at the end (the script fails if they differ).
3. The planned fit and speed for 70B / 120B / 175B with 256 GB to 1.5 TB of RAM and 1 or 4 Gen5
   drives (`megatrain plan`'s placement and closed form; no model is allocated).

    python benchmarks/nvme_tier.py [--dir /mnt/nvme] [--hidden 1024 --layers 6 --steps 5]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import megacompile
from megacompile.runtime.adamw import HostAdamW
from megacompile.runtime.state_tier import StateTier
from megacompile.runtime.store import master_weight
from megacompile.runtime.tier_io import measure_ssd


def _model(hidden: int, layers: int, vocab: int, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 256),
                         vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16).train()


def _train(args, directory: Path | None):
    """(step seconds, tier counters or None, masters, moments) of `args.steps` timed steps."""
    megacompile.reset()
    model = _model(args.hidden, args.layers, args.vocab)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    tier = (StateTier(list(model.named_parameters()), [directory], "all", min_numel=args.min_numel)
            if directory is not None else None)
    opt = HostAdamW(model.parameters(), lr=1e-4, overlap="forward", tier=tier)
    g = torch.Generator().manual_seed(1)
    times = []
    try:
        for step in range(args.warmup + args.steps):
            if step == args.warmup and tier is not None:
                tier._engine.reset_counters()
            ids = torch.randint(0, args.vocab, (1, args.seq), generator=g)
            t0 = time.perf_counter()
            loss = cmodel(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        opt.synchronize()
        counters = tier.io_counters() if tier is not None else None
        masters = [master_weight(p).clone() for p in model.parameters()]
        moments = opt.state_dict()["state"]
    finally:
        if tier is not None:
            tier.close()
    return statistics.median(times[args.warmup:]), counters, masters, moments


def measured(args) -> None:
    """Parts 1 and 2 of the module docstring."""
    if args.dir is None:
        with tempfile.TemporaryDirectory(prefix="megatrain-nvme-") as tmp:
            return _measured(args, Path(tmp))
    return _measured(args, Path(args.dir))


def _measured(args, root: Path) -> None:
    reads, writes = [], []

    def probe() -> None:   # (a virtual disk drifts: probed before and after the runs)
        for _ in range(3):
            r, w = measure_ssd([root], bytes_per_path=int(args.probe_mib) << 20, repeat=1)
            reads.append(r)
            writes.append(w)
    probe()
    ram_s, _, want_masters, want_moments = _train(args, None)
    tier_s, c, masters, moments = _train(args, root)
    probe()
    limit_r, limit_w = statistics.median(reads), statistics.median(writes)
    print(f"disk under {root}: read {limit_r:.2f} GB/s, write {limit_w:.2f} GB/s (O_DIRECT, 1 MiB requests, 8 in "
          f"flight; median of 6 probes, 3 before and 3 after the runs; read {min(reads):.2f}-{max(reads):.2f}, write "
          f"{min(writes):.2f}-{max(writes):.2f})")
    params = sum(m.numel() for m in masters)
    same = all(torch.equal(a, b) for a, b in zip(masters, want_masters)) and all(
        torch.equal(moments[i][k], want_moments[i][k]) for i in want_moments for k in ("exp_avg", "exp_avg_sq"))
    read_gbps = c["bytes_read"] / c["read_busy_s"] / 1e9 if c["read_busy_s"] else 0.0
    write_gbps = c["bytes_written"] / c["write_busy_s"] / 1e9 if c["write_busy_s"] else 0.0
    steps = args.steps
    print(f"model: {params / 1e6:.0f}M parameters, {args.layers} layers, hidden {args.hidden}; batch 1 x {args.seq}")
    print("| | step (s, median) | vs all in RAM | tier read GB/s | of the disk's | tier write GB/s | of the disk's |")
    print("|---|---|---|---|---|---|---|")
    print(f"| all in RAM | {ram_s:.3f} | 1.00x | | | | |")
    print(f"| tier (all: masters + moments) | {tier_s:.3f} | {tier_s / ram_s:.2f}x | {read_gbps:.2f} | "
          f"{read_gbps / limit_r:.0%} | {write_gbps:.2f} | {write_gbps / limit_w:.0%} |")
    moved = c["bytes_read"] + c["bytes_written"]
    mixed_limit = moved / (c["bytes_read"] / (limit_r * 1e9) + c["bytes_written"] / (limit_w * 1e9)) / 1e9
    achieved = moved / c["busy_s"] / 1e9 if c["busy_s"] else 0.0
    print(f"tier traffic, reads and writes together: {achieved:.2f} GB/s while busy, {achieved / mixed_limit:.0%} of "
          f"the disk's {mixed_limit:.2f} GB/s for that mix (its read and write rates, weighted by the bytes); "
          f"the drive was busy {c['busy_s'] / steps:.2f} s per step")
    print(f"per step: {c['bytes_read'] / steps / 1e9:.2f} GB read, {c['bytes_written'] / steps / 1e9:.2f} GB written; "
          f"read ahead {c['read_ahead_hits']} tiles, stalled on {c['stalls']}")
    print(f"bit-identical masters and moments: {same}")
    if not same:
        raise SystemExit("the tier's run differs from the all-in-RAM run")


PLAN_MODELS = ("llama-3-70b", "gpt-oss-120b", "dense-175b")
PLAN_RAM = (("256 GB", 256e9), ("512 GB", 512e9), ("1 TB", 1e12), ("1 TiB", 2.0**40), ("1.5 TB", 1.5e12))
PLAN_DRIVES = ("gen5x1", "gen5x4")


def planned(args) -> None:
    """Fit and speed by host RAM and drives. One capture per model gives a micro-batch's forward
    and backward seconds at each batch (they do not depend on the RAM); the placement and the RAM
    it needs come from plan.host_bytes, the SSD time from tier_plan.ssd_seconds (the same
    functions `megatrain plan --nvme` uses)."""
    from megacompile.hardware import load_hardware
    from megacompile.ssd import load_ssd
    from megacompile.inspect import build_meta_model
    from megacompile.plan import host_bytes, plan_model, tier_placement
    from megacompile.tier_plan import TIER_READ_AHEAD, ssd_seconds
    hw = load_hardware(args.gpu)
    print(f"\nplanned on {args.gpu}, seq {args.plan_seq} x accum {args.accum} per step (tokens/s at the best batch; "
          "the SSD time the compute does not hide in brackets)")
    print("| model | host RAM | placement | RAM needed | disk (2 slots) | " + " | ".join(PLAN_DRIVES) + " |")
    print("|---|---|---|---|---|" + "---|" * len(PLAN_DRIVES))
    for name in args.plan_models:
        plan = plan_model(name, hardware=hw, host_ram=2**42, seq=args.plan_seq, ssd=load_ssd("gen5x4"),
                          placement="all", accum=args.accum, max_batch=args.max_batch)
        meta, _ = build_meta_model(name, None, torch.bfloat16)
        for label, ram in PLAN_RAM:
            cells = []
            for drives in PLAN_DRIVES:
                ssd = load_ssd(drives)
                placement = tier_placement(meta, "cuda", int(ram), ssd)
                need = host_bytes(meta, "cuda", placement)
                if need.total > ram:
                    cells.append("does not fit")
                    continue
                tiered = need.ssd_masters + need.ssd_optimizer_state
                best = None
                for b in plan.batches:
                    if b.device_peak_bytes > plan.device_capacity:
                        continue
                    _, exposed = ssd_seconds(tiered, ssd.read_gbps, ssd.write_gbps, TIER_READ_AHEAD,
                                             b.forward_seconds, b.backward_seconds, args.accum)
                    step = args.accum * (b.forward_seconds + b.backward_seconds) + b.optimizer_seconds + exposed
                    rate = b.batch * args.accum * args.plan_seq / step
                    if best is None or rate > best[0]:
                        best = (rate, exposed, step)
                cells.append(f"{best[0]:,.0f} ({best[1]:.1f} s of {best[2]:.0f} s)" if best else "device: no fit")
            print(f"| {name} | {label} | {placement} | {need.total / 2**30:,.0f} GiB | "
                  f"{need.ssd_total / 2**40:.2f} TiB | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a new one in /tmp)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--probe-mib", type=int, default=512, help="MiB written and read per bandwidth probe")
    ap.add_argument("--min-numel", type=int, default=None, help="smallest tiered parameter (default: the tier's)")
    ap.add_argument("--gpu", default="h200", help="hardware profile of the planned table")
    ap.add_argument("--plan-seq", type=int, default=4096)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--plan-models", nargs="*", default=list(PLAN_MODELS))
    ap.add_argument("--skip-measured", action="store_true", help="only the planned table")
    args = ap.parse_args()
    if not args.skip_measured:
        measured(args)
    if args.plan_models:
        planned(args)


if __name__ == "__main__":
    main()
