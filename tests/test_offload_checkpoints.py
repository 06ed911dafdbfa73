"""Layer checkpoints kept on the host (passes/offload_checkpoints.py, runtime/checkpoints.py):
the offload/reload ops in the schedule programs, exactness against the same step with them on
the device and against eager transformers, the device bytes they free (planned, and measured
independently), and the `auto` choice under a device budget."""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_model
from device_bytes import host_grads, measure_step
from families import tiny_family_model
from megacompile.backend import programs_of
from megacompile.errors import CannotFitError


def _ops(program, direction: str, op: str) -> int:
    nodes = program.compiled[direction].schedule.program.graph.nodes
    return sum(1 for n in nodes if str(n.target) == f"megatrain.{op}.default")


def _long_batch(seq: int, layout: str, seed: int = 0):
    """One row of `seq` tokens: left padding (a quarter of it), or packed documents (positions
    restarting at every document: transformers' packing, no attention mask)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (1, seq), generator=g)
    kw = {}
    if layout == "left":
        mask = torch.ones(1, seq, dtype=torch.long)
        mask[0, :seq // 4] = 0
        kw["attention_mask"] = mask
        labels = ids.masked_fill(mask == 0, -100)
    else:
        cuts = [0, seq // 3, seq // 3 + seq // 5, seq]
        kw["position_ids"] = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])])[None]
        labels = ids.clone()
    return ids, labels, kw


def _step(model, ids, labels, kw, **options):
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", **options})
    loss = cmodel(input_ids=ids, labels=labels, use_cache=False, **kw).loss
    loss.backward()
    return loss


@pytest.mark.parametrize("family,layout", [
    # (CI runs each family and each layout once; -m slow the other three pairs)
    ("llama", "left"), pytest.param("llama", "packed", marks=pytest.mark.slow),
    pytest.param("mistral", "left", marks=pytest.mark.slow), ("mistral", "packed"),
    # (Qwen3-Next's chunked linear attention unrolls 128 chunks at 8K: ~2 minutes a case, so in the
    # slow set; CI's hybrid case is test_checkpoints_on_the_host_are_bit_identical, at 2K)
    pytest.param("qwen3_next", "left", marks=pytest.mark.slow),
    pytest.param("qwen3_next", "packed", marks=pytest.mark.slow), ("mixtral", "left"),
    pytest.param("mixtral", "packed", marks=pytest.mark.slow)])
def test_long_context_step_at_8k_tokens_equals_the_plain_one_and_eager(family, layout):
    """8192 tokens (left-padded, or packed documents) of a dense, a sliding-window, a hybrid
    linear-attention and an MoE family: with every layer checkpoint on the host and the MLPs in 4
    sequence tiles, the loss and gradients of plain megatrain (checkpoints on the device, whole
    MLPs) and of eager transformers, within fp32 tolerances; the forward offloads each checkpoint
    and the backward reloads each, and the planned device peak falls while the host holds them."""
    seq = 8192
    ref = tiny_family_model(family, num_hidden_layers=4, max_position_embeddings=2 * seq)
    ids, labels, kw = _long_batch(seq, layout)
    want = ref(input_ids=ids, labels=labels, use_cache=False, **kw).loss
    want.backward()
    runs = {}
    for name, options in (("plain", {"offload_checkpoints": "never", "mlp_tiles": 1}),
                          ("long", {"offload_checkpoints": "always", "mlp_tiles": 4})):
        torch._dynamo.reset()
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        loss = _step(model, ids, labels, kw, **options)
        runs[name] = (loss, [p.grad for p in model.parameters()], programs_of(model)[-1])
    (loss_p, grads_p, plain), (loss_l, grads_l, long) = runs["plain"], runs["long"]
    for reference, grads in ((loss_p, grads_p), (want, [p.grad for p in ref.parameters()])):
        torch.testing.assert_close(loss_l, reference, rtol=1e-5, atol=1e-6)
        for (name, _), a, b in zip(ref.named_parameters(), grads_l, grads):
            if b is not None:
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5, msg=name)
    moved = _ops(long, "forward", "offload")
    assert moved >= 3 and _ops(long, "backward", "reload") == moved   # (embedding + layers 1..3)
    assert _ops(plain, "forward", "offload") == 0
    tiled = long.tile_counts
    assert tiled == ([] if family == "mixtral" else [4] * 4)   # (Mixtral: experts only, no dense MLP)
    plans = {m: {d: c.plan for d, c in runs[m][2].compiled.items()} for m in runs}
    assert plans["long"]["forward"].host_checkpoint_bytes >= 4 * seq * 32 * 4   # (at least 4 hidden states)
    for d in ("forward", "backward"):
        assert plans["long"][d].peak_bytes < plans["plain"][d].peak_bytes


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_checkpoints_on_the_host_are_bit_identical(family):
    """The moves themselves change no number: losses and gradients equal bit for bit."""
    base = tiny_family_model(family, num_hidden_layers=4, max_position_embeddings=4096)
    ids, labels, kw = _long_batch(2048, "left")
    runs = []
    for mode in ("never", "always"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        runs.append((_step(model, ids, labels, kw, offload_checkpoints=mode), [p.grad for p in model.parameters()]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]) if a is not None)


def _measured(seq: int, offload: str, reload: str = "ahead") -> tuple[int, int, int]:
    """(planned peak, independently measured peak, host checkpoint bytes) of a compiled step's
    second run, tiny Llama with 6 layers, left-padded, gradients synchronous (see
    test_memory_plan._planned_and_probed); the host copies of checkpoints are not device bytes."""
    model = tiny_model("llama", layers=6)
    ids, labels, kw = _long_batch(seq, "left")
    cmodel = torch.compile(model, backend="megatrain",
                           options={"device": "cpu", "overlap_grads": False, "offload_checkpoints": offload,
                                    "reload_checkpoints": reload})
    cmodel(input_ids=ids, labels=labels, use_cache=False, **kw).loss.backward()
    program = programs_of(model)[0]
    model.zero_grad(set_to_none=True)
    copies = []
    mover_offload = program.checkpoints.offload

    def offload(value):
        copies.append(mover_offload(value))
        return copies[-1]
    program.checkpoints.offload = offload
    with measure_step(program) as probe:
        cmodel(input_ids=ids, labels=labels, use_cache=False, **kw).loss.backward()
        host = probe.allocations_of(copies)
    copies.clear()
    planned = max(program.runners[d].plan.peak_bytes for d in ("forward", "backward"))
    return planned, probe.peak(exclude=host_grads(probe, model) | host), \
        program.compiled["forward"].plan.host_checkpoint_bytes


def test_device_peak_is_linear_in_the_sequence_and_within_the_plan():
    """Segment attention and host checkpoints: the measured device peak at twice the sequence
    is at most 2.1 times the peak, the plan bounds it (within 1.25x), and the host checkpoints
    lower it against the same step keeping them on the device."""
    p1, m1, h1 = _measured(1024, "always")
    p2, m2, h2 = _measured(2048, "always")
    assert m1 <= p1 <= 1.25 * m1 and m2 <= p2 <= 1.25 * m2
    assert m2 <= 2.1 * m1, (m1, m2)
    assert h2 == 2 * h1 > 0
    _, kept, _ = _measured(2048, "never")
    assert m2 < kept


def test_late_reloads_hold_one_checkpoint_less_and_change_no_number():
    """reload_checkpoints="late": each checkpoint comes back just before its layer's backward,
    not under the segment ahead: the planned and the measured peaks fall by about one
    checkpoint ([seq, hidden]), the plan still bounds the measurement, and losses and gradients
    equal the ahead schedule's bit for bit."""
    planned_ahead, measured_ahead, _ = _measured(2048, "always")
    planned, measured, _ = _measured(2048, "always", "late")
    checkpoint = 2048 * 32 * 4   # (tiny Llama: hidden 32, fp32)
    assert measured <= planned <= 1.25 * measured
    assert planned <= planned_ahead - checkpoint // 2 and measured <= measured_ahead - checkpoint // 2, \
        (planned_ahead, planned, measured_ahead, measured)
    base = tiny_model("llama", layers=4)
    ids, labels, kw = _long_batch(1024, "left")
    runs = []
    for reload in ("ahead", "late"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        loss = _step(model, ids, labels, kw, offload_checkpoints="always", reload_checkpoints=reload)
        runs.append((loss, [p.grad for p in model.parameters()]))
        assert _ops(programs_of(model)[-1], "backward", "reload") == 4
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]) if a is not None)


