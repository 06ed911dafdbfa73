"""LLaMA-Factory configs under `megatrain train`: the key table (lf_keys.py), unknown and refused
keys, value checks, LR schedules equal to Hugging Face's, report_to, disable_shuffling, CLI help.

Everything but one short training run loads configs only (no model), so the file runs in seconds.
"""
from __future__ import annotations

import ast
import dataclasses
import glob
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from test_train import EXAMPLES, config, log_rows, tiny_dir  # noqa: F401 (tiny_dir: fixture)

from megacompile.cli import main
from megacompile.errors import ConfigError
from megacompile.train.hparams import lf_keys
from megacompile.train import report
from megacompile.train import schedule
from megacompile.train.hparams.config import _FIELDS, _OPTION_FIELDS, TrainConfig, from_mapping, load_config
from megacompile.train.data import DataError, Order

OK = dict(model_name_or_path="m", dataset="d", output_dir="o")

# LLaMA-Factory's examples/train_full/qwen3_full_sft.yaml (v0.9.5), with its comments
QWEN3_FULL_SFT = """\
### model
model_name_or_path: Qwen/Qwen3-4B-Instruct-2507
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: full
deepspeed: examples/deepspeed/ds_z3_config.json  # choices: [ds_z0_config.json, ds_z2_config.json, ds_z3_config.json]

### dataset
dataset: identity,alpaca_en_demo
template: qwen3_nothink
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/qwen3-4b/full/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 2
learning_rate: 1.0e-5
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null
"""


def refused(mapping: dict) -> str:
    with pytest.raises(ConfigError) as e:
        from_mapping({**OK, **mapping})
    return str(e.value)


# -- the key table ----------------------------------------------------------------------------

def test_llamafactory_qwen3_full_sft_example_loads_with_notes_and_mapped_values(tmp_path):
    cfg = tmp_path / "qwen3_full_sft.yaml"
    cfg.write_text(QWEN3_FULL_SFT)
    c = load_config(cfg)
    assert (c.model_name_or_path, c.trust_remote_code, c.stage) == ("Qwen/Qwen3-4B-Instruct-2507", True, "sft")
    assert c.torch_dtype == "bfloat16"   # bf16: true
    assert (c.dataset, c.template, c.cutoff_len, c.max_samples) == ("identity,alpaca_en_demo", "qwen3_nothink", 2048,
                                                                    1000)
    assert (c.overwrite_cache, c.preprocessing_num_workers, c.report_to) == (True, 16, "none")
    assert (c.learning_rate, c.num_train_epochs, c.lr_scheduler_type, c.warmup_ratio) == (1e-5, 3.0, "cosine", 0.1)
    assert (c.per_device_train_batch_size, c.gradient_accumulation_steps, c.resume_from_checkpoint) == (1, 2, None)
    # one line per "what megatrain does instead"; every ignored key is named exactly once
    noted = {"deepspeed", "do_train", "dataloader_num_workers", "plot_loss", "save_only_model"}   # (ddp_timeout: used)
    named = [k for line in c.notes for k in re.match(r"LLaMA-Factory keys? (.+?): ignored; ", line)[1].split(", ")]
    assert sorted(named) == sorted(noted)
    assert any(line.startswith("LLaMA-Factory key deepspeed: ignored; megatrain streams the weights from host RAM "
                               "and runs its own data parallelism") for line in c.notes)
    assert c.ddp_timeout == 180000000   # (LLaMA-Factory's example: the timeout of a collective under torchrun)
    assert len(c.notes) == 5
    assert "notes" not in c.to_dict()   # (not a setting: a resumed run does not compare it)


def test_every_llamafactory_and_hf_training_key_has_a_row():
    """Every Seq2SeqTrainingArguments field, and (where LLaMA-Factory is installed next to us)
    every field of its hparams dataclasses, is a TrainConfig field or in the table."""
    from transformers import Seq2SeqTrainingArguments
    ours = set(_FIELDS) | _OPTION_FIELDS
    table = set(lf_keys.NOTED) | set(lf_keys.REFUSED) | set(lf_keys.MAPPED)
    assert not (table & ours) and not (set(lf_keys.NOTED) & set(lf_keys.REFUSED))
    assert not (set(lf_keys.MAPPED) & (set(lf_keys.NOTED) | set(lf_keys.REFUSED)))
    missing = [f.name for f in dataclasses.fields(Seq2SeqTrainingArguments) if f.name not in ours | table]
    assert not missing
    files = [f for f in glob.glob("/work/lfenv/lib/python3*/site-packages/llamafactory/hparams/*_args.py")
             if "evaluation" not in f]
    if not files:
        pytest.skip("LLaMA-Factory's source is not installed in /work/lfenv")
    for path in files:
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for st in node.body:
                if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
                    continue
                init_false = isinstance(st.value, ast.Call) and any(
                    k.arg == "init" and getattr(k.value, "value", True) is False for k in st.value.keywords)
                assert init_false or st.target.id in ours | table, f"{Path(path).name}: {st.target.id}"


