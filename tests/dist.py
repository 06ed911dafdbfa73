"""Helpers of the data-parallel tests: a tiny model folder of a family, and torchrun launches.

    run_torchrun(["-m", "megacompile.cli", "train", cfg], nproc=2)   # -> CompletedProcess
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "data"


def tiny_model_dir(path: Path, family: str = "llama") -> Path:
    """A tiny model of `family` (tests/families.py) and a ChatML byte-level BPE tokenizer,
    saved like a Hub checkpoint (fp32)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import chatml_tokenizer
    from families import tiny_family_model
    tok = chatml_tokenizer()
    tok.save_pretrained(path)
    model = tiny_family_model(family, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                              max_position_embeddings=512)
    model.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(args: list[str], nproc: int = 2, timeout: float = 240, env: dict | None = None,
                 agent: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc ARGS` (agent=False: the ranks as plain processes with
    torchrun's variables, so a survivor's own exit is seen without the agent's SIGTERM)."""
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    port = free_port()
    if agent:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--monitor-interval",
               "0.1", "--master-addr", "127.0.0.1", "--master-port", str(port), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=base, cwd=ROOT)
    procs = []
    for r in range(nproc):
        rank_env = {**base, "WORLD_SIZE": str(nproc), "RANK": str(r), "LOCAL_RANK": str(r),
                    "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=rank_env, cwd=ROOT))
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, o, "") for p, o in zip(procs, outs)]


def run_nodes(args: list[str], nnodes: int = 2, nproc: int = 1, timeout: float = 240,
              env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """`nnodes` torchrun agents on this machine, as if on `nnodes` machines (their GROUP_RANKs
    differ, so each is a node of its own: HSDP can be tested on one box)."""
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank",
                               str(i), "--nproc-per-node", str(nproc), "--monitor-interval", "0.1", "--master-addr",
                               "127.0.0.1", "--master-port", port, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=base, cwd=ROOT) for i in range(nnodes)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, o, "") for p, o in zip(procs, outs)]
