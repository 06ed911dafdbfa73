"""The `megatrain` command line."""
from __future__ import annotations

import argparse
import errno
import os
import re
import sys
from pathlib import Path

import torch

from . import interrupts
from .errors import ConfigError, InternalError, megatrain_error_in
from .log import console, quiet
from .units import GivenBytes, parse_bytes  # noqa: F401 (API: megacompile.cli.GivenBytes)

from .interrupts import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated  # noqa: F401 (API)

#: exit codes (docs/errors.md); a MegatrainError's own is its `exit_code` (errors.py)
EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_CANNOT_FIT, EXIT_TRAINING_FAILED = 0, 1, 2, 3, 4


class UsageError(ConfigError):
    """A command-line argument argparse refused (unknown flag, missing or malformed value)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors end as one `megatrain: error: ...` line (exit 2) instead of usage + exit."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")

    def unknown(self, extras: list[str]):
        """Refuse unrecognized arguments, suggesting the closest option of this (sub)command."""
        import difflib
        options = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        hints = []
        for arg in extras:
            if arg.startswith("-"):
                close = difflib.get_close_matches(arg.split("=")[0], options, n=1, cutoff=0.6)
                if close:
                    hints.append(f"{arg}: did you mean {close[0]}?")
        self.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else ""))


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive integer (1 or more)")
    if value > _MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{text!r} is too large (at most {_MAX_SIZE})")
    return value


_MAX_SIZE = 2**31 - 1   # batch x seq must stay a valid tensor size


def byte_size(text: str) -> int:
    """argparse type: a byte size with a unit (e.g. 1.5T, 512GiB, 768G)."""
    try:
        value = parse_bytes(text)
    except (ConfigError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if text.strip().isdigit() and value < 2**30:   # "--host-ram 512": bytes, surely meant GB
        raise argparse.ArgumentTypeError(f"{text!r} is {value} bytes; give a unit, e.g. {text.strip()}G or "
                                         f"{text.strip()}GiB")
    return GivenBytes(value, text)


_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}


def dtype_name(text: str) -> str:
    """argparse type: a dtype name (bf16, fp16 and fp32 are accepted for bfloat16, float16, float32)."""
    return _DTYPES.get(text.lower(), text)


def _check_output(path: str) -> Path:
    """Refuse, before any work, an output path that cannot be written (without creating it)."""
    out = Path(path).expanduser()
    if str(path).endswith(("/", os.sep)) or out.is_dir():
        raise ConfigError(f"-o {path}: is a directory; give a file name, e.g. -o {out / 'inspect.json'}")
    folder = out.parent
    if not folder.exists():
        raise ConfigError(f"-o {path}: the folder {folder} does not exist; create it first (mkdir -p {folder}) "
                          "or write elsewhere.")
    if not folder.is_dir():
        raise ConfigError(f"-o {path}: {folder} is a file, not a folder.")
    if out.exists() and not os.access(out, os.W_OK):
        raise ConfigError(f"-o {path}: the file is not writable (permission denied).")
    if not out.exists() and not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"-o {path}: cannot create a file in {folder} (permission denied).")
    return out


def _inspect(args) -> int:
    from .hardware import load_hardware
    from .ssd import load_ssd
    from .inspect import inspect_model, to_chrome_trace, to_json, to_svg, to_text
    if args.output:
        _check_output(args.output)
    report = inspect_model(args.model, layers=args.layers, batch=args.batch, seq=args.seq, slots=args.slots,
                           hardware=load_hardware(args.gpu), dtype=getattr(torch, args.dtype),
                           options={"recompute": args.recompute, "logits": args.logits,
                                    "offload_checkpoints": args.offload_checkpoints, "mlp_tiles": args.mlp_tiles,
                                    "reload_checkpoints": args.reload_checkpoints, "plan_ranks": args.gpus},
                           overlap_optimizer=None if args.overlap_optimizer == "false" else args.overlap_optimizer,
                           ssd=load_ssd(args.nvme) if args.nvme else None, placement=args.nvme_placement)
    if args.format == "json":
        text = to_json(report)
    elif args.format == "chrome-trace":
        text = to_chrome_trace(report)
    elif args.format == "svg":
        text = to_svg(report)
    else:
        text = to_text(report, args.show)
    if args.output:
        Path(args.output).expanduser().write_text(text)
        print(f"wrote {args.output} ({report['inspect_seconds']:.1f} s)", file=sys.stderr)
    else:
        print(text)
    return 0


def _plan(args) -> int:
    import json as _json

    from .hardware import load_hardware
    from .ssd import load_ssd
    from .plan import plan_model, to_text
    dtype = getattr(torch, args.dtype)
    if args.compare and (args.gpu is not None or args.host_ram is not None):
        given = " and ".join(o for o, v in (("--gpu", args.gpu), ("--host-ram", args.host_ram)) if v is not None)
        raise ConfigError(f"--compare with {given}: --compare plans every built-in GPU with every host RAM size "
                          "itself; leave out " + given + ", or leave out --compare to plan one machine.")
    if args.compare and args.probe_host:
        raise ConfigError("--compare with --probe-host: --compare plans other machines than this one, whose host "
                          "this machine cannot measure; leave out one of the two.")
    args.gpu = args.gpu or "h200"
    hardware = load_hardware(args.gpu, dtype)
    host_measured = ""
    if args.probe_host or hardware.name == "cpu":   # (cpu: load_hardware measured with the same probe)
        from .host_probe import probed_host, with_host
        rates = probed_host()
        hardware, host_measured = with_host(hardware, rates), rates.describe()
    if args.host_ram is None and hardware.name != "cpu" and not args.compare:
        raise ConfigError(f"--host-ram is required with --gpu {args.gpu}: the host RAM of the machine you "
                          "will train on, e.g. --host-ram 1.5T (it defaults to this machine's RAM only with "
                          "--gpu cpu).")
    host_ram = args.host_ram   # (bytes: byte_size)
    model, seq, slots, recompute, vision = args.model, args.seq, args.slots, args.recompute, args.vision
    logits, prepare = args.logits, None
    nvme, placement, accum, nvme_paths = args.nvme, args.nvme_placement, args.accum, None
    if model.endswith((".yaml", ".yml")):   # a `megatrain train` config: its model, cutoff_len, slots, tier
        from .train.config import load_config
        cfg = load_config(model)
        model = cfg.model_name_or_path
        seq = seq or cfg.cutoff_len
        slots = cfg.megatrain.get("slots", slots)
        recompute = cfg.megatrain.get("recompute", recompute)
        logits = cfg.megatrain.get("logits", logits)
        vision = cfg.vision
        accum = accum or cfg.gradient_accumulation_steps
        if nvme is None and cfg.nvme is not None:   # (--nvme plans other drives than the config's)
            nvme, nvme_paths = cfg.nvme, cfg.nvme_paths
            placement = cfg.nvme_placement if placement == "auto" else placement
        from .train.finetuning import apply_finetuning
        prepare = lambda meta: apply_finetuning(meta, cfg)   # noqa: E731 (finetuning_type: freeze counts less)
    if nvme is None and placement in ("moments", "all") and not args.compare:   # (--compare: gen4x4)
        raise ConfigError(f"--nvme-placement {placement} needs --nvme PROFILE (the drives: gen4x4, gen5x4, a JSON "
                          "profile or measure:DIR).")
    ssd = load_ssd(nvme) if nvme is not None else None
    if ssd is not None and nvme_paths and not args.compare:   # the config's directories: their free space is checked
        import dataclasses
        ssd = dataclasses.replace(ssd, paths=tuple(nvme_paths))
    same = dict(seq=seq or 4096, batch=args.batch, slots=slots, dtype=dtype, vision=vision, accum=accum or 1,
                options={"recompute": recompute, "logits": logits})
    if args.compare:   # (plan_compare.py: a row per built-in GPU x host RAM size)
        from .plan_compare import compare_plans, none_fits, rows_json, rows_text
        rows = compare_plans(model, gpus=args.gpus, ssd=ssd, placement=placement, prepare=prepare,
                             progress=_progress_on_terminal(), **same)
        print(_json.dumps(rows_json(rows), indent=2) if args.format == "json" else rows_text(rows))
        if not any(r.fits for r in rows):
            print("megatrain: error: " + none_fits(rows, args.model), file=sys.stderr)
            return 3
        return 0
    plan = plan_model(model, hardware=hardware, host_ram=host_ram, prepare=prepare, ssd=ssd, placement=placement,
                      gpus=args.gpus, progress=_progress_on_terminal(), **same)
    plan.host_measured = host_measured
    text = _json.dumps(plan.to_dict(), indent=2) if args.format == "json" else to_text(plan)
    print(text)
    if not plan.fits:
        print("megatrain: error: " + " ".join(plan.problems), file=sys.stderr)
        return 3
    return 0


def _progress_on_terminal():
    """Where a long command says what it is doing: stderr when a person watches it (a terminal;
    stdout holds the answer), nowhere for a script, whose stderr is the one error line."""
    if not sys.stderr.isatty():
        return None
    return lambda text: print(text, file=sys.stderr, flush=True)


def _train(args) -> int:
    from .train.config import load_config
    from .train.trainer import train
    if "--help" in args.overrides or "-h" in args.overrides:   # `megatrain train cfg.yaml --help`
        args.parser.print_help()
        return EXIT_OK
    # overrides and --no-progress may come in any order after the config file
    no_progress = args.no_progress or "--no-progress" in args.overrides
    overrides = [o for o in args.overrides if o != "--no-progress"]
    config = load_config(args.config, overrides)
    try:
        train(config, progress=not no_progress)
    except KeyboardInterrupt as e:   # (and SIGTERM): what is true of the folder now, for the one line
        e.advice = _after_interrupt(Path(config.output_dir).expanduser())
        raise
    return 0


def _after_interrupt(out: Path) -> str:
    """What to do after a run was interrupted: continue from its last checkpoint, or (none was
    written) run the same command again, which starts over (run_dir.py)."""
    from .train.checkpoint import format as checkpoint
    found = checkpoint.checkpoints(out)
    if found:
        return (f"the last complete checkpoint is {found[-1]}: continue from it with resume_from_checkpoint: "
                "true")
    return "no checkpoint was written: run the same command again to start over"


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = ArgumentParser(prog="megatrain", description="Train LLMs larger than accelerator memory.")
    p.add_argument("--version", action="version", version=f"megatrain {__version__}")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="debug messages too (the megatrain logger at DEBUG: pass op counts, lowering choices)")
    sub = p.add_subparsers(dest="command", metavar="{inspect,plan,train}")
    i = sub.add_parser("inspect", help="dump graphs, pass records, the schedule and the memory plan of a model",
                       description="Build MODEL on the meta device (no weights allocated), run the real capture "
                                   "and passes, and print what megatrain would do.")
    i.add_argument("model", help="a preset name (e.g. llama-3-70b), a config.json path or a model directory")
    i.add_argument("--layers", type=positive_int, help="keep only the first N decoder layers")
    i.add_argument("--batch", type=positive_int, default=1)
    i.add_argument("--seq", type=positive_int, default=4096)
    i.add_argument("--slots", type=positive_int, default=2)
    i.add_argument("--dtype", default="bfloat16", type=dtype_name, choices=["bfloat16", "float16", "float32"])
    i.add_argument("--recompute", default="layer", choices=["layer", "selective"],
                   help="layer: recompute whole layers; selective: keep matmul/attention outputs")
    i.add_argument("--logits", default="drop", choices=["drop", "keep"],
                   help="drop (default, as megatrain train): LM head and loss fused, no [tokens, vocab] logits; "
                        "keep: the logits are computed and returned (torch.compile's default)")
    i.add_argument("--offload-checkpoints", default="never", choices=["never", "always"],
                   help="always: keep the layer checkpoints in host memory between forward and backward "
                        "(the offload/reload ops in the schedule; megatrain train chooses it when the step does not "
                        "fit the device otherwise)")
    i.add_argument("--mlp-tiles", default="auto", type=lambda v: v if v == "auto" else positive_int(v),
                   help="sequence tiles of each layer's MLP, norms, output projection and residuals: auto (none "
                        "below 32K tokens) or N")
    i.add_argument("--reload-checkpoints", default="ahead", choices=["ahead", "late"],
                   help="with --offload-checkpoints always: each checkpoint comes back one segment ahead of its "
                        "layer's backward (overlapped), or late: just before it (one [seq, hidden] value less)")
    i.add_argument("--gpu", default="h200", help="hardware profile for time estimates: a built-in name or a JSON file")
    i.add_argument("--overlap-optimizer", default="false", choices=["false", "forward", "backward"],
                   help="backward: the host optimizer updates each segment as its gradients land, under the "
                        "backward (HostAdamW overlap='backward', megatrain train's default on CUDA); forward: "
                        "the last step's updates run under this forward, each before its segment's prefetch "
                        "(overlap='forward', or a clipped step); false: after the backward")
    i.add_argument("--nvme", default=None, metavar="PROFILE",
                   help="the NVMe state tier's drives (gen4x1/gen4x4/gen5x1/gen5x4, a JSON profile or measure:DIR): "
                        "each update's reads and writes of masters/moments on an `ssd` stream")
    i.add_argument("--nvme-placement", default="all", choices=["moments", "all"],
                   help="what the tier holds: AdamW's moments, or the fp32 masters too (default)")
    i.add_argument("--gpus", type=positive_int, default=1,
                   help="GPUs of one node training data parallel: the schedule with each GPU's sharded fetches, "
                        "all-gathers and reduce-scatters")
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
    pl.add_argument("--gpu", help="hardware profile: h200 (default), h100, gh200, a100, cpu (measured here) or a "
                                   "JSON profile path")
    pl.add_argument("--host-ram", type=byte_size,
                    help="host RAM of the training machine, e.g. 1.5T, 512GiB (default with "
                                       "--gpu cpu: this machine's)")
    pl.add_argument("--seq", type=positive_int, help="sequence length (tokens per sample; default 4096, or a train "
                                             "config's cutoff_len)")
    pl.add_argument("--batch", type=positive_int,
                    help="check this batch size (default: report the largest and the best)")
    pl.add_argument("--slots", type=positive_int, default=2, help="decoder-layer weight slots on the device")
    pl.add_argument("--dtype", default="bfloat16", type=dtype_name, choices=["bfloat16", "float16", "float32"])
    pl.add_argument("--recompute", default="layer", choices=["layer", "selective"],
                    help="layer: recompute whole layers (least memory); selective: keep matmul/attention outputs")
    pl.add_argument("--logits", default="drop", choices=["drop", "keep"],
                    help="drop (default, as megatrain train): LM head and loss fused, no [tokens, vocab] logits; "
                        "keep: the logits are computed and returned (torch.compile's default)")
    pl.add_argument("--vision", default="frozen", choices=["frozen", "train"],
                    help="a vision-language model's vision tower: frozen (default) or trained (on the device)")
    pl.add_argument("--nvme", metavar="PROFILE",
                    help="plan the NVMe state tier (fp32 masters / AdamW moments on disk; default: a train config's "
                         "nvme keys) on these drives: gen4x1, "
                         "gen4x4, gen5x1, gen5x4 (4 drives in RAID0: 27 / 11 GB/s), a JSON profile "
                         "({name, read_gbps, write_gbps, paths, capacity_gib}) or measure:DIR[,DIR...]")
    pl.add_argument("--nvme-placement", default="auto", choices=["auto", "none", "moments", "all"],
                    help="what goes to NVMe: auto (the least that fits the host RAM), none, moments (AdamW state: "
                         "10 B/param left in RAM) or all (fp32 masters too: 6 B/param)")
    pl.add_argument("--accum", type=positive_int,
                    help="gradient accumulation steps: micro-batches per optimizer step (the tier reads and "
                         "writes once per step, so more hides more of its I/O; default 1, or a train config's "
                         "gradient_accumulation_steps)")
    pl.add_argument("--gpus", type=positive_int, default=1,
                    help="GPUs of one node training data parallel (torchrun --nproc-per-node): the host holds one "
                         "copy of the state, each GPU's step adds its collectives")
    pl.add_argument("--compare", action="store_true",
                    help="what to buy: a row per built-in GPU (h200, h100, gh200, a100) x host RAM (256G, 512G, 1T, "
                         "2T), and with the optimizer state on NVMe (gen4x4, or --nvme) where the RAM alone does "
                         "not fit: fits or what is short, tokens/s, time per 1B tokens, the binding resource. "
                         "Not with --gpu or --host-ram; exits 3 when nothing fits")
    pl.add_argument("--probe-host", action="store_true",
                    help="measure this machine's host (memory bandwidth and the AdamW rate on the cores this process "
                         "may use: CPU affinity and cgroup quota; about a second) and plan with those figures "
                         "instead of the profile's: for planning on the machine that will train (--gpu cpu always "
                         "measures). Not with --compare")
    pl.add_argument("--format", default="text", choices=["text", "json"])
    pl.set_defaults(func=_plan)
    # "--host-ram -5G" is a (bad) value, not an option: byte_size then says what is wrong with it
    pl._negative_number_matcher = re.compile(r"^-\d*\.?\d+[A-Za-z]*$")

    from .train.keys_help import keys_help
    t = sub.add_parser("train", help="train a model from a YAML config (LLaMA-Factory key names)",
                       description="Fine-tune (stage: sft) or pre-train (stage: pt) a model: data from a "
                                   "dataset_info.json registry, checkpoints in output_dir, an HF model at the end.",
                       epilog=keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("config", help="YAML config file (see examples/)")
    t.add_argument("overrides", nargs=argparse.REMAINDER,
                   help="key=value overrides, e.g. learning_rate=1e-4 max_steps=20").required = False
    t.add_argument("--no-progress", action="store_true", help="no progress bar (logs still go to output_dir)")
    t.set_defaults(func=_train, parser=t)
    p.subparser = lambda name: sub.choices.get(name, p)
    return p


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in str(message).splitlines() if line.strip())


#: OS errors about the user's files or machine (not megatrain's code): a user error
_USER_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ENOSPC, errno.EROFS,
                getattr(errno, "EDQUOT", -1)}


def main(argv=None) -> int:
    """Run the command line; returns the exit code (docs/errors.md): 0 done, 1 internal error
    (a bug: traceback + one `megatrain: internal error:` line), 2 a user error (one
    `megatrain: error:` line saying what to change), 3 it cannot fit the machine, 4 training
    failed, 130 interrupted, 143 terminated (SIGTERM)."""
    with interrupts.handled():   # (one exception for the first Ctrl-C or SIGTERM, the later ones ignored)
        return _main(argv)


def _main(argv) -> int:
    import traceback
    try:
        parser = build_parser()
        try:
            args, extras = parser.parse_known_args(argv)
        except SystemExit as e:   # --help (prints, exits 0)
            return e.code if isinstance(e.code, int) else EXIT_OK
        if args.command is None:   # `megatrain` alone: the help, as pip and docker do (not an error)
            parser.print_help()
            return EXIT_OK
        if extras:
            parser.subparser(args.command).unknown(extras)
        console(verbose=args.verbose)
        # (plan and inspect answer on standard output: the compile's progress lines only with --verbose)
        with quiet("compile", when=args.command in ("inspect", "plan") and not args.verbose):
            return args.func(args)
    except KeyboardInterrupt as e:
        advice = getattr(e, "advice", "")
        what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        print(f"megatrain: {what}" + (f"; {advice}" if advice else ""), file=sys.stderr)
        return EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED
    except Exception as e:
        error = megatrain_error_in(e)
        if isinstance(error, InternalError):   # (ours, recognised: the facts of a report, no traceback)
            print(f"megatrain: internal error: {_one_line(error)}", file=sys.stderr)
            return EXIT_INTERNAL
        if error is not None:
            print(f"megatrain: error: {_one_line(error)}", file=sys.stderr)
            return getattr(error, "exit_code", EXIT_USAGE)
        if isinstance(e, OSError) and e.errno in _USER_ERRNOS and e.filename is not None:
            print(f"megatrain: error: {e.filename}: {e.strerror}", file=sys.stderr)
            return EXIT_USAGE
        traceback.print_exc()
        print(f"megatrain: internal error: {_one_line(f'{type(e).__name__}: {e}')[:500]} -- this is a bug in "
              "megatrain: please report it with the command line and the traceback above.", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
