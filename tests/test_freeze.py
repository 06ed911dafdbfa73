"""`finetuning_type: freeze` (LLaMA-Factory's freeze tuning): the selection is LF's, the frozen
model trains like eager PyTorch, frozen weights have no master, moments or gradients (and move
no gradient bytes), the plan counts only what trains, checkpoints resume bit for bit.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import batch, run_steps
from families import tiny_family_model
from test_train import config, log_rows, tiny_dir  # noqa: F401 (tiny_dir: fixture)
from transformers import AutoConfig, AutoModelForCausalLM

import megacompile
from megacompile.cli import main
from megacompile.errors import ConfigError
from megacompile.plan import host_bytes
from megacompile.train.checkpoint import format as checkpoint
from megacompile.train.checkpoint import resume
from megacompile.train.hparams.config import from_mapping
from megacompile.train.model.finetuning import apply_finetuning
from megacompile.train.model.freeze import freeze, select
from megacompile.train.trainer import train
from megacompile.runtime.adamw import HostAdamW
from megacompile.runtime.store import entry_of

REFERENCE = json.loads((Path(__file__).parent / "data" / "lf_reference" / "freeze_selection.json").read_text())
OK = dict(model_name_or_path="m", dataset="d", output_dir="o")


def meta_model(name: str, dtype=torch.float32):
    values = dict(REFERENCE["models"][name])
    cfg = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


# -- the selection: LLaMA-Factory's own output (freeze_generate.py) ------------------------------
@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: "{model}-{freeze_trainable_layers}-"
                         "{freeze_trainable_modules}-{freeze_extra_modules}".format(**c))
def test_selection_is_llamafactorys(case):
    model = meta_model(case["model"])
    args = case["freeze_trainable_layers"], case["freeze_trainable_modules"], case["freeze_extra_modules"]
    if "error" in case:
        with pytest.raises(ConfigError) as e:
            select(model, *args)
        bad = case["error"].split("Module ")[1].split(" is not found")[0]
        valid = case["error"].split("choose from ")[1].split(", ")
        msg = str(e.value)
        assert (repr(bad) if bad else "an empty name") in msg and all(v in msg for v in valid) and "\n" not in msg
        return
    freeze(model, *args)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == case["trainable"]


def test_reference_covers_both_models_errors_and_lfs_substring_quirk():
    """(a test of the reference itself: the cases that matter are in it)"""
    cases = REFERENCE["cases"]
    assert {c["model"] for c in cases} == {"llama", "qwen3_moe"} and sum("error" in c for c in cases) >= 6
    norm = next(c for c in cases if c["model"] == "llama" and c["freeze_extra_modules"] == "embed_tokens,norm")
    assert "model.layers.0.input_layernorm.weight" in norm["trainable"]   # LF matches `norm` as a substring


# -- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mapping, match", [
    ({"finetuning_type": "oft"}, "finetuning_type: oft: OFT"),
    ({"finetuning_type": "partial"}, "finetuning_type='partial': use one of full, freeze"),
    ({"freeze_trainable_layers": 4}, "freeze_trainable_layers=4 configure finetuning_type: freeze, but"),
    ({"finetuning_type": "freeze", "freeze_trainable_modules": "mlp,"}, "has an empty name"),
    ({"finetuning_type": "freeze", "freeze_trainable_layers": 0}, "trains nothing"),
    ({"finetuning_type": "freeze", "freeze_trainable_modules": ["mlp"]}, "expected str"),
])
def test_config_refuses_what_would_not_train_as_written(mapping, match):
    with pytest.raises(ConfigError, match=match):
        from_mapping({**OK, **mapping})


def test_config_keys_and_resume():
    c = from_mapping({**OK, "finetuning_type": "freeze", "freeze_trainable_layers": -1, "freeze_extra_modules":
                      "embed_tokens"})
    assert (c.finetuning_type, c.freeze_trainable_layers, c.freeze_extra_modules) == ("freeze", -1, "embed_tokens")
    assert from_mapping({**OK, "freeze_trainable_layers": 2}).finetuning_type == "full"   # LF's defaults pass
    saved = c.to_dict()
    for key, value in (("finetuning_type", "full"), ("freeze_trainable_layers", 1),
                       ("freeze_trainable_modules", "mlp"), ("freeze_extra_modules", None)):
        refused, _ = resume.changes(saved, {**saved, key: value}, True)
        assert refused and refused[0].startswith(key)


# -- training: parity with eager, what frozen weights cost ----------------------------------------
SHAPES = [(2, 8, 0), (2, 8, 2), (3, 11, 3), (2, 9, 1)]


def _steps(call, opt, steps=4):
    return run_steps(None, call, opt, steps, SHAPES)


@pytest.mark.parametrize("family, layers, modules, extra", [
    ("llama", -1, "all", None),              # trains the first layer: the backward runs through frozen ones
    ("llama", 1, "self_attn", "embed_tokens,lm_head"),   # trainable embeddings and head, a frozen MLP
    ("qwen3_moe", 1, "mlp", None),           # routed experts and router of the last layer
])
def test_frozen_model_trains_like_eager(family, layers, modules, extra):
    model = tiny_family_model(family, num_hidden_layers=3)
    start = copy.deepcopy(model.state_dict())
    freeze(model, layers, modules, extra)
    ref = copy.deepcopy(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = HostAdamW(trained, lr=1e-2, weight_decay=0.0)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ours = _steps(cmodel, opt)
    theirs = _steps(ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                                                 weight_decay=0.0))
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
            assert not torch.equal(p, start[name]), name   # (it did train)
        else:
            assert torch.equal(p, start[name]), name       # bit-unchanged
            assert p.grad is None
    # AdamW holds moments for the trainable weights only
    assert {id(p) for p in opt.state} == {id(p) for p in trained}


def test_bf16_freeze_updates_fp32_masters_of_the_trainable_weights_only():
    """bf16 (LF's bf16 freeze run casts the trainable weights to fp32): the trainable weights
    update fp32 masters as an fp32-master eager reference does; frozen ones stay bf16, unchanged."""
    from conftest import Fp32MasterReference
    model = tiny_family_model("llama", dtype=torch.bfloat16, num_hidden_layers=3)
    start = copy.deepcopy(model.state_dict())
    freeze(model, -1, "all", "norm")
    ref = Fp32MasterReference(copy.deepcopy(model), lr=1e-3)
    trained = [p for p in model.parameters() if p.requires_grad]
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ours = _steps(cmodel, HostAdamW(trained, lr=1e-3, weight_decay=1e-2), 3)
    theirs = _steps(ref, ref, 3)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1.6e-2, atol=1e-2)
    masters = iter(ref.masters)
    for name, p in model.named_parameters():
        if p.requires_grad:   # (bf16 rounding can flip an update where the gradient is ~0: <= 2 lr a step)
            master = megacompile.master_weight(p)
            assert master.dtype == torch.float32 and (master - next(masters)).abs().max() <= 6e-3, name
        else:
            assert p.dtype == torch.bfloat16 and torch.equal(p, start[name]) and entry_of(p).master is None, name


def test_frozen_weights_have_no_master_and_send_no_gradient():
    """bf16: a frozen weight is its transfer copy only (no fp32 master); the backward copies to
    the host exactly the fp32 gradients of the trainable weights."""
    def one_backward(setup):
        model = tiny_family_model("llama", dtype=torch.bfloat16, num_hidden_layers=4)
        setup(model)
        cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
        ids, mask, labels = batch(2, 8)
        cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
        return model, megacompile.stats(cmodel)["d2h_bytes"]

    full, full_d2h = one_backward(lambda m: None)
    frozen, frozen_d2h = one_backward(lambda m: freeze(m, 1, "all", None))
    trained = [p for p in frozen.parameters() if p.requires_grad]
    assert 0 < len(trained) < len(list(frozen.parameters()))
    # (a gradient crosses in the compute dtype and becomes fp32 on the host)
    assert full_d2h == sum(p.numel() * p.element_size() for p in full.parameters())
    assert frozen_d2h == sum(p.numel() * p.element_size() for p in trained) < full_d2h / 2
    for p in frozen.parameters():
        entry = entry_of(p)
        assert entry is not None and (entry.master is not None) == p.requires_grad
        assert (p.grad is not None) == p.requires_grad


def test_host_bytes_count_only_what_trains():
    model = meta_model("llama", torch.bfloat16)   # (fp32 weights are their own masters)
    full = host_bytes(model, "cuda")
    freeze(model, 1, "all", None)
    part = host_bytes(model, "cuda")
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert (part.masters, part.optimizer_state, part.grads) == (4 * trained, 8 * trained, 4 * trained)
    assert part.transfer_copy == full.transfer_copy and part.total < full.total


# -- megatrain train ----------------------------------------------------------------------------
FREEZE = dict(finetuning_type="freeze", freeze_trainable_layers=-1, freeze_trainable_modules="self_attn,mlp")


def test_train_freeze_resumes_bit_for_bit_and_exports(tiny_dir, tmp_path, capsys):
    full = config(tiny_dir, tmp_path / "full", max_steps=4, save_steps=2, **FREEZE)
    train(full, progress=False)
    said = capsys.readouterr().out
    assert "[megatrain] freeze: trains layer 0 of 2, modules self_attn,mlp" in said
    # the preflight ran on the frozen meta model: moments and gradients of the trainable weights only
    from megacompile.units import fmt_bytes
    trained = sum(p.numel() for n, p in AutoModelForCausalLM.from_pretrained(tiny_dir).named_parameters()
                  if n.startswith(("model.layers.0.self_attn", "model.layers.0.mlp")))
    assert f"AdamW {fmt_bytes(8 * trained)}, " in said and f"grads {fmt_bytes(4 * trained)})" in said
    part = config(tiny_dir, tmp_path / "part", max_steps=4, save_steps=2, **FREEZE)
    train(part, stop_at_step=3, progress=False)
    resumed = config(tiny_dir, tmp_path / "part", max_steps=4, save_steps=2, resume_from_checkpoint=True, **FREEZE)
    train(resumed, progress=False)
    losses = [r["loss"] for r in log_rows(Path(full.output_dir))]
    assert [r["loss"] for r in log_rows(Path(resumed.output_dir))] == losses
    original = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    a = checkpoint.load_file(str(Path(full.output_dir) / "checkpoint-4" / "model.safetensors"))
    b = checkpoint.load_file(str(Path(resumed.output_dir) / "checkpoint-4" / "model.safetensors"))
    exported = AutoModelForCausalLM.from_pretrained(full.output_dir).state_dict()
    for name in original:
        assert torch.equal(a[name], b[name]) and torch.equal(exported[name], a[name]), name
        trains = name.startswith(("model.layers.0.self_attn", "model.layers.0.mlp"))
        assert torch.equal(a[name], original[name]) != trains, name
    # resuming with another selection is refused
    other = config(tiny_dir, tmp_path / "part", max_steps=6, resume_from_checkpoint=True,
                   **{**FREEZE, "freeze_trainable_layers": 1})
    with pytest.raises(ConfigError, match="freeze_trainable_layers: -1 -> 1"):
        train(other, progress=False)


def test_bad_module_name_fails_before_the_weights_load(tiny_dir, tmp_path, monkeypatch, capsys):
    from megacompile.train.model.model_source import ModelSource

    def never(self):
        raise AssertionError("the weights were loaded")
    monkeypatch.setattr(ModelSource, "load", never)
    cfg = config(tiny_dir, tmp_path, finetuning_type="freeze", freeze_trainable_modules="attn")
    with pytest.raises(ConfigError, match="'attn' is not a module of this model; choose from all, input_layernorm, "
                                          "mlp, post_attention_layernorm, self_attn"):
        train(cfg, progress=False)
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(json.dumps({**{k: v for k, v in cfg.to_dict().items() if v is not None and k not in (
        "finetuning_type", "freeze_trainable_modules", "freeze_trainable_layers", "freeze_extra_modules")},
        "finetuning_type": "freeze", "freeze_extra_modules": "embed", "output_dir": str(tmp_path / "cli")}))
    assert main(["train", str(cfg_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatrain: error: freeze_extra_modules: 'embed' is not a module") and err.count("\n") == 1


def test_apply_finetuning_full_leaves_the_model_alone():
    model = meta_model("llama")
    assert apply_finetuning(model, from_mapping(OK)) is None
    assert all(p.requires_grad for p in model.parameters())


def test_megatrain_plan_of_a_freeze_config_counts_only_what_trains(tiny_dir, tmp_path, capsys):
    path = tmp_path / "freeze.yaml"
    path.write_text(f"model_name_or_path: {tiny_dir}\ndataset: alpaca_demo\noutput_dir: {tmp_path / 'out'}\n"
                    "finetuning_type: freeze\nfreeze_trainable_layers: 1\nfreeze_trainable_modules: mlp\n")
    assert main(["plan", str(path), "--gpu", "h200", "--host-ram", "1T", "--format", "json", "--seq", "16",
                 "--batch", "1"]) == 0
    host = json.loads(capsys.readouterr().out)["host"]
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    freeze(model, 1, "mlp", None)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    assert 0 < trained < total / 4
    assert (host["masters"], host["optimizer_state"], host["grads"]) == (4 * trained, 8 * trained, 4 * trained)
    assert host["transfer_copy"] == 2 * total   # (every weight streams, in bf16)


def test_freeze_of_a_vision_language_model_is_refused():
    from test_vlm import tiny_vlm
    cfg = from_mapping({**OK, "finetuning_type": "freeze"})
    with pytest.raises(ConfigError, match="vision-language model llava is not supported yet: use finetuning_type"):
        apply_finetuning(tiny_vlm("llava"), cfg)
