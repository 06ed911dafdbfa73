"""What `megatrain plan` compiles and how it reaches the full depth: a prefix of layers holding
every layer kind (`layer_kinds`), captured through the real Dynamo capture, AOTAutograd partition
and passes (`capture_prefix`, as `megatrain inspect` does), and extrapolated to any batch size
and to every layer (`PrefixModel`). plan.py turns that into host/device bytes and a speed.
"""
from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from . import disk_cache
from .cost_model import BodyCost, body_cost, body_seconds
from .hardware import Hardware
from .ir import SegmentInfo, Step, segment_calls
from .passes.memory_plan import value_bytes
from .passes.schedule import choose_lookahead
from .simulate import SegmentCost


def layer_kinds(model: torch.nn.Module, config) -> tuple[str, list[int]]:
    """(layer stack prefix, kind id of every layer); identical parameters + layer type = same kind."""
    from .capture import find_layer_stack
    prefix, stack = find_layer_stack(model)
    types = getattr(config, "layer_types", None) or [None] * len(stack)
    sigs: dict[tuple, int] = {}
    kinds = []
    for i, layer in enumerate(stack):
        sig = (types[i] if i < len(types) else None,
               tuple((name, tuple(p.shape), p.dtype) for name, p in layer.named_parameters()))
        kinds.append(sigs.setdefault(sig, len(sigs)))
    return prefix, kinds


# -- captured costs ---------------------------------------------------------------------------

@dataclass
class DirectionCosts:
    """One direction of a captured prefix: segments in execution order with their costs."""
    infos: list                 # SegmentInfo per segment (schedule.py)
    seconds: list[float]        # estimated body time per segment (cost_model.body_seconds)
    layer: list[int | None]     # decoder layer index of each segment (None: prologue/embed/head)
    saved: list[int]            # bytes of forward outputs (saved for the backward) per segment
    peak: int                   # memory plan peak of the captured prefix
    host_checkpoints: int = 0   # layer checkpoints the prefix keeps on the host (offload_checkpoints)
    bodies: list = field(default_factory=list)   # each segment's body graph ([]: read from the disk cache)
    lookahead: int = 0          # the prefetch lookahead the capture's schedule chose on its profile
    costs: list = field(default_factory=list)    # each segment's BodyCost (its seconds on another profile)

    def seconds_on(self, hw: Hardware) -> list[float]:
        """Each segment's body seconds on `hw` (a profile that times ops needs the bodies)."""
        if hw.measure_ops:
            if len(self.bodies) != len(self.infos):   # (read from the disk cache: costs, no graphs)
                from .errors import InternalError
                raise InternalError(f"a capture without its bodies cannot be timed on profile {hw.name!r}")
            return body_costs(self.bodies, hw)
        return [c.seconds(hw) for c in self.costs]


@dataclass
class Capture:
    batch: int
    directions: dict[str, DirectionCosts]
    attention_chunks: list[int] = field(default_factory=list)   # query chunks per chunked attention


#: the captures made in this process, newest last, by everything a capture depends on
#: (`capture_key`): a resumed run's preflight, a notebook's second plan, or run after run of one
#: model shape (a test suite) compiles the prefix once. A Capture is never changed once made.
_CAPTURES: OrderedDict[str, Capture] = OrderedDict()
_KEEP = 16   # (a capture holds its bodies' graphs: some, not every shape ever planned)


def capture_key(config, layers: int, batch: int, seq: int, slots: int, dtype, hw: Hardware, options) -> str:
    """What a capture depends on, as text: the model's configuration (less where it was loaded
    from), the prefix, the shape, the profile and the compile options. A value without a plain
    form is keyed by its repr, which for an object is its identity: never a wrong hit."""
    return json.dumps(_key_parts(config, layers, batch, seq, slots, dtype, hw.to_dict(), options), sort_keys=True,
                      default=repr)


