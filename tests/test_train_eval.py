"""`megatrain train` evaluation (val_size / eval_dataset, eval_strategy), the log's TFLOP/s and
MFU, and checkpoints that are Hugging Face model folders. Tiny Llama from test_train's fixture."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import megacompile
from megacompile.errors import ConfigError
from megacompile.train.checkpoint import format as checkpoint
from megacompile.train.model import hf_folder
from megacompile.train import trainer
from megacompile.train.data import IGNORE, Example, build_examples, collate
from megacompile.train.evaluate import Schedule, check_config, evaluate, holdout_indices
from megacompile.train.flops import FlopCounter
from test_train import EXAMPLES, config, log_rows, tiny_dir  # noqa: F401 (tiny_dir: a fixture)

EVAL = dict(val_size=4, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=3)


def _eager_mean_loss(model, examples: list[Example]) -> float:
    """Eager PyTorch: cross entropy summed over every trained token of `examples`, / their count."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            ids, labels = torch.tensor([ex.input_ids]), torch.tensor([ex.labels])
            logits = model(input_ids=ids, use_cache=False).logits.float()
            total += float(torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=IGNORE,
                                                             reduction="sum"))
            tokens += int((labels[0, 1:] != IGNORE).sum())
    return total / tokens


# -- config ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("keys, message", [
    (dict(val_size=0.1, eval_dataset="sharegpt_demo", do_eval=True), "not both"),   # (config.py's check)
    (dict(eval_strategy="steps"), "needs evaluation data"),
    (dict(do_eval=True), "needs an eval set"),
    (dict(val_size=0.1), "never evaluated"),
    (dict(eval_dataset="sharegpt_demo"), "never evaluated"),
    (dict(val_size=0.1, do_eval=True, eval_steps=5), "only with eval_strategy: steps"),
    (dict(val_size=2.5, do_eval=True), "must be whole"),
])
def test_contradicting_eval_keys_are_refused_before_the_model_loads(tiny_dir, tmp_path, keys, message):  # noqa: F811
    with pytest.raises(ConfigError, match=message):
        check_config(config(tiny_dir, tmp_path, **keys))
    # the trainer refuses it before loading anything: a model folder that does not exist is never reached
    with pytest.raises(ConfigError, match=message):
        trainer.train(config(tiny_dir, tmp_path, **keys, model_name_or_path=str(tmp_path / "no-model")),
                      progress=False)
    with pytest.raises(ConfigError, match="leaving none to train on"):
        holdout_indices(4, 4, 0)


def test_schedule_steps_epoch_and_do_eval(tiny_dir, tmp_path):  # noqa: F811
    def due(total, per_epoch, **keys):
        when = Schedule(config(tiny_dir, tmp_path, val_size=0.1, **keys), total, per_epoch)
        return [s for s in range(1, total + 1) if when.due(s)]
    assert due(10, 4, eval_strategy="steps", eval_steps=4) == [4, 8, 10]
    assert due(10, 4, eval_strategy="steps", logging_steps=3) == [3, 6, 9, 10]        # eval_steps None: logging_steps
    assert due(10, 4, eval_strategy="steps", eval_steps=0.25) == [3, 6, 9, 10]        # ceil(0.25 * 10), as HF
    assert due(10, 4, eval_strategy="epoch") == [4, 8, 10]                            # each epoch, and the end
    assert due(10, 4, do_eval=True) == [10]                                           # LF's do_eval: at the end


# -- the eval set ---------------------------------------------------------------------------------
def test_val_size_holds_out_the_records_llamafactory_holds_out(tiny_dir, tmp_path):  # noqa: F811
    """LLaMA-Factory: dataset.train_test_split(test_size=val_size, seed=seed) on the raw records."""
    import datasets
    from transformers import AutoTokenizer
    from megacompile.train.evaluate import eval_set
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    records = json.loads((EXAMPLES / "alpaca_demo.json").read_text())
    for val_size, held in ((0.1, 2), (3, 3)):   # a fraction rounds up (ceil(1.6)); a count is a count
        cfg = config(tiny_dir, tmp_path, val_size=val_size, do_eval=True, seed=7, cutoff_len=256)
        examples, counts = build_examples(cfg, tok)
        split = eval_set(cfg, tok, None, examples, counts)
        assert len(split.examples) == held and len(split.train) == len(records) - held
        assert "records LLaMA-Factory's split holds out" in split.note and split.train is examples
        # the records LF's split holds out, encoded on their own, are our eval examples, in order
        raw = datasets.load_dataset("json", data_files=str(EXAMPLES / "alpaca_demo.json"), split="train")
        lf = raw.train_test_split(
            test_size=int(val_size) if val_size > 1 else val_size, seed=7)
        for part, ours in (("test", split.examples), ("train", split.train)):
            folder = tmp_path / f"{part}{val_size}"
            folder.mkdir()
            (folder / "d.json").write_text(json.dumps(lf[part].to_list()))
            (folder / "dataset_info.json").write_text(json.dumps({"d": {"file_name": "d.json",
                                                                        "columns": {"history": "history",
                                                                                    "system": "system"}}}))
            theirs, _ = build_examples(config(tiny_dir, tmp_path, dataset="d", dataset_dir=str(folder),
                                              cutoff_len=256), tok)
            assert [e.input_ids for e in ours] == [e.input_ids for e in theirs]
            assert [e.labels for e in ours] == [e.labels for e in theirs]