def test_auto_offloads_only_when_the_budget_needs_it():
    """offload_checkpoints="auto" (the default): without a device budget, or with one the step
    fits with its checkpoints on the device, nothing moves; under a budget between the two
    schedules' peaks the checkpoints go to the host and the step runs; below both it cannot fit."""
    ids, labels, kw = _long_batch(2048, "left")
    peaks = {}
    for mode in ("never", "always"):
        model = tiny_model("llama", layers=6)
        _step(model, ids, labels, kw, offload_checkpoints=mode)
        program = programs_of(model)[-1]
        peaks[mode] = max(c.plan.peak_bytes for c in program.compiled.values())
    assert peaks["always"] < peaks["never"]
    for budget, moves in ((None, False), (peaks["never"], False), ((peaks["always"] + peaks["never"]) // 2, True)):
        torch._dynamo.reset()
        model = tiny_model("llama", layers=6)
        _step(model, ids, labels, kw, device_budget=budget)
        assert (_ops(programs_of(model)[-1], "forward", "offload") > 0) == moves, budget
    torch._dynamo.reset()
    with pytest.raises(Exception) as e:
        _step(tiny_model("llama", layers=6), ids, labels, kw, device_budget=peaks["always"] // 2)
    inner = getattr(e.value, "inner_exception", e.value)
    assert isinstance(inner, CannotFitError) and "layer checkpoints already on the host" in str(inner)


def test_the_pass_disabled_keeps_them_on_the_device():
    """disable_passes=["offload_checkpoints"]: the marks stay unread, no op moves anything, and the
    step is the same."""
    ids, labels, kw = _long_batch(512, "packed")
    model = tiny_model("llama", layers=3)
    loss = _step(model, ids, labels, kw, offload_checkpoints="always", disable_passes=["offload_checkpoints"])
    program = programs_of(model)[-1]
    assert _ops(program, "forward", "offload") == 0 and _ops(program, "backward", "reload") == 0
    torch._dynamo.reset()
    other = tiny_model("llama", layers=3)
    assert torch.equal(_step(other, ids, labels, kw, offload_checkpoints="always"), loss)


def test_a_budget_between_the_two_reloads_chooses_late():
    """reload_checkpoints="auto" under a device budget the ahead schedule does not fit but the
    late one does: the backend compiles again with late reloads and trains."""
    ids, labels, kw = _long_batch(1024, "left")
    peaks = {}
    for reload in ("ahead", "late"):
        torch._dynamo.reset()
        model = tiny_model("llama", layers=4)
        _step(model, ids, labels, kw, offload_checkpoints="always", mlp_tiles=1, reload_checkpoints=reload)
        peaks[reload] = max(c.plan.peak_bytes for c in programs_of(model)[-1].compiled.values())
    assert peaks["late"] < peaks["ahead"], peaks
    torch._dynamo.reset()
    model = tiny_model("llama", layers=4)
    _step(model, ids, labels, kw, offload_checkpoints="always", mlp_tiles=1,
          device_budget=(peaks["ahead"] + peaks["late"]) // 2)
    program = programs_of(model)[-1]
    assert program.options.reload_checkpoints == "late"
    assert max(c.plan.peak_bytes for c in program.compiled.values()) == peaks["late"]
