"""The tier interface, the directory layout every level shares, and the pooled read order.

A *tier* is one place a version's shards can be: node-local scratch
(:mod:`~deepfreeze.tiers.scratch`), the memory tier (:mod:`~deepfreeze.tiers.memtier`), shared
persistent storage (:mod:`~deepfreeze.tiers.persistent`, with the commit protocol), and the
write-once route into persistent (:mod:`~deepfreeze.tiers.direct`). Which of them a run uses, and
which one each version goes to, is decided once, by :func:`deepfreeze.tiers.choose`. The shard
bytes themselves (files written and copied in chunks, CRC32 while copying) are
:mod:`~deepfreeze.tiers.shardbytes`'; one rank's flush to persistent is
:func:`deepfreeze.tiers.flush.flush_job`.

Every version directory is ``<root>/<name>/v<version:012d>/`` on each directory tier; a version is
committed on a tier when its ``manifest.json`` is there (the details are each tier's). Levels are
classes so faults can be injected by subclassing one (tests subclass
:class:`~deepfreeze.tiers.scratch.ScratchLevel` and :class:`~deepfreeze.tiers.persistent.PersistentLevel`).

The pooled read order (:data:`READ_ORDER`: :data:`TIER_ORDER`, scratch expanded into
:data:`SHARD_SOURCES`), written here once: a reader of a version (:mod:`deepfreeze.loader`,
:mod:`deepfreeze.inventory`) takes the memory tier's slots first (in place, no file; pooled with
scratch, a slot before a scratch file of the same shard), then the participants' own scratch
shards, a partner copy of a missing shard, a rebuild from XOR parity, and last the assembled file
on persistent. Both iterate these sequences; neither spells the order itself.
"""
from __future__ import annotations

import abc
import json
import logging
import os
import re
import stat
from typing import Any, Iterable

from .. import counters
from .. import format as fmt
from .. import ownership
from ..errors import CorruptCheckpointError, UntrustedOwnerError
from ..shardplan import ShardPlan, TensorSpec
from .shardbytes import _read_regular

__all__ = ["Tier", "Level", "plan_of", "MANIFEST", "READ_ORDER", "TIER_ORDER", "SHARD_SOURCES"]

log = logging.getLogger("deepfreeze")


class Tier(abc.ABC):
    """One place a version's shards can be, and the calls a writer and a reader make on it.

    Call order, for a writer (one rank, per version; :class:`deepfreeze.engine.Engine`), after
    :func:`deepfreeze.tiers.choose` gave the engine its :class:`~deepfreeze.tiers.Tiers`::

        decided = direct.decide(...)        # only when tiers.wants_decision (write once in effect)
        route = tiers.route(decided.kind)   # memtier | direct | scratch: the flush job's source kind
        where = <the tier's write>          # ScratchLevel.write_version -> the shard path (shard,
                                            #   partner copies or parity, manifest); direct.write_version
                                            #   -> the write-once record;
                                            #   MemtierTier.local_put or the backend's copy -> SlotSource
        flush_job(job)                      # reads the shard from ``where`` into persistent:
                                            #   PersistentLevel.flush_shard (the commit protocol)
        tier.retain(name, ...)              # after the flush: each tier keeps its newest versions

    and for a reader (:mod:`deepfreeze.loader`, :mod:`deepfreeze.inventory`), tier by tier in
    :data:`TIER_ORDER`, each rank's shard from :data:`SHARD_SOURCES` in order::

        tier.versions(name)                 # the version directories present, ascending
        tier.read_manifest(name, version)   # a version's manifest, checked (name, version, owner)
        ... the tier's own read             # scratch: committed()/inventory(); persistent: the
                                            #   assembled file; the memory tier: MemtierLevel's slots

    The directory tiers (:class:`Level`: scratch, persistent) implement these as classes; the
    memory tier's device is not a directory tree: its write side is
    :class:`~deepfreeze.tiers.memtier.MemtierTier`, its read side
    :class:`~deepfreeze.tiers.memtier.MemtierLevel`."""

    #: the tier's name in listings and logs (``scratch``, ``persistent``, ``memtier``)
    kind = "tier"

    @abc.abstractmethod
    def versions(self, name: str) -> list[int]:
        """Every version present (committed or not), ascending."""

    @abc.abstractmethod
    def read_manifest(self, name: str, version: int) -> dict[str, Any]:
        """The version's manifest, checked (name, version, owner)."""

    @abc.abstractmethod
    def retain(self, name: str, *args: Any, **kwargs: Any) -> list[int]:
        """Remove what the tier no longer keeps of ``name``; the versions removed."""