# -- evaluation in a run --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eval_runs(tiny_dir, tmp_path_factory):  # noqa: F811
    """The same 4-step run with evaluation every 2 steps, and with evaluation switched off. The
    optimizer overlaps the backward (and the next forward): updates are pending after each step."""
    root = tmp_path_factory.mktemp("eval")
    on = config(tiny_dir, root / "on", overlap_optimizer="backward", **EVAL)
    trainer.train(on, progress=False)
    off = config(tiny_dir, root / "off", overlap_optimizer="backward", **EVAL)
    real = Schedule.due
    Schedule.due = lambda self, step: False
    try:
        trainer.train(off, progress=False)
    finally:
        Schedule.due = real
    return Path(on.output_dir), Path(off.output_dir), on


def test_eval_loss_is_eager_mean_loss_of_the_step_weights(eval_runs, tiny_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, _, cfg = eval_runs
    rows = [r for r in log_rows(out) if "eval_loss" in r]
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    examples, counts = build_examples(cfg, tok)   # (the training examples: the held-out ones are not trained)
    per_epoch = len(examples) // cfg.per_device_train_batch_size
    assert [(r["step"], r["epoch"]) for r in rows] == [(2, 2 / per_epoch), (4, 4 / per_epoch)]
    held = list(counts["held_out"])
    for row in rows:   # each eval read the weights of its own step (the overlapped update was complete)
        model = AutoModelForCausalLM.from_pretrained(out / f"checkpoint-{row['step']}", dtype=torch.float32)
        assert row["eval_tokens"] == sum(e.trained_tokens for e in held)
        assert row["eval_loss"] == pytest.approx(_eager_mean_loss(model, held), rel=1e-5, abs=1e-6)
    # train and eval curves on the plot
    assert (out / "training_loss.png").stat().st_size > 0


def test_evaluation_does_not_change_training(eval_runs):
    on, off, _ = eval_runs
    train_on = [r for r in log_rows(on) if "loss" in r]
    train_off = log_rows(off)
    assert not any("eval_loss" in r for r in train_off)
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in train_on] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in train_off]
    for step in (2, 4):
        a = checkpoint.read(on / f"checkpoint-{step}")
        b = checkpoint.read(off / f"checkpoint-{step}")
        assert a.masters.keys() == b.masters.keys()
        assert all(torch.equal(a.masters[k], b.masters[k]) for k in a.masters)
        moments = [(k, n) for k, s in a.optimizer["state"].items() for n in s]
        assert all(torch.equal(a.optimizer["state"][k][n], b.optimizer["state"][k][n]) for k, n in moments)


def test_evaluate_runs_no_backward_and_leaves_the_optimizer(tiny_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from megacompile.runtime.adamw import HostAdamW
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).train()
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "logits": "drop"})
    opt = HostAdamW(model.parameters(), lr=1e-3, overlap="forward")
    examples, _ = build_examples(config(tiny_dir, Path("/nonexistent")), tok)
    batch = collate(examples[:2], tok.pad_token_id)
    cmodel(**batch, use_cache=False).loss.backward()
    opt.step()   # overlapped: the weights are still being written when evaluate starts
    opt.zero_grad(set_to_none=True)
    train_stats = megacompile.stats(cmodel)
    assert train_stats["backward_seconds"] > 0 and train_stats["d2h_bytes"] > 0
    opt.synchronize()
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    counters = dict(opt.counters)
    loss, tokens, _ = evaluate(cmodel, model, opt, examples[2:7], 2, tok.pad_token_id)
    stats = megacompile.stats(cmodel)   # the eval's own program: a forward, no backward
    assert stats["backward_seconds"] == 0 and stats["d2h_bytes"] == 0 and stats["segments"]["backward"] == 0
    assert all(p.grad is None for p in model.parameters()) and model.training
    assert opt.counters == counters
    assert all(torch.equal(state[id(p)][k], v) for p, s in opt.state.items() for k, v in s.items())
    assert tokens == sum(e.trained_tokens for e in examples[2:7])
    assert loss == pytest.approx(_eager_mean_loss(model, examples[2:7]), rel=1e-5)


def test_eval_dataset_once_at_the_end(tiny_dir, tmp_path):  # noqa: F811
    from transformers import AutoTokenizer
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = config(tiny_dir, tmp_path, eval_dataset="sharegpt_demo", do_eval=True, max_steps=2, save_steps=2,
                 report_to="tensorboard")
    trainer.train(cfg, progress=False)
    rows = log_rows(Path(cfg.output_dir))
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2] and math.isfinite(evals[0]["eval_loss"])
    events = EventAccumulator(str(Path(cfg.output_dir) / "runs")).Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("eval/loss")] == [(2, evals[0]["eval_loss"])]
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    sharegpt, _ = build_examples(config(tiny_dir, tmp_path, dataset="sharegpt_demo"), tok)
    assert evals[0]["eval_tokens"] == sum(e.trained_tokens for e in sharegpt)
    # the training data is not cut: alpaca_demo's 16 examples, 8 steps per epoch
    assert [r["epoch"] for r in rows if "loss" in r] == [1 / 8, 2 / 8]


