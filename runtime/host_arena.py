"""Host arenas: the transfer copies of each segment kind in one allocation, one row per segment,
laid out exactly as the segment's device slot buffer, pinned once.

    arena (one per layer kind)   uint8 [segments of that kind, row bytes]   cudaHostRegister'ed
    row of layer L               | q_proj | pad | k_proj | pad | ... | down_proj | pad |
    device slot buffer           | q_proj | pad | k_proj | pad | ... | down_proj | pad | others...
    fetch(layer L)               one copy: slot[:row bytes] <- row L          (was: one per weight)

Why: per-tensor pinning goes through torch's caching host allocator, which rounds every block
up to a power of two (a 136 MB MLP weight takes 256 MB of pinned memory) and never returns
freed blocks to the system; and a layer of a dozen weights costs a dozen copies where one
would do. Registering one plain allocation per kind (`cudaHostRegister`) pins exactly the
bytes, and the slot buffer's layout (`weight_pool.layout`) makes each fetch one transfer.

Each weight's transfer copy (`p.data`, or the store entry's `transfer` when an fp32 master
sits beside it) becomes a tensor over its slice of the row with a storage of its own
(`torch.frombuffer`), so everything that looks at storages (safetensors, `save_pretrained`'s
tied-weight detection, `deepcopy`) sees separate tensors, while the optimizer's in-place
writes land in the row. Only weights that one segment alone reads (not tied weights, not
routed experts, contiguous) go into rows; the others are pinned one by one. A row whose
weights no longer sit where it put them (the user assigned `p.data`) is not used: the pool
falls back to one copy per weight, so the arena is an optimisation, never a correctness risk.
"""
from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass

import torch

from .weight_pool import layout


@dataclass(eq=False)
class ArenaRow:
    buffer: torch.Tensor          # uint8 [nbytes]: this row of its arena
    order: tuple[int, ...]        # flat indices of the weights in the row, in layout order
    offsets: dict[int, int]       # flat index -> byte offset in the row
    ptrs: dict[int, int]          # flat index -> data_ptr its transfer copy must have
    nbytes: int
    members: tuple = ()           # the weights' store entries, in layout order

    def for_indices(self, index_of: dict[int, int]) -> "ArenaRow":
        """This row as a program with other flat indices sees it (`index_of`: id(entry) -> its
        index there): a graph Dynamo recompiled numbers its inputs differently."""
        order = tuple(index_of[id(e)] for e in self.members)
        old = dict(zip(self.order, order))
        return ArenaRow(self.buffer, order, {old[i]: o for i, o in self.offsets.items()},
                        {old[i]: p for i, p in self.ptrs.items()}, self.nbytes, self.members)

    def intact(self, sources: dict[int, torch.Tensor]) -> bool:
        """Whether each weight's current transfer copy is still the row's slice."""
        return all(i in sources and sources[i].data_ptr() == p for i, p in self.ptrs.items())


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:   # pragma: no cover - interpreter shutdown
        pass


_PAGE = 4096
_REGISTER_PORTABLE = 1   # cudaHostRegisterPortable: pinned for every CUDA context, not only the current one


def _allocate(nbytes: int, pin: bool) -> torch.Tensor:
    """`nbytes` of host memory; with `pin`, registered with CUDA. A registration covers whole
    pages and two may not share one (the second fails), so a pinned arena starts on a page
    boundary and spans whole pages (small arenas and slabs would otherwise sit side by side
    in one page of the heap)."""
    nbytes = max(nbytes, 1)
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8)
    span = -(-nbytes // _PAGE) * _PAGE
    base = torch.empty(span + _PAGE, dtype=torch.uint8)
    start = -base.data_ptr() % _PAGE
    arena = base[start: start + nbytes]   # (the view keeps `base` alive)
    _register(arena, nbytes, "host arena")
    return arena


def _register(tensor: torch.Tensor, nbytes: int, what: str) -> None:
    """Register a page-aligned host range (its whole pages) with CUDA; unregistered when the
    tensor goes (the caller keeps it for as long as it is in use). A failure leaves it correct,
    only the copies from it synchronous: a warning says so. (A node heap's range is the node's
    shared memory: each rank registers it for its own CUDA context.)"""
    span = -(-nbytes // _PAGE) * _PAGE
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), span, _REGISTER_PORTABLE)
    if int(err) != 0:
        _clear_cuda_error()
        import warnings
        warnings.warn(f"megatrain: cudaHostRegister of a {nbytes / 2**30:.2f} GiB {what} failed ({err}); its weights "
                      "are copied to the device without overlap. Check the host's locked-memory limit (ulimit -l).",
                      stacklevel=3)
    else:
        weakref.finalize(tensor, _unregister, tensor.data_ptr())


