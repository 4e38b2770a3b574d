"""DeepClone for Keras + Horovod: the in-graph clone sink, ``CloneCallback`` (source group)
and ``receive_clone`` (clone groups). Guide: docs/clone.md; protocol:
:mod:`deepfreeze.clone.transfer`.

Source side, at the clone step K: right after each trainable variable's update (and its
optimizer slots', updated in the same ``_update_step``), the :class:`CloneSink`'s op
hands this rank's element range of each of them (a view of the variable, no copy) to
the :class:`~deepfreeze.clone.Sender`, which posts one ``Isend`` per route; the sends
progress on the sender's thread while the rest of the step's updates run. After the
last update, the sink's closing op waits for every send (bounded by ``clone_timeout``),
so no buffer is touched by step K+1's update while a clone still reads it. Then
``on_train_batch_end(K)`` sends what the graph did not: tensors the optimizer did not
update in step K (no gradient) from their route's rank, the non-replicated ones
(BatchNormalization's moving statistics, the iteration counter) whole from source
rank 0, and the header (step, epoch, run). Clone side: :func:`receive_clone` exchanges
plans, receives everything, runs the all-gathers in plan order, sets every weight,
slot and counter, and positions the next ``fit``.
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Any

import numpy as np
import tensorflow as tf

from ..clone import CloneInfo, Group, Receiver, Sender, plans_for
from ..clone.plan import DEFAULT_THRESHOLD, ClonePlan
from ..clone.transfer import DEFAULT_TIMEOUT, TAG_HEADER
from ..errors import CloneError, ConfigError, ModelMismatchError
from ..lease import new_run_id
from . import hook as _hook
from ._dist import _hvd, rank_and_size
from ._state import TrainState, train_state
from .callback import _ResumePoint, _SkipBatches
from .state_loader import build_from_spec

__all__ = ["CloneSink", "CloneCallback", "receive_clone"]

log = logging.getLogger("deepfreeze")


class CloneSink(_hook.VariableSink):
    """Posts this rank's ranges of each variable (and its slots) right after its update;
    waits for every send at the end of the step. ``times``: per hooked variable, (first
    tensor id, time its update finished (``tf.timestamp`` after the update ops; 0 when op
    determinism is enabled, which refuses that op), time its sends were posted); ``updates_done``: when the closing op started (every update done);
    ``sent``: when every send had completed; ``error``: the :class:`CloneError` of a failed post
    or wait inside the step (the graph goes on; ``CloneCallback`` raises it after the step)."""

    def __init__(self, name: str, optimizer: Any, state: TrainState, sender: Sender) -> None:
        super().__init__(name)
        self.optimizer, self.state, self.sender = optimizer, state, sender
        self.groups = _hook.update_groups(optimizer, state.variables, state.slots)
        self.hooked: set[int] = set()
        self.times: list[tuple[int, float, float]] = []
        self.updates_done: float | None = None
        self.sent: float | None = None
        self.error: CloneError | None = None  # a failed post or wait in the step, raised by the callback

    def ops_for(self, variable: Any) -> Any:
        group = self.groups.get(self.optimizer._var_key(variable))
        if group is None:
            return None
        ranges = [self.sender.source_range(t) for t in group]

        def build() -> None:
            # the same ops on every rank (only the slice bounds differ): Horovod names its
            # collectives after graph node ids
            flats = [tf.reshape(self.state.variables[t].value(), [-1])[lo:hi] for t, (lo, hi) in zip(group, ranges)]
            # tf.timestamp runs (inline, cheap) as soon as the update is done: when the update finished,
            # independent of when the executor gets to the Python op (refused under op determinism)
            ts = tf.constant(0.0, tf.float64) if _determinism() else tf.timestamp()
            tf.numpy_function(functools.partial(self._post, tuple(group), tuple(lo for lo, _ in ranges)),
                              [ts] + flats, Tout=tf.bool, stateful=True, name="deepfreeze_clone_send")
        return build

    def _post(self, tids: tuple[int, ...], bases: tuple[int, ...], ts: Any, *flats: np.ndarray) -> np.bool_:
        if self.error is not None:
            return np.bool_(False)
        t = time.time()
        try:
            for tid, base, flat in zip(tids, bases, flats):
                self.sender.post(tid, flat, base)
                self.hooked.add(tid)
        except Exception as e:  # an MPI error too: raised by the callback, as a CloneError
            self.error = _as_clone_error(e, "posting the clone sends")
            return np.bool_(False)
        self.times.append((tids[0], float(ts), t))
        return np.bool_(True)

    def end_of_step(self) -> Any:
        def build(step: Any) -> None:
            tf.numpy_function(self._wait, [step], Tout=tf.bool, stateful=True, name="deepfreeze_clone_wait")
        return build

    def _wait(self, step: Any) -> np.bool_:
        self.updates_done = time.time()
        if self.error is None:
            try:  # raised here, it would leave fit as TensorFlow's UnknownError: the callback raises it
                self.sender.wait()
            except Exception as e:
                self.error = _as_clone_error(e, "waiting for the clone sends")
        self.sent = time.time()
        return np.bool_(self.error is None)


def _as_clone_error(e: Exception, doing: str) -> CloneError:
    if isinstance(e, CloneError):
        return e
    err = CloneError(f"clone step failed {doing}: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err


def check_horovod(group: Group, who: str) -> None:
    """Raise :class:`ConfigError` unless Horovod runs over ``group``'s communicator (the
    ``hvd.init(comm=group.comm)`` every group needs: with ``hvd.init()`` Horovod spans every
    group, and the source's first all-reduce waits forever for the clone ranks). Local
    checks only (rank, size, ``MPI_Comm_compare``), so a wrong set-up cannot deadlock here."""
    fix = ("call hvd.init(comm=group.comm) right after group = deepfreeze.clone.split(...), on every rank: "
           "each group is its own Horovod world")
    hvd = _hvd()
    if hvd is None:
        if group.size > 1:
            raise ConfigError(f"{who}: Horovod is not initialized, but this group has {group.size} ranks: {fix}")
        return
    rank, size = hvd.rank(), hvd.size()
    if (rank, size) != (group.rank, group.size):
        raise ConfigError(f"{who}: Horovod's world is not this group's: Horovod has {size} ranks (this is rank "
                          f"{rank}), group {group.index} has {group.size} (this is rank {group.rank}); Horovod "
                          f"would wait forever for ranks of other groups: {fix}")
    try:
        from horovod.common.process_sets import global_process_set
        given = global_process_set.mpi_comm
    except (ImportError, AttributeError):
        given = None
    if given is not None:
        from mpi4py import MPI
        try:
            same = MPI.Comm.Compare(given, group.comm) in (MPI.IDENT, MPI.CONGRUENT)
        except MPI.Exception:  # freed
            same = False
        if not same:
            raise ConfigError(f"{who}: Horovod runs over another communicator than group {group.index}'s (same size, "
                              f"other ranks): {fix}")


def _determinism() -> bool:
    from tensorflow.python.framework import config  # no public getter in TF 2.15
    return bool(config.is_op_determinism_enabled())


class CloneCallback(tf.keras.callbacks.Callback):
    """Fork this (source) group into every clone group of ``group`` after one optimizer step.

    ``at_step=K``: the state after the global optimizer step K (the number a checkpoint of
    that step gets); ``at_epoch_end=E`` (0-based, Keras' epoch index): after the last step
    of epoch E (its number of steps must be known). Give exactly one. ``clone_timeout``:
    seconds to wait for the clone groups' hello at step K and for them to take the data.
    ``threshold``: tensors up to this many bytes go whole (not split). ``timings``
    (after the clone): wall-clock times (``time.time()``) of the clone step's end, the
    first post, all sends done, and per hooked variable its update and post times.

    Every source rank must use it with the same arguments; the clone groups call
    :func:`receive_clone`. ``steps_per_execution`` must be 1.
    """

    def __init__(self, group: Group, at_step: int | None = None, *, at_epoch_end: int | None = None,
                 clone_timeout: float = DEFAULT_TIMEOUT, threshold: int = DEFAULT_THRESHOLD) -> None:
        super().__init__()
        if not isinstance(group, Group):
            raise ConfigError("CloneCallback: group must come from deepfreeze.clone.split(...)")
        if not group.is_source:
            raise ConfigError(f"CloneCallback runs on the source group (index 0); this rank is in clone group "
                              f"{group.index}: call deepfreeze.keras.receive_clone(model, group) there")
        if (at_step is None) == (at_epoch_end is None):
            raise ConfigError("CloneCallback: give exactly one of at_step=K (global optimizer step) and "
                              "at_epoch_end=E (0-based epoch)")
        if at_step is not None and (not isinstance(at_step, int) or at_step < 1):
            raise ConfigError(f"CloneCallback: at_step={at_step!r}: use the global optimizer step, an integer >= 1")
        if at_epoch_end is not None and (not isinstance(at_epoch_end, int) or at_epoch_end < 0):
            raise ConfigError(f"CloneCallback: at_epoch_end={at_epoch_end!r}: use a 0-based epoch index >= 0")
        if not clone_timeout > 0:
            raise ConfigError(f"CloneCallback: clone_timeout={clone_timeout!r}: use a positive number of seconds")
        check_horovod(group, "CloneCallback")
        self.group, self.at_step, self.at_epoch_end = group, at_step, at_epoch_end
        self.clone_timeout, self.threshold = float(clone_timeout), int(threshold)
        self.sender: Sender | None = None
        self.sink: CloneSink | None = None
        self.step: int | None = None  # the clone step, once known
        self.done = False
        self.timings: dict[str, Any] = {}
        self._state: TrainState | None = None
        self._it = 0  # global optimizer steps done
        self._epoch = 0
        self._epoch_base: int | None = None  # global step before the epoch's batch 0 (set at its first batch)
        self._own_run: str | None = None  # a run id when no DeepFreezeCheckpoint shares the optimizer

    # -- set-up -----------------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.done:
            return
        model = self.model
        spe = getattr(model, "_steps_per_execution", None)
        if spe is not None and int(spe.numpy()) != 1:
            raise ConfigError("CloneCallback: steps_per_execution must be 1 (the callback sends the state the "
                              "graph does not at the end of the clone step)")
        self._it = int(model.optimizer.iterations.numpy())
        if self.at_step is not None:
            self._check_step(self.at_step, f"at_step={self.at_step}")
            self.step = self.at_step
        elif not self.params.get("steps"):
            raise ConfigError("CloneCallback: at_epoch_end needs the number of steps per epoch: give fit "
                              "steps_per_epoch or a dataset of known length")
        if model.built and model.weights:
            self._set_up()
            return
        # not built: built from the input's shape and set up when the first step starts, as the
        # checkpoint callback does (one build function; the optimizer is built before the step)
        if self.step is not None and self.step <= self._it + 1:
            raise ConfigError(f"CloneCallback: the model is not built when fit begins, so the clone is set up at "
                              f"fit's first step, and the clone step {self.step} is that step: clone at a later "
                              "step, or build the model first (an Input layer or model.build(...))")
        model.train_function = _SetUpAtFirstStep(self, model.train_function)

    def _set_up(self) -> None:
        """The plan, the sender (its hello) and the in-graph sink; retraces the train function."""
        model = self.model
        if self.sender is None:
            self._state = train_state(model)
            plans = plans_for(self.group, self._state.specs, whole=self._state.pinned, threshold=self.threshold)
            self.sender = Sender(self.group, plans, timeout=self.clone_timeout)
            self.sender.hello()
        self.sink = CloneSink(f"clone.{id(self):x}", model.optimizer, self._state, self.sender)
        _hook.attach(model.optimizer, self.sink)
        model.make_train_function(force=True)  # retrace at the next step: the sends must be in the graph

    def _check_step(self, k: int, what: str) -> None:
        if k <= self._it:
            raise ConfigError(f"CloneCallback: {what}: step {k} has already passed (the optimizer has done "
                              f"{self._it} steps): pick a later step")
        if k == self._it + 1 and rank_and_size()[1] > 1:
            raise ConfigError(f"CloneCallback: {what} is the first step of this fit: Horovod's "
                              "BroadcastGlobalVariablesCallback only makes the ranks identical after it; "
                              "clone at a later step")

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        self._epoch_base = None

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._epoch_base is None:  # the epoch's first batch: Keras' index says where the epoch
            self._epoch_base = self._it - batch  # started (a resumed or cloned fit starts mid-epoch)
            if self.at_epoch_end == self._epoch and not self.done:
                k = self._epoch_base + int(self.params["steps"])
                self._check_step(k, f"at_epoch_end={self._epoch}")
                self.step = k
        if self.done or self.sender is None:
            return
        try:
            self.sender.poll_hello()  # a model mismatch, a clone that gave up: here, within one batch
            if self.step == self._it + 1:
                self.sender.wait_hello()
                self.sink.arm(self.step)
        except (CloneError, ModelMismatchError) as e:
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        """End the clone after ``e`` (raised in a callback, or recorded by the sink in the
        step): unhook, tell the clones, close the sender, raise ``e`` (out of ``fit`` as it is)."""
        if self.sink is not None:
            _hook.detach(self.model.optimizer, self.sink)
            self.model.make_train_function(force=True)
            self.sink = None
        if self.sender is not None:
            if not isinstance(e, ModelMismatchError):  # a mismatch: every clone rank found it already
                self.sender.abort(f"source rank {self.group.rank} failed: {type(e).__name__}: {e}")
            self.sender.close()
            self.sender = None
        self.done = True
        raise e

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._it += 1
        if self.sink is None or self.sink.armed == _hook.NOT_ARMED:
            return
        t_end = time.time()
        self.sink.disarm()
        if self.sink.error is not None:  # the step's sends failed (recorded in the graph, raised here)
            self._fail(self.sink.error)
        try:
            self._send_rest(batch, t_end)
        except CloneError as e:
            self._fail(e)

    def _send_rest(self, batch: int, t_end: float) -> None:
        """After the clone step: what the graph did not send, the header; wait for every send."""
        st, sender = self._state, self.sender
        # what the graph did not send: replicated tensors not updated in this step (their route's
        # rank sends them), then the non-replicated ones (their routes start at source rank 0)
        rest = [t for t in range(len(st.specs)) if t not in self.sink.hooked]
        for t in rest:
            if sender.routes(t):  # read only the variables this rank sends
                sender.post(t, np.asarray(st.variables[t].value()).reshape(-1))
        if self.group.rank == 0:
            steps = self.params.get("steps")
            name, run = self._source()
            info = CloneInfo(step=self.step, epoch=self._epoch, epoch_step=self._it - self._epoch_base,
                             epoch_complete=bool(steps) and self._it - self._epoch_base >= steps,
                             source_run=run, source_name=name)
            sender.post_control(TAG_HEADER, info.header())
        sender.wait()
        self.done = True
        self.timings = {"step": self.step, "step_end": t_end, "sent_done": time.time(),
                        "posted_first": min((p[1] for p in sender.posted), default=None),
                        "graph_sent": self.sink.sent, "updates_done": self.sink.updates_done,
                        "variables": list(self.sink.times), "bytes_sent": sender.bytes_sent,
                        "sent_after_step": len(rest)}

    def _source(self) -> tuple[str | None, str]:
        """(checkpoint name, run id) of the source: a DeepFreezeCheckpoint's on the same
        optimizer (its sink's ``owner``), else no name and a run id of this callback's own."""
        reg = _hook.registry_of(self.model.optimizer)
        owner = next((s.owner for s in (reg.sinks if reg else []) if hasattr(s, "owner")), None)
        run = getattr(owner, "run_id", None)
        if not run:
            self._own_run = self._own_run or new_run_id()
            run = self._own_run
        return getattr(owner, "name", None), run

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.sink is not None:
            _hook.detach(self.model.optimizer, self.sink)
            self.model.make_train_function(force=True)
            self.sink = None
        if self.sender is None:
            return
        if not self.done:
            self.sender.abort(f"the source's fit ended after optimizer step {self._it}, before the clone step "
                              f"{self.step if self.step is not None else f'(end of epoch {self.at_epoch_end})'}")
            self.done = True
        self.sender.close()
        self.sender = None


class _SetUpAtFirstStep:
    """Wraps the train function of a model not built when ``fit`` starts. Its first call:
    builds the model from the input's element spec (:func:`build_from_spec`, as the checkpoint
    callback does), sets the clone up (which retraces the train function), then runs the step:
    through another callback's first-step set-up if this one wrapped it, else the new function."""

    sets_up_at_first_step = True

    def __init__(self, callback: CloneCallback, fn: Any) -> None:
        self.callback, self.fn = callback, fn

    def __call__(self, iterator: Any) -> Any:
        cb = self.callback
        build_from_spec(cb.model, getattr(iterator, "element_spec", None), "CloneCallback")
        cb._set_up()
        inner = self.fn if getattr(self.fn, "sets_up_at_first_step", False) else cb.model.train_function
        return inner(iterator)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)


