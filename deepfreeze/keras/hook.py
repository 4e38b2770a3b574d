"""One optimizer hook, many sinks: the in-graph capture of the train step.

:func:`attach` installs, once per optimizer *instance*, a :class:`HookRegistry`
that wraps two of its methods (``_update_step``, called once per variable, and
``_distributed_apply_gradients_fn``, which runs all updates and increments
``iterations``); the class, its name and ``get_config()`` stay those of the
wrapped optimizer (also Horovod's ``DistributedOptimizer``), so a saved model
loads without DeepFreeze. Every consumer of the train step's state is a
:class:`Sink` registered on it: the checkpoint callback's :class:`FusedSink`
today; clone transfers, stream publishers and the memory tier later. Adding or
removing sinks costs one retrace (``model.make_train_function(force=True)``,
traced at the next step), whatever their number. Registering two sinks of one
name is a ``ValueError``; the last :func:`detach` removes both wrappers. The sink
interface is below.

Two kinds of sinks:

* **fused** (:class:`FusedSink`): after the last update of the step (every op the
  optimizer created for the step, including the ``iterations`` increment, is a
  control input), one op copies this rank's pieces of every tensor of the sink's
  shard plan into one contiguous buffer laid out as the shard file's data region
  (:mod:`deepfreeze.fused`), stamped with the step. With the native op
  (:mod:`deepfreeze.keras.native`, built by setup) the destination is a
  pre-faulted, page-aligned buffer of a :class:`~deepfreeze.fused.BufferPool`
  owned by the sink: one memcpy pass, no TensorFlow allocation, no read op
  afterwards. Without it (fallback), one ``concat`` of aligned views of the
  variables into a fresh TF buffer assigned to a variable: one op and one copy
  too, but into freshly faulted memory, and one read at the hand-off.
* **per-variable** (:class:`VariableSink`): right after each variable's update
  (explicit control edges from every op of that update), the sink's ops for that
  variable run, so work can overlap with the back-propagation of the layers below
  (what cloning needs). :class:`PieceCopySink` copies a rank's pieces into
  per-piece buffers.

Each sink has its own trigger (a ``tf.Variable``): :meth:`Sink.arm` sets the
step (the value of ``optimizer.iterations`` after the update) at which it fires;
with ``steps_per_execution > 1`` it fires at exactly that step of the execution.
A step whose trigger is not armed pays one comparison per sink. Trigger,
control and buffers are held by non-trackable objects, so they are not in
``optimizer.variables()`` (Horovod's broadcast would send them) nor in any
checkpoint of the model or optimizer.

What a sink gets. A per-variable sink's ``ops_for(variable)`` returns a builder (or ``None``)
whose ops run right after that variable's update, while back-propagation of lower layers may
still run; ``end_of_step()`` adds ops after every update of the step (cloning:
``deepfreeze.keras.clone.CloneSink`` posts sends right after each update and waits for all of
them at the end of the step, docs/clone.md). A fused sink is read with ``FusedSink.read(step)``,
a :class:`~deepfreeze.fused.FusedShard`: ``layout`` (a pure function of the shard plan and rank),
``buffer`` (flat ``uint8``), ``step``, ``data`` (the shard file's data region) and ``pieces()``
(typed zero-copy views in plan order); a framework-neutral consumer (the engine, a publisher)
may hold it, or any view of it, as long as it likes: the capture never writes into a buffer
something still refers to. A reader checks the stamp, so a step that did not capture (a bypassed
apply path) is a :class:`~deepfreeze.errors.CaptureMissedError`, never stale data. The trigger
is ``control = [step, address, capacity]``, set in one assign by ``arm`` (``disarm`` sets -1);
the graph compares ``optimizer.iterations`` with ``control[0]``, so a batch that captures
nothing runs no DeepFreeze op outside the graph (the callback arms in ``on_train_batch_begin``
of a checkpoint batch only).

The two capture paths. *Native*: the buffers come from a ``BufferPool`` of ``max_inflight + 1``
page-aligned, pre-faulted anonymous mappings; ``arm`` takes a free one (no ``FusedShard`` or view
of it alive), so the copy goes to memory already faulted in and nothing a queued write holds is
overwritten; the pool buffer is the numpy array the engine reads (no read op). *Graph* (no
compiled code): one ``tf.concat`` of the stamp, the gaps and an aligned contiguous slice of every
variable (a view: split points are 64-byte aligned), bitcast to bytes and assigned to a
``tf.Variable`` whose buffer TF adopts from the concat (no second copy); its memory is a fresh TF
allocation each time, read with one ``value()`` op, zero-copy. Either way a capture is one op and
one pass over the shard, whatever the number of tensors (a copy op per piece cost 2.5-5.4x the
memcpy for ResNet-50; a ``ReadVariableOp`` per tensor 3-10 us each, 1-4 ms for its 320 tensors).
For epoch-end checkpoints whose step was not known in advance (a dataset of unknown length), and
for an execution that ended before the armed step, the callback slices the pieces from the
variables eagerly. With more than one rank, a checkpoint due in the first batch of a ``fit``
call is skipped: Horovod's ``BroadcastGlobalVariablesCallback`` broadcasts rank 0's weights at
the end of that batch, so pieces captured in it would come from different replicas.

Every rank builds the same graph. The fused capture has an input (and, in the graph path, a
slice, a bitcast and a gap constant) for *every* tensor of the plan, zero-length where the rank
holds no piece; ``PieceCopySink`` has a buffer and a copy for every trainable tensor and slot.
The ranks' graphs therefore differ only in attributes and shapes. Horovod requires it: it
matches collectives across ranks by name, and its ``DistributedOptimizer`` places each allreduce
inside a ``tf.cond`` (``horovod/tensorflow/__init__.py:_allreduce_cond``) whose lowered branch
name contains a graph node id (``.../cond/then/_40/...``). With different numbers of ops the
node ids, hence the allreduce names, differ, and each rank waits for a collective the others
never submit. Observed twice: per-piece copies only for the tensors a rank holds (``_40`` vs
``_31``), and a first fused capture that concatenated only the rank's own pieces (``_44`` vs
``_45``, a 2-rank test hung).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from ..errors import CaptureMissedError
from ..fused import STAMP_BYTES, BufferPool, FusedLayout, FusedShard
from ..format import dtype_itemsize
from ..shardplan import ShardPlan

__all__ = ["Sink", "FusedSink", "VariableSink", "PieceCopySink", "HookRegistry", "attach", "detach", "registry_of",
           "update_groups"]

log = logging.getLogger("deepfreeze")
_ATTR = "_deepfreeze_hooks"
NOT_ARMED = -1


class Sink:
    """A consumer of the train step's state, registered on an optimizer's :class:`HookRegistry`.

    ``kind`` is ``"fused"`` or ``"variable"``. ``control`` is a ``[3]`` int64 variable:
    ``[step to fire at, destination address, destination capacity]`` (the last two for
    a fused sink with a native buffer), set by :meth:`arm` in one assign.
    """

    kind = "abstract"

    def __init__(self, name: str) -> None:
        self.name = name
        self.control = tf.Variable(tf.constant([NOT_ARMED, 0, 0], tf.int64), trainable=False,
                                   name=f"deepfreeze_control_{name}")
        self.armed = NOT_ARMED  # Python mirror of control[0]
        self._set(NOT_ARMED)  # the eager assign's kernel is made now, not in the first arm (a batch hook)

    def _set(self, step: int, address: int = 0, capacity: int = 0) -> None:
        self.control.assign(tf.constant([step, address, capacity], tf.int64), read_value=False)
        self.armed = step

    def arm(self, step: int) -> None:
        """Fire at the train step after which ``optimizer.iterations == step``."""
        if step != self.armed:
            self._set(step)

    def disarm(self) -> None:
        if self.armed != NOT_ARMED:
            self._set(NOT_ARMED)


class VariableSink(Sink):
    """A sink whose ops run right after each variable's update (overlapping back-propagation)."""

    kind = "variable"

    def ops_for(self, variable: Any) -> "Callable[[], None] | None":
        """Called while the train step is traced, right after the optimizer built ``variable``'s
        update: a function that builds this sink's ops for it (they run only when the sink's
        trigger equals the step being computed, after every op of the update), or None."""
        raise NotImplementedError

    def end_of_step(self) -> "Callable[[Any], None] | None":
        """Called while the train step is traced, after every update and the ``iterations``
        increment: a function of the step tensor that builds this sink's closing ops (they run
        only when the sink fires, after every op of the step's updates, including this sink's
        per-variable ops), or None."""
        return None


