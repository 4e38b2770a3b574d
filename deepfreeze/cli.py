"""``deepfreeze``: list, inspect, verify, export and clean up checkpoints; talk to the backend.

    deepfreeze ls       [--config FILE] [--name NAME] [--set KEY=VALUE ...] [--json]
    deepfreeze inspect  [...] [--version V] [--json]
    deepfreeze verify   [...] [--version V | --all] [--json]
    deepfreeze export   [...] [--version V] --format h5|npz|safetensors --output PATH [--force]
    deepfreeze gc       [...] [--dry-run]
    deepfreeze backend  status|stop [...]

The configuration is built as the Keras callback builds it:
``Config.resolve(--config, **--set)``, so ``VELOC_<KEY>`` environment variables
apply between the file and ``--set``. Imports no TensorFlow. Exit codes: 0
success, 1 damaged / not found / I/O error, 2 usage or configuration error.
Documented in docs/cli.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import socket
import sys
import time
from typing import Any, Iterable, NoReturn

from . import format as fmt
from .backend import BackendClient, socket_path
from .config import KEYS, Config, validate_name
from .errors import BackendError, CheckpointNotFoundError, ConfigError, CorruptCheckpointError, DeepFreezeError
from .levels import read_decision, ASSEMBLED, MANIFEST, PersistentLevel, ScratchLevel, _open_regular, plan_of
from .ownership import remove_tree_nofollow
from .restore import list_versions, load, scratch_recoverable

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
_SHARD_RE = re.compile(r"^r(\d{6})\.dfs$")


class UsageError(Exception):
    """A command-line mistake: exit code 2."""


# ============================================================================ output helpers

def _err(msg: str) -> None:
    sys.stderr.write("deepfreeze: error: " + " ".join(str(msg).split()) + "\n")


def _emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=1, sort_keys=False) + "\n")


def _table(headers: list[str], rows: list[list[Any]], right: Iterable[int] = ()) -> list[str]:
    right = set(right)
    cells = [headers] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for r in cells:
        parts = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)]
        out.append("  ".join(parts).rstrip())
    return out


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class Progress:
    """One self-overwriting status line on stderr, only when stderr is a terminal."""

    def __init__(self) -> None:
        try:
            self.enabled = sys.stderr.isatty()
        except (AttributeError, ValueError):
            self.enabled = False
        self._last = 0.0
        self._shown = False

    def update(self, text: str, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and self._shown and now - self._last < 0.1:
            return
        self._last, self._shown = now, True
        sys.stderr.write("\r\033[K" + text)
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled and self._shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self._shown = False


# ============================================================================ configuration

def _overrides(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE, e.g. --set scratch=/local/ssd/ckpt")
        if key not in KEYS:
            raise ConfigError(f"--set {key}=...: unknown key {key!r}. Known keys: {', '.join(sorted(KEYS))} "
                              "(see docs/configuration.md)")
        out[key] = value.strip()
    return out


def _file_sets_mode(path: str | None) -> bool:
    if path is None:
        return False
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except OSError:
        return True  # let Config.load report the file problem itself
    return any(line.split("#", 1)[0].split("=", 1)[0].strip() == "mode"
               for line in text.splitlines() if "=" in line.split("#", 1)[0])


def load_config(config: str | None, sets: list[str]) -> Config:
    """``Config.resolve(config, **overrides)``. The tool never writes checkpoints, so when no
    source sets the mandatory ``mode`` it is taken as ``sync`` instead of failing."""
    overrides = _overrides(sets)
    if "mode" not in overrides and "VELOC_MODE" not in os.environ and not _file_sets_mode(config):
        overrides["mode"] = "sync"
    try:
        return Config.resolve(config, **overrides)
    except ConfigError as e:
        msg = str(e).replace("keyword override", "--set")
        if msg.startswith("<code>: "):  # no file: the value had to come from VELOC_<KEY> or --set
            msg = "configuration (no --config file): " + msg[len("<code>: "):] + " (--set KEY=VALUE or VELOC_<KEY>)"
        raise ConfigError(msg) from None


def checkpoint_names(cfg: Config) -> list[str]:
    """Checkpoint names that have at least one version directory on either level."""
    found = set()
    for level in (ScratchLevel(cfg.scratch), PersistentLevel(cfg.persistent)):
        try:
            entries = os.listdir(level.root)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for n in entries:
            try:
                validate_name(n)
            except ConfigError:
                continue
            if os.path.isdir(level.name_dir(n)) and not os.path.islink(level.name_dir(n)) and level.versions(n):
                found.add(n)
    return sorted(found)


def resolve_name(args: argparse.Namespace, cfg: Config) -> str:
    if args.name is not None:
        return validate_name(args.name)
    names = checkpoint_names(cfg)
    if len(names) == 1:
        return names[0]
    if not names:
        raise CheckpointNotFoundError(f"no checkpoints in scratch {cfg.scratch} or persistent {cfg.persistent}: "
                                      "check --config / --set, or pass --name")
    raise UsageError(f"several checkpoints under scratch {cfg.scratch} and persistent {cfg.persistent} "
                     f"({', '.join(names)}): pick one with --name")


# ============================================================================ scanning the levels

@dataclasses.dataclass
class VersionCopy:
    """One version directory on one level, as found on disk (no data read)."""

    level: str  # scratch | persistent
    version: int
    path: str
    status: str  # complete | partial | committed | skipped | incomplete | damaged
    detail: str = ""
    step: int | None = None
    epoch: int | None = None
    bytes: int = 0  # bytes of the files in the directory
    tensor_bytes: int | None = None
    manifest: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("manifest")
        return d


def _dir_bytes(path: str) -> tuple[int, list[str]]:
    total, names = 0, []
    try:
        with os.scandir(path) as it:
            for e in it:
                names.append(e.name)
                try:
                    if e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_size
                except OSError:
                    pass
    except OSError:
        pass
    return total, sorted(names)


def _ranks_text(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _scratch_missing(m: dict[str, Any], present: set[int]) -> tuple[str, str]:
    """Status of a scratch version with a manifest: complete, partial (the missing ranks ran in
    other failure domains, whose scratch is elsewhere) or incomplete."""
    missing = [s for s in m["shards"] if s["rank"] not in present]
    if not missing:
        return "complete", ""
    here = {s.get("domain") for s in m["shards"] if s["rank"] in present}
    away = {s.get("domain") for s in missing}
    if here and None not in here and not here & away:
        return "partial", (f"{_ranks_text(sorted(present))} here ({', '.join(sorted(here))}); "
                           f"{_ranks_text(s['rank'] for s in missing)} on the scratch of other failure domains "
                           f"({', '.join(sorted(str(d) for d in away))})")
    return "incomplete", f"missing shards of {_ranks_text(s['rank'] for s in missing)}"


def scan_scratch(cfg: Config, name: str) -> list[VersionCopy]:
    level = ScratchLevel(cfg.scratch)
    out = []
    for v in level.versions(name):
        vdir = level.version_dir(name, v)
        size, files = _dir_bytes(vdir)
        present = {int(m.group(1)) for f in files if (m := _SHARD_RE.match(f))}
        c = VersionCopy("scratch", v, vdir, "incomplete", bytes=size)
        try:
            m = level.read_manifest(name, v)
        except FileNotFoundError:
            c.detail = (f"no manifest.json yet; shards of {_ranks_text(sorted(present))}" if present
                        else "no manifest.json and no shards") + " (being written, or abandoned)"
        except (OSError, DeepFreezeError, ValueError) as e:
            c.status, c.detail = "damaged", f"manifest unreadable: {e}"
        else:
            # the shard files the manifest names; partner copies and parity can stand in for missing ones
            present = {s["rank"] for s in m["shards"] if os.path.exists(os.path.join(vdir, s["file"]))}
            c.status, c.detail = _scratch_missing(m, present)
            if c.status != "complete" and scratch_recoverable(m, level.inventory(name, v)):
                c.status, c.detail = "complete", "missing shards recoverable from partner copies / parity here"
            c.step, c.epoch, c.tensor_bytes, c.manifest = m["step"], m["epoch"], m.get("total_bytes"), m
        out.append(c)
    return out


def _decision(vdir: str) -> str | None:
    d = read_decision(vdir)
    return None if d is None else d["decision"]


def scan_persistent(cfg: Config, name: str) -> list[VersionCopy]:
    level = PersistentLevel(cfg.persistent)
    committed = level.committed_versions(name)
    out = []
    for v in level.versions(name):
        vdir = level.version_dir(name, v)
        size, files = _dir_bytes(vdir)
        c = VersionCopy("persistent", v, vdir, "incomplete", bytes=size)
        if MANIFEST in files:
            try:
                m = level.read_manifest(name, v)
            except (OSError, DeepFreezeError, ValueError) as e:
                c.status, c.detail = "damaged", f"manifest unreadable: {e}"
            else:
                c.step, c.epoch, c.tensor_bytes, c.manifest = m["step"], m["epoch"], m.get("total_bytes"), m
                asm = m.get("assembled") or {}
                path = os.path.join(vdir, asm.get("file", ASSEMBLED))
                try:
                    actual = os.path.getsize(path)
                except OSError:
                    c.status, c.detail = "damaged", f"{os.path.basename(path)} is missing"
                else:
                    if "bytes" in asm and actual != asm["bytes"]:
                        c.status, c.detail = "damaged", (f"{os.path.basename(path)} has {actual} bytes, "
                                                         f"the manifest says {asm['bytes']}")
                    else:
                        c.status = "committed"
        elif _decision(vdir) == "skip":
            c.status, c.detail = "skipped", "not flushed (persistent_interval); on scratch only"
        else:
            done = sum(1 for f in files if f.startswith("done.r") and f.endswith(".json"))
            partial = (ASSEMBLED + ".partial") in files
            state = f"{done} rank(s) flushed" + (", model.dfz.partial present" if partial else "")
            newer = [x for x in committed if x > v]
            c.detail = (f"not committed (no manifest.json): {state}; "
                        + (f"abandoned (v{newer[-1]} is committed)" if newer else "flush in progress, or abandoned"))
        out.append(c)
    return out


def scan(cfg: Config, name: str) -> list[VersionCopy]:
    return scan_scratch(cfg, name) + scan_persistent(cfg, name)


def newest_restorable(cfg: Config, name: str, trust_owners: list[str] | None = None) -> int:
    versions = list_versions(cfg, name, trust_owners=trust_owners)
    if not versions:
        raise CheckpointNotFoundError(f"no committed version of {name!r} in scratch {cfg.scratch} or persistent "
                                      f"{cfg.persistent} (deepfreeze ls --name {name} shows what is there)")
    return max(versions)


# ============================================================================ ls

def cmd_ls(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.name is not None:
        names = [validate_name(args.name)]
    else:
        names = checkpoint_names(cfg)
    report = []
    for name in names:
        copies = scan(cfg, name)
        restorable = list_versions(cfg, name, trust_owners=args.trust_owners)
        if args.name is not None and not copies:
            others = checkpoint_names(cfg)
            raise CheckpointNotFoundError(f"no checkpoint named {name!r} in scratch {cfg.scratch} or persistent "
                                          f"{cfg.persistent}" + (f"; found: {', '.join(others)}" if others else ""))
        report.append((name, copies, restorable))
    if args.json:
        _emit_json({"scratch": cfg.scratch, "persistent": cfg.persistent, "checkpoints": [
            {"name": n, "newest_restorable": max(r) if r else None,
             "restorable": {str(v): lv for v, lv in r.items()},
             "versions": [c.to_json() for c in cs]} for n, cs, r in report]})
        return EXIT_OK
    if not report:
        print(f"no checkpoints in scratch {cfg.scratch} or persistent {cfg.persistent}")
        return EXIT_OK
    lines = []
    for i, (name, copies, restorable) in enumerate(report):
        if i:
            lines.append("")
        lines.append(f"checkpoint {name!r}  (scratch {cfg.scratch}, persistent {cfg.persistent})")
        rows, notes = [], {}
        for c in copies:
            rows.append([c.level, c.version, c.step, c.epoch, c.bytes, c.status, c.path])
            if c.detail:
                notes[len(rows) - 1] = c.detail
        table = _table(["LEVEL", "VERSION", "STEP", "EPOCH", "BYTES", "STATUS", "WHERE"], rows, right=(1, 2, 3, 4))
        lines.append(table[0])
        for j, row in enumerate(table[1:]):
            lines.append(row)
            if j in notes:
                lines.append(f"    {notes[j]}")
        if restorable:
            v = max(restorable)
            lines.append(f"newest restorable: v{v} ({', '.join(restorable[v])})")
        else:
            lines.append("newest restorable: none")
    print("\n".join(lines))
    return EXIT_OK


# ============================================================================ inspect

def _pick_manifest(copies: list[VersionCopy], version: int) -> tuple[dict[str, Any], VersionCopy]:
    mine = [c for c in copies if c.version == version and c.manifest is not None]
    mine.sort(key=lambda c: c.level != "persistent")  # the committed manifest first
    if not mine:
        raise CheckpointNotFoundError(f"version {version} has no readable manifest on any level; versions on "
                                      f"disk: {sorted({c.version for c in copies}) or 'none'}")
    return mine[0].manifest, mine[0]


def describe(manifest: dict[str, Any], copies: list[VersionCopy]) -> dict[str, Any]:
    """Everything ``inspect`` prints, as a JSON-able dict."""
    plan = plan_of(manifest)
    tensors = []
    for t in plan.tensors:
        itemsize = fmt.dtype_itemsize(t.dtype)
        tensors.append({"id": t.id, "name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                        "pieces": [{"rank": p.rank, "start": p.start, "stop": p.stop, "bytes": p.count * itemsize}
                                   for p in plan.pieces if p.tensor_id == t.id]})
    shard_by_rank = {s["rank"]: s for s in manifest["shards"]}
    rank_bytes = plan.rank_bytes()
    ranks = [{"rank": r, "domain": shard_by_rank.get(r, {}).get("domain"), "file": shard_by_rank.get(r, {}).get("file"),
              "pieces": len(plan.for_rank(r)), "bytes": rank_bytes[r]} for r in range(plan.world_size)]
    domains: dict[str, list[int]] = {}
    for r in ranks:
        domains.setdefault(str(r["domain"]), []).append(r["rank"])
    out = {
        "name": manifest["name"], "version": manifest["version"], "step": manifest["step"],
        "epoch": manifest["epoch"], "epoch_complete": manifest.get("epoch_complete"),
        "world_size": plan.world_size, "total_bytes": plan.total_bytes, "min_shard_bytes": plan.min_shard_bytes,
        "failure_domains": domains,
        "levels": [{"level": c.level, "status": c.status, "detail": c.detail, "path": c.path}
                   for c in copies if c.version == manifest["version"]],
        "assembled": manifest.get("assembled"), "committed": manifest.get("committed"),
        "tensors": tensors, "ranks": ranks,
    }
    return out


def _utc(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def cmd_inspect(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    name = resolve_name(args, cfg)
    copies = scan(cfg, name)
    version = args.version if args.version is not None else newest_restorable(cfg, name, args.trust_owners)
    manifest, _ = _pick_manifest(copies, version)
    d = describe(manifest, copies)
    if args.json:
        _emit_json(d)
        return EXIT_OK
    ec = d["epoch_complete"]
    lines = [f"checkpoint {d['name']!r} version {d['version']}: step {d['step']}, epoch {d['epoch']}"
             + ("" if ec is None else f" ({'end of epoch' if ec else 'within the epoch'})"),
             f"world size {d['world_size']}; {len(d['tensors'])} tensors, {d['total_bytes']} bytes "
             f"({_mb(d['total_bytes'])}); plan min_shard_bytes {d['min_shard_bytes']}",
             "failure domains: " + "; ".join(f"{dom} ({_ranks_text(rs)})" for dom, rs in d["failure_domains"].items()),
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
    lines += ["  " + s for s in _table(
        ["ID", "NAME", "DTYPE", "SHAPE", "BYTES"],
        [[t["id"], t["name"], t["dtype"], "[" + ", ".join(map(str, t["shape"])) + "]", t["bytes"]]
         for t in d["tensors"]], right=(0, 4))]
    lines += ["", "shard plan, per rank:"]
    lines += ["  " + s for s in _table(["RANK", "DOMAIN", "FILE", "PIECES", "BYTES"],
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


# ============================================================================ verify

@dataclasses.dataclass
class Verdict:
    level: str
    version: int
    path: str
    status: str  # OK | DAMAGED | PARTIAL | SKIPPED
    reason: str = ""
    files: int = 0
    pieces: int = 0
    bytes: int = 0
    checksums: bool | None = None


def _check_file(path: str, kind: int, version: int, manifest: dict[str, Any],
                expected: list[tuple[int, int, int]], rank: int | None, world: int | None,
                progress: Progress, label: str, done: list[int], total: int) -> tuple[int, int, bool]:
    """Read and check one shard/assembled file the way restore does; every piece read with its CRC32."""
    pieces = nbytes = 0
    with os.fdopen(_open_regular(path), "rb") as f:  # never through a symbolic link, no FIFO
        idx = fmt.read_index(f, path)
        want_kind = "shard" if kind == fmt.KIND_SHARD else "assembled file"
        if idx.kind != kind:
            raise CorruptCheckpointError(f"{path}: not a DeepFreeze {want_kind} (kind {idx.kind})")
        if idx.version != version:
            raise CorruptCheckpointError(f"{path}: written for version {idx.version}, found under v{version}")
        if rank is not None and (idx.rank != rank or idx.world_size != world):
            raise CorruptCheckpointError(f"{path}: written by rank {idx.rank} of {idx.world_size}, expected rank "
                                         f"{rank} of {world}")
        if [(e.tensor_id, e.start, e.stop) for e in idx.entries] != expected:
            raise CorruptCheckpointError(f"{path}: its index does not match the manifest's shard plan")
        for e in idx.entries:
            t = manifest["tensors"][e.tensor_id]
            if e.dtype != t["dtype"] or list(e.shape) != t["shape"]:
                raise CorruptCheckpointError(f"{path}: tensor {t['name']!r} is {e.dtype}{list(e.shape)} in the "
                                             f"file but {t['dtype']}{t['shape']} in the manifest")
        for e in idx.entries:
            fmt.read_entry(f, e, verify=idx.has_crc, path=path)  # CRC32 of every piece, as restore checks it
            pieces += 1
            nbytes += e.length
            done[0] += e.length
            progress.update(f"verifying {label}: {_mb(done[0])} of {_mb(total)}")
    return pieces, nbytes, idx.has_crc


def verify_scratch(cfg: Config, copy: VersionCopy, name: str, progress: Progress) -> Verdict:
    level = ScratchLevel(cfg.scratch)
    v = copy.version
    out = Verdict("scratch", v, copy.path, "DAMAGED")
    try:
        m = level.read_manifest(name, v)
    except FileNotFoundError:
        out.reason = "incomplete: " + copy.detail
        return out
    except (OSError, DeepFreezeError, ValueError) as e:
        out.reason = f"manifest unreadable: {e}"
        return out
    try:
        plan = plan_of(m)
        present = [r for r in range(plan.world_size) if os.path.exists(level.shard_path(name, v, r))]
        status, detail = _scratch_missing(m, set(present))
        total = sum(plan.rank_bytes()[r] for r in present)
        has_crc = True
        done = [0]
        for r in present:
            path = level.shard_path(name, v, r)
            p, b, crc = _check_file(path, fmt.KIND_SHARD, v, m,
                                    [(x.tensor_id, x.start, x.stop) for x in plan.for_rank(r)],
                                    r, plan.world_size, progress, f"{name} v{v} scratch", done, total)
            out.files += 1
            out.pieces += p
            out.bytes += b
            has_crc &= crc
        out.checksums = has_crc if present else None
    except (OSError, DeepFreezeError, ValueError) as e:
        out.reason = str(e)
        return out
    if status == "incomplete":
        out.reason = "incomplete: " + detail
    elif status == "partial":
        out.status, out.reason = "PARTIAL", detail + "; the shards here are intact, the others can be verified " \
                                                      "only on their nodes"
    else:
        out.status = "OK"
    return out


def verify_persistent(cfg: Config, copy: VersionCopy, name: str, progress: Progress) -> Verdict:
    level = PersistentLevel(cfg.persistent)
    v = copy.version
    out = Verdict("persistent", v, copy.path, "DAMAGED")
    if copy.status == "skipped":
        out.status, out.reason = "SKIPPED", copy.detail
        return out
    if copy.status == "incomplete":
        out.reason = "incomplete: " + copy.detail
        return out
    try:
        m = level.read_manifest(name, v)
        plan = plan_of(m)
        asm = m.get("assembled") or {}
        path = os.path.join(copy.path, asm.get("file", ASSEMBLED))
        out.path = path
        if "bytes" in asm and os.path.getsize(path) != asm["bytes"]:
            raise CorruptCheckpointError(f"{path}: {os.path.getsize(path)} bytes, the manifest says {asm['bytes']}")
        p, b, crc = _check_file(path, fmt.KIND_ASSEMBLED, v, m,
                                [(x.tensor_id, x.start, x.stop) for x in plan.pieces], None, None,
                                progress, f"{name} v{v} persistent", [0], plan.total_bytes)
        if "checksums" in asm and bool(asm["checksums"]) != crc:
            raise CorruptCheckpointError(f"{path}: the manifest says checksums={asm['checksums']}, the file "
                                         f"header says {crc}")
    except (OSError, DeepFreezeError, ValueError) as e:
        out.reason = str(e)
        return out
    out.status, out.files, out.pieces, out.bytes, out.checksums = "OK", 1, p, b, crc
    return out


def cmd_verify(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    name = resolve_name(args, cfg)
    copies = scan(cfg, name)
    if args.all:
        chosen = copies
        if not chosen:
            raise CheckpointNotFoundError(f"no version of {name!r} in scratch {cfg.scratch} or persistent "
                                          f"{cfg.persistent}")
    else:
        version = args.version if args.version is not None else newest_restorable(cfg, name, args.trust_owners)
        chosen = [c for c in copies if c.version == version]
        if not chosen:
            raise CheckpointNotFoundError(f"version {version} of {name!r} is on no level; versions on disk: "
                                          f"{sorted({c.version for c in copies}) or 'none'}")
    chosen.sort(key=lambda c: (c.version, c.level != "scratch"))
    progress = Progress()
    verdicts = []
    try:
        for c in chosen:
            fn = verify_scratch if c.level == "scratch" else verify_persistent
            verdicts.append(fn(cfg, c, name, progress))
    finally:
        progress.done()
    damaged = [x for x in verdicts if x.status == "DAMAGED"]
    if args.json:
        _emit_json({"name": name, "ok": not damaged, "results": [dataclasses.asdict(x) for x in verdicts]})
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
        print("\n".join(lines))
    return EXIT_FAIL if damaged else EXIT_OK


# ============================================================================ export

def cmd_export(args: argparse.Namespace) -> int:
    from . import export as ex
    fmt_name = args.format or ex.format_from_path(args.output)
    if fmt_name is None:
        raise UsageError(f"cannot tell the format from {args.output!r}: pass --format h5|npz|safetensors")
    cfg = load_config(args.config, args.overrides)
    name = resolve_name(args, cfg)
    progress = Progress()
    progress.update(f"loading {name}" + (f" v{args.version}" if args.version is not None else ""), force=True)
    try:
        ck = load(cfg, name, args.version, verify=True, trust_owners=args.trust_owners)
        progress.update(f"writing {args.output}", force=True)
        meta = {"name": ck.name, "version": ck.version, "step": ck.step, "epoch": ck.epoch, "format": "deepfreeze"}
        # a Keras weights file holds the model's weights only; npz/safetensors also the optimizer state
        arrays = ck.model_arrays() if fmt_name == "h5" else ck.arrays
        size = ex.export(arrays, fmt_name, args.output, metadata=meta, force=args.force)
    finally:
        progress.done()
    print(f"exported {name!r} v{ck.version} (step {ck.step}, {len(arrays)} tensors, read from {ck.level}) "
          f"to {os.path.abspath(args.output)} ({fmt_name}, {size} bytes)")
    return EXIT_OK


# ============================================================================ gc

@dataclasses.dataclass
class Removal:
    level: str
    version: int
    path: str
    why: str
    files: list[str] = dataclasses.field(default_factory=list)  # scratch: the shard files
    whole_dir: bool = True


def plan_gc(cfg: Config, name: str) -> tuple[list[Removal], dict[str, Any]]:
    """What ``gc`` removes, computed with the same rules the Level classes' retain methods apply."""
    scratch, pers = ScratchLevel(cfg.scratch), PersistentLevel(cfg.persistent)
    out: list[Removal] = []
    committed = pers.committed_versions(name)
    keep_p = cfg.max_versions
    if keep_p > 0:
        for v in committed[:-keep_p]:
            out.append(Removal("persistent", v, pers.version_dir(name, v),
                               f"committed, older than the newest max_versions={keep_p}"))
    if committed:
        for v in pers.versions(name):
            if v < committed[-1] and v not in committed:
                vdir = pers.version_dir(name, v)
                if os.path.lexists(os.path.join(vdir, MANIFEST)):
                    continue  # a damaged manifest: left for the user to look at (verify reports it)
                why = ("decided skip (persistent_interval)" if _decision(vdir) == "skip"
                       else "incomplete (no manifest.json)")
                out.append(Removal("persistent", v, vdir, f"{why}, older than committed v{committed[-1]}"))
    # scratch: versions up to the newest one settled on persistent (committed or skipped; all of them
    # when persistent_interval < 0), so a version whose flush may still be pending is never counted
    keep_s = cfg.keep_scratch
    versions = scratch.versions(name)
    if cfg.persistent_interval < 0:
        upto = versions[-1] if versions else -1
    else:
        settled = [v for v in pers.versions(name)
                   if v in committed or _decision(pers.version_dir(name, v)) == "skip"]
        upto = settled[-1] if settled else -1
    ranks: set[int] = set()
    for v in versions:
        _, files = _dir_bytes(scratch.version_dir(name, v))
        ranks |= {int(m.group(1)) for f in files if (m := _SHARD_RE.match(f))}
    if keep_s > 0:
        for v in [v for v in versions if v <= upto][:-keep_s]:
            vdir = scratch.version_dir(name, v)
            _, files = _dir_bytes(vdir)
            shards = [f for f in files if _SHARD_RE.match(f)]
            whole = not any(f.endswith(".dfs") or ".dfs.tmp" in f for f in files if f not in shards)
            out.append(Removal("scratch", v, vdir, f"older than the newest scratch_versions/max_versions={keep_s}",
                               shards, whole))
    info = {"keep_persistent": keep_p, "keep_scratch": keep_s, "scratch_upto": upto, "ranks": sorted(ranks)}
    return out, info


