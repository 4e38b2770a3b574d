"""Standalone use of the memory tier for any numpy state (no engine, no backend, no TensorFlow).

::

    from deepfreeze.memtier import device, api
    dev = device.create("/dev/shm/tier", "8G")          # once (or device.open)
    model = api.register(dev, "mystate", arrays)        # layout once: MemtierFullError if too big
    api.checkpoint(model, arrays, step=1)               # one copy into a slot, CRC while copying
    state, version = api.restore(dev, "mystate")        # newest restorable version, bit-exact
    model.close()                                       # finished: repack may compact it

A standalone model is one shard of a world-1 :class:`~deepfreeze.shardplan.ShardPlan`; every
version is a real shard image (``format.py``, kind shard, rank 0, world 1) and a manifest that
``format.decode_manifest`` accepts, in a slot written with the commit protocol of
:mod:`deepfreeze.memtier.device`. :func:`restore` reads standalone models and whole engine models
(every rank's region on this device) alike.

**Jobs.** A standalone model belongs to the job ``job=`` names at :func:`register` (an id of 32
hex digits), and :func:`restore` / :func:`select` consider only the regions of the job they
are given, matched on that id; without ``job`` a model is of *unknown job*, and only models of
unknown job are restored without ``job``. So two programs that may use one name on one device
each keep their job id, e.g. in a file beside their data: :func:`job_id` (``job_id(path)``
reads the id kept in the file ``path``, or creates it there race-free on first use: the same
rule as a checkpoint name's ``<persistent>/<name>/job``). An engine model is of the job in
its persistent directory, so ``restore(dev, name, job=deepfreeze.lease.read_job_id(persistent,
name))`` reads it. Regions of the name left out for being of another job are named once in a
log line.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import numpy as np

from .. import format as fmt
from ..format import build_manifest
from ..node import host_name
from ..errors import CheckpointNotFoundError, MemtierCorruptError, MemtierError
from ..lease import RunInfo, Version, job_id_at, new_run_id, valid_job_id
from ..shardplan import ShardPlan, TensorSpec
from . import device as mdev
from . import jobs
from . import layout as mlayout
from . import slot as mslot
from .copy import LocalCopier

__all__ = ["register", "checkpoint", "restore", "view", "Model", "select", "assemble", "job_id"]

log = logging.getLogger("deepfreeze")


def job_id(path: str) -> str:
    """The job id kept in the file ``path`` (e.g. ``~/myjob/memtier.job``), created there now
    (32 random hex digits, written whole under a temporary name, then linked into place) when
    there is none: what a standalone program passes as ``job=`` to :func:`register` and
    :func:`restore` so that it never restores another program's model of the same name."""
    return job_id_at(path)


def _check_job(job: Any) -> None:
    if job is not None and not valid_job_id(job):
        raise ValueError(f"job {job!r} is not a job id (32 lowercase hex digits, e.g. memtier.job_id(path))")


def _device(dev: "mdev.Device | str", writable: bool) -> tuple[mdev.Device, bool]:
    if isinstance(dev, mdev.Device):
        return dev, False
    return mdev.open(dev, writable=writable), True


def _specs(arrays: "Mapping[str, np.ndarray] | Sequence[tuple[str, Any, Sequence[int]]]") -> list[TensorSpec]:
    if isinstance(arrays, Mapping):
        items = [(n, a.dtype, a.shape) for n, a in arrays.items()]
    else:
        items = [(n, d, s) for n, d, s in arrays]
    specs = []
    for i, (n, d, s) in enumerate(items):
        if not isinstance(n, str) or not n:
            raise ValueError(f"tensor {i}: the name must be a non-empty string, got {n!r}")
        specs.append(TensorSpec(i, n, fmt.dtype_name(d), tuple(int(x) for x in s)))
    if len({s.name for s in specs}) != len(specs):
        raise ValueError("tensor names must be unique")
    return specs


