"""The host optimizer (runtime/adamw.py): torch AdamW's update, the transfer copy written in the
same pass with torch's rounding, the clipping factor fused in, state interchangeable with
torch's AdamW, and a megatrain-compiled bf16 model trained with it like with torch's AdamW."""
from __future__ import annotations

import copy
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megacompile  # noqa: F401  (registers the backend)
from conftest import batch, tiny_model
from megacompile.runtime import adamw, host_kernels
from megacompile.runtime.adamw import HostAdamW
from megacompile.runtime import store
from megacompile.runtime.store import master_weight

# One float32 rounding step of difference from torch's kernels is allowed: torch's fused and
# foreach AdamW themselves differ by that much (both are checked against each other here).
TOL = dict(rtol=1e-6, atol=1e-6)


def _params(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _run(opt_cls, params, steps, seed, scale=1.0, **kw):
    opt = opt_cls(params, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        if opt_cls is HostAdamW:
            opt.step(grad_scale=scale)
        else:
            for p in params:
                p.grad.mul_(scale)
            opt.step()
    return opt


@settings(max_examples=12, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 70)), min_size=1, max_size=3),
       lr=st.sampled_from([1e-4, 3e-3, 0.1]), wd=st.sampled_from([0.0, 0.01, 0.3]),
       betas=st.sampled_from([(0.9, 0.999), (0.8, 0.95)]), scale=st.sampled_from([1.0, 0.37]),
       seed=st.integers(0, 1000))
def test_update_matches_torch_adamw(shapes, lr, wd, betas, scale, seed):
    kw = dict(lr=lr, weight_decay=wd, betas=betas, eps=1e-8)
    ours = _params(shapes, seed)
    fused, plain = copy.deepcopy(ours), copy.deepcopy(ours)
    _run(HostAdamW, ours, 4, seed, scale, **kw)
    _run(torch.optim.AdamW, fused, 4, seed, scale, fused=True, **kw)
    _run(torch.optim.AdamW, plain, 4, seed, scale, foreach=False, **kw)
    for a, b, c in zip(ours, fused, plain):
        torch.testing.assert_close(a, b, **TOL)
        torch.testing.assert_close(a, c, **TOL)


def test_the_kernel_is_built_here():
    """CI has a compiler: the fused kernel, not the fallback, is what the other tests check."""
    assert adamw.kernel() is not None


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_transfer_copy_rounds_like_torch(low):
    """With lr 0 the weights stay, and the copy written in the pass equals torch's conversion
    bit for bit: every exponent, halfway cases, infinities, NaN, subnormals."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(50_000, generator=g) * torch.exp2(torch.randint(-140, 128, (50_000,), generator=g).float())
    halfway = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -11, 65520.0, -65504.0, 6e-8, 1e-45])
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 3.4e38])
    w = torch.cat([values, halfway, special])
    ext = adamw.kernel()
    out = torch.empty(w.shape, dtype=low)
    ext.adamw_step(w, torch.zeros_like(w), torch.zeros_like(w), torch.zeros_like(w), out, 0.0, 0.9, 0.999, 1e-8,
                   0.0, 1, 1.0, 0)
    ref = w.to(low)
    same = (out.view(torch.int16) == ref.view(torch.int16)) | (out.isnan() & ref.isnan())
    assert bool(same.all()), (w[~same][:5], out[~same][:5], ref[~same][:5])


def test_state_is_interchangeable_with_torch_adamw():
    """A HostAdamW state dict continues in torch's AdamW and back, as if never switched."""
    shapes = [(8, 5), (13,)]
    ours, ref = _params(shapes, 3), _params(shapes, 3)
    a = _run(HostAdamW, ours, 3, 3, lr=1e-2, weight_decay=0.1)
    b = _run(torch.optim.AdamW, ref, 3, 3, lr=1e-2, weight_decay=0.1)
    assert set(a.state_dict()["state"][0]) == set(b.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    switched = torch.optim.AdamW(ours, lr=1e-2, weight_decay=0.1)
    switched.load_state_dict(a.state_dict())
    back = HostAdamW(ref, lr=1e-2, weight_decay=0.1)
    back.load_state_dict(b.state_dict())
    g = torch.Generator().manual_seed(9)
    for _ in range(2):
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        switched.step()
        back.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, **TOL)