class _ClonePoint(_ResumePoint):
    """Where the next ``fit`` starts. Keras asks for it after every callback's
    ``on_train_begin`` (which may retrace the train function): then the final train
    function is wrapped to draw the epoch's first ``step`` batches unused, once, and the
    point removes itself from the model."""

    def __init__(self, model: Any, epoch: int, step: int) -> None:
        super().__init__(epoch, step)
        self.model = model

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch: int, initial_epoch: int,
                                              mode: Any = None) -> tuple[int, int]:
        if self.model._training_state is self:
            self.model._training_state = None
            if self.step:
                self.model.train_function = _SkipBatches(self.model.train_function, self.step)
        return self.epoch, self.step


def _variable_buffers(state: TrainState) -> tuple[dict[int, np.ndarray], list]:
    """Writable flat views of every variable's own buffer: the clone is received and
    all-gathered in place, straight into the variables (the paper's zero-copy
    reconstruction; no second buffer, no assign afterwards).

    Each variable is first assigned a fresh copy of its value: TensorFlow then gives it a
    buffer no other tensor shares (an assign whose variable buffer is referenced elsewhere,
    e.g. by a cached constant of zeros an optimizer slot was initialized from, allocates a new
    one), so writing into it changes that variable only. The read-only views returned in ``pins``
    keep those buffers alive and in place while the clone arrives; nothing else runs on the
    model meanwhile. Drop both afterwards."""
    import ctypes
    buffers, pins = {}, []
    for spec, v in zip(state.specs, state.variables):
        # a fresh copy, not the value itself: assigning a variable its own buffer changes nothing,
        # and TF may share one buffer between a variable and e.g. a cached constant of zeros
        v.assign(tf.raw_ops.DeepCopy(x=v.read_value()), read_value=False)
        view = np.asarray(v.value())  # shares the variable's buffer (read-only for numpy)
        pins.append(view)
        if view.nbytes == 0:
            buffers[spec.id] = np.empty(0, view.dtype)
            continue
        raw = (ctypes.c_ubyte * view.nbytes).from_address(view.ctypes.data)
        buffers[spec.id] = np.frombuffer(raw, np.uint8).view(view.dtype)  # writable, same memory
    spans = sorted((b.ctypes.data, b.ctypes.data + b.nbytes) for b in buffers.values() if b.nbytes)
    if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
        raise CloneError("receive_clone: two variables of the model share memory; cannot receive in place")
    return buffers, pins


