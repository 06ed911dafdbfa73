"""megatrain side by side with what a user would pick instead, on one GPU (issue 36's table).

One model (random weights, a real model's shapes: Llama-3-8B cut to --layers), the same tokens
per step (--tokens as batch x --seq) and the same optimizer maths (AdamW on fp32 masters, bf16
compute, per-layer activation checkpointing, no clipping) for each row:
  limit                    weights, gradients and AdamW on the GPU (overlap.py's limit): the step
                           when nothing moves; fewer layers where the GPU cannot hold them (said so)
  megatrain                torch.compile(backend="megatrain") as overlap.py's "megatrain" row
                           (host arenas, gradient copies overlapped, fused LM head + loss, HostAdamW
                           after the backward); megatrain+bwd: HostAdamW(overlap="backward")
  fsdp2-offload            torch FSDP2 fully_shard per decoder layer and on the root with
                           CPUOffloadPolicy, MixedPrecisionPolicy(bf16, fp32 reduce), torch AdamW
  deepspeed-zero3-offload  DeepSpeed ZeRO-3, offload_param and offload_optimizer to pinned cpu,
                           bf16, DeepSpeedCPUAdam (probed first: import + cpu_adam build, --probe-timeout)
Each row runs in its own process with a hard timeout (SIGUSR1 first: its stacks are printed), so
a hang or an out-of-memory in one row keeps the others; a row cut short reports the steps it ran.
Printed per row: median step, tokens/s, TFLOP/s and MFU, counted for every row with one formula
(long_context.py's: 6 x parameters x tokens + causal attention), the ratio to the limit, the
GPU and host peaks, and the bytes per parameter per step on each link (measured for megatrain,
the runtime's counters; "theory" where only the design can say) and of the host optimizer pass,
against the minimum: 4 B/param H2D (bf16 weights for the forward and again for recompute +
backward), 2 B/param D2H (bf16 gradients once).

    python benchmarks/peers.py                                   # 16 layers, 32K tokens as 8 x 4096
    python benchmarks/peers.py --seq 32768                       # one 32K sequence
    python benchmarks/peers.py --tokens 65536 --rows megatrain,limit --budget 200
    python benchmarks/peers.py --dry-run                         # every row at toy size on the CPU
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROW_NAMES = ("limit", "megatrain", "megatrain+bwd", "fsdp2-offload", "deepspeed-zero3-offload")
LABELS = {"limit": "limit (GPU-resident)", "megatrain+bwd": "megatrain +overlap bwd"}
PEERS = ("fsdp2-offload", "deepspeed-zero3-offload")
# dense bf16 peaks from the vendor's sheets (TFLOP/s); other GPUs: the hardware profile's rate
SPEC_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4), ("GH200", 989.4))
PROBE = """
import sys, time
sys.path.append(sys.argv[1]) if sys.argv[1] else None
t = time.time()
import deepspeed
from deepspeed.ops.op_builder import CPUAdamBuilder
CPUAdamBuilder().load()
print(f"deepspeed {deepspeed.__version__}, cpu_adam loaded in {time.time() - t:.1f} s")
"""


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3-8b", help="a shape of benchmarks/overlap.py's SHAPES")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per step (batch = tokens / seq)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default=",".join(ROW_NAMES), help="comma-separated, run in this order")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="steps not timed (at least 1)")
    ap.add_argument("--timeout", type=float, default=180, help="seconds per row (build, warm-up and steps)")
    ap.add_argument("--timeouts", default="", help="per-row timeouts, e.g. limit=60,deepspeed-zero3-offload=90")
    ap.add_argument("--budget", type=float, default=0, help="seconds for all rows together (0: no limit)")
    ap.add_argument("--lowering", default="eager", choices=["auto", "eager", "inductor"])
    ap.add_argument("--attention", default="segments", choices=["segments", "transformers"])
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--loss-chunk", type=int, default=4096, help="tokens per LM head + loss chunk (limit and peers)")
    ap.add_argument("--limit-layers", type=int, default=0, help="layers of the limit (0: as many as fit)")
    ap.add_argument("--peak-tflops", type=float, default=0, help="for MFU (0: the GPU's dense bf16 spec)")
    ap.add_argument("--deepspeed-site", default="", help="a folder deepspeed is installed in (appended to sys.path)")
    ap.add_argument("--probe-timeout", type=float, default=20, help="seconds for deepspeed's import + cpu_adam build")
    ap.add_argument("--dry-run", action="store_true", help="every row at toy size on the CPU")
    ap.add_argument("--row", default="", help=argparse.SUPPRESS)      # (a child: run this row)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)   # (a child: its JSON result file)
    args = ap.parse_args()
    if args.dry_run:   # (tokens and sequence 128 times smaller: the same batch x seq split)
        args.device, args.model, args.layers = "cpu", "tiny", 2
        args.tokens, args.seq = max(16, args.tokens // 128), max(16, args.seq // 128)
        args.steps, args.loss_chunk, args.timeout = 1, 64, min(args.timeout, 120)
    args.warmup = max(1, args.warmup)
    return args


def peak_tflops(args, device_name: str) -> tuple[float | None, str]:
    if args.peak_tflops:
        return args.peak_tflops, "--peak-tflops"
    if device_name == "cpu":
        return None, ""
    for key, value in SPEC_TFLOPS:
        if key in device_name.split("NVIDIA ")[-1]:
            return value, f"{key} dense bf16 spec"
    from megacompile.hardware import profile_for_gpu_name
    hw = profile_for_gpu_name(device_name)
    return (hw.compute_tflops, f"hardware profile {hw.name}") if hw else (None, "")


def probe_deepspeed(args) -> tuple[bool, str]:
    """Whether deepspeed imports and its CPU Adam builds (or loads from the cache) in time."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE, args.deepspeed_site], capture_output=True, text=True,
                              timeout=args.probe_timeout)
    except subprocess.TimeoutExpired:
        return False, f"deepspeed import + cpu_adam build took over {args.probe_timeout:.0f} s (probe)"
    if done.returncode:
        lines = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()]
        return False, "probe failed: " + (lines[-1].strip() if lines else f"rc {done.returncode}")[:200]
    return True, done.stdout.strip().splitlines()[-1]


