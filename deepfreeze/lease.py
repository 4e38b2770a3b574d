"""Run identity, versions, generations, jobs and the lease on a checkpoint name (layer L1;
framework-neutral). The :class:`~deepfreeze.run.Run` that uses them is in :mod:`deepfreeze.run`.

* A **run** is one writer of a name: one :class:`~deepfreeze.keras.DeepFreezeCheckpoint`
  instance (or one framework-neutral job) from its first ``begin`` to ``close()`` or process
  exit. Its id (:func:`new_run_id`, 16 hex digits) is made on rank 0 and shared with every
  rank; it is written into every shard header, scratch manifest, done marker and decision,
  so the commit protocol (:mod:`deepfreeze.tiers.persistent`) never combines pieces of two runs. A
  resumed run gets a new id and records the step it resumed from.
* A **version** is :class:`Version` ``(generation, step)``. The generation of a name is kept
  in ``<persistent>/<name>/generation`` (absent = 0) and grows by one with every
  ``overwrite``; one atomic rename retires every version of the old generation at once
  (readers only accept manifests of the current generation). Within a generation steps only
  grow; ``version=`` arguments of the API mean the step in the current generation.
* The **lease** ``<persistent>/<name>/lease`` names the live run that may commit versions of
  the name (host, pid, run id). It is created exclusively, renewed by a heartbeat thread of
  rank 0 every ``lease_timeout / 3`` seconds (the file's mtime is the heartbeat, touched through a
  descriptor whose content is checked), released at ``close()`` by marking it released (a
  tombstone naming the run, taken over at once by the next run), and is also the fencing token: every flush and finalize compares its run id with the lease's under the
  version's ``commit.lock`` and abandons the work of any other run. A holder is *stale* when
  its heartbeat is older than ``lease_timeout`` by the file system's clock (:func:`fs_now`),
  or at once when its process is provably gone: the lease records the holder's
  :func:`~deepfreeze.node.process_identity` (pid, boot id, PID-namespace inode, start time), and
  only a holder of this boot and PID namespace whose pid is free, a zombie or reused counts
  (:func:`~deepfreeze.node.holder_gone`). A lease of an older DeepFreeze (no such fields), or of
  another PID namespace, waits for its heartbeat to go stale; one with this process's node id
  but another boot or PID namespace is a :class:`~deepfreeze.errors.NodeIdConflictError`.

Lease takeover (a stale or released holder): the lease is renamed aside (only one renamer can
succeed), the moved file is checked to be the one judged stale (else it is put back), then removed,
and the new holder creates the lease exclusively. A holder whose heartbeat finds the lease
no longer its own has lost it: its later flushes are fenced off, and it reports that once.

* A **job** is every run of a name in one persistent directory: its id (:func:`new_job_id`, 32
  hex digits) is made once, by the name's first run (:func:`job_id`), and kept in
  ``<persistent>/<name>/job`` beside the lease and the generation. It is created race-free
  (written whole under a temporary name, then ``link``ed into place: of concurrent creators
  one wins and every other reads the winner's id; a reader never sees a partial file) and
  never changes (``overwrite`` keeps it; removing the name's directory starts a new job). It
  tells apart jobs that share a name on one node's memory-tier device (:mod:`deepfreeze.memtier`):
  every region there records it, and restore, ``ls``, ``verify`` and ``resume`` only consider
  regions of their own job (matched on the id, never on paths, which differ between nodes).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import threading
import time
from typing import Any, Callable

from . import counters
from . import crashpoints as cp
from . import node as _node
from . import ownership
from .errors import CorruptCheckpointError, DeepFreezeError, LeaseHeldError, NodeIdConflictError
from .fsafe import read_small
from .jsonsafe import loads as bounded_loads

__all__ = ["Version", "RunInfo", "new_run_id", "new_job_id", "job_id", "read_job_id", "job_id_at",
           "read_job_id_at", "valid_job_id", "JOB", "fs_now", "read_generation", "write_generation", "Lease", "read_lease",
           "fence_holder", "describe_holder", "warn_skew", "GENERATION", "LEASE"]

log = logging.getLogger("deepfreeze")
GENERATION = "generation"
LEASE = "lease"
JOB = "job"
_MAX_LEASE_BYTES = 4096


@dataclasses.dataclass(frozen=True, order=True)
class Version:
    """A version of a name: the generation (grows with every ``overwrite``) and the step."""

    generation: int
    step: int

    def __str__(self) -> str:
        return f"v{self.step}" if self.generation == 0 else f"g{self.generation}/v{self.step}"


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What every manifest records of the run that wrote it."""

    id: str
    generation: int = 0
    resumed_from: int | None = None
    #: the job's id (``<persistent>/<name>/job``); None for work without one (not in manifests)
    job: str | None = dataclasses.field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "generation": self.generation, "resumed_from": self.resumed_from}


