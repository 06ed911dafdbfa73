"""The `megatrain` TorchDynamo backend.

    torch.compile(model, backend="megatrain", options={"device": "cpu", "slots": 2})

Dynamo hands us one whole-model graph whose inputs include the real parameters. We
  1. capture: name every input and give each weight its decoder-layer group (`capture.py`);
  2. register the weights in the host store (fp32 masters, transfer copies; `runtime/store.py`);
  3. run AOTAutograd with a partition that saves only layer-boundary activations
     (`passes/recompute_boundaries.py` + torch's min-cut partitioner);
  4. split forward and backward into per-layer segments, dedupe identical bodies, and build the
     transfer schedule (`passes/`);
  5. return AOT's autograd wrapper around two schedule executors (`runtime/executor.py`).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
import unittest.mock
import weakref
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch.fx as fx
from torch._decomp import get_decompositions
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

from . import compile_start, distributed, dynamo_regions
from .capture import ModelCapture, capture_inputs, compiled_model_in_stack
from .compile_progress import CLOCK
from .options import Options
from .ir import (CHECKPOINTS, DYNAMO_REGIONS, GROUP, LAYER_REGIONS, MEMORY_PLAN, Compiled, DynamoRegions, LayerRegions,
                 compiled)
from .passes import PassContext, run_pipeline
from .passes.memory_plan import check_budget
from .errors import CannotFitError, MegatrainError
from .passes.inline_layer_regions import inline_layer_regions
from .passes.pipelines import DIRECTION_PASSES, DYNAMO_PASSES, JOINT_PASSES
from .passes.recompute_boundaries import recompute_whole_layer
from .passes.tile_mlp import MAX_BUDGET_TILES, TILE_GAIN
from .runtime import store
from .runtime.kernels import ops as _kernels  # noqa: F401  (the kernels of torch.ops.megatrain.*)
from .runtime.executor import DirectionRunner
from .runtime.checkpoints import CheckpointMover
from .runtime.grad_offload import GradOffloader
from .runtime.weight_pool import DeviceWeightPool

# softplus_backward's fake strides disagree with the CPU kernel (Gated-DeltaNet models).
DECOMPOSITIONS = get_decompositions([torch.ops.aten.softplus_backward])

_log = logging.getLogger("megatrain.compile")

_PROGRAMS: "weakref.WeakKeyDictionary[torch.nn.Module, list[Program]]" = weakref.WeakKeyDictionary()


class Program:
    """Everything compiled for one Dynamo graph: the runners, the pool and the step figures."""

    def __init__(self, capture: ModelCapture, params: dict[int, torch.nn.Parameter], options: Options,
                 runtime: bool = True):
        """`runtime=False`: compile only (plan, inspect): the compile artifacts (`compiled`), no
        weight store, pool, gradient path or runners."""
        self.options = options
        self.capture = capture
        device = options.torch_device
        names = {inp.index: inp.name for inp in capture.inputs}
        self.weight_nbytes = {i: p.numel() * p.element_size() for i, p in params.items()}   # (one transfer each)
        self.compiled: dict[str, Compiled] = {}
        self.runtime = runtime
        self.runners: dict[str, DirectionRunner] = {}
        # data parallelism: the node's ranks share one host copy of the state (megacompile/distributed.py)
        self.topo = distributed.current(device) if runtime and options.data_parallel == "auto" else distributed.SINGLE
        self.heap = None
        if runtime and options.plan_ranks > 1:
            from .errors import ConfigError
            raise ConfigError(f"option plan_ranks={options.plan_ranks} is for planning and inspection (megatrain "
                              "plan / inspect --gpus); a run takes its ranks from torchrun. Leave it out.")
        if self.topo.enabled:
            _check_data_parallel(options)
            from .runtime.node_heap import NodeHeap
            # one heap for every program of the job: a graph Dynamo recompiles (on one rank, for a
            # new shape) reuses what the first one placed there, and maps nothing new
            self.heap = self.topo.shared.setdefault("heap", NodeHeap(self.topo, "state"))
        if runtime:
            # (pinned later, when the schedule is known: host arenas per layer kind, runtime/host_arena.py)
            self.grads = GradOffloader(device, overlap=options.overlap_grads)
            self.entries = self._subscribe(store.register(params, names, pin=False, heap=self.heap))
            self.arena_rows: dict | None = None   # flat index -> host arena row, built at the first forward
            self.pool = DeviceWeightPool(device, options.slots)
            self.checkpoints = CheckpointMover(device)
        self.hardware = options.hardware_profile()
        self.pass_records: dict[str, list] = {}
        self.layer_regions: LayerRegions | None = None   # what AOTAutograd traced once per layer kind
        self.dynamo_regions: DynamoRegions | None = None   # what Dynamo traced once per layer kind
        self.lowering_records: dict[str, dict] = {}   # direction -> body -> eager | inductor, and why
        self.last_stats: dict[str, Any] = {}
        self._step: dict[str, Any] = {}
        self.last_run = 0.0

    def _dynamo_record(self, name: str, kind: str) -> list[int]:
        """What the Dynamo-graph pass `name` recorded as `kind` ([]: nothing)."""
        return next((r[2] for r in self.pass_records.get("dynamo", []) if r[:2] == (name, kind)), [])

    @property
    def tile_counts(self) -> list[int]:
        """The sequence tiles of each tiled region, as passes/tile_mlp.py recorded them ([]: none)."""
        return self._dynamo_record("tile_mlp", "tiled")

    @property
    def attention_chunks(self) -> list[int]:
        """The query chunks of each chunked attention, as passes/tile_attention.py recorded them."""
        return self._dynamo_record("tile_attention", "chunked")

    def rebind(self, params: dict[int, torch.nn.Parameter]) -> dict:
        """Point the weight entries at other parameters (same shapes) that this graph now runs with."""
        if self.topo.enabled:
            raise RuntimeError("megatrain: a compiled graph reused for another model's parameters under data "
                               "parallelism; compile each model separately")
        names = {i: self.entries[i].name for i in params}
        self.entries.update(self._subscribe(store.register(params, names, pin=False)))
        self.arena_rows = None   # the arenas follow the parameters too
        return self.entries

    def _subscribe(self, entries: dict) -> dict:
        """These weights' gradients go through this program's offloader (an optimizer finds it there)."""
        for entry in entries.values():
            entry.offloaders.add(self.grads)
        return entries

    def ensure_arenas(self) -> dict:
        """Host arena rows for the segments' weights (built once, at the first forward run).
        Without arenas (option host_arena=False), weights are pinned one by one on CUDA."""
        if self.arena_rows is None:
            from .runtime import host_arena
            pin = self.options.torch_device.type == "cuda"
            # rows follow the forward's segments; a backward segment uses a row when it reads all of it
            segments = self.runners["forward"].schedule.segments
            if self.options.host_arena:
                self.arena_rows = host_arena.build(segments, self.entries, pin, heap=self.heap)
            else:
                if pin:
                    for entry in self.entries.values():
                        host_arena._pin_alone(entry)
                self.arena_rows = {}
        return self.arena_rows

    def context(self, direction: str) -> PassContext:
        cap = self.capture
        return PassContext(
            direction=direction,
            num_groups=cap.num_layers + 2,
            flat_groups={inp.index: inp.group for inp in cap.inputs if inp.kind == "param"},
            device=self.options.torch_device,
            weight_nbytes=self.weight_nbytes,
            slots=self.options.slots,
            module_groups=self.capture.module_groups(),
            recompute_head=self.options.recompute_head,
            recompute=self.options.recompute,
            routed_experts=self.options.routed_experts,
            kernels=self.options.kernel_backend,
            logits=self.options.logits,
            mlp_tiles=self.options.mlp_tiles,
            reload_checkpoints="late" if self.options.reload_checkpoints == "late" else "ahead",
            layer_regions=self.options.layer_regions,
            data_parallel=self.topo.local if self.topo.enabled else self.options.plan_ranks,
            data_parallel_nodes=self.topo.nodes,
            device_budget=self.options.device_budget_bytes,
            hardware=self.hardware,
            disabled=self.options.disable_passes,
            debug=self.options.debug_passes,
        )

    # AOTAutograd hooks ------------------------------------------------------------
    def partition(self, joint: fx.GraphModule, joint_inputs, **kwargs):
        if not joint_inputs:   # a layer kind's subgraph (passes/layer_subgraphs.py), partitioned once per kind
            return min_cut_rematerialization_partition(recompute_whole_layer(joint), joint_inputs, **kwargs)
        ctx = self.context("joint")
        budget = self.options.device_budget_bytes
        offload = self.options.offload_checkpoints
        if budget is not None and (ctx.recompute == "selective" or offload == "auto"):
            peak = self._layer_boundary_peak(joint, joint_inputs, **kwargs)
            if offload == "auto":   # only when the step would not fit with its checkpoints on the device
                offload = "always" if peak > budget else "never"
            if ctx.recompute == "selective":
                # what selective recompute may keep is what the layer-boundary schedule leaves free
                # (nothing when even that needs its checkpoints on the host)
                ctx.selective_bytes = max(0, budget - peak) if offload != "always" else 0
        offload = "never" if offload == "auto" else offload
        joint = run_pipeline(joint, JOINT_PASSES, ctx)
        self.pass_records["joint"] = ctx.records
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        if offload == "always":
            mark_checkpoints(fw, bw)
        return fw, bw

    def _layer_boundary_peak(self, joint: fx.GraphModule, joint_inputs, **kwargs) -> int:
        """Planned peak device bytes of the step with layer-boundary recomputation only (a trial
        on a copy: the passes tag and rewrite the graph they get, and the real partition follows)."""
        ctx = self.context("joint")
        ctx.recompute = "layer"
        trial = fx.GraphModule(joint, copy.deepcopy(joint.graph))
        fw, bw = min_cut_rematerialization_partition(run_pipeline(trial, JOINT_PASSES, ctx), joint_inputs, **kwargs)
        peak = 0
        for direction, gm in (("forward", fw), ("backward", bw)):
            top = run_pipeline(gm, DIRECTION_PASSES, self.context(direction))
            peak = max(peak, top.meta[MEMORY_PLAN].peak_bytes if MEMORY_PLAN in top.meta else 0)
        return peak

    def compile(self, direction: str, gm: fx.GraphModule, *, training: bool = True) -> DirectionRunner:
        ctx = self.context(direction)
        top = run_pipeline(gm, DIRECTION_PASSES, ctx)
        self.pass_records[direction] = ctx.records
        done = self.compiled[direction] = compiled(direction, top)
        CLOCK.stage(f"{direction} lowered at {{at}}")
        if direction == "backward" or not training:  # a training step is checked once both exist
            check_budget({d: c.plan for d, c in self.compiled.items() if c.plan is not None},
                         self.options.device_budget_bytes, self.options.slots)
        if not self.runtime:
            return _compile_only
        runner = self.runners[direction] = DirectionRunner(done, self)
        return runner

    # step accounting ----------------------------------------------------------------
    def begin(self, direction: str) -> dict:
        self.last_run = time.monotonic()
        if direction == "forward":
            self.pool.reset_counters()
            if self.options.torch_device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.options.torch_device)
            self._step = {"peak_device_bytes": 0, "d2h_bytes": 0, "forward_seconds": 0.0,
                          "backward_seconds": 0.0}
        return self._step

    def end(self, direction: str, step: dict, *, peak: int, d2h: int, seconds: float) -> None:
        if self.options.torch_device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.options.torch_device)
        step["peak_device_bytes"] = max(step["peak_device_bytes"], peak)
        step["d2h_bytes"] += d2h
        step[f"{direction}_seconds"] = seconds
        self.last_stats = self.stats_now()

    def stats_now(self) -> dict[str, Any]:
        fw = self.compiled.get("forward")
        bw = self.compiled.get("backward")
        layer_groups = range(1, self.capture.num_layers + 1)

        def layer_bodies(done):
            if done is None:
                return 0
            return len({done.body_of[k] for k, seg in enumerate(done.schedule.segments) if seg.group in layer_groups})

        moved = {}
        if self.runtime:   # (what the runtime moved and holds)
            moved = {"peak_device_weight_bytes": self.pool.counters.peak_resident_bytes,
                     "h2d_bytes": self.pool.counters.h2d_bytes,
                     "h2d_copies": self.pool.counters.h2d_copies,
                     "arena_weights": len(self.arena_rows or ()),
                     "grad_slab_bytes": self.grads.slabs.nbytes if self.grads.slabs is not None else 0}
        return {
            "device": str(self.options.torch_device),
            "layers": self.capture.num_layers,
            "slots": self.options.slots,
            "peak_device_bytes": self._step.get("peak_device_bytes", 0),
            **moved,
            "inductor_bodies": sum(r.get("lowering") == "inductor" for recs in self.lowering_records.values()
                                   for r in recs.values()),
            "d2h_bytes": self._step.get("d2h_bytes", 0),
            "distinct_layer_bodies": layer_bodies(fw),
            "distinct_bodies": {"forward": len(fw.bodies) if fw else 0,
                                "backward": len(bw.bodies) if bw else 0},
            "distinct_backward_layer_bodies": layer_bodies(bw),
            "segments": {"forward": len(fw.body_of) if fw else 0, "backward": len(bw.body_of) if bw else 0},
            "forward_seconds": self._step.get("forward_seconds", 0.0),
            "backward_seconds": self._step.get("backward_seconds", 0.0),
            "weight_bytes": sum(self.weight_nbytes.values()),
            # stacked expert weights whose rows are fetched by routing (options routed_experts)
            "routed_weights": len({i for seg in fw.schedule.segments for i in seg.routed}) if fw else 0,
        }


def _check_data_parallel(options: Options) -> None:
    """What data parallelism does not run with yet (a ConfigError before any work)."""
    from .errors import ConfigError
    if not options.host_arena:
        raise ConfigError("option host_arena=False with data parallelism: each rank's part of a layer is a slice of "
                          "its arena row. Leave host_arena on.")
    if options.routed_experts:
        raise ConfigError("option routed_experts=True with data parallelism is not supported yet: each rank would "
                          "fetch other experts. Set routed_experts=False.")
    if "data_parallel" in options.disable_passes:
        raise ConfigError("disable_passes contains 'data_parallel' while torch.distributed runs several ranks: every "
                          "rank would fetch and update weights it does not own. Set option data_parallel='off' to "
                          "run the ranks independently instead.")


def mark_checkpoints(fw: fx.GraphModule, bw: fx.GraphModule) -> None:
    """Mark the layer checkpoints of a partitioned step (passes/offload_checkpoints.py moves
    them): the saved values the embedding and the decoder layers but the last compute (GROUP 0
    .. the last layer - 1); not the prologue's tables (every layer
    reads them) nor the last layer's or the head's (the backward starts with them). The
    partitioner names each backward placeholder of a saved value after its forward node."""
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outputs = list(out.args[0])
    groups = [n.meta.get(GROUP) for n in fw.graph.nodes if isinstance(n.meta.get(GROUP), int)]
    head = max(groups, default=-1)
    saved = {n.name: i for i, n in enumerate(n for n in bw.graph.nodes if n.op == "placeholder")}
    fw_pos, bw_pos = set(), set()
    for p, v in enumerate(outputs):
        if not isinstance(v, fx.Node) or v.name not in saved or v.op == "placeholder":
            continue
        val, group = v.meta.get("val"), v.meta.get(GROUP)
        if not isinstance(val, torch.Tensor) or not isinstance(group, int) or not 0 <= group < head - 1:
            continue   # (group head - 1: the last layer's output, the head's input, read first by the backward)
        fw_pos.add(p)
        bw_pos.add(saved[v.name])
    if fw_pos:
        fw.meta[CHECKPOINTS], bw.meta[CHECKPOINTS] = frozenset(fw_pos), frozenset(bw_pos)


def _compile_only(*_args):
    raise RuntimeError("this megatrain program was compiled for inspection (plan/inspect) and does not run")


def megatrain_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, runtime: bool = True,
                      **_ignored):
    """TorchDynamo backend entry point (registered as "megatrain" via entry points). `runtime=False`
    (plan, inspect): compile to the artifacts (`Program.compiled`) without building the runtime."""
    opts = Options.from_mapping(options)   # (disable_passes checked there: check_pipelines, before any work)
    compile_start.register()  # again: torch._dynamo.reset() drops it
    if runtime and not compile_start.prepared_this_compile():
        root = compiled_model_in_stack()   # (the model torch.compile was given; None: a function)
        changed = compile_start.prepare_late(root, opts.attention) if root is not None else None
        if changed:
            _log.info("megatrain: %s was traced without megatrain's compile-start callback (torch._dynamo.reset() "
                     "drops it); prepared now (%s), traced again", type(root).__name__, changed)
            compile_start.retrace(f"megatrain prepared the model: {changed}")
    capture, params = capture_inputs(gm, example_inputs, {"options": dict(options or {})},
                                     prepared=compile_start.prepared_this_compile())
    _check_dynamo_regions(capture, gm)
    CLOCK.stage(f"traced at {{at}}: {capture.num_layers} decoder layers; AOTAutograd differentiates and "
                "partitions the step")
    if runtime:
        compile_start.late(capture.root, opts.attention)
    program = Program(capture, params, opts, runtime=runtime)
    with compile_start.gc_paused():
        compiled = _compile_within_budget(program, gm, example_inputs)
    _PROGRAMS.setdefault(capture.root, []).append(program)
    return compiled


def _check_dynamo_regions(capture: ModelCapture, gm: fx.GraphModule) -> None:
    """Where Dynamo traced each layer kind once (dynamo_regions.py): a trace that read an attribute
    the kind key leaves out (`layer_idx`, different in every layer) cannot be reused for the
    other layers of its kind; the model is traced again whole."""
    if not gm.graph.find_nodes(op="call_function", target=invoke_subgraph):
        return
    context = torch._guards.TracingContext.try_get()
    names = [g.name for g in context.guards_context.dynamo_guards] if context is not None else []
    read = dynamo_regions.read_per_layer_attributes(names, capture.layer_prefix)
    if read:
        _trace_whole(capture, f"the layer's trace reads {read[0]}, which differs between layers of one kind")


def _trace_whole(capture: ModelCapture, why: str) -> None:
    root = capture.root
    dynamo_regions.uninstall(root, root.get_submodule(capture.layer_prefix), why)
    _log.info("megatrain: Dynamo traces %s again without layer regions: %s", type(root).__name__, why)
    compile_start.retrace(f"megatrain: {why}")


def _compile_within_budget(program: Program, gm: fx.GraphModule, example_inputs):
    """Compile the step; under `device_budget`, a step that does not fit is compiled again with
    what costs least time first:
      1. (`mlp_tiles: "auto"`) twice the sequence tiles (passes/tile_mlp.py), again while a
         doubling lowers the planned peak by TILE_GAIN or more; the fewest tiles that fit are
         kept (each tile more runs smaller matmuls);
      2. (`reload_checkpoints: "auto"`, with the checkpoints on the host) at the tiles that went
         lowest, each checkpoint reloaded just before the backward that reads it, not a segment
         ahead (passes/offload_checkpoints.py).
    (Checkpoint offload itself is chosen inside each compile: Program.partition.) The refusal
    with the lowest planned peak is raised when none fits.
    """
    opts = program.options
    tiles_auto, reload_auto = opts.mlp_tiles == "auto", opts.reload_checkpoints == "auto"
    if opts.device_budget is None or not (tiles_auto or reload_auto):
        return _compile_graph(program, gm, example_inputs)
    source = _graph_copy(gm)   # (the passes rewrite the graph they get)

    def attempt(**changes):
        program.options = dataclasses.replace(opts, **changes)
        program.compiled.clear()
        program.runners.clear()
        compiled = _compile_graph(program, _graph_copy(source), example_inputs)
        _log.info("megatrain: the step fits device_budget=%s with %s (planned peak %d bytes)", opts.device_budget,
                  ", ".join(f"{k}={v}" for k, v in changes.items()), _planned_peak(program))
        return compiled

    try:
        return _compile_graph(program, gm, example_inputs)
    except CannotFitError as refused:
        best, peak = refused, _planned_peak(program)
    best_peak, best_tiles = peak, (tiles := max(_tiles_used(program), 1))
    offloaded = _offloaded(program)
    while tiles_auto and tiles < MAX_BUDGET_TILES:
        tiles *= 2
        try:
            return attempt(mlp_tiles=tiles)
        except CannotFitError as refused:
            now = _planned_peak(program)
            offloaded = _offloaded(program)
            if now < best_peak:
                best, best_tiles, best_peak = refused, tiles, now
            if now > peak * (1 - TILE_GAIN) or _tiles_used(program) < tiles:   # (or no more tokens to tile)
                break
            peak = now
    if reload_auto and offloaded:
        try:
            return attempt(**({"mlp_tiles": best_tiles} if tiles_auto else {}), reload_checkpoints="late")
        except CannotFitError as refused:
            if _planned_peak(program) < best_peak:
                best = refused
    program.options = opts
    raise best


def _offloaded(program: Program) -> bool:
    """Whether the last compile keeps layer checkpoints on the host."""
    return any(c.plan is not None and c.plan.host_checkpoint_bytes for c in program.compiled.values())


def _planned_peak(program: Program) -> int:
    return max((c.plan.peak_bytes for c in program.compiled.values() if c.plan is not None), default=0)


def _tiles_used(program: Program) -> int:
    return max(program.tile_counts, default=1)


def _graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a Dynamo graph module whose nodes the passes can rewrite (node metas copied
    shallowly: their fake values are shared, not re-made)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    out = fx.GraphModule(gm, graph)
    out.meta.update(gm.meta)
    return out


def _compile_graph(program: Program, gm: fx.GraphModule, example_inputs):
    """The Dynamo passes, then AOTAutograd with the program's partition and direction compilers
    (per layer kind where the regions form; else, and where torch cannot trace a layer subgraph,
    over the whole graph)."""
    trace_inputs = example_inputs
    # fused_kernels is a no-op unless the kernels resolve to Triton, fused_lm_loss unless
    # logits="drop", retarget_device when the device is the CPU. Off the CPU, forward/backward are
    # traced as they will run: device
    # constants and fake inputs on the accelerator, so AOTAutograd selects its kernels (the host
    # copy stays the source).
    ctx = program.context("dynamo")
    gm = run_pipeline(gm, DYNAMO_PASSES, ctx)
    program.dynamo_regions = gm.meta.get(DYNAMO_REGIONS)
    if program.dynamo_regions is not None and program.dynamo_regions.retrace:
        _trace_whole(program.capture, program.dynamo_regions.retrace)
    if program.dynamo_regions is not None and program.dynamo_regions.calls:
        _log.info("megatrain: Dynamo traced %d layer kinds once each for %d decoder layers",
                  program.dynamo_regions.kinds, program.dynamo_regions.calls)
    program.pass_records["dynamo"] = ctx.records
    program.layer_regions = gm.meta.get(LAYER_REGIONS)
    _log_regions(program.layer_regions)
    device = program.options.torch_device
    if device.type != "cpu":
        trace_inputs = fake_inputs_on(gm, example_inputs, device)
    try:
        compiled = _differentiate(program, gm, trace_inputs)
    except MegatrainError:
        raise
    except Exception as e:   # torch cannot trace a layer subgraph: the whole graph, as before
        regions = program.layer_regions
        if regions is None or not regions.kinds:
            raise
        why = f"AOTAutograd failed on the layer subgraphs ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        _log.info("megatrain: %s; the whole graph is traced instead", why)
        gm = run_pipeline(gm, [inline_layer_regions], program.context("dynamo"))
        program.layer_regions = LayerRegions(off=why)
        program.compiled.clear()
        program.runners.clear()
        compiled = _differentiate(program, gm, trace_inputs)
    return compiled


def _differentiate(program: Program, gm: fx.GraphModule, trace_inputs):
    """AOTAutograd over the Dynamo graph with the program's partition and direction compilers."""
    # Lower the backward right away (not at the first backward call): errors such as a budget
    # that cannot fit surface before any training work, and the step's plan is complete.
    with functorch_config.patch(force_non_lazy_backward_lowering=True), _regions_checked(program.layer_regions):
        return aot_module_simplified(
            gm,
            trace_inputs,
            fw_compiler=lambda g, _inputs: program.compile("forward", g),
            bw_compiler=lambda g, _inputs: program.compile("backward", g),
            inference_compiler=lambda g, _inputs: program.compile("forward", g, training=False),
            partition_fn=program.partition,
            decompositions=DECOMPOSITIONS,
        )


