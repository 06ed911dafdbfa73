"""Hardware profiles: the rates the schedule's cost model and `megatrain plan` simulate against.

A profile is a small JSON object. All rates are sustained figures, not datasheet peaks:

    {"name": "h200",
     "compute_tflops": 700,       # dense matmul throughput in the compute dtype (TFLOP/s)
     "device_memory_gbps": 3800,  # device memory bandwidth for elementwise/norm/softmax ops (GB/s)
     "op_overhead_us": 4,         # fixed cost per op (kernel launch / dispatch), microseconds
     "h2d_gbps": 55, "d2h_gbps": 55,  # host<->device link (PCIe 5 x16 sustains ~55 GB/s)
     "device_memory_gib": 141,    # usable device memory
     "host_memory_gbps": 200,     # host DRAM bandwidth
     "optimizer_gbps": 100,       # bytes/s the CPU optimizer streams (AdamW moves ~32 B/param)
     "optimizer_gparams": 0,      # or its rate in 1e9 parameters/s, as measured (0: from optimizer_gbps)
     "overlap": true,             # copies run on their own streams, concurrently with compute
     "measure_ops": false}        # time each op here instead of rooflines (only for this machine)

Only `name`, `compute_tflops`, `h2d_gbps`, `d2h_gbps`, `device_memory_gib` and
`host_memory_gbps` are required; the others default as in `Hardware`. Pass a built-in name
(`h200`, `h100`, `gh200`, `a100`, `cpu`) or the path of such a JSON file. The `cpu` profile is
not a table entry: it is measured on the running machine (`measure_cpu`), where the CPU plays
the accelerator (no overlap: copies and compute share the same cores).

On CUDA without a `hardware` option, `gpu_profile(device, dtype)` gives the GPU's profile: the
built-in one whose name is a whole word of the CUDA device name (`profile_for_gpu_name`: an
"NVIDIA GH200 480GB" is a gh200, not an h200), else rates measured on the GPU itself
(`measure_gpu`, a few seconds, cached).

`host_memory_limit()` is the host RAM this process can still use: the smaller of the kernel's
MemAvailable and what the cgroup memory limit (containers, Slurm jobs) leaves.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from .cgroup import cgroup_dirs as _cgroup_dirs
from .cgroup import memberships
from .cgroup import read_int as _read_int
from .cgroup import read_text as _read
from .cgroup import stat_value as _stat_value
from .errors import ConfigError
from .units import fmt_bytes


@dataclass(frozen=True)
class Hardware:
    name: str
    compute_tflops: float
    h2d_gbps: float
    d2h_gbps: float
    device_memory_gib: float
    host_memory_gbps: float
    device_memory_gbps: float = 2000.0
    op_overhead_us: float = 5.0
    optimizer_gbps: float = 0.0          # 0: half of host_memory_gbps
    optimizer_gparams: float = 0.0       # the host AdamW's measured rate, 1e9 parameters/s (0: from optimizer_gbps)
    overlap: bool = True
    measure_ops: bool = False            # time ops on this machine instead of rooflines (cost_model.py)
    # data parallelism (plan --gpus): the all-gather / reduce-scatter bus bandwidth between the
    # GPUs of a node (NCCL's "busbw"; NVLink 4 about 360 GB/s, PCIe-only boxes tens), per collective latency
    peer_gbps: float = 360.0
    peer_latency_us: float = 15.0

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def optimizer_bytes_per_s(self) -> float:
        return (self.optimizer_gbps or self.host_memory_gbps / 2) * 1e9


BUILTIN = {
    "h200": Hardware("h200", 700.0, 55.0, 55.0, 141.0, 200.0, device_memory_gbps=3800.0, op_overhead_us=4.0),
    "h100": Hardware("h100", 600.0, 50.0, 50.0, 80.0, 200.0, device_memory_gbps=2700.0, op_overhead_us=4.0),
    # NVLink-C2C host link; Grace LPDDR5X
    "gh200": Hardware("gh200", 700.0, 400.0, 400.0, 96.0, 400.0, device_memory_gbps=3400.0, op_overhead_us=4.0),
    "a100": Hardware("a100", 250.0, 24.0, 24.0, 80.0, 150.0, device_memory_gbps=1600.0, op_overhead_us=5.0,
                     peer_gbps=230.0),  # PCIe 4 host link, NVLink 3 peers
}
NAMES = (*BUILTIN, "cpu")

# -- profiles from JSON files -------------------------------------------------------------------

_REQUIRED = ("name", "compute_tflops", "h2d_gbps", "d2h_gbps", "device_memory_gib", "host_memory_gbps")
_POSITIVE = ("compute_tflops", "h2d_gbps", "d2h_gbps", "device_memory_gib", "host_memory_gbps", "device_memory_gbps",
             "peer_gbps")
# (optimizer_gbps 0: half of host_memory_gbps; optimizer_gparams 0: from optimizer_gbps)
_NON_NEGATIVE = ("op_overhead_us", "optimizer_gbps", "optimizer_gparams", "peer_latency_us")
_BOOLS = ("overlap", "measure_ops")


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _value_problems(data: dict) -> list[str]:
    """What is wrong with each known key's value, one entry per bad key."""
    bad = []
    for key, value in data.items():
        shown = f"{key}={value!r} ({type(value).__name__})"
        if key == "name" and not (isinstance(value, str) and value.strip()):
            bad.append(f"{shown} must be a non-empty string")
        elif key in _POSITIVE and not (is_number(value) and value > 0):
            bad.append(f"{shown} must be a finite number > 0")
        elif key in _NON_NEGATIVE and not (is_number(value) and value >= 0):
            bad.append(f"{shown} must be a finite number >= 0"
                       + (" (0: the default)" if key in ("optimizer_gbps", "optimizer_gparams") else ""))
        elif key in _BOOLS and not isinstance(value, bool):
            bad.append(f"{shown} must be true or false")
    return bad


