"""The host as the training process sees it: its usable cores, its memory bandwidth and the
host AdamW rate on those cores, measured in about a second.

Why measure: the host pass (AdamW over fp32 masters, 30 bytes/parameter) bounds the step when
the host is slow, and a cloud pod often gives the process a few cgroup cores and a small share of
the socket's bandwidth (one H200 pod measured 6 GB/s where the datasheet says 300+). A profile's
table figure would then promise a speed the run never sees.

    usable_cores()  -> (n, why)   the smaller of the CPU affinity mask and the cgroup CPU quota
                                  (v2 cpu.max, v1 cpu.cfs_quota_us / cfs_period_us, each ancestor)
    probe_host()    -> HostRates  on that many threads:
        copy    c = a, 64 MiB fp32 buffers (counts read + write: 8 B/element)
        triad   c = a + s * b   (12 B/element)
        update  c += s * b      (12 B/element; in place, as AdamW's buffers: no write-allocate
                                 reads the STREAM-style counts of copy and triad leave out;
                                 compiled with the AdamW kernel, on the same OpenMP threads)
                bandwidth = the best of the three
        adamw   the host AdamW kernel (runtime/host_kernels.py), 30 B/parameter with the bf16
                transfer copy; torch's fused AdamW plus a copy when the kernel cannot be built

Buffers are larger than a server socket's last-level cache share, touched once before timing;
the result is the median of a few rounds. The kernel's one-time build (about 30 s, cached on
disk) is not counted: `probe_host` loads it first.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import statistics
import time
from pathlib import Path

import torch

from .cgroup import cgroup_dirs, memberships, read_int, read_text

log = logging.getLogger("megatrain.plan")

#: bytes the host AdamW kernel moves per parameter (read master, grad, m, v; write master, m, v
#: and the bf16 transfer copy): what its GB/s figure counts
ADAMW_BYTES_PER_PARAM = 30


@dataclasses.dataclass(frozen=True)
class HostRates:
    cores: int                 # threads the measurement ran on (usable_cores)
    cores_why: str             # which limit set them
    copy_gbps: float
    triad_gbps: float
    update_gbps: float
    adamw_params_per_s: float
    adamw_kernel: str          # "fused" (ours) or "torch" (fused AdamW + copy: no compiler here)
    seconds: float             # how long the probe took

    @property
    def bandwidth_gbps(self) -> float:
        """The measured memory bandwidth: the best of copy, triad and update."""
        return max(self.copy_gbps, self.triad_gbps, self.update_gbps)

    @property
    def adamw_gbps(self) -> float:
        return self.adamw_params_per_s * ADAMW_BYTES_PER_PARAM / 1e9

    def describe(self) -> str:
        return (f"host (measured, {self.cores} core(s): {self.cores_why}): memory bandwidth "
                f"{self.bandwidth_gbps:.1f} GB/s (copy {self.copy_gbps:.1f}, triad {self.triad_gbps:.1f}, update "
                f"{self.update_gbps:.1f}), "
                f"AdamW {self.adamw_params_per_s / 1e9:.2f} Gparam/s ({self.adamw_gbps:.1f} GB/s, "
                f"{self.adamw_gbps / self.bandwidth_gbps:.0%} of the bandwidth; {self.adamw_kernel} kernel)")


def _quota_cores(cgroup_root: Path, proc_self_cgroup: Path) -> tuple[float, str] | None:
    """The tightest cgroup CPU quota over this process's cgroup and its ancestors, in cores."""
    best: tuple[float, str] | None = None
    for v2, controllers, rel in memberships(proc_self_cgroup):
        found = []
        if v2:   # "cpu.max" = "<quota|max> <period>"
            for d in cgroup_dirs(cgroup_root, rel):
                cols = (read_text(d / "cpu.max") or "").split()
                if len(cols) == 2 and cols[0].isdigit() and cols[1].isdigit() and int(cols[1]) > 0:
                    found.append((int(cols[0]) / int(cols[1]), f"cgroup cpu.max {cols[0]} {cols[1]}"))
        elif "cpu" in controllers:  # cgroup v1: cfs quota -1 = none
            for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                for d in cgroup_dirs(cgroup_root / name, rel):
                    quota, period = read_int(d / "cpu.cfs_quota_us"), read_int(d / "cpu.cfs_period_us")
                    if quota is not None and quota > 0 and period:
                        found.append((quota / period, f"cgroup cpu.cfs_quota_us {quota} / {period}"))
        for cores, why in found:
            if best is None or cores < best[0]:
                best = (cores, why)
    return best


