"""Long because: one class over one schema; put, get and add_pack share its connection and pack helpers.

The embedded model repository: one directory, SQLite metadata, tensors in DeepFreeze-format packs.

Storage layout
--------------
A repository is one directory (created 0700)::

    meta.db  (+ meta.db-wal, meta.db-shm)   SQLite, WAL mode: names, tensors, blobs, packs, graphs,
                                            layer metadata, settings
    packs/<32 hex>.dfz                      pack files in the DeepFreeze binary format
                                            (deepfreeze/format.py, kind ASSEMBLED): a header, a
                                            per-tensor index (dtype, shape, offset, length, CRC32),
                                            then the raw C-order bytes of each tensor
    packs/tmp-<32 hex>                      a pack being written (never referenced)

The database (schema version :data:`SCHEMA_VERSION`, in ``settings``) holds:

* ``models``: one row per name ever stored (``deleted`` = 1 once deleted: the row stays, so a
  name is never reused), its creation time, logical bytes, graph (``graph.encode_graph`` bytes);
* ``tensors``: (model, key) -> blob, in the order the tensors were given;
* ``blobs``: one stored tensor: its pack, index entries (``entry``, ``n_entries``: an imported
  checkpoint tensor may be several contiguous pieces), byte range, CRC32 of the whole tensor,
  dtype, shape, reference count;
* ``packs``: file name, size, data bytes it was written with;
* ``layer_meta``: layer id -> JSON (class, canonical config, weight specs), write-once;
* ``settings``: schema version, format version, the layer-id scheme (set by the first store of a
  graph), and generic write-once keys (:meth:`EmbeddedRepository.set_setting_once`: the
  providers record their provider list there).

One connection per thread (``busy_timeout`` 60 s, ``synchronous=NORMAL``, ``FULL`` with
``fsync=True``); several processes may use one directory at once. SQLite's WAL mode needs shared
memory between them: keep the directory on a local file system (node-local disk, or a parallel
file system only if it supports POSIX locks and shared mmap; otherwise serve it with providers).

Commit protocol (put)
---------------------
1. Check the name (``<model>[@<tag>]``), the tensors (supported dtypes, native byte order, C order),
   the graph (its tensor keys must be exactly the tensors') and fail early if the name is taken.
2. CRC32 of every tensor (ISA-L's, zlib's values; on the arrays' memory, no copy).
3. De-duplication: one query finds the stored blobs with the same (CRC32, dtype, shape); each
   candidate is CONFIRMED by a byte-for-byte comparison with the stored bytes (so a CRC collision
   can never alias two tensors); identical tensors within one put are stored once too.
4. The tensors that are new go into ONE pack written to ``packs/tmp-<uuid>`` with a few large
   ``pwritev`` calls straight from the arrays' memory (``fsync=True``: fsync), renamed to
   ``packs/<uuid>.dfz`` (``fsync=True``: fsync of ``packs/``).
5. ONE transaction (``BEGIN IMMEDIATE``): the name must still be free (else rollback, unlink our
   pack, :class:`~deepfreeze.errors.NameExistsError`), every de-duplicated blob must still exist
   (else rollback, unlink, start over), our pack must still exist; then insert the pack, the new
   blobs, reference counts, the model row, its tensors (``executemany``), its graph and the layer
   metadata (``INSERT OR IGNORE``: write-once); ``COMMIT``.

Crash safety: nothing is visible before the ``COMMIT`` (SQLite's WAL makes it atomic and, with
``fsync=True``, durable). A store killed anywhere before it leaves at most an unreferenced
``tmp-*`` or ``*.dfz`` file in ``packs/``, which :meth:`~EmbeddedRepository.gc` removes (a
``*.dfz`` into the quarantine) once it is older than the grace period (default one hour; a store
still running is never disturbed: gc removes orphans while holding the write lock and a store
checks its pack is still there inside its commit transaction). A gc run with a grace period
shorter than a store takes can still take the store's pack: the store then fails with an error
that names gc (the ``tmp-*`` file removed mid-write: :class:`~deepfreeze.errors.CheckpointWriteError`;
the pack moved into the quarantine before the commit: :class:`~deepfreeze.errors.RepositoryError`),
and nothing is stored. Of two concurrent stores of one name, the first ``COMMIT`` wins; the
other finds the name taken inside its own transaction, rolls back, unlinks its pack and raises
``NameExistsError``.

De-duplication
--------------
Content key: (CRC32 of the tensor's bytes, dtype, shape), confirmed byte for byte. It runs inside
the timed store (the CRC is the integrity checksum anyway; the confirmation reads the stored copy
of each candidate). Only blobs still referenced are candidates. Blobs carry a reference count
(``refs``), a cache of the rows that delete and gc recount and never trust to free anything.
``info()`` reports the logical bytes (what the live models hold), the stored bytes (live blobs,
each once) and the savings.

Garbage collection, delete, a full disk
---------------------------------------
In :mod:`deepfreeze.repo.maintenance` (the mixin :class:`~deepfreeze.repo.maintenance.Maintenance`
that :class:`EmbeddedRepository` inherits): how gc recounts references from the rows and reports
damaged rows, how delete frees space, and the reserve that lets a delete run on a full disk.

Reads
-----
Before anything is allocated, every size and offset of the database rows requested is bounded
(:meth:`~EmbeddedRepository._bounded`, also used by ``specs``): the bytes of the declared shape
(an exact integer product, no overflow) must equal the row's length, and the row's byte range must
lie inside the pack file's real size; a row that fails (a declared shape of 2**48 elements) is a
:class:`~deepfreeze.errors.CorruptCheckpointError`, never a huge ``np.empty``. Then
``get`` reads the pack's index (cached per file and inode), checks every offset and size of the
database row against the pack's own index and size (a tampered row or pack raises
:class:`~deepfreeze.errors.CorruptCheckpointError`, never a read outside the tensor), then
``preadv`` straight into the destination arrays (``np.empty`` or the caller's ``out=``), adjacent
tensors coalesced into one call, and checks each tensor's CRC32 (``verify``). Only the requested
tensors' bytes are read (plus the < 64-byte alignment gaps between adjacent ones);
``bytes_read`` counts them (reads of :meth:`~EmbeddedRepository.get` only, not the
confirmation reads of de-duplication). A get whose pack was moved by a concurrent gc looks its
rows up again (4 times); a pack still missing is a :class:`~deepfreeze.errors.CorruptCheckpointError`
that says whether a gc moved it into the quarantine (when, and the command that restores it).

Import (:meth:`~EmbeddedRepository.add_pack`)
---------------------------------------------
An existing DeepFreeze-format file (an assembled checkpoint) becomes a pack without being
re-serialized: hard-linked into ``packs/`` (copied with ``copy_file_range`` across file systems),
its chosen index entries mapped to tensor keys (a tensor may be several contiguous pieces: the
mapping, contiguity and bounds are checked, each piece's CRC verified and the whole tensor's CRC32
computed by reading it once), then the same commit transaction as a store. The entries not
mapped (optimizer slots) are dead bytes of that pack: gc rewrites it if they are most of it.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import sqlite3
import stat
import threading
import time
import uuid
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from .. import fsafe, ownership
from .._native import available, memcmp
from ..jsonsafe import MAX_CONFIG_DEPTH, loads as bounded_loads
from ..errors import (CheckpointWriteError, CorruptCheckpointError, ModelMismatchError, ModelNotFoundError,
                      NameExistsError, RepositoryDatabaseError, RepositoryError, UnsafePathError)
from ..format import (DTYPES, FORMAT_VERSION, KIND_ASSEMBLED, MAX_NDIM, Entry, ShardIndex, crc32,
                      dtype_itemsize, dtype_name, encode_index, layout, numpy_dtype, read_index)
from .graph import ID_HEX_RE, check_graph, decode_graph, encode_graph, tensor_keys
from .maintenance import BUSY_TIMEOUT as _BUSY_TIMEOUT
from .maintenance import PACK_SUFFIX as _PACK_SUFFIX
from .maintenance import Maintenance
from .maintenance import SQL_CHUNK as _SQL_CHUNK
from .maintenance import db_op as _db_op
from .maintenance import few as _few
from .maintenance import unlink as _unlink
from .maintenance import valid_pack_name as _valid_pack_name
from .names import parse_name
from . import quarantine
from .quarantine import DEFAULT_QUARANTINE_PERIOD, QUARANTINE_DIR

__all__ = ["EmbeddedRepository", "tensor_entries", "SCHEMA_VERSION", "DEFAULT_ORPHAN_GRACE"]

#: version of the database schema (``settings.schema_version``)
SCHEMA_VERSION = 1
#: seconds an unreferenced pack file must be old before gc removes it (a store may be writing it)
DEFAULT_ORPHAN_GRACE = 3600.0
#: the files SQLite opens by name in a repository directory (checked before it does)
_DB_FILES = ("meta.db", "meta.db-wal", "meta.db-shm", "meta.db-journal")
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_MAX_KEY = 4096
_MAX_META = 1 << 20
_ZEROS = memoryview(bytes(4096))
_GAP = 64  # format.PIECE_ALIGN: adjacent tensors are at most this far apart

_SCHEMA = """
CREATE TABLE IF NOT EXISTS settings(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS packs(id INTEGER PRIMARY KEY, file TEXT NOT NULL UNIQUE, size INTEGER NOT NULL,
    data_bytes INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS blobs(id INTEGER PRIMARY KEY, pack INTEGER NOT NULL, entry INTEGER NOT NULL,
    n_entries INTEGER NOT NULL, offset INTEGER NOT NULL, length INTEGER NOT NULL, crc INTEGER NOT NULL,
    dtype TEXT NOT NULL, shape TEXT NOT NULL, refs INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS blobs_content ON blobs(crc);
CREATE INDEX IF NOT EXISTS blobs_pack ON blobs(pack);
CREATE TABLE IF NOT EXISTS models(id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, model TEXT NOT NULL,
    tag TEXT, created REAL NOT NULL, bytes INTEGER NOT NULL, n_tensors INTEGER NOT NULL,
    deduplicated INTEGER NOT NULL, graph BLOB, deleted INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS models_model ON models(model);
CREATE TABLE IF NOT EXISTS tensors(model INTEGER NOT NULL, key TEXT NOT NULL, pos INTEGER NOT NULL,
    blob INTEGER NOT NULL, PRIMARY KEY(model, key)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tensors_blob ON tensors(blob);
CREATE TABLE IF NOT EXISTS layer_meta(id TEXT PRIMARY KEY, meta TEXT NOT NULL) WITHOUT ROWID;
"""

_HAS_MEMCMP = available("memcmp")


def _equal(a: memoryview, b: memoryview) -> bool:
    """Byte-for-byte equality of two flat byte views of one length (memcmp, GIL released)."""
    if len(a) != len(b):
        return False
    if not len(a):
        return True
    if _HAS_MEMCMP:
        pa = np.frombuffer(a, dtype=np.uint8).ctypes.data
        pb = np.frombuffer(b, dtype=np.uint8).ctypes.data
        return memcmp(pa, pb, len(a)) == 0
    return bool(np.array_equal(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)))  # pragma: no cover


def _u8(arr: np.ndarray) -> memoryview:
    """Flat writable-or-not byte view of a C-contiguous array (no copy; bfloat16 too)."""
    return memoryview(arr.reshape(-1).view(np.uint8))


_RA_DEFAULT = 8 << 20   # a readahead window to assume where the device does not say (a network file system)
_RA_WINDOWS: dict[int, int] = {}


def _readahead_window(dev: int) -> int:
    """The kernel's largest readahead window for device ``dev`` (its ``queue/read_ahead_kb``,
    8 MiB on this machine's disk), cached per device; :data:`_RA_DEFAULT` where sysfs does not say."""
    if dev not in _RA_WINDOWS:
        window = _RA_DEFAULT
        base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
        for q in (f"{base}/queue/read_ahead_kb", f"{base}/../queue/read_ahead_kb"):  # a disk, or a partition's disk
            try:
                with open(q) as f:
                    window = max(int(f.read().strip()) << 10, 1 << 17)
                break
            except (OSError, ValueError):
                continue
        _RA_WINDOWS[dev] = window
    return _RA_WINDOWS[dev]


def _read_runs(fd: int, runs: list[tuple[int, int, list[memoryview]]],
               preadv_all: Callable[[int, list[memoryview], int], int]) -> int:
    """Read every run (``start``, ``end``, the buffers its bytes go into) with ``preadv_all``, one
    call each, bringing in its bytes and not the kernel's readahead window past it (up to 8 MiB
    past each read on this machine's disk: a partial load of 25.2 MB read 33.6).

    A run that ends within a tenth of its length of the end of the file (a whole model, a suffix)
    is read with the kernel's readahead, which streams fastest and cannot pass the end of the file
    (102 MB: 61 ms here). The others with readahead off (``POSIX_FADV_RANDOM``), every such byte
    asked for first (``POSIX_FADV_WILLNEED``, which the kernel takes one readahead window at a
    time; from a helper thread when they are more than a window, so the disk works on the later
    ones while the first are copied: 75 ms for 102 MB, 95-110 ms without the thread). Returns the
    bytes read."""
    if not runs or not hasattr(os, "posix_fadvise"):
        return sum(preadv_all(fd, iovs, start) for start, _end, iovs in runs)
    st = os.fstat(fd)
    size = st.st_size
    exact = [(start, end) for start, end, _ in runs if size - end > (end - start) // 10]
    helper = None
    if exact:
        window = _readahead_window(st.st_dev)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        if sum(end - start for start, end in exact) > window:
            helper = threading.Thread(target=_willneed, args=(fd, exact, window), daemon=True,
                                      name="deepfreeze-repo-readahead")
            helper.start()
        else:
            _willneed(fd, exact, window)
    got = 0
    streaming = not exact   # the descriptor's advice now: NORMAL (readahead on) or RANDOM
    try:
        for start, end, iovs in runs:
            near_end = size - end <= (end - start) // 10
            if near_end != streaming:   # advice changed only where a run needs the other one
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL if near_end else os.POSIX_FADV_RANDOM)
                streaming = near_end
            got += preadv_all(fd, iovs, start)
    finally:
        if helper is not None:
            helper.join()   # before the descriptor is closed
    return got


def _willneed(fd: int, ranges: list[tuple[int, int]], window: int) -> None:
    """``POSIX_FADV_WILLNEED`` over ``ranges``, one readahead window per call (advice: errors ignored)."""
    try:
        for start, end in ranges:
            for o in range(start, end, window):
                os.posix_fadvise(fd, o, min(window, end - o), os.POSIX_FADV_WILLNEED)
    except OSError:  # pragma: no cover - a file system that takes no advice
        pass


_DTYPE_NAMES: dict[np.dtype, str] = {}


def _dtype_name(dtype: np.dtype) -> str:
    """format.dtype_name, cached (numpy's dtype.name is slow: it shows in puts of many small tensors)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return name


def _shape_text(shape: Sequence[int]) -> str:
    return ",".join(str(int(d)) for d in shape)


class _Retry(Exception):
    """A de-duplicated blob vanished (gc) between planning and commit: store again."""


class _RemovedByGc(FileNotFoundError):
    """The ``tmp-`` file of a pack being written vanished before its rename: a gc whose grace
    period was shorter than the write took removed it as a crashed store's leftover."""

    def __init__(self, tmp: str) -> None:
        super().__init__(errno.ENOENT, "removed by a concurrent gc while being written", tmp)


class _Copy:
    """Bytes of another pack to stream into a new one (gc), CRC-checked on the way."""

    def __init__(self, fd: int, offset: int, length: int, what: str) -> None:
        self.fd, self.offset, self.length, self.what = fd, offset, length, what

    def copy_to(self, fd: int, offset: int, crc: int) -> None:
        chunk = 16 << 20
        buf = memoryview(bytearray(min(chunk, self.length)))
        got = 0
        value = 0
        while got < self.length:
            n = min(chunk, self.length - got)
            EmbeddedRepository._preadv_all(self.fd, [buf[:n]], self.offset + got, self.what)
            value = crc32(buf[:n], value)
            EmbeddedRepository._pwritev_all(fd, [buf[:n]], offset + got)
            got += n
        if value != crc:
            raise CorruptCheckpointError(f"{self.what}: checksum mismatch: the pack was damaged after it was written; "
                                         "it is kept as it is (restore it from a backup or delete its models)")


class _Tensor:
    """One tensor of a put: its array, byte view, content key."""
    __slots__ = ("key", "arr", "view", "dtype", "shape", "crc", "blob", "new")

    def __init__(self, key: str, arr: np.ndarray) -> None:
        self.key, self.arr = key, arr
        self.view = _u8(arr)
        self.dtype = _dtype_name(arr.dtype)
        self.shape = _shape_text(arr.shape)
        self.crc = 0
        self.blob: int | None = None  # an existing blob id (de-duplicated)
        self.new: int | None = None  # index into the new pack's tensors


class EmbeddedRepository(Maintenance):
    """A model repository in one directory (see the module docstring), used in-process.

    ``fsync``: fsync every pack and the directory, and commit with ``synchronous=FULL`` (durable
    against power loss); without it a store survives a process crash, not an OS crash.
    ``verify``: check each tensor's CRC32 on :meth:`get` (overridable per call).
    ``create``: create the repository when ``directory`` is missing or empty (a non-empty
    directory that is not a repository is refused). ``orphan_grace``: seconds an unreferenced
    pack must be old before :meth:`gc` removes it. ``quarantine_period``: seconds a pack gc removed
    stays in ``<directory>/quarantine/`` (restorable) before a later gc unlinks it.
    """

    def __init__(self, directory: str | os.PathLike, *, fsync: bool = False, verify: bool = True,
                 create: bool = True, orphan_grace: float = DEFAULT_ORPHAN_GRACE,
                 quarantine_period: float = DEFAULT_QUARANTINE_PERIOD) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        self.location = self.directory
        self.fsync = bool(fsync)
        self.verify = bool(verify)
        self.orphan_grace = float(orphan_grace)
        self.quarantine_period = float(quarantine_period)
        self.bytes_read = 0
        self._db = os.path.join(self.directory, "meta.db")
        self._packs = os.path.join(self.directory, "packs")
        self._lock = threading.Lock()
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._index_cache: dict[str, tuple[tuple[int, int, int], ShardIndex]] = {}
        self._closed = False
        try:
            self._open(create)
        except RepositoryError as e:
            # on a full disk SQLite cannot even map its shared memory: give up the reserve, try again
            if isinstance(e, RepositoryDatabaseError) or not os.path.isfile(self._db) or not self._disk_full():
                raise
            if not self._release_reserve():
                raise RepositoryDatabaseError(
                    f"cannot open the repository {self.directory}: the disk holding it is full (SQLite needs a "
                    "little room to open its database) and the repository has no reserve left to give up; free "
                    "some space on that file system by other means and retry") from e
            self._drop_conn()
            self._open(create)
        self._ensure_reserve()

    # ------------------------------------------------------------------ setup

    def _open(self, create: bool) -> None:
        d = self.directory
        if os.path.islink(d):
            raise RepositoryError(f"{d} is a symbolic link: a repository directory must be a real directory")
        if not os.path.exists(d):
            if not create:
                raise RepositoryError(f"no repository at {d}: the directory does not exist; check the path (a "
                                      "repository is created by the first store into a new directory)")
        elif not os.path.isdir(d):
            raise RepositoryError(f"{d} is not a directory: a repository is a directory")
        # the directory follows the root rule (deepfreeze.ownership.check_root: yours or root's, never
        # writable by others unless sticky; created 0700), packs/ the own-directory rule; a file another
        # user planted in it is refused below by its owner, so the checks hold until SQLite opens them
        try:
            ownership.ensure_dir(d, d)
        except UnsafePathError:
            raise
        except OSError as e:
            raise RepositoryError(f"cannot create the repository directory {d}: {e}") from e
        mode = os.lstat(d).st_mode
        if mode & 0o022:  # (check_root lets a sticky root be writable by others)
            raise UnsafePathError(
                f"{d} is writable by {'others' if mode & 0o002 else 'its group'} (mode {stat.S_IMODE(mode):04o}): "
                f"SQLite opens {', '.join(_DB_FILES)} there by name, so another user could put their own file at "
                "one of those names between DeepFreeze's check and SQLite's open (even in a sticky directory): "
                "a repository directory must be writable by you alone; use a directory of your own (or chmod go-w)")
        for f in _DB_FILES:  # SQLite opens these by name: each the user's own regular file (or absent)
            ownership.check_existing(os.path.join(d, f), kind="repository database")
        if not os.path.exists(self._db):
            if not create:
                raise RepositoryError(f"{d} is not a repository (it has no meta.db): check the path (a repository "
                                      "is created by the first store into a new or empty directory)")
            others = set(os.listdir(d)) - {*_DB_FILES, "packs"}
            if others:
                raise RepositoryError(
                    f"{d} is not empty and not a repository (it holds {_few(sorted(others))}): refusing to turn it "
                    "into one; use an empty or new directory")
            with contextlib.suppress(FileExistsError):  # created 0600 here: SQLite gives -wal/-shm its mode
                os.close(ownership.open_trusted(self._db, os.O_RDWR | os.O_CREAT | os.O_EXCL,
                                                kind="repository database"))
        conn = self._conn()
        try:
            conn.execute("BEGIN IMMEDIATE")
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    conn.execute(stmt)
            conn.execute("INSERT OR IGNORE INTO settings VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            conn.execute("INSERT OR IGNORE INTO settings VALUES ('format_version', ?)", (str(FORMAT_VERSION),))
            version = conn.execute("SELECT value FROM settings WHERE key='schema_version'").fetchone()[0]
            conn.execute("COMMIT")
        except sqlite3.DatabaseError as e:
            self._rollback(conn)
            raise RepositoryError(f"{self._db}: cannot open the repository's database ({e}): "
                                  "it is damaged or not a DeepFreeze repository") from e
        if version != str(SCHEMA_VERSION):
            raise RepositoryError(f"{self._db}: repository schema version {version!r}, this DeepFreeze reads "
                                  f"{SCHEMA_VERSION}: upgrade DeepFreeze")
        for f in _DB_FILES:  # -wal/-shm just created by SQLite: 0600 like meta.db (tightened otherwise)
            ownership.check_existing(os.path.join(d, f), kind="repository database")
        ownership.ensure_dir(self._packs, d)  # a link, or a directory of another user: UnsafePathError
        self._migrate_ids()

    def _conn(self) -> sqlite3.Connection:
        """This thread's connection (a new one after a fork)."""
        if self._closed:
            raise RepositoryError(f"repository {self.location} is closed")
        c = getattr(self._local, "conn", None)
        if c is not None and self._local.pid == os.getpid():
            return c
        try:
            c = sqlite3.connect(self._db, timeout=_BUSY_TIMEOUT, isolation_level=None, check_same_thread=False)
            c.execute("PRAGMA journal_mode=WAL")
            c.execute(f"PRAGMA synchronous={'FULL' if self.fsync else 'NORMAL'}")
            c.execute(f"PRAGMA busy_timeout={int(_BUSY_TIMEOUT * 1000)}")
        except sqlite3.DatabaseError as e:
            raise RepositoryError(f"{self._db}: cannot open the repository's database ({e}): it is damaged or "
                                  "not a DeepFreeze repository") from e
        self._local.conn, self._local.pid = c, os.getpid()
        with self._lock:
            self._conns.append(c)
        return c

    def _drop_conn(self) -> None:
        """Close this thread's connection (a new one is opened by the next :meth:`_conn`)."""
        c = getattr(self._local, "conn", None)
        self._local.conn = None
        if c is not None:
            with self._lock:
                if c in self._conns:
                    self._conns.remove(c)
            try:
                c.close()
            except sqlite3.Error:  # pragma: no cover
                pass

    @staticmethod
    def _rollback(conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass

    def close(self) -> None:
        """Close every connection this object opened (idempotent)."""
        with self._lock:
            conns, self._conns = self._conns, []
            self._closed = True
        for c in conns:
            try:
                c.close()
            except sqlite3.Error:  # pragma: no cover
                pass

    def __enter__(self) -> "EmbeddedRepository":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EmbeddedRepository({self.location!r})"

    # ------------------------------------------------------------------ settings

    def setting(self, key: str) -> str | None:
        """The value of setting ``key`` (None if unset)."""
        row = self._conn().execute("SELECT value FROM settings WHERE key=?", (str(key),)).fetchone()
        return row[0] if row else None

    def set_setting_once(self, key: str, value: str) -> str:
        """Set ``key`` to ``value`` unless it is set; returns the stored value (the first writer's)."""
        if not isinstance(key, str) or not isinstance(value, str):
            raise RepositoryError("settings are strings")
        conn = self._conn()
        conn.execute("INSERT OR IGNORE INTO settings VALUES (?, ?)", (key, value))
        return conn.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()[0]

    # ------------------------------------------------------------------ helpers

    def _pack_path(self, file: str) -> str:
        """Path of a pack named in the database; a name that is not ``<32 hex>.dfz`` is damage."""
        if not _valid_pack_name(file):
            raise CorruptCheckpointError(f"{self._db}: pack file name {file!r} is not '<32 hex>.dfz': the "
                                         "database is damaged or was tampered with; restore it from a backup")
        return os.path.join(self._packs, file)

    @property
    def _gc_removed_tmp(self) -> str:
        return (f"a concurrent gc removed it as a crashed store's leftover (a gc removes unnamed files of packs/ older "
                f"than its grace period, {self.orphan_grace:g} s by default here: a gc(grace=...) shorter than a "
                "store takes does this)")

    def _gone_why(self, file: str, reading: bool = True) -> str:
        """Why the pack ``file`` (named by a row, or being stored: ``reading=False``) is not in
        ``packs/``, and what to do: a gc moved it into the quarantine (when, and how to restore
        it), or nobody knows (removed by hand)."""
        q = quarantine.find(os.path.join(self.directory, QUARANTINE_DIR), file) if _valid_pack_name(file) else None
        if q is not None:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(q["since"]))
            return (f"a gc moved it into the quarantine as {os.path.join(self.directory, QUARANTINE_DIR, q['entry'])} "
                    f"at {when}, because no row of the database named it then (a concurrent gc whose grace period "
                    "was shorter than the store took, a deletion, or a database restored or repaired since): if a "
                    f"model needs it, restore it with 'deepfreeze repo gc {self.location} --restore {file}'")
        if not reading:
            return ("it is not in the quarantine either: removed by hand or by another program (a gc moves such a "
                    "pack into the quarantine)")
        return ("it is not in the quarantine either: a concurrent gc moved this model's tensors to new packs each "
                "time it was looked up, or the pack was removed by hand; retry, or restore the pack from a backup "
                "or delete the model")

    def _parse_spec(self, dtype: str, shape: str, where: str) -> tuple[str, tuple[int, ...]]:
        try:
            if dtype not in DTYPES.values():
                raise ValueError(f"dtype {dtype!r}")
            dims = tuple(int(x) for x in shape.split(",")) if shape else ()
            if len(dims) > MAX_NDIM or any(not 0 <= x <= 1 << 48 for x in dims) or math.prod(dims) > 1 << 48:
                raise ValueError(f"shape {shape!r}")
        except (ValueError, AttributeError, TypeError) as e:  # any type a row may hold
            raise CorruptCheckpointError(f"{self._db}: {where}: invalid {e}: the database is damaged or was "
                                         "tampered with; restore it from a backup or delete the model") from e
        return dtype, dims

    def _index(self, f: Any, path: str) -> ShardIndex:
        st = os.fstat(f.fileno())
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        hit = self._index_cache.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        index = read_index(f, path)
        with self._lock:
            if len(self._index_cache) > 1024:
                self._index_cache.clear()
            self._index_cache[path] = (stamp, index)
        return index

    def _resolve(self, index: ShardIndex, path: str, what: str, entry: int, n_entries: int, offset: int,
                 length: int, crc: int, dtype: str, shape: tuple[int, ...]) -> list[Entry]:
        """The index entries of one blob after checking the database row against the pack's index."""
        def bad(why: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(
                f"{path}: {what}: the repository database and the pack disagree ({why}); meta.db or the pack "
                "is damaged or was tampered with: restore from a backup, or delete the model and run gc")
        if not all(type(v) is int for v in (offset, length, crc)):  # a row may hold any type
            raise bad(f"offset {offset!r}, length {length!r} or CRC {crc!r} is not an integer")
        if not (type(entry) is int and type(n_entries) is int and 0 <= entry and 1 <= n_entries
                and entry + n_entries <= len(index.entries)):
            raise bad(f"entries [{entry}, {entry}+{n_entries}) but the pack has {len(index.entries)}")
        es = list(index.entries[entry:entry + n_entries])
        total = math.prod(shape)
        for e in es:
            if e.dtype != dtype or e.shape != shape or e.tensor_id != es[0].tensor_id:
                raise bad(f"entry {e.tensor_id} is {e.dtype}{list(e.shape)}, the database says {dtype}{list(shape)}")
        if es[0].start != 0 or es[-1].stop != total:
            raise bad(f"entries cover elements [{es[0].start}, {es[-1].stop}) of {total}")
        for a, b in zip(es, es[1:]):
            if b.start != a.stop or b.offset != a.offset + a.length:
                raise bad("the pieces are not contiguous")
        nbytes = total * dtype_itemsize(dtype)
        if offset != es[0].offset or length != nbytes or es[0].offset + nbytes > index.file_size:
            raise bad(f"bytes [{offset}, {offset}+{length}), the pack has [{es[0].offset}, {es[0].offset}+{nbytes}) "
                      f"of {index.file_size}")
        if n_entries == 1 and index.has_crc and es[0].crc != crc:
            raise bad(f"CRC32 {crc:#010x} in the database, {es[0].crc:#010x} in the pack")
        return es

    @staticmethod
    def _preadv_all(fd: int, iovs: list[memoryview], offset: int, path: str) -> int:
        """Fill ``iovs`` from ``offset`` (short reads resumed); a premature end of file is damage."""
        total = sum(len(v) for v in iovs)
        done = 0
        i = 0
        while i < len(iovs):
            batch = iovs[i:i + _IOV_MAX]
            n = os.preadv(fd, batch, offset + done)
            if n <= 0:
                if sum(len(v) for v in batch) == 0:
                    i += len(batch)
                    continue
                raise CorruptCheckpointError(f"{path}: unexpected end of file at byte {offset + done}: the pack "
                                             "was truncated; restore it from a backup or delete the model")
            done += n
            while n and i < len(iovs):  # drop what was filled; resume inside a partly filled buffer
                if n >= len(iovs[i]):
                    n -= len(iovs[i])
                    i += 1
                else:
                    iovs[i] = iovs[i][n:]
                    n = 0
            while i < len(iovs) and len(iovs[i]) == 0:
                i += 1
        return total

    @staticmethod
    def _pwritev_all(fd: int, iovs: list[memoryview], offset: int) -> None:
        iovs = [v for v in iovs if len(v)]
        i = 0
        pos = offset
        while i < len(iovs):
            n = os.pwritev(fd, iovs[i:i + _IOV_MAX], pos)
            pos += n
            while n and i < len(iovs):
                if n >= len(iovs[i]):
                    n -= len(iovs[i])
                    i += 1
                else:
                    iovs[i] = iovs[i][n:]
                    n = 0

    def _fsync_dir(self) -> None:
        fd = os.open(self._packs, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_pack(self, items: Sequence[tuple[Any, str, tuple[int, ...], int]]) -> tuple[str, int, list[Entry]]:
        """Write ``(source, dtype, shape, crc)`` items as one pack: a tmp name, then a rename. A
        source is a memoryview of the bytes, or a :class:`_Copy` (bytes of another pack, streamed
        and CRC-checked). Returns (file name, file size, entries)."""
        entries = [Entry(i, dtype, shape, 0, math.prod(shape), crc=crc)
                   for i, (_, dtype, shape, crc) in enumerate(items)]
        entries, data_offset, size = layout(entries)
        head = encode_index(KIND_ASSEMBLED, 0, 1, 0, entries, data_offset, size, True, os.urandom(8).hex())
        uid = uuid.uuid4().hex
        tmp = os.path.join(self._packs, f"tmp-{uid}")
        file = uid + _PACK_SUFFIX
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                iovs: list[memoryview] = [memoryview(head)]
                start = 0  # file offset of iovs[0]
                pos = len(head)
                for e, (src, *_rest) in zip(entries, items):
                    while pos < e.offset:  # zero padding (< 64 bytes; the header's up to 4096)
                        gap = min(e.offset - pos, len(_ZEROS))
                        iovs.append(_ZEROS[:gap])
                        pos += gap
                    if isinstance(src, _Copy):
                        self._pwritev_all(fd, iovs, start)
                        src.copy_to(fd, e.offset, e.crc)
                        iovs, start = [], e.offset + e.length
                    else:
                        iovs.append(src)
                    pos += e.length
                while pos < size:  # (an empty last tensor at an aligned offset)
                    gap = min(size - pos, len(_ZEROS))
                    iovs.append(_ZEROS[:gap])
                    pos += gap
                self._pwritev_all(fd, iovs, start)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.rename(tmp, os.path.join(self._packs, file))
            except FileNotFoundError as e:  # our tmp- file is gone: only gc removes those
                raise _RemovedByGc(tmp) from e
        except BaseException:
            _unlink(tmp)
            raise
        if self.fsync:
            self._fsync_dir()
        return file, size, entries

    def _before_commit(self, name: str) -> None:
        """Called by put/add_pack after the pack is in place and before the commit transaction
        (a hook for fault injection in tests; does nothing)."""

    # ------------------------------------------------------------------ put

    def _check_tensors(self, tensors: Mapping[str, Any]) -> list[_Tensor]:
        if not isinstance(tensors, Mapping):
            raise RepositoryError(f"tensors must be a mapping of key -> numpy array, not {type(tensors).__name__}")
        out = []
        for key, value in tensors.items():
            if not isinstance(key, str) or not 0 < len(key) <= _MAX_KEY or "\0" in key:
                raise RepositoryError(f"tensor key {key!r:.80}: expected a non-empty string of at most {_MAX_KEY} "
                                      "characters without NUL")
            arr = value if isinstance(value, np.ndarray) else np.asarray(value)
            try:
                _dtype_name(arr.dtype)
            except (CorruptCheckpointError, TypeError) as e:
                raise RepositoryError(f"tensor {key!r}: dtype {arr.dtype} is not supported ({e})") from e
            if arr.ndim > MAX_NDIM:
                raise RepositoryError(f"tensor {key!r}: {arr.ndim} dimensions, at most {MAX_NDIM} supported")
            if not arr.dtype.isnative:
                arr = arr.astype(arr.dtype.newbyteorder("="))
            if not arr.flags.c_contiguous:
                arr = arr.copy(order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d)
            out.append(_Tensor(key, arr))
        return out

    def _check_meta(self, meta: Mapping[str, Any] | None) -> list[tuple[str, str]]:
        if meta is None:
            return []
        if not isinstance(meta, Mapping):
            raise RepositoryError("meta must be a mapping of layer id -> JSON-able dict")
        rows = []
        for lid, m in meta.items():
            if not isinstance(lid, str) or not ID_HEX_RE.fullmatch(lid):
                raise RepositoryError(f"layer metadata key {lid!r:.80} is not a layer id (32 lowercase hex digits)")
            if not isinstance(m, dict):
                raise RepositoryError(f"layer metadata of {lid} must be a dict, not {type(m).__name__}")
            try:
                text = json.dumps(m, sort_keys=True, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise RepositoryError(f"layer metadata of {lid} is not JSON-able: {e}") from e
            if len(text) > _MAX_META:
                raise RepositoryError(f"layer metadata of {lid} is {len(text)} bytes of JSON, at most {_MAX_META}")
            rows.append((lid, text))
        return rows

    def _begin_commit(self, conn: sqlite3.Connection, name: str) -> None:
        """Start a store's commit transaction (after the test hook): the name must still be free."""
        self._before_commit(name)
        conn.execute("BEGIN IMMEDIATE")
        taken = self._name_taken(conn, name)
        if taken is not None:
            raise taken

    def _record_scheme(self, conn: sqlite3.Connection, graph: dict | None) -> None:
        """Inside a commit: the first graph sets the repository's layer-id scheme, later ones must match."""
        if graph is None:
            return
        scheme = self._set_once(conn, "id_scheme", str(graph["scheme"]))
        if scheme != str(graph["scheme"]):
            raise RepositoryError(f"the repository's layer ids use scheme {scheme}, this graph scheme "
                                  f"{graph['scheme']}: ids of different schemes never match; use another "
                                  "repository or a DeepFreeze with the same id scheme")

    def _name_taken(self, conn: sqlite3.Connection, name: str) -> NameExistsError | None:
        row = conn.execute("SELECT deleted FROM models WHERE name=?", (name,)).fetchone()
        if row is None:
            return None
        if row[0]:
            return NameExistsError(f"{name!r} was stored and deleted in {self.location}: a deleted name is never "
                                   "reused (clients cache by name); store under a new tag")
        return NameExistsError(f"{name!r} already exists in {self.location}: names are write-once; store under a "
                               "new tag (e.g. '<model>@<step>')")

    def put(self, name: str, tensors: Mapping[str, np.ndarray], graph: dict | None = None,
            meta: Mapping[str, dict] | None = None) -> dict:
        """Store ``tensors`` under the new name ``name`` (see the module docstring for the protocol).

        Returns ``{"bytes": tensor bytes, "written": bytes of new blobs, "deduplicated": bytes
        shared with stored tensors}``. Raises :class:`NameExistsError` when the name exists or
        existed, :class:`RepositoryError` for a bad name, tensor, graph or metadata."""
        model, tag = parse_name(name)
        items = self._check_tensors(tensors)
        gbytes = self._check_graph_keys(graph, [t.key for t in items])
        meta_rows = self._check_meta(meta)
        conn = self._conn()
        taken = self._name_taken(conn, name)
        if taken is not None:
            raise taken
        for t in items:
            t.crc = crc32(t.view)
        for _attempt in range(8):
            new = self._plan(items)
            try:
                pack = self._write_pack([(t.view, t.dtype, tuple(t.arr.shape), t.crc) for t in new]) if new else None
            except _RemovedByGc as e:
                raise CheckpointWriteError(errno.ENOENT, f"storing {name!r} in {self.location}: its pack {e.filename} "
                                           f"was removed while it was being written: {self._gc_removed_tmp}; nothing "
                                           "was stored; store it again") from e
            except OSError as e:
                raise CheckpointWriteError(e.errno, f"storing {name!r} in {self.location}: writing its pack failed "
                                           f"({e.strerror or e}); nothing was stored") from e
            try:
                return self._commit(name, model, tag, items, new, pack, gbytes, graph, meta_rows)
            except _Retry:
                continue
        raise RepositoryError(f"storing {name!r}: the blobs it shares kept disappearing (a concurrent gc?); try again")

    def _check_graph_keys(self, graph: dict | None, keys: list[str]) -> bytes | None:
        if graph is None:
            return None
        check_graph(graph)
        want = set(tensor_keys(graph))
        have = set(keys)
        if want != have:
            missing, extra = sorted(want - have), sorted(have - want)
            raise RepositoryError(f"the tensors do not match the layer graph: missing {_few(missing) or 'none'}, "
                                  f"not in the graph {_few(extra) or 'none'}: give one tensor per weight of the "
                                  "graph, keyed '<layer id>/<k>'")
        return encode_graph(graph)

    def _plan(self, items: list[_Tensor]) -> list[_Tensor]:
        """De-duplicate: set ``t.blob`` (an existing blob) or ``t.new``; returns the new tensors."""
        for t in items:
            t.blob, t.new = None, None
        conn = self._conn()
        crcs = sorted({t.crc for t in items})
        cands: dict[tuple[int, str, str], list[tuple]] = {}
        for i in range(0, len(crcs), _SQL_CHUNK):
            chunk = crcs[i:i + _SQL_CHUNK]
            q = ("SELECT b.id, b.crc, b.dtype, b.shape, b.entry, b.n_entries, b.offset, b.length, p.file "
                 f"FROM blobs b JOIN packs p ON p.id=b.pack WHERE b.refs>0 AND b.crc IN ({','.join('?' * len(chunk))})")
            for row in conn.execute(q, chunk):
                cands.setdefault((row[1], row[2], row[3]), []).append(row)
        new: list[_Tensor] = []
        firsts: dict[tuple[int, str, str], list[_Tensor]] = {}
        files: dict[str, Any] = {}
        try:
            for t in items:
                ck = (t.crc, t.dtype, t.shape)
                for row in cands.get(ck, ()):
                    if self._same_as_stored(t, row, files):
                        t.blob = row[0]
                        break
                if t.blob is not None:
                    continue
                for other in firsts.get(ck, ()):
                    if _equal(t.view, other.view):
                        t.new = other.new
                        break
                if t.new is None:
                    t.new = len(new)
                    new.append(t)
                    firsts.setdefault(ck, []).append(t)
        finally:
            for f in files.values():
                if f is not None:
                    f.close()
        return new

    def _same_as_stored(self, t: _Tensor, row: tuple, files: dict[str, Any]) -> bool:
        """Whether the stored blob ``row`` holds exactly ``t``'s bytes (any doubt: False)."""
        blob, crc, dtype, shape, entry, n_entries, offset, length, file = row
        try:
            path = self._pack_path(file)
            if file not in files:
                try:
                    files[file] = ownership.open_trusted_file(path, kind="repository pack")
                except (OSError, CorruptCheckpointError):
                    files[file] = None
            f = files[file]
            if f is None:
                return False
            _, dims = self._parse_spec(dtype, shape, f"blob {blob}")
            self._resolve(self._index(f, path), path, f"blob {blob}", entry, n_entries, offset, length, crc,
                          dtype, dims)
            if length != len(t.view):
                return False
            chunk = 16 << 20
            buf = np.empty(min(chunk, length), dtype=np.uint8)
            pos = 0
            while pos < length:
                n = min(chunk, length - pos)
                view = memoryview(buf)[:n]
                self._preadv_all(f.fileno(), [view], offset + pos, path)
                if not _equal(view, t.view[pos:pos + n]):
                    return False
                pos += n
            return True
        except (CorruptCheckpointError, OSError):
            return False  # a damaged or vanished candidate is not a copy: store the tensor anew

    def _commit(self, name: str, model: str, tag: str | None, items: list[_Tensor], new: list[_Tensor],
                pack: tuple[str, int, list[Entry]] | None, gbytes: bytes | None, graph: dict | None,
                meta_rows: list[tuple[str, str]]) -> dict:
        conn = self._conn()
        committed = False
        try:
            self._begin_commit(conn, name)
            shared = sorted({t.blob for t in items if t.blob is not None})
            found = 0
            for i in range(0, len(shared), _SQL_CHUNK):
                chunk = shared[i:i + _SQL_CHUNK]
                found += conn.execute(f"SELECT count(*) FROM blobs WHERE id IN ({','.join('?' * len(chunk))})",
                                      chunk).fetchone()[0]
            if found != len(shared):
                raise _Retry()
            if pack is not None and not os.path.exists(os.path.join(self._packs, pack[0])):
                raise RepositoryError(f"storing {name!r} in {self.location}: its pack {pack[0]} disappeared before "
                                      f"the commit: {self._gone_why(pack[0], False)}; nothing was stored; store it again")
            self._record_scheme(conn, graph)
            refs: dict[int, int] = {}
            for t in items:
                if t.blob is not None:
                    refs[t.blob] = refs.get(t.blob, 0) + 1
            new_ids: list[int] = []
            if pack is not None:
                file, size, entries = pack
                data = sum(e.length for e in entries)
                pid = conn.execute("INSERT INTO packs(file, size, data_bytes, created) VALUES (?,?,?,?)",
                                   (file, size, data, time.time())).lastrowid
                base = conn.execute("SELECT COALESCE(MAX(id), 0) FROM blobs").fetchone()[0] + 1
                new_ids = [base + i for i in range(len(new))]
                counts = [0] * len(new)
                for t in items:
                    if t.new is not None:
                        counts[t.new] += 1
                conn.executemany(
                    "INSERT INTO blobs(id, pack, entry, n_entries, offset, length, crc, dtype, shape, refs) "
                    "VALUES (?,?,?,1,?,?,?,?,?,?)",
                    [(new_ids[i], pid, i, e.offset, e.length, t.crc, t.dtype, t.shape, counts[i])
                     for i, (e, t) in enumerate(zip(entries, new))])
            conn.executemany("UPDATE blobs SET refs=refs+? WHERE id=?", [(c, b) for b, c in refs.items()])
            total = sum(len(t.view) for t in items)
            written = sum(len(t.view) for t in new)
            mid = conn.execute(
                "INSERT INTO models(name, model, tag, created, bytes, n_tensors, deduplicated, graph) "
                "VALUES (?,?,?,?,?,?,?,?)",
                (name, model, tag, time.time(), total, len(items), total - written, gbytes)).lastrowid
            conn.executemany("INSERT INTO tensors(model, key, pos, blob) VALUES (?,?,?,?)",
                             [(mid, t.key, i, t.blob if t.blob is not None else new_ids[t.new])
                              for i, t in enumerate(items)])
            conn.executemany("INSERT OR IGNORE INTO layer_meta(id, meta) VALUES (?,?)", meta_rows)
            conn.execute("COMMIT")
            committed = True
        except sqlite3.DatabaseError as e:
            raise RepositoryError(f"storing {name!r} in {self.location}: the database failed ({e}); nothing was "
                                  "stored") from e
        finally:
            if not committed:
                self._rollback(conn)
                if pack is not None:
                    _unlink(os.path.join(self._packs, pack[0]))
        return {"bytes": total, "written": written, "deduplicated": total - written}

    @staticmethod
    def _set_once(conn: sqlite3.Connection, key: str, value: str) -> str:
        conn.execute("INSERT OR IGNORE INTO settings VALUES (?, ?)", (key, value))
        return conn.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()[0]

    # ------------------------------------------------------------------ reads

    def _model_row(self, conn: sqlite3.Connection, name: str) -> tuple:
        parse_name(name)
        row = conn.execute("SELECT id, deleted, created, bytes, n_tensors, deduplicated, graph, model, tag "
                           "FROM models WHERE name=?", (name,)).fetchone()
        if row is None or row[1]:
            why = "was deleted" if row is not None else "is not stored"
            raise ModelNotFoundError(f"model {name!r} {why} in {self.location}: check the name (deepfreeze repo ls "
                                     f"{self.location} lists the stored models)")
        return row

    def _rows(self, name: str, keys: Sequence[str] | None = None) -> list[tuple]:
        """(key, blob, dtype, shape text, entry, n_entries, offset, length, crc, file) of every tensor.
        A tensor whose row does not resolve to a blob and a pack is damage (:class:`CorruptCheckpointError`)
        when it is among ``keys`` (default: all); the model's other tensors stay readable."""
        conn = self._conn()
        try:
            conn.execute("BEGIN")
            mid = self._model_row(conn, name)[0]
            rows = conn.execute(
                "SELECT t.key, b.id, b.dtype, b.shape, b.entry, b.n_entries, b.offset, b.length, b.crc, p.file "
                "FROM tensors t LEFT JOIN blobs b ON b.id=t.blob LEFT JOIN packs p ON p.id=b.pack WHERE t.model=? "
                "ORDER BY t.pos", (mid,)).fetchall()
        finally:
            self._rollback(conn)
        want = None if keys is None else set(keys)
        lost = [r[0] for r in rows if r[9] is None and (want is None or r[0] in want)]
        if lost:
            raise CorruptCheckpointError(f"{self._db}: model {name!r}: tensor {_few(lost)} has no stored blob or "
                                         "pack: the database is damaged; restore meta.db from a backup, or delete "
                                         "the model (its other tensors can still be read)")
        return [r for r in rows if r[9] is not None]

    def _bounded(self, name: str, rows: Iterable[tuple]) -> dict[str, tuple[str, tuple[int, ...]]]:
        """key -> (dtype, shape) of ``rows`` after bounding what the database says against the
        packs' real sizes: the shape's bytes (an exact integer product, no overflow) must be the
        row's length, and the row's byte range must lie inside its pack file. So a tampered row
        (a huge shape, an offset past the end) is a :class:`CorruptCheckpointError` before anything
        is allocated. A missing pack is a FileNotFoundError (the caller looks again: gc moved it)."""
        sizes: dict[str, int] = {}
        out = {}
        for r in rows:
            key, blob, dtype, shape, _entry, _n, offset, length, _crc, file = r
            what = f"tensor {key!r} of {name!r}"
            dtype, dims = self._parse_spec(dtype, shape, what)
            nbytes = math.prod(dims) * dtype_itemsize(dtype)
            if file not in sizes:
                sizes[file] = os.stat(self._pack_path(file)).st_size
            if not (type(offset) is int and type(length) is int and length == nbytes and 0 <= offset
                    and offset + length <= sizes[file]):
                raise CorruptCheckpointError(
                    f"{self._pack_path(file)}: {what}: the repository database and the pack disagree (the database "
                    f"says {dtype}{list(dims)}, {nbytes} bytes, at bytes [{offset}, {offset}+{length}); the pack "
                    f"has {sizes[file]} bytes); meta.db is damaged or was tampered with; nothing was read or "
                    "allocated: restore meta.db from a backup, or delete the model")
            out[key] = (dtype, dims)
        return out

    @_db_op("reading the tensor specs of")
    def specs(self, name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """key -> (dtype name, shape) of every tensor of ``name`` (each checked against its pack:
        :class:`CorruptCheckpointError` for a row the pack cannot hold)."""
        return _retry_moved(name, lambda: self._bounded(name, self._rows(name)), self._gone_why)

    @_db_op("reading")
    def get(self, name: str, tensors: Iterable[str] | None = None, *,
            out: Mapping[str, np.ndarray] | None = None, verify: bool | None = None) -> dict[str, np.ndarray]:
        """The tensors of ``name`` (all, or the keys in ``tensors``), reading only their bytes.

        ``out``: C-contiguous writable arrays filled in place (dtype and shape must match the
        stored ones: :class:`ModelMismatchError`); the others are allocated. ``verify``: check
        each tensor's CRC32 (default: the repository's ``verify``)."""
        verify = self.verify if verify is None else bool(verify)
        if isinstance(tensors, (str, bytes)):
            raise RepositoryError(f"tensors must be an iterable of tensor keys, not the string {tensors!r:.80} "
                                  "(write [key] for one)")
        keys = tensors if tensors is None else list(tensors)
        return _retry_moved(name, lambda: self._get(name, keys, out, verify), self._gone_why)

    def _get(self, name: str, tensors: list[str] | None, out: Mapping[str, np.ndarray] | None,
             verify: bool) -> dict[str, np.ndarray]:
        rows = self._rows(name, tensors)
        by_key = {r[0]: r for r in rows}
        if tensors is None:
            keys = list(by_key)
        else:
            keys = list(dict.fromkeys(tensors))
            unknown = [k for k in keys if k not in by_key]
            if unknown:
                raise ModelNotFoundError(f"model {name!r} has no tensor {_few(unknown)}: ask for keys it has "
                                         "(repo.specs(name) lists them; '<layer id>/<k>' for a Keras model)")
        out = dict(out or {})
        extra = [k for k in out if k not in keys]
        if extra:
            if any(k not in by_key for k in extra):
                raise ModelNotFoundError(f"out= has key {_few([k for k in extra if k not in by_key])}, which model "
                                         f"{name!r} does not have: give out= arrays only for tensors of the model")
            raise RepositoryError(f"out= has key {_few(extra)}, not among the requested tensors: request it too "
                                  "or leave it out of out=")
        result: dict[str, np.ndarray] = {}
        by_pack: dict[str, list[tuple[str, tuple, np.ndarray]]] = {}
        bounded = self._bounded(name, [by_key[k] for k in keys])  # before any allocation
        for k in keys:
            r = by_key[k]
            dtype, dims = bounded[k]
            npd = numpy_dtype(dtype)
            if k in out:
                a = out[k]
                if not isinstance(a, np.ndarray) or a.dtype != npd or a.shape != dims \
                        or not a.flags.c_contiguous or not a.flags.writeable:
                    got = (f"{a.dtype}{list(a.shape)}{'' if a.flags.c_contiguous else ' not C-contiguous'}"
                           f"{'' if a.flags.writeable else ' read-only'}" if isinstance(a, np.ndarray)
                           else type(a).__name__)
                    raise ModelMismatchError(f"out[{k!r}] is {got}; tensor {k!r} of {name!r} is {dtype}{list(dims)} "
                                             "(out= needs C-contiguous writable arrays of that dtype and shape)")
            else:
                a = np.empty(dims, dtype=npd)
            result[k] = a
            by_pack.setdefault(r[9], []).append((k, r, a))
        for file, group in by_pack.items():
            self._read_pack(name, file, group, verify)
        return result

    def _read_pack(self, name: str, file: str, group: list[tuple[str, tuple, np.ndarray]], verify: bool) -> None:
        path = self._pack_path(file)
        # FileNotFoundError: moved by gc -> get() looks again; another user's pack: UnsafePathError
        with ownership.open_trusted_file(path, kind="repository pack") as f:
            index = self._index(f, path)
            plan = []
            for k, r, a in group:
                _key, blob, dtype, _shape, entry, n_entries, offset, length, crc, _file = r
                what = f"tensor {k!r} of {name!r}"
                es = self._resolve(index, path, what, entry, n_entries, offset, length, crc, dtype, a.shape)
                plan.append((offset, length, k, a, es, crc))
            plan.sort(key=lambda p: p[0])
            # a tensor stored once for several keys (de-duplicated: the same blob) is read once and copied
            first: dict[tuple[int, int], np.ndarray] = {}
            reads, copies = [], []
            for p in plan:
                src = first.setdefault((p[0], p[1]), p[3])
                (reads if src is p[3] else copies).append(p)
            runs = []
            scratch = memoryview(bytearray(_GAP))  # where the padding between two tensors of a run is read to
            i = 0
            while i < len(reads):  # coalesce adjacent tensors (gaps < 64 bytes) into one run: one preadv
                start = reads[i][0]
                iovs = [_u8(reads[i][3])]
                end = start + reads[i][1]
                j = i + 1
                while j < len(reads) and 0 <= reads[j][0] - end < _GAP and len(iovs) < _IOV_MAX - 2 \
                        and end - start < 1 << 30:
                    if reads[j][0] > end:
                        iovs.append(scratch[:reads[j][0] - end])
                    iovs.append(_u8(reads[j][3]))
                    end = reads[j][0] + reads[j][1]
                    j += 1
                if end > start:
                    runs.append((start, end, iovs))
                i = j
            got = _read_runs(f.fileno(), runs, lambda fd, iovs, at: self._preadv_all(fd, iovs, at, path))
            for offset, length, k, a, es, crc in copies:
                _u8(a)[:] = _u8(first[(offset, length)])
        with self._lock:
            self.bytes_read += got
        if verify:
            for offset, length, k, a, es, crc in reads:   # the copies are of these bytes: checked with them
                if crc32(_u8(a)) != crc:  # the whole tensor's CRC32 (a piece's, for one-piece blobs)
                    raise CorruptCheckpointError(
                        f"{path}: checksum mismatch in tensor {k!r} of model {name!r} (bytes [{offset}, "
                        f"{offset + length})): the pack was damaged after it was written; restore it from a backup "
                        "or delete the model (and run gc)")

    def _migrate_ids(self) -> None:
        """Rewrite the layer ids of a repository written with id scheme 1 (:mod:`.migrate`): each
        live model's graph, tensor keys and layer metadata get scheme-2 ids recomputed from its
        stored graph and metadata, in one transaction, once (settings ``id_scheme`` becomes the
        current scheme). A model whose scheme-1 ids cannot be reproduced keeps its graph (scheme
        1: loaded through ``mapping=`` or ``match="shape"`` only) and is listed in settings
        ``id_migration_failed``."""
        from .migrate import migrate_repository
        migrate_repository(self._conn(), self._db, self._rollback)

    def graph(self, name: str) -> dict | None:
        """The plain-data layer graph stored with ``name`` (None if it was stored without one)."""
        row = self._model_row(self._conn(), name)
        if row[6] is None:
            return None
        return decode_graph(row[6], f"{self._db}: graph of {name!r}")

    def layer_meta(self, ids: Iterable[str]) -> dict[str, dict]:
        """The stored metadata of the given layer ids (ids not stored are left out)."""
        ids = [i for i in dict.fromkeys(ids) if isinstance(i, str)]
        conn = self._conn()
        out = {}
        for i in range(0, len(ids), _SQL_CHUNK):
            chunk = ids[i:i + _SQL_CHUNK]
            for lid, text in conn.execute(f"SELECT id, meta FROM layer_meta WHERE id IN ({','.join('?' * len(chunk))})",
                                          chunk):
                try:
                    if len(text) > _MAX_META:
                        raise ValueError(f"{len(text)} bytes")
                    m = bounded_loads(text, "layer meta", max_bytes=_MAX_META, max_depth=MAX_CONFIG_DEPTH)
                    if not isinstance(m, dict):
                        raise ValueError("not an object")
                except (ValueError, TypeError) as e:
                    raise CorruptCheckpointError(f"{self._db}: metadata of layer {lid} is not valid JSON ({e}): the "
                                                 "database is damaged; restore it from a backup") from e
                out[lid] = m
        return out

    def list(self) -> dict[str, list[str]]:
        """model -> sorted names (``<model>[@<tag>]``) of the stored (not deleted) models."""
        out: dict[str, list[str]] = {}
        for model, name in self._conn().execute("SELECT model, name FROM models WHERE deleted=0 ORDER BY model, name"):
            out.setdefault(model, []).append(name)
        return out

    def info(self, name: str | None = None) -> dict:
        """One model's facts, or (``name=None``) the repository's totals (see the module docstring)."""
        conn = self._conn()
        if name is not None:
            _mid, _d, created, nbytes, n, dedup, gbytes, model, tag = self._model_row(conn, name)
            layers = None
            if gbytes is not None:
                layers = len(decode_graph(gbytes, f"{self._db}: graph of {name!r}")["layers"])
            return {"name": name, "model": model, "tag": tag, "bytes": nbytes, "tensors": n, "created": created,
                    "layers": layers, "deduplicated": dedup}
        try:
            conn.execute("BEGIN")
            names, models, logical, n = conn.execute(
                "SELECT count(*), count(DISTINCT model), COALESCE(SUM(bytes), 0), COALESCE(SUM(n_tensors), 0) "
                "FROM models WHERE deleted=0").fetchone()
            deleted = conn.execute("SELECT count(*) FROM models WHERE deleted=1").fetchone()[0]
            stored, blobs = conn.execute("SELECT COALESCE(SUM(length), 0), count(*) FROM blobs WHERE refs>0").fetchone()
            pack_bytes, packs = conn.execute("SELECT COALESCE(SUM(size), 0), count(*) FROM packs").fetchone()
            n_meta = conn.execute("SELECT count(*) FROM layer_meta").fetchone()[0]
            settings = dict(conn.execute("SELECT key, value FROM settings").fetchall())
        finally:
            self._rollback(conn)
        providers = settings.get("providers")
        if providers is not None:
            try:
                providers = bounded_loads(providers, "providers", max_bytes=1 << 20)
            except ValueError:
                pass
        return {"location": self.location, "names": names, "models": models, "deleted_names": deleted,
                "tensors": n, "logical_bytes": logical, "stored_bytes": stored, "savings": logical - stored,
                "blobs": blobs, "packs": packs, "pack_bytes": pack_bytes, "layer_meta": n_meta,
                "id_scheme": int(settings["id_scheme"]) if settings.get("id_scheme", "").isdigit() else None,
                "schema_version": SCHEMA_VERSION, "format_version": FORMAT_VERSION, "providers": providers}

    def _rewrite(self, pid: int, file: str, size: int, warnings: list[str]) -> int | None:
        """Move the live blobs of pack ``pid`` into a new pack and the old pack into the quarantine;
        the bytes that moved there, None if skipped."""
        conn = self._conn()
        rows = conn.execute("SELECT id, dtype, shape, entry, n_entries, offset, length, crc FROM blobs WHERE pack=? "
                            "ORDER BY offset", (pid,)).fetchall()
        path = self._pack_path(file)
        try:  # the one trust check, as for get: another user's pack is never copied into one of yours
            with ownership.open_trusted_file(path, kind="repository pack") as f:
                index = self._index(f, path)
                items = []
                for bid, dtype, shape, entry, n_entries, offset, length, crc in rows:
                    _, dims = self._parse_spec(dtype, shape, f"blob {bid}")
                    self._resolve(index, path, f"blob {bid}", entry, n_entries, offset, length, crc, dtype, dims)
                    items.append((_Copy(f.fileno(), offset, length, f"{path}: blob {bid}"), dtype, dims, crc))
                new_file, new_size, entries = self._write_pack(items)
        except FileNotFoundError:
            return None  # another gc got there first
        committed = False
        try:
            conn.execute("BEGIN IMMEDIATE")
            if conn.execute("SELECT 1 FROM packs WHERE id=?", (pid,)).fetchone() is None:
                return None
            ids = {r[0] for r in conn.execute("SELECT id FROM blobs WHERE pack=?", (pid,))}
            if not ids <= {r[0] for r in rows}:
                return None
            new_pid = conn.execute("INSERT INTO packs(file, size, data_bytes, created) VALUES (?,?,?,?)",
                                   (new_file, new_size, sum(e.length for e in entries), time.time())).lastrowid
            conn.executemany("UPDATE blobs SET pack=?, entry=?, n_entries=1, offset=?, length=? WHERE id=? AND pack=?",
                             [(new_pid, i, e.offset, e.length, r[0], pid)
                              for i, (e, r) in enumerate(zip(entries, rows))])
            conn.execute("DELETE FROM packs WHERE id=?", (pid,))
            conn.execute("COMMIT")
            committed = True
        finally:
            self._rollback(conn)
            if not committed:
                _unlink(os.path.join(self._packs, new_file))
        return self._quarantine(file, "old copy of a compacted pack", warnings)

    # ------------------------------------------------------------------ import

    def add_pack(self, name: str, path: str, mapping: Mapping[str, Sequence[int]], graph: dict | None = None,
                 meta: Mapping[str, dict] | None = None) -> dict:
        """Store ``name`` from an existing DeepFreeze-format file without re-serializing it.

        The file is hard-linked into ``packs/`` (copied when it is on another file system) and
        ``mapping`` names its tensors: key -> the indices (in file order) of the index entries that
        form that tensor, contiguous pieces covering it whole. The whole tensor's CRC32 is computed
        by reading it once (the pieces' CRCs are checked on the way). Returns like :meth:`put`
        (``written``: the size of the file taken in) plus ``"how"``: ``"linked"`` or ``"copied"``."""
        model, tag = parse_name(name)
        if not isinstance(mapping, Mapping) or not mapping:
            raise RepositoryError("mapping must be a non-empty mapping of tensor key -> entry indices")
        gbytes = self._check_graph_keys(graph, list(mapping))
        meta_rows = self._check_meta(meta)
        conn = self._conn()
        taken = self._name_taken(conn, name)
        if taken is not None:
            raise taken
        with fsafe.open_regular_file(path) as f:
            index = read_index(f, path)
            used: set[int] = set()
            specs = []
            for key, idx in mapping.items():
                if not isinstance(key, str) or not 0 < len(key) <= _MAX_KEY or "\0" in key:
                    raise RepositoryError(f"tensor key {key!r:.80}: expected a non-empty string without NUL")
                try:
                    idx = list(idx) if not isinstance(idx, (str, bytes)) else []
                except TypeError:
                    idx = []
                if not idx or not all(type(i) is int and 0 <= i < len(index.entries) for i in idx) \
                        or any(b <= a for a, b in zip(idx, idx[1:])) or used & set(idx):
                    raise RepositoryError(f"tensor {key!r}: entry indices {_few(idx, 10) or 'none'} must be "
                                          f"increasing indices below {len(index.entries)}, each used by one tensor "
                                          "only: map each key to the index entries of one tensor "
                                          "(tensor_entries(path) lists them)")
                used |= set(idx)
                es = [index.entries[i] for i in idx]
                e0 = es[0]
                total = math.prod(e0.shape)
                ok = e0.start == 0 and es[-1].stop == total and all(
                    b.tensor_id == e0.tensor_id and b.dtype == e0.dtype and b.shape == e0.shape
                    and b.start == a.stop and b.offset == a.offset + a.length for a, b in zip(es, es[1:]))
                if not ok:
                    raise RepositoryError(f"tensor {key!r}: entries {_few(idx, 10)} of {path} are not the "
                                          "contiguous pieces of one whole tensor: map each key to all the index "
                                          "entries of one tensor (tensor_entries(path) lists them)")
                crc = 0
                chunk = 16 << 20
                buf = np.empty(min(chunk, max(e.length for e in es)), dtype=np.uint8) if es else None
                for e in es:
                    piece = 0
                    pos = 0
                    while pos < e.length:
                        n = min(chunk, e.length - pos)
                        view = memoryview(buf)[:n]
                        self._preadv_all(f.fileno(), [view], e.offset + pos, path)
                        piece = crc32(view, piece)
                        crc = crc32(view, crc)
                        pos += n
                    if index.has_crc and piece != e.crc:
                        raise CorruptCheckpointError(f"{path}: checksum mismatch in tensor {e.tensor_id} elements "
                                                     f"[{e.start}, {e.stop}): the file is damaged; nothing was stored")
                specs.append((key, idx[0], len(idx), e0.offset, total * dtype_itemsize(e0.dtype), crc, e0.dtype,
                              _shape_text(e0.shape)))
            uid = uuid.uuid4().hex
            file = uid + _PACK_SUFFIX
            dest = os.path.join(self._packs, file)
            size = index.file_size
            try:
                how = _place(f, path, dest, os.path.join(self._packs, f"tmp-{uid}"), self.fsync)
            except _RemovedByGc as e:
                raise CheckpointWriteError(errno.ENOENT, f"importing {name!r} into {self.location}: its copy "
                                           f"{e.filename} was removed while it was being written: "
                                           f"{self._gc_removed_tmp}; nothing was stored; import it again") from e
        if self.fsync:
            self._fsync_dir()
        committed = False
        try:
            self._begin_commit(conn, name)
            if not os.path.exists(dest):
                raise RepositoryError(f"importing {name!r} into {self.location}: its pack {file} disappeared before "
                                      f"the commit: {self._gone_why(file, False)}; nothing was stored; import it again")
            self._record_scheme(conn, graph)
            data = sum(e.length for e in index.entries)
            pid = conn.execute("INSERT INTO packs(file, size, data_bytes, created) VALUES (?,?,?,?)",
                               (file, size, data, time.time())).lastrowid
            base = conn.execute("SELECT COALESCE(MAX(id), 0) FROM blobs").fetchone()[0] + 1
            conn.executemany(
                "INSERT INTO blobs(id, pack, entry, n_entries, offset, length, crc, dtype, shape, refs) "
                "VALUES (?,?,?,?,?,?,?,?,?,1)", [(base + i, pid, *s[1:]) for i, s in enumerate(specs)])
            total = sum(s[4] for s in specs)
            mid = conn.execute(
                "INSERT INTO models(name, model, tag, created, bytes, n_tensors, deduplicated, graph) "
                "VALUES (?,?,?,?,?,?,0,?)", (name, model, tag, time.time(), total, len(specs), gbytes)).lastrowid
            conn.executemany("INSERT INTO tensors(model, key, pos, blob) VALUES (?,?,?,?)",
                             [(mid, s[0], i, base + i) for i, s in enumerate(specs)])
            conn.executemany("INSERT OR IGNORE INTO layer_meta(id, meta) VALUES (?,?)", meta_rows)
            conn.execute("COMMIT")
            committed = True
        except sqlite3.DatabaseError as e:
            raise RepositoryError(f"importing {name!r}: the database failed ({e}); nothing was stored") from e
        finally:
            if not committed:
                self._rollback(conn)
                _unlink(dest)
        return {"bytes": total, "written": size, "deduplicated": 0, "how": how}


def tensor_entries(path: str) -> dict[int, list[int]]:
    """tensor id -> the indices (file order) of its index entries in the DeepFreeze-format file
    ``path``: the ``mapping`` values :meth:`EmbeddedRepository.add_pack` takes (map tensor ids to
    keys with the checkpoint's manifest). :class:`CorruptCheckpointError` if it is not a valid file."""
    with fsafe.open_regular_file(path) as f:
        index = read_index(f, path)
    out: dict[int, list[int]] = {}
    for i, e in enumerate(index.entries):
        out.setdefault(e.tensor_id, []).append(i)
    return out


def _place(f: Any, src: str, dest: str, tmp: str, fsync: bool) -> str:
    """Put the open file ``f`` (path ``src``) at ``dest``: a hard link on the same file system
    (returns ``"linked"``), else a copy (copy_file_range) under ``tmp`` renamed into place
    (``"copied"``). Only a file of the user's own is linked: a pack must be (deepfreeze.ownership),
    so one of another (trusted) owner, e.g. imported by root with ``trust_owners``, is copied."""
    st = os.fstat(f.fileno())
    try:
        if st.st_uid != os.getuid():
            raise OSError(errno.EPERM, "not your file: copied, never linked into packs/")
        os.link(src, dest, follow_symlinks=False)
        dst = os.stat(dest)
        if (dst.st_ino, dst.st_dev) == (st.st_ino, st.st_dev):  # the file we checked, not a swapped one
            return "linked"
        _unlink(dest)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES, errno.ENOTSUP):
            raise
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        try:
            pos = 0
            while pos < st.st_size:
                try:
                    n = os.copy_file_range(f.fileno(), fd, st.st_size - pos, pos, pos)
                except OSError:
                    f.seek(pos)
                    with os.fdopen(os.dup(fd), "wb") as out:
                        out.seek(pos)
                        shutil.copyfileobj(f, out, 16 << 20)
                    break
                if n <= 0:
                    raise CorruptCheckpointError(f"{src}: shrank while being imported")
                pos += n
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.rename(tmp, dest)
        except FileNotFoundError as e:  # our tmp- file is gone: only gc removes those
            raise _RemovedByGc(tmp) from e
    except BaseException:
        _unlink(tmp)
        raise
    return "copied"


def _retry_moved(name: str, read: "Callable[[], Any]", why: "Callable[[str], str]") -> Any:
    """``read()``, looked up again (up to 4 times) when a pack it needs is gone: gc moved the
    tensors meanwhile. Still gone: :class:`CorruptCheckpointError` naming the pack and, from
    ``why(pack file name)``, who removed it (a gc, into the quarantine) and what to do."""
    for attempt in range(4):
        try:
            return read()
        except FileNotFoundError as e:
            if attempt == 3:
                path = str(e.filename)
                raise CorruptCheckpointError(
                    f"{path}: a pack of model {name!r} is missing from the repository: "
                    f"{why(os.path.basename(path))}") from e
    raise AssertionError("unreachable")  # pragma: no cover
