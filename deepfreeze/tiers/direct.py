"""The write-once (direct) tier: a version decided ``flush`` goes from memory straight into persistent.

With scratch and persistent on one file system (one disk), the scratch path writes every byte
twice and reads it once in between: the writer thread writes the shard file, the backend reads it
back and writes it into the assembled file. INI key ``write_once``:

* ``off``: every version through a scratch file (the commit protocol of :mod:`deepfreeze.tiers.persistent`).
* ``on``: the writer thread takes the version's decision itself (:meth:`PersistentLevel.decide`,
  the same call the flush makes); decided ``flush``, it writes the rank's pieces from memory into
  ``model.dfz.partial.<nonce>`` at their assembled offsets, CRC32 per piece computed on each chunk
  right before it is written (:meth:`PersistentLevel.write_direct`), and hands the backend (sync
  mode: runs) a flush job carrying those CRCs (``job["direct"]``), which fsyncs the partial,
  publishes the rank's done marker and finalizes exactly as after a copy. Decided ``skip`` (or with
  the lease lost: the flush then abandons it), the version goes to scratch as before. No scratch
  file, no scratch manifest is written for a version written once; restore reads it from
  persistent. Refused with ``ec_interval >= 0`` (partner copies and parity protect scratch files)
  and with ``memtier`` (already one write to disk).
* ``auto`` (the default): ``on`` when scratch and persistent are on the same file system and
  neither ``ec_interval >= 0``, ``memtier`` nor ``persistent_interval < 0`` rules it out; else
  ``off`` (the rule is :func:`deepfreeze.tiers.write_once`, asked by :func:`deepfreeze.tiers.choose`,
  which also routes each version: decided ``flush`` here, ``skip`` or a lost lease to scratch).
  *Same file system* is judged by :func:`same_file_system`: the ``st_dev`` of both
  directories (the nearest existing one) agree **and** so do the mounts holding them in
  ``/proc/self/mountinfo`` (device, file-system type, source); a device number alone never turns it
  on, and without a readable mountinfo ``auto`` stays ``off``. One INFO log line per process says
  what was chosen and why.

Memory: none beyond the scratch path's (the pieces are written from the buffers the writer already
holds). The guarantees of docs/guarantees.md are unchanged: nothing is committed before every rank's
done marker, which is published only after its bytes in the partial are fsynced; the finalizer,
fence and nonce checks are the same code. The crash points of this path are
``persistent.direct.write`` and ``persistent.direct.fsync`` (:mod:`deepfreeze.crashpoints`).
"""
from __future__ import annotations

import errno
import os
from typing import Any, Sequence

import numpy as np

from .. import format as fmt
from ..config import Config
from ..errors import CheckpointWriteError
from ..fused import FusedShard
from ..shardplan import ShardPlan
from .job import FlushJob, register as register_source
from .persistent import FencedError, PersistentLevel

__all__ = ["Decided", "decide", "same_file_system", "write_version"]

MOUNTINFO = "/proc/self/mountinfo"


def _existing(path: str) -> str:
    """``path`` or its nearest existing ancestor, resolved (symbolic links followed)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return os.path.realpath(p)


def _unescape(field: str) -> str:
    """A mountinfo path field with its octal escapes (``\\040`` for a space) decoded."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts(mountinfo: str) -> list[tuple[str, str, str, str]]:
    """``(mount point, major:minor, fs type, source)`` of every line of a mountinfo file, in order."""
    out = []
    with open(mountinfo, encoding="utf-8", errors="replace") as f:
        for line in f:
            left, sep, right = line.partition(" - ")
            a, b = left.split(), right.split()
            if sep and len(a) >= 5 and len(b) >= 2:
                out.append((_unescape(a[4]), a[2], b[0], b[1]))
    return out


def _mount_of(path: str, mounts: Sequence[tuple[str, str, str, str]]) -> tuple[str, str, str, str] | None:
    """The mount holding ``path`` (resolved): the longest mount point above it, the last one listed
    among equal ones (it is mounted over the others)."""
    best = None
    for m in mounts:
        mp = m[0]
        if path == mp or path.startswith(mp.rstrip("/") + "/"):
            if best is None or len(mp) >= len(best[0]):
                best = m
    return best


