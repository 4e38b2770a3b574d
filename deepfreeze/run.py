"""The :class:`Run`: one writer of a checkpoint name, as each rank sees it (layer L5).

Run identity, versions, generations, jobs and the lease it uses are defined in
:mod:`deepfreeze.lease` (layer L1), which every lower module imports; their names are re-exported
here, where they were defined before the split, so ``from deepfreeze.run import Version`` keeps
working.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
from typing import Any, Sequence

from .comm import Comm
from .config import Config
from .engine import Engine, resolve_engine
from .errors import CheckpointNotFoundError, ConfigError, DeepFreezeError, ExistingCheckpointError, LeaseHeldError, NodeIdConflictError
from .lease import (ANONYMOUS_RUN, GENERATION, JOB, LEASE, Lease, RunInfo, Version, fence_holder, fs_now,  # noqa: F401
                    job_id, job_id_at, new_job_id, new_run_id, read_generation, read_job_id, read_job_id_at,
                    read_lease, valid_job_id, write_generation)
from .levels import ScratchLevel
from .shardplan import ShardPlan
from .veloc_engine import VelocEngine

__all__ = ["Version", "RunInfo", "ANONYMOUS_RUN", "new_run_id", "new_job_id", "job_id", "read_job_id", "job_id_at",
           "read_job_id_at", "valid_job_id", "JOB", "fs_now", "read_generation", "write_generation", "Lease", "read_lease",
           "fence_holder", "Run", "GENERATION", "LEASE", "make_engine"]

log = logging.getLogger("deepfreeze")


class Run:
    """One run of a checkpoint name as seen by one rank: :meth:`begin` (collective) makes the
    run id on rank 0, takes the lease, applies ``overwrite`` (a new generation) and refuses a
    new run on a name that already has committed versions; :meth:`resumed` (collective)
    records the step restored and retires what older runs left above it; :meth:`close`
    releases the lease. ``comm`` is anything with ``rank``, ``size`` and ``allgather(bytes)``
    (:class:`deepfreeze.comm.MPIComm`, :class:`~deepfreeze.comm.LocalComm`)."""

    def __init__(self, config: Any, name: str, rank: int, size: int, comm: Any = None, *,
                 resume: bool = False, overwrite: bool = False, lease_wait: float = 0.0) -> None:
        if resume and overwrite:
            raise ConfigError("resume=True and overwrite=True contradict each other: resume continues the "
                              "name's newest version, overwrite starts a new generation; pick one")
        if lease_wait < 0:
            raise ConfigError(f"lease_wait = {lease_wait} must be >= 0 seconds")
        if comm is None:
            from .comm import LocalComm
            comm = LocalComm()
        self.config, self.name, self.rank, self.size, self.comm = config, name, rank, size, comm
        self.resume, self.overwrite, self.lease_wait = resume, overwrite, float(lease_wait)
        self.lease: Lease | None = None
        self.info: RunInfo | None = None

    def _gather0(self, payload: dict[str, Any] | None) -> dict[str, Any]:
        rows = self.comm.allgather(json.dumps(payload).encode() if self.rank == 0 else b"")
        return json.loads(rows[0])

    def begin(self) -> RunInfo:
        """Start the run (collective). Raises :class:`LeaseHeldError`,
        :class:`~deepfreeze.errors.ExistingCheckpointError` or another DeepFreezeError on
        every rank when rank 0 cannot start it."""
        from .levels import PersistentLevel, ScratchLevel
        cfg = self.config
        pers = PersistentLevel(cfg.persistent, shared_group=cfg.shared_group)
        payload = None
        if self.rank == 0:
            payload = {"id": new_run_id(), "gen": 0, "committed": None, "err": "", "kind": "", "job": None}
            try:
                if cfg.persistent_interval >= 0 or self.overwrite or getattr(cfg, "memtier", None):
                    pers.makedirs(pers.name_dir(self.name))  # the job id lives there (memtier regions record it)
                if cfg.persistent_interval < 0:
                    log.warning("deepfreeze: persistent_interval < 0: no persistent level, so no lease on %r: "
                                "nothing stops a second job from writing the same name on scratch", self.name)
                else:
                    lease = Lease(cfg.persistent, self.name, payload["id"], timeout=cfg.lease_timeout)
                    lease.acquire(wait=self.lease_wait, resume=self.resume)
                    self.lease = lease
                    atexit.register(lease.release)
                if os.path.isdir(pers.name_dir(self.name)):  # persistent_interval < 0 without memtier: no job id
                    payload["job"] = job_id(cfg.persistent, self.name)
                gen = read_generation(cfg.persistent, self.name)
                if self.overwrite:
                    gen += 1
                    write_generation(cfg.persistent, self.name, gen)
                    log.warning("deepfreeze: overwrite=True: %r starts generation %d; every older version is "
                                "retired", self.name, gen)
                    pers.retain(self.name, 0)  # removes the older generations' versions (manifest first)
                committed = pers.committed_versions(self.name, gen)
                payload.update(gen=gen, committed=committed[-1] if committed else None)
            except (DeepFreezeError, OSError) as e:
                payload.update(err=str(e)[:2000], kind=type(e).__name__)
        got = self._gather0(payload)
        if got["err"]:
            self.close()
            if got["kind"] == "NodeIdConflictError":
                raise NodeIdConflictError(got["err"])
            if got["kind"] == "LeaseHeldError":
                raise LeaseHeldError(got["err"])
            raise DeepFreezeError(f"cannot start a run of {self.name!r} (rank 0: {got['kind']}): {got['err']}")
        gen = int(got["gen"])
        scratch = ScratchLevel(cfg.scratch)
        mine: dict[str, Any] = {"newest": None, "err": ""}
        try:  # every rank's error is gathered: no rank is left waiting in a collective
            if self.overwrite:
                scratch.clear(self.name, self.rank)
            local = scratch.committed(self.name, gen)
            mine["newest"] = max(local) if local else None
        except (DeepFreezeError, OSError) as e:
            mine["err"] = f"{type(e).__name__}: {str(e)[:1000]}"
        rows = [json.loads(r) for r in self.comm.allgather(json.dumps(mine).encode())]
        bad = [(r, row["err"]) for r, row in enumerate(rows) if row["err"]]
        if bad:
            self.close()
            raise DeepFreezeError(f"cannot start a run of {self.name!r}: rank {bad[0][0]}: {bad[0][1]}")
        on_scratch = [row["newest"] for row in rows if row["newest"] is not None]
        if not self.resume and not self.overwrite and (got["committed"] is not None or on_scratch):
            newest = max([got["committed"] or 0] + on_scratch)
            self.close()
            raise ExistingCheckpointError(
                f"checkpoint name {self.name!r} already has committed versions (newest v{newest}, in "
                f"{cfg.persistent} or on scratch {cfg.scratch}); a new run must not mix with them. Either "
                "resume=True (continue from the newest), another name, or overwrite=True (start a new generation: "
                "the old versions are retired)")
        self.info = RunInfo(got["id"], gen, job=got.get("job"))
        return self.info

    def resumed(self, step: int) -> RunInfo:
        """Record that this run continues from ``step`` (collective): every rank removes its
        scratch files of higher versions, rank 0 retires higher versions on persistent (manifest
        first), so no number this run will write can mean an older run's state."""
        from .levels import PersistentLevel, ScratchLevel
        assert self.info is not None, "begin() first"
        self.info = dataclasses.replace(self.info, resumed_from=int(step))
        err = ""
        try:
            ScratchLevel(self.config.scratch).clear(self.name, self.rank, above=step)
        except (DeepFreezeError, OSError) as e:
            err = f"rank {self.rank}: {type(e).__name__}: {str(e)[:1000]}"
        if self.rank == 0 and self.config.persistent_interval >= 0 and not err:
            pers = PersistentLevel(self.config.persistent)
            try:
                for v in pers.versions(self.name):
                    if v > step:
                        log.warning("deepfreeze: retiring %r v%d on persistent (left by an older run above the "
                                    "resume point v%d)", self.name, v, step)
                        pers.retire(self.name, v, stale_after=self.config.lease_timeout)
            except (DeepFreezeError, OSError) as e:
                err = f"{type(e).__name__}: {e}"
        rows = [json.loads(r) for r in self.comm.allgather(json.dumps(err).encode())]  # also a barrier
        bad = [e for e in rows if e]
        if bad:  # every rank raises: nobody writes above step before it is retired
            raise DeepFreezeError(f"resume of {self.name!r} from v{step}: {bad[0]}")
        return self.info

    def pick_resume(self, comm: Any = None, *, version: int | None = None,
                    trust_owners: Any = None) -> Any:
        """What ``resume=True`` does first, for every adapter (collective over ``comm``, or this
        process alone): load the newest version every participant can recover (or ``version``),
        record it with :meth:`resumed` and return the :class:`~deepfreeze.Checkpoint`; None, with
        one warning (rank 0), when the name has no committed version (start fresh)."""
        from .loader import load
        try:
            ck = load(self.config, self.name, version, comm=comm, trust_owners=trust_owners)
        except CheckpointNotFoundError:
            if self.rank == 0:
                log.warning("DeepFreeze: resume=True but no committed version of %r: starting fresh", self.name)
            return None
        self.resumed(ck.version)  # retires what older runs left above it; recorded in every manifest
        return ck

    def check(self) -> None:
        """Raise if this rank holds the lease and lost it (another run took the name over)."""
        if self.lease is not None and self.lease.lost:
            raise LeaseHeldError(self.lease.lost)

    def close(self) -> None:
        """Release the lease (rank 0)."""
        if self.lease is not None:
            self.lease.release()
            atexit.unregister(self.lease.release)
            self.lease = None


