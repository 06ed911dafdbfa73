"""Ctrl-C and SIGTERM: one exception in the main thread, one line on the terminal.

    with interrupts.handled():      SIGINT raises KeyboardInterrupt, SIGTERM raises Terminated,
        ...                         once; the block unwinds (a step in flight is discarded, the
                                    output_dir lock released, the checkpoints stay complete)

Only the first signal raises. One that arrives while the run unwinds is ignored: raised again,
it would land in whatever cleanup or finalizer runs at that moment (torch's, datasets') and
print "Exception ignored in ... Traceback ... KeyboardInterrupt" before our one line. If the
first one's exception lands in a finalizer itself (Python drops it there, and the run would go
on), the signal is delivered again. A third
Ctrl-C ends the process at once (exit 130), for a cleanup that hangs. A process forked from this
one (datasets' worker pool while tokenizing) inherits the handlers, but its parent ends it with
SIGTERM: there a signal does what it does by default, or the pool's workers turn it into an
exception and the parent waits for them forever.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

EXIT_INTERRUPTED = 130   # 128 + SIGINT
EXIT_TERMINATED = 143    # 128 + SIGTERM, as a shell reports a process the signal ended


class Terminated(KeyboardInterrupt):
    """SIGTERM (Slurm's preemption and time limit, `kill`, a container stop), raised in the main
    thread so the run unwinds as on Ctrl-C."""


class _Handler:
    """The handler of both signals in process `pid` (see the module docstring)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.count = 0
        self.raised: tuple[int, BaseException] | None = None   # the first signal and what it raised

    def __call__(self, signum, frame):
        if os.getpid() != self.pid:   # a forked child: the default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.count += 1
        if self.count == 1:
            exc = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
            self.raised = (signum, exc)
            raise exc
        if self.count >= 3:
            os._exit(EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_TERMINATED)

    def swallowed(self, exc: BaseException) -> None:
        """The first signal's exception was raised inside a finalizer (the handler runs wherever
        the main thread is), where Python prints and drops it, and the run would go on: deliver
        the signal again, to land in the run's own code."""
        if self.raised is not None and self.raised[1] is exc and self.count == 1:
            self.count, signum, self.raised = 0, self.raised[0], None

            def again():   # (from a thread, a moment later: raised now, it would land in this hook)
                time.sleep(0.05)
                os.kill(self.pid, signum)
            threading.Thread(target=again, daemon=True, name="megatrain-signal-again").start()


def _quiet_unraisable(previous, handler: _Handler):
    """sys.unraisablehook that drops a KeyboardInterrupt raised in a finalizer (there is nothing
    the user can do with its traceback; the first signal's is delivered again) and passes
    everything else on."""
    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            handler.swallowed(unraisable.exc_value)
            return
        previous(unraisable)
    return hook


@contextlib.contextmanager
def handled():
    """Install the handlers for the block (the main thread only: signal handlers live there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = _Handler(os.getpid())
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    hook = sys.unraisablehook
    sys.unraisablehook = _quiet_unraisable(hook, handler)
    try:
        yield
    finally:
        # (restored only after the block's exception was handled by the caller's `except`: the
        # caller prints its one line inside this block)
        for s, h in previous.items():
            signal.signal(s, h)
        sys.unraisablehook = hook