def _key_parts(config, layers: int, batch: int, seq: int, slots: int, dtype, profile, options) -> list:
    """The parts of a capture's key, the profile as the caller keys it."""
    shape = config.to_dict()
    shape.pop("_name_or_path", None)
    return [shape, getattr(config, "_attn_implementation", None), layers, batch, seq, slots, str(dtype), profile,
            options]


def disk_key(config, layers: int, batch: int, seq: int, slots: int, dtype, hw: Hardware, options) -> str | None:
    """`capture_key` for the disk cache (disk_cache.py), less the profile's figures: a capture
    depends on them only through the prefetch lookahead its schedule chooses and its seconds
    (plan_compare.py relies on the same), so an entry serves every profile of the device kind
    that chooses its lookahead (`capture_prefix`), as the trainer's preflight needs: its CPU or
    GPU profile is measured, a little different at every start. None where a capture must not
    be kept between processes: a value with no plain form, a model whose code comes from its
    folder (`auto_map`: that code is not part of the cache's version), a profile that times
    this machine's ops (its bodies are needed again for every profile)."""
    if hw.measure_ops or getattr(config, "auto_map", None):
        return None
    return disk_cache.key_text(_key_parts(config, layers, batch, seq, slots, dtype,
                                          "cpu" if hw.name == "cpu" else "gpu", options))


def to_json(capture: Capture) -> dict:
    """`capture` as plain data, without its bodies' graphs (their costs are kept)."""
    def direction(d: DirectionCosts) -> dict:
        return {"infos": [dict(dataclasses.asdict(i), grad_nbytes=sorted(i.grad_nbytes.items())) for i in d.infos],
                "seconds": d.seconds, "layer": d.layer, "saved": d.saved, "peak": d.peak,
                "host_checkpoints": d.host_checkpoints, "lookahead": d.lookahead,
                "costs": [[c.flops, c.memory_bytes, c.ops] for c in d.costs]}
    return {"batch": capture.batch, "attention_chunks": capture.attention_chunks,
            "directions": {name: direction(d) for name, d in capture.directions.items()}}


def from_json(data: dict) -> Capture | None:
    """The Capture `to_json` wrote (None: not one: an entry of an older layout reads as a miss)."""
    try:
        directions = {}
        for name, d in data["directions"].items():
            infos = [SegmentInfo(**{**i, "grad_nbytes": dict(i["grad_nbytes"]),
                                    "grads": [tuple(g) for g in i["grads"]]}) for i in d["infos"]]
            directions[name] = DirectionCosts(infos, d["seconds"], d["layer"], d["saved"], d["peak"],
                                              d["host_checkpoints"], [], d["lookahead"],
                                              [BodyCost(*c) for c in d["costs"]])
        return Capture(data["batch"], directions, data["attention_chunks"])
    except (KeyError, TypeError, ValueError):
        return None


def capture_prefix(config, layers: int, batch: int, seq: int, slots: int, dtype, hw: Hardware, options,
                   announce=None) -> Capture:
    """The first `layers` layers of `config` compiled for meta inputs of `batch` x `seq`, costed
    on `hw`: made once per process for each `capture_key`, and read from the disk cache where an
    earlier process made it on a profile that chooses the same prefetch lookahead (`disk_key`),
    re-costed on `hw`. `announce()`, if given, is called before a compile."""
    key = capture_key(config, layers, batch, seq, slots, dtype, hw, options)
    if key in _CAPTURES:
        _CAPTURES.move_to_end(key)
        return _CAPTURES[key]
    on_disk = disk_key(config, layers, batch, seq, slots, dtype, hw, options)
    stored = disk_cache.read("plan", on_disk) if on_disk is not None else None
    variants = stored if isinstance(stored, list) else []
    made = next((c for c in map(from_json, variants)
                 if c is not None and lookaheads(c, hw, slots) == {n: d.lookahead for n, d in c.directions.items()}),
                None)
    if made is not None:
        made = recosted(made, hw)
    else:
        if announce is not None:
            announce()
        made = _capture(config, layers, batch, seq, slots, dtype, hw, options)
        if on_disk is not None:   # (one variant per lookahead the profiles choose)
            disk_cache.write("plan", on_disk, variants + [to_json(made)])
    _CAPTURES[key] = made
    while len(_CAPTURES) > _KEEP:
        _CAPTURES.popitem(last=False)
    return made


