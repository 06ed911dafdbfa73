"""Device weight pool: holds the weights of at most `slots` segments on the device.

`fetch` copies a segment's transfer copies into one flat device buffer and hands out views (one
copy when they sit in a host arena row with the buffer's layout, runtime/host_arena.py);
`evict` releases the buffer. On CUDA the caching allocator recycles the block (identical layers
ask for identical sizes). On the CPU a fresh large allocation is a fresh mmap whose pages fault
in on first touch, so the pool recycles released buffers itself, but only when no view of the
old weights survives (a surviving view would otherwise see the next layer's weights). On CUDA
the copy runs on a dedicated stream and `wait` makes the compute stream wait on its event; on
the CPU copies are synchronous and `wait` is free.

A resident segment goes through two states, checked where a transition is expected:

    fetch -> COPYING --(gather: data parallelism's collectives start)--> COPYING
          --wait--> READY --(views: read by the bodies; run any number of times)--> evict
"""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field

import torch

from ..errors import ResidencyError
from . import expert_rows

_ALIGN = 256


def layout(tensors) -> tuple[list[int], int]:
    """Byte offsets of (shape, dtype) pairs packed in order, each aligned to 256 bytes, and the
    total: the slot buffer's layout, which host arena rows (runtime/host_arena.py) share."""
    offsets, total = [], 0
    for shape, dtype in tensors:
        offsets.append(total)
        total += -(-int(torch.Size(shape).numel()) * dtype.itemsize // _ALIGN) * _ALIGN
    return offsets, total


class Residency(enum.Enum):
    COPYING = "copying"   # fetched: its copy (and under data parallelism its collectives) may be in flight
    READY = "ready"       # waited for: the bodies may read its views


@dataclass
class Resident:
    buffer: torch.Tensor
    views: dict[int, torch.Tensor]
    nbytes: int
    event: object = None
    routed: list = None        # views whose rows are fetched by routing
    gather: tuple = None       # data parallelism: (row bytes to all-gather, end of the rest to all-reduce)
    works: list = field(default_factory=list)   # its collectives in flight (waited for by `wait`)
    state: Residency = Residency.COPYING

    def expect(self, key: int, *states: Residency, doing: str) -> None:
        """A transition the schedule must only ask for in `states` (a program bug otherwise)."""
        if self.state not in states:
            raise ResidencyError(f"segment {key}: {doing} while its weights are {self.state.value} (expected "
                                 f"{' or '.join(s.value for s in states)}): the schedule's transfer ops are out of "
                                 "order")


def _sum_owned(res: Resident, head: int, end: int, group) -> list:
    """All-reduce (sum) each weight outside the row in its own dtype (a sum of bytes would carry
    between elements), in place: they are contiguous views of the buffer. Returns the works."""
    import torch.distributed as dist
    return [dist.all_reduce(view, group=group, async_op=True) for view in res.views.values()
            if head <= view.data_ptr() - res.buffer.data_ptr() < end]


@dataclass
class PoolCounters:
    h2d_bytes: int = 0
    h2d_copies: int = 0        # copy operations issued (one per arena row, else one per weight)
    resident_bytes: int = 0
    peak_resident_bytes: int = 0


class DeviceWeightPool:
    def __init__(self, device: torch.device, slots: int):
        self.device = device
        self.slots = slots
        self.resident: dict[int, Resident] = {}
        self.counters = PoolCounters()
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._free: dict[int, list[torch.Tensor]] = {}  # CPU only: released buffers by size
        self.routed_rows: dict[int, list[int]] = {}  # flat index -> expert rows fetched last

    def reset_counters(self) -> None:
        self.routed_rows.clear()
        self.counters = PoolCounters(resident_bytes=self.counters.resident_bytes,
                                     peak_resident_bytes=self.counters.resident_bytes)

    def fetch(self, key: int, entries: dict[int, "WeightEntry"], routed=(), rows=None,  # noqa: F821
              shard: tuple[int, int] | None = None) -> None:
        """Copy a segment's weights into one device buffer. `routed` weights (stacked experts)
        get their place in the buffer but no copy: their bodies fetch the rows the router picks
        (`runtime/expert_rows.py`). `rows` (flat index -> host arena row): weights whose row is
        intact arrive in one copy of the row, laid out as the buffer's head.

        `shard=(ranks, rank)` (data parallelism): copy only this rank's part, its slice of the
        row and the elements of the other weights it owns (`entry.shards`), zeros elsewhere;
        `gather` then completes the buffer from the other ranks' parts."""
        if len(self.resident) >= self.slots:
            raise ResidencyError(
                f"schedule asked for more than slots={self.slots} resident segments "
                f"(resident: {sorted(self.resident)}, fetching {key})")
        sources = {i: e.source() for i, e in entries.items()}
        row = next((rows[i] for i in sources if rows and i in rows), None)
        if row is not None and not (set(row.order) <= sources.keys() and row.intact(sources)):
            row = None
        offsets = dict(row.offsets) if row is not None else {}
        rest = [i for i in sources if i not in offsets]
        rest_offsets, rest_bytes = layout([(sources[i].shape, sources[i].dtype) for i in rest])
        head = row.nbytes if row is not None else 0
        offsets.update({i: head + off for i, off in zip(rest, rest_offsets)})
        buffer = self._allocate(head + rest_bytes)
        views = {}
        stream = self.copy_stream
        copies = 0
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        mine = 0   # (data parallelism: the bytes of this rank's part)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if row is not None and shard is not None:   # this rank's slice of the row
                size = head // shard[0]
                part = slice(shard[1] * size, (shard[1] + 1) * size)
                buffer[part].copy_(row.buffer[part], non_blocking=stream is not None)
                copies, mine = copies + 1, mine + size
            elif row is not None:
                buffer[:head].copy_(row.buffer, non_blocking=stream is not None)
                copies += 1
            if shard is not None and rest_bytes:
                buffer[head:].zero_()   # (summed over the ranks: each adds the elements it owns)
            for i, src in sources.items():
                n = src.numel() * src.element_size()
                view = buffer[offsets[i]:offsets[i] + n].view(src.dtype).view(src.shape)
                if i in routed:
                    expert_rows.expect(view, src, i, self)
                elif (row is None or i not in row.offsets) and shard is not None:
                    for a, b in entries[i].shards[shard[1]]:
                        view.view(-1)[a:b].copy_(src.view(-1)[a:b], non_blocking=stream is not None)
                        copies, mine = copies + 1, mine + (b - a) * src.element_size()
                elif row is None or i not in row.offsets:
                    view.copy_(src, non_blocking=stream is not None)
                    copies += 1
                views[i] = view
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        nbytes = sum(s.numel() * s.element_size() for s in sources.values())
        self.resident[key] = Resident(buffer, views, nbytes, event, [views[i] for i in routed],
                                      (head, head + rest_bytes) if shard is not None else None)
        c = self.counters
        c.h2d_bytes += mine if shard is not None else sum(s.numel() * s.element_size() for i, s in sources.items()
                                                          if i not in routed)
        c.h2d_copies += copies
        c.resident_bytes += nbytes
        c.peak_resident_bytes = max(c.peak_resident_bytes, c.resident_bytes)

    def gather(self, key: int, group, rank: int) -> None:
        """(data parallelism) Start completing a sharded fetch from every rank's part: the row by
        an in-place all-gather of the slices, the other weights by an all-reduce of the owned
        elements over zeros (exact: each element is one rank's value plus zeros). Asynchronous:
        issued after this rank's copy (on CUDA from the copy stream, so the collective waits for
        the copy and the compute stream does not), waited for by `wait(key)` before the body
        that reads the weights; it runs under the bodies before it."""
        import torch.distributed as dist
        from ..distributed import all_gather_into
        res = self.resident[key]
        res.expect(key, Residency.COPYING, doing="all-gather")
        head, end = res.gather
        works = []
        with torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else contextlib.nullcontext():
            if head:
                size = head // dist.get_world_size(group)
                works.append(all_gather_into(res.buffer[:head], res.buffer[rank * size:(rank + 1) * size], group,
                                             async_op=True))
            if end > head:
                works += _sum_owned(res, head, end, group)
        res.works = [w for w in works if w is not None]

    def wait(self, key: int) -> None:
        """The compute stream (the CPU: this thread) waits for the segment's copy and, under data
        parallelism, its collectives."""
        res = self.resident[key]
        res.expect(key, Residency.COPYING, Residency.READY, doing="wait")   # (a second wait finds nothing in flight)
        if res.event is not None:
            torch.cuda.current_stream(self.device).wait_event(res.event)
            res.event = None
        works, res.works = res.works, []
        for work in works:
            work.wait()
        res.state = Residency.READY

    def views(self, key: int) -> dict[int, torch.Tensor]:
        """The segment's weights as device tensors, for a body to read (after `wait`)."""
        res = self.resident[key]
        res.expect(key, Residency.READY, doing="a body reads its weights")
        return res.views

    def record_rows(self, index: int, rows: list[int], nbytes: int) -> None:
        """A routed weight's body fetched `rows` (its gradient leaves the device for those only)."""
        self.routed_rows[index] = rows
        self.counters.h2d_bytes += nbytes

    def evict(self, key: int) -> None:
        res = self.resident.pop(key)
        for view in res.routed:
            expert_rows.forget(view)
        self.counters.resident_bytes -= res.nbytes
        if self.copy_stream is None:
            res.views.clear()
            free = self._free.setdefault(res.buffer.numel(), [])
            if len(free) < self.slots:
                free.append(res.buffer)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        free = self._free.get(nbytes)
        while free:
            buffer = free.pop()
            # 2 references: `buffer` and the storage's own; more means a view of old weights lives
            if torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) <= 2:
                return buffer
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def check_resident(self, key: int, index: int, tensor: torch.Tensor, name: str) -> None:
        """Debug check: `tensor` is a live view of a resident segment, never freed memory."""
        res = self.resident.get(key)
        if res is None or res.views.get(index) is not tensor:
            raise ResidencyError(f"weight {name} is read by segment {key} but is not resident on the device")
        if tensor.untyped_storage().nbytes() == 0:
            raise ResidencyError(f"weight {name} has no storage (evicted) but is about to be read")
