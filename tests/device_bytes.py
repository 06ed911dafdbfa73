"""Device bytes of a compiled CPU training step, measured from the tensors themselves.

An accounting independent of the memory plan's liveness and of the executor's own counters:
a TorchDispatchMode, active while the executor runs a direction (DirectionRunner.__call__),
records every storage an op allocates (outputs that are neither views nor one of the op's
inputs) and drops it when the last tensor on it dies (weakref finalizers), views included (a
view, or `_unsafe_view`'s output, keeps its base's storage alive). The timeline is kept,
so storages that turn out to be host memory (parameters' `.grad`, accumulated on the host) can
be left out afterwards. The weight pool's CPU free list (a stand-in for a caching allocator's
reserve: evicted buffers kept for reuse) is turned off, so an evicted slot is freed memory.

    with measure_step(model) as probe:
        cmodel(**batch).loss.backward()
    probe.peak(exclude=host_grads(probe, model))
"""
from __future__ import annotations

import contextlib
import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class LiveStorages(TorchDispatchMode):
    supports_higher_order_operators = True   # (run_and_save_rng_state in the bodies: run as is)

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}       # storage address -> [allocation number, bytes, tensors]
        self.events: list[tuple[int, int]] = []    # (allocation number, +bytes allocated / -bytes freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = set() if getattr(func, "is_view", False) else \
            {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            if _key(t) in self.live:   # a view (or `_unsafe_view`) of a storage counted: one more holder
                self._hold(t)
            elif _key(t) not in inputs and not getattr(func, "is_view", False):
                self._see(t)
        return out

    def _hold(self, t: torch.Tensor) -> None:
        key = _key(t)
        self.live[key][2] += 1
        weakref.finalize(t, self._release, key)

    def _see(self, t: torch.Tensor) -> None:
        key = _key(t)
        if key not in self.live:   # (an address is reused after a free: allocations are numbered)
            self.live[key] = [len(self.events), t.untyped_storage().nbytes(), 0]
            self.events.append((self.live[key][0], self.live[key][1]))
        self.live[key][2] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[2] -= 1
        if entry[2] == 0:
            self.events.append((entry[0], -entry[1]))
            del self.live[key]

    def allocations_of(self, tensors) -> set[int]:
        """The allocation numbers of the storages of `tensors` (alive now)."""
        return {self.live[_key(t)][0] for t in tensors if _key(t) in self.live}

    def peak(self, exclude=frozenset()) -> int:
        """The most bytes live at once, leaving out the allocations numbered in `exclude`."""
        now = peak = 0
        for number, n in self.events:
            if number not in exclude:
                now += n
                peak = max(peak, now)
        return peak


class _NoCache(dict):
    """The pool's free list, keeping nothing: an evicted buffer dies with its last view."""

    def setdefault(self, key, default=None):
        return []


@contextlib.contextmanager
def measure_step(program):
    """Measure what the executor allocates while the block runs (forward and backward)."""
    from megacompile.runtime.executor import DirectionRunner
    probe = LiveStorages()
    original = DirectionRunner.__call__

    def call(runner, args):
        if runner.program is not program:
            return original(runner, args)
        with probe:
            return original(runner, args)
    program.pool._free = _NoCache()
    DirectionRunner.__call__ = call
    # no cycle collection during the step: it would free cyclic garbage at moments that vary from
    # run to run (the count would too); what only a collection frees then counts as live
    gc.collect()
    gc.disable()
    try:
        yield probe
    finally:
        gc.enable()
        DirectionRunner.__call__ = original


def host_grads(probe: LiveStorages, model) -> set[int]:
    """The allocations of the parameters' gradients (host memory, not device)."""
    return probe.allocations_of(p.grad for p in model.parameters() if p.grad is not None)