def new_run_id() -> str:
    """A fresh run id: 16 random hex digits."""
    return secrets.token_hex(8)


def new_job_id() -> str:
    """A fresh job id: 32 random hex digits."""
    return secrets.token_hex(16)


def valid_job_id(job: Any) -> bool:
    """Is ``job`` a job id (32 lowercase hex digits)?"""
    return isinstance(job, str) and len(job) == 32 and all(c in "0123456789abcdef" for c in job)


def read_job_id_at(path: str) -> str | None:
    """The job id kept in the file ``path``; None when there is no such file.
    :class:`CorruptCheckpointError` when it holds something else (it is never replaced silently).
    The file must be the user's own (:func:`deepfreeze.ownership.open_trusted`: a regular file,
    no link; another user's is an :class:`~deepfreeze.errors.UnsafePathError` naming its owner:
    one who planted the same id in two programs' job files would make them restore each other's
    models)."""
    try:
        fd = ownership.open_trusted(path, os.O_RDONLY, kind="job id file")
    except FileNotFoundError:
        return None
    except DeepFreezeError:
        raise
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot read the job id: {e}") from e
    try:
        data = os.read(fd, 129)
    finally:
        os.close(fd)
    if len(data) > 128:
        raise CorruptCheckpointError(f"{path} is larger than 128 bytes: not a job id file")
    text = data.decode("ascii", "replace").strip()
    if not valid_job_id(text):
        raise CorruptCheckpointError(f"{path}: {text[:40]!r} is not a job id (32 hex digits): the file is damaged. "
                                     "Restore it from a backup, or remove it to start a new job (the memory tier's "
                                     "versions of the old id are then no longer restored)")
    return text


def job_id_at(path: str) -> str:
    """The job id kept in the file ``path``, created now (race-free: written whole under a
    temporary name, fsynced, then linked into place; a concurrent creator that loses the link
    reads the winner's id) when there is none. The directory must exist."""
    got = read_job_id_at(path)
    if got is not None:
        return got
    job = new_job_id()
    try:
        ownership.create_whole(path, f"{job}\n".encode(), fsync_point="run.job.fsync", link_point="run.job.link")
    except FileExistsError:
        got = read_job_id_at(path)
        if got is None:  # pragma: no cover - linked, then removed at once by someone else
            raise CorruptCheckpointError(f"{path}: the job id appeared and vanished: retry") from None
        return got
    return job


def read_job_id(persistent: str, name: str) -> str | None:
    """The id of the job of ``name`` in ``persistent`` (``<persistent>/<name>/job``), or None when
    no run of the name has made one yet (see the module docstring)."""
    return read_job_id_at(os.path.join(persistent, name, JOB))


def job_id(persistent: str, name: str) -> str:
    """The id of the job of ``name`` in ``persistent``, made now when this is its first run."""
    return job_id_at(os.path.join(persistent, name, JOB))


def _uniq() -> str:
    return f"{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(3)}"


_skew_warned = False


