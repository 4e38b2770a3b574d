"""The torch capture: finished shards (or the live tensors) with state records, apart from their policy.

A :class:`Capture` turns the state of a training step into this rank's shard of one version: a
pooled buffer laid out as the rank's shard file (:class:`~deepfreeze.fused.FusedLayout`), its
replicated pieces copied from the live tensors (in the hook, or with ``overlap`` by the
background thread ``deepfreeze-capture-r<rank>``; CUDA pieces by device-to-host copies on a side
stream, :mod:`deepfreeze.torch._cuda`), the ``_version`` guard against tensors changed during the
copy (a *torn* capture is never a shard), and the rank's state record in its own piece
(:class:`StateRecords`). It owns the shard plan (built, checked and changed collectively), the
buffer pool and the CUDA capture. *Which* steps are captured, what happens to a finished shard
(the engine, coalescing, riders) and the ``on_error`` policy are its owner's: the
:class:`~deepfreeze.torch.Checkpointer`.

Call order (every rank, the same calls; ``take`` and ``finish`` are collective over ``comm``)::

    cap = Capture(model, optimizers, ...)      # nothing collective; refuses meta/mps tensors
    cap.take(step)                             # optimizer post-hook of the step: plan check (one
                                               # all-gather; a change: a new plan, on_plan(plan)),
                                               # record part "a", the copy starts -> cap.pending
    cap.take_record_b()                        # the model's next forward pre-hook (the loop's
                                               # scheduler.step()/scaler.update() are done), or
    cap.take_records()                         # at the loop's boundary instead (end_iteration)
    got = cap.finish()                         # next optimizer pre-hook (or checkpoint/wait/close):
                                               # wait for the copy, the torn check (one all-gather),
                                               # the record into its piece -> Captured, or None
                                               # (failed on some rank: given to guard, on every rank)
    ...                                        # take/finish again at the next wanted step
    cap.close()                                # the copy thread and the buffer pool

Each capture costs two small all-gathers (``take``, ``finish``) and one copy of the rank's
pieces into a pooled buffer; the :class:`Captured` shard *is* that buffer (no further copy).

**Subscribers.** Who else receives the finished shards implements :class:`CaptureSubscriber`
and is subscribed to the capture's owner
(:meth:`Checkpointer.subscribe <deepfreeze.torch.Checkpointer.subscribe>`). For each step the
owner asks every subscriber :meth:`~CaptureSubscriber.wants_capture` in the post-hook (a step
anyone wants is captured once); a finished capture goes to the engine first (the owner's policy)
and then to :meth:`~CaptureSubscriber.on_capture` of the subscribers that wanted it;
:meth:`~CaptureSubscriber.on_wait` runs in the owner's ``wait``, and
:meth:`~CaptureSubscriber.on_close` once, when the subscriber is unsubscribed or the owner
closes. The owner calls each of them under its ``on_error`` policy: a
:class:`~deepfreeze.errors.DeepFreezeError` they raise is raised through ``optimizer.step()``
(``on_error="raise"``) or logged and counted (``"warn"``).

**Live subscribers.** What reads the live tensors of a step instead of a shard (the
:class:`~deepfreeze.torch.CloneServer`, which sends each rank's share of them straight to a clone,
and the stream :class:`~deepfreeze.torch.Publisher`, which copies its share straight into a
shared-memory slot: no copy into a buffer, none of the capture's all-gathers) implements :class:`LiveSubscriber` and
subscribes to a :class:`LiveCapture`, a sink of the model's step hook beside the Checkpointer's.
It counts the steps, asks ``wants_live(step)`` in each post-hook (collective calls are the
subscriber's: the clone server's agreement), lends a wanted step's tensor list (:class:`Live`)
through ``on_live``, takes the rank's state record, and holds the next ``optimizer.step()`` until
each holder's ``on_release`` returned (call order: :class:`LiveSubscriber`).

The state record of a rank (:class:`StateRecords`) is the one definition both take: part ``"a"``
in the post-hook, part ``"b"`` at the next forward pre-hook, or both at the loop's boundary.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import logging
import struct
import threading
import time
import weakref
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch

from ..comm import allgather_failures
from ..errors import (CaptureTornError, ChangedInPlaceError, ConfigError, DeepFreezeError, ModelMismatchError,
                      RanksFailedError, StateRecordOverflowError)
from ..fused import BufferPool, FusedLayout, FusedShard
from ..lease import RunInfo
from ..shardplan import Piece, ShardPlan, TensorSpec, check_tensor_names
from . import _cuda, _loop, _state
from .hook import Sink, hook_for

__all__ = ["Capture", "Captured", "CaptureSubscriber", "Live", "LiveCapture", "LiveSubscriber", "Pending", "StateRecords",
           "local_piece"]

log = logging.getLogger("deepfreeze")
_PAGE = 4096


def _phase_b(obj: Any) -> bool:
    """Objects the loop updates after ``optimizer.step()``: LR schedulers and GradScalers."""
    return _state.torch_stateful(obj)


@dataclasses.dataclass
class Captured:
    """A finished, checked capture of this rank: the state after optimizer step ``step``.

    ``shard`` is the pooled buffer itself (no copy): the pool counts references, so the buffer
    is reused once nobody holds the shard (the engine until it has written it, a coalesced
    capture until a newer one is written); a subscriber keeps no reference past its call. ``plan``: the shard plan it is laid out by; ``model_tensors``: how many
    leading tensors of the plan are the model's; ``extra``: the manifest's framework fields;
    ``post_s``/``wait_s``: seconds the capture took in the post-hook and waited for its copy."""

    step: int
    shard: FusedShard
    plan: ShardPlan
    model_tensors: int
    extra: dict
    post_s: float = 0.0
    wait_s: float = 0.0


class CaptureSubscriber(Protocol):
    """What receives a capture besides its owner's engine, and the owner's ``wait`` and ``close``.

    Call order, on every rank (module docstring): ``wants_capture`` in each step's post-hook;
    ``on_capture`` for each finished capture it wanted (after the owner's hand-off to the
    engine; collective calls inside are fine: every rank receives the same captures);
    ``on_wait`` in the owner's ``wait``; ``on_close`` once, last. Each runs under the owner's
    ``on_error`` policy."""

    def wants_capture(self, step: int) -> bool:
        """Does this subscriber want the state after optimizer step ``step``?"""
        ...

    def on_capture(self, captured: Captured, run: RunInfo) -> None:
        """A finished capture it wanted, of the run ``run`` (its id and generation)."""
        ...

    def on_wait(self, timeout: "float | None") -> None:
        """The owner's ``wait``: wait (at most ``timeout`` s) for what it does with its captures."""
        ...

    def on_close(self) -> None:
        """No capture comes any more (unsubscribed, or the owner closed)."""
        ...


