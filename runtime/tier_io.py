"""The I/O engine of the NVMe state tier: asynchronous, checked reads and writes of 4 KiB-aligned
extents of a few preallocated files (one per drive).

    e = Engine([path_a, path_b], [size_a, size_b])     # creates and preallocates the files
    t = e.write(0, 0, buf)                               # ticket; returns at once
    e.wait(t)                                            # raises TierIOError if the write failed
    e.close()                                            # removes the files

The work is done by a C++ extension (`csrc/tier_io.cpp`, compiled on first use with torch's C++
extension builder and cached under ~/.cache/torch_extensions, as the host AdamW kernel is):
`queue_depth` threads per file run blocking pread/pwrite without the GIL, with O_DIRECT so the
state the tier keeps out of RAM does not come back as page cache. Every result is checked; a
failed request raises `TierIOError` (`TierSpaceError` for a full disk or quota) naming the path,
offset, length and the errno's text, for whoever waits on it. `measure_ssd` measures the drives
with this same engine, for the planner's SSD profile and the benchmark's limit.
"""
from __future__ import annotations

import errno as errno_codes
import logging
import operator
import os
import statistics
import threading
import time
import uuid
import weakref
from pathlib import Path

import torch

log = logging.getLogger("megatrain.tier")

#: every offset, size and buffer address is a multiple of this (O_DIRECT's requirement)
ALIGN = 4096

_KERNEL: list = []   # [module], loaded once


def kernel():
    """The compiled C++ engine module (raises RuntimeError when it cannot be built here: the
    tier has no fallback)."""
    if not _KERNEL:
        from torch.utils.cpp_extension import load
        try:
            source = Path(__file__).with_name("csrc") / "tier_io.cpp"
            _KERNEL.append(load(name="megatrain_tier_io", sources=[str(source)], extra_cflags=["-O2"], verbose=False))
        except Exception as e:
            raise RuntimeError(f"megatrain: the state tier's I/O engine could not be built ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}); install ninja and a C++ compiler, "
                               "or keep the optimizer state in RAM.") from e
    return _KERNEL[0]


class TierIOError(OSError):
    """An I/O request of the state tier failed; the message names path, offset, length and the
    errno text. `errno`, `strerror`, `filename` (the path) as OSError, plus `offset`, `length`
    and `op` ("read", "write", "sync", "open", "preallocate")."""

    def __init__(self, code: int, path, offset: int = 0, length: int = 0, op: str = "read", detail: str = ""):
        super().__init__(code, os.strerror(code), str(path))
        self.offset = offset
        self.length = length
        self.op = op
        self.detail = detail

    def __str__(self) -> str:
        name = errno_codes.errorcode.get(self.errno, str(self.errno))
        return (f"state tier: {self.op} of {self.length} bytes at offset {self.offset} of {self.filename} failed: "
                f"[Errno {self.errno}] {name} {self.strerror}{self.detail}")

    def __reduce__(self):   # (OSError's pickling would pass the wrong arguments back to __init__)
        return type(self), (self.errno, self.filename, self.offset, self.length, self.op, self.detail)


class TierSpaceError(TierIOError):
    """The state tier's drive is full (ENOSPC) or over quota (EDQUOT), at preallocation or at a write."""


_SPACE = (errno_codes.ENOSPC, errno_codes.EDQUOT)


