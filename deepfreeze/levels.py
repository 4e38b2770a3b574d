"""Storage levels, their directory layout and the commit protocol.

Layout::

    <scratch>/<name>/v<version:012d>/r<rank:06d>.dfs   one shard file per rank (format.py)
    <scratch>/<name>/v<version:012d>/h<holder>.r<src>.dfs  partner copy of rank src's shard (redundancy.py)
    <scratch>/<name>/v<version:012d>/x<holder>.dfx     parity block held by rank holder (redundancy.py)
    <scratch>/<name>/v<version:012d>/manifest.json     written by every local rank after its shard
    <persistent>/<name>/v<version:012d>/decision       flush|skip, the version's nonce and run
    <persistent>/<name>/v<version:012d>/model.dfz.partial.<nonce>, done.r<rank>.<nonce>.json  while flushing
    <persistent>/<name>/v<version:012d>/model.dfz      the assembled checkpoint (all tensors, whole)
    <persistent>/<name>/v<version:012d>/manifest.json  the commit marker, written last
    <persistent>/<name>/lease, generation               the live run's lease; the name's generation (run.py)

Commit protocol. The promise: a restored version is one run's state, whole, or an error, after a
crash at any point (every file operation below passes a named crash point of
:mod:`deepfreeze.crashpoints`; ``tests/faults/test_crashpoints.py`` kills a job at each):

* **Runs** (:mod:`deepfreeze.run`): every shard header, scratch manifest, decision, done marker,
  parity header and assembled header carries the id of the run that wrote it; readers and the
  finalizer never combine pieces whose run ids differ. Readers only accept manifests of the
  name's current generation.
* **Scratch.** A rank writes its shard to a temporary name and renames it to ``r<rank>.dfs``
  (atomic on POSIX), then writes ``manifest.json`` the same way (same bytes on every rank of the
  node). A version is *complete on a scratch directory* when its manifest and every rank's shard
  (of the manifest's run) are there. Scratch is not fsynced: node-local storage is lost with its
  node anyway, and a killed process loses nothing already renamed.
* **Decision** (first flush of a version, any node): under the version's ``commit.lock``, after
  the fence check (the name's lease is held by this run, or by nobody; else the work is
  abandoned: :class:`FencedError`), ``decision`` = ``{"decision": "flush"|"skip", "nonce", "run"}``
  is created exclusively (temporary file hard-linked into place: never seen empty). A decision of
  another run (an attempt abandoned by a crash) is retired first, manifest first. ``skip`` when
  ``persistent_interval`` has not passed since the newest earlier ``flush`` decision, judged by the
  file system's clock (a future mtime is due, and warned once). Every node then follows it. A
  node that finds no decision and the lock held does not queue on the lock: it re-reads the
  decision with a growing, jittered pause (10 ms doubling to 200 ms) and follows it once it is
  there, taking the lock only when it is free (so at N nodes the lock passes to a few of them,
  not to all N in turn while the rest poll it).
* **Flush** of one rank: its pieces are copied into ``model.dfz.partial.<nonce>`` at offsets
  computed from the manifest alone, each piece's CRC32 computed from the bytes as they are copied
  and compared with the shard's index (no second read); the shard's run id must be the
  manifest's; fsync (then the pages are dropped from the node's page cache); then
  ``done.r<rank>.<nonce>.json`` (run, nonce, piece CRCs) is published by temp + fsync + rename +
  directory fsync.
* **Finalize**: whoever sees done markers of the *current nonce* for exactly ranks 0..N-1 takes
  ``commit.lock`` (a lock whose holder is provably gone, :func:`~deepfreeze.node.holder_gone`, is
  broken at once; any other once it is older than ``lease_timeout``), checks the fence and that the decision
  still has this nonce, writes header and index into the partial, fsyncs, renames it to
  ``model.dfz``, writes ``manifest.json`` (temp + fsync + rename + directory fsync) and removes the
  markers. A ``model.dfz`` already in place without a manifest (a finalizer killed after its rename)
  is finished: its header must be this run's and version's, then the manifest is written; it is
  never reopened as an empty partial. **A version is committed on persistent if and only if its
  ``manifest.json`` exists** (valid, this name and version, the current generation); anything else
  in a version directory is unfinished or abandoned work that readers ignore. A re-sent flush
  (a restarted backend) of a committed version does nothing; of an unfinished one, repeats the
  idempotent copy under the same nonce.
* **Memory tier** (``memtier = PATH``): a rank's shard is not a scratch file but the image in one
  slot of the device (:mod:`deepfreeze.memtier.device`; byte for byte a shard file). Its flush job
  names the slot (``job["memtier"]``, :class:`SlotSource`); the flush reads the image through a
  read-only descriptor of the device at the image's offset exactly as it reads a scratch shard
  (same checks, same partial, marker and finalize), after checking that the slot header is DONE
  and holds this run and version, and again after the copy (a slot rewritten meanwhile fails the
  flush; the busy-slot rule of the backend never lets that happen). No scratch file is read,
  written or retained for such a job.
* **Write once** (``write_once``, :mod:`deepfreeze.writeonce`): a rank's shard is not a scratch
  file either: its writer thread makes the decision above itself and, decided ``flush``, writes its
  pieces from memory into ``model.dfz.partial.<nonce>`` (:meth:`PersistentLevel.write_direct`,
  CRC32 per piece computed on each chunk right before it is written). Its flush job carries the
  nonce and CRCs (``job["direct"]``, checked against the plan and the decision's nonce); the flush
  fsyncs the partial, then publishes the marker and finalizes as above. No scratch file or
  manifest is written for such a version.
* **Retention** runs after a commit: ``max_versions`` newest committed versions of the current
  generation stay on persistent, older generations and ``skip`` directories older than the
  newest commit go; a version is retired manifest first, then its files one by one (no symlink
  followed); ``scratch_versions`` (else ``max_versions``) newest stay on scratch, each rank
  deleting only its own files, the manifest with the last of them.

Levels are classes so faults can be injected by subclassing one.

Details behind these statements. Directories are created with mode ``0700``, files with
``0600``; temporary names carry the host, pid and thread id. With ``ec_interval`` due, the
partner/parity exchange (:mod:`deepfreeze.redundancy`) runs between the shard's rename and the
scratch manifest, so on scratch the order is shard, partner copies or parity block, manifest;
scratch retention deletes the partner copies and parity block a rank holds with its own shard.
The unit of flushing is one rank's shard (:func:`flush_job`: one job per rank and version; "a
node flushes" means the jobs of its ranks). A shard, on scratch and into the partial, goes out
in writes of at most 1 MiB through one reused buffer (consecutive small pieces in one read),
each piece's CRC32 computed on the chunk right before it goes out; the write-back of every
8 MiB is started at once (``sync_file_range``, else ``posix_fadvise``), so the final fsync finds
little left; a scratch shard's header and index are written last, then the rename. O_DIRECT was
measured and not adopted (docs/performance-history.md). The ``persistent_interval`` decision compares
the file system's clock with the mtime of the ``decision`` file of the newest earlier version
decided ``flush`` (committed or not); with no such version, or an interval of 0, the decision is
``flush``; with a negative interval no decision is written and nothing goes to persistent.
Deciding ``skip`` still creates the version directory on persistent (it holds the decision);
:meth:`PersistentLevel.retain` runs in the flush job that commits a version and in every flush
job of a version decided ``skip``; it leaves alone the directories of versions decided ``flush``
that never committed (an interrupted flush): ``deepfreeze gc`` removes those abandoned flushes.
Scratch retention runs after every flush job, whether or not
the version went to persistent, counting only versions up to the one just flushed (newer ones
are not flushed yet), and removes a version directory once no file of any rank is left in it.
The engine takes the scratch level's class (``scratch_cls=``), :func:`flush_job` both.

Long because: one protocol (the commit protocol above), whose steps share one set of file helpers.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import secrets
import stat
import time
from typing import Any, ClassVar, Iterable, Iterator, Sequence

import numpy as np

from . import counters
from . import crashpoints as cp
from . import format as fmt
from . import ownership
from ._native import SYNC_FILE_RANGE_WRITE, available, sync_file_range
from .errors import CheckpointWriteError, CorruptCheckpointError, DeepFreezeError, UnsafePathError, UntrustedOwnerError
from .format import ANONYMOUS_RUN
from .lease import describe_holder, fence_holder, fs_now, read_generation, warn_skew
from .fsafe import atomic_write, replacing_file, temp_suffix, write_all
from .fsafe import open_regular, read_small
from .jsonsafe import loads as bounded_loads
from .fused import FusedShard
from .node import holder_gone, in_this_pid_space, node_id, process_identity
from .shardplan import ShardPlan, TensorSpec
from .tiers.job import SCRATCH, FlushJob, register as register_source, source as job_source

__all__ = ["Level", "ScratchLevel", "PersistentLevel", "plan_of", "flush_job", "write_shard_file",
           "read_decision", "FencedError", "SlotSource", "lock_record", "parse_lock"]

log = logging.getLogger("deepfreeze")
_VDIR = re.compile(r"^v(\d{12})$")
_SCRATCH_FILE = re.compile(r"^(?:r(\d{6})\.dfs|h(\d{6})\.r(\d{6})\.dfs|x(\d{6})\.dfx)$")
_MARKER = re.compile(r"^done\.r(\d{6})\.([0-9a-f]{16})\.json$")
MANIFEST = "manifest.json"
ASSEMBLED = "model.dfz"
DECISION = "decision"
LOCK = "commit.lock"
_POLL_FIRST, _POLL_MAX = 0.01, 0.2  # waits on the version lock: 10 ms, doubling to 200 ms, jittered
_MAX_MARKER_BYTES = 64 << 20


class FencedError(DeepFreezeError, RuntimeError):
    """The work belongs to a run that no longer holds the lease on its name: abandoned."""


def _pause(delay: float) -> float:
    """Sleep about ``delay`` seconds (jittered down to half, so nodes that collided spread out);
    return the next, doubled, delay (at most ``_POLL_MAX``)."""
    time.sleep(delay * (0.5 + secrets.randbelow(1 << 16) / (1 << 17)))
    return min(2 * delay, _POLL_MAX)


_KNOWN_RUNS: dict[tuple, tuple[str, int, int | None]] = {}  # Level.committed_run: manifest identity -> its run
_KNOWN_MAX = 4096


#: plan_of's memory: the JSON of (tensors, plan record, world size) -> the plan built and checked from it
_PLANS: dict[str, ShardPlan] = {}
_PLANS_MAX = 8


def plan_of(manifest: dict[str, Any]) -> ShardPlan:
    """The manifest's :class:`ShardPlan`, derived and validated (:meth:`ShardPlan.from_json`). Kept
    for the last few distinct (tensor list, plan record, world size) contents, compared as their
    JSON (C speed): the backend reads one plan per flush job of a run, and deriving and checking
    it again was tens of milliseconds per job with 1000s of tensors. The same plan object comes
    back for the same content, so its assembled layout is kept too
    (:meth:`PersistentLevel.assembled_layout`)."""
    try:
        key = json.dumps([manifest["tensors"], manifest["plan"], manifest["world_size"]], sort_keys=True)
    except (TypeError, ValueError, KeyError):
        key = None  # not JSON (a caller's own dict): derived, not kept
    hit = _PLANS.get(key) if key is not None else None
    if hit is not None:
        return hit
    tensors = [TensorSpec(t["id"], t["name"], t["dtype"], tuple(t["shape"])) for t in manifest["tensors"]]
    plan = ShardPlan.from_json(tensors, manifest["plan"])
    if plan.world_size != manifest["world_size"]:
        raise CorruptCheckpointError("manifest world_size disagrees with its shard plan")
    if key is not None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
    return plan


def piece_entries(plan: ShardPlan, pieces: Iterable) -> list[fmt.Entry]:
    return [fmt.Entry(p.tensor_id, plan.tensors[p.tensor_id].dtype, plan.tensors[p.tensor_id].shape,
                      p.start, p.stop) for p in pieces]


class Level:
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

        def key() -> tuple | None:
            try:
                st = os.lstat(path)
            except OSError:
                return None
            return (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_uid) \
                if stat.S_ISREG(st.st_mode) and st.st_uid in self.trusted else None
        before = key()
        if before is not None and before in _KNOWN_RUNS:
            counters.fs("stat", f"{self.kind}.manifest.known")
            return _KNOWN_RUNS[before]
        run = fmt.manifest_run(self.read_manifest(name, version))
        if before is not None and key() == before:  # the file read is the one stat'ed
            if len(_KNOWN_RUNS) >= _KNOWN_MAX:
                _KNOWN_RUNS.pop(next(iter(_KNOWN_RUNS)))
            _KNOWN_RUNS[before] = run
        return run

    def makedirs(self, path: str) -> None:
        """Create ``path`` and every missing parent owner-only (0700) and check the existing ones
        (:func:`deepfreeze.ownership.ensure_dir`: the root, or its nearest existing parent, may be
        sticky or, with ``shared_group``, group-writable; every directory below must be a real
        directory of the user's, writable by nobody else). Raises
        :class:`~deepfreeze.errors.UnsafePathError`."""
        ownership.ensure_dir(path, self.root, shared_group=self.shared_group, site=f"{self.kind}.mkdirs")


class ScratchLevel(Level):
    """Node-local first level: one shard file per rank and version."""

    kind = "scratch"

    def shard_path(self, name: str, version: int, rank: int) -> str:
        return os.path.join(self.version_dir(name, version), f"r{rank:06d}.dfs")

    def write_shard(self, name: str, version: int, rank: int, plan: ShardPlan,
                    arrays: "Sequence[np.ndarray] | FusedShard", *, chksum: bool, fsync: bool = False,
                    run: str = ANONYMOUS_RUN) -> str:
        """Write this rank's pieces (flat arrays, plan order, or one
        :class:`~deepfreeze.fused.FusedShard` of this plan and rank; :func:`write_shard_file`) and
        commit them by rename; the header carries ``run``, the id of the run that wrote it."""
        vdir = self.version_dir(name, version)
        final = self.shard_path(name, version, rank)
        for attempt in (1, 2):
            self.makedirs(vdir)
            try:
                write_shard_file(final, version, rank, plan, arrays, chksum=chksum, fsync=fsync, run=run)
                return final
            except OSError as e:
                if isinstance(e, FileNotFoundError) and attempt == 1:
                    continue  # another rank's retention removed the empty directory meanwhile
                raise CheckpointWriteError(e.errno, f"writing shard of rank {rank} for {name!r} v{version} to "
                                           f"scratch {vdir} failed: {e.strerror}; nothing was committed. "
                                           "Free space or point 'scratch' elsewhere.") from e
        return final

    def partner_path(self, name: str, version: int, holder: int, src: int) -> str:
        return os.path.join(self.version_dir(name, version), f"h{holder:06d}.r{src:06d}.dfs")

    def parity_path(self, name: str, version: int, holder: int) -> str:
        return os.path.join(self.version_dir(name, version), f"x{holder:06d}.dfx")

    def inventory(self, name: str, version: int) -> dict[str, dict[int, str]]:
        """The files this scratch directory holds of ``version`` (the manifest is the caller's to
        read): ``{"shard": {rank: path}, "partner": {src: path}, "parity": {holder: path}}``."""
        vdir = self.version_dir(name, version)
        inv: dict[str, dict[int, str]] = {"shard": {}, "partner": {}, "parity": {}}
        for n in _listdir(vdir):
            m = _SCRATCH_FILE.match(n)
            if m is None:
                continue
            path = os.path.join(vdir, n)
            if os.path.islink(path):
                continue  # never followed: not a file of this version
            if m.group(1) is not None:
                inv["shard"][int(m.group(1))] = path
            elif m.group(3) is not None:
                inv["partner"][int(m.group(3))] = path
            else:
                inv["parity"][int(m.group(4))] = path
        return inv

    def committed(self, name: str, generation: int | None = None
                  ) -> dict[int, tuple[dict[str, Any], dict[str, dict[int, str]]]]:
        """Versions with a valid manifest here (of ``generation``, when given) ->
        (manifest, :meth:`inventory`)."""
        out = {}
        for v in self.versions(name):
            try:
                m = self.read_manifest(name, v)
            except UntrustedOwnerError as e:
                log.warning("deepfreeze: %s v%d on scratch is ignored: %s", name, v, e)
                continue
            except (OSError, DeepFreezeError, ValueError):
                continue
            if generation is not None and fmt.manifest_run(m)[1] != generation:
                continue
            out[v] = (m, self.inventory(name, v))
        return out

    def write_manifest(self, name: str, version: int, manifest: dict[str, Any]) -> None:
        atomic_write(os.path.join(self.version_dir(name, version), MANIFEST),
                     fmt.encode_manifest(manifest), fsync=False, point="scratch.manifest")

    @staticmethod
    def _own_files(names: Iterable[str], rank: int) -> list[str]:
        return [n for n in names if n == f"r{rank:06d}.dfs" or n == f"x{rank:06d}.dfx"
                or (n.startswith(f"h{rank:06d}.r") and n.endswith(".dfs"))]

    def _remove_own(self, vdir: str, rank: int, point: str) -> bool:
        """Remove this rank's files in ``vdir`` (own shard, partner copies and parity it holds),
        then the manifest and the directory once no rank's file is left. True if the own shard
        was there."""
        try:  # through a descriptor of the directory: a symbolic link is never followed
            fd = ownership.open_dir_nofollow(vdir)
        except (FileNotFoundError, NotADirectoryError, UnsafePathError):
            return False
        try:
            names = os.listdir(fd)
            mine = self._own_files(names, rank)
            for n in mine:
                try:
                    cp.unlink(n, point, dir_fd=fd)
                except FileNotFoundError:
                    pass
            names = os.listdir(fd)
            if not any(n.endswith((".dfs", ".dfx")) or ".tmp" in n for n in names):
                # rmdir, not rmtree: a lagging rank on this node may create its file in the
                # directory after the listing; rmdir then fails and the directory stays
                # (that rank's own retention removes it later)
                if MANIFEST in names:
                    try:
                        cp.unlink(MANIFEST, "scratch.retain.manifest", dir_fd=fd)
                    except FileNotFoundError:
                        pass
                try:
                    cp.rmdir(vdir, "scratch.retain.rmdir")  # rmdir never follows a link
                except OSError:
                    pass
        finally:
            os.close(fd)
        return f"r{rank:06d}.dfs" in mine

    def retain(self, name: str, rank: int, keep: int, upto: int) -> list[int]:
        """Delete this rank's shards of all but the newest ``keep`` versions up to ``upto``.

        Versions newer than ``upto`` (written by the client while the backend was
        still flushing ``upto``) are not counted: they have not been flushed yet.
        """
        if keep <= 0:
            return []
        removed = []
        for v in [v for v in self.versions(name) if v <= upto][:-keep]:
            if self._remove_own(self.version_dir(name, v), rank, "scratch.retain.unlink"):
                removed.append(v)
        return removed

    def clear(self, name: str, rank: int, above: int | None = None) -> list[int]:
        """Remove this rank's files of every version above ``above`` (all when None): a new run
        that resumed from ``above`` (or overwrites the name) rewrites those numbers."""
        removed = []
        for v in self.versions(name):
            if above is None or v > above:
                if self._remove_own(self.version_dir(name, v), rank, "scratch.clear.unlink"):
                    removed.append(v)
        return removed


def write_shard_file(final: str, version: int, rank: int, plan: ShardPlan,
                     arrays: "Sequence[np.ndarray] | FusedShard", *, chksum: bool, fsync: bool = False,
                     run: str = ANONYMOUS_RUN, point: str = "scratch.shard") -> None:
    """Write a rank's shard file (format.py) to ``final``: temporary name, then rename.

    ``arrays`` is either the rank's pieces as flat arrays (plan order) or a
    :class:`~deepfreeze.fused.FusedShard` of this plan and rank, whose data region is written as is.
    Either way the data goes out in writes of at most ``_CHUNK`` bytes, each piece's CRC32 computed
    chunk by chunk right before the chunk is written (while it is in the CPU cache: one pass over the
    bytes), and the header and index, which hold the CRCs, are written last at offset 0 (the file is
    committed by the rename, so nobody sees it before). Raises OSError (nothing left behind) or
    ValueError (arrays do not match the plan, or a fused shard of another plan or rank)."""
    if isinstance(arrays, FusedShard):
        shard = _check_fused(arrays, plan, rank)
        entries, data_offset, size = list(shard.layout.entries), shard.layout.data_offset, shard.layout.file_size
        spans = [(e.offset - data_offset, e.length) for e in entries]
        with replacing_file(final, fsync=fsync, point=point) as fd:
            crcs = _write_region(fd, shard.data, data_offset, spans, chksum, f"bytes.{point.split('.')[0]}.data")
            write_all(fd, fmt.encode_index(fmt.KIND_SHARD, rank, plan.world_size, version, entries,
                                            data_offset, size, chksum, run, crcs if chksum else None),
                      0, f"bytes.{point.split('.')[0]}.meta")
            os.ftruncate(fd, size)
        return
    entries, data_offset, size = fmt.layout(_check_arrays(arrays, plan, rank))
    with replacing_file(final, fsync=fsync, point=point) as fd:
        crcs = [_write_region(fd, fmt.byte_view(a), e.offset, [(0, e.length)], chksum,
                              f"bytes.{point.split('.')[0]}.data")[0] if e.length else 0
                for e, a in zip(entries, arrays)]
        write_all(fd, fmt.encode_index(fmt.KIND_SHARD, rank, plan.world_size, version, entries,
                                        data_offset, size, chksum, run, crcs if chksum else None),
                  0, f"bytes.{point.split('.')[0]}.meta")
        os.ftruncate(fd, size)


def _check_fused(shard: FusedShard, plan: ShardPlan, rank: int) -> FusedShard:
    """``shard`` if it is rank ``rank``'s fused shard of ``plan``; else ValueError."""
    if not (shard.layout.rank == rank and (shard.layout.plan is plan or shard.layout.plan == plan)):
        raise ValueError(f"the fused shard is rank {shard.layout.rank}'s of another shard plan or rank than "
                         f"the one written (rank {rank}): build it with FusedLayout.build(plan, rank)")
    return shard


