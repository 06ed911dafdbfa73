"""SSD profiles of the NVMe state tier (fp32 masters and AdamW moments on disk, issue 18): the
drives' read and write rates, where the tier's files go and how much room they have.

    load_ssd("gen5x4")                built in (gen4x1, gen4x4, gen5x1, gen5x4)
    load_ssd("raid.json")             {"name", "read_gbps", "write_gbps", "paths", "capacity_gib", ...}
    load_ssd("measure:/mnt/nvme0")    measured with the tier's own I/O engine (runtime/tier_io.py)
"""
from __future__ import annotations

import difflib
import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import ConfigError
from .hardware import is_number, key_problems

# -- SSD profiles (the NVMe state tier: fp32 masters and AdamW moments on disk) -------------------

@dataclass(frozen=True)
class SSD:
    """The drives the state tier streams optimizer state through (issue 18; plan.py places it).

    Rates are sustained O_DIRECT figures aggregated over `paths` (one directory per drive; empty
    for a plan-only profile). `capacity_gib` 0 means unknown: the free space of `paths` (statvfs)
    when there are paths, else not checked."""
    name: str
    read_gbps: float
    write_gbps: float
    paths: tuple[str, ...] = ()
    capacity_gib: float = 0.0
    queue_depth: int = 8

    def to_dict(self) -> dict:
        return {**asdict(self), "paths": list(self.paths)}


#: Built-in SSD profiles. gen4x4 and gen5x4 are the issue's figures for 4 drives in RAID0
#: (ZeRO-Infinity's 4 x Gen4: ~10 / 5 GB/s read / write; 4 x Gen5: ~27 / 11). The one-drive
#: gen4x1 and gen5x1 are DERIVED, a quarter of those, not measured.
SSD_BUILTIN = {
    "gen4x4": SSD("gen4x4", 10.0, 5.0),
    "gen5x4": SSD("gen5x4", 27.0, 11.0),
    "gen4x1": SSD("gen4x1", 10.0 / 4, 5.0 / 4),
    "gen5x1": SSD("gen5x1", 27.0 / 4, 11.0 / 4),
}
_SSD_KEYS = ("name", "read_gbps", "write_gbps", "paths", "capacity_gib", "queue_depth")
_SSD_REQUIRED = ("name", "read_gbps", "write_gbps")
#: bytes written and read per path by `measure:DIR` (enough to pass the drive's own cache)
SSD_MEASURE_BYTES = 256 * 2**20
_SSD_HELP = (f"use one of {', '.join(SSD_BUILTIN)}, the path of a JSON profile "
             '({"name": ..., "read_gbps": ..., "write_gbps": ..., "paths": [...], "capacity_gib": ...}) '
             "or measure:DIR[,DIR...] (one directory per drive)")


def _ssd_problems(data: dict) -> list[str]:
    """What is wrong with an SSD profile's keys and values, one entry per problem."""
    bad = key_problems(data, _SSD_KEYS, _SSD_REQUIRED)
    for key, value in data.items():
        shown = f"{key}={value!r}"
        if key == "name" and not (isinstance(value, str) and value.strip()):
            bad.append(f"{shown} must be a non-empty string")
        elif key in ("read_gbps", "write_gbps") and not (is_number(value) and value > 0):
            bad.append(f"{shown} must be a finite number > 0 (GB/s)")
        elif key == "capacity_gib" and not (is_number(value) and value >= 0):
            bad.append(f"{shown} must be a finite number >= 0 (0: the free space of the paths)")
        elif key == "queue_depth" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            bad.append(f"{shown} must be a whole number >= 1")
        elif key == "paths" and not (isinstance(value, (list, tuple))
                                     and all(isinstance(p, str) and p for p in value)):
            bad.append(f"{shown} must be a list of directory paths (one per drive)")
    return bad


def _ssd_from_dict(data, where: str) -> SSD:
    if not isinstance(data, dict):
        raise ConfigError(f"SSD profile {where} holds a JSON {type(data).__name__}, not an object: {_SSD_HELP}.")
    problems = _ssd_problems(data)
    if problems:
        raise ConfigError(f"SSD profile {where}: {'; '.join(problems)}. Required keys {list(_SSD_REQUIRED)}, "
                          f"optional {[k for k in _SSD_KEYS if k not in _SSD_REQUIRED]}.")
    values = {k: (float(v) if k in ("read_gbps", "write_gbps", "capacity_gib") else v) for k, v in data.items()}
    values["paths"] = tuple(str(Path(p).expanduser()) for p in data.get("paths", ()))
    return SSD(**values)


