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
References are recomputed from the live rows (names -> tensors -> blobs -> packs), never taken
from the stored counts. In one write transaction: check the rows (a tensor row of a live model
pointing to a blob or pack row that does not exist, a model with fewer tensor rows than it was
stored with: "damaged"; then gc only repairs the counts and removes nothing, because the blob the
row meant cannot be told from an unused one); set every stored count to the recount
(``refs_repaired``); drop blobs no tensor row points to, drop packs left without blobs, remove
orphan packs (not in the database, older than the grace period); after the commit, unlink the
dead packs. Then every pack that still holds blobs is checked against the database (the file
exists, its index, each blob's entries, byte range, dtype and shape): a mismatch is reported
(``damaged``) and that pack is neither removed nor rewritten. Then rewrite each pack whose live
bytes are below ``rewrite_below`` (default 0.5) of its data (no room for the new pack: a
``warnings`` entry, the old pack stays): the live tensors are streamed (CRC-checked) into a new pack written as above, and one
transaction moves their blobs to it (blob ids are unchanged, so a concurrent store that
de-duplicated against them stays valid); the old pack is unlinked. An imported file still
hard-linked from its checkpoint is not rewritten (a copy would free nothing), and ``freed``
counts only bytes really released (not a link of a file that has others). A pack whose live
tensor fails its CRC is kept as it is and reported (``damaged``). A crash during gc leaves
either the old or the new pack referenced, and at most an orphan.

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
import os
import sqlite3
import stat
import time
import uuid
from typing import Any, Sequence

from .. import ownership
from ..errors import CorruptCheckpointError, RepositoryDatabaseError, UnsafePathError, UntrustedOwnerError
from .graph import ID_HEX_RE
from .names import parse_name

__all__ = ["Maintenance", "RESERVE_FILE", "RESERVE_BYTES"]

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

    def _damaged_packs(self) -> tuple[list[str], set[int]]:
        """Check every referenced blob's row against its pack file (exists, index, byte range,
        dtype, shape, CRC of the index entry): (messages, ids of the packs concerned)."""
        conn = self._conn()
        try:
            conn.execute("BEGIN")
            rows = conn.execute("SELECT p.id, p.file, b.id, b.dtype, b.shape, b.entry, b.n_entries, b.offset, "
                                "b.length, b.crc FROM packs p JOIN blobs b ON b.pack=p.id ORDER BY p.id").fetchall()
            users: dict[int, list[str]] = {}
            for bid, name in conn.execute("SELECT t.blob, m.name FROM tensors t JOIN models m ON m.id=t.model "
                                          "WHERE m.deleted=0"):
                users.setdefault(bid, []).append(name)
        finally:
            self._rollback(conn)
        by_pack: dict[tuple[int, str], list[tuple]] = {}
        for r in rows:
            by_pack.setdefault((r[0], r[1]), []).append(r[2:])
        out: list[str] = []
        bad: set[int] = set()
        for (pid, file), blobs in by_pack.items():
            names = sorted({n for b in blobs for n in users.get(b[0], ())})
            used = f"used by model {few(names)}" if names else "used by no live model"
            try:
                path = self._pack_path(file)
                with ownership.open_trusted_file(path, kind="repository pack") as f:  # as get reads it
                    index = self._index(f, path)
                    for bid, dtype, shape, entry, n_entries, offset, length, crc in blobs:
                        try:
                            _, dims = self._parse_spec(dtype, shape, f"blob {bid}")
                            self._resolve(index, path, f"blob {bid}", entry, n_entries, offset, length, crc, dtype,
                                          dims)
                        except CorruptCheckpointError as e:
                            who = few(sorted(set(users.get(bid, ())))) or "no live model"
                            out.append(f"{e} (blob {bid}, model {who}; kept as it is)")
                            bad.add(pid)
            except FileNotFoundError:
                out.append(f"{os.path.join(self._packs, file)}: pack {used} is missing (removed by hand?): its "
                           "tensors cannot be read; restore it from a backup or delete the models; its rows were kept")
                bad.add(pid)
            except (OSError, CorruptCheckpointError) as e:  # (a symbolic link: UnsafePathError)
                out.append(f"{e} (pack {used}; kept as it is)")
                bad.add(pid)
        return out, bad

    @db_op("garbage-collecting")
    def gc(self, *, grace: float | None = None, rewrite_below: float = 0.5) -> dict:
        """Compact, trusting no stored count: references are recounted from the live rows (names ->
        tensors -> blobs -> packs); blobs no tensor row points to are dropped, packs left without
        blobs unlinked, orphan packs of crashed stores older than ``grace`` seconds (default: the
        repository's ``orphan_grace``) removed, and packs whose live bytes are below
        ``rewrite_below`` of their data rewritten. A blob a model reaches is never dropped.

        Returns ``{"freed": bytes freed on disk, "blobs_removed", "packs_removed",
        "packs_rewritten", "orphans_removed", "refs_repaired", "warnings": [messages], "damaged":
        [messages]}``: counts of what was removed or rewritten; ``refs_repaired``: stored reference
        counts that differed from the recount and were set to it; ``warnings``: compactions not
        done (no room for the new pack; nothing lost); ``damaged``: rows that do not resolve (a tensor
        pointing to a missing blob or pack, a blob outside its pack, a missing pack file) and
        packs whose live tensor failed its CRC. Damaged rows and their packs are reported, never
        removed or rewritten."""
        grace = self.orphan_grace if grace is None else float(grace)
        conn = self._conn()
        dead: list[tuple[int, str]] = []
        orphans = 0
        freed = 0
        try:
            conn.execute("BEGIN IMMEDIATE")
            damaged, lost = self._damaged_rows(conn)
            count = "(SELECT count(*) FROM tensors t WHERE t.blob=blobs.id)"
            repaired = conn.execute(f"UPDATE blobs SET refs={count} WHERE refs IS NOT {count}").rowcount
            if lost:  # a live model's tensor points nowhere: the blob or pack it meant may look unused
                conn.execute("COMMIT")
                more, _bad = self._damaged_packs()
                return {"freed": 0, "blobs_removed": 0, "packs_removed": 0, "packs_rewritten": 0,
                        "orphans_removed": 0, "refs_repaired": repaired, "warnings": [],
                        "damaged": damaged + more + [
                            f"{self.location}: gc removed nothing: a model's tensor rows point to rows that do not "
                            "exist (above), so the data they meant cannot be told from unused data; restore meta.db "
                            "from a backup, or delete those models (deepfreeze repo rm), then run gc again"]}
            blobs_removed = conn.execute("DELETE FROM blobs WHERE refs=0 AND NOT EXISTS (SELECT 1 FROM tensors t "
                                         "WHERE t.blob=blobs.id)").rowcount
            for pid, file in conn.execute("SELECT id, file FROM packs WHERE NOT EXISTS (SELECT 1 FROM blobs b "
                                          "WHERE b.pack=packs.id)").fetchall():
                if valid_pack_name(file):
                    dead.append((pid, file))
                else:
                    damaged.append(f"{self._db}: pack row {pid} names the file {file!r:.80}, not '<32 hex>.dfz': "
                                   "the database was tampered with; the row was kept and no file removed")
            conn.executemany("DELETE FROM packs WHERE id=?", [(pid,) for pid, _ in dead])
            known = {r[0] for r in conn.execute("SELECT file FROM packs")} | {f for _, f in dead}
            now = time.time()
            for fn in os.listdir(self._packs):  # orphans: removed under the write lock (see put)
                is_pack = len(fn) == 36 and fn.endswith(PACK_SUFFIX) and ID_HEX_RE.fullmatch(fn[:32])
                is_tmp = len(fn) == 36 and fn.startswith("tmp-") and ID_HEX_RE.fullmatch(fn[4:])
                if not (is_pack or is_tmp) or fn in known:
                    continue
                p = os.path.join(self._packs, fn)
                try:
                    st = os.lstat(p)
                except FileNotFoundError:
                    continue
                if now - max(st.st_mtime, st.st_ctime) >= grace:  # ctime: a hard link made now
                    if unlink(p):
                        orphans += 1
                        freed += st.st_size if st.st_nlink == 1 else 0
            conn.execute("COMMIT")
        finally:
            self._rollback(conn)
        for fn in os.listdir(self.directory):  # a reserve half made by a process that died
            if fn.startswith(RESERVE_FILE + ".") and ID_HEX_RE.fullmatch(fn[len(RESERVE_FILE) + 1:]):
                p = os.path.join(self.directory, fn)
                try:
                    if time.time() - os.lstat(p).st_mtime >= grace and unlink(p):
                        orphans += 1
                except FileNotFoundError:
                    pass
        packs_removed = 0
        for _pid, file in dead:
            path = os.path.join(self._packs, file)
            packs_removed += 1
            freed += unlink_freed(path)
            with self._lock:
                self._index_cache.pop(path, None)
        more, bad = self._damaged_packs()
        damaged += more
        rewritten = 0
        warnings: list[str] = []
        rows = conn.execute("SELECT p.id, p.file, p.size, p.data_bytes, SUM(b.length) FROM packs p JOIN blobs b "
                            "ON b.pack=p.id GROUP BY p.id").fetchall()
        for pid, file, size, data, live in rows:
            if pid in bad or not live < rewrite_below * data:
                continue
            try:
                if os.lstat(self._pack_path(file)).st_nlink > 1:
                    continue  # an imported file still linked from its checkpoint: a copy frees nothing
                delta = self._rewrite(pid, file, size)
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
            if delta is not None:
                freed += delta
                rewritten += 1
        self._ensure_reserve()
        return {"freed": freed, "blobs_removed": blobs_removed, "packs_removed": packs_removed,
                "packs_rewritten": rewritten, "orphans_removed": orphans, "refs_repaired": repaired,
                "warnings": warnings, "damaged": damaged}