def _capture(config, layers: int, batch: int, seq: int, slots: int, dtype, hw: Hardware, options) -> Capture:
    from . import meta_model
    from .log import quiet
    model = meta_model.build_model_from_config(config, layers, dtype)
    with quiet("compile"):   # (a plan's captures are not the run's compile: `megatrain train` says it plans)
        program = meta_model.capture_program(model, batch, seq, slots, hw, options)
    num_layers = program.capture.num_layers
    out = {}
    for direction, done in program.compiled.items():
        top = done.graph
        segs = done.schedule.segments
        produced = {}
        for k, n in enumerate(segment_calls(top)):
            for name in n.meta["mt_segment"]["outputs"]:
                produced[name] = k
        saved = [0] * len(segs)
        if direction == "forward":   # (as the program returns them: offloaded checkpoints are host values)
            result = next(n for n in done.schedule.program.graph.nodes if n.op == "output")
            for a in result.all_input_nodes:
                if a.name in produced:
                    saved[produced[a.name]] += value_bytes(a.meta.get("val"))
        layer = [s.group - 1 if 1 <= s.group <= num_layers else None for s in segs]
        bodies = [done.bodies[name] for name in done.body_of]
        costs = DirectionCosts(segs, [], layer, saved, done.plan.peak_bytes if done.plan else 0,
                               done.plan.host_checkpoint_bytes if done.plan else 0, bodies,
                               done.schedule.lookahead, per_body(bodies, body_cost))
        out[direction] = dataclasses.replace(costs, seconds=costs.seconds_on(hw))
    return Capture(batch, out, program.attention_chunks)


def per_body(bodies: list, fn) -> list:
    """`fn(body)` for each segment's body, a body shared by several segments computed once."""
    done: dict[int, Any] = {}
    for body in bodies:
        if id(body) not in done:
            done[id(body)] = fn(body)
    return [done[id(body)] for body in bodies]


def body_costs(bodies: list, hw: Hardware) -> list[float]:
    """Each segment's body seconds on `hw`, a body shared by several segments costed once."""
    return per_body(bodies, lambda body: body_seconds(body, hw))


def recosted(cap: Capture, hw: Hardware) -> Capture:
    """`cap` with every segment's body seconds on `hw` (as `capture_prefix` costs them)."""
    return dataclasses.replace(cap, directions={name: dataclasses.replace(d, seconds=d.seconds_on(hw))
                                                for name, d in cap.directions.items()})


def lookaheads(cap: Capture, hw: Hardware, slots: int) -> dict[str, int]:
    """The prefetch lookahead the schedule pass would choose on `hw` for each direction of `cap`."""
    out = {}
    for name, d in recosted(cap, hw).directions.items():
        costs = [SegmentCost(i.name, i.weight_nbytes, sum(i.grad_nbytes.values()), s)
                 for i, s in zip(d.infos, d.seconds)]
        out[name] = choose_lookahead(d.infos, costs, hw, slots) if slots > 1 else slots - 1
    return out


# -- the plan -------------------------------------------------------------------------------

