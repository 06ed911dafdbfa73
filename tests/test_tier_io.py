"""runtime/tier_io.py, the state tier's I/O engine: what is read back equals what was written
(many requests in flight, O_DIRECT and buffered), bad requests are refused before anything is
queued, every failure (injected EIO/ENOSPC, a preallocation larger than the drive) raises a
TierIOError naming the path, offset and errno, the files never outlive the engine, and the
counters and measure_ssd measure what moved."""
from __future__ import annotations

import copy
import ctypes
import errno
import gc
import logging
import math
import mmap
import os
import threading
import time
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megacompile.runtime import tier_io
from megacompile.runtime.tier_io import ALIGN, Engine, TierIOError, TierSpaceError, aligned_empty

PAGE = ALIGN


def _random(nbytes: int, seed: int, dtype=torch.uint8) -> torch.Tensor:
    """An aligned buffer of `nbytes` random bytes, viewed as `dtype`."""
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return buf.view(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bytes seen as floats hold NaNs)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _engine(tmp_path, sizes, **kw) -> Engine:
    return Engine([tmp_path / f"f{i}.bin" for i in range(len(sizes))], sizes, **kw)


def test_aligned_empty():
    for n in (0, 1, PAGE, 3 * PAGE + 5):
        t = aligned_empty(n)
        assert t.dtype == torch.uint8 and t.numel() == n and t.data_ptr() % ALIGN == 0


def test_basic_round_trip(tmp_path):
    e = _engine(tmp_path, [64 * PAGE, 16 * PAGE])
    assert e.direct == [True, True]   # O_DIRECT works on ext4 and on tmpfs since Linux 6.6
    data = _random(8 * PAGE, 1, torch.float32)
    e.wait(e.write(1, 4 * PAGE, data))
    back = aligned_empty(8 * PAGE).view(torch.float32)
    e.wait(e.read(1, 4 * PAGE, back))
    assert _same(back, data)
    e.close()


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_round_trip_many_requests_in_flight(tmp_path_factory, data):
    """Non-overlapping extents of 1-3 files, written all at once, then reads of the old contents
    interleaved with writes of new ones, then everything read back; a read queued after a waited
    write sees it."""
    tmp = tmp_path_factory.mktemp("rt")
    files = data.draw(st.integers(1, 3))
    direct = data.draw(st.booleans())
    extents = []   # (file, offset, nbytes)
    sizes = []
    for f in range(files):
        pages = data.draw(st.lists(st.integers(1, 64), min_size=1, max_size=6))
        start = 0
        for n in pages:
            extents.append((f, start * PAGE, n * PAGE))
            start += n
        sizes.append(start * PAGE)
    dtype = data.draw(st.sampled_from([torch.uint8, torch.float32, torch.bfloat16]))
    seed = data.draw(st.integers(0, 2**31))
    e = Engine([tmp / f"t{i}" for i in range(files)], sizes, queue_depth=data.draw(st.integers(1, 4)), direct=direct)
    old = [_random(n, seed + i, dtype) for i, (_, _, n) in enumerate(extents)]
    tickets = [e.write(f, off, buf) for (f, off, _), buf in zip(extents, old)]
    for t in data.draw(st.permutations(tickets)):
        e.wait(t)
    # interleaved: each extent is either read (old contents) or rewritten (new), all in flight
    rewrite = data.draw(st.lists(st.booleans(), min_size=len(extents), max_size=len(extents)))
    new = [_random(n, seed + 1000 + i, dtype) for i, (_, _, n) in enumerate(extents)]
    seen = [aligned_empty(n).view(dtype) for (_, _, n) in extents]
    order = data.draw(st.permutations(range(len(extents))))
    tickets = [(e.write if rewrite[i] else e.read)(extents[i][0], extents[i][1], (new if rewrite[i] else seen)[i])
               for i in order]
    e.wait_all()
    assert all(e.done(t) for t in tickets)
    for i in range(len(extents)):
        if not rewrite[i]:
            assert _same(seen[i], old[i])
    expect = [new[i] if rewrite[i] else old[i] for i in range(len(extents))]
    back = [aligned_empty(n).view(dtype) for (_, _, n) in extents]
    tickets = [e.read(f, off, buf) for (f, off, _), buf in zip(extents, back)]
    for t in tickets:
        e.wait(t)
    for b, x in zip(back, expect):
        assert _same(b, x)
    e.close()
    assert list(tmp.iterdir()) == []


