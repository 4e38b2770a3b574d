"""The fused capture buffer: one contiguous buffer per rank and version (framework-neutral).

A framework's hook (``deepfreeze.keras.hook``) fills it inside the train step with
one concatenation of this rank's pieces, so a capture costs one op and one pass
over the shard whatever the number of tensors, and the buffer is handed to the
engine as one view. Its layout is the shard file's own (:func:`deepfreeze.format.layout`),
so the writer writes the data region with a few large writes, no gather::

    bytes [0, STAMP_BYTES)          stamp: the optimizer step of the capture (int64,
                                    little-endian), then zeros (4096 bytes: the data
                                    region is page-aligned where the buffer is)
    bytes [STAMP_BYTES, total)      the data region of the rank's shard file: byte
                                    ``STAMP_BYTES + k`` is byte ``data_offset + k``
                                    of the file; pieces at PIECE_ALIGN offsets, zero
                                    padding between them

The stamp lets a reader check that the buffer holds the step it expects (a
capture that did not happen leaves the previous step's stamp).
"""
from __future__ import annotations

import ctypes
import dataclasses
import mmap
import sys
import threading
from typing import Sequence

import numpy as np

from . import format as fmt
from ._native import MADV_POPULATE_WRITE, available, madvise
from .priority import lower_thread
from .shardplan import Piece, ShardPlan

__all__ = ["STAMP_BYTES", "Segment", "FusedLayout", "FusedShard", "BufferPool"]

STAMP_BYTES = fmt.DATA_ALIGN  # the data region starts page-aligned in a page-aligned buffer (O_DIRECT)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Where one piece goes in the buffer: ``nbytes`` bytes at ``offset`` (from the buffer start)."""

    piece: Piece
    dtype: str
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class FusedLayout:
    """Layout of one rank's fused buffer for a shard plan (pure function of plan and rank)."""

    plan: ShardPlan
    rank: int
    entries: tuple[fmt.Entry, ...]  #: the shard file's index entries (offsets from the file start)
    data_offset: int  #: where the data region starts in the shard file
    file_size: int
    segments: tuple[Segment, ...]

    @classmethod
    def build(cls, plan: ShardPlan, rank: int) -> "FusedLayout":
        pieces = plan.for_rank(rank)
        raw = [fmt.Entry(p.tensor_id, plan.tensors[p.tensor_id].dtype, plan.tensors[p.tensor_id].shape,
                         p.start, p.stop) for p in pieces]
        entries, data_offset, file_size = fmt.layout(raw)
        segments = tuple(Segment(p, e.dtype, STAMP_BYTES + e.offset - data_offset, e.length)
                         for p, e in zip(pieces, entries))
        return cls(plan, rank, tuple(entries), data_offset, file_size, segments)

    @property
    def data_bytes(self) -> int:
        """Bytes of the data region (the buffer holds ``STAMP_BYTES`` more)."""
        return self.file_size - self.data_offset

    @property
    def nbytes(self) -> int:
        return STAMP_BYTES + self.data_bytes

    def gaps(self) -> list[tuple[int, int]]:
        """(offset, length) of the zero padding before each segment and at the end, in buffer order
        (the stamp's padding excluded): what a concatenation must insert."""
        out, pos = [], STAMP_BYTES
        for s in self.segments:
            out.append((pos, s.offset - pos))
            pos = s.offset + s.nbytes
        out.append((pos, self.nbytes - pos))
        return out


class FusedShard:
    """One captured version of a rank's shard: a flat ``uint8`` buffer in :class:`FusedLayout`."""

    __slots__ = ("layout", "buffer")

    def __init__(self, layout: FusedLayout, buffer: np.ndarray) -> None:
        buf = np.asarray(buffer)
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size != layout.nbytes:
            raise ValueError(f"a fused buffer of rank {layout.rank} must be {layout.nbytes} uint8 bytes, got "
                             f"{buf.size} {buf.dtype} (ndim {buf.ndim})")
        self.layout, self.buffer = layout, buf

    @property
    def step(self) -> int:
        """The optimizer step stamped by the capture."""
        return int(self.buffer[:8].view("<i8")[0])

    @property
    def data(self) -> np.ndarray:
        """The shard file's data region (a view)."""
        return self.buffer[STAMP_BYTES:]

    def pieces(self) -> list[np.ndarray]:
        """Typed flat views of the pieces, in plan order (no copy)."""
        out = []
        for s in self.layout.segments:
            out.append(self.buffer[s.offset:s.offset + s.nbytes].view(fmt.numpy_dtype(s.dtype)))
        return out

    @classmethod
    def from_arrays(cls, layout: FusedLayout, arrays: Sequence[np.ndarray], step: int) -> "FusedShard":
        """Copy flat pieces (plan order) into a new buffer: for captures made outside a graph."""
        if len(arrays) != len(layout.segments):
            raise ValueError(f"rank {layout.rank} holds {len(layout.segments)} pieces, got {len(arrays)} arrays")
        buf = np.zeros(layout.nbytes, dtype=np.uint8)
        buf[:8].view("<i8")[0] = step
        for s, a in zip(layout.segments, arrays):
            a = np.ascontiguousarray(a).reshape(-1)
            if a.size != s.piece.count or fmt.dtype_name(a.dtype) != s.dtype:
                raise ValueError(f"piece of tensor {s.piece.tensor_id} [{s.piece.start},{s.piece.stop}) needs "
                                 f"{s.piece.count} {s.dtype} elements, got {a.size} {a.dtype}")
            buf[s.offset:s.offset + s.nbytes] = a.view(np.uint8)
        return cls(layout, buf)


