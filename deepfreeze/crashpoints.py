"""Named crash points: every file-system operation the commit protocol depends on.

Every ``os.replace``, ``os.rename``, ``os.link``, ``os.fsync``, ``os.unlink`` and
``os.rmdir`` in the modules that write checkpoints (levels, engine, backend, redundancy,
run) goes through one function of this module that takes a *point name*. In normal runs
the name costs one set lookup. For the crash-point tests the environment variable
``DEEPFREEZE_CRASH_AT=<point>:<n>`` makes the process kill itself (SIGKILL, no cleanup,
like ``kill -9`` or a node failure) right *before* the n-th operation at that point, and
``DEEPFREEZE_CRASH_ONCE=<file>`` limits that to the first process that gets there (a
restarted backend then runs through), and ``DEEPFREEZE_CRASH_TRACE=<file>`` appends every point passed to a file, so a test can
first run a job to learn which points it passes and how often, then kill it at each.
Each operation is also counted as ``fs.<op>:<point>`` when :mod:`deepfreeze.counters` is on.

:data:`POINTS` lists every point with what is on disk when a crash happens there; a test
checks that every call site uses a registered name and that every name is covered.
"""
from __future__ import annotations

import os
import signal
import threading

from . import counters

__all__ = ["POINTS", "PERIPHERAL", "MEMTIER", "RACE_ONLY", "replace", "rename", "link", "fsync", "unlink", "rmdir", "hit"]

#: point name -> the state a crash right before the operation leaves behind
POINTS: dict[str, str] = {
    # scratch level (tiers.scratch.ScratchLevel, redundancy)
    "scratch.shard.rename": "a rank's shard complete under its temporary name, not yet published",
    "scratch.manifest.rename": "a rank's shard published, its copy of the scratch manifest not yet",
    "scratch.partner.rename": "a partner copy received, not yet published (redundancy)",
    "scratch.parity.rename": "a parity block computed, not yet published (redundancy)",
    "scratch.retain.unlink": "retention: some of this rank's files of an old version removed",
    "scratch.retain.manifest": "retention: every shard of an old version gone, its manifest not yet",
    "scratch.retain.rmdir": "retention: an old version directory empty, not yet removed",
    "scratch.clear.unlink": "a resumed run removing this rank's files of versions above its resume point",
    "tmp.cleanup": "a failed write removing its temporary file",
    # persistent level (tiers.persistent.PersistentLevel): decision, partial, markers, finalize, retire
    "persistent.decision.link": "the version's decision and nonce about to be created (under commit.lock)",
    "persistent.partial.fsync": "this rank's pieces copied into model.dfz.partial.<nonce>, not fsynced",
    "persistent.direct.write": "write_once: a rank's writer thread writing its pieces from memory straight into "
                               "model.dfz.partial.<nonce>: the first written, the others not, nothing fsynced",
    "persistent.direct.fsync": "write_once: this rank's pieces written into model.dfz.partial.<nonce> by its writer "
                               "(no scratch file), not fsynced, no done marker",
    "persistent.marker.fsync": "the done marker written under its temporary name, not fsynced",
    "persistent.marker.rename": "this rank's pieces durable in the partial, its done marker not yet published",
    "persistent.marker.dirsync": "the done marker renamed, its directory not fsynced",
    "persistent.lock.link": "about to take commit.lock of the version",
    "persistent.lock.break": "a stale commit.lock (dead or silent holder) about to be moved aside",
    "persistent.lock.putback": "a lock moved aside that was not the stale one, about to be put back (a race of two breakers)",
    "persistent.lock.unlink": "commit.lock about to be released",
    "persistent.final.fsync": "header and index written into the partial, not fsynced",
    "persistent.final.rename": "the partial complete and durable, not yet renamed to model.dfz",
    "persistent.manifest.fsync": "model.dfz in place, the manifest written under a temporary name",
    "persistent.manifest.rename": "model.dfz in place, the manifest not yet published (not committed)",
    "persistent.manifest.dirsync": "the manifest renamed (committed), the directory not fsynced",
    "persistent.cleanup.unlink": "committed; the done markers being removed",
    "persistent.retire.manifest": "retiring a version: its manifest (the commit) about to be removed",
    "persistent.retire.dirsync": "retiring a version: uncommitted, not yet durable",
    "persistent.retire.unlink": "retiring a version: uncommitted, its files being removed",
    "persistent.retire.rmdir": "retiring a version: its directory empty, not yet removed",
    # run identity, generation, lease (run.py)
    "run.generation.fsync": "overwrite: the new generation being written under a temporary name",
    "run.generation.rename": "overwrite: the new generation durable under a temporary name, not yet current",
    "run.generation.dirsync": "overwrite: the new generation current, its directory not fsynced",
    "run.lease.fsync": "a new lease written under a temporary name",
    "run.lease.link": "a lease about to be created",
    "run.lease.takeover": "a stale lease about to be moved aside by a new holder",
    "run.lease.putback": "a lease moved aside that was not the stale one, about to be put back (a race of two takers)",
    "run.lease.release.rename": "the lease about to be marked released (a tombstone naming the run)",
    "run.lease.unlink": "a lease about to be released, or a moved-aside lease removed",
    "run.job.fsync": "a name's first run: its job id being written under a temporary name",
    "run.job.link": "a name's first run: its job id durable under a temporary name, about to be linked into place",
    "backend.lock.unlink": "a backend at exit removing a stale start-lock file (no socket, nobody holds it)",
    "run.clock.unlink": "the file that gave the file system's clock about to be removed",
    # backend (backend.py)
    "backend.socket.unlink": "the backend removing a stale socket, or its own at exit",
    # memory tier (deepfreeze/memtier/device.py; the slot and table commit protocols documented there)
    "memtier.slot.active": "a slot about to be marked ACTIVE: it still holds its previous state",
    "memtier.slot.data": "a slot ACTIVE, its image (data, header, manifest) about to be written: a torn image",
    "memtier.slot.done": "a slot's image written and flushed, its header not yet DONE (still ACTIVE)",
    "memtier.table.valid": "a model-table entry and its index written (WRITING), the entry not yet VALID",
    # outside the commit protocol: exports and VeloC's INI file (registered, covered elsewhere)
    "export.rename": "an export complete under its temporary name",
    "veloc.config.rename": "VeloC's INI file written under its temporary name",
    "stream.endpoint.rename": "a stream producer rank's endpoint file written under its temporary name",
}

