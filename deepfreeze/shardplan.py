"""Shard plan: which rank captures which part of which tensor.

Computed once, when the training graph is built, identically on every rank (it
is a pure function of the tensor list and the world size), so no rank ever has
to ask another what it holds.

Layout choice: a tensor is split into ``world_size`` *flat contiguous* element
ranges of its C-order buffer (``reshape(-1)[start:stop]``). The paper slices
along the largest dimension; a flat split is never worse for balance (pieces
differ by at most 64 bytes: split points are 64-byte aligned, see ``split_bounds``), its in-graph copy is one contiguous memcpy
instead of a strided gather when the largest dimension is not the first
(``experiments/shard_layout.py`` measures both), and every piece lands in the
assembled file with a single contiguous write.

Tensors smaller than ``min_shard_bytes`` (biases, norms), scalars, tensors with
fewer elements than ranks, and zero-size tensors are assigned *whole* to one
rank: largest first to the rank with the fewest bytes so far, so every rank
writes about the same number of bytes. Tensors ``pinned`` to rank 0 (variables
the optimizer does not update, e.g. BatchNormalization moving statistics,
which may differ across ranks) are assigned whole to rank 0 first.

Tensors already sharded by the framework (FSDP2's dim-0 shards) come with *given* bounds:
``given[id]`` lists ``world_size + 1`` flat element bounds, rank ``r`` holding
``[bounds[r], bounds[r + 1])`` (a dim-0 row range of a C-order tensor is one flat range); the
plan takes them as they are (uneven, some empty: an empty range makes no piece) instead of its
own split. Offsets are always global: the manifest records every piece's place in the whole
tensor, so readers see whole tensors whatever the layout that wrote them.

Rules of :meth:`ShardPlan.build`, in order: pinned tensors whole to rank 0; tensors with given
bounds as given; a tensor is split when ``world_size > 1``, it has at least ``min_shard_bytes``
(default 64 KiB) and at least 1 byte, and at least ``world_size`` elements; every other tensor
whole, largest first, to the rank with the fewest bytes so far (ties: the lowest rank). The
flat split against largest-dimension slicing, measured on NT3's weights at 2 ranks: 25.5 and
25.3 ms per rank against 81.7 and 86.8 ms, the same bytes per rank (docs/performance.md, "Shard
layout").

Every rank builds the plan itself, and the adapters check that the ranks agree before any
checkpoint (Keras: an all-gather of a 16-byte SHA-256 prefix of the plan and tensor list with
the rank's failure domain; torch: the tensor-list key at every checkpoint); a difference is a
:class:`~deepfreeze.errors.ModelMismatchError`. The plan is stored in every manifest
(:meth:`ShardPlan.to_json`) and validated when read back (:meth:`ShardPlan.from_json`: the pieces
must tile every tensor exactly); restore uses the stored plan, so a checkpoint can be read at any
world size.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Sequence

from .errors import CorruptCheckpointError
from .format import dtype_itemsize

__all__ = ["TensorSpec", "Piece", "ShardPlan", "DEFAULT_MIN_SHARD_BYTES", "SPLIT_ALIGN", "split_bounds"]

DEFAULT_MIN_SHARD_BYTES = 64 * 1024
SPLIT_ALIGN = 64  # bytes: split points of a tensor fall on multiples of this (see split_bounds)


def split_bounds(size: int, world_size: int, itemsize: int) -> list[int]:
    """Element bounds of ``world_size`` flat pieces of a tensor of ``size`` elements.

    Every inner bound is rounded down to a multiple of ``SPLIT_ALIGN`` bytes (when the
    item size divides it), so every piece starts at an aligned address of the tensor's
    buffer: the in-graph capture then reads each piece as a view of the variable (TF
    aliases an aligned contiguous slice, and copies an unaligned one), and pieces differ
    by at most ``SPLIT_ALIGN / itemsize`` elements. If rounding would leave a piece
    empty, the plain split (``size * r // world_size``) is used.
    """
    plain = [size * r // world_size for r in range(world_size + 1)]
    step = SPLIT_ALIGN // itemsize if itemsize and SPLIT_ALIGN % itemsize == 0 else 1
    bounds = [b // step * step for b in plain[:-1]] + [size]
    if any(bounds[r + 1] <= bounds[r] for r in range(world_size)):
        return plain
    return bounds


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One checkpointed tensor: stable id (its position), name, dtype name, full shape."""

    id: int
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * dtype_itemsize(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of tensor ``tensor_id`` (flat, C order), held by ``rank``."""

    tensor_id: int
    rank: int
    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    tensors: tuple[TensorSpec, ...]
    world_size: int
    pieces: tuple[Piece, ...]  # sorted by (tensor_id, start); they tile every tensor exactly
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES

    @classmethod
    def build(cls, tensors: Sequence[TensorSpec], world_size: int, *,
              min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
              pinned: Iterable[int] = (), given: "dict[int, Sequence[int]] | None" = None) -> "ShardPlan":
        """The plan of ``tensors`` over ``world_size`` ranks (module docstring); ``given``: tensor
        id -> ``world_size + 1`` flat element bounds of the framework's own shards."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if min_shard_bytes < 0:
            raise ValueError(f"min_shard_bytes must be >= 0, got {min_shard_bytes}")
        tensors = tuple(tensors)
        for i, t in enumerate(tensors):
            if t.id != i:
                raise ValueError(f"tensor ids must be 0..n-1 in order; tensor {t.name!r} has id {t.id} at {i}")
        pinned = set(pinned)
        given = dict(given or {})
        for tid, b in given.items():
            if not 0 <= tid < len(tensors) or tid in pinned:
                raise ValueError(f"given bounds for tensor id {tid}: not a tensor of the list, or pinned")
            b = list(b)
            if len(b) != world_size + 1 or b[0] != 0 or b[-1] != tensors[tid].size \
                    or any(b[r + 1] < b[r] for r in range(world_size)):
                raise ValueError(f"given bounds {b} of tensor {tensors[tid].name!r} ({tensors[tid].size} elements) "
                                 f"are not {world_size + 1} non-decreasing bounds from 0 to its size")
        load = [0] * world_size
        pieces: list[Piece] = []
        whole: list[TensorSpec] = []
        for t in tensors:
            if t.id in pinned:
                pieces.append(Piece(t.id, 0, 0, t.size))
                load[0] += t.nbytes
            elif t.id in given and t.size > 0:
                b = list(given[t.id])
                for r in range(world_size):
                    if b[r + 1] > b[r]:
                        pieces.append(Piece(t.id, r, b[r], b[r + 1]))
                        load[r] += (b[r + 1] - b[r]) * dtype_itemsize(t.dtype)
            elif world_size > 1 and t.nbytes >= max(min_shard_bytes, 1) and t.size >= world_size:
                bounds = split_bounds(t.size, world_size, dtype_itemsize(t.dtype))
                for r in range(world_size):
                    pieces.append(Piece(t.id, r, bounds[r], bounds[r + 1]))
                    load[r] += (bounds[r + 1] - bounds[r]) * dtype_itemsize(t.dtype)
            else:
                whole.append(t)
        for t in sorted(whole, key=lambda t: (-t.nbytes, t.id)):
            r = min(range(world_size), key=lambda r: (load[r], r))
            pieces.append(Piece(t.id, r, 0, t.size))
            load[r] += t.nbytes
        pieces.sort(key=lambda p: (p.tensor_id, p.start, p.rank))
        return cls(tensors, world_size, tuple(pieces), min_shard_bytes)

    def for_rank(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.rank == rank]

    def rank_bytes(self) -> list[int]:
        out = [0] * self.world_size
        for p in self.pieces:
            out[p.rank] += p.count * dtype_itemsize(self.tensors[p.tensor_id].dtype)
        return out

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "min_shard_bytes": self.min_shard_bytes,
                "pieces": [[p.tensor_id, p.rank, p.start, p.stop] for p in self.pieces]}

    @classmethod
    def from_json(cls, tensors: Sequence[TensorSpec], obj: Any) -> "ShardPlan":
        """Rebuild and *validate* a plan read from disk: pieces must tile every tensor exactly."""
        try:
            world = int(obj["world_size"])
            msb = int(obj.get("min_shard_bytes", DEFAULT_MIN_SHARD_BYTES))
            raw = obj["pieces"]
            if not isinstance(raw, list) or not 1 <= world <= 1 << 20:
                raise ValueError("bad world_size or pieces")
            pieces = []
            for item in raw:
                if not (isinstance(item, list) and len(item) == 4 and all(type(v) is int for v in item)):
                    raise ValueError(f"bad piece {item!r}")
                pieces.append(Piece(*item))
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"manifest shard plan is malformed: {e}") from e
        pieces.sort(key=lambda p: (p.tensor_id, p.start, p.rank))
        cursor = {t.id: 0 for t in tensors}
        for p in pieces:
            if p.tensor_id not in cursor or not 0 <= p.rank < world or p.start != cursor[p.tensor_id] \
                    or p.stop < p.start:
                raise CorruptCheckpointError(f"manifest shard plan does not tile the tensors (piece {p})")
            cursor[p.tensor_id] = p.stop
        for t in tensors:
            if cursor[t.id] != t.size:
                raise CorruptCheckpointError(
                    f"manifest shard plan covers {cursor[t.id]} of {t.size} elements of tensor {t.name!r}")
        return cls(tuple(tensors), world, tuple(pieces), msb)
