"""A ring of K >= 3 shared-memory slots holding the newest versions of one producer rank's shard.

One ring per (channel, run, rank) on the producer's node, one file (by default under
``/dev/shm``). The producer is its only writer (it creates the file with ``O_EXCL``, mode
``0600``); any number of readers (consumers on the node, the rank's own TCP server thread) map it
read-only. Framework-neutral: numpy and the standard library only (numpy 1 and 2).

**Layout** (little-endian; every offset and size is re-derived and checked by a reader)::

    offset 0    fixed header (64 bytes): magic b"DFSR", format u16 (1), flags u16 (0), slots u32,
                meta length u32, capacity u64, stride u64 (capacity rounded up to a page),
                records offset u64, locks offset u64, data offset u64, file size u64
    offset 64   header CRC u32 (CRC32 of bytes 0..63 followed by the meta bytes)
    offset 127  the writer's lock byte: held by the writer from the moment it creates the file
                until it closes it or dies (:meth:`SlotRing.writer_alive`, :func:`sweep_stale`)
    offset 128  meta: UTF-8 JSON object of ``meta length`` (<= 64 KiB) bytes (never pickle)
    records     K slot records of 64 bytes, at the first 64-byte boundary after the meta:
                seq u64, generation u64, step i64, nbytes u64, crc u32 (of the slot's nbytes
                bytes), record CRC u32 (of the 36 bytes before it), 24 bytes of zeros
    locks       K lock bytes (slot i's pin lock is the byte at ``locks + i``); never data
    data        K data regions of ``stride`` bytes, the first at the first page boundary after
                the lock bytes; slot i's at ``data + i * stride``

A record with ``seq == 0`` was never written; an odd ``seq`` marks a slot being written (or whose
writer died mid-write); a slot is *complete* when its ``seq`` is even and non-zero and its record
CRC holds.

**Commit protocol** (one writer; :meth:`SlotRing.write`):

1. Pick a slot: never the newest complete one, never one pinned by a reader (in-process pins are
   counted; other processes' pins are tested with a non-blocking exclusive lock on the slot's lock
   byte, which the writer then holds until step 5). Prefer empty and torn slots, then the oldest
   version. None free: the version is skipped (:attr:`SlotRing.skipped`), never waited for.
2. Store ``seq + 1`` (odd): from now on readers see the slot as incomplete.
3. Copy the bytes in (chunks of :data:`CHUNK` bytes; the CRC32 of each chunk is computed right
   after its copy, while it is in cache, unless the caller gave the CRC). With
   :meth:`SlotRing.write_with` the caller's ``fill`` copies them straight from its source (the
   torch live capture: the model's tensors) with the CRC in the same pass; a ``fill`` whose
   source was torn during the copy stops here: the slot stays odd, as if its writer had died.
4. Store generation, step, nbytes, crc and the record CRC, computed over the final even ``seq``
   (the stored ``seq`` is still odd: readers still see the slot incomplete). A reader whose copy
   of the record mixes two states sees a record CRC that does not hold and reads it again.
5. Store ``seq + 2`` (even) LAST: the slot is complete. Release the lock byte.

A writer killed anywhere before step 5 leaves the slot odd (invisible); every other slot, and so
the previous version, is untouched. The notification that a version exists must be sent after
:meth:`~SlotRing.write` returns. Ordering: the stores are plain stores into the shared mapping
(ordered on x86; every pin and slot choice is a ``fcntl`` system call, a full barrier), and a
reader checks the seqlock and, by default, the CRC of what it copied, so a reordering elsewhere
would show as a torn read, never as accepted wrong bytes.

**Reading** (:meth:`SlotRing.read`, :meth:`SlotRing.pinned`): scan the records, pick the slot,
pin it (a shared lock on its lock byte, non-blocking: when the writer holds it, the slot is being
rewritten and the version is gone from it), read the record again (it must be unchanged: the
writer may have taken the slot between the scan and the pin), copy, then check that ``seq`` did
not change during the copy (seqlock) and, unless ``verify=False``, the CRC. A pinned slot is never
rewritten, so a slow reader is never lapped; the pin dies with the reader's process (a killed
reader never blocks the writer). Each read holds one pin, and the writer never takes the newest
slot: with at most R reads in progress at once, ``slots >= R + 2`` means no version is skipped
(the default 4 slots: two concurrent readers, e.g. a consumer and the rank's TCP server). A reader
whose scan was lapped by the writer :data:`_OPTIMISTIC` times in a row (only a writer publishing
back to back, every few microseconds, does that) pins every free slot for the moment of one scan
instead (:meth:`SlotRing._pin_newest_locked`): reading the newest never fails, at the price of a
possible skip of a version the writer tries to publish in those microseconds.
:meth:`SlotRing.writer_alive` tells a reader whether the ring's writer still has it open (its lock
byte dies with it): a dead producer's ring stays readable, but nothing newer will come.

**Trust and memory.** A reader maps only a regular file of its own user that nobody else can
write (consumers under another account use TCP with the token); that user could still truncate
it under a reader (SIGBUS), as it could kill the reader. A ring takes :func:`ring_bytes`
``(capacity, slots)`` bytes of shared memory, allocated and mapped at :meth:`SlotRing.create`.

Locks are Linux open file description locks (``F_OFD_SETLK``): they belong to one
:class:`SlotRing` object, so a reader object in the producer's own process is honoured too, and
closing another descriptor of the file does not drop them. Where they are missing (not 64-bit
Linux) classic process-associated ``fcntl`` locks are used, and a process must then not open a
ring it writes a second time. A descriptor inherited by a ``fork``ed child keeps the locks of its
parent's object alive while the child lives (every descriptor here is ``O_CLOEXEC``).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import mmap
import os
import stat
import struct
import sys
import threading
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from ..errors import ConfigError, StreamError, UnsafePathError, UntrustedOwnerError, VersionGoneError
from ..format import crc32
from ..jsonsafe import MAX_JSON_DEPTH, json_depth, loads as bounded_loads
from ..ownership import open_trusted
from ..repo.arena import close_mapping
from ..lease import Version

__all__ = ["SlotRing", "MAGIC", "FORMAT", "SHM_DIR", "MIN_SLOTS", "MAX_SLOTS", "MAX_META", "MAX_CAPACITY",
           "CHUNK", "ring_bytes", "sweep_stale"]

log = logging.getLogger("deepfreeze")

MAGIC = b"DFSR"
FORMAT = 1
SHM_DIR = "/dev/shm"
MIN_SLOTS = 3
MAX_SLOTS = 64
MAX_META = 64 * 1024
MAX_CAPACITY = 1 << 40          # 1 TiB per slot: anything larger in a file is hostile
#: copy (and CRC) granularity: a chunk is checksummed right after its copy, while it is in cache
CHUNK = 2 << 20
PAGE = mmap.PAGESIZE

_HDR = struct.Struct("<4sHHIIQQQQQQ")      # 64 bytes
_HCRC = struct.Struct("<I")
_HCRC_OFF = 64
_META_OFF = 128
_WRITER_LOCK = 127                          # a byte of the header's padding, never data
_REC = struct.Struct("<QQqQII")             # 40 bytes, padded to 64
_REC_SIZE = 64
_SEQ = struct.Struct("<Q")
_MAX_ATTEMPTS = 16
_OPTIMISTIC = 8              # scan-then-pin tries before pinning every slot to find the newest
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)    # Linux >= 5.14
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _layout(slots: int, capacity: int, meta_len: int) -> tuple[int, int, int, int, int]:
    """(stride, records offset, locks offset, data offset, file size)."""
    stride = _align(max(capacity, 1), PAGE)
    records = _align(_META_OFF + meta_len, 64)
    locks = records + _REC_SIZE * slots
    data = _align(locks + slots, PAGE)
    return stride, records, locks, data, data + slots * stride


def ring_bytes(capacity: int, slots: int = 4, meta_len: int = 0) -> int:
    """The size of the file of a ring of ``slots`` slots of ``capacity`` bytes (the shared memory it needs)."""
    return _layout(slots, capacity, meta_len)[4]


# ---------------------------------------------------------------------------------------------- locks
if sys.platform.startswith("linux") and hasattr(fcntl, "F_OFD_SETLK") and sys.maxsize > 2**32:
    class _Flock(ctypes.Structure):
        _fields_ = [("l_type", ctypes.c_short), ("l_whence", ctypes.c_short), ("l_start", ctypes.c_int64),
                    ("l_len", ctypes.c_int64), ("l_pid", ctypes.c_int32)]

    OFD_LOCKS = True

    def _lock(fd: int, kind: int, offset: int) -> bool:
        """Non-blocking lock (``fcntl.F_RDLCK``/``F_WRLCK``/``F_UNLCK``) of one byte; False when held by another."""
        fl = _Flock(kind, os.SEEK_SET, offset, 1, 0)
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, bytes(fl))
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True
else:  # pragma: no cover - 64-bit Linux has OFD locks
    OFD_LOCKS = False
    _LOCKF = {fcntl.F_RDLCK: fcntl.LOCK_SH | fcntl.LOCK_NB, fcntl.F_WRLCK: fcntl.LOCK_EX | fcntl.LOCK_NB,
              fcntl.F_UNLCK: fcntl.LOCK_UN}

    def _lock(fd: int, kind: int, offset: int) -> bool:
        try:
            fcntl.lockf(fd, _LOCKF[kind], 1, offset, os.SEEK_SET)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True


def _byte_array(buf: Any, what: str, *, writable: bool) -> np.ndarray:
    """A flat uint8 view of a C-contiguous buffer (no copy)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError(f"{what}: must be C-contiguous (got an array with strides {buf.strides})")
        if writable and not buf.flags.writeable:
            raise ValueError(f"{what}: must be writable (got a read-only array)")
        return buf.reshape(-1).view(np.uint8)
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError(f"{what}: must be a C-contiguous buffer")
    if writable and mv.readonly:
        raise ValueError(f"{what}: must be writable (got a read-only {type(buf).__name__})")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return np.frombuffer(mv, dtype=np.uint8)


