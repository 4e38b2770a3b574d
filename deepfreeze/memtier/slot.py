"""A memory-tier region's slots: the slot commit protocol and the readers of a slot.

A :class:`ShardRegion` is one (model, run, rank) region of an open
:class:`~deepfreeze.memtier.device.Device` (which creates them:
:meth:`~deepfreeze.memtier.device.Device.shards`); its slots
are written with :meth:`ShardRegion.put` (or :meth:`ShardRegion.begin` and a :class:`SlotWriter`)
and read with :meth:`ShardRegion.newest` / :meth:`ShardRegion.read_image`. The bytes of a slot
header and of the region's index are specified in :mod:`deepfreeze.memtier.layout`.

**Slot commit protocol** (one writer per region; :meth:`ShardRegion.begin` and
:meth:`SlotWriter.finish`):

1. header <- ACTIVE(run, generation, version number) with its CRC; msync the header page;
2. the data is copied into the image's data region (:attr:`SlotWriter.data`; the pieces' CRCs are
   computed while copying, :mod:`deepfreeze.memtier.copy`), then the image header
   (``format.encode_index``, holding those CRCs) and the manifest are written; msync the slot;
3. header <- DONE(..., image_crc, meta_len) with its CRC; msync the header page.

A header torn by a crash fails its CRC and reads as invalid, an ACTIVE slot is never restorable:
``kill -9`` at any moment leaves the previous DONE version intact, because a new version never
goes into the newest valid DONE slot (:meth:`ShardRegion.choose_slot`). Readers take the DONE
slot with a valid header and the newest ``Version(generation, version)``, verify the image (its
header, index and every piece's CRC) and fall back to the next DONE slot on damage. A reader's
copy is checked like a seqlock: the slot header is compared before and after the copy, so a slot
rewritten during the read is detected (:meth:`ShardRegion.read_image`).

Limit of the choice: it looks at headers only, so if the newest DONE image was damaged in memory
after it was written, the older one may be overwritten next (media damage, not a crash).

**What a DONE slot survives, per medium.** tmpfs (``/dev/shm``): any process crash, ``kill -9``
included (the pages belong to the file), not a reboot or power loss. A file on a disk or NVMe
file system: power loss too, because every step above msyncs its page-aligned range before the
next. DAX (persistent memory mapped directly): msync is not enough on every platform, cache-line
flushes (``clwb``) and a fence would be needed, which Python cannot issue: correctness on DAX
needs a native flush and is not claimed.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Sequence

import numpy as np

from .. import crashpoints as cp
from .. import format as fmt
from ..errors import CorruptCheckpointError, MemtierCorruptError, MemtierError
from ..lease import Version
from .layout import (_RUN_RE, _SLOT, _U32, FINISHED, PAGE, SLOT_MAGIC, SlotHeader, SlotState, _Entry, _index_entries,
                     _touch)

__all__ = ["ShardRegion", "SlotWriter"]

log = logging.getLogger("deepfreeze")


def _slot_header_bytes(state: SlotState, run: str, version: Version, meta_len: int, image_len: int,
                       image_crc: int, written: float) -> bytes:
    raw = _SLOT.pack(SLOT_MAGIC, int(state), 0, run.encode("ascii"), version.generation, version.step,
                     meta_len, 0, image_len, image_crc, 0, written)
    return raw + _U32.pack(fmt.crc32(raw))


class ShardRegion:
    """One (model, run, rank) region of a device (``device``: the open
    :class:`~deepfreeze.memtier.device.Device` it lies in): its index and slots."""

    def __init__(self, device: Any, e: _Entry, index: dict[str, Any]) -> None:
        self.device, self._e, self.index = device, e, index
        self.name, self.run, self.rank, self.world_size = e.name, e.run, e.rank, e.world_size
        self.nslots, self.entry_no, self.region_off = e.nslots, e.entry_no, e.region_off
        self.region_len, self.meta_cap, self.image_size = e.region_len, e.meta_cap, e.image_size
        self.finished = e.state == FINISHED
        #: the id of the job this region belongs to (its MIndex ``job``); None: job unknown
        self.job: str | None = index.get("job")
        self.data_offset, self.file_size = index["data_offset"], index["file_size"]
        #: the image's index entries (offsets in the image; CRCs 0: the written ones are in the image)
        self.entries = _index_entries(index)
        self.names = [t["name"] for t in index["tensors"]]

    def __repr__(self) -> str:
        return (f"ShardRegion({self.name!r}, run={self.run}, rank={self.rank}/{self.world_size}, "
                f"slots={self.nslots}, entry={self.entry_no})")

    def _slot_off(self, k: int) -> int:
        if not 0 <= k < self.nslots:
            raise IndexError(f"slot {k} of {self.nslots}")
        return self._e.slot_off + k * self._e.slot_stride

    def image_offset(self, k: int) -> int:
        return self._slot_off(k) + PAGE + self.meta_cap

    def raw_header(self, k: int) -> bytes:
        """Slot ``k``'s header bytes as they are now (compared by seqlock readers)."""
        off = self._slot_off(k)
        return bytes(self.device.mm[off:off + _SLOT.size + 4])

    def slot_header(self, k: int) -> SlotHeader | None:
        """Slot ``k``'s header, or None if it is invalid (wrong magic, checksum, state or bounds:
        a torn or damaged header)."""
        return self._parse_header(self.raw_header(k))

    def _parse_header(self, raw: bytes) -> SlotHeader | None:
        magic, state, _, run, gen, step, meta_len, _, image_len, image_crc, _, written = _SLOT.unpack_from(raw)
        if magic != SLOT_MAGIC or _U32.unpack_from(raw, _SLOT.size)[0] != fmt.crc32(raw[:_SLOT.size]):
            return None
        if state not in (0, 1, 2) or meta_len > self.meta_cap or image_len > self.image_size:
            return None
        try:
            run_s = run.decode("ascii")
        except UnicodeDecodeError:
            return None
        if not _RUN_RE.match(run_s) or gen >= 1 << 62 or step >= 1 << 62:
            return None
        return SlotHeader(SlotState(state), run_s, Version(gen, step), meta_len, image_len, image_crc, written, raw)

    def _done(self) -> list[tuple[int, SlotHeader]]:
        """DONE slots of this run with a valid header, newest first."""
        out = []
        for k in range(self.nslots):
            h = self.slot_header(k)
            if h is not None and h.state == SlotState.DONE and h.run == self.run and h.image_len == self.image_size:
                out.append((k, h))
        out.sort(key=lambda kh: (kh[1].version, -kh[0]), reverse=True)
        return out

    def holding(self, k: int, run: str, step: int) -> SlotHeader | None:
        """Slot ``k``'s header if it is DONE (valid checksum) and holds version ``step`` of ``run``; else None."""
        h = self.slot_header(k)
        if h is None or h.state != SlotState.DONE or h.run != run or h.version.step != step:
            return None
        return h

    def put(self, k: int, version: Version, copier: Any, regions: Sequence[tuple[int, int]],
            manifest: dict[str, Any], *, dest_offsets: Sequence[int] | None = None) -> Any:
        """The whole slot protocol for one version: header ACTIVE (:meth:`begin`), ``copier``
        (:class:`~deepfreeze.memtier.copy.Copier`) copies the source ``regions`` into the data region
        with every piece's CRC32, then image header, manifest and header DONE
        (:meth:`SlotWriter.finish`). A failed copy leaves the slot ACTIVE (never restorable). Without
        ``dest_offsets`` the regions must fill the data region exactly (:class:`MemtierError` before
        anything is written otherwise). Returns the copier's ``CopyStats``."""
        if dest_offsets is None and sum(n for _, n in regions) != self.file_size - self.data_offset:
            raise MemtierError(f"{self.device.path} {self.name!r} rank {self.rank}: {sum(n for _, n in regions)} "
                               f"bytes to copy into a slot data region of {self.file_size - self.data_offset}: "
                               "not the registered layout")
        writer = self.begin(k, version)
        try:
            stats = copier.copy_in(regions, writer.data, writer.spans, dest_offsets=dest_offsets)
            writer.finish(list(stats.crcs), manifest)
        finally:
            writer.release()
        return stats

    def choose_slot(self, busy: "set[int] | Sequence[int]" = ()) -> int | None:
        """The slot to write a new version into: never the newest valid DONE slot nor one in
        ``busy`` (versions waiting for their flush); EMPTY, invalid or ACTIVE (a crashed write)
        slots first, then the oldest DONE one. None when there is none (the caller waits)."""
        busy = set(busy)
        done = self._done()
        newest = done[0][0] if done else None
        done_k = {k for k, _ in done}
        free = [k for k in range(self.nslots) if k not in done_k and k not in busy]
        if free:
            return free[0]
        for k, _ in reversed(done):
            if k != newest and k not in busy:
                return k
        return None

    def begin(self, k: int, version: Version) -> "SlotWriter":
        """Step 1 of the slot protocol: slot ``k``'s header goes ACTIVE (``version``) and is msynced.
        Returns the writer (write :attr:`SlotWriter.data`, then :meth:`SlotWriter.finish`)."""
        self.device._need_writable()
        if not isinstance(version, Version):
            raise TypeError("version must be a deepfreeze.lease.Version(generation, version number)")
        off = self._slot_off(k)
        cp.hit("memtier.slot.active")
        raw = _slot_header_bytes(SlotState.ACTIVE, self.run, version, 0, 0, 0, time.time())
        self.device.mm[off:off + len(raw)] = raw
        self.device._flush(off, PAGE)
        return SlotWriter(self, k, version)

    def newest(self, verify: bool = True) -> tuple[int, SlotHeader] | None:
        """The newest DONE slot with a valid header (and, with ``verify``, an image whose header,
        index, manifest and every piece's CRC check out: a damaged one is skipped with a log line)."""
        for k, h in self._done():
            if not verify:
                return k, h
            why = self.verify_slot(k, h)
            if why is None:
                return k, h
            log.warning("deepfreeze memtier: %s rank %d slot %d (%s) is damaged (%s): falling back to an older "
                        "slot", self.name, self.rank, k, h.version, why)
        return None

    def restorable(self) -> list[tuple[int, SlotHeader]]:
        """Every DONE slot with a valid header, newest first (images not verified)."""
        return self._done()

    def image(self, k: int) -> memoryview:
        """Read-only view of slot ``k``'s image (``image_size`` bytes; valid while the device is open;
        not protected against a concurrent rewrite: see :meth:`read_image`)."""
        off = self.image_offset(k)
        return memoryview(self.device.mm).toreadonly()[off:off + self.image_size]

    def check_image(self, buf: Any, h: SlotHeader, *, verify_data: bool = True) -> fmt.ShardIndex:
        """Check an image (slot view or copy) against this region and header ``h``: format.py header
        and index valid and matching (kind shard, rank, world size, run, version number, the
        index's layout), and with ``verify_data`` every piece's CRC. :class:`MemtierCorruptError`."""
        where = f"{self.device.path} {self.name!r} rank {self.rank}"
        try:
            si = fmt.read_index(buf, where)
            if (si.kind, si.rank, si.world_size, si.run, si.version, si.has_crc) != \
                    (fmt.KIND_SHARD, self.rank, self.world_size, self.run, h.version.step, True):
                raise MemtierCorruptError(f"{where}: the image's header (rank {si.rank}/{si.world_size}, run {si.run}, "
                                          f"version {si.version}) does not match the slot")
            if (si.data_offset, si.file_size) != (self.data_offset, self.file_size) or \
                    [(e.tensor_id, e.dtype, e.shape, e.start, e.stop, e.offset, e.length) for e in si.entries] != \
                    [(e.tensor_id, e.dtype, e.shape, e.start, e.stop, e.offset, e.length) for e in self.entries]:
                raise MemtierCorruptError(f"{where}: the image's index differs from the registered layout")
            if verify_data:
                for e in si.entries:
                    fmt.entry_view(buf, e, verify=True, path=where)
        except CorruptCheckpointError as e:
            raise MemtierCorruptError(str(e)) from None
        return si

    def verify_slot(self, k: int, h: SlotHeader | None = None) -> str | None:
        """What is wrong with DONE slot ``k`` (None: restorable), reading it in place."""
        h = h or self.slot_header(k)
        if h is None or h.state != SlotState.DONE:
            return "not DONE"
        try:
            self.check_image(self.image(k), h)
            self.manifest(k, h)
        except MemtierCorruptError as e:
            return str(e)
        return None if self.raw_header(k) == h.raw else "rewritten while verified"

    def read_image(self, k: int, *, verify: bool = True) -> np.ndarray:
        """A copy of DONE slot ``k``'s image, taken like a seqlock read: the header is read before
        and compared after the copy (a slot rewritten meanwhile raises :class:`MemtierCorruptError`;
        take another slot). With ``verify``, the copy's header, index and CRCs are checked."""
        h = self.slot_header(k)
        if h is None or h.state != SlotState.DONE or h.run != self.run:
            raise MemtierCorruptError(f"{self.device.path} {self.name!r} rank {self.rank} slot {k} is not a valid "
                                      f"DONE slot ({'invalid header' if h is None else h.state.name})")
        out = np.empty(self.image_size, dtype=np.uint8)
        out[:] = np.frombuffer(self.image(k), dtype=np.uint8)
        if self.raw_header(k) != h.raw:
            raise MemtierCorruptError(f"{self.device.path} {self.name!r} rank {self.rank} slot {k} was rewritten "
                                      "while it was read: read another slot or retry")
        if verify:
            self.check_image(out, h)
        return out

    def manifest(self, k: int, h: SlotHeader | None = None) -> dict[str, Any]:
        """The manifest of slot ``k``'s version (``format.decode_manifest``); MemtierCorruptError."""
        h = h or self.slot_header(k)
        if h is None or h.state != SlotState.DONE:
            raise MemtierCorruptError(f"{self.device.path} {self.name!r} rank {self.rank} slot {k} is not DONE")
        off = self._slot_off(k) + PAGE
        try:
            m = fmt.decode_manifest(bytes(self.device.mm[off:off + h.meta_len]),
                                    f"{self.device.path} {self.name!r} rank {self.rank} slot {k}")
        except CorruptCheckpointError as e:
            raise MemtierCorruptError(str(e)) from None
        if m.get("name") != self.name or fmt.manifest_run(m)[0] != self.run or m.get("version") != h.version.step \
                or m.get("world_size") != self.world_size:
            raise MemtierCorruptError(f"{self.device.path} {self.name!r} rank {self.rank} slot {k}: the manifest "
                                      "names another model, run, version or world size")
        return m

    def prefault(self) -> None:
        """Touch every page of the region (pre-fault in this process before the first copy)."""
        _touch(self.device.mm, self.region_off, self.region_len)


