"""`megatrain plan` and the cost-model prefetch lookahead."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_step_matches_eager, tiny_config, tiny_model
from megacompile.cli import main
from megacompile.hardware import BUILTIN, Hardware, load_hardware
from megacompile.plan import plan_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture
def config_json(tmp_path):
    path = tmp_path / "config.json"
    tiny_config("llama", layers=6, hidden=64, vocab_size=256).to_json_file(path)
    return path


def test_plan_reports_host_parts_device_bytes_and_batches(config_json, capsys):
    assert main(["plan", str(config_json), "--gpu", "h100", "--host-ram", "64GiB", "--seq", "64",
                 "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    n = plan["model"]["parameters"]
    host = plan["host"]
    # bf16 model: fp32 master 4 + AdamW 8 + bf16 transfer copy 2 (pinned on CUDA) + fp32 grad 4 bytes/param
    assert (host["masters"], host["optimizer_state"], host["transfer_copy"], host["grads"]) \
        == (4 * n, 8 * n, 2 * n, 4 * n)
    assert host["pinned"] == 2 * n and plan["fits"] and plan["problems"] == []
    assert plan["model"]["layer_kinds"] == 1 and plan["model"]["layers"] == 6
    rows = {b["batch"]: b for b in plan["batches"]}
    assert plan["max_batch"] == 4096 and plan["best_batch"] in rows  # tiny: capped by max_batch
    assert rows[2]["device_peak_bytes"] > rows[1]["device_peak_bytes"] > plan["device_weight_bytes"] > 0
    assert rows[8]["tokens_per_s"] > rows[1]["tokens_per_s"]
    for b in rows.values():
        assert b["step_seconds"] == pytest.approx(b["forward_seconds"] + b["backward_seconds"] + b["optimizer_seconds"])
        # the optimizer overlapped (simulated): at most the serial step, at least the forward +
        # backward, and at least the optimizer's own length beside the direction it hides under
        assert b["forward_seconds"] + max(b["backward_seconds"], b["optimizer_seconds"]) \
            <= b["overlap_backward_seconds"] <= b["step_seconds"] * (1 + 1e-9)
        assert b["backward_seconds"] + max(b["forward_seconds"], b["optimizer_seconds"]) \
            <= b["overlap_forward_seconds"] <= b["step_seconds"] * (1 + 1e-9)


def test_largest_batch_is_the_edge_of_the_device(config_json, tmp_path):
    profile = tmp_path / "small_gpu.json"
    profile.write_text(json.dumps({"name": "small", "compute_tflops": 100, "h2d_gbps": 20, "d2h_gbps": 20,
                                   "device_memory_gib": 1.12, "host_memory_gbps": 50}))
    hw = load_hardware(str(profile))
    plan = plan_model(str(config_json), hardware=hw, host_ram=2**36, seq=2048)
    assert plan.fits and 1 <= plan.max_batch < 4096
    rows = {b.batch: b for b in plan.batches}
    assert rows[plan.max_batch].device_peak_bytes <= plan.device_capacity
    slope = rows[2].device_peak_bytes - rows[1].device_peak_bytes
    assert rows[plan.max_batch].device_peak_bytes + slope > plan.device_capacity
    # asking for more than fits is refused with the largest batch that does
    over = plan_model(str(config_json), hardware=hw, host_ram=2**36, seq=2048, batch=plan.max_batch + 1)
    assert not over.fits and f"largest batch that fits is {plan.max_batch}" in over.problems[0]


def test_a_plan_of_one_batch_compiles_it_once_and_goes_on_where_it_does_not_fit(config_json, tmp_path,
                                                                               captures_made):
    """The train preflight plans one batch (batch = max_batch): one capture at that batch, whose
    peak is the whole plan's captured figure there. A batch that does not fit goes on to the
    whole plan's captures, and is refused with the whole plan's words (the largest batch that fits)."""
    profile = tmp_path / "small_gpu.json"
    profile.write_text(json.dumps({"name": "small", "compute_tflops": 100, "h2d_gbps": 20, "d2h_gbps": 20,
                                   "device_memory_gib": 1.12, "host_memory_gbps": 50}))
    hw = load_hardware(str(profile))
    one = plan_model(str(config_json), hardware=hw, host_ram=2**36, seq=2048, batch=4, max_batch=4)
    assert captures_made == [4] and one.fits and [b.batch for b in one.batches] == [4] and one.batches[0].captured
    whole = plan_model(str(config_json), hardware=hw, host_ram=2**36, seq=2048)
    assert captures_made[:2] == [4, 2] and 4 not in captures_made[1:]   # (batch 4 from the memo)
    assert one.batches[0].device_peak_bytes == next(b for b in whole.batches if b.batch == 4).device_peak_bytes
    over = whole.max_batch + 1
    del captures_made[:]
    refused = plan_model(str(config_json), hardware=hw, host_ram=2**36, seq=2048, batch=over, max_batch=over)
    assert captures_made[0] == over and not refused.fits
    assert refused.problems == plan_model(str(config_json), hardware=hw, host_ram=2**36, seq=2048, batch=over).problems


@pytest.fixture
def captures_made(monkeypatch, own_compile_cache):
    """The batch of every prefix capture compiled from here on, with an empty in-process memo
    and compile cache."""
    from megacompile import plan_capture
    made = []
    real = plan_capture._capture
    monkeypatch.setattr(plan_capture, "_capture", lambda *a: made.append(a[2]) or real(*a))   # (its batch)
    monkeypatch.setattr(plan_capture, "_CAPTURES", type(plan_capture._CAPTURES)())
    return made


PLAN = {"hardware": BUILTIN["h100"], "host_ram": 2**36, "seq": 64, "max_batch": 4}   # (batches 2 and 4 only)


def test_a_second_plan_of_the_same_shape_compiles_nothing(config_json, tmp_path, captures_made):
    """Captures are made once per process for everything they depend on: the same config from
    another folder plans from the first plan's captures (and equals it); another sequence
    length or option compiles its own."""
    first = plan_model(str(config_json), **PLAN)
    assert captures_made == [2, 4]
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "config.json").write_text(config_json.read_text())
    again = plan_model(str(tmp_path / "copy" / "config.json"), **PLAN)
    assert captures_made == [2, 4] and again.to_dict()["batches"] == first.to_dict()["batches"]
    for other in ({"seq": 32}, {"options": {"recompute": "selective"}}):
        before = len(captures_made)
        plan_model(str(config_json), **{**PLAN, **other})
        assert captures_made[before:] == [2, 4], other


def test_a_later_process_plans_from_the_compile_cache(config_json, captures_made, own_compile_cache, monkeypatch):
    """A capture is kept on disk (megacompile/disk_cache.py): a process with an empty memo plans
    the same model from it without compiling, to the same plan, on the same profile or on one
    with other figures (a measured profile differs at every start) that chooses the same
    lookahead, where it equals a plan compiled afresh; MEGATRAIN_COMPILE_CACHE=off reads and
    keeps nothing; an entry of other code or cut short reads as a miss."""
    import dataclasses

    from megacompile import disk_cache, plan_capture
    first = plan_model(str(config_json), **PLAN).to_dict()
    entries = sorted((own_compile_cache / "plan").glob("*.json"))
    assert captures_made == [2, 4] and len(entries) == 2

    def new_process(**plan):
        monkeypatch.setattr(plan_capture, "_CAPTURES", type(plan_capture._CAPTURES)())
        return plan_model(str(config_json), **{**PLAN, **plan}).to_dict()
    assert new_process()["batches"] == first["batches"] and captures_made == [2, 4]
    h100 = PLAN["hardware"]
    other = dataclasses.replace(h100, compute_tflops=h100.compute_tflops * 1.3, h2d_gbps=h100.h2d_gbps * 0.9,
                                op_overhead_us=h100.op_overhead_us * 2)
    recosted = new_process(hardware=other)["batches"]
    assert captures_made == [2, 4] and recosted != first["batches"]
    monkeypatch.setenv("MEGATRAIN_COMPILE_CACHE", "off")
    assert new_process(hardware=other)["batches"] == recosted and captures_made == [2, 4, 2, 4]
    assert sorted((own_compile_cache / "plan").glob("*.json")) == entries   # (nothing written)
    monkeypatch.setenv("MEGATRAIN_COMPILE_CACHE", str(own_compile_cache))
    key = json.loads(entries[0].read_text())["key"]
    assert disk_cache.read("plan", key) is not None
    monkeypatch.setattr(disk_cache, "code_version", lambda: "a changed pass")
    assert disk_cache.read("plan", key) is None
    monkeypatch.undo()
    monkeypatch.setenv("MEGATRAIN_COMPILE_CACHE", str(own_compile_cache))
    entries[0].write_text(entries[0].read_text()[:100])   # (a crash mid-write: os.replace prevents it)
    assert disk_cache.read("plan", key) is None


def test_refuses_with_exit_code_and_what_would_fit(config_json, tmp_path, capsys):
    assert main(["plan", str(config_json), "--gpu", "h200", "--host-ram", "1MB", "--seq", "64"]) == 3
    err = capsys.readouterr().err
    assert "host RAM" in err and "add at least" in err and "--host-ram" in err
    profile = tmp_path / "tiny_gpu.json"
    profile.write_text(json.dumps({"name": "tiny", "compute_tflops": 1, "h2d_gbps": 1, "d2h_gbps": 1,
                                   "device_memory_gib": 0.0001, "host_memory_gbps": 1}))
    assert main(["plan", str(config_json), "--gpu", str(profile), "--host-ram", "64G", "--seq", "64"]) == 3
    err = capsys.readouterr().err
    assert "device memory" in err and "--slots 1" in err and "shorter --seq" in err
    assert main(["plan", str(config_json), "--gpu", "h200"]) == 2
    assert "--host-ram is required" in capsys.readouterr().err


def test_bad_hardware_profile_is_a_clear_error(tmp_path, config_json, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "compute_tflops": 1}))
    assert main(["plan", str(config_json), "--gpu", str(bad), "--host-ram", "1T"]) == 2
    assert "missing keys" in capsys.readouterr().err
    assert main(["plan", str(config_json), "--gpu", "tpu-v9", "--host-ram", "1T"]) == 2
    assert "unknown hardware" in capsys.readouterr().err


def test_100b_class_prediction():
    """What the planner predicts for a 100B-class model (gpt-oss-120b: 116.8B parameters, 36
    layers of 2 kinds, MoE) on one H200 with PCIe 5, seq 4096:
      * host store 18 B/param = 1.92 TiB: it does NOT fit the MegaTrain paper's 1.5 TB host
        (their code keeps bf16 masters at ~12 B/param); the planner says to add ~566 GiB;
      * with 2.5 TB it fits; the device holds 2 weight slots (~12 GiB) and the best batch is
        the largest that fits, checked by a capture at that batch (32 x 4096 tokens: the
        interpolated 89 did not fit), at ~2.5k tokens/s, ~53 s/step, of which ~37 s is the CPU
        AdamW step over fp32 masters (the runtime does not overlap it yet).
    The asserted bounds are physical: the forward cannot beat moving every weight once over the
    link, and the optimizer cannot beat streaming 32 B/param through host memory."""
    hw = BUILTIN["h200"]
    small = plan_model("gpt-oss-120b", hardware=hw, host_ram=int(1.5e12), seq=4096)
    assert not small.fits and "add at least" in small.problems[0]
    per_param = small.host.total / small.model["parameters"]
    assert 17.9 < per_param < 18.1 and 1.9 * 2**40 < small.host.total < 1.95 * 2**40
    plan = plan_model("gpt-oss-120b", hardware=hw, host_ram=int(2.5e12), seq=4096)
    assert plan.fits and plan.model["layer_kinds"] == 2
    best = plan.best
    assert best.batch == plan.max_batch and 16 <= best.batch <= 128 and best.captured
    assert best.device_peak_bytes <= plan.device_capacity
    weight_bytes = plan.host.transfer_copy
    assert best.forward_seconds >= weight_bytes / (hw.h2d_gbps * 1e9)
    assert best.optimizer_seconds >= plan.model["trainable"] * 32 / (hw.host_memory_gbps * 1e9)
    assert 1_000 < plan.tokens_per_s(best) < 10_000
    assert 5 * 2**30 < plan.device_weight_bytes < 20 * 2**30


@pytest.mark.serial
def test_prediction_matches_measured_cpu_steps_within_25_percent():
    """The simulator against real steps on this machine (benchmarks/plan_accuracy.py), two sizes.
    Two rounds of (measure, predict), interleaved; each side keeps its fastest round: on a shared
    2-core VM other load only adds time, to either side, and one plan's body timings came out 60%
    slow in a burst (CI failed at 1.31 that way)."""
    import plan_accuracy
    rows = plan_accuracy.run(steps=4, rounds=2)
    for r in rows:
        assert 0.75 <= r["ratio_to_fastest"] <= 1.25, rows


def _hardware_json(tmp_path, name, h2d_gbps):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"name": name, "compute_tflops": 0.05, "h2d_gbps": h2d_gbps, "d2h_gbps": 1e6,
                                "device_memory_gib": 16, "host_memory_gbps": 10}))
    return str(path)


@pytest.mark.parametrize("h2d_gbps", [0.05, 0.2, 1e9])
def test_cost_model_picks_the_prefetch_lookahead(tmp_path, h2d_gbps, clone):
    """The lookahead is the smallest whose simulated time is within 1% of the best one the slots
    allow (a free link needs no prefetch: lookahead 0, one resident segment); the runtime keeps
    to it, and training stays exact."""
    from megacompile.passes.schedule import build_steps, segment_costs
    from megacompile.simulate import makespan, simulate
    import megacompile
    from megacompile.backend import programs_of
    model = tiny_model("llama", layers=4)
    ref = clone(model)
    cmodel = torch.compile(model, backend="megatrain", options={
        "device": "cpu", "slots": 3, "hardware": _hardware_json(tmp_path, "link", h2d_gbps)})
    assert_step_matches_eager(model, ref, cmodel)
    program = programs_of(model)[-1]
    hw = program.hardware
    for runner in program.runners.values():
        sched = runner.schedule
        costs = segment_costs(runner.graph, sched.segments, hw)
        times = [makespan(simulate(build_steps(sched.segments, d), costs, hw)) for d in range(3)]
        assert times[sched.lookahead] <= min(times) * 1.01
        assert all(t > min(times) * 1.01 for t in times[:sched.lookahead])
        if h2d_gbps == 1e9:
            assert sched.lookahead == 0
    lookahead = max(r.schedule.lookahead for r in program.runners.values())
    seg_bytes = sorted((seg.weight_nbytes for seg in program.runners["forward"].schedule.segments), reverse=True)
    assert megacompile.stats(cmodel)["peak_device_weight_bytes"] <= sum(seg_bytes[:lookahead + 1])


def test_measured_cpu_profile_is_sane():
    hw = load_hardware("cpu", torch.float32)
    assert isinstance(hw, Hardware) and hw.name == "cpu" and not hw.overlap and hw.measure_ops
    assert 1e-3 < hw.compute_tflops < 100 and 0.1 < hw.h2d_gbps < 1000 and hw.device_memory_gib > 0.5


def _uniform_layers(layers: int, body_s: float, nbytes: float, grads: bool):
    """A schedule of `layers` equal segments (`nbytes` of weights, and of gradients with `grads`,
    `body_s` each) on free links: (steps, costs, hardware) for the simulator."""
    from megacompile.passes.schedule import SegmentInfo, build_steps
    from megacompile.simulate import SegmentCost
    segs = [SegmentInfo(f"l{i}", i, [i], grads=[(i, "g")] if grads else [], weight_nbytes=int(nbytes))
            for i in range(layers)]
    costs = [SegmentCost(f"l{i}", int(nbytes), int(nbytes) if grads else 0, body_s) for i in range(layers)]
    hw = Hardware("t", 1.0, h2d_gbps=1e6, d2h_gbps=1e6, device_memory_gib=1.0, host_memory_gbps=1.0)
    return build_steps(segs, 1), costs, hw


def test_overlapped_step_hides_the_optimizer_under_the_backward_up_to_its_own_length():
    """overlap_optimizer=backward in the simulator: a host stream updates each layer once its
    gradient offload has landed, so the step pays one layer's update after the backward when
    the host is faster than the layers arrive, and the whole optimizer after the first layer's
    gradients when the host is the slower stream; on a profile without overlap it all adds up."""
    from megacompile.simulate import grad_bytes, makespan, simulate
    layers, body_s, gb = 10, 1.0, 1e9
    steps, costs, hw = _uniform_layers(layers, body_s, gb, grads=True)
    assert grad_bytes(steps, costs) == layers * gb
    backward = makespan(simulate(steps, costs, hw))
    assert backward == pytest.approx(layers * body_s, rel=1e-3)

    def overlapped(optimizer_s):
        timed = simulate(steps, costs, hw, optimizer_s_per_byte=optimizer_s / (layers * gb))
        updates = [s for s in timed if s.op == "optimizer"]
        assert len(updates) == layers and all(s.stream == "host" for s in updates)
        assert all(u.start >= o.end for u, o in zip(updates, [s for s in timed if s.op == "grad_offload"]))
        return makespan(timed)
    assert overlapped(5.0) == pytest.approx(backward + 5.0 / layers, rel=1e-3)       # fast host: one layer's update
    assert overlapped(20.0) == pytest.approx(body_s + 20.0, rel=1e-3)                # slow host: all of it
    serial = Hardware("t", 1.0, 1e6, 1e6, 1.0, 1.0, overlap=False)
    assert makespan(simulate(steps, costs, serial, optimizer_s_per_byte=5.0 / (layers * gb))) == \
        pytest.approx(backward + 5.0, rel=1e-3)


def test_optimizer_under_the_next_forward_delays_each_prefetch_until_its_update():
    """optimizer="forward" in the simulator: the host updates the segments in the order the
    forward fetches them, from the step's start; a prefetch waits for its segment's update, so a
    fast host costs the first segment's update and a slow one stretches the forward to its own
    length plus the last segment's body."""
    from megacompile.simulate import fetched_bytes, makespan, simulate
    layers, body_s, gb = 10, 1.0, 1e9
    steps, costs, hw = _uniform_layers(layers, body_s, gb, grads=False)
    assert fetched_bytes(steps) == layers * gb
    forward = makespan(simulate(steps, costs, hw))

    def overlapped(optimizer_s):
        timed = simulate(steps, costs, hw, optimizer_s_per_byte=optimizer_s / (layers * gb), optimizer="forward")
        updates = {s.segment: s for s in timed if s.op == "optimizer"}
        assert sorted(updates) == list(range(layers))
        assert all(s.start >= updates[s.segment].end for s in timed if s.op == "prefetch")
        return makespan(timed)
    assert overlapped(5.0) == pytest.approx(forward + 5.0 / layers, rel=1e-3)
    assert overlapped(20.0) == pytest.approx(20.0 + body_s, rel=1e-3)
    with pytest.raises(ValueError, match="'backward' or 'forward'"):
        simulate(steps, costs, hw, optimizer_s_per_byte=1e-9, optimizer="sideways")


