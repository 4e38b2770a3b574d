"""Long because: one protocol (the model table under one flock) in the one class owning the file.

The memory-tier device: one preallocated, pre-faulted file holding many models' checkpoint slots.

A *device* (default under ``/dev/shm``) is laid out once, at :func:`create`, and then only
written through this module. Per (model, shard) it holds an *index* (MIndex) and ``nslots``
*slots*; a slot's image is exactly a :mod:`deepfreeze.format` shard file (header + index + data),
so everything that reads shard files reads a slot image unchanged.

The on-device layout (superblock, model table, regions, slot headers) is specified in
:mod:`deepfreeze.memtier.layout`, which also decodes and checks every record read; the slot
commit protocol and the readers of a region are in :mod:`deepfreeze.memtier.slot`. This module
owns the file and its model table.

**Model table protocol.** Every change of the table happens under an exclusive ``flock`` of the
device file (bounded wait, :class:`MemtierBusyError` naming the holder). Register: take the
first FREE entry (else reuse a RETIRED one: its state goes to WRITING first), state WRITING,
write the body, write the MIndex and an EMPTY header into every slot, pre-fault the region, msync,
then flip the state to VALID (one aligned 4-byte store) and msync. A crash before the flip leaves
a WRITING entry, which nothing reads and the next :meth:`Device.repack` retires. Retire: state
RETIRED. There is no allocator state on the device: free space is computed at open from the VALID
regions (first fit, page aligned).

Every offset and size read from the device is bounds-checked before use. A damaged superblock
raises :class:`MemtierCorruptError`; a damaged or hostile table entry (or index) is
*quarantined*: left out of the regions with a log line naming the entry and the reason, its
claimed bytes kept out of the free space when its body checksum holds (and it overlaps no valid
region), and every other model stays usable (:meth:`Device.refresh`; ``strict=True`` raises
instead). A hostile or damaged file never crashes the reader.

**Jobs and capacity.** Each region's MIndex records its job id (``deepfreeze.lease.job_id``);
readers select by it (:func:`for_job`). The regions of a run that a newer run of the same job
superseded (a newer verified DONE version on every region of the newer run) are retired
(:meth:`Device.reclaim`, :meth:`Device.repack`); a registration that does not fit may evict
finished models (:meth:`Device._evict_for`: never a live one, each job's newest version last);
:meth:`Device.drop` is ``deepfreeze memtier rm``.
"""
from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import threading
import time
from typing import Any, Callable, Iterator

from .. import crashpoints as cp
from .. import format as fmt
from .. import node as _node
from ..errors import (CorruptCheckpointError, MemtierBusyError, MemtierCorruptError, MemtierError,
                      MemtierFullError, UntrustedOwnerError)
from ..lease import Version
from . import jobs as _jobs
from .layout import (_BODY, _LIVE_STATES, _RUN_RE, _SB, _STATE_NAMES, _U32, DEFAULT_TABLE_CAP, DEVICE_FORMAT,
                     ENTRY_SIZE, FINISHED, FREE, MAX_INDEX_BYTES, MAX_SLOTS, PAGE, RETIRED, SB_MAGIC, VALID, WRITING,
                     SlotState, _align, _check_name, _decode_json, _entry_problem, _Entry, _index_problem,
                     _parse_entry, _touch, manifest_capacity)
from .slot import ShardRegion, _slot_header_bytes

__all__ = ["create", "open", "view", "parse_size", "Device", "default_live",
           "FLOCK_TIMEOUT"]

log = logging.getLogger("deepfreeze")

#: seconds to wait for the device's flock before :class:`MemtierBusyError`
FLOCK_TIMEOUT = 30.0
builtins_open = builtins.open  # this module defines open()


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
          "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12}