def test_unknown_keys_are_reported_together_with_close_suggestions_only():
    msg = refused({"learnig_rate": 1e-4, "lr": 1e-4, "frobnicate": 1, "deep_speed_cfg": "x", "slot": 2})
    assert msg.count("unknown config keys") == 1
    assert "'learnig_rate' (Did you mean 'learning_rate'?)" in msg
    assert "'lr' (Did you mean 'learning_rate'?)" in msg       # a synonym
    assert "'slot' (Did you mean 'slots'?)" in msg             # a compile option
    assert "'frobnicate'," in msg and "'deep_speed_cfg'" in msg
    assert msg.count("Did you mean") == 3   # nothing for the two that resemble no key
    assert "\n" not in msg


def test_refused_keys_say_why_and_harmless_values_pass():
    msg = refused({"stage": "dpo", "quantization_bit": 4, "use_galore": True, "optim": "sgd", "bogus_key": 1})
    assert "unknown config key 'bogus_key'" in msg
    assert "stage: dpo: DPO (preference pairs) is not supported yet" in msg
    assert "quantization_bit: 4: megatrain trains full-precision weights" in msg
    assert "use_galore: True: megatrain's optimizer is AdamW on the host" in msg
    assert "optim: 'sgd'" in msg
    for stage in ("ppo", "rm", "kto"):
        assert f"stage: {stage}:" in refused({"stage": stage})
    # (finetuning_type is a config key: finetuning.py refuses the methods megatrain lacks; tests/test_freeze.py)
    assert "finetuning_type: oft: OFT" in refused({"finetuning_type": "oft"})
    # LLaMA-Factory's defaults of those keys change nothing
    c = from_mapping({**OK, "finetuning_type": "full", "quantization_bit": None, "use_galore": False,
                      "optim": "adamw_torch", "lora_rank": 8, "pref_beta": 0.1, "packing": None,
                      "label_smoothing_factor": 0.0})
    assert c.packing is None and len(c.notes) == 1 and "pref_beta" in c.notes[0]   # (lora_rank: a lora key now)


def test_mapped_keys():
    assert from_mapping({**OK, "fp16": True}).torch_dtype == "float16"
    assert from_mapping({**OK, "pure_bf16": True, "bf16": False}).torch_dtype == "bfloat16"
    assert from_mapping({**OK, "bf16": True, "torch_dtype": "bfloat16"}).torch_dtype == "bfloat16"
    assert "bf16: True means torch_dtype: bfloat16, but torch_dtype is 'float16'" in \
        refused({"bf16": True, "torch_dtype": "float16"})
    assert "set one of them" in refused({"bf16": True, "fp16": True})
    assert from_mapping({**OK, "neat_packing": True}).packing is True
    assert "for stage: sft" in refused({"neat_packing": True, "stage": "pt"})
    assert from_mapping({**OK, "freeze_vision_tower": False}).vision == "train"
    assert from_mapping({**OK, "train_sampling_strategy": "random"}).disable_shuffling is False
    assert "disable_shuffling: true" in refused({"train_sampling_strategy": "sequential"})


