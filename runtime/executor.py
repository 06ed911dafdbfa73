"""Schedule executor: runs one direction's schedule program (forward or backward).

The program (`megacompile/ir.py` `schedule_program`, built by `passes/schedule.py`) is the split
graph with its transfers written out as ops around the body calls:

    prefetch(1, [w...]) -> wait(1) -> seg1 = body_a(x, w...) -> getitem -> evict(1) -> prefetch(3, ...)
    ... -> seg7 = body_b(...) -> grad_offload(7, [g...]) -> evict(7) ...
    (with checkpoints on the host) getitem_3 = seg2[0] -> offload(2, getitem_3) ... | reload(5, p) -> seg5
    (data parallel) prefetch_shard(1, [w...]) -> all_gather(1) ... reduce_scatter(7, [g...]) -> grad_offload(7, ...)

Running it is walking its nodes in order through one table of per-op handlers (`HANDLERS`
below): a prefetch/wait/evict is the weight pool's, a grad_offload the gradient offloader's
(runtime/grad_offload.py: overlapping the next segment; all in `param.grad` when the backward
returns), a prefetch_shard/all_gather the pool's over the node's process group, a reduce_scatter
this module's (fp32, the rank's parts kept for its grad_offload), an offload/reload the
checkpoint mover's (runtime/checkpoints.py: host copies of layer checkpoints, which are not
device bytes), a run calls the lowered body with its weight inputs
bound to device views from the pool (never the host parameters). Every value is freed right after its last reader (one
liveness analysis, `ir.liveness`, the memory plan's too); a run that is a value's last reader
hands it over (boxed call): the body frees it at its own last reader inside, and the byte accounting that
`megacompile.stats` reports is kept here. An op a later pass adds needs a handler here, in the
memory plan and in the simulator: the program is refused up front otherwise.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.profiler import record_function

from ..distributed import collective, reduce_scatter_into
from ..errors import ResidencyError
from ..ir import FLAT_INDEX, SEGMENT, STEP, WEIGHT_GROUP, Compiled, Schedule, dispatch, host_values, liveness
from .weight_pool import DeviceWeightPool


@dataclass
class Call:
    body: fx.GraphModule
    inputs: list[tuple[str, int | None]]   # (value name, flat index if it is a weight)
    outputs: list[str]
    consumed: tuple[str, ...] = ()   # inputs whose last reader is this call: the body frees them


def _nbytes(v) -> int:
    return v.untyped_storage().nbytes() if isinstance(v, torch.Tensor) else 0


class _Run:
    """One call's state: the values by name, the host weights, and the accounting."""

    def __init__(self, program, env: dict, host_args: dict, entries, rows, host: dict):
        self.program, self.env, self.host_args, self.entries, self.rows = program, env, host_args, entries, rows
        self.host = host   # values on the host: offloaded checkpoints (not device bytes)
        self.shards: dict[int, dict] = {}   # data parallelism: segment -> this rank's summed gradient parts
        self.pool: DeviceWeightPool = program.pool
        self.debug = program.options.debug_residency
        self.peak = 0
        self.grads_bytes = 0