#: The tiers a reader tries for a version, in order: the memory tier's slots (pooled with scratch,
#: a slot listed before a scratch file of the same shard), the participants' scratch, persistent.
TIER_ORDER = ("memtier", "scratch", "persistent")
#: Where one rank's shard is read from on pooled scratch (and the memory tier), in order: its own
#: shard, a partner copy another node holds, a rebuild from XOR parity (the inventory's kinds).
SHARD_SOURCES = ("shard", "partner", "parity")
#: The pooled read order, written once: every tier of :data:`TIER_ORDER`, scratch expanded into
#: :data:`SHARD_SOURCES`.
READ_ORDER = tuple(s for t in TIER_ORDER for s in ((t,) if t != "scratch" else SHARD_SOURCES))


_VDIR = re.compile(r"^v(\d{12})$")
MANIFEST = "manifest.json"

_KNOWN_RUNS: dict[tuple, tuple[str, int, int | None]] = {}  # Level.committed_run: manifest identity -> its run
_KNOWN_MAX = 4096


def _remember(key: tuple, run: tuple[str, int, int | None]) -> None:
    if len(_KNOWN_RUNS) >= _KNOWN_MAX:
        _KNOWN_RUNS.pop(next(iter(_KNOWN_RUNS)))
    _KNOWN_RUNS[key] = run


#: plan_of's memory: the JSON of (tensors, plan record, world size) -> the plan built and checked from it
_PLANS: dict[str, ShardPlan] = {}
_PLANS_MAX = 8
_PLAN_KEY = json.JSONEncoder(separators=(",", ":"))  # plan_of's key: compact, in the objects' key order
#: plan_of's last answer with the objects it came from: [tensors, plan record, world size, ShardPlan]
_LAST_PLAN: list = []


def plan_of(manifest: dict[str, Any]) -> ShardPlan:
    """The manifest's :class:`ShardPlan`, derived and validated (:meth:`ShardPlan.from_json`). Kept
    for the last few distinct (tensor list, plan record, world size) contents, compared as their
    JSON (C speed): the backend reads one plan per flush job of a run, and deriving and checking
    it again was tens of milliseconds per job with 1000s of tensors. The same plan object comes
    back for the same content, so its assembled layout is kept too
    (:meth:`PersistentLevel.assembled_layout`). The JSON is compact and in the objects' own key
    order (a manifest's keys come in the order its writer put them): equal text is equal content,
    types included (``1`` is not ``1.0``), and content in another key order is only derived again
    (sorting the keys cost half as much again: 7.2 against 4.8 ms per job with 3,000 tensors).
    Before that, the very objects of the last call (the same ``tensors`` list and ``plan`` record,
    held here): the backend's jobs on one connection share them
    (:func:`deepfreeze.tiers.job.json_object`'s ``seen``), so a run's flushes after its first
    encode nothing (5.4 ms per job with 4,000 tensors). A manifest is never changed in place once
    built, so the same objects are the same content."""
    last = _LAST_PLAN
    if last and manifest.get("tensors") is last[0] and manifest.get("plan") is last[1] \
            and manifest.get("world_size") == last[2] and type(manifest.get("world_size")) is int:
        return last[3]  # the very objects of the last call (a backend connection's jobs share them)
    try:
        key = _PLAN_KEY.encode([manifest["tensors"], manifest["plan"], manifest["world_size"]])
    except (TypeError, ValueError, KeyError):
        key = None  # not JSON (a caller's own dict): derived, not kept
    hit = _PLANS.get(key) if key is not None else None
    if hit is not None:
        _LAST_PLAN[:] = [manifest["tensors"], manifest["plan"], manifest["world_size"], hit]
        return hit
    tensors = [TensorSpec(t["id"], t["name"], t["dtype"], tuple(t["shape"])) for t in manifest["tensors"]]
    plan = ShardPlan.from_json(tensors, manifest["plan"])
    if plan.world_size != manifest["world_size"]:
        raise CorruptCheckpointError("manifest world_size disagrees with its shard plan")
    if key is not None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
        _LAST_PLAN[:] = [manifest["tensors"], manifest["plan"], manifest["world_size"], plan]
    return plan