class StateRecords:
    """The parts of a rank's state record (the one definition, the :class:`Capture`'s and the
    :class:`LiveCapture`'s): ``"a"`` (RNG states, optimizer classes, tied FQNs, the ``state=`` objects
    that are not schedulers or GradScalers, the position of ``iterate`` (``loop``), FSDP2
    buffers) and ``"b"`` (``param_groups`` and non-tensor optimizer state, schedulers and
    GradScalers). :meth:`train_state` keeps the FQNs and tied names the records use."""

    def __init__(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], state: dict[str, Any],
                 loop: "_loop.Passes", *, rank: int, size: int, sharded: bool) -> None:
        self.model, self.optimizers, self.state, self.loop = model, optimizers, state, loop
        self.rank, self.size, self.sharded = rank, size, sharded
        self.fqn_of: dict[int, str] = {}  # id() of a parameter -> FQN, from the last train_state
        self.aliases: dict[str, str] = {}  # tied FQN -> the FQN stored, from the last train_state

    def train_state(self, previous: "_state.TrainState | None") -> "_state.TrainState":
        """The tensor list now (:func:`deepfreeze.torch._state.train_state`); its names serve the records."""
        st = _state.train_state(self.model, self.optimizers, previous)
        self.fqn_of, self.aliases = st.fqn_of, st.aliases  # tied weights, found by train_state (the record names them)
        return st

    def part(self, phase: str, st: "_state.TrainState | None" = None) -> Any:
        """Part ``"a"`` or ``"b"`` of the record now (``st``: a tensor list whose optimizer groups serve ``"b"``)."""
        if phase == "a":
            rec = {"rank": self.rank, "world_size": self.size, "rng": _state.rng_state(),
                   "optimizers": [_state.class_name(o) for o in self.optimizers], "aliases": self.aliases,
                   "state": {k: o.state_dict() for k, o in self.state.items() if not _phase_b(o)}}
            if self.loop.current is not None:
                rec["loop"] = self.loop.current.record()
            if self.sharded:  # FSDP2 does not broadcast buffers: each rank's own, restored on it (same world size)
                rec["buffers"] = {fqn: t.detach().cpu().clone() for fqn, t, is_param in
                                  _state.model_entries(self.model) if not is_param}
            return rec
        groups, extra = (st.groups, st.extra) if st is not None else \
            _state.optimizer_groups(self.optimizers, self.fqn_of)  # no state_dict: FSDP2's forward
        return {"param_groups": groups, "optim_extra": extra,
                "state": {k: o.state_dict() for k, o in self.state.items() if _phase_b(o)}}

    def encode_a(self) -> bytes:
        """Part ``"a"`` now, encoded (raises :class:`~deepfreeze.errors.DeepFreezeError`)."""
        return _state.encode(self.part("a"), "record")

    def encode_b(self) -> bytes:
        """Part ``"b"`` now, encoded (raises :class:`~deepfreeze.errors.DeepFreezeError`)."""
        return _state.encode(self.part("b"), "state")

    def join(self, a: bytes, b: "bytes | None") -> bytes:
        """The whole record of encoded parts (``b`` None: taken now)."""
        return _state.encode({"a": _state.decode(a), **(_state.decode(b) if b is not None else self.part("b"))},
                             "state")


