"""Copying tensor bytes between processes for the memory tier (the memtier's only native calls, made
through :mod:`deepfreeze._native`; ctypes here is only the ``iovec`` layout).

The backend pulls a rank's capture buffer straight into a device slot with ``process_vm_readv``
(the local stand-in for Portus's one-sided RDMA read: no copy in the rank, no file, no
serialization), and restore can push a slot image into another process's buffers with
``process_vm_writev``. :class:`VmReadvCopier` does that for another process, :class:`LocalCopier`
the same from addresses of this process (``memmove``), for the fallback where the rank copies
into the mapping itself (Yama forbids the backend) and for the standalone API.

Both copy in batches of at most :data:`CHUNK` bytes (and :data:`IOV_MAX` iovecs per system call)
and compute the CRC32 of each requested span over the bytes of a batch right after it landed,
while they are still in the CPU cache (one pass over the bytes). ``process_vm_readv`` may return
a partial count: the copier loops on the remaining iovecs, and a call that makes no progress is an
error; every byte count is checked.

Test-only hook: the environment variable ``DEEPFREEZE_MEMTIER_COPY_DELAY`` (seconds, read once at
import into :data:`COPY_DELAY`) makes every batch sleep that long after it landed, so that tests
can kill a process in the middle of a slot write or make copies slower than checkpoints. Never
set it outside tests.
"""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import time
from typing import Any, Sequence

import numpy as np

from .. import format as fmt
from .._native import PR_SET_PTRACER, available, memmove, prctl, process_vm_readv, process_vm_writev
from ..errors import MemtierError, MemtierPermissionError

__all__ = ["Copier", "VmReadvCopier", "LocalCopier", "CopyStats", "allow_ptracer", "ptrace_scope",
           "CHUNK", "IOV_MAX", "COPY_DELAY"]

#: bytes per batch: one system call (or memmove run) then the CRCs of what landed
CHUNK = 4 << 20
#: iovecs per process_vm_readv/writev call (the kernel's UIO_MAXIOV)
IOV_MAX = 1024
#: seconds slept after every batch (test-only: ``DEEPFREEZE_MEMTIER_COPY_DELAY``; 0 otherwise)
COPY_DELAY = float(os.environ.get("DEEPFREEZE_MEMTIER_COPY_DELAY") or 0)


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_readv = process_vm_readv if available("process_vm_readv") else None
_writev = process_vm_writev if available("process_vm_writev") else None


def ptrace_scope() -> int | None:
    """Yama's ``kernel.yama.ptrace_scope`` (0 classic, 1 restricted to descendants and allowed
    tracers, 2 admin only, 3 none), or None when Yama is not active."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope", "rb") as f:
            return int(f.read(16).strip())
    except (OSError, ValueError):
        return None


def allow_ptracer(pid: int) -> bool:
    """Allow process ``pid`` (the backend) to read this process's memory under Yama
    ``ptrace_scope = 1`` (``prctl(PR_SET_PTRACER, pid)``). True when it is allowed now or no Yama
    restriction applies; False when impossible (scope 2 or 3, or prctl refused)."""
    scope = ptrace_scope()
    if scope is None or scope == 0:
        return True
    if scope >= 2:
        return False
    try:
        prctl(PR_SET_PTRACER, pid, 0, 0, 0)
    except OSError:
        return False
    return True


@dataclasses.dataclass
class CopyStats:
    """What a copy did: bytes moved, system calls (or memmove batches), the CRC32 of every span
    requested, and seconds spent."""

    bytes: int
    calls: int
    crcs: list[int]
    seconds: float = 0.0


def _bytes_view(buf: Any) -> memoryview:
    """A flat byte memoryview of a buffer or a (contiguous) numpy array, without copying."""
    if isinstance(buf, np.ndarray):
        return memoryview(buf.reshape(-1).view(np.uint8))
    return memoryview(buf).cast("B")


def _address(buf: Any) -> tuple[int, int, Any]:
    """(address, length, keeper) of a writable, contiguous buffer (keep ``keeper`` alive meanwhile)."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    if not arr.flags.writeable:
        raise ValueError("the destination buffer is read-only")
    return arr.ctypes.data, arr.size, arr


