"""The training config's NVMe state tier keys (issue 18), checked before anything loads.

    nvme: gen5x4                       # an SSD profile as ssd.load_ssd takes it (null: no tier)
    nvme_paths: [/mnt/nvme0/mt, /mnt/nvme1/mt]   # where the tier's files go, one directory per drive
    nvme_placement: auto               # auto (the least that fits the host RAM), moments or all

They are top-level keys, not compile options: the tier is the optimizer's, not torch.compile's.
"""
from __future__ import annotations

from pathlib import Path

from ...errors import ConfigError

#: nvme_placement values ("none" is `nvme` left unset)
TIER_PLACEMENTS = ("auto", "moments", "all")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def model_folder(config) -> Path | None:
    """The local folder of model_name_or_path, if it is one (a Hub id or a preset is not)."""
    path = Path(str(config.model_name_or_path)).expanduser()
    return path.resolve() if path.is_dir() else None


def tier_dirs(config, profile_paths: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The directories the tier's files go into: nvme_paths, else the profile's paths; each an
    existing writable directory outside output_dir and the model folder (files there would be
    taken for the run's outputs, and megatrain never writes into a model folder)."""
    from ...ssd import check_tier_dirs
    given = config.nvme_paths if config.nvme_paths else list(profile_paths)
    if not given:
        raise ConfigError(f"nvme={config.nvme!r} needs nvme_paths: the directories the state tier's files go "
                          "into, one per drive (e.g. nvme_paths: [/mnt/nvme0/megatrain]), or a profile with paths.")
    dirs = check_tier_dirs(given, "nvme_paths")
    out = Path(str(config.output_dir)).expanduser().resolve()
    model = model_folder(config)
    for d in dirs:
        if _inside(Path(d), out):
            raise ConfigError(f"nvme_paths: {d} is inside output_dir {out}: put the state tier's working files on "
                              "another directory (they are not checkpoints).")
        if model is not None and _inside(Path(d), model):
            raise ConfigError(f"nvme_paths: {d} is inside the model folder {model}: megatrain never writes there; "
                              "give another directory.")
    return dirs


def check_tier_keys(config) -> None:
    """Refuse a bad nvme / nvme_paths / nvme_placement now (ConfigError, exit 2). A measure:
    profile's directories are checked here and measured only when training starts."""
    from ...ssd import check_ssd_spec
    if config.nvme_placement not in TIER_PLACEMENTS:
        raise ConfigError(f"nvme_placement={config.nvme_placement!r}: use one of {', '.join(TIER_PLACEMENTS)} "
                          "(leave nvme unset to keep everything in RAM).")
    if config.nvme is None:
        if config.nvme_paths is not None:
            raise ConfigError("nvme_paths is set but nvme is not: give the drives' profile too (nvme: gen5x4, a "
                              "JSON profile or measure:DIR), or remove nvme_paths.")
        if config.nvme_placement != "auto":
            raise ConfigError(f"nvme_placement={config.nvme_placement!r} needs nvme (the drives' profile, e.g. "
                              "nvme: gen5x4), or remove it.")
        return
    if config.nvme_paths is not None and not (
            isinstance(config.nvme_paths, list) and config.nvme_paths
            and all(isinstance(p, str) and p.strip() for p in config.nvme_paths)):
        raise ConfigError(f"nvme_paths={config.nvme_paths!r}: give a list of directories, one per drive (e.g. "
                          "[/mnt/nvme0/megatrain]).")
    tier_dirs(config, check_ssd_spec(config.nvme).paths)
