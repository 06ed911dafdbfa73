"""Fuzzing the config and data loaders (hypothesis): whatever a user writes, the only outcomes
are a config / examples, or a MegatrainError (exit 2, one `megatrain: error:` line), never
another exception (a traceback). MEGATRAIN_HYPOTHESIS_EXAMPLES sets the budget (default 12)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given, HealthCheck, settings, strategies as st

from megacompile.cli import main
from megacompile.errors import MegatrainError
from megacompile.train.hparams.config import TrainConfig, from_mapping, load_config
from megacompile.train.data import build_examples

EXAMPLES = int(os.environ.get("MEGATRAIN_HYPOTHESIS_EXAMPLES", "12"))
KEYS = sorted(TrainConfig.__dataclass_fields__)

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["", "true", "1e-4", "-1", "auto", "nan", "cosine", "lora", "sft", "a,b",
                                     "embedded:smollm2", "../..", "/"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=6)
BASE = {"model_name_or_path": "m", "dataset": "d", "output_dir": "o"}


@settings(max_examples=EXAMPLES * 4, deadline=None)
@given(st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=10)), values, max_size=6))
def test_any_config_mapping_is_a_config_or_a_config_error(mapping):
    try:
        cfg = from_mapping({**BASE, **mapping})
    except MegatrainError:
        return
    assert isinstance(cfg, TrainConfig)


@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(st.one_of(st.text(max_size=80), st.binary(max_size=80).map(lambda b: b.decode("latin-1")),
                 st.dictionaries(st.sampled_from(KEYS), values, max_size=5).map(
                     lambda m: yaml.safe_dump({**BASE, **m}, allow_unicode=True))),
       st.lists(st.text(max_size=16), max_size=2))
def test_any_yaml_file_and_overrides_load_or_say_why(text, overrides):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        try:
            load_config(path, overrides)
        except MegatrainError:
            pass


_field = st.one_of(st.text(max_size=20), st.integers(), st.floats(allow_nan=False), st.none(), st.booleans(),
                   st.lists(st.text(max_size=5), max_size=2), st.dictionaries(st.text(max_size=4), st.text(max_size=4),
                                                                             max_size=2))
_alpaca = st.fixed_dictionaries({"instruction": st.one_of(st.text(max_size=20), _field), "output": _field},
                                optional={"input": _field, "system": _field,
                                          "history": st.one_of(_field, st.lists(st.lists(_field, max_size=3),
                                                                                max_size=2))})
_turn = st.fixed_dictionaries({"from": st.one_of(st.sampled_from(["human", "gpt", "system", "observation",
                                                                   "function_call", "tool"]), _field),
                               "value": _field})
_sharegpt = st.fixed_dictionaries({"conversations": st.one_of(st.lists(_turn, max_size=4), _field)},
                                  optional={"system": _field, "tools": _field})


@pytest.fixture(scope="module")
def tok():
    from conftest import chatml_tokenizer
    return chatml_tokenizer()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
@given(st.sampled_from(["alpaca", "sharegpt"]).flatmap(
    lambda f: st.tuples(st.just(f), st.lists(_alpaca if f == "alpaca" else _sharegpt, min_size=1, max_size=4))),
    st.booleans())
@example(data=("sharegpt", [{"conversations": [{"from": [], "value": None}]}]), jsonl=False)   # (a list as a role)
def test_any_records_give_examples_or_a_data_error(tok, own_cache, data, jsonl):
    formatting, records = data
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        name = "d.jsonl" if jsonl else "d.json"
        text = "".join(json.dumps(r) + "\n" for r in records) if jsonl else json.dumps(records)
        (d / name).write_text(text)
        (d / "dataset_info.json").write_text(json.dumps({"d": {"file_name": name, "formatting": formatting}}))
        cfg = from_mapping({**BASE, "dataset_dir": str(d), "cutoff_len": 64, "template": "chatml"})
        try:
            examples, counts = build_examples(cfg, tok)
        except MegatrainError:
            return
        assert len(examples) >= 1 and counts["samples"] == len(records)


def test_a_record_skipped_for_its_reply_is_named_by_file_record_and_cause(tok, own_cache, tmp_path):
    records = [{"instruction": "a", "input": "", "output": "fine"}, {"instruction": "b", "input": "", "output": 42}]
    (tmp_path / "d.json").write_text(json.dumps(records))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"d": {"file_name": "d.json"}}))
    _, counts = build_examples(from_mapping({**BASE, "dataset_dir": str(tmp_path), "template": "chatml"}), tok)
    assert counts["malformed"] == 1
    assert counts["skipped"] == ["d.json record 2: its 'output' is int 42, not text"]


def test_the_cli_turns_a_fuzzed_config_into_one_line(tmp_path, capsys):
    """One end-to-end check of the outcome the fuzzing above guards: exit 2, one line."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**BASE, "learning_rate": [1, {"a": None}], "cutoff_len": "many"}))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len([x for x in err.splitlines() if x.startswith("megatrain: error:")]) == 1


def test_an_empty_required_key_shows_a_value_not_its_empty_default():
    with pytest.raises(MegatrainError, match=r"output_dir has no value: give one \(e\.g\. output_dir: saves/"):
        from_mapping({**BASE, "output_dir": None})


def test_the_projects_sample_data_reads_every_column_it_has(tok, own_cache):
    """examples/data maps the system columns its records carry: no "column ... not read" note."""
    examples_dir = Path(__file__).resolve().parents[1] / "examples" / "data"
    said = []
    cfg = from_mapping({**BASE, "dataset": "alpaca_demo,sharegpt_demo", "dataset_dir": str(examples_dir),
                        "cutoff_len": 128})
    build_examples(cfg, tok, say=said.append)
    assert not any("not read" in s for s in said), said