def _check_arrays(arrays: Sequence[np.ndarray], plan: ShardPlan, rank: int) -> list[fmt.Entry]:
    """The entries of rank ``rank``'s pieces (plan order) if ``arrays`` match them one to one
    (element count and dtype); else ValueError."""
    pieces = plan.for_rank(rank)
    if len(arrays) != len(pieces):
        raise ValueError(f"rank {rank} holds {len(pieces)} pieces, got {len(arrays)} arrays")
    entries = []
    for p, e, a in zip(pieces, piece_entries(plan, pieces), arrays):
        if a.size != p.count or fmt.dtype_name(a.dtype) != e.dtype:
            raise ValueError(f"array for tensor {plan.tensors[p.tensor_id].name!r} piece "
                             f"[{p.start},{p.stop}) has {a.size} {a.dtype} elements")
        entries.append(e)
    return entries


#: bytes per read or write of the shard data paths (write_shard_file, the flush's copy): large enough
#: that the per-call cost vanishes, small enough that a chunk is still in the CPU cache when it is
#: written after its CRC (experiments/flush.py)
_CHUNK = 1 << 20
#: bytes the flush writes before it asks the kernel to start writing them to the device
_WRITEBACK_BATCH = 8 << 20


def _write_region(fd: int, data: Any, base: int, spans: Sequence[tuple[int, int]], chksum: bool,
                  count: str | None = None) -> list[int]:
    """Write ``data`` (a byte buffer) at file offset ``base`` in writes of at most ``_CHUNK`` bytes and
    return the CRC32 of each ``(offset, length)`` span of it (sorted by offset, not overlapping; 0s
    without ``chksum``), each chunk checksummed right before it is written."""
    view = fmt.byte_view(data)
    crcs = [0] * len(spans)
    k = 0
    for c0 in range(0, len(view), _CHUNK):
        c1 = min(len(view), c0 + _CHUNK)
        if chksum:
            while k < len(spans) and spans[k][0] < c1:
                off, length = spans[k]
                lo, hi = max(off, c0), min(off + length, c1)
                if hi > lo:
                    crcs[k] = fmt.crc32_bytes(view[lo:hi], crcs[k])  # (a byte memoryview: no byte_view per piece)
                if off + length > c1:
                    break  # the span goes on in the next chunk
                k += 1
        write_all(fd, view[c0:c1], base + c0, count)
    return crcs