@pytest.mark.parametrize("mapping, match", [
    ({"mix_strategy": "interleave_twice"}, "mix_strategy='interleave_twice': use one of concat, interleave_under"),
    ({"eval_strategy": "best"}, "eval_strategy='best': use one of no, steps, epoch"),
    ({"val_size": -0.1}, "val_size=-0.1: must be 0 or more"),
    ({"val_size": 2.5}, "must be whole"),
    ({"val_size": 0.1, "eval_dataset": "x"}, "set val_size or eval_dataset, not both"),
    ({"interleave_probs": "0.5,0.5", "dataset": "a,b"}, "interleave_probs is only for mix_strategy: interleave"),
    ({"interleave_probs": "1", "dataset": "a,b", "mix_strategy": "interleave_under"}, "one probability per data set"),
    ({"interleave_probs": "0.5,0.6", "dataset": "a,b", "mix_strategy": "interleave_over"}, "sum to 1"),
    ({"interleave_probs": "x,y", "dataset": "a,b", "mix_strategy": "interleave_over"}, "comma-separated numbers"),
    ({"mask_history": True, "train_on_prompt": True}, "mask_history and train_on_prompt cannot both be true"),
    ({"stage": "pt", "train_on_prompt": True}, "are for stage: sft"),
    ({"streaming": True, "max_samples": 10}, "max_samples with streaming"),
    ({"streaming": True, "val_size": 0.1}, "give a number of examples"),
    ({"eval_strategy": "steps"}, "needs evaluation data"),
    ({"eval_steps": 0}, "eval_steps=0.0: must be positive"),
    ({"per_device_eval_batch_size": 0}, "per_device_eval_batch_size=0: must be at least 1"),
    ({"preprocessing_num_workers": 0}, "preprocessing_num_workers=0"),
    ({"report_to": "mlflow"}, "'mlflow' is not one of none, jsonl, all, tensorboard, wandb"),
    ({"report_to": ["none", "wandb"]}, "give it alone"),
    ({"report_to": 3}, r"report_to=3 \(int\): expected str or list"),
    ({"lr_scheduler_kwargs": [1]}, r"lr_scheduler_kwargs=\[1\] \(list\): expected dict"),
    ({"lr_scheduler_kwargs": {"num_cycles": 2}}, "lr_scheduler_type='linear' with lr_scheduler_kwargs"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "is not supported: it lowers the lr when an evaluation metric"),
    ({"lr_scheduler_type": "cosin"}, "lr_scheduler_type='cosin': use one of linear, cosine"),
    ({"lr_scheduler_type": "constant", "lr_scheduler_kwargs": {"x": 1}}, "takes no lr_scheduler_kwargs"),
    ({"warmup_steps": -1}, "warmup_steps=-1: must be 0 or more"),
    ({"warmup_steps": 5, "warmup_ratio": 0.1}, "warmup_ratio=0.1 and warmup_steps=5: set one of them"),
])
def test_values_are_checked_before_the_model_loads(mapping, match):
    with pytest.raises(ConfigError, match=match):
        from_mapping({**OK, **mapping})


def test_typed_keys_accept_their_types():
    c = from_mapping({**OK, "report_to": ["jsonl", "tensorboard"], "warmup_steps": 0.1, "eval_strategy": "steps",
                      "val_size": 0.1, "lr_scheduler_type": "cosine_with_min_lr",
                      "lr_scheduler_kwargs": {"min_lr_rate": 0.1}, "mix_strategy": "interleave_under",
                      "dataset": "a,b", "interleave_probs": "0.25,0.75"})
    assert c.report_to == ["jsonl", "tensorboard"] and c.warmup_steps == 0.1 and isinstance(c.warmup_steps, float)
    assert from_mapping({**OK, "warmup_steps": 3}).warmup_steps == 3
    assert report.trackers(c.report_to) == ["tensorboard"] and report.trackers("none") == []


# -- LR schedules ----------------------------------------------------------------------------

