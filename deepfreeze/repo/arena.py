"""The staging arena of a repository provider: preallocated, pre-faulted shared memory.

One file in ``/dev/shm`` (mode ``0600``, named ``deepfreeze-arena-<uid>-<pid>-<random>``, created
with ``O_EXCL``) of :data:`DEFAULT_ARENA_BYTES` (1 GiB) unless told otherwise, mapped once and
pre-faulted at creation (``MADV_POPULATE_WRITE``, else one written byte per page), so a transfer
through it never pays for page faults or allocation: the local analogue of DStore's pre-pinned
RDMA buffers. Same-node clients of the same user map the same file and copy their tensors in or
out; the socket carries only offsets.

A new arena first removes the staging files of this user's processes that are gone (a provider
killed outright leaves its arena behind).

Allocation is a thread-safe buddy allocator over pages: extents come in power-of-two numbers of
pages (the size classes), split from larger free blocks and merged back with their buddy when
freed, the local analogue of the paper's ``synchronized_pool_resource``. When the arena is
exhausted, :meth:`Arena.alloc` waits up to its timeout for frees, then raises
:class:`~deepfreeze.errors.ProviderTimeoutError`. The largest extent (:attr:`Arena.max_extent`)
is the largest power-of-two block of the arena: bigger requests are chunked by the caller.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import re
import secrets
import stat
import threading
import time

import numpy as np

from ..errors import ConfigError, ProviderTimeoutError, RepositoryError, UnsafePathError, UntrustedOwnerError
from ..ownership import open_trusted

__all__ = ["DEFAULT_ARENA_BYTES", "PAGE", "Extent", "Arena", "open_shared", "close_mapping", "create_staging_file", "sweep_stale",
           "SHM_DIR", "ARENA_NAME_RE"]

#: default arena size of a provider (``deepfreeze repo serve --arena-bytes``)
DEFAULT_ARENA_BYTES = 1 << 30
PAGE = mmap.PAGESIZE
SHM_DIR = "/dev/shm"
#: file names of arenas and on-demand staging files (what a peer may ask us to map)
ARENA_NAME_RE = re.compile(r"deepfreeze-(arena|od)-\d{1,10}-\d{1,10}-[0-9a-f]{16}")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


@dataclasses.dataclass(frozen=True)
class Extent:
    """``length`` bytes at ``offset`` of an arena (``length`` a power-of-two number of pages)."""
    offset: int
    length: int


def close_mapping(mm: mmap.mmap) -> None:
    """Unmap ``mm`` now, or, while numpy views of it are still exported, when the last one goes."""
    try:
        mm.close()
    except BufferError:
        pass


def _prefault(mm: mmap.mmap, size: int) -> None:
    try:
        mm.madvise(_MADV_POPULATE_WRITE, 0, size)
        return
    except (OSError, ValueError):
        pass
    arr = np.frombuffer(mm, dtype=np.uint8, count=size)
    arr[::PAGE] = 0  # one write per page
    del arr


def _create_shm(kind: str, size: int, directory: str) -> tuple[str, mmap.mmap]:
    name = f"deepfreeze-{kind}-{os.getuid()}-{os.getpid()}-{secrets.token_hex(8)}"
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path, mm


def open_shared(path: str, min_size: int, *, kind: str | None = None) -> mmap.mmap:
    """Map an existing staging file of this user (an arena, or an on-demand file) read-write.

    Refused (:class:`RepositoryError`, nothing mapped) unless ``path`` is a file directly in
    ``/dev/shm`` whose name is a DeepFreeze staging name (``kind``: ``"arena"`` or ``"od"``),
    not a link, a regular file owned by this user with mode ``0600``, of at least ``min_size``
    bytes."""
    name = os.path.basename(path) if isinstance(path, str) else ""
    m = ARENA_NAME_RE.fullmatch(name)
    if (not m or os.path.dirname(path) != SHM_DIR or (kind is not None and m.group(1) != kind)
            or not 0 < min_size < 1 << 48):
        raise RepositoryError(f"staging file {path!r}: not a DeepFreeze staging file in {SHM_DIR}")
    try:  # a regular 0600 file of yours, no link (deepfreeze.ownership; a wider mode is refused)
        fd = open_trusted(path, os.O_RDWR, kind="repository staging file", loose="refuse")
    except (UnsafePathError, UntrustedOwnerError) as e:
        raise RepositoryError(f"staging file {path}: {e}: refused") from e
    except OSError as e:
        raise RepositoryError(f"staging file {path}: cannot open it: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if st.st_size < min_size:
            raise RepositoryError(f"staging file {path}: {st.st_size} bytes, fewer than the {min_size} asked: refused")
        return mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove this user's staging files (arenas, on-demand files) whose process is gone (a provider
    or client killed outright cannot unlink its own). Returns the removed paths."""
    removed = []
    uid = os.getuid()
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = ARENA_NAME_RE.fullmatch(name)
        if not m:
            continue
        _kind, file_uid, pid = name.split("-")[1:4]
        if int(file_uid) != uid or os.path.exists(f"/proc/{int(pid)}"):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
    return removed


