"""The `megatrain` command line."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .errors import MegatrainError


def _inspect(args) -> int:
    from .hardware import load_hardware
    from .inspect import inspect_model, to_chrome_trace, to_json, to_svg, to_text
    report = inspect_model(args.model, layers=args.layers, batch=args.batch, seq=args.seq, slots=args.slots,
                           hardware=load_hardware(args.gpu), dtype=getattr(torch, args.dtype))
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
    i.add_argument("--gpu", default="h200", help="hardware profile for time estimates: a built-in name or a JSON file")
    i.add_argument("--show", default="schedule", choices=["graphs", "passes", "schedule", "memory"])
    i.add_argument("--format", default="text", choices=["text", "json", "chrome-trace", "svg"])
    i.add_argument("-o", "--output", help="write to this file instead of standard output")
    i.set_defaults(func=_inspect)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MegatrainError as e:
        print(f"megatrain: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