def update_groups(optimizer: Any, variables: Sequence[Any], slots: dict[int, list[int]]) -> dict[Any, list[int]]:
    """What one ``_update_step`` call updates, for a per-variable sink: the optimizer's key of
    each trainable variable -> [its tensor id] + the ids of its optimizer slots (``slots``:
    tensor id -> slot ids; optimizer variables are never trainable)."""
    return {optimizer._var_key(v): [i] + slots.get(i, []) for i, v in enumerate(variables) if v.trainable}


class FusedSink(Sink):
    """A sink fed one contiguous per-rank capture buffer at the end of the step.

    ``variables``: every tensor of ``plan``, by tensor id (TF variables). ``pool``: buffers
    the native op writes into (None: the concat fallback into a TF variable). Read a
    capture with :meth:`read`, after the step it was armed for.
    """

    kind = "fused"

    def __init__(self, name: str, plan: ShardPlan, rank: int, variables: Sequence[Any], *,
                 buffers: int = 3, native: Any = None) -> None:
        super().__init__(name)
        self.layout = FusedLayout.build(plan, rank)
        self.variables = list(variables)
        self.native = native
        self.pool: BufferPool | None = BufferPool(self.layout.nbytes, buffers) if native is not None else None
        self._dest: np.ndarray | None = None  # the pool buffer the armed capture goes to
        # the fallback's buffer: shape unknown until the first capture (no shard-sized zeros now)
        self.buffer = None if native is not None else tf.Variable(
            tf.zeros([0], tf.uint8), shape=tf.TensorShape([None]), trainable=False, name=f"deepfreeze_fused_{name}")
        if self.buffer is not None:
            np.asarray(self.buffer.value())  # the read's kernel is made now, not in the first read (a batch hook)

    def arm(self, step: int) -> None:
        if self.pool is None:
            return super().arm(step)
        if step == self.armed:
            return
        if step == NOT_ARMED:
            self._dest = None
            return self._set(NOT_ARMED)
        self._dest = self.pool.acquire()
        self._set(step, BufferPool.address(self._dest), self._dest.size)

    def read(self, step: int) -> FusedShard:
        """The capture of ``step`` (armed before that step ran): one buffer, zero-copy.
        Raises :class:`CaptureMissedError` if the train step did not capture it."""
        if self.pool is not None:
            buf, self._dest = self._dest, None
            if buf is None:
                raise CaptureMissedError(f"sink {self.name!r}: no capture was armed for step {step}")
        else:
            buf = np.asarray(self.buffer.value())  # zero-copy: the view keeps TF's buffer alive
        if buf.size != self.layout.nbytes or int(buf[:8].view("<i8")[0]) != step:
            got = int(buf[:8].view("<i8")[0]) if buf.size >= 8 else None
            raise CaptureMissedError(
                f"sink {self.name!r}: the train step did not capture step {step} (buffer stamp {got}): the "
                "optimizer's apply path bypassed the DeepFreeze hook (jit_compile, a custom train_step that does "
                "not call apply_gradients, or a model re-compiled after fit began)")
        return FusedShard(self.layout, buf)

    def build(self, step: Any) -> Any:
        """The capture op (traced inside the step, under this sink's trigger).

        Every rank builds the *same* graph: ops for every tensor of the plan, in id order
        (a zero-length piece where the rank holds none), so only attributes and shapes
        differ. Horovod names its collectives after graph node ids; a rank whose graph has
        more nodes shifts them and the job deadlocks.
        """
        held = {s.piece.tensor_id: s for s in self.layout.segments}
        tensors = self.layout.plan.tensors
        if self.native is not None:
            src, dst, length = [], [], []
            for t in tensors:
                s = held.get(t.id)
                src.append(s.piece.start * dtype_itemsize(s.dtype) if s else 0)
                dst.append(s.offset if s else STAMP_BYTES)
                length.append(s.nbytes if s else 0)
            # one node reads every variable itself (no ReadVariableOp per tensor: ~3-10 us each)
            variables = [self.variables[t.id] for t in tensors]
            return self.native.fused_copy_vars(self.control[1:], step, variables, src, dst, length)
        parts = [tf.reshape(tf.bitcast(tf.reshape(step, [1]), tf.uint8), [-1]),
                 tf.zeros([STAMP_BYTES - 8], tf.uint8)]
        pos = STAMP_BYTES
        for t in tensors:  # gaps are < PIECE_ALIGN bytes: always a Const op
            s = held.get(t.id)
            start, stop = (s.piece.start, s.piece.stop) if s else (0, 0)
            gap = s.offset - pos if s else 0
            parts.append(tf.zeros([gap], tf.uint8))
            parts.append(_as_bytes(self.variables[t.id], start, stop))
            pos = s.offset + s.nbytes if s else pos
        parts.append(tf.zeros([self.layout.nbytes - pos], tf.uint8))
        self.buffer.assign(tf.concat(parts, 0), read_value=False)
        return step