def _plan(regions: Sequence[tuple[int, int]], dest_len: int, offsets: Sequence[int] | None
          ) -> list[tuple[int, int, int]]:
    """(remote address, destination offset, length) of each non-empty region, checked: inside the
    destination, in increasing destination order, not overlapping."""
    out, pos = [], 0
    if offsets is not None and len(offsets) != len(regions):
        raise ValueError(f"{len(offsets)} destination offsets for {len(regions)} regions")
    for i, (addr, n) in enumerate(regions):
        off = pos if offsets is None else offsets[i]
        if not (isinstance(addr, int) and isinstance(n, int) and isinstance(off, int)) or n < 0 or off < 0:
            raise ValueError(f"region {i}: address, length and offset must be integers >= 0")
        if off < pos:
            raise ValueError(f"region {i}: destination offset {off} overlaps the previous region (ends at {pos})")
        if off + n > dest_len:
            raise ValueError(f"region {i}: bytes [{off}, {off + n}) run past the destination ({dest_len} bytes)")
        if n:
            if addr <= 0:
                raise ValueError(f"region {i}: null address")
            out.append((addr, off, n))
        pos = off + n
    return out


def _batches(plan: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Split the copy into batches of at most CHUNK bytes and IOV_MAX pieces."""
    batches: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    size = 0
    for addr, off, n in plan:
        while n:
            take = min(n, CHUNK - size)
            cur.append((addr, off, take))
            size += take
            addr, off, n = addr + take, off + take, n - take
            if size >= CHUNK or len(cur) >= IOV_MAX:
                batches.append(cur)
                cur, size = [], 0
    if cur:
        batches.append(cur)
    return batches


class Copier:
    """Copies bytes at addresses (of some process) into a local buffer, computing CRCs as it goes."""

    #: what the copy reads from (for messages)
    source = "?"

    def copy_in(self, regions: Sequence[tuple[int, int]], dest: Any, spans: Sequence[tuple[int, int]] = (), *,
                dest_offsets: Sequence[int] | None = None) -> CopyStats:
        """Copy the source ``regions`` ((address, length) each) into ``dest`` (a writable buffer):
        back to back from offset 0, or region ``i`` at ``dest_offsets[i]`` (increasing, not
        overlapping). Returns the stats with the CRC32 of every ``spans`` entry ((offset, length)
        in ``dest``; each must lie inside the copied bytes), computed batch by batch as the bytes
        land. Raises ValueError for bad arguments, :class:`MemtierPermissionError` when the source
        may not be read, :class:`MemtierError` when it is gone or an address is not mapped."""
        t0 = time.perf_counter()
        dest_mv = _bytes_view(dest)
        base, dest_len, keeper = _address(dest_mv)
        plan = _plan(regions, dest_len, dest_offsets)
        spans = [(int(o), int(n)) for o, n in spans]
        _check_covered(spans, plan)
        crcs = [0] * len(spans)
        order = sorted(range(len(spans)), key=lambda i: spans[i][0])
        first = 0  # the first span (in offset order) not yet complete
        total = calls = 0
        try:
            for batch in _batches(plan):
                got, c = self._move(batch, base)
                total += got
                calls += c
                lo, hi = batch[0][1], batch[-1][1] + batch[-1][2]
                while first < len(order) and sum(spans[order[first]]) <= lo:
                    first += 1
                for j in range(first, len(order)):
                    i = order[j]
                    s0, sn = spans[i]
                    if s0 >= hi:
                        break
                    a, b = max(s0, lo), min(s0 + sn, hi)
                    if a < b:
                        crcs[i] = fmt.crc32(dest_mv[a:b], crcs[i])
                if COPY_DELAY:
                    time.sleep(COPY_DELAY)
        finally:
            del keeper
        expected = sum(n for _, _, n in plan)
        if total != expected:  # pragma: no cover - _move checks every call
            raise MemtierError(f"copy from {self.source} moved {total} bytes, expected {expected}")
        return CopyStats(total, calls, crcs, time.perf_counter() - t0)

    def copy_out(self, src: Any, regions: Sequence[tuple[int, int]], *,
                 src_offsets: Sequence[int] | None = None) -> CopyStats:
        """The reverse: write ``src`` (a local buffer; back to back, or from ``src_offsets``) into
        the target's ``regions`` (restore into a freshly built model's buffers)."""
        t0 = time.perf_counter()
        mv = _bytes_view(src)
        arr = np.frombuffer(mv, dtype=np.uint8)
        plan = _plan(regions, arr.size, src_offsets)
        total = calls = 0
        for batch in _batches(plan):
            got, c = self._move(batch, arr.ctypes.data, out=True)
            total += got
            calls += c
            if COPY_DELAY:
                time.sleep(COPY_DELAY)
        return CopyStats(total, calls, [], time.perf_counter() - t0)

    def _move(self, batch: list[tuple[int, int, int]], base: int, out: bool = False) -> tuple[int, int]:
        """Move one batch ((remote address, local offset, length) pieces; ``out``: local -> remote).
        Returns (bytes, system calls)."""
        raise NotImplementedError


def _check_covered(spans: list[tuple[int, int]], plan: list[tuple[int, int, int]]) -> None:
    ranges, merged = sorted((off, off + n) for _, off, n in plan), []
    for a, b in ranges:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    import bisect
    starts = [m[0] for m in merged]
    for o, n in spans:
        if n < 0 or o < 0:
            raise ValueError(f"span ({o}, {n}) is negative")
        if n == 0:
            continue
        i = bisect.bisect_right(starts, o) - 1
        if i < 0 or o + n > merged[i][1]:
            raise ValueError(f"span [{o}, {o + n}) is not inside the copied bytes")


class LocalCopier(Copier):
    """Copies from addresses of this process (``memmove``, which releases the GIL)."""

    source = "this process"

    def _move(self, batch: list[tuple[int, int, int]], base: int, out: bool = False) -> tuple[int, int]:
        n = 0
        for addr, off, length in batch:
            if out:
                memmove(addr, base + off, length)
            else:
                memmove(base + off, addr, length)
            n += length
        return n, 1


class VmReadvCopier(Copier):
    """Copies from (or to) another process's memory with ``process_vm_readv`` / ``process_vm_writev``."""

    def __init__(self, pid: int) -> None:
        if _readv is None or _writev is None:  # pragma: no cover - glibc >= 2.15 has them
            raise MemtierError("this C library has no process_vm_readv: the memory tier's cross-process copy "
                               "needs Linux >= 3.2 and glibc >= 2.15")
        self.pid = int(pid)
        self.source = f"process {self.pid}"

    def _move(self, batch: list[tuple[int, int, int]], base: int, out: bool = False) -> tuple[int, int]:
        n = len(batch)
        local = (_Iovec * n)(*[(base + off, length) for _, off, length in batch])
        remote = (_Iovec * n)(*[(addr, length) for addr, _, length in batch])
        fn = _writev if out else _readv
        want = sum(length for _, _, length in batch)
        done = calls = 0
        i = 0  # first iovec not completely moved (local and remote have the same lengths)
        while done < want:
            calls += 1
            try:
                got = self._syscall(fn, ctypes.addressof(local) + i * ctypes.sizeof(_Iovec),
                                    ctypes.addressof(remote) + i * ctypes.sizeof(_Iovec), n - i)
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                raise self._error(e.errno, out) from e
            if got == 0:
                raise MemtierError(f"{'process_vm_writev' if out else 'process_vm_readv'} of {self.source} made no "
                                   f"progress ({done} of {want} bytes of a batch): the peer's memory changed under "
                                   "the copy (buffer freed?)")
            if got > want - done:  # pragma: no cover - the kernel never returns more than asked
                raise MemtierError(f"{self.source}: the kernel reported {got} bytes, at most {want - done} asked")
            done += got
            while got:  # advance past the iovecs moved, and into a partially moved one
                take = min(got, local[i].iov_len)
                got -= take
                if take == local[i].iov_len:
                    i += 1
                else:
                    local[i].iov_base += take
                    local[i].iov_len -= take
                    remote[i].iov_base += take
                    remote[i].iov_len -= take
        return done, calls

    def _syscall(self, fn: Any, local: int, remote: int, count: int) -> int:
        """One ``process_vm_readv``/``writev`` call over ``count`` iovecs at addresses ``local`` and
        ``remote``: the bytes moved, or ``OSError`` (a seam for tests that inject partial returns by
        subclassing)."""
        return fn(self.pid, local, count, remote, count, 0)

    def _error(self, err: int, out: bool) -> Exception:
        call = "process_vm_writev" if out else "process_vm_readv"
        if err == errno.EPERM:
            scope = ptrace_scope()
            return MemtierPermissionError(
                f"{call} of {self.source} refused (EPERM): this process may not access its memory. "
                + (f"Yama ptrace_scope is {scope}: the rank must allow the backend with prctl(PR_SET_PTRACER) "
                   "(deepfreeze does this when it connects) or an admin sets kernel.yama.ptrace_scope=0; "
                   if scope else "")
                + "both processes must run as the same user, and containers need CAP_SYS_PTRACE. "
                  "The rank then copies into the device itself (slower)")
        if err == errno.ESRCH:
            return MemtierError(f"{call}: {self.source} is gone (ESRCH): the rank exited or was killed before "
                                "its buffers were copied; this version is not written")
        if err == errno.EFAULT:
            return MemtierError(f"{call}: an address of {self.source} is not mapped (EFAULT): the rank announced "
                                "a buffer it no longer holds (it must keep every announced buffer alive until the "
                                "backend acknowledges)")
        return MemtierError(f"{call} of {self.source} failed: {os.strerror(err)}")
