"""Jobs on a memory-tier device: which regions belong to a reader's job, and the capacity policy
(which runs a newer run of their job superseded, in which order finished runs are evicted).

Pure functions over :class:`~deepfreeze.memtier.slot.ShardRegion` lists (duck-typed: ``name``,
``run``, ``rank``, ``job``, ``restorable()``, ``verify_slot()``); :mod:`deepfreeze.memtier.device`
applies them under the device lock. A region's job is the id its MIndex records
(``deepfreeze.lease.job_id``: ``<persistent>/<name>/job`` for an engine model, ``job=`` for a
standalone one); ``None`` is "job unknown" (written before job ids). Regions are matched on that
id only, never on paths (which differ between nodes).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

from ..lease import Version

__all__ = ["job_text", "pick_job", "for_job", "say_ignored", "superseded_runs", "eviction_order"]

log = logging.getLogger("deepfreeze")


def job_text(job: str | None) -> str:
    """A job id as shown to people: its first 12 hex digits, or ``unknown``."""
    return "unknown" if job is None else job[:12]


def pick_job(jobs: "Sequence[str]", job: str, what: str) -> str:
    """The one of ``jobs`` (ids, or ``"unknown"``) that ``job`` names: itself, or a unique prefix of
    at least 4 hex digits of an id (as ``memtier view`` shows it). None or several matching:
    :class:`~deepfreeze.errors.CheckpointNotFoundError` naming ``what`` and the jobs (a command
    given a prefix two jobs share must never act on both)."""
    from ..errors import CheckpointNotFoundError
    got = sorted({j for j in jobs if j == job or (job != "unknown" and j != "unknown" and len(job) >= 4
                                                   and j.startswith(job))})
    if len(got) != 1:
        raise CheckpointNotFoundError(f"{what}: {'no' if not got else 'more than one'} job matches {job!r} (its jobs: "
                                      f"{', '.join(sorted(set(jobs))) or 'none'}); give more digits of the id "
                                      "('deepfreeze memtier view' shows each model's job)")
    return got[0]


def for_job(regions: Sequence[Any], job: str | None) -> tuple[list[Any], list[str]]:
    """Split ``regions`` (of one name) into those of job ``job`` (matched on the id recorded in
    their MIndex; ``None`` matches only regions of unknown job, written before job ids) and notes
    on the ignored ones, one per (job, run): ``run R (ranks 0,1) of job J: another job``."""
    mine, other = [], {}
    for r in regions:
        if r.job == job:
            mine.append(r)
        else:
            other.setdefault((r.job or "", r.run), []).append(r.rank)
    notes = []
    for (j, run), ranks in sorted(other.items()):
        why = ("job unknown (written before job ids): never restored into a job that has one" if not j else
               "another job" if job is not None else "a job with an id, and this one has none")
        notes.append(f"run {run} (rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, sorted(ranks)))}) of job "
                     f"{job_text(j or None)}: {why}")
    return mine, notes


_said: set[tuple[str, str, str, tuple[str, ...]]] = set()
_said_lock = threading.Lock()


def say_ignored(path: str, name: str, job: str | None, notes: Sequence[str]) -> None:
    """Log, once per process for the same device, name, job and ignored regions, which regions of
    ``name`` on the device at ``path`` were ignored (notes of :func:`for_job`) and why."""
    if not notes:
        return
    key = (path, name, job or "", tuple(notes))
    with _said_lock:
        if key in _said:
            return
        _said.add(key)
    log.warning("deepfreeze memtier: %s: ignored %d model(s) named %r that are not of this job (job %s): %s. "
                "'deepfreeze memtier view %s' lists them with their jobs", path, len(notes), name, job_text(job),
                "; ".join(notes), path)


def _runs(regions: Sequence[Any]) -> dict[tuple[str, str], list[Any]]:
    runs: dict[tuple[str, str], list[Any]] = {}
    for r in regions:
        runs.setdefault((r.name, r.run), []).append(r)
    return runs


def _newest_whole(regions: Sequence[Any]) -> Version | None:
    """The newest version that every one of ``regions`` (one run's) holds in a verified DONE slot."""
    common: set[Version] | None = None
    for r in regions:
        have = {h.version for k, h in r.restorable() if r.verify_slot(k, h) is None}
        common = have if common is None else common & have
    return max(common) if common else None


def superseded_runs(regions: Sequence[Any], live: Callable[[Any], bool], *, name: str | None = None,
                    job: str | None = None) -> list[list[Any]]:
    """The runs (each as its regions) that a newer run of the same job (the same job id, never
    None: unknown jobs are never compared) has superseded: the run is not live, and the newer run
    holds, on every one of its regions here, a verified DONE version newer than every version the
    older run holds. Only name ``name`` / job ``job`` when given."""
    by_job: dict[tuple[str, str], dict[str, list[Any]]] = {}
    for (n, run), rs in _runs(regions).items():
        j = rs[0].job
        if j is None or any(r.job != j for r in rs) or (name is not None and n != name) \
                or (job is not None and j != job):
            continue
        by_job.setdefault((j, n), {})[run] = rs
    out = []
    for runs in by_job.values():
        if len(runs) < 2:
            continue
        whole = {run: _newest_whole(rs) for run, rs in runs.items()}
        for run, rs in runs.items():
            held = [h.version for r in rs for _, h in r.restorable()]
            top = max(held) if held else None
            newer = [w for other, w in whole.items() if other != run and w is not None and (top is None or w > top)]
            if newer and not any(live(r) for r in rs):
                out.append(rs)
    return out


def eviction_order(regions: Sequence[Any], live: Callable[[Any], bool]
                   ) -> tuple[dict[tuple[str, str], list[Any]], list[tuple[str, str]]]:
    """The finished runs (``{(name, run): regions}``, none of them live) and the order to evict
    them in when space is needed: runs whose job holds a newer version elsewhere on the device
    first, then each job's newest version, oldest written first, so that every job keeps its
    newest version as long as possible. A run of unknown job counts as a job of its own."""
    runs = _runs(regions)

    def newest(rs: Sequence[Any]) -> tuple[Version, float]:
        hs = [h for r in rs for _, h in r.restorable()]
        if not hs:
            return Version(-1, -1), 0.0
        top = max(h.version for h in hs)
        return top, max(h.written for h in hs if h.version == top)

    def group(n: str, run: str, rs: Sequence[Any]) -> tuple[Any, ...]:
        return (rs[0].job, n) if rs[0].job is not None else (None, n, run)

    best: dict[tuple[Any, ...], Version] = {}
    for (n, run), rs in runs.items():
        g, v = group(n, run, rs), newest(rs)[0]
        best[g] = max(best.get(g, v), v)
    dead = {key: rs for key, rs in runs.items() if not any(live(r) for r in rs)}
    keyed = []
    for (n, run), rs in dead.items():
        v, written = newest(rs)
        keyed.append((v >= best[group(n, run, rs)] and v.step >= 0, written, n, run))
    keyed.sort()
    return dead, [(n, run) for _, _, n, run in keyed]
