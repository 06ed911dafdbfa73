"""Unit tests of individual passes on hand-built graphs."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from megacompile.passes import GROUP, PassContext, pipelines, run_pipeline
from megacompile.passes.layer_regions import PROLOGUE, layer_regions
from megacompile.passes.recompute_boundaries import recompute_boundaries
from megacompile.passes.tag_weights import tag_weights

aten = torch.ops.aten


def joint_graph():
    """x -> [layer: mm(x, t(w1))] -> [head: mm(h, t(w2))] -> output; w2's transpose is weight-only."""
    g = fx.Graph()
    w1 = g.placeholder("primals_1")
    w2 = g.placeholder("primals_2")
    x = g.placeholder("primals_3")
    g.placeholder("tangents_1")
    t = g.call_function(aten.t.default, (w1,), name="t")
    h = g.call_function(aten.mm.default, (x, t), name="mm")
    r = g.call_function(aten.relu.default, (h,), name="relu")
    t_1 = g.call_function(aten.t.default, (w2,), name="t_1")
    out = g.call_function(aten.mm.default, (r, t_1), name="mm_1")
    for node, module in ((t, "layers.0"), (h, "layers.0"), (r, "layers.0"), (t_1, "head"), (out, "head")):
        node.meta["nn_module_stack"] = {module: (f"L['self'].{module}", torch.nn.Module)}
    g.output((out,))
    return fx.GraphModule(torch.nn.Module(), g)


def ctx(**kw):
    # groups: 0 embed (unused here), 1 the layer, 2 the head
    return PassContext(direction="joint", num_groups=3, flat_groups={0: 1, 1: 2},
                       module_groups={"layers": 1, "layers.0": 1, "head": 2}, **kw)


def test_layer_regions_follow_the_weights():
    gm = run_pipeline(joint_graph(), [tag_weights, layer_regions], ctx())
    groups = {n.name: n.meta.get(GROUP) for n in gm.graph.nodes if n.op == "call_function"}
    assert groups["mm"] == 1 and groups["relu"] == 1 and groups["mm_1"] == 2
    assert PROLOGUE not in groups.values()


def test_weight_only_nodes_are_always_recomputed_never_boundaries():
    gm = run_pipeline(joint_graph(), [tag_weights, layer_regions, recompute_boundaries], ctx())
    nodes = {n.name: n for n in gm.graph.nodes}
    for t in ("t", "t_1"):  # t(w1) in the layer, t(w2) in the head (which is not recomputed)
        assert nodes[t].meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
        assert "ac_graph_id" not in nodes[t].meta
    # the layer's output feeds the head: a boundary, saved
    assert nodes["relu"].meta["recompute"] == CheckpointPolicy.MUST_SAVE
    assert nodes["mm"].meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
    assert "recompute" not in nodes["mm_1"].meta  # the head is left to the min-cut by default


def test_recompute_head_option_tags_the_head():
    gm = run_pipeline(joint_graph(), [tag_weights, layer_regions, recompute_boundaries],
                      ctx(recompute_head=True))
    nodes = {n.name: n for n in gm.graph.nodes}
    assert nodes["mm_1"].meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
    assert nodes["mm_1"].meta["ac_graph_id"] == 2


def test_model_level_glue_runs_in_its_consumer():
    """A node without a module (the model's own forward) goes to the segment that reads it."""
    gm = joint_graph()
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    del relu.meta["nn_module_stack"]
    gm = run_pipeline(gm, [tag_weights, layer_regions], ctx())
    assert relu.meta[GROUP] == 2


def test_disabled_pass_is_recorded_and_contracts_are_checked():
    import pytest
    from megacompile.passes import ContractError
    c = ctx(disabled=("layer_regions",))
    with pytest.raises(ContractError, match="reads node key 'mt_group'.*'layer_regions' writes, and it is disabled"):
        run_pipeline(joint_graph(), [tag_weights, layer_regions, recompute_boundaries], c)
    assert c.records == []   # refused before the first pass ran
    c = ctx(disabled=("recompute_boundaries",))
    run_pipeline(joint_graph(), [tag_weights, layer_regions, recompute_boundaries], c)
    assert [r[:2] for r in c.records] == [("tag_weights", "ran"), ("layer_regions", "ran"),
                                          ("recompute_boundaries", "disabled")]


