"""The memory tier as a tier of the write path: a rank's shard in a slot of the device.

With ``memtier = PATH`` (built-in engine only; :func:`deepfreeze.tiers.choose`) a version's shard
goes to a slot of the node's device (:mod:`deepfreeze.memtier`) instead of a scratch file.
:class:`MemtierTier` registers the rank's shard on the device when the engine starts
(:meth:`MemtierTier.register`), lays a version's buffers out as the slot's regions and copies
them in this process when the backend may not (:meth:`MemtierTier.local_put`), and retires the
regions of earlier runs of the job once this run has a DONE version. A flush reads the slot
through :class:`SlotSource` (``job["memtier"]``) with :func:`_open_source`, which opens either a
scratch shard file or such a slot. The backend's copy of a rank's memory into a slot is
:func:`backend_put`. For readers, :data:`level` is :mod:`deepfreeze.memtier.level` (the tier as
a restore level); no module outside this package and the command line imports
:mod:`deepfreeze.memtier`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import time
from typing import Any, Iterator, Sequence

import numpy as np

from .. import format as fmt
from ..config import Config
from ..errors import CheckpointWriteError, CorruptCheckpointError, MemtierError, MemtierFullError
from ..format import ANONYMOUS_RUN
from ..fsafe import open_regular
from ..fused import FusedLayout, FusedShard
from ..lease import RunInfo, Version
from ..shardplan import ShardPlan
from .shardbytes import _FdFile

__all__ = ["SlotSource", "MemtierTier"]

log = logging.getLogger("deepfreeze")


@dataclasses.dataclass(frozen=True)
class SlotSource:
    """A flush job's memory-tier source (``job["memtier"]``): slot ``slot`` of the model-table entry
    ``entry`` of the device file ``device``, holding version ``version`` of run ``run``, rank ``rank``.
    As a job dict: ``{"device": path, "entry": int, "slot": int, "version": int, "run": hex16,
    "rank": int}``."""

    device: str
    entry: int
    slot: int
    version: int
    run: str
    rank: int

    @classmethod
    def from_job(cls, spec: Any, name: str, version: int, rank: int, run: str) -> "SlotSource":
        """Validate ``job["memtier"]`` against the job's own name/version/rank/run (a job is JSON that
        crossed a socket: every field is checked, nothing trusted)."""
        ok = isinstance(spec, dict) and isinstance(spec.get("device"), str) and os.path.isabs(spec["device"]) \
            and all(isinstance(spec.get(k), int) and not isinstance(spec.get(k), bool) and spec[k] >= 0
                    for k in ("entry", "slot", "version", "rank")) and isinstance(spec.get("run"), str)
        if not ok or spec["version"] != version or spec["rank"] != rank or spec["run"] != run:
            raise CheckpointWriteError(errno.EINVAL, f"flush job of {name!r} v{version} rank {rank}: malformed "
                                       f"memory-tier source {str(spec)[:300]} (expected device, entry, slot, version, "
                                       "run, rank matching the job)")
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


@contextlib.contextmanager
def _open_source(shard_path: str | None, source: SlotSource | None
                 ) -> Iterator[tuple[int, int, fmt.ShardIndex, str, Any]]:
    """Open a flush's shard: ``(fd, base, index, label, recheck)``: the shard's bytes start at
    ``base`` of ``fd``; ``recheck()`` raises if the source changed since it was opened (a no-op for a
    scratch file, which is never rewritten: a new version is a new file)."""
    if source is None:
        fd = open_regular(shard_path)
        try:
            yield fd, 0, fmt.read_index(_FdFile(fd), shard_path), shard_path, (lambda: None)
        finally:
            os.close(fd)
        return
    from ..memtier import device as mdev
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


class MemtierTier:
    """This rank's shard on the node's memory-tier device: its region (:meth:`register`), the
    regions of a version's buffers (:meth:`regions`), the in-process copy (:meth:`local_put`), the
    reclaim of earlier runs of the job (:meth:`after_put`). The engine's writer hands a version to
    the backend's copy (``memtier_put``) or calls :meth:`local_put`; the flush job then carries
    :meth:`source`."""

    def __init__(self, config: Config, name: str, rank: int, plan: ShardPlan, run: RunInfo, device: Any,
                 region: Any, layout: FusedLayout, job: str | None) -> None:
        self.config, self.name, self.rank, self.plan, self.run = config, name, rank, plan, run
        self.device, self.region, self.layout = device, region, layout
        self.reclaimed = job is None  # earlier runs of this job: reclaimed after this run's first DONE version
        self._zeros = np.zeros(fmt.DATA_ALIGN, np.uint8)  # the padding between flat pieces is read from here

    @classmethod
    def register(cls, config: Config, name: str, rank: int, plan: ShardPlan, run: RunInfo) -> "MemtierTier":
        """Register this rank's shard on the device (or find its registration by this run) and
        keep the region (:func:`deepfreeze.tiers.choose` checked the engine and the device path);
        MemtierFullError when it does not fit (before training starts)."""
        cfg = config
        from ..memtier import device as mdev
        layout = FusedLayout.build(plan, rank)
        job = run.job
        if job is None and run.id == ANONYMOUS_RUN:  # an engine built without a Run: the name's job, if any
            from ..lease import read_job_id
            job = read_job_id(cfg.persistent, name)
        # the region records its job: restore, ls and resume of another job sharing the name never read it
        index = mdev.make_index(plan, rank, name, run.id,
                                lease={"persistent": cfg.persistent, "timeout": cfg.lease_timeout}, job=job)
        dev = mdev.open(cfg.memtier)
        meta_cap = mdev.manifest_capacity(len(plan.tensors), fmt.plan_items(plan.to_json()), plan.world_size)
        try:  # an engine rebuilt within the same run (a second fit) gets its region again
            try:
                region = dev.register_shard(name, run.id, rank, plan.world_size, index=index,
                                            image_size=layout.file_size, meta_cap=meta_cap, nslots=cfg.memtier_slots)
            except MemtierFullError:
                # as Portus's repacking tool runs when free memory is low: compact away finished jobs'
                # models (never a live run's, never the only valid version), then try once more; still
                # no room: finished models are evicted (every job's newest version last), never a live one
                freed = dev.repack(live=mdev.default_live)
                log.warning("deepfreeze: memory tier %s full: repacked finished models (%d bytes freed)",
                            cfg.memtier, freed.get("freed_bytes", 0))
                region = dev.register_shard(name, run.id, rank, plan.world_size, index=index,
                                            image_size=layout.file_size, meta_cap=meta_cap, nslots=cfg.memtier_slots,
                                            make_room=mdev.default_live)
        except BaseException:
            dev.close()
            raise
        return cls(config, name, rank, plan, run, dev, region, layout, job)

    def regions(self, arrays: "Sequence[np.ndarray] | FusedShard") -> tuple[list[tuple[int, int]], list]:
        """``(regions, keep)``: the (address, length) pairs whose concatenation is the shard image's
        data region, and the arrays they point into (held by the caller until the copy is done)."""
        layout = self.layout
        if isinstance(arrays, FusedShard):
            if not (arrays.layout.rank == self.rank and (arrays.layout.plan is self.plan
                                                         or arrays.layout.plan == self.plan)):
                raise ValueError(f"the fused shard is rank {arrays.layout.rank}'s of another shard plan than this "
                                 f"engine's (rank {self.rank}): build it with FusedLayout.build(plan, rank)")
            data = arrays.data
            return [(_address(data), data.nbytes)], [arrays, data]
        pieces = self.plan.for_rank(self.rank)
        if len(arrays) != len(pieces):
            raise ValueError(f"rank {self.rank} holds {len(pieces)} pieces, got {len(arrays)} arrays")
        regions, keep, pos = [], [], layout.data_offset
        zero = _address(self._zeros)
        for p, e, a in zip(pieces, layout.entries, arrays):
            if a.size != p.count or fmt.dtype_name(a.dtype) != e.dtype:
                raise ValueError(f"array for tensor {self.plan.tensors[p.tensor_id].name!r} piece [{p.start},"
                                 f"{p.stop}) has {a.size} {a.dtype} elements")
            a = np.ascontiguousarray(a)
            keep.append(a)
            if e.offset > pos:
                regions.append((zero, e.offset - pos))  # < PIECE_ALIGN bytes
            if e.length:
                regions.append((_address(a), e.length))
            pos = e.offset + e.length
        return regions, keep

    def local_put(self, slot: int, version: int, regions: list[tuple[int, int]],
                  manifest: dict[str, Any]) -> dict[str, Any]:
        """Copy the regions into ``slot`` from this process (sync mode, or the backend may not read
        our memory): the same slot protocol as the backend's copy."""
        from ..memtier.copy import LocalCopier
        c0 = time.perf_counter()
        stats = self.region.put(slot, Version(self.run.generation, version), LocalCopier(), regions, manifest)
        return {"slot": slot, "bytes": stats.bytes, "calls": stats.calls, "copy_s": time.perf_counter() - c0}

    def source(self, slot: int, version: int) -> SlotSource:
        """The flush job's source of ``version`` in ``slot``; the first one of this run also retires
        the regions of earlier runs of its job (:meth:`reclaim`)."""
        if not self.reclaimed:
            self.reclaimed = True
            self.reclaim()
        return SlotSource(self.config.memtier, self.region.entry_no, slot, version, self.run.id, self.rank)

    def reclaim(self) -> None:
        """This run has a DONE version in the tier: retire the regions of earlier runs of its job
        (same job id) there (issue 24: a past run no longer keeps a stale version). Best effort: a
        busy device lock is left for the next restart or repack (log line)."""
        from ..memtier import device as mdev
        try:
            got = self.device.reclaim(self.name, self.region.job, live=mdev.default_live)
            if got["retired"]:
                log.info("deepfreeze: memory tier %s: %d region(s) of earlier runs of %r reclaimed (%d bytes)",
                         self.config.memtier, got["retired"], self.name, got["freed_bytes"])
        except (MemtierError, OSError) as e:
            log.warning("deepfreeze: memory tier %s: could not reclaim earlier runs of %r (%s): 'deepfreeze memtier "
                        "repack' does it later", self.config.memtier, self.name, e)

    @staticmethod
    def allow_reader(pid: int) -> None:
        """Allow process ``pid`` (the backend) to read this process's memory (Yama ``ptrace_scope = 1``)."""
        from ..memtier.copy import allow_ptracer
        allow_ptracer(pid)

    def close(self) -> None:
        self.region = None
        self.device.close()


def _address(a: np.ndarray) -> int:
    """Address of a contiguous array's first byte in this process."""
    return int(a.__array_interface__["data"][0])