_POPULATE_STEP = 64 << 20   # one madvise call's bytes: a pool closed meanwhile stops the thread within one step


def _populate(mems: list) -> None:
    """Fault in every page of ``mems`` (anonymous mappings) for writing, contents untouched, at the
    background priority, the GIL released (:func:`deepfreeze._native.madvise`); stops at the first
    refusal (a kernel before 5.14) or a closed mapping."""
    lower_thread()
    for mem in mems:
        try:
            base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
            for off in range(0, len(mem), _POPULATE_STEP):
                madvise(base + off, min(_POPULATE_STEP, len(mem) - off), MADV_POPULATE_WRITE)
        except (OSError, ValueError, TypeError):
            return


def _mapping(buf: np.ndarray) -> mmap.mmap:
    """The anonymous mapping a pool buffer is a view of (``np.frombuffer`` keeps a memoryview of it)."""
    base = buf.base
    return getattr(base, "obj", base)


class BufferPool:
    """Fused buffers that a capture writes into: page-aligned, zero until first written.

    A buffer is free when nothing outside the pool refers to it (no :class:`FusedShard`, no
    numpy view of it is alive: a view holds a reference to its base array); :meth:`acquire`
    returns a free one, or allocates one more (logged) when all are held. Padding bytes are
    never written by a capture, so they stay zero. The ``count`` buffers are allocated (mapped)
    when the pool is built. ``prefault=True`` also faults every page in then, so that no capture
    pays for faulting fresh pages: what a native capture writing from inside the training step
    needs (Keras). ``prefault=False`` leaves each page to be faulted by the first copy that
    writes it, one pass instead of two (a zero fill, then the copy), and no memory taken for
    buffers the job never fills: the torch capture, whose large copies run on its copy thread,
    and whose pool is built inside the first checkpoint's step (issue 45: a gpt2 rank's three
    0.75 GB buffers were faulted in the step and beside it). ``populate=True`` (with
    ``prefault=False``) then faults the buffers in ahead of their first use from a daemon thread
    at the background priority (:func:`deepfreeze.priority.lower_thread`), with
    ``madvise(MADV_POPULATE_WRITE)``, which never changes a byte, so a copy into the same buffer
    at the same time is safe (Linux 5.14 and later; elsewhere the copies fault the pages).
    :attr:`populating` is that thread.
    """

    def __init__(self, nbytes: int, count: int, *, prefault: bool = True, populate: bool = False) -> None:
        if nbytes < STAMP_BYTES or count < 1:
            raise ValueError(f"a buffer pool needs nbytes >= {STAMP_BYTES} and count >= 1, got {nbytes}, {count}")
        self.nbytes = nbytes
        self.prefault = prefault
        self.buffers: list[np.ndarray] = [self._allocate() for _ in range(count)]
        self.grown = 0  #: buffers allocated beyond ``count`` because all were held
        self.populating: "threading.Thread | None" = None
        if populate and not prefault and available("madvise"):
            # the mappings, not the arrays: a reference to an array would make the pool see it held
            mems = [_mapping(b) for b in self.buffers[1:] + self.buffers[:1]]   # the first is being copied into now
            self.populating = threading.Thread(target=_populate, args=(mems,), daemon=True,
                                               name="deepfreeze-buffer-pool")
            self.populating.start()

    def _allocate(self) -> np.ndarray:
        mem = mmap.mmap(-1, max(self.nbytes, 1))  # anonymous: page-aligned, zero
        buf = np.frombuffer(mem, dtype=np.uint8, count=self.nbytes)
        if self.prefault:
            buf.fill(0)  # fault every page in now
        return buf

    @staticmethod
    def address(buf: np.ndarray) -> int:
        return int(buf.__array_interface__["data"][0])

    def _free(self, i: int) -> bool:
        # references of an unused buffer: the pool's list and getrefcount's argument
        return sys.getrefcount(self.buffers[i]) <= 2

    def acquire(self) -> np.ndarray:
        for i in range(len(self.buffers)):
            if self._free(i):
                return self.buffers[i]
        buf = self._allocate()
        self.buffers.append(buf)
        self.grown += 1
        import logging
        logging.getLogger("deepfreeze").warning(
            "deepfreeze: all %d capture buffers of %.1f MB are still held (by the write queue or another "
            "consumer): allocated one more", len(self.buffers) - 1, self.nbytes / 1e6)
        return buf

    def held(self) -> int:
        """How many buffers are referenced outside the pool now."""
        return sum(not self._free(i) for i in range(len(self.buffers)))
