"""The planner's side of the NVMe state tier (issue 18): SSD profiles, placement, RAM vs NVMe
bytes, the exposed SSD time, `megatrain plan --nvme` and the train config's nvme keys."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import megacompile.hardware
import megacompile.ssd
import megacompile.plan
from conftest import tiny_config
from megacompile.cli import main
from megacompile.errors import ConfigError
from megacompile.hardware import BUILTIN
from megacompile.ssd import SSD, load_ssd
from megacompile.inspect import build_meta_model
from megacompile.plan import host_bytes, plan_model, tier_placement
from megacompile.tier_plan import TIER_POOL_BYTES, min_numel, ssd_seconds
from megacompile.train.hparams.config import from_mapping
from megacompile.train.preflight import PreflightError, choose_tier, preflight

GiB = 2**30


@pytest.fixture
def wide_json(tmp_path):
    """A 2-layer llama (built on the meta device only) whose 84M-parameter projections are tiered
    (more state than the tier's RAM pool) and whose norms are below MIN_NUMEL."""
    path = tmp_path / "config.json"
    tiny_config("llama", layers=2, hidden=2048).to_json_file(path)
    return path


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatrain: error: "), err
    return err[0]


# -- the targets, planned on the big presets ------------------------------------------------

def test_gpt_oss_120b_on_1_5t_needs_the_tier_and_fits_with_gen5x4(capsys):
    assert main(["plan", "gpt-oss-120b", "--gpu", "h200", "--host-ram", "1.5T"]) == 3
    assert "--nvme PROFILE" in error_line(capsys)
    assert main(["plan", "gpt-oss-120b", "--gpu", "h200", "--host-ram", "1.5T", "--nvme", "gen5x4",
                 "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    host, nvme, n = plan["host"], plan["nvme"], plan["model"]["parameters"]
    assert plan["fits"] and host["placement"] == "moments" == nvme["placement"]   # the least that fits
    assert host["ssd_masters"] == 0 and 7.9 < host["ssd_optimizer_state"] / n <= 8
    assert host["total"] <= 1.5e12 and 9.9 < host["total"] / n < 10.1
    assert nvme["disk_needed"] == host["ssd_total"] == 2 * host["ssd_optimizer_state"]
    assert nvme["read_per_step"] == nvme["written_per_step"] == host["ssd_optimizer_state"]
    assert nvme["seconds_per_step"] == pytest.approx(host["ssd_optimizer_state"] * (1 / 27e9 + 1 / 11e9))
    assert nvme["tb_written_per_1000_steps"] == pytest.approx(host["ssd_optimizer_state"] * 1000 / 1e12)
    assert nvme["capacity"] == 0 and nvme["profile"]["name"] == "gen5x4"   # a plan-only profile: not checked
    for b in plan["batches"]:   # every batch carries the SSD time and the step includes what is exposed
        assert b["ssd_seconds"] == pytest.approx(nvme["seconds_per_step"])
        assert 0 <= b["ssd_exposed_seconds"] <= b["ssd_seconds"]
        assert b["step_seconds"] == pytest.approx(b["forward_seconds"] + b["backward_seconds"]
                                                  + b["optimizer_seconds"] + b["ssd_exposed_seconds"])


def test_llama_3_70b_fits_512g_with_masters_and_moments_on_gen5x4(capsys):
    assert main(["plan", "llama-3-70b", "--gpu", "h200", "--host-ram", "512G"]) == 3
    capsys.readouterr()
    assert main(["plan", "llama-3-70b", "--gpu", "h200", "--host-ram", "512G", "--nvme", "gen5x4"]) == 0
    text = capsys.readouterr().out
    assert "NVMe placement all" in text and "ssd exposed" in text and "on NVMe" in text
    assert "TB written per 1000 steps" in text and "disk needed" in text


def test_a_175b_dense_model_fits_1tib_with_gen5x4():
    hw, ssd = BUILTIN["h200"], load_ssd("gen5x4")
    plan = plan_model("dense-175b", hardware=hw, host_ram=2**40, ssd=ssd, max_batch=4)
    assert 174e9 < plan.model["parameters"] < 177e9 and plan.fits and plan.host.placement == "all"
    assert 5.9 < plan.host.total / plan.model["parameters"] < 6.1
    # 6 B/param is 1.05e12: a decimal terabyte is about 50 GB short, and the plan says so
    short = plan_model("dense-175b", hardware=hw, host_ram=10**12, ssd=ssd, max_batch=4)
    assert not short.fits and "host RAM" in short.problems[0] and "--nvme" not in short.problems[0]


# -- placement and host bytes ------------------------------------------------------------------------

def _meta(path, dtype=torch.bfloat16):
    return build_meta_model(str(path), None, dtype)[0]


def test_host_bytes_split_ram_and_nvme_and_add_up_to_all_in_ram(wide_json):
    model = _meta(wide_json)
    ram = host_bytes(model, "cuda")
    tiered = sum(p.numel() for p in model.parameters() if p.numel() >= min_numel())
    assert 0 < tiered < sum(p.numel() for p in model.parameters())   # the small ones stay in RAM
    for placement, master_bytes in (("moments", 0), ("all", 4 * tiered)):
        h = host_bytes(model, "cuda", placement)
        assert h.placement == placement and h.tier_pool == min(TIER_POOL_BYTES, h.ssd_masters + h.ssd_optimizer_state)
        assert (h.ssd_masters, h.ssd_optimizer_state) == (master_bytes, 8 * tiered)
        assert h.masters + h.ssd_masters == ram.masters and h.optimizer_state + h.ssd_optimizer_state \
            == ram.optimizer_state
        assert (h.transfer_copy, h.grads, h.pinned) == (ram.transfer_copy, ram.grads, ram.pinned)
        assert h.total + h.ssd_masters + h.ssd_optimizer_state - h.tier_pool == ram.total
        assert h.ssd_total == 2 * (h.ssd_masters + h.ssd_optimizer_state)
    # an fp32 model's parameter is its own transfer copy: "all" leaves it in RAM, as "moments" does
    fp32 = _meta(wide_json, torch.float32)
    assert dataclasses.replace(host_bytes(fp32, "cuda", "all"), placement="moments") \
        == host_bytes(fp32, "cuda", "moments")
    with pytest.raises(ConfigError, match="placement='most'"):
        host_bytes(model, "cuda", "most")


def test_placement_is_the_least_that_fits_the_host_ram(wide_json):
    model = _meta(wide_json)
    need = {p: host_bytes(model, "cuda", p).total for p in ("none", "moments", "all")}
    assert need["none"] > need["moments"] > need["all"]
    ssd = load_ssd("gen4x4")
    assert tier_placement(model, "cuda", need["none"], ssd) == "none"
    assert tier_placement(model, "cuda", need["none"] - 1, ssd) == "moments"
    assert tier_placement(model, "cuda", need["moments"] - 1, ssd) == "all"
    assert tier_placement(model, "cuda", need["all"] - 1, ssd) == "all"   # the fit check then refuses it
    assert tier_placement(model, "cuda", 1, None) == "none"                # no profile, no tier
    assert tier_placement(model, "cuda", need["none"], ssd, "all") == "all"  # asked for: honoured


# -- exposed SSD time --------------------------------------------------------------------------------

def test_exposed_time_closed_form_by_hand():
    # R = W = 100 GB at 10 / 5 GB/s: t_r 10 s, t_w 20 s; 10 GB read ahead (1 s of reads)
    assert ssd_seconds(100 * 10**9, 10.0, 5.0, 10 * 10**9, 2.0, 3.0, 4) == (30.0, 10.0)   # throughput: 30 - 4 x 5
    assert ssd_seconds(100 * 10**9, 10.0, 5.0, 10 * 10**9, 2.0, 3.0, 8) == (30.0, 4.0)    # read: 10 - 1 - 5
    assert ssd_seconds(100 * 10**9, 10.0, 5.0, 10 * 10**9, 5.0, 5.0, 3) == (30.0, 0.0)    # hidden
    assert ssd_seconds(0, 10.0, 5.0, 0, 1.0, 1.0, 1) == (0.0, 0.0)


def test_the_plan_adds_the_exposed_time_of_each_batch_and_accumulation(wide_json, tmp_path, capsys):
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"name": "slow", "read_gbps": 0.002, "write_gbps": 0.001}))
    ssd = load_ssd(slow)
    for accum in (1, 3):
        plan = plan_model(str(wide_json), hardware=BUILTIN["h100"], host_ram=2**40, seq=64, ssd=ssd,
                          placement="all", accum=accum, max_batch=4)
        tiered = plan.host.ssd_masters + plan.host.ssd_optimizer_state
        assert plan.fits and plan.accum == accum and tiered > 0
        for b in plan.batches:
            io, exposed = ssd_seconds(tiered, 0.002, 0.001, TIER_POOL_BYTES // 2, b.forward_seconds,
                                      b.backward_seconds, accum)
            assert (b.accum, b.ssd_seconds, b.ssd_exposed_seconds) == (accum, io, exposed) and exposed > 0
            assert b.step_seconds == pytest.approx(accum * (b.forward_seconds + b.backward_seconds)
                                                   + b.optimizer_seconds + exposed)
            assert plan.tokens_per_s(b) == pytest.approx(b.batch * accum * 64 / b.step_seconds)
    assert main(["plan", str(wide_json), "--gpu", "h100", "--host-ram", "1T", "--seq", "64", "--nvme", str(slow),
                 "--nvme-placement", "moments", "--accum", "3"]) == 0
    text = capsys.readouterr().out
    assert "ssd exposed" in text and "step = 3 x (forward + backward)" in text and "x accum 3" in text


