"""Routed expert rows: copy to the device only the experts that received tokens.

`passes/routed_experts.py` puts `fetch_expert_rows(W, offs)` in front of the grouped matmuls of
a stacked expert weight. The weight pool allocates W's device buffer without copying it and
registers the buffer here (`expect`); when the body reaches the call, the router has run, so
`offs` (cumulative tokens per expert) says which experts are active and only their rows cross
the link. The rows fetched are remembered per weight, so the gradient (zero for every other
expert) is delivered to the host for those rows only (`WeightEntry.accumulate_grad`).

Inside a body the call is an identity on W: it returns W itself (the memory plan treats it as
an alias). A tensor that was not registered (a body timed on random inputs by the cost model)
passes through untouched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PendingRows:
    source: torch.Tensor        # the host transfer copy [E, ...]
    index: int                  # flat index of the weight
    pool: object                # the DeviceWeightPool that owns the buffer (counts the bytes)


#: the attribute of a registered expert weight view (the very tensor object the executor passes
#: to the body) that says where its rows come from: the pool that owns the view owns this too,
#: so no process-wide registry is kept
_ATTR = "_megatrain_pending_rows"


def expect(view: torch.Tensor, source: torch.Tensor, index: int, pool) -> None:
    setattr(view, _ATTR, PendingRows(source, index, pool))


def forget(view: torch.Tensor) -> None:
    if hasattr(view, _ATTR):
        delattr(view, _ATTR)


def active_experts(offs: torch.Tensor) -> list[int]:
    """Experts owning at least one row, from cumulative row counts (one device-to-host read)."""
    ends = offs.tolist()
    return [e for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)) if end > start]


def fetch_expert_rows(weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    pending = getattr(weight, _ATTR, None)
    if pending is None:
        return weight
    active = active_experts(offs)
    src = pending.source
    cuda = weight.device.type == "cuda"
    for e in active:
        weight[e].copy_(src[e], non_blocking=cuda)  # pinned host rows: asynchronous on CUDA
    pending.pool.record_rows(pending.index, active, len(active) * src[0].numel() * src.element_size())
    return weight
