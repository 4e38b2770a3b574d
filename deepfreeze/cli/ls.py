"""``deepfreeze ls``: versions per level with their status."""
from __future__ import annotations

import argparse
from typing import Any

from ..config import validate_name
from ..errors import CheckpointNotFoundError
from ..inventory import checkpoint_names, memtier_ignored, parent_text, restorable, scan
from ._common import EXIT_OK, emit_json, load_config, mb_number, table

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, parents: dict[str, argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ls", parents=[parents["common"], parents["json"], parents["trust"]], help="versions per level with their status",
                       description="List the versions of a checkpoint (all checkpoints without --name) on scratch "
                                   "and persistent: step, epoch (counted from 1; '-' for PyTorch "
                                   "checkpoints, which count steps only), size on disk (MB), "
                                   "status, the run that wrote it and the step that run resumed from, directory; "
                                   "below a clone's version, the checkpoint it was cloned from.")
    p.set_defaults(func=run)


def _epoch(c: Any) -> "int | str | None":
    """The EPOCH cell: counted from 1; '-' for a version of deepfreeze.torch (steps only)."""
    if (c.manifest or {}).get("framework") == "torch":
        return "-"
    return None if c.epoch is None else c.epoch + 1


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.name is not None:
        names = [validate_name(args.name)]
    else:
        names = checkpoint_names(cfg)
    report = []
    for name in names:
        copies = scan(cfg, name)
        levels = restorable(cfg, name, copies, args.trust_owners)
        if args.name is not None and not copies and not memtier_ignored(cfg, name):
            others = checkpoint_names(cfg)
            raise CheckpointNotFoundError(f"no checkpoint named {name!r} in scratch {cfg.scratch} or persistent "
                                          f"{cfg.persistent}" + (f"; found: {', '.join(others)}" if others else ""))
        report.append((name, copies, levels, memtier_ignored(cfg, name)))
    if args.json:
        emit_json({"scratch": cfg.scratch, "persistent": cfg.persistent, "checkpoints": [
            {"name": n, "newest_restorable": max(r) if r else None,
             "restorable": {str(v): lv for v, lv in r.items()},
             "versions": [c.to_json() for c in cs], "memtier_ignored": ig} for n, cs, r, ig in report]})
        return EXIT_OK
    if not report:
        print(f"no checkpoints in scratch {cfg.scratch} or persistent {cfg.persistent}")
        return EXIT_OK
    lines = []
    for i, (name, copies, levels, ignored) in enumerate(report):
        if i:
            lines.append("")
        lines.append(f"checkpoint {name!r}  (scratch {cfg.scratch}, persistent {cfg.persistent})")
        rows, notes = [], {}
        for c in copies:
            rows.append([c.level, c.version, c.step, _epoch(c), mb_number(c.bytes),
                         c.status, c.run if c.run is None else (c.run or "(none)"),
                         None if c.resumed_from is None else f"v{c.resumed_from}", c.path])
            note = "; ".join(x for x in (parent_text(c.parent), c.detail) if x)
            if note:
                notes[len(rows) - 1] = note
        lines_t = table(["LEVEL", "VERSION", "STEP", "EPOCH", "MB", "STATUS", "RUN", "RESUMED FROM", "WHERE"], rows,
                        right=(1, 2, 3, 4))
        lines.append(lines_t[0])
        for j, row in enumerate(lines_t[1:]):
            lines.append(row)
            if j in notes:
                lines.append(f"    {notes[j]}")
        if ignored:  # said once, here (regions of this name that belong to other jobs)
            lines.append(f"memory tier {cfg.memtier}: ignored {len(ignored)} model(s) named {name!r} not of this "
                         "job: " + "; ".join(ignored))
        if levels:
            v = max(levels)
            lines.append(f"newest restorable: v{v} ({', '.join(levels[v])})")
        else:
            lines.append("newest restorable: none")
    print("\n".join(lines))
    return EXIT_OK