def _as_bytes(variable: Any, start: int, stop: int) -> Any:
    """Elements [start, stop) of a variable's flat value as uint8 bytes, a view where TF allows
    (aligned contiguous slices alias the variable's buffer; the concat that follows copies)."""
    flat = tf.reshape(variable.value(), [-1])[start:stop]  # always sliced: the same ops on every rank
    if flat.dtype == tf.bool:
        return tf.cast(flat, tf.uint8)
    if flat.dtype == tf.uint8:
        return flat
    return tf.reshape(tf.bitcast(flat, tf.uint8), [-1])


class PieceCopySink(VariableSink):
    """Copies this rank's piece of each trainable variable (and its optimizer slots) into a
    per-piece buffer right after the variable's update. ``variables``: every tensor of
    ``plan``, by id; ``slots``: model tensor id -> ids of optimizer slots updated with it."""

    def __init__(self, name: str, optimizer: Any, plan: ShardPlan, rank: int, variables: Sequence[Any],
                 slots: dict[int, list[int]] | None = None) -> None:
        super().__init__(name)
        self.optimizer, self.plan, self.rank, self.variables = optimizer, plan, rank, list(variables)
        self.groups = update_groups(optimizer, self.variables, slots or {})
        owned = {p.tensor_id: (p.start, p.stop) for p in plan.for_rank(rank)}
        # Every rank builds the *same* graph (a zero-length buffer where it holds no piece):
        # Horovod names its collectives after graph node ids.
        self.buffers: dict[int, tf.Variable] = {}
        self.slices: dict[int, tuple[int, int]] = {}
        for tid in sorted(t for g in self.groups.values() for t in g):
            start, stop = owned.get(tid, (0, 0))
            self.buffers[tid] = tf.Variable(tf.zeros([stop - start], dtype=self.variables[tid].dtype),
                                            trainable=False, name=f"deepfreeze_piece_{name}_{tid}")
            self.slices[tid] = (start, stop)

    def ops_for(self, variable: Any) -> "Callable[[], None] | None":
        group = self.groups.get(self.optimizer._var_key(variable))
        if group is None:
            return None
        sources = [variable] + [self.variables[t] for t in group[1:]]

        def copy() -> None:
            for tid, src in zip(group, sources):
                start, stop = self.slices[tid]
                flat = tf.reshape(src.value(), [-1])
                # DeepCopy: an aligned slice is a view of the variable's buffer; the next update
                # would copy-on-write the whole variable instead of this copying 1/N
                self.buffers[tid].assign(tf.raw_ops.DeepCopy(x=flat[start:stop]), read_value=False)
        return copy

    def pieces(self) -> dict[int, np.ndarray]:
        """tensor id -> this rank's piece as captured (for the tensors it copies)."""
        return {tid: np.asarray(b.value()) for tid, b in self.buffers.items() if b.shape[0]}


