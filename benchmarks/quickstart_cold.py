"""The README's first command, cold: `python examples/quickstart.py --steps 12` with an empty
megatrain cache (the embedded model converted again) and fresh Inductor/Triton caches, timed
from the start of the process, with the time of its first output line, the first step and each
compile stage.

    python benchmarks/quickstart_cold.py                 # the README's command, 3 runs, medians
    python benchmarks/quickstart_cold.py --runs 1 -- --layers 4

Prints one line per run and the medians; the goal (issue 35) is under 2 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(extra: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "MEGATRAIN_CACHE": cache, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
               "TRITON_CACHE_DIR": os.path.join(cache, "triton"), "PYTHONUNBUFFERED": "1"}
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "quickstart.py"), "--steps", "12", *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        seen: dict[str, float] = {}
        for line in proc.stdout:
            now = time.perf_counter() - start
            seen.setdefault("first output", now)
            if line.startswith("loaded "):
                seen.setdefault("model loaded", now)
            if "compiling" in line:
                seen.setdefault("compile started", now)
            if "compiled in" in line:
                seen.setdefault("compiled", now)
            if re.match(r"step\s+1 ", line):
                seen.setdefault("step 1 done", now)
            if line.startswith("A: "):
                seen.setdefault("answer", now)
        if proc.wait() != 0:
            raise SystemExit(f"quickstart failed (exit {proc.returncode})")
        seen["total"] = time.perf_counter() - start
        return seen


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("extra", nargs="*", help="arguments for quickstart.py (after --)")
    args = p.parse_args(argv)
    runs = []
    for k in range(args.runs):
        r = one_run(args.extra)
        runs.append(r)
        print(f"run {k + 1}: " + ", ".join(f"{name} {t:.1f} s" for name, t in r.items()), flush=True)
    names = list(runs[0])
    print(f"median of {len(runs)} (cpus: {len(os.sched_getaffinity(0))}): "
          + ", ".join(f"{n} {statistics.median(r.get(n, float('nan')) for r in runs):.1f} s" for n in names))


if __name__ == "__main__":
    main()