def test_fallback_without_the_kernel(monkeypatch):
    """No compiler: torch's fused AdamW and a copy give the same update."""
    shapes = [(6, 7), (3,)]
    fast, slow = _params(shapes, 5), _params(shapes, 5)
    _run(HostAdamW, fast, 3, 5, 0.5, lr=1e-2, weight_decay=0.1)
    monkeypatch.setattr(host_kernels, "_KERNEL", [None])
    _run(HostAdamW, slow, 3, 5, 0.5, lr=1e-2, weight_decay=0.1)
    for p, q in zip(fast, slow):
        torch.testing.assert_close(p, q, **TOL)


def test_compiled_bf16_model_trains_like_with_torch_adamw():
    """A megatrain-compiled bf16 model, gradients clipped by 0.5: HostAdamW (factor fused in)
    updates the fp32 masters as torch's AdamW does through the store's hooks (grads scaled
    first), and the bf16 transfer copies it writes are the masters rounded."""
    runs = {}
    for name, opt_cls in (("host", HostAdamW), ("torch", torch.optim.AdamW)):
        torch._dynamo.reset()
        model = tiny_model("llama", layers=2, dtype=torch.bfloat16)
        cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
        opt = opt_cls(model.parameters(), lr=1e-3, weight_decay=0.01)
        losses = []
        for step in range(3):
            ids, mask, labels = batch(seed=step)
            loss = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            loss.backward()
            if name == "host":
                opt.step(grad_scale=0.5)
            else:
                for p in model.parameters():
                    p.grad.mul_(0.5)
                opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[name] = (model, losses)
    (host, host_losses), (ref, ref_losses) = runs["host"], runs["torch"]
    assert host_losses[0] == ref_losses[0]
    assert host_losses == pytest.approx(ref_losses, rel=1e-3)
    for p, q in zip(host.parameters(), ref.parameters()):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.data, master_weight(p).to(torch.bfloat16))   # transfer copy = rounded master
        torch.testing.assert_close(master_weight(p), master_weight(q), rtol=1e-4, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 200_000), scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e18]), seed=st.integers(0, 99))
def test_squared_norm_equals_torch_and_ignores_the_thread_count(n, scale, seed):
    """The gradient norm's kernel: sum of squares in double, as torch in float64, whatever the
    threads (fixed chunks added in order); no overflow where fp32 squares would (1e18**2)."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    want = float(torch.linalg.vector_norm(g.double(), 2.0)) ** 2
    got = adamw.squared_norm(g)
    assert got == pytest.approx(want, rel=1e-12)
    assert {adamw.squared_norm(g, threads) for threads in (1, 2, 3)} == {got}


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 100_000), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       add=st.booleans(), threads=st.sampled_from([0, 1, 3]), seed=st.integers(0, 99))
def test_a_landing_writes_what_torch_writes_and_takes_the_norm_in_the_same_pass(n, dtype, add, threads, seed):
    """host_kernels.land: dst += src (or dst = src) bit for bit as torch's add_/copy_ (a bf16 or
    fp16 gradient widened exactly), returning the squared norm of the new dst exactly as
    squared_norm computes it (the same chunks and lanes), and moving dst's version as torch would."""
    g = torch.Generator().manual_seed(seed)
    src, dst = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g)
    want = dst.clone().add_(src) if add else src.float()
    version = dst._version
    squares = host_kernels.land(dst, src, add, threads)
    assert torch.equal(dst, want)
    assert squares == adamw.squared_norm(dst)
    assert dst._version > version


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_clipping_norm_is_the_one_taken_as_gradients_landed(dtype, monkeypatch):
    """After a megatrain backward (gradient accumulation: two micro-batches), each gradient's
    squared norm was taken as it landed on the host, so grad_norm() reads no gradient again; it
    equals torch's norm of the gradients. A user's in-place change of a gradient moves its
    version: that gradient's norm is then taken again (never a stale one)."""
    torch._dynamo.reset()
    model = tiny_model("llama", layers=2, dtype=dtype)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    for step in range(2):
        ids, mask, labels = batch(seed=step)
        cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    opt = HostAdamW(model.parameters(), lr=1e-3)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    want = float(torch.nn.utils.get_total_norm([g.double() for g in grads]))
    landed = sum(store.entry_of(p).landed_squares(p.grad) is not None for p in model.parameters() if p.grad is not None)
    assert landed == len(grads)   # (the second micro-batch's landing adds: its pass took the norm)
    read = []
    real = host_kernels.squared_norm
    monkeypatch.setattr(adamw, "squared_norm", lambda t, threads=0: read.append(t) or real(t, threads))
    assert opt.grad_norm() == pytest.approx(want, rel=1e-12)
    assert len(read) == len(grads) - landed
    p = next(p for p in model.parameters() if p.grad is not None)
    p.grad.mul_(2.0)
    read.clear()
    norm = opt.grad_norm()
    assert any(t is p.grad for t in read)
    want = float(torch.nn.utils.get_total_norm([g.double() for g in grads]))
    assert norm == pytest.approx(want, rel=1e-12)