def _lrs(scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def _sgd(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


KWARGS = {"cosine_with_restarts": {"num_cycles": 2}, "polynomial": {"lr_end": 1e-5, "power": 2.0},
          "cosine_with_min_lr": {"min_lr_rate": 0.1}, "cosine_warmup_with_min_lr": {"min_lr_rate": 0.2},
          "warmup_stable_decay": {"num_decay_steps": 4}, "inverse_sqrt": {"timescale": 5}}


@pytest.mark.parametrize("name", schedule.SCHEDULERS)
@pytest.mark.parametrize("warmup, steps", [({}, 0), ({"warmup_steps": 3}, 3), ({"warmup_steps": 0.25}, 5),
                                           ({"warmup_ratio": 0.1}, 2)])
def test_schedule_equals_hugging_faces(name, warmup, steps):
    """Our scheduler (what the trainer builds) gives HF's get_scheduler lr sequence, with the
    warmup counted by TrainingArguments.get_warmup_steps (warmup_ratio as HF folds it in)."""
    from transformers import TrainingArguments, get_scheduler
    total, lr = 20, 1e-3
    c = from_mapping({**OK, "lr_scheduler_type": name, "learning_rate": lr, "lr_scheduler_kwargs": KWARGS.get(name, {}),
                      **warmup})
    hf_warmup = TrainingArguments.get_warmup_steps(
        types.SimpleNamespace(warmup_steps=warmup.get("warmup_steps", warmup.get("warmup_ratio", 0))), total)
    ours = _lrs(schedule.make_scheduler(_sgd(lr), c, total), total + 2)
    theirs = _lrs(get_scheduler(name, _sgd(lr), num_warmup_steps=hf_warmup, num_training_steps=total,
                                scheduler_specific_kwargs=KWARGS.get(name, {})), total + 2)
    assert ours == theirs
    assert schedule.warmup_steps(c, total) == hf_warmup == steps   # (of total = 20)


def test_warmup_starts_at_zero_and_constant_has_none():
    """HF's warmup: 0, 0.5, 1.0 of the lr for 2 warmup steps (the old lambda gave 1/3, 2/3, 1)."""
    c = from_mapping({**OK, "learning_rate": 1.0, "warmup_steps": 2, "lr_scheduler_type": "linear"})
    assert _lrs(schedule.make_scheduler(_sgd(1.0), c, 4), 5) == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.0])
    c = from_mapping({**OK, "learning_rate": 1.0, "warmup_steps": 2, "lr_scheduler_type": "constant"})
    assert _lrs(schedule.make_scheduler(_sgd(1.0), c, 4), 3) == [1.0, 1.0, 1.0]
    assert c.notes == ["lr_scheduler_type: constant has no warmup (as in Hugging Face and LLaMA-Factory), so "
                       "warmup_steps/warmup_ratio are not used: use constant_with_warmup for a warmup."]


def test_schedule_state_is_json_and_restores_the_position():
    c = from_mapping({**OK, "learning_rate": 1.0, "warmup_steps": 2, "lr_scheduler_type": "cosine"})
    first = schedule.make_scheduler(_sgd(1.0), c, 10)
    _lrs(first, 4)
    state = json.loads(json.dumps(first.state_dict()))
    second = schedule.make_scheduler(_sgd(1.0), c, 10)
    second.load_state_dict(state)
    assert _lrs(second, 6) == _lrs(first, 6)


def test_trainer_logs_hugging_faces_schedule(tiny_dir, tmp_path, capsys):  # noqa: F811
    """The trainer's logged lr (the one each step used, as HF logs it) is HF's cosine with warmup; the
    LLaMA-Factory keys it ignores are said once at the start."""
    from transformers import get_scheduler
    train_run(config(tiny_dir, tmp_path, lr_scheduler_type="cosine", warmup_steps=0.5, max_steps=4, save_steps=4,
                     learning_rate=1e-3, deepspeed="ds_z3_config.json", ddp_timeout=180000000, bf16=False))
    printed = capsys.readouterr().out
    assert printed.startswith("[megatrain] LLaMA-Factory key deepspeed: ignored; megatrain streams the weights from "
                              "host RAM")
    assert printed.count("deepspeed") == 1
    hf = _lrs(get_scheduler("cosine", _sgd(1e-3), num_warmup_steps=2, num_training_steps=4), 4)
    assert [r["lr"] for r in log_rows(tmp_path / "out")] == pytest.approx(hf, rel=1e-12)   # each step's own lr
    assert hf[0] == 0.0 and hf[1] == pytest.approx(5e-4) and hf[-1] > 0


@pytest.mark.slow
def test_trainer_resume_applies_a_new_learning_rate_to_the_schedule(tiny_dir, tmp_path):  # noqa: F811
    """A resumed run with another learning_rate continues the same (cosine, warmup) schedule
    scaled to it."""
    from transformers import get_scheduler
    base = dict(lr_scheduler_type="cosine", warmup_steps=2, max_steps=6, save_steps=3, learning_rate=1e-3)
    train_run(config(tiny_dir, tmp_path, **base), stop_at_step=3)
    train_run(config(tiny_dir, tmp_path, resume_from_checkpoint=True, **{**base, "learning_rate": 5e-4}))
    hf = _lrs(get_scheduler("cosine", _sgd(1.0), num_warmup_steps=2, num_training_steps=6), 6)
    rows = log_rows(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in rows] == pytest.approx([1e-3 * f for f in hf[:3]] + [5e-4 * f for f in hf[3:]])


