"""`megatrain train` under faults and bad input: nothing of the user's lost, nothing foreign
executed, no tracebacks. One test (or a few) per class of the issue: security, data loss,
non-finite training, corrupt files, bad values, resume changes, exit codes.

Most tests start from one finished 4-step run (checkpoints 2 and 4, the exported model),
copied per test, and resume it; a resume of the tiny Llama costs one compile (~10 s).
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from megacompile.cli import main
from megacompile.errors import CannotFitError, ConfigError, TrainingError
from megacompile.train.checkpoint import format as checkpoint
from megacompile.train.model import hf_folder
from megacompile.train.checkpoint.format import CheckpointError, DiskSpaceError
from megacompile.train.hparams.config import from_mapping, load_config
from megacompile.train.data import DataError
from megacompile.train.run_dir import LOCK, RunLock
from megacompile.train.trainer import LOG_NAME, train
from test_train import EXAMPLES, config, log_rows, tiny_dir  # noqa: F401 (tiny_dir: a fixture)


@pytest.fixture(scope="module")
def finished(tiny_dir, tmp_path_factory) -> Path:  # noqa: F811
    """A 4-step run: checkpoint-2, checkpoint-4, its log and exported model."""
    root = tmp_path_factory.mktemp("finished")
    train(config(tiny_dir, root, max_steps=4, save_steps=2), progress=False)
    return root / "out"


def copy_of(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    return out


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("megatrain: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def yaml_config(tmp_path: Path, tiny_dir: Path, **kw) -> Path:  # noqa: F811
    import yaml
    base = dict(model_name_or_path=str(tiny_dir), dataset="alpaca_demo", dataset_dir=str(EXAMPLES),
                output_dir=str(tmp_path / "out"), cutoff_len=64, per_device_train_batch_size=2, max_steps=2,
                save_steps=2, device="cpu")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**base, **kw}))
    return path


# -- security -------------------------------------------------------------------------------------

class _Payload:
    """Pickles into a call of os.system: what a crafted checkpoint file would hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _rewrite_sizes(ckpt: Path) -> None:
    """What an attacker would do too: make trainer.json's file sizes match the crafted files."""
    meta = json.loads((ckpt / "trainer.json").read_text())
    meta["files"] = {name: (ckpt / name).stat().st_size for name in meta["files"] if (ckpt / name).exists()}
    (ckpt / "trainer.json").write_text(json.dumps(meta))


def test_a_crafted_checkpoint_is_refused_and_runs_nothing(finished, tiny_dir, tmp_path):  # noqa: F811
    out = copy_of(finished, tmp_path)
    marker = tmp_path / "executed"
    ckpt = out / "checkpoint-4"
    torch.save({"state": {}, "param_groups": [], "x": _Payload(marker)}, ckpt / "optimizer.pt")
    _rewrite_sizes(ckpt)
    with pytest.raises(CheckpointError, match=r"checkpoint-4/optimizer.pt is damaged.*checkpoint-2"):
        train(config(tiny_dir, tmp_path, max_steps=6, resume_from_checkpoint=str(ckpt)), progress=False)
    assert not marker.exists()
    # an earlier megatrain's rng.pt (a pickle) is read with weights_only=True: a crafted one is refused
    old = out / "checkpoint-2"
    (old / "rng.json").unlink()
    meta = json.loads((old / "trainer.json").read_text())
    del meta["files"]
    (old / "trainer.json").write_text(json.dumps(meta))
    torch.save({"python": _Payload(marker), "torch": torch.get_rng_state()}, old / "rng.pt")
    with pytest.raises(CheckpointError, match=r"checkpoint-2/rng.pt is damaged"):
        checkpoint.read(old)
    assert not marker.exists()
    # the RNG state is JSON now: the good checkpoint never holds a pickle outside optimizer.pt (tensors only)
    assert json.loads((finished / "checkpoint-4" / "rng.json").read_text())["python"][0] == 3
    assert not (finished / "checkpoint-4" / "rng.pt").exists()


