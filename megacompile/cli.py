"""The `megatrain` command line."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .errors import ConfigError, MegatrainError


def _inspect(args) -> int:
    from .hardware import load_hardware
    from .inspect import inspect_model, to_chrome_trace, to_json, to_svg, to_text
    report = inspect_model(args.model, layers=args.layers, batch=args.batch, seq=args.seq, slots=args.slots,
                           hardware=load_hardware(args.gpu), dtype=getattr(torch, args.dtype),
                           options={"recompute": args.recompute, "logits": args.logits},
                           overlap_optimizer=None if args.overlap_optimizer == "false" else args.overlap_optimizer)
    if args.format == "json":
        text = to_json(report)
    elif args.format == "chrome-trace":
        text = to_chrome_trace(report)
    elif args.format == "svg":
        text = to_svg(report)
    else:
        text = to_text(report, args.show)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output} ({report['inspect_seconds']:.1f} s)", file=sys.stderr)
    else:
        print(text)
    return 0


def _plan(args) -> int:
    import json as _json

    from .hardware import load_hardware
    from .options import parse_bytes
    from .plan import plan_model, to_text
    dtype = getattr(torch, args.dtype)
    hardware = load_hardware(args.gpu, dtype)
    if args.host_ram is None and hardware.name != "cpu":
        raise ConfigError(f"--host-ram is required with --gpu {args.gpu}: the host RAM of the machine you "
                          "will train on, e.g. --host-ram 1.5T (it defaults to this machine's RAM only with --gpu cpu).")
    host_ram = parse_bytes(args.host_ram) if args.host_ram is not None else None
    model, seq, slots, recompute, vision = args.model, args.seq, args.slots, args.recompute, args.vision
    logits = args.logits
    if model.endswith((".yaml", ".yml")):   # a `megatrain train` config: its model, cutoff_len, slots
        from .train.config import load_config
        cfg = load_config(model)
        model = cfg.model_name_or_path
        seq = seq or cfg.cutoff_len
        slots = cfg.megatrain.get("slots", slots)
        recompute = cfg.megatrain.get("recompute", recompute)
        logits = cfg.megatrain.get("logits", logits)
        vision = cfg.vision
    plan = plan_model(model, hardware=hardware, host_ram=host_ram, seq=seq or 4096, batch=args.batch,
                      slots=slots, dtype=dtype, options={"recompute": recompute, "logits": logits}, vision=vision)
    text = _json.dumps(plan.to_dict(), indent=2) if args.format == "json" else to_text(plan)
    print(text)
    if not plan.fits:
        print("megatrain: error: " + " ".join(plan.problems), file=sys.stderr)
        return 3
    return 0


def _train(args) -> int:
    from .train.config import load_config
    from .train.trainer import train
    # overrides and --no-progress may come in any order after the config file
    no_progress = args.no_progress or "--no-progress" in args.overrides
    overrides = [o for o in args.overrides if o != "--no-progress"]
    train(load_config(args.config, overrides), progress=not no_progress)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatrain", description="Train LLMs larger than accelerator memory.")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="dump graphs, pass records, the schedule and the memory plan of a model",
                       description="Build MODEL on the meta device (no weights allocated), run the real capture "
                                   "and passes, and print what megatrain would do.")
    i.add_argument("model", help="a preset name (e.g. llama-3-70b), a config.json path or a model directory")
    i.add_argument("--layers", type=int, help="keep only the first N decoder layers")
    i.add_argument("--batch", type=int, default=1)
    i.add_argument("--seq", type=int, default=4096)
    i.add_argument("--slots", type=int, default=2)
    i.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    i.add_argument("--recompute", default="layer", choices=["layer", "selective"],
                   help="layer: recompute whole layers; selective: keep matmul/attention outputs")
    i.add_argument("--logits", default="drop", choices=["drop", "keep"],
                   help="drop (default, as megatrain train): LM head and loss fused, no [tokens, vocab] logits; "
                        "keep: the logits are computed and returned (torch.compile's default)")
    i.add_argument("--gpu", default="h200", help="hardware profile for time estimates: a built-in name or a JSON file")
    i.add_argument("--overlap-optimizer", default="false", choices=["false", "forward", "backward"],
                   help="backward: the host optimizer updates each segment as its gradients land, under the "
                        "backward (HostAdamW overlap='backward', megatrain train's default on CUDA); forward: "
                        "the last step's updates run under this forward, each before its segment's prefetch "
                        "(overlap='forward', or a clipped step); false: after the backward")
    i.add_argument("--show", default="schedule", choices=["graphs", "passes", "schedule", "memory"])
    i.add_argument("--format", default="text", choices=["text", "json", "chrome-trace", "svg"])
    i.add_argument("-o", "--output", help="write to this file instead of standard output")
    i.set_defaults(func=_inspect)

    pl = sub.add_parser("plan", help="host RAM, device memory, best batch size and expected speed of a model",
                        description="Say, without allocating the model, whether MODEL trains on a machine: host "
                                    "bytes by part, device bytes, the largest and the best batch size, and the "
                                    "step time simulated on the hardware profile. Exits 3 when it cannot fit.")
    pl.add_argument("model", help="a preset name (e.g. llama-3-70b) or its Hub id, a config.json path, a model "
                                  "directory, or a `megatrain train` YAML config (its model and cutoff_len)")
    pl.add_argument("--gpu", default="h200", help="hardware profile: h200, h100, gh200, a100, cpu (measured "
                                                   "here) or a JSON profile path")
    pl.add_argument("--host-ram", help="host RAM of the training machine, e.g. 1.5T, 512GiB (default with "
                                       "--gpu cpu: this machine's)")
    pl.add_argument("--seq", type=int, help="sequence length (tokens per sample; default 4096, or a train "
                                             "config's cutoff_len)")
    pl.add_argument("--batch", type=int, help="check this batch size (default: report the largest and the best)")
    pl.add_argument("--slots", type=int, default=2, help="decoder-layer weight slots on the device")
    pl.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    pl.add_argument("--recompute", default="layer", choices=["layer", "selective"],
                    help="layer: recompute whole layers (least memory); selective: keep matmul/attention outputs")
    pl.add_argument("--logits", default="drop", choices=["drop", "keep"],
                    help="drop (default, as megatrain train): LM head and loss fused, no [tokens, vocab] logits; "
                        "keep: the logits are computed and returned (torch.compile's default)")
    pl.add_argument("--vision", default="frozen", choices=["frozen", "train"],
                    help="a vision-language model's vision tower: frozen (default) or trained (on the device)")
    pl.add_argument("--format", default="text", choices=["text", "json"])
    pl.set_defaults(func=_plan)

    t = sub.add_parser("train", help="train a model from a YAML config (LLaMA-Factory key names)",
                       description="Fine-tune (stage: sft) or pre-train (stage: pt) a model: data from a "
                                   "dataset_info.json registry, checkpoints in output_dir, an HF model at the end.")
    t.add_argument("config", help="YAML config file (see examples/)")
    t.add_argument("overrides", nargs=argparse.REMAINDER,
                   help="key=value overrides, e.g. learning_rate=1e-4 max_steps=20")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (logs still go to output_dir)")
    t.set_defaults(func=_train)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as e:
        inner = getattr(e, "inner_exception", None)   # Dynamo wraps backend errors
        error = e if isinstance(e, MegatrainError) else inner if isinstance(inner, MegatrainError) else None
        if error is None:
            raise
        print(f"megatrain: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
