"""The memory tier as a tier of the write path: a rank's shard in a slot of the device.

With ``memtier = PATH`` (built-in engine only; :func:`deepfreeze.tiers.choose`) a version's shard
goes to a slot of the node's device (:mod:`deepfreeze.memtier`) instead of a scratch file.
:class:`MemtierTier` registers the rank's shard on the device when the engine starts
(:meth:`MemtierTier.register`), lays a version's buffers out as the slot's regions and copies
them in this process when the backend may not (:meth:`MemtierTier.local_put`), and retires the
regions of earlier runs of the job once this run has a DONE version. A flush reads the slot
through :class:`SlotSource` (the ``memtier`` source kind of :mod:`deepfreeze.tiers.job`'s table,
registered here with its opener). The backend opens devices and copies a rank's memory into a
slot through :func:`open_device` and :func:`remote_copier`. No module outside this package and the
command line imports :mod:`deepfreeze.memtier`.

**The memory tier as a restore level** (:class:`MemtierLevel`): what a node's device holds of a
checkpoint name, in the shape :meth:`deepfreeze.tiers.scratch.ScratchLevel.committed` gives, so
:func:`deepfreeze.loader.load` pools it across nodes, checks run identity and falls back
exactly as it does for scratch files.

A slot's payload is a format.py shard image, so an item of the inventory is not a path but a
*memtier address* ``memtier:<device>#<entry>:<slot>:<run>:<step>``: :func:`read_item` copies
that slot's image out (re-checking after the copy that the slot was not rewritten meanwhile)
and the caller checks its index and CRCs as it does for a shard file.

Only regions of the reader's *job* are considered (:attr:`MemtierLevel.job`, the id kept in
``<persistent>/<name>/job``, :func:`deepfreeze.lease.read_job_id`; matched on the id each region's
MIndex records, never on paths): two jobs that share a checkpoint name on one device never see
each other's versions, a region written before job ids ("job unknown") is never restored into a
job that has an id, and the regions left out are named once in a log line
(:func:`deepfreeze.memtier.device.say_ignored`).

Only DONE slots whose header checksum holds are listed (an ACTIVE slot is never trusted); of
one version, the slots of one run are used (a version with slots of two runs keeps the one
whose manifest a caller agrees on: the run of the first region found, with a log line).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import threading
import time
from typing import Any, ClassVar, Iterator, Sequence

import numpy as np

from .. import format as fmt
from ..config import Config
from ..errors import CheckpointWriteError, CorruptCheckpointError, DeepFreezeError, MemtierError, MemtierFullError
from ..format import ANONYMOUS_RUN
from ..fused import FusedLayout, FusedShard
from ..lease import RunInfo, Version
from ..shardplan import ShardPlan
from ..memtier import device as _device
from ..memtier import layout as mlayout
from ..memtier import jobs as _jobs
from .job import FlushJob, register as register_source

__all__ = ["SlotSource", "MemtierTier", "open_device", "remote_copier", "committed", "merge", "PREFIX", "MemtierLevel",
           "job_of", "is_item", "read_item", "region_address", "reading", "forget", "changed"]

log = logging.getLogger("deepfreeze")


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


@contextlib.contextmanager
def _open_source(shard_path: str | None, source: SlotSource
               ) -> Iterator[tuple[int, int, fmt.ShardIndex, str, Any]]:
    """The ``memtier`` source kind's opener (:mod:`deepfreeze.tiers.job`'s table): the image in a
    DONE slot of the device, as ``(fd, base, index, label, recheck)``."""
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


# the memory tier's source kind (deepfreeze.tiers.job's table)
register_source(SlotSource.kind, open=_open_source, decode=SlotSource.from_job, encode=SlotSource.to_job,
                scratch_files=False)


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
        index = mlayout.make_index(plan, rank, name, run.id,
                                lease={"persistent": cfg.persistent, "timeout": cfg.lease_timeout}, job=job)
        dev = mdev.open(cfg.memtier)
        meta_cap = mlayout.manifest_capacity(len(plan.tensors), fmt.plan_items(plan.to_json()), plan.world_size)
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
            return [(_buffer_address(data), data.nbytes)], [arrays, data]
        pieces = self.plan.for_rank(self.rank)
        if len(arrays) != len(pieces):
            raise ValueError(f"rank {self.rank} holds {len(pieces)} pieces, got {len(arrays)} arrays")
        regions, keep, pos = [], [], layout.data_offset
        zero = _buffer_address(self._zeros)
        for p, e, a in zip(pieces, layout.entries, arrays):
            if a.size != p.count or fmt.dtype_name(a.dtype) != e.dtype:
                raise ValueError(f"array for tensor {self.plan.tensors[p.tensor_id].name!r} piece [{p.start},"
                                 f"{p.stop}) has {a.size} {a.dtype} elements")
            a = np.ascontiguousarray(a)
            keep.append(a)
            if e.offset > pos:
                regions.append((zero, e.offset - pos))  # < PIECE_ALIGN bytes
            if e.length:
                regions.append((_buffer_address(a), e.length))
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


def _buffer_address(a: np.ndarray) -> int:
    """Address of a contiguous array's first byte in this process."""
    return int(a.__array_interface__["data"][0])


