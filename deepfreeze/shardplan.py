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
25.3 ms per rank against 81.7 and 86.8 ms, the same bytes per rank (docs/performance-history.md, "Shard
layout").

Every rank builds the plan itself, and the adapters check that the ranks agree before any
checkpoint (Keras: an all-gather of a 16-byte SHA-256 prefix of the plan and tensor list with
the rank's failure domain; torch: the tensor-list key at every checkpoint); a difference is a
:class:`~deepfreeze.errors.ModelMismatchError`. The plan is stored in every manifest
(:meth:`ShardPlan.to_json`) and validated when read back (:meth:`ShardPlan.from_json`: the pieces
must tile every tensor exactly); restore uses the stored plan, so a checkpoint can be read at any
world size.

The plan record (the manifest's ``plan``) is *compact*: it holds what the plan is a function of,
not the pieces, so a manifest grows as T + N, not T·N::

    {"algorithm": "flat-v1", "world_size": N, "min_shard_bytes": m, "pinned": [tensor ids],
     "given": [[tensor id, b0, ..., bN], ...], "explicit": [[tensor id, rank, start, stop], ...]}

``algorithm`` names the rules above (``flat-v1``: the rules of :meth:`ShardPlan.build` as of
format version 2, split points aligned to ``SPLIT_ALIGN`` = 64 bytes); ``world_size``,
``min_shard_bytes``, ``pinned`` (the ids pinned to rank 0) and ``given`` (FSDP2's bounds, one row
of ``N + 1`` bounds per tensor: no rule derives them) are its parameters. ``explicit`` lists every
piece of each tensor whose pieces the rules do not give (the PyTorch adapter's per-rank state
records, each whole on its own rank): the reader builds the plan with the recorded parameters
(:meth:`ShardPlan.build`), then replaces the pieces of each tensor named in ``explicit`` by the
listed ones, and validates the result like any plan. A plan no rule set reproduces at all is
written in the older form, ``{"world_size", "min_shard_bytes", "pieces": [[tensor id, rank,
start, stop], ...]}`` (every piece), which every DeepFreeze still reads. An ``algorithm`` this
version does not know is refused with a :class:`~deepfreeze.errors.CorruptCheckpointError` that
says a newer DeepFreeze wrote it. ``tests/test_plan_golden.py`` pins what ``flat-v1`` derives, so
the meaning of a manifest already written never changes: a change to the rules is a new
algorithm id.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from typing import Any, Iterable, Sequence

from .errors import ConfigError, CorruptCheckpointError
from .format import MAX_ENTRIES, dtype_itemsize

__all__ = ["TensorSpec", "Piece", "ShardPlan", "DEFAULT_MIN_SHARD_BYTES", "SPLIT_ALIGN", "split_bounds",
           "PLAN_ALGORITHM", "PLAN_ALGORITHMS", "RESERVED_PREFIX", "check_tensor_names"]

DEFAULT_MIN_SHARD_BYTES = 64 * 1024
SPLIT_ALIGN = 64  # bytes: split points of a tensor fall on multiples of this (see split_bounds)
PLAN_ALGORITHM = "flat-v1"  #: the plan algorithm this version writes (module docstring)
PLAN_ALGORITHMS = ("flat-v1",)  #: the plan algorithms this version reads
RESERVED_PREFIX = "_deepfreeze/"  #: tensor names DeepFreeze keeps for itself (the torch state records)


def check_tensor_names(tensors: Iterable[TensorSpec], what: str = "checkpoint") -> None:
    """Refuse, at plan time, the user's tensor list of a writer (every adapter calls this before
    it builds a plan of the tensors it was given): a name beginning with ``_deepfreeze/`` (kept
    for DeepFreeze's own records; a manifest holding one is ignored by every reader) or a name
    two tensors share (readers refuse such a manifest). :class:`~deepfreeze.errors.ConfigError`
    naming the key; ``what`` says whose tensors they are."""
    seen: set[str] = set()
    for t in tensors:
        if t.name.startswith(RESERVED_PREFIX):
            raise ConfigError(f"{what}: tensor {t.name!r}: names beginning with {RESERVED_PREFIX!r} are reserved for "
                              "DeepFreeze's own records (readers would ignore the version): rename it")
        if t.name in seen:
            raise ConfigError(f"{what}: two tensors are named {t.name!r} (readers refuse a checkpoint with a name "
                              "twice): give them distinct names")
        seen.add(t.name)


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


def _splits(t: TensorSpec, world_size: int, min_shard_bytes: int) -> bool:
    """Whether rule 3 of :meth:`ShardPlan.build` splits ``t`` (not pinned, no given bounds)."""
    return world_size > 1 and t.nbytes >= max(min_shard_bytes, 1) and t.size >= world_size


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """The pieces of every tensor and who holds them (module docstring). ``pinned`` and ``given``
    are the :meth:`build` parameters the plan was made with (what :meth:`to_json` records so a
    reader derives the pieces again); they take no part in equality: two plans with the same
    tensors, world size, pieces and ``min_shard_bytes`` are the same plan."""

    tensors: tuple[TensorSpec, ...]
    world_size: int
    pieces: tuple[Piece, ...]  # sorted by (tensor_id, start); they tile every tensor exactly
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES
    pinned: tuple[int, ...] = dataclasses.field(default=(), compare=False)  # sorted tensor ids
    given: tuple[tuple[int, tuple[int, ...]], ...] = dataclasses.field(default=(), compare=False)  # sorted by id

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
            elif _splits(t, world_size, min_shard_bytes):
                bounds = split_bounds(t.size, world_size, dtype_itemsize(t.dtype))
                for r in range(world_size):
                    pieces.append(Piece(t.id, r, bounds[r], bounds[r + 1]))
                    load[r] += (bounds[r + 1] - bounds[r]) * dtype_itemsize(t.dtype)
            else:
                whole.append(t)
        # whole tensors, largest first, each to the rank with the fewest bytes so far (ties: the
        # lowest rank): a heap of (load, rank) pops exactly min(range(N), key=(load[r], r))
        heap = [(load[r], r) for r in range(world_size)]
        heapq.heapify(heap)
        for t in sorted(whole, key=lambda t: (-t.nbytes, t.id)):
            nbytes, r = heapq.heappop(heap)
            pieces.append(Piece(t.id, r, 0, t.size))
            heapq.heappush(heap, (nbytes + t.nbytes, r))
        pieces.sort(key=lambda p: (p.tensor_id, p.start, p.rank))
        return cls(tensors, world_size, tuple(pieces), min_shard_bytes,
                   tuple(sorted(int(i) for i in pinned if 0 <= i < len(tensors))),
                   tuple(sorted((int(tid), tuple(int(x) for x in b)) for tid, b in given.items())))

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

    @functools.cached_property
    def _record(self) -> dict[str, Any]:
        """The plan record of :meth:`to_json`, computed once per plan (a frozen plan never changes)."""
        legacy = {"world_size": self.world_size, "min_shard_bytes": self.min_shard_bytes,
                  "pieces": [[p.tensor_id, p.rank, p.start, p.stop] for p in self.pieces]}
        try:
            derived = ShardPlan.build(self.tensors, self.world_size, min_shard_bytes=self.min_shard_bytes,
                                      pinned=self.pinned, given=dict(self.given))
        except (ValueError, CorruptCheckpointError):
            return legacy  # (a plan made by hand with parameters no rule accepts)
        mine: dict[int, list[Piece]] = {}
        for p in self.pieces:
            mine.setdefault(p.tensor_id, []).append(p)
        rules: dict[int, list[Piece]] = {}
        for p in derived.pieces:
            rules.setdefault(p.tensor_id, []).append(p)
        explicit = []
        for t in self.tensors:
            ps = sorted(mine.get(t.id, ()), key=lambda p: (p.start, p.rank))
            if ps == rules.get(t.id, []):
                continue
            if not ps:
                return legacy  # a tensor without pieces: no override can say so
            explicit += [[p.tensor_id, p.rank, p.start, p.stop] for p in ps]
        return {"algorithm": PLAN_ALGORITHM, "world_size": self.world_size, "min_shard_bytes": self.min_shard_bytes,
                "pinned": list(self.pinned), "given": [[tid, *b] for tid, b in self.given], "explicit": explicit}

    def to_json(self) -> dict[str, Any]:
        """The plan record of a manifest (module docstring): compact (``algorithm`` and its
        parameters, plus the pieces no rule gives) whenever :meth:`build` with the recorded
        parameters reproduces the plan, else every piece (the older form)."""
        rec = self._record
        return {k: [list(x) for x in v] if k in ("given", "explicit", "pieces") else
                (list(v) if isinstance(v, list) else v) for k, v in rec.items()}

    @classmethod
    def from_json(cls, tensors: Sequence[TensorSpec], obj: Any) -> "ShardPlan":
        """Rebuild and *validate* a plan read from disk: a compact record is derived again with
        :meth:`build` (its ``explicit`` pieces replacing those of their tensors), an older record's
        pieces are taken as listed; either way the pieces must tile every tensor exactly."""
        tensors = tuple(tensors)
        pinned: tuple[int, ...] = ()
        given: tuple[tuple[int, tuple[int, ...]], ...] = ()
        try:
            if not isinstance(obj, dict):
                raise ValueError(f"not an object but {type(obj).__name__}")
            world = obj["world_size"]
            msb = obj.get("min_shard_bytes", DEFAULT_MIN_SHARD_BYTES)
            if type(world) is not int or not 1 <= world <= 1 << 20 or type(msb) is not int or msb < 0:
                raise ValueError("bad world_size or min_shard_bytes")
            if "algorithm" in obj:
                algorithm = obj["algorithm"]
                if algorithm not in PLAN_ALGORITHMS:
                    raise CorruptCheckpointError(
                        f"manifest shard plan uses plan algorithm {str(algorithm)[:40]!r}, which this DeepFreeze "
                        f"does not know (it reads {list(PLAN_ALGORITHMS)}): a newer DeepFreeze wrote it; "
                        "upgrade DeepFreeze to read this checkpoint")
                pieces, pinned, given = _derive(tensors, world, msb, obj)
            else:
                raw = obj["pieces"]
                if not isinstance(raw, list):
                    raise ValueError("bad pieces")
                pieces = [_piece(item) for item in raw]
        except CorruptCheckpointError:
            raise
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
        return cls(tensors, world, tuple(pieces), msb, pinned, given)


def _piece(item: Any) -> Piece:
    if not (isinstance(item, list) and len(item) == 4 and all(type(v) is int for v in item)):
        raise ValueError(f"bad piece {str(item)[:80]}")
    return Piece(*item)


def _derive(tensors: tuple[TensorSpec, ...], world: int, msb: int, obj: dict[str, Any]
            ) -> tuple[list[Piece], tuple[int, ...], tuple[tuple[int, tuple[int, ...]], ...]]:
    """The pieces of a compact ``flat-v1`` record (its schema checked here; ValueError when not):
    :meth:`ShardPlan.build` with the recorded parameters, then the ``explicit`` pieces in place of
    their tensors'. The number of pieces is counted before any is made: at most ``MAX_ENTRIES``
    (the most an assembled file's index holds), so a small record cannot make a huge plan."""
    n = len(tensors)
    pinned, given_rows, explicit = obj["pinned"], obj["given"], obj["explicit"]
    if not (isinstance(pinned, list) and all(type(i) is int and 0 <= i < n for i in pinned)
            and len(set(pinned)) == len(pinned)):
        raise ValueError("'pinned' is not a list of distinct tensor ids")
    if not (isinstance(given_rows, list) and all(isinstance(g, list) and len(g) == world + 2
                                                 and all(type(x) is int for x in g) for g in given_rows)):
        raise ValueError(f"'given' is not a list of [tensor id, {world + 1} bounds] rows")
    given = {g[0]: g[1:] for g in given_rows}
    if len(given) != len(given_rows):
        raise ValueError("'given' names a tensor twice")
    if not isinstance(explicit, list):
        raise ValueError("'explicit' is not a list")
    over: dict[int, list[Piece]] = {}
    for item in explicit:
        p = _piece(item)
        if not 0 <= p.tensor_id < n:
            raise ValueError(f"explicit piece {item} names no tensor")
        over.setdefault(p.tensor_id, []).append(p)
    pin = set(pinned)
    count = sum(len(over[t.id]) if t.id in over else
                1 if t.id in pin else
                sum(1 for r in range(world) if given[t.id][r + 1] > given[t.id][r]) if t.id in given and t.size > 0 else
                world if _splits(t, world, msb) else 1 for t in tensors)
    if count > MAX_ENTRIES:
        raise ValueError(f"the record derives {count} pieces, more than the {MAX_ENTRIES} an assembled file holds")
    plan = ShardPlan.build(tensors, world, min_shard_bytes=msb, pinned=pinned, given=given)
    pieces = [p for p in plan.pieces if p.tensor_id not in over] + [p for ps in over.values() for p in ps]
    return pieces, plan.pinned, plan.given
