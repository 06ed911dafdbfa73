"""Reading /proc and /sys/fs/cgroup: what a container, a Slurm job or a pod leaves this process.
hardware.py (host memory limit) and host_probe.py (CPU quota) read through these."""
from __future__ import annotations

from pathlib import Path


def read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def read_int(path: Path) -> int | None:
    text = read_text(path)
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def stat_value(path: Path, key: str) -> int:
    for line in (read_text(path) or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1])
    return 0


def cgroup_dirs(base: Path, rel: str) -> list[Path]:
    """`base/rel` and its ancestors up to `base`, innermost first, those that exist."""
    parts = [p for p in rel.split("/") if p not in ("", ".", "..")]
    dirs = [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def memberships(proc_self_cgroup: Path) -> list[tuple[bool, list[str], str]]:
    """This process's cgroups, one per line of /proc/self/cgroup: (cgroup v2 (the unified "0::"
    line), the v1 hierarchy's controllers, the cgroup's path below the mount)."""
    out = []
    for line in (read_text(proc_self_cgroup) or "").splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        out.append((hid == "0" and controllers == "", controllers.split(",") if controllers else [], rel))
    return out
