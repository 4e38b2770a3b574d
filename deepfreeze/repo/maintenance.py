"""Repository upkeep: garbage collection, deletion, a full disk, database errors.

The part of the embedded repository (:mod:`deepfreeze.repo.store`, whose layout and commit
protocol it relies on) that removes things: :meth:`Maintenance.delete` and :meth:`Maintenance.gc`,
as a mixin :class:`~deepfreeze.repo.store.EmbeddedRepository` inherits, plus the translation of
``sqlite3`` errors into :class:`~deepfreeze.errors.RepositoryDatabaseError`.

Delete
------
One transaction removes the model's tensor rows, marks the name deleted (reserved forever),
RECOUNTS its blobs from the remaining tensor rows (the stored ``refs`` are a cache, never trusted
to free anything), drops the blobs no row points to and the packs left without blobs; after the
commit it unlinks those packs. Packs shared with other models are compacted by gc.

Garbage collection (:meth:`~Maintenance.gc`)
--------------------------------------------
gc never destroys what a repair of the database could reach. References are recomputed from the
live rows (names -> tensors -> blobs -> packs), never taken from the stored counts.

1. Outside the write lock (it reads every pack's index): each pack row's blobs that a live model
   uses are checked against the pack file (its index, each blob's entries, byte range, dtype,
   shape, CRC of the index entry).
2. In one write transaction: check the rows (a tensor row of a live model pointing to a blob or
   pack row that does not exist, a model with fewer tensor rows than it was stored with: then gc
   only repairs the counts and removes nothing, because the blob the row meant cannot be told
   from an unused one); check every pack row against its file with ``lstat`` only (a name that is
   not ``<32 hex>.dfz``: never used as a path; a missing file, saying when it is in the
   quarantine; not a regular file; a size other than the row's; ``data_bytes`` outside
   [0, size]); set every stored count to the recount (``refs_repaired``); drop blobs no tensor
   row points to. If step 1 or this check found anything, gc commits that and stops: it moves,
   unlinks and rewrites no pack (a pack that looks unused may be the one a repaired row names,
   e.g. a row whose file was changed leaves its real pack looking orphan), and says so in
   ``damaged`` and a warning of the ``deepfreeze.repo`` logger.
3. Otherwise, still under the lock: unlink the quarantine entries older than the quarantine
   period (moved by an earlier gc: the ones this gc moves wait a period whatever it is), drop the
   pack rows left without blobs, move the orphan packs (``*.dfz`` no row names, older than the
   grace period) into the quarantine and unlink the ``tmp-*`` files of crashed stores older than
   it; commit; move the dead packs into the quarantine.
4. Rewrite each pack whose live bytes are below ``rewrite_below`` (default 0.5) of its data (no
   room for the new pack: a ``warnings`` entry, the old pack stays): the live tensors are streamed
   (CRC-checked) into a new pack, and one transaction moves their blobs to it (blob ids are
   unchanged, so a concurrent store that de-duplicated against them stays valid); the old pack
   goes into the quarantine. An imported file still hard-linked from its checkpoint is not
   rewritten (a copy would free nothing). A pack whose live tensor fails its CRC is kept as it is
   and reported (``damaged``). A crash during gc leaves either the old or the new pack
   referenced, and at most an orphan.

The quarantine (:mod:`deepfreeze.repo.quarantine`): ``<repository>/quarantine/<seconds>-<32
hex>.dfz``, the time the pack was moved and its own name; kept ``quarantine_period`` seconds
(:data:`~deepfreeze.repo.quarantine.DEFAULT_QUARANTINE_PERIOD`, 7 days), listed by
:meth:`~Maintenance.quarantined` and in gc's result, moved back by :meth:`~Maintenance.restore_pack`
(``deepfreeze repo gc REPO --restore PACK``). ``freed`` counts only bytes really released (purged
entries, ``tmp-*`` files; a file with other hard links releases none), ``quarantined`` the bytes
moved into the quarantine. ``delete`` still unlinks the packs only its model used at once: it is
how space is freed, on a full disk too.

Full disk
---------
A write transaction of SQLite in WAL mode needs new space (WAL frames, and the ``-shm`` shared
memory a fresh process maps), so on a full file system a deletion could not be recorded, and
without it no space could be freed. The repository keeps ``<repository>/reserve``, a 1 MiB
preallocated file (:data:`RESERVE_BYTES`, made when the repository is opened with room to spare).
When opening fails on a full disk (SQLite cannot map its shared memory), or a ``delete``
transaction fails with SQLITE_FULL, the reserve is unlinked and the operation tried once more; the
delete then frees its packs, and the reserve is made again (best effort) after every delete and
gc. Measured on an 8 MiB tmpfs filled to the last byte: a process that had the repository open
and a fresh ``deepfreeze repo rm`` both delete a model and free its pack
(tests/faults/test_repo_safety.py). Every ``sqlite3`` error of a public method surfaces as
:class:`~deepfreeze.errors.RepositoryDatabaseError` naming what failed, why (full disk, lock held
past the busy timeout, read-only, damaged) and what to do.
"""
from __future__ import annotations

