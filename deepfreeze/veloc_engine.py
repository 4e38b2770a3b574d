"""The VeloC engine: each rank's shard goes through a real VeloC (``engine="veloc"``).

Same interface and guarantees as :class:`deepfreeze.engine.Engine` (writer
thread, ``max_inflight`` queue, errors surfaced once), with VeloC doing the
scratch-to-persistent transfer, its checksums, versioning and (in its sync or
threaded modes) erasure coding. Per version and rank, in the writer thread:

1. ``VELOC_Checkpoint_wait`` for the previous version, then *assemble* it: the
   rank copies its pieces from the per-rank file VeloC flushed
   (``<persistent>/<name>/v<version>/r<rank>.dfs``) into the version's
   ``model.dfz`` with :meth:`deepfreeze.levels.PersistentLevel.flush_shard`
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
import glob
import hashlib
import logging
import math
import os
import re
import shutil
import socket
import stat
import time
from typing import Any, Sequence

import numpy as np

from .config import Config
from .engine import Engine
from .errors import BackendError, CheckpointWriteError, VelocError
from .levels import FencedError, PersistentLevel, ScratchLevel, atomic_write, write_shard_file
from .shardplan import ShardPlan

__all__ = ["VelocEngine", "write_veloc_config", "veloc_settings", "veloc_backend", "start_backend", "stop_backend",
           "veloc_daemon_status", "stop_veloc_daemon", "clean_veloc_leftovers"]

log = logging.getLogger("deepfreeze")
READY_FILE = "/dev/shm/veloc-backend-ready-{uid}"
#: VeloC's daemon socket: ``veloc-socket-<host>-<uid>`` in 1.8 (``veloc-socket-<uid>`` before)
SOCKET_GLOB = "/dev/shm/veloc-socket-*"
#: the name of a configuration file DeepFreeze wrote (:func:`write_veloc_config`)
_OUR_CFG = re.compile(r"^\.deepfreeze-veloc-[0-9a-f]{12}\.cfg$")
#: VeloC's per-rank symlink on persistent, ``<name>-<rank>-<version>.dat``
_VELOC_LINK = re.compile(r"^[A-Za-z0-9_.]+-\d+-\d+\.dat$")


def _seconds(value: float) -> int:
    """VeloC reads intervals as whole seconds: negative stays off (-1), positive rounds up."""
    return -1 if value < 0 else math.ceil(value)


def veloc_settings(config: Config) -> dict[str, str]:
    """The effective configuration (file < ``VELOC_<KEY>`` < overrides) as VeloC's keys.
    ``failure_domain`` is left out: VeloC 1.8 does not read it (its EC uses one domain per node)."""
    out = {"mode": config.mode, "scratch": config.scratch, "persistent": config.persistent,
           "persistent_interval": str(_seconds(config.persistent_interval)),
           "ec_interval": str(_seconds(config.ec_interval)),
           # VeloC's own scratch retention deletes every rank's file of an old version when the first
           # rank moves on, racing the other ranks' flushes: DeepFreeze retains scratch itself.
           "max_versions": str(config.max_versions), "scratch_versions": "0",
           "chksum": "true" if config.chksum and config.meta else "false"}
    if config.watchdog_interval > 0:
        out["watchdog_interval"] = str(_seconds(config.watchdog_interval))
    if config.meta:
        out["meta"] = config.meta
    if config.axl_type:
        out["axl_type"] = config.axl_type
    out.update(config.veloc_only)
    return out


def write_veloc_config(config: Config, directory: str) -> str:
    """Write the effective configuration as VeloC's INI file in ``directory``; returns its path.

    The name carries a digest of the content, so two different configurations never share a
    file (the running backend's file then tells which configuration it was started with).
    VeloC lets ``VELOC_<KEY>`` environment variables win over its file; DeepFreeze's keyword
    overrides win over them, so any such variable that disagrees is set to the value used here.
    """
    settings = veloc_settings(config)
    for key, value in settings.items():
        env = "VELOC_" + key.upper()
        if env in os.environ and os.environ[env] != value:
            log.warning("deepfreeze: %s=%s overridden by the configuration in code (%s) for VeloC",
                        env, os.environ[env], value)
            os.environ[env] = value
    text = "# written by DeepFreeze from its resolved configuration\n" + \
        "".join(f"{k} = {v}\n" for k, v in settings.items())
    path = os.path.join(directory, f".deepfreeze-veloc-{hashlib.sha256(text.encode()).hexdigest()[:12]}.cfg")
    atomic_write(path, text.encode(), fsync=False, point="veloc.config")
    return path


def veloc_backend() -> tuple[int, str | None] | None:
    """(pid, config file) of this user's running ``veloc-backend``, or None."""
    try:
        with open(READY_FILE.format(uid=os.getuid()), "rb") as f:
            raw = f.read(4)
    except OSError:
        return None
    if len(raw) != 4:
        return None
    pid = int.from_bytes(raw, "little")
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read(1 << 16).split(b"\0") if a]
    except OSError:
        return None  # stale ready file: VeloC starts a new backend
    if not argv or not os.path.basename(argv[0]).startswith("veloc-backend"):
        return None
    cfg = next((a for a in argv[1:] if not a.startswith("--")), None)
    return pid, cfg