class Level(Tier):
    """A directory tree of versions for checkpoint names."""

    kind = "level"

    def __init__(self, root: str, *, shared_group: bool = False,
                 trust_owners: "Iterable[str | int] | None" = None) -> None:
        self.root = root
        #: the root may be group-writable (INI ``shared_group``; :mod:`deepfreeze.ownership`)
        self.shared_group = shared_group
        #: owners whose files are read (:func:`deepfreeze.ownership.trusted_uids`); scratch: you and root only
        self.trusted = ownership.trusted_uids(trust_owners if self.kind != "scratch" else None)
        #: versions whose manifest is owned by an untrusted user (found by the last scan) -> the error
        self.untrusted: dict[int, UntrustedOwnerError] = {}

    def name_dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def version_dir(self, name: str, version: int) -> str:
        if not 0 <= version < 10 ** 12:
            raise ValueError(f"version {version} out of range [0, 1e12)")
        return os.path.join(self.root, name, f"v{version:012d}")

    def versions(self, name: str) -> list[int]:
        """Every version directory present (committed or not), ascending. A symbolic link named
        like a version is not one (never followed); ``<root>/<name>`` being a link is an error."""
        ndir = self.name_dir(name)
        counters.fs("listdir", f"{self.kind}.versions")
        try:
            fd = ownership.open_dir_nofollow(ndir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        try:
            with os.scandir(fd) as it:
                return sorted(int(m.group(1)) for e in it if (m := _VDIR.match(e.name)) and e.is_dir(follow_symlinks=False))
        finally:
            os.close(fd)

    def read_manifest(self, name: str, version: int) -> dict[str, Any]:
        path = os.path.join(self.version_dir(name, version), MANIFEST)
        counters.fs("open", f"{self.kind}.manifest.read")
        data = _read_regular(path, fmt.MAX_MANIFEST_BYTES + 1, self.trusted, self.kind)  # no link, no FIFO, owner
        m = fmt.decode_manifest(data, path)
        if m["name"] != name or m["version"] != version:
            raise CorruptCheckpointError(f"{path}: manifest is for {m['name']!r} v{m['version']}, "
                                         f"found under {name!r} v{version}")
        return m

    def committed_run(self, name: str, version: int) -> tuple[str, int, int | None]:
        """:func:`format.manifest_run` of ``version``'s valid manifest (run id, generation,
        resumed-from): all retention needs of it. The body is read and decoded (validated, as
        :meth:`read_manifest`) the first time this process meets that file; while ``lstat`` then
        shows the same regular file (device, inode, size, modification and change times: a
        manifest is replaced by a rename, never rewritten in place) and its owner is trusted, the
        answer is remembered (site ``{kind}.manifest.known``) and no byte is read. Raises what
        :meth:`read_manifest` raises."""
        path = os.path.join(self.version_dir(name, version), MANIFEST)
        before = self._manifest_key(path)
        if before is not None and before in _KNOWN_RUNS:
            counters.fs("stat", f"{self.kind}.manifest.known")
            return _KNOWN_RUNS[before]
        run = fmt.manifest_run(self.read_manifest(name, version))
        if before is not None and self._manifest_key(path) == before:  # the file read is the one stat'ed
            _remember(before, run)
        return run

    def remember_run(self, name: str, version: int, manifest: dict[str, Any]) -> None:
        """Remember ``manifest``'s run for :meth:`committed_run` without reading it back: for the
        committer, right after it wrote ``version``'s manifest itself (the file it just renamed into
        place, under the version's ``commit.lock``), so retention's next look at it reads no byte."""
        key = self._manifest_key(os.path.join(self.version_dir(name, version), MANIFEST))
        if key is not None:
            _remember(key, fmt.manifest_run(manifest))

    def _manifest_key(self, path: str) -> tuple | None:
        """What identifies a manifest file's content for :meth:`committed_run`: a regular file of a
        trusted owner, by device, inode, size, modification and change times (a manifest is replaced
        by a rename, never rewritten in place); None for anything else."""
        try:
            st = os.lstat(path)
        except OSError:
            return None
        return (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_uid) \
            if stat.S_ISREG(st.st_mode) and st.st_uid in self.trusted else None

    def makedirs(self, path: str) -> None:
        """Create ``path`` and every missing parent owner-only (0700) and check the existing ones
        (:func:`deepfreeze.ownership.ensure_dir`: the root, or its nearest existing parent, may be
        sticky or, with ``shared_group``, group-writable; every directory below must be a real
        directory of the user's, writable by nobody else). Raises
        :class:`~deepfreeze.errors.UnsafePathError`."""
        ownership.ensure_dir(path, self.root, shared_group=self.shared_group, site=f"{self.kind}.mkdirs")
