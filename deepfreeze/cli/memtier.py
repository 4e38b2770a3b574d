"""``deepfreeze memtier``: the memory tier's tools (create, view, dump, repack).

    deepfreeze memtier create PATH --size 8G [--force] [--json]
    deepfreeze memtier view   PATH [--json]
    deepfreeze memtier dump   PATH NAME -o OUT.h5|.npz|.safetensors [--force] [--version V]
    deepfreeze memtier repack PATH [--json]

``PATH`` is a memory-tier device file (docs/memtier.md). Thin over :mod:`deepfreeze.memtier`
(:func:`~deepfreeze.memtier.device.create`, :func:`~deepfreeze.memtier.device.open`,
:func:`~deepfreeze.memtier.device.view`, :meth:`~deepfreeze.memtier.device.Device.repack`,
:func:`~deepfreeze.memtier.dump.dump`); no TensorFlow. ``view`` reads the device read-only and
never trusts an ACTIVE slot (it is shown as being written, or as left by a crash). ``repack``
asks, per model, whether its run is still live: an engine model is live while its run holds the
lease on the checkpoint name (:func:`run_live`), a standalone model while it is not closed.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import time
from typing import Any

from ._common import EXIT_OK, UsageError, emit_json, mb, table, version_arg

__all__ = ["add_parser", "run_live", "parse_size"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_FORMATS = (".h5", ".hdf5", ".npz", ".safetensors")


def parse_size(text: str) -> int:
    """``"8G"``, ``"512M"``, ``"1.5GiB"``, ``"4096"`` -> bytes (binary units; argparse type)."""
    t = text.strip().upper()
    t = t[:-1] if t.endswith("B") else t
    t = t[:-1] if t.endswith("I") else t
    num, unit = (t[:-1], t[-1]) if t and t[-1] in _UNITS else (t, "")
    try:
        if len(num) > 24:
            raise ValueError(num)
        n = int(float(num) * _UNITS[unit])
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 512M, 8G, 1.5G)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return n


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
                      description="Create the device file PATH of --size bytes (binary units: 512M, 8G). On "
                                  "tmpfs the size is checked against the available memory first.")
    q.add_argument("--size", required=True, type=parse_size, metavar="SIZE", help="device size, e.g. 8G")
    q.add_argument("--force", action="store_true", help="replace an existing file at PATH (its models are lost)")
    q.set_defaults(func=_create)
    q = ms.add_parser("view", parents=[dev, parents["json"]],
                      help="models, shards, every slot's state, version and size, free space")
    q.set_defaults(func=_view)
    q = ms.add_parser("dump", parents=[dev], help="export a model's newest (or given) version to a file",
                      description="Write model NAME's newest DONE version (or --version V) to OUT; the format "
                                  "follows OUT's suffix: .h5 (Keras model.load_weights), .npz, .safetensors.")
    q.add_argument("name", metavar="NAME", help="the model's (checkpoint) name")
    q.add_argument("-o", "--output", required=True, metavar="OUT", help="output file (.h5, .npz or .safetensors)")
    q.add_argument("--version", type=version_arg, metavar="V", help="the step to dump (default: the newest DONE)")
    q.add_argument("--force", action="store_true",
                   help="dump an ACTIVE or damaged slot anyway, and replace an existing OUT")
    q.set_defaults(func=_dump)
    q = ms.add_parser("repack", parents=[dev, parents["json"]],
                      help="compact away finished models' old versions and invalid slots",
                      description="For every model whose run is over (an engine model: its run no longer holds "
                                  "the lease on the checkpoint name; a standalone model: closed), keep only the "
                                  "newest valid version, compacted; drop models with none. Live models are not "
                                  "touched.")
    q.set_defaults(func=_repack)


# ============================================================================ helpers

def _when(t: Any) -> str:
    if not isinstance(t, (int, float)) or t <= 0:
        return "-"
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def run_live(region: Any, *, now: float | None = None) -> bool:
    """Whether the run that registered ``region`` (a :class:`~deepfreeze.memtier.device.ShardRegion`)
    may still write it, i.e. whether :meth:`Device.repack` must leave it alone.

    * a standalone model (``index["standalone"]``): live until :meth:`Model.close` marked it
      finished (``region.finished``);
    * an engine model: live while its run holds the lease on the checkpoint name
      (:func:`deepfreeze.run.read_lease` on ``index["lease"]["persistent"]``): the holder names
      this run, is not released, and is not stale (a process of this host that is gone, or no
      heartbeat for longer than ``index["lease"]["timeout"]`` by the file system's clock);
    * an engine model without a lease record: live (nothing tells that its run ended).
    """
    from ..run import _alive, fs_now, read_lease  # noqa: PLC2701 - the lease's own liveness rules
    index = region.index
    if index.get("standalone"):
        return not bool(getattr(region, "finished", False))
    lease = index.get("lease")
    if not isinstance(lease, dict) or not isinstance(lease.get("persistent"), str):
        return True
    persistent = lease["persistent"]
    try:
        got = read_lease(persistent, region.name)
    except OSError:
        return True  # cannot tell (persistent unreachable): keep
    if got is None:
        return False
    holder, mtime = got
    if holder.get("run") != region.run or holder.get("released"):
        return False
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int) and pid > 0 and not _alive(pid):
        return False
    timeout = lease.get("timeout")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        return True
    if now is None:
        try:
            now = fs_now(os.path.join(persistent, region.name))
        except OSError:
            now = time.time()
    return now - mtime <= timeout


# ============================================================================ commands

def _create(args: argparse.Namespace) -> int:
    from ..memtier import device as mdev
    dev = mdev.create(args.path, args.size, force=args.force)
    try:
        info = {"device": dev.path, "size": dev.size, "free": dev.free_bytes()}
    finally:
        dev.close()
    if args.json:
        emit_json(info)
    else:
        print(f"created {info['device']}: {mb(info['size'])}, {mb(info['free'])} free for models "
              f"(use it with memtier = {info['device']}; see docs/memtier.md)")
    return EXIT_OK


def _slot_text(s: dict) -> str:
    state = str(s.get("state", "?"))
    if not s.get("valid", False) and state not in ("EMPTY", "empty"):
        state += " (invalid)" if state not in ("ACTIVE", "active") else " (being written, or left by a crash)"
    return state


def _view(args: argparse.Namespace) -> int:
    from ..memtier import device as mdev
    info = mdev.view(args.path)
    if args.json:
        emit_json(info)
        return EXIT_OK
    print(f"device {info.get('path', args.path)}: {mb(info['size'])}, {mb(info['free'])} free, "
          f"{len(info.get('models', []))} model(s)")
    rows = []
    for m in info.get("models", []):
        for sh in m.get("shards", []):
            for s in sh.get("slots", []):
                v = s.get("version")
                rows.append([m.get("name"), m.get("run"), f"{sh.get('rank')}/{sh.get('world_size')}", s.get("slot"),
                             _slot_text(s), v if v is not None else None,
                             mb(s["size"]) if isinstance(s.get("size"), int) else None, _when(s.get("written"))])
    if rows:
        print("\n".join(table(["MODEL", "RUN", "RANK", "SLOT", "STATE", "VERSION", "SIZE", "WRITTEN"], rows,
                              right=(3, 6))))
    return EXIT_OK


def _dump(args: argparse.Namespace) -> int:
    from ..memtier import device as mdev
    from ..memtier.dump import dump
    ext = os.path.splitext(args.output)[1].lower()
    if ext not in _FORMATS:
        raise UsageError(f"-o {args.output}: unknown format {ext or '(no suffix)'!r}; end the name with .h5, .npz "
                         "or .safetensors")
    if os.path.lexists(args.output) and not args.force:
        raise UsageError(f"-o {args.output} exists: pass --force to replace it")
    dev = mdev.open(args.path, writable=False)
    try:
        got = dump(dev, args.name, args.output, force=args.force, version=args.version)
    finally:
        dev.close()
    print(f"wrote {args.output}" + (f" ({got})" if got else ""))
    return EXIT_OK


def _repack(args: argparse.Namespace) -> int:
    from ..memtier import device as mdev
    dev = mdev.open(args.path)
    try:
        out = dev.repack(live=run_live)
    finally:
        dev.close()
    if args.json:
        emit_json(out)
    else:
        print(f"retired {out.get('retired', 0)} region(s), moved {out.get('moved', 0)}, freed "
              f"{mb(out.get('freed_bytes', 0))}")
    return EXIT_OK