#: the memory tier's points: killed at by its own tests (tests/test_memtier_*.py), not by the file-level suite
MEMTIER = {"memtier.slot.active", "memtier.slot.data", "memtier.slot.done", "memtier.table.valid"}
#: points outside the file-level checkpoint commit protocol (not part of its kill suite)
PERIPHERAL = {"export.rename", "veloc.config.rename", "stream.endpoint.rename", "backend.lock.unlink"} | MEMTIER
#: points only a race of two processes reaches (tested by their own race tests, not by a kill of one job)
RACE_ONLY = {"persistent.lock.putback", "run.lease.putback"}

_lock = threading.Lock()
_counts: dict[str, int] = {}
_armed: tuple[str, int] | None = None
_trace: str | None = None


def _configure() -> None:
    global _armed, _trace
    spec = os.environ.get("DEEPFREEZE_CRASH_AT", "")
    if spec:
        point, _, n = spec.rpartition(":")
        if point not in POINTS or not n.isdigit():
            raise ValueError(f"DEEPFREEZE_CRASH_AT={spec!r}: expected <point>:<n> with a point of "
                             "deepfreeze.crashpoints.POINTS")
        _armed = (point, int(n))
    _trace = os.environ.get("DEEPFREEZE_CRASH_TRACE") or None


_configure()


def _first_crash() -> bool:
    """With ``DEEPFREEZE_CRASH_ONCE=<file>``, only the first process to get here crashes (it
    creates the file), so a restarted process (a new backend) runs through."""
    once = os.environ.get("DEEPFREEZE_CRASH_ONCE")
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return True
    except FileExistsError:
        return False


def hit(point: str) -> None:
    """Pass crash point ``point`` (kill the process here if the test armed it). Under test
    (armed or tracing) an unregistered name is an error; otherwise the call costs nothing."""
    if _armed is None and _trace is None:
        return
    if point not in POINTS:
        raise ValueError(f"unregistered crash point {point!r}: add it to deepfreeze.crashpoints.POINTS")
    with _lock:
        n = _counts[point] = _counts.get(point, 0) + 1
        if _trace is not None:
            fd = os.open(_trace, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, f"{point}\n".encode())
            finally:
                os.close(fd)
        if _armed is not None and _armed == (point, n) and _first_crash():
            os.kill(os.getpid(), signal.SIGKILL)


def replace(src: str, dst: str, point: str, *, src_dir_fd: int | None = None,
            dst_dir_fd: int | None = None) -> None:
    hit(point)
    counters.fs("replace", point)
    os.replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)


def rename(src: str, dst: str, point: str) -> None:
    hit(point)
    counters.fs("rename", point)
    os.rename(src, dst)


def link(src: str, dst: str, point: str) -> None:
    hit(point)
    counters.fs("link", point)
    os.link(src, dst)


def fsync(fd: int, point: str) -> None:
    hit(point)
    counters.fs("fsync", point)
    os.fsync(fd)


def unlink(path: str, point: str, *, dir_fd: int | None = None) -> None:
    hit(point)
    counters.fs("unlink", point)
    os.unlink(path, dir_fd=dir_fd)


def rmdir(path: str, point: str, *, dir_fd: int | None = None) -> None:
    hit(point)
    counters.fs("rmdir", point)
    os.rmdir(path, dir_fd=dir_fd)
