"""runtime/lowering.py: segment bodies run eagerly or compiled by Inductor, chosen per distinct
body. Inductor's numerics differ from eager only by reassociation: fp32 losses rel 1e-5 and
gradients within 5e-5 (a tied embedding's two contributions after an AdamW step) over 2 steps.
The Inductor tests compile C++ on the CPU (tens of seconds):
marked slow; the CPU default (eager) and the option's validation run in CI.
"""
from __future__ import annotations

import copy

import pytest
import torch

import megacompile
from conftest import batch, tiny_model
from megacompile.backend import programs_of
from megacompile.errors import ConfigError
from megacompile.runtime import lowering


def _train(model, options, steps=2):
    cmodel = torch.compile(model, backend="megatrain", options=options) if options is not None else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        ids, mask, labels = batch(2, 8, seed=step, pad_left=2 * step)
        loss = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


def _compare(got, want):
    for (loss, grads), (ref_loss, ref_grads) in zip(got, want):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=5e-5, msg=name)


def test_cpu_default_is_eager_and_bad_value_refused():
    model = tiny_model("llama")
    _train(model, {}, steps=1)
    records = programs_of(model)[-1].lowering_records
    assert records["forward"] and all(r["lowering"] == "eager" for d in records.values() for r in d.values())
    assert megacompile.stats(model)["inductor_bodies"] == 0
    with pytest.raises(ConfigError, match="lowering='triton'"):
        megacompile.Options.from_mapping({"lowering": "triton"})


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_inductor_bodies_match_eager(family):
    """Every body, layer bodies included (their attention saves and replays the generator
    state for the recompute), compiles and runs compiled."""
    model = tiny_model(family)
    ref = copy.deepcopy(model)
    _compare(_train(model, {"lowering": "inductor"}), _train(ref, None))
    program = programs_of(model)[-1]
    for direction, records in program.lowering_records.items():
        for name, r in records.items():
            assert r["lowering"] == "inductor", (direction, name, r)
    for runner in program.runners.values():
        assert all(run.fallbacks == 0 for run in runner.runs.values())
    assert megacompile.stats(model)["inductor_bodies"] == len(program.runners["forward"].bodies) + \
        len(program.runners["backward"].bodies)


@pytest.mark.slow
def test_measured_choice_keeps_the_faster_form(monkeypatch):
    """"auto" as on CUDA: both forms timed, the faster kept (forced here by slowing Inductor's)."""
    monkeypatch.setattr(lowering, "resolve", lambda mode, device: "measure")
    timed = lowering._time

    def biased(fn, inputs, device, repeat=5):
        t = timed(fn, inputs, device, repeat)
        return t + 1.0 if isinstance(fn, lowering.CompiledBody) else t

    monkeypatch.setattr(lowering, "_time", biased)
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    _compare(_train(model, {}), _train(ref, None))
    records = programs_of(model)[-1].lowering_records
    for r in (r for d in records.values() for r in d.values()):
        assert r["lowering"] == "eager" and r["inductor_seconds"] > r["eager_seconds"], r


@pytest.mark.slow
def test_a_body_compiled_again_loads_from_inductors_disk_cache(tmp_path, monkeypatch, caplog):
    """A second run of the same model starts warm: a body Inductor compiled before is loaded
    from its FX graph cache on disk (it bypassed the cache without a tracing context before),
    gives the same result, and the compile says each body's progress."""
    import logging

    from torch._dynamo.utils import counters
    from torch.fx.experimental.proxy_tensor import make_fx
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    body = make_fx(lambda x, w: (torch.nn.functional.silu(x @ w) * 2.0,))(torch.randn(8, 16), torch.randn(16, 4))
    inputs = [torch.randn(8, 16), torch.randn(16, 4)]
    counters.clear()
    with caplog.at_level(logging.INFO, logger="megatrain.compile"):
        runs, records = lowering.lower({"seg0": body}, "inductor", torch.device("cpu"))
    assert records["seg0"]["lowering"] == "inductor", records
    assert counters["inductor"]["fxgraph_cache_miss"] == 1 and not counters["inductor"]["fxgraph_cache_bypass"]
    assert "lowering body 1/1 (seg0" in caplog.text and "body 1/1 compiled in" in caplog.text
    again, _ = lowering.lower({"seg0": body}, "inductor", torch.device("cpu"))
    assert counters["inductor"]["fxgraph_cache_hit"] == 1
    torch.testing.assert_close(again["seg0"](list(inputs)), body(*inputs), rtol=1e-5, atol=1e-6)


def test_a_body_frees_an_input_at_its_last_reader():
    """Bodies run boxed: an input the caller no longer holds (the executor drops what the body
    reads last, as the memory plan counts it) dies at its last reader inside the body, not
    when the body returns (a layer's incoming gradient: one [seq, hidden] value less at the
    attention backward's peak)."""
    import weakref

    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import TorchDispatchMode

    body = make_fx(lambda x, w: (torch.sin(x).sum() * w,))(torch.randn(64), torch.randn(4))
    freed: list[str] = []

    class AtMul(TorchDispatchMode):   # what was freed when the body's last op runs
        seen = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mul.Tensor:
                AtMul.seen = list(freed)
            return func(*args, **(kwargs or {}))

    runs, _ = lowering.lower({"b": body}, "eager", torch.device("cpu"))
    args = [torch.randn(64), torch.randn(4)]
    weakref.finalize(args[0], freed.append, "x")
    with AtMul():
        out = runs["b"](args)
    assert args == [] and out[0].shape == (4,)
    assert AtMul.seen == ["x"], AtMul.seen