class Model:
    """A standalone model registered on a device (see :func:`register`). Context manager:
    leaving it calls :meth:`close`."""

    def __init__(self, device: mdev.Device, region: mslot.ShardRegion, plan: ShardPlan, owns_device: bool) -> None:
        self.device, self.region, self.plan = device, region, plan
        self.name, self.run, self.job = region.name, region.run, region.job
        self._owns = owns_device
        self.closed = False

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return self.plan.tensors

    def checkpoint(self, arrays: "Mapping[str, np.ndarray] | Sequence[np.ndarray]", step: int, *,
                   generation: int = 0) -> Version:
        """:func:`checkpoint` of this model."""
        return checkpoint(self, arrays, step, generation=generation)

    def close(self) -> None:
        """Mark the model finished (it stays restorable; ``repack`` may compact it to its newest
        version) and close the device if :func:`register` opened it."""
        if self.closed:
            return
        self.closed = True
        try:
            self.device.finish(self.region)
        finally:
            if self._owns:
                self.device.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Model({self.name!r}, run={self.run}, tensors={len(self.plan.tensors)})"


def register(device: "mdev.Device | str", name: str,
             arrays: "Mapping[str, np.ndarray] | Sequence[tuple[str, Any, Sequence[int]]]", *,
             slots: int = 2, job: str | None = None) -> Model:
    """Register a model made of ``arrays`` (name -> array, or (name, dtype, shape) triples, in
    order) on ``device`` (a :class:`~deepfreeze.memtier.device.Device` or a path): a new run id,
    a world-1 shard plan, its index and ``slots`` (>= 2) slots laid out and pre-faulted now.
    ``job``: the id of the job it belongs to (:func:`job_id`; None: unknown job, see the module
    docstring). Raises :class:`~deepfreeze.errors.MemtierFullError` when the device has no room."""
    _check_job(job)
    if slots < 2:
        raise ValueError(f"a model needs at least 2 slots (a new version never overwrites the newest), got {slots}")
    specs = _specs(arrays)
    plan = ShardPlan.build(specs, 1)
    run = new_run_id()
    index = mlayout.make_index(plan, 0, name, run, standalone=True, owner=mdev.owner_record(), job=job)
    dev, owns = _device(device, True)
    try:
        region = dev.register_shard(name, run, 0, 1, index=index, image_size=index["file_size"],
                                    meta_cap=mlayout.manifest_capacity(len(specs), fmt.plan_items(plan.to_json()), 1), nslots=slots)
    except BaseException:
        if owns:
            dev.close()
        raise
    return Model(dev, region, plan, owns)


def _manifest(name: str, version: Version, step: int, plan: ShardPlan, run: RunInfo) -> dict[str, Any]:
    return build_manifest(name, version.step, step, 0, plan, [host_name()], {"memtier": True}, run=run)


def checkpoint(model: Model, arrays: "Mapping[str, np.ndarray] | Sequence[np.ndarray]", step: int, *,
               generation: int = 0) -> Version:
    """Write ``arrays`` (same names, dtypes and shapes as registered) as version
    ``Version(generation, step)`` into a free slot of ``model``: header ACTIVE, one copy per array
    into the slot image (CRC32 while copying), image header and manifest, header DONE. Versions
    must grow (the newest restorable one is never overwritten). Returns the version."""
    if model.closed:
        raise MemtierError(f"model {model.name!r} is closed")
    if not (type(step) is int and 0 <= step < 1 << 62 and type(generation) is int and 0 <= generation < 1 << 62):
        raise ValueError("step and generation must be integers in [0, 2**62)")
    specs = model.plan.tensors
    if isinstance(arrays, Mapping):
        missing = [s.name for s in specs if s.name not in arrays]
        extra = [n for n in arrays if n not in {s.name for s in specs}]
        if missing or extra:
            raise ValueError(f"arrays do not match model {model.name!r}: missing {missing[:5]}, unknown {extra[:5]}")
        arrs = [arrays[s.name] for s in specs]
    else:
        arrs = list(arrays)
        if len(arrs) != len(specs):
            raise ValueError(f"{len(arrs)} arrays for the {len(specs)} tensors of model {model.name!r}")
    flat = []
    for s, a in zip(specs, arrs):
        a = np.asarray(a)
        if fmt.dtype_name(a.dtype) != s.dtype or tuple(a.shape) != s.shape:
            raise ValueError(f"tensor {s.name!r}: got {a.dtype}{list(a.shape)}, registered {s.dtype}{list(s.shape)}")
        flat.append(np.ascontiguousarray(a))  # referenced until the copy is done
    version = Version(generation, step)
    region = model.region
    newest = region.newest(verify=False)
    if newest is not None and version <= newest[1].version:
        raise ValueError(f"version {version} of {model.name!r} is not newer than {newest[1].version}, already "
                         "on the device: checkpoint with a larger step (or generation)")
    k = region.choose_slot()
    if k is None:  # pragma: no cover - with >= 2 slots and no flushes there is always one
        raise MemtierError(f"no free slot in {model.name!r}")
    entries = region.entries
    region.put(k, version, LocalCopier(), [(int(a.ctypes.data), e.length) for a, e in zip(flat, entries)],
               _manifest(model.name, version, step, model.plan, RunInfo(model.run, generation)),
               dest_offsets=[e.offset - region.data_offset for e in entries])
    del flat
    return version


