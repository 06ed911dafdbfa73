"""`finetuning_type: lora` (megacompile/train/model/lora.py): peft's LoRA compiled by the megatrain
backend matches eager PEFT, streams the frozen base without masters, moments or gradients, and the
trainer checkpoints, resumes and exports the adapter as LLaMA-Factory does."""
from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("peft")

import megacompile  # noqa: E402
from conftest import Fp32MasterReference, batch, run_steps, tiny_model  # noqa: E402
from megacompile.errors import ConfigError  # noqa: E402
from megacompile.runtime.adamw import HostAdamW  # noqa: E402
from megacompile.train.checkpoint import format as checkpoint  # noqa: E402
from megacompile.train.model import lora
from test_train import config, log_rows, tiny_dir  # noqa: E402,F401 (the tiny model folder fixture)

SHAPES = [(2, 8, 0), (2, 8, 2), (3, 11, 3), (2, 9, 1)]   # (batch, seq, left padding)


def lora_config(**kw):
    """The lora keys as a TrainConfig holds them."""
    return SimpleNamespace(finetuning_type="lora", **{**lora.LORA_KEYS, **kw})


def with_lora(model, seed=1, init_b=True, **kw):
    """`model` with adapters (seeded); `init_b`: lora_B random too, so the adapters change the
    loss from the first step (peft's init makes B zero)."""
    torch.manual_seed(seed)
    lora.apply_lora(model, lora_config(**kw))
    if init_b:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return model


