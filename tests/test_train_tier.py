"""`megatrain train` with the NVMe state tier (nvme, nvme_paths, nvme_placement): the same losses,
gradient norms and checkpoints as the run without it, checkpoints that resume across the two,
the tier's files gone when the run ends, and an I/O error of the tier stopping the run with an
error that names the file and the last checkpoint."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from megacompile.errors import TrainingError
from megacompile.runtime import state_tier
from megacompile.train.checkpoint import format as checkpoint
from megacompile.train import trainer
from megacompile.train.trainer import train
from test_train import config, log_rows, tiny_dir  # noqa: F401 (a fixture)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """The tiny model's matrices (512-12800 elements) go to the tier."""
    monkeypatch.setattr(state_tier, "MIN_NUMEL", 1024)


def _tiered(tiny_dir, out, tmp_path, **kw):
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    return config(tiny_dir, out, nvme="gen5x4", nvme_paths=[str(nvme)], nvme_placement="all", **kw), nvme


def _run(cfg, **kw):
    train(cfg, progress=False, **kw)
    out = Path(cfg.output_dir)
    rows = log_rows(out)
    return [(r["loss"], r["grad_norm"]) for r in rows], out


def _weights(out: Path, step: int) -> dict:
    return checkpoint.load_file(str(out / f"checkpoint-{step}" / "model.safetensors"))


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("overlap", [False, "backward"])
def test_training_with_the_tier_equals_training_without_it(tiny_dir, tmp_path, overlap, capsys):  # noqa: F811
    kw = dict(overlap_optimizer=overlap, gradient_accumulation_steps=2, max_grad_norm=0.5)
    want, want_out = _run(config(tiny_dir, tmp_path / "ram", **kw))
    capsys.readouterr()
    cfg, nvme = _tiered(tiny_dir, tmp_path / "tier", tmp_path, **kw)
    got, got_out = _run(cfg)
    assert got == want
    for step in (2, 4):
        assert _same_weights(_weights(got_out, step), _weights(want_out, step))
    assert list(nvme.iterdir()) == [], "the tier's files go when the run ends"
    said = capsys.readouterr().out
    assert "state tier: all of 12 parameters, 336.00 KiB x 2 slots" in said and str(nvme) in said, said


@pytest.mark.slow   # (40 s; in CI: tests/test_tier_checkpoint.py resumes across the tier both ways, bit for bit)
def test_a_checkpoint_resumes_across_the_tier_both_ways(tiny_dir, tmp_path):  # noqa: F811
    """Interrupted after step 3 (checkpoint at 2), resumed to step 4 with the tier switched the
    other way: the losses and the weights of the uninterrupted run."""
    want, want_out = _run(config(tiny_dir, tmp_path / "full"))
    for first_tiered in (True, False):
        name = f"part-{first_tiered}"
        first = _tiered(tiny_dir, tmp_path / name, tmp_path)[0] if first_tiered else config(tiny_dir, tmp_path / name)
        _run(first, stop_at_step=3)
        kw = dict(resume_from_checkpoint=True)
        second = (config(tiny_dir, tmp_path / name, **kw) if first_tiered
                  else _tiered(tiny_dir, tmp_path / name, tmp_path, **kw)[0])
        got, out = _run(second)
        assert [r for r in got] == want, first_tiered
        assert _same_weights(_weights(out, 4), _weights(want_out, 4)), first_tiered


def test_an_io_error_of_the_tier_stops_the_run_naming_the_file(tiny_dir, tmp_path, monkeypatch):  # noqa: F811
    """The drive fails after a few steps: TrainingError with the file, the errno and the last
    checkpoint, which is complete; the tier's files are removed."""
    real = state_tier.StateTier

    class Failing(real):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            # the move in, then about three steps of reads and writes
            self._engine.inject(0, after_bytes=7 * self.nbytes, error=errno.EIO)

    monkeypatch.setattr(trainer, "StateTier", Failing)
    cfg, nvme = _tiered(tiny_dir, tmp_path / "tier", tmp_path, max_steps=8)
    with pytest.raises(TrainingError) as info:
        train(cfg, progress=False)
    message = str(info.value)
    assert "state tier" in message and str(nvme) in message and "checkpoint-2" in message, message
    assert (Path(cfg.output_dir) / "checkpoint-2" / checkpoint.TRAINER).is_file()
    assert list(nvme.iterdir()) == []
