"""LLaMA-Factory's data registry, sampling and mixing, and the tokenization cache.

The reference record choices (tests/data/lf_reference/registry_sampling.json) were made by
LLaMA-Factory 0.9.5's own loader (registry_generate.py, run in LF's environment); its real
data/dataset_info.json (104 entries) is registry_dataset_info.json.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from megacompile.train.data import tokenize_cache
from megacompile.train.hparams.config import from_mapping
from megacompile.train.data import (CHATML, DataError, Example, build_examples, check_datasets, encode_record,
                                    fingerprint, load_registry)
from megacompile.train.data.examples import Examples
from megacompile.train.data.sources import load_source, mix, select_records

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
REFERENCE = Path(__file__).resolve().parent / "data" / "lf_reference"


@pytest.fixture(scope="module")
def tok():
    """A ChatML byte-level BPE tokenizer trained in-process on the example data (offline)."""
    from conftest import chatml_tokenizer
    return chatml_tokenizer()


@pytest.fixture(autouse=True)
def cache(own_cache, monkeypatch) -> Path:
    """Each test its own tokenization cache, and no hub switches from the environment."""
    for name in ("USE_MODELSCOPE_HUB", "USE_OPENMIND_HUB"):
        monkeypatch.delenv(name, raising=False)
    return own_cache


def cfg(dataset_dir, **kw):
    return from_mapping({"model_name_or_path": "m", "output_dir": "o", "dataset_dir": str(dataset_dir),
                         "cutoff_len": 64, **kw})


def lf_dir(tmp_path: Path) -> Path:
    """LLaMA-Factory's dataset_info.json with two of its demo files (alpaca, txt corpus)."""
    d = tmp_path / "lf_data"
    d.mkdir()
    shutil.copy(REFERENCE / "registry_dataset_info.json", d / "dataset_info.json")
    shutil.copy(EXAMPLES / "alpaca_demo.json", d / "alpaca_en_demo.json")
    texts = [json.loads(line)["text"] for line in (EXAMPLES / "pretrain_demo.jsonl").read_text().splitlines()]
    (d / "wiki_demo.txt").write_text("\n".join(texts) + "\n")
    return d


# registry ---------------------------------------------------------------------------
def test_llamafactory_dataset_info_loads_with_one_entry_selected(tmp_path, tok):
    d = lf_dir(tmp_path)
    raw = json.loads((d / "dataset_info.json").read_text())
    assert len(raw) == 104 and "deepctrl" in raw and not {"file_name", "hf_hub_url"} & set(raw["deepctrl"])
    registry = load_registry(d, ["alpaca_en_demo"])
    assert registry["alpaca_en_demo"].file_name == "alpaca_en_demo.json" and len(registry) == 104
    # every entry's keys are known: an entry is refused only for what megatrain cannot train
    refused = {}
    for name in raw:
        try:
            attr = registry[name]
        except DataError as e:
            refused[name] = str(e)
            continue
        assert attr.load_from in ("file", "hf_hub", "ms_hub")
    assert all("preference data" in m or "text and image models" in m for m in refused.values()), refused
    assert {n for n, e in raw.items() if e.get("ranking")} <= set(refused)
    assert registry["deepctrl"].load_from == "ms_hub" and registry["alpaca_en"].load_from == "hf_hub"
    assert registry["starcoder_python"].folder == "python"
    # checking everything (names=None) stops at the first unusable entry
    with pytest.raises(DataError, match="entry 'mllm_audio_demo' maps audios"):
        load_registry(d)
    examples, counts = build_examples(cfg(d, dataset="alpaca_en_demo"), tok)
    assert len(examples) > 0 and counts["records"] == {"alpaca_en_demo": 16}