def test_disabling_each_pass_runs_or_is_refused_before_any_work(monkeypatch):
    """Every pass switched off in turn: the step runs (and computes eager's loss), or a
    ContractError naming the reader and the disabled writer comes before any pass has run."""
    import pytest
    import torch

    import megacompile.backend as backend
    from conftest import batch, tiny_model
    from megacompile.errors import ContractError
    from megacompile.options import pass_names
    calls = []
    real = backend.run_pipeline
    monkeypatch.setattr(backend, "run_pipeline", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, mask, labels = batch(2, 8)
    eager = tiny_model("llama", layers=2)(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    refused = []
    for name in pass_names():
        calls.clear()
        torch._dynamo.reset()
        cmodel = torch.compile(tiny_model("llama", layers=2), backend="megatrain",
                               options={"device": "cpu", "disable_passes": [name]})
        try:
            loss = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        except Exception as e:  # Dynamo wraps a backend's errors (BackendCompilerFailed)
            inner = getattr(e, "inner_exception", e)
            assert isinstance(inner, ContractError), (name, repr(inner))
            assert (f"pass {name!r} writes, and it is disabled" in str(inner)
                    or f"that pass {name!r} must handle later, and it is disabled" in str(inner)), (name, str(inner))
            assert not calls, name
            refused.append(name)
            continue
        loss.backward()
        torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
    # the passes others read cannot be switched off; the rest can
    assert set(refused) == {"tag_weights", "layer_regions", "recompute_boundaries", "split_segments", "schedule",
                            "layer_region_inputs", "inline_layer_regions"}   # (what layer_subgraphs' calls need)
    with pytest.raises(ContractError, match="pass 'offload_checkpoints' reads graph key 'mt_schedule'"):
        pipelines.check_pipelines(("schedule",))
    pipelines.check_pipelines(("layer_subgraphs", "layer_region_inputs", "inline_layer_regions"))   # (no calls made)


def test_a_profiler_trace_shows_the_schedule_ops_per_segment():
    """torch.profiler ranges named megatrain.<direction>.<op>.<segment> around every schedule op,
    and the optimizer's step, on any device (here the CPU)."""
    import torch

    from conftest import batch, tiny_model
    from megacompile.runtime.adamw import HostAdamW
    model = tiny_model("llama", layers=2)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    opt = HostAdamW(model.parameters(), lr=1e-3)
    ids, mask, labels = batch(2, 8)
    cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()   # (compiles)
    opt.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
        opt.step()
    names = {e.key for e in prof.key_averages() if e.key.startswith("megatrain.")}
    ops = {tuple(n.split(".")[1:3]) for n in names}
    assert {("forward", "prefetch"), ("forward", "wait"), ("forward", "run"), ("forward", "evict"),
            ("backward", "run"), ("backward", "grad_offload"), ("backward", "grad_drain"),
            ("optimizer", "step")} <= ops, sorted(names)
    # one range per segment and op: the 2 decoder layers' forward runs are told apart
    assert len({n for n in names if n.startswith("megatrain.forward.run.")}) >= 4


def test_a_pass_receives_only_the_options_it_declares():
    import pytest

    from megacompile.passes import graph_pass
    seen = {}

    @graph_pass("peek", uses=("slots",))
    def peek(gm, opts):
        seen["slots"] = opts.slots
        opts.records.append(("peek", "noted", None))
        return gm if not seen.get("greedy") else (gm, opts.kernels)
    c = ctx()
    run_pipeline(joint_graph(), [peek], c)
    assert seen["slots"] == c.slots and ("peek", "noted", None) in c.records
    seen["greedy"] = True
    with pytest.raises(AttributeError, match="pass 'peek' reads option 'kernels' it does not declare"):
        run_pipeline(joint_graph(), [peek], ctx())
    with pytest.raises(ValueError, match="not PassContext fields"):
        graph_pass("typo", uses=("slot",))(lambda gm, opts: gm)
