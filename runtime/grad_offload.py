"""Gradient offload: a segment's finished gradients leave the device and are added into
`param.grad` (fp32, host) while the backward goes on with the next segment.

    compute stream:  ... body k ──┬── body k-1 ──┬── body k-2 ...
    D2H stream:                   └ copy grads k ┘└ copy grads k-1 ...      (CUDA: pinned, async)
    host worker:                        wait event, grads k += fp32 ...      (one thread, FIFO)

Without it each layer's copy and its fp32 conversion and accumulation (a pass over 6 bytes per
parameter in host memory, single-threaded) would run on the compute path between two bodies.
On CUDA the copies run on their own stream after the compute stream has produced the gradients
(`wait_stream`); the device tensors are marked as used by that stream (`record_stream`), so the
caching allocator does not hand their memory to the next body before the copy has read it; the
host copies land in pinned gradient slabs, a ring per layer kind registered once
(runtime/host_arena.py `GradSlabs`; a slab is reused once the landing that read it is done),
instead of a pinned block per gradient from torch's caching host allocator (routed expert rows,
whose count changes every step, still take that path). On the CPU ("device" = host) there is nothing to copy
and the worker does the accumulation, which still overlaps the next body.

Completion: the executor flags the offload that completes a weight's gradient for this backward
(its last contribution); once that contribution is in `param.grad` the functions registered with
`listen` are called with the weight's entry, on the worker (an optimizer armed to update each
layer during the backward, runtime/adamw.py).

Exactness: the same copies and the same fp32 additions in the same order as the synchronous
path (one worker, first in first out, so a tied weight's two contributions add in segment
order); `drain()` at the end of the backward returns only when every gradient is in place, so
`loss.backward()` hands the optimizer complete gradients. At most `max_pending` segments are in
flight, which bounds the pinned host memory; an error on the worker is raised by `drain()` or
the next `offload()`.
"""
from __future__ import annotations

import collections
import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .host_arena import GradSlabs

