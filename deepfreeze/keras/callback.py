"""``DeepFreezeCheckpoint``: the Keras callback, thin over the hook and the engine."""
from __future__ import annotations

import array
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import time
import weakref
from typing import Any

import numpy as np
import tensorflow as tf

from ..config import KEYS, Config, did_you_mean, validate_name
from ..errors import ConfigError, DeepFreezeError, ModelMismatchError
from ..run import Run, RunView
from ..shardplan import DEFAULT_MIN_SHARD_BYTES, ShardPlan, TensorSpec, check_tensor_names
from . import hook as _hook
from ._dist import allgather_bytes, mpi_comm, rank_and_size, run_comm
from ._state import train_state
from .state_loader import apply_checkpoint, build_from_spec
from ..format import parent_problem

__all__ = ["DeepFreezeCheckpoint", "CaptureOptions"]

log = logging.getLogger("deepfreeze")


class _ResumePoint:
    """Keras' hook for where ``fit`` starts (what BackupAndRestore sets as ``_training_state``)."""

    def __init__(self, epoch: int, step: int) -> None:
        self.epoch, self.step = epoch, step

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch: int, initial_epoch: int,
                                              mode: Any = None) -> tuple[int, int]:
        return self.epoch, self.step


class _SkipBatches:
    """Wraps the train function: its first call first draws ``n`` batches from the iterator
    unused (Keras resumes its step count, not its data position)."""

    def __init__(self, fn: Any, n: int) -> None:
        self.fn, self.n = fn, n

    def __call__(self, iterator: Any) -> Any:
        for _ in range(self.n):
            next(iterator)
        self.n = 0
        return self.fn(iterator)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)


def _raise(e: BaseException) -> None:
    raise e


def _check_overrides(overrides: dict[str, Any]) -> None:
    """Reject a keyword that is neither an argument of the callback nor an INI key, suggesting
    the closest of both (``every_n_batch`` -> "did you mean 'every_n_batches'?")."""
    for key in overrides:
        if key not in KEYS:
            own = [p for p in inspect.signature(DeepFreezeCheckpoint.__init__).parameters
                   if p not in ("self", "overrides")]
            raise ConfigError(f"DeepFreezeCheckpoint: unknown argument {key!r}.{did_you_mean(key, own + sorted(KEYS))} "
                              f"It is neither an argument of the callback ({', '.join(own)}) nor an INI key "
                              "(a keyword override, see docs/configuration.md)")


class _SetUpAtFirstStep:
    """Wraps the train function of a model that is not built when ``fit`` starts (a
    ``Sequential`` without ``Input``, as in most Horovod examples). Its first call, before
    the first step: builds the model from the input's element spec, restores the version
    ``resume=True`` picked (so no step is trained before restoring), sets up the capture
    (the callback's ``on_train_begin``, which retraces the train function), draws the
    batches a resumed epoch already trained on, then runs the step with the new function."""

    sets_up_at_first_step = True  # CloneCallback's first-step set-up chains to this one, and this one to it

    def __init__(self, callback: "DeepFreezeCheckpoint", fn: Any, skip: int) -> None:
        self.callback, self.fn, self.skip = callback, fn, skip

    def __call__(self, iterator: Any) -> Any:
        cb = self.callback
        cb._build_from(iterator)
        first_batch, cb._deferred = cb._first_batch, None
        cb.on_train_begin()  # the model is built now: the normal set-up (restores a preloaded version)
        cb._first_batch = first_batch  # batch 0 has begun already
        if cb._pending is not None:  # batch 0 asked for a checkpoint before the hook existed
            cb.sink.arm(cb._pending)
        for _ in range(self.skip):
            next(iterator)
        inner = self.fn if getattr(self.fn, "sets_up_at_first_step", False) else cb.model.train_function
        return inner(iterator)  # another callback's first-step set-up, wrapped before this one, runs too

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)