#: the last plan object laid out: [plan, (entries, data offset, file size), its _Assembled or None]
_LAYOUT: list = []


#: one write of write once: ``(src, end, dst, pieces)``, bytes ``[src, end)`` of a rank's buffer
#: (``base``-relative) written at file offset ``dst``, holding ``pieces`` (fused-layout entries)
Run = tuple[int, int, int, list]


@dataclasses.dataclass
class _Assembled:
    """Where every piece of a plan lies in the assembled file (kept for the newest plan object)."""

    where: dict  # (tensor_id, start) -> offset
    after: dict  # (tensor_id, start) -> the (tensor_id, start) laid right after it, or None
    offsets: list  # every non-empty piece's offset, ascending
    entries: list  # the non-empty assembled entries in that order (they do not overlap)
    owner: dict  # (tensor_id, start) -> the rank whose piece it is


def _assembled_offsets(level: "PersistentLevel", plan: ShardPlan) -> _Assembled:
    """Where every piece of ``plan`` lies in the assembled file (:class:`_Assembled`), kept with its
    layout for the newest plan object (a writer writes version after version of one plan)."""
    layout, _, _ = level.assembled_layout(plan)
    cached = _LAYOUT and _LAYOUT[0] is plan and _LAYOUT[1][0] is layout  # (not a subclass's own layout)
    if cached and _LAYOUT[2] is not None:
        return _LAYOUT[2]
    ordered = sorted(layout, key=lambda e: e.offset)
    keys = [(e.tensor_id, e.start) for e in ordered]
    out = _Assembled(where={k: e.offset for k, e in zip(keys, ordered)},
                     after={k: (keys[i + 1] if i + 1 < len(keys) else None) for i, k in enumerate(keys)},
                     offsets=[e.offset for e in ordered if e.length], entries=[e for e in ordered if e.length],
                     owner={(p.tensor_id, p.start): p.rank for p in plan.pieces})
    if cached:
        _LAYOUT[2] = out
    return out


def _write_runs(fd: int, data: memoryview, base: int, runs: "Sequence[Run]", chksum: bool) -> list[list[int]]:
    """Write a fused shard's ``runs`` (:meth:`PersistentLevel.direct_runs`, checked by
    :func:`_check_runs`): each run's bytes of ``data`` (``base``-relative), its pieces with the
    padding between them, at the run's file offset by :func:`_write_region` (writes of at most
    ``_CHUNK``, each piece's CRC32 taken chunk by chunk right before the write). One rank's pieces
    are a handful of runs: a handful of writes instead of one per piece (4000 for a 1000-layer MLP's
    AdamW state). The write-back of every ``_WRITEBACK_BATCH`` bytes is started at once.
    Returns ``[[tensor_id, start, crc], ...]`` in the runs' piece order (crashpoint
    ``persistent.direct.write`` after the first run)."""
    crcs: list[list[int]] = []
    lo: int | None = None  # the range written since the last write-back kick
    hi = pending = 0
    for k, (src, end, dst, run) in enumerate(runs):
        got = _write_region(fd, data[src:end], dst, [(e.offset - base - src, e.length) for e in run],
                            chksum, "bytes.persistent.data")
        crcs.extend([e.tensor_id, e.start, c] for e, c in zip(run, got))
        lo, hi = (dst if lo is None else min(lo, dst)), max(hi, dst + end - src)
        pending += end - src
        if pending >= _WRITEBACK_BATCH:
            _start_writeback(fd, lo, hi - lo)
            lo, hi, pending = None, 0, 0
        if k == 0:
            cp.hit("persistent.direct.write")  # the first run written, the others not yet
    if lo is not None:
        _start_writeback(fd, lo, hi - lo)
    return crcs