def key_problems(data: dict, known, required) -> list[str]:
    """A profile's unknown keys (with the closest known one) and missing required keys."""
    problems = []
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            problems.append(f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    missing = [k for k in required if k not in data]
    if missing:
        problems.append(f"missing keys {missing}")
    return problems


def _profile_from_dict(data, where: str) -> Hardware:
    if not isinstance(data, dict):
        raise ConfigError(f"hardware profile {where} holds a JSON {type(data).__name__}, not an object: write one "
                          f"object of rates, e.g. {{\"name\": \"my_gpu\", \"compute_tflops\": 700, ...}} with the "
                          f"keys {list(_REQUIRED)} (see megacompile/hardware.py).")
    names = [f.name for f in fields(Hardware)]
    problems = key_problems(data, names, _REQUIRED)
    problems += _value_problems({k: v for k, v in data.items() if k in names})
    if problems:
        raise ConfigError(f"hardware profile {where}: {'; '.join(problems)}. Required keys {list(_REQUIRED)}, "
                          f"optional {[n for n in names if n not in _REQUIRED]}.")
    return Hardware(**{k: (float(v) if k in _POSITIVE + _NON_NEGATIVE else v) for k, v in data.items()})


def load_hardware(spec: str | os.PathLike | Hardware, dtype: torch.dtype = torch.bfloat16) -> Hardware:
    """A built-in profile name, "cpu" (measured here, for `dtype`), a JSON profile path, or a
    Hardware (checked like a JSON profile). Anything else, or a bad profile, is a ConfigError."""
    if isinstance(spec, Hardware):
        problems = _value_problems(asdict(spec))
        if problems:
            raise ConfigError(f"hardware profile {spec.name!r}: {'; '.join(problems)}.")
        return spec
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"hardware={spec!r} ({type(spec).__name__}): expected one of {', '.join(NAMES)} or the "
                          "path of a JSON hardware profile.")
    if spec == "cpu":
        return measure_cpu(dtype)
    if spec in BUILTIN:
        return BUILTIN[spec]
    path = Path(spec)
    if path.is_dir():
        raise ConfigError(f"hardware profile {path} is a directory: give the path of a JSON profile file, or one "
                          f"of {', '.join(NAMES)}.")
    if not path.exists():
        raise ConfigError(f"unknown hardware {spec!r}: use one of {', '.join(NAMES)} or a JSON profile path.")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"hardware profile {path} cannot be read ({reason}): make it a readable UTF-8 JSON "
                          "file.") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"hardware profile {path} is not valid JSON: {e}") from None
    return _profile_from_dict(data, str(path))


# -- which built-in profile a GPU is --------------------------------------------------------------