def open_device(path: str, *, writable: bool = True) -> Any:
    """The memory-tier device file at ``path`` (:func:`deepfreeze.memtier.device.open`)."""
    return _device.open(path, writable=writable)


def remote_copier(pid: int) -> Any:
    """The backend's copier of process ``pid``'s memory into a slot (``process_vm_readv``)."""
    from ..memtier.copy import VmReadvCopier
    return VmReadvCopier(pid)


# ----------------------------------------------------------------- the memory tier as a restore level


PREFIX = "memtier:"


def is_item(path: str) -> bool:
    """Is ``path`` a memtier address (an inventory item of :class:`MemtierLevel`)?"""
    return isinstance(path, str) and path.startswith(PREFIX)


def _address(device: str, entry: int, slot: int, run: str, step: int) -> str:
    return f"{PREFIX}{os.path.abspath(device)}#{entry}:{slot}:{run}:{step}"


def region_address(device: str, region: Any, slot: int, run: str, step: int) -> str:
    """The memtier address of ``slot`` of ``region`` (a ShardRegion of the device at ``device``)."""
    return _address(device, region.entry_no, slot, run, step)


def _parse(item: str) -> tuple[str, int, int, str, int]:
    try:
        device, rest = item[len(PREFIX):].rsplit("#", 1)
        entry, slot, run, step = rest.split(":")
        return device, int(entry), int(slot), run, int(step)
    except ValueError as e:
        raise CorruptCheckpointError(f"{item!r} is not a memory-tier address") from e


_NO_JOB = object()


def job_of(persistent: str, name: str) -> "str | None | object":
    """The job id of ``name`` in ``persistent`` (None: no run made one yet), or a marker meaning
    "unreadable" (a damaged ``job`` file: logged; then no region of the device matches)."""
    from ..lease import read_job_id
    try:
        return read_job_id(persistent, name)
    except (OSError, DeepFreezeError) as e:
        log.warning("deepfreeze: the job id of %r is unreadable (%s): the memory tier is not read for it", name, e)
        return _NO_JOB


