"""Packing equals LLaMA-Factory 0.9.5's (tests/data/lf_reference/pack_reference.json, from
pack_generate.py run with LF's interpreter): sft samples grouped by LF's greedy knapsack within
each tokenization batch (preprocessing_batch_size), in LF's order, positions restarting per
sample; stage pt blocks cut within each batch (each batch drops its own remainder)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from test_lf_data import RECORDS, needs_smollm2, smollm2_tokenizer  # noqa: F401 (a fixture)
from test_lf_pt import REF as PT_TEXTS

from megacompile.train.hparams.config import from_mapping
from megacompile.train.data import IGNORE, build_examples
from megacompile.train.data.packing import knapsacks, map_batches

REF = json.loads((Path(__file__).parent / "data" / "lf_reference" / "pack_reference.json").read_text())


pytestmark = pytest.mark.usefixtures("own_cache")


def _records_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    info = {}
    for name in REF["sets"]:
        (d / f"{name}.json").write_text(json.dumps(RECORDS[name]["records"]))
        info[name] = {**RECORDS[name]["attr"], "file_name": f"{name}.json"}
    (d / "dataset_info.json").write_text(json.dumps(info))
    return d


@needs_smollm2
@pytest.mark.parametrize("case", REF["sft"],
                         ids=lambda c: f"cutoff{c['cutoff_len']}-batch{c['preprocessing_batch_size']}")
def test_sft_packs_equal_llamafactorys(case, smollm2_tokenizer, tmp_path):  # noqa: F811
    config = from_mapping({"model_name_or_path": "m", "output_dir": "o", "dataset": ",".join(REF["sets"]),
                           "dataset_dir": str(_records_dir(tmp_path)),
                           **{k: case[k] for k in ("template", "cutoff_len", "neat_packing",
                                                   "preprocessing_batch_size")}})
    packed, counts = build_examples(config, copy.deepcopy(smollm2_tokenizer), say=lambda *_: None)
    assert [ex.input_ids for ex in packed] == [p["input_ids"] for p in case["packs"]]
    assert [ex.position_ids for ex in packed] == [p["position_ids"] for p in case["packs"]]
    for ex, theirs in zip(packed, case["packs"]):   # the same labels but at each sample's first token
        starts = {k for k, p in enumerate(ex.position_ids) if p == 0}
        assert [y for k, y in enumerate(ex.labels) if k not in starts] == \
               [y for k, y in enumerate(theirs["labels"]) if k not in starts]
        assert all(ex.labels[k] == IGNORE for k in starts)
    assert max(len(p["input_ids"]) for p in case["packs"]) <= case["lf_cutoff_len"] < case["cutoff_len"]


@needs_smollm2
@pytest.mark.parametrize("case", REF["pt"], ids=lambda c: f"batch{c['preprocessing_batch_size']}")
def test_pt_blocks_are_cut_within_each_batch_as_llamafactory(case, smollm2_tokenizer, tmp_path):  # noqa: F811
    d = tmp_path / "pt"
    d.mkdir()
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in PT_TEXTS["texts"]))
    (d / "dataset_info.json").write_text(json.dumps({"docs": {"file_name": "docs.jsonl",
                                                              "columns": {"prompt": "text"}}}))
    config = from_mapping({"model_name_or_path": "m", "output_dir": "o", "dataset": "docs", "stage": "pt",
                           "dataset_dir": str(d), "cutoff_len": case["cutoff_len"],
                           "preprocessing_batch_size": case["preprocessing_batch_size"]})
    examples, _ = build_examples(config, copy.deepcopy(smollm2_tokenizer), say=lambda *_: None)
    assert [ex.input_ids for ex in examples] == case["input_ids"]


def test_the_reference_batches_change_the_packs():
    sft = {c["preprocessing_batch_size"]: c for c in REF["sft"] if c["cutoff_len"] == 64}
    assert [p["input_ids"] for p in sft[4]["packs"]] != [p["input_ids"] for p in sft[1000]["packs"]]
    assert REF["pt"][0]["input_ids"] != REF["pt"][1]["input_ids"]


def test_map_batches_follow_datasets_sharding_and_knapsacks_take_the_longest_that_fits():
    assert map_batches(10, None, 4) == [(0, 4), (4, 8), (8, 10)]
    assert map_batches(10, 3, 3) == [(0, 3), (3, 4), (4, 7), (7, 10)]   # shards of 4, 3, 3
    assert map_batches(2, 16, 1000) == [(0, 1), (1, 2)]                  # datasets lowers num_proc to 2
    assert knapsacks([4, 4, 7, 1, 2], 8) == [[2, 3], [1, 0], [4]]
    with pytest.raises(ValueError):
        knapsacks([9], 8)