def profile_for_gpu_name(name: str) -> Hardware | None:
    """The built-in profile of a CUDA device name, or None for a GPU without one.

    A profile matches when its name is a whole word of the device name (words split at anything
    but letters and digits), never a substring: "NVIDIA H200 NVL" and "NVIDIA H100 80GB HBM3"
    are an h200 and an h100, "NVIDIA GH200 480GB" a gh200 (not an h200), "NVIDIA A100-SXM4-80GB"
    an a100; "NVIDIA L40S", "NVIDIA B200" or "NVIDIA H20" have none.
    """
    words = set(re.findall(r"[a-z0-9]+", str(name).lower()))
    found = [hw for key, hw in BUILTIN.items() if key in words]
    return found[0] if len(found) == 1 else None


def _resolve_device(device) -> torch.device:
    dev = torch.device("cuda", device) if isinstance(device, int) and not isinstance(device, bool) \
        else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _g(x: float) -> str:
    return f"{x:.3g}"


def describe_rates(hw: Hardware, dtype: torch.dtype) -> str:
    return (f"{_g(hw.compute_tflops)} TFLOP/s {str(dtype).removeprefix('torch.')} matmul, "
            f"H2D {_g(hw.h2d_gbps)} GB/s, D2H {_g(hw.d2h_gbps)} GB/s, device memory {_g(hw.device_memory_gbps)} GB/s, "
            f"{_g(hw.op_overhead_us)} us per op, {hw.device_memory_gib:.1f} GiB")


def gpu_profile(device: torch.device | str | int, dtype: torch.dtype = torch.bfloat16) -> tuple[Hardware, str]:
    """The profile of the GPU `device` and one sentence saying which it is and why.

    A GPU with a built-in profile (`profile_for_gpu_name`) gets it, with device_memory_gib its
    real total memory. Another GPU is measured (`measure_gpu`: matmul rate in `dtype`, H2D/D2H
    and device memory bandwidth, op overhead, host copy and AdamW rates; a few seconds, cached);
    if the measurement fails, the h100 profile is assumed (with its real memory). A CPU device
    gets the measured `cpu` profile. This is what the trainer uses when no `hardware` is set.
    """
    dev = _resolve_device(device)
    if dev.type == "cpu":
        hw = measure_cpu(dtype)
        return hw, f"cpu: rates measured on this machine: {describe_rates(hw, dtype)}"
    if dev.type != "cuda":
        raise ConfigError(f"device={str(dev)!r}: a hardware profile is known only for 'cuda' or 'cpu' devices.")
    name = torch.cuda.get_device_name(dev)
    gib = torch.cuda.get_device_properties(dev).total_memory / 2**30
    builtin = profile_for_gpu_name(name)
    if builtin is not None:
        return (dataclasses.replace(builtin, device_memory_gib=gib),
                f"{name}: built-in {builtin.name} profile ({gib:.1f} GiB)")
    try:
        hw = measure_gpu(dev, dtype)
    except Exception as e:   # any failure to measure (out of memory, a driver error): still train
        reason = (str(e).strip().splitlines() or [""])[0]
        return (dataclasses.replace(BUILTIN["h100"], device_memory_gib=gib),
                f"{name}: no built-in profile and measuring its rates failed ({type(e).__name__}: {reason}); "
                "assumed h100")
    return hw, f"{name}: no built-in profile, rates measured on it: {describe_rates(hw, dtype)}"


# -- measured profiles ------------------------------------------------------------------------

def _best_of(fn, repeat: int, inner: int = 1, sync=None) -> float:
    """Seconds per call of `fn`, best of `repeat` rounds of `inner` calls; `sync` (e.g. a CUDA
    synchronize) runs after the warm-up and inside each round, so asynchronous work is timed."""
    fn()  # warm up
    if sync is not None:
        sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        if sync is not None:
            sync()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


# -- host memory ------------------------------------------------------------------------------

def _gib(n: float) -> str:   # (the limits' own messages: one decimal)
    return fmt_bytes(n, unit="GiB", digits=1)


#: a cgroup v1 limit at least this large is "no limit" (the kernel writes ~2^63 rounded to pages)
_V1_UNLIMITED = 2**62


