"""Bad input gets a clear error that says what to change."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import megacompile
from conftest import batch, tiny_model


def raised(excinfo, kind):
    """Dynamo wraps backend errors in BackendCompilerFailed; ours must be the inner cause."""
    err = excinfo.value
    inner = getattr(err, "inner_exception", err)
    assert isinstance(inner, kind), repr(err)
    return str(inner)


def test_encoder_decoder_model_is_refused():
    from transformers import T5Config, T5ForConditionalGeneration
    model = T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                num_decoder_layers=1, num_heads=4)).train()
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ids = torch.randint(0, 128, (2, 6))
    with pytest.raises(Exception) as e:
        cmodel(input_ids=ids, labels=ids, use_cache=False)
    msg = raised(e, megacompile.UnsupportedModelError)
    assert "encoder-decoder" in msg and "t5" in msg and "ForCausalLM" in msg


_SEQ2SEQ = dict(vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, decoder_start_token_id=1)


@pytest.mark.parametrize("model_type,kind,call", [
    ("bert", "encoder-only", lambda m, ids: m(input_ids=ids, labels=ids)),
    ("bart", "encoder-decoder", lambda m, ids: m(input_ids=ids, labels=ids, use_cache=False)),
    ("whisper", "encoder-decoder",
     lambda m, ids: m(input_features=torch.randn(2, 8, 32), decoder_input_ids=ids, labels=ids, use_cache=False)),
])
def test_non_decoder_only_models_are_refused_before_any_work(model_type, kind, call):
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq
    if model_type == "bert":
        model = AutoModelForMaskedLM.from_config(AutoConfig.for_model(
            "bert", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64))
    elif model_type == "bart":
        model = AutoModelForSeq2SeqLM.from_config(AutoConfig.for_model("bart", **_SEQ2SEQ))
    else:
        model = AutoModelForSpeechSeq2Seq.from_config(AutoConfig.for_model(
            "whisper", **_SEQ2SEQ, num_mel_bins=8, max_source_positions=16))
    cmodel = torch.compile(model.train(), backend="megatrain", options={"device": "cpu"})
    with pytest.raises(Exception) as e:
        call(cmodel, torch.randint(3, 128, (2, 8)))
    msg = raised(e, megacompile.UnsupportedModelError)
    assert kind in msg and repr(model_type) in msg and "ForCausalLM" in msg


def _moe_with_router_logits(in_config=True):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=16, output_router_logits=in_config,
                               router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).train()


def test_router_logits_asked_only_in_the_call_says_how_to_compile_it():
    """transformers registers its router-logit hooks on the first call that asks for them, which
    Dynamo cannot trace; megatrain installs them before tracing when the config asks for them,
    but a flag passed only in the call is not visible then: the error gives the recipe."""
    model = _moe_with_router_logits(in_config=False)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ids = torch.randint(0, 128, (2, 8))
    with pytest.raises(Exception) as e:
        cmodel(input_ids=ids, labels=ids, use_cache=False, output_router_logits=True)
    msg = raised(e, megacompile.GraphBreakError)
    assert "output_router_logits" in msg and "config" in msg and "once eagerly before compiling" in msg


def test_router_aux_loss_trains_from_the_first_compiled_call():
    """With `output_router_logits=True` in the config, the whole model compiles as one graph on
    its first call (megacompile/output_hooks.py) and the load-balancing loss trains like eager."""
    import copy
    model = _moe_with_router_logits()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    out = cmodel(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    expected = ref(input_ids=ids, labels=ids, use_cache=False)
    expected.loss.backward()
    assert out.aux_loss is not None and expected.aux_loss.item() > 0
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.aux_loss, expected.aux_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    router = [p for n, p in model.named_parameters() if "gate.weight" in n and "experts" not in n]
    assert router and all(p.grad is not None and p.grad.abs().sum() > 0 for p in router)
    assert megacompile.stats(cmodel)["compiled_graphs"] == 1


class NoLayerStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.block_a = nn.Linear(16, 16)
        self.block_b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids):
        return self.head(torch.relu(self.block_b(torch.relu(self.block_a(self.embed(input_ids)))))).sum()


def test_model_without_layer_stack_is_refused():
    cmodel = torch.compile(NoLayerStack(), backend="megatrain", options={"device": "cpu"})
    with pytest.raises(Exception) as e:
        cmodel(torch.randint(0, 32, (2, 5)))
    msg = raised(e, megacompile.UnsupportedModelError)
    assert "could not find the decoder layers of NoLayerStack" in msg and "nn.ModuleList" in msg


def test_graph_break_inside_a_layer_names_the_op_and_the_layer():
    model = tiny_model("llama", layers=3)
    mlp = model.model.layers[1].mlp
    original = mlp.forward

    def forward_with_break(x):
        torch._dynamo.graph_break()
        return original(x)

    mlp.forward = forward_with_break
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ids, _, labels = batch()
    with pytest.raises(Exception) as e:
        cmodel(input_ids=ids, labels=labels, use_cache=False)
    msg = raised(e, megacompile.GraphBreakError)
    assert "inside decoder layer model.layers.1" in msg
    assert "test_errors.py" in msg and "graph_break" in msg


def test_use_cache_during_training_is_refused():
    model = tiny_model("llama", layers=2)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ids, _, labels = batch()
    with pytest.raises(Exception) as e:
        cmodel(input_ids=ids, labels=labels, use_cache=True)
    assert "use_cache=False" in raised(e, megacompile.UnsupportedModelError)


def test_unknown_option_suggests_the_closest():
    model = tiny_model("llama", layers=2)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "slot": 3})
    ids, _, labels = batch()
    with pytest.raises(Exception) as e:
        cmodel(input_ids=ids, labels=labels, use_cache=False)
    assert "Did you mean 'slots'" in raised(e, megacompile.ConfigError)


@pytest.mark.parametrize("bad", [{"slots": 0}, {"device": "tpu"}, {"device": "cuda:0"}])
def test_impossible_option_values(bad):
    if bad.get("device", "").startswith("cuda") and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(megacompile.ConfigError):
        megacompile.Options.from_mapping(bad)


def test_default_device_follows_availability():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert megacompile.Options.from_mapping({}).device == expected


def test_router_aux_loss_after_a_dynamo_reset_needs_one_more_call():
    """torch._dynamo.reset() drops the compile-start callback that installs the hooks: the first
    call says so and installs them; after the reset it asks for, the next call is one graph."""
    model = _moe_with_router_logits()
    torch._dynamo.reset()
    megacompile.compile_start.unregister()   # (what Dynamo's own reset does; the tests' reset keeps it)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ids = torch.randint(0, 128, (2, 8))
    with pytest.raises(Exception) as e:
        cmodel(input_ids=ids, labels=ids, use_cache=False)
    assert "call the model again" in raised(e, megacompile.GraphBreakError)
    torch._dynamo.reset()
    out = cmodel(input_ids=ids, labels=ids, use_cache=False)
    assert out.aux_loss is not None and megacompile.stats(cmodel)["compiled_graphs"] == 1


def test_a_break_site_is_never_an_earlier_models():
    """Dynamo's failure records are process-wide: once an error has read them, a later model's
    error does not point at the earlier model's break (here transformers' hook registration)."""
    from megacompile.capture import _break_site
    model = _moe_with_router_logits(in_config=False)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ids = torch.randint(0, 128, (2, 8))
    with pytest.raises(Exception):
        cmodel(input_ids=ids, labels=ids, use_cache=False, output_router_logits=True)
    reason, site, place = _break_site(tiny_model("llama", layers=2))
    assert (site, place) == ("", "") and "several graphs" in reason


def test_router_aux_loss_compiles_after_a_plan_in_the_same_process():
    """`megatrain train` plans first (which resets Dynamo): the router-logit hooks are still
    installed before the real compile traces the model."""
    from megacompile.plan import plan_model
    from megacompile.hardware import BUILTIN
    model = _moe_with_router_logits(in_config=True)
    plan_model(model.config, hardware=BUILTIN["h100"], seq=16, batch=1, max_batch=1, host_ram=2**40)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ids = torch.randint(0, 128, (2, 8))
    out = cmodel(input_ids=ids, labels=ids, use_cache=False)
    assert out.aux_loss is not None and megacompile.stats(cmodel)["compiled_graphs"] == 1