class MemtierLevel:
    """The memory-tier device at ``path`` (the INI key ``memtier``), read-only, as seen by job
    ``job`` (its id; None: a reader without one, which sees only regions of unknown job)."""

    level = "memtier"

    def __init__(self, path: str, job: "str | None | object") -> None:
        self.path = os.path.abspath(path)
        self.job = job
        #: notes on the regions of the last :meth:`slots` call's name that were not of this job
        self.ignored: list[str] = []

    def regions(self, dev: "_device.Device", name: str, *, quiet: bool = False) -> list[Any]:
        """The valid regions of ``name`` on ``dev`` that belong to this job; the others are noted
        in :attr:`ignored` and (unless ``quiet``) logged once."""
        regions = dev.find(name)
        if self.job is _NO_JOB:
            mine: list[Any] = []
            self.ignored = [f"run {r.run} rank {r.rank}: this job's id is unreadable" for r in regions]
        else:
            mine, self.ignored = _jobs.for_job(regions, self.job)  # type: ignore[arg-type]
        if not quiet:
            _jobs.say_ignored(self.path, name, None if self.job is _NO_JOB else self.job, self.ignored)  # type: ignore[arg-type]
        return mine

    def _open(self) -> "_device.Device | None":
        try:
            return _device.open(self.path, writable=False)
        except FileNotFoundError:
            return None
        except (OSError, DeepFreezeError, ValueError) as e:
            log.warning("deepfreeze: the memory tier %s is unusable (%s): not reading it", self.path, e)
            return None

    def slots(self, name: str, generation: int | None = None, *,
              quiet: bool = False) -> list[tuple[Any, int, Any, dict[str, Any]]]:
        """(region, slot, header, manifest) of every DONE slot of ``name`` of this job whose header
        and manifest read fine (of ``generation``, when given)."""
        self.ignored = []
        dev = self._open()
        if dev is None:
            return []
        out = []
        try:
            for region in self.regions(dev, name, quiet=quiet):
                for k in range(region.nslots):
                    h = region.slot_header(k)
                    if h is None or h.state != mlayout.SlotState.DONE:
                        continue
                    if generation is not None and h.version.generation != generation:
                        continue
                    try:
                        m = region.manifest(k, h)
                    except (OSError, DeepFreezeError, ValueError) as e:
                        log.warning("deepfreeze: %s slot %d of %s rank %d: manifest unreadable (%s)",
                                    self.path, k, name, region.rank, e)
                        continue
                    out.append((region, k, h, m))
        finally:
            dev.close()
        return out

    def names(self, job_of_name: "Any" = None) -> list[str]:
        """Checkpoint names with at least one DONE slot on the device; with ``job_of_name`` (name ->
        job id, e.g. :func:`job_of` over a persistent directory) only names with a region of that
        job."""
        dev = self._open()
        if dev is None:
            return []
        try:
            jobs: dict[str, Any] = {}
            out = set()
            for r in dev.shards():
                if not any((h := r.slot_header(k)) is not None and h.state == mlayout.SlotState.DONE
                           for k in range(r.nslots)):
                    continue
                if job_of_name is not None:
                    if r.name not in jobs:
                        jobs[r.name] = job_of_name(r.name)
                    if jobs[r.name] is _NO_JOB or r.job != jobs[r.name]:
                        continue
                out.add(r.name)
            return sorted(out)
        finally:
            dev.close()

    def committed(self, name: str, generation: int | None = None, *, quiet: bool = False
                  ) -> dict[int, tuple[dict[str, Any], dict[str, dict[int, str]]]]:
        """Versions of ``name`` held in DONE slots here -> (manifest, inventory), the inventory
        ``{"shard": {rank: memtier address}, "partner": {}, "parity": {}}``."""
        out: dict[int, tuple[dict[str, Any], dict[str, dict[int, str]]]] = {}
        for region, k, h, m in self.slots(name, generation, quiet=quiet):
            v = h.version.step
            if v not in out:
                out[v] = (m, {"shard": {}, "partner": {}, "parity": {}})
            manifest, inv = out[v]
            if fmt.manifest_run(manifest)[0] != h.run:
                log.warning("deepfreeze: %s v%d in the memory tier %s has slots of runs %s and %s: using %s's",
                            name, v, self.path, fmt.manifest_run(manifest)[0], h.run, fmt.manifest_run(manifest)[0])
                continue
            inv["shard"].setdefault(region.rank, _address(self.path, region.entry_no, k, h.run, v))
        return out


class _Session:
    """The devices one :func:`reading` block maps (read-only, each opened once) and the slots it
    handed out as views, with their headers as read before (the seqlock's first half)."""

    def __init__(self) -> None:
        self.devices: dict[str, Any] = {}
        self.reads: list[tuple[str, Any, int, bytes]] = []

    def device(self, path: str) -> Any:
        dev = self.devices.get(path)
        if dev is None:
            dev = self.devices[path] = _device.open(path, writable=False)
        return dev

    def close(self) -> None:
        for dev in self.devices.values():
            dev.close()  # views still held keep their mapping alive until released
        self.devices.clear()
        self.reads.clear()


