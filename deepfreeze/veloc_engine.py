"""The VeloC engine: each rank's shard goes through a real VeloC (``engine="veloc"``).

Same interface and guarantees as :class:`deepfreeze.engine.Engine` (writer
thread, ``max_inflight`` queue, errors surfaced once), with VeloC doing the
scratch-to-persistent transfer, its checksums, versioning and (in its sync or
threaded modes) erasure coding. Per version and rank, in the writer thread:

1. ``VELOC_Checkpoint_wait`` for the previous version, then *assemble* it: the
   rank copies its pieces from the per-rank file VeloC flushed
   (``<persistent>/<name>/v<version>/r<rank>.dfs``) into the version's
   ``model.dfz`` with :meth:`deepfreeze.tiers.persistent.PersistentLevel.flush_shard`
   (same commit protocol as the built-in engine: the last rank writes the
   manifest) and deletes the per-rank file;
2. ``VELOC_Checkpoint_begin``; ``VELOC_Route_file`` with that persistent path as
   the *original*, which names VeloC's scratch file
   ``<scratch>/<name>-<rank>-<version>.dat``; the shard is written there in
   DeepFreeze's format (index, CRC32s) and hard-linked into DeepFreeze's scratch
   layout (``<scratch>/<name>/v<version>/r<rank>.dfs`` + manifest), so the
   built-in restore reads VeloC's scratch copies directly; ``VELOC_Checkpoint_end``.

In ``sync`` mode ``VELOC_Checkpoint_end`` returns after the flush and step 1 runs
at once. VeloC decides by itself, per rank, whether a version goes to persistent
(``persistent_interval``); a version some rank did not flush is never assembled
(the rank marks it ``skip``, as the built-in engine's ``decision`` file does, and
``PersistentLevel.retain`` sweeps it once a newer version commits).

VeloC 1.8 facts this relies on (``docs/veloc.md``): one ``veloc-backend`` daemon
per user and machine, found via ``$VELOC_BIN``, keeping the configuration it
started with (so this engine refuses to run against a backend started with
another configuration); in ``async`` mode the daemon runs with ``--disable-ec``.

The daemon's lifetime: every async ``VelocEngine`` holds a shared ``flock`` on
``/dev/shm/deepfreeze-veloc-users-<uid>`` (per user and machine, as the daemon) from before it starts (or finds) the daemon
until its ``close()``; the engine that closes last (it gets the lock exclusively)
stops the daemon if DeepFreeze started it (its configuration file is one
DeepFreeze wrote), so a leftover daemon does not refuse the user's next job with
another configuration. Stale files of a dead daemon (its ready file, its socket)
and VeloC's dangling ``<persistent>/<name>-<rank>-<version>.dat`` symlinks are
removed (:func:`clean_veloc_leftovers`). :func:`veloc_daemon_status` and
:func:`stop_veloc_daemon` are what ``deepfreeze backend status|stop`` report.

Construction (every rank): creates ``scratch``, ``persistent`` and ``meta``; writes the resolved
configuration as VeloC's INI file ``<scratch>/.deepfreeze-veloc-<digest>.cfg``
(:func:`write_veloc_config`, docs/configuration.md); loads the library
(``deepfreeze.bindings.veloc.Veloc()``); in ``sync`` (or ``threaded``) mode refuses a running
``veloc-backend`` daemon (:class:`~deepfreeze.errors.BackendError`: VeloC's in-process backend
would take over its socket), in ``async`` mode starts it if needed (:func:`start_backend`); then
``VELOC_Init`` collectively over ``mpi_comm`` (the adapter's ``MPIComm``'s duplicate of MPI's
world) or, at world size 1, ``VELOC_Init_single(rank)``. ``VELOC_Checkpoint_end(success)`` always
closes VeloC's phase of a version. ``wait()`` runs the finish step (1.) of the last version on the
writer thread (every VeloC call stays on that thread); ``close()`` waits, then calls
``VELOC_Finalize(1)`` there. Assembling a version also removes older uncommitted version
directories without a ``decision`` file and applies scratch retention. There is no DeepFreeze
partner/XOR exchange with this engine (it is made without ``comm``); VeloC's own erasure coding
acts only in its ``sync``/``threaded`` modes on two or more nodes, and restore does not read it.
"""
from __future__ import annotations

import fcntl
import logging
import os
import time
from typing import Any, Sequence

import numpy as np

