"""The benchmark scripts run end to end (tiny sizes, on the CPU; plan_accuracy.py runs in
test_plan.py): a GPU session gets one try at them, so a script broken by a change must fail
here first. Their figures are not checked: timings belong to the benchmarks, not to tests."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_overlap_benchmark_smoke_run():
    out = run("overlap.py", "--device", "cpu", "--model", "tiny", "--seq", "256", "--steps", "1", "--warmup", "1")
    for config in ("limit", "megatrain plain", "megatrain", "megatrain +overlap fwd", "megatrain +overlap bwd"):
        assert any(line.startswith(config + " ") for line in out.splitlines()), (config, out)
    assert "engine speed-up over plain" in out


def test_cpu_adam_benchmark_smoke_run():
    pytest.importorskip("ninja")
    out = run("cpu_adam.py", "--params", "1e5", "--repeat", "1")
    for row in ("megatrain HostAdamW + bf16 copy", "torch AdamW fused + bf16 copy",
                "HostAdamW.step(), a layer's 12 tensors", "memory bandwidth: copy", "landing: land(grad, bf16)",
                "the host's pass per step", "per-tensor steps over a layer vs one flat tensor"):
        assert row in out, (row, out)
    # the last line, exactly
    assert re.fullmatch(r"host adamw: [\d.]+ GB/s, [\d.]+ of the measured memory bandwidth \([\d.]+ GB/s\)",
                        out.strip().splitlines()[-1]), out


def test_step_overhead_benchmark_smoke_run():
    out = run("step_overhead.py", "--layers", "2", "--hidden", "64", "--vocab", "256", "--batch", "1", "--seq", "32",
              "--steps", "1", "--warmup", "1")
    assert "ratio megatrain / eager+ckpt" in out and "distinct layer bodies 1" in out, out


def test_moe_transfer_benchmark_smoke_run():
    out = run("moe_transfer.py", "--tokens", "8", "--steps", "1", "--only", "mixtral")
    assert any(line.startswith("mixtral (8 experts, top-2)") for line in out.splitlines()), out


def test_kernels_benchmark_smoke_run():
    out = run("kernel_speed.py", "--device", "cpu", "--tokens", "16", "--hidden", "32", "--ffn", "64", "--vocab", "64",
              "--repeat", "1", "--warmup", "1")
    for op in ("rmsnorm", "swiglu", "lm head + CE"):
        assert sum(line.startswith(op + " ") for line in out.splitlines()) == 2, (op, out)
    assert "copy bandwidth" in out


def test_long_context_benchmark_smoke_run():
    out = run("long_context.py", "--models", "llama-3-8b", "--gpus", "h200", "--start", "65536", "--limit", "131072",
              "--cpu-seqs", "128", "--steps", "1", "--cpu-layers", "1", "--cpu-hidden", "32")
    assert "longest sequence that fits" in out and "llama-3-8b" in out, out
    rows = [line.split() for line in out.splitlines() if line.startswith("    128 ")]
    assert rows and len(rows[0]) == 7, out   # seq, megatrain s, peak and tiles, eager s and peak, ratio


@pytest.mark.slow   # (37 s; the tier's exactness is tests/test_state_tier.py's, and the GPU session no longer runs it)
def test_nvme_tier_benchmark_smoke_run():
    out = run("nvme_tier.py", "--hidden", "64", "--layers", "1", "--vocab", "512", "--seq", "16", "--steps", "1",
              "--warmup", "1", "--probe-mib", "4", "--min-numel", "1024", "--plan-models")
    assert "bit-identical masters and moments: True" in out and "| tier (all: masters + moments) |" in out


@pytest.mark.slow   # (36 s: two torchrun jobs; data parallelism itself is tests/test_data_parallel.py's)
def test_data_parallel_benchmark_smoke_run():
    out = run("data_parallel.py", "--hidden", "64", "--layers", "1", "--steps", "1", "--warmup", "0", "--cpu-seq", "16",
              "--model", "smollm2-135m", "--seq", "128", "--gpu-batch", "1", "--plan-gpus", "1,2",
              "--plan-hardware", "h200")
    assert "2 rank(s):" in out and "scaling 2 ranks / 1:" in out and " h200  2 " in out, out


def test_peers_benchmark_dry_run():
    """Every row of issue 36's table at toy size on the CPU, each in its own process (about 35 s:
    megatrain+bwd is overlap.py's, tested above); deepspeed, when it is not installed, is a row
    that says why, and the script still succeeds."""
    out = run("peers.py", "--dry-run", "--rows", "limit,megatrain,fsdp2-offload,deepspeed-zero3-offload")
    lines = out.splitlines()
    for row in ("limit (GPU-resident)", "megatrain", "fsdp2 (gloo, no offload: CPU)", "deepspeed-zero3-offload"):
        assert any(line.startswith(row + " ") for line in lines), (row, out)
    mega = next(line for line in lines if line.startswith("megatrain "))
    assert "not run" not in mega and "2.00" in mega, mega   # (bf16 gradients down once: measured)
    assert "megatrain vs the better offload peer" in out, out