def start_backend(cfg_file: str, timeout: float = 60) -> int:
    """Start this user's ``veloc-backend`` on ``cfg_file`` unless one runs; return its pid.

    DeepFreeze starts it itself, before ``VELOC_Init`` (whose own start then finds it
    running), so that the daemon inherits no file descriptor of the caller: started
    through VeloC's ``system()`` it keeps the caller's pipes open, and whoever reads
    them (a test harness, ``| tee``) waits for it forever. Raises BackendError if the
    running backend was started with another configuration (VeloC would ignore ours).
    """
    import subprocess
    if veloc_backend() is None:
        clean_veloc_leftovers()  # a dead daemon's ready file or socket would make VeloC's start fail
        bindir = os.environ.get("VELOC_BIN")
        exe = os.path.join(bindir, "veloc-backend") if bindir else shutil.which("veloc-backend")
        if not exe or not os.access(exe, os.X_OK):
            raise BackendError("veloc-backend was not found: set VELOC_BIN to the directory holding it "
                               "(<VeloC prefix>/bin), or put it on PATH")
        try:  # the backend forks its daemon and returns once the daemon is ready
            subprocess.run([exe, cfg_file, "--disable-ec"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True, timeout=timeout,
                           check=True)
        except (OSError, subprocess.SubprocessError) as e:
            raise BackendError(f"starting {exe} {cfg_file} failed: {e}; see /dev/shm/veloc-backend-*.log") from e
    running = veloc_backend()
    if running is None:
        raise BackendError("veloc-backend did not come up; see /dev/shm/veloc-backend-*.log")
    if not _same_config(cfg_file, running[1]):
        raise BackendError(
            f"a veloc-backend (pid {running[0]}, config {running[1]}) is already running for this user; "
            "VeloC keeps one backend per user and machine with the configuration it started with, so "
            f"this job's configuration ({cfg_file}) would be ignored. Stop it (kill {running[0]}) once its "
            "job is done, or use the same scratch, persistent and other keys")
    return running[0]


def stop_backend(timeout: float = 10) -> int | None:
    """Stop this user's ``veloc-backend`` (SIGTERM) and wait for it to go; returns its pid."""
    import signal
    running = veloc_backend()
    if running is None:
        return None
    os.kill(running[0], signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while veloc_backend() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return running[0]


def _started_by_deepfreeze(cfg_file: str | None) -> bool:
    return bool(cfg_file) and bool(_OUR_CFG.match(os.path.basename(cfg_file)))


def _users_path() -> str:
    """Per user and machine, like the daemon (next to VeloC's ready file), not per runtime directory:
    a batch job and a login shell of the user must see the same users."""
    if os.path.isdir("/dev/shm"):
        return f"/dev/shm/deepfreeze-veloc-users-{os.getuid()}"
    from .backend import runtime_dir
    return os.path.join(runtime_dir(), "veloc-daemon.users")


def _open_users(mode: int, timeout: float) -> int | None:
    """An fd of the daemon users file holding ``flock(mode)`` (timed ``LOCK_NB`` loop), or None
    (the lock was not had within ``timeout``; for ``LOCK_EX`` with timeout 0: others use it).
    ``BackendError`` if the file is not this user's regular file (planted in the shared /dev/shm)."""
    path = _users_path()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as e:
        raise BackendError(f"cannot open {path} (the lock of the VeloC daemon's DeepFreeze users): {e}; "
                           "remove it if it is not yours") from e
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise BackendError(f"{path} is not a regular file owned by you: remove it (another user may have "
                           "planted it); until then the VeloC daemon is not stopped at close()")
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.05)


def _veloc_socket_stale(path: str) -> bool:
    """True if ``path`` is this user's socket file and nothing listens on it."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
        return False  # a live daemon (or an in-process sync backend) listens
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        s.close()


def clean_veloc_leftovers(persistent: str | None = None, name: str | None = None) -> list[str]:
    """Remove what a dead VeloC daemon and VeloC's flushes leave behind; returns the removed paths.

    * with no live ``veloc-backend`` of this user: its ready file (a stale pid there makes VeloC's
      next start believe a daemon runs, or a reused pid makes ``kill(pid, 0)`` succeed) unless a
      starting daemon holds its lock, and this user's ``/dev/shm/veloc-socket-*`` files nothing
      listens on (VeloC's bind fails on them: "Address already in use");
    * in ``persistent`` (for checkpoint ``name``, or all): VeloC's
      ``<name>-<rank>-<version>.dat`` symlinks whose target is gone (DeepFreeze deletes the per-rank
      file once it is assembled). Only symlinks are touched, never followed.
    """
    removed: list[str] = []
    uid = os.getuid()
    if veloc_backend() is None:
        ready = READY_FILE.format(uid=uid)
        try:
            fd = os.open(ready, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                if os.fstat(fd).st_uid == uid:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a starting daemon holds it: leave it
                    if veloc_backend() is None:
                        os.unlink(ready)
                        removed.append(ready)
            except OSError:
                pass
            finally:
                os.close(fd)
        for path in glob.glob(SOCKET_GLOB):
            if path.endswith(f"-{uid}") and _veloc_socket_stale(path):
                try:
                    os.unlink(path)
                    removed.append(path)
                except OSError:
                    pass
    if persistent:
        try:
            names = os.listdir(persistent)
        except OSError:
            names = []
        for n in names:
            if not _VELOC_LINK.match(n) or (name is not None and not n.startswith(name + "-")):
                continue
            path = os.path.join(persistent, n)
            try:
                if stat.S_ISLNK(os.lstat(path).st_mode) and not os.path.exists(path):
                    os.unlink(path)
                    removed.append(path)
            except OSError:
                pass
    for path in removed:
        log.info("deepfreeze: removed VeloC's stale %s", path)
    return removed


def veloc_daemon_status() -> dict[str, Any] | None:
    """This user's ``veloc-backend`` (one per user and machine) as a dict, or None if none runs:
    ``state`` (``"running"``), ``pid``, ``config``, ``process`` (kernel state, e.g. ``"T (stopped)"``),
    ``deepfreeze`` (DeepFreeze started it: the configuration file is one it wrote), ``in_use``
    (a DeepFreeze job of this user holds it; None if unknown) and ``message``. Never blocks."""
    from .backend import process_state
    running = veloc_backend()
    if running is None:
        return None
    pid, cfg = running
    try:
        fd = _open_users(fcntl.LOCK_EX, 0)
    except (OSError, BackendError):
        in_use = None
    else:
        in_use = fd is None
        if fd is not None:
            os.close(fd)
    ours = _started_by_deepfreeze(cfg)
    return {"state": "running", "pid": pid, "config": cfg, "process": process_state(pid), "deepfreeze": ours,
            "in_use": in_use,
            "message": (f"VeloC daemon (veloc-backend): running, pid {pid} ({process_state(pid) or 'state unknown'}), "
                        f"config {cfg}, " + ("started by DeepFreeze" if ours else "not started by DeepFreeze")
                        + {True: ", used by a DeepFreeze job", False: ", no DeepFreeze job uses it",
                           None: ""}[in_use])}


def stop_veloc_daemon(timeout: float = 10.0, *, force: bool = False) -> dict[str, Any] | None:
    """Stop this user's ``veloc-backend`` if DeepFreeze started it and no DeepFreeze job uses it
    (``force``: in any case); then remove stale VeloC files. Returns None if none ran, else
    :func:`veloc_daemon_status` with ``state`` ``"stopped"``, ``"still running"`` (SIGTERM sent,
    not gone after ``timeout``: a stopped or hung process), ``"in use"`` or ``"not DeepFreeze's"``,
    and ``message``."""
    info = veloc_daemon_status()
    if info is None:
        clean_veloc_leftovers()
        return None
    pid = info["pid"]
    if not force and not info["deepfreeze"]:
        info.update(state="not DeepFreeze's", message=(
            f"VeloC daemon pid {pid} (config {info['config']}) was not started by DeepFreeze: left running "
            f"(stop it with kill {pid} once no job uses it)"))
        return info
    fd = None
    if not force:
        try:
            fd = _open_users(fcntl.LOCK_EX, 0)
        except (OSError, BackendError):
            fd = None
        if fd is None:
            info.update(state="in use", message=f"VeloC daemon pid {pid}: a DeepFreeze job of this user uses it; "
                                                "left running")
            return info
    try:
        stop_backend(timeout)
        gone = veloc_backend() is None
    finally:
        if fd is not None:
            os.close(fd)
    if gone:
        clean_veloc_leftovers()
        info.update(state="stopped", message=f"VeloC daemon pid {pid}: stopped")
    else:
        info.update(state="still running", message=(
            f"VeloC daemon pid {pid} ({info['process']}): SIGTERM sent, still running after {timeout:g}s "
            f"(stopped or stuck in I/O?); not killed: kill -9 {pid} yourself once it is safe"))
    return info


def _same_config(a: str, b: str | None) -> bool:
    if b is None:
        return False
    try:
        with open(a) as fa, open(b) as fb:
            return fa.read() == fb.read()
    except OSError:
        return False


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
                self._users_fd = _open_users(fcntl.LOCK_SH, 60.0)
                if self._users_fd is None:
                    log.warning("deepfreeze: %s has been locked for 60s (a job stopping the VeloC daemon, hung?): "
                                "going on without it", _users_path())
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
        if running is None or self._users_fd is None or not _started_by_deepfreeze(running[1]) \
                or _same_config(self.cfg_file, running[1]):
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
            if running is not None and _started_by_deepfreeze(running[1]):
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
