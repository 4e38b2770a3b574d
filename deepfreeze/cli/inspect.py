"""``deepfreeze inspect``: one version's tensors, shard plan and failure domains."""
from __future__ import annotations

import argparse
import datetime
from typing import Any

from ..inventory import describe, newest_restorable, parent_text, pick_manifest, ranks_text, scan
from ._common import EXIT_OK, emit_json, load_config, mb, resolve_name, table

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, parents: dict[str, argparse.ArgumentParser]) -> None:
    p = sub.add_parser("inspect", parents=[parents["common"], parents["version"], parents["json"], parents["trust"]],
                       help="tensors, shard plan, domains",
                       description="Show one version's tensors, world size, shard plan and failure domains.")
    p.set_defaults(func=run)


def _utc(ts: float | None) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    try:
        return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return "-"


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    name = resolve_name(args, cfg)
    copies = scan(cfg, name)
    version = args.version if args.version is not None else newest_restorable(cfg, name, copies, args.trust_owners)
    manifest, _ = pick_manifest(copies, version)
    d = describe(manifest, copies)
    if args.json:
        emit_json(d)
        return EXIT_OK
    ec = d["epoch_complete"]
    run = d["run"]
    torch = manifest.get("framework") == "torch"  # (steps only: no epoch)
    lines = [f"checkpoint {d['name']!r} version {d['version']}: step {d['step']}"
             + ("" if torch else f", epoch {d['epoch'] + 1}")
             + ("" if ec is None or torch else f" ({'end of epoch' if ec else 'within the epoch'})"),
             f"run {run['id'] or '(none: written before runs had ids)'}, generation {run['generation']}"
             + ("" if run["resumed_from"] is None else f", resumed from v{run['resumed_from']}")
             + ("" if d["parent"] is None else f", {parent_text(d['parent'])}"),
             f"world size {d['world_size']}; {len(d['tensors'])} tensors, {d['total_bytes']} bytes "
             f"({mb(d['total_bytes'])}); plan min_shard_bytes {d['min_shard_bytes']}",
             "failure domains: " + "; ".join(f"{dom} ({ranks_text(rs)})" for dom, rs in d["failure_domains"].items()),
             "", "levels:"]
    for lv in d["levels"]:
        lines.append(f"  {lv['level']:<10}  {lv['status']:<10}  {lv['path']}")
        if lv["level"] == "persistent" and lv["status"] == "committed" and d["assembled"]:
            a = d["assembled"]
            lines.append(f"  {'':<10}  {'':<10}  {a.get('file')}: {a.get('bytes')} bytes, checksums "
                         f"{'yes' if a.get('checksums') else 'no'}, committed {_utc(d['committed'])}")
        if lv["detail"]:
            lines.append(f"  {'':<10}  {'':<10}  {lv['detail']}")
    lines += ["", "tensors:"]
    lines += ["  " + s for s in table(
        ["ID", "NAME", "DTYPE", "SHAPE", "BYTES"],
        [[t["id"], t["name"], t["dtype"], "[" + ", ".join(map(str, t["shape"])) + "]", t["bytes"]]
         for t in d["tensors"]], right=(0, 4))]
    lines += ["", "shard plan, per rank:"]
    lines += ["  " + s for s in table(["RANK", "DOMAIN", "FILE", "PIECES", "BYTES"],
                                      [[r["rank"], r["domain"], r["file"], r["pieces"], r["bytes"]]
                                       for r in d["ranks"]], right=(0, 3, 4))]
    lines += ["", "shard plan, per tensor (rank: element range [start, stop) of the flat tensor):"]
    width = max((len(t["name"]) for t in d["tensors"]), default=0)
    for t in d["tensors"]:
        ps = t["pieces"]
        size = 1
        for dim in t["shape"]:
            size *= dim
        if len(ps) == 1 and ps[0]["start"] == 0 and ps[0]["stop"] == size:
            where = f"r{ps[0]['rank']} whole"
        else:
            where = "  ".join(f"r{p['rank']} [{p['start']}, {p['stop']})" for p in ps)
        lines.append(f"  {t['name']:<{width}}  {where}")
    print("\n".join(lines))
    return EXIT_OK
