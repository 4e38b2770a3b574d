"""Long because: one IPC protocol, its server and client ends with the start election and status/stop.

The active backend: one process per node that flushes scratch to persistent.

Started automatically by the first rank on a node that finds none listening
(``flock`` on a lock file elects one starter), shared by every rank whose
``scratch`` is the same directory, and stopped cleanly: it exits once no client
is connected and its queue is empty for ``DEEPFREEZE_BACKEND_IDLE`` seconds
(default 5), or on ``stop``. It imports no TensorFlow, so it starts in well
under a second and stays small.

IPC: a Unix stream socket, owner-only (``0700`` directory, ``0600`` socket),
one JSON object per line in each direction. Both ends check the other's uid with ``SO_PEERCRED``
(:func:`deepfreeze.ownership.check_peer`): the backend closes a connection of another uid before
reading from it (``memtier_put`` makes it read a process's memory), and a client refuses a socket
served by another uid (:class:`~deepfreeze.errors.UntrustedOwnerError`). Same uid only: a root
backend serves root's ranks, not other users'. Requests::

    {"op": "hello", "protocol": 2}       -> {"ok": true, "pid": N, "protocol": 2}
    {"op": "flush", "job": {...}}        -> {"ok": true, "id": N}        (queued)
                                            or {"ok": false, "error": "..."} (a malformed job, or a
                                            connection whose hello named another protocol)
    {"op": "wait", "ids": [...], "timeout": s, "ack": [...]}
                                         -> as poll, when those jobs are done, or after ``timeout`` s
    {"op": "poll", "ids": [...], "wait": s, "need": n, "ack": [...]}
                                         -> {"ok": true, "done": [...], "errors": [...], "unknown": [...],
                                             "stalled": s}
                                            (once ``need`` of them (default all) are done, or after
                                            ``wait`` seconds (default 0, at most 30): never blocks longer)

The protocol's version, :data:`PROTOCOL` (3; 2 carried a write-once job's CRCs as a list of
``[tensor_id, start, crc]`` per piece and every job's whole manifest; 1 was the version before ``hello`` carried it, whose job was
an untyped dict), is part of the socket's name and of ``hello``: a client sends its own
and the backend answers with its own (an answer without one is protocol 1). A backend of another
version gets no flush job: the client closes the connection and, where it may start a backend (the
engine's), starts its own on the same path (as for an unresponsive one: the other process is left
running for the clients it has), else (``status``, ``stop``) raises
:class:`~deepfreeze.errors.BackendError` naming both versions. Versions coexist on a node by the
socket name: a backend of protocol 1 listens on ``backend-<key>.sock``, one of protocol N > 1 on
``backend-<key>-pN.sock``, each serving the clients of its version until idle. The backend, for
its part, refuses ``flush`` on a connection whose ``hello`` named another protocol (or none).

The flush job (``job``) is a :class:`~deepfreeze.tiers.job.FlushJob`'s :meth:`encode`, rebuilt
with :meth:`~deepfreeze.tiers.job.FlushJob.decode` as it comes off the socket: every field is
checked (type, range, length, no NUL in a path; of the manifest, the entries that differ from the
connection's last job: ``seen``), unknown and missing keys are refused, and a job that fails is
answered ``{"ok": false}`` (the connection stays). Its fields (``?``: optional)::

    name: str ([a-zA-Z0-9_.]{1,200}), version: int [0, 2**63), rank: int [0, 2**31),
    scratch, persistent: str (1..4096 chars, no NUL), persistent_interval: float (finite),
    keep_scratch, keep_persistent: int [0, 2**31), manifest: object (depth <= 32, <= 2**22 values),
    run?: str (16 hex digits), lease_timeout?: float (> 0), shared_group?: bool,
    watchdog_interval?: float (>= 0), t?: float (>= 0) | null, interval?: float (>= 0) | null,
    priority?: "low" | "normal", fsync?: bool,
    memtier?: {"device": abs path, "entry", "slot", "version", "run", "rank"} (a memory-tier slot) |
    direct?: {"nonce": str, "has_crc": bool, "crc32": str (base64 of the rank's piece CRCs, uint32
             little-endian, in plan order: deepfreeze.format.encode_crcs)} (written once),
    manifest_same?: [str] (the manifest's keys equal to the last job this connection accepted:
             taken from it, not sent; refused on a connection with none)

(the full table: :mod:`deepfreeze.tiers.job`). A job with neither ``memtier`` nor ``direct`` reads
the rank's scratch file.

A finished job's result stays until the client acknowledges it (``ack``: the ids of its previous
answer), so an answer lost to a timeout or a dropped connection is given again; an id the backend
does not know is reported ``unknown`` (the client turns it into an error: never "done, no error").
    {"op": "status"}                     -> {"ok": true, "pid": N, "pending": N, "clients": N, "jobs": N,
                                             "overdue": [watchdog messages], "memtier_waits": N,
                                             "priority": {"low_jobs": N, "urgent_jobs": N, "boosted": N,
                                                          "sections": N, "tids": {"low": N, "normal": N},
                                                          "low": true, "queued": N},
                                             "flusher": {"tid": N, "tids": [N, N], "job": id or null,
                                                         "stalled": s}}

``stalled``: seconds the flusher threads have made no progress (no job started or ended, their I/O
counters in ``/proc/self/task/<tid>/io`` unchanged) while jobs are pending; 0 when idle, null if
unknown. A thread stuck in uninterruptible I/O leaves the process answering: this tells.
    {"op": "stop"}                       -> {"ok": true}  (drains the queue, then exits)
    {"op": "memtier_put", "device": path, "entry": n, "name": s, "run": hex16, "rank": n,
     "generation": n, "version": n, "pid": n, "regions": [[address, length], ...],
     "manifest": {...}, "wait": s, "self_copy": false}
                                         -> {"ok": true, "slot": k, "bytes": n, "calls": n, "copy_s": s,
                                             "waited_s": s}
                                            or {"ok": false, "kind": "busy" | "permission" | "error",
                                                "error": "..."}

Memory tier (``memtier = PATH``, :mod:`deepfreeze.memtier`): ``memtier_put`` copies one version of a
rank's shard from the rank's memory (``process_vm_readv`` of ``pid``: the concatenation of
``regions`` is byte for byte the data region of the shard image) into a slot of the rank's
model-table ``entry`` on the device, in the connection's handler thread at normal priority (not
the flusher's low lane), with the per-piece CRCs computed as the bytes land, and answers once
the slot is DONE (the rank holds the buffers until then). Devices are opened once (again when an
entry registered later is asked for). The slot: never the newest DONE one, never one that a
queued or running flush job names (its ``memtier`` source), nor one being copied into; none free:
the request waits (counted in ``status``'s ``memtier_waits``) up to its ``wait`` seconds (at
most ``_MAX_SLOT_WAIT``), then answers ``busy`` (the rank waits for its flushes and asks again).
``kind`` ``permission``: the kernel refused the read (Yama ``ptrace_scope``): the rank copies by
itself and asks with ``self_copy``: the slot is then only chosen and reserved for it (until its
flush job or its next ``memtier_put`` of the entry), ``bytes``/``calls``/``copy_s`` are 0.

Jobs run one at a time, in arrival order, through :func:`deepfreeze.tiers.flush.flush_job` (the same
code sync mode runs in the client), each on one of two threads (:class:`deepfreeze.priority.Lanes`):
``deepfreeze-flusher`` (the low lane: nice +10 and I/O best-effort 7, set when it starts) or
``deepfreeze-flusher-urgent`` (the normal lane: the process's priority). A job takes the normal lane
when it would otherwise end later than half an interval after its call (its ``t``, the monotonic
time of the rank's checkpoint call, plus half its ``interval``, the time between that call and the
rank's previous one, less the last job's duration for it and each job ahead of it:
:mod:`deepfreeze.priority`),
when a client waits for it (a ``wait``, or a ``poll`` with ``wait`` > 0 and ``need`` jobs not
done: the oldest ``need`` pending ones; the rank's queue is full or it waits in ``wait()``), or
when its ``priority`` is ``normal`` (``background_priority = normal``). A job that becomes urgent
while running on the low lane has its thread's I/O priority raised at once (and its nice value
where the process may lower it). Whichever lane runs the job, the sections that hold the
version's ``commit.lock`` (the decision, the finalize; other nodes' flushes wait for them) run on
the normal lane (``flush_job(critical=...)``). Two threads because an unprivileged process cannot
lower a thread's nice value again. A failed job's error is reported to whoever waits for it.

Bounded waits: every socket operation has a timeout on both sides. A client
gives every request ``answer_timeout`` seconds (the engine: INI
``backend_timeout``) and raises :class:`~deepfreeze.errors.BackendUnresponsiveError`
when it passes (a stopped process, or one stuck in uninterruptible I/O on a
hung file system); a new client whose connection is accepted but not answered
starts a new backend on the same path (``serve`` unlinks and binds; the stuck
process is left alone and, should it wake up, never removes its successor's
socket). The server drops a client that stops reading its answers. The spawn
lock is taken with a timed ``LOCK_NB`` loop, so a hung holder delays a newcomer
by at most the start timeout. A backend that exits removes the start locks
(``backend-*.sock.lock``) of its runtime directory whose socket is gone and which
nobody holds (:func:`remove_stale_locks`: each locked before it is unlinked; a
client that locked a lock file checks it is still the one at the path). :func:`status` and :func:`stop` are what
``deepfreeze backend status|stop`` call: they answer within their timeouts.

Where and how it starts. The socket is
``<runtime>/deepfreeze-<uid>/backend-<sha1(realpath(scratch))[:16]>-p<PROTOCOL>.sock``, ``<runtime>`` being
``$DEEPFREEZE_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR``, else ``/tmp``; the directory must be the
user's with mode ``0700`` (else :class:`~deepfreeze.errors.BackendError`). A
:class:`BackendClient` (made by the engine in async mode) connects and says ``hello``; if
nothing listens it takes the ``flock`` on ``<socket>.lock``, checks again, and the first to get
the lock spawns ``python -m deepfreeze.backend --socket <path>`` in a new session (so it finishes
queued flushes after the ranks have exited), logging to ``<scratch>/.deepfreeze-backend.log``,
with the rank's environment but one OpenBLAS thread (``_spawn_environ``: it multiplies no
matrices, and numpy's OpenBLAS otherwise starts a thread per core when it is imported), and waits
up to 60 s for the socket. A holder that keeps the spawn lock for 60 s is logged with
its pid (from ``/proc/locks``) and the newcomer goes on without it. :func:`start_async` does all
this in a background thread and holds the connection (the backend stays up) until released:
:meth:`deepfreeze.run.Run.begin` calls it in async mode, so the client the engine makes at the
first checkpoint finds the backend running and no training step waits for a process to start.
Since backends are started from threads while the training thread may fork (DataLoader workers),
a fork waits for a ``Popen`` in progress and a forked child lets go of the start locks (see
``_FORK_GUARD``). The backend process keeps the
priority it was started with (the rank's); only its low flusher lane lowers itself, so the
connection threads (and the ``memtier_put`` copies in them) run at normal priority. The
engine itself uses ``flush``, ``poll`` and ``memtier_put``; a job's result is handed out until
acknowledged.

Watchdog (``watchdog_interval`` > 0, VeloC's semantics: report a client that stopped
checkpointing): every flush job carries the interval; the backend remembers, per client
connection, the time of its newest job, and the thread ``deepfreeze-watchdog`` checks every
0.5 s and, once per silence, logs an error (``watchdog: rank <r> of '<name>' sent no checkpoint
for <t>s ...``) and adds it to ``status``'s ``overdue`` list. A new job re-arms it; a closed
connection is no longer watched. It only reports.

Unresponsive backends, seen from each caller: the engine's retries and replacement are in
:mod:`deepfreeze.engine`'s docstring. ``wait(timeout=T)`` replaces a backend silent for
``backend_timeout`` only if at least 5 s are left (the new backend gets the rest, minus 1 s, to
start); otherwise the next call with time for it does. ``status(scratch, timeout=2)`` reports a
backend that accepts but does not answer as ``unresponsive``, with its pid (known from
``SO_PEERCRED`` even when it never answers) and kernel state (``T (stopped)``, ``D
(uninterruptible I/O wait)``); ``stop`` never signals it. Both also report this user's VeloC
daemon (:func:`deepfreeze.veloc_daemon.veloc_daemon_status`), and ``stop`` stops that daemon if
DeepFreeze started it and no DeepFreeze job uses it.

Socket details: ``connect`` also has the ``answer_timeout`` (it blocks once a stopped backend's
listen backlog is full); :class:`~deepfreeze.errors.BackendUnresponsiveError` carries the
backend's pid (from ``SO_PEERCRED``) and the inode of the socket file; a timed-out connection is
closed (a late answer would be read as the next request's). The server gives a client 30 s to
take each answer and drops one that stops reading; its wait for a client's next request is not
bounded (ranks checkpoint every few minutes).
(The flush job's own encoding and checks are :mod:`deepfreeze.tiers.job`'s.)
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

from . import counters
from . import crashpoints as cp
from . import ownership
from .errors import BackendError, BackendUnresponsiveError, CheckpointWriteError, UntrustedOwnerError
from .jsonsafe import loads as bounded_loads
from .tiers.flush import flush_job
from .tiers.job import FlushJob
from .tiers.memtier import SlotSource
from .tiers.scratch import ScratchLevel
from .node import process_state
from .priority import Lanes
from .ownership import runtime_dir  # noqa: F401  (re-exported: defined here before)

__all__ = ["PROTOCOL", "socket_path", "BackendClient", "BackendStart", "start_async", "serve", "main", "status", "stop",
           "remove_stale_locks",
           "DEFAULT_TIMEOUT",
           "LOG_EVERY"]

log = logging.getLogger("deepfreeze.backend")
#: the version of this protocol (the requests, their answers and the encoding of a
#: :class:`~deepfreeze.tiers.job.FlushJob`): exchanged in ``hello``, part of the socket's name. 1: before
#: ``hello`` carried it (the job an untyped dict); 2: the typed FlushJob; 3: write once's CRCs as one
#: record, a manifest's unchanged entries named (``manifest_same``), not sent again
PROTOCOL = 3
_MAX_LINE = 256 << 20
#: seconds a client waits for an answer by default (the engine uses INI ``backend_timeout``)
DEFAULT_TIMEOUT = 60.0
#: seconds between the log lines of a wait on an unresponsive backend
LOG_EVERY = 10.0
#: seconds the server gives a client to take an answer (a client that stops reading is dropped)
_SERVER_SEND_TIMEOUT = 30.0
#: longest server-side wait of one ``poll`` (the client's socket timeout covers it)
_MAX_POLL_WAIT = 30.0
#: longest server-side ``wait`` with a ``timeout``
_MAX_WAIT = 3600.0
#: longest wait of a ``memtier_put`` for a free slot before it answers ``busy``
_MAX_SLOT_WAIT = 30.0
#: most source regions one ``memtier_put`` may name
_MAX_REGIONS = 1 << 22


def socket_path(scratch: str, protocol: int = PROTOCOL) -> str:
    """The socket of the backend of protocol ``protocol`` serving the node whose scratch directory
    is ``scratch`` (protocol 1, before the version was part of the name: ``backend-<key>.sock``)."""
    key = hashlib.sha1(os.path.realpath(scratch).encode()).hexdigest()[:16]
    return os.path.join(runtime_dir(), f"backend-{key}.sock" if protocol == 1 else f"backend-{key}-p{protocol}.sock")


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic); raises ``TimeoutError`` once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


#: a message's JSON: compact, and no cycle check (messages are plain data this module builds): a
#: 3,001-tensor flush job encodes in 4.4 ms instead of 6.3, in 11 % fewer bytes (issue 45, item 2)
_ENCODE = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode


def _send(sock: socket.socket, obj: dict[str, Any], deadline: float | None = None) -> None:
    """Send one line; with ``deadline``, ``TimeoutError`` if the peer does not take it by then
    (without, the socket's own timeout applies)."""
    if deadline is not None:
        sock.settimeout(_left(deadline))
    sock.sendall(_ENCODE(obj).encode() + b"\n")


class _BadMessage(BackendError, ValueError):
    """A backend message that is not a JSON object within the limits (a ValueError, as the
    other protocol errors the connection handlers catch)."""


class _OtherProtocol(BackendError):
    """The backend on the socket answered ``hello`` with another protocol version: it gets no
    request of this client (``inode``: of its socket file, so a new backend replaces it)."""

    def __init__(self, message: str, inode: int | None) -> None:
        super().__init__(message)
        self.inode = inode


class _Lines:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def read(self, deadline: float | None = None) -> dict[str, Any] | None:
        """The next message; None if the peer closed. With ``deadline`` (monotonic),
        ``TimeoutError`` if no whole line came by then (a partial line stays buffered)."""
        while b"\n" not in self.buf:
            if deadline is not None:
                self.sock.settimeout(_left(deadline))
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                return None
            self.buf += chunk
            if len(self.buf) > _MAX_LINE:
                raise ValueError("message too long")
        line, self.buf = self.buf.split(b"\n", 1)
        obj = bounded_loads(line, "backend message", max_bytes=_MAX_LINE, error=_BadMessage, advice="refused")
        if not isinstance(obj, dict):
            raise ValueError("message is not an object")
        return obj


# ----------------------------------------------------------------------------- server

class _Server:
    def __init__(self, path: str, idle: float) -> None:
        self.path, self.idle = path, idle
        self.cond = threading.Condition()
        self.next_id = 0
        self.results: dict[int, str | None] = {}
        self.clients = 0
        self.last_activity = time.monotonic()
        self.stopping = False
        # watchdog_interval (VeloC semantics: report clients that stopped checkpointing):
        # connection -> {"who", "interval", "deadline", "fired"}
        self.watched: dict[int, dict] = {}
        self.overdue: list[str] = []
        # progress of the flusher (a thread stuck in uninterruptible I/O on a hung file system leaves
        # this process answering while its flushes never finish): the last time it started or ended
        # a job, or its I/O counters (/proc/self/task/<tid>/io) moved, while work was pending
        self.current: int | None = None
        self.progress_at = time.monotonic()
        self.io_readable = False
        self._io: bytes | None = None
        # memory tier (all under self.cond): opened devices, regions by (device, entry), slots named
        # by queued or running flush jobs (counts), slots being copied into, self-copy reservations
        self.devices: dict[str, Any] = {}
        self.regions: dict[tuple[str, int], Any] = {}
        self.busy: dict[tuple[str, int, int], int] = {}
        self.copying: set[tuple[str, int, int]] = set()
        self.reserved: dict[tuple[str, int], int] = {}
        self.prefaulted: set[tuple[str, int]] = set()
        self.memtier_waits = 0
        # the flush jobs: one at a time in arrival order, on the low or the normal lane (deepfreeze.priority)
        self.lanes = Lanes("deepfreeze-flusher", drain_at_exit=False)
        self.flusher_tid: int | None = self.lanes.tids.get("low", self.lanes.tids.get("normal"))

    def _busy(self) -> bool:  # under self.cond
        return any(v == "pending" for v in self.results.values())

    def stalled(self) -> float | None:
        """Seconds the flusher has made no progress while jobs are pending (0 when idle); None if
        its I/O counters cannot be read (progress is then unknown)."""
        if self._io is None:  # not sampled yet
            self._sample_io()
        with self.cond:
            if not self.io_readable:
                return None
            return round(time.monotonic() - self.progress_at, 1) if self._busy() else 0.0

    def _sample_io(self) -> None:
        try:  # both lanes' counters: a job runs on either
            io = b""
            for tid in sorted(self.lanes.tids.values()):
                with open(f"/proc/self/task/{tid}/io", "rb") as f:
                    io += f.read(4096)
        except OSError:
            self.io_readable = False
            return
        with self.cond:
            self.io_readable = True
            if io != self._io:
                self._io, self.progress_at = io, time.monotonic()

    def watchdog(self) -> None:
        """Log (once per silence) a client whose last checkpoint is older than its watchdog_interval;
        sample the flusher's progress."""
        while not self.stopping:
            time.sleep(0.5)
            self._sample_io()
            now = time.monotonic()
            with self.cond:
                for w in self.watched.values():
                    if not w["fired"] and now > w["deadline"]:
                        w["fired"] = True
                        msg = (f"watchdog: {w['who']} sent no checkpoint for {now - w['last']:.1f}s "
                               f"(watchdog_interval = {w['interval']:g}s): hung, or checkpointing less often")
                        log.error("%s", msg)
                        self.overdue.append(msg)

    def submit(self, jid: int, job: FlushJob) -> None:
        """Queue a flush job on the lanes: its deadline is its checkpoint call time ``t`` plus its
        ``interval`` (the rank's monotonic clock: one clock per node); ``priority`` ``normal``
        runs it at normal priority whatever its age."""
        self.lanes.submit(self.flush, jid, job, t=job.t, interval=job.interval, tag=jid,
                          urgent=job.priority == "normal")

    def flush(self, jid: int, job: FlushJob) -> None:
        """Run one flush job (on a lane) and record its result."""
        with self.cond:
            self.current, self.progress_at = jid, time.monotonic()
        err = None
        t0 = time.monotonic()
        try:
            res = flush_job(job, critical=self.lanes.run_normal)
            log.info("job %d: %s v%d rank %d %s in %.3fs", jid, job.name, job.version, job.rank,
                     "committed" if res["committed"] else "flushed" if res["flushed"] else "kept on scratch",
                     time.monotonic() - t0)
        except Exception as e:  # reported to the waiter; the backend keeps serving
            err = f"{type(e).__name__}: {e}"
            log.error("job %d (%s v%s rank %s) failed: %s", jid, job.name, job.version, job.rank, err)
        with self.cond:
            self.results[jid] = err
            self.current = None
            key = _slot_key(job)
            if key is not None:
                self.busy[key] -= 1
                if not self.busy[key]:
                    del self.busy[key]
            self.last_activity = self.progress_at = time.monotonic()
            self.cond.notify_all()

    def handle(self, conn: socket.socket) -> None:
        """Serve one client. Every send has a timeout (a client that stops reading is dropped);
        reads wait for the next request as long as the client stays connected (a rank
        checkpoints every few minutes), and no request blocks this thread without a bound
        unless the client asked for it (``wait`` without ``timeout``)."""
        with self.cond:
            self.clients += 1
        lines = _Lines(conn)
        protocol = None  # the client's, from its hello (1: a hello without it)
        seen: dict = {}  # the manifest parts this connection's last job had (FlushJob.decode's seen)
        last: dict | None = None  # the manifest of the last job accepted here (FlushJob.decode's last)
        try:
            while True:
                try:
                    req = lines.read()
                except TimeoutError:  # an idle client: keep it, unless we are stopping
                    if self.stopping:
                        return
                    continue
                if req is None:
                    return
                op = req.get("op")
                if op == "hello":
                    protocol = req.get("protocol", 1)
                    _send(conn, {"ok": True, "pid": os.getpid(), "protocol": PROTOCOL})
                elif op == "flush":
                    if protocol != PROTOCOL:  # a client of another version never has a job decoded here
                        _send(conn, {"ok": False, "error": f"this backend speaks protocol {PROTOCOL}, the client "
                                     f"{'sent no hello' if protocol is None else f'protocol {str(protocol)[:20]}'}"
                                     ": no flush job taken"})
                        continue
                    try:
                        job = FlushJob.decode(req.get("job"), seen=seen, last=last)
                    except CheckpointWriteError as e:  # refused; the connection stays
                        _send(conn, {"ok": False, "error": str(e)[:2000]})
                        continue
                    with self.cond:
                        if not self._busy():  # the flusher was idle: its progress is judged from now
                            self.progress_at = time.monotonic()
                        jid = self.next_id
                        self.next_id += 1
                        self.results[jid] = "pending"
                        interval = job.watchdog_interval
                        if interval > 0:
                            now = time.monotonic()
                            self.watched[id(conn)] = {
                                "who": f"rank {job.rank} of {job.name!r}", "interval": interval,
                                "deadline": now + interval, "last": now, "fired": False}
                        key = _slot_key(job)
                        if key is not None:  # the slot stays out of reach of new versions until flushed
                            self.busy[key] = self.busy.get(key, 0) + 1
                            if self.reserved.get(key[:2]) == key[2]:
                                del self.reserved[key[:2]]
                    self.submit(jid, job)
                    last = job.manifest
                    _send(conn, {"ok": True, "id": jid})
                elif op == "memtier_put":  # this thread runs at the process's (normal) priority
                    _send(conn, self.memtier_put(req))
                elif op in ("wait", "poll"):  # which of these jobs are done, their errors (waiting at most "wait" s)
                    ids = [int(i) for i in req.get("ids", [])]
                    if op == "wait":
                        need = len(ids)
                        limit = req.get("timeout")
                        wait = _MAX_WAIT if limit is None else min(_MAX_WAIT, max(0.0, float(limit)))
                    else:
                        need = min(len(ids), int(req.get("need", len(ids))))
                        wait = min(_MAX_POLL_WAIT, max(0.0, float(req.get("wait", 0))))
                    with self.cond:
                        # results are kept until the client acknowledges them in a later request: an
                        # answer lost to a timeout is given again, never read as "done, no error"
                        for i in req.get("ack", []):
                            if self.results.get(int(i), "pending") != "pending":
                                self.results.pop(int(i), None)
                        pending = sorted(i for i in ids if self.results.get(i) == "pending")
                        short = need - (len(ids) - len(pending))
                        if wait > 0 and short > 0:  # someone waits for the oldest of them: normal priority
                            self.lanes.hurry(pending[:short])
                        if wait > 0:
                            self.cond.wait_for(
                                lambda: sum(self.results.get(i) != "pending" for i in ids) >= need, wait)
                        done = [i for i in ids if i in self.results and self.results[i] != "pending"]
                        unknown = [i for i in ids if i not in self.results]
                        errors = [self.results[i] for i in done if self.results[i]]
                    _send(conn, {"ok": True, "done": done, "errors": errors, "unknown": unknown,
                                 "stalled": self.stalled()})
                elif op == "status":
                    with self.cond:
                        pending = sum(1 for v in self.results.values() if v == "pending")
                        msg = {"ok": True, "pid": os.getpid(), "pending": pending, "clients": self.clients,
                               "jobs": self.next_id, "overdue": list(self.overdue),
                               "memtier_waits": self.memtier_waits, "priority": self.lanes.snapshot(),
                               "flusher": {"tid": self.flusher_tid, "job": self.current,
                                           "tids": sorted(self.lanes.tids.values())}}
                    msg["flusher"]["stalled"] = self.stalled()
                    _send(conn, msg)  # not under the lock: a slow reader must not stall the flusher
                elif op == "stop":
                    self.stopping = True
                    _send(conn, {"ok": True})
                else:
                    _send(conn, {"ok": False, "error": f"unknown op {op!r}"})
        except TimeoutError:
            log.warning("client connection dropped: it took no answer for %gs", _SERVER_SEND_TIMEOUT)
        except (OSError, ValueError, KeyError, TypeError, OverflowError) as e:
            log.warning("client connection dropped: %s", e)
        finally:
            conn.close()
            with self.cond:
                self.watched.pop(id(conn), None)
                self.clients -= 1
                self.last_activity = time.monotonic()

    def _region(self, path: str, entry: int) -> Any:
        """The VALID model-table entry ``entry`` of the device ``path`` (opened once; its table is
        read again when the entry was registered after that). MemtierError if there is none."""
        from .tiers.memtier import open_device
        from .errors import MemtierError
        with self.cond:
            region = self.regions.get((path, entry))
            if region is not None:
                return region
            dev = self.devices.get(path)
            if dev is None:
                dev = self.devices[path] = open_device(path)
            else:
                dev.refresh()
            region = dev.region(entry)
            if region is not None:
                self.regions[(path, entry)] = region
                return region
        raise MemtierError(f"memory tier {path}: no valid model-table entry {entry} (retired, or not a device "
                           "this rank registered on)")

    def memtier_put(self, req: dict[str, Any]) -> dict[str, Any]:
        """Serve one ``memtier_put`` (see the module docstring); the answer, never an exception for
        a bad request or a failed copy (the connection stays up)."""
        from .errors import MemtierError, MemtierPermissionError
        from .tiers.memtier import remote_copier
        from .lease import Version
        try:
            path, entry = str(req["device"]), int(req["entry"])
            name, run, rank = str(req["name"]), str(req["run"]), int(req["rank"])
            version = Version(int(req["generation"]), int(req["version"]))
            self_copy = bool(req.get("self_copy", False))
            wait = min(_MAX_SLOT_WAIT, max(0.0, float(req.get("wait", 0))))
            regions = req.get("regions") or []
            if not isinstance(regions, list) or len(regions) > _MAX_REGIONS:
                raise ValueError(f"regions: a list of at most {_MAX_REGIONS} [address, length] pairs expected")
            regions = [(int(a), int(n)) for a, n in regions]
            if any(a < 0 or n < 0 for a, n in regions):
                raise ValueError("regions: negative address or length")
            manifest = req.get("manifest")
            if not self_copy and not isinstance(manifest, dict):
                raise ValueError("manifest: an object expected")
            pid = int(req.get("pid", 0))
            region = self._region(path, entry)
            if (region.name, region.run, region.rank) != (name, run, rank):
                raise MemtierError(f"memory tier {path} entry {entry} holds {region.name!r} run {region.run} rank "
                                   f"{region.rank}, not {name!r} run {run} rank {rank}")
        except MemtierError as e:
            return {"ok": False, "kind": "error", "error": str(e)}
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            return {"ok": False, "kind": "error", "error": f"malformed memtier_put request: {e}"}
        t0 = time.monotonic()
        waited = 0.0
        with self.cond:
            self.reserved.pop((path, entry), None)  # the rank's previous put is over: it sent this one
            while True:
                busy = {k for (p, e, k) in list(self.busy) + list(self.copying) if (p, e) == (path, entry)}
                k = region.choose_slot(busy)
                if k is not None:
                    break
                left = t0 + wait - time.monotonic()
                if waited == 0.0:
                    self.memtier_waits += 1
                if left <= 0:
                    return {"ok": False, "kind": "busy", "error": f"no free slot of {name!r} rank {rank} on {path} "
                            f"within {wait:g}s: every slot holds the newest version or one waiting for its "
                            f"flush ({sorted(busy)})", "waited_s": time.monotonic() - t0}
                self.cond.wait(min(left, 0.5))
                waited = time.monotonic() - t0
            if self_copy:
                self.reserved[(path, entry)] = k
                return {"ok": True, "slot": k, "bytes": 0, "calls": 0, "copy_s": 0.0, "waited_s": waited}
            self.copying.add((path, entry, k))
        try:
            with self.cond:
                first = (path, entry) not in self.prefaulted
                self.prefaulted.add((path, entry))
            if first:  # fault this process's mapping of the region in now, not during the timed copy
                region.prefault()
            c0 = time.monotonic()
            stats = region.put(k, version, remote_copier(pid), regions, manifest)
            copy_s = time.monotonic() - c0
            log.info("memtier: %s v%d rank %d -> slot %d of %s entry %d: %d bytes in %d calls, %.3fs", name,
                     version.step, rank, k, path, entry, stats.bytes, stats.calls, copy_s)
            return {"ok": True, "slot": k, "bytes": stats.bytes, "calls": stats.calls, "copy_s": copy_s,
                    "waited_s": waited}
        except MemtierPermissionError as e:
            return {"ok": False, "kind": "permission", "error": str(e)}
        except (MemtierError, OSError, ValueError, KeyError, TypeError) as e:
            log.error("memtier: %s v%s rank %s failed: %s: %s", name, version.step, rank, type(e).__name__, e)
            return {"ok": False, "kind": "error", "error": f"{type(e).__name__}: {e}"}
        finally:
            with self.cond:
                self.copying.discard((path, entry, k))
                self.cond.notify_all()

    def idle_now(self) -> bool:
        with self.cond:
            busy = self.clients > 0 or any(v == "pending" for v in self.results.values())
            if self.stopping:
                return not any(v == "pending" for v in self.results.values())
            return not busy and time.monotonic() - self.last_activity >= self.idle


def _slot_key(job: FlushJob) -> tuple[str, int, int] | None:
    """(device, entry, slot) of a flush job that reads a memory-tier slot, else None."""
    if job.source != SlotSource.kind:
        return None
    return job.spec.device, job.spec.entry, job.spec.slot


def serve(path: str, idle: float = 5.0) -> None:
    """Run a backend on ``path`` until idle or stopped."""
    srv = _Server(path, idle)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        try:  # a dead predecessor's socket file, or a hung one's: it keeps its listening socket, unreachable
            if os.path.lexists(path):
                cp.unlink(path, "backend.socket.unlink")
        except FileNotFoundError:
            pass
        sock.bind(path)
    finally:
        os.umask(old)
    inode = os.stat(path).st_ino
    sock.listen(64)
    sock.settimeout(0.2)
    threading.Thread(target=srv.watchdog, name="deepfreeze-watchdog", daemon=True).start()
    log.info("backend %d listening on %s", os.getpid(), path)
    try:
        while not srv.idle_now():
            try:
                conn, _ = sock.accept()
            except socket.timeout:
                continue
            try:  # a process of another user never gets a byte read or answered (deepfreeze.ownership)
                ownership.check_peer(conn, f"backend socket {path}")
            except UntrustedOwnerError as e:
                log.warning("refused a connection: %s", e)
                conn.close()
                continue
            conn.settimeout(_SERVER_SEND_TIMEOUT)  # sends; reads treat a timeout as "still idle"
            threading.Thread(target=srv.handle, args=(conn,), name="deepfreeze-backend-conn",
                             daemon=True).start()
    finally:
        srv.lanes.shutdown(wait=False)
        try:
            if os.stat(path).st_ino == inode:  # not a successor's socket
                cp.unlink(path, "backend.socket.unlink")
        except OSError:
            pass
        sock.close()
        remove_stale_locks(os.path.dirname(path))  # this backend's start lock, and any left by killed ones
        log.info("backend %d stopped", os.getpid())


# ----------------------------------------------------------------------------- client

def _socket_inode(path: str) -> int | None:
    try:
        return os.lstat(path).st_ino
    except OSError:
        return None


def _gone(pid: int | None) -> bool:
    state = process_state(pid)
    return state is None or state[0] in "ZX"


def _flock_holder(path: str) -> int | None:
    """Pid holding a ``flock`` on ``path`` (from /proc/locks), or None."""
    ino = _socket_inode(path)
    if ino is None:
        return None
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].rsplit(":", 1)[-1] == str(ino):
                    return int(parts[4])
    except (OSError, ValueError):
        pass
    return None


