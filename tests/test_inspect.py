"""`megatrain inspect`: real capture and passes on a meta-device model, several output formats."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import tiny_config
from megacompile.cli import main


@pytest.fixture
def config_json(tmp_path):
    path = tmp_path / "config.json"
    tiny_config("llama", layers=3).to_json_file(path)
    return path


def test_json_report_of_a_config_file(config_json, capsys):
    assert main(["inspect", str(config_json), "--seq", "16", "--format", "json", "--gpu", "h100"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["version"] == 2 and report["model"]["layers"] == 3
    assert report["model"]["distinct_layer_bodies"] == 1 and report["hardware"]["name"] == "h100"
    fw, bw = report["directions"]["forward"], report["directions"]["backward"]
    names = [s["name"] for s in fw["segments"]]
    assert names == ["prologue", "embed", "model.layers.0", "model.layers.1", "model.layers.2", "head"]
    for d in (fw, bw):
        for s in d["steps"]:
            assert s["end_s"] >= s["start_s"] >= 0
            assert s["stream"] in {"h2d", "compute", "d2h", "host"}
        # a body never starts before its segment's weights arrived
        arrived = {s["segment"]: s["end_s"] for s in d["steps"] if s["op"] == "prefetch"}
        for s in d["steps"]:
            if s["op"] in ("forward", "recompute", "backward") and s["segment"] in arrived:
                assert s["start_s"] >= arrived[s["segment"]]
    assert {s["op"] for s in fw["steps"]} == {"prefetch", "wait", "forward", "evict"}
    assert {"recompute", "backward", "grad_offload", "optimizer"} <= {s["op"] for s in bw["steps"]}
    # each layer's backward replays its forward first (layer-boundary recomputation)
    layer_segs = [s["index"] for s in bw["segments"] if s["name"].startswith("model.layers.")]
    assert all(0 < bw["segments"][k]["recompute_fraction"] < 1 for k in layer_segs)
    opt = next(s for s in bw["steps"] if s["op"] == "optimizer")
    assert opt["stream"] == "host" and opt["start_s"] == report["forward_backward_seconds"]
    assert report["step_seconds"] == opt["end_s"] > report["forward_backward_seconds"]
    assert bw["saved_activation_bytes"] > 0
    assert report["step_seconds"] >= max(s["end_s"] for s in fw["steps"])


def test_overlapped_optimizer_updates_each_segment_after_its_gradients_land(config_json, capsys):
    """--overlap-optimizer backward: one host update per gradient offload, each after it and in
    its order; the store's whole optimizer time is spread over them and the step is no longer."""
    args = ["inspect", str(config_json), "--seq", "16", "--format", "json", "--gpu", "h100"]
    assert main(args) == 0
    serial = json.loads(capsys.readouterr().out)
    assert main(args + ["--overlap-optimizer", "backward"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["overlap_optimizer"] == "backward" and serial["overlap_optimizer"] is None
    steps = report["directions"]["backward"]["steps"]
    offloads = [s for s in steps if s["op"] == "grad_offload"]
    updates = [s for s in steps if s["op"] == "optimizer"]
    assert len(updates) == len(offloads) > 3 and all(u["stream"] == "host" for u in updates)
    assert [u["segment"] for u in updates] == [o["segment"] for o in offloads]
    for u, o in zip(updates, offloads):
        assert u["start_s"] >= o["end_s"] and u["bytes"] == o["bytes"]
    assert all(b["start_s"] >= a["end_s"] for a, b in zip(updates, updates[1:]))   # one host stream
    (serial_opt,) = [s for s in serial["directions"]["backward"]["steps"] if s["op"] == "optimizer"]
    assert sum(u["end_s"] - u["start_s"] for u in updates) == pytest.approx(serial_opt["end_s"] - serial_opt["start_s"])
    assert report["forward_backward_seconds"] == pytest.approx(serial["forward_backward_seconds"])
    assert report["forward_backward_seconds"] < report["step_seconds"] <= serial["step_seconds"]
    # under the next forward: one update per prefetch, before it
    assert main(args + ["--overlap-optimizer", "forward"]) == 0
    report = json.loads(capsys.readouterr().out)
    steps = report["directions"]["forward"]["steps"]
    updates = {s["segment"]: s for s in steps if s["op"] == "optimizer"}
    prefetches = [s for s in steps if s["op"] == "prefetch"]
    assert sorted(updates) == sorted(s["segment"] for s in prefetches) and len(prefetches) > 3
    assert all(s["start_s"] >= updates[s["segment"]]["end_s"] for s in prefetches)
    assert not any(s["op"] == "optimizer" for s in report["directions"]["backward"]["steps"])
    assert sum(u["end_s"] - u["start_s"] for u in updates.values()) == \
        pytest.approx(serial_opt["end_s"] - serial_opt["start_s"])
    assert report["step_seconds"] <= serial["step_seconds"]


def test_chrome_trace_and_text_views(config_json, tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert main(["inspect", str(config_json), "--seq", "16", "--format", "chrome-trace", "-o", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {"compute", "h2d", "d2h", "host"}
    assert any(e["ph"] == "X" and e["name"].startswith("prefetch") for e in events)
    svg = tmp_path / "timeline.svg"
    assert main(["inspect", str(config_json), "--seq", "16", "--format", "svg", "-o", str(svg)]) == 0
    import xml.etree.ElementTree as ET
    root = ET.fromstring(svg.read_text())
    rects = [r for r in root.iter("{http://www.w3.org/2000/svg}rect")
             if r.find("{http://www.w3.org/2000/svg}title") is not None]
    assert any("prefetch" in r.find("{http://www.w3.org/2000/svg}title").text for r in rects)
    for show in ("schedule", "memory", "passes", "graphs"):
        assert main(["inspect", str(config_json), "--seq", "16", "--show", show]) == 0
        text = capsys.readouterr().out
        assert "distinct layer bodies 1" in text
    assert "aten." in text  # --show graphs prints the lowered bodies
    # ... after the schedule program, whose transfer ops follow the schedule
    program = text.split("-- schedule program")[1].split("-- body")[0]
    assert all(f"torch.ops.megatrain.{op}.default(" in program for op in ("prefetch", "wait", "evict"))


def test_the_schedule_program_writes_out_the_executed_steps():
    """The schedule program (ir.schedule_program, built by the schedule pass): one node per
    transfer step, in step order, the bodies called where the schedule runs them; the executor
    runs exactly its nodes, and calling it without the runtime is refused."""
    import pytest
    import torch

    from conftest import batch, tiny_model
    from megacompile.backend import programs_of
    from megacompile.ir import SCHEDULE_OPS
    model = tiny_model("llama", layers=3)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ids, mask, labels = batch(2, 8)
    cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    ops = {f: name for name, f in SCHEDULE_OPS.items()}
    for direction, runner in programs_of(model)[0].runners.items():
        gm = runner.schedule.program
        written = [(ops[n.target], n.args[0]) if n.op == "call_function" and n.target in ops else ("run", n.name)
                   for n in gm.graph.nodes if n.op == "call_module" or n.target in ops]
        calls = [n.name for n in runner.graph.graph.nodes if n.op == "call_module"]
        steps = [(s.op, s.segment if s.op != "run" else calls[s.segment]) for s in runner.schedule.steps]
        assert written == steps and any(op == "grad_offload" for op, _ in steps) == (direction == "backward")
        # the executor's table runs the program's nodes, placeholders and output aside
        assert [n for _, _, n, _ in runner.ops] == [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        # the bodies it calls are the deduplicated ones: 3 identical layers, one body
        layer_bodies = {n.target for n in gm.graph.nodes if n.op == "call_module"}
        assert len(layer_bodies) < len(calls)
    with pytest.raises(RuntimeError, match="run by the runtime"):
        torch.ops.megatrain.wait(0)


def test_an_op_without_a_handler_is_refused_before_the_first_node():
    """A pass that adds an op to the program that a walker has no handler for: refused by name
    before anything runs (ir.walk, and the executor's table)."""
    import pytest
    import torch.fx as fx

    from megacompile.ir import walk
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(abs, (x,)))
    seen = []
    with pytest.raises(KeyError, match="value"):
        walk(fx.GraphModule({}, g), {"placeholder": lambda i, n: seen.append(n), "output": lambda i, n: None})
    assert not seen


def test_preset_builds_on_the_meta_device(capsys):
    assert main(["inspect", "llama-3-8b", "--layers", "2", "--seq", "256", "--show", "memory"]) == 0
    text = capsys.readouterr().out
    assert "llama-3-8b (llama): 2 layers" in text and "peak resident weights" in text


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["inspect", "no-such-model"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "megacompile.cli", "inspect", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--format" in out and "chrome-trace" in out


@pytest.mark.parametrize("preset", sorted(__import__("megacompile.presets", fromlist=["PRESETS"]).PRESETS))
def test_every_preset_inspects(preset, capsys):
    """Dense, MoE, hybrid linear-attention, MLA and VLM presets all capture and schedule (2 layers)."""
    assert main(["inspect", preset, "--layers", "2", "--seq", "64", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["layers"] == 2 and report["model"]["distinct_layer_bodies"] >= 1
    fw = report["directions"]["forward"]
    last = [s["name"] for s in fw["segments"]][-3:]   # (a VLM's stack: model.language_model.layers)
    assert last[0].endswith("layers.0") and last[1].endswith("layers.1") and last[2] == "head", last


def test_inspect_compiles_to_artifacts_without_a_runtime():
    """plan and inspect read compile artifacts (ir.Compiled: the split graph, its schedule
    program, memory plan and bodies): no weight store entries, pool, gradient path or runners."""
    import pytest
    import torch

    from megacompile.inspect import build_meta_model, capture_program
    from megacompile.runtime.store import entry_of
    model, _ = build_meta_model("llama-3-8b", 2, torch.bfloat16)
    program = capture_program(model, 1, 64, 2)
    assert not program.runtime and not program.runners and set(program.compiled) == {"forward", "backward"}
    assert not hasattr(program, "pool") and not hasattr(program, "grads")
    assert all(entry_of(p) is None for p in model.parameters())
    for done in program.compiled.values():
        assert done.plan is not None and done.schedule.program is not None
        assert len(done.body_of) == len(done.schedule.segments)
    with pytest.raises(RuntimeError, match="compiled for inspection"):
        from megacompile.backend import _compile_only
        _compile_only([])


def test_the_state_tier_reads_and_writes_on_an_ssd_stream(config_json, capsys, monkeypatch):
    """--nvme: each host update waits for the tier's read of its state and is followed by its
    write, on one `ssd` stream (one drive: no two of its ops at once); together they move the
    tiered masters and moments once each per step."""
    from megacompile.plan import host_bytes
    from megacompile.runtime import state_tier
    monkeypatch.setattr(state_tier, "MIN_NUMEL", 1)   # (the tiny model's weights go to the tier)
    args = ["inspect", str(config_json), "--seq", "16", "--format", "json", "--gpu", "h100", "--nvme", "gen4x1"]
    assert main(args + ["--overlap-optimizer", "backward"]) == 0
    report = json.loads(capsys.readouterr().out)
    tiered = report["nvme"]["bytes_per_step"]
    from megacompile.inspect import build_meta_model
    import torch
    model, _ = build_meta_model(str(config_json), None, torch.bfloat16)
    placed = host_bytes(model, "cuda", "all")
    assert tiered == placed.ssd_masters + placed.ssd_optimizer_state > 0
    steps = report["directions"]["backward"]["steps"]
    ssd = sorted((s for s in steps if s["stream"] == "ssd"), key=lambda s: s["start_s"])
    assert all(b["start_s"] >= a["end_s"] - 1e-12 for a, b in zip(ssd, ssd[1:]))
    reads = {s["segment"]: s for s in ssd if s["op"] == "tier_read"}
    writes = {s["segment"]: s for s in ssd if s["op"] == "tier_write"}
    updates = [s for s in steps if s["op"] == "optimizer"]
    assert len(updates) > 3 and sorted(reads) == sorted(writes) == sorted(u["segment"] for u in updates)
    for u in updates:
        assert u["start_s"] >= reads[u["segment"]]["end_s"] and writes[u["segment"]]["start_s"] >= u["end_s"]
    assert sum(s["bytes"] for s in reads.values()) == pytest.approx(tiered, rel=1e-6)
    # after the backward: one read of the whole state, the update waits for it, then the write
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    steps = report["directions"]["backward"]["steps"]
    (read,) = [s for s in steps if s["op"] == "tier_read"]
    (write,) = [s for s in steps if s["op"] == "tier_write"]
    assert read["bytes"] == write["bytes"] == tiered and report["step_seconds"] >= read["end_s"] <= write["start_s"]
    assert main(args[:-2] + ["--show", "schedule"]) == 0 and "ssd" not in capsys.readouterr().out


def test_capture_returns_the_graphs_outputs_without_running_the_layers(monkeypatch):
    """inspect/plan never run the captured graph: its layer-kind calls would each re-trace their
    subgraph (torch's invoke_subgraph schema), 7 s at 80 layers. The outputs are meta tensors of
    the traced shapes."""
    import torch

    import megacompile.meta_model as inspect
    real, graphs = inspect.megatrain_backend, []

    def backend(gm, example_inputs, **kw):
        result = real(gm, example_inputs, **kw)
        graphs.append(gm)
        gm.forward = lambda *a, **k: pytest.fail("the captured graph ran")
        return result
    monkeypatch.setattr(inspect, "megatrain_backend", backend)
    model = inspect.build_model_from_config(tiny_config("llama", layers=3), None, torch.float32)
    program = inspect.capture_program(model, batch=2, seq=16, slots=2, options={"layer_regions": "always"})
    assert graphs and program.layer_regions.kinds   # (the graph had layer-kind calls)
    out = next(n for n in graphs[0].graph.nodes if n.op == "output")
    vals = [a.meta["example_value"] for a in out.args[0] if isinstance(a, torch.fx.Node)]
    got = [t for t in inspect.meta_outputs(graphs[0]) if isinstance(t, torch.Tensor)]
    assert [(t.shape, t.dtype, t.device.type) for t in got] == [(v.shape, v.dtype, "meta") for v in vals]
