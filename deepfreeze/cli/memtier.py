"""``deepfreeze memtier``: the memory tier's tools (create, view, dump, repack).

    deepfreeze memtier create PATH --size 8G [--force] [--json]
    deepfreeze memtier view   PATH [--json]
    deepfreeze memtier dump   PATH NAME -o OUT.h5|.npz|.safetensors [--force] [--version V]
    deepfreeze memtier repack PATH [--json]
    deepfreeze memtier rm     PATH NAME [--run ID] [--job ID] [--force] [--json]
    deepfreeze memtier rm     PATH --entry N [--json]

``PATH`` is a memory-tier device file (docs/memtier.md). Thin over :mod:`deepfreeze.memtier`
(:func:`~deepfreeze.memtier.device.create`, :func:`~deepfreeze.memtier.device.open`,
:func:`~deepfreeze.memtier.device.view`, :meth:`~deepfreeze.memtier.device.Device.repack`,
:func:`~deepfreeze.memtier.dumper.dump`); no TensorFlow. ``view`` reads the device read-only and
never trusts an ACTIVE slot (it is shown as being written, or as left by a crash). ``repack``
asks, per model, whether its job is still running with
:func:`deepfreeze.memtier.device.default_live`: an engine model while its run holds the lease on
the checkpoint name (``deepfreeze.lease.read_lease``), a standalone model until it is closed (or
its owner process is gone).
"""
from __future__ import annotations

import argparse
import datetime
from typing import Any

from ._common import EXIT_FAIL, EXIT_OK, UsageError, emit_json, err, mb, table, version_arg

__all__ = ["add_parser", "parse_size"]

def parse_size(text: str) -> int:
    """argparse type of ``--size``: :func:`deepfreeze.memtier.device.parse_size` (``8G``, ``512M``)."""
    from ..memtier.device import parse_size as parse
    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(sub: Any, parents: dict[str, argparse.ArgumentParser]) -> None:
    p = sub.add_parser("memtier", help="the memory tier: create, view, dump, repack a device",
                       description="Manage a memory-tier device (docs/memtier.md): one preallocated, pre-faulted "
                                   "file (e.g. under /dev/shm) holding the newest checkpoint versions of "
                                   "several models.")
    ms = p.add_subparsers(dest="memtier_command", metavar="SUBCOMMAND", parser_class=type(p))
    ms.required = True
    dev = argparse.ArgumentParser(add_help=False)
    dev.add_argument("path", metavar="PATH", help="the device file")

    q = ms.add_parser("create", parents=[dev, parents["json"]], help="create a device (preallocated, pre-faulted)",
                      description="Create the device file PATH of --size bytes: 512M, 8G, 8GiB are binary (8G = "
                                  "8 x 2^30 bytes), 10GB, 500MB decimal (10GB = 10^10 bytes). On tmpfs the size is "
                                  "checked against the available memory first. Shows its progress on a terminal "
                                  "(every page is touched once: a few seconds per GiB).")
    q.add_argument("--size", required=True, type=parse_size, metavar="SIZE",
                   help="device size: 8G = 8 GiB (binary), 10GB = 10^10 bytes (decimal)")
    q.add_argument("--force", action="store_true", help="replace an existing file at PATH (its models are lost)")
    q.set_defaults(func=_create)
    q = ms.add_parser("view", parents=[dev, parents["json"]],
                      help="models, shards, every slot's state, version and size, free space")
    q.set_defaults(func=_view)
    q = ms.add_parser("dump", parents=[dev], help="export a model's newest (or given) version to a file",
                      description="Write model NAME's newest version (or --version V) to OUT; the format "
                                  "follows OUT's suffix: .h5 (Keras model.load_weights), .npz, .safetensors. A "
                                  "version that is not DONE and intact on every rank (ACTIVE: being written or "
                                  "interrupted) is refused unless --force, and so is a multi-rank model whose other "
                                  "ranks are on other nodes' devices (use 'deepfreeze export').")
    q.add_argument("name", metavar="NAME", help="the model's (checkpoint) name")
    q.add_argument("-o", "--output", required=True, metavar="OUT", help="output file (.h5, .npz or .safetensors)")
    q.add_argument("--version", type=version_arg, metavar="V",
                   help="the version (step) to dump (default: the newest any slot names)")
    q.add_argument("--force", action="store_true",
                   help="dump an ACTIVE (being written or interrupted) or damaged version anyway, unchecked, and "
                        "replace an existing OUT")
    q.add_argument("--job", metavar="ID",
                   help="when models of several jobs share NAME: the job to dump (its id or a unique prefix, as "
                        "'view' shows it; 'unknown' for models written before job ids)")
    q.add_argument("--optimizer", action="store_true",
                   help="also write the optimizer state (by default only the model's weights: what Keras "
                        "model.load_weights accepts from an .h5)")
    q.set_defaults(func=_dump)
    q = ms.add_parser("repack", parents=[dev, parents["json"]],
                      help="compact away finished models' old versions and invalid slots",
                      description="For every model whose run is over (an engine model: its run no longer holds "
                                  "the lease on the checkpoint name; a standalone model: closed), keep only the "
                                  "newest valid version, compacted; drop models with none. Live models are not "
                                  "touched.")
    q.set_defaults(func=_repack)
    q = ms.add_parser("rm", parents=[dev, parents["json"]], help="drop a model (or one run of it) from a device",
                      description="Retire every region of model NAME on the device (only run --run / job --job when "
                                  "given), or the model-table entry --entry N (e.g. a damaged, quarantined one that "
                                  "'view' lists). A live model (its run still holds the lease on the name; a "
                                  "standalone model not closed whose process runs) is refused unless --force. "
                                  "Exit code 1 when nothing matches.")
    q.add_argument("name", metavar="NAME", nargs="?", help="the model's (checkpoint) name")
    q.add_argument("--run", metavar="ID", help="only this run (16 hex digits, as 'view' shows it)")
    q.add_argument("--job", metavar="ID", help="only this job (its id or a unique prefix; 'unknown')")
    q.add_argument("--entry", metavar="N", type=int, help="the model-table entry N instead of NAME")
    q.add_argument("--force", action="store_true", help="drop a live model too (its job's next checkpoint into "
                                                        "the tier then fails)")
    q.set_defaults(func=_rm)