@dataclasses.dataclass(frozen=True)
class CaptureOptions:
    """When to checkpoint and how to shard; validated when built.

    ``every_n_batches``: checkpoint after every N optimizer steps (None: never by count).
    ``at_epoch_end``: also checkpoint after the last step of each epoch (as
    Keras' ``ModelCheckpoint(save_freq="epoch")``).
    ``min_shard_bytes``: tensors smaller than this are written whole by one rank.
    ``capture``: ``"auto"``, ``"native"`` or ``"graph"`` (see :class:`DeepFreezeCheckpoint`).
    """

    every_n_batches: int | None = None
    at_epoch_end: bool = True
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES
    capture: str = "auto"

    def __post_init__(self) -> None:
        if self.every_n_batches is not None and (not isinstance(self.every_n_batches, int)
                                                 or self.every_n_batches < 1):
            raise ConfigError(f"every_n_batches = {self.every_n_batches!r}: use a positive integer or None")
        if not isinstance(self.min_shard_bytes, int) or self.min_shard_bytes < 0:
            raise ConfigError(f"min_shard_bytes = {self.min_shard_bytes!r}: use an integer >= 0")
        if self.capture not in ("auto", "native", "graph"):
            raise ConfigError(f"capture = {self.capture!r}: use 'auto', 'native' (DeepFreeze's TF op) or 'graph'")
        if self.every_n_batches is None and not self.at_epoch_end:
            raise ConfigError("nothing would ever be checkpointed: set every_n_batches or at_epoch_end=True")


