"""A program's checkpoint moves (passes/offload_checkpoints.py): layer checkpoints to the host
after the forward reads them, back to the device before the backward needs them.

    forward   compute: ... layer k ──┬── layer k+1 ──┬── ...
              d2h:                   └ checkpoint k ─┘        (CUDA: pinned host copies, async)
    backward  h2d:      reload k-1 ──┐                         (issued one segment ahead)
              compute: ... layer k ──┴── layer k-1 ...        (its run waits for the reload)

On CUDA each copy runs on this mover's own stream after the compute stream produced (or freed)
what it touches (`wait_stream`); a device value being copied out is marked as used by the copy
stream (`record_stream`), so the allocator keeps it until the copy is done; the forward returns
only once its host copies are complete (`finish`), and a body waits for the reloads it reads
(`ready`). Host copies are pinned through torch's caching host allocator (reused across steps).
On the CPU the copies are plain and synchronous: the same program and accounting run.
"""
from __future__ import annotations

import torch


class CheckpointMover:
    def __init__(self, device: torch.device):
        self.device = device
        cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if cuda else None
        self.h2d = torch.cuda.Stream(device) if cuda else None
        self._offloads: list = []            # events of this forward's copies out
        self._reloads: dict[int, object] = {}  # id(device tensor) -> event of its copy in
        self.moved = {"offload": 0, "reload": 0}

    def offload(self, value: torch.Tensor) -> torch.Tensor:
        """A host copy of `value` (the device copy may die right after this call)."""
        self.moved["offload"] += value.numel() * value.element_size()
        if self.d2h is None:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype).copy_(value)
        host = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, pin_memory=True)
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            host.copy_(value, non_blocking=True)
            value.record_stream(self.d2h)
            event = torch.cuda.Event()
            event.record(self.d2h)
        self._offloads.append(event)
        return host

    def finish(self) -> None:
        """The forward's host copies are complete (they are what AOT saves for the backward)."""
        for event in self._offloads:
            event.synchronize()
        self._offloads.clear()

    def reload(self, value: torch.Tensor) -> torch.Tensor:
        """A device copy of host `value`; a body reading it waits for it (`ready`)."""
        self.moved["reload"] += value.numel() * value.element_size()
        if self.h2d is None:
            return value.to(self.device, copy=True)
        device_value = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=self.device)
        # (after the compute stream is done with whatever this memory held before)
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.h2d):
            device_value.copy_(value, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.h2d)
        self._reloads[id(device_value)] = event
        return device_value

    def ready(self, inputs) -> None:
        """The compute stream waits for the reloads among `inputs` (before the body reading them)."""
        if not self._reloads:
            return
        stream = torch.cuda.current_stream(self.device)
        for value in inputs:
            event = self._reloads.pop(id(value), None) if isinstance(value, torch.Tensor) else None
            if event is not None:
                stream.wait_event(event)