class PrefixModel:
    """The captured prefix at two batch sizes, extrapolated to any batch and the full depth (or at
    one batch, `a` is `b`: its figures at that batch and the full depth)."""

    def __init__(self, full_kinds: list[int], prefix_len: int, a: Capture, b: Capture, hw: Hardware):
        self.kinds, self.k, self.a, self.b, self.hw = full_kinds, prefix_len, a, b, hw
        self.checked: dict[int, int] = {}   # batch -> peak from a capture at that batch
        self.late_reload = False            # checkpoints reloaded just before their backward (not ahead)
        rep = {}
        for i in range(prefix_len):
            rep.setdefault(full_kinds[i], i)
        self.rep = [i if i < prefix_len else rep[full_kinds[i]] for i in range(len(full_kinds))]

    def _lerp(self, x: float, y: float, batch: int) -> float:
        if self.a.batch == self.b.batch:   # (one capture: its figures, at its batch only)
            return x
        return x + (y - x) * (batch - self.a.batch) / (self.b.batch - self.a.batch)

    def expand(self, direction: str, batch: int) -> tuple[list, list[SegmentCost]]:
        """Full-depth segments (SegmentInfo) and their costs at `batch`, in execution order."""
        da, db = self.a.directions[direction], self.b.directions[direction]
        seconds = [max(0.0, self._lerp(ta, tb, batch)) for ta, tb in zip(da.seconds, db.seconds)]
        by_layer: dict[int, list[int]] = {}
        for j, layer in enumerate(da.layer):
            if layer is not None:
                by_layer.setdefault(layer, []).append(j)
        first = next(j for j, layer in enumerate(da.layer) if layer is not None)
        last = max(j for j, layer in enumerate(da.layer) if layer is not None)
        order = range(len(self.kinds)) if da.layer[first] <= da.layer[last] else reversed(range(len(self.kinds)))
        index = list(range(first)) + [j for i in order for j in by_layer[self.rep[i]]] \
            + list(range(last + 1, len(da.infos)))
        infos = [da.infos[j] for j in index]
        costs = [SegmentCost(da.infos[j].name, da.infos[j].weight_nbytes, sum(da.infos[j].grad_nbytes.values()),
                             seconds[j]) for j in index]
        return infos, costs

    def extra_saved(self, batch: int) -> float:
        """Saved-for-backward bytes of the layers the captured prefix left out."""
        def per_layer(c: Capture) -> dict[int, int]:
            d = c.directions["forward"]
            out: dict[int, int] = {}
            for layer, s in zip(d.layer, d.saved):
                if layer is not None:
                    out[layer] = out.get(layer, 0) + s
            return out
        sa, sb = per_layer(self.a), per_layer(self.b)
        return sum(self._lerp(sa[self.rep[i]], sb[self.rep[i]], batch) for i in range(self.k, len(self.kinds)))

    def host_checkpoints(self, batch: int) -> int:
        """Host bytes of the full model's offloaded layer checkpoints at `batch` (one per layer
        but the last, plus the embedding's output: as many as layers, as in the prefix)."""
        ha, hb = (c.directions["forward"].host_checkpoints for c in (self.a, self.b))
        return int(max(0.0, self._lerp(ha, hb, batch)) * len(self.kinds) / self.k)

    def with_checkpoints(self, direction: str, steps: list, infos: list, batch: int) -> list:
        """`steps` with the checkpoint moves the offload_checkpoints pass writes: each layer's
        checkpoint (the embedding's or the previous layer's output) offloaded after the run
        that makes it, and reloaded before the segment ahead of that layer's backward (with
        `late_reload`, just before that backward's own run)."""
        per_layer = self.host_checkpoints(batch) // max(1, len(self.kinds))
        if not per_layer:
            return steps
        layers = len(self.kinds)
        if direction == "forward":
            moved = {k for k, s in enumerate(infos) if 0 <= s.group <= layers - 1}
        else:
            moved = {k for k, s in enumerate(infos) if 1 <= s.group <= layers}
        out = []
        for step in steps:
            ahead = 0 if self.late_reload else 1
            if direction == "backward" and step.op == "run" and step.segment + ahead in moved:
                out.append(Step("reload", "h2d", step.segment + ahead, per_layer))
            out.append(step)
            if direction == "forward" and step.op == "run" and step.segment in moved:
                out.append(Step("offload", "d2h", step.segment, per_layer))
        return out

    def device_peak(self, batch: int) -> int:
        if batch in self.checked:   # captured at this batch (see plan_model)
            return self.checked[batch]
        peak_a = max(d.peak for d in self.a.directions.values())
        peak_b = max(d.peak for d in self.b.directions.values())
        return int(self._lerp(peak_a, peak_b, batch) + self.extra_saved(batch))