def parse_size(size: "int | str") -> int:
    """Bytes of a size given as an int or a string: ``K``/``M``/``G``/``T`` and ``KiB``/``MiB``/
    ``GiB``/``TiB`` are binary (``10G`` = ``10GiB`` = 10 * 2**30 bytes), ``KB``/``MB``/``GB``/``TB``
    decimal (``10GB`` = 10**9 * 10 bytes), a plain number or ``B`` bytes; case does not matter."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?(?:i?B)?)\s*", str(size), re.IGNORECASE)
        unit = m.group(2).upper() if m else None
        if not m or unit not in _UNITS:
            raise ValueError(f"size {size!r} is not a number of bytes or a size such as '8G' (GiB), '512M' (MiB), "
                             "'10GB' (10**9 bytes)")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return n


# --------------------------------------------------------------------------- small helpers

def _mem_available() -> int | None:
    try:
        with builtins_open("/proc/meminfo", "rb") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _fs_type(directory: str) -> str:
    """File system type of the mount holding ``directory`` (``/proc/self/mountinfo``), or ``""``."""
    best, kind = "", ""
    real = os.path.realpath(directory)
    try:
        with builtins_open("/proc/self/mountinfo", "rb") as f:
            lines = f.read(1 << 22).decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    for line in lines:
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(parts) < 5 or not rparts:
            continue
        mnt = parts[4].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, kind = mnt, rparts[0]
    return kind


def _flock_holder(fd: int) -> str:
    """Who holds the flock of the file behind ``fd`` (from ``/proc/locks``), if it can be told."""
    try:
        st = os.fstat(fd)
        want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with builtins_open("/proc/locks", "rb") as f:
            for line in f.read(1 << 20).decode("ascii", "replace").splitlines():
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].lower() == want:
                    pid = parts[4]
                    try:
                        with builtins_open(f"/proc/{pid}/cmdline", "rb") as c:
                            cmd = c.read(200).replace(b"\0", b" ").decode("utf-8", "replace").strip()
                    except OSError:
                        cmd = "?"
                    return f"pid {pid} ({cmd})"
    except (OSError, ValueError):
        pass
    return "another process (unknown: /proc/locks did not say)"


_said_lock = threading.Lock()
_said_quarantine: set[tuple[str, int, str]] = set()


# --------------------------------------------------------------------------- device

def create(path: str, size: "int | str", *, force: bool = False, table_cap: int = DEFAULT_TABLE_CAP,
           progress: "Callable[[str, int, int], None] | None" = None) -> "Device":
    """Create a device file of ``size`` bytes (``"8G"`` = 8 GiB, ``"512M"``, ``"10GB"`` = 10**10
    bytes, or an int: :func:`parse_size`; rounded up to pages) at ``path``, allocated
    (``posix_fallocate``) and pre-faulted (every page touched through a mapping), mode 0600, and
    return it open. ``progress(phase, done, total)`` is called as the file is allocated
    (``"allocating"``) and pre-faulted (``"pre-faulting"``, every 64 MiB). On tmpfs the size is checked against
    ``MemAvailable`` and the file system's free space first (:class:`MemtierFullError`). An existing
    file is an error unless ``force`` (then it is replaced: every checkpoint on it is lost). The
    file appears under ``path`` only once complete (built under a temporary name, then linked)."""
    size = _align(parse_size(size))
    if not 1 <= table_cap <= 1 << 16:
        raise ValueError(f"table_cap {table_cap} out of range [1, 65536]")
    data_start = _align(PAGE + table_cap * ENTRY_SIZE)
    if size < data_start + 2 * PAGE:
        raise ValueError(f"a device of {size} bytes is too small: the superblock and model table alone take "
                         f"{data_start} bytes; give at least {data_start + 2 * PAGE}")
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    if os.path.lexists(path) and not force:
        lst = os.lstat(path)
        if lst.st_uid != os.getuid():
            from ..ownership import owner_name
            raise UntrustedOwnerError(f"{path} already exists and is owned by {owner_name(lst.st_uid)}, not by you: "
                                      "another user created it first (it could read and forge your checkpoints). "
                                      "Pick another path (or have its owner or root remove it)")
        raise MemtierError(f"{path} already exists: pass force=True (--force) to replace it, which destroys every "
                           "checkpoint on it, or pick another path")
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if os.path.lexists(path):
        with contextlib.suppress(OSError):
            free += os.stat(path).st_blocks * 512 if os.path.isfile(path) else 0
    kind = _fs_type(directory)
    if size > free:
        raise MemtierFullError(f"cannot create a {size}-byte memory-tier device in {directory}: the file system has "
                               f"{free} bytes free. Pick a smaller --size or free space there")
    if kind in ("tmpfs", "ramfs", "shm"):
        avail = _mem_available()
        if avail is not None and size > avail:
            raise MemtierFullError(f"cannot create a {size}-byte memory-tier device on {kind} ({directory}): the "
                                   f"machine has {avail} bytes of memory available (MemAvailable), and a tmpfs file "
                                   "lives in memory. Pick a smaller --size, or a disk/NVMe path")
    tmp = f"{path}.creating.{os.getpid()}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            if progress is not None:
                progress("allocating", 0, size)
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise MemtierFullError(f"cannot allocate {size} bytes for the memory-tier device {path}: "
                                       f"{os.strerror(e.errno)}. Pick a smaller --size") from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, size)
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            step = 64 << 20
            for off in range(0, size, step):
                if progress is not None:
                    progress("pre-faulting", off, size)
                _touch(mm, off, min(step, size - off))
            if progress is not None:
                progress("pre-faulting", size, size)
            created = time.time()
            sb = _SB.pack(SB_MAGIC, DEVICE_FORMAT, PAGE, size, PAGE, table_cap, ENTRY_SIZE, created)
            mm[0:_SB.size + 4] = sb + _U32.pack(fmt.crc32(sb))
            mm.flush()
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    try:
        if force:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if someone created it meanwhile
            os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return open(path)



def open(path: str, *, writable: bool = True) -> "Device":  # noqa: A001 - the documented name
    """Open and validate a device (superblock, every table entry, region and index). A damaged
    table entry is quarantined (that model unreadable, shown by ``view``; everything else usable);
    a damaged superblock or overlapping valid regions: :class:`MemtierCorruptError`.
    ``writable=False`` maps it read-only (view, dump, restore)."""
    return Device(path, writable=writable)


class Device:
    """An open memory-tier device. Use as a context manager or call :meth:`close`.

    Thread-safe for the table operations (a lock plus the device flock); slot writes are the
    caller's (one writer per region)."""

    def __init__(self, path: str, *, writable: bool = True, strict: bool = False) -> None:
        from ..fsafe import open_regular
        from ..ownership import check_file
        self.path = os.path.abspath(path)
        self.writable = writable
        try:
            self._fd = open_regular(self.path, os.O_RDWR if writable else os.O_RDONLY)
        except CorruptCheckpointError as e:
            raise MemtierCorruptError(f"{self.path} is not a memory-tier device: {e}") from None
        try:  # the user's own file; a wider mode is tightened to 0600 (one log line); another user's
            # device is refused, for reading too: its owner could forge any version at any time
            check_file(self._fd, os.fstat(self._fd), self.path, kind="memory-tier device")
        except BaseException:
            os.close(self._fd)
            raise
        self._lock = threading.RLock()
        self._mm: mmap.mmap | None = None
        try:
            self.size = os.fstat(self._fd).st_size
            if self.size < PAGE:
                raise self._bad(f"{self.size} bytes, smaller than the superblock")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mm = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED, prot)
            self._read_superblock()
            #: problems found at open (damaged entries, quarantined: see :meth:`refresh`)
            self.problems: list[str] = []
            #: the quarantined entries: {"entry", "name", "rank", "reason"} (name/rank None if unreadable)
            self.quarantined: list[dict[str, Any]] = []
            self._reserved: list[tuple[int, int]] = []
            self._reserved_map: dict[int, tuple[int, int]] = {}
            self._strict = strict
            self._regions: list[ShardRegion] = []
            self._other: list[_Entry] = []  # WRITING / RETIRED entries (for view and repack)
            self.refresh()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- basics
    def _bad(self, why: str) -> MemtierCorruptError:
        return MemtierCorruptError(f"{self.path}: not a valid memory-tier device: {why}. The file is damaged or "
                                   "not a device: recreate it with 'deepfreeze memtier create PATH --size S --force' "
                                   "(after dumping what 'deepfreeze memtier view' still shows as valid)")

    def _read_superblock(self) -> None:
        raw = bytes(self.mm[0:_SB.size + 4])
        magic, ver, page, size, table_off, table_cap, entry_size, created = _SB.unpack_from(raw)
        if magic != SB_MAGIC:
            raise self._bad(f"wrong magic {magic!r}")
        if _U32.unpack_from(raw, _SB.size)[0] != fmt.crc32(raw[:_SB.size]):
            raise self._bad("superblock checksum mismatch")
        if ver != DEVICE_FORMAT:
            raise self._bad(f"device format {ver}, this DeepFreeze reads {DEVICE_FORMAT}: upgrade DeepFreeze")
        if page != PAGE or table_off != PAGE or entry_size != ENTRY_SIZE or not 1 <= table_cap <= 1 << 16:
            raise self._bad(f"page {page}, table offset {table_off}, entry size {entry_size} or table "
                            f"capacity {table_cap} unsupported")
        if size != self.size:
            raise self._bad(f"the file has {self.size} bytes, the superblock says {size} (truncated or grown)")
        self.table_off, self.table_cap, self.created = table_off, table_cap, created
        self.data_start = _align(table_off + table_cap * ENTRY_SIZE)
        if self.data_start > self.size:
            raise self._bad("the model table runs past the end of the file")

    @property
    def mm(self) -> mmap.mmap:
        if self._mm is None:
            raise MemtierError(f"device {self.path} is closed")
        return self._mm

    def fileno(self) -> int:
        """The descriptor of the device file this object checked and mapped at open (valid until
        :meth:`close`): read through it (``os.dup`` it to keep it longer), never by path again, so
        a file put at the path since is never read."""
        if self._fd < 0:
            raise MemtierError(f"device {self.path} is closed")
        return self._fd

    def close(self) -> None:
        """Unmap and close (views handed out keep the mapping alive until they are released)."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # exported views (a caller still holds a slot image): unmapped with them
                pass
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Device({self.path!r}, size={self.size}, shards={len(self._regions)})"

    # ---------------------------------------------------------------- table
    def _entry_off(self, no: int) -> int:
        return self.table_off + no * ENTRY_SIZE

    def _state(self, no: int) -> int:
        return _U32.unpack_from(self.mm, self._entry_off(no))[0]

    def refresh(self) -> None:
        """Re-read the model table (other processes may have registered or retired regions).

        A damaged or hostile entry is *quarantined*, not fatal: it is left out of the regions
        (that model cannot be read or written), named in :attr:`problems` and
        :attr:`quarantined` (logged once per process), and every other model stays usable. The
        bytes it claims stay reserved when its body checksum holds and its region lies in the
        data area (a damaged index does not free the space of its region); entries whose regions
        overlap are both quarantined. With ``strict=True`` (the constructor's) a problem raises
        :class:`MemtierCorruptError` instead, as before."""
        with self._lock:
            regions, other, problems, bad = [], [], [], set()
            quarantined: list[dict[str, Any]] = []
            reserved: dict[int, tuple[int, int]] = {}  # entry -> (offset, length) kept out of the free space
            mm = self.mm

            def quarantine(no: int, why: str, e: "_Entry | None") -> None:
                label = f"model table entry {no}" + (f" ({e.name!r} rank {e.rank})" if e is not None else "")
                problems.append(f"{label}: {why}")
                quarantined.append({"entry": no, "name": None if e is None else e.name,
                                    "rank": None if e is None else e.rank, "reason": why})
                if e is not None and self.data_start <= e.region_off and 0 < e.region_len \
                        and e.region_off + e.region_len <= self.size and not e.region_off % PAGE:
                    reserved[no] = (e.region_off, _align(e.region_len))

            for no in range(self.table_cap):
                off = self._entry_off(no)
                state = _U32.unpack_from(mm, off)[0]
                if state == FREE:
                    continue
                parsed = _parse_entry(no, bytes(mm[off:off + ENTRY_SIZE]))
                if state not in _STATE_NAMES:
                    quarantine(no, f"unknown state {state}", parsed if not isinstance(parsed, str) else None)
                    continue
                if isinstance(parsed, str):
                    if state in _LIVE_STATES:
                        quarantine(no, parsed, None)
                    continue  # WRITING/RETIRED entries may be torn: never read
                if state not in _LIVE_STATES:
                    other.append(parsed)
                    continue
                why = _entry_problem(parsed, self.data_start, self.size)
                if why is None:
                    try:
                        idx = self._read_index(parsed)
                    except MemtierCorruptError as e:
                        why = str(e)
                if why is not None:
                    quarantine(no, why, parsed)
                    continue
                regions.append(ShardRegion(self, parsed, idx))
            regions.sort(key=lambda r: r.region_off)
            end: ShardRegion | None = None  # the region reaching furthest so far
            for r in regions:
                if end is not None and end.region_off + end.region_len > r.region_off:
                    problems.append(f"model table entries {end.entry_no} ({end.name!r}) and {r.entry_no} "
                                    f"({r.name!r}): regions overlap")
                    bad |= {end.entry_no, r.entry_no}
                if end is None or r.region_off + r.region_len > end.region_off + end.region_len:
                    end = r
            for no, (o, n) in list(reserved.items()):  # a damaged entry never takes a valid region's place
                if any(r.region_off < o + n and o < r.region_off + r.region_len for r in regions):
                    del reserved[no]
            if problems and self._strict:
                raise self._bad("; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5
                                                           else ""))
            for r in regions:
                if r.entry_no in bad:
                    quarantined.append({"entry": r.entry_no, "name": r.name, "rank": r.rank,
                                        "reason": "its region overlaps another entry's"})
                    reserved[r.entry_no] = (r.region_off, r.region_len)
            regions = [r for r in regions if r.entry_no not in bad]
            self.problems = problems
            self.quarantined = quarantined
            self._reserved = sorted(reserved.values())
            self._reserved_map = reserved
            self._regions = sorted(regions, key=lambda r: (r.name, r.run, r.rank, r.entry_no))
            self._other = other
            for q in quarantined:
                key = (self.path, q["entry"], q["reason"])
                with _said_lock:
                    if key in _said_quarantine:
                        continue
                    _said_quarantine.add(key)
                log.warning("deepfreeze memtier: %s: model table entry %d%s is damaged (%s): quarantined (that model "
                            "cannot be read; every other model is usable). 'deepfreeze memtier view %s' shows it; "
                            "'deepfreeze memtier rm %s --entry %d' drops it", self.path, q["entry"],
                            f" ({q['name']!r} rank {q['rank']})" if q["name"] else "", q["reason"], self.path,
                            self.path, q["entry"])

    def _read_index(self, e: _Entry) -> dict[str, Any]:
        raw = bytes(self.mm[e.index_off:e.index_off + e.index_len + 4])
        if len(raw) != e.index_len + 4 or fmt.crc32(raw[:-4]) != _U32.unpack_from(raw, e.index_len)[0]:
            raise MemtierCorruptError("index checksum mismatch")
        idx = _decode_json(raw[:-4], "index")
        why = _index_problem(idx, e)
        if why:
            raise MemtierCorruptError(f"index: {why}")
        return idx

    def shards(self) -> "list[ShardRegion]":
        """The valid regions (as of the last :meth:`refresh`), sorted by (name, run, rank)."""
        return list(self._regions)

    def region(self, entry_no: int) -> "ShardRegion | None":
        """The valid region of model-table entry ``entry_no`` (as of the last :meth:`refresh`), or None."""
        return next((r for r in self._regions if r.entry_no == entry_no), None)

    def find(self, name: str, run: str | None = None, rank: int | None = None) -> "list[ShardRegion]":
        """Valid regions of ``name`` (and ``run``, ``rank`` when given), after a :meth:`refresh`."""
        self.refresh()
        return [r for r in self._regions if r.name == name and (run is None or r.run == run)
                and (rank is None or r.rank == rank)]

    def _free_gaps(self) -> list[tuple[int, int]]:
        gaps, pos = [], self.data_start
        used = sorted([(r.region_off, r._e.region_len) for r in self._regions] + list(self._reserved))
        for off, n in used:  # valid regions and the extents quarantined entries reserve
            if off > pos:
                gaps.append((pos, off - pos))
            pos = max(pos, off + n)
        if self.size > pos:
            gaps.append((pos, self.size - pos))
        return gaps

    def free_bytes(self) -> int:
        """Bytes of the data area not used by a valid region (not necessarily contiguous)."""
        return sum(n for _, n in self._free_gaps())

    @contextlib.contextmanager
    def locked(self, timeout: float = FLOCK_TIMEOUT) -> Iterator[None]:
        """Hold the device's exclusive flock (and this object's lock), waiting at most ``timeout`` s."""
        with self._lock:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise MemtierBusyError(
                            f"{self.path}: the device lock is held by {_flock_holder(self._fd)} for more than "
                            f"{timeout:.0f} s: wait for it to finish (a repack can take a while) or stop it") from None
                    time.sleep(0.01)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _need_writable(self) -> None:
        if not self.writable:
            raise MemtierError(f"{self.path} is open read-only: open it with writable=True to change it")

    def _flush(self, off: int, length: int) -> None:
        start = off // PAGE * PAGE
        self.mm.flush(start, _align(off + length) - start)

    def _set_state(self, no: int, state: int) -> None:
        off = self._entry_off(no)
        self.mm[off:off + 4] = _U32.pack(state)  # one aligned 4-byte store
        self._flush(off, 4)

    def _alloc(self, need: int) -> int | None:
        for off, n in self._free_gaps():
            if n >= need:
                return off
        return None

    def _layout(self, index_bytes: int, image_size: int, meta_cap: int, nslots: int) -> tuple[int, int, int]:
        """(slot_off - region_off, slot_stride, region_len) of a region."""
        slot_rel = _align(index_bytes + 4)
        stride = PAGE + meta_cap + _align(image_size)
        return slot_rel, stride, slot_rel + nslots * stride

    def register_shard(self, name: str, run: str, rank: int, world_size: int, *, index: dict[str, Any],
                       image_size: int, meta_cap: int | None = None, nslots: int = 2,
                       make_room: "Callable[[ShardRegion], bool] | None" = None) -> "ShardRegion":
        """Lay out a region for (``name``, ``run``, ``rank``): its MIndex (``index``, see
        :func:`make_index`) and ``nslots`` slots of ``image_size`` bytes (= ``index["file_size"]``)
        with ``meta_cap`` bytes for each version's manifest (default: :func:`manifest_capacity` of
        the index, enough for a world-1 model; an engine passes the capacity of its whole plan).
        Pre-faults the region. The same (name, run, rank) registered again with the same index
        returns the existing region. With ``make_room`` (a liveness rule such as
        :func:`default_live`), a region that does not fit first evicts finished models
        (:meth:`_evict_for`: never a live one; every job's newest version last). Raises
        :class:`MemtierFullError` (naming the bytes needed and free) when it does not fit."""
        self._need_writable()
        if _check_name(name):
            raise ValueError(_check_name(name))
        if not _RUN_RE.match(str(run)):
            raise ValueError(f"run {run!r} is not 16 hex digits (deepfreeze.lease.new_run_id)")
        if not 1 <= nslots <= MAX_SLOTS:
            raise ValueError(f"nslots must be in [1, {MAX_SLOTS}], got {nslots}")
        why = _index_problem(index, None)
        if why is None and (index["name"], index["run"], index["rank"], index["world_size"]) != \
                (name, run, rank, world_size):
            why = "its name, run, rank or world size differ from the arguments"
        if why is None and index["file_size"] != image_size:
            why = f"its file_size {index['file_size']} differs from image_size {image_size}"
        if why:
            raise ValueError(f"invalid memory-tier index for {name!r} rank {rank}: {why}")
        if meta_cap is None:
            n_ids = len({t["tensor_id"] for t in index["tensors"]})
            meta_cap = manifest_capacity(n_ids, len(index["tensors"]), world_size)
        meta_cap = _align(meta_cap)
        data = json.dumps(index, sort_keys=True, separators=(",", ":")).encode("utf-8")
        if len(data) > MAX_INDEX_BYTES:
            raise ValueError(f"the index of {name!r} rank {rank} is {len(data)} bytes (at most {MAX_INDEX_BYTES})")
        slot_rel, stride, region_len = self._layout(len(data), image_size, meta_cap, nslots)
        with self.locked():
            self.refresh()
            for r in self._regions:
                if (r.name, r.run, r.rank) == (name, run, rank):
                    if r.index == json.loads(data) and r.nslots == nslots and r.meta_cap == meta_cap:
                        return r
                    raise MemtierError(f"{self.path}: {name!r} run {run} rank {rank} is already registered with "
                                       "another layout; a model of another shape needs another run id")
            off = self._alloc(region_len)
            if off is None and make_room is not None:
                self._evict_for(region_len, make_room, f"{name!r} rank {rank}")
                off = self._alloc(region_len)
            if off is None:
                gaps = self._free_gaps()
                largest = max((n for _, n in gaps), default=0)
                raise MemtierFullError(
                    f"{self.path}: no room for {name!r} rank {rank}: it needs {region_len} bytes ({nslots} slots of "
                    f"{stride} bytes + index), the device has {self.free_bytes()} bytes free ({largest} contiguous) "
                    f"of {self.size}. Run 'deepfreeze memtier repack {self.path}' to drop finished models, use "
                    "fewer slots, or create a bigger device")
            no = next((i for i in range(self.table_cap) if self._state(i) == FREE), None)
            if no is None:
                no = next((i for i in range(self.table_cap) if self._state(i) == RETIRED), None)
            if no is None:
                raise MemtierFullError(f"{self.path}: the model table is full ({self.table_cap} entries in use): "
                                       "create a new device (or a bigger table)")
            e = _Entry(no, WRITING, name, run, rank, world_size, nslots, off, region_len, off, len(data),
                       off + slot_rel, stride, meta_cap, image_size, time.time())
            mm = self.mm
            eoff = self._entry_off(no)
            self._set_state(no, WRITING)
            mm[eoff + 4:eoff + 4 + _BODY.size + 4] = e.pack_body()
            _touch(mm, off, region_len)
            mm[off:off + len(data) + 4] = data + _U32.pack(fmt.crc32(data))
            empty = _slot_header_bytes(SlotState.EMPTY, run, Version(0, 0), 0, 0, 0, 0.0)
            for k in range(nslots):
                so = e.slot_off + k * stride
                mm[so:so + len(empty)] = empty
            self._flush(off, region_len)
            self._flush(eoff, ENTRY_SIZE)
            cp.hit("memtier.table.valid")
            self._set_state(no, VALID)
            self.refresh()
            r = self.region(no)
            if r is not None:
                return r
            raise MemtierCorruptError(f"{self.path}: the entry just registered ({no}) does not read back valid: "
                                      f"{self.problems[:3]}")

    def retire(self, region: "ShardRegion") -> None:
        """Retire ``region`` (its entry goes RETIRED; its space is free for later registrations)."""
        self._need_writable()
        with self.locked():
            self._retire(region)
            self.refresh()

    def _retire(self, region: "ShardRegion") -> None:
        no = region.entry_no
        off = self._entry_off(no)
        if self._state(no) not in _LIVE_STATES or bytes(self.mm[off + 4:off + 4 + _BODY.size]) != region._e.body:
            raise MemtierError(f"{self.path}: entry {no} is no longer {region.name!r} rank {region.rank}: "
                               "someone else retired or replaced it")
        self._set_state(no, RETIRED)

    def finish(self, region: "ShardRegion") -> None:
        """Mark ``region``'s job finished (state FINISHED: still valid and restorable; repack may
        compact it). Used by :meth:`deepfreeze.memtier.api.Model.close`."""
        self._need_writable()
        with self.locked():
            no = region.entry_no
            off = self._entry_off(no)
            if self._state(no) == VALID and bytes(self.mm[off + 4:off + 4 + _BODY.size]) == region._e.body:
                self._set_state(no, FINISHED)
            self.refresh()

    # ---------------------------------------------------------------- capacity
    def _superseded(self, live: "Callable[[ShardRegion], bool]", name: str | None = None,
                    job: str | None = None) -> "list[list[ShardRegion]]":
        """:func:`~deepfreeze.memtier.jobs.superseded_runs` of this device's valid regions."""
        return _jobs.superseded_runs(self._regions, live, name=name, job=job)

    def reclaim(self, name: str, job: str, *, live: "Callable[[ShardRegion], bool] | None" = None) -> dict[str, int]:
        """Retire the regions of earlier runs of job ``job``'s ``name`` that a newer run of the job has
        superseded (:meth:`_superseded`): the engine calls this once its run has a DONE version in
        the tier. Returns ``{"retired", "freed_bytes"}``."""
        self._need_writable()
        retired = freed = 0
        with self.locked():
            self.refresh()
            for regions in self._superseded(live or default_live, name, job):
                for r in regions:
                    self._retire(r)
                    retired += 1
                    freed += r.region_len
                log.info("deepfreeze memtier: %s: run %s of %r reclaimed (%d region(s)): a newer run of its job has "
                         "a DONE version", self.path, regions[0].run, name, len(regions))
            self.refresh()
        return {"retired": retired, "freed_bytes": freed}

    def _evict_for(self, need: int, live: "Callable[[ShardRegion], bool]", what: str) -> int:
        """Under the lock: retire finished models (never a live one), a run at a time, until ``need``
        contiguous bytes are free. Order: runs whose job has a newer version elsewhere on the
        device first, then each job's newest version, oldest written first (so every job's newest
        version is kept as long as possible). Returns the bytes freed (0: nothing evictable)."""
        dead, order = _jobs.eviction_order(self._regions, live)
        freed, evicted = 0, []
        for n, run in order:
            if self._alloc(need) is not None:
                break
            for r in dead[(n, run)]:
                self._retire(r)
                freed += r.region_len
            evicted.append(f"{n!r} run {run}")
            self.refresh()
        if evicted:
            log.warning("deepfreeze memtier: %s full: evicted finished model(s) %s (%d bytes) to make room for %s",
                        self.path, ", ".join(evicted), freed, what)
        return freed

    def drop(self, name: str | None = None, *, run: str | None = None, job: str | None = None,
             entry: int | None = None, force: bool = False,
             live: "Callable[[ShardRegion], bool] | None" = None) -> dict[str, Any]:
        """Retire the regions of model ``name`` (only run ``run`` / job ``job`` when given), or the
        quarantined or valid entry ``entry``: ``deepfreeze memtier rm``. A live model (its run
        still holds its lease; a standalone model not closed whose owner runs) is refused with
        :class:`MemtierError` unless ``force``. Returns ``{"retired", "freed_bytes", "models"}``;
        :class:`~deepfreeze.errors.CheckpointNotFoundError` when nothing matches."""
        from ..errors import CheckpointNotFoundError
        self._need_writable()
        live = live or default_live
        with self.locked():
            self.refresh()
            if entry is not None:
                q = next((q for q in self.quarantined if q["entry"] == entry), None)
                r = self.region(entry)
                if q is None and r is None:
                    raise CheckpointNotFoundError(f"{self.path}: no valid or quarantined model-table entry {entry}")
                if r is not None and live(r) and not force:
                    raise MemtierError(f"{self.path}: entry {entry} ({r.name!r} run {r.run}) is live: stop its job "
                                       "first (or --force)")
                freed = r.region_len if r is not None else self._reserved_map.get(entry, (0, 0))[1]
                self._set_state(entry, RETIRED)
                self.refresh()
                return {"retired": 1, "freed_bytes": freed,
                        "models": [f"entry {entry}" + (f" ({r.name!r} run {r.run})" if r is not None else "")]}
            match = [r for r in self._regions if r.name == name and (run is None or r.run == run)]
            if job is not None and match:  # an id or a unique prefix: one that two jobs share drops nothing
                job = _jobs.pick_job([r.job or "unknown" for r in match], job, f"{self.path}: {name!r}")
                match = [r for r in match if (r.job or "unknown") == job]
            if not match:
                raise CheckpointNotFoundError(f"{self.path} holds no model {name!r}"
                                              + (f" of run {run}" if run else "") + (f" of job {job}" if job else "")
                                              + " ('deepfreeze memtier view' lists them)")
            busy = [r for r in match if live(r)]
            if busy and not force:
                raise MemtierError(f"{self.path}: {name!r} run(s) {', '.join(sorted({r.run for r in busy}))} are live "
                                   "(their job still runs): stop the job first, or pass --force (a live job then "
                                   "fails its next checkpoint into the tier)")
            for r in match:
                self._retire(r)
            self.refresh()
            return {"retired": len(match), "freed_bytes": sum(r.region_len for r in match),
                    "models": sorted({f"{r.name!r} run {r.run}" for r in match})}

    def repack(self, *, live: "Callable[[ShardRegion], bool] | None" = None) -> dict[str, int]:
        """Compact the device under its lock; returns ``{"retired", "moved", "freed_bytes"}``.

        Entries left WRITING by a crash are retired, and so are the regions of runs a newer run of
        the same job has superseded (:meth:`_superseded`). Regions for which ``live(region)`` is false
        (default :func:`default_live`: lease released or stale, standalone owner gone or model
        closed) keep only their newest valid DONE version: it is copied into slot 0 of a new
        one-slot region (registered WRITING, copied, msynced, flipped VALID), and only then is
        the old entry retired; a region without a valid DONE version is retired. A crash in
        between leaves two valid copies of one version (harmless: the next repack retires the
        extra one). Live regions are never touched (their ACTIVE slots are being written)."""
        self._need_writable()
        live = live or default_live
        retired = moved = freed = 0
        with self.locked():
            self.refresh()
            mm = self.mm
            for e in self._other:
                if e.state == WRITING:
                    self._set_state(e.entry_no, RETIRED)
                    retired += 1
            self.refresh()
            for regions in self._superseded(live):
                for r in regions:
                    self._retire(r)
                    retired += 1
                    freed += r.region_len
            self.refresh()
            dead = [r for r in self._regions if not live(r)]
            kept: dict[tuple[str, str, int], tuple[Version, ShardRegion]] = {}
            for r in sorted(dead, key=lambda r: (r.nslots != 1, r.entry_no)):  # compact copies first
                best = r.newest(verify=True)
                key = (r.name, r.run, r.rank)
                if best is None or (key in kept and kept[key][0] >= best[1].version):
                    self._retire(r)
                    retired += 1
                    freed += r._e.region_len
                    continue
                k, head = best
                if r.nslots == 1:
                    kept[key] = (head.version, r)
                    continue
                e = r._e
                slot_rel, stride, region_len = self._layout(e.index_len, e.image_size, e.meta_cap, 1)
                off = self._alloc(region_len)
                no = next((i for i in range(self.table_cap) if self._state(i) in (FREE, RETIRED)
                           and i != r.entry_no), None)
                if off is None or no is None:
                    log.warning("deepfreeze memtier repack: no room to compact %r rank %d (needs %d bytes): "
                                "left as is", r.name, r.rank, region_len)
                    kept[key] = (head.version, r)
                    continue
                ne = dataclasses.replace(e, entry_no=no, state=WRITING, nslots=1, region_off=off,
                                         region_len=region_len, index_off=off, slot_off=off + slot_rel,
                                         slot_stride=stride, created=time.time())
                eoff = self._entry_off(no)
                self._set_state(no, WRITING)
                mm[eoff + 4:eoff + 4 + _BODY.size + 4] = ne.pack_body()
                mm[off:off + e.index_len + 4] = mm[e.index_off:e.index_off + e.index_len + 4]
                src = e.slot_off + k * e.slot_stride
                n = PAGE + e.meta_cap + e.image_size
                mm[ne.slot_off:ne.slot_off + n] = mm[src:src + n]
                self._flush(off, region_len)
                self._flush(eoff, ENTRY_SIZE)
                cp.hit("memtier.table.valid")
                self._set_state(no, FINISHED)
                self._retire(r)
                retired += 1
                moved += 1
                freed += e.region_len - region_len
                self.refresh()
                new = next(x for x in self._regions if x.entry_no == no)
                kept[key] = (head.version, new)
            self.refresh()
        return {"retired": retired, "moved": moved, "freed_bytes": freed}