def fs_now(directory: str) -> float:
    """The file system's clock: the mtime of a file freshly created in ``directory``. On a
    shared file system every node sees the same clock this way, whatever its own says."""
    path = os.path.join(directory, f".clock.{_uniq()}")
    counters.fs("create", "run.clock.create")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        try:
            cp.unlink(path, "run.clock.unlink")
        except FileNotFoundError:
            pass


def warn_skew(what: str, ahead: float) -> None:
    """Log clock skew (a file's mtime ahead of the file system's now) once per process."""
    global _skew_warned
    if not _skew_warned:
        _skew_warned = True
        log.warning("deepfreeze: %s is %.0f s in the future by the file system's clock (another node's clock "
                    "is ahead?); treating it as due. Check the nodes' time synchronization (NTP).", what, ahead)


def _write_replace(path: str, data: bytes, point: str, *, fsync: bool = True) -> None:
    """Replace ``path`` by ``data`` atomically (crash points ``<point>.fsync``, ``<point>.rename``)."""
    tmp = f"{path}.tmp{_uniq()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.write(fd, data)
            if fsync:
                cp.fsync(fd, point + ".fsync")
        finally:
            os.close(fd)
        cp.replace(tmp, path, point + ".rename")
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_generation(persistent: str, name: str) -> int:
    """The current generation of ``name`` (0 when none was ever started by ``overwrite``)."""
    path = os.path.join(persistent, name, GENERATION)
    counters.fs("open", "run.generation.read")
    try:
        data = read_small(path, 32)
    except FileNotFoundError:
        return 0
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot read the generation of {name!r}: {e}") from e
    text = data.decode("ascii", "replace").strip()
    if not text.isdigit() or len(text) > 18:
        raise CorruptCheckpointError(f"{path}: {text[:40]!r} is not a generation number; restore it or "
                                     "remove it (generation 0)")
    return int(text)


def write_generation(persistent: str, name: str, generation: int) -> None:
    """Make ``generation`` current (atomic: every older version is retired at this rename)."""
    d = os.path.join(persistent, name)
    _write_replace(os.path.join(d, GENERATION), f"{generation}\n".encode(), "run.generation")
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        cp.fsync(fd, "run.generation.dirsync")
    finally:
        os.close(fd)


