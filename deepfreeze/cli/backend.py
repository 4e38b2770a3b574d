"""``deepfreeze backend status|stop``: talk to the backend process serving a scratch directory."""
from __future__ import annotations

import argparse
import socket
import time
from typing import Any

from ..backend import BackendClient, socket_path
from ..errors import BackendError
from ._common import EXIT_FAIL, EXIT_OK, emit_json, load_config

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, parents: dict[str, argparse.ArgumentParser]) -> None:
    p = sub.add_parser("backend", parents=[parents["common"]], help="status or stop of this scratch's backend process",
                       description="Talk to the backend process serving the configured scratch directory.")
    p.add_argument("action", choices=["status", "stop"])
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="stop: seconds to wait for the backend to drain its queue and exit (default 60)")
    p.set_defaults(func=run)


def _listening(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    path = socket_path(cfg.scratch)  # BackendError here (bad runtime dir) is an error, not "not running"
    try:
        client = BackendClient(cfg.scratch, start=False)
    except BackendError:
        if args.json:
            emit_json({"running": False, "socket": path, "scratch": cfg.scratch})
        else:
            print(f"backend for scratch {cfg.scratch}: not running (socket {path})")
        return EXIT_OK
    try:
        st = client.request({"op": "status"})
        info = {"running": True, "pid": st["pid"], "socket": path, "scratch": cfg.scratch,
                "pending": st["pending"], "clients": max(0, st["clients"] - 1), "jobs": st["jobs"],
                "overdue": st.get("overdue", [])}
        if args.action == "stop":
            client.request({"op": "stop"})
    finally:
        client.close()
    if args.action == "status":
        if args.json:
            emit_json(info)
        else:
            print(f"backend for scratch {cfg.scratch}: running, pid {info['pid']}, {info['pending']} flush job(s) "
                  f"pending, {info['jobs']} received, {info['clients']} other client(s) connected "
                  f"(socket {path})")
            for msg in info["overdue"]:
                print(f"  {msg}")
        return EXIT_OK
    # stop: the backend drains its queue, then exits and removes its socket
    deadline = time.monotonic() + args.timeout
    while _listening(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    stopped = not _listening(path)
    info.update(running=not stopped, stop_requested=True)
    if args.json:
        emit_json(info)
    elif stopped:
        print(f"backend pid {info['pid']} for scratch {cfg.scratch}: stopped"
              + (f" after draining {info['pending']} pending flush job(s)" if info["pending"] else ""))
    else:
        print(f"backend pid {info['pid']} for scratch {cfg.scratch}: stop requested; still draining "
              f"{info['pending']} pending flush job(s) after {args.timeout:g}s")
    return EXIT_OK if stopped else EXIT_FAIL
