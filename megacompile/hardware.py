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
     "overlap": true,             # copies run on their own streams, concurrently with compute
     "measure_ops": false}        # time each op here instead of rooflines (only for this machine)

Only `name`, `compute_tflops`, `h2d_gbps`, `d2h_gbps`, `device_memory_gib` and
`host_memory_gbps` are required; the others default as in `Hardware`. Pass a built-in name
(`h200`, `h100`, `gh200`, `a100`, `cpu`) or the path of such a JSON file. The `cpu` profile is
not a table entry: it is measured on the running machine (`measure_cpu`), where the CPU plays
the accelerator (no overlap: copies and compute share the same cores).
"""
from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from .errors import ConfigError


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
    overlap: bool = True
    measure_ops: bool = False            # time ops on this machine instead of rooflines (cost_model.py)

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
    "a100": Hardware("a100", 250.0, 24.0, 24.0, 80.0, 150.0, device_memory_gbps=1600.0, op_overhead_us=5.0),  # PCIe 4
}
NAMES = (*BUILTIN, "cpu")

_REQUIRED = ("name", "compute_tflops", "h2d_gbps", "d2h_gbps", "device_memory_gib", "host_memory_gbps")


def load_hardware(spec: str | Hardware, dtype: torch.dtype = torch.bfloat16) -> Hardware:
    """A built-in profile name, "cpu" (measured here, for `dtype`), or a JSON profile path."""
    if isinstance(spec, Hardware):
        return spec
    if spec == "cpu":
        return measure_cpu(dtype)
    if spec in BUILTIN:
        return BUILTIN[spec]
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"unknown hardware {spec!r}: use one of {', '.join(NAMES)} or a JSON profile path.")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"hardware profile {path} is not valid JSON: {e}") from None
    names = {f.name for f in fields(Hardware)}
    unknown = set(data) - names
    missing = set(_REQUIRED) - set(data)
    if unknown or missing or not isinstance(data, dict):
        raise ConfigError(f"hardware profile {path}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}; "
                          f"required {list(_REQUIRED)}, optional {sorted(names - set(_REQUIRED))}.")
    bad = [k for k, v in data.items() if k not in ("name", "overlap", "measure_ops") and not (isinstance(v, (int, float)) and v >= 0)]
    if bad:
        raise ConfigError(f"hardware profile {path}: {bad} must be non-negative numbers.")
    return Hardware(**data)


# -- the cpu profile, measured ----------------------------------------------------------------

def _best_of(fn, repeat: int, inner: int = 1) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * 2**30


@functools.lru_cache(maxsize=None)
def measure_cpu(dtype: torch.dtype = torch.float32) -> Hardware:
    """Measure this machine as the "device" megatrain runs on without an accelerator.

    compute: a 1024^3 matmul in `dtype`; memory: an out-of-place add over 64 MiB tensors (read
    2, write 1); transfer: a 64 MiB copy (what a CPU "prefetch" is); op overhead: a dispatched
    aten op on a tiny tensor; optimizer: torch.optim.AdamW over 16M fp32 parameters (the optimizer
    a user passes), expressed as the bytes/s it streams (32 B per parameter).
    Takes about two seconds; cached per process.
    """
    n = 1024
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    t_mm = _best_of(lambda: torch.mm(a, b), 5)
    big = 16 * 2**20  # fp32 elements: 64 MiB
    x, y, z = torch.ones(big), torch.ones(big), torch.empty(big)
    t_add = _best_of(lambda: torch.add(x, y, out=z), 5)
    t_copy = _best_of(lambda: z.copy_(x), 5)
    tiny = torch.ones(8)
    add = torch.ops.aten.add.Tensor
    t_op = _best_of(lambda: add(tiny, tiny), 5, inner=200)
    params = [torch.nn.Parameter(torch.zeros(2 * 2**20)) for _ in range(8)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    t_opt = _best_of(opt.step, 3)
    del x, y, z, params, opt
    copy_gbps = 2 * big * 4 / t_copy / 1e9
    return Hardware(
        name="cpu",
        compute_tflops=2 * n**3 / t_mm / 1e12,
        h2d_gbps=big * 4 / t_copy / 1e9,   # bytes moved per second by one copy
        d2h_gbps=big * 4 / t_copy / 1e9,
        device_memory_gib=host_memory_bytes() / 2**30,
        host_memory_gbps=copy_gbps,
        device_memory_gbps=3 * big * 4 / t_add / 1e9,
        op_overhead_us=t_op * 1e6,
        optimizer_gbps=32 * 16 * 2**20 / t_opt / 1e9,
        overlap=False,
        measure_ops=True,
    )
