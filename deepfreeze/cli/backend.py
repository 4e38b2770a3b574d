"""``deepfreeze backend status|stop``: talk to the backend process serving a scratch directory."""
from __future__ import annotations

import argparse
from typing import Any

from ..backend import status as backend_status
from ..backend import stop as backend_stop
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


def run(args: argparse.Namespace) -> int:
    """Thin over :func:`deepfreeze.backend.status` / :func:`~deepfreeze.backend.stop`: both answer
    within their bounds, also for a backend that accepts but never answers ("unresponsive")."""
    cfg = load_config(args.config, args.overrides)
    if args.action == "status":
        info = backend_status(cfg.scratch, timeout=2.0)
        ok = info["state"] != "unresponsive"
    else:
        info = backend_stop(cfg.scratch, timeout=args.timeout)
        ok = info["state"] in ("stopped", "none")
    if args.json:
        emit_json(info)
    else:
        print(info["message"])
        for msg in info.get("overdue", []):
            print(f"  {msg}")
        if info.get("veloc"):
            print(info["veloc"]["message"])
    return EXIT_OK if ok else EXIT_FAIL