def _landing_threads() -> int:
    """Threads for a landing's torch ops (fp32 conversion and add). torch's OpenMP team size is
    per calling thread: left at its default, the worker would start a team as large as the
    training thread's, and with the optimizer's threads (HostAdamW.host_threads) during the
    backward the cores would be oversubscribed three times. Half of what is left after the
    training thread and one more. (On this 2-core CI machine 1 thread vs 2 measured the same.)"""
    return max(1, ((os.cpu_count() or 2) - 2) // 2)


class GradOffloader:
    """A program's gradient path to the host: its D2H stream, pinned slabs, one host worker
    thread (first in, first out: a tied weight's contributions add in segment order; every
    backward drains it before returning, so programs never interleave), and the listeners an
    optimizer registers for this program's gradients (`listen`)."""

    def __init__(self, device: torch.device, overlap: bool = True, max_pending: int = 2,
                 slabs: bool | None = None):
        """`slabs`: stage through pinned slab rings (None: on CUDA; True on the CPU is an extra
        copy there, for tests of the CUDA path's reuse)."""
        self.device = device
        self.overlap = overlap
        self.max_pending = max(1, max_pending)
        self.stream = torch.cuda.Stream(device) if overlap and device.type == "cuda" else None
        self.pending: collections.deque[Future] = collections.deque()
        # pinned staging per layer kind (runtime/host_arena.py): one more slab than landings in flight
        use_slabs = overlap and (slabs if slabs is not None else self.stream is not None)
        self.slabs = GradSlabs(self.max_pending + 1, pin=self.stream is not None) if use_slabs else None
        self.listeners: list = []   # fn(entry): that weight's gradient for this backward is complete
        self.guards: list = []      # guard() -> None, or why no forward or backward may run now
        self._worker: ThreadPoolExecutor | None = None
        weakref.finalize(self, _shutdown, self.__dict__)

    # listeners -------------------------------------------------------------------
    def listen(self, fn, guard=None) -> None:
        """Call `fn(entry)` each time a weight's gradient for the running backward is complete
        (on the worker); `guard()`, checked before every forward and backward of this program,
        may forbid them."""
        if fn not in self.listeners:
            self.listeners.append(fn)
            if guard is not None:
                self.guards.append(guard)

    def unlisten(self, fn, guard=None) -> None:
        if fn in self.listeners:
            self.listeners.remove(fn)
        if guard in self.guards:
            self.guards.remove(guard)

    def check_guards(self) -> None:
        for guard in list(self.guards):
            reason = guard()
            if reason:
                raise RuntimeError(reason)

    def _completed(self, entry) -> None:
        for fn in list(self.listeners):
            fn(entry)

    def worker(self) -> ThreadPoolExecutor:
        if self._worker is None:
            before = torch.get_num_threads()
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-grads",
                                              initializer=torch.set_num_threads, initargs=(_landing_threads(),))
            self._worker.submit(int).result()   # (its initializer has run)
            # torch.set_num_threads also sets the process-wide count that a thread reads when it
            # first runs a parallel op from another library (at::init_num_threads): left at the
            # worker's, the training thread shrank to it at its first call into the host AdamW
            # kernel, and Dynamo recompiled the whole model for the changed num_threads (its
            # global-state guard). Put back the calling thread's.
            torch.set_num_threads(before)
        return self._worker

    def offload(self, items: list[tuple["WeightEntry", torch.Tensor, list[int] | None, bool]]) -> int:  # noqa: F821
        """Send one segment's gradients (entry, device gradient, routed rows or None, whether
        this completes the weight's gradient) to `param.grad`; returns the bytes that cross the link."""
        if not self.overlap:
            moved = 0
            for entry, grad, rows, final in items:
                moved += entry.accumulate_grad(grad, rows)
                if final:
                    self._completed(entry)
            return moved
        # whole gradients go through a slab of their kind; routed rows (a different count every
        # step) through the allocator as before
        whole = [it for it in items if it[2] is None]
        slab = self.slabs.take([grad for _, grad, _, _ in whole]) if self.slabs is not None and whole else None
        views = dict(zip(map(id, whole), slab.views)) if slab is not None else {}
        non_blocking = self.stream is not None

        def stage(item):   # -> (entry, host tensor, rows, final, borrowed (a slab view), bytes moved)
            entry, grad, rows, final = item
            view = views.get(id(item))
            if view is None:
                host, moved = entry.stage_grad(grad, rows, non_blocking=non_blocking)
            else:
                host, moved = view.copy_(grad, non_blocking=non_blocking), grad.numel() * grad.element_size()
            return entry, host, rows, final, view is not None, moved

        # copies (and routed-row gathers) on the D2H stream, after the body that made the grads
        staged, event = self._staged(lambda: [stage(item) for item in items], [grad for _, grad, _, _ in items])
        future = self._queue(_land, event, [s[:5] for s in staged])
        if slab is not None:
            slab.busy = future
        return sum(s[5] for s in staged)

    def offload_pieces(self, items: list[tuple["WeightEntry", torch.Tensor | None, tuple | None, bool]]) -> int:  # noqa: F821
        """Data parallelism: send this rank's summed parts of one segment's gradients (entry,
        device fp32 part or None, its element range, whether this completes the weight's
        gradient) into the node's shared gradients; returns the bytes that cross the link."""
        non_blocking = self.stream is not None
        staged, event = self._staged(
            lambda: [(e, None if t is None else t.to("cpu", non_blocking=non_blocking), piece, final)
                     for e, t, piece, final in items], [t for _, t, _, _ in items if t is not None])
        moved = sum(t.numel() * t.element_size() for _, t, _, _ in items if t is not None)
        if not self.overlap:
            _land_pieces(None, staged, self._completed)
        else:
            self._queue(_land_pieces, event, staged)
        return moved

    def _staged(self, stage, tensors: list[torch.Tensor]) -> tuple[list, object]:
        """Run `stage()` (the device-to-host copies) on the D2H stream once the compute stream has
        made `tensors` (kept from the allocator until the copies read them): (its result, the event
        the landing waits for; None without a D2H stream)."""
        if self.stream is None:
            return stage(), None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            staged = stage()
            for t in tensors:
                t.record_stream(self.stream)
        event = torch.cuda.Event(blocking=True)   # (the worker sleeps in synchronize(), not spins:
        event.record(self.stream)                 # the host optimizer wants the cores)
        return staged, event

    def _queue(self, land, event, staged) -> Future:
        """Hand a landing to the worker once fewer than `max_pending` are in flight."""
        while len(self.pending) >= self.max_pending:
            self.pending.popleft().result()
        future = self.worker().submit(land, event, staged, self._completed)
        self.pending.append(future)
        return future

    def drain(self) -> None:
        """Return once every offloaded gradient is in `param.grad` (re-raises a worker error)."""
        while self.pending:
            self.pending.popleft().result()


def _land(event, staged, completed) -> None:
    if event is not None:
        event.synchronize()   # the copies into the pinned host tensors are complete
    for entry, host, rows, final, borrowed in staged:
        entry.add_host_grad(host, rows, borrowed)
        if final:
            completed(entry)


def _land_pieces(event, staged, completed) -> None:
    if event is not None:
        event.synchronize()
    for entry, host, piece, final in staged:
        entry.add_grad_piece(host, piece)
        if final:
            completed(entry)


def _shutdown(state: dict) -> None:
    """(the offloader was collected) its worker thread exits once idle"""
    worker = state.get("_worker")
    if worker is not None:
        worker.shutdown(wait=False)