def _clear_cuda_error() -> None:
    """Reset CUDA's last-error state after a failed runtime call. torch checks
    cudaGetLastError() after each kernel launch, so a failed cudaHostRegister left there would
    surface as the next kernel's (unrelated) error; torch exposes no binding to clear it."""
    import ctypes
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:   # pragma: no cover - not Linux: nothing to find the runtime by
        pass


def _rebind(entry, tensor: torch.Tensor) -> None:
    """Make `tensor` (already holding the weights) the entry's transfer copy."""
    p = entry.param
    if entry.master is not None:
        entry.transfer = tensor
    p.data = tensor
    entry.synced_version = p._version   # (the weights did not change: the master stays exact)


def _pin_alone(entry) -> None:
    src = entry.source()
    if src.is_pinned():
        return
    _rebind(entry, src.pin_memory())


def build(segments, entries: dict, pin: bool, heap=None) -> dict[int, ArenaRow]:
    """Put the transfer copies of `segments` (schedule segments: `.weights`, `.routed`) into
    arenas; returns flat index -> its row (rows already built for these parameters are reused).
    With `pin` (CUDA), arenas are registered and the weights left out are pinned one by one.
    With `heap` (data parallelism, runtime/node_heap.py) the arenas and the weights left out
    live in the node's shared memory, each row padded to a page per rank, and every weight gets
    its owners (`ownership`)."""
    ranks = heap.topo.local if heap is not None else 1
    allocated = heap.allocated if heap is not None else 0
    owners = collections.Counter(i for seg in segments for i in dict.fromkeys(seg.weights))
    rows: dict[int, ArenaRow] = {}
    new: dict[tuple, list] = collections.defaultdict(list)   # layout signature -> segments' weights
    for seg in segments:
        own = [i for i in seg.weights if owners[i] == 1 and i not in seg.routed]
        sources = {i: entries[i].source() for i in own}
        own = [i for i in own if sources[i].is_contiguous() and sources[i].device.type == "cpu"]
        if not own:
            continue
        existing = {entries[i].arena_row for i in own}
        row = next(iter(existing)) if len(existing) == 1 else None
        if row is not None and {id(e) for e in row.members} == {id(entries[i]) for i in own}:
            # built by this program or by an earlier compile of the same model (other flat indices)
            row = row.for_indices({id(entries[i]): i for i in own})
            if row.intact(sources):
                rows.update(dict.fromkeys(own, row))
                continue
        signature = tuple((tuple(sources[i].shape), sources[i].dtype) for i in own)
        new[signature].append(own)
    def padded(row_bytes: int) -> int:   # (data parallelism: each rank's slice of a row is whole pages)
        return -(-row_bytes // (ranks * _PAGE)) * ranks * _PAGE if heap is not None else row_bytes
    if heap is not None:   # the rows and the weights left out, in one chunk of exactly their bytes
        placing = {i for members in new.values() for own in members for i in own}
        loose = [entries[i].source() for i in sorted(entries) if not entries[i].shared and i not in placing]
        heap.reserve(sum(heap.span((padded(layout(list(sig))[1]) * len(members),), torch.uint8)
                         for sig, members in new.items()) + sum(heap.span(t.shape, t.dtype) for t in loose))
    for signature, members in new.items():
        offsets, row_bytes = layout([(shape, dtype) for shape, dtype in signature])
        if heap is not None:
            row_bytes = padded(row_bytes)
            arena = heap.alloc((row_bytes * len(members),), torch.uint8)
            if pin:
                _register(arena, arena.numel(), "shared host arena")
        else:
            arena = _allocate(row_bytes * len(members), pin)
        raw = memoryview(arena.numpy())
        for r, own in enumerate(members):
            base = r * row_bytes
            ptrs, offs = {}, {}
            for i, (shape, dtype), off in zip(own, signature, offsets):
                n = dtype.itemsize * int(torch.Size(shape).numel())
                t = torch.frombuffer(raw[base + off: base + off + n], dtype=dtype, count=n // dtype.itemsize)
                t = t.view(shape)
                with torch.no_grad():
                    t.copy_(entries[i].source())
                _rebind(entries[i], t)
                ptrs[i], offs[i] = t.data_ptr(), off
            row = ArenaRow(arena[base: base + row_bytes], tuple(own), offs, ptrs, row_bytes,
                           tuple(entries[i] for i in own))
            for i in own:
                entries[i].arena_row = row
                entries[i].shared = heap is not None
                rows[i] = row
    if heap is not None:
        for i in sorted(entries):
            if i not in rows:
                _share_alone(entries[i], heap, pin)
        ownership(entries, rows, ranks, heap.topo.local_rank)
        if heap.allocated != allocated:   # (a program that placed nothing new: a recompile on one rank)
            from ..distributed import barrier   # nobody updates a weight before every rank wrote its copy
            barrier(heap.topo, "building the node's weight arenas", heap.topo.node_host_group)
    elif pin:
        for i, entry in entries.items():
            if i not in rows:
                _pin_alone(entry)
    return rows


def _share_alone(entry, heap, pin: bool) -> None:
    """(data parallelism) A weight outside the rows into the node heap, alone."""
    if entry.shared:
        return
    src = entry.source()
    if src.device.type != "cpu" or not src.is_contiguous():
        raise RuntimeError(f"megatrain: weight {entry.name} is not a contiguous host tensor; data parallelism needs "
                           "every weight in the node's shared memory")
    t = heap.alloc(src.shape, src.dtype)
    with torch.no_grad():
        t.copy_(src)
    if pin and t.numel():
        _register(t, t.numel() * t.element_size(), "shared weight")
    _rebind(entry, t)
    entry.shared = True


def ownership(entries: dict, rows: dict[int, ArenaRow], ranks: int, rank: int) -> None:
    """Which rank of the node updates which elements of each weight (`entry.shards`).

        row (ranks = 2)   | q_proj      | pad | k_proj | pad | ... | down_proj | pad |
                          |<----- rank 0's slice ----->|<------ rank 1's slice ------>|
        q_proj: rank 0 [0, n);  k_proj: rank 0 [0, m), rank 1 [m, n_k); ...

    A row's rank r owns bytes [r*S, (r+1)*S) with S = row bytes / ranks (whole pages): each
    weight's elements in that range. A weight outside the rows (a tied embedding) has one
    owner for all of it, the rank with the fewest such bytes so far (largest weights first,
    ties by flat index): the same answer on every rank."""
    load = [0] * ranks
    loose = sorted((i for i in entries if i not in rows), key=lambda i: (-entries[i].nbytes, i))
    for i, entry in entries.items():
        if i not in rows:
            continue
        row = rows[i]
        size = row.nbytes // ranks
        t = entry.source()
        e, n = t.element_size(), t.numel()
        off = row.offsets[i]
        shards = []
        for r in range(ranks):
            a = max(0, (r * size - off) // e)
            b = min(n, max(0, ((r + 1) * size - off) // e))
            shards.append([(a, b)] if b > a else [])
        entry.shards, entry.rank = tuple(shards), rank
    for i in loose:
        owner = min(range(ranks), key=lambda r: (load[r], r))
        load[owner] += entries[i].nbytes
        n = entries[i].param.numel()
        entries[i].shards = tuple([(0, n)] if r == owner else [] for r in range(ranks))
        entries[i].rank = rank


# gradient slabs ---------------------------------------------------------------------------
@dataclass(eq=False)
class GradSlab:
    buffer: torch.Tensor               # uint8 [nbytes], pinned with its ring
    views: list[torch.Tensor]          # one per gradient of the segment, in offload order
    busy: object = None                # the Future of the landing that reads it, until it is done


class GradSlabs:
    """Pinned host staging for the gradients a segment sends back, per layer kind.

        ring per kind (gradient shapes and dtypes)   slab 0 | slab 1 | slab 2      depth = in flight + 1
        slab                                          | dq_proj | pad | dk_proj | pad | ... |
        offload(layer L)   D2H copies into the next slab of L's kind; the landing adds it into
                           param.grad (fp32) and frees the slab for a later layer of that kind

    Why: a non-blocking copy to the host needs pinned memory, and `tensor.to("cpu",
    non_blocking=True)` takes it from torch's caching host allocator, a power-of-two block per
    gradient per layer. The slabs are registered once (`cudaHostRegister`, exact bytes) and
    reused every layer; a slab is handed out again only once the landing that read it is done.
    """

    def __init__(self, depth: int, pin: bool):
        self.depth = max(2, depth)
        self.pin = pin
        self.rings: dict[tuple, list[GradSlab]] = {}
        self.turn: dict[tuple, int] = collections.Counter()

    @property
    def nbytes(self) -> int:
        return sum(s.buffer.numel() for ring in self.rings.values() for s in ring)

    def take(self, grads: list[torch.Tensor]) -> GradSlab:
        """A free slab for these gradients' shapes and dtypes (waiting for its last landing)."""
        signature = tuple((tuple(g.shape), g.dtype) for g in grads)
        ring = self.rings.get(signature)
        if ring is None:
            offsets, nbytes = layout(list(signature))
            ring = []
            for _ in range(self.depth):
                buffer = _allocate(nbytes, self.pin)
                views = [buffer[off: off + dtype.itemsize * int(torch.Size(shape).numel())].view(dtype).view(shape)
                         for (shape, dtype), off in zip(signature, offsets)]
                ring.append(GradSlab(buffer, views))
            self.rings[signature] = ring
        slab = ring[self.turn[signature] % len(ring)]
        self.turn[signature] += 1
        if slab.busy is not None:
            slab.busy.result()   # (its landing's error, if any, is raised by drain() as well)
            slab.busy = None
        return slab