def usable_cores(cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
                 proc_self_cgroup: str | os.PathLike = "/proc/self/cgroup") -> tuple[int, str]:
    """(cores this process may run on at once, which limit says so): the CPU affinity mask
    (taskset, Slurm's binding, a container's cpuset) and the cgroup CPU quota (a pod's `cpu`
    limit), the smaller, at least 1. A fractional quota rounds down (1.5 cores: 1 thread runs
    without being throttled)."""
    try:
        affinity = len(os.sched_getaffinity(0))
        cores, why = affinity, f"affinity {affinity} of {os.cpu_count()}"
    except (AttributeError, OSError):   # not on Linux
        cores = os.cpu_count() or 1
        why = f"cpu_count {cores}"
    quota = _quota_cores(Path(cgroup_root), Path(proc_self_cgroup))
    if quota is not None and math.floor(quota[0]) < cores:
        cores, why = max(1, math.floor(quota[0])), f"{quota[1]} = {quota[0]:g} cores (affinity {cores})"
    return cores, why


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def interleaved_medians(fns: dict, rounds: int) -> dict:
    """{name: median seconds of fns[name]()}, the functions taken in turn in each round (so a
    neighbour's load on a shared machine falls on every measurement alike; ratios stay honest).
    One untimed call each first: the pages' first touch, the thread team's start."""
    for fn in fns.values():
        fn()
    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def stream_ops(elements: int) -> tuple[dict, dict]:
    """({name: fn}, {name: bytes each call moves}) of the bandwidth probes over fp32 buffers of
    `elements`, on the calling thread's torch threads."""
    from .runtime.host_kernels import kernel
    ext = kernel()
    a, b, c = torch.rand(elements), torch.rand(elements), torch.empty(elements)
    threads = torch.get_num_threads()
    update = (lambda: ext.stream_update(c, b, 0.5, threads)) if ext is not None else (lambda: c.add_(b, alpha=0.5))
    fns = {"copy": lambda: c.copy_(a), "triad": lambda: torch.add(a, b, alpha=0.5, out=c), "update": update}
    return fns, {"copy": 8 * elements, "triad": 12 * elements, "update": 12 * elements}


def adamw_op(n: int, threads: int) -> tuple:
    """(fn, which kernel): one AdamW step with the bf16 transfer copy over n fp32 parameters."""
    from .runtime.host_kernels import kernel
    ext = kernel()
    g = torch.Generator().manual_seed(0)
    master, grad = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3
    m, v, low = torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
    step = [0]
    if ext is not None:
        def run():
            step[0] += 1
            ext.adamw_step(master, grad, m, v, low, 1e-4, 0.9, 0.999, 1e-8, 0.01, step[0], 1.0, threads)
        return run, "fused"
    p = torch.nn.Parameter(master)
    p.grad = grad
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)

    def run_torch():
        opt.step()
        low.copy_(p.data)
    return run_torch, "torch"


def probe_host(*, elements: int = 16 * 2**20, adamw_params: int = 8 * 2**20, rounds: int = 5,
               cores: int | None = None) -> HostRates:
    """Measure the host on the cores this process may use (`usable_cores`; `cores` overrides).
    About half a second on a quiet 2-core machine (3 x 64 MiB buffers, 8M parameters' AdamW
    state: 340 MB for the moment)."""
    why = "given"
    if cores is None:
        cores, why = usable_cores()
    from .runtime.host_kernels import kernel
    kernel()   # (built and cached once per machine: not part of the measurement)
    t0 = time.perf_counter()
    with _threads(cores), torch.no_grad():
        fns, nbytes = stream_ops(elements)
        fns["adamw"], which = adamw_op(adamw_params, cores)
        seconds = interleaved_medians(fns, rounds)
    gbps = {name: nbytes[name] / seconds[name] / 1e9 for name in nbytes}
    rates = HostRates(cores=cores, cores_why=why, copy_gbps=gbps["copy"], triad_gbps=gbps["triad"],
                      update_gbps=gbps["update"], adamw_params_per_s=adamw_params / seconds["adamw"],
                      adamw_kernel=which, seconds=time.perf_counter() - t0)
    log.debug("%s, in %.2f s", rates.describe(), rates.seconds)
    return rates


@functools.lru_cache(maxsize=None)
def probed_host() -> HostRates:
    """`probe_host()` once per process (the plan, the preflight and `--gpu cpu` share it)."""
    return probe_host()


def with_host(hw, rates: HostRates):
    """Hardware profile `hw` with its host figures replaced by measured ones: the memory
    bandwidth and the host AdamW rate (parameters/s)."""
    return dataclasses.replace(hw, host_memory_gbps=rates.bandwidth_gbps,
                               optimizer_gparams=rates.adamw_params_per_s / 1e9)


def host_bound(est) -> str | None:
    """A sentence when the host AdamW pass, not the device, bounds a step (`est`: a plan's
    BatchEstimate), else None. The optimizer can hide under one micro-batch's backward (its
    updates start as gradients land: overlap_optimizer=backward) and the next forward
    (overlap_optimizer=forward); longer than both, the step waits for the host however it overlaps."""
    hideable = est.forward_seconds + est.backward_seconds
    if est.optimizer_seconds <= hideable:
        return None
    return (f"the host bounds the step: its AdamW pass takes {est.optimizer_seconds:.2f} s, longer than a "
            f"micro-batch's forward + backward ({hideable:.2f} s) it can overlap, so at least "
            f"{est.optimizer_seconds - hideable:.2f} s of each step waits for the host. More tokens per "
            "micro-batch (batch size, sequence length) hide it; so do more host cores or memory bandwidth.")