def make_engine(engine: str | None, config: Config, name: str, rank: int, plan: ShardPlan,
                domains: Sequence[str] | None = None, *, comm: Comm | None = None, mpi_comm: Any = None,
                scratch_cls: type = ScratchLevel, run: RunInfo | None = None) -> Engine:
    """The engine of one rank: :class:`~deepfreeze.engine.Engine` or
    :class:`~deepfreeze.veloc_engine.VelocEngine` (the engine factory is here, above both).
    ``comm`` carries the built-in redundancy exchange; ``mpi_comm`` (mpi4py) is VeloC's."""
    if config.memtier is not None:  # the memory tier is the built-in engine's: decided before looking for VeloC
        requested = engine or os.environ.get("DEEPFREEZE_ENGINE") or "builtin"
        if requested == "veloc":
            raise ConfigError(f"memtier = {config.memtier} ({config.where('memtier')}) needs the built-in engine: "
                              "with engine='veloc' the shards go through VeloC's files; leave memtier out or use "
                              "engine='builtin'")
        if requested == "auto":
            log.info("deepfreeze: engine='auto' uses the built-in engine: memtier is set")
            engine = "builtin"
    if resolve_engine(engine) == "veloc":
        return VelocEngine(config, name, rank, plan, domains, mpi_comm=mpi_comm, scratch_cls=scratch_cls, run=run)
    return Engine(config, name, rank, plan, domains, scratch_cls=scratch_cls, comm=comm, run=run)
