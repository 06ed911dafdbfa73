"""Device weight pool: holds the weights of at most `slots` segments on the device.

`fetch` copies a segment's transfer copies into one flat device buffer (one allocation per
segment, so identical layers reuse the same allocator block) and hands out views; `evict`
drops the buffer. On CUDA the copy runs on a dedicated stream and `wait` makes the compute
stream wait on its event; on the CPU copies are synchronous and `wait` is free.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..errors import ResidencyError

_ALIGN = 256


@dataclass
class Resident:
    buffer: torch.Tensor
    views: dict[int, torch.Tensor]
    nbytes: int
    event: object = None


@dataclass
class PoolCounters:
    h2d_bytes: int = 0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0


class DeviceWeightPool:
    def __init__(self, device: torch.device, slots: int):
        self.device = device
        self.slots = slots
        self.resident: dict[int, Resident] = {}
        self.counters = PoolCounters()
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def reset_counters(self) -> None:
        self.counters = PoolCounters(resident_bytes=self.counters.resident_bytes,
                                     peak_resident_bytes=self.counters.resident_bytes)

    def fetch(self, key: int, entries: dict[int, "WeightEntry"]) -> None:  # noqa: F821
        if len(self.resident) >= self.slots:
            raise ResidencyError(
                f"schedule asked for more than slots={self.slots} resident segments "
                f"(resident: {sorted(self.resident)}, fetching {key})")
        sources = {i: e.source() for i, e in entries.items()}
        offsets, total = {}, 0
        for i, src in sources.items():
            offsets[i] = total
            total += -(-src.numel() * src.element_size() // _ALIGN) * _ALIGN
        buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
        views = {}
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for i, src in sources.items():
                n = src.numel() * src.element_size()
                view = buffer[offsets[i]:offsets[i] + n].view(src.dtype).view(src.shape)
                view.copy_(src, non_blocking=stream is not None)
                views[i] = view
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        nbytes = sum(s.numel() * s.element_size() for s in sources.values())
        self.resident[key] = Resident(buffer, views, nbytes, event)
        c = self.counters
        c.h2d_bytes += nbytes
        c.resident_bytes += nbytes
        c.peak_resident_bytes = max(c.peak_resident_bytes, c.resident_bytes)

    def wait(self, key: int) -> None:
        res = self.resident[key]
        if res.event is not None:
            torch.cuda.current_stream(self.device).wait_event(res.event)
            res.event = None

    def views(self, key: int) -> dict[int, torch.Tensor]:
        return self.resident[key].views

    def evict(self, key: int) -> None:
        res = self.resident.pop(key)
        self.counters.resident_bytes -= res.nbytes

    def check_resident(self, key: int, index: int, tensor: torch.Tensor, name: str) -> None:
        """Debug check: `tensor` is a live view of a resident segment, never freed memory."""
        res = self.resident.get(key)
        if res is None or res.views.get(index) is not tensor:
            raise ResidencyError(f"weight {name} is read by segment {key} but is not resident on the device")
        if tensor.untyped_storage().nbytes() == 0:
            raise ResidencyError(f"weight {name} has no storage (evicted) but is about to be read")