class DeepFreezeCheckpoint(RunView, tf.keras.callbacks.Callback):
    """Asynchronous sharded checkpoints during ``model.fit``; add it to ``callbacks``.

    Args:
      config: path of a VeloC INI file (see ``veloc_cfg/``), a :class:`~deepfreeze.Config`, or None (keyword
        arguments; mode async and a default scratch: docs/configuration.md).
      name: checkpoint name (``[a-zA-Z0-9_.]+``).
      every_n_batches: checkpoint every N training steps.
      at_epoch_end: also checkpoint at the end of every epoch.
      min_shard_bytes: tensors below this size are not split across ranks.
      verbose: 1 logs each checkpoint on rank 0.
      on_error: ``"raise"`` (default) stops training at a failed checkpoint (disk full,
        I/O error, backend failure); ``"warn"`` logs it, counts it in ``failures`` and
        training goes on. Either way nothing partial is committed.
      resume: restore the newest committed version when training begins and continue
        from its epoch and step (weights, optimizer state, data position): a job relaunched
        by a batch script just works. Bit-identical continuation needs a deterministic data
        order (``shuffle=False`` or a pipeline whose order depends only on the epoch).
        Versions an older run left above the restored one are retired.
      overwrite: start a new generation of ``name``: every committed version of it is retired
        at once (without ``resume`` or ``overwrite``, a name that already has committed
        versions is refused at train begin).
      lease_wait: seconds to wait for another live run holding the name (0: fail at once,
        naming the holder).
      capture: how the train step captures the shard (:mod:`deepfreeze.keras.hook`): ``"native"``
        (DeepFreeze's TF op, built by setup: one copy into a pre-faulted buffer), ``"graph"`` (a TF
        ``concat``, no compiled code) or ``"auto"`` (native when it loads, else graph).
      trust_owners: with ``resume``, also restore persistent files owned by these users (names or
        uids); by default only your own and root's are read (docs/guarantees.md, "Shared directories").
      save_optimizer: also checkpoint the optimizer's variables (slots, iteration counter),
        sharded and captured in the train step like the weights; False: weights only.
      engine: ``"builtin"`` (default; or ``$DEEPFREEZE_ENGINE``), ``"veloc"`` (shards go through a
        VeloC install found via ``DEEPFREEZE_VELOC_PREFIX``/``VELOC_LIB``) or ``"auto"`` (VeloC
        when found, else builtin). Same INI file, same files on disk, same restore.
      scratch_cls: advanced: the :class:`~deepfreeze.tiers.scratch.ScratchLevel` subclass that
        writes shards (other storage, fault injection).
      **overrides: INI keys set in code (``scratch=``, ``persistent=``, ``mode=`` ...).

    Rank and world size come from Horovod when it is initialized; otherwise one rank.
    When ``fit`` returns, the newest checkpoint is committed on scratch; call
    :meth:`wait` to also wait for the background flush to persistent.
    """

    def __init__(self, config: "str | Config | None" = None, name: str = "model", *,
                 every_n_batches: int | None = None, at_epoch_end: bool = True,
                 min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES, verbose: int = 0, on_error: str = "raise",
                 resume: bool = False, save_optimizer: bool = True, engine: str | None = None,
                 scratch_cls: "type | None" = None, overwrite: bool = False,
                 lease_wait: float = 0.0, trust_owners: "list[str | int] | None" = None,
                 capture: str = "auto", **overrides: Any) -> None:
        super().__init__()
        self.name = validate_name(name)
        _check_overrides(overrides)
        #: the run: argument checks, the on_error policy, the engine, the lease (deepfreeze.run.Run);
        #: begun at the first on_train_begin, ended by close()
        self._run = Run(config, self.name, resume=resume, overwrite=overwrite, lease_wait=lease_wait,
                        on_error=on_error, engine=engine, scratch_cls=scratch_cls, trust_owners=trust_owners,
                        verbose=verbose, **overrides)
        self._run.before_raise = self._remove_hook  # Keras skips on_train_end when a callback raises
        self._exit_registered = False
        self.save_optimizer = bool(save_optimizer)
        self._resume_pending = False  # resume once, when the run begins
        self.resumed_from: int | None = None  # version restored by resume=True, if any
        self._skip_steps = 0
        self._rebase = False
        self._deferred: _SetUpAtFirstStep | None = None  # set-up waits for the first step (unbuilt model)
        self._preloaded: tuple[Any] | None = None  # (Checkpoint or None,) picked by resume for a deferred set-up
        self.options = CaptureOptions(every_n_batches, at_epoch_end, min_shard_bytes, capture)
        self.config = self._run.config
        self.verbose = verbose
        self.rank, self.size = 0, 1
        self.sink: _hook.FusedSink | None = None
        self.plan: ShardPlan | None = None
        self.timings: list[dict[str, float]] = []
        #: seconds spent in this callback's batch hooks (begin + end) on each batch without a checkpoint
        self.quiet_times = array.array("d")
        self._pending: int | None = None  # the step the armed capture is for
        self._t_begin = 0.0  # seconds spent in on_train_batch_begin of the current batch
        self._first_batch = True
        self._epoch = 0
        self._epoch_base = 0
        self._spe = 1
        self._model_tensors = 0  # how many leading checkpointed tensors are model weights
        self._layers: dict | None = None  # the model's layer graph for `deepfreeze repo import` (manifest "layers")
        #: another callback of this fit on the same name and persistent directory, whose run, engine and
        #: capture this one shares (this one is then a *rider*: see :func:`_primary_for`)
        self._primary: DeepFreezeCheckpoint | None = None
        self._owner: DeepFreezeCheckpoint | None = None  # the one ridden on in the last fit (kept after it)
        self._riders: list[DeepFreezeCheckpoint] = []  # callbacks riding on this one (this fit)
        self._roles: list[DeepFreezeCheckpoint] = []  # who wanted the pending capture (self and/or riders)
        self._last_capture: int | None = None  # step of the newest capture handed on (checkpointed or not)
        #: captures not checkpointed because a writer was busy and only a publisher wanted them
        self.coalesced = 0
        self._held: tuple | None = None  # the newest coalesced capture (version, arrays, epoch, extra)

    # ------------------------------------------------------------------ keras events
    def on_train_begin(self, logs: dict | None = None) -> None:
        model = self.model
        opt = getattr(model, "optimizer", None)
        if opt is None or not callable(getattr(type(opt), "_update_step", None)) or not hasattr(opt, "build"):
            raise ConfigError(
                f"DeepFreezeCheckpoint hooks Keras 2.15 optimizers (tf.keras.optimizers.*), got "
                f"{type(opt).__name__}: compile the model with e.g. tf.keras.optimizers.SGD, not a "
                "tf.keras.optimizers.legacy optimizer (Horovod's DistributedOptimizer over one is fine)")
        self.rank, self.size = rank_and_size()
        self.config.check_directories()  # an unusable scratch/persistent path: one clear error now
        primary = _primary_for(model, self)
        if primary is not self:  # another callback of this fit owns the name: share its run, engine, capture
            self._primary = self._owner = primary
            primary._riders.append(self)
            if primary.plan is not None:
                self._attached(primary)
            return
        self._primary = self._owner = None
        started = not self._run.begun
        self._begin_run()
        try:
            self._set_up(model)
        except BaseException:
            if started:  # this call started the run: end it (release the lease)
                self._run.close()
            raise

    def _set_up(self, model: Any) -> None:
        """The rest of ``on_train_begin``: resume, the shard plan, the engine, the hook."""
        if not model.built or not model.weights:
            self._defer_setup()  # built (and restored) at the first step, from the input's spec
            return
        if self._resume_pending:
            self._resume_pending = False
            self._resume()
        variables, tensors, pinned = self._tensors(model)
        check_tensor_names(tensors, f"checkpoint {self.name!r}")  # no reserved name, no name twice
        self._model_tensors = len(model.weights)
        self._layers = _layer_record(model)
        plan = ShardPlan.build(tensors, self.size, min_shard_bytes=self.options.min_shard_bytes, pinned=pinned)
        digest = hashlib.sha256(json.dumps([plan.to_json(), [t.to_json() for t in tensors]]).encode()).digest()[:16]
        rows = allgather_bytes(digest + self.config.failure_domain.encode()[:200])
        for r, row in enumerate(rows):
            if row[:16] != digest:
                raise ModelMismatchError(f"rank {r} built a different model or shard plan than rank {self.rank}: "
                                         "every rank must build the same architecture")
        domains = [row[16:].decode(errors="replace") for row in rows]
        if self.engine is None or self.plan != plan:  # (the last fit's engine is closed under on_error)
            veloc = self._run.engine_kind == "veloc"
            comm = mpi_comm() if (self.config.ec_interval >= 0 or veloc) and self.size > 1 else None
            self._run.new_engine(plan, domains, comm)
        self.plan = plan
        if self.sink is not None:  # a previous fit's sink (removed at its end, unless that failed)
            _hook.detach(model.optimizer, self.sink)
        self.sink = _hook.FusedSink(f"checkpoint.{self.name}", plan, self.rank, variables,
                                    buffers=self.config.max_inflight + 1, native=self._native())
        self.sink.owner = self  # other sinks of the step (clones) find the run and name here
        _hook.attach(model.optimizer, self.sink)
        model.make_train_function(force=True)  # retrace (at the next step): the capture must be in the graph
        if self._skip_steps:
            model.train_function = _SkipBatches(model.train_function, self._skip_steps)
        spe = getattr(model, "_steps_per_execution", None)
        self._spe = int(spe.numpy()) if spe is not None else 1
        self._first_batch = True
        for rider in self._riders:
            rider._attached(self)
        self._attached(self)
        self._run.summary(plan, len(tensors))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self._primary is not None:
            return
        self._epoch = epoch
        # a resumed epoch starts at batch index _skip_steps (Keras numbers its batches from there);
        # the first batch re-bases on the index Keras gives it (fit may have been positioned by
        # someone else too, e.g. receive_clone)
        self._epoch_base = int(self.model.optimizer.iterations.numpy()) - self._skip_steps
        self._rebase = True
        self._skip_steps = 0
        if isinstance(getattr(self.model, "_training_state", None), _ResumePoint):
            self.model._training_state = None  # consumed by fit

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._primary is not None:
            return
        t0 = time.perf_counter()
        if self._rebase:
            self._rebase = False
            self._epoch_base = int(self.model.optimizer.iterations.numpy()) - batch
        steps = self.params.get("steps") if self.params else None
        last = batch + self._spe if not steps else min(batch + self._spe, steps)
        before, after = self._epoch_base + batch, self._epoch_base + last
        self._roles = [c for c in (self, *self._riders) if c._want_batch(before, after, last, steps)]
        want = bool(self._roles)
        if want and self._first_batch and self.size > 1:
            # Horovod's broadcast of rank 0's weights happens at the end of the first batch:
            # shards captured in it would come from different replicas.
            if self.rank == 0:
                log.info("DeepFreeze: skipping a checkpoint in the first batch (before the Horovod broadcast)")
            want = False
        self._first_batch = False
        if want:
            if self.sink is not None:  # else armed by the deferred set-up, before the step runs
                self._guard(self.sink.arm, after)
            self._pending = after
        self._t_begin = time.perf_counter() - t0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._primary is not None:
            return
        t0 = time.perf_counter()
        if self._pending is None or self.sink is None:  # (no sink: removed after a failure that was caught)
            self._pending = None
            self.quiet_times.append(self._t_begin + time.perf_counter() - t0)
            return
        target, self._pending = self._pending, None
        version = self._epoch_base + batch + 1
        if version == target:
            arrays: Any = self._capture(target)
        else:  # the execution ended before the armed step (a dataset of unknown length ran out)
            self.sink.disarm()
            arrays = self._capture_eager(version)
        t1 = time.perf_counter()
        if arrays is not None:
            self._checkpoint(version, arrays, t0 - self._t_begin, t1)
        else:  # a failed capture (on_error='warn'): still take part in the shared coalescing decision
            self._coalesce(self._roles or [self], failed=True)
            self._roles = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._primary is not None:
            return
        roles = [c for c in (self, *self._riders) if c._want_epoch_end(epoch)]
        if not roles:
            return
        step = int(self.model.optimizer.iterations.numpy())
        if self._last_capture != step and step > 0:
            # step count unknown in advance (e.g. a dataset of unknown length): slice now, eagerly
            t0 = time.perf_counter()
            arrays = self._capture_eager(step)
            if arrays is not None:
                self._roles = roles
                self._checkpoint(step, arrays, t0, time.perf_counter(), epoch_end=True)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._primary is not None:
            self._primary = None  # the next fit decides again
            return
        _release_primary(self.model, self)
        self._riders = []
        try:
            self._write_held()
            self._run.wait(persistent=False)  # committed at least on scratch
        finally:
            self._remove_hook()
            if isinstance(getattr(self.model, "train_function", None), _SetUpAtFirstStep):
                self.model.train_function = self.model.train_function.fn  # fit ended before its first step

    # ------------------------------------------------------------------ public
    def wait(self, timeout: float | None = None) -> None:
        """Block until every checkpoint taken so far is committed on persistent (or skipped by
        ``persistent_interval``); raises the first background error, once. With ``timeout``
        (seconds), raises :class:`~deepfreeze.BackendError` if that is not done by then."""
        self._run.wait(timeout, engine=self.engine if self.engine is not None else getattr(self._owner, "engine", None))

    def close(self) -> None:
        """Wait for the flushes, then release the writer thread, the backend connection and the
        lease on the name (the run ends here). A callback not closed when the interpreter exits
        is closed then (within 60 s)."""
        self._run.close()  # raises a pending background error once; shuts down and releases either way

    def _at_exit(self) -> None:
        """The exit hand-off: a run not closed is closed at exit (its flushes waited for, at most
        60 s), as :meth:`deepfreeze.torch.Checkpointer.close` is (:meth:`deepfreeze.run.Run.at_exit`)."""
        if self._run.begun:
            self._run.close_at_exit(self.close, 60.0, who="DeepFreezeCheckpoint.close()", pending=None,
                                    hint="callback.close()")

    @property
    def run_id(self) -> str | None:
        """Id of this callback's run (made at the first ``on_train_begin``), or None before."""
        if self._owner is not None:
            return self._owner.run_id
        return self._run.info.id if self._run.begun and self._run.info is not None else None

    # ------------------------------------------------------------------ roles (shared capture)
    #: every capture this callback wants must be checkpointed (a publisher's may be coalesced)
    _checkpoints = True

    def _want_batch(self, before: int, after: int, last: int, steps: "int | None") -> bool:
        """Does this callback want the state after global step ``after`` (the batch covering
        steps ``(before, after]``, ending at batch index ``last`` of an epoch of ``steps``)?"""
        n = self.options.every_n_batches
        want = bool(n) and after // n > before // n
        return want or (self.options.at_epoch_end and bool(steps) and last >= steps)

    def _want_epoch_end(self, epoch: int) -> bool:
        """Does this callback want the state at the end of ``epoch`` (if not captured already)?"""
        return self.options.at_epoch_end

    def _attached(self, owner: "DeepFreezeCheckpoint") -> None:
        """Called once the capture's owner (this callback, or the one it rides on) is set up."""

    def _captured(self, owner: "DeepFreezeCheckpoint", version: int, arrays: Any) -> None:
        """Called by the capture's owner with each capture this callback wanted, after the
        engine's hand-off (``arrays``: a FusedShard or this rank's flat pieces)."""

    # ------------------------------------------------------------------ internals
    def _tensors(self, model: Any) -> tuple[list, list[TensorSpec], list[int]]:
        """Variables to checkpoint (model weights, then optimizer variables), their specs and the
        ids pinned whole to rank 0 (:func:`deepfreeze.keras._state.train_state`); slots are split
        like their weight."""
        st = train_state(model, optimizer=self.save_optimizer)
        return st.variables, st.specs, st.pinned

    def _resume(self) -> None:
        """Restore the newest version every rank can recover (collectively over the ranks'
        scratch directories, partner copies and parity, then persistent) and tell fit where to
        continue; the first train call skips the batches already trained on. For a deferred
        set-up, the version picked when fit began (:meth:`_resume_pick`) is restored."""
        if self._preloaded is not None:
            (ck,), self._preloaded = self._preloaded, None
        else:
            ck = self._resume_pick()
        if ck is not None:
            self._resume_restore(ck)

    def _resume_pick(self) -> Any:
        """Load the version to resume from (collective) and tell fit where to continue; the
        model is not touched. Returns the :class:`~deepfreeze.Checkpoint`, or None (nothing
        committed: start fresh)."""
        from ..loader import list_versions
        from ._dist import broadcast_int
        comm = mpi_comm()
        if comm is not None or self.size == 1:
            ck = self._run.pick_resume(comm, trust_owners=self._run.trust_owners)
        else:  # several ranks without MPI (Horovod over Gloo): rank 0 picks, every rank reads it
            versions = (list_versions(self.config, self.name, trust_owners=self.trust_owners)
                        if self.rank == 0 else {})
            picked = broadcast_int(max(versions) if versions else -1)
            ck = self._run.pick_resume(None, version=picked, trust_owners=self.trust_owners) if picked >= 0 else None
            if picked < 0 and self.rank == 0:
                log.warning("DeepFreeze: resume=True but no committed version of %r: starting fresh", self.name)
        if ck is None:
            return None
        version = ck.version
        m = ck.manifest
        if m.get("epoch_complete") or "epoch_step" not in m:
            epoch, step = m["epoch"] + 1, 0
        else:
            epoch, step = m["epoch"], int(m["epoch_step"])
        self.model._training_state = _ResumePoint(epoch, step)
        self._skip_steps = step
        self.resumed_from = version
        if self.rank == 0:  # epochs as Keras prints them ("Epoch 1/3" is epoch index 0)
            at = (f"at the start of epoch {epoch + 1}" if step == 0
                  else f"in epoch {epoch + 1} after its first {step} batch{'es' if step > 1 else ''}")
            log.warning("DeepFreeze: resumed %r from v%d (%s, step %d): continuing %s", self.name, version,
                        ck.level, ck.step, at)
        return ck

    def _resume_restore(self, ck: Any) -> None:
        """Put the picked version's weights (and optimizer state) into the built model."""
        restored_opt = apply_checkpoint(self.model, ck, optimizer=self.save_optimizer)
        if self.save_optimizer and not restored_opt and self.rank == 0:
            log.warning("DeepFreeze: %r v%d holds weights only: the optimizer state starts fresh", self.name,
                        ck.version)
        if not restored_opt:
            self.model.optimizer.iterations.assign(ck.step)

    def _begin_run(self) -> None:
        """Start the run at the first ``on_train_begin`` (collective): its id, the lease on the
        name, ``overwrite``; several ``fit`` calls are one run, resumed (if asked) once."""
        if not self._run.begun:
            self._run.begin(run_comm())
            self._resume_pending = self.resume
            if not self._exit_registered:
                self._exit_registered = True
                self._run.at_exit(self._at_exit)

    def _defer_setup(self) -> None:
        """The model is not built yet: set up at the first step (:class:`_SetUpAtFirstStep`).
        With ``resume``, the version is picked now, so fit starts at its epoch and step, and the
        optimizer's step counter is set now (batch numbering); the weights are restored at the
        first step, once the model is built, before that step runs."""
        model = self.model
        if isinstance(model.train_function, _SetUpAtFirstStep):  # left by a fit that stopped before its first step
            model.train_function = model.train_function.fn
        if self._resume_pending and self._preloaded is None:
            ck = self._resume_pick()
            self._preloaded = (ck,)
            if ck is not None:
                model.optimizer.iterations.assign(ck.step)
        spe = getattr(model, "_steps_per_execution", None)
        self._spe = int(spe.numpy()) if spe is not None else 1
        self._first_batch = True
        self._deferred = _SetUpAtFirstStep(self, model.train_function, self._skip_steps)
        model.train_function = self._deferred
        if self.verbose and self.rank == 0:
            log.warning("DeepFreeze: the model is not built yet: it is built from the first batch's shape and "
                        "set up%s before the first step", " and restored" if self.resume else "")

    def _build_from(self, iterator: Any) -> None:
        """Build the model from the element spec of ``fit``'s input iterator (nothing is drawn)."""
        build_from_spec(self.model, getattr(iterator, "element_spec", None), "DeepFreezeCheckpoint")

    def _native(self) -> Any:
        """The native capture op's module per ``capture``, or None for the graph fallback."""
        if self.options.capture == "graph":
            return None
        try:
            from . import native
        except ImportError as e:  # a copy of the package without the op's Python side
            native, why = None, str(e)
        else:
            if native.load() is not None:
                return native
            why = native.unavailable_reason()
        if self.options.capture == "native":
            raise ConfigError(f"capture='native' but DeepFreeze's TF op cannot be loaded: {why} "
                              "(build it with `python -m deepfreeze.keras.native build`, or use capture='auto')")
        return None

    def _capture(self, step: int) -> Any:
        """The armed capture of ``step`` (a FusedShard), or None after a failure under on_error=warn."""
        try:
            return self.sink.read(step)
        except DeepFreezeError as e:
            self._guard(_raise, e)
            return None

    def _capture_eager(self, step: int) -> "list | None":
        """This rank's pieces, sliced from the variables now (outside the graph)."""
        if self.sink is None:
            return None
        out = []
        for s in self.sink.layout.segments:
            value = np.asarray(self.sink.variables[s.piece.tensor_id].value())
            out.append(value.reshape(-1)[s.piece.start:s.piece.stop])
        return out

    def _remove_hook(self) -> None:
        if self.sink is None:
            return
        self._pending = None
        _hook.detach(self.model.optimizer, self.sink)
        self.model.make_train_function(force=True)
        self.sink = None

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> bool:
        """``fn`` under the run's ``on_error`` policy (:meth:`deepfreeze.run.Run.guard`; the hook is
        removed before a raise)."""
        return self._run.guard(fn, *args, **kwargs)

    def _writer_busy(self) -> bool:
        """This rank's vote in the coalescing decision: would a checkpoint now wait for its writer?"""
        return self.engine is None or self.engine.saturated()

    def _coalesce(self, roles: list, failed: bool = False) -> bool:
        """Skip the persistent copy of a capture only a publisher wanted? One decision per version,
        the same on every rank (so a version is written by all ranks or none): a rank's writer is
        busy (or its capture failed) -> every rank skips. Decided by an all-reduce of the ranks'
        votes (:func:`~deepfreeze.keras._dist.any_rank`, in the training thread; only for
        publisher-only captures, which every rank makes at the same steps). A checkpoint
        callback's own versions are never skipped."""
        if any(c._checkpoints for c in roles):
            return False
        busy = failed or self._writer_busy()
        if self.size > 1:
            from ._dist import any_rank
            busy = any_rank(busy, what=f"the skip decision of {self.name!r} v{self._last_capture}")
        return busy

    def _write_held(self) -> None:
        """Train end: the newest capture was coalesced (the same on every rank): write it now, so
        after ``wait()`` the newest published version is restorable."""
        held, self._held = self._held, None
        if held is None or self.engine is None:
            return
        version, arrays, epoch, extra = held
        if self._run.last_version is not None and version <= self._run.last_version:
            return
        self._run.hand_off(version, arrays, step=version, epoch=epoch, extra=extra)
        self._run.last_version = version
        self.coalesced -= 1

    def _checkpoint(self, version: int, arrays: list, t0: float, t1: float, epoch_end: bool = False) -> None:
        epoch_step = version - self._epoch_base
        epoch_complete = epoch_end or (bool(self.params.get("steps")) and epoch_step >= self.params["steps"])
        extra = {"epoch_complete": epoch_complete, "epoch_step": epoch_step, "model_tensors": self._model_tensors}
        if self._layers is not None:
            extra["layers"] = self._layers
        parent = getattr(self.model, "_deepfreeze_parent", None)  # set by receive_clone on a cloned model
        if parent is not None:
            why = parent_problem(parent)
            if why is None:
                extra["parent"] = dict(parent)
            else:
                self._guard(_raise, ConfigError(
                    f"model._deepfreeze_parent = {str(parent)[:200]} is malformed ({why}), so checkpoint "
                    f"{self.name!r} cannot record the parent it was cloned from: leave it as "
                    "deepfreeze.keras.receive_clone sets it ({'name': str or None, 'run': run id, 'step': int})"))
        roles, self._roles = self._roles or [self], []
        self._last_capture = version
        if not self._coalesce(roles):
            self._held = None  # a newer version is written: the held one is superseded (newer wins)
            self._run.hand_off(version, arrays, step=version, epoch=self._epoch, extra=extra)  # the lease first
            self._run.last_version = version
        else:  # only a publisher wanted it and a writer is busy: the persistent copy coalesces to a newer one
            self.coalesced += 1
            self._held = (version, arrays, self._epoch, extra)  # written at train end if nothing newer is
        for c in roles:
            c._captured(self, version, arrays)
        t2 = time.perf_counter()
        self.timings.append({"version": version, "time": time.time() - (t2 - t0), "capture_s": t1 - t0,
                             "blocking_s": t2 - t0})
        self._run.note_stall(version, [("capturing", t1 - t0), ("handing off to the engine", t2 - t1)],
                             setup_inside=False)  # the first checkpoint over STALL_WARN says what took the time
        if self.verbose and self.rank == 0:
            log.warning("DeepFreeze: checkpoint %s v%d handed off in %.1f ms", self.name, version, 1e3 * (t2 - t0))