def test_selected_entries_are_refused_with_the_reason(tmp_path, monkeypatch):
    d = lf_dir(tmp_path)

    def refused(name, match, **kw):
        with pytest.raises(DataError, match=match):
            check_datasets(cfg(d, dataset=name, **kw))
    refused("dpo_en_demo", "preference data .*stage dpo or rm, which megatrain does not train")
    refused("kto_en_demo,dpo_zh_demo", "entry 'dpo_zh_demo' is preference data")
    refused("mllm_video_demo", "maps videos columns: megatrain trains text and image models")
    refused("deepctrl", r"from ModelScope \('deepctrl/deepctrl-sft-data', because the entry has no hf_hub_url\)")
    refused("nope", "'nope' is not in .*registered: ")
    monkeypatch.setenv("USE_MODELSCOPE_HUB", "1")
    refused("alpaca_en", "from ModelScope .*USE_MODELSCOPE_HUB is set.*Unset USE_MODELSCOPE_HUB to read its hf_hub_url")
    monkeypatch.delenv("USE_MODELSCOPE_HUB")
    monkeypatch.setenv("USE_OPENMIND_HUB", "true")
    assert load_registry(d, ["alpaca_en"])["alpaca_en"].load_from == "om_hub"
    refused("alpaca_en", "from OpenMind .*'HaM/alpaca_en'")
    monkeypatch.delenv("USE_OPENMIND_HUB")
    info = json.loads((d / "dataset_info.json").read_text())
    info.update({"script": {"script_url": "my_loader"}, "cloud": {"cloud_file_name": "s3://bucket/x.json"},
                 "typo": {"file_name": "alpaca_en_demo.json", "columns": {"promt": "q"}},
                 "none": {"formatting": "alpaca"}, "openai": {"file_name": "alpaca_en_demo.json",
                                                              "formatting": "openai"},
                 "weird": {"file_name": "alpaca_en_demo.json", "ranking": "yes"}})
    (d / "dataset_info.json").write_text(json.dumps(info))
    refused("script", "loading script; datasets 4 and later no longer run them")
    refused("cloud", "needs cloud credentials")
    refused("typo", r"columns has unknown names \['promt'\]")
    refused("none", "names no data")
    refused("openai", "formatting='openai'; use alpaca or sharegpt")
    refused("weird", r"ranking='yes' \(str\); expected true or false")
    # the unselected bad entries are ignored
    assert check_datasets(cfg(d, dataset="alpaca_en_demo"))["alpaca_en_demo"].endswith("alpaca_en_demo.json")


def test_txt_files_are_one_text_per_line(tmp_path, tok):
    d = lf_dir(tmp_path)
    from_txt, counts = build_examples(cfg(d, dataset="wiki_demo", stage="pt", cutoff_len=16), tok)
    from_jsonl, _ = build_examples(cfg(EXAMPLES, dataset="pretrain_demo", stage="pt", cutoff_len=16), tok)
    assert counts["records"] == {"wiki_demo": 16} and len(from_txt) > 3
    assert fingerprint(from_txt) == fingerprint(from_jsonl)


# sampling and mixing against LLaMA-Factory ------------------------------------------
def _sets(tmp_path: Path, sizes: dict[str, int]) -> Path:
    d = tmp_path / "sets"
    d.mkdir(exist_ok=True)
    for name, n in sizes.items():
        records = [{"instruction": f"{name} {i}", "input": "", "output": "x"} for i in range(n)]
        (d / f"{name}.json").write_text(json.dumps(records))
    return d


@pytest.mark.parametrize("case", json.loads((REFERENCE / "registry_sampling.json").read_text()),
                         ids=lambda c: f"{c['dataset']}-{c.get('mix_strategy', 'concat')}")
def test_num_samples_max_samples_and_mixing_choose_llamafactorys_records(tmp_path, case):
    import numpy as np
    d = _sets(tmp_path, case["sizes"])
    info = {name: {"file_name": f"{name}.json", **({"num_samples": case["num_samples"][name]}
                                                   if name in case.get("num_samples", {}) else {})}
            for name in case["sizes"]}
    (d / "dataset_info.json").write_text(json.dumps(info))
    c = cfg(d, dataset=case["dataset"], max_samples=case.get("max_samples"), seed=case["seed"],
            mix_strategy=case.get("mix_strategy", "concat"), interleave_probs=case.get("interleave_probs"))
    registry = load_registry(d, c.datasets)
    rng = np.random.RandomState(c.seed)   # what build_examples draws with
    parts = [select_records(load_source(registry[n], d), registry[n], c.max_samples, rng) for n in c.datasets]
    probs = None if c.interleave_probs is None else [float(p) for p in c.interleave_probs.split(",")]
    mixed = mix(parts, c.mix_strategy, probs, c.seed)
    assert [r.split() for r in mixed["instruction"]] == [[s, str(i)] for s, i in case["chosen"]]


