"""LLaMA-Factory data parity: val_size splits the mixed records (not the examples) as LF's
split_dataset does, mix_strategy interleave_once, preserve_thinking (compared with LF's output in
test_lf_data.py; here: that it changes what it should), columns LF reads only when mapped.
Tiny ChatML tokenizer of test_lf_registry."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_lf_registry import _sets, cache, cfg, tok  # noqa: F401 (fixtures)
from test_train import config, log_rows, tiny_dir  # noqa: F401 (tiny_dir: a fixture)

from megacompile.train.data import IGNORE, build_examples, encode_record, load_registry
from megacompile.train.evaluate import eval_set, holdout_indices

REF = Path(__file__).parent / "data" / "lf_reference"


def _chat_set(tmp_path: Path) -> Path:
    """12 sharegpt records; 3 are malformed (end on a prompt) and give no example."""
    d = tmp_path / "chat"
    d.mkdir()
    records = []
    for i in range(12):
        turns = [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i} " * (1 + i % 3)}]
        records.append({"conversations": turns[:1] if i in (1, 5, 8) else turns})
    (d / "c.json").write_text(json.dumps(records))
    (d / "dataset_info.json").write_text(json.dumps({"c": {"file_name": "c.json", "formatting": "sharegpt"}}))
    return d


def test_val_size_splits_the_records_even_when_some_give_no_example(tmp_path, tok):  # noqa: F811
    d = _chat_set(tmp_path)
    c = cfg(d, dataset="c", val_size=0.25, do_eval=True, seed=3)
    examples, counts = build_examples(c, tok)
    records = json.loads((d / "c.json").read_text())
    train_rows, eval_rows = holdout_indices(len(records), 0.25, 3)   # LF's train_test_split over the records
    attr = load_registry(d, ["c"])["c"]

    def encoded(rows):
        out = [encode_record(records[i], attr, c, tok, _encoder(c, tok))[0] for i in rows]
        return [e.input_ids for e in out if e is not None]
    split = eval_set(c, tok, None, examples, counts)
    assert [e.input_ids for e in split.examples] == encoded(eval_rows)
    assert [e.input_ids for e in split.train] == encoded(train_rows)
    assert counts["held_out_records"] == 3 and counts["malformed"] == 3 and counts["samples"] == 12
    # splitting the 9 examples instead (the old way) would hold out other ones
    _, by_example = holdout_indices(9, 0.25, 3)
    every = encoded(range(12))
    assert [every[i] for i in by_example] != encoded(eval_rows)


def _encoder(c, tok):  # noqa: F811
    from megacompile.train.data import chat_template
    return chat_template(tok, c.template, c)


def test_val_size_with_pt_and_packing_makes_each_side_on_its_own(tmp_path, tok):  # noqa: F811
    """pt blocks and packed sequences are made from each side's records: none mixes the two."""
    d = tmp_path / "pt"
    d.mkdir()
    texts = [f"document {i} " + "word " * (3 + i) for i in range(10)]
    (d / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (d / "dataset_info.json").write_text(json.dumps({"t": {"file_name": "t.jsonl", "columns": {"prompt": "text"}}}))
    c = cfg(d, dataset="t", stage="pt", cutoff_len=8, val_size=3, do_eval=True)
    examples, counts = build_examples(c, tok)
    train_rows, eval_rows = holdout_indices(10, 3, c.seed)

    def blocks(rows):
        stream = [t for i in rows for t in tok(texts[i] + tok.eos_token, add_special_tokens=False)["input_ids"]]
        return [stream[k:k + 8] for k in range(0, len(stream) - len(stream) % 8, 8)]
    assert [e.input_ids for e in counts["held_out"]] == blocks(eval_rows)
    assert [e.input_ids for e in examples] == blocks(train_rows)
    # sft packing: each side packed from its own samples
    chat = _chat_set(tmp_path)
    c = cfg(chat, dataset="c", packing=True, val_size=0.25, do_eval=True, seed=3)
    examples, counts = build_examples(c, tok)
    n_eval = sum(1 for ex in counts["held_out"] for p in ex.position_ids if p == 0)
    n_train = sum(1 for ex in examples for p in ex.position_ids if p == 0)
    train_rows, eval_rows = holdout_indices(12, 0.25, 3)
    well_formed = [i for i in range(12) if i not in (1, 5, 8)]
    assert n_eval == len(set(eval_rows) & set(well_formed)) and n_train == len(set(train_rows) & set(well_formed))
    assert counts["packed_from"] == n_train and len(counts["held_out"]) >= 1


def test_interleave_once_reads_every_record_exactly_once(tmp_path):
    import numpy as np

    from megacompile.train.data.sources import load_source, mix, select_records
    d = _sets(tmp_path, {"a": 7, "b": 3, "c": 12})
    (d / "dataset_info.json").write_text(json.dumps({n: {"file_name": f"{n}.json"} for n in "abc"}))
    for probs in (None, [0.2, 0.5, 0.3]):
        c = cfg(d, dataset="a,b,c", mix_strategy="interleave_once",
                interleave_probs=None if probs is None else ",".join(map(str, probs)))
        registry = load_registry(d, c.datasets)
        parts = [select_records(load_source(registry[n], d), registry[n], None, np.random.RandomState(0))
                 for n in c.datasets]
        mixed = mix(parts, c.mix_strategy, probs, c.seed)["instruction"]
        assert sorted(mixed) == sorted(f"{n} {i}" for n, k in (("a", 7), ("b", 3), ("c", 12)) for i in range(k))
        assert mixed != sorted(mixed, key=lambda r: (r.split()[0], int(r.split()[1])))   # interleaved, not concat
    with pytest.raises(Exception, match="interleave_once"):
        cfg(d, dataset="a,b", mix_strategy="interleave_twice")


def test_preserve_thinking_keeps_the_history_thoughts_with_mask_history():
    """The reference holds LF's encodings with and without preserve_thinking (test_lf_data.py
    compares ours with each): the earlier reply's thought is kept only with it."""
    from megacompile.train.hparams import lf_keys
    cases = json.loads((REF / "reference.json").read_text())
    records = json.loads((REF / "records.json").read_text())["sharegpt_multiturn"]["records"]
    assert "<think>" in records[2]["conversations"][1]["value"]
    for template in ("qwen3", "deepseekr1"):
        def ids(**opts):
            case = next(c for c in cases if c["template"] == template and c["datasets"] == ["sharegpt_multiturn"]
                        and all(c.get(k, False) == v for k, v in opts.items()))
            return case["results"]["sharegpt_multiturn"][2]["input_ids"]
        kept, dropped = ids(mask_history=True, preserve_thinking=True), ids(mask_history=True, preserve_thinking=False)
        assert len(kept) > len(dropped)
    assert "preserve_thinking" not in lf_keys.REFUSED


def test_unmapped_history_column_is_not_read_and_the_log_says_so(tmp_path, tok, capsys):  # noqa: F811
    d = tmp_path / "h"
    d.mkdir()
    (d / "a.json").write_text(json.dumps([{"instruction": "And in Spanish?", "input": "", "output": "Buenos dias.",
                                           "history": [["Translate 'good morning' to French.", "Bonjour."]]}]))
    (d / "dataset_info.json").write_text(json.dumps({"plain": {"file_name": "a.json"},
                                                     "mapped": {"file_name": "a.json",
                                                                "columns": {"history": "history"}}}))
    plain, _ = build_examples(cfg(d, dataset="plain"), tok)
    assert "column 'history' not read" in capsys.readouterr().out
    mapped, _ = build_examples(cfg(d, dataset="mapped"), tok)
    assert "not read" not in capsys.readouterr().out
    assert "Bonjour" not in tok.decode(plain[0].input_ids) and "Bonjour" in tok.decode(mapped[0].input_ids)
    assert sum(t != IGNORE for t in mapped[0].labels) > sum(t != IGNORE for t in plain[0].labels)


def test_eval_on_each_dataset_logs_one_loss_per_set(tiny_dir, tmp_path):  # noqa: F811
    """Each eval data set is evaluated on its own and logged as eval_<name>_loss (HF/LF's name);
    their token-weighted mean is the single eval_loss of the same run without the key."""
    from megacompile.errors import ConfigError
    from megacompile.train.trainer import train
    model = tiny_dir
    keys = dict(eval_dataset="alpaca_demo,sharegpt_demo", do_eval=True, max_steps=2, save_steps=2)
    train(config(model, tmp_path / "each", eval_on_each_dataset=True, **keys), progress=False)
    train(config(model, tmp_path / "one", **keys), progress=False)
    each = {k: v for r in log_rows(tmp_path / "each" / "out") for k, v in r.items() if k.startswith("eval_")}
    one = [r for r in log_rows(tmp_path / "one" / "out") if "eval_loss" in r][-1]
    a, s = ("alpaca_demo", "sharegpt_demo")
    assert {f"eval_{a}_loss", f"eval_{s}_loss"} <= set(each) and "eval_loss" not in each
    assert each[f"eval_{a}_tokens"] + each[f"eval_{s}_tokens"] == one["eval_tokens"]
    mean = (each[f"eval_{a}_loss"] * each[f"eval_{a}_tokens"] + each[f"eval_{s}_loss"] * each[f"eval_{s}_tokens"]) \
        / one["eval_tokens"]
    assert mean == pytest.approx(one["eval_loss"], rel=1e-5) and each[f"eval_{a}_loss"] != each[f"eval_{s}_loss"]
    with pytest.raises(ConfigError, match="eval_on_each_dataset: true needs eval_dataset"):
        config(model, tmp_path, eval_on_each_dataset=True, val_size=0.1, do_eval=True)

