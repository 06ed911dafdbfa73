"""Schedule executor: runs one direction (forward or backward) of a split program.

The top-level graph from `passes/split_segments.py` says which values flow between segments;
the schedule from `passes/schedule.py` says when weights move. The executor binds weight inputs
to device views from the pool (never to the host parameters), frees every value right after its
last use, sends gradients to the host as soon as a segment finalises them (runtime/
grad_offload.py: overlapping the next segment; all in `param.grad` when the backward returns),
and keeps the byte accounting that `megacompile.stats` reports.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.profiler import record_function

from ..errors import ResidencyError
from ..ir import BODY, FLAT_INDEX, MEMORY_PLAN, SCHEDULE, SEGMENT, WEIGHT_GROUP, Schedule, liveness, segment_calls
from . import grad_offload
from .weight_pool import DeviceWeightPool


@dataclass
class Call:
    body: fx.GraphModule
    inputs: list[tuple[str, int | None]]   # (value name, flat index if it is a weight)
    outputs: list[str]


def _nbytes(v) -> int:
    return v.untyped_storage().nbytes() if isinstance(v, torch.Tensor) else 0


class DirectionRunner:
    """Callable handed to AOTAutograd as the compiled forward or backward."""

    _boxed_call = True  # AOT passes the argument list itself, so we can drop saved tensors early

    def __init__(self, direction: str, top: fx.GraphModule, program):
        self.direction = direction
        self.program = program
        self.graph = top  # the split graph, kept for inspection
        self.schedule: Schedule = top.meta[SCHEDULE]
        self.device: torch.device = program.options.torch_device
        self.placeholders: list[tuple[str, int | None]] = []
        for n in top.graph.nodes:
            if n.op == "placeholder":
                weight = n.meta.get(FLAT_INDEX) if WEIGHT_GROUP in n.meta else None
                self.placeholders.append((n.name, weight))
        weight_names = {name: idx for name, idx in self.placeholders if idx is not None}
        self.calls: list[Call] = []
        bodies: dict[str, fx.GraphModule] = {}
        for n in segment_calls(top):
            body_name = n.meta.get(BODY, n.target)
            body = bodies.setdefault(body_name, top.get_submodule(body_name))
            inputs = [(a.name, weight_names.get(a.name)) for a in n.args]
            self.calls.append(Call(body, inputs, list(n.meta[SEGMENT]["outputs"])))
        self.bodies = bodies
        # planned intermediates per body (passes/memory_plan.py); 0 when that pass is disabled
        plan = top.meta.get(MEMORY_PLAN)
        self.plan = plan
        self.transient = {name: plan.transient.get(name, 0) if plan else 0 for name in bodies}
        self.body_of = [next(k for k, b in bodies.items() if b is c.body) for c in self.calls]
        self.runs = None   # body name -> what runs it (runtime/lowering.py), chosen at the first call
        out = next(n for n in top.graph.nodes if n.op == "output")
        self.output_spec = [a.name if isinstance(a, fx.Node) else a for a in out.args[0]]
        # last segment reading each value (graph outputs live to the end); gradients delivered to
        # param.grad leave the device at their grad_offload step: the memory plan's own analysis
        lives = liveness(top)
        self.last_use, self.offloaded = lives.last_use, lives.offloaded
        # profiler range names: megatrain.<direction>.<op>.<segment> (e.g. megatrain.forward.run.seg_3)
        self.labels = [f"megatrain.{direction}.{step.op}.{self.schedule.segments[step.segment].name}"
                       for step in self.schedule.steps]
        # the grad_offload step that completes each weight's gradient in this backward (the last,
        # should several segments send a contribution): from there an optimizer armed for the
        # backward may update it (runtime/adamw.py, overlap="backward")
        self.final_offload: dict[int, int] = {}
        for step in self.schedule.steps:
            if step.op == "grad_offload":
                for index, _ in self.schedule.segments[step.segment].grads:
                    self.final_offload[index] = step.segment

    # ------------------------------------------------------------------------------
    def __call__(self, args: list):
        grad_offload.check_guards()   # e.g. weights holding an armed optimizer's speculative updates
        program = self.program
        stats = program.begin(self.direction)
        pool: DeviceWeightPool = program.pool
        entries = program.entries
        env: dict[str, object] = {}
        host_args: dict[str, object] = {}
        stale = {}
        for (name, weight), value in zip(self.placeholders, args):
            if weight is not None:
                host_args[name] = value  # weights are read from the pool, never from here
                if isinstance(value, torch.nn.Parameter) and entries[weight].param_ref() is not value:
                    stale[weight] = value
            elif isinstance(value, torch.Tensor) and value.device != self.device:
                env[name] = value.to(self.device, non_blocking=True)
            else:
                env[name] = value
        if stale:
            # Dynamo reuses a compiled graph for another model of the same architecture (its guards
            # check shapes, not identities): the store entries follow the parameters passed now.
            entries = program.rebind(stale)
        rows = program.ensure_arenas()
        if self.runs is None:
            from .lowering import lower
            self.runs, program.lowering_records[self.direction] = lower(
                self.bodies, program.options.lowering, self.device)
        args.clear()  # boxed call: saved activations die at their last use, not at the end
        debug = program.options.debug_residency
        live_bytes = self._live(env) + pool.counters.resident_bytes
        peak = live_bytes
        grads_bytes = 0
        t0 = time.perf_counter()
        for label, step in zip(self.labels, self.schedule.steps):
            with record_function(label):   # a profiler trace shows each schedule op per segment
                k = step.segment
                seg = self.schedule.segments[k]
                if step.op == "prefetch":
                    pool.fetch(k, {i: entries[i] for i in seg.weights}, seg.routed, rows)
                elif step.op == "wait":
                    pool.wait(k)
                elif step.op == "evict":
                    pool.evict(k)
                elif step.op == "run":
                    call = self.calls[k]
                    views = pool.views(k) if seg.weights else {}
                    inputs = []
                    for name, weight in call.inputs:
                        if weight is None:
                            inputs.append(env[name])
                        else:
                            if debug:
                                pool.check_resident(k, weight, views.get(weight), entries[weight].name)
                            inputs.append(views[weight])
                    if debug:
                        _check_inputs_have_storage(inputs, call, k)
                    before = self._live(env) + pool.counters.resident_bytes
                    outs = self.runs[self.body_of[k]](*inputs)
                    for name, value in zip(call.outputs, outs):
                        env[name] = value
                    after = self._live(env) + pool.counters.resident_bytes
                    peak = max(peak, before + self.transient[self.body_of[k]], after)
                    for name, _ in call.inputs:
                        if self.last_use.get(name) == k:
                            env.pop(name, None)
                    for name in call.outputs:
                        if name not in self.last_use and name not in self.offloaded:
                            env.pop(name, None)
                elif step.op == "grad_offload":
                    items = []
                    for index, name in seg.grads:
                        grad = env.pop(name) if self.last_use.get(name, -1) <= k else env[name]
                        rows_fetched = pool.routed_rows.get(index) if index in seg.routed else None
                        items.append((entries[index], grad, rows_fetched,
                                      self.final_offload[index] == k))
                    grads_bytes += program.grads.offload(items)
        if self.direction == "backward":
            with record_function("megatrain.backward.grad_drain"):
                program.grads.drain()   # backward() returns with every gradient in param.grad
        result = []
        for spec in self.output_spec:
            if spec is None or not isinstance(spec, str):
                result.append(spec)
            elif spec in host_args:       # a saved weight: hand back the host parameter
                result.append(host_args[spec])
            elif spec in self.offloaded:  # already delivered to param.grad
                result.append(None)
            else:
                result.append(env[spec])
        program.end(self.direction, stats, peak=peak, d2h=grads_bytes, seconds=time.perf_counter() - t0)
        return tuple(result)

    @staticmethod
    def _live(env: dict) -> int:
        seen, total = set(), 0
        for v in env.values():
            if isinstance(v, torch.Tensor):
                key = v.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += _nbytes(v)
        return total


def _check_inputs_have_storage(inputs, call: Call, k: int) -> None:
    for (name, _), value in zip(call.inputs, inputs):
        if isinstance(value, torch.Tensor) and value.numel() > 0 and value.untyped_storage().nbytes() == 0:
            raise ResidencyError(f"input {name} of segment {k} has no storage (freed or evicted)")
