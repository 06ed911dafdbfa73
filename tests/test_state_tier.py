"""The state tier (runtime/state_tier.py): masters and AdamW moments of the large parameters in
files, updated tile by tile through bounce buffers. The kernel is element-wise, so a run with the
tier equals the all-in-RAM run bit for bit: masters, moments, step counts, transfer copies,
losses and gradient norms, through kept, skipped, accumulated and clipped steps, with the
updates after the backward, under the next forward and during the backward."""
from __future__ import annotations

import errno

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megacompile  # noqa: F401  (registers the backend)
from megacompile.runtime import adamw
from megacompile.runtime.adamw import HostAdamW
from megacompile.runtime.state_tier import StateTier
from megacompile.runtime.store import entry_of, master_weight, set_master
from test_host_adamw import _assert_same_training, _train_with_schedule


def _tier(tmp_path, placement, tile=1024, min_numel=512, drives=2, **kw):
    dirs = [tmp_path / f"drive{i}" for i in range(drives)]
    for d in dirs:
        d.mkdir(exist_ok=True)
    return lambda model: StateTier(list(model.named_parameters()), dirs, placement, tile=tile,
                                   min_numel=min_numel, **kw)


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 9000), tile=st.sampled_from([1024, 2048, 4096]), drives=st.integers(1, 3),
       placement=st.sampled_from(["moments", "all"]), low=st.sampled_from([torch.bfloat16, torch.float32]),
       scale=st.sampled_from([1.0, 0.3]), seed=st.integers(0, 99))
def test_a_tiled_update_equals_the_whole_tensor_update(tmp_path_factory, n, tile, drives, placement, low, scale,
                                                        seed):
    """One update through the tier (any size, tile, number of files) gives the bits of the kernel
    on whole tensors: master, moments, transfer copy, non-finite count."""
    tmp = tmp_path_factory.mktemp("tier")
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(n, generator=g)
    p = torch.nn.Parameter(weights.to(low))
    grad, m0, v0 = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.rand(n, generator=g)
    ext = adamw.kernel()
    # the reference: whole tensors
    master = weights.clone() if low is torch.bfloat16 else p.detach().clone()
    ref_low = torch.empty(n, dtype=low) if low is torch.bfloat16 else None
    m, v = m0.clone(), v0.clone()
    bad = ext.adamw_step(master, grad, m, v, ref_low, 1e-2, 0.9, 0.99, 1e-8, 0.1, 3, scale, 0)
    # the tier (an fp32 parameter keeps its master in RAM: it is its own transfer copy)
    if low is torch.bfloat16:
        set_master(p, weights)   # (the store's entry, with the exact fp32 master)
    dirs = [tmp / f"d{i}" for i in range(drives)]
    for d in dirs:
        d.mkdir()
    tier = StateTier([("w", p)], dirs, placement, tile=tile, min_numel=1)
    try:
        tier.write(p, exp_avg=m0, exp_avg_sq=v0)
        entry = entry_of(p)
        ram = None if tier.holds_master(p) else (p.data if low is torch.float32 else entry.master)
        got = tier.update(p, grad, p.data if low is torch.bfloat16 else None, ram, ext,
                          (1e-2, 0.9, 0.99, 1e-8, 0.1), 3, scale, 0)
        assert (got > 0) == (bad > 0)
        assert torch.equal(tier.read(p, "exp_avg"), m) and torch.equal(tier.read(p, "exp_avg_sq"), v)
        assert torch.equal(master_weight(p).view(-1), master)
        if ref_low is not None:
            assert torch.equal(p.data, ref_low)
    finally:
        tier.close()
    assert not any(tmp.rglob("megatrain-tier-*")), "the files go with the tier"


@pytest.mark.parametrize("placement,dtype,overlap", [("all", torch.bfloat16, False),
                                                     ("all", torch.bfloat16, "forward"),
                                                     ("all", torch.bfloat16, "backward"),
                                                     ("moments", torch.bfloat16, "backward"),
                                                     ("moments", torch.float32, "backward")])