# --------------------------------------------------------------------------- restore

_ANY = object()


def select(dev: mdev.Device, name: str, job: "str | None | object" = _ANY, *, quiet: bool = False
           ) -> tuple[list[tuple[Version, float, dict[int, tuple[mslot.ShardRegion, int]]]], list[str]]:
    """Candidate versions of ``name`` on ``dev``, newest first: (version, written time, rank ->
    (region, slot)) for every version that has a DONE slot (valid header) on every rank of its
    run; and notes on runs whose ranks are not all on this device. With ``job`` (an id, or None
    for unknown job) only that job's regions are considered; the others are noted (and logged
    once unless ``quiet``); without it, every job's (the tools: ``dump``)."""
    regions = dev.find(name)
    notes: list[str] = []
    if job is not _ANY:
        regions, ignored = jobs.for_job(regions, job)  # type: ignore[arg-type]
        if not quiet:
            jobs.say_ignored(dev.path, name, job, ignored)  # type: ignore[arg-type]
        notes += [f"ignored {x}" for x in ignored]
    by_run: dict[str, list[mslot.ShardRegion]] = {}
    for r in regions:
        by_run.setdefault(r.run, []).append(r)
    out = []
    for run, regions in by_run.items():
        world = regions[0].world_size
        ranks = {r.rank: r for r in regions if r.world_size == world}
        missing = sorted(set(range(world)) - set(ranks))
        if missing:
            notes.append(f"run {run}: ranks {_ranges(missing)} of {world} are not on this device")
            continue
        per_rank = [{h.version: (k, h.written) for k, h in reversed(ranks[i].restorable())} for i in range(world)]
        common = set(per_rank[0]).intersection(*per_rank[1:])
        for v in common:
            written = max(p[v][1] for p in per_rank)
            out.append((v, written, {i: (ranks[i], per_rank[i][v][0]) for i in range(world)}))
    out.sort(key=lambda c: (c[0], c[1]), reverse=True)
    return out, notes


def _ranges(xs: list[int]) -> str:
    parts, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)


