"""Dynamo traces each decoder-layer kind once (option dynamo_regions: megacompile/dynamo_regions.py,
passes/inline_dynamo_regions.py): the program is the whole trace's, the numbers are eager's, and
a layer whose trace reads what differs between layers of one kind is traced whole again."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import assert_step_matches_eager, batch, tiny_model
from families import FAMILIES
from random_stacks import compiled_step, stack_and_batch, stack_specs
from test_layer_regions import capture, layout

from megacompile import dynamo_regions
from megacompile.backend import programs_of
from megacompile.errors import ConfigError
from megacompile.options import Options

ON = {"dynamo_regions": "always", "layer_regions": "always"}


def named_layout(program) -> dict:
    """test_layer_regions.layout with each weight and gradient by parameter name instead of flat
    index (a stamped-out layer lifts its weights in its subgraph's order, a whole trace in the
    order it first reads them: Lfm2-MoE's expert bias)."""
    names = {inp.index: inp.name for inp in program.capture.inputs}
    out = layout(program)
    for direction in out.values():
        direction["segments"] = [(group, tuple(sorted(names[i] for i in weights)), nbytes,
                                  tuple(sorted(names[i] for i in grads)))
                                 for group, weights, nbytes, grads in direction["segments"]]
    return out


def check_family(name: str) -> None:
    regional, whole = capture(name, ON), capture(name, {})
    assert named_layout(regional) == named_layout(whole), name
    record = regional.dynamo_regions
    assert record is not None and not record.retrace, record
    # (a kind of one layer is traced in line: torch inlines a subgraph called once)
    repeated = sum(len(layers) for layers in regional.layer_regions.kinds.values() if len(layers) > 1)
    assert record.calls == repeated if repeated else record.calls == 0, (record, regional.layer_regions)


# dense; sliding + full attention; hybrid linear attention + MoE; a layer that returns (h, None)
CI_FAMILIES = ["llama", "gemma3_text", "qwen3_next", "bamba"]


@pytest.mark.parametrize("name", CI_FAMILIES)
def test_dynamo_regions_give_the_whole_trace_program(name):
    check_family(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(FAMILIES) - set(CI_FAMILIES)))
def test_dynamo_regions_give_the_whole_trace_program_for_every_family(name):
    check_family(name)


def _compiled(model, **options):
    return torch.compile(model, backend="megatrain", options={"device": "cpu", "slots": 2, **ON, **options})


def test_a_step_with_dynamo_regions_is_eager_s_and_compiles_once(clone):
    model = tiny_model(layers=4)
    ref = clone(model)
    cmodel = _compiled(model)
    assert_step_matches_eager(model, ref, cmodel)
    record = programs_of(model)[-1].dynamo_regions
    assert (record.calls, record.kinds, record.retrace) == (4, 1, "")
    ids, mask, labels = batch(2, 8, seed=1)
    cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    assert len(programs_of(model)) == 1   # (the wrappers stay: no recompile for the same shapes)
    # outside torch.compile the wrapped layers run as before
    model.zero_grad()
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss)