def host_memory_limit(proc_meminfo: str | os.PathLike = "/proc/meminfo",
                      cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
                      proc_self_cgroup: str | os.PathLike = "/proc/self/cgroup") -> tuple[int, str]:
    """(bytes of host RAM this process can still use, which limit that is).

    The smallest of: MemAvailable in /proc/meminfo; for the cgroup v2 of this process (the
    "0::/path" line of /proc/self/cgroup) and each of its ancestors, `memory.max` minus what the
    cgroup uses ("max": no limit); for cgroup v1, `memory/.../memory.limit_in_bytes` minus
    `memory.usage_in_bytes` (~2^63: no limit). What a cgroup uses excludes its inactive page
    cache (`inactive_file` in memory.stat), which the kernel reclaims before it OOM-kills, as the
    kubelet counts a container's working set. Off Linux: the physical memory (sysconf).
    """
    candidates: list[tuple[int, str]] = []
    meminfo = {}
    for line in (_read(Path(proc_meminfo)) or "").splitlines():
        key, _, rest = line.partition(":")
        cols = rest.split()
        if cols and cols[0].isdigit():
            meminfo[key.strip()] = int(cols[0]) * (1024 if cols[1:2] == ["kB"] else 1)
    if "MemTotal" in meminfo:
        avail = meminfo.get("MemAvailable")
        label = "MemAvailable"
        if avail is None:   # kernels before 3.14
            avail = sum(meminfo.get(k, 0) for k in ("MemFree", "Buffers", "Cached"))
            label = "MemFree+Buffers+Cached"
        candidates.append((avail, f"{label} {_gib(avail)} of {_gib(meminfo['MemTotal'])}"))
    else:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            candidates.append((total, f"physical memory {_gib(total)} (sysconf)"))
        except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
            pass

    root = Path(cgroup_root)
    for v2, controllers, rel in memberships(Path(proc_self_cgroup)):
        if v2:
            for d in _cgroup_dirs(root, rel):
                raw = (_read(d / "memory.max") or "").strip()
                if not raw.isdigit():   # "max" (no limit) or no memory controller here
                    continue
                limit = int(raw)
                used = max(0, (_read_int(d / "memory.current") or 0) - _stat_value(d / "memory.stat", "inactive_file"))
                candidates.append((max(0, limit - used),
                                   f"cgroup memory.max {_gib(limit)} ({_gib(used)} in use)"))
        elif "memory" in controllers:   # cgroup v1 memory controller
            for d in _cgroup_dirs(root / "memory", rel):
                limit = _read_int(d / "memory.limit_in_bytes")
                if limit is None or limit >= _V1_UNLIMITED:
                    continue
                used = max(0, (_read_int(d / "memory.usage_in_bytes") or 0)
                           - _stat_value(d / "memory.stat", "total_inactive_file"))
                candidates.append((max(0, limit - used),
                                   f"cgroup memory.limit_in_bytes {_gib(limit)} ({_gib(used)} in use)"))
    if not candidates:  # pragma: no cover - neither /proc nor sysconf
        return 16 * 2**30, "assumed 16.0 GiB (no /proc/meminfo, no sysconf)"
    return min(candidates, key=lambda c: c[0])


def host_memory_bytes() -> int:
    """Bytes of host RAM this process can still use (`host_memory_limit`)."""
    return host_memory_limit()[0]


# -- the cpu profile, measured ----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def measure_cpu(dtype: torch.dtype = torch.float32) -> Hardware:
    """Measure this machine as the "device" megatrain runs on without an accelerator.

    compute: an n^3 matmul in `dtype`, n doubled from 256 to at most 1024 while one takes under
    10 ms (a CPU without fp16 kernels takes 4.5 s for one 1024^3 fp16 matmul and 14 ms at 256, so
    the probe stays short; its figure is then the smaller matmul's); memory: an out-of-place add
    over 64 MiB tensors (read 2, write 1); transfer: a 64 MiB copy (what a CPU "prefetch" is); op overhead: a dispatched
    aten op on a tiny tensor; host memory bandwidth and the optimizer: `host_probe.probed_host()`
    (copy, triad and update bandwidth and the host AdamW kernel's parameters/s on the cores this
    process may use). Device memory: the host RAM this process can use (`host_memory_bytes`).
    Takes about two seconds; cached per process.
    """
    n = 256
    while True:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)   # (warm up)
        t0 = time.perf_counter()
        torch.mm(a, b)
        if n >= 1024 or time.perf_counter() - t0 >= 0.01:
            break
        n *= 2
    t_mm = _best_of(lambda: torch.mm(a, b), 5)
    big = 16 * 2**20  # fp32 elements: 64 MiB
    x, y, z = torch.ones(big), torch.ones(big), torch.empty(big)
    t_add = _best_of(lambda: torch.add(x, y, out=z), 5)  # noqa: F821
    tiny = torch.ones(8)
    add = torch.ops.aten.add.Tensor
    t_op = _best_of(lambda: add(tiny, tiny), 5, inner=200)
    del x, y, z
    from .host_probe import probed_host
    host = probed_host()
    return Hardware(
        name="cpu",
        compute_tflops=2 * n**3 / t_mm / 1e12,
        h2d_gbps=host.copy_gbps / 2,   # bytes copied per second (the probe counts read + write)
        d2h_gbps=host.copy_gbps / 2,
        device_memory_gib=host_memory_bytes() / 2**30,
        host_memory_gbps=host.bandwidth_gbps,
        device_memory_gbps=3 * big * 4 / t_add / 1e9,
        op_overhead_us=t_op * 1e6,
        optimizer_gparams=host.adamw_params_per_s / 1e9,
        overlap=False,
        measure_ops=True,
    )