def test_build_examples_follow_the_mixed_records(tmp_path, tok):
    """End to end: the examples are the chosen records' encodings, in the mixed order."""
    case = json.loads((REFERENCE / "registry_sampling.json").read_text())[-1]   # num_samples, max_samples, over
    d = _sets(tmp_path, case["sizes"])
    info = {name: {"file_name": f"{name}.json"} for name in case["sizes"]}
    info["a"]["num_samples"] = case["num_samples"]["a"]
    (d / "dataset_info.json").write_text(json.dumps(info))
    c = cfg(d, dataset=case["dataset"], max_samples=case["max_samples"], seed=case["seed"],
            mix_strategy=case["mix_strategy"])
    examples, counts = build_examples(c, tok)
    registry = load_registry(d, c.datasets)
    expected = [encode_record({"instruction": f"{s} {i}", "input": "", "output": "x"}, registry[s], c, tok, CHATML)[0]
                for s, i in case["chosen"]]
    assert [e.input_ids for e in examples] == [e.input_ids for e in expected]
    assert [e.labels for e in examples] == [e.labels for e in expected]
    assert counts["records"] == {"c": 8, "a": 8} and counts["samples"] == len(case["chosen"])


# the cache --------------------------------------------------------------------------
def _entries(cache: Path) -> set[str]:
    return {p.name for p in (cache / "tokenized").iterdir() if p.is_dir() and not p.name.startswith(".")}


def test_cache_hits_misses_and_invalidation(tmp_path, tok, cache, monkeypatch):
    d = tmp_path / "data"
    shutil.copytree(EXAMPLES, d, ignore=shutil.ignore_patterns("images"))
    calls = []
    real = tokenize_cache.encode_batch

    def counting(batch, *indices, **kw):
        calls.append(len(next(iter(batch.values()))))
        return real(batch, *indices, **kw)
    monkeypatch.setattr(tokenize_cache, "encode_batch", counting)

    def build(**kw):
        calls.clear()
        examples, _ = build_examples(cfg(d, dataset="alpaca_demo", **kw), tok)
        return fingerprint(examples), bool(calls)
    first, tokenized = build()
    assert tokenized and len(_entries(cache)) == 1
    hashed = []
    real_digest = tokenize_cache._file_digest
    monkeypatch.setattr(tokenize_cache, "_file_digest",
                        lambda p: (hashed.append(p) if p.parent == d else None) or real_digest(p))
    assert build() == (first, False) and hashed                        # hit; the bytes hashed again (not the mtime)
    assert build(learning_rate=1e-3, output_dir="elsewhere", preprocessing_num_workers=1) == (first, False)
    assert build(overwrite_cache=True) == (first, True)                # rebuilt, same key
    assert len(_entries(cache)) == 1
    assert build(cutoff_len=32)[1] and len(_entries(cache)) == 2       # an option that changes the examples
    records = json.loads((d / "alpaca_demo.json").read_text())
    records[0]["output"] = "Changed."
    (d / "alpaca_demo.json").write_text(json.dumps(records))
    changed, tokenized = build()                                       # the file's contents
    assert tokenized and changed != first and len(_entries(cache)) == 3 and hashed
    # an edit that keeps the size and the mtime (cp -p, rsync -t and tar x keep both): the new text
    path = d / "alpaca_demo.json"
    stamp = path.stat()
    path.write_text(path.read_text().replace("Changed.", "Chanced."))
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert path.stat().st_size == stamp.st_size and path.stat().st_mtime_ns == stamp.st_mtime_ns
    edited, tokenized = build()
    assert tokenized and edited not in (first, changed) and len(_entries(cache)) == 4
    assert build(overwrite_cache=True) == (edited, True)
    other = tok.__class__.from_pretrained(_saved(tok, tmp_path))
    other.chat_template = CHATML.replace("<|im_start|>", "<|im_start|> ")
    calls.clear()
    build_examples(cfg(d, dataset="alpaca_demo"), other)               # the tokenizer's chat template
    assert calls and len(_entries(cache)) == 5


