"""bf16/fp16 weights with fp32 masters under gradient accumulation, on the library path
(`torch.compile` + a torch optimizer or HostAdamW), when a micro-batch of a new length makes
Dynamo recompile while the step's fp32 gradients sit on the parameters.

Dynamo refuses to wrap a parameter whose .grad has another dtype ("dtype mismatch between tensor
and its gradient"); megatrain's compile callbacks lift those gradients for the length of each
compile (megacompile/compile_start.py). Checked here: the step trains like an eager fp32-master
reference that accumulates the same micro-batches in fp32, the gradients survive the recompile
(the same tensors), a user's clip_grad_norm_ sees them, and a break megatrain causes is reported
as megatrain's bug, not the user's.
"""
from __future__ import annotations

import copy
import threading

import pytest
import torch

import megacompile
from conftest import batch, tiny_model
from megacompile import compile_start
from megacompile.errors import GraphBreakError, InternalError, megatrain_error_in

LR = 1e-3
# per step, the micro-batches (rows >= 2: Dynamo specialises a size of 1; length): every step has
# lengths the step before did not,
# so Dynamo recompiles in the middle of an accumulated step (the first call of a new length)
STEPS = [[(2, 8), (3, 16), (2, 24)], [(3, 12), (2, 20)]]


class _Fp32Accumulating:
    """Eager reference: the low-precision model computes, each micro-batch's gradient is added
    into an fp32 buffer (as megatrain's store does), AdamW updates fp32 masters."""

    def __init__(self, model):
        self.model = model
        self.trained = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.trained]
        self.opt = torch.optim.AdamW(self.masters, lr=LR)
        self.acc = [torch.zeros(p.shape) for p in self.trained]

    def micro(self, **kw) -> float:
        loss = self.model(**kw).loss
        loss.backward()
        for a, p in zip(self.acc, self.trained):
            a += p.grad.float()
            p.grad = None
        return loss.item()

    def step(self, max_norm: float) -> float:
        for m, a in zip(self.masters, self.acc):
            m.grad = a.clone()
            a.zero_()
        norm = torch.nn.utils.clip_grad_norm_(self.masters, max_norm)
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(self.trained, self.masters):
                p.copy_(m)
        return float(norm)


def _inputs(rows: int, length: int, seed: int) -> dict:
    ids, mask, labels = batch(rows, length, seed=seed, pad_left=length // 4)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": False}


def _freeze(model, how: str) -> None:
    if how == "freeze":   # embeddings and the first layer frozen: only some weights have masters
        model.model.embed_tokens.weight.requires_grad_(False)
        for p in model.model.layers[0].parameters():
            p.requires_grad_(False)


@pytest.mark.parametrize("dtype,optimizer,tuning", [
    (torch.bfloat16, "torch", "full"),
    (torch.float16, "host", "full"),
    (torch.bfloat16, "host", "freeze"),
    (torch.float16, "torch", "freeze"),
])
def test_accumulated_low_precision_steps_over_new_lengths_match_fp32_eager(dtype, optimizer, tuning):
    model = tiny_model("llama", layers=2, dtype=dtype)
    _freeze(model, tuning)
    ref = _Fp32Accumulating(copy.deepcopy(model))
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.AdamW(trained, lr=LR) if optimizer == "torch"
           else megacompile.HostAdamW(trained, lr=LR, weight_decay=0.01))
    ours, theirs = [], []
    seed = 0
    for micro in STEPS:
        for k, (rows, length) in enumerate(micro):
            seed += 1
            held = [p.grad for p in trained]
            loss = cmodel(**_inputs(rows, length, seed)).loss
            if k:   # the gradients of the micro-batches so far went through the recompile untouched
                assert all(p.grad is g for p, g in zip(trained, held))
            loss.backward()
            ours.append(loss.item())
            theirs.append(ref.micro(**_inputs(rows, length, seed)))
        for p, a in zip(trained, ref.acc):
            assert p.dtype == dtype and p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad, a, rtol=2e-2, atol=2e-3)
        if optimizer == "torch":   # a user's clipping reads the fp32 gradients on the parameters
            norm = float(torch.nn.utils.clip_grad_norm_(trained, 0.5))
            opt.step()
        else:
            norm = opt.grad_norm()
            opt.step(grad_scale=min(1.0, 0.5 / (norm + 1e-6)))
        assert norm == pytest.approx(ref.step(0.5), rel=2e-2)
        opt.zero_grad(set_to_none=True)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1.6e-2, atol=1e-2)
    # test_parity.py's bf16 bound: an Adam update moves a weight by at most ~lr, and bf16 rounding
    # can flip its sign where the gradient is ~0
    diff = torch.cat([(megacompile.master_weight(p) - m).abs().flatten() for p, m in zip(trained, ref.masters)])
    assert diff.max() <= 2 * len(STEPS) * LR and diff.mean() < 2e-5, (diff.max(), diff.mean())
    # one graph for the first length, one dynamic graph for the rest: lifting costs no recompile
    assert megacompile.stats(cmodel)["compiled_graphs"] == 2
    assert not any(p.grad is not None for p in model.parameters() if not p.requires_grad)


