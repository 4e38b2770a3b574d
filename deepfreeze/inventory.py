"""What is on the levels: scanning, describing, verifying and planning clean-up of version directories.

The core layer the ``deepfreeze`` command's modules (and anything else that
inspects checkpoints without restoring them) share. No TensorFlow, no argparse,
no printing: functions return dataclasses and dicts, problems are statuses with
a one-line ``detail`` (never an exception for a damaged or hostile file), and
callers decide how to show them.

Reading rules (docs/cli.md, *Statuses*): every file is opened with
:func:`deepfreeze.fsafe.open_regular_file` (a FIFO, socket, directory or
symlink in a version directory is reported, never waited on or followed);
every manifest goes through :func:`deepfreeze.format.decode_manifest` (its
limits); any exception while reading a manifest or an index makes that copy
``damaged`` with the reason, once per directory; a version directory with no
files at all is ``empty`` (abandoned), not damaged; one whose manifest names
shards none of which is here is ``incomplete`` with "no shard here". Everything
is linear in the number of tensors, pieces and ranks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from typing import Any, Callable, Iterable

from . import format as fmt
from .config import Config, validate_name
from .errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, DeepFreezeError
from .fsafe import open_regular_file
from .tiers.base import MANIFEST, TIER_ORDER, plan_of
from .tiers.persistent import ASSEMBLED, PersistentLevel, read_decision
from .tiers.scratch import ScratchLevel
from .tiers.memtier import MemtierLevel, job_of as memtier_job_of, read_item as read_memtier_item, region_address
from .tiers.memtier import changed as memtier_changed, forget as memtier_forget, reading as memtier_reading
from .loader import list_versions, scratch_recoverable
from .lease import fs_now, read_lease

__all__ = ["VersionCopy", "Verdict", "Removal", "checkpoint_names", "scan_scratch", "scan_persistent", "scan", "parent_text",
           "newest_restorable", "restorable", "scan_memtier", "verify_memtier", "memtier_names", "memtier_ignored", "declared_bytes", "pick_manifest", "describe", "verify_scratch", "verify_persistent", "verify_copy",
           "plan_gc", "live_run", "decision_word", "ranks_text", "dir_listing"]

_SHARD_RE = re.compile(r"^r(\d{6})\.dfs$")
# what reading a damaged or hostile file can raise; each means "this copy is damaged", with the reason
_UNREADABLE = (OSError, DeepFreezeError, ValueError, KeyError, IndexError, TypeError)

#: ``progress(label, bytes_done, bytes_total)``, called as pieces are verified (the CLI draws a line)
ProgressFn = Callable[[str, int, int], None]


def _reason(e: BaseException) -> str:
    return " ".join((str(e) or type(e).__name__).split())


def checkpoint_names(cfg: Config) -> list[str]:
    """Checkpoint names that have at least one version directory on either level."""
    found = set()
    for level in (ScratchLevel(cfg.scratch), PersistentLevel(cfg.persistent)):
        try:
            entries = os.listdir(level.root)
        except OSError:
            continue
        for n in entries:
            try:
                validate_name(n)
            except ConfigError:
                continue
            try:
                if os.path.isdir(level.name_dir(n)) and not os.path.islink(level.name_dir(n)) and level.versions(n):
                    found.add(n)
            except OSError:
                continue
    found.update(memtier_names(cfg))
    return sorted(found)


def memtier_names(cfg: Config) -> set[str]:
    """Checkpoint names with a DONE slot in the memory tier (INI ``memtier``), if one is configured."""
    if not getattr(cfg, "memtier", None):
        return set()
    return set(MemtierLevel(cfg.memtier, None).names(lambda n: memtier_job_of(cfg.persistent, n)))


def memtier_ignored(cfg: Config, name: str) -> list[str]:
    """Notes on the memory-tier regions of ``name`` that ``ls``/``verify``/restore ignore because
    they are not of this job (``<persistent>/<name>/job``): another job's, or of unknown job."""
    if not getattr(cfg, "memtier", None):
        return []
    level = MemtierLevel(cfg.memtier, memtier_job_of(cfg.persistent, name))
    level.slots(name, quiet=True)
    return level.ignored


