"""`stage: pt` examples equal LLaMA-Factory 0.9.5's (tests/data/lf_reference/pt_reference.json,
from pt_generate.py run with LF's interpreter): packing by default (blocks of cutoff_len, the
remainder dropped), an explicit `packing: true` packing into cutoff_len - 1 as LF's
DataArguments does, `packing: false` truncating each document, the llama3 template's
<|end_of_text|> separator, a template that replaces EOS, and BOS with add_bos_token."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from test_lf_data import needs_smollm2, smollm2_tokenizer  # noqa: F401 (a fixture)

from megacompile.train.hparams.config import from_mapping
from megacompile.train.data import IGNORE, DataError, build_examples, data_cutoff_len, packs

REF = json.loads((Path(__file__).parent / "data" / "lf_reference" / "pt_reference.json").read_text())


pytestmark = pytest.mark.usefixtures("own_cache")


def corpus(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in REF["texts"]))
    (d / "dataset_info.json").write_text(json.dumps({"docs": {"file_name": "docs.jsonl",
                                                              "columns": {"prompt": "text"}}}))
    return d


def pt_config(tmp_path, case: dict):
    keys = {k: v for k, v in case.items() if k in ("cutoff_len", "packing", "template")}
    return from_mapping({"model_name_or_path": "m", "output_dir": "o", "dataset": "docs", "stage": "pt",
                         "dataset_dir": str(corpus(tmp_path)), **keys})


def _label(case: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in case.items() if k not in ("input_ids", "eos_token", "bos_token_id"))


@needs_smollm2
@pytest.mark.parametrize("case", REF["cases"], ids=_label)
def test_pt_examples_equal_llamafactorys(case, smollm2_tokenizer, tmp_path):  # noqa: F811
    tok = copy.deepcopy(smollm2_tokenizer)
    if case.get("add_bos_token"):
        tok.add_bos_token = True
    config = pt_config(tmp_path, case)
    assert data_cutoff_len(config) == case["lf_cutoff_len"] and packs(config) == case.get("packing", True)
    if not case["input_ids"]:
        with pytest.raises(DataError, match="stage pt: fewer than cutoff_len"):
            build_examples(config, tok, say=lambda *_: None)
        return
    examples, _ = build_examples(config, tok, say=lambda *_: None)
    assert [ex.input_ids for ex in examples] == case["input_ids"]
    assert tok.eos_token == case["eos_token"]
    for ex in examples:   # LF's DataCollatorForLanguageModeling: the pad token is never a target
        assert ex.labels == [IGNORE if t == tok.pad_token_id else t for t in ex.input_ids]


def test_reference_covers_the_cases():
    """The reference exercises what it claims: the explicit-packing block is one shorter, BOS
    starts blocks, a truncated document, the llama3 separator differs from EOS."""
    by = {json.dumps({k: v for k, v in c.items() if k in ("cutoff_len", "packing", "template", "add_bos_token")},
                     sort_keys=True): c for c in REF["cases"]}
    assert {len(b) for b in by['{"cutoff_len": 16}']["input_ids"]} == {16}
    assert {len(b) for b in by['{"cutoff_len": 16, "packing": true}']["input_ids"]} == {15}
    assert max(len(b) for b in by['{"cutoff_len": 16, "packing": false}']["input_ids"]) == 16
    bos = by['{"add_bos_token": true, "cutoff_len": 16}']
    assert all(b[0] == bos["bos_token_id"] for b in bos["input_ids"])
    assert by['{"cutoff_len": 12, "template": "llama3"}']["eos_token"] != "<|end_of_text|>"


def test_explicit_packing_lowers_cutoff_len_as_llamafactory(tmp_path):
    base = {"model_name_or_path": "m", "output_dir": "o", "dataset": "d", "cutoff_len": 32}
    assert data_cutoff_len(from_mapping({**base, "stage": "pt"})) == 32   # pt packs by default: no change
    assert data_cutoff_len(from_mapping({**base, "stage": "pt", "packing": True})) == 31
    assert data_cutoff_len(from_mapping({**base, "neat_packing": True})) == 31
    assert not packs(from_mapping(base)) and packs(from_mapping({**base, "stage": "pt"}))
    assert not packs(from_mapping({**base, "stage": "pt", "packing": False}))
