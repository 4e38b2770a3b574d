"""The :class:`Run`: one writer of a checkpoint name, as each rank sees it (layer L5).

Run identity, versions, generations, jobs and the lease it uses are defined in
:mod:`deepfreeze.lease` (layer L1), which every lower module imports; import them from there (this
module re-exports none of them).
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from . import backend
from .comm import Comm
from .config import Config
from .engine import Engine
from .tiers import choose
from .errors import CheckpointNotFoundError, ConfigError, DeepFreezeError, ExistingCheckpointError, LeaseHeldError, NodeIdConflictError
from .lease import Lease, RunInfo, job_id, new_run_id, read_generation, write_generation
from .tiers.scratch import ScratchLevel
from .shardplan import ShardPlan
from .veloc_engine import VelocEngine

__all__ = ["Run", "RunView", "ON_ERROR", "STALL_WARN", "make_engine"]

log = logging.getLogger("deepfreeze")

#: the ``on_error`` policies: ``"raise"`` stops training at a failed checkpoint, ``"warn"`` logs it,
#: counts it in :attr:`Run.failures` and training goes on
ON_ERROR = ("raise", "warn")
#: seconds: a first checkpoint that stalls the training step longer logs one warning naming its parts
#: (:meth:`Run.note_stall`)
STALL_WARN = 0.25


class Run:
    """One run of a checkpoint name as seen by one rank, and everything both adapters
    (:class:`deepfreeze.keras.DeepFreezeCheckpoint`, :class:`deepfreeze.torch.Checkpointer`) share
    about it; an adapter keeps only its framework's hooks, its capture, its tensor list and the
    ranks' agreement on the shard plan.

    * Arguments, checked once with one wording each (not collective): ``on_error``, ``scratch_cls``,
      ``trust_owners``, ``resume``/``overwrite``, ``lease_wait``, ``engine``; ``config`` resolved
      with ``overrides`` (:meth:`deepfreeze.Config.resolve`).
    * :meth:`begin` (collective) makes the run id on rank 0, takes the lease, applies ``overwrite``
      (a new generation) and refuses a new run on a name that already has committed versions;
      :meth:`pick_resume` / :meth:`resumed` (collective) restore and record the step restored and
      retire what older runs left above it.
    * :meth:`guard`: the ``on_error`` policy (:attr:`failures`).
    * :meth:`new_engine`: the engine for a new shard plan (the old one closed, the newest version
      carried); :meth:`hand_off` (the lease checked first), :meth:`wait`, :meth:`close` (the
      engine, then the lease); :meth:`at_exit`: the hand-off when the interpreter exits without
      ``close()``.

    ``comm`` is anything with ``rank``, ``size`` and ``allgather(bytes)``
    (:class:`deepfreeze.comm.MPIComm`, :class:`~deepfreeze.comm.LocalComm`); an adapter that learns
    its ranks later passes it to :meth:`begin`."""

    def __init__(self, config: Any, name: str, rank: int = 0, size: int = 1, comm: Any = None, *,
                 resume: bool = False, overwrite: bool = False, lease_wait: float = 0.0, on_error: str = "raise",
                 engine: str | None = None, scratch_cls: type | None = None, trust_owners: Any = None,
                 verbose: int = 0, **overrides: Any) -> None:
        from .tiers.scratch import ScratchLevel
        from .ownership import trusted_uids
        if on_error not in ON_ERROR:
            raise ConfigError(f"on_error = {on_error!r}: use 'raise' (stop training) or 'warn' (log and go on)")
        scratch_cls = ScratchLevel if scratch_cls is None else scratch_cls
        if not (isinstance(scratch_cls, type) and issubclass(scratch_cls, ScratchLevel)):
            raise ConfigError("scratch_cls must be a subclass of deepfreeze.tiers.scratch.ScratchLevel")
        trust = ([trust_owners] if isinstance(trust_owners, (str, int)) else
                 list(trust_owners) if trust_owners else None)
        trusted_uids(trust)  # an unknown user name is a ConfigError now, not at resume
        if resume and overwrite:
            raise ConfigError("resume=True and overwrite=True contradict each other: resume continues the "
                              "name's newest version, overwrite starts a new generation; pick one")
        if isinstance(lease_wait, bool) or not isinstance(lease_wait, (int, float)) or lease_wait < 0:
            raise ConfigError(f"lease_wait = {lease_wait} must be >= 0 seconds")
        if comm is None:
            from .comm import LocalComm
            comm = LocalComm()
        self.config: Config = Config.resolve(config, **overrides)
        from .tiers import resolve_engine
        self.engine_kind = resolve_engine(engine)
        self.name, self.rank, self.size, self.comm = name, rank, size, comm
        self.resume, self.overwrite, self.lease_wait = bool(resume), bool(overwrite), float(lease_wait)
        self.on_error, self.scratch_cls, self.trust_owners, self.verbose = on_error, scratch_cls, trust, verbose
        self.lease: Lease | None = None
        self.info: RunInfo | None = None
        #: between :meth:`begin` and :meth:`close`
        self.begun = False
        #: the engine of the current shard plan (:meth:`new_engine`), None before and after :meth:`close`
        self.engine: Any = None
        #: the newest version handed off (the adapter decides what counts); carried into a new engine
        self.last_version: int | None = None
        #: failures under ``on_error='warn'`` (their messages), in order
        self.failures: list[str] = []
        #: checkpoint errors this rank reported under either ``on_error`` policy (raised or warned)
        self.errors = 0
        #: called before :meth:`guard` re-raises under ``on_error='raise'`` (an adapter's clean-up)
        self.before_raise: Callable[[], None] | None = None
        #: the node's backend being started or found off the training thread since :meth:`begin` (async
        #: mode, built-in engine; :func:`deepfreeze.backend.start_async`), until the first engine is built
        self.backend_start: backend.BackendStart | None = None
        #: (what, seconds) of the engine set-ups (:meth:`new_engine`) since the last :meth:`note_stall`
        self.setup_s: list[tuple[str, float]] = []
        self._stall_noted = False

    def _gather0(self, payload: dict[str, Any] | None) -> dict[str, Any]:
        rows = self.comm.allgather(json.dumps(payload).encode() if self.rank == 0 else b"")
        return json.loads(rows[0])

    def begin(self, comm: Any = None) -> RunInfo:
        """Start the run (collective; over ``comm`` when given, which sets :attr:`rank` and
        :attr:`size`). Raises :class:`LeaseHeldError`,
        :class:`~deepfreeze.errors.ExistingCheckpointError` or another DeepFreezeError on
        every rank when rank 0 cannot start it."""
        from .tiers.persistent import PersistentLevel
        from .tiers.scratch import ScratchLevel
        if comm is not None:
            self.comm, self.rank, self.size = comm, comm.rank, comm.size
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
        self.begun = True
        if cfg.mode == "async" and (self.engine_kind == "builtin" or cfg.memtier is not None) \
                and self.backend_start is None:  # the engine's backend (make_engine), started off this thread
            self.backend_start = backend.start_async(cfg.scratch, shared_group=cfg.shared_group,
                                                     answer_timeout=cfg.backend_timeout)
        return self.info

    def resumed(self, step: int) -> RunInfo:
        """Record that this run continues from ``step`` (collective): every rank removes its
        scratch files of higher versions, rank 0 retires higher versions on persistent (manifest
        first), so no number this run will write can mean an older run's state."""
        from .tiers.persistent import PersistentLevel
        from .tiers.scratch import ScratchLevel
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

    # ------------------------------------------------------------------ the write path
    def guard(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Call ``fn`` under the ``on_error`` policy: a DeepFreezeError is raised (after
        :attr:`before_raise`) with ``"raise"``, or logged and counted in :attr:`failures` with
        ``"warn"``. Returns whether ``fn`` returned."""
        try:
            fn(*args, **kwargs)
        except DeepFreezeError as e:
            self.errors += 1
            if self.on_error == "raise":
                if self.before_raise is not None:
                    self.before_raise()
                raise
            self.failures.append(str(e))
            log.warning("DeepFreeze (rank %d): checkpointing failed, training goes on (on_error='warn'): %s",
                        self.rank, e)
            return False
        return True

    def fail(self, error: DeepFreezeError) -> None:
        """``error`` under the ``on_error`` policy (a failure the adapter found itself)."""
        def throw() -> None:
            raise error
        self.guard(throw)

    def new_engine(self, plan: Any, domains: Any = None, comm: Any = None) -> Any:
        """The engine of this rank for a new shard ``plan`` (the previous one closed first, its
        background error under ``on_error``), numbering on from :attr:`last_version`. ``comm``
        carries the built-in engine's redundancy exchange, or (its ``comm`` attribute, mpi4py)
        VeloC's."""
        assert self.info is not None, "begin() first"
        if self.engine is not None:
            old, self.engine = self.engine, None
            self.guard(old.close)
        veloc = self.engine_kind == "veloc"
        t0 = time.perf_counter()
        start, self.backend_start = self.backend_start, None
        if start is not None:
            # started at begin(): usually up by now, else the rest of its start is waited for (its client
            # has its own bounds; past this one the engine's client goes through the start lock itself)
            start.wait(self.config.backend_timeout + 60.0)
        t1 = time.perf_counter()
        try:
            self.engine = make_engine(self.engine_kind, self.config, self.name, self.rank, plan, domains,
                                      scratch_cls=self.scratch_cls, comm=None if veloc else comm,
                                      mpi_comm=comm.comm if veloc and comm is not None else None, run=self.info)
        finally:
            if start is not None:
                start.release()  # the engine holds its own connection now
        self.setup_s += [("waiting for the node's backend to start", t1 - t0),
                         ("building the engine", time.perf_counter() - t1)]
        if self.last_version is not None:
            self.engine.last_version = self.last_version  # versions keep growing within the run
        return self.engine

    def note_stall(self, version: int, parts: Sequence[tuple[str, float]], *, setup_inside: bool = True) -> None:
        """An adapter's account of how long checkpoint ``version`` stalled the training step:
        ``parts``, (what, seconds) adding up to the stall. With ``setup_inside``, the engine set-ups
        of :meth:`new_engine` since the last call (:attr:`setup_s`) were made inside the first part
        and are named apart from it. The run's first call whose stall exceeds :data:`STALL_WARN`
        logs one warning (rank 0) naming the parts, largest first; every later call does nothing
        (one line per run: the library installs no log handler, so an INFO line would never be seen)."""
        setup, self.setup_s = self.setup_s, []
        if self._stall_noted:
            return
        self._stall_noted = True
        total = sum(s for _, s in parts)
        if total <= STALL_WARN or self.rank != 0 or not parts:
            return
        named = list(parts)
        if setup_inside and setup:
            named = [*setup, (parts[0][0], max(0.0, parts[0][1] - sum(s for _, s in setup))), *parts[1:]]
        named = sorted((p for p in named if p[1] >= 0.005), key=lambda p: -p[1])  # (what shows as 0.00 s left out)
        log.warning("DeepFreeze: %r v%d: the first checkpoint stalled the step %.2f s: %s", self.name, version,
                    total, ", ".join(f"{s:.2f} s {what}" for what, s in named))

    def summary(self, plan: Any, tensors: int) -> None:
        """Log the shard plan's size (rank 0, ``verbose``)."""
        if self.verbose and self.rank == 0:
            log.warning("DeepFreeze: %d tensors, %.1f MB, %d ranks, %.1f MB per rank (max), mode %s",
                        tensors, plan.total_bytes / 1e6, self.size, max(plan.rank_bytes()) / 1e6, self.config.mode)

    def hand_off(self, version: int, data: Any, **meta: Any) -> bool:
        """Hand ``version`` to the engine (``meta``: the manifest's ``step``, ``epoch``, ``extra``)
        under ``on_error``, unless the lease was lost (another run took the name over: this
        run's versions are fenced off; a :class:`LeaseHeldError` under ``on_error``). Returns
        whether the engine took it."""
        if self.lease is not None and self.lease.lost and not self.guard(self.check):
            return False
        return self.guard(self.engine.checkpoint, version, data, **meta)

    def wait(self, timeout: float | None = None, *, persistent: bool = True, engine: Any = None) -> None:
        """Wait for the engine (``engine``: another run's, which this one shares) under
        ``on_error``: every version handed off committed on persistent (or on scratch)."""
        engine = self.engine if engine is None else engine
        if engine is not None:
            self.guard(engine.wait, persistent=persistent, timeout=timeout)

    def close(self) -> None:
        """Close the engine (waits for its flushes; raises a pending background error once,
        shuts down either way), then release the lease (rank 0): the run ends here."""
        engine, self.engine = self.engine, None
        start, self.backend_start = self.backend_start, None
        if start is not None:
            start.release()  # no engine was built: the backend exits once idle
        try:
            if engine is not None:
                engine.close(wait=True)
        finally:
            self.begun = False
            if self.lease is not None:
                self.lease.release()
                atexit.unregister(self.lease.release)
                self.lease = None

    # ------------------------------------------------------------------ the exit hand-off
    def at_exit(self, hand_off: Callable[[], None]) -> None:
        """Call the bound method ``hand_off`` when the interpreter exits, while thread pools
        still take work: on the hooks ``concurrent.futures`` itself uses (run before its executors
        shut down and before the ``atexit`` handlers, among them the lease's release), else
        ``atexit``. Holds its object weakly; does nothing in a forked child (``multiprocessing``
        runs threading's exit hooks in the children it forks: DataLoader workers)."""
        ref = weakref.WeakMethod(hand_off)  # type: ignore[arg-type]
        pid = os.getpid()

        def run_at_exit() -> None:
            fn = ref()
            if fn is not None and os.getpid() == pid:  # never in a fork (a DataLoader worker runs these hooks)
                fn()
        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise RuntimeError("no threading._register_atexit")
            register(run_at_exit)
        except RuntimeError:
            atexit.register(run_at_exit)

    def close_at_exit(self, close: Callable[[], None], timeout: float, *, who: str, pending: int | None,
                      hint: str = "close()") -> None:
        """The exit hand-off of an adapter whose ``close`` (named ``who``, e.g.
        ``"Checkpointer.close()"``; ``hint``: how the user calls it) was not called: run it in a
        thread for at most ``timeout`` seconds (every rank exiting normally does this
        collectively), then say what happened to ``pending`` (the version captured but not
        handed off yet, if any)."""
        err: list[BaseException] = []

        def run() -> None:
            try:
                close()
            except BaseException as e:  # reported below
                err.append(e)
        t = threading.Thread(target=run, name=f"deepfreeze-atexit-close-r{self.rank}", daemon=True)
        t.start()
        t.join(timeout)
        what = f"v{pending}" if pending is not None else "its last versions"
        if t.is_alive():
            log.warning("DeepFreeze (rank %d): %r: %s was not called and closing at exit did not finish within "
                        "close_timeout=%gs (another rank did not exit normally?): %s may not be written; call "
                        "%s at the end of training", self.rank, self.name, who, timeout, what, hint)
        elif err:
            log.warning("DeepFreeze (rank %d): %r: %s was not called and closing at exit failed (%s: %s): %s may "
                        "not be written; call %s at the end of training", self.rank, self.name, who,
                        type(err[0]).__name__, err[0], what, hint)
        elif pending is not None and self.saw_committed(pending):
            if self.rank == 0:
                log.warning("DeepFreeze: %r: %s was not called: v%d was handed off and flushed at exit (committed); "
                            "call %s at the end of training", self.name, who, pending, hint)
        elif pending is not None:  # said by each rank that did not see it committed, not only rank 0
            log.warning("DeepFreeze (rank %d): %r: %s was not called: this rank's part of v%d was handed off and "
                        "flushed at exit, but this rank did not see v%d committed: it is committed only if every "
                        "rank's part was flushed (else the next resume retires it); call %s at the end of training",
                        self.rank, self.name, who, pending, pending, hint)

    def saw_committed(self, version: int) -> bool:
        """Whether this rank sees ``version`` committed by this run on persistent now: a valid
        manifest of this name and version, of this run (its id) and generation. Reads one
        manifest; any error reading it is a no."""
        from . import format as fmt
        from .tiers.persistent import PersistentLevel
        if self.config.persistent_interval < 0:
            return False
        try:
            pers = PersistentLevel(self.config.persistent, shared_group=self.config.shared_group)
            run_id, gen, _ = fmt.manifest_run(pers.read_manifest(self.name, version))
            if self.info is not None and (run_id, gen) != (self.info.id, self.info.generation):
                return False
            return gen == pers.generation(self.name)
        except (OSError, DeepFreezeError, ValueError):
            return False


def _view(attr: str, doc: str) -> property:
    return property(lambda self: getattr(self._run, attr), doc=doc)


class RunView:
    """The read-only attributes an adapter shows of its :class:`Run` (held as ``self._run``)."""

    _run: Run
    engine = _view("engine", "This rank's engine (:func:`make_engine`) for the current shard "
                             "plan; None before the first plan and after ``close()``.")
    failures = _view("failures", "Messages of the checkpoint errors tolerated under ``on_error='warn'``.")
    last_version = _view("last_version", "Version (the optimizer step) of the newest checkpoint taken, or None.")
    on_error = _view("on_error", "``'raise'`` or ``'warn'``.")
    engine_kind = _view("engine_kind", "The resolved engine: ``'builtin'`` or ``'veloc'``.")
    scratch_cls = _view("scratch_cls", "The ScratchLevel subclass that writes shards.")
    trust_owners = _view("trust_owners", "Owners (names or uids) trusted when reading, or None.")
    resume = _view("resume", "Whether the run resumes the name's newest version.")
    overwrite = _view("overwrite", "Whether the run starts a new generation of the name.")
    lease_wait = _view("lease_wait", "Seconds to wait for another run's lease on the name.")


def make_engine(engine: str | None, config: Config, name: str, rank: int, plan: ShardPlan,
                domains: Sequence[str] | None = None, *, comm: Comm | None = None, mpi_comm: Any = None,
                scratch_cls: type = ScratchLevel, run: RunInfo | None = None) -> Engine:
    """The engine of one rank: :class:`~deepfreeze.engine.Engine` or
    :class:`~deepfreeze.veloc_engine.VelocEngine` (the engine factory is here, above both), as
    :func:`deepfreeze.tiers.choose` decides.
    ``comm`` carries the built-in redundancy exchange; ``mpi_comm`` (mpi4py) is VeloC's."""
    if choose(config, engine).engine == "veloc":  # every rule of the choice: deepfreeze.tiers.choose
        return VelocEngine(config, name, rank, plan, domains, mpi_comm=mpi_comm, scratch_cls=scratch_cls, run=run)
    return Engine(config, name, rank, plan, domains, scratch_cls=scratch_cls, comm=comm, run=run)
