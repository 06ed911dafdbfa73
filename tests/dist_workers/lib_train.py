"""Worker: train a tiny family model with torch.compile(backend="megatrain") + HostAdamW, under
torchrun (data parallel) or as one process, and save losses, norms and final masters.

    python tests/dist_workers/lib_train.py OUT FAMILY OVERLAP STEPS GLOBAL_BATCH [DTYPE]

Every rank takes its slice of each global batch (rank r: rows r*b .. (r+1)*b); the loss is the
sum over tokens divided by the global token count, so the gradient sum over the ranks equals one
process's gradient at the global batch.
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from families import tiny_family_model  # noqa: E402

from megacompile import HostAdamW, distributed  # noqa: E402
from megacompile.runtime.store import master_weight  # noqa: E402


def main(out, family, overlap, steps, global_batch, dtype="float32"):
    topo = distributed.setup(torch.device("cpu"), timeout_s=60)
    torch.manual_seed(0)
    model = tiny_family_model(family, dtype=getattr(torch, dtype))
    model.config.use_cache = False
    cmodel = torch.compile(model, backend="megatrain",
                           options={"device": "cpu", "grad_reduce": "sum" if topo.enabled else "mean"})
    opt = HostAdamW(model.parameters(), lr=1e-3, weight_decay=0.01, overlap=overlap)
    per = global_batch // topo.world
    gen = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for step in range(steps):
        ids = torch.randint(3, 128, (global_batch, 12), generator=gen)
        labels = ids.clone()
        labels[:, :3] = -100
        labels[1::2, -2:] = -100   # (ragged: token counts differ between the ranks' slices)
        mine = slice(topo.rank * per, (topo.rank + 1) * per)
        count = torch.tensor(int((labels[:, 1:] != -100).sum()))
        opt.arm()
        loss = cmodel(input_ids=ids[mine], labels=labels[mine], num_items_in_batch=count).loss
        loss.backward()
        norm = opt.grad_norm()
        clip = min(1.0, 0.5 / (norm + 1e-6)) if step == 1 else 1.0   # one clipped step
        opt.step(grad_scale=clip)
        opt.zero_grad(set_to_none=True)
        losses.append(distributed.all_sum(topo, [loss.item()])[0])
        norms.append(norm)
    opt.synchronize()
    distributed.barrier(topo)
    if topo.writer:
        masters = {n: master_weight(p).clone() for n, p in model.named_parameters()}
        torch.save(masters, os.path.join(out, "masters.pt"))
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"losses": losses, "norms": norms, "counters": opt.counters}, f)
    distributed.end(topo)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], {"none": False}.get(a[2], a[2]), int(a[3]), int(a[4]), *a[5:])