def create_staging_file(size: int, directory: str = SHM_DIR) -> tuple[str, mmap.mmap]:
    """A fresh ``0600`` on-demand staging file of ``size`` bytes (DStore-OnDemand): path and mapping.
    Not pre-faulted: the per-request cost is the point. The caller unlinks it."""
    return _create_shm("od", max(size, 1), directory)


class Arena:
    """A preallocated, pre-faulted shared-memory staging arena with a buddy allocator.

    ``nbytes`` is rounded down to whole pages (at least one). ``path`` is the file other
    processes map; :attr:`buffer` a ``uint8`` numpy view of the whole arena."""

    def __init__(self, nbytes: int = DEFAULT_ARENA_BYTES, *, directory: str = SHM_DIR,
                 prefault: bool = True) -> None:
        pages = int(nbytes) // PAGE
        if pages < 1:
            raise ConfigError(f"arena size {nbytes}: must be at least one page ({PAGE} bytes)")
        self.size = pages * PAGE
        sweep_stale(directory)
        self.path, self._mm = _create_shm("arena", self.size, directory)
        if prefault:
            _prefault(self._mm, self.size)
        self.buffer = np.frombuffer(self._mm, dtype=np.uint8)
        self._cond = threading.Condition()
        self._free: list[set[int]] = [set() for _ in range(pages.bit_length())]  # order -> page offsets
        self._used: dict[int, int] = {}  # page offset -> order
        off = 0
        while off < pages:  # greedy aligned power-of-two blocks
            order = (pages - off).bit_length() - 1
            while off % (1 << order):
                order -= 1
            self._free[order].add(off)
            off += 1 << order
        self.max_extent = (1 << (pages.bit_length() - 1)) * PAGE
        self.closed = False

    @property
    def free_bytes(self) -> int:
        with self._cond:
            return sum(len(s) << k for k, s in enumerate(self._free)) * PAGE

    def _take(self, order: int) -> int | None:  # under the lock
        k = order
        while k < len(self._free) and not self._free[k]:
            k += 1
        if k == len(self._free):
            return None
        off = min(self._free[k])  # lowest address first: keeps big blocks whole
        self._free[k].discard(off)
        while k > order:  # split, keep the lower half
            k -= 1
            self._free[k].add(off + (1 << k))
        self._used[off] = order
        return off

    def alloc(self, nbytes: int, timeout: float) -> Extent:
        """An extent of at least ``nbytes`` bytes (a power-of-two number of pages), waiting up to
        ``timeout`` seconds while the arena is full (:class:`ProviderTimeoutError`). More than
        :attr:`max_extent`: :class:`RepositoryError` (chunk the request)."""
        if not 0 <= nbytes <= self.max_extent:
            raise RepositoryError(f"a staging extent of {nbytes} bytes: must be in [0, {self.max_extent}] (the "
                                  "arena's largest block); split the request")
        pages = max(1, -(-nbytes // PAGE))
        order = (pages - 1).bit_length()
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self.closed:
                    raise RepositoryError("the staging arena is closed (the provider is stopping)")
                off = self._take(order)
                if off is not None:
                    return Extent(off * PAGE, (1 << order) * PAGE)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProviderTimeoutError(
                        f"the staging arena ({self.size} bytes) had no free extent of {nbytes} bytes for "
                        f"{timeout:g}s: concurrent requests hold it; retry, use a bigger arena (deepfreeze repo serve --arena-size) "
                        "or a longer timeout")
                self._cond.wait(left)

    def free(self, extent: Extent) -> None:
        """Give ``extent`` back (merging buddies); waiters are woken. Freeing twice: RepositoryError."""
        off = extent.offset // PAGE
        with self._cond:
            order = self._used.pop(off, None) if extent.offset % PAGE == 0 else None
            if order is None or (1 << order) * PAGE != extent.length:
                raise RepositoryError(f"the staging extent at byte {extent.offset} ({extent.length} bytes) is not "
                                      "allocated (freed twice?): a bug of the caller; nothing was freed")
            while order + 1 < len(self._free):
                buddy = off ^ (1 << order)
                if buddy not in self._free[order]:
                    break
                self._free[order].discard(buddy)
                off = min(off, buddy)
                order += 1
            self._free[order].add(off)
            self._cond.notify_all()

    def view(self, offset: int, length: int) -> np.ndarray:
        """The ``uint8`` view of ``length`` bytes at ``offset`` (bounds-checked)."""
        if not (0 <= offset and 0 <= length and offset + length <= self.size):
            raise RepositoryError(f"bytes [{offset}, {offset}+{length}) are outside the staging arena of "
                                  f"{self.size} bytes")
        return self.buffer[offset:offset + length]

    def close(self) -> None:
        """Unlink the file and unmap (the mapping stays while views of it are alive)."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.buffer = None  # type: ignore[assignment]
        close_mapping(self._mm)  # views still exported: the mapping goes with them

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
