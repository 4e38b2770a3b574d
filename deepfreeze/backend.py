"""The active backend: one process per node that flushes scratch to persistent.

Started automatically by the first rank on a node that finds none listening
(``flock`` on a lock file elects one starter), shared by every rank whose
``scratch`` is the same directory, and stopped cleanly: it exits once no client
is connected and its queue is empty for ``DEEPFREEZE_BACKEND_IDLE`` seconds
(default 5), or on ``stop``. It imports no TensorFlow, so it starts in well
under a second and stays small.

IPC: a Unix stream socket, owner-only (``0700`` directory, ``0600`` socket),
one JSON object per line in each direction. Requests::

    {"op": "hello"}                      -> {"ok": true, "pid": N}
    {"op": "flush", "job": {...}}        -> {"ok": true, "id": N}        (queued)
    {"op": "wait", "ids": [...]}         -> {"ok": true, "errors": [...]} (when those jobs are done)
    {"op": "poll", "ids": [...]}         -> {"ok": true, "done": [...], "errors": [...]} (now)
    {"op": "status"}                     -> {"ok": true, "pid": N, "pending": N, "clients": N, "jobs": N,
                                             "overdue": [watchdog messages]}
    {"op": "stop"}                       -> {"ok": true}  (drains the queue, then exits)

Jobs run one at a time, in arrival order, in the thread ``deepfreeze-flusher``
through :func:`deepfreeze.levels.flush_job`, the same code sync mode runs in
the client. A failed job's error is reported to whoever waits for it.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from . import crashpoints as cp
from . import ownership
from .errors import BackendError, UnsafePathError
from .levels import ScratchLevel, flush_job

__all__ = ["socket_path", "BackendClient", "serve", "main"]

log = logging.getLogger("deepfreeze.backend")
_MAX_LINE = 256 << 20


def runtime_dir() -> str:
    base = os.environ.get("DEEPFREEZE_RUNTIME_DIR") or os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    path = os.path.join(base, f"deepfreeze-{os.getuid()}")
    try:  # base may be sticky (/tmp); the directory itself must be ours, never a link (deepfreeze.ownership)
        ownership.ensure_dir(path, base)
    except UnsafePathError as e:
        raise BackendError(f"unsafe backend runtime directory: {e}") from e
    st = os.lstat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise BackendError(f"{path} must be a directory owned by you with mode 0700 (it holds the backend "
                           "socket); remove it or set DEEPFREEZE_RUNTIME_DIR to a private directory")
    return path


def socket_path(scratch: str) -> str:
    """The backend socket serving the node whose scratch directory is ``scratch``."""
    key = hashlib.sha1(os.path.realpath(scratch).encode()).hexdigest()[:16]
    return os.path.join(runtime_dir(), f"backend-{key}.sock")


def _send(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


class _Lines:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def read(self) -> dict[str, Any] | None:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                return None
            self.buf += chunk
            if len(self.buf) > _MAX_LINE:
                raise ValueError("message too long")
        line, self.buf = self.buf.split(b"\n", 1)
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise ValueError("message is not an object")
        return obj


# ----------------------------------------------------------------------------- server

class _Server:
    def __init__(self, path: str, idle: float) -> None:
        self.path, self.idle = path, idle
        self.jobs: "queue.Queue[tuple[int, dict] | None]" = queue.Queue()
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

    def watchdog(self) -> None:
        """Log (once per silence) a client whose last checkpoint is older than its watchdog_interval."""
        while not self.stopping:
            time.sleep(0.5)
            now = time.monotonic()
            with self.cond:
                for w in self.watched.values():
                    if not w["fired"] and now > w["deadline"]:
                        w["fired"] = True
                        msg = (f"watchdog: {w['who']} sent no checkpoint for {now - w['last']:.1f}s "
                               f"(watchdog_interval = {w['interval']:g}s): hung, or checkpointing less often")
                        log.error("%s", msg)
                        self.overdue.append(msg)

    def flusher(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            jid, job = item
            err = None
            t0 = time.monotonic()
            try:
                res = flush_job(job)
                log.info("job %d: %s v%d rank %d %s in %.3fs", jid, job["name"], job["version"], job["rank"],
                         "committed" if res["committed"] else "flushed" if res["flushed"] else "kept on scratch",
                         time.monotonic() - t0)
            except Exception as e:  # reported to the waiter; the backend keeps serving
                err = f"{type(e).__name__}: {e}"
                log.error("job %d (%s v%s rank %s) failed: %s", jid, job.get("name"), job.get("version"),
                          job.get("rank"), err)
            with self.cond:
                self.results[jid] = err
                self.last_activity = time.monotonic()
                self.cond.notify_all()

    def handle(self, conn: socket.socket) -> None:
        with self.cond:
            self.clients += 1
        lines = _Lines(conn)
        try:
            while True:
                req = lines.read()
                if req is None:
                    return
                op = req.get("op")
                if op == "hello":
                    _send(conn, {"ok": True, "pid": os.getpid()})
                elif op == "flush":
                    job = req["job"]
                    with self.cond:
                        jid = self.next_id
                        self.next_id += 1
                        self.results[jid] = "pending"
                        interval = float(job.get("watchdog_interval") or 0)
                        if interval > 0:
                            now = time.monotonic()
                            self.watched[id(conn)] = {
                                "who": f"rank {job.get('rank')} of {job.get('name')!r}", "interval": interval,
                                "deadline": now + interval, "last": now, "fired": False}
                    self.jobs.put((jid, req["job"]))
                    _send(conn, {"ok": True, "id": jid})
                elif op == "wait":
                    ids = [int(i) for i in req.get("ids", [])]
                    with self.cond:
                        self.cond.wait_for(lambda: all(self.results.get(i) != "pending" for i in ids))
                        errors = [self.results.pop(i, None) for i in ids]
                    _send(conn, {"ok": True, "errors": [e for e in errors if e]})
                elif op == "poll":  # non-blocking: which of these jobs are done, and their errors
                    ids = [int(i) for i in req.get("ids", [])]
                    with self.cond:
                        done = [i for i in ids if self.results.get(i, None) != "pending"]
                        errors = [e for e in (self.results.pop(i, None) for i in done) if e]
                    _send(conn, {"ok": True, "done": done, "errors": errors})
                elif op == "status":
                    with self.cond:
                        pending = sum(1 for v in self.results.values() if v == "pending")
                        _send(conn, {"ok": True, "pid": os.getpid(), "pending": pending,
                                     "clients": self.clients, "jobs": self.next_id,
                                     "overdue": list(self.overdue)})
                elif op == "stop":
                    self.stopping = True
                    _send(conn, {"ok": True})
                else:
                    _send(conn, {"ok": False, "error": f"unknown op {op!r}"})
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("client connection dropped: %s", e)
        finally:
            conn.close()
            with self.cond:
                self.watched.pop(id(conn), None)
                self.clients -= 1
                self.last_activity = time.monotonic()

    def idle_now(self) -> bool:
        with self.cond:
            busy = self.clients > 0 or any(v == "pending" for v in self.results.values())
            if self.stopping:
                return not any(v == "pending" for v in self.results.values())
            return not busy and time.monotonic() - self.last_activity >= self.idle


def serve(path: str, idle: float = 5.0) -> None:
    """Run a backend on ``path`` until idle or stopped."""
    srv = _Server(path, idle)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        if os.path.exists(path):
            cp.unlink(path, "backend.socket.unlink")
        sock.bind(path)
    finally:
        os.umask(old)
    inode = os.stat(path).st_ino
    sock.listen(64)
    sock.settimeout(0.2)
    threading.Thread(target=srv.flusher, name="deepfreeze-flusher", daemon=True).start()
    threading.Thread(target=srv.watchdog, name="deepfreeze-watchdog", daemon=True).start()
    log.info("backend %d listening on %s", os.getpid(), path)
    try:
        while not srv.idle_now():
            try:
                conn, _ = sock.accept()
            except socket.timeout:
                continue
            conn.settimeout(None)
            threading.Thread(target=srv.handle, args=(conn,), name="deepfreeze-backend-conn",
                             daemon=True).start()
    finally:
        srv.jobs.put(None)
        try:
            if os.stat(path).st_ino == inode:  # not a successor's socket
                cp.unlink(path, "backend.socket.unlink")
        except OSError:
            pass
        sock.close()
        log.info("backend %d stopped", os.getpid())


# ----------------------------------------------------------------------------- client

class BackendClient:
    """A connection to the node's backend; starts one if none is listening."""

    def __init__(self, scratch: str, *, start: bool = True, timeout: float = 60.0) -> None:
        self.path = socket_path(scratch)
        self.scratch = scratch
        self._lock = threading.Lock()
        self.sock = self._connect()
        if self.sock is None and start:
            self.sock = self._spawn(timeout)
        if self.sock is None:
            raise BackendError(f"no DeepFreeze backend listens on {self.path} for scratch {scratch}")

    def _connect(self) -> socket.socket | None:
        """A connection to a live backend that answered ``hello``, or None (none, or a dying one)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self.path)
            _send(s, {"op": "hello"})
            lines = _Lines(s)
            resp = lines.read()
            if not resp or not resp.get("ok"):
                raise OSError("no hello")
        except (OSError, ValueError):
            s.close()
            return None
        self._lines, self.pid = lines, resp["pid"]
        return s

    def _spawn(self, timeout: float) -> socket.socket:
        with open(self.path + ".lock", "a") as lockf:
            fcntl.flock(lockf, fcntl.LOCK_EX)
            s = self._connect()
            if s is not None:
                return s
            ScratchLevel(self.scratch).makedirs(self.scratch)
            logf = os.fdopen(ownership.open_private(os.path.join(self.scratch, ".deepfreeze-backend.log"),
                                                    os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab")  # no link, 0600
            proc = subprocess.Popen([sys.executable, "-m", "deepfreeze.backend", "--socket", self.path],
                                    stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                    start_new_session=True, close_fds=True)
            logf.close()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                s = self._connect()
                if s is not None:
                    return s
                if proc.poll() is not None:
                    raise BackendError(f"the DeepFreeze backend exited with code {proc.returncode} at start; "
                                       f"see {self.scratch}/.deepfreeze-backend.log")
                time.sleep(0.02)
            proc.kill()
            raise BackendError(f"the DeepFreeze backend did not listen on {self.path} within {timeout}s")

    def request(self, obj: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            try:
                _send(self.sock, obj)
                resp = self._lines.read()
            except (OSError, ValueError) as e:
                raise BackendError(f"lost the DeepFreeze backend on {self.path} during {obj.get('op')!r}: {e}; "
                                   f"see {self.scratch}/.deepfreeze-backend.log") from e
        if resp is None:
            raise BackendError(f"the DeepFreeze backend on {self.path} closed the connection during "
                               f"{obj.get('op')!r}; see {self.scratch}/.deepfreeze-backend.log")
        if not resp.get("ok"):
            raise BackendError(f"backend refused {obj.get('op')!r}: {resp.get('error')}")
        return resp

    def flush(self, job: dict[str, Any]) -> int:
        return self.request({"op": "flush", "job": job})["id"]

    def wait(self, ids: list[int]) -> list[str]:
        return self.request({"op": "wait", "ids": ids})["errors"] if ids else []

    def poll(self, ids: list[int]) -> tuple[list[int], list[str]]:
        if not ids:
            return [], []
        r = self.request({"op": "poll", "ids": ids})
        return r["done"], r["errors"]

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepfreeze.backend", description=__doc__.split("\n")[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--idle", type=float, default=float(os.environ.get("DEEPFREEZE_BACKEND_IDLE", "5")))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s backend[%(process)d] %(levelname)s %(message)s")
    try:
        os.nice(10)  # flushes yield the CPU to training on the same node
    except OSError:
        pass
    serve(args.socket, args.idle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
