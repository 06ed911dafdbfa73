"""Data parallelism without processes: who owns what (runtime/host_arena.ownership, hypothesis),
the data_parallel pass's rewrite, and what plan / inspect --gpus say."""
from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from megacompile.cli import main
from megacompile.errors import ConfigError
from megacompile.hardware import BUILTIN
from megacompile.ir import Step
from megacompile.passes.data_parallel import sharded
from megacompile.plan import plan_model
from megacompile.runtime.host_arena import ArenaRow, ownership
from megacompile.runtime.weight_pool import layout

EXAMPLES = int(os.environ.get("MEGATRAIN_HYPOTHESIS_EXAMPLES", "12"))
DTYPES = [torch.float32, torch.bfloat16, torch.uint8]


def _entry(numel: int, dtype: torch.dtype):
    t = torch.empty(numel, dtype=dtype)
    return SimpleNamespace(source=lambda: t, nbytes=t.numel() * t.element_size(), param=t, shards=None, rank=0)


@settings(max_examples=EXAMPLES * 4, deadline=None, derandomize=True)
@given(rows=st.lists(st.lists(st.tuples(st.integers(1, 5000), st.sampled_from(DTYPES)), min_size=1, max_size=6),
                     min_size=0, max_size=3),
       loose=st.lists(st.tuples(st.integers(1, 5000), st.sampled_from(DTYPES)), max_size=4),
       ranks=st.integers(1, 8))