def receive_clone(model: Any, group: Group, *, clone_timeout: float = DEFAULT_TIMEOUT, position: bool = True,
                  threshold: int = DEFAULT_THRESHOLD, input_spec: Any = None,
                  receiver_cls: type = Receiver) -> CloneInfo:
    """Block until the source group's clone arrived; set every weight, optimizer slot and the
    step counter of ``model`` (built and compiled like the source's); return its
    :class:`~deepfreeze.clone.CloneInfo`. Collective over the clone group.

    ``position``: make the next ``fit`` continue where the source was (epoch and batch, as
    ``resume=True`` does: the batches of the epoch already trained are drawn unused).
    ``input_spec``: build an unbuilt model first from the data it will be fit on (a
    ``tf.data.Dataset`` or its ``element_spec``), as the checkpoint callback does.
    ``receiver_cls``: advanced, a :class:`~deepfreeze.clone.Receiver` subclass (tests).
    Raises ConfigError (Horovod not initialized over ``group.comm``), ModelMismatchError
    (another model or plan than the source's), CloneTimeoutError (nothing within
    ``clone_timeout`` seconds), CloneError (the source, or another rank of this clone group,
    gave up). Every wait is bounded by ``clone_timeout``.
    """
    if not isinstance(group, Group):
        raise ConfigError("receive_clone: group must come from deepfreeze.clone.split(...)")
    if group.is_source:
        raise ConfigError("receive_clone runs on a clone group; the source group (index 0) uses CloneCallback")
    check_horovod(group, "receive_clone")
    if getattr(model, "optimizer", None) is None:
        raise ConfigError("receive_clone: compile the model first (the clone receives the optimizer's state too)")
    if (not model.built or not model.weights) and input_spec is not None:
        build_from_spec(model, input_spec, "receive_clone")
    if not model.built or not model.weights:
        raise ConfigError("receive_clone: build the model first (an Input layer, or model.build(...)), or pass "
                          "input_spec=<the dataset it will be fit on>: the clone plan lists its tensors")
    t0 = time.time()
    state = train_state(model)
    plan = ClonePlan(state.specs, group.sizes[0], group.size, whole=state.pinned, threshold=threshold)
    recv = receiver_cls(group, plan, timeout=clone_timeout)
    recv.open_group()  # the clone group's own communicator for the all-gathers (nonblocking)
    error: CloneError | None = None
    t_hello = None
    try:
        recv.hello()
        t_hello = time.time()
        buffers, pins = _variable_buffers(state)
        recv.prepare(buffers, group.rank)
        header = recv.receive(buffers)
        info = CloneInfo.from_header(header)
    except CloneError as e:  # ModelMismatchError is not one: every rank of both sides sees it at once
        error = e
    comm = recv.agree(error)  # bounded: raises the error, or names the clone ranks that failed
    try:
        recv.reconstruct(buffers, comm)
    finally:
        comm.Free()
    t_gathered = time.time()
    del buffers, pins  # the variables hold the clone now (no copy; the step counter too); drop the views
    if position:
        epoch, step = (info.epoch + 1, 0) if info.epoch_complete else (info.epoch, info.epoch_step)
        model._training_state = _ClonePoint(model, epoch, step)
    model._deepfreeze_parent = {"name": info.source_name, "run": info.source_run, "step": info.step}
    info.timings.update(start=t0, hello=t_hello, first_data=recv.first_data_at, received=recv.done_at,
                        gathered=t_gathered, ready=time.time(), bytes_received=recv.bytes_received,
                        gather_s=dict(recv.gather_s))
    if group.rank == 0:
        log.info("DeepFreeze: clone group %d received step %d (%.1f MB per rank) from run %s", group.index,
                 info.step, recv.bytes_received / 1e6, info.source_run)
    return info