def _check_runs(runs: "Sequence[Run]", base: int, at: _Assembled, plan: ShardPlan, rank: int,
                what: str) -> None:
    """Before a byte is written: every piece of ``runs`` is rank ``rank``'s and lands at its assembled
    offset, and a run's bytes cover no piece but its own (what lies between them is padding no piece
    holds). Else :class:`CheckpointWriteError` naming the version (``what``), the tensor and the rank:
    bytes written over another piece would not match the CRC its rank records for it, and a run of
    padding over a piece is exactly that. The check costs one lookup per piece and one bisection
    per run, in memory; nothing of the file is read."""
    def piece(key: tuple[int, int]) -> str:
        e = next((x for x in at.entries if (x.tensor_id, x.start) == key), None)
        span = f"[{key[1]},{e.stop})" if e is not None else f"[{key[1]},{key[1]})"
        return f"tensor {plan.tensors[key[0]].name!r} elements {span}"
    for src, end, dst, run in runs:
        keys = set()
        for e in run:
            key = (e.tensor_id, e.start)
            land = dst + (e.offset - base - src)
            if at.owner.get(key) != rank or land != at.where.get(key) or not (src <= e.offset - base
                                                                              and e.offset - base + e.length <= end):
                raise CheckpointWriteError(errno.EIO, f"{what} rank {rank}: {piece(key)} would be written at offset "
                                           f"{land} of the partial, not at its assembled offset {at.where.get(key)} "
                                           f"(a piece of rank {at.owner.get(key)}): not committing the version")
            keys.add(key)
        lo, hi = dst, dst + end - src
        i = max(0, bisect.bisect_right(at.offsets, lo) - 1)
        while i < len(at.entries) and at.entries[i].offset < hi:
            e = at.entries[i]
            key = (e.tensor_id, e.start)
            if e.offset + e.length > lo and key not in keys:
                raise CheckpointWriteError(errno.EIO, f"{what} rank {rank}: a write of bytes [{lo},{hi}) of the partial "
                                           f"would cover {piece(key)} of rank {at.owner[key]}, whose bytes would then "
                                           "not match the CRC recorded for them: not committing the version")
            i += 1


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _read_regular(path: str, limit: int, trusted: frozenset[int] | None = None, level: str = "") -> bytes:
    """The bytes of a regular file (no symlink followed, no FIFO opened), at most ``limit``;
    with ``trusted``, the file must be owned by one of those uids (:func:`ownership.check_owner`)."""
    return read_small(path, limit, None if trusted is None else
                      (lambda st: ownership.check_owner(st, path, trusted, level)))


_MAX_LOCK_BYTES = 512


def lock_record(token: str) -> bytes:
    """The content of a ``commit.lock`` taken by this process: ``node pid token boot pidns start``
    (:func:`deepfreeze.node.node_id`, :func:`deepfreeze.node.process_identity`; ``-`` for a start
    time ``/proc`` cannot show), one line of fields without white space."""
    me = process_identity()
    start = "-" if me["start"] is None else me["start"]
    return f"{node_id()} {me['pid']} {token} {me['boot'] or '-'} {me['pidns']} {start}".encode()


def parse_lock(raw: bytes) -> dict[str, Any]:
    """A ``commit.lock``'s content as a holder record (``node``, ``pid``, ``boot``, ``pidns``,
    ``start``) for :func:`deepfreeze.node.holder_gone`; fields it lacks (an older DeepFreeze's
    lock) or that are not numbers are left out, so such a holder is never judged by its pid."""
    f = raw.decode("ascii", "replace").split(" ")
    rec: dict[str, Any] = {"node": f[0]}
    for i, key in ((1, "pid"), (4, "pidns"), (5, "start")):
        if len(f) > i and f[i].isdigit() and len(f[i]) <= 20:
            rec[key] = int(f[i])
    if len(f) > 3:
        rec["boot"] = f[3]
    return rec


def _of_run(d: dict[str, str] | None, run: str) -> bool:
    """Whether ``d`` (:func:`read_decision`) is a decision of ``run`` with a nonce."""
    return d is not None and d["run"] == run and bool(d["nonce"])


def read_decision(vdir: str) -> dict[str, str] | None:
    """The version's decision ``{"decision": "flush"|"skip", "nonce", "run"}``, or None.
    A format-1 decision (the bare word) has no nonce and run ``""``; an unreadable one is
    reported as decision ``"corrupt"``."""
    path = os.path.join(vdir, DECISION)
    counters.fs("open", "persistent.decision.read")
    try:
        data = _read_regular(path, 4096)
    except FileNotFoundError:
        return None
    except (OSError, DeepFreezeError):
        return {"decision": "corrupt", "nonce": "", "run": ""}
    if data in (b"flush", b"skip"):
        return {"decision": data.decode(), "nonce": "", "run": ""}
    try:
        d = bounded_loads(data, path, max_bytes=4096)
        if (isinstance(d, dict) and d.get("decision") in ("flush", "skip")
                and isinstance(d.get("nonce"), str) and re.fullmatch(r"[0-9a-f]{16}", d["nonce"])
                and isinstance(d.get("run"), str)):
            return {"decision": d["decision"], "nonce": d["nonce"], "run": d["run"]}
    except (ValueError, UnicodeDecodeError):
        pass
    return {"decision": "corrupt", "nonce": "", "run": ""}


