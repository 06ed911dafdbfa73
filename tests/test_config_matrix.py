"""Options as users combine them: a pairwise matrix of `megatrain train` configs (issue 28).

LLaMA-Factory's own qwen3_full_sft.yaml (bf16 + gradient_accumulation_steps: 2) did not train:
the second micro-batch's new length made Dynamo recompile while the first one's fp32 gradients
were on the bf16 parameters (megacompile/compile_start.py). Every option was tested alone, none
with the others. Here a covering array (tests/pairwise.py) puts every value of every factor
together with every value of every other factor in at least one row:

    precision    fp32 | bf16 | fp16 (LLaMA-Factory's bf16: true / fp16: true; fp32 masters always)
    accum        gradient_accumulation_steps 1 | 2 | 3
    batch        per_device_train_batch_size 1 | 2
    tuning       finetuning_type full | freeze (the last layer) | lora (rank 4, all linear layers)
    packing      off | on (sft: neat_packing: true; pt: packing: true)
    eval         off | val_size 4 + eval_strategy steps + eval_steps 2
    template     qwen3_nothink | llama3 | the tokenizer's own (a custom Jinja chat template)
    stage        sft (alpaca + sharegpt records) | pt (raw text)
    scheduler    cosine | constant_with_warmup (warmup_ratio 0.25)
    resume       fresh | interrupted after step 3 and resumed from the last checkpoint (step 2)

The first row is the combination of LLaMA-Factory's example (`required`); the generator adds 10
more (the full product would be 5184). Each row trains 4 steps of a tiny Llama through
`megatrain train` (in this process, with a fresh Dynamo) at cutoff_len 128 for sft, so the
micro-batches of a step differ in length and Dynamo recompiles inside an accumulated step (pt:
48, packed blocks or single texts), and is checked two ways:
  * against eager PyTorch on the same data pipeline (tests/eager_trainer.py): trained tokens and
    learning rates equal, losses, gradient norms and eval losses within the tolerances of
    tests/test_parity.py (fp32 1e-5; bf16/fp16 1.6e-2 relative), the final fp32 masters within
    1e-5 (fp32) or test_parity's bf16 bound (at most 2 x steps x lr apart, 2e-5 on average);
  * against itself resumed, bit for bit: a "fresh" row's run is continued from its checkpoint-2
    by a second run in a new output_dir (resume_from_checkpoint: PATH); a "resume" row's run is
    the one resumed in place (resume_from_checkpoint: true) from the folder the run leaves when
    it is interrupted after step 3, and the uninterrupted run must equal it. Steps 3-4 (losses,
    gradient norms, learning rates, eval losses) and every tensor of checkpoint-4 compare with ==.

No combination of these factors is refused; the combinations megatrain refuses are in
`REFUSED` below: each must stop at preflight with exit 2 and one `megatrain: error:` line,
before any step, and leave no run behind.
"""
from __future__ import annotations

import json
import shutil
from itertools import combinations
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eager_trainer import eager_run
from megacompile.cli import main
from megacompile.train.hparams.config import load_config
from megacompile.train.trainer import LOG_NAME
from pairwise import pairwise, pairs_of

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
FACTORS = {
    "precision": ["fp32", "bf16", "fp16"],
    "accum": [1, 2, 3],
    "batch": [1, 2],
    "tuning": ["full", "freeze", "lora"],
    "packing": ["off", "on"],
    "eval": ["off", "on"],
    "template": ["qwen3_nothink", "llama3", "jinja"],
    "stage": ["sft", "pt"],
    "scheduler": ["cosine", "constant_with_warmup"],
    "resume": ["fresh", "resume"],
}
# LLaMA-Factory's examples/train_full/qwen3_full_sft.yaml as a row: it runs whatever else is covered
LF_EXAMPLE = {"precision": "bf16", "accum": 2, "batch": 1, "tuning": "full", "packing": "off", "eval": "off",
              "template": "qwen3_nothink", "stage": "sft", "scheduler": "cosine", "resume": "fresh"}