def test_training_with_the_tier_equals_all_in_ram(tmp_path, placement, dtype, overlap):
    """Five steps (kept, skipped, accumulated, clipped, paused): the same losses, norms, masters,
    moments, step counts, transfer copies and speculation counters as without the tier."""
    want = _train_with_schedule(dtype, overlap=overlap)
    got = _train_with_schedule(dtype, overlap=overlap, tier=_tier(tmp_path, placement))
    _assert_same_training(got, want)
    assert got[3] == want[3]


def test_a_slow_drive_changes_nothing_but_the_time(tmp_path):
    """One of two drives answers every request 2 ms late: the updates during the backward wait
    for their reads, the writes land late, the results are the same bits."""
    make_tier = _tier(tmp_path, "all")

    def slow(model):
        tier = make_tier(model)
        tier._engine.inject(1, delay_us=2000)
        return tier
    want = _train_with_schedule(torch.bfloat16, overlap="backward")
    got = _train_with_schedule(torch.bfloat16, overlap="backward", tier=slow)
    _assert_same_training(got, want)


def test_an_moe_model_with_routed_experts_trains_the_same_with_the_tier(tmp_path):
    from test_routed_experts import many_experts

    def make():
        return many_experts("qwen3_moe")
    options = {"routed_experts": True}
    want = _train_with_schedule(torch.float32, overlap="backward", make=make, options=options)
    got = _train_with_schedule(torch.float32, overlap="backward", make=make, options=options,
                               tier=_tier(tmp_path, "moments", min_numel=256))
    _assert_same_training(got, want)
    assert got[3] == want[3]


def test_reads_run_ahead_of_the_updates(tmp_path):
    """Under the next forward the state is read in the order the updates come: most reads are
    already in a bounce buffer when the update wants them."""
    from conftest import batch, tiny_model
    torch._dynamo.reset()
    model = tiny_model("llama", layers=3, dtype=torch.bfloat16)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    tier = _tier(tmp_path, "all")(model)
    opt = HostAdamW(model.parameters(), lr=1e-2, overlap="forward", tier=tier)
    try:
        for step in range(3):
            ids, mask, labels = batch(seed=step)
            cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        tier.synchronize()   # (the last update's writes may still be in flight)
        counters = tier.io_counters()
        tiles = sum(len(q.tiles) for q in tier._params.values())
        assert counters["read_ahead_hits"] >= 2 * tiles and counters["stalls"] <= tiles
        assert counters["bytes_written"] >= 3 * tier.nbytes + tier.nbytes   # the move in, then three steps
    finally:
        tier.close()


def test_an_io_error_stops_the_step_with_the_file_and_errno(tmp_path):
    """A failing write reaches the training thread as an error naming the file, not as a wrong
    weight: synchronize() raises it (overlapped), step() itself otherwise."""
    from conftest import batch, tiny_model
    from megacompile.runtime.tier_io import TierIOError
    torch._dynamo.reset()
    model = tiny_model("llama", layers=2, dtype=torch.bfloat16)
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
    for overlap in (False, "forward"):
        tier = _tier(tmp_path, "all", drives=1)(model)
        opt = HostAdamW(model.parameters(), lr=1e-2, overlap=overlap, tier=tier)
        try:
            tier._engine.inject(0, error=errno.EIO)
            ids, mask, labels = batch()
            cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
            with pytest.raises((TierIOError, RuntimeError)) as info:
                opt.step()
                opt.synchronize()
            error = info.value if isinstance(info.value, TierIOError) else info.value.__cause__
            assert isinstance(error, TierIOError) and error.errno == errno.EIO
            assert str(tier.paths[0]) in str(error)
        finally:
            tier._engine.inject(0)
            tier.close()
            opt.zero_grad()