_PRIMARIES: "weakref.WeakKeyDictionary[Any, dict[tuple[str, str], DeepFreezeCheckpoint]]" = weakref.WeakKeyDictionary()


def _owner_key(cb: DeepFreezeCheckpoint) -> tuple[str, str]:
    """One name on one persistent directory: what one run (and one capture) owns."""
    return cb.name, os.path.realpath(cb.config.persistent)


def _primary_for(model: Any, cb: DeepFreezeCheckpoint) -> DeepFreezeCheckpoint:
    """The callback of this fit that owns ``cb``'s name on ``cb``'s persistent directory: the first
    one whose ``on_train_begin`` ran (it holds the run, the lease, the engine and the capture; later
    ones on the same name ride on it). Returns ``cb`` itself when it is the first."""
    key = _owner_key(cb)
    owners = _PRIMARIES.setdefault(model, {})
    owner = owners.get(key)
    if owner is None or owner is cb:
        owners[key] = cb
        return cb
    if (owner.config.scratch, owner.config.mode) != (cb.config.scratch, cb.config.mode):
        raise ConfigError(f"two callbacks of this fit use the name {cb.name!r} on {cb.config.persistent} with "
                          "different configurations: one job on one name shares one engine; give both the same "
                          "config (or use another name)")
    return owner


def _release_primary(model: Any, cb: DeepFreezeCheckpoint) -> None:
    owners = _PRIMARIES.get(model)
    if owners is not None and owners.get(_owner_key(cb)) is cb:
        del owners[_owner_key(cb)]


def _layer_record(model: Any) -> "dict | None":
    """The manifest's ``"layers"`` record (:mod:`deepfreeze.repo.importer`): the model's compact
    layer graph and the checkpoint tensor (an index into ``model.weights``, which lead the
    checkpoint's tensors) of each layer weight. None, with a warning, for a model whose graph
    cannot be computed: checkpointing goes on, ``deepfreeze repo import`` then needs ``--model``."""
    from .repo import layer_record
    try:
        rec = layer_record(model)
    except Exception as e:  # an exotic model must not stop checkpointing
        log.warning("DeepFreeze: the layer graph of model %r could not be computed (%s: %s); checkpoints are "
                    "written without it ('deepfreeze repo import' will need --model)", getattr(model, "name", "?"),
                    type(e).__name__, e)
        return None
    return {"graph": rec["graph"], "tensors": rec["tensors"]}