def train_run(cfg, **kw):
    from megacompile.train.trainer import train
    return train(cfg, progress=False, **kw)


# -- data order ------------------------------------------------------------------------------

def test_disable_shuffling_reads_in_order_and_resumes():
    order = Order(5, 2, seed=0, shuffle=False)
    assert [order.next() for _ in range(3)] == [[0, 1], [2, 3], [0, 1]]   # (the incomplete batch is dropped)
    resumed = Order(5, 2, seed=0, shuffle=False)
    resumed.load_state_dict(json.loads(json.dumps(order.state_dict())))
    assert resumed.next() == order.next() == [2, 3]
    shuffled = Order(5, 2, seed=0)
    with pytest.raises(DataError, match="resume with disable_shuffling: true"):
        shuffled.load_state_dict(order.state_dict())
    old = {k: v for k, v in Order(5, 2, seed=0).state_dict().items() if k != "shuffle"}   # an older checkpoint
    shuffled.load_state_dict(old)
    assert from_mapping({**OK, "disable_shuffling": True}).disable_shuffling is True


# -- report_to -------------------------------------------------------------------------------

def test_wandb_reporter_logs_scalars_offline(monkeypatch, tmp_path):
    calls = []
    run = types.SimpleNamespace(log=lambda d, step: calls.append(("log", d, step)),
                                finish=lambda: calls.append(("finish",)))
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or run)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    c = from_mapping({**OK, "report_to": "wandb", "output_dir": str(tmp_path / "run1")})
    rep = report.open_reporter(c)
    rep.start(tmp_path, c)
    rep.log({"step": 3, "loss": 1.5, "lr": 1e-4, "skipped_steps": 0, "optimizer_overlap": {"kept": 1},
             "flag": True}, 3)
    rep.close()
    assert calls[0][0] == "init" and calls[0][1]["name"] == "run1" and calls[0][1]["dir"] == str(tmp_path)
    assert calls[1] == ("log", {"train/loss": 1.5, "train/lr": 1e-4, "train/skipped_steps": 0}, 3)
    assert calls[2] == ("finish",)
    named = from_mapping({**OK, "report_to": ["wandb"], "run_name": "sft-1"})
    report.open_reporter(named).start(tmp_path, named)
    assert calls[3][0] == "init" and calls[3][1]["name"] == "sft-1"


def test_missing_tracker_package_is_a_config_error_before_the_model_loads(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)   # (import wandb raises ImportError)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model_name_or_path: {tmp_path / 'no_such_model'}\ndataset: alpaca_demo\ndataset_dir: {EXAMPLES}\n"
                   f"output_dir: {tmp_path / 'out'}\nreport_to: [jsonl, wandb]\ndevice: cpu\n")
    assert main(["train", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatrain: error: report_to: wandb needs the wandb package (pip install wandb)")
    assert report.trackers("all") == [t for t in ("tensorboard",) if report._importable(t)]


# -- the command line ------------------------------------------------------------------------

def test_version_and_no_arguments(capsys):
    from megacompile import __version__
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"megatrain {__version__}"
    assert main([]) == 0   # the help, as pip and docker print it (not an error)
    out = capsys.readouterr().out
    assert out.startswith("usage: megatrain") and "train" in out and "--version" in out


def test_train_help_lists_the_keys_by_group(tmp_path, capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    headings = ["\nmodel:", "\ndata:", "\ntraining:", "\nevaluation:", "\noutput:", "\nmegatrain options"]
    assert [out.index(h) for h in headings] == sorted(out.index(h) for h in headings)
    for f in dataclasses.fields(TrainConfig):
        if f.name != "megatrain":
            assert f"\n  {f.name} " in out, f.name
    assert re.search(r"\n  learning_rate +5e-05 +peak learning rate of AdamW\n", out)
    assert re.search(r"\n  slots +2 +Number of decoder-layer weight slots", out)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name_or_path: m\n")   # (incomplete: --help must not load it)
    assert main(["train", str(cfg), "--help"]) == 0
    assert "\ntraining:" in capsys.readouterr().out