def _saved(tok, tmp_path) -> Path:
    path = tmp_path / "tok"
    tok.save_pretrained(path)
    return path


def test_workers_give_the_same_examples(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(tokenize_cache, "RECORDS_PER_PROCESS", 1)   # (worker processes even for 24 records)
    one, counts1 = build_examples(cfg(EXAMPLES, dataset="alpaca_demo,sharegpt_demo", cutoff_len=48), tok)
    two, counts2 = build_examples(cfg(EXAMPLES, dataset="alpaca_demo,sharegpt_demo", cutoff_len=48,
                                      preprocessing_num_workers=2, overwrite_cache=True), tok)
    assert fingerprint(one) == fingerprint(two) and counts1 == counts2 and len(one) == counts1["samples"] == 24
    # a record error inside a worker is the same one-line DataError
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.json").write_text(json.dumps([{"question": f"q{i}", "answer": "a"} for i in range(4)]))
    (bad / "dataset_info.json").write_text(json.dumps({"x": {"file_name": "x.json"}}))
    with pytest.raises(DataError, match="no 'instruction' column"):
        build_examples(cfg(bad, dataset="x", preprocessing_num_workers=2), tok)


def test_worker_processes_only_where_they_pay_off(monkeypatch):
    """preprocessing_num_workers is a ceiling: a process per RECORDS_PER_PROCESS records and per
    usable CPU (LLaMA-Factory's examples ask for 16 workers for a dozen records)."""
    monkeypatch.setattr(tokenize_cache.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    per = tokenize_cache.RECORDS_PER_PROCESS
    assert tokenize_cache._processes(16, 12) is None
    assert tokenize_cache._processes(None, 10**6) is None and tokenize_cache._processes(1, 10**6) is None
    assert tokenize_cache._processes(16, 3 * per) == 3
    assert tokenize_cache._processes(16, 100 * per) == 8   # (the CPUs)
    assert tokenize_cache._processes(4, 100 * per) == 4


def test_tokenized_path_saves_then_loads_as_llamafactory(tmp_path, tok, capsys):
    saved = tmp_path / "tokenized"
    first, _ = build_examples(cfg(EXAMPLES, dataset="alpaca_demo", tokenized_path=str(saved)), tok)
    assert (saved / tokenize_cache.META).is_file() and "tokenized data saved to" in capsys.readouterr().out
    # loaded as is: the other data options are ignored, and said
    again, counts = build_examples(cfg(EXAMPLES, dataset="sharegpt_demo", cutoff_len=32,
                                       tokenized_path=str(saved)), tok)
    assert fingerprint(again) == fingerprint(first) and "are ignored" in capsys.readouterr().out
    assert check_datasets(cfg(EXAMPLES, dataset="sharegpt_demo", tokenized_path=str(saved))) == {
        "sharegpt_demo": f"tokenized_path {saved}"}
    # LLaMA-Factory's own format: a DatasetDict whose train split has input_ids and labels (int64)
    import datasets
    lf = tmp_path / "lf_tokenized"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({
        "input_ids": [[5, 6, 7, 8], [9, 10]], "attention_mask": [[1] * 4, [1] * 2],
        "labels": [[-100, -100, 7, 8], [-100, 10]]})}).save_to_disk(str(lf))
    examples, _ = build_examples(cfg(EXAMPLES, dataset="alpaca_demo", tokenized_path=str(lf)), tok)
    assert [(e.input_ids, e.labels) for e in examples] == [([5, 6, 7, 8], [-100, -100, 7, 8]), ([9, 10], [-100, 10])]
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="holds files but no tokenized data set"):
        build_examples(cfg(EXAMPLES, dataset="alpaca_demo", tokenized_path=str(tmp_path / "junk")), tok)