# -- a GPU without a built-in profile, measured -------------------------------------------------

@functools.lru_cache(maxsize=None)
def measure_gpu(device: torch.device, dtype: torch.dtype = torch.bfloat16, *, n: int = 4096,
                link_bytes: int = 256 * 2**20, memory_bytes: int = 256 * 2**20) -> Hardware:
    """Measure the accelerator `device` (a CUDA device; a CPU device runs the same code, for tests).

    compute: an n^3 matmul in `dtype` (2 n^3 FLOPs); H2D / D2H: one `link_bytes` copy between a
    pinned host buffer and the device; device memory: an out-of-place fp32 add over
    `memory_bytes` tensors (read 2, write 1); op overhead: a tiny add, dispatch to completion;
    host memory and optimizer: as `measure_cpu` (`host_probe.probed_host()`). Every timing is
    best-of, between device synchronizes. Peak device use about 3 x memory_bytes (768 MiB); a few
    seconds; cached per device and dtype.
    """
    device = _resolve_device(device)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else None
    try:
        with torch.cuda.device(device) if cuda else contextlib.nullcontext():
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            t_mm = _best_of(lambda: torch.mm(a, b), 5, inner=10, sync=sync)  # noqa: F821
            del a, b
            host = torch.empty(link_bytes, dtype=torch.uint8, pin_memory=cuda)
            dev = torch.empty(link_bytes, dtype=torch.uint8, device=device)
            t_h2d = _best_of(lambda: dev.copy_(host, non_blocking=True), 4, sync=sync)  # noqa: F821
            t_d2h = _best_of(lambda: host.copy_(dev, non_blocking=True), 4, sync=sync)  # noqa: F821
            del host, dev
            elems = memory_bytes // 4
            x = torch.ones(elems, device=device)
            y = torch.ones(elems, device=device)
            z = torch.empty(elems, device=device)
            t_add = _best_of(lambda: torch.add(x, y, out=z), 5, inner=10, sync=sync)  # noqa: F821
            del x, y, z
            tiny = torch.ones(8, device=device)
            add = torch.ops.aten.add.Tensor
            t_op = _best_of(lambda: add(tiny, tiny), 5, inner=200, sync=sync)  # noqa: F821
            del tiny
        if cuda:
            name = torch.cuda.get_device_name(device)
            total = torch.cuda.get_device_properties(device).total_memory
        else:
            name, total = "cpu", host_memory_bytes()
    finally:
        if cuda:   # give the buffers back (the device's caching allocator, the pinned host cache)
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
                host_empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
                if host_empty is not None:
                    host_empty()
    from .host_probe import probed_host
    rates = probed_host()
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-").removeprefix("nvidia-") or "gpu"
    return Hardware(
        name=f"{slug}-measured",
        compute_tflops=2 * n**3 / t_mm / 1e12,
        h2d_gbps=link_bytes / t_h2d / 1e9,
        d2h_gbps=link_bytes / t_d2h / 1e9,
        device_memory_gib=total / 2**30,
        host_memory_gbps=rates.bandwidth_gbps,
        device_memory_gbps=3 * elems * 4 / t_add / 1e9,
        op_overhead_us=t_op * 1e6,
        optimizer_gparams=rates.adamw_params_per_s / 1e9,
        overlap=cuda,
        measure_ops=False,
    )
