"""Worker: where a data-parallel run's host state lives, and what it costs the node.

    torchrun --nproc-per-node N tests/dist_workers/heap_bytes.py OUT

Trains 2 steps of a Llama-shaped model (~17M parameters, fp32) and writes, per rank, the growth
of its /proc figures (RssAnon, RssShmem, Pss_Shmem; the node's Shmem on the leader), the node
heap's bytes, and whether every master, moment and gradient is a view of the heap.
"""
from __future__ import annotations

import json
import os
import sys

import torch

from megacompile import HostAdamW, distributed
from megacompile.backend import programs_of


def proc() -> dict:
    out = {}
    for path, keys in (("/proc/self/status", ("RssAnon", "RssShmem")), ("/proc/self/smaps_rollup", ("Pss_Shmem",)),
                       ("/proc/meminfo", ("Shmem",))):
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in keys:
                    out[name] = int(rest.split()[0]) * 1024
    return out


def main(out_dir: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    topo = distributed.setup(torch.device("cpu"), timeout_s=120)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    params = sum(p.numel() for p in model.parameters())
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    opt = HostAdamW(model.parameters(), lr=1e-4)
    before = proc()
    for _ in range(2):
        ids = torch.randint(0, 4000, (1, 16))
        cmodel(input_ids=ids, labels=ids).loss.backward()
        opt.grad_norm()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    distributed.barrier(topo)
    after = proc()
    heap = programs_of(model)[0].heap
    spans = [(m.data_ptr(), m.data_ptr() + m.numel()) for m, _ in heap.chunks]

    def shared(t):
        return any(a <= t.data_ptr() < b for a, b in spans)
    from megacompile.runtime.store import entry_of
    placed = all(shared(p.data) and shared(entry_of(p).moments[0]) and shared(entry_of(p).moments[1])
                 and shared(entry_of(p).grad_home) for p in model.parameters())
    row = {"rank": topo.rank, "params": params, "heap_bytes": heap.nbytes, "heap_allocated": heap.allocated,
           "all_state_in_heap": placed, **{k: after[k] - before.get(k, 0) for k in after}}
    rows = [None] * topo.world
    import torch.distributed as dist
    dist.all_gather_object(rows, row, group=topo.host_group)
    if topo.writer:
        with open(os.path.join(out_dir, "heap_bytes.json"), "w") as f:
            json.dump(rows, f, indent=1)
    distributed.end(topo)


if __name__ == "__main__":
    main(sys.argv[1])
