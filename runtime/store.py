"""Host weight store: the home of every weight, its fp32 master and its transfer copy.

Layout per trainable parameter `p` of compute dtype `c` (the dtype Dynamo traced):
  * c == float32: `p.data` is the master AND the transfer copy (nothing duplicated).
  * c is bf16/fp16: `p.data` stays the compute-dtype transfer copy (so Dynamo's dtype guards
    hold and no recompile happens), an fp32 master lives beside it, and `p.grad` is fp32.
    Around every `optimizer.step()` (global optimizer hooks) the parameter is switched to its
    fp32 master, so a plain `torch.optim.AdamW` updates fp32 masters with fp32 state; afterwards
    the transfer copy is refreshed from the master, so the next forward never reads stale weights.
On CUDA the transfer copies are pinned (runtime/host_arena.py) so host-to-device copies are
asynchronous.
"""
from __future__ import annotations

import itertools
import sys
import threading
import weakref
from dataclasses import dataclass, field

import torch
import torch.optim.optimizer as _optim
from torch import nn

from .host_kernels import land

LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(eq=False)
class WeightEntry:
    param_ref: "weakref.ref[nn.Parameter]"
    name: str
    master: torch.Tensor | None     # fp32 master when the transfer copy is low precision
    transfer: torch.Tensor | None   # its compute-dtype host copy (None: the parameter is both)
    synced_version: int = 0         # p._version when transfer and master last agreed
    order: int = 0                  # registration order: the order the forward first reads weights
    # cleared while an overlapped optimizer step has yet to update this weight (runtime/adamw.py)
    ready: threading.Event = field(default_factory=lambda: _set_event())
    # the last step's fp32 gradient, handed back by HostAdamW.zero_grad: the next backward writes
    # into it when nothing else holds it (a fresh 4 bytes/parameter each step cost the page faults
    # of first touch in the backward and the unmapping in zero_grad: 30-50 ms per 3B-model layer)
    spare_grad: torch.Tensor | None = None
    # the gradient paths (runtime/grad_offload.py) of the programs that read this weight: an
    # optimizer updating it as its gradient lands listens to these, not to the process
    offloaders: "weakref.WeakSet" = field(default_factory=weakref.WeakSet)
    arena_row: object = None   # the host arena row holding its transfer copy (runtime/host_arena.py)
    # the state tier holding its fp32 master (runtime/state_tier.py); `master` is then a 4-byte
    # stand-in with the parameter's shape and the values are read and written through the tier
    tier: object = None
    # data parallelism (runtime/node_heap.py): the node's shared AdamW moments and fp32 gradient
    # of this weight (every rank maps them; each writes only the parts it owns), and which
    # element ranges of the flattened weight each rank of the node owns (runtime/host_arena.py)
    moments: tuple | None = None
    grad_home: torch.Tensor | None = None
    shards: tuple | None = None        # per local rank: [(start, end), ...]
    rank: int = 0                      # this process's local rank (its ranges: shards[rank])
    shared: bool = False               # its transfer copy (p.data) is in the node heap
    # (gradient weakref, its version, sum of its squares) taken as it last landed (add_host_grad):
    # the clipping norm reads it instead of a pass over the gradient after the backward
    grad_squares: tuple | None = None

    @property
    def pieces(self) -> list[tuple[int, int]] | None:
        """The element ranges of the flattened weight this rank updates (None: all, one process)."""
        return None if self.shards is None else self.shards[self.rank]

    def __deepcopy__(self, memo) -> None:   # a copied parameter is a new weight: no entry yet
        return None

    def __reduce__(self):   # pickled with its parameter (torch.save(model)): as no entry
        return (type(None), ())

    def wait_ready(self) -> None:
        """Block until a pending overlapped optimizer update of this weight is written."""
        if not self.ready.is_set():
            self.ready.wait()

    @property
    def param(self) -> nn.Parameter:
        p = self.param_ref()
        if p is None:  # pragma: no cover - the model was garbage collected under us
            raise RuntimeError(f"parameter {self.name} no longer exists")
        return p

    @property
    def nbytes(self) -> int:
        """Bytes one transfer of this weight moves."""
        p = self.param  # (no `.data` here: this runs under FakeTensorMode during compilation)
        return p.numel() * (p.element_size() if self.transfer is None else self.transfer.element_size())

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad

    def source(self) -> torch.Tensor:
        """The host tensor to copy to the device (once its pending update, if any, is written)."""
        self.wait_ready()
        return self.param.data

    def accumulate_grad(self, grad: torch.Tensor, rows: list[int] | None = None) -> int:
        """Deliver a device gradient to `param.grad` on the host as fp32; returns bytes moved.
        With `rows` (routed experts), only those rows of dim 0 move: the others are zero.
        (Synchronous: `stage` then `add_host_grad`; runtime/grad_offload.py splits the two.)"""
        host, moved = self.stage_grad(grad, rows)
        self.add_host_grad(host, rows)
        return moved

    def stage_grad(self, grad: torch.Tensor, rows: list[int] | None = None,
                   non_blocking: bool = False) -> tuple[torch.Tensor, int]:
        """Start moving a device gradient (or its `rows`) to the host: (host tensor, bytes).
        With `non_blocking` on CUDA the host tensor is pinned and valid once the current stream
        has passed the copy."""
        if rows is not None:
            index = torch.tensor(rows, dtype=torch.long)
            if grad.device.type == "cuda":   # (a pageable copy would wait for the stream: it waited on the body)
                index = index.pin_memory().to(grad.device, non_blocking=True)
            grad = grad[index]
        host = grad if grad.device.type == "cpu" else grad.to("cpu", non_blocking=non_blocking)
        return host, grad.numel() * grad.element_size()

    def add_host_grad(self, host: torch.Tensor, rows: list[int] | None = None, borrowed: bool = False) -> None:
        """Add a host gradient (all rows, or `rows` of dim 0) into `param.grad` as fp32.
        `borrowed`: `host` is reused afterwards (a gradient slab), so it never becomes the grad.
        The add or the widening copy is the host kernel's `land`, which takes the new gradient's
        squared norm in the same pass (`landed_squares`)."""
        p = self.param
        self.wait_ready()   # (the optimizer may still read the previous step's gradient)
        want = torch.float32 if p.dtype in LOW_PRECISION or p.dtype == torch.float32 else p.dtype
        if rows is not None:
            full = self._take_spare(p.shape, want) if p.grad is None else None
            full = full.zero_() if full is not None else torch.zeros(p.shape, dtype=want)
            full[torch.tensor(rows, dtype=torch.long)] = host.to(want)
            host = full
        if p.grad is not None:
            # (a bf16 host gradient is widened inside the add: no fp32 temporary)
            self._landed(p.grad, land(p.grad, host, add=True))
            return
        squares = None
        spare = self._take_spare(host.shape, want)   # (taken either way: an unused one is let go)
        if spare is not None and (host.dtype != want or borrowed):   # a new tensor either way: this one
            squares, host, borrowed = land(spare, host, add=False), spare, False
        if host.dtype != want or borrowed:
            fresh = torch.empty(host.shape, dtype=want)
            squares, host = land(fresh, host, add=False), fresh
        # (a host tensor adopted as the grad as it is was not read: its norm is taken when asked)
        grad = host.contiguous()
        assign_grad(p, grad)
        self._landed(grad, squares)

    def _landed(self, grad: torch.Tensor, squares: float | None) -> None:
        self.grad_squares = (weakref.ref(grad), grad._version, squares) if squares is not None else None

    def landed_squares(self, grad: torch.Tensor) -> float | None:
        """sum(grad ** 2) as it was taken when `grad` last landed, if it is still that gradient
        unchanged (the same tensor at the same version: a user's in-place clipping moves it)."""
        taken = self.grad_squares
        if taken is None or taken[0]() is not grad or taken[1] != grad._version:
            return None
        return taken[2]

    def add_grad_piece(self, host: torch.Tensor | None, piece: tuple[int, int] | None) -> None:
        """Data parallelism: add this rank's summed part `host` (fp32, flat) of the gradient into
        elements `piece` of the node's shared gradient, which becomes `param.grad` on every rank
        (None: this rank owns no part of this weight, its gradient only exists)."""
        p = self.param
        self.wait_ready()
        fresh = p.grad is None
        if fresh:
            assign_grad(p, self.grad_home)
        if host is not None:
            target = p.grad.view(-1)[piece[0]:piece[1]]
            if fresh:
                target.copy_(host)
            else:
                target.add_(host)

    def _take_spare(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        """The spare gradient if it fits and nothing but this entry refers to it (a user's
        reference to the old `p.grad`, or a view of it, keeps it theirs: it is then left alone)."""
        spare, self.spare_grad = self.spare_grad, None
        if spare is None or spare.shape != shape or spare.dtype != dtype or not spare.is_contiguous():
            return None
        # references: `spare` here, getrefcount's argument; a view or autograd keeps a use count
        return spare if sys.getrefcount(spare) <= 2 and spare._use_count() == 1 else None

    # optimizer hooks ---------------------------------------------------------------
    def to_master(self) -> None:
        p = self.param
        if self.master is None:
            return
        if p._version != self.synced_version:  # the user wrote the weights in place
            if self.tier is not None:
                self.tier.write(p, master=p.detach().float())
            else:
                self.master.copy_(p.detach())
        p.data = self.master

    def to_transfer(self) -> None:
        p = self.param
        if self.master is None:
            return
        if self.tier is None:   # (a tiered master is written only with its transfer copy: they agree)
            self.transfer.copy_(self.master)
        p.data = self.transfer
        self.synced_version = p._version


_HOOKS_INSTALLED = False   # (torch's optimizer hook registry is process-wide: ours go in once)
_ORDER = itertools.count()   # registration order numbers (an id source, like itertools' own)
#: the attribute of a parameter that holds its entry: the entry lives and dies with its weight
#: (no registry keyed by id(), which Python reuses); copies and pickles of the parameter carry none
_ENTRY = "_megatrain_entry"


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


def assign_grad(p: nn.Parameter, grad: torch.Tensor | None) -> None:
    """`p.grad = grad`, also when `grad` is fp32 and `p` a bf16/fp16 transfer copy: torch checks
    a grad's dtype against its tensor's on assignment, so the grad is assigned while `p` shows a
    4-byte stand-in of the grad's dtype and shape; it survives the switch back (the version
    counter does not move). Works on every torch we support (`grad_dtype` is recent)."""
    if grad is None or grad.dtype == p.dtype:
        p.grad = grad
        return
    data = p.data
    p.data = torch.empty((), dtype=grad.dtype, device=data.device).expand(data.shape)
    try:
        p.grad = grad
    finally:
        p.data = data


def entry_of(p: nn.Parameter) -> WeightEntry | None:
    """The store entry of `p`, if the parameter is registered."""
    return getattr(p, _ENTRY, None)


def master_entry(p: nn.Parameter) -> WeightEntry | None:
    """The entry of `p` if it has an fp32 master (a registered low-precision parameter)."""
    entry = getattr(p, _ENTRY, None)
    return entry if entry is not None and entry.master is not None else None


def _live_entries(optimizer: torch.optim.Optimizer):
    if getattr(optimizer, "updates_transfer_copies", False):   # runtime/adamw.py's HostAdamW
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if (entry := master_entry(p)) is not None:
                yield entry


def _pre_step(optimizer, args, kwargs):
    if not getattr(optimizer, "updates_transfer_copies", False) and any(
            entry_of(p) is not None and entry_of(p).shards is not None for g in optimizer.param_groups
            for p in g["params"]):
        raise RuntimeError("megatrain: under data parallelism each rank updates only its part of the node's shared "
                           f"weights; {type(optimizer).__name__} would update all of them on every rank. Use "
                           "megacompile.HostAdamW.")
    for entry in _live_entries(optimizer):
        entry.to_master()


def _post_step(optimizer, args, kwargs):
    for entry in _live_entries(optimizer):
        entry.to_transfer()


def _install_hooks() -> None:
    global _HOOKS_INSTALLED
    if not _HOOKS_INSTALLED:
        _optim.register_optimizer_step_pre_hook(_pre_step)
        _optim.register_optimizer_step_post_hook(_post_step)
        _HOOKS_INSTALLED = True


def register(params: dict[int, nn.Parameter], names: dict[int, str], pin: bool, heap=None) -> dict[int, WeightEntry]:
    """Entries for the given parameters (flat index -> entry), created once per parameter. With
    `heap` (data parallelism, runtime/node_heap.py) the fp32 masters, AdamW moments and fp32
    gradients of the trainable ones live in the node's shared memory (allocated in flat index
    order: the same offsets on every rank)."""
    entries = {index: entry_for(p, names[index], pin) for index, p in params.items()}
    if heap is not None:
        moving = [entries[i] for i in sorted(entries)
                  if entries[i].grad_home is None and entries[i].param.requires_grad]
        heap.reserve(sum(heap.span(e.param.shape, torch.float32) * (4 if e.master is not None else 3) for e in moving))
        for entry in moving:
            _to_heap(entry, heap)
    return entries


def _to_heap(entry: WeightEntry, heap) -> None:
    """Move a trainable entry's master into the node heap and give it shared moments and a
    gradient; register() picks the entries that have none yet. (Every rank writes the same
    values now; nothing updates them before the ranks meet at the arenas' barrier,
    runtime/host_arena.py.)"""
    p = entry.param
    if entry.tier is not None:
        raise RuntimeError("megatrain: the state tier (nvme) is not available with data parallelism yet")
    _install_hooks()   # (a torch optimizer on the shared weights is refused: _pre_step)
    if entry.master is not None:
        master = heap.alloc(p.shape, torch.float32)
        master.copy_(entry.master)
        entry.master = master
    shape = p.shape
    entry.moments = (heap.alloc(shape, torch.float32), heap.alloc(shape, torch.float32))
    entry.grad_home = heap.alloc(shape, torch.float32)


def entry_for(p: nn.Parameter, name: str, pin: bool) -> WeightEntry:
    """The entry of `p`, created on first use (it goes with the parameter)."""
    entry = getattr(p, _ENTRY, None)
    if entry is None:
        entry = _new_entry(p, name, pin)
        setattr(p, _ENTRY, entry)
    return entry


def _new_entry(p: nn.Parameter, name: str, pin: bool) -> WeightEntry:
    if pin and not p.data.is_pinned():
        p.data = p.data.pin_memory()
    master = None
    if p.requires_grad and p.dtype in LOW_PRECISION:
        master = p.detach().to(torch.float32, copy=True)   # (never pinned: masters do not cross the link)
        _install_hooks()
    return WeightEntry(weakref.ref(p), name, master, p.data if master is not None else None, p._version,
                       next(_ORDER))


def master_weight(p: nn.Parameter) -> torch.Tensor:
    """The fp32 master of a parameter (the parameter itself when it is fp32)."""
    entry = entry_of(p)
    if entry is not None:
        entry.wait_ready()
    entry = master_entry(p)
    if entry is not None and entry.tier is not None:
        return entry.tier.read(p, "master")
    return entry.master if entry is not None else p.detach()


def set_master(p: nn.Parameter, value: torch.Tensor, name: str = "", pin: bool = False) -> None:
    """Set a parameter's weights from an fp32 tensor without rounding its master (resume from a
    checkpoint): the master takes `value` exactly and the transfer copy is refreshed from it.
    Works before the model is compiled: the entry is created now and the backend reuses it."""
    entry = entry_for(p, name, pin)
    with torch.no_grad():
        if entry.master is None:
            p.data.copy_(value)
        elif entry.tier is not None:
            entry.tier.write(p, master=value.to(torch.float32))
            entry.transfer.copy_(value)
            entry.synced_version = p._version
        else:
            entry.master.copy_(value)
            entry.to_transfer()


class masters_shown:
    """Inside, each registered low-precision parameter shows its fp32 master (as during an
    optimizer step), e.g. to load optimizer state without torch casting it to bf16."""

    def __init__(self, params):
        self.entries = [e for p in params if (e := master_entry(p)) is not None]

    def __enter__(self):
        for e in self.entries:
            e.to_master()
        return self

    def __exit__(self, *exc):
        for e in self.entries:
            e.to_transfer()
        return False
