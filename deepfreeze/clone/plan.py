"""The clone plan: which source rank sends which element range of which tensor to which
clone rank, and how the clone group rebuilds every tensor (one all-gather-v each).

A pure function of the tensor list, the two group sizes and the threshold, computed
identically and independently on every rank of both groups; :meth:`ClonePlan.digest`
lets them check that before any data moves.

* A *large* replicated tensor (more than ``threshold`` bytes and at least as many
  elements as either group has ranks): split into N flat element ranges on the
  source side (source rank r holds range r of every replica, so it sends from its
  own range) and M ranges on the clone side (clone rank j ends up with range j). One
  message per non-empty intersection (tensor, source range, clone range): with N == M
  it is the paper's 1:1 "shard r to clone r"; with N != M each clone rank receives its
  own 1/M from the source ranks that hold it. Split points are 64-byte aligned
  (:func:`deepfreeze.shardplan.split_bounds`) so every range is a view of the variable.
* A *small* replicated tensor goes whole, from one source rank to one clone rank,
  both chosen to balance bytes (largest first to the least loaded).
* A *whole* tensor (not replicated across the source ranks: BatchNormalization's
  moving statistics and other state the optimizer does not update) goes whole from
  source rank 0, balanced over the clone ranks.

Reconstruction: ``partition[t][j]`` is the range of tensor t that clone rank j holds after
receiving (the whole tensor on its one owner, nothing on the others, for small and whole
tensors). The clone group then gives every rank everything: one in-place broadcast per
owner j of all of j's ranges, in plan order (the model's weights in forward order, then the
optimizer's variables): the paper's sequence of per-tensor all-gathers, fused
(:meth:`deepfreeze.clone.Receiver.reconstruct`). Every clone rank runs the same sequence,
so the collectives match.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Iterable, Sequence

from ..format import dtype_itemsize
from ..shardplan import TensorSpec, split_bounds

__all__ = ["Route", "ClonePlan", "DEFAULT_THRESHOLD"]

DEFAULT_THRESHOLD = 64 * 1024  # bytes: tensors up to this size go whole (one message, no split)
PLAN_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Route:
    """Elements ``[start, stop)`` of tensor ``tensor_id``'s flat buffer, from source group
    rank ``src`` to clone group rank ``dst``."""

    tensor_id: int
    src: int
    dst: int
    start: int
    stop: int


def _greedy(loads: list[int], nbytes: int) -> int:
    r = min(range(len(loads)), key=lambda i: (loads[i], i))
    loads[r] += nbytes
    return r


class ClonePlan:
    """Routes and all-gather partitions for a source group of ``n_src`` ranks and a clone
    group of ``n_clone`` ranks. ``whole``: ids of tensors taken whole from source rank 0."""

    def __init__(self, tensors: Sequence[TensorSpec], n_src: int, n_clone: int, *,
                 whole: Iterable[int] = (), threshold: int = DEFAULT_THRESHOLD) -> None:
        if n_src < 1 or n_clone < 1:
            raise ValueError(f"group sizes must be >= 1, got {n_src} and {n_clone}")
        self.tensors = list(tensors)
        if [t.id for t in self.tensors] != list(range(len(self.tensors))):
            raise ValueError("tensor ids must be 0..n-1 in order")
        self.n_src, self.n_clone, self.threshold = n_src, n_clone, int(threshold)
        self.whole = frozenset(whole)
        self.routes: list[Route] = []
        # tid -> [(start, stop)] per clone rank: the all-gather-v partition
        self.partition: dict[int, list[tuple[int, int]]] = {}
        src_load, dst_load = [0] * n_src, [0] * n_clone
        small = []
        for t in self.tensors:
            size = t.size
            nbytes = size * dtype_itemsize(t.dtype)
            if size == 0:
                self.partition[t.id] = [(0, 0)] * n_clone
            elif t.id in self.whole or nbytes <= self.threshold or size < max(n_src, n_clone):
                small.append((nbytes, t.id))
            else:
                item = dtype_itemsize(t.dtype)
                sb, cb = split_bounds(size, n_src, item), split_bounds(size, n_clone, item)
                self.partition[t.id] = [(cb[j], cb[j + 1]) for j in range(n_clone)]
                for r in range(n_src):
                    for j in range(n_clone):
                        lo, hi = max(sb[r], cb[j]), min(sb[r + 1], cb[j + 1])
                        if lo < hi:
                            self.routes.append(Route(t.id, r, j, lo, hi))
                for r in range(n_src):
                    src_load[r] += (sb[r + 1] - sb[r]) * item
                for j in range(n_clone):
                    dst_load[j] += (cb[j + 1] - cb[j]) * item
        for nbytes, tid in sorted(small, key=lambda x: (-x[0], x[1])):
            size = self.tensors[tid].size
            if tid in self.whole:
                src = 0
                src_load[0] += nbytes
            else:
                src = _greedy(src_load, nbytes)
            dst = _greedy(dst_load, nbytes)
            self.partition[tid] = [(0, size) if j == dst else (0, 0) for j in range(n_clone)]
            self.routes.append(Route(tid, src, dst, 0, size))
        self.routes.sort(key=lambda r: (r.tensor_id, r.src, r.dst))
        self.src_bytes, self.dst_bytes = src_load, dst_load

    def sends_of(self, src: int) -> dict[int, list[Route]]:
        """tensor id -> the routes source rank ``src`` sends."""
        out: dict[int, list[Route]] = {}
        for r in self.routes:
            if r.src == src:
                out.setdefault(r.tensor_id, []).append(r)
        return out

    def source_range(self, src: int, tensor_id: int) -> tuple[int, int]:
        """The element range covering every route of ``tensor_id`` that ``src`` sends
        ((0, 0) when it sends none): what the in-graph hook hands over."""
        mine = [r for r in self.routes if r.src == src and r.tensor_id == tensor_id]
        if not mine:
            return (0, 0)
        return min(r.start for r in mine), max(r.stop for r in mine)

    def recvs_of(self, dst: int) -> list[Route]:
        """The routes clone rank ``dst`` receives, in plan order."""
        return [r for r in self.routes if r.dst == dst]

    def describe(self) -> dict:
        """Plain data of everything both sides must agree on (what :meth:`digest` hashes)."""
        return {"version": PLAN_VERSION, "n_src": self.n_src, "n_clone": self.n_clone,
                "threshold": self.threshold,
                "tensors": [[t.name, t.dtype, list(t.shape), t.id in self.whole] for t in self.tensors]}

    def digest(self) -> str:
        data = json.dumps(self.describe(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(data).hexdigest()

    @property
    def nbytes(self) -> int:
        return sum(t.size * dtype_itemsize(t.dtype) for t in self.tensors)


def first_difference(mine: dict, theirs: dict) -> str:
    """A sentence naming the first difference between two :meth:`ClonePlan.describe` results."""
    for key in ("version", "n_src", "n_clone", "threshold"):
        if mine.get(key) != theirs.get(key):
            return f"{key} is {mine.get(key)!r} here and {theirs.get(key)!r} there"
    a, b = mine.get("tensors", []), theirs.get("tensors", [])
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            def show(t: list) -> str:
                return f"{t[0]!r} {t[1]} {tuple(t[2])}{' (taken whole from source rank 0)' if t[3] else ''}"
            return f"tensor #{i} is {show(x)} here and {show(y)} there"
    if len(a) != len(b):
        return f"{len(a)} tensors here, {len(b)} there (first extra: {(a if len(a) > len(b) else b)[min(len(a), len(b))][0]!r})"
    return "the plans differ"
