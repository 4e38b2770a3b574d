"""The built-in engine: what one rank calls to checkpoint its shard.

``Engine.checkpoint`` hands this rank's pieces (numpy views of the shard
buffers) to the writer thread ``deepfreeze-writer-r<rank>`` and returns. The
writer commits the shard to scratch (see :mod:`deepfreeze.tiers.persistent` for the
commit protocol) and then, in ``async`` mode, notifies the node's backend
process, which flushes to persistent in the background; in ``sync`` mode the
same flush runs inline and ``checkpoint`` blocks until it is done. With
``write_once`` in effect (:mod:`deepfreeze.tiers.direct`; the default where scratch and
persistent share a file system) a version decided ``flush`` is written by the writer
straight into persistent's partial instead of scratch, and the flush only makes it durable
and commits it.

Backpressure (policy: wait, never skip or drop):

* at most ``max_inflight`` (config key, default 2) versions of a rank are handed
  to the writer thread and not yet on scratch; a checkpoint beyond that waits
  for the oldest. Each holds its shard in memory (the numpy views keep TF's
  buffers alive; the next in-graph copy then goes to a new buffer), so a rank
  holds at most ``max_inflight + 1`` shard copies. With 2, a checkpoint that
  comes while the previous one is still being written costs memory, not time,
  unless the writer is slower than the checkpoint interval on average;
* at most ``max_pending_flushes`` (default ``max(2, scratch_versions or max_versions)``)
  versions of a rank may wait for the backend's flush; beyond that the writer
  thread waits for the oldest, so scratch holds at most ``scratch_versions +
  max_pending_flushes`` versions of a rank and the backend's queue stays bounded.

Redundancy (``ec_interval`` >= 0, several ranks, a communicator): after its
shard is on scratch, each rank's writer thread takes part in the collective
exchange of :func:`deepfreeze.redundancy.protect` (partner copy or XOR parity on
another failure domain) before the version's scratch manifest is written, so a
manifest naming a redundancy scheme is only written once the exchange is done.
Rank 0's clock decides which versions are protected.

Errors of background work (the scratch write here, the flush in the backend,
polled after every notice) surface once, at the first ``checkpoint`` call after the failed work
finished (the next call with ``max_inflight = 1``; with a queue it may be a later one) or at ``wait``.
If the backend process dies (killed, node OOM), the next exchange with it starts
a new one and re-sends every flush not known to be done; flushes are idempotent
(see :func:`deepfreeze.tiers.flush.flush_job`), so a half-done flush is finished.

Memory tier (INI ``memtier = PATH``, :mod:`deepfreeze.tiers.memtier`; built-in engine, ``ec_interval < 0``):
the engine registers this rank's shard on the device when it starts (:class:`MemtierTier`; the index from the shard's
:class:`~deepfreeze.fused.FusedLayout`; a device without room is a :class:`MemtierFullError`
before training) and a version goes to a slot of the device instead of a scratch file: in async
mode the writer thread sends ``memtier_put`` (this process's pid and the ``(address, length)``
regions of the buffer: one for a :class:`FusedShard`, one per piece for flat arrays, with a
static zero buffer for the padding between pieces) and the backend copies the bytes out of this
process (``process_vm_readv``) while training goes on; the writer thread holds the buffer until
the backend's answer (the copy is done: the slot is DONE), then sends the flush job
(:class:`~deepfreeze.tiers.job.FlushJob`) with its ``memtier`` source
(:class:`~deepfreeze.tiers.memtier.SlotSource`), which reads the slot, not a file.
No slot free (every slot holds the newest version or one waiting for its flush): the backend
waits, then answers ``busy`` and the writer thread waits for its oldest flush and asks again
(backpressure; counted in :attr:`Engine.memtier_waits`). The rank allows the backend to read its
memory (``prctl(PR_SET_PTRACER)``, for Yama ``ptrace_scope = 1``); if the kernel refuses the read
anyway, the rank copies into the slot itself (:class:`~deepfreeze.memtier.copy.LocalCopier`,
the slot still chosen by the backend), with one warning. Sync mode copies in the calling thread.
Per version, :attr:`Engine.memtier_stats` records the slot, bytes, copy calls, copy seconds,
the seconds waited for a slot and who copied.

Bounded waits: every exchange with the backend has a timeout. A backend that
does not answer (stopped, or stuck in uninterruptible I/O on a hung file system)
is asked again, with a log line every 10 s ("backend pid N on <socket> has not
answered for X s"); after INI ``backend_timeout`` seconds (default 60) it is
declared dead: the engine starts one new backend on the same socket path (the
stuck process is left running, never killed) and re-sends every pending flush.
If that fails too, the call raises :class:`BackendError` (in the writer thread:
surfaced at the next ``checkpoint``/``wait``, under the callback's ``on_error``).
``wait(timeout=T)`` returns or raises :class:`BackendError` within about T seconds
whatever the backend does. An unanswered request is sent again on a new connection, to whatever
listens on the path then: a rank that finds the socket's inode changed uses the backend another
rank started and re-sends its pending flushes to it; only one new backend is started per
replacement (under the spawn lock). A checkpoint blocked on the backend (the writer's flush
request, or the ``max_pending_flushes`` wait, which also logs every 10 s) is thus bounded by about
``backend_timeout`` plus a backend start.

Engine and tiers: :func:`deepfreeze.run.make_engine` returns an :class:`Engine` or a
:class:`~deepfreeze.veloc_engine.VelocEngine` as :func:`deepfreeze.tiers.choose` decides (``None``:
``$DEEPFREEZE_ENGINE``, default ``builtin``; ``auto``: VeloC when its library loads; with
``memtier`` set always the built-in one); the engine asks it too for its tiers and the route of
each version (:attr:`Engine.tiers`: memory tier, write once, scratch). ``comm`` carries the built-in redundancy exchange,
``mpi_comm`` (mpi4py) is VeloC's. An engine is called from one thread (the training thread); it
is not thread-safe. Both modes run the same :func:`deepfreeze.tiers.flush.flush_job`: ``async`` in
the node's backend, ``sync`` inline in the calling thread (no backend process is started).

Priority (INI ``background_priority``, default ``low``; :mod:`deepfreeze.priority`): the writer
has two lanes, one job at a time in order: ``deepfreeze-writer-r<rank>`` lowers itself when it
starts to nice +10 (capped at 19) and I/O best-effort level 7 (``setpriority``/``ioprio_set`` on
the thread's id: that thread only; failures ignored), so shard writes and CRC32s yield to
training (the paper: "background operations can run with low priority");
``deepfreeze-writer-r<rank>-urgent`` keeps the process's priority and takes a version once the
deferral reaches its bound: at the last version's pace it would end more than half an interval
after its call (the interval: the time between this call and the previous one), a ``checkpoint`` call finds ``max_inflight`` versions in flight, or
``wait()`` waits. Two threads because a non-root thread cannot lower its nice value again; a
running version that becomes urgent gets its I/O priority raised at once (see
:mod:`deepfreeze.priority`). Memory-tier versions always take the normal lane (the hand-off of a
buffer training holds; the copy runs at normal priority in the backend). Every flush job carries
its call time, interval and ``background_priority`` to the backend, which applies the same bound
(:mod:`deepfreeze.backend`). :attr:`Engine.priority` counts the versions each lane wrote. With
``background_priority = normal`` one writer thread runs at normal priority; the VeloC engine keeps
one thread (VeloC's calls must stay on it), lowered. In sync mode the write runs in the training
thread at its normal priority.

Errors, in detail: an exception of the writer thread is stored and raised once; one that is not
a ``DeepFreezeError`` is wrapped in one. Flush errors the backend reports (to the writer's polls,
its wait for the oldest jobs, or ``wait(persistent=True)``) are joined into one
:class:`BackendError`; while a writer error is pending it goes first and the flush errors are
kept for the next call. In sync mode errors raise from ``checkpoint`` itself. A write that fails
with ``OSError`` removes its temporary file and raises a :class:`CheckpointWriteError`
(:func:`write_error`: the level, the path and where its directory's value came from); nothing
partial is committed. ``wait(persistent=False)`` waits until every version is on scratch (its
errors and the flush errors polled so far surface), ``wait()`` for every flush to persistent.

Timings: :attr:`Engine.stats` holds per checkpoint ``version`` and ``blocking_s`` (time spent in
``checkpoint``); :attr:`Engine.write_times` maps each version to the seconds taken to commit this
rank's shard and manifest on scratch (the flush to persistent not included). Redundancy's
exchange adds to the writer's time per version, not to the training thread's blocking time in
async mode, unless the writer is still busy at the next checkpoint.
"""
from __future__ import annotations