class _Rec(tuple):
    """A parsed slot record: (slot, seq, version, nbytes, crc)."""


class SlotRing:
    """A ring of ``slots`` slots of ``capacity`` bytes in one shared-memory file (see the module
    docstring for the layout and the commit protocol).

    :meth:`create` makes the producer's (writer's) ring, :meth:`open` maps an existing one
    read-only. ``meta`` is the small JSON object the producer stored (<= 64 KiB).
    ``skipped`` counts the writes skipped because every candidate slot was pinned.
    Thread-safe: one writer thread at a time, any number of reader threads."""

    path: str
    capacity: int
    slots: int
    meta: dict
    skipped: int
    last_written: tuple[Version, int, int] | None

    def __init__(self, path: str, fd: int, mm: mmap.mmap, *, slots: int, capacity: int, meta: dict,
                 records: int, locks: int, data: int, stride: int, writer: bool) -> None:
        """Use :meth:`create` or :meth:`open`."""
        self.path, self.slots, self.capacity, self.meta = path, slots, capacity, meta
        self.skipped = 0
        #: versions :meth:`write_with` did not publish because their source was torn during the copy
        self.torn = 0
        self.writer = writer
        self._fd, self._mm = fd, mm
        self._records, self._locks, self._data, self._stride = records, locks, data, stride
        self._buf = np.frombuffer(mm, dtype=np.uint8)          # the whole file
        self._mutex = threading.Lock()                         # pins, _writing, fcntl calls
        self._wmutex = threading.Lock()                        # one write at a time
        self._pins = [0] * slots
        self._writing: int | None = None
        # writer state (the writer is the only one to change records, so it needs not parse them)
        self._seq = [0] * slots
        self._held: list[Version | None] = [None] * slots
        self._last: Version | None = None
        self._newest: int | None = None
        #: (version, nbytes, crc) of the last version :meth:`write` published (None before): what
        #: the notification of that version carries
        self.last_written: tuple[Version, int, int] | None = None
        self._closed = False

    # ----------------------------------------------------------------------------------- creating
    @classmethod
    def create(cls, path: str, capacity: int, slots: int = 4, *,
               meta: Mapping[str, Any] | None = None) -> "SlotRing":
        """Create the ring file (``O_EXCL``, mode ``0600``), preallocate it (``posix_fallocate``),
        map it read-write and pre-fault every page, so no write pays a first touch.

        ``slots < 3`` or a bad capacity or meta: :class:`ConfigError`. A file system (tmpfs) with
        less free space than the ring needs: :class:`StreamError` naming the sizes (nothing is left
        behind). An existing ``path``: :class:`FileExistsError`."""
        if not isinstance(slots, int) or isinstance(slots, bool) or not MIN_SLOTS <= slots <= MAX_SLOTS:
            raise ConfigError(f"SlotRing slots={slots!r}: must be an integer from {MIN_SLOTS} to {MAX_SLOTS} "
                              f"(with fewer than {MIN_SLOTS} a fast producer would have to wait for a reader)")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or not 0 < capacity <= MAX_CAPACITY:
            raise ConfigError(f"SlotRing capacity={capacity!r}: must be an integer from 1 to {MAX_CAPACITY} bytes")
        try:
            meta_d = dict(meta or {})
            meta_b = json.dumps(meta_d, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            raise ConfigError(f"SlotRing meta: must be a JSON object of strings, numbers, lists and objects ({e})") from e
        if json_depth(meta_b) > MAX_JSON_DEPTH:  # never write what open() refuses
            raise ConfigError(f"SlotRing meta: nested deeper than {MAX_JSON_DEPTH} JSON levels")
        if len(meta_b) > MAX_META:
            raise ConfigError(f"SlotRing meta: {len(meta_b)} bytes of JSON, at most {MAX_META} allowed")
        stride, records, locks, data, size = _layout(slots, capacity, len(meta_b))
        directory = os.path.dirname(os.path.abspath(path))
        try:
            vfs = os.statvfs(directory)
        except OSError as e:
            raise StreamError(f"slot ring {path}: cannot inspect its directory ({e.strerror})") from e
        free = vfs.f_bavail * vfs.f_frsize
        if free < size:
            raise StreamError(_too_small(path, directory, size, free, slots, capacity))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        mm = None
        try:
            _lock(fd, fcntl.F_WRLCK, _WRITER_LOCK)    # "its writer is alive": until close or death
            os.fchmod(fd, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise StreamError(_too_small(path, directory, size, None, slots, capacity)) from e
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise StreamError(f"slot ring {path}: cannot allocate {size} bytes ({e.strerror})") from e
                os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                _prefault(mm, size, write=True)
            except OSError as e:
                raise StreamError(_too_small(path, directory, size, None, slots, capacity) + f" ({e.strerror})") from e
            hdr = _HDR.pack(MAGIC, FORMAT, 0, slots, len(meta_b), capacity, stride, records, locks, data, size)
            mm[_META_OFF:_META_OFF + len(meta_b)] = meta_b
            mm[4:_HDR.size] = hdr[4:]
            mm[_HCRC_OFF:_HCRC_OFF + 4] = _HCRC.pack(crc32(meta_b, crc32(hdr)))
            mm[0:4] = MAGIC                                     # last: a half-made ring is "not a ring"
            ring = cls(path, fd, mm, slots=slots, capacity=capacity, meta=meta_d, records=records, locks=locks,
                       data=data, stride=stride, writer=True)
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return ring

    # ------------------------------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: str, *, prefault: bool = True) -> "SlotRing":
        """Map an existing ring read-only (``O_RDONLY``, ``PROT_READ``) after validating it: a
        regular file of this user not writable by others, the magic, format, header CRC, and
        every size and offset (re-derived from slots, capacity and meta length, and within the
        file). Anything else (hostile, truncated, not a ring): :class:`StreamError`, nothing mapped.
        A missing file: :class:`FileNotFoundError`. ``prefault`` maps every page now
        (``MADV_POPULATE_READ``), so reads pay no page faults."""
        try:  # the user's own regular file, no link, mode 0600 (deepfreeze.ownership); a ring is made
            # 0600 by its producer, so a wider one is refused, not tightened
            fd = open_trusted(path, os.O_RDONLY, kind="stream slot ring", loose="refuse")
        except FileNotFoundError:
            raise
        except (UnsafePathError, UntrustedOwnerError) as e:
            raise StreamError(f"slot ring {path}: {e}. A ring must be this user's (uid {os.getuid()}) and "
                              "writable by nobody else: refused") from e
        except OSError as e:
            raise StreamError(f"slot ring {path}: cannot open it ({e.strerror}); a ring is only readable by "
                              f"its producer's user (others use TCP with the token)") from e
        mm = None
        try:
            st = os.fstat(fd)
            head = os.pread(fd, _META_OFF, 0)
            if len(head) < _META_OFF or head[:4] != MAGIC:
                raise StreamError(f"slot ring {path}: not a DeepFreeze slot ring (bad magic or shorter than its header)")
            (_m, fmt, flags, slots, meta_len, capacity, stride, records, locks, data, size) = _HDR.unpack_from(head)
            if fmt != FORMAT or flags != 0:
                raise StreamError(f"slot ring {path}: format {fmt} flags {flags}; this DeepFreeze reads format "
                                  f"{FORMAT} (producer and consumer must run compatible versions)")
            if not (MIN_SLOTS <= slots <= MAX_SLOTS and meta_len <= MAX_META and 0 < capacity <= MAX_CAPACITY):
                raise StreamError(f"slot ring {path}: header out of bounds (slots {slots}, capacity {capacity}, "
                                  f"meta {meta_len} bytes): damaged or hostile file, refused")
            meta_b = os.pread(fd, meta_len, _META_OFF) if meta_len else b""
            (hcrc,) = _HCRC.unpack_from(head, _HCRC_OFF)
            if len(meta_b) != meta_len or crc32(meta_b, crc32(head[:_HDR.size])) != hcrc:
                raise StreamError(f"slot ring {path}: header checksum does not hold: damaged or hostile file, refused")
            expect = _layout(slots, capacity, meta_len)
            if (stride, records, locks, data, size) != expect:
                raise StreamError(f"slot ring {path}: header offsets {(stride, records, locks, data, size)} differ from "
                                  f"the ones its slots and capacity imply {expect}: refused")
            if size > st.st_size:
                raise StreamError(f"slot ring {path}: {st.st_size} bytes, its header needs {size} ({slots} slots of "
                                  f"{capacity} bytes): truncated or hostile file, refused")
            # size and nesting bounded before parsing: a hostile meta is a StreamError, never a RecursionError
            meta = bounded_loads(meta_b, f"slot ring {path}: meta", max_bytes=MAX_META, error=StreamError,
                                 advice="refused (a damaged or hostile ring file)") if meta_len else {}
            if not isinstance(meta, dict):
                raise StreamError(f"slot ring {path}: meta is not a JSON object: refused")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            if prefault:
                try:
                    _prefault(mm, size, write=False)
                except OSError as e:
                    raise StreamError(f"slot ring {path}: cannot map its {size} bytes ({e.strerror}): truncated "
                                      f"while being opened?") from e
            ring = cls(path, fd, mm, slots=slots, capacity=capacity, meta=meta, records=records, locks=locks,
                       data=data, stride=stride, writer=False)
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            raise
        return ring

    # ------------------------------------------------------------------------------------ records
    def _raw_record(self, slot: int) -> bytes:
        off = self._records + slot * _REC_SIZE
        return self._mm[off:off + _REC.size]

    def _record(self, slot: int) -> _Rec | None:
        """The slot's record when complete, else None (empty, being written, or died mid-write).
        A record whose CRC keeps failing, or that holds more than ``capacity`` bytes: StreamError."""
        for _ in range(_MAX_ATTEMPTS):
            raw = self._raw_record(slot)
            seq, gen, step, nbytes, crc, rcrc = _REC.unpack(raw)
            if seq == 0 or seq & 1:
                return None
            if crc32(raw[:36]) != rcrc:
                continue  # read while the writer stored it (step 4/5): read again
            if nbytes > self.capacity or gen >= 1 << 62:
                raise StreamError(f"slot ring {self.path}: slot {slot} claims {nbytes} bytes of generation {gen} in "
                                  f"slots of {self.capacity}: damaged or hostile file, refused")
            return _Rec((slot, seq, Version(gen, step), nbytes, crc))
        raise StreamError(f"slot ring {self.path}: slot {slot}'s record checksum does not hold (read "
                          f"{_MAX_ATTEMPTS} times): damaged or hostile file, refused")

    def _complete(self) -> list[_Rec]:
        self._check_open()
        recs = [r for r in (self._record(i) for i in range(self.slots)) if r is not None]
        recs.sort(key=lambda r: r[2], reverse=True)
        return recs

    def latest(self) -> tuple[Version, int, int] | None:
        """``(version, nbytes, crc)`` of the newest complete slot, or None when nothing is published."""
        recs = self._complete()
        return (recs[0][2], recs[0][3], recs[0][4]) if recs else None

    def versions(self) -> list[tuple[Version, int, int]]:
        """``(version, nbytes, crc)`` of every complete slot, newest first."""
        return [(r[2], r[3], r[4]) for r in self._complete()]

    def writer_alive(self) -> bool:
        """Whether the ring's writer (the producer that created it) still has it open: False once
        it closed the ring or its process died (then nothing newer will be written here)."""
        self._check_open()
        if self.writer:
            return True
        with self._mutex:
            if not _lock(self._fd, fcntl.F_RDLCK, _WRITER_LOCK):
                return True
            _lock(self._fd, fcntl.F_UNLCK, _WRITER_LOCK)
            return False

    def data_region(self) -> tuple[int, int]:
        """``(address, nbytes)`` of the slots' data in this process's mapping (valid until
        :meth:`close`): what a producer registers for device-to-host copies into its slots."""
        self._check_open()
        return int(self._buf.ctypes.data) + self._data, self.slots * self._stride

    def _seq_now(self, slot: int) -> int:
        off = self._records + slot * _REC_SIZE
        return _SEQ.unpack(self._mm[off:off + 8])[0]

    def _slot_data(self, slot: int, nbytes: int) -> np.ndarray:
        off = self._data + slot * self._stride
        return self._buf[off:off + nbytes]

    # ------------------------------------------------------------------------------------ pinning
    def _acquire(self, slot: int) -> bool:
        with self._mutex:
            if self._writing == slot:
                return False
            if self._pins[slot] == 0 and not _lock(self._fd, fcntl.F_RDLCK, self._locks + slot):
                return False
            self._pins[slot] += 1
            return True

    def _release(self, slot: int) -> None:
        with self._mutex:
            self._pins[slot] -= 1
            if self._pins[slot] == 0 and not self._closed:
                _lock(self._fd, fcntl.F_UNLCK, self._locks + slot)

    def _pin(self, version: Version | None) -> _Rec:
        """Pin the slot of ``version`` (None: the newest complete one); its record, re-read after the pin."""
        for _ in range(_OPTIMISTIC):
            recs = self._complete()
            if version is None:
                if not recs:
                    raise VersionGoneError(f"slot ring {self.path}: no version published yet")
                rec = recs[0]
            else:
                rec = next((r for r in recs if r[2] == version), None)
                if rec is None:
                    raise VersionGoneError(self._gone(version, recs))
            slot = rec[0]
            if self._acquire(slot):
                try:
                    again = self._record(slot)
                except BaseException:
                    self._release(slot)
                    raise
                if again == rec:
                    return rec
                self._release(slot)
            # the writer took the slot between the scan and the pin
            if version is not None:
                raise VersionGoneError(self._gone(version, self._complete()))
        return self._pin_newest_locked()

    def _pin_newest_locked(self) -> _Rec:
        """Pin every slot the writer is not writing, then read the records (now stable) and keep the
        newest complete one: never fails while something is published, however fast the writer
        laps the scans above (it may make the writer skip a version during these microseconds)."""
        self._check_open()
        got = [i for i in range(self.slots) if self._acquire(i)]
        best = None
        try:
            for i in got:
                r = self._record(i)
                if r is not None and (best is None or r[2] > best[2]):
                    best = r
        finally:
            for i in got:
                if best is None or i != best[0]:
                    self._release(i)
        if best is None:
            raise VersionGoneError(f"slot ring {self.path}: no version published yet")
        return best

    def _gone(self, version: Version, recs: list[_Rec]) -> str:
        held = ", ".join(str(r[2]) for r in recs) or "none"
        return (f"slot ring {self.path}: version {version} is not (or no longer) held (held: {held}); "
                f"read the newest instead")

    @contextlib.contextmanager
    def pinned(self, version: Version | None = None) -> Iterator[tuple[Version, int, memoryview]]:
        """A zero-copy read-only view ``(version, crc, memoryview of nbytes)`` of the slot of
        ``version`` (None: the newest complete one), pinned (never rewritten) while inside the
        block. The CRC is not checked here (the receiver of the bytes checks it). Not held:
        :class:`VersionGoneError`. If the slot changed anyway (only if pins were broken from
        outside), :class:`StreamError` at the end of the block."""
        _slot, seq, ver, nbytes, crc = rec = self._pin(version)
        view = memoryview(self._slot_data(rec[0], nbytes)).toreadonly()
        try:
            yield ver, crc, view
        finally:
            with contextlib.suppress(BufferError):
                view.release()
            changed = self._seq_now(rec[0]) != seq
            self._release(rec[0])
        if changed:
            raise StreamError(f"slot ring {self.path}: slot {rec[0]} was rewritten while pinned: the bytes read "
                              f"of version {ver} may be torn")

    def read(self, version: Version | None = None, out: Any = None, *,
             verify: bool = True) -> tuple[Version, int, np.ndarray]:
        """Copy the bytes of ``version`` (None: the newest complete one) into ``out`` (a writable
        C-contiguous buffer of at least nbytes; None: a new array) while its slot is pinned.
        Returns ``(version, crc, out[:nbytes])`` as a uint8 array.

        The version is not (or no longer) held: :class:`VersionGoneError`. ``out`` too small for
        it, its bytes changed during the copy, or (``verify``) their CRC32 differs from the
        record's: :class:`StreamError`."""
        got: list[np.ndarray] = []

        def copy(src: np.ndarray, ver: Version) -> int:
            nbytes = src.size
            if out is None:
                dst = np.empty(nbytes, dtype=np.uint8)
            else:
                dst = _byte_array(out, "SlotRing.read out", writable=True)
                if dst.size < nbytes:
                    raise StreamError(f"slot ring {self.path}: version {ver} has {nbytes} bytes, the buffer given "
                                      f"holds {dst.size}: pass a buffer of at least the ring's capacity "
                                      f"({self.capacity})")
                dst = dst[:nbytes]
            got[:] = [dst]
            c = 0
            for a in range(0, nbytes, CHUNK):
                b = min(nbytes, a + CHUNK)
                np.copyto(dst[a:b], src[a:b])
                if verify:
                    c = crc32(dst[a:b], c)
            return c
        ver, crc = self._copy_out(version, copy, verify)
        return ver, crc, got[0]

    def read_into(self, version: Version | None, pieces: "list[tuple[int, np.ndarray]]", *,
                  verify: bool = True) -> tuple[Version, int]:
        """Copy the bytes of ``version`` (None: the newest complete one) straight into their
        destinations while its slot is pinned: ``pieces`` are ``(offset in the slot, flat writable
        uint8 array)`` in ascending offset order, not overlapping (a consumer's replica tensors:
        no receive buffer between the slot and them). The CRC32 of the slot's bytes (the gaps
        between pieces included) is computed in the same pass, each chunk right after its copy.
        Returns ``(version, crc)``. Refusals as :meth:`read`; on a CRC mismatch the destinations
        hold unchecked bytes: the caller must not use them (a consumer's idle replica, not served)."""
        def copy(src: np.ndarray, ver: Version) -> int:
            nbytes = src.size
            c = pos = 0
            for off, dst in pieces:
                n = dst.size
                if off < pos or off + n > nbytes:
                    raise StreamError(f"slot ring {self.path}: version {ver} holds {nbytes} bytes; a piece of "
                                      f"{n} bytes at {off} is outside it or overlaps the one before (a plan "
                                      "that does not match the producer's)")
                if verify and off > pos:
                    c = crc32(src[pos:off], c)
                for a in range(0, n, CHUNK):
                    b = min(n, a + CHUNK)
                    np.copyto(dst[a:b], src[off + a:off + b])
                    if verify:
                        c = crc32(src[off + a:off + b], c)
                pos = off + n
            return crc32(src[pos:nbytes], c) if verify and pos < nbytes else c
        return self._copy_out(version, copy, verify)

    def _copy_out(self, version: Version | None, copy: Callable[[np.ndarray, Version], int],
                  verify: bool) -> tuple[Version, int]:
        """Pin the slot of ``version``, ``copy(slot bytes, version)`` out of it (returns the CRC32 of
        what it copied; anything when not ``verify``), unpin; then the seqlock and CRC checks of
        :meth:`read`. Returns ``(version, record's crc)``."""
        for _ in range(_MAX_ATTEMPTS):
            slot, seq, ver, nbytes, crc = self._pin(version)
            try:
                c = copy(self._slot_data(slot, nbytes), ver)
                torn = self._seq_now(slot) != seq
            finally:
                self._release(slot)
            if torn:   # only if a pin was broken from outside (e.g. the file's locks were dropped)
                if version is not None:
                    raise VersionGoneError(f"slot ring {self.path}: version {ver} was overwritten during the copy")
                continue
            if verify and c != crc:
                raise StreamError(f"slot ring {self.path}: version {ver} in slot {slot}: CRC32 of its {nbytes} bytes "
                                  f"is {c:08x}, its record says {crc:08x}: the slot was changed by something other "
                                  f"than its producer, refused")
            return ver, crc
        raise StreamError(f"slot ring {self.path}: every copy of the newest version was torn ({_MAX_ATTEMPTS} tries)")

    # ------------------------------------------------------------------------------------ writing
    def _take_slot(self) -> int | None:
        """A slot for the next version with its lock byte held exclusively, or None (all pinned)."""
        order = sorted((i for i in range(self.slots) if i != self._newest),
                       key=lambda i: (self._held[i] is not None, self._held[i] or Version(0, 0)))
        with self._mutex:
            for i in order:
                if self._pins[i] == 0 and _lock(self._fd, fcntl.F_WRLCK, self._locks + i):
                    self._writing = i
                    return i
        return None

    def _copied(self, slot: int, done: int, total: int) -> None:
        """Called by :meth:`write` after each chunk copied into ``slot`` (``done`` of ``total``
        bytes); does nothing. A fault-injection point for subclasses (a writer dying mid-copy)."""

    def write(self, version: Version, data: Any, *, crc: int | None = None) -> int | None:
        """Publish ``data`` (any C-contiguous buffer of at most ``capacity`` bytes) as ``version``
        (commit protocol: module docstring). Never waits for a reader: when every candidate slot
        is pinned, returns None and counts it in :attr:`skipped`. Returns the slot index.

        Only on the ring :meth:`create` made (else :class:`StreamError`). ``version`` not larger
        than the last one written, or ``data`` larger than ``capacity``: :class:`ValueError`."""
        src = _byte_array(data, "SlotRing.write data", writable=False)

        def fill(dst: np.ndarray, copied: Callable[[int], None]) -> int:
            n, c = dst.size, 0
            for a in range(0, n, CHUNK):
                b = min(n, a + CHUNK)
                np.copyto(dst[a:b], src[a:b])
                if crc is None:
                    c = crc32(dst[a:b], c)
                copied(b)
            return (crc if crc is not None else c) & 0xFFFFFFFF
        return self.write_with(version, int(src.size), fill)

    def write_with(self, version: Version, nbytes: int, fill: Callable[[np.ndarray, Callable[[int], None]],
                                                                        "int | None"]) -> int | None:
        """Publish ``nbytes`` bytes that ``fill`` puts straight into the slot (no buffer between the
        source and the slot: the torch live capture's one copy). ``fill(dst, copied)`` gets the
        slot's ``nbytes`` writable bytes, copies them in (calling ``copied(done)`` after each chunk:
        the fault-injection point :meth:`_copied`) and returns the CRC32 of ``dst`` as it left it,
        computed in the same pass as its copy, or None: the source was torn during the copy, the
        slot is left odd (step 3 never ends: no reader ever sees it, as a writer that died there)
        and nothing is published. What ``fill`` raises leaves the slot the same way, then goes on.
        Returns the slot, or None (every candidate slot pinned: :attr:`skipped`, ``fill`` not
        called; or torn: :attr:`torn`). Same refusals as :meth:`write`."""
        self._check_open()
        if not self.writer:
            raise StreamError(f"slot ring {self.path}: opened read-only; only its creator writes")
        if not isinstance(version, Version):
            raise TypeError(f"SlotRing.write version: a deepfreeze.lease.Version, got {type(version).__name__}")
        n = int(nbytes)
        if not 0 <= n <= self.capacity:
            raise ValueError(f"slot ring {self.path}: {n} bytes to publish, the slots hold {self.capacity}: "
                             f"create the ring with a larger capacity")
        if not 0 <= version.generation < 1 << 62 or not -(1 << 63) <= version.step < 1 << 63:
            raise ValueError(f"slot ring {self.path}: version {version!r} out of range")
        with self._wmutex:
            if self._last is not None and version <= self._last:
                raise ValueError(f"slot ring {self.path}: version {version} after {self._last}: versions must grow")
            slot = self._take_slot()
            if slot is None:
                self.skipped += 1
                log.debug("deepfreeze: slot ring %s: every slot pinned, version %s not published in shared memory",
                          self.path, version)
                return None
            rec_off = self._records + slot * _REC_SIZE
            seq = self._seq[slot]
            odd = seq + 1 if seq % 2 == 0 else seq + 2
            try:
                self._seq[slot], self._held[slot] = odd, None
                self._mm[rec_off:rec_off + 8] = _SEQ.pack(odd)                           # 2. being written
                c = fill(self._slot_data(slot, n), lambda done: self._copied(slot, done, n))  # 3. the bytes
                if c is None:  # torn: the slot stays odd (invisible); the previous versions are untouched
                    self.torn += 1
                    return None
                c = int(c) & 0xFFFFFFFF
                body = _REC.pack(odd + 1, version.generation, version.step, n, c, 0)[:36]
                self._mm[rec_off + 8:rec_off + 40] = body[8:] + _HCRC.pack(crc32(body))  # 4. fields
                self._mm[rec_off:rec_off + 8] = _SEQ.pack(odd + 1)                       # 5. complete, LAST
                self._seq[slot], self._held[slot] = odd + 1, version
                self._last, self._newest = version, slot
                self.last_written = (version, n, c)
            finally:
                with self._mutex:
                    self._writing = None
                    _lock(self._fd, fcntl.F_UNLCK, self._locks + slot)
            return slot

    # ------------------------------------------------------------------------------------ closing
    def _check_open(self) -> None:
        if self._closed:
            raise StreamError(f"slot ring {self.path}: closed")

    def close(self) -> None:
        """Unmap and close (drops this object's pins; the file stays: see :meth:`unlink`). Idempotent."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
        self._buf = None  # type: ignore[assignment]
        close_mapping(self._mm)
        os.close(self._fd)

    def unlink(self) -> None:
        """Remove the ring's file (the producer, at its end; mappings stay valid until closed)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> "SlotRing":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SlotRing({self.path!r}, slots={self.slots}, capacity={self.capacity}, "
                f"{'writer' if self.writer else 'reader'}{', closed' if self._closed else ''})")


def sweep_stale(directory: str = SHM_DIR, prefix: str = "deepfreeze-stream-", *,
                min_age: float = 10.0) -> list[str]:
    """Remove this user's ring files named ``prefix*`` in ``directory`` whose writer is gone (no
    process holds the writer's lock byte: it closed the ring without unlinking it, or was killed),
    so a crashed producer does not keep its slots of shared memory forever. Files younger than
    ``min_age`` seconds are left alone (a writer takes its lock a moment after creating the file).
    Readers that still map a removed ring keep reading it. Returns the removed paths."""
    import time
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()
                    or time.time() - st.st_mtime < min_age or not _lock(fd, fcntl.F_RDLCK, _WRITER_LOCK)):
                continue
            if os.path.samestat(st, os.lstat(path)):
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def _too_small(path: str, directory: str, size: int, free: int | None, slots: int, capacity: int) -> str:
    has = f"has {free} bytes free" if free is not None else "could not allocate them"
    return (f"slot ring {path}: {slots} slots of {capacity} bytes need {size} bytes of shared memory, {directory} "
            f"{has}: use fewer slots (at least {MIN_SLOTS}), free or enlarge {directory} (e.g. "
            f"`mount -o remount,size=<bytes> {directory}`, or `--shm-size` for a container), or put the ring "
            f"on another tmpfs")


def _prefault(mm: mmap.mmap, size: int, *, write: bool) -> None:
    """Map every page now: one ``madvise(MADV_POPULATE_*)`` (Linux >= 5.14), else, only where the
    kernel does not know that advice, one touch per page. Any other failure (memory or file space
    ran out): OSError, raised, never a touch that would die of SIGBUS."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ, 0, size)
        return
    except AttributeError:           # no mmap.madvise (Python < 3.8 or a platform without it)
        pass
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    arr = np.frombuffer(mm, dtype=np.uint8, count=size)
    if write:
        arr[::PAGE] = 0
    else:
        int(arr[::PAGE].sum())
    del arr
