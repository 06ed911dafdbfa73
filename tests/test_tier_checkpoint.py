"""Checkpoints of a run with the state tier (megacompile/train/checkpoint/tier.py): the same model
files as without the tier, the tiered moments in their own shards, written and read one shard
(or tensor) at a time; a checkpoint taken with the tier resumes with it off and on, and one taken
without it resumes with it on, masters and moments equal bit for bit to the saved ones and the
next step equal to the uninterrupted run's; damaged moment shards are refused by name."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import megacompile  # noqa: F401  (registers the backend)
from conftest import batch, tiny_model
from megacompile.errors import TrainingError
from megacompile.runtime.adamw import HostAdamW
from megacompile.runtime.state_tier import StateTier
from megacompile.runtime.store import master_weight
from megacompile.train.checkpoint import format as checkpoint
from megacompile.train.model import hf_folder
from megacompile.train.checkpoint import tier as checkpoint_tier
from megacompile.train.checkpoint.format import CheckpointError

TRAINER = {"scheduler": {}, "data": {}, "state": {}}
SMALL_SHARD = "12KB"   # a few tensors per shard: several model and moment shards for the tiny model


def _tier(model, folder: Path, placement: str) -> StateTier:
    dirs = [folder / "drive0", folder / "drive1"]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    # (min_numel 512: the tiny model's matrices are tiered, its norms stay in RAM)
    return StateTier(list(model.named_parameters()), dirs, placement, tile=1024, min_numel=512)


def _fresh(placement: str | None, folder: Path):
    """A tiny bf16 Llama with other weights than the trained one, and its optimizer."""
    model = tiny_model("llama", layers=2, dtype=torch.bfloat16, seed=7)
    tier = _tier(model, folder, placement) if placement else None
    return model, HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.01, tier=tier)


def _step(cmodel, opt, seed: int) -> None:
    ids, mask, labels = batch(seed=seed)
    cmodel(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    opt.step(grad_scale=0.5)
    opt.zero_grad()


def _compiled(model):
    torch._dynamo.reset()
    return torch.compile(model, backend="megatrain", options={"device": "cpu"})


def _snapshot(model, opt) -> tuple[dict, dict]:
    """The fp32 masters by name and the optimizer's full state dict (moments read from a tier)."""
    masters = {n: master_weight(p).clone() for n, p in model.named_parameters()}
    state = opt.state_dict()
    return masters, {k: {n: v.clone() for n, v in s.items()} for k, s in state["state"].items()}