def cmd_gc(args: argparse.Namespace) -> int:
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
                    and not os.path.exists(os.path.join(r.path, MANIFEST)):
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


# ============================================================================ backend

def _listening(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def cmd_backend(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    path = socket_path(cfg.scratch)  # BackendError here (bad runtime dir) is an error, not "not running"
    try:
        client = BackendClient(cfg.scratch, start=False)
    except BackendError:
        if args.json:
            _emit_json({"running": False, "socket": path, "scratch": cfg.scratch})
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
            _emit_json(info)
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
        _emit_json(info)
    elif stopped:
        print(f"backend pid {info['pid']} for scratch {cfg.scratch}: stopped"
              + (f" after draining {info['pending']} pending flush job(s)" if info["pending"] else ""))
    else:
        print(f"backend pid {info['pid']} for scratch {cfg.scratch}: stop requested; still draining "
              f"{info['pending']} pending flush job(s) after {args.timeout:g}s")
    return EXIT_OK if stopped else EXIT_FAIL


# ============================================================================ argument parsing

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _version_arg(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid version {text!r}: an integer >= 0") from None
    if not 0 <= v < 10 ** 12:
        raise argparse.ArgumentTypeError(f"invalid version {text!r}: an integer >= 0")
    return v


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    g = common.add_argument_group("configuration (as the Keras callback)")
    g.add_argument("--config", metavar="FILE",
                   help="VeloC INI file (optional; VELOC_<KEY> environment variables apply on top)")
    g.add_argument("--name", metavar="NAME",
                   help="checkpoint name (as DeepFreezeCheckpoint(name=...)); default: the only one found")
    g.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                   help="override an INI key, e.g. --set scratch=/local/ssd/ckpt (repeatable)")
    as_json = _Parser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print machine-readable JSON")
    trust = _Parser(add_help=False)
    trust.add_argument("--trust-owner", metavar="USER", action="append", default=None, dest="trust_owners",
                       help="also read persistent files owned by USER (name or uid; repeatable); by default only "
                            "your own and root's are read")
    version = _Parser(add_help=False)
    version.add_argument("--version", type=_version_arg, metavar="V",
                         help="checkpoint version (default: the newest committed one)")

    ap = _Parser(prog="deepfreeze", description="Inspect and manage DeepFreeze checkpoints (see docs/cli.md).",
                 epilog="exit codes: 0 success, 1 damaged / not found / I/O error, 2 usage or configuration error")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("ls", parents=[common, as_json, trust], help="versions per level with their status",
                       description="List the versions of a checkpoint (all checkpoints without --name) on scratch "
                                   "and persistent: step, epoch, bytes on disk, status, directory.")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", parents=[common, version, as_json, trust], help="tensors, shard plan, domains",
                       description="Show one version's tensors, world size, shard plan and failure domains.")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", parents=[common, as_json, trust], help="read every piece and check every checksum",
                       description="Check completeness and every CRC32 of a version on each level that holds it. "
                                   "Exit code 1 if anything is damaged.")
    x = p.add_mutually_exclusive_group()
    x.add_argument("--version", type=_version_arg, metavar="V",
                   help="checkpoint version (default: the newest committed one)")
    x.add_argument("--all", action="store_true", help="every version directory on every level")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("export", parents=[common, version, trust], help="write a version as h5, npz or safetensors",
                       description="Load a committed version (checksums verified) and write it as a Keras HDF5 "
                                   "weights file, a NumPy .npz or a safetensors file.")
    p.add_argument("--format", choices=["h5", "npz", "safetensors"],
                   help="output format (default: from the --output suffix)")
    p.add_argument("--output", "-o", required=True, metavar="PATH", help="output file")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("gc", parents=[common], help="apply retention now; remove abandoned flushes",
                       description="Apply max_versions / scratch_versions now and remove incomplete persistent "
                                   "version directories older than the newest committed version.")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("backend", parents=[common], help="status or stop of this scratch's backend process",
                       description="Talk to the backend process serving the configured scratch directory.")
    p.add_argument("action", choices=["status", "stop"])
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="stop: seconds to wait for the backend to drain its queue and exit (default 60)")
    p.set_defaults(func=cmd_backend)
    return ap


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (UsageError, ConfigError) as e:
        _err(e)
        return EXIT_USAGE
    except DeepFreezeError as e:
        from .export import ExportError  # the output or format refused: a usage error
        _err(e)
        return EXIT_USAGE if isinstance(e, ExportError) else EXIT_FAIL
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")  # the reader went away (e.g. `| head`): no second error
        except OSError:
            pass
        return EXIT_FAIL
    except (DeepFreezeError, OSError) as e:
        _err(e)
        return EXIT_FAIL
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