def test_spare_gradients_are_reused_only_when_nobody_holds_them():
    """HostAdamW.zero_grad hands a bf16 model's fp32 gradients back to the store and the next
    backward writes into them (no new 4 bytes/parameter per step); a gradient the user still
    holds, or a view of it, is never written: that weight gets a new one. The losses and
    weights equal a run where every gradient is new."""
    def train(keep: bool, reuse: bool):
        torch._dynamo.reset()
        model = tiny_model("llama", layers=2, dtype=torch.bfloat16)
        cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
        opt = HostAdamW(model.parameters(), lr=1e-3)
        params = list(model.parameters())
        held, saved, same, losses, before = {}, {}, [], [], []
        for step in range(3):
            ids, mask, labels = batch(seed=step)
            loss = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            loss.backward()
            losses.append(loss.item())
            if step == 1 and keep:   # the user keeps one gradient and a view of another
                held = {0: params[0].grad, 1: params[1].grad.view(-1)}
                saved = {k: v.clone() for k, v in held.items()}
            if step == 2:
                same = [p.grad is old() for p, old in zip(params, before)]
            before[:] = [weakref.ref(p.grad) for p in params]   # (an address may be reused by malloc: not a test)
            opt.step()
            if not reuse:
                for p in params:
                    p.grad = None
            opt.zero_grad()
        if keep:   # what the user held is unchanged by the next backward
            assert all(torch.equal(held[k], saved[k]) for k in held)
        return losses, [master_weight(p).clone() for p in params], same

    fresh = train(keep=False, reuse=False)
    reused = train(keep=False, reuse=True)
    kept = train(keep=True, reuse=True)
    assert fresh[2] and not any(fresh[2])   # nothing handed back: every gradient new
    assert all(reused[2])                    # every gradient written into last step's
    assert kept[2][0] is False and kept[2][1] is False and all(kept[2][2:])
    for run in (reused, kept):
        assert run[0] == fresh[0]
        assert all(torch.equal(a, b) for a, b in zip(run[1], fresh[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overlapped_step_equals_the_step_after_the_backward(dtype, monkeypatch):
    """overlap=True: the update runs on a host thread while the next step's forward starts,
    each weight fetch waiting for that weight's update. With the thread slowed down (so the
    forward does catch up with it), losses and weights equal the non-overlapped run's bit for
    bit, clipping factor included."""
    import time
    slow_calls = []
    real = adamw.kernel()

    class Slow:
        def adamw_step(self, *args):
            slow_calls.append(1)
            time.sleep(0.002)
            return real.adamw_step(*args)

        def __getattr__(self, name):   # (the kernel module's other functions, as they are)
            return getattr(real, name)

    runs = {}
    for overlap in (False, True):
        if overlap:
            monkeypatch.setattr(host_kernels, "_KERNEL", [Slow()])
        torch._dynamo.reset()
        model = tiny_model("llama", layers=3, dtype=dtype)
        cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
        opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.01, overlap=overlap)
        losses = []
        for step in range(4):
            ids, mask, labels = batch(seed=step)
            loss = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            loss.backward()
            opt.step(grad_scale=0.7)
            opt.zero_grad()
            losses.append(loss.item())
        opt.synchronize()
        runs[overlap] = (losses, {k: master_weight(p).clone() for k, p in model.named_parameters()})
    assert slow_calls
    assert runs[True][0] == runs[False][0]
    for k, w in runs[False][1].items():
        assert torch.equal(w, runs[True][1][k]), k


def test_a_store_entry_lives_on_its_parameter():
    """The entry of a weight lives on the parameter (no registry keyed by id(), which Python
    reuses: a collected model once took a newer model's entries with it); a copy or a pickle
    of the parameter carries none."""
    import copy
    import gc
    import io
    import weakref

    from megacompile.runtime import store
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    entry = store.entry_for(p, "w", False)
    assert store.entry_of(p) is entry and store.entry_for(p, "w", False) is entry and entry.master is not None
    assert store.entry_of(copy.deepcopy(p)) is None
    buf = io.BytesIO()
    torch.save(torch.nn.ParameterList([p]), buf)
    buf.seek(0)
    assert store.entry_of(torch.load(buf, weights_only=False)[0]) is None
    gone = weakref.ref(entry)
    del p, entry
    gc.collect()
    assert gone() is None   # dropped with its parameter
    assert store.entry_of(torch.nn.Parameter(torch.zeros(3))) is None


# overlap="backward": speculative updates during the backward, exact by rollback -----------------
def _train_with_schedule(dtype, overlap, rollback_bytes=None, scale_some_grads=False, make=None, options=None,
                         tier=None):
    """Five steps through every outcome of a speculative step: kept (no clipping), skipped
    (rolled back), kept after gradient accumulation (speculating only in the last backward),
    clipped (rolled back, redone with the factor), then not speculated (paused after a clipped
    step). Returns losses, norms, masters, moments, transfer copies, counters. `tier`: a
    function of the model making the optimizer's state tier (tests/test_state_tier.py)."""
    torch._dynamo.reset()
    model = make() if make is not None else tiny_model("llama", layers=3, dtype=dtype)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", **(options or {})})
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.01, overlap=overlap, rollback_bytes=rollback_bytes,
                    tier=tier(model) if tier is not None else None)
    losses, norms = [], []
    for step, (max_norm, accumulation, skip) in enumerate([(1e9, 1, False), (1e9, 1, True), (1e9, 2, False),
                                                           (1e-3, 1, False), (1e9, 1, False)]):
        for micro in range(accumulation):
            ids, mask, labels = batch(seed=10 * step + micro)
            loss = cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            if micro == accumulation - 1:
                opt.arm()
            loss.backward()
            losses.append(loss.item())
        if scale_some_grads:   # user code changing gradients between the backward and the step
            for p in list(model.parameters())[::3]:
                p.grad.mul_(0.5)
        norm = opt.grad_norm()
        norms.append(norm)
        if skip:
            opt.discard()
        else:
            opt.step(grad_scale=min(1.0, max_norm / (norm + 1e-6)))
        opt.zero_grad()
    opt.synchronize()
    moments = opt.state_dict()["state"]   # (a tier's moments read back from its files)
    state = {k: (master_weight(p).clone(), moments[i]["exp_avg"].clone(), moments[i]["exp_avg_sq"].clone(),
                 float(moments[i]["step"]), p.data.clone()) for i, (k, p) in enumerate(model.named_parameters())}
    if opt.tier is not None:
        opt.tier.close()
    return losses, norms, state, dict(opt.counters)


def _assert_same_training(got, want):
    assert got[0] == want[0]   # losses
    assert got[1] == want[1]   # gradient norms
    for k, values in want[2].items():
        for a, b in zip(got[2][k], values):
            assert (a == b) if isinstance(a, float) else torch.equal(a, b), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_updates_during_the_backward_equal_the_step_after_it(dtype, monkeypatch):
    """overlap="backward": each layer's update starts as its gradient lands, with the kernel
    slowed so that the backward really runs ahead of it. Kept when the clipping factor is 1,
    rolled back and redone when clipped, rolled back when the step is skipped; the masters,
    moments, step counts and transfer copies equal the plain step's bit for bit."""
    want = _train_with_schedule(dtype, overlap=False)
    import threading
    import time
    real = adamw.kernel()
    threads = set()

    class Slow:
        def adamw_step(self, *args):
            threads.add(threading.current_thread().name)
            time.sleep(0.002)
            return real.adamw_step(*args)

        def __getattr__(self, name):   # (the kernel module's other functions, as they are)
            return getattr(real, name)

    monkeypatch.setattr(host_kernels, "_KERNEL", [Slow()])
    got = _train_with_schedule(dtype, overlap="backward")
    _assert_same_training(got, want)
    counters = got[3]
    layers = 3 * 9   # a tiny Llama layer's 9 weights
    assert counters["speculated"] >= 4 * layers   # every step speculated its layers
    assert counters["kept"] >= 2 * layers         # steps 1 and 3
    assert counters["rolled_back"] >= 2 * layers  # skipped step 2, clipped step 4
    assert counters["paused"] == 1                # step 5, after the clipped one
    assert any(name.startswith("megatrain-optimizer") for name in threads)


def test_backward_updates_respect_the_rollback_budget_and_a_changed_gradient():
    """With a rollback budget for a third of the weights, the others wait for step(); gradients
    changed in place after the backward make step() redo the updates that read them."""
    want = _train_with_schedule(torch.float32, overlap=False)
    got = _train_with_schedule(torch.float32, overlap="backward", rollback_bytes=12 * 12000)
    _assert_same_training(got, want)
    assert got[3]["over_budget"] > 0 and got[3]["speculated"] > 0

    want = _train_with_schedule(torch.float32, overlap=False, scale_some_grads=True)
    got = _train_with_schedule(torch.float32, overlap="backward", scale_some_grads=True)
    _assert_same_training(got, want)
    assert got[3]["rolled_back"] > 2 * 27   # the skipped and clipped steps, and the scaled gradients


@pytest.mark.parametrize("family", ["qwen3-tied", "qwen3_moe-routed"])
def test_backward_updates_with_tied_weights_and_routed_experts(family):
    """A tied embedding is read by the first and the last segment (its gradient is complete
    only at the end of the backward); routed experts land only their routed rows. Both train
    exactly as with the plain step, every weight updated during the backward."""
    if family == "qwen3-tied":
        def make():
            return tiny_model("qwen3", layers=3)
        options = {}
    else:
        from test_routed_experts import many_experts

        def make():
            return many_experts("qwen3_moe")
        options = {"routed_experts": True}
    want = _train_with_schedule(torch.float32, overlap=False, make=make, options=options)
    got = _train_with_schedule(torch.float32, overlap="backward", make=make, options=options)
    _assert_same_training(got, want)
    counters = got[3]
    # every weight updated during each armed backward (none before its last contribution: that
    # would be rolled back in the kept steps too), kept in steps 1 and 3, undone in 2 and 4
    params = sum(1 for _ in make().parameters())
    assert counters["speculated"] == 4 * params, counters
    assert counters["kept"] == counters["rolled_back"] == 2 * params, counters


def test_a_forward_between_the_armed_backward_and_the_step_is_refused_for_its_own_model_only():
    """Between arm()'s backward and the step, a forward of the model would read updated weights:
    refused. The optimizer subscribes to the gradient paths of the programs that read its
    weights (runtime/grad_offload.py, one per program), not to the process: another model
    trains meanwhile, and after the step nothing listens any more."""
    ours, other = tiny_model("llama", layers=2), tiny_model("qwen3", layers=2)
    c_ours = torch.compile(ours, backend="megatrain", options={"device": "cpu"})
    c_other = torch.compile(other, backend="megatrain", options={"device": "cpu"})
    opt = HostAdamW(ours.parameters(), lr=1e-2, overlap="backward")
    ids, mask, labels = batch()
    loss = c_ours(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    opt.arm()
    loss.backward()
    c_other(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()   # not ours
    with pytest.raises(RuntimeError, match="arm\\(\\) right before the step's last backward"):
        c_ours(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    assert opt.counters["speculated"] > 0
    subscribed = set(opt._offloaders)
    assert subscribed and all(o.listeners for o in subscribed)
    opt.step()
    assert not any(o.listeners for o in subscribed)   # unsubscribed at the step
    c_ours(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()   # allowed again


def test_overlap_mode_is_checked():
    with pytest.raises(ValueError, match="overlap="):
        HostAdamW([torch.nn.Parameter(torch.zeros(2))], overlap="sometimes")