def steps(call, opt, n, seed=100):
    """n training steps; dropout masks drawn from a seeded generator per step."""
    return run_steps(None, call, opt, n, SHAPES, seed=seed)


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_fp32_lora_matches_eager_peft(dropout):
    """Same model, same adapters: megatrain + HostAdamW against eager PEFT + torch AdamW. With
    dropout > 0 the backward's recompute must draw the forward's masks, or the gradients differ."""
    model = with_lora(tiny_model("llama", layers=3), lora_dropout=dropout, lora_target="q_proj,v_proj,down_proj")
    ref = copy.deepcopy(model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ours = steps(cmodel, HostAdamW(trainable(model), lr=1e-2, weight_decay=0.0), 4)
    theirs = steps(ref, torch.optim.AdamW(trainable(ref), lr=1e-2, weight_decay=0.0), 4)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(p, base[name]), name   # the base is bit-unchanged
    stats = megacompile.stats(cmodel)
    lora_bytes = sum(4 * p.numel() for p in trainable(model))
    assert stats["d2h_bytes"] == lora_bytes   # gradients come back for the adapters only
    assert stats["layers"] == 3


def test_dropout_actually_changes_the_loss():
    """(the dropout parity test above would prove nothing if the masks did not matter)"""
    losses = []
    for dropout in (0.0, 0.3):
        model = with_lora(tiny_model("llama", layers=2), lora_dropout=dropout, lora_target="q_proj,v_proj")
        ids, mask, labels = batch(2, 8)
        torch.manual_seed(5)
        losses.append(model(input_ids=ids, labels=labels, use_cache=False).loss.item())
    assert losses[0] != losses[1]


def test_only_the_adapters_get_masters_moments_and_gradients():
    model = with_lora(tiny_model("llama", layers=4), lora_target="all", lora_rank=2)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    opt = HostAdamW(trainable(model), lr=1e-3)
    steps(cmodel, opt, 2)
    adapters = {id(p) for p in trainable(model)}
    assert set(map(id, opt.state)) <= adapters and len(opt.state) == len(adapters)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    stats = megacompile.stats(cmodel)
    assert stats["d2h_bytes"] == sum(4 * p.numel() for p in trainable(model))
    assert stats["d2h_bytes"] < stats["weight_bytes"] / 5


def test_identical_layers_still_share_bodies():
    """LoRA layers dedupe: one forward body for every layer; two backward bodies (the first
    layer's has no input gradient: the embeddings are frozen), at any depth."""
    counts = []
    for layers in (3, 6):
        torch._dynamo.reset()
        megacompile.compile_start.register()
        model = with_lora(tiny_model("llama", layers=layers), lora_target="q_proj,v_proj")
        cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
        ids, _, labels = batch(2, 8)
        cmodel(input_ids=ids, labels=labels, use_cache=False).loss.backward()
        stats = megacompile.stats(cmodel)
        counts.append((stats["distinct_layer_bodies"], stats["distinct_backward_layer_bodies"]))
    assert counts == [(1, 2), (1, 2)], counts


def test_the_peft_wrapper_compiles_too():
    """PeftModel itself (names under base_model.model.): capture finds the decoder stack and the
    step matches eager. (The trainer compiles the model peft injected into, as LF trains it.)"""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(1)
    model = get_peft_model(tiny_model("llama", layers=3), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    assert next(n for n, _ in model.named_parameters()).startswith("base_model.model.")
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ours = steps(cmodel, HostAdamW(trainable(model), lr=1e-2, weight_decay=0.0), 3)
    theirs = steps(ref, torch.optim.AdamW(trainable(ref), lr=1e-2, weight_decay=0.0), 3)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)
    stats = megacompile.stats(cmodel)
    assert stats["layers"] == 3 and stats["distinct_layer_bodies"] <= 2


def test_bf16_lora_matches_an_fp32_master_reference():
    model = with_lora(tiny_model("llama", layers=2, dtype=torch.bfloat16), lora_target="all")
    assert all(p.dtype == torch.float32 for p in trainable(model))   # upcast, as LF unless pure_bf16
    assert model.model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16
    ref = Fp32MasterReference(copy.deepcopy(model), lr=1e-3)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ours = steps(cmodel, HostAdamW(trainable(model), lr=1e-3, weight_decay=0.0), 4)
    theirs = steps(ref, SimpleNamespace(step=ref.step, zero_grad=lambda: None), 4)
    # test_parity.py's bf16 tolerances: bf16 rounding may flip an Adam update where the gradient
    # is ~0, so elementwise at most 2 * steps * lr apart, and far closer on average
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1.6e-2, atol=1e-2)
    diff = torch.cat([(p - m).detach().abs().flatten() for p, m in zip(trainable(model), ref.masters)])
    assert diff.max() <= 2 * 4 * 1e-3 and diff.mean() < 2e-5, (diff.max(), diff.mean())
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_moe_lora_all_targets_the_linear_layers_only():
    """Qwen3-MoE in transformers 5: each layer's experts are 3-D parameters (no Linear), so
    lora_target all adapts the attention projections; the router (no Linear either) and the experts stay
    frozen, as in LLaMA-Factory."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(cfg).train()
    targets = lora.target_modules(model, "all")
    assert targets == ["k_proj", "o_proj", "q_proj", "v_proj"]   # LF 0.9.5's find_all_linear_modules says the same
    with_lora(model, lora_target="all")
    assert not any("experts" in n for n, p in model.named_parameters() if p.requires_grad)
    assert any(p.dim() == 3 for n, p in model.named_parameters() if "experts" in n and not p.requires_grad)
    ref = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    ours = steps(cmodel, HostAdamW(trainable(model), lr=1e-2, weight_decay=0.0), 3)
    theirs = steps(ref, torch.optim.AdamW(trainable(ref), lr=1e-2, weight_decay=0.0), 3)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_lora_on_the_meta_model_and_bad_keys():
    from transformers import AutoModelForCausalLM
    from conftest import tiny_config
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny_config("llama", 2))
    line = lora.apply_lora(meta, lora_config(lora_target="q_proj", additional_target="lm_head"))
    assert "rank 8, alpha 16" in line and "lm_head in full" in line
    names = [n for n, p in meta.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in names) and any("lm_head" in n for n in names)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny_config("llama", 2))
    # (LLaMA-Factory 0.9.5's find_all_linear_modules on this model: the same seven names)
    assert lora.target_modules(meta, "all") == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]
    lora.apply_lora(meta, lora_config(lora_rank=4, lora_alpha=8, use_rslora=True, lora_target="q_proj"))
    assert meta.model.layers[0].self_attn.q_proj.scaling["default"] == pytest.approx(8 / 4 ** 0.5)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny_config("llama", 2))
    with pytest.raises(ConfigError, match="qproj is no module"):
        lora.apply_lora(meta, lora_config(lora_target="qproj"))
    lora.apply_lora(meta, lora_config(lora_target="self_attn.q_proj"))   # (peft matches a name's end)
    assert any("q_proj.lora_A" in n for n, p in meta.named_parameters() if p.requires_grad)
    for bad, match in [(dict(lora_rank=0), "lora_rank"), (dict(lora_dropout=1.0), "lora_dropout"),
                       (dict(lora_target="all,q_proj"), "give it alone"), (dict(lora_target="q_proj,"), "empty")]:
        with pytest.raises(ConfigError, match=match):
            lora.check_config(lora_config(**bad))
    with pytest.raises(ConfigError, match="lora_rank=4 configures finetuning_type: lora"):
        lora.check_config(SimpleNamespace(**{**lora.LORA_KEYS, "finetuning_type": "full", "lora_rank": 4}))


def test_lora_without_peft_is_one_line(tiny_dir, tmp_path, monkeypatch, capsys):
    import sys
    from megacompile.cli import main
    monkeypatch.setitem(sys.modules, "peft", None)   # (import peft raises ImportError)
    with pytest.raises(ConfigError, match=r"pip install 'megatrain\[lora\]'"):
        lora.check_config(lora_config())
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_dir}\ndataset: alpaca_demo\ndataset_dir: {Path(__file__).parent.parent}"
                   f"/examples/data\noutput_dir: {tmp_path / 'out'}\nfinetuning_type: lora\ndevice: cpu\n")
    assert main(["train", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatrain: error:") and "needs peft" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_merged_model_of_a_tied_head_trained_in_full(tmp_path):
    """Qwen3 ties lm_head to embed_tokens; additional_target: lm_head trains a copy of it, so the
    merged model must not tie them again when it loads."""
    from transformers import AutoModelForCausalLM
    model = with_lora(tiny_model("qwen3", layers=2), lora_target="all", additional_target="lm_head")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    ids, _, _ = batch(1, 8)
    lora.save_merged(model, tmp_path / "merged")
    # (transformers 5 loads a stored lm_head untied anyway; other loaders tie by the config)
    assert __import__("json").loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is False
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    assert not any("lora_" in n or "base_layer" in n or "modules_to_save" in n for n, _ in merged.named_parameters())


def test_lf_lora_keys_map_or_refuse(tiny_dir, tmp_path):
    cfg = config(tiny_dir, tmp_path, finetuning_type="lora", lora_rank=4, lora_target="q_proj,v_proj")
    assert cfg.lora_rank == 4
    for key, value in [("use_dora", True), ("pissa_init", True), ("loraplus_lr_ratio", 16.0),
                       ("adapter_name_or_path", "some/adapter")]:
        with pytest.raises(ConfigError, match=key):
            config(tiny_dir, tmp_path, finetuning_type="lora", **{key: value})


# the trainer -----------------------------------------------------------------------------------
def lora_run(tiny_dir, tmp_path, **kw):
    return config(tiny_dir, tmp_path, **{"finetuning_type": "lora", "lora_rank": 4, "lora_dropout": 0.1, **kw})


def test_lora_run_resumes_bit_for_bit_and_exports_like_llama_factory(tiny_dir, tmp_path):
    """An interrupted LoRA run resumed from checkpoint-2 (the base from model_name_or_path, the
    adapter, moments and generators from the checkpoint; lora_dropout draws from them) ends
    exactly as the uninterrupted one; output_dir holds the adapter, loadable with PeftModel, and
    merge_lora's merged model; the model folder is never written."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from megacompile.train.trainer import train
    before = {p.name: p.stat().st_mtime_ns for p in Path(tiny_dir).iterdir()}
    kw = dict(max_steps=4, save_steps=2, merge_lora=True, additional_target="embed_tokens")
    full = lora_run(tiny_dir, tmp_path / "full", **kw)
    train(full, progress=False)
    part = lora_run(tiny_dir, tmp_path / "part", **kw)
    train(part, stop_at_step=3, progress=False)   # interrupted after step 3 (checkpoint at 2)
    resumed = lora_run(tiny_dir, tmp_path / "part", resume_from_checkpoint=True, **kw)
    train(resumed, progress=False)
    ours, theirs = log_rows(Path(resumed.output_dir)), log_rows(Path(full.output_dir))
    assert [r["step"] for r in ours] == [1, 2, 3, 4]
    assert [r["loss"] for r in ours] == [r["loss"] for r in theirs]
    a = checkpoint.load_file(str(Path(full.output_dir) / "checkpoint-4" / "model.safetensors"))
    b = checkpoint.load_file(str(Path(resumed.output_dir) / "checkpoint-4" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a and all("lora_" in n or "embed_tokens" in n for n in a)   # checkpoints hold only what trains
    assert {p.name: p.stat().st_mtime_ns for p in Path(tiny_dir).iterdir()} == before   # the model folder unwritten

    out = Path(resumed.output_dir)
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert (out / "tokenizer.json").is_file() and not (out / "model.safetensors").exists()
    assert (out / "checkpoint-4" / "adapter_model.safetensors").is_file()
    ids = torch.tensor([[5, 9, 17, 33, 2, 7]])
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    untrained = base(input_ids=ids).logits
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    adapted = peft_model(input_ids=ids).logits
    assert not torch.allclose(adapted, untrained)
    loaded = {n.removeprefix("base_model.model."): p for n, p in peft_model.named_parameters()}
    for name, master in a.items():   # the adapter holds the fp32 masters of the last step
        assert torch.equal(loaded[name], master), name
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    torch.testing.assert_close(merged(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-5)

    changed = lora_run(tiny_dir, tmp_path / "part", resume_from_checkpoint=True, **{**kw, "max_steps": 6},
                       lora_rank=8)
    with pytest.raises(ConfigError, match="lora_rank"):
        train(changed, progress=False)


def test_preflight_and_plan_count_only_the_adapters(tiny_dir, tmp_path):
    """On the meta model, as the trainer runs them before any weight loads: the host RAM for
    moments and gradients is the adapters', and the device plan works with peft."""
    from megacompile.plan import host_bytes
    from megacompile.train.model.model_source import ModelSource
    from megacompile.train.preflight import plan_check
    cfg = lora_run(tiny_dir, tmp_path, lora_target="all")
    full = ModelSource(config(tiny_dir, tmp_path), torch.device("cpu")).meta_model()
    meta = ModelSource(cfg, torch.device("cpu")).meta_model()
    lora.apply_lora(meta, cfg)
    adapters = sum(p.numel() for p in meta.parameters() if p.requires_grad)
    assert adapters and all(p.device.type == "meta" for p in meta.parameters())
    need, need_full = host_bytes(meta, "cpu"), host_bytes(full, "cpu")
    assert need.optimizer_state == 8 * adapters and need.grads == 4 * adapters
    assert need_full.optimizer_state == 8 * sum(p.numel() for p in full.parameters())
    assert "plan" in plan_check(meta, cfg, torch.device("cpu"))


def test_megatrain_plan_counts_the_adapters(tiny_dir, tmp_path, capsys):
    import re
    from megacompile.cli import main
    from megacompile.units import fmt_bytes
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_dir}\ndataset: alpaca_demo\ndataset_dir: {Path(__file__).parent.parent}"
                   f"/examples/data\noutput_dir: {tmp_path / 'out'}\nfinetuning_type: lora\nlora_target: q_proj\n"
                   "cutoff_len: 64\ndevice: cpu\n")
    assert main(["plan", str(cfg), "--gpu", "h200", "--host-ram", "1T", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    adapters = 2 * (8 * 32 + 32 * 8)   # rank 8 on q_proj (32 -> 32) of 2 layers
    assert re.search(rf"fp32 master weights +{re.escape(fmt_bytes(4 * adapters))}\n", out), out
    assert re.search(rf"optimizer state \(AdamW\) +{re.escape(fmt_bytes(8 * adapters))}\n", out), out


def test_llamafactory_lora_run_has_llamafactorys_losses(tmp_path, monkeypatch, own_cache):
    """LF's example YAML with finetuning_type: lora (rank 8, lora_target all) trains with
    megatrain train and logs LLaMA-Factory 0.9.5's own losses and gradient norms for the same
    model, data, seed and order (tests/data/lf_reference/lora_e2e_generate.py): the same adapters
    (LF seeds before get_peft_model as apply_lora does), the same scaling, the same updates."""
    import importlib.util
    import json
    from megacompile.cli import main
    ref_dir = Path(__file__).resolve().parent / "data" / "lf_reference"
    spec = importlib.util.spec_from_file_location("lf_lora_e2e_generate", ref_dir / "lora_e2e_generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    e2e = gen.e2e()
    reference = json.loads((ref_dir / "lora_e2e_losses.json").read_text())
    assert e2e.build_model(tmp_path / "model") == reference["model_digest"], "regenerate lora_e2e_losses.json"
    e2e.write_data(tmp_path)
    config = tmp_path / "lora.yaml"
    config.write_text(e2e.lf_yaml(str(tmp_path / "model"), str(tmp_path / "out"), lf=False,
                                  extra={**reference["lora"], "device": "cpu"}))
    monkeypatch.chdir(tmp_path)   # dataset_dir is LLaMA-Factory's default, "data"
    assert main(["train", str(config), "--no-progress"]) == 0
    steps = [r for r in log_rows(tmp_path / "out") if "loss" in r]
    want = reference["run"]
    assert [r["loss"] for r in steps] == pytest.approx(want["losses"], abs=5e-6)
    assert [r["grad_norm"] for r in steps] == pytest.approx(want["grad_norms"], rel=1e-4)
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
