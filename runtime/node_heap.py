"""The node heap: one host copy of the model state per node, in shared memory, mapped by every
rank of the node (data parallelism, megacompile/distributed.py).

    node leader:   open /dev/shm/megatrain-<run>-n<node>-<name>-<i>.bin (O_EXCL), fallocate
    every rank:    barrier -> map it (UntypedStorage.from_file, shared) -> barrier
    node leader:   unlink it (the mappings keep the pages; a killed job leaves no file behind)
    alloc(shape, dtype)   the next 4 KiB-aligned range of the mapping, as a tensor with a storage
                          of its own (torch.frombuffer): safetensors and deepcopy see separate tensors

Allocation is deterministic: the same calls in the same order on every rank of a node give the
same offsets, so rank r's tensor k and rank s's tensor k are the same bytes. `reserve(n)` maps
a chunk of exactly the n bytes a batch of allocations will take (the store's state of all
parameters, the arenas' rows) when the current one lacks room: a collective over the node's
ranks, which every rank reaches at the same call because they allocate alike. The leader reserves the chunk's pages
(`posix_fallocate`) so that a /dev/shm too small fails here with a message, not later with a
SIGBUS on first touch; the pages are the node's once (each process's Pss holds its share).
"""
from __future__ import annotations

import logging
import os

import torch

from ..distributed import Topology, barrier, collective
from ..errors import CannotFitError

log = logging.getLogger("megatrain.node_heap")

_PAGE = 4096
SHM_DIR = "/dev/shm"


class NodeHeap:
    def __init__(self, topo: Topology, name: str, chunk_bytes: int = 16 << 20, directory: str = SHM_DIR):
        self.topo, self.name, self.chunk_bytes, self.directory = topo, name, chunk_bytes, directory
        self.chunks: list[tuple[torch.Tensor, memoryview]] = []   # (uint8 mapping, its memoryview)
        self.used = 0          # bytes handed out from the last chunk
        self.nbytes = 0        # bytes mapped in all
        self.allocated = 0     # bytes handed out in all (aligned)

    @staticmethod
    def span(shape, dtype: torch.dtype, align: int = _PAGE) -> int:
        """The bytes `alloc(shape, dtype)` takes."""
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        return max(-(-n // align) * align, align)

    def reserve(self, nbytes: int) -> None:
        """Make room for `nbytes` of allocations to come (the sum of their `span`s) in one
        chunk of exactly what is missing: the callers know what they will place (the store its
        parameters' state, the arenas their rows), so nothing is reserved that is not used."""
        if not self.chunks or self.used + nbytes > self.chunks[-1][0].numel():
            self._map(-(-nbytes // _PAGE) * _PAGE)

    def alloc(self, shape, dtype: torch.dtype, align: int = _PAGE) -> torch.Tensor:
        """A tensor of `shape` and `dtype` in the node's shared memory (zeros until written)."""
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        span = self.span(shape, dtype, align)
        if not self.chunks or self.used + span > self.chunks[-1][0].numel():
            self._map(max(self.chunk_bytes, span))
        _, raw = self.chunks[-1]
        start = self.used
        self.used += span
        self.allocated += span
        t = torch.frombuffer(raw[start:start + max(n, 1)], dtype=torch.uint8)[:n]
        return t.view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)

    def _map(self, nbytes: int) -> None:
        topo = self.topo
        path = os.path.join(self.directory, f"megatrain-{topo.run_id[:12]}-n{topo.node}-{self.name}-{len(self.chunks)}"
                                            ".bin")
        error = None
        if topo.leader:
            error = _create(path, nbytes)
        error = _from_leader(topo, error)
        if error is not None:
            raise CannotFitError(error)
        barrier(topo, f"mapping the node's shared memory ({path})", topo.node_host_group)
        storage = torch.UntypedStorage.from_file(path, True, nbytes)
        mapping = torch.empty(0, dtype=torch.uint8).set_(storage)
        barrier(topo, f"mapping the node's shared memory ({path})", topo.node_host_group)
        if topo.leader:
            os.unlink(path)
        self.chunks.append((mapping, memoryview(mapping.numpy())))
        self.used = 0
        self.nbytes += nbytes
        log.debug("node heap %s: chunk %d, %d bytes", self.name, len(self.chunks) - 1, nbytes)


def _create(path: str, nbytes: int) -> str | None:
    """(leader) Make the file and reserve its pages; the reason it cannot, or None."""
    directory = os.path.dirname(path)
    try:
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        if free < nbytes:
            return (f"{directory} has {free / 2**30:.2f} GiB free, the node's shared copy of the model state needs "
                    f"{nbytes / 2**30:.2f} GiB more: give the container more shared memory (docker run --shm-size "
                    "or --ipc=host), or free it")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
    except OSError as e:
        try:
            os.unlink(path)
        except OSError:
            pass
        return f"cannot reserve {nbytes / 2**30:.2f} GiB of shared memory in {directory} ({e})"
    return None


def _from_leader(topo: Topology, error: str | None) -> str | None:
    """The leader's outcome on every rank of its node."""
    import torch.distributed as dist
    box = [error]
    with collective(topo, "creating the node's shared memory"):
        dist.broadcast_object_list(box, src=topo.node * topo.local, group=topo.node_host_group)
    return box[0]