def test_eval_between_micro_batches_keeps_the_accumulated_gradients():
    """A no-grad forward (a new graph) in the middle of an accumulated bf16 step."""
    model = tiny_model("llama", layers=2, dtype=torch.bfloat16)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    cmodel(**_inputs(2, 8, 1)).loss.backward()
    held = {p: p.grad.clone() for p in model.parameters()}
    with torch.no_grad():
        cmodel(**_inputs(2, 16, 2))
    for p, g in held.items():
        assert torch.equal(p.grad, g)


def _lift_nothing(monkeypatch):
    monkeypatch.setattr(compile_start.LiftedGrads, "lift", lambda self, model: 0)


def test_a_break_megatrain_causes_is_reported_as_its_bug(monkeypatch):
    """With the lifting switched off the recompile breaks on the fp32 gradient: megatrain's bug,
    said so with the facts of a report, never advice to rewrite the model."""
    _lift_nothing(monkeypatch)
    model = tiny_model("llama", layers=2, dtype=torch.bfloat16)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "slots": 2})
    cmodel(**_inputs(2, 8, 1)).loss.backward()
    with pytest.raises(Exception) as caught:
        cmodel(**_inputs(2, 16, 2))
    error = megatrain_error_in(caught.value)
    assert isinstance(error, InternalError) and error.exit_code == 1
    text = str(error)
    assert "megatrain bug" in text and "dtype mismatch between tensor and its gradient" in text
    assert "model: LlamaForCausalLM" in text and "'slots': 2" in text and "bfloat16" in text
    assert "replace the op" not in text


def test_a_reset_that_dropped_the_callbacks_says_how_to_reset(monkeypatch):
    """The user's own torch._dynamo.reset() (not megacompile.reset()) dropped the callbacks."""
    model = tiny_model("llama", layers=2, dtype=torch.bfloat16)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    cmodel(**_inputs(2, 8, 1)).loss.backward()
    compile_start.unregister()
    try:
        with pytest.raises(Exception) as caught:
            cmodel(**_inputs(2, 16, 2))
    finally:
        compile_start.register()
    error = megatrain_error_in(caught.value)
    assert type(error) is GraphBreakError and "megacompile.reset()" in str(error)


def test_the_gradient_worker_leaves_the_thread_counts_alone():
    """The gradient worker's own thread count did set torch's process-wide default: the training
    thread shrank to it at its next call into the C++ AdamW kernel and Dynamo recompiled the
    model (its num_threads guard). A thread started after the steps reads the default."""
    from megacompile.runtime.grad_offload import _landing_threads
    before = torch.get_num_threads()
    want = _landing_threads() + 1
    torch.set_num_threads(want)
    try:
        model = tiny_model("llama", layers=2)
        cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "overlap_grads": True})
        opt = megacompile.HostAdamW(model.parameters(), lr=LR)
        for seed in (1, 2, 3):
            cmodel(**_inputs(2, 8, seed)).loss.backward()
            opt.grad_norm()
            opt.step()
            opt.zero_grad()
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert torch.get_num_threads() == want and seen == [want]
        assert megacompile.stats(cmodel)["compiled_graphs"] == 1
    finally:
        torch.set_num_threads(before)


def test_which_breaks_are_megatrain_s_own():
    """A break in megatrain's own files is its bug; one in the model's code is the user's to see;
    a gradient-dtype break is megatrain's only when its callbacks prepared the compile."""
    from pathlib import Path

    from megacompile import capture
    ours = Path(capture.__file__).with_name("attention.py")
    assert "megatrain's own code" in capture._megatrain_made("Unsupported function call", f"{ours}:40", False)
    runtime = Path(capture._our_source_dirs()[-1]) / "executor.py"
    assert capture._megatrain_made("data dependent operator", f"{runtime}:10", False) is not None
    transformers = Path(torch.__file__).parents[1] / "transformers" / "models" / "llama" / "modeling_llama.py"
    assert capture._megatrain_made("Unsupported function call", f"{transformers}:67", True) is None
    assert capture._megatrain_made(capture.GRAD_DTYPE_BREAK, f"{transformers}:67", False) is None   # (not prepared)
    assert "fp32 gradient" in capture._megatrain_made(capture.GRAD_DTYPE_BREAK, f"{transformers}:67", True)