def test_data_files_outside_dataset_dir_are_refused_unless_allowed(tiny_dir, tmp_path, capsys):  # noqa: F811
    from transformers import AutoTokenizer

    from megacompile.train.data import build_examples
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(EXAMPLES / "alpaca_demo.json", tmp_path / "outside.json")
    (data / "dataset_info.json").write_text(json.dumps({
        "up": {"file_name": "../outside.json"}, "abs": {"file_name": str(tmp_path / "outside.json")}}))
    for name in ("up", "abs"):
        cfg = from_mapping(dict(model_name_or_path="m", dataset=name, dataset_dir=str(data), output_dir="o"))
        with pytest.raises(DataError, match="outside dataset_dir.*allow_outside_dataset_dir: true"):
            build_examples(cfg, tok)
    cfg = from_mapping(dict(model_name_or_path="m", dataset="up", dataset_dir=str(data), output_dir="o",
                            allow_outside_dataset_dir=True))
    assert len(build_examples(cfg, tok)[0]) > 0
    # the training log says which file each data set was read from
    assert main(["train", str(yaml_config(tmp_path, tiny_dir, dataset="up", dataset_dir=str(data),
                                          allow_outside_dataset_dir=True)), "--no-progress"]) == 0
    assert f"data set up: {tmp_path / 'outside.json'} (" in capsys.readouterr().out


# -- data loss ------------------------------------------------------------------------------------

def test_overwrite_deletes_nothing_until_training_starts(finished, tiny_dir, tmp_path):  # noqa: F811
    out = copy_of(finished, tmp_path)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(DataError, match="'alpaca_dem' is not in"):
        train(config(tiny_dir, tmp_path, overwrite_output_dir=True, dataset="alpaca_dem"), progress=False)
    assert sorted(p.name for p in out.iterdir()) == before
    train(config(tiny_dir, tmp_path, overwrite_output_dir=True, max_steps=1), progress=False)
    assert [p.name for p in checkpoint.checkpoints(out)] == ["checkpoint-1"] and len(log_rows(out)) == 1