def _timed_flock(f: Any, path: str, timeout: float) -> bool:
    """``flock(LOCK_EX)`` on ``f`` within ``timeout`` seconds (``LOCK_NB`` polling, a log line every
    LOG_EVERY s); False, with a warning, if its holder kept it that long (a hung process: the
    caller goes on without it rather than wait forever)."""
    t0 = time.monotonic()
    next_log = LOG_EVERY
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        waited = time.monotonic() - t0
        if waited >= timeout:
            holder = _flock_holder(path)
            log.warning("deepfreeze: the backend start lock %s has been held for %.0fs%s (a hung process?): "
                        "going on without it", path, waited, f" by pid {holder}" if holder else "")
            return False
        if waited >= next_log:
            holder = _flock_holder(path)
            log.warning("deepfreeze: waiting %.0fs for the backend start lock %s%s", waited, path,
                        f" held by pid {holder}" if holder else "")
            next_log += LOG_EVERY
        time.sleep(0.05)


@contextlib.contextmanager
def _start_lock(lockpath: str, timeout: float) -> Iterator[None]:
    """Hold the backend start lock ``lockpath`` (:func:`_timed_flock`). A lock file removed by
    :func:`remove_stale_locks` between its open and the lock is opened again (the lock held must
    be the file at ``lockpath``, or two clients would each hold "the" lock)."""
    while True:
        with _FORK_GUARD:  # known to the fork handler from its first moment to its last (see _FORK_GUARD)
            fd = os.open(lockpath, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            _LOCK_FDS.add(fd)
        try:
            got = _timed_flock(fd, lockpath, timeout)
            try:
                same = os.lstat(lockpath).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same or not got:
                yield
                return
        finally:
            with _FORK_GUARD:
                _LOCK_FDS.discard(fd)
                os.close(fd)


# Forks. The backend is started from background threads (start_async, the engine's replacement of
# a dead backend on its writer lane) while the training thread may fork (a DataLoader's workers):
# * a child forked during ``subprocess.Popen`` would inherit the pipe on which Popen waits for its
#   child's exec, and Popen would wait until that child exits (a DataLoader worker: the epoch). Popen
#   runs under _FORK_GUARD, which ``os.fork`` (multiprocessing's fork) takes first: a fork waits for
#   the few milliseconds of a Popen, never the other way;
# * a ``flock`` belongs to the open file, which a forked child shares: a child forked while a thread
#   holds the start lock would keep it locked until that child exits (every other rank of the node
#   waiting for it). The child lets go of its copies of the start locks' descriptors (_LOCK_FDS).
_FORK_GUARD = threading.RLock()
_LOCK_FDS: set[int] = set()


def _close_lock_fds_in_child() -> None:
    if not _LOCK_FDS:
        return
    try:
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    for fd in list(_LOCK_FDS):  # the child's reference only (the parent's lock stays); /dev/null put in
        try:                    # its place, so the lock's file object, should it be closed, closes that
            os.dup2(null, fd, inheritable=False)
        except OSError:
            pass
    os.close(null)
    _LOCK_FDS.clear()


def _before_fork() -> None:
    _FORK_GUARD.acquire()


def _after_fork_in_parent() -> None:
    _FORK_GUARD.release()


def _after_fork_in_child() -> None:
    global _FORK_GUARD
    _FORK_GUARD = threading.RLock()  # (the parent's, held by the forking thread, is not this process's)
    _close_lock_fds_in_child()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def remove_stale_locks(directory: str | None = None) -> list[str]:
    """Remove the backend start locks (``backend-*.sock.lock``) of ``directory`` (default: this
    user's runtime directory) whose socket is gone and which nobody holds: each is locked
    (non-blocking) before it is unlinked, so a client starting a backend keeps its lock, and a
    client that opened one just before sees it removed (:func:`_start_lock`). Returns the names
    removed. A backend calls this as it exits."""
    directory = directory or runtime_dir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for n in names:
        if not (n.startswith("backend-") and n.endswith(".sock.lock")):
            continue
        path = os.path.join(directory, n)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.lexists(path[:-len(".lock")]) or os.lstat(path).st_ino != os.fstat(fd).st_ino:
                continue  # a backend listens (or is starting), or the file was replaced meanwhile
            cp.unlink(path, "backend.lock.unlink")
            removed.append(n)
        except OSError:  # held by a client starting a backend (BlockingIOError), or gone
            continue
        finally:
            os.close(fd)
    return removed


def _spawn_environ() -> dict[str, str]:
    """The environment a spawned backend gets: the rank's, with ``OPENBLAS_NUM_THREADS=1``. The
    backend copies, checks and writes bytes and never multiplies matrices; numpy's OpenBLAS would
    otherwise start one thread per core (and its buffers) when the backend imports numpy: 0.1 CPU-s
    of each start on the 2-core test machine, more on a wide node."""
    return dict(os.environ, OPENBLAS_NUM_THREADS="1")


class BackendClient:
    """A connection to the node's backend; starts one if none is listening.

    ``timeout``: seconds a backend started here may take to listen. ``answer_timeout``: seconds any
    request, and the ``hello`` of a new connection, may wait for the backend's answer before
    :class:`BackendUnresponsiveError` (the engine passes INI ``backend_timeout``). A backend that
    accepts but does not answer ``hello`` in time is treated as unresponsive: with ``start`` a new
    backend is started on the same socket path (logged; the old process is left alone), without
    it the error is raised. ``replace``: the socket inode of a backend already declared dead: it is
    not asked again; a new backend is started unless another client already did.
    """

    def __init__(self, scratch: str, *, start: bool = True, timeout: float = 60.0,
                 answer_timeout: float = DEFAULT_TIMEOUT, replace: int | None = None) -> None:
        self.path = socket_path(scratch)
        self.scratch = scratch
        self.answer_timeout = answer_timeout
        self._lock = threading.Lock()
        self._acks: list[int] = []  # done ids of the last answer, acknowledged with the next poll
        self._flush_lock = threading.Lock()
        self._sent: dict | None = None  # the manifest of the last job the backend accepted on this connection
        self.sock: socket.socket | None = None
        self.pid: int | None = None
        self.inode: int | None = None  # of the socket file this client connected through
        self.stalled: float | None = None  # the backend's flusher progress, from the last poll
        #: pid of the backend process this client started (None: it connected to one already listening)
        self.started: int | None = None
        dead = replace
        if dead is None or _socket_inode(self.path) != dead:
            try:
                self.sock = self._connect(answer_timeout)
            except BackendUnresponsiveError as e:
                if not start:
                    raise
                log.warning("deepfreeze: %s: treating it as unresponsive and starting a new backend on the same "
                            "socket (the old process is left running, not killed: it may be stuck in I/O)", e)
                dead = e.inode
            except _OtherProtocol as e:
                if not start:
                    raise
                log.warning("deepfreeze: %s: starting a backend of protocol %d on the same socket (the other process "
                            "is left running for the clients it has)", e, PROTOCOL)
                dead = e.inode
        if self.sock is None and start:
            self.sock = self._spawn(timeout, dead)
        if self.sock is None:
            raise BackendError(f"no DeepFreeze backend listens on {self.path} for scratch {scratch}")

    def _connect(self, answer_timeout: float) -> socket.socket | None:
        """A connection to a live backend of this :data:`PROTOCOL` that answered ``hello``; None if
        none listens (or it is dying); :class:`BackendUnresponsiveError` if one accepted but did not
        answer in time; :class:`_OtherProtocol` (a :class:`BackendError` naming both versions) if it
        speaks another protocol (an answer without one: protocol 1)."""
        inode = _socket_inode(self.path)
        deadline = time.monotonic() + answer_timeout
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(answer_timeout)  # connect blocks when a stopped backend's backlog is full
            s.connect(self.path)
        except TimeoutError as e:
            s.close()
            raise BackendUnresponsiveError(
                f"the DeepFreeze backend on {self.path} did not accept a connection within {answer_timeout:g}s",
                None, inode) from e
        except OSError:
            s.close()
            return None
        try:  # a backend of another user (a planted socket) never sees a request of ours
            pid = ownership.check_peer(s, f"backend socket {self.path}")
        except BaseException:
            s.close()
            raise
        lines = _Lines(s)
        t0, next_log = time.monotonic(), time.monotonic() + LOG_EVERY
        try:
            _send(s, {"op": "hello", "protocol": PROTOCOL}, deadline)
            while True:
                try:
                    resp = lines.read(min(deadline, next_log))
                    break
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        raise
                    log.warning("deepfreeze: backend pid %s on %s has not answered for %.0fs (hello; gives up "
                                "after %gs)", pid, self.path, time.monotonic() - t0, answer_timeout)
                    next_log += LOG_EVERY
            if not resp or not resp.get("ok") or not isinstance(resp.get("pid"), int):
                raise OSError("no hello")
            theirs = resp.get("protocol", 1)
            if theirs != PROTOCOL:
                raise _OtherProtocol(f"the DeepFreeze backend pid {resp['pid']} on {self.path} speaks protocol "
                                     f"{str(theirs)[:20]}, this client protocol {PROTOCOL} (another DeepFreeze "
                                     "version): it gets no flush job", inode)
        except TimeoutError as e:
            s.close()
            raise BackendUnresponsiveError(
                f"the DeepFreeze backend{'' if pid is None else f' pid {pid}'} on {self.path} accepted the "
                f"connection but did not answer within {answer_timeout:g}s"
                + ("" if pid is None else f" (process state: {process_state(pid) or 'gone'})"), pid, inode) from e
        except _OtherProtocol:
            s.close()
            raise
        except (OSError, ValueError):
            s.close()
            return None
        self._lines, self.pid, self.inode = lines, resp["pid"], inode
        return s

    def _spawn(self, timeout: float, dead: int | None) -> socket.socket:
        """Start a backend (one per node: under ``<socket>.lock``) unless another client did meanwhile.
        ``dead``: inode of a socket whose backend does not answer; never connected to again."""
        lockpath = self.path + ".lock"
        with _start_lock(lockpath, timeout):
            inode = _socket_inode(self.path)
            if inode is not None and inode != dead:  # started by another client while we waited
                try:
                    s = self._connect(self.answer_timeout)
                except (BackendUnresponsiveError, _OtherProtocol) as e:
                    log.warning("deepfreeze: %s: starting a new backend (the old process is left running)", e)
                    s, dead = None, e.inode
                if s is not None:
                    return s
            ScratchLevel(self.scratch).makedirs(self.scratch)
            logf = os.fdopen(ownership.open_private(os.path.join(self.scratch, ".deepfreeze-backend.log"),
                                                    os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab")  # no link, 0600
            with _FORK_GUARD:  # no os.fork in another thread during it (see _FORK_GUARD)
                proc = subprocess.Popen([sys.executable, "-m", "deepfreeze.backend", "--socket", self.path],
                                        stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                        start_new_session=True, close_fds=True, env=_spawn_environ())
            logf.close()
            self.started = proc.pid
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                inode = _socket_inode(self.path)
                if inode is not None and inode != dead:  # the hung one's socket is not asked again
                    try:
                        s = self._connect(max(0.5, min(self.answer_timeout, deadline - time.monotonic())))
                    except (BackendUnresponsiveError, _OtherProtocol):
                        s = None
                    if s is not None:
                        return s
                if proc.poll() is not None:
                    raise BackendError(f"the DeepFreeze backend exited with code {proc.returncode} at start; "
                                       f"see {self.scratch}/.deepfreeze-backend.log")
                time.sleep(0.02)
            proc.kill()  # ours, and it never answered
            raise BackendError(f"the DeepFreeze backend did not listen on {self.path} within {timeout}s; "
                               f"see {self.scratch}/.deepfreeze-backend.log")

    def request(self, obj: dict[str, Any], timeout: float | None = None, *, check: bool = True) -> dict[str, Any]:
        """Send ``obj``, return the answer. ``timeout``: seconds for the whole exchange (default
        ``answer_timeout``); past it :class:`BackendUnresponsiveError`, and this connection is
        closed (a late answer would be read as the next one's): make a new client. With ``check``,
        an answer ``{"ok": false}`` raises :class:`BackendError`; without, it is returned."""
        t = self.answer_timeout if timeout is None else timeout
        op = obj.get("op")
        with self._lock:
            if self.sock is None:
                raise BackendError(f"the connection to the DeepFreeze backend pid {self.pid} on {self.path} was "
                                   "closed after an earlier timeout; connect again")
            deadline = time.monotonic() + t
            try:
                _send(self.sock, obj, deadline)
                resp = self._lines.read(deadline)
            except TimeoutError as e:
                self._drop()
                raise BackendUnresponsiveError(
                    f"the DeepFreeze backend pid {self.pid} on {self.path} did not answer {op!r} within {t:g}s "
                    f"(process state: {process_state(self.pid) or 'gone'})", self.pid, self.inode) from e
            except (OSError, ValueError) as e:
                self._drop()
                raise BackendError(f"lost the DeepFreeze backend on {self.path} during {op!r}: {e}; "
                                   f"see {self.scratch}/.deepfreeze-backend.log") from e
            if resp is None:
                self._drop()
                raise BackendError(f"the DeepFreeze backend on {self.path} closed the connection during "
                                   f"{op!r}; see {self.scratch}/.deepfreeze-backend.log")
        if check and not resp.get("ok"):
            raise BackendError(f"backend refused {op!r}: {resp.get('error')}")
        return resp

    def memtier_put(self, req: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """One ``memtier_put`` (``req`` without ``op``); the answer, ``ok`` or not (see the module
        docstring)."""
        return self.request({"op": "memtier_put", **req}, timeout, check=False)

    def flush(self, job: FlushJob, timeout: float | None = None) -> int:
        """Queue ``job``; its id. The manifest's entries equal to those of the last job this
        connection had accepted are named, not sent (:meth:`FlushJob.encode`'s ``last``: a run's
        tensor list and plan go once per connection)."""
        with self._flush_lock:
            jid = self.request({"op": "flush", "job": job.encode(last=self._sent)}, timeout)["id"]
            self._sent = job.manifest  # accepted (a refusal raised): the backend's last one too
            return jid

    def poll(self, ids: list[int], wait: float = 0.0, need: int | None = None,
             timeout: float | None = None) -> tuple[list[int], list[str]]:
        """(done ids, their errors). With ``wait``, the backend answers once ``need`` (default all)
        of ``ids`` are done or ``wait`` seconds passed; ``timeout`` bounds the whole exchange
        (default ``wait`` + ``answer_timeout``)."""
        if not ids:
            return [], []
        req: dict[str, Any] = {"op": "poll", "ids": ids, "ack": self._acks}
        if wait > 0:
            req["wait"] = wait
            if need is not None:
                req["need"] = need
        r = self.request(req, wait + self.answer_timeout if timeout is None else timeout)
        unknown = [int(i) for i in r.get("unknown", [])]
        self._acks = [int(i) for i in r["done"]]  # acknowledged with the next request
        if unknown:  # never "done, no error" for a job this backend does not know
            r["done"] = list(r["done"]) + unknown
            r["errors"] = list(r["errors"]) + [
                f"flush job {i} is unknown to the backend pid {self.pid} (its result was lost): the version it "
                "flushed is not known to be committed" for i in unknown]
        stalled = r.get("stalled")
        self.stalled = float(stalled) if isinstance(stalled, (int, float)) else None
        return r["done"], r["errors"]

    def wait(self, ids: list[int], timeout: float | None = None) -> list[str]:
        """Errors of ``ids`` once all are done. Polls (each answer within ``answer_timeout``, else
        :class:`BackendUnresponsiveError`); with ``timeout``, :class:`BackendError` if not all
        are done by then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        left, errors = list(ids), []
        while left:
            w = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            done, errs = self.poll(left, wait=w)
            errors += errs
            left = [i for i in left if i not in set(done)]
            if left and deadline is not None and time.monotonic() >= deadline:
                raise BackendError(f"{len(left)} flush job(s) of backend pid {self.pid} not done within {timeout}s")
        return errors

    def _drop(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()


# ----------------------------------------------------------------------------- start in the background

class BackendStart:
    """The node's backend started or found by a background thread (:func:`start_async`).

    The thread ``deepfreeze-backend-start`` makes the scratch directory (as the engine does, with
    ``shared_group``) and a :class:`BackendClient`: the same checks and bounds as any client (the
    socket's owner by ``SO_PEERCRED``, the start lock, ``answer_timeout`` for an unresponsive
    backend, ``timeout`` for a new one to listen). It keeps that connection open until
    :meth:`release` (a backend exits once idle with no client connected), so the client the engine
    makes later finds the backend running and only connects. Nothing is raised: a failure is kept
    in :attr:`error`; the engine's own client meets it again and raises it where it always did."""

    def __init__(self, scratch: str, *, shared_group: bool = False, answer_timeout: float = DEFAULT_TIMEOUT,
                 timeout: float = 60.0) -> None:
        self.scratch = scratch
        #: the connection held until :meth:`release` (None before, after, or on failure)
        self.client: BackendClient | None = None
        #: pid of the backend found or started; pid of the one this start spawned (None: found one running)
        self.pid: int | None = None
        self.started: int | None = None
        #: why it failed (``"<class>: <message>"``), or None
        self.error: str | None = None
        #: threads in :meth:`wait` now
        self.waiting = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._released = False
        self.thread = threading.Thread(target=self._run, args=(shared_group, answer_timeout, timeout),
                                       name="deepfreeze-backend-start", daemon=True)
        self.thread.start()

    def _run(self, shared_group: bool, answer_timeout: float, timeout: float) -> None:
        client = None
        try:
            ScratchLevel(self.scratch, shared_group=shared_group).makedirs(self.scratch)
            client = BackendClient(self.scratch, timeout=timeout, answer_timeout=answer_timeout)
        except Exception as e:  # kept: the engine's own client raises it where it always did
            self.error = f"{type(e).__name__}: {e}"
            log.info("deepfreeze: starting the backend for scratch %s in the background failed (the engine "
                     "tries again): %s", self.scratch, self.error)
        with self._lock:
            if client is not None:
                self.pid, self.started = client.pid, client.started
                if self._released:
                    client.close()
                else:
                    self.client = client
            self._done.set()

    def done(self) -> bool:
        """Whether the thread has finished (the backend listens and answered, or it failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the thread to finish; whether it did."""
        with self._lock:
            self.waiting += 1
        try:
            return self._done.wait(timeout)
        finally:
            with self._lock:
                self.waiting -= 1

    def release(self) -> None:
        """Let go of the connection (now, or when the thread finishes): the engine holds its own."""
        with self._lock:
            self._released = True
            client, self.client = self.client, None
        if client is not None:
            client.close()


def start_async(scratch: str, *, shared_group: bool = False, answer_timeout: float = DEFAULT_TIMEOUT,
                timeout: float = 60.0) -> BackendStart:
    """Start or find the backend serving ``scratch`` in a background thread and hold a connection
    to it until :meth:`BackendStart.release`: what :meth:`deepfreeze.run.Run.begin` calls in async
    mode, so no training step waits for a backend process to start. Returns at once."""
    return BackendStart(scratch, shared_group=shared_group, answer_timeout=answer_timeout, timeout=timeout)


# ----------------------------------------------------------------------------- status / stop

def _veloc_status() -> dict[str, Any] | None:
    """This user's VeloC daemon (VeloC keeps one per user and machine), or None."""
    from .veloc_daemon import veloc_daemon_status
    return veloc_daemon_status()


def status(scratch: str, timeout: float = 2.0, *, veloc: bool = True) -> dict[str, Any]:
    """The state of the backend serving ``scratch``, within about ``timeout`` seconds (it never hangs).

    Returns a dict: ``state`` is ``"running"`` (then ``pid``, ``pending``, ``jobs``, ``clients``
    (other than this query), ``overdue``, ``flusher``, ``priority``: the lanes' counters, as the
    ``status`` request), ``"unresponsive"`` (it accepted the connection but did
    not answer within ``timeout``: ``pid`` if the kernel knows it, ``process`` its state, e.g.
    ``"T (stopped)"`` or ``"D (uninterruptible I/O wait)"``) or ``"none"``; also ``socket``,
    ``scratch``, ``message`` (one line for people) and ``veloc`` (this user's VeloC daemon:
    ``{"state": "running", "pid", "config", "process", "deepfreeze"}`` or None).
    Raises :class:`BackendError` only if the runtime directory is unusable.
    """
    path = socket_path(scratch)  # BackendError here (bad runtime dir) is an error, not "none"
    info: dict[str, Any] = {"state": "none", "pid": None, "socket": path, "scratch": os.path.abspath(scratch)}
    deadline = time.monotonic() + timeout
    client = None
    try:
        client = BackendClient(scratch, start=False, answer_timeout=timeout)
        st = client.request({"op": "status"}, max(0.1, deadline - time.monotonic()))
        info.update(state="running", pid=st["pid"], pending=st["pending"], jobs=st["jobs"],
                    clients=max(0, st["clients"] - 1), overdue=st.get("overdue", []), flusher=st.get("flusher"),
                    priority=st.get("priority"))
        info["message"] = (f"backend for scratch {info['scratch']}: running, pid {st['pid']}, {st['pending']} flush "
                           f"job(s) pending, {st['jobs']} received, {info['clients']} other client(s) connected "
                           f"(socket {path})")
        stalled = (info["flusher"] or {}).get("stalled")
        if isinstance(stalled, (int, float)) and stalled >= LOG_EVERY:
            tid = info["flusher"].get("tid")
            info["message"] += (f"; its flusher (thread {tid}, {process_state(tid) or 'state unknown'}) has made no "
                                f"progress for {stalled:.0f}s: I/O stuck? (see /proc/{st['pid']}/task/{tid}/stack)")
    except BackendUnresponsiveError as e:
        info.update(state="unresponsive", pid=e.pid, process=process_state(e.pid))
        info["message"] = (f"backend for scratch {info['scratch']}: unresponsive"
                           + (f", pid {e.pid}" if e.pid else "")
                           + (f" ({info['process']})" if info["process"] else "")
                           + f": it accepted the connection but did not answer within {timeout:g}s (socket {path}). "
                           "A stopped process (T) resumes with kill -CONT; one in uninterruptible I/O (D) waits for "
                           "its file system. The next job on this node starts a new backend.")
    except BackendError:
        info["message"] = f"backend for scratch {info['scratch']}: not running (socket {path})"
    finally:
        if client is not None:
            client.close()
    info["running"] = info["state"] == "running"
    info["veloc"] = _veloc_status() if veloc else None
    return info


def stop(scratch: str, timeout: float = 60.0, *, answer_timeout: float = 2.0, veloc: bool = True) -> dict[str, Any]:
    """Ask the backend serving ``scratch`` to drain its queue and exit; wait up to ``timeout`` s.

    Never hangs and never kills: an unresponsive backend is reported (``state`` ``"unresponsive"``,
    with its pid and process state), not signalled. Returns the :func:`status` dict with ``state``
    ``"stopped"`` (it exited), ``"draining"`` (stop requested, still flushing after ``timeout``),
    ``"unresponsive"`` or ``"none"``, ``stop_requested``, and ``message``. With ``veloc``, this
    user's VeloC daemon is stopped too if DeepFreeze started it (its configuration file is one
    DeepFreeze wrote) and no DeepFreeze job uses it: ``veloc`` then says ``"state": "stopped"``,
    ``"in use"`` or ``"not DeepFreeze's"``.
    """
    path = socket_path(scratch)
    info: dict[str, Any] = {"state": "none", "pid": None, "socket": path, "scratch": os.path.abspath(scratch),
                            "stop_requested": False}
    client = None
    try:
        client = BackendClient(scratch, start=False, answer_timeout=answer_timeout)
        st = client.request({"op": "status"})
        info.update(pid=st["pid"], pending=st["pending"], jobs=st["jobs"], clients=max(0, st["clients"] - 1),
                    overdue=st.get("overdue", []))
        client.request({"op": "stop"})
        info["stop_requested"] = True
    except BackendUnresponsiveError as e:
        info.update(state="unresponsive", pid=e.pid, process=process_state(e.pid))
        info["message"] = (f"backend for scratch {info['scratch']}: unresponsive"
                           + (f", pid {e.pid} ({info['process'] or 'gone'})" if e.pid else "")
                           + f"; it did not answer within {answer_timeout:g}s, so it was not stopped. "
                           "DeepFreeze never kills it (it may be stuck in I/O on a hung file system): "
                           + (f"resume it (kill -CONT {e.pid}) or kill it (kill -9 {e.pid}) yourself once it is "
                              "safe; " if e.pid else "")
                           + "the next job on this node starts a new backend.")
    except BackendError:
        info["message"] = f"backend for scratch {info['scratch']}: not running (socket {path})"
    finally:
        if client is not None:
            client.close()
    if info["stop_requested"]:
        inode = client.inode if client is not None else None
        deadline = time.monotonic() + timeout
        while True:
            exited = _socket_inode(path) != inode or _gone(info["pid"])
            if exited or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        pending = info.get("pending") or 0
        if exited:
            info["state"] = "stopped"
            info["message"] = (f"backend pid {info['pid']} for scratch {info['scratch']}: stopped"
                               + (f" after draining {pending} pending flush job(s)" if pending else ""))
        else:
            info["state"] = "draining"
            info["message"] = (f"backend pid {info['pid']} for scratch {info['scratch']}: stop requested; still "
                               f"draining {pending} pending flush job(s) after {timeout:g}s (it exits when done)")
    info["running"] = info["state"] == "draining"
    info["veloc"] = None
    if veloc:
        from .veloc_daemon import stop_veloc_daemon
        info["veloc"] = stop_veloc_daemon(timeout=min(timeout, 10.0))
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepfreeze.backend", description=__doc__.split("\n")[2])  # (line 0: why it is long)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--idle", type=float, default=float(os.environ.get("DEEPFREEZE_BACKEND_IDLE", "5")))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s backend[%(process)d] %(levelname)s %(message)s")
    try:  # the flushes yield to training from their own lane (deepfreeze.priority), not the whole process
        serve(args.socket, args.idle)
    finally:
        counters.dump("backend")  # with DEEPFREEZE_COUNTERS set (deepfreeze.counters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