def read_lease(persistent: str, name: str) -> tuple[dict[str, Any], float] | None:
    """(holder, mtime) of the lease on ``name``, or None when nobody holds it. A damaged
    lease file is reported as a holder named ``?`` (it is never silently ignored)."""
    path = os.path.join(persistent, name, LEASE)
    counters.fs("open", "run.lease.read")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        data = os.read(fd, _MAX_LEASE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        holder = bounded_loads(data, "lease", max_bytes=_MAX_LEASE_BYTES)
        if not isinstance(holder, dict) or not isinstance(holder.get("run"), str):
            raise ValueError("not a lease")
    except (ValueError, UnicodeDecodeError):
        holder = {"run": "?", "host": "?", "pid": 0, "seq": -1}
    return holder, st.st_mtime


def fence_holder(persistent: str, name: str, run: str) -> dict[str, Any] | None:
    """The lease (holder or tombstone) on ``name`` if it names a run other than ``run``: that
    run's work must be abandoned. None when ``run`` holds (or last held) it, or when the name has
    no lease file at all (work without a lease: a run without persistent, an engine without a run).
    A released lease stays as a tombstone, so a run that lost the lease never passes again."""
    got = read_lease(persistent, name)
    if got is None or got[0].get("run") == run:
        return None
    return got[0]


def describe_holder(h: dict[str, Any]) -> str:
    return (f"host {h.get('host')}, pid {h.get('pid')}, run {h.get('run')}"
            + (" (released)" if h.get("released") else ""))


class Lease:
    """The lease on ``<persistent>/<name>`` held by one run (rank 0 of it)."""

    def __init__(self, persistent: str, name: str, run: str, *, timeout: float) -> None:
        self.dir = os.path.join(persistent, name)
        self.path = os.path.join(self.dir, LEASE)
        self.name, self.run, self.timeout = name, run, float(timeout)
        self.seq = 0
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _content(self) -> bytes:
        return json.dumps({"run": self.run, "host": _node.host_name(), "node": _node.node_id(),
                           **_node.process_identity(), "seq": self.seq, "timeout": self.timeout}).encode()

    def _create(self) -> bool:
        tmp = f"{self.path}.tmp{_uniq()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.write(fd, self._content())
                cp.fsync(fd, "run.lease.fsync")
            finally:
                os.close(fd)
            try:
                cp.link(tmp, self.path, "run.lease.link")
                return True
            except FileExistsError:
                return False
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def acquire(self, *, wait: float = 0.0, resume: bool = False,
                sleep: Callable[[float], None] = time.sleep) -> None:
        """Take the lease, or raise :class:`LeaseHeldError` naming the live holder.

        A holder whose process is provably gone (:func:`~deepfreeze.node.holder_gone`: this boot
        and PID namespace) is replaced at once; a holder whose heartbeat is older than the timeout
        (file-system clock) is replaced; ``resume`` waits up to the timeout for a holder outside
        this PID namespace whose heartbeat stopped; ``wait`` seconds are granted to a live holder
        to go away. A live holder with this node id in another boot or PID namespace is a
        :class:`~deepfreeze.errors.NodeIdConflictError` (a :class:`LeaseHeldError`)."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        start = time.monotonic()
        said_waiting = False
        seen: dict[str, Any] | None = None
        seen_mtime = 0.0
        while True:
            if self._create():
                break
            got = read_lease(os.path.dirname(self.dir), self.name)
            if got is None:
                continue  # released meanwhile
            holder, mtime = got
            if holder.get("run") == self.run and not holder.get("released"):
                break
            if holder.get("released"):  # its run ended with close(): free
                self._take_over(holder)
                continue
            here = _node.in_this_pid_space(holder)  # its pid can be checked here
            pid = holder.get("pid")
            now = fs_now(self.dir)
            age = now - mtime
            if age < 0:
                warn_skew(f"the lease heartbeat {self.path}", -age)
            if _node.holder_gone(holder):
                log.warning("deepfreeze: %r was held by process %d in this PID namespace of this node, which is "
                            "gone: taking over its lease (run %s)", self.name, pid, holder.get("run"))
                self._take_over(holder)
                continue
            if age > self.timeout:
                log.warning("deepfreeze: the lease on %r of %s has had no heartbeat for %.0f s (lease_timeout = "
                            "%g s): taking it over", self.name, describe_holder(holder), age, self.timeout)
                self._take_over(holder)
                continue
            waited = time.monotonic() - start
            heartbeat_moved = seen is not None and (seen.get("seq") != holder.get("seq") or seen_mtime != mtime)
            seen, seen_mtime = holder, mtime
            if resume and not here and not heartbeat_moved and waited < self.timeout + 1:
                if not said_waiting:
                    said_waiting = True
                    log.warning("deepfreeze: resume: %r is leased by %s, last heartbeat %.0f s ago; waiting up to "
                                "%g s (lease_timeout) for it to go stale", self.name, describe_holder(holder), age,
                                self.timeout)
                sleep(min(1.0, max(0.05, self.timeout / 10)))
                continue
            if waited < wait:
                sleep(min(1.0, wait - waited))
                continue
            mine = here and pid == os.getpid()
            if _node.shares_node_id(holder):
                raise NodeIdConflictError(
                    f"checkpoint name {self.name!r} is leased by a live run with this process's node id "
                    f"{_node.node_id()!r} but in another PID namespace or kernel boot ({describe_holder(holder)}, "
                    f"last heartbeat {max(0.0, age):.0f} s ago; lease {self.path}): two jobs use one node id, so "
                    f"its pid cannot be checked here and it is only taken over once its heartbeat is older than "
                    f"lease_timeout. The node id must be unique per node: give each PID namespace or container "
                    f"its own {_node.NODE_ENV} (or unset it where host name and boot id tell nodes apart); and "
                    "two jobs must not write one name")
            raise LeaseHeldError(
                f"checkpoint name {self.name!r} is in use by a live run ({describe_holder(holder)}, last heartbeat "
                f"{max(0.0, age):.0f} s ago; lease {self.path}): two jobs must not write one name. "
                + ("That run is in this process: call close() on the earlier DeepFreezeCheckpoint of this name "
                   "first (a run lasts until close())." if mine else
                   "Wait for it to end, pass lease_wait=<seconds>, or use another name"))
        self.seq = 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name=f"deepfreeze-lease-{self.name}", daemon=True)
        self._thread.start()

    def _take_over(self, judged: dict[str, Any]) -> None:
        """Move the stale lease aside (one mover wins) and remove it. If what was moved is not
        the lease judged stale (another taker already replaced it), it is put back (the caller
        then finds that live holder)."""
        aside = f"{self.path}.taken.{_uniq()}"
        try:
            cp.rename(self.path, aside, "run.lease.takeover")
        except FileNotFoundError:
            return
        try:
            moved = bounded_loads(read_small(aside, _MAX_LEASE_BYTES), aside, max_bytes=_MAX_LEASE_BYTES, kind=dict)
        except (OSError, ValueError, DeepFreezeError):
            moved = {"run": "?", "seq": -1}
        if moved.get("run") != judged.get("run") or bool(moved.get("released")) != bool(judged.get("released")):
            try:  # not the lease judged stale (another taker already replaced it): put it back
                cp.link(aside, self.path, "run.lease.putback")
            except FileExistsError:
                pass
        try:
            cp.unlink(aside, "run.lease.unlink")
        except FileNotFoundError:
            pass

    def _heartbeat(self) -> None:
        period = max(0.05, self.timeout / 3)
        while not self._stop.wait(period):
            try:
                self.renew()
            except Exception as e:  # reported through self.lost / logged; never kills the thread silently
                log.warning("deepfreeze: lease heartbeat of %r failed: %s", self.name, e)

    def renew(self) -> None:
        """One heartbeat: touch the lease's mtime through a descriptor whose content is checked to
        be this run's (a lease replaced meanwhile is another inode: touching this one is harmless);
        otherwise record that the lease was lost."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None
        holder = None
        if fd is not None:
            try:
                try:
                    holder = bounded_loads(os.read(fd, _MAX_LEASE_BYTES + 1), "lease", max_bytes=_MAX_LEASE_BYTES)
                except (ValueError, UnicodeDecodeError):
                    holder = None
                if isinstance(holder, dict) and holder.get("run") == self.run and not holder.get("released"):
                    os.utime(fd)
                    return
            finally:
                os.close(fd)
        if self.lost is None:
            self.lost = (f"the lease on {self.name!r} was taken over by "
                         f"{describe_holder(holder) if isinstance(holder, dict) else 'nobody (removed)'}: this "
                         "run's later versions are not committed on persistent")
            log.error("deepfreeze: %s", self.lost)

    def release(self) -> None:
        """Stop the heartbeat and, if the lease is still ours, mark it released: a tombstone naming
        this run, not a removal, so a run that lost the lease can never pass the fence once the
        name is free (:func:`fence_holder`); the next run takes a released lease over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        try:
            got = read_lease(os.path.dirname(self.dir), self.name)
            if got is not None and got[0].get("run") == self.run and not got[0].get("released"):
                content = json.loads(self._content())
                content["released"] = True
                _write_replace(self.path, json.dumps(content).encode(), "run.lease.release", fsync=False)
        except FileNotFoundError:
            pass
        except OSError as e:  # the directory went away or broke: nothing to release there
            log.warning("deepfreeze: could not release the lease %s: %s", self.path, e)
