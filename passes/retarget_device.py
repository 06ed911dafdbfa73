"""Move graph constants and factory ops to the compute device.

Dynamo traces against the host copy of the model, so factory ops (`arange`, `full`, `zeros`,
`_to_copy(device=cpu)`, ...) carry `device=cpu`. When bodies run on an accelerator, rewrite
those kwargs to the target device. A no-op when the device is the CPU.

    arange(8, device=cpu)   ->   arange(8, device=cuda:0)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from . import PassContext, graph_pass


@graph_pass("retarget_device")
def retarget_device(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    target = torch.device(ctx.device) if ctx.device is not None else torch.device("cpu")
    if target.type == "cpu":
        return gm
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.kwargs.get("device"), torch.device):
            if n.kwargs["device"].type == "cpu":
                n.kwargs = {**n.kwargs, "device": target}
        elif n.op == "get_attr":
            value = getattr(gm, n.target)
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                setattr(gm, n.target, value.to(target))
    gm.recompile()
    return gm
