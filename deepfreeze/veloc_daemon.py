"""This user's VeloC daemon (``veloc-backend``: one per user and machine), as DeepFreeze manages it.

VeloC's configuration file written from a :class:`~deepfreeze.config.Config`
(:func:`write_veloc_config`), the daemon found, started and stopped (:func:`veloc_backend`,
:func:`start_backend`, :func:`stop_backend`), its DeepFreeze users counted with a shared ``flock``
so the last user stops a daemon DeepFreeze started, its stale files and VeloC's dangling symlinks
removed (:func:`clean_veloc_leftovers`), and its status for ``deepfreeze backend status|stop``
(:func:`veloc_daemon_status`, :func:`stop_veloc_daemon`). The engine that uses the daemon is
:class:`deepfreeze.veloc_engine.VelocEngine` (its docstring has the daemon's lifetime); this module
is below it and below :mod:`deepfreeze.backend`, which reports the daemon beside its own status.
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
from typing import Any

from .config import Config
from .errors import BackendError
from .fsafe import atomic_write
from .node import process_state
from .ownership import runtime_dir

__all__ = ["open_users", "same_config", "started_by_deepfreeze", "users_path", "write_veloc_config", "veloc_settings", "veloc_backend", "start_backend", "stop_backend",
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
    if not same_config(cfg_file, running[1]):
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


def started_by_deepfreeze(cfg_file: str | None) -> bool:
    return bool(cfg_file) and bool(_OUR_CFG.match(os.path.basename(cfg_file)))


def users_path() -> str:
    """Per user and machine, like the daemon (next to VeloC's ready file), not per runtime directory:
    a batch job and a login shell of the user must see the same users."""
    if os.path.isdir("/dev/shm"):
        return f"/dev/shm/deepfreeze-veloc-users-{os.getuid()}"
    return os.path.join(runtime_dir(), "veloc-daemon.users")


def open_users(mode: int, timeout: float) -> int | None:
    """An fd of the daemon users file holding ``flock(mode)`` (timed ``LOCK_NB`` loop), or None
    (the lock was not had within ``timeout``; for ``LOCK_EX`` with timeout 0: others use it).
    ``BackendError`` if the file is not this user's regular file (planted in the shared /dev/shm)."""
    path = users_path()
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
    running = veloc_backend()
    if running is None:
        return None
    pid, cfg = running
    try:
        fd = open_users(fcntl.LOCK_EX, 0)
    except (OSError, BackendError):
        in_use = None
    else:
        in_use = fd is None
        if fd is not None:
            os.close(fd)
    ours = started_by_deepfreeze(cfg)
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
            fd = open_users(fcntl.LOCK_EX, 0)
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


def same_config(a: str, b: str | None) -> bool:
    if b is None:
        return False
    try:
        with open(a) as fa, open(b) as fb:
            return fa.read() == fb.read()
    except OSError:
        return False