import functools
import logging
import os
import sqlite3
import stat
import time
import uuid
from typing import Any, Sequence

from .. import ownership
from ..errors import CorruptCheckpointError, RepositoryDatabaseError, UnsafePathError, UntrustedOwnerError
from . import quarantine
from .graph import ID_HEX_RE
from .names import parse_name

__all__ = ["Maintenance", "RESERVE_FILE", "RESERVE_BYTES"]

log = logging.getLogger("deepfreeze.repo")

PACK_SUFFIX = ".dfz"
SQL_CHUNK = 500  # ids per "IN (...)" query
BUSY_TIMEOUT = 60.0  # seconds a connection waits for another one's lock (sqlite busy_timeout)
#: ``<repository>/reserve``: preallocated space given up when the disk is full, so that the database can
#: still be opened and a model deleted (see "Full disk" above)
RESERVE_FILE = "reserve"
RESERVE_BYTES = 1 << 20
_LOW_SPACE = 256 << 10  # below this many free bytes an I/O error of SQLite counts as a full disk


def _is_full(e: BaseException) -> bool:
    """Whether a sqlite3 error says the disk is full (SQLITE_FULL)."""
    # text matched on purpose: sqlite3 raises one OperationalError class for every cause and names the cause
    # only in its text and in sqlite_errorname (Python 3.11+; absent before, and on errors raised by the module)
    return getattr(e, "sqlite_errorname", "").startswith("SQLITE_FULL") or "full" in str(e).lower()


