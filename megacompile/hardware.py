"""Hardware profiles for the schedule's time estimates.

A profile is a small JSON object (all rates are sustained, not peak datasheet figures):

    {"name": "h200", "compute_tflops": 700, "h2d_gbps": 55, "d2h_gbps": 55,
     "device_memory_gib": 141, "host_memory_gbps": 200}

`compute_tflops` is dense bf16 matmul throughput, `h2d_gbps`/`d2h_gbps` the host<->device link
(PCIe 5 x16 sustains ~55 GB/s), `host_memory_gbps` the host DRAM bandwidth the CPU optimizer
streams through. Pass a built-in name or the path of such a JSON file.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .errors import ConfigError


@dataclass(frozen=True)
class Hardware:
    name: str
    compute_tflops: float
    h2d_gbps: float
    d2h_gbps: float
    device_memory_gib: float
    host_memory_gbps: float

    def to_dict(self) -> dict:
        return asdict(self)


BUILTIN = {
    "h200": Hardware("h200", 700.0, 55.0, 55.0, 141.0, 200.0),
    "h100": Hardware("h100", 600.0, 50.0, 50.0, 80.0, 200.0),
    "gh200": Hardware("gh200", 700.0, 400.0, 400.0, 96.0, 400.0),   # NVLink-C2C host link
    "a100": Hardware("a100", 250.0, 24.0, 24.0, 80.0, 150.0),      # PCIe 4
    "cpu": Hardware("cpu", 0.1, 10.0, 10.0, 24.0, 10.0),           # this class of 2-core machine
}


def load_hardware(spec: str) -> Hardware:
    if spec in BUILTIN:
        return BUILTIN[spec]
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"unknown hardware {spec!r}: use one of {', '.join(BUILTIN)} or a JSON file path.")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"hardware profile {path} is not valid JSON: {e}") from None
    names = {f.name for f in fields(Hardware)}
    unknown = set(data) - names
    missing = names - set(data)
    if unknown or missing:
        raise ConfigError(f"hardware profile {path}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}; "
                          f"expected {sorted(names)}.")
    return Hardware(**data)