def _error(code: int, path, offset: int, length: int, op: str, detail: str = "") -> TierIOError:
    return (TierSpaceError if code in _SPACE else TierIOError)(code, path, offset, length, op, detail)


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `nbytes` whose data_ptr is a multiple of ALIGN
    (over-allocated by one page and sliced; the view keeps its base alive)."""
    if nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes={nbytes} is negative")
    base = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = -base.data_ptr() % ALIGN
    return base[start:start + nbytes]


def file_system_of(path) -> str:
    """The type of the file system holding `path` (the longest mount point above it in
    /proc/mounts), or "unknown"."""
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return kind


def _free_bytes(path) -> int:
    """Bytes free to an unprivileged user on the file system holding `path` (-1: unknown)."""
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
        return st.f_bavail * st.f_frsize
    except OSError:
        return -1


def _space_error(code: int, path: Path, asked: int) -> TierIOError:
    free = _free_bytes(path)
    where = f"{free} bytes are free there" if free >= 0 else "the free space is unknown"
    return _error(code, path, 0, asked, "preallocate",
                  f" (the tier's files on this drive ask for {asked} bytes, {where}; point the tier at a larger drive "
                  "or keep less state on NVMe)")


def _check_space(paths: list[Path], sizes: list[int]) -> None:
    """TierSpaceError when the files on one file system need more than it has free, before any is
    created: a preallocation that fails takes the drive's last free blocks first (ext4 keeps what
    it allocated until the file is removed), which would fail the writes of everyone else on it."""
    asked: dict[int, int] = {}
    for path, size in zip(paths, sizes):
        try:
            device = os.stat(path.parent).st_dev
        except OSError:
            continue   # (a missing directory: open() says so, naming it)
        asked[device] = asked.get(device, 0) + size
        free = _free_bytes(path)
        if 0 <= free < asked[device]:
            raise _space_error(errno_codes.ENOSPC, path, asked[device])


def _close(ext_engine, held: dict, remove: bool) -> None:
    """Finalizer and close(): lets queued requests finish (the buffers in `held` stay alive until
    then), joins the workers, closes and optionally removes the files."""
    ext_engine.close(remove)
    held.clear()


class Engine:
    """Preallocated files, one per path, and asynchronous aligned reads and writes of them.

    Each file is created (mode 0600) with O_DIRECT and preallocated to its size, so a full disk
    fails here (`TierSpaceError` naming the path, the bytes asked and the bytes free) and not in
    the middle of training. A file system that refuses O_DIRECT at open (EINVAL: some FUSE,
    overlay, NFS setups, tmpfs before Linux 6.6) gets buffered I/O instead, with one warning; each
    range is then written back and dropped from the page cache after its request.
    `queue_depth` worker threads per file run the requests.

    A ticket is waited once (wait or wait_all): its error is raised then, and waiting it again
    returns at once. The engine holds a reference to each request's buffer until its ticket is
    waited; the caller must not change a write's buffer, or read a read's, before that.
    """

    def __init__(self, paths: list, sizes: list[int], queue_depth: int = 8, direct: bool = True, *,
                 _simulate_einval: bool = False):
        # (`_simulate_einval`: tests only, open(O_DIRECT) behaves as on a file system without direct I/O)
        self.paths = [Path(p) for p in paths]
        self.sizes = [int(s) for s in sizes]
        if len(self.paths) != len(self.sizes) or not self.paths:
            raise ValueError(f"Engine: {len(self.paths)} paths and {len(self.sizes)} sizes; give one size per path")
        for path, size in zip(self.paths, self.sizes):
            if size < 0 or size % ALIGN:
                raise ValueError(f"Engine: size {size} of {path} is not a multiple of {ALIGN}")
        if len(set(map(os.path.abspath, self.paths))) != len(self.paths):
            raise ValueError(f"Engine: the paths {[str(p) for p in self.paths]} repeat one; give one file per drive")
        if queue_depth < 1:
            raise ValueError(f"Engine: queue_depth={queue_depth}; use 1 or more")
        _check_space(self.paths, self.sizes)
        self.direct: list[bool] = []
        self._pid = os.getpid()
        self._held: dict[int, torch.Tensor] = {}   # ticket -> buffer, until waited
        self._submitting = threading.Lock()         # (a ticket enters _held before wait_all can drop it)
        self._ext = kernel().Engine(int(queue_depth))
        self._finalizer = weakref.finalize(self, _close, self._ext, self._held, True)
        try:
            for path, size in zip(self.paths, self.sizes):
                code, stage, in_use = self._ext.add_file(str(path), size, bool(direct), bool(_simulate_einval))
                if code:
                    self._finalizer()   # (removes the files created so far, then the free space is measured)
                    if stage == "fallocate":
                        raise _space_error(code, path, size)
                    raise _error(code, path, 0, size, "open")
                self.direct.append(in_use)
                if direct and not in_use:
                    log.warning("state tier: %s is on a %s file system, which refuses O_DIRECT; using buffered I/O "
                                "(each range is written back and dropped from the page cache after its request)",
                                path, file_system_of(path.parent))
        except BaseException:
            self._finalizer()
            raise

    # -- requests --------------------------------------------------------------------
    def _file(self, file) -> None:
        try:
            index = operator.index(file)
        except TypeError:
            index = -1
        if not 0 <= index < len(self.paths):
            raise ValueError(f"Engine: file {file!r}; this engine has files 0..{len(self.paths) - 1}")

    def _check(self, file: int, offset: int, buf: torch.Tensor) -> int:
        """buf's size in bytes, after the checks a request needs before it is submitted (ValueError)."""
        if not self._finalizer.alive:
            raise ValueError("Engine: closed")
        self._file(file)
        if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("Engine: the buffer must be a contiguous CPU tensor")
        nbytes = buf.numel() * buf.element_size()
        if offset < 0 or offset % ALIGN or nbytes % ALIGN or buf.data_ptr() % ALIGN:
            raise ValueError(f"Engine: offset {offset}, size {nbytes} and buffer address {buf.data_ptr():#x} must be "
                             f"multiples of {ALIGN} (allocate buffers with aligned_empty)")
        if offset + nbytes > self.sizes[file]:
            raise ValueError(f"Engine: {nbytes} bytes at offset {offset} pass the end of {self.paths[file]} "
                             f"({self.sizes[file]} bytes)")
        return nbytes

    def _submit(self, file: int, offset: int, buf: torch.Tensor, write: bool) -> int:
        nbytes = self._check(file, offset, buf)
        with self._submitting:
            ticket = self._ext.submit(int(file), write, int(offset), buf.data_ptr(), nbytes)
            self._held[ticket] = buf
        return ticket

    def read(self, file: int, offset: int, buf: torch.Tensor) -> int:
        """Queue a read of len(buf) bytes at `offset` of file `file` into `buf`; returns its ticket."""
        return self._submit(file, offset, buf, False)

    def write(self, file: int, offset: int, buf: torch.Tensor) -> int:
        """Queue a write of `buf` at `offset` of file `file`; returns its ticket."""
        return self._submit(file, offset, buf, True)

    def wait(self, ticket: int) -> None:
        """Block (without the GIL) until the request is done; raise its TierIOError if it failed."""
        try:
            code, file, offset, nbytes, write = self._ext.wait(ticket)
        finally:
            self._held.pop(ticket, None)
        if code:
            raise _error(code, self.paths[file], offset, nbytes, "write" if write else "read")

    def done(self, ticket: int) -> bool:
        """Whether the request has completed (successfully or not), without blocking."""
        return self._ext.done(ticket)

    def wait_all(self) -> None:
        """Wait for every request submitted so far; raise the first error not yet raised."""
        mark, code, file, offset, nbytes, write = self._ext.wait_all()
        with self._submitting:
            for ticket in [t for t in list(self._held) if t < mark]:   # (list(): other threads pop too)
                self._held.pop(ticket, None)
        if code:
            raise _error(code, self.paths[file], offset, nbytes, "write" if write else "read")

    def sync(self) -> None:
        """wait_all, then fdatasync every file: what was written is on the drive."""
        self.wait_all()
        code, file = self._ext.sync()
        if code:
            raise _error(code, self.paths[file], 0, self.sizes[file], "sync")

    def close(self, remove: bool = True) -> None:
        """Let every queued request finish, close the files and, with `remove`, delete them.
        Idempotent. Raises the first error of a request nobody waited for (after closing)."""
        if not self._finalizer.alive:
            return
        self._finalizer.detach()
        try:
            if os.getpid() == self._pid:   # (a forked child has no workers to wait for: it only lets go)
                self.wait_all()
        finally:
            _close(self._ext, self._held, remove)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- measurement and tests -------------------------------------------------------
    def counters(self) -> dict:
        """Bytes and number of the requests that succeeded (a failed one counts nothing), and busy
        seconds: the time during which at least one read (write; any) request was in flight, so
        bytes / busy seconds is the bandwidth."""
        keys = ("bytes_read", "bytes_written", "reads", "writes", "read_busy_s", "write_busy_s", "busy_s")
        return dict(zip(keys, self._ext.counters()))

    def reset_counters(self) -> None:
        self._ext.reset_counters()

    def inject(self, file: int, *, after_bytes: int = 0, error: int = 0, delay_us: int = 0) -> None:
        """TEST HOOK: once file `file` has moved `after_bytes` more bytes, every following request
        on it fails with errno `error` (0: none), as if the syscall had returned it; `delay_us`
        sleeps before each request (a slow drive). inject(file) clears both."""
        self._file(file)
        self._ext.inject(int(file), int(after_bytes), int(error), int(delay_us))