# ============================================================================ helpers

def _when(t: Any) -> str:
    if not isinstance(t, (int, float)) or t <= 0:
        return "-"
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


# ============================================================================ commands

def _create(args: argparse.Namespace) -> int:
    from ..memtier import device as mdev
    from ._common import Progress
    progress = Progress()
    try:
        dev = mdev.create(args.path, args.size, force=args.force,
                          progress=lambda phase, done, total: progress.update(
                              f"{phase} {args.path}: {done / 2**30:.2f} of {total / 2**30:.2f} GiB "
                              f"({100 * done // max(total, 1)}%)", force=done in (0, total)))
    except ValueError as e:  # too small for the superblock and model table
        raise UsageError(f"--size {args.size}: {e}") from None
    finally:
        progress.done()
    try:
        info = {"device": dev.path, "size": dev.size, "free": dev.free_bytes()}
    finally:
        dev.close()
    if args.json:
        emit_json(info)
    else:
        print(f"created {info['device']}: {info['size']} bytes ({info['size'] / 2**30:.2f} GiB, "
              f"{mb(info['size'])}), {mb(info['free'])} free for models "
              f"(use it with memtier = {info['device']}; see docs/memtier.md)")
    return EXIT_OK


def _slot_text(s: dict[str, Any]) -> str:
    """A slot's state for the table: ``DONE``, ``DONE (damaged: why)``, ``ACTIVE (being written or
    interrupted)``, ``EMPTY``, ``INVALID (header checksum)``. Only a valid DONE slot is restorable."""
    state = str(s.get("state", "?"))
    if s.get("valid"):
        return state
    if state == "DONE":
        return f"DONE (not restorable: {s.get('reason', 'damaged')})"
    if state == "EMPTY":
        return state
    return f"{state} ({s.get('reason', 'invalid')})"