# --------------------------------------------------------------------------- liveness and view

def _proc_start(pid: int) -> int | None:
    return _node.process_start(pid)


def owner_record() -> dict[str, Any]:
    """This process as the owner of a standalone model (pid, start time, boot id, node)."""
    return {"pid": os.getpid(), "start": _proc_start(os.getpid()) or 0, "boot": _node.boot_id(),
            "node": _node.node_id()}


def default_live(region: ShardRegion) -> bool:
    """Is ``region``'s job still running? FINISHED regions: no. Engine regions (index ``lease``):
    the run's lease on persistent is held by that run, not released and not older than its timeout
    (persistent unreachable: assumed live). Standalone regions: the owner process (pid, start time,
    boot) is alive. Anything else is assumed live (never compacted)."""
    if region.finished:
        return False
    idx = region.index
    lease = idx.get("lease")
    if lease:
        from ..lease import read_lease
        if not os.path.isdir(os.path.join(lease["persistent"], region.name)):
            return not os.path.isdir(lease["persistent"])  # reachable persistent without the name: not live
        try:
            got = read_lease(lease["persistent"], region.name)
        except OSError:
            return True
        if got is None:
            return False
        holder, mtime = got
        if _node.holder_gone(holder):  # its process provably no longer exists (run.py's rule)
            return False
        return holder.get("run") == region.run and not holder.get("released") \
            and time.time() - mtime <= float(lease["timeout"])
    owner = idx.get("owner")
    if owner:
        if owner["boot"] != _node.boot_id():
            return False  # the kernel rebooted since: its process is gone
        if isinstance(owner.get("node"), str) and owner["node"] != _node.node_id():
            return True  # another node on this kernel (its own pids): cannot be checked here
        return _proc_start(owner["pid"]) == owner["start"]
    return True


