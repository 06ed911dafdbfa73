"""Keep layer checkpoints on the host between the forward and the backward.

The forward of a long sequence leaves one checkpoint per layer on the device for the backward
(its input hidden states, `layer recompute`): at 1M tokens of Llama-3-8B that is 8 GiB per
layer, 256 GiB for the model, more than any GPU holds. When the joint graph is partitioned
(backend.Program.partition) the backend marks which saved values to move (CHECKPOINTS: the
outputs of the embedding and the decoder layers, not the prologue's shared tables nor the
head's, which the backward needs first); this pass writes the moves into both schedule
programs as ops:

    forward:   getitem_3 = seg2[0]                   (layer 1's output, layer 2's checkpoint)
               offload = megatrain.offload(2, getitem_3)      (d2h stream; the device copy dies
               ...                                             after layer 2's forward reads it)
               return (..., offload, ...)            (the host copy is what AOT saves)

    backward:  reload = megatrain.reload(5, getitem_3, cuda)  (h2d stream, issued one segment
               seg4 = body(...)                                ahead: under segment 4's compute)
               seg5 = body(reload, ...)              (the run waits for its reloads)

With `reload_checkpoints="late"` (PassContext; the option's "auto" under a device budget the
step does not fit otherwise) the reload is issued just before segment 5's run instead: one
checkpoint on the device during a layer's backward instead of two, its copy not overlapped.

The executor runs them (runtime/checkpoints.py), the memory plan counts the device copy from
its reload to its last reader and never the host one, the simulator times them on their
streams. Without this pass (disabled) or without marks (an inference forward, a step that fits,
`offload_checkpoints="never"`), the programs are unchanged.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..cost_model import logical_bytes
from ..ir import CHECKPOINTS, SCHEDULE, SEGMENT, SCHEDULE_OPS, STEP, Step, op_of
from . import PassContext, graph_pass


def _segment_of_run(node: fx.Node) -> int:
    return node.meta[STEP].segment


def _offload(program: fx.GraphModule, positions) -> int:
    out = next(n for n in reversed(program.graph.nodes) if n.op == "output")
    values = list(out.args[0])
    moved = 0
    for p in sorted(positions):
        v = values[p]
        if not isinstance(v, fx.Node) or op_of(v) != "output_of":
            continue   # (not a segment's result: nothing to move)
        k = _segment_of_run(v.args[0])
        with program.graph.inserting_after(v):
            node = program.graph.call_function(SCHEDULE_OPS["offload"], (k, v))
        nbytes = logical_bytes(v.meta.get("val"))
        node.meta[STEP] = Step("offload", "d2h", k, nbytes)
        node.meta["val"] = torch.empty_like(v.meta["val"], device="cpu") if "val" in v.meta else None
        values[p] = node
        moved += nbytes
    out.args = (tuple(values) if isinstance(out.args[0], tuple) else values, *out.args[1:])
    return moved


def _reload(program: fx.GraphModule, positions, device, ahead: bool = True) -> int:
    nodes = list(program.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    runs = [n for n in nodes if op_of(n) == "run"]
    moved = 0
    for p in sorted(positions):
        ph = placeholders[p]
        readers = list(ph.users)
        first_run = min((runs.index(u) for u in readers if u in runs), default=None)
        if first_run is None:
            continue   # (read between segments only: leave it as is)
        consumer = runs[first_run]
        # issued before the run ahead of its consumer: the copy runs under that segment's compute
        before = runs[first_run - 1] if first_run > 0 and ahead else consumer
        before = min([before, *readers], key=nodes.index)
        with program.graph.inserting_before(before):
            node = program.graph.call_function(SCHEDULE_OPS["reload"], (_segment_of_run(consumer), ph, device))
        nbytes = logical_bytes(ph.meta.get("val"))
        node.meta[STEP] = Step("reload", "h2d", _segment_of_run(consumer), nbytes)
        val = ph.meta.get("val")
        node.meta["val"] = torch.empty_like(val, device=device) if isinstance(val, torch.Tensor) else None
        ph.replace_all_uses_with(node, delete_user_cb=lambda u: u is not node)
        moved += nbytes
    return moved


@graph_pass("offload_checkpoints", reads=(SEGMENT, SCHEDULE), writes=(SCHEDULE,),
            uses=("direction", "device", "reload_checkpoints"))
def offload_checkpoints(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    positions = gm.meta.get(CHECKPOINTS)   # (read when present: set by the partitioner, not a pass)
    if not positions:
        return gm
    program = gm.meta[SCHEDULE].program
    if ctx.direction == "forward":
        moved = _offload(program, positions)
    else:
        moved = _reload(program, positions, torch.device(ctx.device) if ctx.device is not None else "cpu",
                        ahead=ctx.reload_checkpoints != "late")
    program.graph.lint()
    program.recompile()
    ctx.records.append(("offload_checkpoints", ctx.direction, moved))
    return gm