class Pending:
    """A capture taken in a post-hook, finished at the next pre-hook (:attr:`Capture.pending`):
    ``step``; ``record_b`` (None until part "b" of its record is taken); ``at_boundary`` (its
    record was taken at the loop's boundary); the rest is the capture's own."""

    __slots__ = ("step", "buf", "future", "versions", "record_a", "record_b", "error", "cuda", "at_boundary")

    def __init__(self, step: int, buf: np.ndarray) -> None:
        self.step, self.buf = step, buf
        self.at_boundary = False  # its state record was taken at the loop's boundary (end_iteration)
        self.future: "concurrent.futures.Future | None" = None
        self.versions: list[tuple[torch.Tensor, int, str]] = []
        self.record_a = b""
        self.record_b: "bytes | None" = None
        self.error: str = ""
        self.cuda: "_cuda.InFlight | None" = None  # device-to-host copies on the side stream


class Capture:
    """This rank's capture of a DDP or FSDP2 model and its optimizers (call order: module docstring).

    Args:
      model, optimizers: what is captured (the optimizers in the order the loop steps them).
      name: the checkpoint name (messages).
      rank, size, comm: this rank, the world size, and the communicator of the all-gathers.
      records: the state records (:class:`StateRecords`).
      overlap: copy the replicated pieces in a background thread (False: in the post-hook).
      min_shard_bytes: the smallest piece of the shard plan.
      max_inflight: captures the engine may hold at once (the pool has one buffer more).
      on_plan: called with each new shard plan before its buffers are made (the owner's engine).
      guard: the owner's ``on_error`` policy (:meth:`deepfreeze.run.Run.guard`): a capture no
        rank may write is given to it, on every rank.

    Bound methods given as ``on_plan`` and ``guard`` are held weakly: no reference cycle with
    the owner, which is so freed when the loop drops it, not by a later garbage collection
    (one inside a forked DataLoader worker would run its process groups' destructors there).

    Public state: :attr:`plan`, :attr:`plans` (built: 1 + changes), :attr:`torn` (versions not
    written because a tensor changed during their copy), :attr:`pending` (the capture taken and
    not finished: ``step``, ``at_boundary``, ``record_b``), :attr:`pool`, :attr:`cuda`.
    """

    def __init__(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], *, name: str,
                 rank: int, size: int, comm: Any, records: StateRecords, overlap: bool, min_shard_bytes: int,
                 max_inflight: int, on_plan: Callable[[ShardPlan], Any], guard: Callable[..., bool]) -> None:
        self.model, self.optimizers, self.name = model, optimizers, name
        self.rank, self.size, self.comm, self.records = rank, size, comm, records
        self.overlap, self.min_shard_bytes, self.max_inflight = overlap, min_shard_bytes, max_inflight
        self.on_plan, self.guard = _weakly(on_plan), _weakly(guard)
        self.torn: list[int] = []
        self.plans = 0
        self.plan: ShardPlan | None = None
        self.pending: Pending | None = None
        self.pool: BufferPool | None = None
        self.cuda: "_cuda.CudaCapture | None" = None  # CUDA tensors: the side-stream capture (_cuda.py)
        self._key: bytes | None = None
        self._caps: list[int] = []
        self._layout: FusedLayout | None = None
        self._segments: list = []
        self._st: "_state.TrainState | None" = None  # the last capture's tensor list (reused while unchanged)
        self._src_views: dict = {}
        self._dest_split: tuple = ([], {})
        self._grow = False  # a state record outgrew its room: the next plan doubles every rank's
        self._pinned: set[int] = set()
        self._model_tensors = 0
        self._t_post = 0.0
        self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"deepfreeze-capture-r{rank}")

    @staticmethod
    def check_devices(model: torch.nn.Module) -> None:
        """Refuse a model on a device the capture cannot copy from (meta, mps ...)."""
        _cuda.check_devices([*model.parameters(), *model.buffers()], "the model")

    def close(self) -> None:
        """The copy thread (after its copy) and the buffer pool."""
        self._copier.shutdown(wait=True)
        _cuda.release_pool(self.pool)

    def drop(self) -> "int | None":
        """Forget the pending capture (its hand-off can no longer run); its step, or None."""
        p, self.pending = self.pending, None
        return None if p is None else p.step

    # ------------------------------------------------------------------ the state record
    def take_record_b(self) -> None:
        """Part ``"b"`` of the pending capture's record now, unless taken (the next forward pre-hook)."""
        p = self.pending
        if p is not None and p.record_b is None:
            try:  # before the next step's forward (a step GradScaler skips never reaches a pre-hook)
                p.record_b = self.records.encode_b()
            except DeepFreezeError as e:  # surfaced when the capture finishes, on every rank
                p.error = f"rank {self.rank}: {e}"
                p.record_b = b""

    def take_records(self) -> None:
        """Both parts of the pending capture's state record, now (the loop's boundary), unless taken there."""
        p = self.pending
        if p is None or p.at_boundary:
            return
        p.at_boundary = True
        try:
            p.record_a = self.records.encode_a()
            p.record_b = self.records.encode_b()
        except DeepFreezeError as e:  # surfaced when the capture finishes, on every rank
            p.error = f"rank {self.rank}: {e}"
            p.record_b = b""

    # ------------------------------------------------------------------ capture
    def take(self, step: int, t0: "float | None" = None) -> None:
        """Capture the state after ``step`` (collective; a pending capture is finished first by
        the owner). ``t0``: when the post-hook began (its seconds are :attr:`Captured.post_s`)."""
        t0 = time.perf_counter() if t0 is None else t0
        err, key, need, rec_a = "", b"\0" * 16, 0, b""
        try:
            st = self._st = self.records.train_state(self._st)
            key = st.key()
            if self.plan is None or key != self._key:  # plan time: no reserved name, no name twice
                check_tensor_names(st.specs, f"checkpoint {self.name!r}")
            rec_a = self.records.encode_a()
            need = len(rec_a) + len(_state.encode(self.records.part("b", st), "record")) + 64
        except DeepFreezeError as e:  # still take part in the all-gather: no rank is left waiting
            err = f"rank {self.rank}: {e}"
        rows = self.comm.allgather(key + struct.pack("<Q", need) + err.encode()[:2000])
        errors = [r[24:].decode(errors="replace") for r in rows if len(r) > 24]
        if errors:
            self.guard(_raise, ConfigError(f"checkpoint {self.name!r} v{step} is not taken: " + "; ".join(errors)))
            return
        keys = [r[:16] for r in rows]
        if any(k != keys[0] for k in keys):
            bad = next(r for r, k in enumerate(keys) if k != keys[self.rank])
            raise ModelMismatchError(f"rank {bad} checkpoints a different model or optimizer state than rank "
                                     f"{self.rank} at step {step}: every rank must build the same model and optimizers")
        needs = [struct.unpack("<Q", r[16:24])[0] for r in rows]
        if self.plan is None or self._grow or keys[0] != self._key or any(n > c for n, c in zip(needs, self._caps)):
            self._new_plan(st, needs, step)
        assert self._layout is not None and self.pool is not None
        buf = self.pool.acquire()
        buf[:8].view("<i8")[0] = step
        p = Pending(step, buf)
        p.record_a = rec_a
        sync, background = [], []
        tensors, dtensors, versions = st.tensors, st.dtensors, p.versions
        for tid, seg, now, name in self._segments:  # this plan's pieces of this rank (_new_plan)
            t = tensors[tid]
            if now:
                sync.append((t, seg))  # copied now: buffers change in the next forward
            else:
                background.append((t, seg))
                versions.append((t, t._version, name))
                if tid in dtensors:  # the optimizer's in-place updates count on the DTensor, not its local shard
                    d = dtensors[tid]
                    versions.append((d, d._version, name))
        if self.cuda is not None:  # CUDA pieces: device-to-host on a side stream (deepfreeze/torch/_cuda.py)
            sync, background, p.cuda = self.cuda.start(sync, background, buf)
        self._copy(sync, buf)
        if background:
            p.future = self._copier.submit(self._copy, background, buf)
        self.pending = p
        self._t_post = time.perf_counter() - t0

    def _copy(self, items: list, buf: np.ndarray) -> None:
        """Copy each (tensor, segment) piece into ``buf`` (one pass, bytes as they are), in one
        ``torch._foreach_copy_``. The byte views of both sides are built once per plan and kept:
        a source per segment while it is the same tensor
        object on the same memory (``data_ptr``) and contiguous on the CPU (the view of a
        non-contiguous tensor would be a copy: rebuilt each time); the destinations are one
        ``split`` of the buffer (no view of the pool's buffers is kept: the pool counts references).
        With 1000s of small tensors the views, not the copies, were the capture's cost."""
        if not items:
            return
        sizes, where = self._dest_split
        parts = torch.from_numpy(buf[:sum(sizes)]).split(sizes)  # every segment's view, in one call
        cache = self._src_views
        dst, src = [], []
        for t, seg in items:
            dst.append(parts[where[seg.offset]])
            hit = cache.get(seg.offset)
            if hit is not None and hit[0] is t and hit[1] == t.data_ptr():
                v = hit[2]
            else:
                v = self._source_view(t, seg.piece)
                if t.device.type == "cpu" and t.is_contiguous():
                    cache[seg.offset] = (t, t.data_ptr(), v)
            src.append(v)
        torch._foreach_copy_(dst, src)
        del parts, dst  # views of the pool buffer: the pool sees it free once the engine is done

    @staticmethod
    def _source_view(t: torch.Tensor, piece: Piece) -> torch.Tensor:
        """The bytes of ``piece`` of ``t`` as a flat uint8 tensor (a view when ``t`` is contiguous on the CPU)."""
        src = t.detach()
        if src.device.type != "cpu":
            src = src.cpu()  # (CUDA pieces go through _cuda.CudaCapture; this is a fallback)
        src = src.reshape(-1)[piece.start:piece.stop]
        return src.contiguous().view(torch.uint8) if src.dtype != torch.uint8 else src.contiguous()

    def finish(self) -> "Captured | None":
        """Wait for the pending capture, check it, add the state record (collective: every rank
        has the capture or none has; a failure goes to ``guard`` on every rank and gives None)."""
        p, self.pending = self.pending, None
        if p is None:
            return None
        t0 = time.perf_counter()
        if p.future is not None:
            try:
                p.future.result()
            except Exception as e:  # surfaced below, on every rank
                p.error = f"rank {self.rank}: the capture copy failed: {type(e).__name__}: {e}"
        if p.cuda is not None:  # the current stream, then the host, wait for the side stream's copies
            try:
                p.cuda.wait()
            except Exception as e:  # surfaced below, on every rank
                p.error = p.error or f"rank {self.rank}: the CUDA capture copy failed: {type(e).__name__}: {e}"
        waited = time.perf_counter() - t0
        err: "CaptureTornError | None" = CaptureTornError(p.error) if p.error else None  # typed: sent as a record
        changed = [name for t, v, name in p.versions if t._version != v]
        if changed and err is None:
            err = ChangedInPlaceError(
                f"rank {self.rank}: {len(changed)} tensor(s) changed in place during the capture of v{p.step} "
                f"(first: {changed[0]!r}): only the optimizer may write parameters and optimizer state "
                "between two optimizer steps", count=len(changed), first=changed[0][:200])
        record = b""
        if err is None:
            try:
                record = self.records.join(p.record_a, p.record_b)
            except DeepFreezeError as e:
                err = CaptureTornError(f"rank {self.rank}: {e}")
        assert self.plan is not None and self._layout is not None
        rid = self.plan.tensors[-self.size + self.rank].id
        cap = self._caps[self.rank]
        if err is None and len(record) > cap:
            err = StateRecordOverflowError(f"rank {self.rank}: the state record grew to {len(record)} bytes beyond its "
                                           f"reserved {cap} bytes (the next checkpoint reserves more)",
                                           size=len(record), reserved=cap)
        failures = allgather_failures(self.comm, err)  # every rank's typed failure, the same on each rank
        if failures:
            if any(isinstance(e, ChangedInPlaceError) for e in failures.values()):
                self.torn.append(p.step)
            if any(isinstance(e, StateRecordOverflowError) for e in failures.values()):
                self._grow = True  # every rank: the next checkpoint builds a plan with more room
            ranks = RanksFailedError.of(failures)
            torn = CaptureTornError(f"checkpoint {self.name!r} v{p.step} is not written: {ranks}")
            torn.__cause__ = ranks  # .failures: each failed rank's error (class, message, fields)
            self.guard(_raise, torn)
            return None
        seg = next(s for s in self._layout.segments if s.piece.tensor_id == rid)
        dest = p.buf[seg.offset:seg.offset + seg.nbytes]
        dest[:len(record)] = np.frombuffer(record, dtype=np.uint8)
        dest[len(record):] = 0
        extra = {"model_tensors": self._model_tensors, "framework": "torch",
                 "torch": {"version": torch.__version__, "optimizers": len(self.optimizers),
                           "state_records": [t.name for t in self.plan.tensors[-self.size:]]}}
        got = Captured(p.step, FusedShard(self._layout, p.buf), self.plan, self._model_tensors, extra,
                       post_s=self._t_post, wait_s=waited)
        del dest, p  # views of the pool buffer: the shard holds it now
        return got

    def _new_plan(self, st: "_state.TrainState", needs: list[int], step: int) -> None:
        """A shard plan for ``st`` plus one state record per rank (room: twice what it needs now,
        page-rounded; never less than before), and the engine (``on_plan``) and buffers for it."""
        old = self.plan
        caps = [max(c * (2 if self._grow else 1), -(-(2 * n + _PAGE) // _PAGE) * _PAGE) for n, c in
                zip(needs, self._caps or [0] * self.size)]
        self._grow = False
        specs = list(st.specs) + [TensorSpec(len(st.specs) + r, f"{_state.RANK_PREFIX}{r}", "uint8", (caps[r],))
                                  for r in range(self.size)]
        plan = ShardPlan.build(specs, self.size, min_shard_bytes=self.min_shard_bytes, pinned=st.pinned,
                               given=st.bounds)
        records = {len(st.specs) + r: r for r in range(self.size)}
        pieces = [Piece(p.tensor_id, records[p.tensor_id], 0, caps[records[p.tensor_id]]) if p.tensor_id in records
                  else p for p in plan.pieces if p.tensor_id not in records or p.start == 0]  # record r: whole, rank r
        plan = dataclasses.replace(plan, pieces=tuple(pieces))  # (keeps build's parameters: the manifest records them)
        if self.rank == 0 and old is not None:
            why = ("the tensor list changed (optimizer state created lazily, add_param_group, or a model change): "
                   f"{len(old.tensors) - self.size} -> {len(st.specs)} tensors" if st.key() != self._key
                   else "a state record outgrew its reserved room")
            log.warning("DeepFreeze: %r: a new shard plan from v%d on: %s", self.name, step, why)
        self.on_plan(plan)
        self.plan, self._key, self._caps = plan, st.key(), caps
        self._pinned = set(st.pinned)
        self._model_tensors = st.model_tensors
        self._layout = FusedLayout.build(plan, self.rank)
        self._segments = []  # (tensor id, segment, copied in the hook, name): the capture's loop, built once
        self._src_views = {}  # _copy's byte views of this plan's tensors, and the split of a buffer
        cuts, sizes, at = {}, [], 0
        for seg in sorted(self._layout.segments, key=lambda g: g.offset):
            if seg.nbytes and seg.offset >= at:
                if seg.offset > at:
                    sizes.append(seg.offset - at)  # a gap (padding) between segments
                cuts[seg.offset] = len(sizes)
                sizes.append(seg.nbytes)
                at = seg.offset + seg.nbytes
        self._dest_split = (sizes, cuts)
        for seg in self._layout.segments:
            tid = seg.piece.tensor_id
            if tid >= len(st.tensors) or seg.nbytes == 0:
                continue  # a state record (filled when the capture finishes), or nothing to copy
            if tid in st.bounds:
                seg = dataclasses.replace(seg, piece=local_piece(seg.piece, st.bounds, self.rank))
            self._segments.append((tid, seg, tid in self._pinned or not self.overlap, plan.tensors[tid].name))
        self.cuda = _cuda.capture_for(st.tensors, self.cuda)
        _cuda.release_pool(self.pool)
        if self.cuda is not None:
            self.pool = self.cuda.pool(self._layout.nbytes, self.max_inflight + 1)
        else:  # built inside the first checkpoint's step: mapped now; the pages faulted by the copy into them
            # or, ahead of it, by the pool's low-priority thread (not in the step)
            self.pool = BufferPool(self._layout.nbytes, self.max_inflight + 1, prefault=False, populate=True)
        self.plans += 1


# ----------------------------------------------------------------------------- the live capture

class Live:
    """The live state after optimizer step :attr:`step`, lent to the :class:`LiveSubscriber` objects
    that wanted it from their :meth:`~LiveSubscriber.on_live` until their
    :meth:`~LiveSubscriber.on_release` (the tensors do not change in between: the next
    ``optimizer.step()`` waits).

    ``state``: the tensor list (:class:`deepfreeze.torch._state.TrainState`: ``tensors`` are the
    live tensors themselves, no copy; ``specs``, ``pinned``, ``model_tensors``, ``aliases``);
    ``at_boundary``: the record was taken whole at the loop's boundary; ``error``: the
    :class:`~deepfreeze.errors.DeepFreezeError` taking the record raised (None: none, or not yet).
    The rank's state record (:class:`StateRecords`) is :meth:`record`, taken by the
    :class:`LiveCapture` as the Checkpointer's capture takes it: part ``"a"`` in the post-hook,
    part ``"b"`` at the next forward pre-hook, or both at the loop's boundary; at the latest
    before ``on_release``."""

    __slots__ = ("step", "state", "at_boundary", "error", "needs_record", "_a", "_record", "_taken", "_lock")

    def __init__(self, step: int, state: "_state.TrainState", needs_record: bool = True) -> None:
        self.step, self.state = step, state
        #: a holder wants the state record (:attr:`LiveSubscriber.wants_record`): else none is taken
        self.needs_record = needs_record
        self.at_boundary = False
        self.error: "DeepFreezeError | None" = None
        self._a: "bytes | None" = None  # part "a", taken in the post-hook (None: at the loop's boundary)
        self._record = b""
        self._taken = threading.Event()
        self._lock = threading.Lock()  # the loop's thread and a wait()/close() on another may both take it

    @property
    def taken(self) -> bool:
        """Whether the record is taken (or failed: :attr:`error`)."""
        return self._taken.is_set()

    def record(self, timeout: float) -> "bytes | None":
        """This rank's state record, once taken (any thread; waits at most ``timeout`` s: None when
        it is not taken by then). Raises the :class:`~deepfreeze.errors.DeepFreezeError` taking it raised."""
        if not self._taken.wait(timeout):
            return None
        if self.error is not None:
            raise self.error
        return self._record

    def take_a(self, records: StateRecords) -> None:
        """Part ``"a"`` now (the post-hook of a loop that marks no boundary)."""
        try:
            self._a = records.encode_a()
        except DeepFreezeError as e:
            self.error = e
            self._taken.set()

    def take(self, records: StateRecords, whole: bool) -> None:
        """The record now, unless taken: part ``"a"`` of the post-hook and ``"b"`` now, or (``whole``,
        or no part ``"a"`` was taken) both now."""
        with self._lock:
            if self._taken.is_set():
                return
            whole = whole or self._a is None
            try:
                self._record = records.join(records.encode_a() if whole else self._a, None)
            except DeepFreezeError as e:
                self.error = e
            self.at_boundary = whole
            self._taken.set()


class LiveSubscriber(Protocol):
    """What reads the live tensors of a step instead of a finished shard (the
    :class:`~deepfreeze.torch.CloneServer`): no copy into a buffer, no collective of its own.

    Call order, on every rank (the same calls: :class:`LiveCapture`)::

        wants_live(step)   # post-hook of every step, in subscription order; collective calls are
                           # fine (every rank asks every subscriber at every step)
        on_live(live)      # right after, in the same post-hook, if it wanted the step: a Live, its
                           # tensors lent until on_release; collective calls are fine
        on_release(live)   # before the tensors change: the next optimizer pre-hook, or the owner's
                           # LiveCapture.release()/close(); the record is taken by then. Return once
                           # nothing reads the tensors any more (bounded: the subscriber's timeout)
        on_close()         # once, last (LiveCapture.unsubscribe or close)

    What they raise goes through ``optimizer.step()`` (there is no ``on_error`` policy here: a
    subscriber keeps what it survives to itself).

    A subscriber whose class sets ``wants_record = False`` and ``wants_optimizer_state = False``
    (the stream :class:`~deepfreeze.torch.Publisher`: weights only) needs no state record and no
    optimizer state: when no holder of a step wants them, none is taken and ``live.state`` lists
    the model's tensors only (no walk of the optimizers' state)."""

    #: whether it reads the rank's state record (:meth:`Live.record`); False: none is taken for it
    wants_record: bool = True
    #: whether it reads the optimizers' state tensors in ``live.state`` (False: the model's only)
    wants_optimizer_state: bool = True

    def wants_live(self, step: int) -> bool:
        """Does this subscriber want the live state after optimizer step ``step``?"""
        ...

    def on_live(self, live: Live) -> None:
        """The live state it wanted (:class:`Live`), lent until :meth:`on_release`."""
        ...

    def on_release(self, live: Live) -> None:
        """The tensors of ``live`` are about to change: return when nothing reads them."""
        ...

    def on_close(self) -> None:
        """No live state comes any more."""
        ...


class LiveCapture(Sink):
    """The live states of a model's steps, for :class:`LiveSubscriber` objects (call order there):
    a sink of the model's :class:`~deepfreeze.torch.hook.StepHook` that counts the steps
    (:attr:`step`: the last optimizer's), asks its subscribers which steps they want, lends them
    the tensor list of such a step (:class:`Live`), takes the rank's state record with
    ``records`` (:class:`StateRecords`, with the Checkpointer's timing) and holds the next
    ``optimizer.step()`` until every subscriber released it. Nothing collective of its own; no
    copy (what a subscriber copies is its own). Subscribed to the step hook when built, until
    :meth:`close`.

    :attr:`boundary`: the loop marks its boundaries (:meth:`end_iteration`, :meth:`iterate`);
    :attr:`live`: the state lent now (None: none)."""

    def __init__(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], *,
                 records: StateRecords) -> None:
        self.records = records
        self.step = 0
        self.boundary = False
        self.live: "Live | None" = None
        self.subscribers: list[LiveSubscriber] = []
        self._holders: list[LiveSubscriber] = []  # the subscribers the lent state went to
        self._st: "_state.TrainState | None" = None  # the last tensor list (reused while unchanged)
        self._st_model: "_state.TrainState | None" = None  # the last one of the model's tensors only
        self.hook = hook_for(model, optimizers)
        self.hook.subscribe(self)

    def subscribe(self, subscriber: LiveSubscriber) -> None:
        """Lend ``subscriber`` the live states it wants (every rank subscribes the same way)."""
        if subscriber not in self.subscribers:
            self.subscribers.append(subscriber)

    def unsubscribe(self, subscriber: LiveSubscriber) -> None:
        """Release the state lent now, stop asking ``subscriber``, then its ``on_close``."""
        if subscriber not in self.subscribers:
            return
        try:
            self.release()
        finally:
            self.subscribers.remove(subscriber)
            subscriber.on_close()

    # ------------------------------------------------------------------ the loop
    def iterate(self, iterable: Any, name: str) -> Any:
        """``iterable``'s items with :meth:`end_iteration` after each (the records hold the pass's position)."""
        self.boundary = True
        return self.records.loop.iterate(iterable, self.end_iteration, name)

    def end_iteration(self) -> None:
        """The loop's boundary: the lent state's record is taken here, whole. Not collective."""
        self.boundary = True
        live = self.live
        if live is not None and live.needs_record:
            live.take(self.records, whole=True)

    # ------------------------------------------------------------------ the step hook
    def after_step(self, optimizer: Any) -> None:
        self.step += 1
        self.release()
        wanted = [s for s in list(self.subscribers) if s.wants_live(self.step)]
        if not wanted:
            return
        record = any(getattr(s, "wants_record", True) for s in wanted)
        if record or any(getattr(s, "wants_optimizer_state", True) for s in wanted):
            st = self._st = self.records.train_state(self._st)
        else:  # the model's tensors only: no optimizer given, none walked
            st = self._st_model = _state.train_state(self.records.model, (), self._st_model)
        live = Live(self.step, st, record)
        if not self.boundary and live.needs_record:
            live.take_a(self.records)
        self.live, self._holders = live, wanted
        for s in wanted:
            s.on_live(live)

    def before_forward(self, module: Any, args: Any) -> None:
        live = self.live
        if live is not None and not self.boundary and live.needs_record:
            live.take(self.records, whole=False)  # after the loop's scheduler.step()/scaler.update()

    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.release()  # the tensors change next
        return None

    def release(self) -> None:
        """End the lending of :attr:`live` (its record taken now unless taken, then each holder's
        ``on_release``); the next ``optimizer.step()`` does it before any tensor changes."""
        live = self.live
        if live is None:
            return
        if live.needs_record:
            live.take(self.records, whole=False)
        for s in list(self._holders):
            s.on_release(live)
        if self.live is live:  # (another thread may have released it meanwhile)
            self.live, self._holders = None, []

    def close(self) -> None:
        """Release the lent state, leave the step hook, then every subscriber's ``on_close``."""
        try:
            self.release()
        finally:
            self.hook.unsubscribe(self)
            subscribers, self.subscribers = self.subscribers, []
            for s in subscribers:
                s.on_close()


def local_piece(piece: Piece, bounds: dict, rank: int) -> Piece:
    """``piece`` in the elements of this rank's local tensor: an FSDP2 shard's plan offsets are
    global (``bounds``: tensor id -> every rank's flat element bounds), its local tensor starts at
    ``rank``'s bound; any other piece as it is."""
    if piece.tensor_id not in bounds:
        return piece
    base = bounds[piece.tensor_id][rank]
    return dataclasses.replace(piece, start=piece.start - base, stop=piece.stop - base)


def _raise(e: BaseException) -> None:
    raise e


def _weakly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, holding a bound method's object weakly (a plain function as it is)."""
    if not inspect.ismethod(fn):
        return fn
    ref = weakref.WeakMethod(fn)

    def call(*args: Any, **kwargs: Any) -> Any:
        method = ref()
        if method is None:
            raise ReferenceError("the capture's owner is gone")
        return method(*args, **kwargs)
    return call