def check_tier_dirs(paths, what: str = "nvme") -> tuple[str, ...]:
    """`paths` as absolute directory strings, each an existing, writable directory (the tier
    creates its files there), else a ConfigError naming the one to fix."""
    out = []
    for p in paths:
        d = Path(p).expanduser()
        if not d.is_dir():
            raise ConfigError(f"{what}: {p} is not an existing directory: create it (mkdir -p {p}) on the drive "
                              "the state tier should use, or give another one.")
        if not os.access(d, os.W_OK | os.X_OK):
            raise ConfigError(f"{what}: cannot create files in {p} (permission denied): give a writable directory.")
        out.append(str(d.resolve()))
    if len(set(out)) != len(out):
        raise ConfigError(f"{what}: the directory {next(p for p in out if out.count(p) > 1)} is given twice: give "
                          "one directory per drive.")
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _measured_ssd(paths: tuple[str, ...]) -> SSD:
    """The rates of `paths` as the tier's own I/O engine reaches them (runtime/tier_io.py), once
    per process per set of paths."""
    from .runtime.tier_io import measure_ssd   # (the engine builds a C++ extension on first use)
    try:
        read, write = measure_ssd(list(paths), bytes_per_path=SSD_MEASURE_BYTES)
    except OSError as e:
        raise ConfigError(f"measure:{','.join(paths)}: measuring the drives failed ({e.strerror or e}): free "
                          f"{SSD_MEASURE_BYTES >> 20} MiB on each, or give a JSON profile.") from None
    return SSD("measured", float(read), float(write), paths=paths)


def load_ssd(spec: str | os.PathLike | SSD) -> SSD:
    """An SSD profile: a built-in name (gen4x1, gen4x4, gen5x1, gen5x4), a JSON file
    ({"name", "read_gbps", "write_gbps", "paths"?, "capacity_gib"?, "queue_depth"?}),
    `measure:DIR[,DIR...]` (those directories measured with the tier's I/O engine, 256 MiB per
    path, cached per process; the paths stay in the profile), or an SSD (checked). Anything
    else is a ConfigError (exit 2), as for a bad hardware profile.

        >>> load_ssd("gen5x4")
        SSD(name='gen5x4', read_gbps=27.0, write_gbps=11.0, paths=(), capacity_gib=0.0, queue_depth=8)
    """
    if isinstance(spec, SSD):
        problems = _ssd_problems({**spec.to_dict()})
        if problems:
            raise ConfigError(f"SSD profile {spec.name!r}: {'; '.join(problems)}.")
        return spec
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"nvme={spec!r} ({type(spec).__name__}): {_SSD_HELP}.")
    if spec in SSD_BUILTIN:
        return SSD_BUILTIN[spec]
    if spec.startswith("measure:"):
        return _measured_ssd(check_ssd_spec(spec).paths)
    path = Path(spec).expanduser()
    if path.is_dir():
        raise ConfigError(f"SSD profile {spec} is a directory: give a JSON profile file, or measure:{spec} to "
                          "measure that drive.")
    if not path.exists():
        close = difflib.get_close_matches(spec, list(SSD_BUILTIN), n=1)
        raise ConfigError(f"unknown SSD profile {spec!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                          + f": {_SSD_HELP}.")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"SSD profile {path} cannot be read ({reason}): make it a readable UTF-8 JSON file.") \
            from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"SSD profile {path} is not valid JSON: {e}") from None
    return _ssd_from_dict(data, str(path))


def check_ssd_spec(spec) -> SSD:
    """`load_ssd(spec)` without measuring: a `measure:` spec's directories are checked and a
    profile with their paths (rates 0: not measured yet) comes back."""
    if isinstance(spec, str) and spec.startswith("measure:"):
        dirs = [d.strip() for d in spec.removeprefix("measure:").split(",") if d.strip()]
        if not dirs:
            raise ConfigError(f"nvme={spec!r}: name the directories to measure, e.g. measure:/mnt/nvme0,/mnt/nvme1.")
        return SSD("measured", 0.0, 0.0, paths=check_tier_dirs(dirs, f"nvme={spec!r}"))
    return load_ssd(spec)


def free_bytes(paths) -> int:
    """Bytes free to an unprivileged writer (statvfs f_bavail) over `paths`, each file system
    counted once (two directories on one drive share its space)."""
    seen, total = set(), 0
    for p in paths:
        st = os.statvfs(p)
        dev = os.stat(p).st_dev
        if dev not in seen:
            seen.add(dev)
            total += st.f_bavail * st.f_frsize
    return total