from .config import Config
from .engine import Engine
from .errors import BackendError, CheckpointWriteError, VelocError
from .tiers.persistent import FencedError, PersistentLevel
from .tiers.scratch import ScratchLevel
from .tiers.shardbytes import write_shard_file
from .shardplan import ShardPlan
from .veloc_daemon import (clean_veloc_leftovers, open_users, same_config, start_backend, started_by_deepfreeze,
                           stop_backend, users_path, veloc_backend, write_veloc_config)

__all__ = ["VelocEngine"]

log = logging.getLogger("deepfreeze")
class VelocEngine(Engine):
    """Checkpoint engine of one rank over a real VeloC (see the module docstring)."""

    kind = "veloc"

    def __init__(self, config: Config, name: str, rank: int, plan: ShardPlan,
                 domains: Sequence[str] | None = None, *, mpi_comm: Any = None, scratch_cls: type = ScratchLevel,
                 max_pending_flushes: int | None = None, comm: Any = None, run: Any = None) -> None:
        from deepfreeze.bindings.veloc import Veloc  # raises VelocNotFoundError with what to do
        if plan.world_size > 1 and mpi_comm is None:
            raise ValueError("VelocEngine at world size > 1 needs mpi_comm (an mpi4py communicator)")
        super().__init__(config, name, rank, plan, domains, scratch_cls=scratch_cls,
                         max_pending_flushes=max_pending_flushes, run=run)
        self.persistent = PersistentLevel(config.persistent, shared_group=config.shared_group)
        for d in (config.scratch, config.persistent) + ((config.meta,) if config.meta else ()):
            self.scratch.makedirs(d)
        self.cfg_file = write_veloc_config(config, config.scratch)
        self.veloc = Veloc()  # loads the library and sets $VELOC_BIN from its prefix
        running = veloc_backend()
        in_process = config.mode == "sync" or dict(config.veloc_only).get("threaded", "").lower() == "true"
        if in_process and running is not None:
            raise BackendError(
                f"a veloc-backend (pid {running[0]}, config {running[1]}) is running for this user: VeloC's sync "
                "mode would take over its socket (/dev/shm/veloc-socket-<host>-<uid>) and break that job. Stop it "
                f"(kill {running[0]}) once its job is done, or use mode = async with the same configuration")
        self._users_fd: int | None = None
        if not in_process:
            # shared while this engine lives: the last engine to close stops the daemon DeepFreeze started
            try:
                self._users_fd = open_users(fcntl.LOCK_SH, 60.0)
                if self._users_fd is None:
                    log.warning("deepfreeze: %s has been locked for 60s (a job stopping the VeloC daemon, hung?): "
                                "going on without it", users_path())
            except BackendError as e:
                log.warning("deepfreeze: %s", e)
            try:
                self._stop_leftover_daemon()
                start_backend(self.cfg_file)
            except BaseException:
                if self._users_fd is not None:
                    os.close(self._users_fd)
                    self._users_fd = None
                raise
        if plan.world_size > 1:
            self.veloc.init(mpi_comm, self.cfg_file)
        else:
            self.veloc.init_single(rank, self.cfg_file)
        self._unfinished: tuple[int, dict[str, Any]] | None = None

    def _write(self, version: int, arrays: Sequence[np.ndarray], manifest: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self._finish()
        name, rank = self.name, self.rank
        original = os.path.join(self.persistent.version_dir(name, version), f"r{rank:06d}.dfs")
        if self.config.persistent_interval >= 0:  # else VeloC never flushes: no directory to leave behind
            self.persistent.makedirs(os.path.dirname(original))
        self.veloc.checkpoint_begin(name, version)
        ok = False
        try:
            routed = self.veloc.route_file(original)
            vdir = self.scratch.version_dir(name, version)
            try:
                write_shard_file(routed, version, rank, self.plan, arrays, chksum=self.config.chksum,
                                 run=self.run.id)
                self.scratch.makedirs(vdir)
                link = self.scratch.shard_path(name, version, rank)
                try:
                    os.unlink(link)
                except FileNotFoundError:
                    pass
                os.link(routed, link)
            except OSError as e:
                raise CheckpointWriteError(e.errno, f"writing shard of rank {rank} for {name!r} v{version} to "
                                           f"VeloC's scratch {routed} failed: {e.strerror}; nothing was committed. "
                                           "Free space or point 'scratch' elsewhere.") from e
            self.scratch.write_manifest(name, version, manifest)
            ok = True
        finally:
            self.veloc.checkpoint_end(ok)  # always closes VeloC's checkpoint phase
        self.write_times[version] = time.perf_counter() - t0
        self._unfinished = (version, manifest)
        if self.config.mode == "sync":
            self._finish()

    def _finish(self) -> None:
        """Wait for VeloC's flush of the last version and put this rank's pieces into its
        assembled file on persistent (committing it if this rank is the last)."""
        if self._unfinished is None:
            return
        version, manifest = self._unfinished
        self._unfinished = None
        try:
            self.veloc.checkpoint_wait()
        except VelocError as e:
            raise BackendError(f"VeloC could not flush {self.name!r} v{version} of rank {self.rank}: {e}") from e
        cfg, name = self.config, self.name
        flushed = os.path.join(self.persistent.version_dir(name, version), f"r{self.rank:06d}.dfs")
        if os.path.exists(flushed):
            try:
                committed = self.persistent.flush_shard(name, version, self.rank, flushed, manifest,
                                                        stale_after=cfg.lease_timeout)
            except FencedError as e:  # the name's lease went to another run: its version, not ours
                log.warning("deepfreeze: %s", e)
                committed = False
            os.unlink(flushed)  # the assembled file holds it now
            link = os.path.join(cfg.persistent, f"{name}-{self.rank}-{version}.dat")
            try:  # VeloC's symlink to it would dangle
                if os.path.islink(link):
                    os.unlink(link)
            except OSError:
                pass
            if committed:
                self.persistent.retain(name, cfg.max_versions)
        else:  # VeloC did not flush this rank's file (persistent_interval): the version cannot commit
            self.persistent.mark_skipped(name, version, self.run.id)
        for old in self.scratch.retain(name, self.rank, cfg.keep_scratch, upto=version):
            try:  # VeloC's name for the same file (the other hard link)
                os.unlink(os.path.join(cfg.scratch, f"{name}-{self.rank}-{old}.dat"))
            except FileNotFoundError:
                pass

    def wait(self, *, persistent: bool = True, timeout: float | None = None) -> None:
        self._drain(timeout)
        if persistent and self._unfinished is not None:
            self._inflight.append(self._pool.submit(self._finish))  # VeloC calls stay on the writer thread
            self._drain(timeout)
        self._raise_pending()

    def _shutdown(self) -> None:
        try:
            self._pool.submit(self.veloc.finalize, True).result()  # on the writer thread, like every call
        finally:
            self._pool.shutdown(wait=True)
            self._release_daemon()

    def _stop_leftover_daemon(self) -> None:
        """A daemon DeepFreeze started for another configuration that no DeepFreeze job uses any more
        (left by a job that died before its close()) is stopped, so this job can start its own."""
        running = veloc_backend()
        if running is None or self._users_fd is None or not started_by_deepfreeze(running[1]) \
                or same_config(self.cfg_file, running[1]):
            return
        try:  # exclusive: no other DeepFreeze engine of this user holds it (not atomic: at worst we refuse)
            fcntl.flock(self._users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # in use: start_backend refuses, naming it
        try:
            log.warning("deepfreeze: stopping the leftover VeloC daemon pid %d (config %s): no DeepFreeze job uses "
                        "it, and this job's configuration differs", running[0], running[1])
            stop_backend()
        finally:
            fcntl.flock(self._users_fd, fcntl.LOCK_SH)

    def _release_daemon(self) -> None:
        """Let go of the VeloC daemon; the last DeepFreeze engine of the user to do so stops it if
        DeepFreeze started it (a leftover daemon would refuse the next job's configuration)."""
        fd, self._users_fd = getattr(self, "_users_fd", None), None
        if fd is None:
            return
        try:
            try:  # not atomic (flock converts by unlocking first): at worst nobody stops it now
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another DeepFreeze job of this user uses the daemon
            running = veloc_backend()
            if running is not None and started_by_deepfreeze(running[1]):
                log.info("deepfreeze: stopping the VeloC daemon pid %d (no DeepFreeze job uses it any more)",
                         running[0])
                stop_backend()
                if veloc_backend() is not None:
                    log.warning("deepfreeze: the VeloC daemon pid %d did not exit after SIGTERM (stopped or stuck in "
                                "I/O?); left running: the next job with another configuration will be refused "
                                "until it is gone", running[0])
            clean_veloc_leftovers(self.config.persistent, self.name)
        except OSError as e:
            log.warning("deepfreeze: could not stop the VeloC daemon: %s", e)
        finally:
            os.close(fd)