# -- TFLOP/s and MFU ------------------------------------------------------------------------------
def test_flops_count_causal_attention_without_padding(tiny_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    cfg = model.config
    counter = FlopCounter(model)
    embed = model.get_input_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    n = sum(p.numel() for p in model.parameters()) - (0 if tied else embed)
    d = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    layers = cfg.num_hidden_layers
    one = Example(list(range(10)), list(range(10)))
    assert counter.example(one) == 6 * n * 10 + 12 * layers * d * (10 * 11 // 2)
    # packed: two samples of 6 and 4 tokens see only themselves
    packed = Example(list(range(10)), list(range(10)), position_ids=[0, 1, 2, 3, 4, 5, 0, 1, 2, 3])
    assert counter.example(packed) == 6 * n * 10 + 12 * layers * d * (21 + 10)
    assert counter._pairs(10, 4) == 10 + 6 * 4   # sliding window of 4: 1+2+3+4, then 4 keys per query


def test_log_rows_carry_tflops_mfu_and_the_device_peak(eval_runs):
    from megacompile.hardware import measure_cpu
    out, _, _ = eval_runs
    rows = [r for r in log_rows(out) if "loss" in r]
    peak = measure_cpu(torch.float32).compute_tflops   # the CPU's measured profile (cached in this process)
    for r in rows:
        assert r["tflops"] > 0 and r["mfu"] == pytest.approx(r["tflops"] / peak)
        assert isinstance(r["peak_device_bytes"], int) and r["peak_device_bytes"] > 0


# -- checkpoints are Hugging Face model folders ---------------------------------------------------
def test_checkpoint_loads_with_from_pretrained(eval_runs, tiny_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, _, _ = eval_runs
    ckpt = out / "checkpoint-4"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in ckpt.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    masters = checkpoint.read(ckpt).masters
    for name, p in model.named_parameters():
        assert torch.equal(p, masters[name]), name
    assert AutoTokenizer.from_pretrained(ckpt)("hello")["input_ids"] == \
        AutoTokenizer.from_pretrained(tiny_dir)("hello")["input_ids"]
    # every file is listed with its size in trainer.json (read() checks them)
    files = json.loads((ckpt / checkpoint.TRAINER).read_text())["files"]
    assert set(files) == {p.name for p in ckpt.iterdir()} - {checkpoint.TRAINER}


def test_sharded_checkpoint_loads_resumes_and_is_checked(tiny_dir, tmp_path, monkeypatch):  # noqa: F811
    from transformers import AutoModelForCausalLM
    monkeypatch.setattr(hf_folder, "MAX_SHARD_SIZE", 20_000)   # the tiny model in several shards
    full = config(tiny_dir, tmp_path / "full", max_steps=2, save_steps=1)
    trainer.train(full, progress=False)
    part = config(tiny_dir, tmp_path / "part", max_steps=2, save_steps=1)
    trainer.train(part, stop_at_step=1, progress=False)
    ckpt = Path(part.output_dir) / "checkpoint-1"
    index = json.loads((ckpt / checkpoint.WEIGHTS_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (ckpt / checkpoint.WEIGHTS).exists()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    masters = checkpoint.read(ckpt).masters
    assert all(torch.equal(p, masters[n]) for n, p in model.named_parameters())
    # resumed from the sharded checkpoint: the uninterrupted run's weights, bit for bit
    trainer.train(config(tiny_dir, tmp_path / "part", max_steps=2, save_steps=1, resume_from_checkpoint=True),
                  progress=False)
    a = checkpoint.read(Path(full.output_dir) / "checkpoint-2").masters
    b = checkpoint.read(Path(part.output_dir) / "checkpoint-2").masters
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a damaged or missing shard is named
    shard = ckpt / shards[-1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(checkpoint.CheckpointError, match=f"{shards[-1]} is damaged"):
        checkpoint.read(ckpt)
    shard.unlink()
    with pytest.raises(checkpoint.CheckpointError, match=f"no {shards[-1]}"):
        checkpoint.read(ckpt)


def test_an_eval_batch_that_runs_out_of_memory_says_which_key_to_lower(tiny_dir):  # noqa: F811
    from transformers import AutoTokenizer
    from megacompile.errors import CannotFitError
    from megacompile.runtime.adamw import HostAdamW
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    examples, _ = build_examples(config(tiny_dir, Path("/nonexistent")), tok)
    model = torch.nn.Linear(2, 2)

    def out_of_memory(**batch):
        raise torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(CannotFitError, match=r"batch of 3 x \d+ tokens: lower per_device_eval_batch_size \(now 3\)"):
        evaluate(out_of_memory, model, HostAdamW(model.parameters()), examples, 3, tok.pad_token_id)
    assert model.training   # back in train mode
