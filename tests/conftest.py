"""Shared fixtures: tiny HuggingFace models built from config classes (no downloads)."""
from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch._dynamo

import megacompile
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

VOCAB = 128
EXAMPLE_DATA = Path(__file__).resolve().parents[1] / "examples" / "data"


def chatml_tokenizer():
    """A ChatML byte-level BPE tokenizer trained in-process on the example data (offline)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from megacompile.train.data import CHATML
    texts = [line for f in EXAMPLE_DATA.glob("*.json*") for line in f.read_text().splitlines()]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=400, min_frequency=1,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                  bos_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok

def save_tiny_llama(path, tok, max_positions: int = 512) -> Path:
    """Save `tok` and a seeded 2-layer Llama sized to it into `path`, as a Hub checkpoint folder is laid out."""
    from transformers import LlamaForCausalLM

    tok.save_pretrained(path)
    torch.manual_seed(0)
    ids = {k: v for k, v in (("eos_token_id", tok.eos_token_id), ("pad_token_id", tok.pad_token_id),
                             ("bos_token_id", tok.bos_token_id)) if v is not None}
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions, **ids)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return Path(path)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # the README's command runs the suite on 2 pytest-xdist workers, one per core: one thread
    # each (and in the `megatrain train` processes tests start), so they do not oversubscribe
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


def pytest_configure(config):
    """One compile cache (megacompile/disk_cache.py) for the run, empty at its start and shared by
    its xdist workers (they inherit the environment the controller sets here, before it starts
    them): the suite never reads a user's ~/.cache, and a plan one test compiled is read by the
    next. A test that counts compiles gives itself an empty one (`own_compile_cache`)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["MEGATRAIN_COMPILE_CACHE"] = config._megatrain_compile_cache = tempfile.mkdtemp(
            prefix="megatrain-compile-cache-")


def pytest_unconfigure(config):
    if getattr(config, "_megatrain_compile_cache", None):
        shutil.rmtree(config._megatrain_compile_cache, ignore_errors=True)


@pytest.fixture
def own_compile_cache(tmp_path, monkeypatch):
    """This test's own, empty compile cache: what it compiles is not read from another test's."""
    path = tmp_path / "compile-cache"
    monkeypatch.setenv("MEGATRAIN_COMPILE_CACHE", str(path))
    return path


def tiny_config(family: str = "llama", layers: int = 2, hidden: int = 32, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128)
    if family == "llama":
        return LlamaConfig(**{**common, **overrides})
    if family == "qwen3":
        return Qwen3Config(**{**common, "head_dim": hidden // 4, "tie_word_embeddings": True, **overrides})
    raise ValueError(family)


def tiny_model(family: str = "llama", layers: int = 2, dtype=torch.float32, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, layers, **overrides))
    return model.to(dtype).train()


def batch(b: int = 2, s: int = 8, seed: int = 0, pad_left: int = 0):
    """input_ids, attention_mask, labels; the first row gets `pad_left` padded positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    labels = ids.clone()
    if pad_left:
        mask[0, :pad_left] = 0
        labels[0, :pad_left] = -100
    return ids, mask, labels


def run_steps(model, call, opt, steps, shapes, seed: int | None = None):
    """`steps` training steps of `call` (compiled or eager), cycling through (batch, seq, left
    padding) `shapes`; returns the losses. `seed`: torch's generator seeded with seed + step
    before each step (dropout draws the same masks in both runs)."""
    losses = []
    for i in range(steps):
        b, s, pad = shapes[i % len(shapes)]
        ids, mask, labels = batch(b, s, seed=i, pad_left=pad)
        if seed is not None:
            torch.manual_seed(seed + i)
        loss = call(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def assert_step_matches_eager(model, ref, cmodel, pad_left: int = 0) -> None:
    """One forward + backward of `cmodel` (compiled `model`) and of the eager copy `ref`: the same
    loss and the same gradients."""
    ids, mask, labels = batch(2, 8, pad_left=pad_left)
    loss = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    loss.backward()
    ref_loss = ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(autouse=True)
def _triton_interpreter_only_where_asked(request, monkeypatch):
    """The kernel test modules set TRITON_INTERPRET=1 when they are collected (before triton is
    imported), which lasts for the whole session; every other test runs with it unset, so the
    fused ops there take their torch path on the CPU instead of the (very slow) interpreter."""
    if request.node.get_closest_marker("triton_interpreter") is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    """A fresh Dynamo per test; a test's own torch._dynamo.reset() keeps megatrain's compile-start
    callback, as a user re-registers it (reset() drops Dynamo's callbacks: compile_start.py)."""
    reset = torch._dynamo.reset

    def reset_keeping_megatrain():
        reset()
        megacompile.compile_start.register()
    monkeypatch.setattr(torch._dynamo, "reset", reset_keeping_megatrain)
    torch._dynamo.reset()
    yield
    reset()


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """This test's own tokenization cache ($MEGATRAIN_CACHE): tests never read each other's
    tokenized data. (Not autouse: the embedded model's files live under the same root.)"""
    path = tmp_path / "cache"
    monkeypatch.setenv("MEGATRAIN_CACHE", str(path))
    return path


@pytest.fixture
def clone():
    return copy.deepcopy


class Fp32MasterReference:
    """Eager reference for a bf16 model: bf16 compute, fp32 grads, fp32 masters and AdamW state."""

    def __init__(self, model, lr):
        self.model = model
        self.trained = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.trained]
        self.opt = torch.optim.AdamW(self.masters, lr=lr)

    def __call__(self, **kw):
        return self.model(**kw)

    def step(self):
        for p, m in zip(self.trained, self.masters):
            m.grad = p.grad.float()
            p.grad = None
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(self.trained, self.masters):
                p.copy_(m)

    def zero_grad(self):
        pass



@pytest.hookimpl(tryfirst=True)   # (before -m deselects by the marker added here)
def pytest_collection_modifyitems(config, items):
    """tests/ci_budget.py: the tests kept out of CI for time are marked slow. An entry naming no
    collected test of a file collected whole fails the run, so the list cannot rot."""
    from ci_budget import SLOW_IN_CI
    by_id = {item.nodeid.removeprefix("tests/"): item for item in items}
    for t in SLOW_IN_CI:
        if t in by_id:
            by_id[t].add_marker(pytest.mark.slow)
    if any("::" in a for a in config.args):   # (a run of chosen tests: files are not collected whole)
        return
    files = {nodeid.split("::")[0] for nodeid in by_id}
    stale = [t for t in SLOW_IN_CI if t not in by_id and t.split("::")[0] in files]
    if stale:
        raise pytest.UsageError(f"tests/ci_budget.py names tests that do not exist: {stale}")
