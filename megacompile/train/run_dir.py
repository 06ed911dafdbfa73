"""The output folder of a training run: one run per folder, and nothing of anyone else's touched.

    with RunDir(config) as run:        checks, then holds output_dir/.megatrain.lock until the block ends
        run.resume_from                the checkpoint to continue from (resume_from_checkpoint), or None
        ...                            model, data, compile: anything may still fail, nothing was deleted
        run.start(step)                right before the first training step: the old run's files go
                                       (overwrite_output_dir), or the checkpoints newer than the resume
                                       point are retired into retired/<time>-from-step-N/ (renamed, never
                                       deleted), with the log as it was

Refused before anything is written: an output_dir that is a file or cannot be written, the
model's own folder (or a folder inside it), a non-empty folder that holds no megatrain run
(unless overwrite_output_dir: true, which then writes into it without deleting anything of its
own), a run's folder without resume_from_checkpoint or overwrite_output_dir, and a folder that
another live run holds (an exclusive `flock` that the kernel releases when the process ends, so
a killed run leaves no lock behind; the file says which pid on which host holds it).

What overwrite_output_dir may remove is only what a megatrain run provably wrote (`run_files`):
checkpoint-N folders whose trainer.json is megatrain's, the log, and the files the last export's
manifest lists with the sizes it wrote them at. Everything else in the folder is kept; a kept
file that the run would write over (a name its export or checkpoints use: another tool's
config.json, model.safetensors, checkpoint-500) refuses the run, naming it. Nothing that holds an
input of the run (the model, the data, the checkpoint it resumes from) is ever removed: such a
run is refused before it starts. A folder whose earlier run saved nothing (interrupted before
its first checkpoint: a log and no checkpoint or export) is not a run to continue: the same
command starts over, and that log is moved to retired/ first.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

from ..errors import ConfigError
from .checkpoint import format as checkpoint

LOCK = ".megatrain.lock"
LOG_NAME = "train_log.jsonl"
EXPORT_MANIFEST = "megatrain_export.json"   # which files the final export wrote (so a later overwrite removes them)
RETIRED = "retired"
_RUN_FILE = re.compile(r"^checkpoint-\d+(\.tmp|\.prev)?$")


def _describe(path: Path) -> str:
    try:
        return json.loads(path.read_text() or "{}").get("holder", "") or "an unknown process"
    except (OSError, ValueError):
        return "an unknown process"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """An exclusive lock on a folder: `.megatrain.lock` held with flock (released by the kernel
    when the holder exits, even by kill -9), holding "pid N on host H since T" for the message.
    On a file system without flock the pid/host in the file decide: a dead pid on this host is a
    stale lock, taken over."""

    def __init__(self, folder: Path):
        self.path = folder / LOCK
        self.fd: int | None = None
        self.note = ""   # what acquire() found (a stale lock), for the log

    def acquire(self) -> None:
        import fcntl
        holder = f"pid {os.getpid()} on host {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ConfigError(f"output_dir {self.path.parent} is in use by another megatrain run "
                                  f"({_describe(self.path)}): wait for it to end, or use another output_dir.") from None
            except OSError as e:   # no flock here (some network file systems): pid and host decide
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    os.close(fd)
                    raise
                self._without_flock(fd)
            try:   # the file we locked may be one that the previous holder unlinked as we opened it
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            previous = os.read(fd, 4096).decode(errors="replace")
            if previous.strip():
                self.note = (f"a lock left by a run that ended without releasing it ({_describe(self.path)}) "
                             "was taken over")
            os.lseek(fd, 0, os.SEEK_SET)
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"holder": holder, "pid": os.getpid(), "host": socket.gethostname(),
                                     "command": " ".join(sys.argv)[:500]}).encode())
            os.fsync(fd)
            self.fd = fd
            return

    def _without_flock(self, fd: int) -> None:
        try:
            info = json.loads(os.read(fd, 4096).decode() or "{}")
        except ValueError:
            info = {}
        os.lseek(fd, 0, os.SEEK_SET)
        pid, host = info.get("pid"), info.get("host")
        if pid is None:
            return
        if host != socket.gethostname() or _pid_alive(int(pid)):
            os.close(fd)
            raise ConfigError(f"output_dir {self.path.parent} is in use by another megatrain run "
                              f"({info.get('holder')}); "
                              f"if that run is gone, delete {self.path} and start again.")

    def release(self) -> None:
        if self.fd is not None:
            try:
                self.path.unlink()   # while still holding it: a waiting opener sees another inode and retries
            except FileNotFoundError:
                pass
            os.close(self.fd)
            self.fd = None


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _model_folder(source: str) -> Path | None:
    if source.startswith("embedded:"):
        from ..embedded import default_cache_dir
        return default_cache_dir().resolve()
    path = Path(source).expanduser()
    return path.resolve() if path.exists() else None


def _exported(out: Path) -> list[str]:
    """The files the last export wrote that are still as it wrote them (its manifest lists them
    with their sizes: a file replaced since is not ours any more; an earlier megatrain's manifest
    has no sizes and is believed by name)."""
    try:
        manifest = json.loads((out / EXPORT_MANIFEST).read_text())
        files, sizes = manifest.get("files", []), manifest.get("sizes")
    except (OSError, ValueError, AttributeError):
        return []
    names = [f for f in files if isinstance(f, str) and "/" not in f and f not in ("", ".", "..")]
    if not isinstance(sizes, dict):
        return names
    return [f for f in names if sizes.get(f) is None or
            ((out / f).is_file() and not (out / f).is_symlink() and (out / f).stat().st_size == sizes[f])]


#: written into output_dir by report_to's trackers (report.py)
TRACKER_DIRS = ("runs", "wandb")
PLOT = "training_loss.png"
EXPORT_TMP = ".export.tmp"
#: what a run's final export may write (trainer._export: save_pretrained of the model or the
#: adapter, of the tokenizer or processor, and merged/): a file of these names that no megatrain
#: run wrote would be replaced, so it refuses the run instead
EXPORT_NAMES = frozenset({
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "adapter_model.safetensors", "adapter_config.json", "README.md", "merged",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
    "chat_template.json", "additional_chat_templates", "preprocessor_config.json", "processor_config.json",
    "video_preprocessor_config.json", EXPORT_MANIFEST, LOG_NAME, PLOT, EXPORT_TMP, LOCK})
_RETIRED_NAME = re.compile(r"^\d{8}-\d{6}-(from-step-\d+|unsaved-run)$")
_SHARD = re.compile(r"^model-\d+-of-\d+\.safetensors$")


def may_write(name: str) -> bool:
    """Whether a run may write a file or folder of this name into its output_dir."""
    return name in EXPORT_NAMES or bool(_SHARD.match(name) or _RUN_FILE.match(name))


def _our_log(path: Path) -> bool:
    """A train_log.jsonl megatrain wrote: empty (touched at the start) or rows of JSON with a
    step (a kill may have torn the last line)."""
    if not path.is_file() or path.is_symlink():
        return False
    rows, bad = read_log(path)
    return bad <= 1 and (bool(rows) or not path.read_text(errors="replace").strip())


def run_files(out: Path) -> list[Path]:
    """What in `out` a megatrain run provably wrote (see the module docstring)."""
    if not out.is_dir():
        return []
    exported = set(_exported(out))
    log = _our_log(out / LOG_NAME)
    saved = [p for p in out.iterdir() if _RUN_FILE.match(p.name) and p.is_dir() and not p.is_symlink()
             and checkpoint.is_megatrain(p)]
    retired = out / RETIRED
    proven = log or bool(saved) or (out / EXPORT_MANIFEST).is_file() or (
        retired.is_dir() and any(retired.iterdir()) and all(_RETIRED_NAME.match(p.name) for p in retired.iterdir()))
    # a checkpoint-N.tmp (a save a kill cut short) or .export.tmp is the run's when the folder
    # holds one; the trackers' folders (report_to: tensorboard, wandb) only next to its log: a
    # `runs/` of some other tool's output folder is not ours to delete
    partial = [p for p in out.iterdir() if proven and p.is_dir() and not p.is_symlink()
               and (p.name.endswith(".tmp") and _RUN_FILE.match(p.name) or p.name in (EXPORT_TMP, RETIRED))]
    tops = ([LOG_NAME, PLOT, *TRACKER_DIRS] if log else []) + ([EXPORT_MANIFEST, *sorted(exported)] if exported else [])
    return saved + partial + [out / n for n in dict.fromkeys(tops) if (out / n).exists()]


def _saved_nothing(run: list[Path]) -> bool:
    """An earlier run that wrote its log and nothing to continue from (no checkpoint, no export)."""
    return bool(run) and all(p.name in (LOG_NAME, PLOT, RETIRED, *TRACKER_DIRS) for p in run)


def read_log(path: Path) -> tuple[list[dict], int]:
    """The rows of a train_log.jsonl and how many lines could not be read (a kill during a write
    leaves a torn last line)."""
    rows, bad = [], 0
    if not path.exists():
        return rows, bad
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def rewrite_log(path: Path, step: int) -> tuple[int, int]:
    """Keep the rows up to `step` (the checkpoint a run resumes from), atomically; returns
    (rows dropped, torn lines dropped)."""
    rows, bad = read_log(path)
    keep = [r for r in rows if r["step"] <= step]
    if len(keep) == len(rows) and not bad:
        return 0, 0
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in keep))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(rows) - len(keep), bad


class RunDir:
    def __init__(self, config):
        self.config = config
        self.out = Path(config.output_dir).expanduser()
        self.lock = RunLock(self.out)
        self.created: list[Path] = []   # folders this run made (removed again if it writes nothing)
        self.resume_from: Path | None = None
        self.replace_run = False   # overwrite_output_dir over an earlier run: its files go at start()
        self.unsaved: list[Path] = []   # an earlier run's log that saved nothing: retired at start()
        self.notes: list[str] = []

    # -- checks, before anything is written ----------------------------------------------------
    def check(self) -> None:
        """Everything about output_dir that can be refused without touching it."""
        cfg, out = self.config, self.out
        if out.exists() and not out.is_dir():
            raise ConfigError(f"output_dir {out} is a file: set output_dir to a folder (it is created if missing).")
        existing = next((p for p in [out, *out.parents] if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise ConfigError(f"output_dir {out}: {existing} is a file, so no folder can be made under it; choose "
                              "another output_dir.")
        if existing is None or not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"output_dir {out}: {existing} cannot be written by this user; choose a folder you "
                              "can write to.")
        model = _model_folder(cfg.model_name_or_path)
        if model is not None and _inside(out.resolve(), model):
            raise ConfigError(f"output_dir {out} is "
                              f"{'the model folder' if out.resolve() == model else 'inside the model folder'} "
                              f"{model}: the run would write over the model it reads. Choose another output_dir.")

    def _decide(self) -> None:
        """(under the lock) what this run does with the folder's contents."""
        cfg, out = self.config, self.out
        notes = checkpoint.recover(out)
        self.notes += notes
        run = run_files(out)
        foreign = [p.name for p in out.iterdir() if p.name != LOCK and p not in run] if out.is_dir() else []
        if cfg.overwrite_output_dir and foreign:
            self._check_kept(foreign)
        resume = cfg.resume_from_checkpoint
        if resume not in (None, False):
            if resume is True:
                found = checkpoint.checkpoints(out)
                if not found and _saved_nothing(run):
                    raise ConfigError(f"resume_from_checkpoint: true, but the earlier run in {out} stopped before it "
                                      "saved a checkpoint: there is nothing to resume. Run the same config without "
                                      "resume_from_checkpoint: it starts over in that folder.")
                if not found:
                    raise ConfigError(f"resume_from_checkpoint: true, but {out} holds no complete checkpoint.")
                self.resume_from = found[-1]
                return
            path = Path(str(resume)).expanduser()
            if not path.is_dir():
                raise ConfigError(f"resume_from_checkpoint={str(path)!r} does not exist (or is not a folder).")
            if path.resolve().parent != out.resolve() and run:
                raise ConfigError(f"resume_from_checkpoint={str(path)!r} is another run's checkpoint, but output_dir "
                                  f"{out} holds a run of its own: continue into an empty output_dir.")
            if path.resolve().parent != out.resolve() and foreign and not cfg.overwrite_output_dir:
                raise self._foreign(foreign)
            self.resume_from = path
            return
        if run and _saved_nothing(run) and not cfg.overwrite_output_dir:
            self.unsaved = run   # (nothing to continue: the same command starts over)
            if foreign:
                raise self._foreign(foreign)
            return
        if run:
            self._check_inputs(run)
            if not cfg.overwrite_output_dir:
                raise ConfigError(f"output_dir {out} already holds a run: set resume_from_checkpoint: true to continue "
                                  "it, or overwrite_output_dir: true to start over (its checkpoints and log are "
                                  "deleted when the new run's first step starts).")
            self.replace_run = True
        elif foreign and not cfg.overwrite_output_dir:
            raise self._foreign(foreign)

    def _inputs(self) -> list[tuple[str, Path]]:
        """The run's inputs on disk, (key, resolved path): nothing that holds one is removed."""
        cfg, found = self.config, []
        for key in ("model_name_or_path", "dataset_dir", "media_dir", "tokenized_path"):
            value = getattr(cfg, key, None)
            if value and not str(value).startswith("embedded:") and Path(str(value)).expanduser().exists():
                found.append((key, Path(str(value)).expanduser().resolve()))
        if cfg.resume_from_checkpoint not in (None, False, True):
            found.append(("resume_from_checkpoint", Path(str(cfg.resume_from_checkpoint)).expanduser().resolve()))
        try:   # (a data file registered outside dataset_dir)
            from ..errors import MegatrainError
            from .data.registry import load_registry
            from .data.sources import data_path
            for name, attr in load_registry(cfg.dataset_dir, cfg.datasets).items():
                if attr.load_from == "file":
                    found.append((f"the data set {name!r}",
                                  data_path(attr, cfg.dataset_dir, cfg.allow_outside_dataset_dir).resolve()))
        except (MegatrainError, OSError):   # (a bad registry is refused later, with its own message)
            pass
        return found

    def _check_inputs(self, run: list[Path]) -> None:
        """Refuse an overwrite that would delete what this run reads: `OUT/checkpoint-2` as the
        model_name_or_path of a new run in OUT (its starting weights would be gone)."""
        if not self.config.overwrite_output_dir:
            return
        for p in run:
            if p.name == RETIRED:   # (never deleted)
                continue
            for key, path in self._inputs():
                if _inside(path, p.resolve()):
                    raise ConfigError(f"overwrite_output_dir: true would delete {p}, which holds this run's "
                                      f"{key} ({path}): move it out of {self.out} and point {key} there, or choose "
                                      "another output_dir.")

    def _check_kept(self, foreign: list[str]) -> None:
        """overwrite_output_dir over files megatrain did not write: they are kept, unless the run
        would write over them (then it is refused: which files, and why)."""
        hit = sorted(n for n in foreign if may_write(n))
        if hit:
            shown = ", ".join(hit[:6]) + (" ..." if len(hit) > 6 else "")
            raise ConfigError(f"output_dir {self.out} holds {shown}, which no megatrain run wrote there (no "
                              f"{'megatrain trainer.json in it, nor ' if any(_RUN_FILE.match(n) for n in hit) else ''}"
                              f"a listing in {EXPORT_MANIFEST}) and this run's checkpoints or export would replace: "
                              "overwrite_output_dir removes only a megatrain run's files. Move them out, or choose "
                              "another output_dir.")
        shown = ", ".join(sorted(foreign)[:5]) + (" ..." if len(foreign) > 5 else "")
        self.notes.append(f"overwrite_output_dir: {len(foreign)} file(s) in {self.out} that megatrain did not write "
                          f"are kept ({shown})")

    def _foreign(self, names: list[str]) -> ConfigError:
        shown = ", ".join(sorted(names)[:5]) + (" ..." if len(names) > 5 else "")
        return ConfigError(f"output_dir {self.out} is not empty and holds no megatrain run ({shown}): use an empty or "
                           "new folder, or set overwrite_output_dir: true to write into it (files megatrain did not "
                           "write are kept, and one the run would write over stops it before it starts).")

    def __enter__(self) -> "RunDir":
        self.check()
        try:
            missing = [p for p in [self.out, *self.out.parents] if not p.exists()]
            self.out.mkdir(parents=True, exist_ok=True)
            self.created = missing
            self.lock.acquire()
        except OSError as e:   # e.g. a read-only file system, a full disk
            self.__exit__(None, None, None)
            raise ConfigError(f"output_dir {self.out} cannot be written ({e.strerror or e}): choose a folder you can "
                              "write to.") from None
        try:
            if self.lock.note:
                self.notes.append(self.lock.note)
            self._decide()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()
        for folder in self.created:   # a run that stopped before writing anything leaves no empty folder behind
            try:
                folder.rmdir()
            except OSError:
                break

    # -- right before the first step -----------------------------------------------------------
    def start(self, step: int) -> list[str]:
        """Delete the replaced run's files, or retire the checkpoints a resumed branch leaves
        behind (newer than `step`). Returns what was done, for the log."""
        out, done = self.out, []
        self.created = []
        if self.unsaved:
            rows, _ = read_log(out / LOG_NAME)
            dest = out / RETIRED / f"{time.strftime('%Y%m%d-%H%M%S')}-unsaved-run"
            moved = []
            for p in self.unsaved:
                if p.name == RETIRED or not p.exists():
                    continue
                if p.name == LOG_NAME and not rows and p.stat().st_size == 0:
                    p.unlink()   # (an empty log: nothing to keep)
                    continue
                dest.mkdir(parents=True, exist_ok=True)
                os.replace(p, dest / p.name)
                moved.append(p.name)
            done.append("the earlier run in this folder stopped before its first checkpoint: starting over"
                        + (f" (its {', '.join(moved)} moved to {dest})" if moved else ""))
            return done
        if self.replace_run:
            runs = out / "runs"   # the old run's TensorBoard events (only if that is all it holds)
            events = runs.is_dir() and all(f.name.startswith("events.out.tfevents") for f in runs.rglob("*")
                                           if f.is_file())
            # (tracker folders go only when they hold nothing but TensorBoard events; an old wandb/
            # stays: the new run adds its own run folder to it)
            ours = [p for p in run_files(out) if p.name not in TRACKER_DIRS]
            for p in ours + ([runs] if events else []):
                if p.name == RETIRED or not p.exists():
                    continue
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                done.append(p.name)
            return [f"overwrite_output_dir: removed the earlier run's {', '.join(sorted(done))}"] if done else []
        newer = [p for p in checkpoint.checkpoints(out) if checkpoint.step_of(p) > step]
        rows, _ = read_log(out / LOG_NAME)
        if newer or any(r["step"] > step for r in rows):
            stamp = time.strftime("%Y%m%d-%H%M%S")
            dest = out / RETIRED / f"{stamp}-from-step-{step}"
            dest.mkdir(parents=True, exist_ok=False)
            for p in newer:
                os.replace(p, dest / p.name)
            if (out / LOG_NAME).exists():
                shutil.copy2(out / LOG_NAME, dest / LOG_NAME)
            names = ", ".join(p.name for p in newer) or "no checkpoints"
            done.append(f"resuming at step {step} leaves the later steps of the earlier run: moved {names} and a "
                        f"copy of its log to {dest}")
        dropped, torn = rewrite_log(out / LOG_NAME, step)
        if torn:
            done.append(f"{LOG_NAME}: dropped {torn} line(s) that a kill had torn")
        return done