def _trained_step_matches_eager(model, ref) -> None:
    """One compiled step of `model` with regions against eager `ref`: the loss and the gradients
    of what is trained (frozen weights have none)."""
    ids, mask, labels = batch(2, 8)
    loss = _compiled(model)(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    loss.backward()
    ref_loss = ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


class _ScaledMLP(torch.nn.Module):
    """An MLP whose output depends on its layer's index: a trace of layer 0 is wrong for layer 1."""

    def __init__(self, mlp, layer_idx):
        super().__init__()
        self.inner, self.layer_idx = mlp, layer_idx

    def forward(self, x):
        return self.inner(x) * (1.0 + self.layer_idx)


def test_a_layer_whose_trace_reads_layer_idx_is_traced_whole(clone, caplog):
    model = tiny_model(layers=3)
    for i, layer in enumerate(model.model.layers):
        layer.mlp = _ScaledMLP(layer.mlp, i)
    ref = clone(model)
    with caplog.at_level(logging.INFO, logger="megatrain.compile"):
        assert_step_matches_eager(model, ref, _compiled(model))
    assert "again without layer regions" in caplog.text and "layer_idx" in caplog.text
    assert programs_of(model)[-1].dynamo_regions.calls == 0
    assert "layer_idx" in dynamo_regions.install(model, model.model.layers, "model.layers")   # (whole from then on)


def test_a_layer_called_with_an_input_that_needs_no_gradient_is_a_kind_of_its_own(clone, caplog):
    """Frozen embeddings: layer 0's input needs no gradient, layer 1's does (the same layer kind):
    the reuse key tells the calls apart."""
    model = tiny_model(layers=3)
    model.model.embed_tokens.weight.requires_grad_(False)
    ref = clone(model)
    with caplog.at_level(logging.INFO, logger="megatrain.compile"):
        _trained_step_matches_eager(model, ref)
    assert "again without layer regions" not in caplog.text
    record = programs_of(model)[-1].dynamo_regions
    assert (record.calls, record.retrace) == (2, ""), record   # (layers 1 and 2; layer 0 in line)


def test_the_kind_key_tells_layer_kinds_apart():
    model = tiny_model(layers=2)
    a, b = model.model.layers
    assert dynamo_regions.kind_key(a) == dynamo_regions.kind_key(b)   # (layer_idx aside)
    b.self_attn.scaling = b.self_attn.scaling * 2
    assert dynamo_regions.kind_key(a) != dynamo_regions.kind_key(b)
    b.self_attn.scaling = a.self_attn.scaling
    b.mlp.up_proj.weight.requires_grad_(False)
    assert dynamo_regions.kind_key(a) != dynamo_regions.kind_key(b)


def test_dynamo_regions_need_their_inline_pass():
    with pytest.raises(ConfigError, match="dynamo_regions='always' needs pass 'inline_dynamo_regions'"):
        Options.from_mapping({"dynamo_regions": "always", "disable_passes": ["inline_dynamo_regions"]})
    for value in ("auto", "never"):   # (auto forms no regions without the pass)
        Options.from_mapping({"dynamo_regions": value, "disable_passes": ["inline_dynamo_regions"]})
    assert not dynamo_regions.wanted("auto", 80, ("inline_dynamo_regions",))
    assert dynamo_regions.wanted("auto", 80) and not dynamo_regions.wanted("auto", 4)


def test_a_call_with_a_kv_cache_traces_its_layers_in_line():
    """A DynamicCache (which each layer writes into) cannot cross into a reused region: the
    layers run in line, and the call traces as it would without regions."""
    model = tiny_model(layers=3).eval()
    dynamo_regions.install(model, model.model.layers, "model.layers")
    graphs = []
    compiled = torch.compile(model, backend=lambda gm, _inputs: graphs.append(gm) or gm.forward)
    ids = batch()[0]
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, use_cache=True).logits, model(ids, use_cache=True).logits)
    assert not any("subgraph" in name for gm in graphs for name, _ in gm.named_children())


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=stack_specs(max_layers=4), seed=st.integers(0, 2**16))
def test_random_stacks_give_the_whole_trace_program_and_numbers(spec, seed):
    model, ids, labels = stack_and_batch(spec, seed)
    whole_model = copy.deepcopy(model)
    loss = compiled_step(model, ids, labels, ON)
    whole_loss = compiled_step(whole_model, ids, labels, {})
    regional, whole = programs_of(model)[-1], programs_of(whole_model)[-1]
    torch.testing.assert_close(loss, whole_loss, rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(model.named_parameters(), whole_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert named_layout(regional) == named_layout(whole)


def test_a_compile_leaves_the_garbage_collector_as_it_was():
    """The collector is paused while megatrain compiles (compile_start.GcPause) and on again after;
    a user who turned it off keeps it off."""
    import gc
    model = tiny_model(layers=2)
    ids, mask, labels = batch(2, 8)
    assert gc.isenabled()
    _compiled(model)(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    assert gc.isenabled()
    torch._dynamo.reset()
    gc.disable()
    try:
        _compiled(model)(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_passes_walk_new_nodes_arguments_as_torch_does():
    """passes/fx_args.py: the same leaves as pytree for the containers FX arguments hold, and a raw
    SymInt still warns."""
    import warnings

    import torch.fx as fx
    import torch.utils._pytree as pytree
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.immutable_collections import immutable_dict, immutable_list

    from megacompile.passes.fx_args import _leaves, plain_arg_walk
    graph = fx.Graph()
    x = graph.placeholder("x")
    tree = ((x, [1, (2.0, None)], immutable_list([x, "a"])), immutable_dict({"k": (x, slice(1, 2))}))
    assert sorted(map(repr, _leaves(tree))) == sorted(map(repr, pytree.tree_iter(tree)))
    symbolic = ShapeEnv().create_unbacked_symint()
    with plain_arg_walk(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph.call_function(torch.add, (x, [symbolic]))
    assert any("Raw SymInt" in str(w.message) for w in caught)
    import torch.fx.graph as fx_graph
    assert fx_graph.pytree is pytree   # (restored)


def test_a_stack_of_more_kinds_than_torch_s_default_limit_compiles(clone):
    """Every layer a kind of its own (torch allows 8 reuse entries per region function by
    default, and all layers share one function's code): the step runs and equals eager."""
    model = tiny_model(layers=10)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.scaling = layer.self_attn.scaling * (1 + i / 10)
    assert len({dynamo_regions.kind_key(layer) for layer in model.model.layers}) == 10
    ref = clone(model)
    assert_step_matches_eager(model, ref, _compiled(model))


def test_lora_layers_with_dynamo_regions_train_like_eager(clone):
    """peft's LoRA wrappers inside the layers (frozen base, trained adapters) through regions."""
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(tiny_model(layers=4), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                            target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    _trained_step_matches_eager(model, clone(model))
    record = programs_of(model)[-1].dynamo_regions   # (peft names each layer's path in its modules)
    assert (record.calls, record.retrace) == (3, ""), record
