"""The state tier: fp32 masters and AdamW moments of the large parameters in files on NVMe,
streamed through the host update one tile at a time (issue 18).

Layout. Each tiered parameter is cut into tiles of `tile` elements; a tile's record holds its
arrays side by side, each padded to 4 KiB, so one read, one kernel call on the record in its
bounce buffer and one write finish it:

    record (placement "all")       | master[k:k+T] | exp_avg[k:k+T] | exp_avg_sq[k:k+T] |
    record (placement "moments")   | exp_avg[k:k+T] | exp_avg_sq[k:k+T] |   (master in RAM)

Records are numbered over all tiered parameters (in the order given) and dealt to the files in
turn (file j mod D: one file per drive). Every file holds two slots of the same layout; a
parameter's committed slot is the one its state is read from:

    update(p)       read slot[p] --> AdamW in the bounce buffer (writes the bf16 copy to RAM)
                                 --> write 1 - slot[p]   (commit: slot[p] flips; speculative: pending)
    commit(p)       a speculative update is kept: slot[p] flips
    discard(p)      it is undone: slot[p] stays, nothing is copied (no 12 B/param RAM snapshot)

The next forward waits only for the bf16 copy (the update returns once every tile is computed);
writes finish in the background and are waited for only by the next read or write of the same
parameter, `synchronize()` (checkpoints) and `close()`. Reads run ahead in the order the updates
are expected (`expect`), bounded by a fixed pool of 4 KiB-aligned bounce buffers.

The AdamW kernel is element-wise: the same call on tile-sized views gives the same bits as on the
whole tensor, so a tiered run equals an all-in-RAM one bit for bit (tests/test_state_tier.py).
"""
from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .store import LOW_PRECISION, entry_for

log = logging.getLogger("megatrain.tier")

#: parameters smaller than this stay in RAM (norms, biases: negligible bytes, many small requests)
MIN_NUMEL = 1 << 18
TILE = 1 << 18          # elements per tile: 1 MiB per array, a 3 MiB record for placement "all"
PLACEMENTS = ("moments", "all")
_PAD = 1024             # elements per 4 KiB: arrays inside a record start on a 4 KiB boundary
_ARRAYS = ("master", "exp_avg", "exp_avg_sq")


def _padded(n: int) -> int:
    return -(-n // _PAD) * _PAD


def _hold(path: Path) -> tuple[int, Path]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd, path


def reclaim(directory: Path) -> list[Path]:
    """Remove the tier files a killed run left in `directory` (their lock is free); returns them."""
    gone = []
    for lock in sorted(Path(directory).glob("megatrain-tier-*.lock")):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:   # a live run's
            os.close(fd)
            continue
        try:
            for f in sorted(directory.glob(lock.name[:-len(".lock")] + "-*.bin")):
                f.unlink(missing_ok=True)
                gone.append(f)
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)
    for f in gone:
        log.warning("megatrain: removed %s, the state tier file of a run that ended without removing it", f)
    return gone


@dataclass(frozen=True)
class _Tile:
    file: int
    offset: int        # within a slot
    start: int         # first element of the parameter
    length: int        # elements
    stride: int        # padded elements per array in the record

    def nbytes(self, arrays: int) -> int:
        return arrays * self.stride * 4


@dataclass
class _Param:
    name: str
    arrays: tuple[str, ...]         # which of _ARRAYS the records hold, in order
    tiles: list[_Tile]
    slot: int = 0                   # committed slot
    pending: int | None = None      # slot a speculative update wrote, until commit/discard


