"""What a compile is doing while the first step waits: one line per stage, with the time since
it began, so a user never stares at a silent terminal.

    [megatrain] compiling LlamaForCausalLM: Dynamo traces the model (the first step and each new input shape)
    [megatrain]   traced at 2.1 s: 30 decoder layers; AOTAutograd differentiates and partitions the step
    [megatrain]   forward lowered at 9.8 s
    [megatrain]   backward lowered at 14.0 s
    [megatrain]   compiled in 14.2 s; running the step

Logged at INFO on `megatrain.compile`: `megatrain train` and the quickstart show it; `plan` and
`inspect` keep it quiet unless --verbose (their output is the answer). Dynamo compiles one frame
at a time, so one clock serves the compile in progress: the start callback (compile_start.py)
starts it, the backend's stages read it, the end callback stops it.
"""
from __future__ import annotations

import time

from .log import get

log = get("compile")


class Clock:
    def __init__(self) -> None:
        self.started: float | None = None

    def start(self, model_name: str) -> None:
        self.started = time.monotonic()
        log.info("[megatrain] compiling %s: Dynamo traces the model (the first step, and each new input shape)",
                 model_name)

    def at(self) -> str:
        return f"{time.monotonic() - self.started:.1f} s" if self.started is not None else "?"

    def stage(self, text: str) -> None:
        """A stage that ended: `text` may hold "{at}", the time since the compile began."""
        if self.started is not None:
            log.info("[megatrain]   %s", text.format(at=self.at()))

    def stop(self) -> None:
        if self.started is not None:
            log.info("[megatrain]   compiled in %s; running the step", self.at())
        self.started = None


CLOCK = Clock()
