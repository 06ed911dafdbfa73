"""Where a run's scalars go besides the JSONL log: report_to's trackers (TensorBoard, Weights & Biases).

    reporter = open_reporter(config)          # before anything loads: a missing package is a ConfigError
    reporter.start(out, config)               # once output_dir is ready (TensorBoard under out/runs)
    reporter.log({"loss": 2.3, "lr": 1e-4}, step=10, prefix="train")   # -> train/loss, train/lr
    reporter.close()

`log` takes any dict: numbers (not bools) are sent, everything else (nested dicts, strings) is
skipped, so the loop can hand over the row it writes to the JSONL log. The JSONL log itself
(output_dir/train_log.jsonl) is written by the loop whatever report_to says: resume and the
loss plot read it.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError
from .hparams.config import REPORTS, TRACKERS  # noqa: F401 (API: report.REPORTS)

#: report_to values: trackers megatrain can write to ("jsonl" adds nothing: the log is always written)


def trackers(report_to: str | list[str]) -> list[str]:
    """The trackers report_to names: "tensorboard" -> [tensorboard], [jsonl, wandb] -> [wandb];
    "all" (as in Hugging Face: every installed integration) -> those whose package imports."""
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    if "all" in names:
        return [t for t in TRACKERS if _importable(t)]
    return [t for t in TRACKERS if t in names]


def _importable(name: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):   # (a module blocked in sys.modules, or half-installed)
        return False


def _writers(names: list[str]) -> dict[str, object]:
    """The tracker modules/classes, imported now so a missing package is said before the model loads."""
    out = {}
    for name in names:
        try:
            if name == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter
                out[name] = SummaryWriter
            else:
                import wandb
                out[name] = wandb
        except ImportError:
            package = {"tensorboard": "tensorboard", "wandb": "wandb"}[name]
            raise ConfigError(f"report_to: {name} needs the {package} package (pip install {package}), or leave "
                              f"{name} out of report_to (the JSONL log is always written).") from None
    return out


class Reporter:
    """Sends scalars to the configured trackers; with none it does nothing."""

    def __init__(self, writers: dict[str, object]):
        self._classes = writers
        self._open: dict[str, object] = {}

    @property
    def names(self) -> list[str]:
        return list(self._classes)

    def start(self, out: Path, config) -> None:
        """Open the trackers: TensorBoard events in out/runs; a wandb run named run_name (or after
        output_dir), kept on this machine under out/wandb with WANDB_MODE=offline."""
        if "tensorboard" in self._classes:
            self._open["tensorboard"] = self._classes["tensorboard"](str(out / "runs"))
        if "wandb" in self._classes:
            wandb = self._classes["wandb"]
            # (WANDB_PROJECT and the other WANDB_* variables are read by wandb itself, as with HF)
            self._open["wandb"] = wandb.init(project=os.environ.get("WANDB_PROJECT", "megatrain"),
                                             name=config.run_name or Path(config.output_dir).name, dir=str(out),
                                             config=config.to_dict())

    def log(self, scalars: dict, step: int, prefix: str = "train") -> None:
        """Send the numeric values of `scalars` as `prefix/key` at `step`."""
        numbers = {f"{prefix}/{k}": v for k, v in scalars.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if not numbers:
            return
        if "tensorboard" in self._open:
            for key, value in numbers.items():
                self._open["tensorboard"].add_scalar(key, value, step)
        if "wandb" in self._open:
            self._open["wandb"].log(numbers, step=step)

    def close(self) -> None:
        for name, writer in self._open.items():
            writer.finish() if name == "wandb" else writer.close()
        self._open = {}


def open_reporter(config) -> Reporter:
    """The Reporter for config.report_to, its packages imported (a missing one is a ConfigError)."""
    return Reporter(_writers(trackers(config.report_to)))