def _assert_equal(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    assert got[0].keys() == want[0].keys()
    for name, t in want[0].items():
        assert torch.equal(got[0][name], t), name
    assert got[1].keys() == want[1].keys()
    for k, s in want[1].items():
        assert got[1][k].keys() == s.keys(), k
        for n, t in s.items():
            assert t.dtype == got[1][k][n].dtype and torch.equal(got[1][k][n], t), (k, n)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two steps of the same run without the tier and with it (placements "all" and "moments"),
    each saved at step 2 (also with small shards); the state at step 2 and after a third step."""
    root = tmp_path_factory.mktemp("tiered")
    out, sizes = {}, {}
    for placement in (None, "all", "moments"):
        key = placement or "off"
        torch._dynamo.reset()
        model = tiny_model("llama", layers=2, dtype=torch.bfloat16)
        cmodel = torch.compile(model, backend="megatrain", options={"device": "cpu"})
        tier = _tier(model, root / f"tier-{key}", placement) if placement else None
        opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.01, tier=tier)
        for step in range(2):
            _step(cmodel, opt, step)
        opt.synchronize()
        out[f"estimate-{key}"] = checkpoint.estimate_bytes(model, opt)
        for folder in (key, f"small-{key}"):
            (root / folder).mkdir()
        out[key] = checkpoint.save(root / key, 2, model, opt, TRAINER)
        with pytest.MonkeyPatch.context() as mp:   # every save_file call: what it holds at once
            mp.setattr(hf_folder, "MAX_SHARD_SIZE", SMALL_SHARD)
            mp.setattr(checkpoint_tier, "MAX_SHARD_SIZE", SMALL_SHARD)
            held = []
            real = checkpoint_tier.save_file

            def counted(tensors, filename, *args, **kw):
                held.append(sum(t.numel() * t.element_size() for t in tensors.values()))
                return real(tensors, filename, *args, **kw)
            mp.setattr(checkpoint_tier, "save_file", counted)
            out[f"small-{key}"] = checkpoint.save(root / f"small-{key}", 2, model, opt, TRAINER)
            sizes[key] = held
        if placement is None:
            out["want"] = _snapshot(model, opt)
            _step(cmodel, opt, 2)
            out["after"] = _snapshot(model, opt)
        else:
            tier.close()
    out["held"] = sizes
    return out


def _files(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.name.startswith("model")}


@pytest.mark.parametrize("placement", ["all", "moments"])
def test_a_tier_checkpoint_holds_the_same_model_files_and_its_moments_in_shards(saved, placement):
    on, off = saved[placement], saved["off"]
    for a, b in ((on, off), (saved[f"small-{placement}"], saved["small-off"])):
        assert _files(a) == _files(b)   # model.safetensors (and shards, index) byte for byte
    assert len([f for f in _files(saved[f"small-{placement}"]) if f.endswith(".safetensors")]) > 1
    sd = torch.load(on / "optimizer.pt", weights_only=True)
    assert sd["moments"] == "optimizer-moments"
    moments = load_file(str(on / "optimizer-moments-00001-of-00001.safetensors"))
    tiered = {int(k.split(".")[0]) for k in moments}
    assert tiered and all(set(sd["state"][i]) == {"step"} for i in tiered)
    assert any(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in sd["state"].values())   # (norms: in RAM)
    want = saved["want"][1]
    for key, t in moments.items():
        index, name = key.split(".")
        assert torch.equal(t, want[int(index)][name]), key
    listed = json.loads((on / "trainer.json").read_text())["files"]
    assert listed == {f.name: f.stat().st_size for f in on.iterdir() if f.name != "trainer.json"}
    assert "optimizer-moments-00001-of-00001.safetensors" in listed
    assert saved[f"estimate-{placement}"] == saved["estimate-off"]
    # small shards: several moment files, and no save_file call held more than a shard (or one tensor)
    small = saved[f"small-{placement}"]
    assert len(list(small.glob("optimizer-moments-*-of-*.safetensors"))) > 1
    limit = max(12_000, max(p.numel() * 4 for p in tiny_model("llama", layers=2).parameters()))
    assert saved["held"][placement] and max(saved["held"][placement]) <= limit
    small_moments = {}
    for f in small.glob("optimizer-moments-*"):
        small_moments.update(load_file(str(f)))
    assert small_moments.keys() == moments.keys()


@pytest.mark.parametrize("source,target,small", [("all", None, False), ("all", "all", True),
                                                 ("all", "moments", False), ("moments", None, True),
                                                 ("moments", "all", False), ("off", "all", False),
                                                 ("off", "moments", True)])
def test_a_checkpoint_resumes_with_the_tier_on_or_off_bit_for_bit(saved, tmp_path, source, target, small):
    """Masters and moments (and step counts) as saved, whichever way the tier was set on either
    side; a checkpoint taken with the tier is read without holding its weights."""
    path = saved[f"small-{source}" if small else source]
    loaded = checkpoint.read(path, stream=True if source == "off" else None)
    if source != "off":
        assert isinstance(loaded.masters, checkpoint_tier.ShardedMasters) and loaded.moments is not None
    model, opt = _fresh(target, tmp_path)
    try:
        assert checkpoint.apply(loaded, model, opt)["step"] == 2
        _assert_equal(_snapshot(model, opt), saved["want"])
    finally:
        if opt.tier is not None:
            opt.tier.close()


@pytest.mark.parametrize("source,target", [("all", None), ("off", "all")])
def test_the_step_after_a_resume_equals_the_uninterrupted_runs(saved, tmp_path, source, target):
    model, opt = _fresh(target, tmp_path)
    try:
        checkpoint.apply(checkpoint.read(saved[source]), model, opt)
        _step(_compiled(model), opt, 2)
        _assert_equal(_snapshot(model, opt), saved["after"])
    finally:
        if opt.tier is not None:
            opt.tier.close()


def _copy(src: Path, tmp_path: Path) -> Path:
    import shutil
    dst = tmp_path / "out" / src.name
    shutil.copytree(src, dst)
    return dst


def _rewrite_sizes(ckpt: Path) -> None:
    """trainer.json's sizes made to match damaged files (so the damage itself is what is found)."""
    trainer = json.loads((ckpt / "trainer.json").read_text())
    trainer["files"] = {f.name: f.stat().st_size for f in ckpt.iterdir() if f.name != "trainer.json"}
    (ckpt / "trainer.json").write_text(json.dumps(trainer))


def test_damaged_moment_shards_are_refused_by_name(saved, tmp_path):
    ckpt = _copy(saved["small-all"], tmp_path)
    shard = sorted(ckpt.glob("optimizer-moments-*-of-*.safetensors"))[1]
    name = shard.name.replace(".", r"\.")
    good = shard.read_bytes()
    shard.write_bytes(good[:-100])   # truncated: its size is not the one trainer.json wrote
    with pytest.raises(CheckpointError, match=f"{name} is damaged.*truncated"):
        checkpoint.read(ckpt)
    _rewrite_sizes(ckpt)   # truncated, sizes matching: the safetensors file itself does not parse
    with pytest.raises(CheckpointError, match=f"{name} is damaged"):
        checkpoint.read(ckpt)
    tensors = {k: v.clone() for k, v in load_file(str(saved["small-all"] / shard.name)).items()}
    key = sorted(tensors)[0]
    tensors[key].view(-1)[3] = float("nan")
    save_file(tensors, str(shard))
    _rewrite_sizes(ckpt)
    with pytest.raises(CheckpointError, match=f"{name}: the optimizer state {key} is not finite"):
        checkpoint.read(ckpt)
    save_file({**tensors, key: tensors[key].nan_to_num(), "7.exp_avg_sq_x": tensors[key]}, str(shard))
    _rewrite_sizes(ckpt)
    with pytest.raises(CheckpointError, match="exp_avg_sq_x.*not a moment"):
        checkpoint.read(ckpt)
    shard.unlink()
    _rewrite_sizes(ckpt)
    with pytest.raises(CheckpointError, match="not a complete checkpoint .*moment shards"):
        checkpoint.read(ckpt)
    shard.write_bytes(good)
    _rewrite_sizes(ckpt)
    assert checkpoint.read(ckpt).step == 2


def test_a_moment_of_another_shape_is_refused_before_anything_is_set(saved, tmp_path):
    ckpt = _copy(saved["all"], tmp_path)
    shard = ckpt / "optimizer-moments-00001-of-00001.safetensors"
    tensors = load_file(str(shard))
    key = next(k for k, v in tensors.items() if v.dim() == 2)
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, str(shard))
    _rewrite_sizes(ckpt)
    model, opt = _fresh("all", tmp_path)
    try:
        before = _snapshot(model, opt)
        with pytest.raises(CheckpointError, match=f"does not fit this run's optimizer \\({key} has shape"):
            checkpoint.apply(checkpoint.read(ckpt), model, opt)
        _assert_equal(_snapshot(model, opt), before)
    finally:
        opt.tier.close()