def same_file_system(a: str, b: str, *, mountinfo: str = MOUNTINFO) -> tuple[bool, str]:
    """Whether directories ``a`` and ``b`` (or their nearest existing ancestors) are on the same
    file system, with the reason: both ``st_dev`` equal and both mounts of ``mountinfo`` (the
    longest mount point above each) of the same ``major:minor`` (matching ``st_dev``), file-system
    type and source. An unreadable mountinfo, or a path it shows no mount for, is "not known to be
    the same" (False)."""
    pa, pb = _existing(a), _existing(b)
    try:
        da, db = os.stat(pa).st_dev, os.stat(pb).st_dev
    except OSError as e:
        return False, f"cannot stat {e.filename}: {e.strerror}"
    if da != db:
        return False, f"different devices ({pa}: {os.major(da)}:{os.minor(da)}, {pb}: {os.major(db)}:{os.minor(db)})"
    try:
        mounts = _mounts(mountinfo)
    except OSError as e:
        return False, f"{mountinfo} unreadable ({e.strerror}): the mounts cannot be compared"
    ma, mb = _mount_of(pa, mounts), _mount_of(pb, mounts)
    if ma is None or mb is None:
        return False, f"{mountinfo} shows no mount holding {pa if ma is None else pb}"
    dev = f"{os.major(da)}:{os.minor(da)}"
    if not (ma[1:] == mb[1:] and ma[1] == dev):
        return False, (f"same device number but different mounts ({pa} on {ma[0]}: {ma[1]} {ma[2]} {ma[3]}; "
                       f"{pb} on {mb[0]}: {mb[1]} {mb[2]} {mb[3]})")
    return True, f"both on the {ma[2]} file system {ma[3]} (device {dev}, mounted on {ma[0]}{'' if ma == mb else ', ' + mb[0]})"


class Decided:
    """A version decided by this run's writer (:func:`decide`): the level that decided it and the
    decision record (``decision["decision"]`` is ``flush`` or ``skip``)."""

    __slots__ = ("level", "decision")

    def __init__(self, level: PersistentLevel, decision: dict[str, Any]) -> None:
        self.level, self.decision = level, decision

    @property
    def kind(self) -> str:
        """``flush`` or ``skip``: what :meth:`deepfreeze.tiers.Tiers.route` reads."""
        return self.decision["decision"]


def decide(config: Config, name: str, version: int, run: str, *, critical: Any = None,
           level_cls: type = PersistentLevel) -> "Decided | None":
    """Decide ``version`` in the writer (:meth:`PersistentLevel.decide`, the flush's own call); None
    when there is no decision to follow (no persistent level, or the run lost its lease: the
    version then goes to scratch and the flush abandons it). ``critical`` (the engine's
    :meth:`deepfreeze.priority.Lanes.run_normal`): runs the decision, a ``commit.lock`` section
    other nodes wait on, at normal priority (:meth:`PersistentLevel.critical`). ``level_cls``: the
    :class:`PersistentLevel` (sub)class that decides and writes (faults are injected by subclassing)."""
    level = level_cls(config.persistent, shared_group=config.shared_group)
    if critical is not None:
        level.critical = critical
    try:
        decision = level.critical(level.decide, name, version, config.persistent_interval, run,
                                  stale_after=config.lease_timeout)
    except FencedError:
        return None
    return None if decision is None else Decided(level, decision)


def write_version(config: Config, decided: Decided, name: str, version: int, rank: int, plan: ShardPlan,
                  arrays: "Sequence[np.ndarray] | FusedShard") -> dict[str, Any]:
    """Write this rank's pieces of a version ``decided`` ``flush`` (:func:`decide`; routed here by
    :meth:`deepfreeze.tiers.Tiers.route`) into its partial (:meth:`PersistentLevel.write_direct`);
    return the flush job's ``direct`` record (its spec, source kind ``direct``).
    Raises :class:`~deepfreeze.errors.CheckpointWriteError` when the writes it plans would not leave
    every piece's bytes where their CRCs say (:meth:`PersistentLevel.write_direct`): nothing is written."""
    return decided.level.write_direct(name, version, rank, plan, arrays, decided.decision, chksum=config.chksum)


def _direct_record(spec: Any, job: FlushJob) -> dict[str, Any]:
    """The ``direct`` source kind's spec check: the write-once record's shape, bounded (its CRC
    record's count against the plan and its nonce against the decision:
    :func:`deepfreeze.tiers.shardbytes.direct_crcs`)."""
    if not (isinstance(spec, dict) and set(spec) == {"nonce", "has_crc", "crc32"} and isinstance(spec["nonce"], str)
            and 0 < len(spec["nonce"]) <= 64 and type(spec["has_crc"]) is bool and fmt.crc_record_ok(spec["crc32"])):
        raise CheckpointWriteError(errno.EINVAL, f"flush job of {job.name!r} v{job.version} rank {job.rank}: "
                                   f"malformed write-once record {str(spec)[:300]} (expected nonce, has_crc and "
                                   "crc32, the CRCs of the rank's pieces)")
    return spec


# write once's source kind: the shard is in persistent's partial already, no opener (deepfreeze.tiers.job)
register_source("direct", decode=_direct_record, encode=dict)