ROWS, IMPOSSIBLE = pairwise(FACTORS, seed=2, required=[LF_EXAMPLE])   # (11 rows; the greedy stage alone: 14)
STEPS, LR = 4, 1e-3
# a chat template of the tokenizer's own (no LLaMA-Factory name): template unset uses it
JINJA = ("{% for m in messages %}{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>\n"
         "{% elif m['role'] == 'user' %}[USER] {{ m['content'] }}\n{% elif m['role'] == 'assistant' %}"
         "[BOT] {{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}[BOT] {% endif %}")
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]


def _row_id(row: dict) -> str:
    return "-".join(f"{v}" if not isinstance(v, int) else f"{k}{v}" for k, v in row.items())


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> tuple[Path, Path]:
    """(model folder, data folder): a 2-layer Llama whose byte-level BPE tokenizer knows ChatML's
    and Llama 3's special tokens and carries the custom Jinja template; the example records for
    sft and, for pt, every example text as a line (enough text for packed 48-token blocks)."""
    from conftest import chatml_tokenizer, save_tiny_llama
    root = tmp_path_factory.mktemp("matrix")
    model, data = root / "model", root / "data"
    tok = chatml_tokenizer()
    tok.chat_template = JINJA
    tok.add_special_tokens({"additional_special_tokens": LLAMA3_TOKENS})
    save_tiny_llama(model, tok)
    data.mkdir()
    for name in ("alpaca_demo.json", "sharegpt_demo.jsonl"):
        shutil.copy(EXAMPLES / name, data / name)
    alpaca = json.loads((EXAMPLES / "alpaca_demo.json").read_text())
    chats = [json.loads(line) for line in (EXAMPLES / "sharegpt_demo.jsonl").read_text().splitlines()]
    texts = [json.loads(line)["text"] for line in (EXAMPLES / "pretrain_demo.jsonl").read_text().splitlines()]
    texts += [" ".join(filter(None, (r["instruction"], r["input"], r["output"]))) for r in alpaca]
    texts += [" ".join(turn["value"] for turn in c["conversations"]) for c in chats]
    (data / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    info = json.loads((EXAMPLES / "dataset_info.json").read_text())
    info["text"] = {"file_name": "text.jsonl", "columns": {"prompt": "text"}}
    (data / "dataset_info.json").write_text(json.dumps(info, indent=1))
    return model, data


def row_config(row: dict, model: Path, data: Path, out: Path) -> dict:
    """The row as a LLaMA-Factory-style YAML mapping (its keys, as a user writes them)."""
    sft = row["stage"] == "sft"
    cfg = {"model_name_or_path": str(model), "stage": row["stage"], "do_train": True,
           "finetuning_type": row["tuning"], "dataset": "alpaca_demo,sharegpt_demo" if sft else "text",
           "dataset_dir": str(data), "cutoff_len": 128 if sft else 48, "output_dir": str(out), "logging_steps": 1,
           "save_steps": 2, "report_to": "none", "per_device_train_batch_size": row["batch"],
           "gradient_accumulation_steps": row["accum"], "learning_rate": LR, "max_steps": STEPS,
           "lr_scheduler_type": row["scheduler"], "warmup_ratio": 0.25, "seed": 0, "device": "cpu"}
    if row["precision"] != "fp32":
        cfg[row["precision"]] = True
    if row["tuning"] == "freeze":
        cfg["freeze_trainable_layers"] = 1
    if row["tuning"] == "lora":
        cfg.update(lora_rank=4, lora_target="all")
    if row["packing"] == "on":
        cfg["neat_packing" if sft else "packing"] = True
    else:
        cfg["packing"] = False
    if row["eval"] == "on":
        cfg.update(val_size=4, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)
    if row["template"] != "jinja":
        cfg["template"] = row["template"]
    return cfg


def _cli(cfg: dict, path: Path, capsys) -> None:
    path.write_text(yaml.safe_dump(cfg))
    code = main(["train", str(path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]


def _log(out: Path) -> tuple[dict[int, dict], dict[int, float]]:
    """(training rows by step, eval loss by step) of a run's log."""
    rows = [json.loads(line) for line in (out / LOG_NAME).read_text().splitlines()]
    return ({r["step"]: r for r in rows if "loss" in r}, {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r})


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    found = {}
    for name in ("model.safetensors", "adapter_model.safetensors"):
        if (checkpoint / name).exists():
            found.update({f"{name}:{k}": v for k, v in load_file(str(checkpoint / name)).items()})
    return found


def _same_bits(a: Path, b: Path, steps: list[int]) -> None:
    """Run folder `b` repeats `a` bit for bit at `steps` and in checkpoint-STEPS."""
    (ra, ea), (rb, eb) = _log(a), _log(b)
    for s in steps:
        for key in ("loss", "grad_norm", "lr", "skipped_steps"):
            assert rb[s][key] == ra[s][key], (s, key, ra[s], rb[s])
        assert eb.get(s) == ea.get(s), (s, ea, eb)
    ta, tb = _tensors(a / f"checkpoint-{STEPS}"), _tensors(b / f"checkpoint-{STEPS}")
    assert ta.keys() == tb.keys() and ta
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


def _like_eager(out: Path, ref: dict, row: dict) -> None:
    rows, evals = _log(out)
    assert sorted(rows) == list(range(1, STEPS + 1))
    low = row["precision"] != "fp32"
    tol = dict(rel=1.6e-2, abs=1e-2) if low else dict(rel=1e-5, abs=1e-6)
    tokens = [rows[s]["trained_tokens"] - (rows[s - 1]["trained_tokens"] if s > 1 else 0) for s in sorted(rows)]
    assert tokens == ref["tokens"]
    assert [rows[s]["lr"] for s in sorted(rows)] == pytest.approx(ref["lrs"], abs=1e-12)
    assert [rows[s]["loss"] for s in sorted(rows)] == pytest.approx(ref["losses"], **tol)
    assert [rows[s]["grad_norm"] for s in sorted(rows)] == pytest.approx(ref["grad_norms"], rel=2e-2 if low else 1e-4)
    assert evals == pytest.approx({s: v for (_, s), v in ref["eval"].items()}, **tol)
    saved = _tensors(out / f"checkpoint-{STEPS}")
    by_name = {k.split(":", 1)[1]: v for k, v in saved.items()}
    diffs = []
    for name, master in ref["masters"].items():
        plain = name.replace(".default.", ".")   # (a LoRA weight: saved under PEFT's name)
        ours = (by_name[plain] if plain in by_name else by_name["base_model.model." + plain]).float()
        diffs.append((ours - master).abs().flatten())
    diff = torch.cat(diffs)
    if low:   # (test_parity.py: bf16 rounding can flip an Adam update where the gradient is ~0)
        assert diff.max() <= 2 * STEPS * LR and diff.mean() < 2e-5, (diff.max(), diff.mean())
    else:
        assert diff.max() <= 1e-5, diff.max()


def test_the_rows_cover_every_pair_and_reach_issue_28():
    every = {((a, i), (b, j)) for a, b in combinations(FACTORS, 2)
             for i in range(len(FACTORS[a])) for j in range(len(FACTORS[b]))}
    covered = set().union(*(pairs_of(r, FACTORS) for r in ROWS))
    assert not IMPOSSIBLE and covered == every
    assert ROWS[0] == LF_EXAMPLE   # (bf16 with accumulation, full fine-tuning, sft: issue 28's break)
    assert len(ROWS) <= 12   # (the full product is 3 x 3 x 2 x 3 x 2 x 2 x 3 x 2 x 2 x 2 = 5184 rows)


@pytest.mark.parametrize("row", ROWS, ids=_row_id)
def test_row_trains_like_eager_and_resumes_bit_for_bit(row, matrix, tmp_path, own_cache, capsys):
    model, data = matrix
    first = tmp_path / "run"
    cfg = row_config(row, model, data, first)
    _cli(cfg, tmp_path / "run.yaml", capsys)
    if row["resume"] == "fresh":
        # continued from its checkpoint-2 by a new run in an empty folder
        again = tmp_path / "again"
        _cli({**cfg, "output_dir": str(again), "resume_from_checkpoint": str(first / "checkpoint-2")},
             tmp_path / "again.yaml", capsys)
        _same_bits(first, again, [3, 4])
        checked = first
    else:
        # the folder of this run interrupted after step 3 (checkpoint-2, the log to step 3, no
        # export: what a kill leaves; tests/test_train.py kills real runs), resumed in place from
        # its last checkpoint; its steps 1-4 are what is compared with eager
        resumed = tmp_path / "resumed"
        shutil.copytree(first / "checkpoint-2", resumed / "checkpoint-2")
        lines = (first / LOG_NAME).read_text().splitlines()
        (resumed / LOG_NAME).write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= 3))
        _cli({**cfg, "output_dir": str(resumed), "resume_from_checkpoint": True}, tmp_path / "resume.yaml", capsys)
        _same_bits(first, resumed, [3, 4])
        checked = resumed
    _like_eager(checked, eager_run(load_config(tmp_path / "run.yaml")), row)


# combinations megatrain refuses: (the row's config changed by, what the one error line says)
REFUSED = {
    "neat_packing with stage pt": ({"stage": "pt", "dataset": "text", "neat_packing": True},
                                   "packing of separate samples is for stage: sft"),
    "a template whose tokens the tokenizer lacks": ({"template": "llama3", "model_name_or_path": "<chatml>"},
                                                    "which the tokenizer does not have"),
    "bf16 and fp16 together": ({"bf16": True, "fp16": True}, "torch_dtype"),
    "eval steps without eval data": ({"eval_strategy": "steps", "eval_steps": 2}, "needs evaluation data"),
    "a schedule that follows a metric": ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "function of the step"),
    "LoRA with freeze keys": ({"finetuning_type": "lora", "freeze_trainable_layers": 1}, "freeze_trainable_layers"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_combinations_stop_at_preflight_with_one_line(name, matrix, tmp_path, own_cache, capsys):
    model, data = matrix
    change, message = REFUSED[name]
    cfg = {**row_config(LF_EXAMPLE, model, data, tmp_path / "out"), **change}
    if cfg["model_name_or_path"] == "<chatml>":   # the model with a ChatML tokenizer that lacks Llama 3's tokens
        from conftest import chatml_tokenizer
        shutil.copytree(model, tmp_path / "chatml")
        chatml_tokenizer().save_pretrained(tmp_path / "chatml")
        cfg["model_name_or_path"] = str(tmp_path / "chatml")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    code = main(["train", str(tmp_path / "c.yaml"), "--no-progress"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("megatrain:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("megatrain: error:"), err[-2000:]
    assert message in lines[0], lines[0]
    assert not (tmp_path / "out").exists()   # no step ran, no run was left behind


def test_a_break_of_ours_in_a_run_is_reported_as_our_bug(matrix, tmp_path, own_cache, capsys, monkeypatch):
    """The row of issue 28 with the gradient lifting switched off: the run stops at the recompile
    with exit 1 and one line that calls it megatrain's bug and says where in the run it was."""
    from megacompile import compile_start
    monkeypatch.setattr(compile_start.LiftedGrads, "lift", lambda self, model: 0)
    # (the recompile a second length makes: data the trainer cannot see ahead, a stream; with the
    # lengths known, the first compile takes any length and there is no recompile to break)
    monkeypatch.setattr("megacompile.train.trainer.lengths_vary", lambda *_: False)
    model, data = matrix
    cfg = row_config(LF_EXAMPLE, model, data, tmp_path / "out")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**cfg, "max_steps": 3}))
    code = main(["train", str(tmp_path / "c.yaml"), "--no-progress"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("megatrain:")]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("megatrain: internal error:"), err[-2000:]
    for fact in ("This is a megatrain bug", "model: LlamaForCausalLM", "dtypes: bfloat16", "step: ",
                 "micro_batch: 2 of 2", "shape: 1x", "'logits': 'drop'"):
        assert fact in lines[0], (fact, lines[0])
    assert "Traceback" not in err and "replace the op" not in lines[0]