# -- profiles and the CLI's errors -------------------------------------------------------------------

def test_profiles_builtin_json_and_measured(tmp_path, monkeypatch):
    assert load_ssd("gen5x4") == SSD("gen5x4", 27.0, 11.0) and load_ssd("gen4x4").write_gbps == 5.0
    assert load_ssd("gen4x1").read_gbps == 2.5 and load_ssd("gen5x1").write_gbps == 2.75   # a quarter
    path = tmp_path / "raid.json"
    path.write_text(json.dumps({"name": "raid", "read_gbps": 12, "write_gbps": 6.5, "paths": [str(tmp_path)],
                                "capacity_gib": 3500}))
    assert load_ssd(path) == SSD("raid", 12.0, 6.5, (str(tmp_path),), 3500.0)
    calls = []

    def measure_ssd(paths, bytes_per_path):   # (the I/O engine, stubbed: its own tests measure)
        calls.append((paths, bytes_per_path))
        return 3.0, 2.0
    import megacompile.runtime.tier_io as tier_io
    monkeypatch.setattr(tier_io, "measure_ssd", measure_ssd, raising=False)
    megacompile.ssd._measured_ssd.cache_clear()
    try:
        (tmp_path / "b").mkdir()
        spec = f"measure:{tmp_path},{tmp_path / 'b'}"
        got = load_ssd(spec)
        assert got == SSD("measured", 3.0, 2.0, (str(tmp_path), str(tmp_path / "b"))) and load_ssd(spec) is got
        assert calls == [([str(tmp_path), str(tmp_path / "b")], 256 * 2**20)]   # once per process
    finally:
        megacompile.ssd._measured_ssd.cache_clear()