def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def db_op(what: str) -> Any:
    """Decorator of the public methods: a ``sqlite3`` error becomes a :class:`RepositoryDatabaseError`
    saying what failed, why and what to do (``what`` is followed by the name argument, if any)."""
    def deco(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(self: "Maintenance", *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except sqlite3.Error as e:
                doing = f"{what} {args[0]!r}" if args and isinstance(args[0], str) else what
                raise self._db_error(doing, e) from e
        return wrapper
    return deco


def valid_pack_name(file: Any) -> bool:
    return (isinstance(file, str) and len(file) == 32 + len(PACK_SUFFIX) and file.endswith(PACK_SUFFIX)
            and ID_HEX_RE.fullmatch(file[:32]) is not None)


def few(items: Sequence[Any], n: int = 5) -> str:
    """``'a', 'b' and 3 more``: a short list for a message (no list repr)."""
    items = list(items)
    text = ", ".join(repr(x) for x in items[:n])
    return text + (f" and {len(items) - n} more" if len(items) > n else "")


def unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def unlink_freed(path: str) -> int:
    """Unlink ``path``; the bytes this frees (0 if it was gone or has other hard links)."""
    try:
        st = os.lstat(path)
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return st.st_size if st.st_nlink == 1 else 0


class Maintenance:
    """delete / gc / reserve / database errors of :class:`~deepfreeze.repo.store.EmbeddedRepository`
    (a mixin: it uses the store's connection, row and pack helpers)."""

    directory: str
    location: str
    orphan_grace: float
    quarantine_period: float
    _db: str
    _packs: str

    def _disk_full(self) -> bool:
        free = _free_bytes(self.directory)
        return free is not None and free < _LOW_SPACE

    def _ensure_reserve(self) -> None:
        """Preallocate ``<repository>/reserve`` (:data:`RESERVE_BYTES`) when missing; best effort (a full
        disk, a file system without fallocate: no reserve, nothing else changes)."""
        path = os.path.join(self.directory, RESERVE_FILE)
        if os.path.lexists(path) or not os.path.isfile(self._db):
            return
        tmp = os.path.join(self.directory, f"{RESERVE_FILE}.{uuid.uuid4().hex}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                os.posix_fallocate(fd, 0, RESERVE_BYTES)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError:
            unlink(tmp)

    def _release_reserve(self) -> bool:
        """Unlink ``<repository>/reserve``; whether there was one to give up. Only a file that is
        ours for sure: next to a ``meta.db``, a regular file of this user of exactly
        :data:`RESERVE_BYTES` (a user's file of that name in a directory that is no repository
        stays)."""
        path = os.path.join(self.directory, RESERVE_FILE)
        try:
            st = os.lstat(path)
            if (not os.path.isfile(self._db) or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                    or st.st_size != RESERVE_BYTES):
                return False
            os.unlink(path)
        except OSError:
            return False
        return True

    def _db_error(self, doing: str, e: BaseException) -> RepositoryDatabaseError:
        """What / why / what to do for a ``sqlite3`` error raised while ``doing``."""
        name = getattr(e, "sqlite_errorname", "") or ""
        # the cause is read from sqlite_errorname and, where that is absent (Python < 3.11, errors raised by the
        # sqlite3 module itself), from the text: sqlite3 has no exception class per cause, only these two
        text = str(e)
        if _is_full(e) or ((name.startswith("SQLITE_IOERR") or "I/O error" in text) and self._disk_full()):
            why = "the disk holding it is full"
            if doing.startswith("deleting"):
                todo = ("the repository's reserve for this case was missing or too small: free some space on that "
                        "file system by other means (remove other files) and retry")
            else:
                todo = (f"free space on that file system (deepfreeze repo rm {self.location} NAME deletes a model "
                        "even on a full disk) and retry")
        elif name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
            why = f"another process kept it locked for more than {BUSY_TIMEOUT:.0f} s"
            todo = "retry when the other process's long operation (a gc, an import) is done"
        elif name.startswith("SQLITE_READONLY") or "readonly" in text or "read-only" in text:
            why = "it may not be written (permissions, or a read-only file system)"
            todo = "run as the repository's owner on a writable file system"
        elif name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")) or "malformed" in text:
            why = "it is damaged"
            todo = "restore meta.db from a backup"
        else:
            why = "an I/O or database error"
            todo = "check the file system (dmesg, free space) and retry; restore meta.db from a backup if it persists"
        return RepositoryDatabaseError(f"{doing} in {self.location}: the repository database failed ({text}): "
                                       f"{why}; {todo}")


    # ------------------------------------------------------------------ delete, gc

    def delete(self, name: str) -> dict:
        """Delete ``name`` and free what only it used: its tensors are released (blobs shared with
        other models stay), blobs no model references any more are dropped and packs left without
        blobs unlinked (packs shared with other models are compacted by :meth:`gc`). The name stays
        reserved forever. Works on a full disk (the repository's reserve is given up for the
        database's journal, then re-made). Returns ``{"freed": bytes, "blobs_removed",
        "packs_removed"}``. :class:`ModelNotFoundError` if it is not stored;
        :class:`RepositoryDatabaseError` if the database fails (nothing is deleted then)."""
        parse_name(name)
        try:
            try:
                dead, blobs_removed = self._delete(name)
            except sqlite3.Error as e:
                if not ((_is_full(e) or self._disk_full()) and self._release_reserve()):
                    raise
                self._drop_conn()  # a fresh connection: the failed one may hold a half-grown WAL
                dead, blobs_removed = self._delete(name)
        except sqlite3.Error as e:
            raise self._db_error(f"deleting {name!r}", e) from e
        freed = 0
        for file in dead:
            freed += unlink_freed(os.path.join(self._packs, file))
            with self._lock:
                self._index_cache.pop(os.path.join(self._packs, file), None)
        self._ensure_reserve()
        return {"freed": freed, "blobs_removed": blobs_removed, "packs_removed": len(dead)}

    def _delete(self, name: str) -> tuple[list[str], int]:
        """The delete transaction: (files of the packs it dropped, blobs dropped). Reference
        counts of the model's blobs are recounted from the rows, not decremented."""
        conn = self._conn()
        try:
            conn.execute("BEGIN IMMEDIATE")
            mid = self._model_row(conn, name)[0]
            blobs = [r[0] for r in conn.execute("SELECT DISTINCT blob FROM tensors WHERE model=?", (mid,))]
            conn.execute("DELETE FROM tensors WHERE model=?", (mid,))
            conn.execute("UPDATE models SET deleted=1, graph=NULL WHERE id=?", (mid,))
            packs: set[int] = set()
            removed = 0
            for i in range(0, len(blobs), SQL_CHUNK):
                chunk = blobs[i:i + SQL_CHUNK]
                marks = ",".join("?" * len(chunk))
                conn.execute(f"UPDATE blobs SET refs=(SELECT count(*) FROM tensors t WHERE t.blob=blobs.id) "
                             f"WHERE id IN ({marks})", chunk)
                packs.update(r[0] for r in conn.execute(f"SELECT DISTINCT pack FROM blobs WHERE id IN ({marks}) "
                                                        "AND refs=0", chunk))
                removed += conn.execute(f"DELETE FROM blobs WHERE id IN ({marks}) AND refs=0", chunk).rowcount
            dead: list[tuple[int, str]] = []
            for pid in sorted(packs):
                row = conn.execute("SELECT file FROM packs WHERE id=? AND NOT EXISTS (SELECT 1 FROM blobs b "
                                   "WHERE b.pack=packs.id)", (pid,)).fetchone()
                if row is not None and valid_pack_name(row[0]):  # (a damaged name: left to gc to report)
                    dead.append((pid, row[0]))
            conn.executemany("DELETE FROM packs WHERE id=?", [(pid,) for pid, _ in dead])
            conn.execute("COMMIT")
        finally:
            self._rollback(conn)
        return [f for _, f in dead], removed

    def _damaged_rows(self, conn: sqlite3.Connection) -> tuple[list[str], bool]:
        """Rows that do not form names -> tensors -> blobs -> packs (gc reports them, acts on none),
        and whether a live model lost track of a tensor (a tensor row pointing to a blob or pack
        row that does not exist, or missing tensor rows): then the blob it meant is unknown, and gc
        removes nothing."""
        out = []
        fix = "restore meta.db from a backup, or delete the model (deepfreeze repo rm)"
        for mid, name, deleted, n in conn.execute(
                "SELECT t.model, m.name, m.deleted, count(*) FROM tensors t LEFT JOIN models m ON m.id=t.model "
                "WHERE m.id IS NULL OR m.deleted!=0 GROUP BY t.model LIMIT 100"):
            who = f"deleted model {name!r}" if name is not None else f"model id {mid}, which has no row"
            out.append(f"{self._db}: {n} tensor row(s) of {who} remain: the database is inconsistent; the blobs "
                       "they point to were kept; restore meta.db from a backup if space matters")
        bad: dict[str, list[str]] = {}
        for name, key in conn.execute(
                "SELECT m.name, t.key FROM tensors t JOIN models m ON m.id=t.model LEFT JOIN blobs b ON b.id=t.blob "
                "LEFT JOIN packs p ON p.id=b.pack WHERE m.deleted=0 AND p.id IS NULL LIMIT 10000"):
            bad.setdefault(name, []).append(key)
        for name, keys in bad.items():
            these = f"tensor {few(keys)} points" if len(keys) == 1 else f"tensors {few(keys)} point"
            out.append(f"{self._db}: model {name!r}: {these} to a blob or pack row that does not exist: "
                       f"{'it' if len(keys) == 1 else 'they'} cannot be read; {fix}")
        lost = bool(bad)
        for name, n, have in conn.execute(
                "SELECT name, n_tensors, (SELECT count(*) FROM tensors t WHERE t.model=models.id) AS c FROM models "
                "WHERE deleted=0 AND c != n_tensors LIMIT 100"):
            out.append(f"{self._db}: model {name!r} was stored with {n} tensors but {have} tensor rows remain: "
                       f"the database is damaged; {fix}")
            lost = True
        return out, lost

    def _pack_damage(self, conn: sqlite3.Connection, full: bool) -> tuple[list[str], set[int]]:
        """Every pack row checked against its file (inside the caller's transaction on ``conn``):
        a name that is not ``<32 hex>.dfz``, a missing file (saying so when gc put it in the
        quarantine), not a regular file, a size other than the row's, and with ``full`` each live
        blob's row against the pack's index (entries, byte range, dtype, shape, CRC of the index
        entry; a missing file is then left to the check without ``full`` that gc runs under its write
        lock, since a concurrent gc may have moved it since this snapshot). Returns (messages, ids
        of the packs concerned). Only ``lstat`` of names that pass the name check, so a row naming
        ``../../etc/passwd`` touches nothing outside the repository."""
        rows = conn.execute("SELECT id, file, size, data_bytes FROM packs ORDER BY id").fetchall()
        blobs: dict[int, list[tuple]] = {}
        users: dict[int, list[str]] = {}
        if full:  # (under the write lock only the rows: these two reads grow with the repository)
            for bid, name in conn.execute("SELECT t.blob, m.name FROM tensors t JOIN models m ON m.id=t.model "
                                          "WHERE m.deleted=0"):
                users.setdefault(bid, []).append(name)
            for r in conn.execute("SELECT pack, id, dtype, shape, entry, n_entries, offset, length, crc FROM blobs"):
                blobs.setdefault(r[0], []).append(r[1:])
        out: list[str] = []
        bad: set[int] = set()
        qdir = os.path.join(self.directory, quarantine.QUARANTINE_DIR)

        def used_by(pid: int) -> str:
            names = [n for (n,) in conn.execute(
                "SELECT DISTINCT m.name FROM blobs b JOIN tensors t ON t.blob=b.id JOIN models m ON m.id=t.model "
                "WHERE b.pack=? AND m.deleted=0 ORDER BY m.name", (pid,))]
            return f"used by model {few(names)}" if names else "used by no live model"

        for pid, file, size, data in rows:
            mine = blobs.get(pid, [])
            if not valid_pack_name(file):
                used = used_by(pid)
                out.append(f"{self._db}: pack row {pid} ({used}) names the file {file!r:.80}, not '<32 hex>.dfz': the "
                           "database is damaged or was tampered with; restore meta.db from a backup (or set the "
                           "row's file back); no file was touched")
                bad.add(pid)
                continue
            path = os.path.join(self._packs, file)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                if full:
                    continue
                used = used_by(pid)
                q = quarantine.find(qdir, file)
                if q is not None:
                    where = (f"gc moved it into the quarantine as {os.path.join(qdir, q['entry'])} at "
                             f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(q['since']))} (no row named it "
                             f"then): restore it with 'deepfreeze repo gc {self.location} --restore {file}'")
                else:
                    where = ("it is not in the quarantine either (removed by hand?): restore it from a backup, or "
                             "set the row back if it was changed")
                    if used == "used by no live model":
                        where += (f"; if no model needs this pack, drop the row (sqlite3 {self._db} 'DELETE FROM "
                                  f"packs WHERE id={pid}') and gc goes on")
                out.append(f"{path}: pack row {pid} ({used}) names a file that is missing: {where}; its rows were "
                           "kept")
                bad.add(pid)
                continue
            if not stat.S_ISREG(st.st_mode):
                used = used_by(pid)
                out.append(f"{path}: pack row {pid} ({used}) names something that is not a regular file: remove it "
                           "and restore the pack from a backup; its rows were kept")
                bad.add(pid)
                continue
            if type(size) is not int or size != st.st_size or type(data) is not int or not 0 <= data <= size:
                used = used_by(pid)
                out.append(f"{path}: pack row {pid} ({used}) says {size!r:.40} bytes ({data!r:.40} of tensor data), "
                           f"the file has {st.st_size}: the row or the file was changed; restore meta.db or the "
                           "pack from a backup (or set the row back); kept as it is")
                bad.add(pid)
                continue
            live = [b for b in mine if b[0] in users]
            if not full or not live:
                continue
            try:
                with ownership.open_trusted_file(path, kind="repository pack") as f:  # as get reads it
                    index = self._index(f, path)
                    for bid, dtype, shape, entry, n_entries, offset, length, crc in live:
                        try:
                            _, dims = self._parse_spec(dtype, shape, f"blob {bid}")
                            self._resolve(index, path, f"blob {bid}", entry, n_entries, offset, length, crc, dtype,
                                          dims)
                        except CorruptCheckpointError as e:
                            out.append(f"{e} (blob {bid}, model {few(sorted(set(users[bid])))}; kept as it is)")
                            bad.add(pid)
            except FileNotFoundError:  # moved by a concurrent gc since the lstat: checked by that gc
                continue
            except (OSError, CorruptCheckpointError) as e:  # (a symbolic link: UnsafePathError)
                out.append(f"{e} (pack {used_by(pid)}; kept as it is)")
                bad.add(pid)
        return out, bad

    def _damaged_packs(self) -> tuple[list[str], set[int]]:
        """:meth:`_pack_damage` (full: it reads every pack's index) in a read transaction of its
        own, so that the write lock is not held while it runs."""
        conn = self._conn()
        try:
            conn.execute("BEGIN")
            return self._pack_damage(conn, True)
        finally:
            self._rollback(conn)

    def _quarantine(self, file: str, what: str, warnings: list[str]) -> int:
        """Move ``packs/<file>`` into the quarantine; the bytes it holds there (0: gone already, a
        file with other links, or not moved: a ``warnings`` entry, the file stays)."""
        path = os.path.join(self._packs, file)
        try:
            st = os.lstat(path)
            entry = quarantine.move_in(self._packs, os.path.join(self.directory, quarantine.QUARANTINE_DIR),
                                       self.directory, file)
        except FileNotFoundError:
            return 0
        except OSError as e:  # (UnsafePathError: a quarantine directory that is not ours)
            warnings.append(f"{path}: {what} not moved into the quarantine ({e}); it stays in packs/ (nothing was "
                            "lost); fix the cause and run gc again")
            return 0
        finally:
            with self._lock:
                self._index_cache.pop(path, None)
        return st.st_size if entry is not None and st.st_nlink == 1 else 0

    def quarantined(self) -> list[dict]:
        """The packs gc moved into ``<repository>/quarantine/``, oldest first: ``{"file": pack name,
        "entry": name in the quarantine, "bytes", "since": when moved, "purge_after": when a gc
        unlinks it (with this repository's ``quarantine_period``)}``."""
        return quarantine.entries(os.path.join(self.directory, quarantine.QUARANTINE_DIR), self.quarantine_period)

    def restore_pack(self, name: str) -> dict:
        """Move a pack gc quarantined back into ``packs/`` under its own name: ``name`` is a pack
        name (its newest entry) or an entry name, as :meth:`quarantined` lists them. Returns the
        entry plus ``"referenced"``: whether a pack row names it (if not, it is an orphan again, and
        a gc after the grace period quarantines it again: repair the row or restore ``meta.db``
        first). :class:`RepositoryError` when there is no such entry or ``packs/`` has that file."""
        e = quarantine.restore(self._packs, os.path.join(self.directory, quarantine.QUARANTINE_DIR), self.directory,
                               name)
        row = self._conn().execute("SELECT id FROM packs WHERE file=?", (e["file"],)).fetchone()
        log.warning("repository %s: pack %s restored from the quarantine (%s)", self.location, e["file"], e["entry"])
        return {**e, "referenced": row is not None}

    def _gc_result(self, **done: Any) -> dict:
        out = {"freed": 0, "blobs_removed": 0, "packs_removed": 0, "packs_rewritten": 0, "orphans_removed": 0,
               "refs_repaired": 0, "warnings": [], "damaged": [], "quarantined": 0, "purged": 0}
        out.update(done)
        out["quarantine"] = self.quarantined()
        return out

    @db_op("garbage-collecting")
    def gc(self, *, grace: float | None = None, rewrite_below: float = 0.5,
           quarantine_period: float | None = None) -> dict:
        """Compact, trusting no stored count and destroying nothing a repair of the database could
        reach: references are recounted from the live rows (names -> tensors -> blobs -> packs);
        blobs no tensor row points to are dropped, packs left without blobs, orphan packs of crashed
        stores older than ``grace`` seconds (default: the repository's ``orphan_grace``) and the
        old copies of packs whose live bytes are below ``rewrite_below`` of their data (rewritten)
        are moved into the quarantine (``<repository>/quarantine/``, :mod:`deepfreeze.repo.quarantine`),
        and quarantined packs older than ``quarantine_period`` seconds (default: the repository's,
        7 days) are unlinked. A blob a model reaches is never dropped. Any damaged row (a tensor
        pointing to a missing blob or pack row, a pack row naming no valid file, a missing file or
        one of another size, a live blob outside its pack): that gc moves and unlinks no pack at all
        (it repairs counts and drops only blob rows no tensor points to) and says why.

        Returns ``{"freed": bytes released on disk (quarantine entries purged, files of crashed
        stores), "blobs_removed", "packs_removed", "packs_rewritten", "orphans_removed",
        "refs_repaired", "warnings": [messages], "damaged": [messages], "quarantined": bytes moved
        into the quarantine (released when purged), "purged": quarantine entries unlinked,
        "quarantine": [the entries now held, as :meth:`quarantined` lists them]}``: counts of what
        was removed (moved into the quarantine) or rewritten; ``refs_repaired``: stored reference
        counts that differed from the recount and were set to it; ``warnings``: compactions not
        done (no room for the new pack; nothing lost); ``damaged``: rows that do not resolve and
        packs whose live tensor failed its CRC, then the line saying that gc removed nothing.
        Damaged rows and their packs are reported, never removed or rewritten."""
        grace = self.orphan_grace if grace is None else float(grace)
        period = self.quarantine_period if quarantine_period is None else float(quarantine_period)
        conn = self._conn()
        dead: list[tuple[int, str]] = []
        orphans: list[str] = []
        orphans_removed = 0
        freed = 0
        purged: list[str] = []
        warnings: list[str] = []
        pre, bad = self._damaged_packs()  # the full check, before the write lock (it reads every index)
        try:
            conn.execute("BEGIN IMMEDIATE")
            damaged, lost = self._damaged_rows(conn)
            count = "(SELECT count(*) FROM tensors t WHERE t.blob=blobs.id)"
            repaired = conn.execute(f"UPDATE blobs SET refs={count} WHERE refs IS NOT {count}").rowcount
            now_msgs, now_bad = self._pack_damage(conn, False)  # the rows again, under the write lock
            pre = now_msgs + [m for m in pre if m not in now_msgs]
            bad |= now_bad
            if lost:  # a live model's tensor points nowhere: the blob or pack it meant may look unused
                conn.execute("COMMIT")
                why = (f"{self.location}: gc removed nothing: a model's tensor rows point to rows that do not "
                       "exist (above), so the data they meant cannot be told from unused data; restore meta.db "
                       "from a backup, or delete those models (deepfreeze repo rm), then run gc again")
                log.warning("%s", why)
                return self._gc_result(refs_repaired=repaired, damaged=damaged + pre + [why])
            blobs_removed = conn.execute("DELETE FROM blobs WHERE refs=0 AND NOT EXISTS (SELECT 1 FROM tensors t "
                                         "WHERE t.blob=blobs.id)").rowcount
            if bad:
                conn.execute("COMMIT")
                n = len(bad)
                rows_do = "a pack row (above) does not match its file" if n == 1 else \
                    f"the rows of {n} packs (above) do not match their files"
                why = (f"{self.location}: gc removed no pack (none moved into the quarantine, none unlinked): "
                       f"{rows_do}, so a pack that looks unused may be one a repaired row names; repair the row or "
                       "restore meta.db (or the pack) from a backup, then run gc again")
                log.warning("%s", why)
                return self._gc_result(refs_repaired=repaired, blobs_removed=blobs_removed,
                                       damaged=damaged + pre + [why], warnings=warnings)
            try:
                purged, freed = quarantine.purge(os.path.join(self.directory, quarantine.QUARANTINE_DIR),
                                                 self.directory, period)
            except OSError as e:  # (UnsafePathError: a quarantine that is a link or not ours)
                warnings.append(f"the quarantine was not purged: {e}")
            dead = [(pid, file) for pid, file in conn.execute(
                "SELECT id, file FROM packs WHERE NOT EXISTS (SELECT 1 FROM blobs b WHERE b.pack=packs.id)")]
            conn.executemany("DELETE FROM packs WHERE id=?", [(pid,) for pid, _ in dead])
            known = {r[0] for r in conn.execute("SELECT file FROM packs")} | {f for _, f in dead}
            now = time.time()
            for fn in os.listdir(self._packs):  # orphans: moved under the write lock (see put)
                is_pack = valid_pack_name(fn)
                is_tmp = len(fn) == 36 and fn.startswith("tmp-") and ID_HEX_RE.fullmatch(fn[4:])
                if not (is_pack or is_tmp) or fn in known:
                    continue
                p = os.path.join(self._packs, fn)
                try:
                    st = os.lstat(p)
                except FileNotFoundError:
                    continue
                if now - max(st.st_mtime, st.st_ctime) < grace or stat.S_ISDIR(st.st_mode):  # ctime: a hard
                    continue  # link made now
                if is_tmp or not stat.S_ISREG(st.st_mode):  # a crashed store's half-written pack, or a link
                    # with a pack's name: never data a row could name (unlinked, not followed)
                    if unlink(p):
                        orphans_removed += 1
                        freed += st.st_size if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 else 0
                else:
                    orphans.append(fn)
            moved = 0
            for fn in orphans:
                got = self._quarantine(fn, "orphan pack (no row names it)", warnings)
                if got or not os.path.lexists(os.path.join(self._packs, fn)):
                    orphans_removed += 1
                moved += got
            conn.execute("COMMIT")
        finally:
            self._rollback(conn)
        for fn in os.listdir(self.directory):  # a reserve half made by a process that died
            if fn.startswith(RESERVE_FILE + ".") and ID_HEX_RE.fullmatch(fn[len(RESERVE_FILE) + 1:]):
                p = os.path.join(self.directory, fn)
                try:
                    if time.time() - os.lstat(p).st_mtime >= grace and unlink(p):
                        orphans_removed += 1
                except FileNotFoundError:
                    pass
        packs_removed = 0
        for _pid, file in dead:
            packs_removed += 1
            moved += self._quarantine(file, "pack left without blobs", warnings)
        rewritten = 0
        rows = conn.execute("SELECT p.id, p.file, p.size, p.data_bytes, SUM(b.length) FROM packs p JOIN blobs b "
                            "ON b.pack=p.id GROUP BY p.id").fetchall()
        for pid, file, size, data, live in rows:
            if pid in bad or not live < rewrite_below * data:
                continue
            try:
                if os.lstat(self._pack_path(file)).st_nlink > 1:
                    continue  # an imported file still linked from its checkpoint: a copy frees nothing
                got = self._rewrite(pid, file, size, warnings)
            except FileNotFoundError:
                continue
            except CorruptCheckpointError as e:  # keep the pack as it is: the reads will say so
                damaged.append(str(e))
                continue
            except (UnsafePathError, UntrustedOwnerError) as e:  # another user's pack: never rewritten as yours
                warnings.append(f"{e} (not compacted: kept as it is)")
                continue
            except OSError as e:  # no room for the new pack (a full disk): the old one stays
                warnings.append(f"{self._pack_path(file)}: not compacted: writing its replacement failed "
                                f"({e.strerror or e}); free space and run gc again (nothing was lost)")
                continue
            if got is not None:
                moved += got
                rewritten += 1
        self._ensure_reserve()
        return self._gc_result(freed=freed, blobs_removed=blobs_removed, packs_removed=packs_removed,
                               packs_rewritten=rewritten, orphans_removed=orphans_removed, refs_repaired=repaired,
                               warnings=warnings, damaged=damaged, quarantined=moved, purged=len(purged))