class StateTier:
    """Masters and/or moments of `params` (name, parameter) in files under `directories` (one
    per drive). `placement`: "moments" (exp_avg, exp_avg_sq) or "all" (also the fp32 master of
    each low-precision parameter; an fp32 parameter is its own master and keeps it in RAM).
    Parameters that do not train or have fewer than `min_numel` elements are not tiered.
    Creating the tier moves the present state into the files (masters now, zero moments), one
    parameter at a time. `pool_bytes` bounds the bounce buffers (reads ahead + writes in flight)."""

    def __init__(self, params, directories, placement: str, *, tile: int = TILE, queue_depth: int = 8,
                 direct: bool = True, min_numel: int | None = None, pool_bytes: int = 256 << 20):
        from . import tier_io
        if placement not in PLACEMENTS:
            raise ValueError(f"StateTier: placement={placement!r}; use one of {PLACEMENTS}")
        if tile <= 0 or tile % _PAD:
            raise ValueError(f"StateTier: tile={tile} must be a positive multiple of {_PAD} elements")
        min_numel = MIN_NUMEL if min_numel is None else min_numel
        dirs = [Path(d) for d in directories]
        if not dirs:
            raise ValueError("StateTier: no directory for the tier's files")
        self.placement = placement
        self.tile = tile
        self._params: dict[nn.Parameter, _Param] = {}
        ends = [0] * len(dirs)
        record = 0
        for name, p in params:
            # (a VLM vision tower trained on the device keeps its state there)
            if not p.requires_grad or p.numel() < min_numel or p.device.type != "cpu" or p in self._params:
                continue
            arrays = _ARRAYS if placement == "all" and p.dtype in LOW_PRECISION else _ARRAYS[1:]
            tiles = []
            for start in range(0, p.numel(), tile):
                length, file = min(tile, p.numel() - start), record % len(dirs)
                t = _Tile(file, ends[file], start, length, _padded(length))
                tiles.append(t)
                ends[file] += t.nbytes(len(arrays))
                record += 1
            self._params[p] = _Param(name, arrays, tiles)
        self.slot_bytes = ends   # per file; the file holds two slots
        self.reclaimed = [f for d in dirs for f in reclaim(d)]
        token = f"{os.getpid()}-{id(self):x}"
        # held (flock) while the files live: a later run removes the files of a killed one
        self._locks = [_hold(d / f"megatrain-tier-{token}.lock") for d in dict.fromkeys(dirs)]
        self.paths = [d / f"megatrain-tier-{token}-{i}.bin" for i, d in enumerate(dirs)]
        try:
            self._engine = tier_io.Engine(self.paths, [max(2 * e, tier_io.ALIGN) for e in ends],
                                          queue_depth=queue_depth, direct=direct)
        except BaseException:
            self.close()
            raise
        self._lock = threading.RLock()
        widest = max((t.nbytes(len(q.arrays)) for q in self._params.values() for t in q.tiles), default=tier_io.ALIGN)
        tiles = sum(len(q.tiles) for q in self._params.values())
        count = self._count = max(4, min(pool_bytes // widest, tiles + 4))
        self._pool = tier_io.aligned_empty(count * widest)
        self._free = deque(self._pool[i * widest:(i + 1) * widest] for i in range(count))
        self._writes: dict[int, tuple[torch.Tensor, nn.Parameter]] = {}   # ticket -> (buffer, parameter)
        self._param_writes: dict[nn.Parameter, dict[int, int]] = {}     # param -> {ticket: slot written}
        self._ahead: dict[tuple, tuple[int, torch.Tensor]] = {}            # (param, tile, slot) -> (ticket, buf)
        self._queue: deque = deque()                                        # (param, tile index) to read ahead
        self.counters = {"stalls": 0, "read_ahead_hits": 0}
        try:
            for name, p in params:
                if p in self._params:
                    self._adopt(p, name)
        except BaseException:
            self.close()
            raise

    # -- what is where -------------------------------------------------------------
    def __contains__(self, p) -> bool:
        return p in self._params

    def __len__(self) -> int:
        return len(self._params)

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self._params)

    def holds_master(self, p) -> bool:
        return p in self._params and "master" in self._params[p].arrays

    @property
    def nbytes(self) -> int:
        """Bytes of one slot in all files (the state held; the files hold twice this)."""
        return sum(self.slot_bytes)

    def _address(self, q: _Param, t: _Tile, slot: int) -> tuple[int, int]:
        return t.file, slot * self.slot_bytes[t.file] + t.offset

    @staticmethod
    def _views(q: _Param, t: _Tile, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        flat = buf[:t.nbytes(len(q.arrays))].view(torch.float32)
        return {a: flat[i * t.stride: i * t.stride + t.length] for i, a in enumerate(q.arrays)}

    # -- the move in ---------------------------------------------------------------
    @torch.no_grad()
    def _adopt(self, p: nn.Parameter, name: str) -> None:
        """Write p's present state into slot 0 (master; zero moments) and leave a stand-in in RAM."""
        q = self._params[p]
        master = None
        if "master" in q.arrays:
            entry = entry_for(p, name, False)
            master = entry.master.view(-1)
        for i, t in enumerate(q.tiles):
            buf = self._take()
            buf.zero_()
            if master is not None:
                self._views(q, t, buf)["master"].copy_(master[t.start:t.start + t.length])
            self._write(p, q, i, buf, 0)
        if master is not None:
            self._wait_writes(p)
            # 4 bytes in RAM for the master's shape: p.data may show it while an fp32 gradient is
            # assigned (store.add_host_grad); its values live in the tier
            entry.master = torch.empty((), dtype=torch.float32).expand(p.shape)
            entry.tier = self

    # -- buffers and requests --------------------------------------------------------
    def _take(self) -> torch.Tensor:
        with self._lock:
            while not self._free:
                if self._writes:
                    self._retire(next(iter(self._writes)))   # the oldest write in flight
                elif self._ahead:   # every buffer holds a read ahead: give up the latest one
                    self._unread(next(reversed(self._ahead)))
                else:   # pragma: no cover - the pool has at least 4 buffers
                    raise RuntimeError("StateTier: no bounce buffer free")
            return self._free.popleft()

    def _retire(self, ticket: int) -> None:
        buf, p = self._writes.pop(ticket)
        tickets = self._param_writes.get(p)
        if tickets is not None:
            tickets.pop(ticket, None)
            if not tickets:
                del self._param_writes[p]
        try:
            self._engine.wait(ticket)
        finally:
            self._free.append(buf)

    def _write(self, p, q: _Param, i: int, buf: torch.Tensor, slot: int) -> None:
        t = q.tiles[i]
        file, offset = self._address(q, t, slot)
        with self._lock:
            ticket = self._engine.write(file, offset, buf[:t.nbytes(len(q.arrays))])
            self._writes[ticket] = (buf, p)
            self._param_writes.setdefault(p, {})[ticket] = slot

    def _wait_writes(self, p, slot: int | None = None) -> None:
        """Wait for p's writes in flight (those to `slot` only, if given: an update reads one
        slot and writes the other, so its reads never wait for its own writes)."""
        with self._lock:
            for ticket, written in list(self._param_writes.get(p, {}).items()):
                if slot is None or written == slot:
                    self._retire(ticket)

    def _writing(self, p, slot: int) -> bool:
        return slot in self._param_writes.get(p, {}).values()

    def _read(self, p, q: _Param, i: int, slot: int, update: bool = False) -> torch.Tensor:
        """Tile i of p from `slot` in a bounce buffer (read ahead, or read now)."""
        with self._lock:
            ahead = self._ahead.pop((p, i, slot), None)
            if ahead is None:
                self._wait_writes(p, slot)   # (read after write)
                self.counters["stalls"] += update
                buf = self._take()
                t = q.tiles[i]
                ticket = self._engine.read(*self._address(q, t, slot), buf[:t.nbytes(len(q.arrays))])
            else:
                ticket, buf = ahead
                self.counters["read_ahead_hits"] += 1
        try:
            self._engine.wait(ticket)
        except BaseException:
            with self._lock:
                self._free.append(buf)
            raise
        return buf

    # -- read ahead ------------------------------------------------------------------
    def expect(self, params) -> None:
        """The updates come next in this order: read their state ahead (as the pool allows),
        dropping reads ahead for anything else."""
        with self._lock:
            self._drop_ahead()
            self._queue = deque((p, i) for p in params if p in self._params for i in range(len(self._params[p].tiles)))
            self._pump()

    def _drop_ahead(self) -> None:
        self._queue = deque()
        for key in list(self._ahead):
            self._unread(key)

    def _unread(self, key) -> None:
        """Drop a read ahead: its buffer comes back once the read is over (a failed read's
        error goes with it: nobody uses its bytes, and a later read of them reports its own)."""
        ticket, buf = self._ahead.pop(key)
        try:
            self._engine.wait(ticket)
        except OSError:
            pass
        finally:
            self._free.append(buf)

    def _forget(self, p) -> None:
        """Drop p's reads ahead (its committed state is about to change)."""
        with self._lock:
            for key in [k for k in self._ahead if k[0] is p]:
                self._unread(key)

    def _pump(self) -> None:
        """Issue reads ahead, at most half the pool's buffers (the rest take the writes in flight)."""
        for ticket in [t for t in self._writes if self._engine.done(t)]:   # their buffers are free again
            self._retire(ticket)
        while self._queue and self._free and len(self._ahead) < self._count // 2:
            p, i = self._queue.popleft()
            q = self._params[p]
            if (p, i, q.slot) in self._ahead:
                continue
            if self._writing(p, q.slot):   # the writes of that slot first (read after write)
                self._queue.appendleft((p, i))
                break
            buf = self._free.popleft()
            t = q.tiles[i]
            ticket = self._engine.read(*self._address(q, t, q.slot), buf[:t.nbytes(len(q.arrays))])
            self._ahead[(p, i, q.slot)] = (ticket, buf)

    # -- the update ------------------------------------------------------------------
    @torch.no_grad()
    def update(self, p, grad: torch.Tensor, low: torch.Tensor | None, master: torch.Tensor | None, kernel,
               hyper: tuple, step: int, grad_scale: float, threads: int, speculative: bool = False) -> int:
        """AdamW over p's tiles (`kernel.adamw_step` on each tile's views; `master` is p's RAM
        master when the tier does not hold it). Reads the committed slot, writes the other; flips
        it unless `speculative` (then `commit` or `discard` decides). Returns the number of
        non-finite blocks (as adamw_step). Returns once every tile is computed."""
        lr, beta1, beta2, eps, wd = hyper
        q = self._params[p]
        if q.pending is not None:
            raise RuntimeError(f"StateTier: {q.name} has a speculative update neither committed nor discarded")
        self._wait_writes(p)   # (a redo writes where the undone update wrote: in order)
        g = grad.view(-1)
        lo = low.view(-1) if low is not None else None
        ram = master.view(-1) if master is not None else None
        bad = 0
        out = 1 - q.slot
        for i, t in enumerate(q.tiles):
            buf = self._read(p, q, i, q.slot, update=True)
            v = self._views(q, t, buf)
            s, e = t.start, t.start + t.length
            weights = v["master"] if "master" in v else ram[s:e]
            bad += kernel.adamw_step(weights, g[s:e], v["exp_avg"], v["exp_avg_sq"],
                                     lo[s:e] if lo is not None else None, lr, beta1, beta2, eps, wd, step,
                                     grad_scale, threads)
            self._write(p, q, i, buf, out)
            with self._lock:
                self._pump()
        if speculative:
            q.pending = out
        else:
            q.slot = out
        return bad

    def commit(self, p) -> None:
        """Keep p's speculative update."""
        q = self._params[p]
        if q.pending is not None:
            q.slot, q.pending = q.pending, None

    def discard(self, p) -> None:
        """Undo p's speculative update: its committed slot still holds the state before it."""
        self._params[p].pending = None

    # -- whole arrays (checkpoints, the store, tests) ------------------------------------
    @torch.no_grad()
    def read(self, p, which: str) -> torch.Tensor:
        """A new fp32 tensor shaped like p with the committed `which` ("master", "exp_avg",
        "exp_avg_sq")."""
        q = self._params[p]
        if which not in q.arrays:
            raise KeyError(f"StateTier: {q.name} has no {which} in the tier")
        out = torch.empty(p.shape, dtype=torch.float32)
        flat = out.view(-1)
        for i, t in enumerate(q.tiles):
            buf = self._read(p, q, i, q.slot)
            flat[t.start:t.start + t.length].copy_(self._views(q, t, buf)[which])
            with self._lock:
                self._free.append(buf)
        return out

    @torch.no_grad()
    def write(self, p, **arrays: torch.Tensor) -> None:
        """Set p's committed `master` / `exp_avg` / `exp_avg_sq` (those given; the others stay)."""
        q = self._params[p]
        unknown = set(arrays) - set(q.arrays)
        if unknown:
            raise KeyError(f"StateTier: {q.name} has no {', '.join(sorted(unknown))} in the tier")
        flats = {k: v.detach().reshape(-1) for k, v in arrays.items() if v is not None}
        for k, v in flats.items():
            if v.numel() != p.numel():
                raise ValueError(f"StateTier: {q.name}.{k} has {v.numel()} elements, the parameter {p.numel()}")
        whole = set(flats) == set(q.arrays)
        self._forget(p)
        for i, t in enumerate(q.tiles):
            if whole:
                self._wait_writes(p)
                buf = self._take()
            else:
                buf = self._read(p, q, i, q.slot)
            views = self._views(q, t, buf)
            for k, v in flats.items():
                views[k].copy_(v[t.start:t.start + t.length])
            self._write(p, q, i, buf, q.slot)
        self._wait_writes(p)

    def synchronize(self) -> None:
        """Every write issued so far is on disk (raises the first I/O error)."""
        with self._lock:
            for ticket in list(self._writes):
                self._retire(ticket)

    def io_counters(self) -> dict:
        return {**self._engine.counters(), **self.counters}

    def close(self) -> None:
        """Drop the files (the state in them is lost: checkpoints are the way to keep it)."""
        engine, self._engine = getattr(self, "_engine", None), None
        try:
            if engine is not None:
                with self._lock:
                    try:
                        self._engine = engine
                        self._drop_ahead()
                        for ticket in list(self._writes):
                            try:
                                self._retire(ticket)
                            except OSError:
                                pass
                    finally:
                        self._engine = None
                        engine.close(remove=True)
        finally:
            locks, self._locks = getattr(self, "_locks", []), []
            for fd, path in locks:
                path.unlink(missing_ok=True)
                os.close(fd)