class SlotWriter:
    """A slot being written (after step 1 of the protocol): fill :attr:`data`, then :meth:`finish`."""

    def __init__(self, region: ShardRegion, k: int, version: Version) -> None:
        self.region, self.slot, self.version = region, k, version
        off = region.image_offset(k)
        mv = memoryview(region.device.mm)
        #: the whole image (writable)
        self.image = mv[off:off + region.image_size]
        #: the image's data region, from ``data_offset``: the capture buffer's bytes go here
        self.data = self.image[region.data_offset:]
        #: (offset, length) of every piece relative to :attr:`data` (the CRC spans)
        self.spans = [(e.offset - region.data_offset, e.length) for e in region.entries]

    def finish(self, crcs: Sequence[int], manifest: dict[str, Any], *, image_crc: int = 0) -> SlotHeader:
        """Steps 2-3: write the image header (``crcs``: each piece's CRC32, in index order) and the
        manifest, msync the slot, then the DONE header (msynced). Returns the DONE header."""
        r = self.region
        dev = r.device
        if len(crcs) != len(r.entries):
            raise ValueError(f"{len(crcs)} CRCs for {len(r.entries)} pieces")
        if manifest.get("name") != r.name or fmt.manifest_run(manifest)[0] != r.run \
                or manifest.get("version") != self.version.step:
            raise ValueError(f"the manifest (name {manifest.get('name')!r}, run {fmt.manifest_run(manifest)[0]}, "
                             f"version {manifest.get('version')}) is not {r.name!r} run {r.run} "
                             f"version {self.version.step}")
        meta = fmt.encode_manifest(manifest)
        if len(meta) > r.meta_cap:
            raise ValueError(f"the manifest is {len(meta)} bytes, the slot holds {r.meta_cap}: register with a "
                             "larger meta_cap")
        cp.hit("memtier.slot.data")
        entries = [dataclasses.replace(e, crc=int(c) & 0xFFFFFFFF) for e, c in zip(r.entries, crcs)]
        head = fmt.encode_index(fmt.KIND_SHARD, r.rank, r.world_size, self.version.step, entries, r.data_offset,
                                r.file_size, True, r.run)
        self.image[:len(head)] = head
        off = r._slot_off(self.slot)
        dev.mm[off + PAGE:off + PAGE + len(meta)] = meta
        dev._flush(off, r._e.slot_stride)
        cp.hit("memtier.slot.done")
        raw = _slot_header_bytes(SlotState.DONE, r.run, self.version, len(meta), r.image_size, image_crc, time.time())
        dev.mm[off:off + len(raw)] = raw
        dev._flush(off, PAGE)
        h = r.slot_header(self.slot)
        assert h is not None
        return h

    def release(self) -> None:
        """Drop the views into the mapping (so the device can be unmapped)."""
        self.data.release()
        self.image.release()
