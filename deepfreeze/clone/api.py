"""The whole-transfer API of DeepClone over numpy arrays: :class:`CloneInfo`, :func:`plans_for`,
:func:`send`, :func:`receive` (re-exported by :mod:`deepfreeze.clone`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import numpy as np

from ..errors import CloneError
from ..shardplan import TensorSpec
from .group import Group
from .plan import DEFAULT_THRESHOLD, ClonePlan
from .transfer import DEFAULT_TIMEOUT, TAG_HEADER, Receiver, Sender

__all__ = ["CloneInfo", "send", "receive", "plans_for"]


@dataclasses.dataclass(frozen=True)
class CloneInfo:
    """What a clone received besides the tensors. ``step``: the source's global optimizer
    step (the clone's ``optimizer.iterations``); ``epoch`` (0-based) and ``epoch_step``
    (batches of that epoch done); ``epoch_complete``: the step ended its epoch;
    ``source_run``: the source's run id; ``source_name``: the source's checkpoint name,
    if it had one; ``timings``: wall-clock times of the receive's phases (``time.time()``)."""

    step: int
    epoch: int
    epoch_step: int
    epoch_complete: bool
    source_run: str
    source_name: str | None = None
    timings: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_header(cls, h: dict) -> "CloneInfo":
        try:
            return cls(step=int(h["step"]), epoch=int(h.get("epoch", 0)), epoch_step=int(h.get("epoch_step", 0)),
                       epoch_complete=bool(h.get("epoch_complete", False)), source_run=str(h.get("source_run", "")),
                       source_name=None if h.get("source_name") is None else str(h["source_name"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CloneError(f"malformed clone header {h!r}: {e}") from e

    def header(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "timings"}


def plans_for(group: Group, tensors: Sequence[TensorSpec], *, whole: Iterable[int] = (),
              threshold: int = DEFAULT_THRESHOLD) -> dict[int, ClonePlan]:
    """clone group index -> plan with it (source side), or {0: plan} (clone side)."""
    whole = list(whole)
    n = group.sizes[0]
    if group.is_source:
        return {g: ClonePlan(tensors, n, group.sizes[g], whole=whole, threshold=threshold) for g in group.clones}
    return {0: ClonePlan(tensors, n, group.size, whole=whole, threshold=threshold)}


def send(group: Group, tensors: Sequence[TensorSpec], arrays: Sequence[np.ndarray], info: CloneInfo, *,
         whole: Iterable[int] = (), threshold: int = DEFAULT_THRESHOLD,
         timeout: float = DEFAULT_TIMEOUT, sender_cls: type = Sender) -> Sender:
    """Source side of a whole transfer of numpy ``arrays`` (one per tensor spec, identical on
    every source rank except ``whole`` ones, taken from source rank 0). Collective over the
    source group and every clone group's :func:`receive`. Returns the (closed) sender.
    ``sender_cls``: advanced, a :class:`Sender` subclass (tests)."""
    sender = sender_cls(group, plans_for(group, tensors, whole=whole, threshold=threshold), timeout=timeout)
    try:
        sender.hello()
        sender.wait_hello()
        for t, a in zip(tensors, arrays):
            sender.post(t.id, np.ascontiguousarray(a).reshape(-1))
        if group.rank == 0:
            sender.post_control(TAG_HEADER, info.header())
        sender.wait()
    finally:
        sender.close()
    return sender


def receive(group: Group, tensors: Sequence[TensorSpec], *, whole: Iterable[int] = (),
            threshold: int = DEFAULT_THRESHOLD, timeout: float = DEFAULT_TIMEOUT,
            comm: Any = None, receiver_cls: type = Receiver) -> tuple[list[np.ndarray], CloneInfo]:
    """Clone side of :func:`send`: every tensor, whole, on every clone rank (shaped), and the
    :class:`CloneInfo`. ``comm``: the clone group's communicator for the all-gathers
    (default: a duplicate of ``group.comm``). ``receiver_cls``: advanced, a :class:`Receiver`
    subclass (tests). Every wait is bounded by ``timeout``."""
    (plan,) = plans_for(group, tensors, whole=whole, threshold=threshold).values()
    recv = receiver_cls(group, plan, timeout=timeout)
    recv.open_group(comm)
    error: BaseException | None = None
    try:
        recv.hello()
        buffers = recv.allocate()
        recv.prepare(buffers, group.rank)
        info = CloneInfo.from_header(recv.receive(buffers))
    except CloneError as e:  # ModelMismatchError is not one: every rank of both sides sees it
        error = e
    own = recv.agree(error)  # bounded; raises the error, or names a clone rank that failed
    try:
        recv.reconstruct(buffers, own)
    finally:
        if comm is None:
            own.Free()
    return [buffers[t.id].reshape(t.shape) for t in tensors], info
