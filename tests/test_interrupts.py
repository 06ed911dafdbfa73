"""Interrupts at every phase of `megatrain train` (Ctrl-C or SIGTERM), each followed by the
command the one printed line recommends: the compile, a step, an eval before the first save, a
save, the export. And the signal handling itself: one line, a second Ctrl-C quiet."""
from __future__ import annotations

import os
import signal
import time

import pytest

import megacompile.train.trainer as trainer
from megacompile import interrupts
from megacompile.cli import main
from megacompile.train.checkpoint import format as checkpoint
from test_faults import yaml_config
from test_train import tiny_dir  # noqa: F401 (a fixture)


def _raise_once(exc: BaseException, real=None, *, when=lambda *a, **k: True):
    """A stand-in that raises `exc` the first time `when(...)` holds, and calls `real` otherwise."""
    fired = []

    def fake(*args, **kwargs):
        if not fired and when(*args, **kwargs):
            fired.append(1)
            raise exc
        return real(*args, **kwargs) if real is not None else None
    return fake


def _last_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    return err.strip().splitlines()[-1]


PHASES = {
    # phase: (what raises, when, what the line must say)
    "compile": ("_loop", None, "no checkpoint was written: run the same command again"),
    "eval before the first save": ("evaluate", None, "no checkpoint was written: run the same command again"),
    "save": ("checkpoint.save", lambda out, step, *a, **k: step == 2, "checkpoint-1: continue from it"),
    "export": ("_export", None, "checkpoint-2: continue from it"),
}


@pytest.mark.parametrize("phase,signal_kind", [(p, KeyboardInterrupt) for p in PHASES]
                         + [("save", interrupts.Terminated)])
def test_an_interrupt_says_what_is_true_and_its_advice_works(tiny_dir, tmp_path, monkeypatch, capsys,  # noqa: F811
                                                             phase, signal_kind):
    cfg = yaml_config(tmp_path, tiny_dir, max_steps=2, save_steps=1, eval_steps=1, eval_strategy="steps",
                      val_size=0.25)
    where, when, said = PHASES[phase]
    if where == "checkpoint.save":
        monkeypatch.setattr(checkpoint, "save", _raise_once(signal_kind(), checkpoint.save, when=when))
    else:
        monkeypatch.setattr(trainer, where, _raise_once(signal_kind(), getattr(trainer, where)))
    code = main(["train", str(cfg), "--no-progress"])
    line = _last_line(capsys)
    assert code == (143 if signal_kind is interrupts.Terminated else 130)
    assert line.startswith("megatrain: terminated (SIGTERM); " if code == 143 else "megatrain: interrupted; "), line
    assert said in line, line
    monkeypatch.undo()
    follow = ["resume_from_checkpoint=true"] if "continue from it" in said else []
    assert main(["train", str(cfg), "--no-progress", *follow]) == 0, capsys.readouterr().err[-2000:]
    out = tmp_path / "out"
    assert (out / "model.safetensors").is_file() and checkpoint.step_of(checkpoint.checkpoints(out)[-1]) == 2


def test_plan_says_nothing_about_checkpoints_when_terminated(monkeypatch, capsys):
    import megacompile.cli as cli
    monkeypatch.setattr(cli, "_plan", _raise_once(interrupts.Terminated()))
    assert main(["plan", "llama-3-8b"]) == 143
    assert _last_line(capsys) == "megatrain: terminated (SIGTERM)"


def test_a_second_ctrl_c_while_unwinding_is_quiet(capsys):
    """The first SIGINT raises; one that lands in the cleanup is ignored, and a KeyboardInterrupt
    raised inside a finalizer prints nothing (no "Exception ignored ... Traceback")."""
    class Finalized:
        def __del__(self):
            raise KeyboardInterrupt

    def settle():   # (a signal may land on another thread: the main thread runs its handler at its next check)
        for _ in range(50):
            time.sleep(0.01)

    cleaned, before = [], signal.getsignal(signal.SIGINT)
    with interrupts.handled():
        with pytest.raises(KeyboardInterrupt):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                settle()                                # (the handler raises in here)
            finally:
                os.kill(os.getpid(), signal.SIGINT)   # a second Ctrl-C during the cleanup: ignored
                settle()
                Finalized()                             # its __del__ raises into the void: dropped
                cleaned.append(True)
    assert cleaned == [True]
    assert capsys.readouterr().err == ""
    assert signal.getsignal(signal.SIGINT) is before   # restored


def test_a_first_signal_swallowed_by_a_finalizer_is_delivered_again():
    """The handler raises wherever the main thread is; inside a finalizer Python drops the
    exception and the run would go on (a SIGTERM that never stops the run): it is raised again."""
    import gc

    def finalizer_running_the_handler():
        class Dropper:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(50):
                    time.sleep(0.01)   # (the handler raises in here, inside __del__: dropped)
        Dropper()
        gc.collect()

    with interrupts.handled():
        with pytest.raises(interrupts.Terminated):
            finalizer_running_the_handler()
            for _ in range(200):
                time.sleep(0.01)       # the signal delivered again raises here
