"""`megatrain plan MODEL --compare`: a row per built-in GPU x host RAM size (and NVMe where the RAM
alone does not fit), each what `plan --gpu G --host-ram R` says, from captures shared by all rows."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_config
from megacompile import plan_compare
from megacompile.cli import main
from megacompile.hardware import BUILTIN
from megacompile.plan import capture_prefix, plan_model
from megacompile.ssd import load_ssd

#: as the CLI's rows are planned, with the batch capped at 4 (no capture of a larger batch)
SAME = dict(seq=256, max_batch=4)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A 19.3B-parameter Llama (8 layers of hidden 16384): 328 GiB of host store, so it fits
    512G of host RAM but not 256G, except with the AdamW moments on NVMe."""
    path = tmp_path_factory.mktemp("wide") / "config.json"
    tiny_config("llama", layers=8, hidden=16384, vocab_size=256).to_json_file(path)
    return str(path)


@pytest.fixture(scope="module")
def compared(wide):
    """The rows of the sweep, and the captures compiled for all of them."""
    compiled = []

    def counting(*args):
        compiled.append(args[2])   # (the batch)
        return capture_prefix(*args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_compare, "capture_prefix", counting)
        rows = plan_compare.compare_plans(wide, **SAME)
    return rows, compiled


def _row(rows, gpu, ram, nvme=None):
    return next(r for r in rows if r.gpu == gpu and r.host_ram.given == ram and r.nvme == nvme)


def test_a_row_per_gpu_and_host_ram_and_nvme_where_ram_alone_does_not_fit(compared):
    rows, compiled = compared
    boxes = [(r.gpu, r.host_ram.given, r.nvme) for r in rows]
    expected = []
    for gpu in BUILTIN:   # h200, h100, gh200, a100; 256G only with the moments on NVMe
        expected += [(gpu, "256G", None), (gpu, "256G", "gen4x4"), (gpu, "512G", None), (gpu, "1T", None),
                     (gpu, "2T", None)]
    assert boxes == expected
    assert _row(rows, "h200", "2T").fits and not _row(rows, "a100", "256G").fits
    assert _row(rows, "a100", "256G").short() == ["host RAM: needs 328.15 GiB"]
    assert _row(rows, "a100", "256G", "gen4x4").fits and _row(rows, "a100", "256G", "gen4x4").placement == "moments"
    # 20 plans, 2 captures (batch 2 and 4, reused on every profile: the same prefetch lookahead)
    assert sorted(compiled) == [2, 4]
    for r in rows:
        if r.fits:
            bound, share = r.bound()
            assert bound in plan_compare.RESOURCES.values() and 0 < share <= 1 + 1e-9
            assert r.to_dict()["seconds_per_billion_tokens"] == pytest.approx(1e9 / r.tokens_per_s)
    # the cheapest box of each GPU at its best speed, and the last line
    assert [(r.gpu, r.host_ram.given, r.nvme) for r in rows if r.pick] == \
        [(gpu, *next((r.host_ram.given, r.nvme) for r in rows if r.gpu == gpu and r.fits
                     and r.tokens_per_s >= 0.99 * max(x.tokens_per_s for x in rows if x.gpu == gpu and x.fits)))
         for gpu in BUILTIN]
    last = plan_compare.rows_text(rows).splitlines()[-1]
    assert last.startswith("smallest host RAM that fits: h200 512G, or 256G + gen4x4 NVMe (moments)")
    assert "a100 512G" in last


def test_rows_agree_with_a_plan_of_each_box(compared, wide):
    rows, _ = compared
    for gpu, ram, nvme in (("h100", "512G", None), ("gh200", "256G", "gen4x4")):
        row = _row(rows, gpu, ram, nvme)
        plan = plan_model(wide, hardware=BUILTIN[gpu], host_ram=row.host_ram,
                          ssd=load_ssd(nvme) if nvme else None, **SAME)
        assert plan.fits and row.fits
        assert row.tokens_per_s == pytest.approx(plan.tokens_per_s(plan.best), rel=1e-12)
        assert (row.best.batch, row.best.step_seconds, row.plan.lookahead, row.placement) \
            == (plan.best.batch, pytest.approx(plan.best.step_seconds, rel=1e-12), plan.lookahead,
                plan.host.placement)