def test_bad_requests_are_refused_before_anything_is_queued(tmp_path):
    e = _engine(tmp_path, [16 * PAGE])
    good = aligned_empty(PAGE)
    with pytest.raises(ValueError, match="multiples of 4096"):
        e.write(0, 100, good)                                 # misaligned offset
    with pytest.raises(ValueError, match="multiples of 4096"):
        e.write(0, 0, aligned_empty(PAGE + 512))              # misaligned size
    with pytest.raises(ValueError, match="multiples of 4096"):
        e.read(0, 0, aligned_empty(2 * PAGE)[1:PAGE + 1])     # misaligned buffer
    with pytest.raises(ValueError, match="pass the end"):
        e.read(0, 16 * PAGE, good)                            # past the end
    with pytest.raises(ValueError, match="pass the end"):
        e.write(0, 12 * PAGE, aligned_empty(8 * PAGE))        # runs over the end
    with pytest.raises(ValueError, match="files 0..0"):
        e.read(1, 0, good)
    with pytest.raises(ValueError, match="contiguous"):
        e.read(0, 0, aligned_empty(4 * PAGE).view(2, 2 * PAGE)[:, :PAGE])
    with pytest.raises(ValueError, match="multiple of 4096"):
        Engine([tmp_path / "odd"], [PAGE + 1])
    e.wait_all()
    c = e.counters()
    assert c["reads"] == c["writes"] == c["bytes_read"] == c["bytes_written"] == 0 and not e._held
    e.close()
    with pytest.raises(ValueError, match="closed"):
        e.read(0, 0, good)


def test_injected_eio_names_path_offset_errno_and_spares_other_files(tmp_path):
    e = _engine(tmp_path, [16 * PAGE, 16 * PAGE])
    buf = _random(PAGE, 3)
    e.inject(0, after_bytes=2 * PAGE, error=errno.EIO)
    e.wait(e.write(0, 0, buf))
    e.wait(e.write(0, PAGE, buf))                  # 2 pages moved: from here on, every request fails
    with pytest.raises(TierIOError) as caught:
        e.wait(e.write(0, 5 * PAGE, buf))
    err = caught.value
    assert not isinstance(err, TierSpaceError) and isinstance(err, OSError)
    assert (err.errno, err.filename, err.offset, err.length, err.op) == (errno.EIO, str(e.paths[0]), 5 * PAGE,
                                                                        PAGE, "write")
    msg = str(err)
    assert str(e.paths[0]) in msg and str(5 * PAGE) in msg and "EIO" in msg and os.strerror(errno.EIO) in msg
    assert str(copy.copy(err)) == msg   # (reduced and rebuilt, as when it crosses processes)
    with pytest.raises(TierIOError, match="read of 4096 bytes at offset 0"):
        e.wait(e.read(0, 0, aligned_empty(PAGE)))
    back = aligned_empty(PAGE)                     # the other file still works
    e.wait(e.write(1, 0, buf))
    e.wait(e.read(1, 0, back))
    assert torch.equal(back, buf)
    e.inject(0)                                    # cleared
    e.wait(e.read(0, PAGE, back))
    assert torch.equal(back, buf)
    e.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_injected_full_disk_raises_space_error_once(tmp_path, code):
    e = _engine(tmp_path, [16 * PAGE])
    buf = _random(PAGE, 4)
    e.inject(0, error=code)
    tickets = [e.write(0, i * PAGE, buf) for i in range(4)]
    with pytest.raises(TierSpaceError) as caught:
        e.wait_all()
    assert caught.value.errno == code and caught.value.offset == 0 and caught.value.op == "write"
    assert all(e.done(t) for t in tickets) and not e._held
    e.wait_all()                                   # raised once: nothing left to raise
    e.wait(tickets[1])                             # a ticket already waited (by wait_all) returns at once
    e.inject(0)
    e.wait(e.write(0, 0, buf))
    e.close()


