"""Move device constants of a graph to the compute device.

Dynamo traces against the host copy of the model, so `x.device` is the constant `cpu` and
factory ops carry `device=cpu` (`torch.arange(n, device=cpu)`, `.to(cpu)`, `aten.full(..., device=cpu)`).
When bodies run on an accelerator we rewrite those constants to the target device BEFORE
AOTAutograd traces (with fake inputs on the target device), so the forward and backward graphs
pick the accelerator's kernels (e.g. flash attention instead of the CPU attention kernel).
Tensor constants held by the graph (`get_attr`) move too. A no-op when the device is the CPU.

    arange(8, device=cpu)   ->   arange(8, device=cuda:0)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from . import PassContext, graph_pass


def _retarget(value, target: torch.device):
    if isinstance(value, torch.device) and value.type == "cpu":
        return target
    if isinstance(value, (list, tuple)):
        return type(value)(_retarget(v, target) for v in value)
    return value


@graph_pass("retarget_device", uses=("device",))
def retarget_device(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    target = torch.device(ctx.device) if ctx.device is not None else torch.device("cpu")
    if target.type == "cpu":
        return gm
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method"):
            n.args = _retarget(n.args, target)
            n.kwargs = {k: (target if k == "device" and v in ("cpu", torch.device("cpu")) else _retarget(v, target))
                        for k, v in n.kwargs.items()}
        elif n.op == "get_attr":
            value = getattr(gm, n.target)
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                setattr(gm, n.target, value.to(target))
    gm.recompile()
    return gm