def measure_ssd(paths: list, bytes_per_path: int = 1 << 30, request: int = 1 << 20, queue_depth: int = 8,
                repeat: int = 3) -> tuple[float, float]:
    """(read GB/s, write GB/s) of the drives holding the directories `paths`, together (1e9 bytes
    per GB): one temporary file of `bytes_per_path` per directory (removed after), `request`-byte
    requests, `queue_depth` in flight per file, through `Engine` (O_DIRECT; buffered with the page
    cache dropped where a file system refuses it). Each round writes every file whole and syncs
    (the write time includes the fdatasync), then reads them back; the result is the MEDIAN of
    `repeat` rounds, each figure separately."""
    if request <= 0 or request % ALIGN:
        raise ValueError(f"measure_ssd: request={request} must be a positive multiple of {ALIGN}")
    count = max(1, bytes_per_path // request)
    size = count * request
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    files = [Path(d) / f".megatrain-ssd-probe-{token}.bin" for d in paths]
    # random contents (a drive may compress or skip zeros); one source for every write, and a few
    # destinations per file for the reads (what they hold is not looked at)
    source = aligned_empty(request)
    source.copy_(torch.randint(0, 256, (request,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    sinks = [aligned_empty(request) for _ in range(queue_depth)]
    reads, writes = [], []
    with Engine(files, [size] * len(files), queue_depth=queue_depth) as engine:
        for _ in range(max(1, repeat)):
            start = time.perf_counter()
            for i in range(count):
                for f in range(len(files)):
                    engine.write(f, i * request, source)
            engine.sync()
            writes.append(size * len(files) / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            for i in range(count):
                for f in range(len(files)):
                    engine.read(f, i * request, sinks[i % queue_depth])
            engine.wait_all()
            reads.append(size * len(files) / (time.perf_counter() - start) / 1e9)
    return statistics.median(reads), statistics.median(writes)