@pytest.mark.parametrize("profile, expected", [
    ({"name": "x", "read_gbps": 10}, "missing keys ['write_gbps']"),
    ({"name": "x", "read_gbps": -1, "write_gbps": 5}, "read_gbps=-1 must be a finite number > 0"),
    ({"name": "x", "read_gbps": 1, "write_gbps": 5, "read_gpbs": 2}, "did you mean 'read_gbps'"),
    ({"name": "x", "read_gbps": 1, "write_gbps": 5, "paths": "/mnt"}, "must be a list of directory paths"),
    ([1, 2], "not an object"),
])
def test_a_bad_profile_is_one_line_and_exit_2(wide_json, tmp_path, capsys, profile, expected):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(profile))
    assert main(["plan", str(wide_json), "--gpu", "h100", "--host-ram", "1T", "--nvme", str(bad)]) == 2
    assert expected in error_line(capsys)


@pytest.mark.parametrize("args, expected", [
    (["--nvme", "gen5x8"], "unknown SSD profile 'gen5x8' (did you mean 'gen5x4'?)"),
    (["--nvme", "measure:/no/such/dir"], "/no/such/dir is not an existing directory"),
    (["--nvme-placement", "all"], "--nvme-placement all needs --nvme PROFILE"),
    (["--nvme", "gen5x4", "--nvme-placement", "most"], "--nvme-placement: invalid choice"),
    (["--accum", "0"], "--accum"),
])
def test_bad_nvme_arguments_exit_2_before_any_capture(wide_json, capsys, monkeypatch, args, expected):
    monkeypatch.setattr(megacompile.plan, "capture_prefix", lambda *a: pytest.fail("captured before refusing"))
    assert main(["plan", str(wide_json), "--gpu", "h100", "--host-ram", "1T", *args]) == 2
    assert expected in error_line(capsys)