def test_a_capture_read_back_from_json_is_the_capture_without_its_graphs():
    """plan_capture.to_json / from_json: every field but the bodies' graphs comes back equal (the
    seconds re-costed from the kept BodyCosts are the seconds of the graphs); timing it on a
    profile that measures ops, which needs the graphs, is refused rather than costed as nothing."""
    import dataclasses
    import json as json_

    from megacompile.errors import InternalError
    from megacompile.plan_capture import capture_prefix, from_json, to_json
    made = capture_prefix(tiny_config("llama"), 2, 2, 64, 2, torch.bfloat16, BUILTIN["h200"], {"logits": "drop"})
    back = from_json(json_.loads(json_.dumps(to_json(made))))
    assert back.batch == made.batch and back.attention_chunks == made.attention_chunks
    for name, d in made.directions.items():
        assert dataclasses.replace(back.directions[name], bodies=d.bodies) == d
        for hw in (BUILTIN["h200"], BUILTIN["h100"]):
            assert back.directions[name].seconds_on(hw) == d.seconds_on(hw)
    with pytest.raises(InternalError, match="without its bodies"):
        back.directions["forward"].seconds_on(dataclasses.replace(BUILTIN["h200"], measure_ops=True))
    assert from_json({"batch": 2}) is None   # (another layout: a miss)
