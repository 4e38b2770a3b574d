"""The copy of a rank's share of the live weights straight into a stream slot (the torch Publisher's one copy).

:class:`SlotCopy` is the ``fill`` of :meth:`SlotRing.write_with
<deepfreeze.stream.slots.SlotRing.write_with>` that :class:`deepfreeze.torch.Publisher` hands its
publish thread for each version; :func:`slot_chunks` lays a rank's pieces out in chunks of the
slot once per plan.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import torch

from .. import format as fmt
from ..fused import STAMP_BYTES, FusedLayout
from ..stream.slots import CHUNK
from . import _state
from .capture import Capture, local_piece

__all__ = ["SlotCopy", "slot_chunks"]


class SlotCopy:
    """One version's copy from the live tensors straight into this rank's slot: the ``fill`` of
    :meth:`SlotRing.write_with <deepfreeze.stream.slots.SlotRing.write_with>`, run on the publish
    thread between the step's post-hook and the next ``optimizer.step()``.

    Call order: made in the post-hook (``on_live``: the buffers rank 0 publishes, which the next
    forward changes, are copied aside here; every other tensor's ``_version`` is noted); called
    once with the slot's bytes (``fill(dst, copied)``): each chunk (about
    :data:`~deepfreeze.stream.slots.CHUNK` bytes: many small tensors in one ``torch._foreach_copy_``,
    a large one in several) is copied, then its CRC32 computed while it is in cache, ``copied``
    told; then the versions are compared: a tensor changed during the copy makes it torn (None is
    returned: the slot is never completed); :attr:`finished` is set once nothing reads the tensors
    any more (also by :meth:`done` when the fill never runs). :meth:`_copied_chunk` is the
    fault-injection point (a subclass changes a tensor or dies there)."""

    def __init__(self, step: int, chunks: list, pieces: list, st: "_state.TrainState", views: dict) -> None:
        self.step = step
        self.finished = threading.Event()
        #: the name of the first tensor that changed during the copy (None: not torn)
        self.changed: "str | None" = None
        self._chunks = chunks
        self._sources: dict[int, torch.Tensor] = {}
        self.versions: list[tuple[torch.Tensor, int, str]] = []
        for tid, piece, pinned in pieces:
            t = st.tensors[tid]
            hit = views.get(tid)
            if hit is not None and hit[0] is t and hit[1] == t.data_ptr():
                v = hit[2]
            else:
                v = Capture._source_view(t, piece) if t.device.type == "cpu" else _device_bytes(t, piece)
                if t.is_contiguous():
                    views[tid] = (t, t.data_ptr(), v)
            if pinned:  # changed by the next forward: aside now
                v = v.to("cpu", copy=True)
            else:
                name = st.specs[tid].name
                self.versions.append((t, t._version, name))
                if tid in st.dtensors:  # the optimizer's in-place updates count on the DTensor
                    self.versions.append((st.dtensors[tid], st.dtensors[tid]._version, name))
            self._sources[tid] = v

    def __call__(self, dst: np.ndarray, copied: Callable[[int], None]) -> "int | None":
        try:
            d = torch.from_numpy(dst)
            c, pos = 0, 0
            for end, items in self._chunks:
                dsts = [d[off:off + n] for off, n, _, _, a, _ in items]
                srcs = [self._sources[tid][a:a + n] for _, n, tid, _, a, _ in items]
                if any(x.device.type != "cpu" for x in srcs):
                    for x, y in zip(dsts, srcs):
                        x.copy_(y)  # device to host, straight into the slot
                else:
                    torch._foreach_copy_(dsts, srcs)
                del dsts, srcs
                c = fmt.crc32(dst[pos:end], c)  # the chunk (and its padding) while in cache
                pos = end
                self._copied_chunk(end)
                copied(end)
            del d
            self.changed = next((name for t, v, name in self.versions if t._version != v), None)
            return None if self.changed is not None else c
        finally:
            self.finished.set()

    def done(self) -> None:
        """Nothing reads the tensors any more (called once the fill returned or when it never runs)."""
        self.finished.set()

    def _copied_chunk(self, done: int) -> None:
        """After each chunk (``done`` bytes of the slot written): does nothing; a fault-injection point."""



def _device_bytes(t: torch.Tensor, piece: Any) -> torch.Tensor:
    """The bytes of ``piece`` of a device tensor as a flat uint8 tensor on its device (no host copy)."""
    src = t.detach().reshape(-1)[piece.start:piece.stop].contiguous()
    return src.view(torch.uint8) if src.dtype != torch.uint8 else src


def slot_chunks(layout: FusedLayout, bounds: dict, rank: int, pinned: set) -> list:
    """This rank's copy into a slot, in chunks of about :data:`CHUNK` bytes in slot order: a list of
    ``(end offset of the chunk in the slot, items)``, an item ``(slot offset, nbytes, tensor id,
    piece, byte offset in the piece, pinned)``; a chunk's end covers the padding after it, the
    last one the slot's end (so the CRC of the chunks in order is the slot's)."""
    items = []
    for seg in sorted(layout.segments, key=lambda g: g.offset):
        if not seg.nbytes:
            continue
        piece = local_piece(seg.piece, bounds, rank)  # (an FSDP2 shard: its local tensor's elements)
        off = seg.offset - STAMP_BYTES
        for a in range(0, seg.nbytes, CHUNK):
            items.append((off + a, min(CHUNK, seg.nbytes - a), piece.tensor_id, piece, a, piece.tensor_id in pinned))
    chunks: list = []
    group: list = []
    size = 0
    for it in items:
        if group and size + it[1] > CHUNK:
            chunks.append([it[0], group])
            group, size = [], 0
        group.append(it)
        size += it[1]
    if group:
        chunks.append([layout.data_bytes, group])
    return [(end, g) for end, g in chunks]