class DirectionRunner:
    """Callable handed to AOTAutograd as the compiled forward or backward."""

    _boxed_call = True  # AOT passes the argument list itself, so we can drop saved tensors early

    def __init__(self, compiled: Compiled, program):
        direction, top = compiled.direction, compiled.graph
        self.direction = direction
        self.program = program
        self.compiled = compiled
        self.graph = top  # the split graph, kept for inspection
        self.schedule: Schedule = compiled.schedule
        self.device: torch.device = program.options.torch_device
        self.placeholders: list[tuple[str, int | None]] = []
        for n in top.graph.nodes:
            if n.op == "placeholder":
                weight = n.meta.get(FLAT_INDEX) if WEIGHT_GROUP in n.meta else None
                self.placeholders.append((n.name, weight))
        weight_names = {name: idx for name, idx in self.placeholders if idx is not None}
        self.bodies, self.body_of = compiled.bodies, compiled.body_of
        # the values die by the memory plan's own analysis (ir.liveness)
        lives = liveness(self.schedule.program)
        position = {n: i for i, n in enumerate(self.schedule.program.graph.nodes)}
        # each run as the program writes it (a pass may have rerouted an input, e.g. through a
        # checkpoint reload; the run node carries its segment's SEGMENT tag), and the inputs it
        # reads last, which it hands to the body
        runs = sorted((n for n in self.schedule.program.graph.nodes if STEP in n.meta and n.meta[STEP].op == "run"),
                      key=lambda n: n.meta[STEP].segment)
        self.calls = [Call(compiled.body(n.meta[STEP].segment), [(a.name, weight_names.get(a.name)) for a in n.args],
                           list(n.meta[SEGMENT]["outputs"]),
                           tuple({a.name for a in n.args if a.name not in weight_names}
                                 & set(lives.frees.get(position[n], ()))))
                      for n in runs]
        # planned bytes of each segment's body as it runs (passes/memory_plan.py); 0 when that
        # pass is disabled
        self.plan = compiled.plan
        self.run_transient = self.plan.run_transient if self.plan is not None else {}
        self.runs = None   # body name -> what runs it (runtime/lowering.py), chosen at the first call
        # the program's nodes as (profiler range, handler, node, values dead after it): one table
        # of handlers
        self.offloaded = lives.offloaded
        self.host_names = host_values(self.schedule.program)   # (kept out of env: not device bytes)
        self.ops = []
        for i, n, handler in dispatch(self.schedule.program, HANDLERS):
            if n.op in ("placeholder", "output"):
                continue
            step = n.meta.get(STEP)
            # profiler range names: megatrain.<direction>.<op>.<segment> (e.g. megatrain.forward.run.seg3)
            label = f"megatrain.{direction}.{step.op}.{self.schedule.segments[step.segment].name}" if step else None
            self.ops.append((label, handler, n, lives.frees.get(i, ())))
        out = next(reversed(self.schedule.program.graph.nodes))
        self.output_spec = [a.name if isinstance(a, fx.Node) else a for a in out.args[0]]
        # the grad_offload step that completes each weight's gradient in this backward (the last,
        # should several segments send a contribution): from there an optimizer armed for the
        # backward may update it (runtime/adamw.py, overlap="backward")
        self._layouts: dict[int, tuple] = {}   # data parallelism: segment -> its gradients' shard layout
        self.final_offload: dict[int, int] = {}
        for step in self.schedule.steps:
            if step.op == "grad_offload":
                for index, _ in self.schedule.segments[step.segment].grads:
                    self.final_offload[index] = step.segment

    # ------------------------------------------------------------------------------
    def __call__(self, args: list):
        program = self.program
        program.grads.check_guards()   # e.g. weights holding an armed optimizer's speculative updates
        stats = program.begin(self.direction)
        entries = program.entries
        env: dict[str, object] = {}
        host_args: dict[str, object] = {}
        host: dict[str, object] = {}
        stale = {}
        for (name, weight), value in zip(self.placeholders, args):
            if name in self.host_names:
                host[name] = value   # an offloaded checkpoint: its reload brings it back
            elif weight is not None:
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
        run = _Run(program, env, host_args, entries, rows, host)
        run.peak = self._live(env) + run.pool.counters.resident_bytes
        t0 = time.perf_counter()
        for label, handler, node, dead in self.ops:
            if label is None:
                handler(self, run, node)
            else:
                with record_function(label):   # a profiler trace shows each schedule op per segment
                    handler(self, run, node)
            for name in dead:
                env.pop(name, None)
                host.pop(name, None)
        if self.host_names and self.direction == "forward":
            with record_function("megatrain.forward.checkpoints_done"):
                program.checkpoints.finish()   # what AOT saves is complete host copies
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
            elif spec in host:            # an offloaded checkpoint
                result.append(host[spec])
            else:
                result.append(env[spec])
        program.end(self.direction, stats, peak=run.peak, d2h=run.grads_bytes, seconds=time.perf_counter() - t0)
        return tuple(result)

    # the handlers: one per program op --------------------------------------------------
    def _prefetch(self, run: _Run, node: fx.Node) -> None:
        k = node.meta[STEP].segment
        seg = self.schedule.segments[k]
        run.pool.fetch(k, {i: run.entries[i] for i in seg.weights}, seg.routed, run.rows)

    # data parallelism (passes/data_parallel.py): this rank's part, then the collectives ----------
    def _prefetch_shard(self, run: _Run, node: fx.Node) -> None:
        k = node.meta[STEP].segment
        seg = self.schedule.segments[k]
        topo = self.program.topo
        run.pool.fetch(k, {i: run.entries[i] for i in seg.weights}, seg.routed, run.rows,
                       shard=(topo.local, topo.local_rank))

    def _all_gather(self, run: _Run, node: fx.Node) -> None:
        k = node.meta[STEP].segment
        topo = self.program.topo
        with collective(topo, f"the all-gather of {self.direction} segment {self.schedule.segments[k].name}"):
            run.pool.gather(k, topo.node_group, topo.local_rank)

    def _reduce_scatter(self, run: _Run, node: fx.Node) -> None:
        """Sum the segment's gradients over the node's ranks in fp32; keep this rank's parts.

            flat (fp32)   | rank 0's pieces of g0, g1, ... | pad | rank 1's pieces ... | pad |
            reduce-scatter (sum)  ->  this rank's chunk: its pieces, summed over the ranks
        """
        k = node.meta[STEP].segment
        seg = self.schedule.segments[k]
        topo = self.program.topo
        layout, chunk = self._shard_layout(k, run.entries)
        grads = [run.env[name] for _, name in seg.grads]
        device = grads[0].device if grads else self.device
        flat = torch.zeros(topo.local * chunk, dtype=torch.float32, device=device)
        for r, pieces in enumerate(layout):
            for j, a, b, off in pieces:
                flat[r * chunk + off: r * chunk + off + b - a].copy_(grads[j].reshape(-1)[a:b])
        if self.program.options.grad_reduce == "mean":
            flat.div_(topo.world)
        mine = flat[topo.local_rank * chunk:(topo.local_rank + 1) * chunk]
        with collective(topo, f"the reduce-scatter of backward segment {seg.name}"):
            reduce_scatter_into(mine, flat, topo.node_group)
        if topo.nodes > 1:   # HSDP: the same part on the other nodes (replicas of this rank's state)
            import torch.distributed as dist
            with collective(topo, f"the all-reduce across nodes of backward segment {seg.name}"):
                dist.all_reduce(mine, group=topo.replicate_group)
        owned = {j: (a, b, mine[off: off + b - a]) for j, a, b, off in layout[topo.local_rank]}
        run.shards[k] = owned

    def _shard_layout(self, k: int, entries) -> tuple[list, int]:
        """Per rank, where each of its pieces of segment k's gradients sits in its chunk."""
        if k not in self._layouts:
            seg = self.schedule.segments[k]
            ranks = self.program.topo.local
            layout = [[] for _ in range(ranks)]
            for r in range(ranks):
                off = 0
                for j, (index, _) in enumerate(seg.grads):
                    for a, b in entries[index].shards[r]:
                        layout[r].append((j, a, b, off))
                        off += b - a
            chunk = max((sum(b - a for _, a, b, _ in pieces) for pieces in layout), default=0)
            self._layouts[k] = (layout, max(chunk, 1))
        return self._layouts[k]

    def _wait(self, run: _Run, node: fx.Node) -> None:
        k = node.meta[STEP].segment
        if not self.program.topo.enabled:
            run.pool.wait(k)
            return
        with collective(self.program.topo, f"the all-gather of {self.direction} segment "
                                           f"{self.schedule.segments[k].name}"):
            run.pool.wait(k)   # (and for its collectives)

    def _evict(self, run: _Run, node: fx.Node) -> None:
        run.pool.evict(node.meta[STEP].segment)

    def _run(self, run: _Run, node: fx.Node) -> None:
        k = node.meta[STEP].segment
        call, env, pool = self.calls[k], run.env, run.pool
        views = pool.views(k) if self.schedule.segments[k].weights else {}
        inputs = []
        for name, weight in call.inputs:
            if weight is None:
                inputs.append(env[name])
            else:
                if run.debug:
                    pool.check_resident(k, weight, views.get(weight), run.entries[weight].name)
                inputs.append(views[weight])
        if run.debug:
            _check_inputs_have_storage(inputs, call, k)
        self.program.checkpoints.ready(inputs)   # (reloads this body reads: copied in by now)
        for name in call.consumed:   # (the body holds the only reference: freed at its last reader there)
            del env[name]
        before = self._live(env) + pool.counters.resident_bytes
        outs = self.runs[self.body_of[k]](inputs)   # (boxed: the body empties `inputs`)
        for name, value in zip(call.outputs, outs):   # (the program's getitems of this call: bound here)
            env[name] = value
        after = self._live(env) + pool.counters.resident_bytes
        run.peak = max(run.peak, before + self.run_transient.get(k, 0), after)

    def _grad_offload(self, run: _Run, node: fx.Node) -> None:
        k = node.meta[STEP].segment
        seg = self.schedule.segments[k]
        if k in run.shards:   # data parallelism: this rank's summed parts only
            owned = run.shards.pop(k)
            items = []
            for j, (index, _) in enumerate(seg.grads):
                part, piece = (owned[j][2], owned[j][:2]) if j in owned else (None, None)
                items.append((run.entries[index], part, piece, self.final_offload[index] == k))
            run.grads_bytes += self.program.grads.offload_pieces(items)
            return
        items = []
        for index, name in seg.grads:
            rows_fetched = run.pool.routed_rows.get(index) if index in seg.routed else None
            items.append((run.entries[index], run.env[name], rows_fetched, self.final_offload[index] == k))
        run.grads_bytes += self.program.grads.offload(items)

    def _offload(self, run: _Run, node: fx.Node) -> None:
        run.host[node.name] = self.program.checkpoints.offload(run.env[node.args[1].name])

    def _reload(self, run: _Run, node: fx.Node) -> None:
        run.env[node.name] = self.program.checkpoints.reload(run.host[node.args[1].name])   # (a host value)

    def _value(self, run: _Run, node: fx.Node) -> None:
        """Any other op between segments, computed as the graph says."""
        def value(a):
            return run.env[a.name] if a.name in run.env else run.host_args[a.name]
        args = fx.map_arg(node.args, value)
        self.program.checkpoints.ready(a for a in args if isinstance(a, torch.Tensor))
        run.env[node.name] = node.target(*args, **fx.map_arg(node.kwargs, value))

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


def _bound_by_its_run(runner, run, node) -> None:
    """An element of a body's result: the run handler bound it by name."""


def _nothing(runner, run, node) -> None:
    pass


#: program op -> its handler (called as handler(runner, run, node))
HANDLERS = {"prefetch": DirectionRunner._prefetch, "wait": DirectionRunner._wait,
            "evict": DirectionRunner._evict, "run": DirectionRunner._run,
            "grad_offload": DirectionRunner._grad_offload, "offload": DirectionRunner._offload,
            "reload": DirectionRunner._reload, "output_of": _bound_by_its_run,
            "value": DirectionRunner._value, "placeholder": _nothing, "output": _nothing,
            "prefetch_shard": DirectionRunner._prefetch_shard, "all_gather": DirectionRunner._all_gather,
            "reduce_scatter": DirectionRunner._reduce_scatter}


def _check_inputs_have_storage(inputs, call: Call, k: int) -> None:
    for (name, _), value in zip(call.inputs, inputs):
        if isinstance(value, torch.Tensor) and value.numel() > 0 and value.untyped_storage().nbytes() == 0:
            raise ResidencyError(f"input {name} of segment {k} has no storage (freed or evicted)")