class Stop(Exception):
    """A signal to this process (the session's own timeout: SIGUSR1, then SIGTERM): the row
    running is ended and the table of the rows so far printed."""


def _stop(signum, frame):
    raise Stop(signal.Signals(signum).name)


def _end(child: subprocess.Popen) -> None:
    """SIGUSR1 (the child's faulthandler prints every thread's stack), then its whole group killed."""
    try:
        os.kill(child.pid, signal.SIGUSR1)
        child.wait(timeout=5)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def run_child(args, name: str, timeout: float, extra: list[str]) -> dict:
    """Row `name` in its own process group, killed after `timeout` s: its result file, plus
    why it stopped when it did not finish."""
    fd, path = tempfile.mkstemp(prefix=f"peers_{name}_", suffix=".json")
    os.close(fd)
    os.unlink(path)
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], *extra, "--row", name, "--result", path]
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, start_new_session=True)
    status, stopped = "", False
    try:
        rc = child.wait(timeout=timeout)
        if rc:
            status = f"exit {rc}" if rc > 0 else f"killed by signal {-rc}" + (" (host OOM?)" if rc == -9 else "")
    except subprocess.TimeoutExpired:
        status = f"timed out after {timeout:.0f} s"
        _end(child)
    except Stop as e:
        status, stopped = f"stopped by {e} (the session's timeout)", True
        _end(child)
    result = {"row": name}
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
        os.unlink(path)
    result["wall_s"], result["stopped"] = time.perf_counter() - t0, stopped
    if status:
        result["status"] = status + (f": {result['error']}" if result.get("error") else "")
    return result


def summarize(args, r: dict, attn_width: int) -> dict:
    """Median step, tokens/s, TFLOP/s and MFU of a row's result (the same formula for every row)."""
    from long_context import step_flops
    steps = [t["step"] for t in r.get("times", [])]
    if not steps and r.get("first"):
        steps, r["note"] = [r["first"]], ((r.get("note") or "") + " first step only").strip()
    if not steps:
        return r
    r["step"] = statistics.median(steps)
    r["opt"] = statistics.median([t["optimizer"] for t in r["times"]]) if r.get("times") else None
    batch = args.tokens // args.seq
    flops = step_flops(r["params"], r["layers"], attn_width, args.seq, batch)
    r["tflops"] = flops / r["step"] / 1e12
    peak, _ = peak_tflops(args, r.get("device_name", "cpu"))
    r["mfu"] = r["tflops"] / peak if peak else None
    return r


def per_param(value, params: int) -> str:
    if value is None:
        return "n/a"
    return value if isinstance(value, str) else f"{value / params:.2f}"


def label(name: str, args) -> str:
    text = LABELS.get(name, name)
    return text if args.device == "cuda" or name != "fsdp2-offload" else "fsdp2 (gloo, no offload: CPU)"


def print_row(args, name: str, r: dict, limit: dict | None) -> None:
    if "step" not in r:
        print(f"{label(name, args):<30} not run: {r.get('status') or r.get('error') or 'no step finished'}",
              flush=True)
        return
    mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
    vs = f"{r['tflops'] / limit['tflops']:.2f}x" if limit and "tflops" in limit else "-"
    opt = f"{r['opt']:.3f}" if r.get("opt") is not None else "-"
    gpu = f"{r['gpu_peak_gib']:.1f}" if r.get("gpu_peak_gib") is not None else "-"
    print(f"{label(name, args):<30} {r['step']:>8.3f} {opt:>7} {args.tokens / r['step']:>9.0f} {r['tflops']:>8.3g} "
          f"{mfu:>6} {vs:>8} {gpu:>7} {r.get('host_peak_gib', 0):>7.1f} {per_param(r.get('h2d'), r['params']):>15} "
          f"{per_param(r.get('d2h'), r['params']):>15} {r.get('host_opt', 'n/a'):>12}  "
          + "; ".join(x for x in (r.get("note"), r.get("status")) if x), flush=True)