def _view(args: argparse.Namespace) -> int:
    from ..memtier import device as mdev
    from ..memtier.jobs import job_text
    info = mdev.view(args.path)
    if args.json:
        emit_json(info)
        return EXIT_OK
    models = info.get("models", [])
    print(f"device {info.get('path', args.path)}: {mb(info['size'])}, {mb(info['free'])} free, "
          f"{len(models)} model(s), created {_when(info.get('created'))}")
    for p in info.get("problems", []):
        print(f"problem: {p}")
    for q in info.get("quarantined", []):
        what = f" ({q['name']!r} rank {q['rank']})" if q.get("name") else ""
        print(f"quarantined: entry {q['entry']}{what}: unreadable, not used; every other model is usable "
              f"('deepfreeze memtier rm {info.get('path', args.path)} --entry {q['entry']}' drops it)")
    rows = []
    for m in models:
        kind = "standalone" if m.get("standalone") else "engine"
        status = f"{kind}, finished" if m.get("finished") else kind
        for sh in m.get("shards", []):
            for s in sh.get("slots", []):
                version = None
                if s.get("version") is not None and s.get("state") in ("DONE", "ACTIVE"):
                    g = s.get("generation") or 0
                    version = f"v{s['version']}" if g == 0 else f"g{g}/v{s['version']}"
                rows.append([m.get("name"), m.get("run"), job_text(m.get("job")), status,
                             f"{sh.get('rank')}/{m.get('world_size')}",
                             s.get("slot"), _slot_text(s), version,
                             mb(s["bytes"]) if s.get("bytes") else None,
                             _when(s.get("written")) if s.get("state") in ("DONE", "ACTIVE") else None])
    if rows:
        print("\n".join(table(["MODEL", "RUN", "JOB", "KIND", "RANK", "SLOT", "STATE", "VERSION", "SIZE", "WRITTEN"],
                              rows, right=(5, 8))))
    return EXIT_OK


def _dump(args: argparse.Namespace) -> int:
    from ..memtier.dumper import dump
    got = dump(args.path, args.name, args.output, force=args.force, version=args.version, overwrite=args.force,
               job=args.job, optimizer=args.optimizer)
    note = "" if got["verified"] else " UNVERIFIED (forced: the bytes were dumped unchecked)"
    opt = (f" (the optimizer's {got['optimizer_tensors_left_out']} tensors left out: --optimizer includes them)"
           if got.get("optimizer_tensors_left_out") else "")
    print(f"wrote {got['path']} ({got['format']}): {got['name']} {got['version']}, {got['tensors']} tensors, "
          f"{mb(got['bytes'])}{note}{opt}")
    return EXIT_OK


def _repack(args: argparse.Namespace) -> int:
    from ..memtier import device as mdev
    dev = mdev.open(args.path)
    try:
        out = dev.repack(live=mdev.default_live)
    finally:
        dev.close()
    if args.json:
        emit_json(out)
    else:
        print(f"retired {out.get('retired', 0)} region(s), moved {out.get('moved', 0)}, freed "
              f"{mb(out.get('freed_bytes', 0))}")
    if not out.get("freed_bytes") and not out.get("retired"):
        err(f"{args.path}: repack found nothing to free (no finished model with more than its newest version, "
            "no run superseded by a newer run of its job; live models are never touched): 'deepfreeze memtier rm' "
            "drops a model, or create a bigger device")
        return EXIT_FAIL
    return EXIT_OK


def _rm(args: argparse.Namespace) -> int:
    from ..memtier import device as mdev
    if (args.name is None) == (args.entry is None):
        raise UsageError("give NAME or --entry N (one of them)")
    if args.entry is not None and (args.run or args.job):
        raise UsageError("--run and --job go with NAME, not with --entry")
    dev = mdev.open(args.path)
    try:
        out = dev.drop(args.name, run=args.run, job=args.job, entry=args.entry, force=args.force,
                       live=mdev.default_live)
    finally:
        dev.close()
    if args.json:
        emit_json(out)
    else:
        print(f"retired {out['retired']} region(s) of {', '.join(out['models'])}: freed {mb(out['freed_bytes'])}")
    return EXIT_OK
