"""megatrain's logging: one logger tree, `megatrain` (`megatrain.train`, `megatrain.passes`, ...).

    log = get("train")        # logging.getLogger("megatrain.train")
    log.info("[megatrain] 12 examples ...")
    console(verbose=True)     # the CLI: messages on standard output, DEBUG and up

The library configures nothing by itself; `console()` (called by the CLI and by
`megatrain.train.trainer.train`, whose run log is its user interface) attaches one handler that
writes plain messages to the standard output of the moment, INFO and up unless the level was
set otherwise (`--verbose`: DEBUG). It is attached once; messages then do not also propagate
to the root logger (no double lines in an application that logs itself).
"""
from __future__ import annotations

import contextlib
import logging
import sys

ROOT = "megatrain"


def get(name: str) -> logging.Logger:
    return logging.getLogger(f"{ROOT}.{name}")


class _Stdout(logging.StreamHandler):
    """A handler writing to sys.stdout as it is when a message is emitted (tests and
    contextlib.redirect_stdout replace it)."""

    def __init__(self):
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:   # (StreamHandler.__init__ sets it)
        pass


def console(verbose: bool = False) -> logging.Logger:
    """The `megatrain` logger with its console handler (added on the first call)."""
    logger = logging.getLogger(ROOT)
    if not any(isinstance(h, _Stdout) for h in logger.handlers):
        handler = _Stdout()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    if verbose:
        logger.setLevel(logging.DEBUG)
    elif logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    return logger


@contextlib.contextmanager
def quiet(name: str, when: bool = True):
    """`megatrain.<name>` shows only warnings and errors inside the block (when `when`)."""
    logger = get(name)
    level = logger.level
    if when:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