def test_non_finite_state_or_a_tier_error_writes_no_checkpoint(saved, tmp_path):
    out = _copy(saved["all"], tmp_path).parent
    model, opt = _fresh("all", tmp_path)
    try:
        p = next(p for p in model.parameters() if p in opt.tier)
        index = [q for g in opt.param_groups for q in g["params"]].index(p)
        opt.state[p]["step"] = torch.tensor(1.0)   # (updated once: its moments are saved)
        bad = torch.zeros(p.shape)
        bad.view(-1)[5] = float("inf")
        opt.tier.write(p, exp_avg=bad)
        with pytest.raises(TrainingError, match=f"step 3: the optimizer state {index}.exp_avg is not finite"):
            checkpoint.save(out, 3, model, opt, TRAINER)
        opt.tier.write(p, exp_avg=torch.zeros(p.shape), master=bad)
        with pytest.raises(TrainingError, match="step 3: the weights .* are not finite"):
            checkpoint.save(out, 3, model, opt, TRAINER)
        opt.tier.write(p, master=torch.zeros(p.shape))

        def failing(q, which):   # what tier_io raises for a failed request (an OSError naming the file)
            raise OSError(errno.EIO, "Input/output error", str(opt.tier.paths[0]))
        opt.tier.read = failing
        with pytest.raises(CheckpointError, match="checkpoint-3 is not written: reading the state tier failed "
                                                  r"\(\[Errno 5\] Input/output error: .*drive0"):
            checkpoint.save(out, 3, model, opt, TRAINER)
        del opt.tier.read
        assert [f.name for f in out.iterdir()] == ["checkpoint-2"]   # no tmp left, the previous one intact
        assert checkpoint.read(out / "checkpoint-2").step == 2
    finally:
        opt.tier.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_files_match_a_tier_off_save_for_any_dtype_and_frozen_weights(tmp_path, dtype, monkeypatch):
    """The shard plan from names, shapes and dtypes equals the one from the tensors: fp32 weights
    (their own masters, in RAM), low-precision ones (fp32 masters in the tier), frozen ones
    (saved in their dtype), buffers; small shards so that the plan matters."""
    monkeypatch.setattr(hf_folder, "MAX_SHARD_SIZE", SMALL_SHARD)
    monkeypatch.setattr(checkpoint_tier, "MAX_SHARD_SIZE", SMALL_SHARD)
    model = tiny_model("llama", layers=2, dtype=dtype)
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    tier = _tier(model, tmp_path, "all")
    try:
        for folder, opt in (("on", HostAdamW([p for p in model.parameters() if p.requires_grad], tier=tier)),
                            ("off", HostAdamW([p for p in model.parameters() if p.requires_grad]))):
            (tmp_path / folder).mkdir()
            checkpoint.save(tmp_path / folder, 1, model, opt, TRAINER)
        on, off = _files(tmp_path / "on" / "checkpoint-1"), _files(tmp_path / "off" / "checkpoint-1")
        assert len(on) > 2 and on == off
        masters = checkpoint.read(tmp_path / "on" / "checkpoint-1").masters
        assert isinstance(masters, dict)   # (no tiered moments yet: the tier-off format, read whole)
        assert {t.dtype for t in masters.values()} == ({torch.float32, torch.bfloat16} if dtype == torch.bfloat16
                                                       else {torch.float32})
    finally:
        tier.close()