def digests(folder: Path) -> dict[str, str]:
    """Every file under `folder` by relative path, with its SHA-256 (before/after comparisons)."""
    import hashlib
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_overwrite_never_replaces_another_models_files(finished, tiny_dir, tmp_path, capsys):  # noqa: F811
    """output_dir holding a copy of a Hugging Face model (not the one trained) and the user's
    notes: overwrite_output_dir refuses, naming the files the export would replace; nothing moves."""
    out = tmp_path / "out"
    shutil.copytree(tiny_dir, out)
    (out / "notes.md").write_text("mine")
    before = digests(out)
    cfg = yaml_config(tmp_path, tiny_dir, overwrite_output_dir=True, max_steps=1)
    assert main(["train", str(cfg), "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert "config.json" in line and "model.safetensors" in line and "no megatrain run wrote" in line
    assert digests(out) == before
    # an HF Trainer's checkpoint-N (trainer_state.json, no megatrain trainer.json) is not ours either
    other = tmp_path / "hf_run"
    (other / "checkpoint-500").mkdir(parents=True)
    (other / "checkpoint-500" / "trainer_state.json").write_text("{}")
    cfg = yaml_config(tmp_path, tiny_dir, output_dir=str(other), overwrite_output_dir=True, max_steps=1)
    assert main(["train", str(cfg), "--no-progress"]) == 2
    assert "checkpoint-500" in one_error_line(capsys) and (other / "checkpoint-500" / "trainer_state.json").exists()
    # an export file the user replaced since (its size differs from the manifest's) is theirs now
    done = copy_of(finished, tmp_path / "again")
    (done / "config.json").write_text('{"mine": true}')
    before = digests(done)
    with pytest.raises(ConfigError, match="holds config.json, which no megatrain run wrote"):
        train(config(tiny_dir, tmp_path / "again", overwrite_output_dir=True, max_steps=1), progress=False)
    assert digests(done) == before


def test_overwrite_never_deletes_what_the_run_reads(finished, tiny_dir, tmp_path, capsys):  # noqa: F811
    """model_name_or_path = OUT/checkpoint-2 and output_dir = OUT with overwrite_output_dir: the
    starting weights would be deleted at the first step; refused before anything is touched."""
    out = copy_of(finished, tmp_path)
    before = digests(out)
    cfg = yaml_config(tmp_path, tiny_dir, model_name_or_path=str(out / "checkpoint-2"), overwrite_output_dir=True,
                      max_steps=1)
    assert main(["train", str(cfg), "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert "would delete" in line and "checkpoint-2" in line and "model_name_or_path" in line
    assert digests(out) == before


def test_output_dir_as_the_data_folder_keeps_every_data_file(tiny_dir, tmp_path):  # noqa: F811
    data = tmp_path / "data"
    shutil.copytree(EXAMPLES, data)
    before = digests(data)
    train(config(tiny_dir, tmp_path, dataset_dir=str(data), output_dir=str(data), overwrite_output_dir=True,
                 max_steps=1), progress=False)
    after = digests(data)
    assert {k: after.get(k) for k in before} == before and (data / "model.safetensors").is_file()


def test_a_folder_whose_run_saved_nothing_does_not_block_the_same_command(tiny_dir, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    out.mkdir()
    (out / LOG_NAME).write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")   # trained a step, saved nothing
    (out / "notes.md").write_text("mine")
    with pytest.raises(ConfigError, match="not empty and holds no megatrain run \\(notes.md\\)"):
        train(config(tiny_dir, tmp_path, max_steps=1), progress=False)   # (foreign files still refuse)
    (out / "notes.md").unlink()
    train(config(tiny_dir, tmp_path, max_steps=1), progress=False)
    (retired,) = (out / "retired").iterdir()
    assert json.loads((retired / LOG_NAME).read_text())["loss"] == 2.0 and len(log_rows(out)) == 1


def test_one_run_per_output_dir(tiny_dir, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    out.mkdir()
    held = RunLock(out)
    held.acquire()   # another run holds the folder (flock: per open file, so this process counts as another)
    try:
        with pytest.raises(ConfigError, match=f"in use by another megatrain run \\(pid {os.getpid()} on host"):
            train(config(tiny_dir, tmp_path, max_steps=1), progress=False)
        assert sorted(p.name for p in out.iterdir()) == [LOCK]
    finally:
        held.release()
    # a lock file left by a killed run (the kernel dropped its flock) is stale: taken over
    (out / LOCK).write_text(json.dumps({"holder": "pid 999999 on host elsewhere since then", "pid": 999999}))
    train(config(tiny_dir, tmp_path, max_steps=1), progress=False)
    assert not (out / LOCK).exists() and checkpoint.checkpoints(out)


def test_model_folder_and_foreign_folders_are_not_written_into(tiny_dir, tmp_path):  # noqa: F811
    before = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    for out in (tiny_dir, tiny_dir / "sub"):
        with pytest.raises(ConfigError, match="model folder"):
            train(config(tiny_dir, tmp_path, output_dir=str(out), overwrite_output_dir=True), progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()} == before
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty and holds no megatrain run \\(notes.txt\\)"):
        train(config(tiny_dir, tmp_path, output_dir=str(foreign)), progress=False)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    train(config(tiny_dir, tmp_path, output_dir=str(foreign), overwrite_output_dir=True, max_steps=1), progress=False)
    assert (foreign / "notes.txt").read_text() == "keep me" and (foreign / "model.safetensors").is_file()
    # a missing output_dir that a refused run created is not left behind
    gone = tmp_path / "never" / "made"
    with pytest.raises(DataError):
        train(config(tiny_dir, tmp_path, output_dir=str(gone), dataset="nope"), progress=False)
    assert not gone.exists()


def test_a_resave_killed_between_its_renames_loses_nothing(finished, tmp_path, monkeypatch):
    out = copy_of(finished, tmp_path)
    good = checkpoint.read(out / "checkpoint-4").masters
    model = _model_from(out / "checkpoint-4")
    from megacompile.runtime.adamw import HostAdamW
    opt = HostAdamW(model.parameters())
    real, calls = os.replace, []

    def killed_after_moving_aside(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 2:
            raise KeyboardInterrupt   # the kill: checkpoint-4 is aside, the new one not in place
        real(src, dst)
    monkeypatch.setattr(checkpoint.os, "replace", killed_after_moving_aside)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(out, 4, model, opt, {"scheduler": {}, "data": {}, "state": {}})
    monkeypatch.setattr(checkpoint.os, "replace", real)
    assert calls[0] == ("checkpoint-4", "checkpoint-4.prev") and not (out / "checkpoint-4").exists()
    assert "restored checkpoint-4" in checkpoint.recover(out)[0]
    assert all(torch.equal(good[k], v) for k, v in checkpoint.read(out / "checkpoint-4").masters.items())


def _model_from(ckpt: Path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(ckpt.parent)
    return model


def test_resuming_an_older_checkpoint_retires_the_newer_ones(finished, tiny_dir, tmp_path):  # noqa: F811
    out = copy_of(finished, tmp_path)
    old_log = (out / LOG_NAME).read_text()
    train(config(tiny_dir, tmp_path, max_steps=3, save_steps=3, resume_from_checkpoint=str(out / "checkpoint-2")),
          progress=False)
    assert [p.name for p in checkpoint.checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]
    (retired,) = (out / "retired").iterdir()
    assert retired.name.endswith("-from-step-2") and (retired / "checkpoint-4" / "trainer.json").is_file()
    assert (retired / LOG_NAME).read_text() == old_log
    assert [r["step"] for r in log_rows(out)] == [1, 2, 3]
    # a later resume: true continues the new branch (step 3), not the retired step 4
    state = train(config(tiny_dir, tmp_path, max_steps=4, save_steps=4, resume_from_checkpoint=True), progress=False)
    assert state["step"] == 4 and [r["step"] for r in log_rows(out)] == [1, 2, 3, 4]


def test_a_full_disk_says_how_much_room_a_checkpoint_needs(finished, tiny_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    out = copy_of(finished, tmp_path)
    need = _tree_bytes(out / "checkpoint-4")
    real_usage = shutil.disk_usage
    free = {"bytes": 1}

    def usage(path):
        total, used, _ = real_usage(path)
        return type(real_usage(path))(total, used, free["bytes"])
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", usage)
    cfg = config(tiny_dir, tmp_path, max_steps=6, save_steps=1, resume_from_checkpoint=True)
    with pytest.raises(DiskSpaceError, match=r"checkpoint-5 needs about .* free.*previous checkpoints are intact"):
        train(cfg, progress=False)
    assert [p.name for p in checkpoint.checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    assert not list(out.glob("*.tmp"))
    assert issubclass(DiskSpaceError, CannotFitError)   # exit code 3
    # with save_total_limit the checkpoints that would be pruned anyway make the room, never the last one
    removed = []
    real_rmtree = shutil.rmtree

    def rmtree(path, *a, **k):
        if Path(path).name == "checkpoint-2":
            removed.append(path)
            free["bytes"] += 10 * (need + 2**20)
        real_rmtree(path, *a, **k)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    free["bytes"] = 1
    state = train(config(tiny_dir, tmp_path, max_steps=5, save_steps=1, save_total_limit=2,
                         resume_from_checkpoint=True), progress=False)
    assert state["step"] == 5 and removed
    assert [p.name for p in checkpoint.checkpoints(out)] == ["checkpoint-4", "checkpoint-5"]
    # a write that fails on ENOSPC anyway (another writer took the space): a clear error, no .tmp left
    free["bytes"] = 10 * (need + 2**20)

    def no_space(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(hf_folder, "save_file", no_space)   # (the weights' writer)
    with pytest.raises(DiskSpaceError, match="writing checkpoint-6 .* failed \\(.*No space left"):
        train(config(tiny_dir, tmp_path, max_steps=6, save_steps=1, resume_from_checkpoint=True), progress=False)
    assert not list(out.glob("*.tmp")) and checkpoint.checkpoints(out)[-1].name == "checkpoint-5"


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# -- non-finite training --------------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [("learning_rate", math.inf), ("learning_rate", math.nan),
                                       ("num_train_epochs", math.inf), ("max_grad_norm", math.inf),
                                       ("adam_epsilon", -1.0), ("weight_decay", -0.1), ("num_layers", 0),
                                       ("warmup_steps", -1), ("seed", -1), ("max_consecutive_skipped_steps", 0)])
def test_impossible_hyper_parameters_are_refused_before_anything_loads(key, value):
    with pytest.raises(ConfigError, match=key):
        from_mapping(dict(model_name_or_path="m", dataset="d", output_dir="o", **{key: value}))


def test_a_diverging_run_fails_and_reports_no_success(tiny_dir, tmp_path, capsys):  # noqa: F811
    # learning_rate 1e10: the first update makes huge weights, every later step is non-finite
    assert main(["train", str(yaml_config(tmp_path, tiny_dir, learning_rate=1e10, max_steps=6, save_steps=6)),
                 "--no-progress"]) == 4
    line = one_error_line(capsys)
    assert "steps were skipped" in line and "not exported" in line
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_consecutive_skipped_steps_stop_the_run(tiny_dir, tmp_path, monkeypatch):  # noqa: F811
    from megacompile.runtime.adamw import HostAdamW
    monkeypatch.setattr(HostAdamW, "grad_norm", lambda self: float("nan"))
    with pytest.raises(TrainingError, match=r"3 steps in a row \(steps 1-3\).*max_consecutive_skipped_steps"):
        train(config(tiny_dir, tmp_path, max_steps=10, max_consecutive_skipped_steps=3), progress=False)


def test_an_update_that_makes_weights_non_finite_stops_the_run(tiny_dir, tmp_path):  # noqa: F811
    # finite hyper-parameters whose product overflows: (1 - lr * weight_decay) is -inf in float32
    with pytest.raises(TrainingError, match=r"step 1 left NaN or inf in model\..*diverged"):
        train(config(tiny_dir, tmp_path, learning_rate=1e30, weight_decay=1e10, max_steps=3, save_steps=3),
              progress=False)
    assert not checkpoint.checkpoints(tmp_path / "out")


def test_non_finite_weights_in_a_checkpoint_are_refused(finished, tiny_dir, tmp_path):  # noqa: F811
    from safetensors.torch import load_file, save_file
    out = copy_of(finished, tmp_path)
    path = out / "checkpoint-4" / "model.safetensors"
    masters = load_file(str(path))
    name = sorted(masters)[0]
    masters[name][0] = float("nan")
    save_file(masters, str(path))
    _rewrite_sizes(out / "checkpoint-4")
    with pytest.raises(CheckpointError, match=f"the weights {name} are not finite.*checkpoint-2"):
        train(config(tiny_dir, tmp_path, max_steps=6, resume_from_checkpoint=str(out / "checkpoint-4")),
              progress=False)


# -- corrupt files --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "trainer.json", "rng.json"])
def test_a_truncated_checkpoint_file_is_named_and_the_previous_one_offered(finished, tiny_dir, tmp_path, name):  # noqa: F811
    out = copy_of(finished, tmp_path)
    path = out / "checkpoint-4" / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"checkpoint-4/{name}.*damaged.*checkpoint-2"):
        checkpoint.read(out / "checkpoint-4")
    if name != "optimizer.pt":
        return
    # resume_from_checkpoint: true falls back to the newest checkpoint that loads, and says so
    with open(out / LOG_NAME, "a") as log:
        log.write('{"step": 5, "loss": 1.')   # and a log line torn by a kill
    train(config(tiny_dir, tmp_path, max_steps=5, save_steps=5, resume_from_checkpoint=True), progress=False)
    assert [r["step"] for r in log_rows(out)] == [1, 2, 3, 4, 5]
    assert [p.name for p in checkpoint.checkpoints(out)] == ["checkpoint-2", "checkpoint-5"]
    (retired,) = (out / "retired").iterdir()   # the damaged checkpoint-4 is kept aside, not deleted
    assert (retired / "checkpoint-4" / name).is_file()


def _edit_trainer(ckpt: Path, **changes) -> None:
    meta = json.loads((ckpt / "trainer.json").read_text())
    for key, value in changes.items():
        target = meta
        *path, last = key.split("__")
        for part in path:
            target = target[part]
        target[last] = value
    (ckpt / "trainer.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", ["step", "folder", "optimizer"])
def test_a_checkpoint_whose_parts_disagree_is_refused(finished, tiny_dir, tmp_path, capsys, damage):  # noqa: F811
    """trainer.json's step against the folder's name, its own state and scheduler, and AdamW's
    step count in optimizer.pt: a mixed-up checkpoint is refused (exit 2), never reported as a
    finished run that trained nothing."""
    out = copy_of(finished, tmp_path)
    ckpt = out / "checkpoint-4"
    if damage == "step":      # (the state and the scheduler say 4 still)
        _edit_trainer(ckpt, step=9)
        expected = "its step is 9 but the folder's name says 4"
    elif damage == "folder":
        ckpt = ckpt.rename(out / "checkpoint-9")
        expected = "its step is 4 but the folder's name says 9"
    else:                     # checkpoint-2's optimizer state in checkpoint-4
        shutil.copy(out / "checkpoint-2" / "optimizer.pt", ckpt / "optimizer.pt")
        _rewrite_sizes(ckpt)
        expected = "AdamW state took 2 steps where trainer.json says 4"
    before = digests(out)
    cfg = yaml_config(tmp_path, tiny_dir, max_steps=4, resume_from_checkpoint=str(ckpt))
    assert main(["train", str(cfg), "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert expected in line and "damaged" in line, line
    assert digests(out) == before


def test_a_data_file_that_is_a_symlink_loop_is_the_users_error(tiny_dir, tmp_path, capsys):  # noqa: F811
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.json").symlink_to(data / "b.json")
    (data / "b.json").symlink_to(data / "a.json")
    (data / "dataset_info.json").write_text(json.dumps({"loop": {"file_name": "a.json"}}))
    cfg = yaml_config(tmp_path, tiny_dir, dataset="loop", dataset_dir=str(data))
    assert main(["train", str(cfg), "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert "a.json" in line and "leads back to itself" in line


# -- resume with another config --------------------------------------------------------------------

def test_resume_applies_safe_changes_and_refuses_the_others(finished, tiny_dir, tmp_path, capsys):  # noqa: F811
    out = copy_of(finished, tmp_path)
    base = dict(max_steps=6, save_steps=6, resume_from_checkpoint=True)
    with pytest.raises(ConfigError, match="per_device_train_batch_size: 2 -> 1.*start a new run"):
        train(config(tiny_dir, tmp_path, per_device_train_batch_size=1, **base), progress=False)
    # another data set of the same size: refused by the examples' fingerprint
    data = tmp_path / "data"
    data.mkdir()
    records = json.loads((EXAMPLES / "alpaca_demo.json").read_text())
    for r in records:
        r["output"] = r["output"].upper()
    (data / "alpaca_demo.json").write_text(json.dumps(records))
    shutil.copy(EXAMPLES / "dataset_info.json", data / "dataset_info.json")
    with pytest.raises(ConfigError, match="other training examples \\(dataset_dir:"):
        train(config(tiny_dir, tmp_path, dataset_dir=str(data), **base), progress=False)
    # the same data in another folder is fine; a new learning rate is applied from the resumed step
    shutil.copy(EXAMPLES / "alpaca_demo.json", data / "alpaca_demo.json")
    capsys.readouterr()
    train(config(tiny_dir, tmp_path, dataset_dir=str(data), learning_rate=5e-4, **base), progress=False)
    printed = capsys.readouterr().out
    assert "applied from here: learning_rate: 0.001 -> 0.0005" in printed
    rows = log_rows(out)
    total, step = 6, 5   # linear decay without warmup: step k uses lr = base * (1 - (k - 1) / total)
    assert rows[4]["step"] == step and rows[4]["lr"] == pytest.approx(5e-4 * (1 - (step - 1) / total))
    # a finished run asked to train nothing more says so instead of reporting success
    with pytest.raises(ConfigError, match="nothing to train. Raise max_steps"):
        train(config(tiny_dir, tmp_path, dataset_dir=str(data), learning_rate=5e-4, **base), progress=False)


# -- user errors: one line, exit 2, before the model loads ----------------------------------------

def test_user_errors_are_one_line_and_exit_2(tiny_dir, tmp_path, capsys):  # noqa: F811
    from transformers import T5Config, T5ForConditionalGeneration
    data = tmp_path / "data"
    data.mkdir()
    (data / "empty.jsonl").write_text("")
    (data / "none.json").write_text("[]")
    (data / "dataset_info.json").write_text(json.dumps({"empty": {"file_name": "empty.jsonl"},
                                                        "none": {"file_name": "none.json"}}))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny_dir / "config.json", no_weights / "config.json")
    t5 = tmp_path / "t5"
    T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)) \
        .save_pretrained(t5)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = {
        "empty.jsonl is empty": dict(dataset="empty", dataset_dir=str(data)),
        "none.json holds no records": dict(dataset="none", dataset_dir=str(data)),
        "holds no weights": dict(model_name_or_path=str(no_weights)),
        "no such folder": dict(model_name_or_path=str(tmp_path / "nowhere" / "model")),
        "encoder-decoder": dict(model_name_or_path=str(t5)),
        "is a file": dict(output_dir=str(a_file)),
        "is a file, so no folder can be made under it": dict(output_dir=str(a_file / "sub")),
        "num_layers=0": dict(num_layers=0),
        "num_layers=9, but": dict(num_layers=9),
        "num_train_epochs=inf": dict(num_train_epochs=math.inf, max_steps=-1),
        "adam_epsilon=-1.0": dict(adam_epsilon=-1),
        "weight_decay=-0.5": dict(weight_decay=-0.5),
    }
    for expected, kw in cases.items():
        assert main(["train", str(yaml_config(tmp_path, tiny_dir, **kw)), "--no-progress"]) == 2, expected
        assert expected in one_error_line(capsys), expected
    assert not (tmp_path / "out").exists()   # nothing was created for the refused runs
    bad_key = tmp_path / "bad_key.yaml"
    bad_key.write_text(f"model_name_or_path: {tiny_dir}\n1: x\n")
    assert main(["train", str(bad_key)]) == 2 and "config key 1 (int)" in one_error_line(capsys)


def test_registry_entries_of_the_wrong_shape(tmp_path):
    from megacompile.train.data import load_registry
    info = tmp_path / "dataset_info.json"
    for text, message in [("[1, 2]", "holds a JSON list"), ('{"a": {"file_name": 5}}', r"file_name=5 \(int\)"),
                          ('{"a": {"file_name": "x.json", "columns": {"prompt": 3}}}', "columns must map"),
                          ('{"a": {"file_name": "x.json", "num_samples": 0}}', "num_samples=0")]:
        info.write_text(text)
        with pytest.raises(DataError, match=message):
            load_registry(tmp_path)


def test_read_only_output_dir_is_refused_first(tiny_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    import megacompile.train.run_dir as run_dir
    real = os.access
    monkeypatch.setattr(run_dir.os, "access", lambda p, mode: False if Path(p) == tmp_path else real(p, mode))
    assert main(["train", str(yaml_config(tmp_path, tiny_dir, model_name_or_path="nowhere/at-all")),
                 "--no-progress"]) == 2
    assert "cannot be written by this user" in one_error_line(capsys)


def test_cannot_fit_exits_3(tiny_dir, tmp_path, capsys):  # noqa: F811
    profile = tmp_path / "small_gpu.json"
    profile.write_text(json.dumps({"name": "small", "compute_tflops": 10, "h2d_gbps": 10, "d2h_gbps": 10,
                                   "device_memory_gib": 1.0, "host_memory_gbps": 10}))
    assert main(["train", str(yaml_config(tmp_path, tiny_dir, hardware=str(profile))), "--no-progress"]) == 3
    assert "does not fit" in one_error_line(capsys)


def test_config_loading_rejects_bad_yaml_shapes(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(path)
    path.write_text("model_name_or_path: m\ntrue: 1\n")
    with pytest.raises(ConfigError, match="config key True"):
        load_config(path)


# -- beyond the list ----------------------------------------------------------------------

def test_a_config_key_given_twice_and_a_non_utf8_config_are_refused(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: m\ndataset: d\noutput_dir: a\noutput_dir: b\n")
    assert main(["train", str(path)]) == 2
    assert "config key 'output_dir' is given twice (line 4)" in one_error_line(capsys)
    path.write_bytes(b"model_name_or_path: \xff\xfe\n")
    assert main(["train", str(path)]) == 2
    assert "is not UTF-8 text" in one_error_line(capsys)


def test_sigterm_unwinds_like_ctrl_c_and_the_run_resumes(tiny_dir, tmp_path):  # noqa: F811
    """Slurm's preemption or time limit sends SIGTERM: the run stops with exit 143 and one line,
    releases output_dir, and its checkpoints resume."""
    import signal
    import subprocess
    import sys
    import time
    # (a run far longer than the test: the signal always lands mid-run, however fast the steps are)
    cfg = yaml_config(tmp_path, tiny_dir, max_steps=100000, save_steps=2, per_device_train_batch_size=1)
    child = subprocess.Popen([sys.executable, "-m", "megacompile.cli", "train", str(cfg), "--no-progress"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    out, deadline = tmp_path / "out", time.time() + 300
    while not checkpoint.checkpoints(out) and child.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    child.send_signal(signal.SIGTERM)
    err = child.communicate(timeout=120)[1].decode()
    assert child.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("megatrain: terminated (SIGTERM)") and "Traceback" not in err
    lock = RunLock(out)
    lock.acquire()   # released: a second run may take the folder
    lock.release()
    done = checkpoint.checkpoints(out)[-1]
    assert main(["train", str(cfg), "--no-progress", "resume_from_checkpoint=true",
                 f"max_steps={checkpoint.step_of(done) + 1}"]) == 0


def test_a_run_that_failed_before_its_first_step_leaves_a_folder_that_is_still_a_run(tiny_dir, tmp_path,  # noqa: F811
                                                                                       monkeypatch):
    """TensorBoard's runs/ is written before the first step: a run that fails right after it must
    not leave a folder the next run calls foreign (and overwrite then removes the events)."""
    import megacompile.train.trainer as trainer
    monkeypatch.setattr(trainer, "device_peak", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        train(config(tiny_dir, tmp_path, report_to="tensorboard"), progress=False)
    out = tmp_path / "out"
    assert (out / "runs").is_dir() and (out / LOG_NAME).exists()
    monkeypatch.undo()
    # it saved nothing, so it is nothing to continue: the same command starts over (its runs/ retired)
    with pytest.raises(ConfigError, match="stopped before it saved a checkpoint: there is nothing to resume"):
        train(config(tiny_dir, tmp_path, report_to="tensorboard", resume_from_checkpoint=True), progress=False)
    train(config(tiny_dir, tmp_path, report_to="tensorboard", max_steps=1), progress=False)
    assert len(log_rows(out)) == 1
    (retired,) = (out / "retired").iterdir()
    assert retired.name.endswith("-unsaved-run") and (retired / "runs").is_dir()