def test_error_of_an_unwaited_request_is_raised_by_close_after_cleanup(tmp_path):
    e = _engine(tmp_path, [4 * PAGE])
    e.inject(0, error=errno.EIO)
    e.write(0, 0, aligned_empty(PAGE))
    with pytest.raises(TierIOError):
        e.close()
    assert list(tmp_path.iterdir()) == []
    e.close()                                      # idempotent


def test_slow_drive_gives_same_contents_and_counts_its_time(tmp_path):
    e = _engine(tmp_path, [32 * PAGE], queue_depth=2)
    e.inject(0, delay_us=3000)
    bufs = [_random(4 * PAGE, 10 + i) for i in range(8)]
    for i, b in enumerate(bufs):
        e.write(0, i * 4 * PAGE, b)
    e.sync()
    back = [aligned_empty(4 * PAGE) for _ in bufs]
    for i, b in enumerate(back):
        e.read(0, i * 4 * PAGE, b)
    e.wait_all()
    assert all(torch.equal(a, b) for a, b in zip(back, bufs))
    c = e.counters()
    assert c["write_busy_s"] >= 4 * 0.003 and c["read_busy_s"] >= 4 * 0.003   # 8 delayed requests, 2 at a time
    e.close()


def test_wait_blocks_without_the_gil(tmp_path):
    e = _engine(tmp_path, [PAGE])
    e.inject(0, delay_us=300_000)
    ticket = e.write(0, 0, aligned_empty(PAGE))
    waiter = threading.Thread(target=e.wait, args=(ticket,))
    start = time.perf_counter()
    waiter.start()
    spins = 0
    while waiter.is_alive():
        spins += 1
    assert time.perf_counter() - start >= 0.25 and spins > 1000   # this thread ran while the other waited
    e.close()


def test_buffer_is_held_until_waited(tmp_path):
    e = _engine(tmp_path, [PAGE])
    e.inject(0, delay_us=50_000)
    buf = aligned_empty(PAGE)
    alive = weakref.ref(buf)
    ticket = e.read(0, 0, buf)
    del buf
    gc.collect()
    assert alive() is not None
    e.wait(ticket)
    gc.collect()
    assert alive() is None
    e.close()