@contextlib.contextmanager
def _regions_checked(regions: LayerRegions | None):
    """AOTAutograd's trace with our layer subgraphs: torch's invoke_subgraph re-traces a subgraph
    at every call under autograd to look for writes to its inputs (0.12 s a layer: 15 s at 64
    layers); layer_subgraphs.py formed none that write to their inputs, so that check is off
    while this graph is traced (restored after)."""
    if regions is None or not regions.kinds:
        yield
        return
    with unittest.mock.patch.object(invoke_subgraph, "_supports_training_input_mutation", True):
        yield


def _log_regions(regions: LayerRegions | None) -> None:
    """Which path AOTAutograd takes, and why (passes/layer_subgraphs.py)."""
    if regions is None:
        return
    if regions.off:
        _log.info("megatrain: AOTAutograd traces the whole graph: %s", regions.off)
        return
    layers = sum(len(g) for g in regions.kinds.values())
    _log.info("megatrain: %d decoder layers in %d layer kind(s), each traced once by AOTAutograd", layers,
              len(regions.kinds))


def fake_inputs_on(gm: fx.GraphModule, example_inputs, device: torch.device) -> list:
    """Fake copies of the graph inputs on `device`, keeping Dynamo's symbolic sizes."""
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = []
    with fake_mode:
        for node, real in zip(placeholders, example_inputs):
            ev = node.meta.get("example_value")
            if isinstance(real, torch.Tensor) and isinstance(ev, torch.Tensor):
                fake = torch.empty_strided(ev.size(), ev.stride(), dtype=ev.dtype, device=device)
                out.append(fake.requires_grad_(real.requires_grad))
            else:
                out.append(ev if ev is not None else real)
    return out


def programs_of(model: torch.nn.Module) -> list[Program]:
    root = getattr(model, "_orig_mod", model)
    return _PROGRAMS.get(root, [])


def stats(model: torch.nn.Module) -> dict[str, Any]:
    """Figures of the last training step of a model compiled with backend="megatrain"."""
    programs = programs_of(model)
    if not programs:
        raise ValueError("stats(): this model has not run under torch.compile(backend='megatrain') yet.")
    latest = max(programs, key=lambda p: p.last_run)
    return {**latest.last_stats, "compiled_graphs": len(programs)}
