"""The persistent tier: one assembled file per version, and the commit protocol.

Layout::

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
  names the slot (``job["memtier"]``, :class:`~deepfreeze.tiers.memtier.SlotSource`); the flush
  reads the image through a read-only descriptor of the device at the image's offset exactly as
  it reads a scratch shard (same checks, same partial, marker and finalize), after checking that
  the slot header is DONE and holds this run and version, and again after the copy (a slot
  rewritten meanwhile fails the flush; the busy-slot rule of the backend never lets that happen).
  No scratch file is read, written or retained for such a job.
* **Write once** (``write_once``, :mod:`deepfreeze.tiers.direct`): a rank's shard is not a scratch
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

Details behind these statements. Directories are created with mode ``0700``, files with
``0600``; temporary names carry the host, pid and thread id. With ``ec_interval`` due, the
partner/parity exchange (:mod:`deepfreeze.redundancy`) runs between the shard's rename and the
scratch manifest, so on scratch the order is shard, partner copies or parity block, manifest;
scratch retention deletes the partner copies and parity block a rank holds with its own shard.
The unit of flushing is one rank's shard (:func:`~deepfreeze.tiers.flush.flush_job`: one job per rank and version; "a
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
The engine takes the scratch level's class (``scratch_cls=``), :func:`~deepfreeze.tiers.flush.flush_job` both.

"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import stat
import time
from typing import Any, Iterator, Sequence

import numpy as np

from .. import counters
from .. import crashpoints as cp
from .. import format as fmt
from .. import ownership
from ..errors import CheckpointWriteError, CorruptCheckpointError, DeepFreezeError, UnsafePathError, UntrustedOwnerError
from ..format import ANONYMOUS_RUN
from ..lease import describe_holder, fence_holder, fs_now, read_generation, warn_skew
from ..fsafe import atomic_write, open_regular, temp_suffix, write_all
from ..jsonsafe import loads as bounded_loads
from ..fused import FusedShard
from ..node import holder_gone, in_this_pid_space, node_id, process_identity
from ..shardplan import ShardPlan
from . import shardbytes
from .base import MANIFEST, Level, plan_of
from .job import SCRATCH, source as job_source
from .memtier import SlotSource
from .scratch import _SCRATCH_FILE
from .shardbytes import (Run, _assembled_offsets, assembled_order, direct_crcs, _check_arrays, _check_fused, _check_runs, _copy_checked, _drop_cached,
                         _FdFile, _LAYOUT, _listdir, _read_regular, _start_writeback, _write_region, _write_runs,
                         piece_entries)

__all__ = ["PersistentLevel", "FencedError", "read_decision", "lock_record", "parse_lock", "ASSEMBLED",
           "DECISION", "LOCK"]

log = logging.getLogger("deepfreeze")
_MARKER = re.compile(r"^done\.r(\d{6})\.([0-9a-f]{16})\.json$")
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
        contiguous; the entries in plan order, their offsets in :func:`assembled_order`'s): kept for
        the last plan object asked (read-only: do not change the list)."""
        if _LAYOUT and _LAYOUT[0] is plan:
            return _LAYOUT[1]
        order = assembled_order(plan)
        laid, data_offset, size = fmt.layout(piece_entries(plan, [plan.pieces[i] for i in order]),
                                             contiguous_tensors=True)
        entries: list = [None] * len(laid)
        for i, e in zip(order, laid):
            entries[i] = e
        out = (entries, data_offset, size)
        _LAYOUT[:] = [plan, out, None]
        return out

    def write_direct(self, name: str, version: int, rank: int, plan: ShardPlan,
                     arrays: "Sequence[np.ndarray] | FusedShard", decision: dict[str, str], *,
                     chksum: bool) -> dict[str, Any]:
        """Write once (``write_once``, :mod:`deepfreeze.tiers.direct`): write this rank's pieces (flat
        arrays in plan order, or its :class:`~deepfreeze.fused.FusedShard`) from memory straight into
        the version's ``model.dfz.partial.<nonce>`` at their assembled offsets, each piece's CRC32
        computed on each chunk right before it is written (as a scratch write does), the write-back of
        every 8 MiB started at once. Nothing is fsynced, no marker published: the returned record (the
        flush job's ``direct``: ``{"nonce", "has_crc", "crc32"}``, the CRCs of the rank's pieces in
        plan order as one record, :func:`deepfreeze.format.encode_crcs`)
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
                    if pending >= shardbytes._WRITEBACK_BATCH:
                        _start_writeback(dst, lo, hi - lo)
                        lo, hi, pending = None, 0, 0
                    crcs.append(crc)
                    if k == 0:
                        cp.hit("persistent.direct.write")  # the first piece written, the others not yet
                if lo is not None:
                    _start_writeback(dst, lo, hi - lo)
        finally:
            os.close(dst)
        if len(crcs) != len(plan.for_rank(rank)):  # (the runs hold every piece of the rank, in plan order)
            raise ValueError(f"{what}: {len(crcs)} CRCs for the {len(plan.for_rank(rank))} pieces of rank {rank}")
        return {"nonce": decision["nonce"], "has_crc": bool(chksum), "crc32": fmt.encode_crcs(crcs)}

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
            has_crc, crcs = direct_crcs(direct, len(plan.for_rank(rank)), nonce, f"{name!r} v{version} rank {rank}")
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
            marker = {"rank": rank, "run": run, "nonce": nonce, "has_crc": has_crc, "crc32": crcs}
            atomic_write(os.path.join(vdir, f"done.r{rank:06d}.{nonce}.json"), json.dumps(marker).encode(),
                         fsync=fsync, point="persistent.marker")
        elif not os.path.lexists(os.path.join(vdir, ASSEMBLED)):
            where = {(e.tensor_id, e.start): e for e in layout}
            with job_source(SCRATCH if source is None else source.kind).open(shard_path, source) as (  # the kind's opener
                    fd, base, idx, shard_path, recheck):
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
                    crcs = fmt.encode_crcs(got)  # (idx.entries are the rank's pieces in plan order: checked)
                    if fsync:
                        cp.fsync(dst, "persistent.partial.fsync")
                        _drop_cached(dst, [(where[(e.tensor_id, e.start)].offset, e.length) for e in idx.entries])
                finally:
                    os.close(dst)
            marker = {"rank": rank, "run": run, "nonce": nonce, "has_crc": idx.has_crc, "crc32": crcs}
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
            ranks = np.fromiter((p.rank for p in plan.pieces), dtype=np.int64, count=len(plan.pieces))
            by_rank = np.argsort(ranks, kind="stable")  # each rank's pieces' places, in plan order
            ends = np.cumsum(np.bincount(ranks, minlength=plan.world_size))
            crc = np.zeros(len(plan.pieces), dtype=np.uint32)  # in plan order: the layout's (the index's) order
            has_crc = True
            for r, n in done.items():
                path = os.path.join(vdir, n)
                counters.fs("open", "persistent.finalize.marker")
                try:
                    marker = bounded_loads(_read_regular(path, _MAX_MARKER_BYTES), path, max_bytes=_MAX_MARKER_BYTES)
                except (ValueError, TypeError, UnicodeDecodeError) as e:
                    raise CorruptCheckpointError(f"{path}: damaged done marker ({e})") from e
                ok = (isinstance(marker, dict) and marker.get("rank") == r and marker.get("run") == run
                      and marker.get("nonce") == nonce)
                if not ok:
                    raise CorruptCheckpointError(f"{path}: done marker of another run, nonce or rank")
                mine = by_rank[(ends[r - 1] if r else 0):ends[r]]
                got = fmt.decode_crcs(marker.get("crc32"), len(mine))
                if got is None:
                    raise CorruptCheckpointError(f"{path}: damaged done marker (not the CRCs of rank {r}'s "
                                                 f"{len(mine)} pieces)")
                has_crc &= bool(marker.get("has_crc"))
                crc[mine] = got
            assembled = os.path.join(vdir, ASSEMBLED)
            counters.fs("stat", "persistent.finalize.assembled")
            if not os.path.lexists(assembled):
                crcs = crc.tolist() if has_crc else [0] * len(layout)
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
            self.remember_run(name, version, final)   # retention's next look reads none of it back
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
