"""``Checkpointer``: DeepFreeze for PyTorch DDP, captured in the optimizer step.

No change to the training loop: the checkpointer is a sink of the model's and optimizers'
:class:`~deepfreeze.torch.hook.StepHook` (one set of torch hooks, shared with any other sink of the
same model and optimizers). What a run owns (argument checks, ``on_error``, the engine, the lease,
``wait``/``close``, the exit hand-off) is :class:`deepfreeze.run.Run`'s.

* A **step** is an ``optimizer.step()`` that ran: the post-hook of the *last* optimizer given
  (the one the loop steps last) counts it. A step GradScaler skipped (inf/NaN gradients) never
  calls ``optimizer.step()`` and is not counted; with gradient accumulation a step is one
  ``optimizer.step()``. The version of a checkpoint is the step count after it.
* **Capture** (post-hook of a checkpoint step): this rank's pieces of every replicated tensor
  (parameters and optimizer state: every DDP rank holds them bit-identical after the step) are
  copied into a pooled buffer laid out as the rank's shard file
  (:class:`~deepfreeze.fused.FusedLayout`); with ``overlap=True`` by a background thread
  ``deepfreeze-capture-r<rank>`` while the next forward and backward run (CUDA tensors: by
  device-to-host copies on a side stream into pinned buffers, :mod:`deepfreeze.torch._cuda`,
  whose event the next pre-hook makes the stream and the host wait for). The next
  ``optimizer.step()`` of any of the optimizers waits for that copy first (a pre-hook), then
  checks each source tensor's ``_version``: a tensor changed in place during the copy (by
  anything but the optimizer) makes the version *torn*: it is not written
  (:class:`~deepfreeze.errors.CaptureTornError` under ``on_error``), never a wrong shard.
* What is not written by the optimizer is snapshotted synchronously: in the post-hook the
  module buffers (pinned to rank 0, whose buffers DDP broadcasts at the next forward), the RNG
  states of torch, numpy and Python of this rank, and the ``state=`` objects that are not
  schedulers or GradScalers; at the next pre-hook (or ``wait``/``close``), after the loop's
  ``scheduler.step()`` and ``scaler.update()`` that follow ``optimizer.step()``, the
  optimizers' ``param_groups`` and non-tensor state, the LR schedulers and the GradScalers
  (taken at the model's next forward pre-hook: a step GradScaler skips never reaches a
  pre-hook, while the loop steps the schedulers again).
  Both parts go into this rank's state record (:mod:`deepfreeze.torch._state`), which is one
  more piece of the rank's shard; then the buffer goes to the engine.
* The **shard plan** is built at the first checkpoint (optimizers create their state lazily at
  their first step) and checked at every checkpoint, collectively: a changed tensor list
  (lazily created state, ``add_param_group``) or a state record outgrowing its reserved room
  makes a new plan (and engine) from that version on, logged once per change.

The capture itself (the buffers, the copy, CUDA, the ``_version`` guard, the plan, the state
records) is :class:`deepfreeze.torch.capture.Capture`'s; the Checkpointer is its policy: which
steps, the engine, ``on_error``, the loop's boundaries, ``wait``/``close``.

**Subscribers** (:class:`~deepfreeze.torch.capture.CaptureSubscriber`, :meth:`Checkpointer.subscribe`):
the steps a subscriber wants are captured too (one capture per step, whoever wants it); each
finished, checked capture is handed to the engine (a step only subscribers wanted: when every
rank's writer has room, else coalesced, :attr:`coalesced`) and then to the subscribers that
wanted it. The stream :class:`deepfreeze.torch.Publisher` subscribes for :meth:`wait` and
:meth:`close` only: it wants no capture (it copies the live tensors, a
:class:`~deepfreeze.torch.capture.LiveSubscriber`).

Every checkpoint step costs two small all-gathers over the checkpointer's own gloo group
(plan check in the post-hook, write decision in the next pre-hook), so every rank writes a
version or none does.

**FSDP2** (``fully_shard`` on a 1-D mesh of every rank): parameters and the optimizer state
shaped like them are DTensors sharded on dim 0 (``torch.chunk``: uneven, some shards empty).
Each rank captures its own local shard as it is: the plan takes the shards' flat bounds as given
(:meth:`~deepfreeze.shardplan.ShardPlan.build`'s ``given``), the manifest records global shapes
and offsets, and the copy translates the piece's global offsets to the local tensor; the
``_version`` guard watches the DTensor too (the optimizer's in-place updates count there).
Phase-b records never call the model's ``state_dict()`` (FSDP2's forward has unsharded
parameters in place; FQNs come from the last capture). HSDP and tensor parallelism raise
:class:`~deepfreeze.errors.ConfigError` when the checkpointer is built
(:func:`deepfreeze.torch._state.check_layout`).
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any, Sequence

import torch

from ..config import Config, validate_name
from ..errors import ConfigError
from ..fused import FusedShard
from ..run import Run, RunView
from ..shardplan import DEFAULT_MIN_SHARD_BYTES, ShardPlan
from . import _loop, _state
from .capture import Capture, Captured, CaptureSubscriber, Pending, StateRecords
from .hook import Sink, hook_for
from ._dist import TorchComm, make_comm, node_domain, rank_and_size

__all__ = ["Checkpointer"]

log = logging.getLogger("deepfreeze")


class Checkpointer(RunView, Sink):
    """Asynchronous sharded checkpoints of a DDP or FSDP2 model and its optimizers, captured in the step.

    Args:
      model: the model (``DistributedDataParallel``, a module sharded with FSDP2's ``fully_shard``
        on a 1-D mesh of every rank, or a plain module).
      optimizer: an optimizer or a sequence of them, in the order the loop steps them (the last
        one's steps are counted).
      config: path of a VeloC INI file, a :class:`~deepfreeze.Config`, or None (the default: keyword
        arguments and ``VELOC_*``; mode async, scratch ``$DEEPFREEZE_SCRATCH`` else
        ``/var/tmp/deepfreeze-<uid>/scratch``: docs/configuration.md).
      name: checkpoint name (``[a-zA-Z0-9_.]+``).
      every_n_steps: checkpoint after every N optimizer steps (None: only :meth:`checkpoint`).
      resume: restore the newest committed version now (collective: every rank's scratch,
        partner copies, parity, then persistent) and continue from it; :attr:`start_step` is
        its step (0 when there is none).
      overwrite: start a new generation of ``name`` (every committed version is retired).
      state: ``{name: object}`` of extra state with ``state_dict()``/``load_state_dict()``
        (``torch.distributed.checkpoint.stateful.Stateful``): LR schedulers, GradScaler, a data
        position. Saved per rank; restored on the same rank at the same world size (rank 0's
        elsewhere).
      overlap: copy the replicated pieces in a background thread while the next forward and
        backward run (False: in the post-hook).
      on_error: ``"raise"`` (the failing ``optimizer.step()`` raises) or ``"warn"`` (logged,
        counted in :attr:`failures`, training goes on).
      min_shard_bytes, lease_wait, trust_owners, engine, scratch_cls: the smallest piece of the
        shard plan, seconds to wait for another run's lease on ``name``, the owners trusted when
        reading, the flush engine, the scratch level's class (docs/api.md).
      strict: with ``resume``, a checkpoint whose model tensors, optimizers (number, classes,
        parameter groups) or ``state=`` keys differ from this run's is a ModelMismatchError before
        anything is loaded (True), or loads what matches and lists the rest in :attr:`skipped`
        (False).
      start_step: the step counter starts at this step (an int >= 0) instead of 0, for a model
        and optimizers restored from elsewhere (``dcp.load``, a ``torch.load`` file): the steps,
        and so the versions, continue from it (:attr:`start_step`). With ``resume=True`` the
        resumed version's step wins when the name has one (a warning when it differs from
        ``start_step``); ``start_step`` serves when it has none.
      save_last: a normal :meth:`close` (and the Lightning and Hugging Face callbacks' end of
        training) checkpoints the last completed step when it is newer than the newest version,
        as Lightning's ``ModelCheckpoint(save_last=True)``; never with an exception in flight, in
        the exit hand-off, or after any rank reported a checkpoint error (raised, or counted in
        :attr:`failures`). False: only the versions of ``every_n_steps`` and :meth:`checkpoint`.
      **overrides: INI keys set in code (``scratch=``, ``persistent=``, ``mode=`` ...).

    Build it on every rank after ``dist.init_process_group`` and the DDP wrapper (collective).
    Its capture is :attr:`capture` (:class:`~deepfreeze.torch.capture.Capture`, with the state
    records :attr:`records`); what else receives the captures subscribes (:meth:`subscribe`).
    """

    #: the class of :attr:`records` (a subclass may add to each rank's state record: an import's
    #: source, :mod:`deepfreeze.torch.dcp_import`)
    records_cls: "type[StateRecords]" = StateRecords

    def __init__(self, model: torch.nn.Module, optimizer: "torch.optim.Optimizer | Sequence[torch.optim.Optimizer]",
                 config: "str | Config | None" = None, name: str = "model", *, every_n_steps: int | None = None,
                 resume: bool = False, overwrite: bool = False, state: "dict[str, Any] | None" = None,
                 overlap: bool = True, on_error: str = "raise", min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
                 lease_wait: float = 0.0, trust_owners: "list[str | int] | None" = None, engine: str | None = None,
                 scratch_cls: "type | None" = None, verbose: int = 0, strict: bool = True,
                 close_timeout: float = 60.0, start_step: int | None = None, save_last: bool = True,
                 **overrides: Any) -> None:
        if start_step is not None and (type(start_step) is not int or start_step < 0):
            raise ConfigError(f"start_step = {start_step!r}: use the step the restored state was saved at (an int "
                              ">= 0), or None")
        opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
            raise ConfigError("Checkpointer: optimizer must be a torch.optim.Optimizer or a sequence of them")
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ConfigError(f"every_n_steps = {every_n_steps!r}: use a positive integer or None")
        if not isinstance(min_shard_bytes, int) or min_shard_bytes < 0:
            raise ConfigError(f"min_shard_bytes = {min_shard_bytes!r}: use an integer >= 0")
        self.state = _state.statefuls(state)
        if isinstance(close_timeout, bool) or not isinstance(close_timeout, (int, float)) or not close_timeout > 0:
            raise ConfigError(f"close_timeout = {close_timeout!r}: use a positive number of seconds")
        self.close_timeout = float(close_timeout)
        if not isinstance(save_last, bool):
            raise ConfigError(f"save_last = {save_last!r}: use True (close() checkpoints the last step) or False")
        self.save_last = save_last
        self.name = validate_name(name)
        #: the run: argument checks, the on_error policy, the engine, the lease (deepfreeze.run.Run)
        self._run = Run(config, self.name, resume=resume, overwrite=overwrite, lease_wait=lease_wait,
                        on_error=on_error, engine=engine, scratch_cls=scratch_cls, trust_owners=trust_owners,
                        verbose=verbose, **overrides)
        #: how many model tensors are FSDP2 shards (HSDP and tensor parallelism are refused here)
        self.sharded = _state.check_layout(model)
        self.model, self.optimizers = model, opts
        self.every_n_steps, self.overlap = every_n_steps, bool(overlap)
        self.min_shard_bytes, self.verbose = min_shard_bytes, verbose
        self.strict = bool(strict)
        #: what resume=True with strict=False left out of the checkpoint (empty: everything restored)
        self.skipped: list[str] = []
        self.config = self._run.config
        self.config.check_directories()
        self.rank, self.size = rank_and_size("deepfreeze.torch.Checkpointer")
        #: per checkpoint: version, seconds in the post-hook, waited in the next pre-hook, hand-off
        self.timings: list[dict[str, float]] = []
        Capture.check_devices(model)  # refused: meta, mps ...
        #: the capture points on the model and optimizers, shared with other sinks (deepfreeze.torch.hook)
        self.hook = hook_for(model, opts)
        self._closed = False
        #: the subscribers of this capture (:meth:`subscribe`; a :class:`deepfreeze.torch.Publisher`, for wait/close)
        self._subscribers: list[CaptureSubscriber] = []
        self._roles: dict[int, tuple[bool, list]] = {}  # captured step -> (checkpoint wanted, riders wanting it)
        self._explicit = False  # inside checkpoint(): the capture is a checkpoint whoever else wants it
        #: captures only a rider wanted whose persistent copy was skipped (a writer was busy)
        self.coalesced = 0
        self._held: "tuple[int, FusedShard, dict] | None" = None  # the newest coalesced capture
        self._order_warned = False
        self._boundary = False  # the loop marks its iterations' ends (end_iteration/iterate): records are taken there
        self._boundary_warned = False
        self._loop = _loop.Passes()  # the passes of iterate()
        #: the pass of :meth:`iterate` (an epoch, counted from 0) the resumed checkpoint was taken in
        #: (0 without resume, or when that checkpoint was not taken inside ``iterate``)
        self.start_epoch = 0
        self.comm = make_comm()  # the training thread's group (collective)
        self._bg_comm = None
        explicit = any(k == "failure_domain" for k, _ in self.config.origins)
        domain = node_domain(self.config.failure_domain, explicit)
        self.domains = [b.decode() for b in self.comm.allgather(domain.encode()[:200])]
        if self.size > 1 and self.config.ec_interval >= 0 and self._run.engine_kind == "builtin":
            self._bg_comm = TorchComm()  # the writer thread's group (collective)
        #: the records and the capture: finished shards with their state records (deepfreeze.torch.capture)
        self.records = self.records_cls(model, opts, self.state, self._loop, rank=self.rank, size=self.size,
                                        sharded=bool(self.sharded))
        self.capture = Capture(model, opts, name=self.name, rank=self.rank, size=self.size, comm=self.comm,
                               records=self.records, overlap=self.overlap, min_shard_bytes=min_shard_bytes,
                               max_inflight=self.config.max_inflight, on_plan=self._on_plan, guard=self._guard)
        #: versions not written because a tensor changed during their capture
        self.torn: list[int] = self.capture.torn
        self._run.begin(self.comm)
        try:
            #: the step to continue from (the resumed version's, else ``start_step``, else 0)
            self.start_step = 0
            #: the version restored by resume=True, or None
            self.resumed_from: int | None = None
            if resume:
                self._resume()
            if start_step is not None:
                if self.resumed_from is None:
                    self.start_step = start_step
                elif start_step != self.start_step and self.rank == 0:
                    log.warning("DeepFreeze: %r resumed from v%d (step %d): start_step=%d is not used (a resumed "
                                "version's step wins)", self.name, self.resumed_from, self.start_step, start_step)
            self.step = self.start_step
            self.hook.subscribe(self)
        except BaseException:
            self._run.close()
            self.capture.close()
            raise
        self._run.at_exit(self._at_exit)

    # ------------------------------------------------------------------ hooks
    def before_step(self, opt: Any, args: Any, kwargs: Any) -> Any:
        p = self.capture.pending
        if p is None:
            return None
        closure = kwargs.get("closure", args[0] if args else None)
        if not callable(closure):
            self._finish_before_update(opt, p)
            return None

        def finish_after(*a: Any, **k: Any) -> Any:
            # optimizer.step(closure): the forward and backward run inside it (Lightning, LBFGS); the
            # copy overlaps them and is waited for after them, before the update
            out = closure(*a, **k)
            if self.capture.pending is p:
                self._finish_before_update(opt, p)
            return out
        if "closure" in kwargs:
            return args, {**kwargs, "closure": finish_after}
        return (finish_after, *args[1:]), kwargs

    def _finish_before_update(self, opt: Any, p: Pending) -> None:
        """Finish ``p`` before ``opt`` updates its tensors (warnings about the loop's order first)."""
        if p.record_b is None and opt is not self.optimizers[-1] and not self._order_warned:
            self._order_warned = True  # this optimizer steps after the counted one within an iteration
            log.warning("DeepFreeze: optimizer %d (%s) stepped after the capture of v%d and before the model's next "
                        "forward: the checkpoint holds its state before that step. Pass the optimizers to the "
                        "Checkpointer in the order the loop steps them (the last one's steps are counted)",
                        self.optimizers.index(opt), type(opt).__name__, p.step)
        if self._boundary and not p.at_boundary and not self._boundary_warned:
            self._boundary_warned = True  # end_iteration() was called before, but not after this checkpoint step
            log.warning("DeepFreeze: %r v%d: the next optimizer.step() came before end_iteration(): its state "
                        "record (state= objects, schedulers, RNG) is taken now, in the next iteration. Call "
                        "end_iteration() at the end of every iteration, or iterate over ckpt.iterate(loader)",
                        self.name, p.step)
        self._finish()

    def before_forward(self, module: Any, args: Any) -> None:
        if not self._boundary:
            self.capture.take_record_b()  # the pending capture's, unless taken

    def after_step(self, opt: Any) -> None:
        p = self.capture.pending
        if p is not None and p.step == self.step:
            self._finish()  # an optimizer that did not call its closure: updated during the capture (torn)
        self.step += 1
        if self._wants(self.step) or any(self._wanted_by(r, self.step) for r in self._subscribers):
            self._capture(self.step)

    def _wants(self, step: int) -> bool:
        """Whether this checkpointer checkpoints the state after optimizer step ``step`` (every
        ``every_n_steps``; riders add the steps they want captured: :meth:`_capture`)."""
        return bool(self.every_n_steps) and step % self.every_n_steps == 0

    # ------------------------------------------------------------------ public
    def end_iteration(self) -> None:
        """Mark the end of a training iteration: call it after ``optimizer.step()``,
        ``scheduler.step()``, ``scaler.update()`` and the loop's own bookkeeping (a data position
        advanced at the end of the iteration), before the next batch is fetched.

        From the first call on, the state record of a checkpoint step (``state=`` objects, LR
        schedulers, GradScalers, RNG states, ``param_groups``, the position of :meth:`iterate`)
        is taken at the end of that step's iteration instead of in the hooks; the weights and
        optimizer tensors stay those of the checkpoint step. Cheap when nothing is pending
        (one attribute test); not collective."""
        self._boundary = True
        p = self.capture.pending
        self.capture.take_records()  # the pending capture's, unless taken at the boundary
        if p is not None and self._roles.get(p.step, (True, []))[1]:
            self._finish()  # a rider (publisher) wants it: finished now (collective: every rank ends the iteration)

    def iterate(self, iterable: Any) -> Any:
        """Iterate over ``iterable`` (one pass: an epoch of a ``DataLoader``) with
        :meth:`end_iteration` called before each next item is fetched and when it is exhausted::

            for epoch in range(ckpt.start_epoch, epochs):
                sampler.set_epoch(epoch)
                for x, y in ckpt.iterate(loader):
                    ...  # forward, backward, optimizer.step(), scheduler.step()

        The checkpoint holds the pass's position (items fetched so far). On resume, the first
        pass skips what the checkpoint's pass had fetched: a loader with ``state_dict()`` and
        ``load_state_dict()`` (torchdata's ``StatefulDataLoader``) is restored to its saved state
        and skips by itself; any other iterable is replayed from the start of its pass (RNG
        states, and the loader's ``generator``, set to what they were when the pass began, so
        the same seeds, shuffle and worker seeds are drawn) and the items already seen are
        fetched and dropped (loaded again: that costs their loading time), then the RNG states
        of the checkpoint are set again. Wrap only the training loader; a ``DataLoader`` with
        ``persistent_workers=True`` cannot be replayed this way (its workers' RNG carries over
        from earlier epochs): use ``StatefulDataLoader``."""
        self._boundary = True
        return self._loop.iterate(iterable, self.end_iteration, self.name)

    def checkpoint(self) -> None:
        """Checkpoint the state after the current step now (collective; outside the step)."""
        p = self.capture.pending
        if p is not None and p.step == self.step:
            riders = self._roles.get(self.step, (True, []))[1]
            self._roles[self.step] = (True, riders)  # captured for a rider: now also a checkpoint (never skipped)
            return
        if self._held is not None and self._held[0] == self.step:
            self._write_held()  # captured for a rider and its persistent copy skipped: written now
            return
        if self._run.last_version == self.step:
            return  # this step is captured already
        self._explicit = True
        try:
            self._capture(self.step)
        finally:
            self._explicit = False
        self._finish()

    def wait(self, timeout: float | None = None) -> None:
        """Finish a pending capture (riders: publish it, write the newest skipped copy, wait for
        their copies) and block until every checkpoint is committed on persistent."""
        if self.capture.pending is not None:
            self._finish_at_boundary()
        self._write_held()
        for r in list(self._subscribers):
            self._guard(r.on_wait, timeout)
        self._run.wait(timeout)

    def close(self) -> None:
        """Checkpoint the last completed step (``save_last``), finish a pending capture, wait for
        the flushes, release the hooks, threads and the lease (collective: every rank calls it).

        The last step is checkpointed when it is newer than the newest version, ``close`` is not
        called with an exception in flight (from an ``except`` or ``finally`` block while one
        propagates, or ``with`` exiting by one) and no rank reported a checkpoint error."""
        self._close(final=self.save_last and sys.exc_info()[1] is None)

    def _close(self, final: bool) -> None:
        """:meth:`close`; ``final``: may checkpoint the last step (one allgather decides it for every rank)."""
        if self._closed:
            return
        lost = None
        self._closed = True
        try:
            if final and self._group_alive():
                self._save_last()
            if self.capture.pending is not None:
                if not self._group_alive():
                    lost = self.capture.drop()  # its hand-off is collective: too late
                else:
                    self._finish_at_boundary()
            self._write_held()  # the newest capture whose persistent copy a busy writer skipped
        finally:
            riders, self._subscribers = self._subscribers, []
            for r in riders:  # subscribers (publishers) of this capture stop with it
                r.on_close()
            self._held = None
            self.hook.unsubscribe(self)
            try:
                self._run.close()  # the engine (its flushes), then the lease
            finally:
                self.capture.close()
                for comm in (self._bg_comm, self.comm):
                    if hasattr(comm, "close"):
                        comm.close()
        if lost is not None:
            raise ConfigError(f"Checkpointer.close() after torch.distributed.destroy_process_group(): {self.name!r} "
                              f"v{lost} was captured but not written (its hand-off needs every rank's process "
                              "group); call ckpt.close() before destroy_process_group()")

    def _save_last(self) -> None:
        """The ``save_last`` checkpoint of :meth:`close`: every rank says whether it may (a rank
        that reported a checkpoint error, raised or warned, may not) and at which step; the last
        step is checkpointed only when all agree and it is newer than the newest version."""
        newest = self._run.last_version
        p = self.capture.pending
        if p is not None or self._held is not None:
            newest = max(newest or 0, p.step if p is not None else self._held[0])
        ok = not self._run.errors and self.step > self.start_step and (newest is None or self.step > newest)
        mine = f"{int(ok)}:{self.step}".encode()
        votes = self.comm.allgather(mine) if self.size > 1 else [mine]
        if any(v.split(b":")[1] != mine.split(b":")[1] for v in votes) and self.rank == 0:
            log.warning("DeepFreeze: %r: the last step is not checkpointed at close: the ranks are at different "
                        "steps (%s)", self.name, ", ".join(v.decode().split(":")[1] for v in votes))
        elif all(v == b"1:%d" % self.step for v in votes):
            self.checkpoint()

    def _group_alive(self) -> bool:
        """Whether the collective hand-off can still run (one process, or a live process group)."""
        return self.size == 1 or (torch.distributed.is_available() and torch.distributed.is_initialized())

    def _finish_at_boundary(self) -> None:
        """Finish the pending capture from ``wait``/``close``: with a loop that marks its
        boundaries, the iteration of the checkpoint step is over, so its records are taken now."""
        if self._boundary:
            self.capture.take_records()
        self._finish()

    def _at_exit(self) -> None:
        """A run that exits without :meth:`close`: hand the pending capture off (every rank
        exiting normally does this collectively) within ``close_timeout``, or say what was lost."""
        if self._closed:
            return
        pending = self.capture.pending.step if self.capture.pending is not None else None
        if not self._group_alive():
            self._closed = True  # nothing collective can run any more
            if pending is not None:
                log.warning("DeepFreeze (rank %d): %r v%d was captured but not written: the process group was "
                            "destroyed before Checkpointer.close(); call ckpt.close() before "
                            "destroy_process_group()", self.rank, self.name, pending)
            return
        self._run.close_at_exit(lambda: self._close(final=False), self.close_timeout, who="Checkpointer.close()",
                                pending=pending, hint="ckpt.close()")  # no save_last: a peer may be gone

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self._close(final=self.save_last and exc_type is None)

    @property
    def run_id(self) -> str | None:
        return self._run.info.id if self._run.info is not None else None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or the exit hand-off gave up)."""
        return self._closed

    @property
    def plan(self) -> "ShardPlan | None":
        """The current shard plan (None before the first checkpoint)."""
        return self.capture.plan

    @property
    def plans(self) -> int:
        """Shard plans built (1 + changes)."""
        return self.capture.plans

    # ------------------------------------------------------------------ subscribers
    @property
    def subscribers(self) -> "tuple[CaptureSubscriber, ...]":
        """The subscribers of this capture (:class:`~deepfreeze.torch.capture.CaptureSubscriber`)."""
        return tuple(self._subscribers)

    def subscribe(self, subscriber: CaptureSubscriber) -> None:
        """Give ``subscriber`` the captures it wants (:class:`~deepfreeze.torch.capture.CaptureSubscriber`:
        the call order is there). Every rank subscribes the same way."""
        if subscriber not in self._subscribers:
            self._subscribers.append(subscriber)

    def unsubscribe(self, subscriber: CaptureSubscriber) -> None:
        """Stop giving ``subscriber`` captures: a pending capture it wants is finished first
        (collective: every rank unsubscribes it), the newest coalesced one is written, then its
        :meth:`~deepfreeze.torch.capture.CaptureSubscriber.on_close` runs."""
        if subscriber not in self._subscribers:
            return
        try:
            p = self.capture.pending
            if p is not None and subscriber in self._roles.get(p.step, (True, []))[1] and self._group_alive():
                self._finish_at_boundary()
            self._write_held()
        finally:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)
            subscriber.on_close()

    # ------------------------------------------------------------------ the capture's policy
    def _capture(self, step: int) -> None:
        """Capture the state after ``step`` for this checkpointer and the subscribers that want it."""
        t0 = time.perf_counter()
        if self.capture.pending is not None:
            self._finish()
        riders = [r for r in self._subscribers if self._wanted_by(r, step)]
        self._roles[step] = (self._explicit or self._wants(step) or not riders, riders)
        self.capture.take(step, t0)

    def _wanted_by(self, rider: CaptureSubscriber, step: int) -> bool:
        """``rider.wants_capture(step)`` under ``on_error`` (an error: not wanted)."""
        return self._ask(rider.wants_capture, step)

    def _ask(self, question: Any, *args: Any) -> bool:
        """``bool(question(*args))`` under the run's ``on_error`` policy; False when it raised (and
        the policy did not re-raise)."""
        answer = [False]

        def ask() -> None:
            answer[0] = bool(question(*args))
        self._guard(ask)
        return answer[0]

    def _finish(self) -> None:
        """Finish the pending capture (:meth:`Capture.finish`: collective, every rank has it or
        none has) and hand it to the engine and the subscribers that wanted it."""
        got = self.capture.finish()
        if got is None:
            return
        post_s, wait_s = got.post_s, got.wait_s
        t1 = time.perf_counter()
        self._checkpoint(got)
        del got  # the pool sees the buffer free once the engine (and a held copy) let it go
        self.timings.append({"version": self._run.last_version or -1, "post_hook_s": post_s, "wait_s": wait_s,
                             "handoff_s": time.perf_counter() - t1})
        t = self.timings[-1]  # the first checkpoint over STALL_WARN says what took the time (once per run)
        self._run.note_stall(t["version"], [("capturing", t["post_hook_s"]), ("waiting for the background copy",
                                            t["wait_s"]), ("handing off to the engine", t["handoff_s"])])

    def _checkpoint(self, got: Captured) -> None:
        """Hand a finished capture to the engine and to the subscribers that wanted it. A capture
        only subscribers wanted is written when every rank's writer has room (:meth:`_writer_busy`,
        one decision for all ranks), else its persistent copy coalesces to a newer one
        (:attr:`coalesced`; the newest is written at :meth:`wait`/:meth:`close`): publishing
        never waits for the disk. A checkpoint this checkpointer wanted is always written."""
        step, shard, extra = got.step, got.shard, got.extra
        ckpt, riders = self._roles.pop(step, (True, []))
        for old in [s for s in self._roles if s < step]:  # captures that never finished (torn, failed)
            del self._roles[old]
        if ckpt or not self._writer_busy():
            self._held = None  # a newer version is written: the held one is superseded
            self._hand_off(step, shard, extra)
        else:
            self.coalesced += 1
            self._held = (step, shard, extra)
        del shard
        for r in riders:
            self._guard(r.on_capture, got, self._run.info)

    def _hand_off(self, step: int, shard: FusedShard, extra: dict) -> None:
        if not self._run.hand_off(step, shard, step=step, epoch=0, extra=extra):
            return
        self._run.last_version = step
        if self.verbose and self.rank == 0:
            log.warning("DeepFreeze: checkpoint %s v%d handed off", self.name, step)

    def _writer_busy(self) -> bool:
        """Would a hand-off now wait for a writer on any rank? (collective: one decision per version)"""
        engine = self._run.engine
        saturated = getattr(engine, "saturated", None)
        busy = engine is None or (callable(saturated) and bool(saturated()))
        if self.size > 1:
            busy = any(r[:1] == b"1" for r in self.comm.allgather(b"1" if busy else b"0"))
        return busy

    def _write_held(self) -> None:
        """Write the newest capture whose persistent copy was skipped, unless a newer one is written."""
        held, self._held = self._held, None
        if held is None or self._run.engine is None:
            return
        step, shard, extra = held
        if self._run.last_version is not None and step <= self._run.last_version:
            return
        self._hand_off(step, shard, extra)
        self.coalesced -= 1

    def _on_plan(self, plan: ShardPlan) -> None:
        """A new shard plan (:class:`Capture`): the engine for it."""
        self._run.new_engine(plan, self.domains, self._bg_comm)
        self._run.summary(plan, len(plan.tensors))

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> bool:
        """``fn`` under the run's ``on_error`` policy (:meth:`deepfreeze.run.Run.guard`)."""
        return self._run.guard(fn, *args, **kwargs)

    # ------------------------------------------------------------------ resume
    def _resume(self) -> None:
        from .state_loader import apply
        ck = self._run.pick_resume(self.comm, trust_owners=self._run.trust_owners)  # collective
        if ck is None:
            return
        applied = apply(ck, self.model, self.optimizers, state=self.state, rank=self.rank, world_size=self.size,
                        rng=True, strict=self.strict)
        self.skipped = applied.skipped
        loop = (applied.record or {}).get("a", {}).get("loop")
        if loop is not None:  # the checkpoint was taken inside iterate(): its next pass resumes there
            self.start_epoch = self._loop.resume_from(loop, f"checkpoint {self.name!r} v{ck.version}")
        self.start_step = ck.step
        self.resumed_from = ck.version
        self._run.last_version = ck.version
        if self.rank == 0:
            log.warning("DeepFreeze: resumed %r from v%d (%s): continuing at step %d", self.name, ck.version,
                        ck.level, ck.step)