class PersistentLevel(Level):
    """Shared last level: one assembled file per version, committed by its manifest.

    See the module docstring for the commit protocol; every method that creates or removes
    a file of a version does it through :mod:`deepfreeze.crashpoints`."""

    kind = "persistent"

    @staticmethod
    def critical(fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a section that holds ``commit.lock``, which other nodes' flushes wait on (the
        decision, the finalize): here, inline. The backend sets it per flush job to run such
        sections at normal priority (:meth:`deepfreeze.priority.Lanes.run_normal`)."""
        return fn(*args, **kwargs)

    def generation(self, name: str) -> int:
        """The name's current generation (:func:`deepfreeze.lease.read_generation`)."""
        return read_generation(self.root, name)

    def committed_versions(self, name: str, generation: int | None = None) -> list[int]:
        """Versions whose manifest exists, is a valid manifest of this name and version and
        belongs to the current generation (or ``generation``)."""
        gen = self.generation(name) if generation is None else generation
        out = []
        self.untrusted = {}
        for v in self.versions(name):
            try:
                m = self.read_manifest(name, v)
            except UntrustedOwnerError as e:
                self.untrusted[v] = e  # not committed for this reader; restore names the owner
                continue
            except (OSError, DeepFreezeError, ValueError):
                continue
            if fmt.manifest_run(m)[1] == gen:
                out.append(v)
        return out

    # -- the version lock
    @contextlib.contextmanager
    def locked(self, vdir: str, *, wait: float, stale_after: float) -> Iterator[bool]:
        """Hold ``commit.lock`` of a version directory. Yields False (not taken) when another
        live holder keeps it longer than ``wait`` seconds. The lock holds :func:`lock_record`
        (``node pid token boot pidns start``; an older DeepFreeze wrote ``node pid token`` or
        ``host pid token``). A lock whose holder is provably gone (this boot and PID namespace, pid
        free, zombie or reused: :func:`deepfreeze.node.holder_gone`) is broken at once; a live holder
        of this PID namespace is never broken; any other lock (another node, another PID namespace
        under the same node id, an older DeepFreeze's) once it is older than ``stale_after`` seconds
        by the file system's clock. Breaking moves the lock aside (one breaker wins) and puts it
        back if what was moved is not the lock judged stale; release removes the lock only if it
        still holds this holder's token."""
        path = os.path.join(vdir, LOCK)
        me = lock_record(secrets.token_hex(8))
        deadline = time.monotonic() + wait
        taken = False
        delay = _POLL_FIRST
        while True:
            if _create_exclusive(path, me, "persistent.lock.link"):
                taken = True
                break
            counters.add("persistent.lock.busy")  # the lock was held: one more round of reads
            counters.fs("open", "persistent.lock.read")
            try:
                raw = _read_regular(path, _MAX_LOCK_BYTES)
                counters.fs("stat", "persistent.lock.stat")
                mtime = os.lstat(path).st_mtime
            except FileNotFoundError:
                continue
            except (OSError, DeepFreezeError):
                raw, mtime = None, 0.0  # cannot judge it: treated as live
            if raw is not None:
                holder = parse_lock(raw)
                dead = holder_gone(holder)
                if dead or (not in_this_pid_space(holder) and fs_now(vdir) - mtime > stale_after):
                    log.warning("deepfreeze: breaking stale lock %s of %s process %s", path,
                                "dead" if dead else "silent", raw.decode(errors="replace")[:100])
                    self._break(path, raw)
                    continue
            if time.monotonic() >= deadline:
                break
            delay = _pause(delay)
        try:
            yield taken
        finally:
            if taken:
                counters.fs("open", "persistent.lock.read")
                try:
                    if _read_regular(path, _MAX_LOCK_BYTES) == me:  # not a lock someone else took after breaking ours
                        cp.unlink(path, "persistent.lock.unlink")
                except FileNotFoundError:
                    pass

    @staticmethod
    def _break(path: str, judged: bytes) -> None:
        """Move the lock judged stale aside and remove it; if what was moved is another lock (the
        holder was replaced meanwhile), put it back."""
        aside_tmp = f"{path}.tmp{temp_suffix()}"
        try:
            cp.rename(path, aside_tmp, "persistent.lock.break")
        except FileNotFoundError:
            return
        try:
            if _read_regular(aside_tmp, _MAX_LOCK_BYTES) != judged:
                try:
                    cp.link(aside_tmp, path, "persistent.lock.putback")
                except FileExistsError:
                    pass
        finally:
            os.unlink(aside_tmp)

    def _fence(self, name: str, run: str, what: str) -> None:
        holder = fence_holder(self.root, name, run)
        if holder is not None:
            raise FencedError(f"{what} of run {run} abandoned: the lease on {name!r} is held by "
                              f"{describe_holder(holder)}")

    # -- which versions go to persistent
    def _due(self, name: str, version: int, interval: float) -> bool:
        """Has ``interval`` passed (file-system clock) since the newest earlier ``flush`` decision?"""
        if interval <= 0:
            return True
        for v in reversed([v for v in self.versions(name) if v < version]):
            vdir = self.version_dir(name, v)
            d = read_decision(vdir)
            if d is None or d["decision"] != "flush":
                continue
            try:
                mtime = os.lstat(os.path.join(vdir, DECISION)).st_mtime
            except FileNotFoundError:
                continue
            age = fs_now(self.name_dir(name)) - mtime
            if age < 0:
                warn_skew(f"the decision of {name!r} v{v}", -age)
                return True  # a future mtime (another node's clock): due, never "skip forever"
            return age >= interval
        return True

    def decide(self, name: str, version: int, interval: float, run: str = ANONYMOUS_RUN, *,
               stale_after: float = 60.0) -> dict[str, str] | None:
        """The version's decision (``flush``/``skip`` and its nonce), made once per run by the
        first node to flush it (exclusive creation, under the version lock), followed by all.
        A decision of another run (an abandoned attempt, or a version an older run committed
        above this run's resume point) is retired first, if ``run`` holds the lease; if another
        run holds it, :class:`FencedError`. None when ``interval < 0`` (no persistent level).
        A node that finds the lock held waits for the decision (re-read with a growing pause)
        instead of queuing on the lock; :class:`CheckpointWriteError` (``ETIMEDOUT``) when the lock
        stays held by a live process for ``stale_after + 5`` s with no decision made."""
        if interval < 0:
            return None
        vdir = self.version_dir(name, version)
        d = read_decision(vdir)
        if _of_run(d, run):
            return d
        counters.add("persistent.decide.locked")  # no decision of this run seen: the lock path
        self.makedirs(vdir)
        deadline = time.monotonic() + stale_after + 5
        delay = _POLL_FIRST
        while True:
            with self.locked(vdir, wait=0.0, stale_after=stale_after) as taken:
                if taken:
                    return self._decide_locked(name, version, vdir, interval, run)
            # Held (by the node deciding, most likely): wait for its decision rather than queue on
            # the lock; take the lock only if it comes free with no decision of this run made.
            if time.monotonic() >= deadline:
                raise CheckpointWriteError(errno.ETIMEDOUT, f"{vdir}/{LOCK} stayed locked for {stale_after + 5:.0f} s "
                                           "by a live process: cannot decide the version")
            delay = _pause(delay)
            counters.add("persistent.decide.waited")
            d = read_decision(vdir)
            if _of_run(d, run):
                return d

    def _decide_locked(self, name: str, version: int, vdir: str, interval: float, run: str) -> dict[str, str]:
        """:meth:`decide` under the version's lock: the decision of this run, found or made."""
        counters.add("persistent.decide.taken")
        self._fence(name, run, f"flush of {name!r} v{version}")
        d = read_decision(vdir)
        if _of_run(d, run):
            return d
        counters.fs("stat", "persistent.decide.manifest")
        if d is not None or os.path.lexists(os.path.join(vdir, MANIFEST)):
            log.warning("deepfreeze: %s v%d on persistent holds work of another run (%s): retiring it before "
                        "this run (%s) writes the version", name, version, (d or {}).get("run") or "unknown",
                        run)
            # shard files VeloC flushed here are kept: flush_shard checks their run id
            self._clear(vdir, keep=(LOCK,), keep_re=_SCRATCH_FILE)
        flush = self._due(name, version, interval)
        d = {"decision": "flush" if flush else "skip", "nonce": secrets.token_hex(8), "run": run}
        if not _create_exclusive(os.path.join(vdir, DECISION), json.dumps(d).encode(),
                                 "persistent.decision.link"):
            raise CheckpointWriteError(errno.EEXIST, f"{vdir}/{DECISION} appeared while holding {LOCK}")
        return d

    def mark_skipped(self, name: str, version: int, run: str = ANONYMOUS_RUN) -> None:
        """Record ``skip`` for a version some node will not flush (unless a decision exists), so
        :meth:`retain` sweeps its directory once a newer version commits."""
        vdir = self.version_dir(name, version)
        if os.path.isdir(vdir):
            _create_exclusive(os.path.join(vdir, DECISION),
                              json.dumps({"decision": "skip", "nonce": secrets.token_hex(8), "run": run}).encode(),
                              "persistent.decision.link")

    def assembled_layout(self, plan: ShardPlan) -> tuple[list[fmt.Entry], int, int]:
        """(entries, data offset, file size) of the version's assembled file (every piece, tensors
        contiguous): kept for the last plan object asked (read-only: do not change the list)."""
        if _LAYOUT and _LAYOUT[0] is plan:
            return _LAYOUT[1]
        out = fmt.layout(piece_entries(plan, plan.pieces), contiguous_tensors=True)
        _LAYOUT[:] = [plan, out, None]
        return out

    def write_direct(self, name: str, version: int, rank: int, plan: ShardPlan,
                     arrays: "Sequence[np.ndarray] | FusedShard", decision: dict[str, str], *,
                     chksum: bool) -> dict[str, Any]:
        """Write once (``write_once``, :mod:`deepfreeze.writeonce`): write this rank's pieces (flat
        arrays in plan order, or its :class:`~deepfreeze.fused.FusedShard`) from memory straight into
        the version's ``model.dfz.partial.<nonce>`` at their assembled offsets, each piece's CRC32
        computed on each chunk right before it is written (as a scratch write does), the write-back of
        every 8 MiB started at once. Nothing is fsynced, no marker published: the returned record (the
        flush job's ``direct``: ``{"nonce", "has_crc", "crcs": [[tensor_id, start, crc], ...]}``)
        is handed to :meth:`flush_shard`, which makes the bytes durable and goes on with the commit
        protocol. ``decision`` is this run's ``flush`` decision of the version (:meth:`decide`).
        Raises OSError, ValueError (arrays do not match the plan)."""
        at = _assembled_offsets(self, plan)
        what = f"write once of {name!r} v{version}"
        if isinstance(arrays, FusedShard):
            shard = _check_fused(arrays, plan, rank)
            data, base = fmt.byte_view(shard.data), shard.layout.data_offset
            runs = self.direct_runs(shard.layout.entries, base, at.where, at.after)
        else:  # one run a piece, each from its own array
            entries = _check_arrays(arrays, plan, rank)
            runs = [(0, e.nbytes, at.where[(e.tensor_id, e.start)], [e]) for e in entries]
            base = 0
        _check_runs(runs, base, at, plan, rank, what)
        vdir = self.version_dir(name, version)
        counters.fs("create", "persistent.partial.create")
        dst = os.open(os.path.join(vdir, f"{ASSEMBLED}.partial.{decision['nonce']}"),
                      os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if isinstance(arrays, FusedShard):  # runs of pieces laid out alike in both: one write each
                crcs = _write_runs(dst, data, base, runs, chksum)
            else:
                crcs = []
                lo: int | None = None  # the range written since the last write-back kick
                hi = pending = 0
                for k, ((_, _, at_, (e,)), a) in enumerate(zip(runs, arrays)):
                    view = fmt.byte_view(a)
                    crc = _write_region(dst, view, at_, [(0, len(view))], chksum, "bytes.persistent.data")[0]
                    lo, hi = (at_ if lo is None else min(lo, at_)), max(hi, at_ + len(view))
                    pending += len(view)
                    if pending >= _WRITEBACK_BATCH:
                        _start_writeback(dst, lo, hi - lo)
                        lo, hi, pending = None, 0, 0
                    crcs.append([e.tensor_id, e.start, crc])
                    if k == 0:
                        cp.hit("persistent.direct.write")  # the first piece written, the others not yet
                if lo is not None:
                    _start_writeback(dst, lo, hi - lo)
        finally:
            os.close(dst)
        return {"nonce": decision["nonce"], "has_crc": bool(chksum), "crcs": crcs}

    def direct_runs(self, entries: Sequence[fmt.Entry], base: int, where: "dict[tuple[int, int], int]",
                    after: "dict[tuple[int, int], tuple[int, int] | None]") -> list[Run]:
        """How :meth:`write_direct` writes a fused shard (``entries``: its pieces, offsets
        ``base``-relative in its buffer): runs ``(src, end, dst, pieces)``, bytes ``[src, end)`` of
        the buffer at file offset ``dst``. Consecutive pieces form one run, written with the padding
        between them (zeros in a fused buffer; holes of the file read as zeros too), when their
        destinations are as far apart as their sources **and** the second is laid right after the
        first in the assembled file (``after``): the padding of a run then never covers another
        rank's piece. (FSDP2 shards a tensor by rows, unevenly: rank 0's first rows and its next
        tensor can be as far apart in the file as in its buffer, with rank 1's rows between them.)
        :func:`_check_runs` checks what this returns before a byte is written."""
        runs: list[Run] = []
        i = 0
        while i < len(entries):
            e0 = entries[i]
            shift = where[(e0.tensor_id, e0.start)] - (e0.offset - base)
            j, end = i + 1, e0.offset + e0.length
            while j < len(entries):
                e, prev = entries[j], entries[j - 1]
                if (e.offset < end or where[(e.tensor_id, e.start)] - (e.offset - base) != shift
                        or after[(prev.tensor_id, prev.start)] != (e.tensor_id, e.start)):
                    break
                end = e.offset + e.length
                j += 1
            runs.append((e0.offset - base, end - base, e0.offset - base + shift, list(entries[i:j])))
            i = j
        return runs

    @staticmethod
    def _direct_crcs(direct: Any, plan: ShardPlan, rank: int, nonce: str, what: str) -> tuple[bool, list]:
        """Check a flush job's ``direct`` record (JSON that crossed a socket) against the plan's pieces
        of ``rank`` and the version's nonce; return ``(has_crc, [[tensor_id, start, crc], ...])``."""
        pieces = [(p.tensor_id, p.start) for p in plan.for_rank(rank)]
        ok = (isinstance(direct, dict) and isinstance(direct.get("has_crc"), bool)
              and isinstance(direct.get("crcs"), list) and len(direct["crcs"]) == len(pieces)
              and all(isinstance(c, list) and len(c) == 3 and all(type(x) is int for x in c)
                      and (c[0], c[1]) == p and 0 <= c[2] < (1 << 32) for c, p in zip(direct["crcs"], pieces)))
        if not ok:
            raise CheckpointWriteError(errno.EINVAL, f"{what}: malformed write-once record {str(direct)[:300]} "
                                       "(expected nonce, has_crc and one [tensor_id, start, crc] per piece of the "
                                       "rank): not committing it")
        if direct.get("nonce") != nonce:
            raise CheckpointWriteError(errno.ESTALE, f"{what}: its pieces were written into the partial of nonce "
                                       f"{str(direct.get('nonce'))[:20]}, but the version's decision now has nonce "
                                       f"{nonce} (retired and decided again): not committing it")
        return direct["has_crc"], direct["crcs"]

    def flush_shard(self, name: str, version: int, rank: int, shard_path: str | None,
                    manifest: dict[str, Any], *, fsync: bool = True, decision: dict[str, str] | None = None,
                    stale_after: float = 60.0, source: "SlotSource | None" = None,
                    direct: "dict[str, Any] | None" = None) -> bool:
        """Copy one rank's shard into the version's partial file, publish its done marker, and
        finalize if it was the last one. Returns True if this call committed the version.

        The shard is the scratch file ``shard_path``, or, with ``source``, the image in a slot of
        the memory tier (``shard_path`` is then unused), or, with ``direct`` (:meth:`write_direct`'s
        record), already in the partial: nothing is copied, the partial is fsynced and the marker
        carries the CRCs the writer computed.

        ``decision`` is the version's (:meth:`decide`); the partial and the marker carry its
        nonce. Each piece's CRC is computed from the bytes as they are copied and compared with
        the shard's index (no second read). A ``model.dfz`` already renamed into place (a
        finalizer killed before the manifest) is finished, never reopened."""
        run = fmt.manifest_run(manifest)[0] or ANONYMOUS_RUN
        if decision is None:
            decision = self.decide(name, version, 0, run, stale_after=stale_after)
        nonce = decision["nonce"]
        vdir = self.version_dir(name, version)
        counters.fs("stat", "persistent.flush.manifest")
        if os.path.lexists(os.path.join(vdir, MANIFEST)):
            return False  # already committed (a re-sent flush after a backend restart): nothing to do
        plan = plan_of(manifest)
        layout, _, size = self.assembled_layout(plan)
        counters.fs("stat", "persistent.flush.assembled")
        if direct is not None and not os.path.lexists(os.path.join(vdir, ASSEMBLED)):
            has_crc, crcs = self._direct_crcs(direct, plan, rank, nonce, f"{name!r} v{version} rank {rank}")
            if fsync:
                where = {(e.tensor_id, e.start): e for e in layout}
                counters.fs("open", "persistent.partial.open")
                try:  # never created here: the writer wrote it
                    dst = os.open(os.path.join(vdir, f"{ASSEMBLED}.partial.{nonce}"),
                                  os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except FileNotFoundError as e:
                    raise CheckpointWriteError(errno.ENOENT, f"{vdir}: the partial rank {rank} wrote (write_once) "
                                               "is gone (the version was retired?): not committing it") from e
                try:
                    cp.fsync(dst, "persistent.direct.fsync")
                    _drop_cached(dst, [(where[(p.tensor_id, p.start)].offset, where[(p.tensor_id, p.start)].length)
                                       for p in plan.for_rank(rank)])
                finally:
                    os.close(dst)
            marker = {"rank": rank, "run": run, "nonce": nonce, "has_crc": has_crc, "crcs": crcs}
            atomic_write(os.path.join(vdir, f"done.r{rank:06d}.{nonce}.json"), json.dumps(marker).encode(),
                         fsync=fsync, point="persistent.marker")
        elif not os.path.lexists(os.path.join(vdir, ASSEMBLED)):
            where = {(e.tensor_id, e.start): e for e in layout}
            with _open_source(shard_path, source) as (fd, base, idx, shard_path, recheck):
                expect = [(p.tensor_id, p.start, p.stop) for p in plan.for_rank(rank)]
                if [(e.tensor_id, e.start, e.stop) for e in idx.entries] != expect or idx.version != version:
                    raise CorruptCheckpointError(f"{shard_path}: shard does not match the manifest's plan")
                if (idx.run or ANONYMOUS_RUN) != run:
                    raise CorruptCheckpointError(f"{shard_path}: shard written by run {idx.run or 'unknown'}, the "
                                                 f"manifest is run {run}'s: not flushing a mixture of two runs")
                counters.fs("create", "persistent.partial.create")
                dst = os.open(os.path.join(vdir, f"{ASSEMBLED}.partial.{nonce}"),
                              os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    got = _copy_checked(fd, dst, idx.entries, [where[(e.tensor_id, e.start)].offset
                                                               for e in idx.entries], idx.has_crc, shard_path,
                                        base=base)
                    recheck()  # the source still holds what was read (a memory-tier slot not rewritten)
                    for e in idx.entries:
                        counters.record("offsets.persistent", [where[(e.tensor_id, e.start)].offset, e.length])
                    crcs = [[e.tensor_id, e.start, c] for e, c in zip(idx.entries, got)]
                    if fsync:
                        cp.fsync(dst, "persistent.partial.fsync")
                        _drop_cached(dst, [(where[(e.tensor_id, e.start)].offset, e.length) for e in idx.entries])
                finally:
                    os.close(dst)
            marker = {"rank": rank, "run": run, "nonce": nonce, "has_crc": idx.has_crc, "crcs": crcs}
            atomic_write(os.path.join(vdir, f"done.r{rank:06d}.{nonce}.json"), json.dumps(marker).encode(),
                         fsync=fsync, point="persistent.marker")
        return self.critical(self._try_finalize, name, version, manifest, plan, layout, size, nonce, run,
                             fsync=fsync, stale_after=stale_after)

    def _markers(self, vdir: str, nonce: str) -> dict[int, str]:
        out = {}
        counters.fs("listdir", "persistent.finalize.markers")
        for n in _listdir(vdir):
            m = _MARKER.match(n)
            if m and m.group(2) == nonce:
                out[int(m.group(1))] = n
        return out

    def _try_finalize(self, name: str, version: int, manifest: dict[str, Any], plan: ShardPlan,
                      layout: list[fmt.Entry], size: int, nonce: str, run: str, *, fsync: bool,
                      stale_after: float) -> bool:
        vdir = self.version_dir(name, version)
        done = self._markers(vdir, nonce)
        if set(done) != set(range(plan.world_size)):
            return False
        counters.add("persistent.finalize.tries")  # every marker seen: try to finalize
        with self.locked(vdir, wait=0.0, stale_after=stale_after) as taken:
            if not taken:
                return False  # another node finalizes
            counters.add("persistent.finalize.locked")
            self._fence(name, run, f"commit of {name!r} v{version}")
            counters.fs("stat", "persistent.finalize.manifest")
            if os.path.lexists(os.path.join(vdir, MANIFEST)):
                return False
            d = read_decision(vdir)
            if d is None or d["nonce"] != nonce:
                raise FencedError(f"{name!r} v{version}: the version was retired while this run flushed it")
            crc: dict[tuple[int, int], int] = {}
            has_crc = True
            for r, n in done.items():
                path = os.path.join(vdir, n)
                counters.fs("open", "persistent.finalize.marker")
                try:
                    marker = bounded_loads(_read_regular(path, _MAX_MARKER_BYTES), path, max_bytes=_MAX_MARKER_BYTES)
                    ok = (isinstance(marker, dict) and marker.get("rank") == r and marker.get("run") == run
                          and marker.get("nonce") == nonce and isinstance(marker.get("crcs"), list))
                    if ok:
                        has_crc &= bool(marker.get("has_crc"))
                        for tid, start, c in marker["crcs"]:
                            crc[(int(tid), int(start))] = int(c)
                except (ValueError, TypeError, UnicodeDecodeError) as e:
                    raise CorruptCheckpointError(f"{path}: damaged done marker ({e})") from e
                if not ok:
                    raise CorruptCheckpointError(f"{path}: done marker of another run, nonce or rank")
            assembled = os.path.join(vdir, ASSEMBLED)
            counters.fs("stat", "persistent.finalize.assembled")
            if not os.path.lexists(assembled):
                crcs = [crc.get((e.tensor_id, e.start), 0) if has_crc else 0 for e in layout]
                data_offset = fmt.index_data_offset(layout)
                head = fmt.encode_index(fmt.KIND_ASSEMBLED, 0, 1, version, layout, data_offset, size, has_crc,
                                        run, crcs)
                partial = os.path.join(vdir, f"{ASSEMBLED}.partial.{nonce}")
                counters.fs("open", "persistent.final.open")
                fd = os.open(partial, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # never created empty here
                try:
                    write_all(fd, head, 0, "bytes.persistent.meta")
                    os.ftruncate(fd, size)
                    if fsync:
                        cp.fsync(fd, "persistent.final.fsync")
                finally:
                    os.close(fd)
                cp.replace(partial, assembled, "persistent.final.rename")
            else:  # renamed by a finalizer killed before the manifest: finished, check it is this run's
                fd = open_regular(assembled)
                try:
                    idx = fmt.read_index(_FdFile(fd), assembled)
                finally:
                    os.close(fd)
                if (idx.run or ANONYMOUS_RUN) != run or idx.version != version or idx.file_size != size:
                    raise CorruptCheckpointError(f"{assembled}: left by another run or version; not committing it")
            # checked again right before the commit: a finalizer that stalled (a stuck mount) after its
            # first check must not commit once another run took the name or retired the version
            self._fence(name, run, f"commit of {name!r} v{version}")
            d = read_decision(vdir)
            if d is None or d["nonce"] != nonce:
                raise FencedError(f"{name!r} v{version}: the version was retired while this run committed it")
            final = dict(manifest, assembled={"file": ASSEMBLED, "bytes": size, "checksums": has_crc},
                         committed=time.time())
            atomic_write(os.path.join(vdir, MANIFEST), fmt.encode_manifest(final), fsync=fsync,
                         point="persistent.manifest")
            for n in done.values():
                try:
                    cp.unlink(os.path.join(vdir, n), "persistent.cleanup.unlink")
                except FileNotFoundError:
                    pass
        return True

    # -- removing versions
    def _clear(self, vdir: str, keep: Sequence[str] = (), keep_re: "re.Pattern[str] | None" = None) -> None:
        """Remove a version directory's files, the manifest (the commit) first, then the
        directory unless something is kept. Never follows a symbolic link (a link is removed,
        not its target); leaves anything that is not a plain entry of the directory."""
        try:  # through a descriptor of the directory: a symbolic link is never followed
            fd = ownership.open_dir_nofollow(vdir)
        except (FileNotFoundError, NotADirectoryError, UnsafePathError):
            return
        try:
            try:
                os.stat(MANIFEST, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                cp.unlink(MANIFEST, "persistent.retire.manifest", dir_fd=fd)
                cp.fsync(fd, "persistent.retire.dirsync")
            for n in os.listdir(fd):
                if n in keep or (keep_re is not None and keep_re.match(n)):
                    continue
                try:
                    if stat.S_ISDIR(os.stat(n, dir_fd=fd, follow_symlinks=False).st_mode):
                        continue
                    cp.unlink(n, "persistent.retire.unlink", dir_fd=fd)
                except FileNotFoundError:
                    pass
        finally:
            os.close(fd)
        if not keep:
            try:
                cp.rmdir(vdir, "persistent.retire.rmdir")
            except OSError:
                pass

    def retire(self, name: str, version: int, *, stale_after: float = 60.0) -> None:
        """Retire one version: uncommit it (manifest first), then remove its files; under its lock
        so no finalizer is half-way through."""
        vdir = self.version_dir(name, version)
        if not os.path.isdir(vdir):
            return
        with self.locked(vdir, wait=stale_after + 5, stale_after=stale_after) as taken:
            if not taken:
                raise CheckpointWriteError(errno.ETIMEDOUT, f"cannot retire {vdir}: {LOCK} held by a live process")
            self._clear(vdir, keep=(LOCK,))
        try:
            cp.rmdir(vdir, "persistent.retire.rmdir")
        except OSError:
            pass

    def retain(self, name: str, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` committed versions (0 = keep all) of the current
        generation, every version of older generations, and the directories of versions
        decided ``skip`` that are older than the newest commit. A hostile or damaged manifest
        counts as not committed and is never a reason to stop."""
        gen = self.generation(name)
        committed, other_gen = [], []
        for v in self.versions(name):
            try:  # (a manifest this process validated before is not read again: committed_run)
                run = self.committed_run(name, v)
            except (OSError, DeepFreezeError, ValueError):
                continue
            (committed if run[1] == gen else other_gen).append(v)
        for v in other_gen:  # under the version's lock: never half-way through another node's decision
            vdir = self.version_dir(name, v)
            with self.locked(vdir, wait=0.0, stale_after=60.0) as taken:
                if taken:
                    self._clear(vdir, keep=(LOCK,))
            try:
                cp.rmdir(vdir, "persistent.retire.rmdir")
            except OSError:
                pass
        for v in self.versions(name):
            if committed and v < committed[-1] and v not in committed:
                d = read_decision(self.version_dir(name, v))
                if d is not None and d["decision"] == "skip":
                    self._clear(self.version_dir(name, v))
        if keep <= 0:
            return []
        old = committed[:-keep]
        for v in old:
            self._clear(self.version_dir(name, v))  # uncommit first: never a half-deleted "committed" version
        return old


@dataclasses.dataclass(frozen=True)
class SlotSource:
    """A flush job's memory-tier source (source kind ``memtier``, :mod:`deepfreeze.tiers.job`):
    slot ``slot`` of the model-table entry ``entry`` of the device file ``device``, holding version
    ``version`` of run ``run``, rank ``rank``. Encoded: ``{"device": path, "entry": int, "slot":
    int, "version": int, "run": hex16, "rank": int}``."""

    kind: ClassVar[str] = "memtier"

    device: str
    entry: int
    slot: int
    version: int
    run: str
    rank: int

    @classmethod
    def from_job(cls, spec: Any, job: FlushJob) -> "SlotSource":
        """Check ``job``'s encoded source ``spec`` against the job's own version/rank/run (JSON that
        crossed a socket: every field is checked, nothing trusted)."""
        ok = isinstance(spec, dict) and set(spec) == {"device", "entry", "slot", "version", "run", "rank"} \
            and isinstance(spec["device"], str) and os.path.isabs(spec["device"]) and "\x00" not in spec["device"] \
            and len(spec["device"]) <= 4096 \
            and all(type(spec[k]) is int and 0 <= spec[k] < (1 << 63) for k in ("entry", "slot", "version", "rank")) \
            and isinstance(spec["run"], str)
        if not ok or spec["version"] != job.version or spec["rank"] != job.rank or spec["run"] != job.run:
            raise CheckpointWriteError(errno.EINVAL, f"flush job of {job.name!r} v{job.version} rank {job.rank}: "
                                       f"malformed memory-tier source {str(spec)[:300]} (expected device, entry, slot, "
                                       "version, run, rank matching the job)")
        return cls(spec["device"], spec["entry"], spec["slot"], spec["version"], spec["run"], spec["rank"])

    def to_job(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def label(self) -> str:
        return f"{self.device} (memory tier entry {self.entry}, slot {self.slot})"


def _slot_holds(region: Any, src: SlotSource) -> Any:
    """The slot header of ``src`` if it is DONE and holds ``src``'s run and version; else
    :class:`CorruptCheckpointError` naming what it holds."""
    head = region.holding(src.slot, src.run, src.version)
    if head is None:
        now = region.slot_header(src.slot)
        what = "an invalid header" if now is None else \
            f"state {getattr(now.state, 'name', now.state)}, run {now.run}, version {now.version}"
        raise CorruptCheckpointError(f"{src.label()}: the slot should hold run {src.run} v{src.version}, DONE, but "
                                     f"holds {what}: not flushing it (the tier was rewritten or damaged)")
    return head


def _open_source(shard_path: str | None, source: SlotSource | None
                 ) -> "contextlib.AbstractContextManager[tuple[int, int, fmt.ShardIndex, str, Any]]":
    """Open a flush's shard: ``(fd, base, index, label, recheck)``: the shard's bytes start at
    ``base`` of ``fd``; ``recheck()`` raises if the source changed since it was opened (a no-op for a
    scratch file, which is never rewritten: a new version is a new file). Dispatched through the
    source table (:mod:`deepfreeze.tiers.job`): the scratch file ``shard_path``, or ``source``'s kind."""
    return job_source(SCRATCH if source is None else source.kind).open(shard_path, source)


@contextlib.contextmanager
def _open_scratch(shard_path: str | None, source: None
                  ) -> Iterator[tuple[int, int, fmt.ShardIndex, str, Any]]:
    """The ``scratch`` source kind's opener: the rank's shard file."""
    fd = open_regular(shard_path)
    try:
        yield fd, 0, fmt.read_index(_FdFile(fd), shard_path), shard_path, (lambda: None)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _open_slot(shard_path: str | None, source: SlotSource
               ) -> Iterator[tuple[int, int, fmt.ShardIndex, str, Any]]:
    """The ``memtier`` source kind's opener: the image in a DONE slot of the device."""
    from .memtier import device as mdev
    label = source.label()
    dev = mdev.open(source.device, writable=False)
    try:
        region = dev.region(source.entry)
        if region is None or region.run != source.run or region.rank != source.rank or source.slot >= region.nslots:
            raise CorruptCheckpointError(f"{label}: no valid model-table entry {source.entry} of run {source.run} "
                                         f"rank {source.rank} with that slot on the device (retired or repacked?): "
                                         "not flushing")
        head = _slot_holds(region, source)
        view = region.image(source.slot)
        try:
            idx = fmt.read_index(view[:head.image_len], label)  # copies the header and index only
        finally:
            view.release()
        fd = os.dup(dev.fileno())  # the file checked at open, never the path again (it may be another file now)

        def recheck() -> None:
            if _slot_holds(region, source).raw != head.raw:
                raise CorruptCheckpointError(f"{label}: the slot was rewritten while it was flushed: not "
                                             "committing what was read")
        try:
            yield fd, region.image_offset(source.slot), idx, label, recheck
        finally:
            os.close(fd)
    finally:
        dev.close()


def _direct_record(spec: Any, job: FlushJob) -> dict[str, Any]:
    """The ``direct`` source kind's spec check: the write-once record's shape, bounded (its CRCs
    against the plan and its nonce against the decision: :meth:`PersistentLevel._direct_crcs`)."""
    crcs = spec.get("crcs") if isinstance(spec, dict) else None
    if not (isinstance(spec, dict) and set(spec) == {"nonce", "has_crc", "crcs"} and isinstance(spec["nonce"], str)
            and 0 < len(spec["nonce"]) <= 64 and type(spec["has_crc"]) is bool and isinstance(crcs, list)
            and len(crcs) <= (1 << 24)
            and all(type(c) is list and len(c) == 3 and all(type(x) is int and 0 <= x < (1 << 63) for x in c)
                    for c in crcs)):
        raise CheckpointWriteError(errno.EINVAL, f"flush job of {job.name!r} v{job.version} rank {job.rank}: "
                                   f"malformed write-once record {str(spec)[:300]} (expected nonce, has_crc and "
                                   "[tensor_id, start, crc] per piece)")
    return spec


# the source kinds this module's tiers flush from (deepfreeze.tiers.job's table)
register_source(SCRATCH, open=_open_scratch)
register_source(SlotSource.kind, open=_open_slot, decode=SlotSource.from_job, encode=SlotSource.to_job,
                scratch_files=False)
register_source("direct", decode=_direct_record, encode=dict)


class _FdFile:
    """The minimal file object :func:`deepfreeze.format.read_index` needs, over a descriptor."""

    def __init__(self, fd: int) -> None:
        self._fd, self._pos = fd, 0

    def fileno(self) -> int:
        return self._fd

    def seek(self, pos: int) -> None:
        self._pos = pos

    def read(self, n: int) -> bytes:
        data = os.pread(self._fd, n, self._pos)
        self._pos += len(data)
        return data


def _copy_checked(src: int, dst: int, entries: Sequence[fmt.Entry], dst_offsets: Sequence[int], check: bool,
                  path: str, *, base: int = 0) -> list[int]:
    """Copy the pieces ``entries`` of the shard ``src`` to ``dst_offsets`` of ``dst``, computing each
    piece's CRC32 from the copied bytes (no second read); with ``check``, compare it with the index.
    Returns the CRCs (0s when not checked). The shard starts at byte ``base`` of ``src`` (0 for a
    scratch file; a memory-tier slot image's offset in the device file).

    The bytes go through one reused buffer in reads of up to ``_CHUNK`` bytes (small enough to stay
    in the CPU cache from the read through the CRC to the write): consecutive small pieces share
    one read (the padding between them is read too), a large piece takes several. Every
    ``_WRITEBACK_BATCH`` bytes written are handed to the device at once (:func:`_start_writeback`),
    so the copy overlaps the device's writes and the final fsync finds little left to write."""
    order = sorted(range(len(entries)), key=lambda i: entries[i].offset)
    largest = max((e.length for e in entries), default=0)
    span = sum(e.length for e in entries) + 64 * len(entries)
    buf = np.empty(max(1, min(_CHUNK, max(largest, span))), np.uint8)
    view = memoryview(buf)
    crcs = [0] * len(entries)
    lo_dst: int | None = None  # the range written since the last write-back kick
    hi_dst = written = 0
    i = 0
    while i < len(order):
        e = entries[order[i]]
        j, end = i + 1, e.offset + e.length
        if e.length < len(view):  # group the following pieces that fit one read (never overlapping ones)
            while j < len(order):
                n = entries[order[j]]
                if n.offset < end or n.offset + n.length - e.offset > len(view):
                    break
                end = n.offset + n.length
                j += 1
        pos = e.offset
        while pos < end or pos == e.offset == end:  # one read per pass (a large piece: several passes)
            want = min(len(view), end - pos)
            got = _read_full(src, view[:want], base + pos, path)
            for k in order[i:j]:
                p = entries[k]
                lo, hi = max(p.offset, pos), min(p.offset + p.length, pos + got)
                if hi <= lo:
                    continue
                chunk = view[lo - pos:hi - pos]
                if check:
                    crcs[k] = fmt.crc32(chunk, crcs[k])
                at = dst_offsets[k] + lo - p.offset
                write_all(dst, chunk, at, "bytes.persistent.data")
                lo_dst = at if lo_dst is None else min(lo_dst, at)
                hi_dst = max(hi_dst, at + len(chunk))
                written += len(chunk)
            if lo_dst is not None and written >= _WRITEBACK_BATCH:
                _start_writeback(dst, lo_dst, hi_dst - lo_dst)
                lo_dst, hi_dst, written = None, 0, 0
            pos += got
            if got == 0:
                break
        i = j
    if lo_dst is not None:
        _start_writeback(dst, lo_dst, hi_dst - lo_dst)
    if check:
        for k, e in enumerate(entries):
            if crcs[k] != e.crc:
                raise CorruptCheckpointError(f"{path}: checksum mismatch in tensor {e.tensor_id} elements "
                                             f"[{e.start},{e.stop}) while flushing: the shard on scratch was "
                                             "damaged; not committing it")
    return crcs


def _read_full(fd: int, view: memoryview, offset: int, path: str) -> int:
    """Fill ``view`` from ``offset`` (short reads repeated); the file ending first is corruption."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CorruptCheckpointError(f"{path}: shard file ended before its index said")
        done += n
    return done


# the write-back hint (None where the C library has none; tests set it to None for the fallback)
_sync_file_range = sync_file_range if available("sync_file_range") else None


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a just-written range to the device now (not wait for it):
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, else ``posix_fadvise(DONTNEED)``, which starts the
    write-back of dirty pages too. A hint: durability still comes from the fsync after the copy.
    Measured here (``experiments/flush.py --strategies 256``, ``io_strategies`` in its results): write +
    fsync of 256 MiB at 1.29 GB/s this way, 0.80 without the hint, 0.93 with O_DIRECT (median of 12)."""
    if length <= 0:
        return
    if _sync_file_range is not None:
        try:
            _sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE)
            return
        except OSError:
            pass
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass


def _create_exclusive(path: str, data: bytes, point: str) -> bool:
    """Create ``path`` holding ``data`` unless it exists; atomic, and never visible empty:
    the content is written to an owner-only temporary file first, then hard-linked into place."""
    tmp = f"{path}.tmp{temp_suffix()}"
    site = point.rsplit(".", 1)[0]
    # owner-only from the start; the name is unique (host, pid, thread, random), never left by another
    counters.fs("create", site + ".create")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            write_all(fd, data, 0, "bytes.persistent.meta")
        finally:
            os.close(fd)
        cp.link(tmp, path, point)
        return True
    except FileExistsError:
        return False
    finally:
        counters.fs("unlink", site + ".tmp")
        try:
            os.unlink(tmp)  # on every outcome: no decision.tmp* left behind (ENOSPC, EIO, ...)
        except FileNotFoundError:
            pass


def _drop_cached(fd: int, ranges: Iterable[tuple[int, int]]) -> None:
    """Drop durable (fsynced) byte ranges from the page cache: the node's memory is the training's
    (a parallel file system's client does not keep what it wrote either). Ranges at most a page
    apart (a rank's consecutive pieces, alignment padding between them) go in one call."""
    merged: list[list[int]] = []
    for off, length in sorted(ranges):
        if merged and off <= merged[-1][0] + merged[-1][1] + 4096:
            merged[-1][1] = max(merged[-1][1], off + length - merged[-1][0])
        else:
            merged.append([off, length])
    for off, length in merged:
        try:
            os.posix_fadvise(fd, off, length, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):
            return


def flush_job(job: "FlushJob | dict[str, Any]", scratch_cls: type = ScratchLevel,
              persistent_cls: type = PersistentLevel, critical: Any = None) -> dict[str, Any]:
    """Flush one rank's shard of one version (backend or sync mode). Same code in both modes.
    ``job``: a :class:`~deepfreeze.tiers.job.FlushJob` (a dict is decoded first, checked as the
    backend checks one); the shard is read from its source (the source table of
    :mod:`deepfreeze.tiers.job`: the scratch file, a memory-tier slot, or, written once, already in
    persistent's partial). ``critical`` (the backend's): runs the sections under ``commit.lock``
    that other nodes wait on, the decision and the finalize (:meth:`PersistentLevel.critical`).

    Work of a run that lost the lease on its name is abandoned (logged, result
    ``abandoned``), never an error of the live run."""
    if not isinstance(job, FlushJob):
        job = FlushJob.decode(job)
    name, version, rank, run, stale = job.name, job.version, job.rank, job.run, job.lease_timeout
    kind = job_source(job.source)
    scratch = scratch_cls(job.scratch, shared_group=job.shared_group)
    persistent = persistent_cls(job.persistent, shared_group=job.shared_group)
    if critical is not None:
        persistent.critical = critical
    result = {"flushed": False, "committed": False, "abandoned": False}
    try:
        decision = persistent.critical(persistent.decide, name, version, job.persistent_interval, run,
                                       stale_after=stale)
        if decision is not None and decision["decision"] == "flush":
            copy = kind.open is not None  # a source without an opener is in persistent's partial already
            result["committed"] = persistent.flush_shard(
                name, version, rank, scratch.shard_path(name, version, rank) if job.spec is None else None,
                job.manifest, fsync=job.fsync, decision=decision, stale_after=stale,
                source=job.spec if copy else None, direct=None if copy else job.spec)
            result["flushed"] = True
            if result["committed"]:
                persistent._fence(name, run, f"retention of {name!r}")
                persistent.retain(name, job.keep_persistent)
        elif job.persistent_interval >= 0:
            persistent._fence(name, run, f"retention of {name!r}")  # a run without the lease removes nothing
            persistent.retain(name, job.keep_persistent)  # sweeps skipped versions
    except FencedError as e:
        log.warning("deepfreeze: %s", e)
        result["abandoned"] = True
    if kind.scratch_files:  # a memory-tier job has no scratch files (its slots are reused, not retained)
        scratch.retain(name, rank, job.keep_scratch, upto=version)
    return result