HEADER = (f"{'row':<30} {'step s':>8} {'opt s':>7} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'vs limit':>8} "
          f"{'GPU GiB':>7} {'host GiB':>7} {'H2D B/param':>15} {'D2H B/param':>15} {'host opt B/p':>12}  note")


def main() -> None:
    args = parse()
    if args.row:
        from peer_rows import run_row
        import faulthandler
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        run_row(args, args.row, args.result)
        return
    from overlap import SHAPES
    shape = SHAPES[args.model]
    heads = shape["num_attention_heads"]
    attn_width = heads * shape.get("head_dim", shape["hidden_size"] // heads)
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROW_NAMES]
    if unknown or args.tokens % args.seq:
        sys.exit(f"peers.py: unknown rows {unknown} (known: {', '.join(ROW_NAMES)})" if unknown else
                 f"peers.py: --tokens {args.tokens} is not a multiple of --seq {args.seq}")
    timeouts = {k.strip(): float(v) for k, v in (kv.split("=") for kv in args.timeouts.split(",") if "=" in kv)}
    print(f"{args.model} shapes, {args.layers} layers: {args.tokens} tokens/step = {args.tokens // args.seq} x "
          f"{args.seq}, device {args.device}, {args.steps} timed steps after {args.warmup}"
          + (" (dry run: toy size on the CPU)" if args.dry_run else ""), flush=True)
    start, results, extra = time.perf_counter(), {}, []
    signal.signal(signal.SIGUSR1, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        for name in names:
            timeout = timeouts.get(name, args.timeout)
            if args.budget:
                timeout = min(timeout, args.budget - (time.perf_counter() - start))
            if timeout < 10:
                results[name] = {"row": name, "status": "skipped: no time left in --budget"}
                print(f"{label(name, args)}: skipped, no time left in --budget", flush=True)
                continue
            if name.startswith("deepspeed"):
                t = time.perf_counter()
                ok, why = probe_deepspeed(args)
                print(f"deepspeed probe: {why}", flush=True)
                timeout -= time.perf_counter() - t
                if not ok:
                    results[name] = {"row": name, "status": why}
                    continue
            print(f"--- {name} (timeout {timeout:.0f} s) at {time.strftime('%H:%M:%S')}", flush=True)
            t = time.perf_counter()
            r = results[name] = summarize(args, run_child(args, name, timeout, extra), attn_width)
            if (name.startswith("megatrain") and args.attention == "segments" and "step" not in r
                    and not r.get("status", "").startswith("timed out") and not r.get("stopped")):
                # (segment attention's CUDA kernels are new: if they fail, the model's own attention)
                print(f"attention fallback: {name} failed with segment attention ({r.get('status')}); "
                      "transformers attention from here on", flush=True)
                args.attention, extra = "transformers", ["--attention", "transformers"]
                left = timeout - (time.perf_counter() - t)
                if left >= 10:
                    r = results[name] = summarize(args, run_child(args, name, left, extra), attn_width)
            print(f"--- {name}: {r.get('status') or 'done'} in {r['wall_s']:.0f} s, at {time.strftime('%H:%M:%S')}",
                  flush=True)
            if r.get("stopped"):
                break
    except Stop as e:   # (between rows: in the probe or the bookkeeping)
        print(f"stopped by {e} (the session's timeout)", flush=True)
    for name in names:
        results.setdefault(name, {"row": name, "status": "not reached (the session's timeout)"})
    limit = results.get("limit") if "tflops" in results.get("limit", {}) else None
    device = next((r["device_name"] for r in results.values() if r.get("device_name")), args.device)
    peak, source = peak_tflops(args, device)
    print(f"\n{args.model} shapes, {args.layers} layers, {args.tokens} tokens/step = {args.tokens // args.seq} x "
          f"{args.seq}; device {device}" + (f"; MFU against {peak:.0f} TFLOP/s ({source})" if peak else ""))
    print(HEADER)
    for name in names:
        print_row(args, name, results[name], limit)
    print("TFLOP/s: 6 x parameters x tokens + causal attention (recompute not counted), the same for every row. "
          "Minimum per step: H2D 4 B/param (bf16 weights for the forward and for recompute + backward), "
          "D2H 2 B/param (bf16 gradients once); 'theory': counted from the design, not measured; host opt: "
          "the optimizer pass's memory traffic.")
    mega = [results[n] for n in ("megatrain", "megatrain+bwd") if "tflops" in results.get(n, {})]
    peers = [(n, results[n]) for n in PEERS if "tflops" in results.get(n, {})]
    if mega and peers:
        best_name, best = max(peers, key=lambda p: p[1]["tflops"])
        top = max(r["tflops"] for r in mega)
        print(f"megatrain vs the better offload peer ({best_name}): {top / best['tflops']:.2f}x")
    elif mega:
        print("megatrain vs the better offload peer: no peer row finished")


if __name__ == "__main__":
    main()
