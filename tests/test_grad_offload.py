"""runtime/grad_offload.py: gradients land in `param.grad` on a host thread while the backward
goes on, and training is bit-identical to the synchronous path (`overlap_grads=False`).

The worker is slowed down so that, without the drain at the end of the backward, the gradients
would be missing or partial when `backward()` returns: the comparison then fails.
"""
from __future__ import annotations

import copy
import functools
import threading
import time

import pytest
import torch

import megacompile
from conftest import batch, tiny_model
from megacompile.runtime import grad_offload


@pytest.fixture
def slow_worker(monkeypatch):
    """Each landing waits 20 ms first, and records that it ran off the main thread."""
    threads = []
    land = grad_offload._land

    def slow(event, staged, completed):
        time.sleep(0.02)
        threads.append(threading.current_thread() is threading.main_thread())
        land(event, staged, completed)

    monkeypatch.setattr(grad_offload, "_land", slow)
    return threads


def _train(model, overlap: bool, steps: int = 2, accumulation: int = 2):
    cmodel = torch.compile(model, backend="megatrain", options={"overlap_grads": overlap})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        for micro in range(accumulation):
            ids, mask, labels = batch(2, 8, seed=10 * step + micro, pad_left=micro)
            loss = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            loss.backward()
            losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family,dtype,slabs", [("llama", torch.bfloat16, False), ("qwen3", torch.float32, False),
                                                ("llama", torch.bfloat16, True), ("qwen3", torch.float32, True)])
def test_overlapped_offload_is_bit_identical(family, dtype, slabs, slow_worker, monkeypatch):
    """slabs: the gradients staged through the per-kind pinned slab rings as on CUDA (here an
    extra copy): with the slowed worker, a slab is handed out again only after its landing."""
    staged = functools.partial(grad_offload.GradOffloader, slabs=slabs)   # (on the CPU: an extra copy)
    monkeypatch.setattr(megacompile.backend, "GradOffloader", staged)
    model = tiny_model(family, dtype=dtype, layers=4)
    ref = copy.deepcopy(model)
    got = _train(model, overlap=True)
    slab_bytes = megacompile.stats(model)["grad_slab_bytes"]
    assert (slab_bytes > 0) == slabs
    if slabs:   # a ring of 3 slabs per kind, reused: at most 3 gradients' worth of each weight (4
        # steps x 4 layers of fresh staging would be over 16 layers' worth)
        params = list(model.parameters())
        assert slab_bytes <= 3 * sum(p.numel() * p.element_size() + 256 for p in params)
    assert slow_worker and not any(slow_worker), "gradients were not added on the worker thread"
    calls = len(slow_worker)
    want = _train(ref, overlap=False)
    assert len(slow_worker) == calls, "overlap_grads=False still used the worker"
    for a, b in zip(got[0], want[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for ga, gb in zip(got[1], want[1]):
        for name in gb:
            assert ga[name].dtype == torch.float32
            torch.testing.assert_close(ga[name], gb[name], rtol=0, atol=0, msg=name)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=0, atol=0, msg=name)


def test_worker_error_surfaces_in_backward(monkeypatch):
    model = tiny_model("llama")
    cmodel = torch.compile(model, backend="megatrain")
    ids, mask, labels = batch(2, 8)

    def broken(event, staged, completed):
        raise RuntimeError("host gradient buffer lost")

    monkeypatch.setattr(grad_offload, "_land", broken)
    with pytest.raises(RuntimeError, match="host gradient buffer lost"):
        cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
