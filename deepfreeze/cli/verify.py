"""``deepfreeze verify``: read every piece of a version's copies and check every checksum."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..errors import CheckpointNotFoundError
from ..inventory import memtier_ignored, newest_restorable, scan, verify_copy
from ._common import EXIT_FAIL, EXIT_OK, Progress, emit_json, load_config, resolve_name, version_arg

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, parents: dict[str, argparse.ArgumentParser]) -> None:
    p = sub.add_parser("verify", parents=[parents["common"], parents["json"], parents["trust"]],
                       help="read every piece and check every checksum",
                       description="Check completeness and every CRC32 of a version on each level that holds it. "
                                   "Exit code 1 if anything is damaged.")
    x = p.add_mutually_exclusive_group()
    x.add_argument("--version", type=version_arg, metavar="V",
                   help="checkpoint version (default: the newest committed one)")
    x.add_argument("--all", action="store_true", help="every version directory on every level")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    name = resolve_name(args, cfg)
    copies = scan(cfg, name)
    if args.all:
        chosen = copies
        if not chosen:
            raise CheckpointNotFoundError(f"no version of {name!r} in scratch {cfg.scratch} or persistent "
                                          f"{cfg.persistent}")
    else:
        version = args.version if args.version is not None else newest_restorable(cfg, name, copies, args.trust_owners)
        chosen = [c for c in copies if c.version == version]
        if not chosen:
            raise CheckpointNotFoundError(f"version {version} of {name!r} is on no level; versions on disk: "
                                          f"{sorted({c.version for c in copies}) or 'none'}")
    chosen.sort(key=lambda c: (c.version, c.level != "scratch"))
    progress = Progress()
    verdicts = []
    try:
        for c in chosen:
            verdicts.append(verify_copy(cfg, c, name, progress.bytes_fn("verifying")))
    finally:
        progress.done()
    damaged = [x for x in verdicts if x.status == "DAMAGED"]
    ignored = memtier_ignored(cfg, name)
    if args.json:
        emit_json({"name": name, "ok": not damaged, "results": [dataclasses.asdict(x) for x in verdicts],
                   "memtier_ignored": ignored})
    else:
        lines = []
        for x in verdicts:
            if x.status == "OK":
                crc = ("checksums verified" if x.checksums else
                       "no checksums stored (chksum = false): structure checked, data not verifiable")
                what = f"{x.pieces} pieces in {x.files} file{'s' if x.files != 1 else ''}, {x.bytes} bytes, {crc}"
            else:
                what = x.reason
            lines.append(f"{name} v{x.version} {x.level:<10} {x.status:<7} {what}")
            lines.append(f"    {x.path}")
        counts: dict[str, int] = {}
        for x in verdicts:
            counts[x.status] = counts.get(x.status, 0) + 1
        lines.append(f"{len(verdicts)} cop{'ies' if len(verdicts) != 1 else 'y'} of "
                     f"{len({x.version for x in verdicts})} version(s): "
                     + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
        if ignored:
            lines.append(f"memory tier {cfg.memtier}: ignored {len(ignored)} model(s) named {name!r} not of this job: "
                         + "; ".join(ignored))
        print("\n".join(lines))
    return EXIT_FAIL if damaged else EXIT_OK