def test_a_row_that_does_not_fit_agrees_with_its_plan(compared, wide):
    rows, _ = compared
    row = _row(rows, "a100", "256G")
    plan = plan_model(wide, hardware=BUILTIN["a100"], host_ram=row.host_ram, **SAME)
    assert not plan.fits and not row.fits and row.problems == plan.problems and row.tokens_per_s is None


def test_captures_are_reused_on_profiles_that_choose_the_same_lookahead(tmp_path):
    """The memo's premise: a capture depends on the profile only through the schedule's
    lookahead (predicted here without compiling) and its bodies' seconds (re-costed)."""
    cfg = tiny_config("llama", layers=2, hidden=64, vocab_size=256)
    base = capture_prefix(cfg, 2, 2, 64, 2, torch.bfloat16, BUILTIN["h200"], {"logits": "drop"})
    seen, recosts = {tuple(c.lookahead for c in base.directions.values())}, 0
    for name in ("h100", "a100"):
        hw = BUILTIN[name]
        fresh = capture_prefix(cfg, 2, 2, 64, 2, torch.bfloat16, hw, {"logits": "drop"})
        want = plan_compare.lookaheads(base, hw, 2)
        assert want == {d: c.lookahead for d, c in fresh.directions.items()}
        seen.add(tuple(want.values()))
        if want == {d: c.lookahead for d, c in base.directions.items()}:
            again, recosts = plan_compare.recosted(base, hw), recosts + 1
            for d, c in fresh.directions.items():
                assert again.directions[d].seconds == pytest.approx(c.seconds, rel=1e-12)
                assert again.directions[d].peak == c.peak
    # (tiny bodies at seq 64: an a100 prefetches the next layer ahead, an h200 and an h100 do not)
    assert len(seen) > 1 and recosts == 1


def test_cli_compare_json_is_a_list_of_rows(tmp_path, capsys):
    path = tmp_path / "config.json"
    tiny_config("llama", layers=2, hidden=64, vocab_size=256).to_json_file(path)
    # (--slots 1: no prefetch lookahead to choose, so one capture per batch size serves every profile)
    assert main(["plan", str(path), "--seq", "64", "--slots", "1", "--compare", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    boxes = [(g, m) for g in BUILTIN for m in plan_compare.COMPARE_RAM]
    assert [(r["gpu"], r["host_ram_given"]) for r in rows] == boxes
    assert all(r["fits"] and r["nvme"] is None and r["tokens_per_s"] > 0 and r["bound"] for r in rows)
    assert sum(r["pick"] for r in rows) == len(BUILTIN)
    assert rows[0]["host_ram"] == 256 * 10**9 and rows[0]["step_seconds"] > 0 and rows[0]["batch"] >= 1


@pytest.mark.parametrize("given", [["--gpu", "h100"], ["--host-ram", "1T"], ["--gpu", "a100", "--host-ram", "2T"]])
def test_cli_compare_refuses_a_gpu_or_host_ram(given, tmp_path, capsys):
    assert main(["plan", "llama-3-70b", "--compare", *given]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1 and err[0].startswith("megatrain: error: --compare with --")
    assert "leave out --compare to plan one machine" in err[0]


def test_cli_compare_where_nothing_fits_prints_the_table_and_exits_3(wide, capsys):
    """A sequence whose layer boundary alone overflows every GPU (2 x [4M, 16384] bf16 = 250 GiB)."""
    assert main(["plan", wide, "--seq", "4000000", "--compare"]) == 3
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if line.startswith("  ") and " no " in line]
    assert len(rows) == len(BUILTIN) * len(plan_compare.COMPARE_RAM)
    assert captured.out.splitlines()[-1] == "smallest host RAM that fits: h200 none; h100 none; gh200 none; a100 none"
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatrain: error: ") and "fits none of the 16 machines" in err[0]