def test_ownership_tiles_every_weight_once_within_each_rank_slice(rows, loose, ranks):
    """Each weight's elements are owned exactly once over the ranks; a row weight's pieces lie in
    the owning rank's page-aligned slice of the row; a loose weight has one owner, the loads
    balanced greedily (no rank more than the largest loose weight above another)."""
    entries, placed, index = {}, {}, 0
    for members in rows:
        offsets, nbytes = layout([((n,), d) for n, d in members])
        nbytes = -(-nbytes // (ranks * 4096)) * ranks * 4096
        order = tuple(range(index, index + len(members)))
        row = ArenaRow(torch.empty(0), order, dict(zip(order, offsets)), {}, nbytes)
        for i, (n, d) in zip(order, members):
            entries[i] = _entry(n, d)
            placed[i] = row
        index += len(members)
    for n, d in loose:
        entries[index] = _entry(n, d)
        index += 1
    ownership(entries, placed, ranks, 0)
    load = [0] * ranks
    for i, e in entries.items():
        n = e.param.numel()
        assert len(e.shards) == ranks
        covered = sorted(p for shard in e.shards for p in shard)
        assert covered and covered[0][0] == 0 and covered[-1][1] == n
        assert all(a < b for a, b in covered)
        assert all(covered[j][1] == covered[j + 1][0] for j in range(len(covered) - 1))
        if i in placed:
            row, size = placed[i], placed[i].nbytes // ranks
            for r, shard in enumerate(e.shards):
                for a, b in shard:
                    off, item = row.offsets[i], e.param.element_size()
                    assert r * size <= off + a * item and off + b * item <= (r + 1) * size
        else:
            owners = [r for r, shard in enumerate(e.shards) if shard]
            assert len(owners) == 1
            load[owners[0]] += e.nbytes
    if loose:
        assert max(load) - min(load) <= max(entries[i].nbytes for i in entries if i not in placed)


@settings(max_examples=EXAMPLES * 4, deadline=None, derandomize=True)
@given(nbytes=st.integers(0, 10**9), grads=st.integers(0, 10**9), ranks=st.integers(1, 16))
def test_sharded_steps_move_every_byte_once(nbytes, grads, ranks):
    fetch = sharded(Step("prefetch", "h2d", 3, nbytes), ranks)
    if ranks == 1:
        assert fetch == [Step("prefetch", "h2d", 3, nbytes)]
        return
    shard, gather = fetch
    assert (shard.op, gather.op) == ("prefetch_shard", "all_gather") and shard.nbytes == nbytes
    assert 0 <= shard.moved + gather.nbytes - nbytes < ranks   # (rounding: this rank's part up, the rest down)
    rs, off = sharded(Step("grad_offload", "d2h", 5, 0), ranks, grads)
    assert (rs.op, off.op) == ("reduce_scatter", "grad_offload") and 0 <= rs.nbytes + off.nbytes - grads < ranks


def test_plan_gpus_scales_the_node_and_holds_one_copy_of_the_state():
    one = plan_model("smollm2-135m", hardware=BUILTIN["h100"], seq=1024, batch=8, host_ram=2**40)
    four = plan_model("smollm2-135m", hardware=BUILTIN["h100"], seq=1024, batch=8, host_ram=2**40, gpus=4)
    slow = plan_model("smollm2-135m", hardware=dataclasses.replace(BUILTIN["h100"], peer_gbps=1.0), seq=1024, batch=8,
                      host_ram=2**40, gpus=4)
    b1, b4, b4_slow = (next(b for b in p.batches if b.batch == 8) for p in (one, four, slow))
    assert b4_slow.step_seconds > b4.step_seconds + 0.5   # (the collectives are timed: 1 GB/s peer links cost)
    assert 1.0 < four.tokens_per_s(b4) / one.tokens_per_s(b1) <= 4.2   # (each GPU fetches 1/4 of the weights)
    h = four.host
    assert four.shm_bytes == h.masters + h.optimizer_state + h.transfer_copy + h.grads and one.shm_bytes == 0
    assert (h.masters, h.optimizer_state, h.transfer_copy) == (one.host.masters, one.host.optimizer_state,
                                                               one.host.transfer_copy)
    assert h.process_overhead == 4 * one.host.process_overhead
    assert four.to_dict()["gpus"] == 4


def test_inspect_gpus_shows_the_collectives_and_a_run_refuses_plan_ranks(capsys, tmp_path):
    assert main(["inspect", "smollm2-135m", "--layers", "2", "--seq", "64", "--gpus", "2", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ops = [s["op"] for d in report["directions"].values() for s in d["steps"]]
    assert {"prefetch_shard", "all_gather", "reduce_scatter"} <= set(ops) and "prefetch" not in ops
    assert ops.count("reduce_scatter") == ops.count("grad_offload")
    from conftest import tiny_model
    model = tiny_model()
    cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu", "plan_ranks": 2})
    ids = torch.randint(3, 100, (1, 8))
    with pytest.raises(Exception) as e:   # (Dynamo wraps a backend's error)
        cmodel(input_ids=ids, labels=ids, use_cache=False)
    inner = getattr(e.value, "inner_exception", e.value)
    assert isinstance(inner, ConfigError) and "plan_ranks=2 is for planning" in str(inner)


def test_a_shared_memory_too_small_is_refused_with_what_to_change(tmp_path, monkeypatch):
    from megacompile.runtime import node_heap
    monkeypatch.setattr(node_heap.os, "statvfs", lambda _: SimpleNamespace(f_bavail=16, f_frsize=4096))
    why = node_heap._create(str(tmp_path / "heap.bin"), 2**30)
    assert "1.00 GiB" in why and "--shm-size" in why and not (tmp_path / "heap.bin").exists()
    monkeypatch.undo()
    assert node_heap._create(str(tmp_path / "heap.bin"), 8192) is None   # (reserved: the pages exist)
    assert (tmp_path / "heap.bin").stat().st_blocks * 512 >= 8192


def test_resuming_with_another_world_size_keeps_the_global_micro_batch():
    from megacompile.train.checkpoint.resume import changes
    saved = {"per_device_train_batch_size": 2, "seed": 0}
    refused, applied = changes(saved, {"per_device_train_batch_size": 4, "seed": 0}, True, saved_world=2, world=1)
    assert not refused and applied == ["ranks: 2 -> 1 (global micro-batch 4 kept)"]
    refused, _ = changes(saved, {"per_device_train_batch_size": 2, "seed": 0}, True, saved_world=2, world=1)
    assert refused == ["the global micro-batch (per_device_train_batch_size x ranks): 2 x 2 = 4 -> 2 x 1 = 2"]
    refused, _ = changes(saved, {"per_device_train_batch_size": 4, "seed": 0}, True)   # (one process both times)
    assert refused == ["per_device_train_batch_size: 2 -> 4"]
