"""The memory tier as a restore level (framework-neutral): what a node's device holds of a
checkpoint name, in the shape :meth:`deepfreeze.levels.ScratchLevel.committed` gives, so
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
import logging
import os
import threading
from typing import Any, Iterator

import numpy as np

from .. import format as fmt
from ..errors import CorruptCheckpointError, DeepFreezeError
from . import device as _device
from . import jobs as _jobs

__all__ = ["PREFIX", "MemtierLevel", "job_of", "is_item", "read_item", "region_address", "reading", "forget", "changed"]

log = logging.getLogger("deepfreeze")

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
                    if h is None or h.state != _device.SlotState.DONE:
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
                if not any((h := r.slot_header(k)) is not None and h.state == _device.SlotState.DONE
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