def test_preallocation_larger_than_the_drive_fails_before_anything(tmp_path):
    st_ = os.statvfs(tmp_path)
    free = st_.f_bavail * st_.f_frsize
    too_big = (free // PAGE + (1 << 18)) * PAGE        # 1 GiB more than is free
    with pytest.raises(TierSpaceError) as caught:
        Engine([tmp_path / "big"], [too_big])
    assert caught.value.errno == errno.ENOSPC and caught.value.op == "preallocate"
    assert str(tmp_path / "big") in str(caught.value) and f"ask for {too_big} bytes" in str(caught.value)
    # two files on one drive that together do not fit
    half = (free // PAGE // 2 + (1 << 18)) * PAGE
    with pytest.raises(TierSpaceError, match="are free there"):
        Engine([tmp_path / "a", tmp_path / "b"], [half, half])
    assert list(tmp_path.iterdir()) == []


def test_failed_preallocation_removes_the_files(tmp_path, monkeypatch):
    """posix_fallocate's own error (free-space check skipped): a size no file can have fails at
    once, before it allocates, on ext4 (EFBIG) and tmpfs (ENOSPC); the files made before it go."""
    kind = tier_io.file_system_of(tmp_path)
    if kind not in ("ext4", "tmpfs"):
        pytest.skip(f"{kind}: a huge posix_fallocate might fill the drive before it fails")
    monkeypatch.setattr(tier_io, "_free_bytes", lambda path: -1)
    with pytest.raises(TierIOError) as caught:
        Engine([tmp_path / "ok", tmp_path / "huge"], [PAGE, 1 << 50])
    assert caught.value.errno in (errno.EFBIG, errno.ENOSPC) and caught.value.op == "preallocate"
    assert str(tmp_path / "huge") in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_open_failure_names_the_path(tmp_path):
    with pytest.raises(TierIOError, match="open .* of .*missing/f.*ENOENT") as caught:
        Engine([tmp_path / "missing" / "f"], [PAGE])
    assert caught.value.errno == errno.ENOENT


def test_buffered_fallback_warns_once_and_round_trips(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="megatrain.tier"):
        e = Engine([tmp_path / "buffered"], [16 * PAGE], _simulate_einval=True)
    warnings = [r for r in caplog.records if r.name == "megatrain.tier"]
    assert e.direct == [False] and len(warnings) == 1
    text = warnings[0].getMessage()
    assert str(tmp_path / "buffered") in text and tier_io.file_system_of(tmp_path) in text and "O_DIRECT" in text
    data = _random(16 * PAGE, 5)
    e.wait(e.write(0, 0, data))
    back = aligned_empty(16 * PAGE)
    e.wait(e.read(0, 0, back))
    assert _same(back, data)
    e.sync()
    e.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatrain.tier"):
        Engine([tmp_path / "plain"], [PAGE], direct=False).close()   # asked for buffered: no warning
    assert not caplog.records


def test_close_removes_files_and_finalizer_too(tmp_path):
    e = _engine(tmp_path, [PAGE, 2 * PAGE])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f0.bin", "f1.bin"]
    assert [p.stat().st_size for p in e.paths] == [PAGE, 2 * PAGE]   # preallocated
    assert oct(e.paths[0].stat().st_mode & 0o777) == "0o600"
    e.close()
    e.close()
    assert list(tmp_path.iterdir()) == []
    kept = _engine(tmp_path, [PAGE])
    kept.close(remove=False)
    assert [p.name for p in tmp_path.iterdir()] == ["f0.bin"]
    kept.paths[0].unlink()
    dropped = _engine(tmp_path, [PAGE])
    dropped.write(0, 0, aligned_empty(PAGE))
    del dropped
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_counters_count_bytes_exactly(tmp_path):
    e = _engine(tmp_path, [64 * PAGE, 64 * PAGE])
    pages = [1, 3, 8, 2, 16]
    for i, n in enumerate(pages):
        e.write(i % 2, 0, _random(n * PAGE, i))
    e.wait_all()
    for i, n in enumerate(pages[:3]):
        e.read(i % 2, PAGE, aligned_empty(n * PAGE))
    e.wait_all()
    c = e.counters()
    assert (c["bytes_written"], c["writes"]) == (sum(pages) * PAGE, 5)
    assert (c["bytes_read"], c["reads"]) == (12 * PAGE, 3)
    assert 0 < max(c["read_busy_s"], c["write_busy_s"]) <= c["busy_s"] <= c["read_busy_s"] + c["write_busy_s"] + 1e-9
    e.inject(0, error=errno.EIO)                     # a failed request counts nothing
    with pytest.raises(TierIOError):
        e.wait(e.read(0, 0, aligned_empty(PAGE)))
    assert e.counters()["reads"] == 3 and e.counters()["bytes_read"] == 12 * PAGE
    e.reset_counters()
    assert all(v == 0 for v in e.counters().values())
    e.close()


def test_measure_ssd_on_tmp(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    read, write = tier_io.measure_ssd([tmp_path / "a", tmp_path / "b"], bytes_per_path=4 << 20, request=1 << 20,
                                      queue_depth=2, repeat=3)
    assert math.isfinite(read) and math.isfinite(write) and read > 0 and write > 0
    assert list((tmp_path / "a").iterdir()) == [] and list((tmp_path / "b").iterdir()) == []
    with pytest.raises(ValueError, match="request"):
        tier_io.measure_ssd([tmp_path], request=1000)


def test_forked_child_leaves_the_parents_files_alone(tmp_path):
    """A forked child (a DataLoader worker) that closes or drops its copy of the engine neither
    hangs on the parent's workers nor removes the parent's files; it cannot submit."""
    e = _engine(tmp_path, [4 * PAGE])
    data = _random(PAGE, 7)
    e.wait(e.write(0, 0, data))
    e.inject(0, delay_us=200_000)   # a parent thread waits (and a worker sleeps) while the child forks
    waiter = threading.Thread(target=e.wait, args=(e.read(0, 0, aligned_empty(PAGE)),))
    waiter.start()
    time.sleep(0.02)
    pid = os.fork()
    if pid == 0:   # pragma: no cover - the child
        code = 0
        try:
            e.read(0, 0, aligned_empty(PAGE))
            code = 3                                  # submitting must fail here
        except RuntimeError:
            pass
        try:
            e.close()
            del e                                     # (the C++ engine's destructor runs here too)
            gc.collect()
        except BaseException:
            code = 4
        os._exit(code)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in the engine")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert e.paths[0].exists()
    waiter.join()
    e.inject(0)
    back = aligned_empty(PAGE)
    e.wait(e.read(0, 0, back))
    assert _same(back, data)
    e.close()
    assert not e.paths[0].exists()


def _resident_pages(path) -> int:
    """How many of the file's pages are in the page cache (mincore over a read-only mapping of it,
    which by itself brings no page in)."""
    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert base not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(base, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(base, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


def test_buffered_io_leaves_nothing_in_the_page_cache(tmp_path):
    """The fallback's point: what the tier writes or reads buffered does not stay in RAM."""
    if tier_io.file_system_of(tmp_path) == "tmpfs":
        pytest.skip("tmpfs: the page cache is the storage")
    data = _random(64 * PAGE, 8)
    control = tmp_path / "control.bin"                  # the measure works: a plain write stays cached
    fd = os.open(control, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, data.numpy().tobytes(), 0)
    finally:
        os.close(fd)
    assert _resident_pages(control) == 64
    e = Engine([tmp_path / "buffered"], [64 * PAGE], _simulate_einval=True)
    e.wait(e.write(0, 0, data))
    assert _resident_pages(e.paths[0]) == 0
    back = aligned_empty(64 * PAGE)
    e.wait(e.read(0, 0, back))
    assert _same(back, data) and _resident_pages(e.paths[0]) == 0
    e.close()


def test_threads_share_one_engine(tmp_path):
    """Threads submitting and waiting at once (the training thread and the optimizer's host
    thread), with another calling wait_all meanwhile: every read sees its own thread's last write."""
    e = _engine(tmp_path, [4 * 8 * PAGE, 4 * 8 * PAGE], queue_depth=3)
    failures = []
    stop = threading.Event()

    def worker(k: int) -> None:
        try:
            for round_ in range(15):
                data = _random(8 * PAGE, 100 * k + round_)
                back = aligned_empty(8 * PAGE)
                e.wait(e.write(k % 2, (k // 2) * 8 * PAGE, data))
                ticket = e.read(k % 2, (k // 2) * 8 * PAGE, back)
                e.wait(ticket)
                if not _same(back, data):
                    failures.append((k, round_))
        except Exception as error:   # (reported by the main thread)
            failures.append(error)

    def sweeper() -> None:
        while not stop.is_set():
            e.wait_all()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    sweep = threading.Thread(target=sweeper)
    sweep.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    sweep.join()
    assert failures == []
    e.wait_all()
    assert not e._held and e.counters()["writes"] == e.counters()["reads"] == 8 * 15
    e.close()