def assemble(slots: Mapping[int, tuple[mslot.ShardRegion, int]], out: "dict[str, np.ndarray] | None" = None, *,
             verify: bool = True) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    """Copy the tensors of one version from its slots (rank -> (region, slot)) into ``out``
    (arrays filled in place; missing ones allocated): one copy per piece from the slot. With
    ``verify`` (restore): the slot headers must be DONE and unchanged after the copy (seqlock),
    the image headers valid, every piece's CRC is checked on the copied bytes, and the manifest is
    returned; :class:`MemtierCorruptError` otherwise. Without (a forced dump): the registered
    layout is read as it is, nothing checked, manifest None."""
    out = {} if out is None else out
    r0 = slots[0][0]
    manifest = None
    heads = {}
    if verify:
        for rank, (r, k) in slots.items():
            h = r.slot_header(k)
            if h is None or h.state != mlayout.SlotState.DONE:
                raise MemtierCorruptError(f"{r.name!r} rank {rank} slot {k} is no longer DONE")
            heads[rank] = h
        manifest = r0.manifest(slots[0][1], heads[0])
        tensors = {t["id"]: (t["name"], t["dtype"], tuple(t["shape"])) for t in manifest["tensors"]}
    else:
        tensors = {}
        for r, _ in slots.values():
            for t in r.index["tensors"]:
                tensors.setdefault(t["tensor_id"], (t["name"], t["dtype"], tuple(t["shape"])))
    arrays: dict[int, np.ndarray] = {}
    for tid, (n, d, shape) in tensors.items():
        dtype = fmt.numpy_dtype(d)
        a = out.get(n)
        if a is None:
            a = out[n] = np.empty(shape, dtype=dtype)
        elif a.dtype != dtype or tuple(a.shape) != shape or not a.flags.c_contiguous or not a.flags.writeable:
            raise ValueError(f"out[{n!r}] is {a.dtype}{list(a.shape)} (contiguous and writable needed), the "
                             f"checkpoint holds {d}{list(shape)}")
        arrays[tid] = a
    covered = {tid: 0 for tid in tensors}
    for rank, (r, k) in sorted(slots.items()):
        image = r.image(k)
        if verify:
            si = r.check_image(image, heads[rank], verify_data=False)
            entries = si.entries
        else:
            entries = tuple(r.entries)
        for e, t in zip(entries, r.index["tensors"]):
            if e.tensor_id not in arrays or tensors[e.tensor_id][0] != t["name"] or \
                    tensors[e.tensor_id][2] != e.shape or tensors[e.tensor_id][1] != e.dtype:
                raise MemtierCorruptError(f"{r.name!r} rank {rank}: piece of {t['name']!r} does not match the "
                                          "model's tensor list")
            dst = arrays[e.tensor_id].reshape(-1)[e.start:e.stop].view(np.uint8)
            dst[:] = np.frombuffer(image[e.offset:e.offset + e.length], dtype=np.uint8)
            covered[e.tensor_id] += e.stop - e.start
            if verify and fmt.crc32(dst) != e.crc:
                raise MemtierCorruptError(f"{r.name!r} rank {rank} slot {k}: checksum mismatch in {t['name']!r} "
                                          f"elements [{e.start},{e.stop})")
        image.release()
        if verify and r.raw_header(k) != heads[rank].raw:
            raise MemtierCorruptError(f"{r.name!r} rank {rank} slot {k} was rewritten while it was read")
    short = [tensors[t][0] for t, n in covered.items() if n != arrays[t].size]
    if short:
        raise MemtierCorruptError(f"the pieces do not cover tensors {short[:5]}")
    return {tensors[t][0]: arrays[t] for t in sorted(tensors)}, manifest


def restore(device: "mdev.Device | str", name: str, *, out: "dict[str, np.ndarray] | None" = None,
            version: "Version | int | None" = None, job: str | None = None) -> tuple[dict[str, np.ndarray], Version]:
    """The newest restorable version of ``name`` of job ``job`` on ``device`` (or ``version``: a
    :class:`~deepfreeze.lease.Version` or a version number), as name -> array in model order, and
    its version. A standalone model or a whole engine model (every rank's region on this
    device) alike. Only regions recorded with ``job`` are considered (None: only those of unknown
    job; see the module docstring); the others are named once in a log line. ``out`` (name ->
    array) is filled in place. A damaged or concurrently rewritten slot is skipped for the next
    older version (log line). Raises :class:`~deepfreeze.errors.CheckpointNotFoundError` when
    nothing matching is restorable."""
    _check_job(job)
    dev, owns = _device(device, False)
    try:
        cands, notes = select(dev, name, job)
        if version is not None:
            cands = [c for c in cands if (c[0] == version if isinstance(version, Version) else c[0].step == version)]
        problems = []
        for v, _, slots in cands:
            try:
                arrays, _ = assemble(slots, out, verify=True)
                return arrays, v
            except MemtierCorruptError as e:
                log.warning("deepfreeze memtier: %s %s on %s is not restorable (%s): trying an older version",
                            name, v, dev.path, e)
                problems.append(f"{v}: {e}")
        what = f"version {version}" if version is not None else "a restorable version"
        raise CheckpointNotFoundError(
            f"{dev.path} holds no {what} of {name!r} of job {jobs.job_text(job)}"
            + (f" ({'; '.join((notes + problems)[:4])})" if notes or problems else "")
            + ": see 'deepfreeze memtier view'")
    finally:
        if owns:
            dev.close()


def view(path: str) -> dict[str, Any]:
    """:func:`deepfreeze.memtier.device.view`: the device's models, shards, slots and free space."""
    return mdev.view(path)