def test_too_little_disk_is_a_problem(wide_json, tmp_path, capsys, monkeypatch):
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"name": "small", "read_gbps": 10, "write_gbps": 5, "capacity_gib": 0.001}))
    assert main(["plan", str(wide_json), "--gpu", "h100", "--host-ram", "1T", "--seq", "64", "--nvme", str(small),
                 "--nvme-placement", "all"]) == 3
    assert "NVMe: the state tier needs" in error_line(capsys)
    # capacity 0 with paths: the free space of the paths (statvfs)
    on_disk = tmp_path / "disk.json"
    on_disk.write_text(json.dumps({"name": "disk", "read_gbps": 10, "write_gbps": 5, "paths": [str(tmp_path)]}))
    monkeypatch.setattr(megacompile.ssd, "free_bytes", lambda paths: 4096)
    plan = plan_model(str(wide_json), hardware=BUILTIN["h100"], host_ram=2**40, seq=64, ssd=load_ssd(on_disk),
                      placement="moments", max_batch=4)
    assert plan.ssd_capacity == 4096 and "free on" in plan.problems[0] and "NVMe" in plan.problems[0]
    monkeypatch.undo()
    plan = plan_model(str(wide_json), hardware=BUILTIN["h100"], host_ram=2**40, seq=64, ssd=load_ssd(on_disk),
                      placement="moments", max_batch=4)
    assert plan.fits and plan.ssd_capacity > plan.host.ssd_total


# -- the train config's keys, choose_tier and the preflight -----------------------------------------

def _config(tmp_path, **kw):
    base = dict(model_name_or_path="m", dataset="d", output_dir=str(tmp_path / "out"))
    return from_mapping({**base, **kw})


def test_config_nvme_keys_are_checked(tmp_path):
    drive = tmp_path / "nvme0"
    drive.mkdir()
    ok = _config(tmp_path, nvme="gen5x4", nvme_paths=[str(drive)])
    assert (ok.nvme, ok.nvme_paths, ok.nvme_placement) == ("gen5x4", [str(drive)], "auto")
    assert _config(tmp_path).nvme is None
    for kw, expected in [
        (dict(nvme="gen5x4", nvme_paths=[str(drive)], nvme_placement="none"), "nvme_placement='none'"),
        (dict(nvme="gen5x4"), "needs nvme_paths"),
        (dict(nvme_paths=[str(drive)]), "nvme_paths is set but nvme is not"),
        (dict(nvme_placement="all"), "needs nvme"),
        (dict(nvme="gen9", nvme_paths=[str(drive)]), "unknown SSD profile"),
        (dict(nvme="gen5x4", nvme_paths=[str(tmp_path / "nope")]), "is not an existing directory"),
        (dict(nvme="gen5x4", nvme_paths=[]), "give a list of directories"),
        (dict(nvme="gen5x4", nvme_paths=[str(drive), str(drive)]), "given twice"),
        (dict(nvme="gen5x4", nvme_paths=str(drive)), "expected list or null"),
        (dict(nvme="gen5x4", nvme_paths=[str(tmp_path)], output_dir=str(tmp_path)), "inside output_dir"),
        (dict(nvme="gen5x4", nvme_paths=[str(drive)], model_name_or_path=str(tmp_path)), "inside the model folder"),
    ]:
        with pytest.raises(ConfigError, match=expected):
            _config(tmp_path, **kw)
    # a profile's own paths stand in for nvme_paths; a measure: profile is not measured by the check
    assert _config(tmp_path, nvme=f"measure:{drive}").nvme == f"measure:{drive}"