class HookRegistry:
    """The hook installed on one optimizer instance: its sinks and the wrapped methods."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.sinks: list[Sink] = []
        self.original_update = optimizer.__dict__.get("_update_step")  # None: the class method
        self.original_apply = optimizer.__dict__.get("_distributed_apply_gradients_fn")

    def _bound(self, name: str, original: Any) -> Any:
        return original if original is not None else getattr(type(self.optimizer), name).__get__(self.optimizer)

    def update_step(self, gradient: Any, variable: Any) -> Any:
        """Replacement for ``optimizer._update_step``: the update, then per-variable sinks."""
        graph = tf.compat.v1.get_default_graph() if not tf.executing_eagerly() else None
        first = len(graph.get_operations()) if graph is not None else 0
        result = self._bound("_update_step", self.original_update)(gradient, variable)
        builders = [(s, f) for s in self.sinks if s.kind == "variable" for f in [s.ops_for(variable)] if f]
        if not builders:
            return result
        # explicit edges from every op of the update, not only automatic control dependencies
        update_ops = graph.get_operations()[first:] if graph is not None else []
        with tf.control_dependencies(update_ops):
            step = self.optimizer.iterations + 1  # the step being computed (incremented at the end)
            for sink, fn in builders:
                tf.cond(tf.equal(step, sink.control[0]), lambda fn=fn: _run(fn), lambda: tf.constant(False))
        return result

    def apply_fn(self, distribution: Any, grads_and_vars: Any, **kwargs: Any) -> Any:
        """Replacement for ``optimizer._distributed_apply_gradients_fn``: every update and the
        ``iterations`` increment, then the fused sinks' captures and the per-variable sinks'
        closing ops (:meth:`VariableSink.end_of_step`)."""
        graph = tf.compat.v1.get_default_graph() if not tf.executing_eagerly() else None
        first = len(graph.get_operations()) if graph is not None else 0
        result = self._bound("_distributed_apply_gradients_fn", self.original_apply)(
            distribution, grads_and_vars, **kwargs)
        closing = [(s, s.build) for s in self.sinks if s.kind == "fused"]
        closing += [(s, f) for s in self.sinks if s.kind == "variable" for f in [s.end_of_step()] if f]
        if not closing:
            return result
        step_ops = graph.get_operations()[first:] if graph is not None else []
        with tf.control_dependencies(step_ops):
            step = self.optimizer.iterations.value()
            for sink, fn in closing:
                tf.cond(tf.equal(step, sink.control[0]), lambda fn=fn: _run(lambda: fn(step)),
                        lambda: tf.constant(False))
        return result


def _run(fn: Callable[[], Any]) -> Any:
    fn()
    return tf.constant(True)


def registry_of(optimizer: Any) -> HookRegistry | None:
    return optimizer.__dict__.get(_ATTR)


def attach(optimizer: Any, sink: Sink) -> HookRegistry:
    """Register ``sink`` on ``optimizer`` (installing the hook at the first sink). The train
    function must be retraced afterwards (``model.make_train_function(force=True)``)."""
    reg = registry_of(optimizer)
    if reg is None:
        reg = HookRegistry(optimizer)
        object.__setattr__(optimizer, "_update_step", reg.update_step)
        object.__setattr__(optimizer, "_distributed_apply_gradients_fn", reg.apply_fn)
        object.__setattr__(optimizer, _ATTR, reg)
    if any(s is sink for s in reg.sinks):
        return reg
    if any(s.name == sink.name for s in reg.sinks):
        raise ValueError(f"a DeepFreeze sink named {sink.name!r} is already attached to this optimizer")
    reg.sinks.append(sink)
    return reg


def detach(optimizer: Any, sink: Sink) -> None:
    """Unregister ``sink``; the hook is removed with the last sink. Retrace afterwards."""
    reg = registry_of(optimizer)
    if reg is None:
        return
    sink.disarm()
    reg.sinks = [s for s in reg.sinks if s is not sink]
    if reg.sinks:
        return
    for name, original in (("_update_step", reg.original_update),
                           ("_distributed_apply_gradients_fn", reg.original_apply)):
        if original is None:
            optimizer.__dict__.pop(name, None)
        else:
            object.__setattr__(optimizer, name, original)
    optimizer.__dict__.pop(_ATTR, None)