_local = threading.local()


@contextlib.contextmanager
def reading() -> Iterator[None]:
    """A block in which :func:`read_item` hands out slot images as read-only *views* of the
    device mapping (no copy) instead of copies; the caller copies what it needs out of them and
    then calls :func:`changed` (the seqlock's second half) before it trusts the copy. Nested
    blocks share the outer one."""
    if getattr(_local, "session", None) is not None:
        yield
        return
    _local.session = _Session()
    try:
        yield
    finally:
        session, _local.session = _local.session, None
        session.close()


def forget() -> None:
    """Start a new attempt: the slots read so far in this :func:`reading` block are not checked again."""
    session = getattr(_local, "session", None)
    if session is not None:
        session.reads.clear()


def changed() -> list[str]:
    """The addresses of the slots handed out as views in this :func:`reading` block (since
    :func:`forget`) whose header changed since they were read: a writer began rewriting them, so
    anything copied out of them may mix two versions (the caller drops it and reads another source)."""
    session = getattr(_local, "session", None)
    if session is None:
        return []
    return [item for item, region, slot, raw in session.reads if region.raw_header(slot) != raw]


def read_item(item: str, version: int, run: str) -> np.ndarray:
    """The shard image a memtier address names, after checking the slot still holds ``version``
    of ``run``: inside :func:`reading`, a read-only view of the mapping (check :func:`changed`
    after copying out of it); outside, a copy checked like a seqlock. The caller checks the
    image's index and CRCs as for a shard file. Raises
    :class:`~deepfreeze.errors.CorruptCheckpointError` (or a MemtierError) otherwise."""
    path, entry, slot, item_run, step = _parse(item)
    if step != version or item_run != run:
        raise CorruptCheckpointError(f"{item}: names v{step} of run {item_run}, expected v{version} of run {run}")
    session = getattr(_local, "session", None)
    dev = session.device(path) if session is not None else _device.open(path, writable=False)
    try:
        region = dev.region(entry)
        if region is None:
            raise CorruptCheckpointError(f"{item}: the device no longer holds that model (repacked)")
        h = region.holding(slot, run, version)
        if h is None:
            raise CorruptCheckpointError(f"{item}: the slot was rewritten since it was listed")
        if session is None:
            return region.read_image(slot, verify=False)
        session.reads.append((item, region, slot, h.raw))
        return np.frombuffer(region.image(slot), dtype=np.uint8)
    finally:
        if session is None:
            dev.close()


def committed(config: Config, name: str, generation: int, *, quiet: bool = False
              ) -> dict[int, tuple[dict[str, Any], dict[str, dict[int, str]]]]:
    """What this node's memory tier (INI ``memtier``) holds of ``name`` *for this job* (the id in
    ``<persistent>/<name>/job``; regions of other jobs, or of unknown job, are ignored with one log
    line), as scratch's ``committed``."""
    path = getattr(config, "memtier", None)
    if not path:
        return {}
    return MemtierLevel(path, job_of(config.persistent, name)).committed(name, generation, quiet=quiet)


def merge(local: dict[int, tuple[dict[str, Any], dict[str, dict[int, str]]]],
          tier: dict[int, tuple[dict[str, Any], dict[str, dict[int, str]]]], name: str) -> None:
    """Add the memory tier's shards to the scratch inventory, the tier's first (restore reads the
    first listed source of a shard). A version whose tier copy is of another run than its scratch
    copy keeps the tier's (the newer timeline wrote the tier last) with a log line."""
    for v, (m, inv) in tier.items():
        if v not in local:
            local[v] = (m, inv)
            continue
        sm, sinv = local[v]
        if fmt.manifest_run(sm)[0] != fmt.manifest_run(m)[0]:
            log.warning("deepfreeze: %s v%d: the memory tier holds run %s's copy, scratch run %s's: using the "
                        "memory tier's", name, v, fmt.manifest_run(m)[0], fmt.manifest_run(sm)[0])
            local[v] = (m, inv)
            continue
        merged = {k: dict(d) for k, d in sinv.items()}
        for r, item in inv["shard"].items():
            merged["shard"][r] = item
        local[v] = (sm, merged)
