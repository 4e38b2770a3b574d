"""A backend of protocol 1 (DeepFreeze before ``hello`` carried a version): a real process, for
tests/test_flush_job.py.

``python old_backend.py SOCKET LOG``: listens on the Unix socket SOCKET (owner-only) and speaks the
old protocol as the old backend did: ``hello`` -> ``{"ok": true, "pid": N}`` (no ``protocol``),
``flush`` -> ``{"ok": true, "id": N}`` (the job taken as it comes: an untyped dict), ``poll``/``wait``
-> every id done, ``status`` -> the old status keys, ``stop`` -> exits. Every request is appended
to LOG (one JSON line each), so a test can tell what a client of another version sent it. It runs
no flush (a client that mistook it for its own backend would find its versions never committed).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _util import lines_of  # noqa: E402


def main(path: str, log: str) -> int:
    lock = threading.Lock()
    jobs: list[int] = []
    stop = threading.Event()

    def record(req: dict) -> None:
        with lock, open(log, "a") as f:
            f.write(json.dumps(req) + "\n")

    def serve(conn: socket.socket) -> None:
        with conn:
            for line in lines_of(conn, 1 << 20, stop):
                req = json.loads(line)
                record(req)
                op = req.get("op")
                if op == "hello":
                    resp = {"ok": True, "pid": os.getpid()}
                elif op == "flush":
                    with lock:
                        jobs.append(len(jobs))
                        resp = {"ok": True, "id": jobs[-1]}
                elif op in ("poll", "wait"):
                    resp = {"ok": True, "done": list(req.get("ids", [])), "errors": [], "unknown": [],
                            "stalled": 0.0}
                elif op == "status":
                    resp = {"ok": True, "pid": os.getpid(), "pending": 0, "clients": 1, "jobs": len(jobs),
                            "overdue": []}
                elif op == "stop":
                    resp = {"ok": True}
                    stop.set()
                else:
                    resp = {"ok": False, "error": f"unknown op {op!r}"}
                conn.sendall(json.dumps(resp).encode() + b"\n")

    old = os.umask(0o177)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    os.umask(old)
    inode = os.stat(path).st_ino
    s.listen(16)
    s.settimeout(0.2)
    print("listening", flush=True)
    try:
        while not stop.is_set():
            try:
                conn, _ = s.accept()
            except socket.timeout:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
    finally:
        s.close()
        try:
            if os.stat(path).st_ino == inode:  # not a successor's socket (as the old backend did)
                os.unlink(path)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
