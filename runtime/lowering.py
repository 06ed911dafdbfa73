"""Lowering of the segment bodies: run as FX graphs of aten ops, or compiled by Inductor
(generated Triton kernels on CUDA, C++ on the CPU), chosen per distinct body.

    option lowering="eager"      every body runs its aten ops one by one (no compile time)
    option lowering="inductor"   every body that Inductor compiles runs compiled
    option lowering="auto"       on CUDA: compile each body, time both versions on random inputs
                                 of its traced shapes, keep the faster; on the CPU: "eager"

Bodies are deduplicated (passes/dedupe_bodies.py), so this costs one Inductor compile per
layer kind and direction, not per layer. It happens at a runner's first call, outside
AOTAutograd's tracing, on real tensors. A body keeps its eager form when Inductor cannot
compile it or a random input cannot drive it (data-dependent routing), and when its shapes are
symbolic (a compiled body is specialised to one shape; Dynamo's dynamic shapes would need a
recompile per size); `Program.lowering_records` says which form each body got and why, with
the measured times. The numerics are Inductor's: fused elementwise ops round once instead of
per op, so results match eager within floating-point reassociation, not bit for bit.

Every body runs with the boxed calling convention: it takes its inputs as one list and empties
it, so an input the caller no longer holds (the executor drops the values whose last reader is
this body) dies at its last reader inside the body, not when the body returns:

    outs = run([checkpoint, grad_out, w...])   # grad_out freed after the MLP's backward reads it
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch
import torch.fx as fx

from ..ir import materialize

MODES = ("auto", "eager", "inductor")

# (the compile's progress lines: megacompile/compile_progress.py logs the stages on this logger)
log = logging.getLogger("megatrain.compile")


def resolve(mode: str, device: torch.device) -> str:
    if mode == "auto":
        return "measure" if device.type == "cuda" else "eager"
    return mode


_RNG_OPS = {torch.ops.higher_order.run_and_save_rng_state, torch.ops.higher_order.run_with_rng_state}


def _rng_states(body: fx.GraphModule) -> set[fx.Node]:
    """Values that are a generator's state (saved by the forward, replayed by the recompute):
    their size is the generator's, symbolic in the graph but fixed on a device."""
    out = set()
    for n in body.graph.nodes:
        if n.target is torch.ops.higher_order.run_and_save_rng_state:
            out.update(u for u in n.users if u.args[1] == 0)
        elif n.target is torch.ops.higher_order.run_with_rng_state and isinstance(n.args[0], fx.Node):
            out.add(n.args[0])
    return out


def _static(body: fx.GraphModule) -> bool:
    rng = _rng_states(body)
    for n in body.graph.nodes:
        if n in rng or n.target in _RNG_OPS:
            continue
        v = n.meta.get("val")
        vals = v if isinstance(v, (list, tuple)) else [v]
        for x in vals:
            if isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
                    isinstance(d, torch.SymInt) for d in (*x.shape, *x.stride()))):
                return False
    return True


def _inputs(body: fx.GraphModule, device: torch.device) -> list:
    """Random inputs of the traced shapes; a generator state input is the device's real one."""
    rng = _rng_states(body)
    out = []
    for n in body.graph.nodes:
        if n.op != "placeholder":
            continue
        if n in rng:
            out.append(torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state())
            continue
        v = materialize(n)
        out.append(v.to(device) if isinstance(v, torch.Tensor) else v)
    return out


def boxed(body: fx.GraphModule) -> fx.GraphModule:
    """`body` as a function of one list of inputs that it empties (FX's generated code then
    drops each input after its last reader, as it does every intermediate)."""
    from torch.fx.graph import _BoxedCodeGen   # (torch's own: compiled autograd's and regional Inductor's)
    graph = fx.Graph()
    graph.output(graph.graph_copy(body.graph, {}))
    graph.set_codegen(_BoxedCodeGen())
    return fx.GraphModule(body, graph, class_name=type(body).__name__)