def view(path: str) -> dict[str, Any]:
    """A JSON-able description of the device: size, free bytes, problems found (damaged entries:
    ``quarantined``), and per model (name, run; its job; ``finished``: closed or its job over, by
    :func:`default_live`, i.e. not live) its shards with every slot's state, version, size and whether it is restorable
    (an ACTIVE slot never is; a DONE one only if its header checksum holds and its image verifies)."""
    with Device(path, writable=False, strict=False) as dev:
        models: dict[tuple[str, str], dict[str, Any]] = {}
        for r in dev.shards():
            # finished: closed (FINISHED), or its job is over (lease released / taken over / stale,
            # owner process gone): what repack may compact, the same rule (default_live)
            done = r.finished or not default_live(r)
            m = models.setdefault((r.name, r.run), {"name": r.name, "run": r.run, "job": r.job,
                                                   "world_size": r.world_size,
                                                   "standalone": bool(r.index.get("standalone")),
                                                   "finished": done, "shards": []})
            m["finished"] = m["finished"] and done
            slots = []
            for k in range(r.nslots):
                h = r.slot_header(k)
                if h is None:
                    slots.append({"slot": k, "state": "INVALID", "valid": False, "reason": "header checksum"})
                    continue
                s: dict[str, Any] = {"slot": k, "state": h.state.name, "generation": h.version.generation,
                                     "version": h.version.step, "written": h.written,
                                     "bytes": h.image_len if h.state == SlotState.DONE else 0}
                if h.state == SlotState.DONE:
                    why = r.verify_slot(k, h) if h.run == r.run else "another run's"
                    s["valid"] = why is None
                    if why:
                        s["reason"] = why
                    else:
                        with contextlib.suppress(MemtierCorruptError):
                            s["step"] = r.manifest(k, h).get("step")
                else:
                    s["valid"] = False
                    s["reason"] = "being written or interrupted" if h.state == SlotState.ACTIVE else "empty"
                slots.append(s)
            newest = max((s for s in slots if s["valid"]), key=lambda s: (s["generation"], s["version"]), default=None)
            m["shards"].append({"rank": r.rank, "entry": r.entry_no, "region_off": r.region_off,
                                "region_bytes": r.region_len, "image_bytes": r.image_size,
                                "tensors": len(r.entries), "slots": slots,
                                "newest": None if newest is None else
                                {"generation": newest["generation"], "version": newest["version"]}})
        return {"path": dev.path, "size": dev.size, "free": dev.free_bytes(), "table_cap": dev.table_cap,
                "created": dev.created, "problems": list(dev.problems), "quarantined": list(dev.quarantined),
                "models": list(models.values())}
