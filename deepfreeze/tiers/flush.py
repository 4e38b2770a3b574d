"""One rank's flush of one version to persistent: :func:`flush_job` (the backend's and sync mode's).

The shard is read from where the writer left it (a scratch file, a memory-tier slot:
:class:`~deepfreeze.tiers.memtier.SlotSource`, or already in the partial: write once's record)
and copied into persistent by :meth:`~deepfreeze.tiers.persistent.PersistentLevel.flush_shard`
under the commit protocol; retention of both tiers follows.
"""
from __future__ import annotations

import logging
from typing import Any

from ..format import ANONYMOUS_RUN
from .memtier import SlotSource
from .persistent import FencedError, PersistentLevel
from .scratch import ScratchLevel

__all__ = ["flush_job"]

log = logging.getLogger("deepfreeze")


def flush_job(job: dict[str, Any], scratch_cls: type = ScratchLevel,
              persistent_cls: type = PersistentLevel, critical: Any = None) -> dict[str, Any]:
    """Flush one rank's shard of one version (backend or sync mode). Same code in both modes.
    With ``job["memtier"]`` (:class:`SlotSource`), the shard is read from that memory-tier slot.
    ``critical`` (the backend's): runs the sections under ``commit.lock`` that other nodes wait
    on, the decision and the finalize (:meth:`PersistentLevel.critical`).

    Work of a run that lost the lease on its name is abandoned (logged, result
    ``abandoned``), never an error of the live run."""
    name, version, rank = job["name"], job["version"], job["rank"]
    run = job.get("run") or ANONYMOUS_RUN
    stale = float(job.get("lease_timeout") or 60.0)
    shared = bool(job.get("shared_group", False))
    scratch = scratch_cls(job["scratch"], shared_group=shared)
    persistent = persistent_cls(job["persistent"], shared_group=shared)
    if critical is not None:
        persistent.critical = critical
    result = {"flushed": False, "committed": False, "abandoned": False}
    source = None if job.get("memtier") is None else SlotSource.from_job(job["memtier"], name, version, rank, run)
    try:
        decision = persistent.critical(persistent.decide, name, version, job["persistent_interval"], run,
                                       stale_after=stale)
        if decision is not None and decision["decision"] == "flush":
            result["committed"] = persistent.flush_shard(
                name, version, rank, None if source else scratch.shard_path(name, version, rank), job["manifest"],
                fsync=job.get("fsync", True), decision=decision, stale_after=stale, source=source,
                direct=job.get("direct"))
            result["flushed"] = True
            if result["committed"]:
                persistent._fence(name, run, f"retention of {name!r}")
                persistent.retain(name, job["keep_persistent"])
        elif job["persistent_interval"] >= 0:
            persistent._fence(name, run, f"retention of {name!r}")  # a run without the lease removes nothing
            persistent.retain(name, job["keep_persistent"])  # sweeps skipped versions
    except FencedError as e:
        log.warning("deepfreeze: %s", e)
        result["abandoned"] = True
    if source is None:  # a memory-tier job has no scratch files (its slots are reused, not retained)
        scratch.retain(name, rank, job["keep_scratch"], upto=version)
    return result
