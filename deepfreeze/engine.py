"""The built-in engine: what one rank calls to checkpoint its shard.

``Engine.checkpoint`` hands this rank's pieces (numpy views of the shard
buffers) to the writer thread ``deepfreeze-writer-r<rank>`` and returns. The
writer commits the shard to scratch (see :mod:`deepfreeze.levels` for the
commit protocol) and then, in ``async`` mode, notifies the node's backend
process, which flushes to persistent in the background; in ``sync`` mode the
same flush runs inline and ``checkpoint`` blocks until it is done.

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
(see :func:`deepfreeze.levels.flush_job`), so a half-done flush is finished.
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

from .backend import BackendClient
from .config import Config, validate_name
from .errors import BackendError, CheckpointWriteError, ConfigError, DeepFreezeError
from .levels import ScratchLevel, flush_job
from .redundancy import Comm, plan_redundancy, protect
from .run import ANONYMOUS_RUN, RunInfo
from .shardplan import ShardPlan

__all__ = ["Engine", "build_manifest", "make_engine", "resolve_engine", "ENGINES"]

log = logging.getLogger("deepfreeze")


def build_manifest(name: str, version: int, step: int, epoch: int, plan: ShardPlan,
                   domains: Sequence[str], extra: dict[str, Any] | None = None,
                   run: RunInfo | None = None) -> dict[str, Any]:
    run = run or RunInfo(ANONYMOUS_RUN)
    return {
        "format": "deepfreeze-manifest", "format_version": 2, "run": run.to_json(), "name": name, "version": version,
        "step": step, "epoch": epoch, "world_size": plan.world_size,
        "tensors": [t.to_json() for t in plan.tensors], "plan": plan.to_json(),
        "shards": [{"rank": r, "file": f"r{r:06d}.dfs", "domain": domains[r], "bytes": b}
                   for r, b in enumerate(plan.rank_bytes())],
        "total_bytes": plan.total_bytes, **(extra or {}),
    }


class Engine:
    """Checkpoint engine of one rank. Not thread-safe: call from the training thread."""

    #: name of the engine (``builtin``; ``veloc`` for :class:`deepfreeze.veloc_engine.VelocEngine`)
    kind = "builtin"

    def __init__(self, config: Config, name: str, rank: int, plan: ShardPlan,
                 domains: Sequence[str] | None = None, *, scratch_cls: type = ScratchLevel,
                 max_pending_flushes: int | None = None, comm: Comm | None = None,
                 run: RunInfo | None = None) -> None:
        self.config, self.name, self.rank, self.plan = config, validate_name(name), rank, plan
        #: the run this engine writes for (:mod:`deepfreeze.run`); without one, the anonymous run
        self.run = run or RunInfo(ANONYMOUS_RUN)
        self.domains = list(domains) if domains is not None else [config.failure_domain] * plan.world_size
        self.scratch = scratch_cls(config.scratch, shared_group=config.shared_group)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"deepfreeze-writer-r{rank}",
                                                           initializer=lower_priority)
        self._inflight: collections.deque[concurrent.futures.Future] = collections.deque()  # oldest first
        self._error: BaseException | None = None
        self._pending: dict[int, dict[str, Any]] = {}  # backend job id -> job not known to be done
        self._backend_errors: list[str] = []
        self.max_pending_flushes = max_pending_flushes or max(2, config.keep_scratch)
        self._backend: BackendClient | None = None
        self.last_version: int | None = None
        self.stats: list[dict[str, float]] = []
        self.write_times: dict[int, float] = {}  # version -> seconds to commit the shard on scratch
        if config.mode == "async" and self.kind == "builtin":
            self.scratch.makedirs(config.scratch)  # checked with shared_group before the backend creates its log
            self._backend = BackendClient(config.scratch)
        self._manifest_base = build_manifest(self.name, 0, 0, 0, plan, self.domains, run=self.run)
        self.comm, self.redundancy, self._last_ec = comm, None, None
        if config.ec_interval >= 0 and plan.world_size > 1 and self.kind == "builtin":
            if comm is None or comm.size != plan.world_size:
                log.warning("deepfreeze: ec_interval = %g but no communicator of %d ranks was given: scratch "
                            "checkpoints are not partner/parity protected", config.ec_interval, plan.world_size)
            else:
                self.redundancy = plan_redundancy(self.domains, config.ec_scheme)
                if self.redundancy["unprotected"] and rank == 0:
                    log.warning("deepfreeze: ranks %s cannot be protected by %s across failure domains %s "
                                "(one failure domain, or more ranks in one domain than in the others)",
                                self.redundancy["unprotected"], config.ec_scheme, sorted(set(self.domains)))

    # -- public
    def checkpoint(self, version: int, arrays: Sequence[np.ndarray], *, step: int, epoch: int,
                   extra: dict[str, Any] | None = None) -> None:
        """Commit this rank's pieces of ``version`` (flat arrays in plan order). Versions of one
        run strictly increase: a version at or below the last one is a :class:`ConfigError`."""
        t0 = time.perf_counter()
        if self.last_version is not None and version <= self.last_version:
            raise ConfigError(f"checkpoint {self.name!r} v{version} requested after v{self.last_version} in the same "
                              "run: versions (optimizer steps) must grow within a run. A model re-compiled with a "
                              "fresh optimizer restarts its step count: use a new DeepFreezeCheckpoint with "
                              "overwrite=True or another name")
        if self.run.resumed_from is not None and version <= self.run.resumed_from:
            raise ConfigError(f"checkpoint {self.name!r} v{version} requested, but this run resumed from "
                              f"v{self.run.resumed_from}: versions must grow")
        self._drain(keep=self.config.max_inflight - 1)
        self._raise_pending()
        # the version-independent part is built once: allocating thousands of small objects here
        # (a ResNet-50 plan) made Python's full garbage collection (~0.5 s in a Keras process) run
        # inside this call now and then
        manifest = {**self._manifest_base, "version": version, "step": step, "epoch": epoch, **(extra or {})}
        if self.config.mode == "sync":
            self._write_checked(version, arrays, manifest)
        else:
            self._inflight.append(self._pool.submit(self._write_checked, version, arrays, manifest))
        self.last_version = version
        self.stats.append({"version": version, "blocking_s": time.perf_counter() - t0})

    def wait(self, *, persistent: bool = True, timeout: float | None = None) -> None:
        """Block until every submitted checkpoint is on scratch (and, if ``persistent``, flushed).

        With ``timeout`` (seconds), raise :class:`BackendError` if the flushes are not done by
        then; they go on in the background and a later ``wait`` picks them up.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._drain(timeout)
        if persistent and self._backend is not None and self._pending:
            if deadline is None:
                self._backend_errors += self._call_backend(lambda b: b.wait(list(self._pending)))
                self._pending.clear()
            else:
                while self._pending:
                    done, errors = self._call_backend(lambda b: b.poll(list(self._pending)))
                    self._backend_errors += errors
                    for i in done:
                        self._pending.pop(i, None)
                    if self._pending and time.monotonic() >= deadline:
                        self._raise_pending()
                        raise BackendError(
                            f"{len(self._pending)} flush(es) to {self.config.persistent} not finished within "
                            f"{timeout}s (backend pid {self._backend.pid}, log {self.config.scratch}/"
                            ".deepfreeze-backend.log); they go on in the background: call wait() again")
                    if self._pending:
                        time.sleep(0.02)
        self._raise_pending()

    def close(self, *, wait: bool = True) -> None:
        try:
            if wait:
                self.wait(persistent=True)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        """Stop the writer thread and let go of the backend (it exits when idle)."""
        self._pool.shutdown(wait=True)
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    # -- internals
    def _drain(self, timeout: float | None = None, keep: int = 0) -> None:
        """Collect finished writes; wait (oldest first) until at most ``keep`` are in flight."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._inflight and (len(self._inflight) > keep or self._inflight[0].done()):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self._inflight[0].result(left)
            except concurrent.futures.TimeoutError:
                raise CheckpointWriteError(errno.ETIMEDOUT, f"the shard write to scratch {self.config.scratch} "
                                           f"did not finish within {timeout}s; it goes on: call wait() again")
            except BaseException as e:  # surfaced once, by _raise_pending
                self._error = self._error or e
            self._inflight.popleft()

    def _call_backend(self, fn: Callable[[BackendClient], Any]) -> Any:
        """``fn(backend)``; if the backend died, start a new one, re-send every flush not
        known to be done (flushes are idempotent), and call ``fn`` once more."""
        try:
            return fn(self._backend)
        except BackendError as e:
            log.warning("deepfreeze: rank %d lost its backend (%s); starting a new one and re-sending %d "
                        "pending flush(es)", self.rank, e, len(self._pending))
            self._backend.close()
            self._backend = BackendClient(self.config.scratch)
            jobs, self._pending = list(self._pending.values()), {}
            for job in jobs:
                self._pending[self._backend.flush(job)] = job
            return fn(self._backend)

    def _raise_pending(self) -> None:
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
        cfg = self.config
        t0 = time.perf_counter()
        try:
            path: str | None = self.scratch.write_shard(self.name, version, self.rank, self.plan, arrays,
                                                        chksum=cfg.chksum, run=self.run.id)
            failure = None
        except BaseException as e:  # still take part in the exchange below, so nobody waits for us
            path, failure = None, e
        if self.redundancy is not None:
            now = time.monotonic()
            want = self._last_ec is None or now - self._last_ec >= cfg.ec_interval
            if protect(self.comm, self.scratch, self.name, version, self.rank, path, self.redundancy, want=want,
                       run=self.run.id):
                self._last_ec = now
                manifest = dict(manifest, redundancy=self.redundancy)
        if failure is not None:
            raise failure
        self.scratch.write_manifest(self.name, version, manifest)
        self.write_times[version] = time.perf_counter() - t0
        job = {"name": self.name, "version": version, "rank": self.rank, "scratch": cfg.scratch,
               "persistent": cfg.persistent, "persistent_interval": cfg.persistent_interval,
               "keep_scratch": cfg.keep_scratch, "keep_persistent": cfg.max_versions,
               "watchdog_interval": cfg.watchdog_interval, "manifest": manifest, "run": self.run.id,
               "lease_timeout": cfg.lease_timeout, "shared_group": cfg.shared_group}
        if self._backend is not None:
            self._call_backend(lambda b: self._pending.__setitem__(b.flush(job), job))
            done, errors = self._call_backend(lambda b: b.poll(list(self._pending)))
            waiting = [i for i in self._pending if i not in done]
            if len(waiting) > self.max_pending_flushes:
                oldest = waiting[:-self.max_pending_flushes]
                errors += self._call_backend(lambda b: b.wait(oldest))
                done += oldest
            for i in done:
                self._pending.pop(i, None)
            self._backend_errors += errors
        else:
            flush_job(job, scratch_cls=type(self.scratch))


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


BACKGROUND_NICE = 10


def lower_priority() -> None:
    """Run the calling thread at nice +10 (Linux: per thread), so background writes yield
    the CPU to training (the paper's "background operations run with low priority")."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except (OSError, AttributeError):
        pass


ENGINES = ("builtin", "veloc", "auto")


def resolve_engine(engine: str | None) -> str:
    """``builtin`` or ``veloc`` for ``engine`` (``None``: ``$DEEPFREEZE_ENGINE``, else builtin;
    ``auto``: VeloC when its library can be loaded, else builtin)."""
    from .errors import ConfigError
    engine = engine or os.environ.get("DEEPFREEZE_ENGINE") or "builtin"
    if engine not in ENGINES:
        raise ConfigError(f"engine = {engine!r}: use 'builtin' (no dependency), 'veloc' (a VeloC install pointed "
                          "to by DEEPFREEZE_VELOC_PREFIX) or 'auto' (VeloC when found, else builtin)")
    if engine == "auto":
        from deepfreeze.bindings.veloc import available
        why = available()
        if why is not None:
            log.info("deepfreeze: engine='auto' uses the built-in engine: %s", why)
        return "builtin" if why is not None else "veloc"
    if engine == "veloc":
        from deepfreeze.bindings.veloc import available
        from .errors import VelocNotFoundError
        why = available()
        if why is not None:
            raise VelocNotFoundError(why)
    return engine


def make_engine(engine: str | None, config: Config, name: str, rank: int, plan: ShardPlan,
                domains: Sequence[str] | None = None, *, comm: Comm | None = None, mpi_comm: Any = None,
                scratch_cls: type = ScratchLevel, run: RunInfo | None = None) -> Engine:
    """The engine of one rank: :class:`Engine` or :class:`~deepfreeze.veloc_engine.VelocEngine`.
    ``comm`` carries the built-in redundancy exchange; ``mpi_comm`` (mpi4py) is VeloC's."""
    if resolve_engine(engine) == "veloc":
        from .veloc_engine import VelocEngine
        return VelocEngine(config, name, rank, plan, domains, mpi_comm=mpi_comm, scratch_cls=scratch_cls, run=run)
    return Engine(config, name, rank, plan, domains, scratch_cls=scratch_cls, comm=comm, run=run)
