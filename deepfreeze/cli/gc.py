"""``deepfreeze gc``: apply retention now; remove abandoned flushes."""
from __future__ import annotations

import argparse
import os
from typing import Any

from ..inventory import plan_gc
from ..levels import MANIFEST, PersistentLevel, ScratchLevel
from ..ownership import remove_tree_nofollow
from ._common import EXIT_OK, load_config, resolve_name

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, parents: dict[str, argparse.ArgumentParser]) -> None:
    p = sub.add_parser("gc", parents=[parents["common"]], help="apply retention now; remove abandoned flushes",
                       description="Apply max_versions / scratch_versions now and remove incomplete persistent "
                                   "version directories older than the newest committed version.")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    name = resolve_name(args, cfg)
    removals, info = plan_gc(cfg, name)
    verb = "would remove" if args.dry_run else "removed"
    if not args.dry_run:
        scratch, pers = ScratchLevel(cfg.scratch), PersistentLevel(cfg.persistent)
        # persistent: retention of committed versions (and skip-decided directories), then abandoned flushes
        pers.retain(name, info["keep_persistent"])
        for r in removals:
            if r.level == "persistent" and os.path.isdir(r.path) \
                    and not os.path.lexists(os.path.join(r.path, MANIFEST)):
                remove_tree_nofollow(r.path)  # through directory descriptors: never follows a symlink
        # scratch: each rank's shards, as the flush jobs do it
        if info["keep_scratch"] > 0 and info["scratch_upto"] >= 0:
            for rank in info["ranks"]:
                scratch.retain(name, rank, info["keep_scratch"], upto=info["scratch_upto"])
        removals = [r for r in removals if not os.path.exists(r.path) or
                    (r.level == "scratch" and not any(os.path.exists(os.path.join(r.path, f)) for f in r.files))]
    lines = [f"gc {name!r}: keep {info['keep_persistent'] or 'all'} committed on persistent, "
             f"{info['keep_scratch'] or 'all'} on scratch"]
    for r in removals:
        what = f"shards {', '.join(r.files)}" if r.level == "scratch" else "directory"
        if r.level == "scratch" and r.whole_dir:
            what += " and the directory"
        lines.append(f"{verb} {r.level} v{r.version}: {what} ({r.why})")
        lines.append(f"    {r.path}")
    if info["keep_scratch"] > 0 and info["scratch_upto"] < 0 and ScratchLevel(cfg.scratch).versions(name):
        lines.append("scratch: no version is committed (or decided skip) on persistent yet, so none is old "
                     "enough to remove: a flush may still need it")
    if not removals:
        lines.append("nothing to remove")
    elif args.dry_run:
        lines.append(f"dry run: {len(removals)} version director{'ies' if len(removals) != 1 else 'y'} "
                     "would be touched; nothing was removed")
    print("\n".join(lines))
    return EXIT_OK