# the store --------------------------------------------------------------------------
def test_examples_are_stored_as_int32_arrays(tok):
    examples, _ = build_examples(cfg(EXAMPLES, dataset="alpaca_demo,sharegpt_demo", cutoff_len=256), tok)
    assert isinstance(examples, Examples) and examples.ids.dtype.name == "int32"
    per_token = examples.nbytes / examples.tokens
    assert 8 <= per_token < 8 + 16 * len(examples) / examples.tokens + 1e-9   # tokens + labels + two offsets
    pt, _ = build_examples(cfg(EXAMPLES, dataset="pretrain_demo", stage="pt", cutoff_len=16), tok)
    assert pt.ids is pt.labels and pt.nbytes < 4 * pt.tokens + 16 * len(pt) + 1
    # the Example API: lists, slices, selection, from a list and back
    listed = [examples[i] for i in range(len(examples))]
    assert all(isinstance(e.input_ids, list) and isinstance(e.input_ids[0], int) for e in listed)
    assert [e.input_ids for e in examples[2:5]] == [e.input_ids for e in listed[2:5]]
    assert [e.labels for e in examples.select([4, 1])] == [listed[4].labels, listed[1].labels]
    assert fingerprint(Examples.from_list(listed)) == fingerprint(listed) == fingerprint(examples)
    packed = Examples.from_list([Example([1, 2], [-100, 2], [0, 1], ["a.png"]), Example([3], [3], [0])])
    assert packed[0] == Example([1, 2], [-100, 2], [0, 1], ["a.png"]) and packed[1].images is None


def test_packing_works_on_the_store(tok):
    from megacompile.train.data import IGNORE, pack
    examples, _ = build_examples(cfg(EXAMPLES, dataset="alpaca_demo,sharegpt_demo", cutoff_len=96), tok)
    listed = [examples[i] for i in range(len(examples))]
    packed = pack(examples, 128)
    assert fingerprint(packed) == fingerprint(pack(listed, 128)) and isinstance(packed, Examples)
    assert len(packed) < len(examples) and packed.tokens == examples.tokens
    assert max(packed.lengths()) <= 128
    first = packed[0]
    starts = [k for k, p in enumerate(first.position_ids) if p == 0]
    assert len(starts) >= 2 and all(first.labels[k] == IGNORE for k in starts)
    assert sum(e.trained_tokens for e in packed) == sum(e.trained_tokens for e in listed) - sum(
        1 for e in listed if e.labels[0] != IGNORE)


def test_a_damaged_cache_is_rebuilt_and_a_full_disk_is_one_error(tmp_path, tok, cache, monkeypatch, capsys):
    import errno
    c = cfg(EXAMPLES, dataset="alpaca_demo")
    first = fingerprint(build_examples(c, tok)[0])
    (entry,) = [p for p in (cache / "tokenized").iterdir() if p.is_dir()]
    for arrow in (entry / "data").glob("*.arrow"):
        arrow.write_bytes(b"garbage")
    assert fingerprint(build_examples(c, tok)[0]) == first
    assert "cannot be read" in capsys.readouterr().out
    # overwrite_cache replaces the entry (the old one is not read)
    meta = json.loads((entry / tokenize_cache.META).read_text())
    (entry / tokenize_cache.META).write_text(json.dumps({**meta, "records": {"alpaca_demo": -1}}))
    assert build_examples(cfg(EXAMPLES, dataset="alpaca_demo", overwrite_cache=True), tok)[1]["records"] == {
        "alpaca_demo": 16}

    def full(tmp, entry):
        raise OSError(errno.ENOSPC, "No space left on device", str(entry))
    monkeypatch.setattr(tokenize_cache, "_publish", full)
    with pytest.raises(DataError, match="No space left on device.*MEGATRAIN_CACHE"):
        build_examples(cfg(EXAMPLES, dataset="alpaca_demo", cutoff_len=40), tok)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DataError, match="tokenized_path .*afile is a file"):
        check_datasets(cfg(EXAMPLES, dataset="alpaca_demo", tokenized_path=str(tmp_path / "afile")))
