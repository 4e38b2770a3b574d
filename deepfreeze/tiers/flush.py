"""One rank's flush of one version to persistent: :func:`flush_job` (the backend's and sync mode's).

The shard is read from where the writer left it, its :class:`~deepfreeze.tiers.job.FlushJob`'s
source kind (:mod:`deepfreeze.tiers.job`'s table, which the tiers register into: a scratch file,
a memory-tier slot, :class:`~deepfreeze.tiers.memtier.SlotSource`, or already in the partial:
write once's record) and copied into persistent by
:meth:`~deepfreeze.tiers.persistent.PersistentLevel.flush_shard` under the commit protocol;
retention of both tiers follows.
"""
from __future__ import annotations

import logging
from typing import Any

from . import direct, memtier, scratch
from .job import FlushJob, source as job_source
from .persistent import FencedError, PersistentLevel
from .scratch import ScratchLevel

__all__ = ["flush_job"]

log = logging.getLogger("deepfreeze")

#: the tiers whose modules register the source kinds a flush reads from (deepfreeze.tiers.job's
#: table): imported here so that every kind is known wherever a flush job is decoded or run
SOURCE_TIERS = (scratch, memtier, direct)


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
