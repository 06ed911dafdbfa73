"""What the trainer does differently as one of several ranks (megacompile/distributed.py):
what the ranks other than 0 know of output_dir, and what does not run with more than one rank.
"""
from __future__ import annotations

from pathlib import Path

from ..distributed import Topology
from ..errors import ConfigError
from .hparams.config import TrainConfig


class Follower:
    """What a rank other than 0 knows of output_dir: where it is and what rank 0 resumes."""

    def __init__(self, config: TrainConfig, resume_from):
        self.out = Path(config.output_dir).expanduser()
        self.resume_from = resume_from
        self.notes: list[str] = []

    def start(self, step: int) -> list[str]:
        return []


def check_config(config: TrainConfig, topo: Topology) -> None:
    """What does not run with more than one rank yet (ConfigError before anything loads)."""
    if not topo.enabled:
        return
    off = [(key, why) for key, on, why in (
        ("nvme", config.nvme is not None, "the state tier"),
        ("streaming", config.streaming, "streamed data"),
    ) if on]
    if off:
        key, why = off[0]
        raise ConfigError(f"{key}: {why} does not run with more than one rank yet ({topo.world} ranks here). Run it "
                          "in one process, or leave it out.")