@dataclasses.dataclass
class VersionCopy:
    """One version directory on one level, as found on disk (no tensor data read)."""

    level: str  # memtier | scratch | persistent
    version: int
    path: str
    status: str  # complete | partial | committed | skipped | incomplete | empty | damaged
    detail: str = ""
    step: int | None = None
    epoch: int | None = None
    bytes: int = 0  # bytes of the regular files in the directory
    tensor_bytes: int | None = None
    manifest: dict[str, Any] | None = None
    run: str | None = None  # id of the run that wrote it ("" before runs had ids)
    generation: int | None = None
    resumed_from: int | None = None  # the step that run resumed from, if it was a resumed run
    parent: dict[str, Any] | None = None  # a clone's source: {"name", "run", "step"} (format.manifest_parent)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("manifest")
        return d


def dir_listing(path: str) -> tuple[int, list[str]]:
    """(bytes of the regular files, sorted names of every entry) of a directory; symlinks are
    listed but neither followed nor counted; an unreadable directory is empty."""
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


def ranks_text(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def parent_text(parent: dict[str, Any] | None) -> str:
    """``cloned from 'NAME' run RUN step K`` for a clone's parent record ("" for none)."""
    if not parent:
        return ""
    name = "(unnamed)" if parent.get("name") is None else repr(parent["name"])
    return f"cloned from {name} run {parent.get('run') or '(none)'} step {parent.get('step')}"


def _scratch_missing(m: dict[str, Any], present: set[int]) -> tuple[str, str]:
    """Status of a scratch version with a manifest: complete, partial (the missing ranks ran in
    other failure domains, whose scratch is elsewhere) or incomplete."""
    missing = [s for s in m["shards"] if s["rank"] not in present]
    if not missing:
        return "complete", ""
    if not present:
        return "incomplete", ("manifest only, no shard here (retention interrupted, or the files were "
                              "purged): not on scratch")
    here = {s.get("domain") for s in m["shards"] if s["rank"] in present}
    away = {s.get("domain") for s in missing}
    if here and None not in here and not here & away:
        return "partial", (f"{ranks_text(sorted(present))} here ({', '.join(sorted(map(str, here)))}); "
                           f"{ranks_text(s['rank'] for s in missing)} on the scratch of other failure domains "
                           f"({', '.join(sorted(str(d) for d in away))})")
    return "incomplete", f"missing shards of {ranks_text(s['rank'] for s in missing)}"


def declared_bytes(m: dict[str, Any]) -> int:
    """Bytes of all tensors a (decoded) manifest declares: what its files must hold at least."""
    return sum(math.prod(t["shape"]) * fmt.dtype_itemsize(t["dtype"]) for t in m["tensors"])


def scan_scratch(cfg: Config, name: str) -> list[VersionCopy]:
    """Every version directory of ``name`` on this scratch, with its status (one line of detail)."""
    level = ScratchLevel(cfg.scratch)
    out = []
    for v in level.versions(name):
        vdir = level.version_dir(name, v)
        size, files = dir_listing(vdir)
        present = {int(m.group(1)) for f in files if (m := _SHARD_RE.match(f))}
        c = VersionCopy("scratch", v, vdir, "incomplete", bytes=size)
        if not files:
            c.status, c.detail = "empty", "empty directory (abandoned): nothing to restore"
            out.append(c)
            continue
        try:
            m = level.read_manifest(name, v)
        except FileNotFoundError:
            c.detail = (f"no manifest.json yet; shards of {ranks_text(sorted(present))}" if present
                        else "no manifest.json and no shards") + " (being written, or abandoned)"
        except _UNREADABLE as e:
            c.status, c.detail = "damaged", f"manifest unreadable: {_reason(e)}"
        else:
            try:
                shard_files = {s["rank"]: s["file"] for s in m["shards"]}
                # the shard files the manifest names; partner copies and parity can stand in for missing ones
                names = set(files)
                present = {r for r, f in shard_files.items() if f in names}
                c.status, c.detail = _scratch_missing(m, present)
                if c.status != "complete" and scratch_recoverable(m, level.inventory(name, v)):
                    c.status, c.detail = "complete", "missing shards recoverable from partner copies / parity here"
                elif c.status == "complete":  # every shard here: they must hold the tensors the manifest declares
                    held = sum(_size(os.path.join(vdir, shard_files[r])) for r in present)
                    if declared_bytes(m) > held:
                        c.status, c.detail = "damaged", (f"the manifest declares {declared_bytes(m)} bytes of tensors, "
                                                         f"the shard files hold {held} bytes")
                c.step, c.epoch, c.tensor_bytes, c.manifest = m["step"], m["epoch"], m.get("total_bytes"), m
            except _UNREADABLE as e:
                c.status, c.detail = "damaged", f"manifest unusable: {_reason(e)}"
        out.append(c)
    return out


def decision_word(vdir: str) -> str | None:
    """The ``decision`` of a persistent version directory (``flush``/``skip``/``corrupt``), or None
    (:func:`deepfreeze.tiers.persistent.read_decision`)."""
    d = read_decision(vdir)
    return None if d is None else d["decision"]


def scan_persistent(cfg: Config, name: str) -> list[VersionCopy]:
    """Every version directory of ``name`` on persistent, with its status (one line of detail)."""
    level = PersistentLevel(cfg.persistent)
    versions = level.versions(name)
    copies = []
    for v in versions:
        vdir = level.version_dir(name, v)
        size, files = dir_listing(vdir)
        c = VersionCopy("persistent", v, vdir, "incomplete", bytes=size)
        copies.append((c, files))
        if not files:
            c.status, c.detail = "empty", "empty directory (abandoned): nothing to restore"
        elif MANIFEST in files:
            try:
                m = level.read_manifest(name, v)
                c.step, c.epoch, c.tensor_bytes = m["step"], m["epoch"], m.get("total_bytes")
                asm = m.get("assembled") or {}
                path = os.path.join(vdir, asm.get("file", ASSEMBLED))
            except _UNREADABLE as e:
                c.status, c.detail = "damaged", f"manifest unreadable: {_reason(e)}"
                continue
            c.manifest = m
            try:
                with open_regular_file(path) as f:
                    actual = os.fstat(f.fileno()).st_size
            except FileNotFoundError:
                c.status, c.detail = "damaged", f"{os.path.basename(path)} is missing"
            except _UNREADABLE as e:
                c.status, c.detail = "damaged", _reason(e)
            else:
                if "bytes" in asm and actual != asm["bytes"]:
                    c.status, c.detail = "damaged", (f"{os.path.basename(path)} has {actual} bytes, "
                                                     f"the manifest says {asm['bytes']}")
                elif declared_bytes(m) > actual:
                    c.status, c.detail = "damaged", (f"the manifest declares {declared_bytes(m)} bytes of tensors, "
                                                     f"{os.path.basename(path)} has {actual} bytes")
                else:
                    c.status = "committed"
        elif decision_word(vdir) == "skip":
            c.status, c.detail = "skipped", "not flushed (persistent_interval); on scratch only"
    committed = [c.version for c, _ in copies if c.status == "committed"]
    for c, files in copies:
        if c.status == "incomplete":
            done = sum(1 for f in files if f.startswith("done.r") and f.endswith(".json"))
            partial = any(f.startswith(ASSEMBLED + ".partial") for f in files)
            state = f"{done} rank(s) flushed" + (", model.dfz.partial present" if partial else "")
            newer = [x for x in committed if x > c.version]
            c.detail = (f"not committed (no manifest.json): {state}; "
                        + (f"abandoned (v{newer[-1]} is committed)" if newer else "flush in progress, or abandoned"))
    return [c for c, _ in copies]


def scan_memtier(cfg: Config, name: str) -> list[VersionCopy]:
    """Every version of ``name`` in DONE slots of the memory tier (INI ``memtier``), one copy per
    version: ``complete`` when every rank's shard is on this device, else ``partial``/``incomplete``
    as on scratch. ACTIVE slots are never listed as copies (``deepfreeze memtier view`` shows them)."""
    if not getattr(cfg, "memtier", None):
        return []
    level = MemtierLevel(cfg.memtier, memtier_job_of(cfg.persistent, name))
    by_version: dict[int, list] = {}
    for region, k, h, m in level.slots(name, quiet=True):  # what was ignored: memtier_ignored()
        by_version.setdefault(h.version.step, []).append((region, k, h, m))
    out = []
    for v, slots in sorted(by_version.items()):
        region, k, h, m = slots[0]
        run = fmt.manifest_run(m)[0]
        ranks = {r.rank for r, _, hh, _ in slots if hh.run == run}
        c = VersionCopy("memtier", v, f"{cfg.memtier} [{name} v{v}]", "incomplete",
                        bytes=sum(hh.image_len for r, _, hh, _ in slots if hh.run == run))
        try:
            c.status, c.detail = _scratch_missing(m, ranks)
            c.step, c.epoch, c.tensor_bytes, c.manifest = m["step"], m["epoch"], m.get("total_bytes"), m
        except _UNREADABLE as e:
            c.status, c.detail = "damaged", f"manifest unusable: {_reason(e)}"
        out.append(c)
    return out


def scan(cfg: Config, name: str) -> list[VersionCopy]:
    """:func:`scan_memtier`, :func:`scan_scratch` then :func:`scan_persistent`, with the run of each
    copy that has a valid manifest (run id, generation, resumed from) and, for a clone, its parent."""
    scans = {"memtier": scan_memtier, "scratch": scan_scratch, "persistent": scan_persistent}
    copies = [c for tier in TIER_ORDER for c in scans[tier](cfg, name)]  # the read order (deepfreeze.tiers.base)
    for c in copies:
        if c.manifest is not None:
            c.run, c.generation, c.resumed_from = fmt.manifest_run(c.manifest)
            c.parent = fmt.manifest_parent(c.manifest)
    return copies


def _size(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def restorable(cfg: Config, name: str, copies: list[VersionCopy] | None = None,
               trust_owners: list[str] | None = None) -> dict[int, list[str]]:
    """``deepfreeze.list_versions`` (with ``trust_owners``) without the copies :func:`scan` found
    damaged (a manifest that reads fine but whose files cannot hold it, a FIFO as ``model.dfz``):
    what restore will read."""
    copies = scan(cfg, name) if copies is None else copies
    damaged = {(c.level, c.version) for c in copies if c.status == "damaged"}
    out = {}
    for v, lvls in list_versions(cfg, name, trust_owners=trust_owners).items():
        ok = [lv for lv in lvls if (lv, v) not in damaged]
        if ok:
            out[v] = ok
    return out


def newest_restorable(cfg: Config, name: str, copies: list[VersionCopy] | None = None,
                      trust_owners: list[str] | None = None) -> int:
    """The newest version :func:`restorable` reports (what ``deepfreeze.load`` returns unless a
    file fails its checksums)."""
    versions = restorable(cfg, name, copies, trust_owners)
    if not versions:
        raise CheckpointNotFoundError(f"no committed version of {name!r} in scratch {cfg.scratch} or persistent "
                                      f"{cfg.persistent} (deepfreeze ls --name {name} shows what is there)")
    return max(versions)


# ============================================================================ describe (inspect)

def pick_manifest(copies: list[VersionCopy], version: int) -> tuple[dict[str, Any], VersionCopy]:
    """The manifest of ``version``: the committed one on persistent first, else scratch's."""
    mine = [c for c in copies if c.version == version and c.manifest is not None]
    mine.sort(key=lambda c: c.level != "persistent")
    if not mine:
        raise CheckpointNotFoundError(f"version {version} has no readable manifest on any level; versions on "
                                      f"disk: {sorted({c.version for c in copies}) or 'none'}")
    return mine[0].manifest, mine[0]


def describe(manifest: dict[str, Any], copies: list[VersionCopy]) -> dict[str, Any]:
    """Everything ``inspect`` shows, as a JSON-able dict. Linear in tensors + pieces + ranks."""
    plan = plan_of(manifest)
    by_tensor: list[list[dict[str, int]]] = [[] for _ in plan.tensors]
    pieces_of_rank = [0] * plan.world_size
    rank_bytes = [0] * plan.world_size
    itemsize = [fmt.dtype_itemsize(t.dtype) for t in plan.tensors]
    for p in plan.pieces:  # one pass (pieces are sorted by tensor, then start)
        nbytes = p.count * itemsize[p.tensor_id]
        by_tensor[p.tensor_id].append({"rank": p.rank, "start": p.start, "stop": p.stop, "bytes": nbytes})
        pieces_of_rank[p.rank] += 1
        rank_bytes[p.rank] += nbytes
    tensors = [{"id": t.id, "name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                "pieces": by_tensor[t.id]} for t in plan.tensors]
    shard_by_rank = {s["rank"]: s for s in manifest["shards"]}
    ranks = [{"rank": r, "domain": shard_by_rank.get(r, {}).get("domain"), "file": shard_by_rank.get(r, {}).get("file"),
              "pieces": pieces_of_rank[r], "bytes": rank_bytes[r]} for r in range(plan.world_size)]
    domains: dict[str, list[int]] = {}
    for r in ranks:
        domains.setdefault(str(r["domain"]), []).append(r["rank"])
    return {
        "name": manifest["name"], "version": manifest["version"], "step": manifest["step"],
        "epoch": manifest["epoch"], "epoch_complete": manifest.get("epoch_complete"),
        "world_size": plan.world_size, "total_bytes": plan.total_bytes, "min_shard_bytes": plan.min_shard_bytes,
        "plan_algorithm": manifest["plan"].get("algorithm"),  # None: an older record listing every piece
        "failure_domains": domains,
        "levels": [{"level": c.level, "status": c.status, "detail": c.detail, "path": c.path}
                   for c in copies if c.version == manifest["version"]],
        "assembled": manifest.get("assembled"), "committed": manifest.get("committed"),
        "run": dict(zip(("id", "generation", "resumed_from"), fmt.manifest_run(manifest))),
        "parent": fmt.manifest_parent(manifest),
        "tensors": tensors, "ranks": ranks,
    }


# ============================================================================ verify

@dataclasses.dataclass
class Verdict:
    """The result of verifying one copy of a version."""

    level: str
    version: int
    path: str
    status: str  # OK | DAMAGED | PARTIAL | SKIPPED | EMPTY
    reason: str = ""
    files: int = 0
    pieces: int = 0
    bytes: int = 0
    checksums: bool | None = None


class _Meter:
    def __init__(self, progress: ProgressFn | None, label: str, total: int) -> None:
        self.progress, self.label, self.total, self.done = progress, label, total, 0

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.label, self.done, self.total)


def check_file(path: str, kind: int, version: int, manifest: dict[str, Any],
               expected: list[tuple[int, int, int]], rank: int | None, world: int | None,
               meter: _Meter, data: Any = None) -> tuple[int, int, bool]:
    """Read and check one shard/assembled file the way restore does; every piece read with its
    CRC32, one piece in memory at a time. ``data``: the file's bytes already in memory (a
    memory-tier slot image; ``path`` then only names it). Returns (pieces, bytes, has checksums)."""
    pieces = nbytes = 0
    with (open_regular_file(path) if data is None else contextlib.nullcontext()) as f:
        idx = fmt.read_index(f if data is None else data, path)
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
            if data is None:
                fmt.read_entry(f, e, verify=idx.has_crc, path=path)  # CRC32 of every piece, as restore checks it
            else:
                fmt.entry_view(data, e, verify=idx.has_crc, path=path)
            pieces += 1
            nbytes += e.length
            meter.add(e.length)
    return pieces, nbytes, idx.has_crc


def verify_scratch(cfg: Config, copy: VersionCopy, name: str, progress: ProgressFn | None = None) -> Verdict:
    """Verify the scratch copy ``copy`` (from :func:`scan_scratch`): every shard here, every checksum."""
    level = ScratchLevel(cfg.scratch)
    v = copy.version
    out = Verdict("scratch", v, copy.path, "DAMAGED")
    if copy.status == "empty":
        out.status, out.reason = "EMPTY", copy.detail
        return out
    try:
        m = level.read_manifest(name, v)
    except FileNotFoundError:
        out.reason = "incomplete: " + copy.detail
        return out
    except _UNREADABLE as e:
        out.reason = f"manifest unreadable: {_reason(e)}"
        return out
    try:
        plan = plan_of(m)
        present = [r for r in range(plan.world_size) if os.path.lexists(level.shard_path(name, v, r))]
        status, detail = _scratch_missing(m, set(present))
        expected: list[list[tuple[int, int, int]]] = [[] for _ in range(plan.world_size)]
        for p in plan.pieces:  # one pass: pieces per rank
            expected[p.rank].append((p.tensor_id, p.start, p.stop))
        rank_bytes = plan.rank_bytes()
        meter = _Meter(progress, f"{name} v{v} scratch", sum(rank_bytes[r] for r in present))
        has_crc = True
        for r in present:
            p, b, crc = check_file(level.shard_path(name, v, r), fmt.KIND_SHARD, v, m, expected[r],
                                   r, plan.world_size, meter)
            out.files += 1
            out.pieces += p
            out.bytes += b
            has_crc &= crc
        out.checksums = has_crc if present else None
    except _UNREADABLE as e:
        out.reason = _reason(e)
        return out
    return _settle(out, status, detail, "shards")


def _settle(out: Verdict, status: str, detail: str, what: str) -> Verdict:
    """The verdict of a copy whose files here all verified: OK, PARTIAL (the missing ranks' files
    are on other nodes) or, still DAMAGED, incomplete."""
    if status == "incomplete":
        out.reason = "incomplete: " + detail
    elif status == "partial":
        out.status, out.reason = "PARTIAL", (f"{detail}; the {what} here are intact, the others can be verified "
                                             "only on their nodes")
    else:
        out.status = "OK"
    return out


def verify_memtier(cfg: Config, copy: VersionCopy, name: str, progress: ProgressFn | None = None) -> Verdict:
    """Verify the memory-tier copy ``copy`` (from :func:`scan_memtier`): every slot image of the
    version on this device, every checksum (each image copied out and re-checked as restore does)."""
    v = copy.version
    out = Verdict("memtier", v, copy.path, "DAMAGED")
    m = copy.manifest
    if m is None:
        out.reason = copy.detail
        return out
    run = fmt.manifest_run(m)[0]
    try:
        plan = plan_of(m)
        slots = {r.rank: (r, k) for r, k, h, _ in MemtierLevel(cfg.memtier, memtier_job_of(cfg.persistent, name))
                 .slots(name, quiet=True)
                 if h.version.step == v and h.run == run}
        expected: list[list[tuple[int, int, int]]] = [[] for _ in range(plan.world_size)]
        for p in plan.pieces:
            expected[p.rank].append((p.tensor_id, p.start, p.stop))
        rank_bytes = plan.rank_bytes()
        meter = _Meter(progress, f"{name} v{v} memtier", sum(rank_bytes[r] for r in slots))
        has_crc = True
        with memtier_reading():  # each slot verified in place; a slot rewritten meanwhile is reported as such
            for r, (region, k) in sorted(slots.items()):
                item = f"{copy.path} rank {r} slot {k}"
                memtier_forget()
                image = read_memtier_item(region_address(cfg.memtier, region, k, run, v), v, run)
                p, b, crc = check_file(item, fmt.KIND_SHARD, v, m, expected[r], r, plan.world_size, meter, data=image)
                del image
                if memtier_changed():
                    raise CorruptCheckpointError(f"{item}: rewritten by a newer version while it was verified "
                                                 "(the job is running): verify again, or verify persistent")
                out.files += 1
                out.pieces += p
                out.bytes += b
                has_crc &= crc
        out.checksums = has_crc if slots else None
        status, detail = _scratch_missing(m, set(slots))
    except _UNREADABLE as e:
        out.reason = _reason(e)
        return out
    return _settle(out, status, detail, "slots")


def verify_persistent(cfg: Config, copy: VersionCopy, name: str, progress: ProgressFn | None = None) -> Verdict:
    """Verify the persistent copy ``copy`` (from :func:`scan_persistent`): the assembled file, every checksum."""
    level = PersistentLevel(cfg.persistent)
    v = copy.version
    out = Verdict("persistent", v, copy.path, "DAMAGED")
    if copy.status == "skipped":
        out.status, out.reason = "SKIPPED", copy.detail
        return out
    if copy.status == "empty":
        out.status, out.reason = "EMPTY", copy.detail
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
        with open_regular_file(path) as f:
            actual = os.fstat(f.fileno()).st_size
        if "bytes" in asm and actual != asm["bytes"]:
            raise CorruptCheckpointError(f"{path}: {actual} bytes, the manifest says {asm['bytes']}")
        p, b, crc = check_file(path, fmt.KIND_ASSEMBLED, v, m,
                               [(x.tensor_id, x.start, x.stop) for x in plan.pieces], None, None,
                               _Meter(progress, f"{name} v{v} persistent", plan.total_bytes))
        if "checksums" in asm and bool(asm["checksums"]) != crc:
            raise CorruptCheckpointError(f"{path}: the manifest says checksums={asm['checksums']}, the file "
                                         f"header says {crc}")
    except _UNREADABLE as e:
        out.reason = _reason(e)
        return out
    out.status, out.files, out.pieces, out.bytes, out.checksums = "OK", 1, p, b, crc
    return out


def verify_copy(cfg: Config, copy: VersionCopy, name: str, progress: ProgressFn | None = None) -> Verdict:
    """:func:`verify_scratch` or :func:`verify_persistent`, by the copy's level."""
    fn = {"memtier": verify_memtier, "scratch": verify_scratch}.get(copy.level, verify_persistent)
    return fn(cfg, copy, name, progress)


# ============================================================================ gc

@dataclasses.dataclass
class Removal:
    """One version directory ``gc`` removes (or, for scratch, the shard files in it)."""

    level: str
    version: int
    path: str
    why: str
    files: list[str] = dataclasses.field(default_factory=list)  # scratch: the shard files
    whole_dir: bool = True


def live_run(cfg: Config, name: str) -> str | None:
    """The id of the run holding a live lease on ``name`` (heartbeat younger than ``lease_timeout``
    by the file system's clock), or None."""
    got = read_lease(cfg.persistent, name)
    if got is None or got[0].get("released"):
        return None
    holder, mtime = got
    try:
        age = fs_now(os.path.join(cfg.persistent, name)) - mtime
    except OSError:
        return holder.get("run")  # cannot tell: assume it is alive
    return holder.get("run") if age <= cfg.lease_timeout else None


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
    live = live_run(cfg, name)
    if committed:
        for v in pers.versions(name):
            if v < committed[-1] and v not in committed:
                vdir = pers.version_dir(name, v)
                if os.path.lexists(os.path.join(vdir, MANIFEST)):
                    continue  # a damaged manifest: left for the user to look at (verify reports it)
                d = read_decision(vdir)
                if live is not None and d is not None and d["run"] == live and d["decision"] == "flush":
                    continue  # a flush of the live run, maybe still in progress: never touched
                why = ("decided skip (persistent_interval)" if decision_word(vdir) == "skip"
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
                   if v in committed or decision_word(pers.version_dir(name, v)) == "skip"]
        upto = settled[-1] if settled else -1
    ranks: set[int] = set()
    listing = {v: dir_listing(scratch.version_dir(name, v))[1] for v in versions}
    for files in listing.values():
        ranks |= {int(m.group(1)) for f in files if (m := _SHARD_RE.match(f))}
    if keep_s > 0:
        for v in [v for v in versions if v <= upto][:-keep_s]:
            files = listing[v]
            shards = [f for f in files if _SHARD_RE.match(f)]
            whole = not any(f.endswith(".dfs") or ".dfs.tmp" in f for f in files if f not in shards)
            out.append(Removal("scratch", v, scratch.version_dir(name, v),
                               f"older than the newest scratch_versions/max_versions={keep_s}", shards, whole))
    info = {"keep_persistent": keep_p, "keep_scratch": keep_s, "scratch_upto": upto, "ranks": sorted(ranks)}
    return out, info
