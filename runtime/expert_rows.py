"""Routed expert rows: copy to the device only the experts that received tokens.

`passes/routed_experts.py` puts `fetch_expert_rows(W, offs)` (megacompile/ir_ops.py) in front of
the grouped matmuls of a stacked expert weight. The weight pool allocates W's device buffer
without copying it and registers the buffer here (`expect`); when the body reaches the call, the
router has run, so `offs` (cumulative tokens per expert) says which experts are active and only
their rows cross the link. The rows fetched are remembered per weight, so the gradient (zero for
every other expert) is delivered to the host for those rows only (`WeightEntry.accumulate_grad`).
"""
from __future__ import annotations

import torch

from ..ir_ops import PENDING_ROWS, PendingRows


def expect(view: torch.Tensor, source: torch.Tensor, index: int, pool) -> None:
    """`view`'s rows come from `source` when a body's fetch_expert_rows reaches it; `pool` counts them."""
    setattr(view, PENDING_ROWS, PendingRows(source, index, pool))


def forget(view: torch.Tensor) -> None:
    if hasattr(view, PENDING_ROWS):
        delattr(view, PENDING_ROWS)