def test_choose_tier_and_preflight(tmp_path, wide_json, monkeypatch):
    model, cpu = _meta(wide_json), torch.device("cpu")
    drive = tmp_path / "nvme0"
    drive.mkdir()
    assert choose_tier(model, cpu, _config(tmp_path)) == ("none", None)
    config = _config(tmp_path, nvme="gen4x4", nvme_paths=[str(drive)])
    need = {p: host_bytes(model, "cpu", p).total for p in ("none", "moments", "all")}
    monkeypatch.setattr(megacompile.hardware, "host_memory_limit", lambda: (need["moments"], "test"))
    placement, ssd = choose_tier(model, cpu, config)
    assert placement == "moments" and ssd == dataclasses.replace(load_ssd("gen4x4"), paths=(str(drive.resolve()),))
    text = preflight(model, cpu, "frozen", placement, ssd)
    assert "NVMe (gen4x4, placement moments)" in text and str(drive.resolve()) in text
    with pytest.raises(PreflightError, match="nvme_placement: all"):   # the RAM of "moments" is not there
        monkeypatch.setattr(megacompile.hardware, "host_memory_limit", lambda: (need["moments"] - 1, "test"))
        preflight(model, cpu, "frozen", placement, ssd)
    monkeypatch.setattr(megacompile.hardware, "host_memory_limit", lambda: (need["none"], "test"))
    assert choose_tier(model, cpu, config)[0] == "none"
    monkeypatch.setattr(megacompile.ssd, "free_bytes", lambda paths: 4096)
    with pytest.raises(PreflightError, match="not enough free disk for the state tier"):
        preflight(model, cpu, "frozen", "all", ssd)
    with pytest.raises(PreflightError, match=r"nvme: gen5x4 or measure:DIR"):   # no tier asked: say how
        monkeypatch.setattr(megacompile.hardware, "host_memory_limit", lambda: (need["none"] - 1, "test"))
        preflight(model, cpu, "frozen")


def test_plan_of_a_train_config_plans_its_tier_and_accumulation(wide_json, tmp_path, capsys):
    drive = tmp_path / "nvme0"
    drive.mkdir()
    yaml = tmp_path / "train.yaml"
    yaml.write_text(f"model_name_or_path: {wide_json}\ndataset: d\noutput_dir: {tmp_path / 'out'}\ncutoff_len: 64\n"
                    f"gradient_accumulation_steps: 3\nnvme: gen4x4\nnvme_paths: [{drive}]\nnvme_placement: all\n")
    assert main(["plan", str(yaml), "--gpu", "h100", "--host-ram", "1T", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["accum"] == 3 and plan["nvme"]["placement"] == "all"
    assert plan["nvme"]["profile"]["paths"] == [str(drive)] and plan["nvme"]["capacity_source"].startswith("free on")
    assert main(["plan", str(yaml), "--gpu", "h100", "--host-ram", "1T", "--format", "json", "--accum", "2",
                 "--nvme-placement", "moments"]) == 0   # the command line wins
    plan = json.loads(capsys.readouterr().out)
    assert plan["accum"] == 2 and plan["nvme"]["placement"] == "moments"
