"""The memory choices of a plan at batch 1, as the backend's search under `device_budget` makes
them (megacompile/backend.py `_compile_within_budget`): layer checkpoints on the host when
batch 1 does not fit with them on the device, then 2x, 4x, ... the sequence tiles while a
doubling lowers the peak by TILE_GAIN, then late checkpoint reloads.

    m, options, on_host = choose_memory(m, options, capacity, capture, config, seq)

Each candidate is a recapture of the prefix model (plan_capture.py): at batch 2 first, and at
batch 4 only when it helps (a capture at 2M tokens takes tens of seconds).
"""
from __future__ import annotations

import warnings
from typing import Callable

from .passes.tile_mlp import MAX_BUDGET_TILES, TILE_GAIN, auto_tiles
from .plan_capture import Capture, PrefixModel


def mlp_tiles(config, options: dict, tokens: int) -> int:
    """The MLP tile count a run at a sequence of `tokens` gets (passes/tile_mlp.py)."""
    tiles = options.get("mlp_tiles", "auto")
    if isinstance(tiles, int):
        return tiles
    text = config.get_text_config(decoder=True)
    hidden, inter = getattr(text, "hidden_size", 0), getattr(text, "intermediate_size", 0)
    return auto_tiles(tokens, hidden, inter) if hidden and isinstance(inter, int) and inter else 1


def choose_memory(m: PrefixModel, options: dict, capacity: int, capture: Callable[[int, dict, str], Capture],
                  config, seq: int) -> tuple[PrefixModel, dict, bool]:
    """(the prefix model chosen, its compile options, whether the checkpoints are on the host);
    `capture(batch, options, why)` compiles the prefix."""
    def model(opts: dict, why: str, at2: Capture | None = None) -> PrefixModel:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            at2 = at2 or capture(2, opts, why)
            return PrefixModel(m.kinds, m.k, at2, capture(4, opts, why), m.hw)

    checkpoints_on_host = options.get("offload_checkpoints") == "always"
    if options.get("offload_checkpoints", "auto") == "auto" and m.device_peak(1) > capacity:
        offloading = {**options, "offload_checkpoints": "always"}
        moved = model(offloading, ", layer checkpoints on the host")
        if moved.device_peak(1) < m.device_peak(1):
            m, options, checkpoints_on_host = moved, offloading, True

    def better(opts: dict, why: str) -> PrefixModel | None:   # (None: batch 2 gains under TILE_GAIN)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            at2 = capture(2, opts, why)
        if max(d.peak for d in at2.directions.values()) > (1 - TILE_GAIN) * max(
                d.peak for d in m.a.directions.values()):
            return None
        return model(opts, why, at2)

    if options.get("mlp_tiles", "auto") == "auto" and m.device_peak(1) > capacity:
        tiles = max(1, mlp_tiles(config, options, seq))
        while m.device_peak(1) > capacity and tiles < min(MAX_BUDGET_TILES, seq):
            tiles *= 2
            tiled = {**options, "mlp_tiles": tiles}
            if (more := better(tiled, f", its layers in {tiles} sequence tiles")) is None:
                break
            m, options = more, tiled
    if options.get("reload_checkpoints", "auto") == "auto" and checkpoints_on_host and m.device_peak(1) > capacity:
        late = {**options, "reload_checkpoints": "late"}
        if (later := better(late, ", checkpoints reloaded just before their backward")) is not None:
            later.late_reload = True
            m, options = later, late
    return m, options, checkpoints_on_host