def _time(fn: Callable, inputs: list, device: torch.device, repeat: int = 5) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    fn(list(inputs))   # warm up
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn(list(inputs))
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)   # other load only ever adds time


def _compile(body: fx.GraphModule, inputs: list, eager: Callable) -> Callable:
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx
    # Inductor lowers graphs already decomposed by its own table (compile_fx runs AOTAutograd
    # with it); our bodies were traced with only megatrain's decompositions, so retrace first
    graph = make_fx(body, decomposition_table=select_decomp_table())(*inputs)
    # Inductor's FX graph cache (on disk: a second run of the same model loads the compiled
    # bodies instead of compiling them again) keys its guards on the tracing context's shape
    # environment and bypasses the cache without one: give it an empty one (the body is static)
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    fake = FakeTensorMode(shape_env=ShapeEnv())
    examples = [fake.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
    with tracing(TracingContext(fake)):
        return CompiledBody(compile_fx_inner(graph, examples), eager, inputs)


class CompiledBody:
    """An Inductor-compiled body (boxed, as Inductor's own calls are). An input that arrives
    with other sizes or strides than traced would fail Inductor's checks after the list was
    emptied, so they are compared first: the body then runs eagerly from then on."""

    def __init__(self, compiled, body: Callable, inputs: list):   # (body: the boxed eager form)
        self.compiled, self.body, self.fallbacks = compiled, body, 0
        self.layouts = [_layout(x) for x in inputs]

    def __call__(self, args: list):
        if not self.fallbacks:
            if [_layout(x) for x in args] == self.layouts:
                return self.compiled(args)
            self.fallbacks += 1
        return self.body(args)


def _layout(x):
    return (tuple(x.shape), x.stride(), x.dtype, x.device) if isinstance(x, torch.Tensor) else type(x)


def lower(bodies: dict[str, fx.GraphModule], mode: str, device: torch.device) -> tuple[dict[str, Callable], dict]:
    """(body name -> boxed callable to run, body name -> record) for `mode` as resolved on `device`."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    mode = resolve(mode, device)
    runs: dict[str, Callable] = {name: boxed(body) for name, body in bodies.items()}
    records: dict[str, dict] = {}
    if mode == "eager":
        return runs, {name: {"lowering": "eager"} for name in bodies}
    static = {name: body for name, body in bodies.items() if _static(body)}
    for name in bodies.keys() - static.keys():
        records[name] = {"lowering": "eager", "why": "symbolic shapes"}
    for i, (name, body) in enumerate(static.items(), 1):
        # (Inductor's FX graph cache on disk makes a second run of the same model start warm)
        log.info("[megatrain]     lowering body %d/%d (%s, %d ops) with Inductor", i, len(static), name,
                 sum(n.op == "call_function" for n in body.graph.nodes))
        with unset_fake_temporarily(), torch.no_grad():
            try:
                inputs = _inputs(body, device)
                t0 = time.perf_counter()
                compiled = _compile(body, inputs, runs[name])
                compile_s = time.perf_counter() - t0
                if mode == "measure":
                    eager_s, inductor_s = _time(runs[name], inputs, device), _time(compiled, inputs, device)
                else:
                    compiled(list(inputs))
                    eager_s = inductor_s = None
            except Exception as e:   # Inductor cannot compile it, or random inputs cannot drive it
                records[name] = {"lowering": "eager", "why": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                continue
        use = mode == "inductor" or inductor_s < eager_s
        log.info("[megatrain]     body %d/%d compiled in %.1f s%s", i, len(static), compile_s,
                 "" if eager_s is None else f" ({'kept' if use else 'slower than eager'}: Inductor "
                 f"{inductor_s * 1e3:.2f} ms, eager {eager_s * 1e3:.2f} ms)")
        if use:
            runs[name] = compiled
        records[name] = {"lowering": "inductor" if use else "eager", "compile_seconds": round(compile_s, 3),
                         "eager_seconds": eager_s, "inductor_seconds": inductor_s}
    return runs, {name: records[name] for name in bodies}
