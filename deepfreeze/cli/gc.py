"""``deepfreeze gc``: apply retention now; remove abandoned flushes."""
from __future__ import annotations

import argparse
import os
from typing import Any

from ..inventory import dir_listing, plan_gc
from ..tiers.base import MANIFEST
from ..tiers.persistent import PersistentLevel
from ..tiers.scratch import ScratchLevel
from ..ownership import remove_tree_nofollow
from ._common import EXIT_OK, load_config, resolve_name

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, parents: dict[str, argparse.ArgumentParser]) -> None:
    p = sub.add_parser("gc", parents=[parents["common"]], help="apply retention now; remove abandoned flushes",
                       description="Apply max_versions / scratch_versions now and remove incomplete persistent "
                                   "version directories older than the newest committed version.")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")
    p.set_defaults(func=run)


def _entries(level: Any, name: str) -> dict[int, set[str]]:
    """version -> the names in its directory (empty: nothing readable)."""
    return {v: set(dir_listing(level.version_dir(name, v))[1]) for v in level.versions(name)}


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    name = resolve_name(args, cfg)
    removals, info = plan_gc(cfg, name)
    lines = [f"gc {name!r}: keep {info['keep_persistent'] or 'all'} committed on persistent, "
             f"{info['keep_scratch'] or 'all'} on scratch"]
    if args.dry_run:
        for r in removals:
            what = f"shards {', '.join(r.files)}" if r.level == "scratch" else "directory"
            if r.level == "scratch" and r.whole_dir:
                what += " and the directory"
            lines.append(f"would remove {r.level} v{r.version}: {what} ({r.why})")
            lines.append(f"    {r.path}")
    else:
        scratch, pers = ScratchLevel(cfg.scratch), PersistentLevel(cfg.persistent)
        before = {"persistent": _entries(pers, name), "scratch": _entries(scratch, name)}
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
        # report what is gone (compared with before), never what was only planned
        after = {"persistent": _entries(pers, name), "scratch": _entries(scratch, name)}
        planned = {(r.level, r.version): r for r in removals}
        for level in ("persistent", "scratch"):
            lv = pers if level == "persistent" else scratch
            for v, had in sorted(before[level].items()):
                now = after[level].get(v)
                gone = sorted(had - now) if now is not None else sorted(had)
                r = planned.pop((level, v), None)
                why = r.why if r is not None else "retention"
                if now is None:
                    what = "directory" if level == "persistent" or not had else f"{', '.join(sorted(had))} and the directory"
                    lines.append(f"removed {level} v{v}: {what} ({why})")
                elif gone:
                    lines.append(f"removed {level} v{v}: {', '.join(gone)}; the directory stays, holding "
                                 f"{', '.join(sorted(now))} ({why})")
                else:
                    if r is not None:
                        lines.append(f"not removed: {level} v{v} ({why}): nothing in it could be removed, or it "
                                     "changed meanwhile; run gc again, or look at it")
                        lines.append(f"    {lv.version_dir(name, v)}")
                    continue
                lines.append(f"    {lv.version_dir(name, v)}")
    if info["keep_scratch"] > 0 and info["scratch_upto"] < 0 and ScratchLevel(cfg.scratch).versions(name):
        lines.append("scratch: no version is committed (or decided skip) on persistent yet, so none is old "
                     "enough to remove: a flush may still need it")
    removed = [ln for ln in lines if ln.startswith("removed ")]
    if args.dry_run:
        lines.append("nothing to remove" if not removals else
                     f"dry run: {len(removals)} version director{'ies' if len(removals) != 1 else 'y'} "
                     "would be touched; nothing was removed")
    elif not removed:
        lines.append("nothing to remove" if not removals else "nothing removed")
    print("\n".join(lines))
    return EXIT_OK