import collections
import concurrent.futures
import errno
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from .backend import LOG_EVERY, BackendClient
from .node import process_state
from .config import Config, validate_name
from . import counters
from .fused import FusedLayout, FusedShard
from .errors import (BackendError, BackendUnresponsiveError, CheckpointWriteError, ConfigError, DeepFreezeError,
                     MemtierBusyError, MemtierError)
from .tiers import choose
from .tiers.direct import decide, write_version
from .tiers.flush import flush_job
from .tiers.memtier import MemtierTier, SlotSource
from .tiers.persistent import PersistentLevel
from .tiers.scratch import ScratchLevel
from .tiers.job import SCRATCH, FlushJob
from .priority import Lanes
from .comm import Comm
from .redundancy import plan_redundancy
from .format import ANONYMOUS_RUN
from .lease import RunInfo
from .format import build_manifest
from .shardplan import ShardPlan

__all__ = ["Engine"]

log = logging.getLogger("deepfreeze")


class Engine:
    """Checkpoint engine of one rank. Not thread-safe: call from the training thread."""

    #: name of the engine (``builtin``; ``veloc`` for :class:`deepfreeze.veloc_engine.VelocEngine`)
    kind = "builtin"

    def __init__(self, config: Config, name: str, rank: int, plan: ShardPlan,
                 domains: Sequence[str] | None = None, *, scratch_cls: type = ScratchLevel,
                 persistent_cls: type = PersistentLevel, max_pending_flushes: int | None = None,
                 comm: Comm | None = None, run: RunInfo | None = None) -> None:
        self.config, self.name, self.rank, self.plan = config, validate_name(name), rank, plan
        #: the run this engine writes for (:mod:`deepfreeze.run`); without one, the anonymous run
        self.run = run or RunInfo(ANONYMOUS_RUN)
        self.domains = list(domains) if domains is not None else [config.failure_domain] * plan.world_size
        #: the tier set and the per-version route (deepfreeze.tiers.choose: every rule of it, once)
        self.tiers = choose(config, self.kind, resolved=True)
        self.scratch = scratch_cls(config.scratch, shared_group=config.shared_group)
        #: the persistent level's class in this process: write once's writes and the sync flush (faults are
        #: injected by subclassing it; a backend process flushes with its own)
        self.persistent_cls = persistent_cls
        # the writer's two lanes (deepfreeze.priority), started now, not in the first checkpoint call; VeloC's
        # calls must stay on one thread
        self._pool = Lanes(f"deepfreeze-writer-r{rank}", low=config.background_priority == "low",
                           one_thread=self.kind != "builtin")
        self._called: dict[int, tuple[float, float | None]] = {}  # version -> (monotonic call time, interval)
        self._last_call: float | None = None
        self._inflight: collections.deque[concurrent.futures.Future] = collections.deque()  # oldest first
        self._error: BaseException | None = None
        self._pending: dict[int, FlushJob] = {}  # backend job id -> job not known to be done
        self._backend_errors: list[str] = []  # appended by the writer thread, taken by the training thread
        self._errors_lock = threading.Lock()
        self.max_pending_flushes = max_pending_flushes or max(2, config.keep_scratch)
        self._backend: BackendClient | None = None
        self._pending_owner: tuple[int | None, int | None] = (None, None)  # (pid, socket inode) the ids belong to
        self._unresponsive_since: float | None = None  # monotonic time of the first unanswered request
        self._next_log = LOG_EVERY
        self._in_backend = False  # the writer thread is waiting for the backend
        self.last_version: int | None = None
        self.stats: list[dict[str, float]] = []
        self.write_times: dict[int, float] = {}  # version -> seconds to commit the shard on scratch
        self.writer_cpu: dict[int, float] = {}  # version -> CPU seconds the writer thread spent on it
        #: checkpoint calls that waited for the writer thread (max_inflight versions not yet written:
        #: in memory-tier mode, not yet copied into the tier, so their buffers are still held)
        self.write_waits = 0
        #: versions that had to wait for a free memory-tier slot (the backend waited, or answered busy)
        self.memtier_waits = 0
        #: version -> {"slot", "bytes", "calls", "copy_s", "waited_s", "copier"} of its memory-tier copy
        self.memtier_stats: dict[int, dict[str, Any]] = {}
        #: the memory tier (deepfreeze.tiers.memtier): this rank's registered shard, or None
        self._mt: MemtierTier | None = None
        self._mt_layout: FusedLayout | None = None
        self._mt_self_copy = False  # the kernel refused the backend's read: this rank copies (one warning)
        self._mt_ptracer: int | None = None  # the backend pid this process allowed to read its memory
        if self.tiers.memtier:
            try:
                self._mt = MemtierTier.register(config, self.name, rank, plan, self.run)
            except BaseException:
                self._pool.shutdown(wait=False)  # refused before training: no thread left behind
                raise
            self._mt_layout = self._mt.layout
        if config.mode == "async" and self.kind == "builtin":
            self.scratch.makedirs(config.scratch)  # checked with shared_group before the backend creates its log
            self._backend = BackendClient(config.scratch, answer_timeout=config.backend_timeout)
            self._pending_owner = (self._backend.pid, self._backend.inode)
        #: write_once: versions decided 'flush' go from memory straight into persistent (deepfreeze.tiers.direct)
        self.write_once = self.tiers.write_once
        self._manifest_base = build_manifest(self.name, 0, 0, 0, plan, self.domains, run=self.run)
        self.comm, self.redundancy, self._last_ec = comm, None, None
        if config.ec_interval >= 0 and plan.world_size > 1 and self.kind == "builtin":
            if comm is None or comm.size != plan.world_size:
                log.warning("deepfreeze: ec_interval = %g but no communicator of %d ranks was given: scratch "
                            "checkpoints are not partner/parity protected", config.ec_interval, plan.world_size)
            else:
                self.redundancy = plan_redundancy(self.domains, config.ec_scheme, config.ec_group_size)
                if self.redundancy["unprotected"] and rank == 0:
                    log.warning("deepfreeze: ranks %s cannot be protected by %s across failure domains %s "
                                "(one failure domain, or more ranks in one domain than in the others)",
                                self.redundancy["unprotected"], config.ec_scheme, sorted(set(self.domains)))

    # -- public
    def checkpoint(self, version: int, arrays: "Sequence[np.ndarray] | FusedShard", *, step: int, epoch: int,
                   extra: dict[str, Any] | None = None) -> None:
        """Commit this rank's pieces of ``version``: flat arrays in plan order, or one
        :class:`~deepfreeze.fused.FusedShard` (the hook's capture buffer, written as it is).
        Versions of one run strictly increase: a version at or below the last one is a
        :class:`ConfigError`. The arrays (buffer) are held, unchanged, until written."""
        t0 = time.perf_counter()
        if self.last_version is not None and version <= self.last_version:
            raise ConfigError(f"checkpoint {self.name!r} v{version} requested after v{self.last_version} in the same "
                              "run: versions (optimizer steps) must grow within a run. A model re-compiled with a "
                              "fresh optimizer restarts its step count: use a new DeepFreezeCheckpoint with "
                              "overwrite=True or another name")
        if self.run.resumed_from is not None and version <= self.run.resumed_from:
            raise ConfigError(f"checkpoint {self.name!r} v{version} requested, but this run resumed from "
                              f"v{self.run.resumed_from}: versions must grow")
        now = time.monotonic()
        interval = None if self._last_call is None else now - self._last_call
        self._last_call = now
        if interval is not None:  # the interval this engine learns from its calls: the deferral's bound
            self._pool.interval = interval
        if len(self._inflight) >= self.config.max_inflight and not self._inflight[0].done():
            self.write_waits += 1
            self._pool.hurry()  # the queue is full: the work waited for runs at normal priority
        self._drain(keep=self.config.max_inflight - 1)
        self._raise_pending()
        # the version-independent part is built once: allocating thousands of small objects here
        # (a ResNet-50 plan) made Python's full garbage collection (~0.5 s in a Keras process) run
        # inside this call now and then
        manifest = {**self._manifest_base, "version": version, "step": step, "epoch": epoch, **(extra or {})}
        if self.config.mode == "sync":
            self._write_checked(version, arrays, manifest)
        else:
            self._called[version] = (now, interval)
            # a memory-tier job is the hand-off of training's buffer (held until copied): never deferred
            self._inflight.append(self._pool.submit(self._write_checked, version, arrays, manifest, t=now,
                                                    interval=interval, urgent=self._mt is not None))
        self.last_version = version
        self.stats.append({"version": version, "blocking_s": time.perf_counter() - t0})

    @property
    def priority(self) -> dict[str, Any]:
        """The writer's lanes (:mod:`deepfreeze.priority`): ``low_jobs``/``urgent_jobs`` (versions
        written at low and at normal priority), ``boosted``, ``sections``, ``tids`` (thread id of
        each lane), ``low`` (whether lowering is on), ``queued``."""
        return self._pool.snapshot()

    def saturated(self) -> bool:
        """True when a :meth:`checkpoint` now would wait for the writer thread (``max_inflight``
        versions still on their way to scratch, or waiting there for the backend's flushes).
        Finished writes are collected; nothing waits."""
        self._drain(keep=len(self._inflight))
        return self.config.mode == "async" and len(self._inflight) >= self.config.max_inflight

    def wait(self, *, persistent: bool = True, timeout: float | None = None) -> None:
        """Block until every submitted checkpoint is on scratch (and, if ``persistent``, flushed).
        With :attr:`write_once` in effect a version has no scratch copy, so this always waits for the
        flushes too: when it returns, every version is restorable, as before.

        With ``timeout`` (seconds), raise :class:`BackendError` if the flushes are not done by
        then; they go on in the background and a later ``wait`` picks them up.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._pool.hurry()  # the training thread waits for all of it
        self._drain(timeout)
        if (persistent or self.write_once) and self._backend is not None and self._pending:
            self._await_flushes(0, deadline, timeout)
        self._raise_pending()

    def close(self, *, wait: bool = True) -> None:
        try:
            if wait:
                self.wait(persistent=True)
        finally:
            self._shutdown()
            counters.dump(f"rank{self.rank}")  # with DEEPFREEZE_COUNTERS set (deepfreeze.counters)

    def _shutdown(self) -> None:
        """Stop the writer thread and let go of the backend (it exits when idle)."""
        self._pool.shutdown(wait=True)
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        if self._mt is not None:
            self._mt.close()
            self._mt = None

    # -- memory tier
    def _memtier_put(self, version: int, arrays: "Sequence[np.ndarray] | FusedShard",
                     manifest: dict[str, Any]) -> SlotSource:
        """Put ``version`` into a slot of the device (see the module docstring); returns the flush
        job's source. ``arrays`` stays referenced (by the caller) until this returns."""
        cfg, region = self.config, self._mt.region
        regions, keep = self._mt.regions(arrays)
        if self._backend is None:  # sync mode: nothing waits for a flush when the next version comes
            slot = region.choose_slot(set())
            if slot is None:
                raise MemtierBusyError(f"memory tier {cfg.memtier}: no slot of {self.name!r} rank {self.rank} is free "
                                       f"({region.nslots} slots)")
            stat = dict(self._mt.local_put(slot, version, regions, manifest), waited_s=0.0, copier="rank")
        else:
            wait = min(10.0, cfg.backend_timeout / 2)
            req = {"device": cfg.memtier, "entry": region.entry_no, "name": self.name, "run": self.run.id,
                   "rank": self.rank, "generation": self.run.generation, "version": version, "pid": os.getpid(),
                   "regions": regions, "manifest": manifest, "wait": wait}
            waited_s, busy_since = 0.0, None
            while True:
                resp = self._call_backend(lambda b, t: self._memtier_request(b, req, wait))
                waited_s += float(resp.get("waited_s") or 0.0)
                if resp.get("ok"):
                    break
                kind = resp.get("kind")
                if kind == "busy":  # backpressure: wait for our oldest flush, then ask again
                    w0 = time.monotonic()
                    if self._pending:
                        busy_since = None
                        self._await_flushes(len(self._pending) - 1)
                    else:
                        busy_since = busy_since or w0
                        if w0 - busy_since >= cfg.backend_timeout:
                            raise MemtierBusyError(
                                f"memory tier {cfg.memtier}: no free slot for {self.name!r} v{version} rank "
                                f"{self.rank} for {cfg.backend_timeout:g}s (backend_timeout) and no flush of this "
                                f"rank pending: {resp.get('error')}")
                        time.sleep(0.05)
                    waited_s += time.monotonic() - w0
                    continue
                if kind == "permission" and not req.get("self_copy"):
                    log.warning("deepfreeze: rank %d: the backend (pid %s) may not read this process's memory (%s); "
                                "this rank copies its shards into the memory tier itself from now on (the copy "
                                "then costs this process's CPU)", self.rank, self._backend.pid, resp.get("error"))
                    self._mt_self_copy = True
                    req["self_copy"] = True
                    continue
                raise MemtierError(f"memory tier {cfg.memtier}: the backend could not put {self.name!r} v{version} of "
                                   f"rank {self.rank}: {resp.get('error')}")
            if req.get("self_copy"):
                stat = dict(self._mt.local_put(int(resp["slot"]), version, regions, manifest), copier="rank")
            else:
                stat = {"slot": int(resp["slot"]), "bytes": int(resp["bytes"]), "calls": int(resp["calls"]),
                        "copy_s": float(resp["copy_s"]), "copier": "backend"}
            stat["waited_s"] = waited_s
            if waited_s > 0:
                self.memtier_waits += 1
        del keep  # the copy is done (the slot is DONE): the buffer may go
        self.memtier_stats[version] = stat
        return self._mt.source(stat["slot"], version)

    def _memtier_request(self, backend: BackendClient, req: dict[str, Any], wait: float) -> dict[str, Any]:
        """One ``memtier_put`` exchange; first allows this backend to read our memory (Yama)."""
        if backend.pid != self._mt_ptracer and not self._mt_self_copy:
            self._mt.allow_reader(backend.pid)
            self._mt_ptracer = backend.pid
        if self._mt_self_copy:
            req["self_copy"] = True
        return backend.memtier_put(req, wait + self.config.backend_timeout)

    # -- internals
    def _drain(self, timeout: float | None = None, keep: int = 0) -> None:
        """Collect finished writes; wait (oldest first) until at most ``keep`` are in flight."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._inflight and (len(self._inflight) > keep or self._inflight[0].done()):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self._inflight[0].result(left)
            except concurrent.futures.TimeoutError:
                if self._in_backend and self._backend is not None:
                    raise BackendError(
                        f"the writer thread of rank {self.rank} has waited more than {timeout}s for the DeepFreeze "
                        f"backend (pid {self._backend.pid}, socket {self._backend.path}, log {self.config.scratch}/"
                        f".deepfreeze-backend.log); it goes on (a backend silent for backend_timeout = "
                        f"{self.config.backend_timeout:g}s is replaced): call wait() again") from None
                raise CheckpointWriteError(errno.ETIMEDOUT, f"the shard write to scratch {self.config.scratch} "
                                           f"did not finish within {timeout}s; it goes on: call wait() again")
            except BaseException as e:  # surfaced once, by _raise_pending
                self._error = self._error or e
            self._inflight.popleft()

    def _call_backend(self, fn: Callable[[BackendClient, float], Any], deadline: float | None = None) -> Any:
        """``fn(backend, seconds)``: one exchange that must be answered within ``seconds``.

        A dead backend (connection refused, reset or closed) is replaced at once: a new one is
        started, every flush not known to be done is re-sent (flushes are idempotent) and ``fn``
        runs once more. An unresponsive one (:class:`BackendUnresponsiveError`) is asked again on a
        new connection, with a log line every ``LOG_EVERY`` s, until ``backend_timeout`` seconds
        without an answer; then it is declared dead and replaced the same way (left running, not
        killed). If the replacement fails too, :class:`BackendError`. With ``deadline`` (monotonic),
        :class:`BackendError` once it passes (the backend is not replaced before its time).
        """
        cfg = self.config
        while True:
            now = time.monotonic()
            limit = cfg.backend_timeout if self._unresponsive_since is None else \
                self._unresponsive_since + cfg.backend_timeout - now
            if deadline is not None:
                limit = min(limit, deadline - now)
            t = max(0.05, min(limit, LOG_EVERY))
            try:
                if self._backend.sock is None:  # closed after a timeout: a new connection (maybe to a successor)
                    self._reconnect(t)
                result = fn(self._backend, t)
            except BackendUnresponsiveError as e:
                if self._unresponsive_since is None:
                    self._unresponsive_since, self._next_log = now, LOG_EVERY
                waited = time.monotonic() - self._unresponsive_since
                start = self._start_timeout(deadline)
                if waited >= cfg.backend_timeout and start is not None:
                    self._replace_backend(e, f"has not answered for {waited:.0f}s", start, deadline)
                    return fn(self._backend, self._budget(deadline))
                if waited >= self._next_log:
                    log.warning("deepfreeze: rank %d: backend pid %s on %s has not answered for %.0fs (process "
                                "state %s); still waiting: it will be declared dead and replaced once it has been "
                                "silent for backend_timeout = %gs", self.rank,
                                e.pid or self._backend.pid, self._backend.path, waited,
                                process_state(e.pid or self._backend.pid) or "unknown", cfg.backend_timeout)
                    self._next_log += LOG_EVERY
                if deadline is not None and time.monotonic() >= deadline:
                    raise BackendError(
                        f"the DeepFreeze backend pid {e.pid or self._backend.pid} on {self._backend.path} has not "
                        f"answered for {waited:.1f}s ({len(self._pending)} flush(es) pending; once silent for "
                        f"backend_timeout = {cfg.backend_timeout:g}s it is replaced by the next call with time to "
                        "start a new one): call wait() again") from e
                continue
            except BackendError as e:
                start = self._start_timeout(deadline)
                if start is None:  # too little time left to start one: the next call does it
                    raise BackendError(f"rank {self.rank} lost its backend ({e}) with too little time left before "
                                       f"the deadline to start a new one: call wait() again") from e
                log.warning("deepfreeze: rank %d lost its backend (%s); starting a new one and re-sending %d "
                            "pending flush(es)", self.rank, e, len(self._pending))
                self._backend.close()
                # a backend started from the writer's low lane would inherit its nice value for good
                self._backend = self._pool.run_normal(BackendClient, cfg.scratch, timeout=start,
                                                      answer_timeout=min(cfg.backend_timeout, start))
                self._backend.answer_timeout = cfg.backend_timeout
                self._unresponsive_since = None
                self._resend(deadline)
                return fn(self._backend, self._budget(deadline))
            self._unresponsive_since = None
            return result

    def _budget(self, deadline: float | None) -> float:
        """Seconds one exchange may take: ``backend_timeout``, or what is left before ``deadline``."""
        if deadline is None:
            return self.config.backend_timeout
        return max(0.05, min(self.config.backend_timeout, deadline - time.monotonic()))

    @staticmethod
    def _start_timeout(deadline: float | None) -> float | None:
        """Seconds a replacement backend may take to start: 60, or what is left before ``deadline``
        minus a margin; None if too little is left (the caller raises at its deadline instead, and
        the next call replaces the backend)."""
        if deadline is None:
            return 60.0
        left = deadline - time.monotonic() - 1.0
        return min(60.0, left) if left >= 4.0 else None

    def _reconnect(self, seconds: float) -> None:
        """A new connection to whatever backend listens now (never starting one: the caller decides
        when a silent one is dead); BackendUnresponsiveError if it does not answer in ``seconds``."""
        client = BackendClient(self.config.scratch, start=False, answer_timeout=seconds)
        client.answer_timeout = self.config.backend_timeout
        self._backend = client
        self._resend()

    def _replace_backend(self, e: BackendUnresponsiveError, why: str, start_timeout: float = 60.0,
                         deadline: float | None = None) -> None:
        """Declare the backend dead (``why``: what it did not do for ``backend_timeout``), start one new
        backend on its socket path (another rank of the node may have done it already: then that one
        is used) and re-send the pending flushes."""
        cfg, old = self.config, self._backend
        pid = e.pid or old.pid
        log.error("deepfreeze: rank %d: backend pid %s on %s %s (backend_timeout = %gs): declaring it dead and "
                  "starting a new backend; the old process is left running, not killed (state %s: it may be stuck "
                  "in uninterruptible I/O on a hung file system); re-sending %d pending flush(es)",
                  self.rank, pid, old.path, why, cfg.backend_timeout, process_state(pid) or "gone", len(self._pending))
        old.close()
        self._unresponsive_since = None
        try:
            self._backend = self._pool.run_normal(  # not from the low lane: the new process would inherit it
                BackendClient, cfg.scratch, timeout=start_timeout,
                answer_timeout=min(cfg.backend_timeout, start_timeout),
                replace=e.inode if e.inode is not None else old.inode)
            self._backend.answer_timeout = cfg.backend_timeout
            self._resend(deadline)
        except BackendError as e2:
            raise BackendError(f"the DeepFreeze backend pid {pid} on {old.path} {why} and was declared dead (left "
                               f"running); its replacement failed too: {e2}") from e2
        log.warning("deepfreeze: rank %d: backend pid %s now serves %s (%d flush(es) re-sent)", self.rank,
                    self._backend.pid, self._backend.path, len(self._pending))

    def _resend(self, deadline: float | None = None) -> None:
        """Re-send the pending flushes if the backend is not the one their ids belong to (each
        request bounded by what is left before ``deadline``)."""
        owner = (self._backend.pid, self._backend.inode)
        if owner == self._pending_owner:
            return
        jobs = list(self._pending.values())
        pending = {}
        for job in jobs:  # a failure leaves the old ids: the next backend gets them all again
            pending[self._backend.flush(job, self._budget(deadline))] = job
        self._pending, self._pending_owner = pending, owner

    def _await_flushes(self, keep: int, deadline: float | None = None, timeout: float | None = None) -> None:
        """Poll the backend (at least once) until at most ``keep`` flushes are pending; their errors
        are collected.
        Logs every ``LOG_EVERY`` s while it waits; with ``deadline``, BackendError once it passes."""
        t0, next_log = time.monotonic(), LOG_EVERY
        replaced = False
        while self._pending:  # polled at least once: errors of finished flushes surface early
            need = len(self._pending) - keep
            done, errors = self._call_backend(
                lambda b, t: b.poll(list(self._pending), wait=min(1.0, t / 2) if need > 0 else 0.0,
                                    need=len(self._pending) - keep, timeout=t), deadline)
            with self._errors_lock:
                self._backend_errors += errors
            for i in done:
                self._pending.pop(i, None)
            if len(self._pending) <= keep:
                break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self._raise_pending()
                raise BackendError(
                    f"{len(self._pending)} flush(es) to {self.config.persistent} not finished within "
                    f"{timeout}s (backend pid {self._backend.pid}, log {self.config.scratch}/"
                    ".deepfreeze-backend.log); they go on in the background: call wait() again")
            stalled = self._backend.stalled or 0.0
            start = self._start_timeout(deadline)
            if stalled >= self.config.backend_timeout and start is not None:  # it answers; its flusher is stuck
                why = f"answers, but its flusher has made no progress for {stalled:.0f}s"
                if replaced:
                    self._raise_pending()
                    raise BackendError(f"the DeepFreeze backend pid {self._backend.pid} on {self._backend.path} "
                                       f"{why}, as did the backend it replaced: is {self.config.persistent} (or "
                                       f"{self.config.scratch}) hung? {len(self._pending)} flush(es) pending")
                self._replace_backend(BackendUnresponsiveError(why, self._backend.pid, self._backend.inode), why, start,
                                      deadline)
                replaced = True
                continue
            if now - t0 >= next_log:
                log.warning("deepfreeze: rank %d has waited %.0fs for %d flush(es) by backend pid %s (it answers; its "
                            "flusher made no progress for %s s; see %s/.deepfreeze-backend.log)", self.rank, now - t0,
                            len(self._pending) - keep, self._backend.pid,
                            "?" if self._backend.stalled is None else f"{stalled:.0f}", self.config.scratch)
                next_log += LOG_EVERY

    def _raise_pending(self) -> None:
        with self._errors_lock:  # errors not reported now (another error goes first) are kept for the next call
            if self._backend_errors and self._error is None:
                self._error = BackendError("background flush to persistent failed: " + "; ".join(self._backend_errors))
                self._backend_errors = []
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, DeepFreezeError):
                raise err
            raise DeepFreezeError(f"background checkpoint work failed: {err}") from err

    def _write_checked(self, version: int, arrays: Sequence[np.ndarray], manifest: dict[str, Any]) -> None:
        """:meth:`_write`, with a bare OSError (a scratch or persistent directory that is a file,
        lost permissions, a full disk in retention or the sync flush) turned into a
        :class:`CheckpointWriteError` naming the level, the path and the config key's source, so
        ``on_error`` applies to it."""
        try:
            self._write(version, arrays, manifest)
        except OSError as e:
            if isinstance(e, DeepFreezeError):
                raise
            raise write_error(self.config, self.name, version, e) from e

    def _write(self, version: int, arrays: Sequence[np.ndarray], manifest: dict[str, Any]) -> None:
        c0 = time.thread_time()
        try:
            self._write_version(version, arrays, manifest)
        finally:
            self.writer_cpu[version] = time.thread_time() - c0
            self._called.pop(version, None)

    def _write_version(self, version: int, arrays: Sequence[np.ndarray], manifest: dict[str, Any]) -> None:
        """Write one version where :meth:`deepfreeze.tiers.Tiers.route` sends it (with write once, by
        the writer's own decision of it), then hand its flush job to the backend."""
        cfg = self.config
        t0 = time.perf_counter()
        decided = decide(cfg, self.name, version, self.run.id, critical=self._pool.run_normal,
                         level_cls=self.persistent_cls) if self.tiers.wants_decision else None
        route = self.tiers.route(decided.kind if decided is not None else None)
        if route == "memtier":  # a slot instead of a scratch file (no redundancy)
            spec: Any = self._memtier_put(version, arrays, manifest)
        elif route == "direct":  # written once, into persistent's partial: no scratch file
            spec = write_version(cfg, decided, self.name, version, self.rank, self.plan, arrays)
        else:
            asked: list[float] = []

            def due() -> bool:  # asked once the shard is on scratch (rank 0's answer counts: redundancy.protect)
                asked.append(time.monotonic())
                return self._last_ec is None or asked[0] - self._last_ec >= cfg.ec_interval
            if self.scratch.write_version(self.name, version, self.rank, self.plan, arrays, manifest,
                                          chksum=cfg.chksum, run=self.run.id, comm=self.comm,
                                          redundancy=self.redundancy, due=due):
                self._last_ec = asked[0]
            spec = None
        self.write_times[version] = time.perf_counter() - t0
        self._flush(version, manifest, route, spec)

    def _flush(self, version: int, manifest: dict[str, Any], source: str = SCRATCH, spec: Any = None) -> None:
        """Hand the version's flush job to the backend (async) or run it (sync); ``source``: the
        route the version took (a source kind of :mod:`deepfreeze.tiers.job`), ``spec`` its record
        (a memory-tier slot, :class:`~deepfreeze.tiers.memtier.SlotSource`; a version written once,
        :func:`deepfreeze.tiers.direct.write_version`'s record; scratch: None)."""
        cfg = self.config
        t, interval = self._called.pop(version, (time.monotonic(), None))
        job = FlushJob(name=self.name, version=version, rank=self.rank, scratch=cfg.scratch, persistent=cfg.persistent,
                       persistent_interval=cfg.persistent_interval, keep_scratch=cfg.keep_scratch,
                       keep_persistent=cfg.max_versions, manifest=manifest, run=self.run.id,
                       lease_timeout=cfg.lease_timeout, shared_group=cfg.shared_group,
                       watchdog_interval=cfg.watchdog_interval,
                       t=t, interval=interval, priority=cfg.background_priority,  # the backend's bound (priority.py)
                       source=source, spec=spec)
        if self._backend is not None:
            self._in_backend = True
            try:
                self._call_backend(lambda b, t: self._pending.__setitem__(b.flush(job, t), job))
                # beyond max_pending_flushes this waits (bounded: a silent backend is replaced)
                self._await_flushes(self.max_pending_flushes)
            finally:
                self._in_backend = False
        else:
            flush_job(job, scratch_cls=type(self.scratch), persistent_cls=self.persistent_cls)


def write_error(config: Config, name: str, version: int, e: OSError) -> CheckpointWriteError:
    """A :class:`CheckpointWriteError` for an OSError met while checkpointing ``name`` v``version``."""
    path = os.fspath(e.filename) if isinstance(e.filename, (str, os.PathLike)) else ""
    under = [k for k in ("persistent", "scratch") if path and os.path.commonpath(
        [os.path.abspath(path), getattr(config, k)]) == getattr(config, k)]
    level = max(under, key=lambda k: len(getattr(config, k)), default=None)  # the innermost root
    where = (f"on {level} ({path}); check that {level} = {getattr(config, level)} ({config.where(level)}) is a "
             "writable directory with free space") if level else (
        f"({path or 'writing to scratch ' + config.scratch + ' or persistent ' + config.persistent})")
    return CheckpointWriteError(e.errno, f"checkpoint {name!r} v{version} failed: {e.strerror or e} {where}. "
                                "A version is committed whole or not at all.")
