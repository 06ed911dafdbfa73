"""Worker: a check that fails on one rank only must stop every rank with the same error.

    torchrun --nproc-per-node 2 tests/dist_workers/agree.py FAILING_RANK
"""
from __future__ import annotations

import sys

import torch

from megacompile import distributed
from megacompile.errors import CannotFitError, MegatrainError


def check(rank: int, failing: int) -> str:
    if rank == failing:
        raise CannotFitError("host RAM: 12 GiB free, the run needs 40 GiB")
    return "ok"


def main(failing: int) -> int:
    topo = distributed.setup(torch.device("cpu"), timeout_s=30)
    try:
        distributed.agree(topo, check, topo.rank, failing)
    except MegatrainError as e:
        # (one write per line: two ranks share the pipe, and print's text and newline may interleave)
        sys.stdout.write(f"rank {topo.rank}: {type(e).__name__} exit {e.exit_code}: {e}\n")
        sys.stdout.flush()
        return e.exit_code
    finally:
        distributed.end(topo)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
