"""The memory-tier device's bytes: layout, records, and the checks of everything read from it.

What the file holds, byte by byte (written and read by :mod:`deepfreeze.memtier.device`, the file
and its model table, and :mod:`deepfreeze.memtier.slot`, a region's slots); here: the constants
and struct formats, table entries and slot headers as records, the per-shard index (MIndex) and
the bounds checks of each before use. No file, no mapping, no lock (:func:`_touch` pre-faults a
range of a mapping it is given).

Layout (little-endian, every offset from the file start, ``PAGE`` = 4096)::

    superblock [0, 4096)
      magic b"DFMEMTR\\0", format u32 = 1, page u32, size u64, table_off u64 (= 4096),
      table_cap u32, entry_size u32 (= 1024), created f64, crc u32 (CRC32 of the bytes before it)
    model table at table_off: table_cap entries of entry_size bytes, append-only
      state u32 (0 FREE: never written, 1 WRITING, 2 VALID, 3 RETIRED, 4 FINISHED: valid, and the
      model's job has finished so repack may compact it), then the body:
      name (u16 len + 255 bytes utf-8), run 16s (hex), rank u32, world_size u32, nslots u32,
      region_off, region_len, index_off, index_len, slot_off, slot_stride, meta_cap, image_size
      (all u64), created f64, body_crc u32 (CRC32 of the body; the state word is outside it)
    data area from data_start = align(table_off + table_cap * entry_size, PAGE): the regions
    region of an entry (page aligned): index, then the slots
      MIndex at index_off: index_len bytes of JSON + u32 CRC32 trailer (see :func:`make_index`); its
        ``job`` is the id of the job the region belongs to (``deepfreeze.lease.job_id``; absent or
        null: "job unknown", a region written before job ids existed)
      slot k at slot_off + k * slot_stride:
        header page: magic b"DFSLOT\\0\\0", state u32 (0 EMPTY, 1 ACTIVE, 2 DONE), pad u32, run 16s,
          generation u64, step u64 (the checkpoint version number), meta_len u32, pad u32,
          image_len u64, image_crc u32 (0: not computed), pad u32, written f64, hdr_crc u32
          (CRC32 of the header bytes before it)
        manifest [PAGE, PAGE + meta_cap): meta_len bytes, the version's checkpoint manifest (JSON)
        image [PAGE + meta_cap, + image_size): the format.py shard image of the version
"""
from __future__ import annotations

import dataclasses
import enum
import math
import mmap
import re
import struct
from typing import Any, Sequence

import numpy as np

from .. import format as fmt
from ..jsonsafe import loads as bounded_loads
from ..errors import MemtierCorruptError
from ..lease import Version, valid_job_id

__all__ = ["PAGE", "SlotHeader", "SlotState", "make_index", "index_for_entries", "manifest_capacity"]

PAGE = 4096
SB_MAGIC = b"DFMEMTR\0"
SLOT_MAGIC = b"DFSLOT\0\0"
DEVICE_FORMAT = 1
ENTRY_SIZE = 1024
DEFAULT_TABLE_CAP = 1024
MAX_INDEX_BYTES = 64 << 20
MAX_SLOTS = 64
MAX_NAME_BYTES = 255

_SB = struct.Struct("<8sIIQQIId")  # + crc u32
_BODY = struct.Struct("<H255s16sIIIQQQQQQQQd")  # + body_crc u32
_SLOT = struct.Struct("<8sII16sQQIIQIId")  # + hdr_crc u32
_U32 = struct.Struct("<I")
assert _SB.size + 4 <= PAGE and 4 + _BODY.size + 4 <= ENTRY_SIZE and _SLOT.size + 4 <= PAGE

FREE, WRITING, VALID, RETIRED, FINISHED = 0, 1, 2, 3, 4
_LIVE_STATES = (VALID, FINISHED)
_STATE_NAMES = {FREE: "free", WRITING: "writing", VALID: "valid", RETIRED: "retired", FINISHED: "finished"}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.]{1,200}$")  # config.validate_name's rule
_RUN_RE = re.compile(r"^[0-9a-f]{16}$")


class SlotState(enum.IntEnum):
    EMPTY = 0
    ACTIVE = 1
    DONE = 2


def _align(n: int, a: int = PAGE) -> int:
    return (n + a - 1) // a * a


def _check_name(name: Any) -> str | None:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        return f"name {str(name)[:60]!r} is not a checkpoint name ([A-Za-z0-9_.], at most 200 characters)"
    return None


def _decode_json(data: bytes, what: str) -> Any:
    """JSON with the manifest limits of format.py (long integers, NaN, nesting depth); never pickle."""
    return bounded_loads(data, what, max_bytes=len(data), error=MemtierCorruptError, hooks=fmt.json_hooks(data),
                         advice="the memory-tier entry is damaged: it is not used")


def _int(v: Any, lo: int = 0, hi: int = 1 << 62) -> bool:
    return type(v) is int and lo <= v <= hi


@dataclasses.dataclass(frozen=True)
class SlotHeader:
    """A slot's header as read (only headers with the right magic and a matching CRC are returned)."""

    state: SlotState
    run: str
    version: Version  #: (generation, checkpoint version number)
    meta_len: int
    image_len: int
    image_crc: int
    written: float
    raw: bytes = dataclasses.field(repr=False, compare=False, default=b"")


@dataclasses.dataclass(frozen=True)
class _Entry:
    entry_no: int
    state: int
    name: str
    run: str
    rank: int
    world_size: int
    nslots: int
    region_off: int
    region_len: int
    index_off: int
    index_len: int
    slot_off: int
    slot_stride: int
    meta_cap: int
    image_size: int
    created: float
    body: bytes = dataclasses.field(repr=False, default=b"")

    def pack_body(self) -> bytes:
        name = self.name.encode("utf-8")
        body = _BODY.pack(len(name), name, self.run.encode("ascii"), self.rank, self.world_size, self.nslots,
                          self.region_off, self.region_len, self.index_off, self.index_len, self.slot_off,
                          self.slot_stride, self.meta_cap, self.image_size, self.created)
        return body + _U32.pack(fmt.crc32(body))


def _parse_entry(no: int, raw: bytes) -> "_Entry | str":
    """The entry in ``raw`` (entry_size bytes), or what is wrong with it."""
    state = _U32.unpack_from(raw, 0)[0]
    body = raw[4:4 + _BODY.size]
    crc = _U32.unpack_from(raw, 4 + _BODY.size)[0]
    if fmt.crc32(body) != crc:
        return "body checksum mismatch (torn or damaged entry)"
    f = _BODY.unpack(body)
    nlen, nraw, run = f[0], f[1], f[2]
    if nlen > MAX_NAME_BYTES:
        return f"name length {nlen} above {MAX_NAME_BYTES}"
    try:
        name, run_s = nraw[:nlen].decode("utf-8"), run.decode("ascii")
    except UnicodeDecodeError:
        return "name or run is not text"
    return _Entry(no, state, name, run_s, *f[3:], body=body)  # type: ignore[arg-type]


def _entry_problem(e: _Entry, data_start: int, size: int) -> str | None:
    why = _check_name(e.name)
    if why:
        return why
    if not _RUN_RE.match(e.run):
        return f"run {e.run!r} is not 16 hex digits"
    if not (1 <= e.world_size <= 1 << 20 and e.rank < e.world_size):
        return f"rank {e.rank} / world size {e.world_size} out of range"
    if not 1 <= e.nslots <= MAX_SLOTS:
        return f"{e.nslots} slots (1..{MAX_SLOTS} allowed)"
    if any(v % PAGE for v in (e.region_off, e.region_len, e.slot_off, e.slot_stride, e.meta_cap)):
        return "region, slot offsets, stride or manifest capacity not page aligned"
    if not (data_start <= e.region_off and e.region_len > 0 and e.region_off + e.region_len <= size):
        return (f"region [{e.region_off}, {e.region_off + e.region_len}) outside the data area "
                f"[{data_start}, {size})")
    if e.index_len > MAX_INDEX_BYTES:
        return f"index of {e.index_len} bytes (at most {MAX_INDEX_BYTES})"
    if not (e.region_off <= e.index_off and e.index_off + e.index_len + 4 <= e.slot_off):
        return "index outside the region or overlapping the slots"
    if not 0 < e.image_size <= 1 << 50:
        return f"image size {e.image_size} out of range"
    if e.slot_stride < PAGE + e.meta_cap + _align(e.image_size):
        return f"slot stride {e.slot_stride} smaller than header + manifest + image"
    if e.slot_off + e.nslots * e.slot_stride > e.region_off + e.region_len:
        return "slots run past the region"
    return None


def _index_problem(idx: Any, e: "_Entry | None") -> str | None:
    """What is wrong with an MIndex (dict), checked against its table entry when given."""
    if not isinstance(idx, dict):
        return "not an object"
    for k, typ in (("name", str), ("run", str), ("rank", int), ("world_size", int), ("tensors", list),
                   ("data_offset", int), ("file_size", int), ("standalone", bool)):
        if not isinstance(idx.get(k), typ) or (typ is int and isinstance(idx.get(k), bool)):
            return f"'{k}' missing or not {typ.__name__}"
    if e is not None and (idx["name"], idx["run"], idx["rank"], idx["world_size"]) != \
            (e.name, e.run, e.rank, e.world_size):
        return "name, run, rank or world size differ from the table entry"
    if _check_name(idx["name"]) or not _RUN_RE.match(idx["run"]):
        return "name or run malformed"
    if not (1 <= idx["world_size"] <= 1 << 20 and 0 <= idx["rank"] < idx["world_size"]):
        return "rank / world size out of range"
    lease = idx.get("lease")
    if lease is not None and not (isinstance(lease, dict) and isinstance(lease.get("persistent"), str)
                                  and isinstance(lease.get("timeout"), (int, float))
                                  and not isinstance(lease.get("timeout"), bool)):
        return "'lease' malformed (null or {persistent: str, timeout: number})"
    job = idx.get("job")
    if job is not None and not valid_job_id(job):
        return "'job' malformed (null or 32 hex digits)"
    owner = idx.get("owner")
    if owner is not None and not (isinstance(owner, dict) and _int(owner.get("pid"), 1, 1 << 31)
                                  and _int(owner.get("start"), 0, 1 << 62) and isinstance(owner.get("boot"), str)
                                  and isinstance(owner.get("node", ""), str)):
        return "'owner' malformed"
    data_offset, file_size, tensors = idx["data_offset"], idx["file_size"], idx["tensors"]
    if len(tensors) > fmt.MAX_ENTRIES:
        return f"{len(tensors)} pieces"
    if e is not None and file_size != e.image_size:
        return f"file_size {file_size} differs from the entry's image size {e.image_size}"
    if not (data_offset % PAGE == 0 and 0 < data_offset <= file_size <= 1 << 50):
        return f"data_offset {data_offset} / file_size {file_size} out of range"
    head = 72
    pos = data_offset
    for i, t in enumerate(tensors):
        if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("dtype"), str)
                and t["dtype"] in fmt.ITEMSIZE
                and isinstance(t.get("shape"), list) and len(t["shape"]) <= fmt.MAX_NDIM
                and all(_int(d, 0, 1 << 48) for d in t["shape"])
                and all(_int(t.get(k)) for k in ("size", "offset", "tensor_id", "start", "stop"))):
            return f"piece {i} malformed"
        total = math.prod(t["shape"])
        if not (total <= fmt.MAX_TENSOR_ELEMENTS and t["start"] <= t["stop"] <= total
                and t["size"] == (t["stop"] - t["start"]) * fmt.ITEMSIZE[t["dtype"]] and t["tensor_id"] < 1 << 32):
            return f"piece {i} ({t['name']!r}): range, size or shape inconsistent"
        if not (pos <= t["offset"] and t["offset"] + t["size"] <= file_size):
            return f"piece {i} ({t['name']!r}): bytes [{t['offset']}, {t['offset'] + t['size']}) overlap another " \
                   f"piece or lie outside the data region [{data_offset}, {file_size})"
        pos = t["offset"] + t["size"]
        head += 48 + 8 * len(t["shape"])
    if head > data_offset:
        return f"the image header and index ({head} bytes) do not fit before data_offset {data_offset}"
    return None


def index_for_entries(name: str, run: str, rank: int, world_size: int, names: Sequence[str],
                      entries: Sequence[fmt.Entry], data_offset: int, file_size: int, *,
                      lease: dict[str, Any] | None = None, standalone: bool = False,
                      owner: dict[str, Any] | None = None, job: str | None = None) -> dict[str, Any]:
    """The MIndex of a shard laid out by ``format.layout`` (``entries`` with offsets; ``names[i]``
    is the tensor name of ``entries[i]``), e.g. from ``FusedLayout.build(plan, rank)``; ``job``:
    the id of the job it belongs to (:func:`deepfreeze.lease.job_id`), None: job unknown."""
    if job is not None and not valid_job_id(job):
        raise ValueError(f"job {job!r} is not a job id (32 hex digits: deepfreeze.lease.new_job_id)")
    tensors = [{"name": n, "dtype": e.dtype, "shape": list(e.shape), "size": e.length, "offset": e.offset,
                "tensor_id": e.tensor_id, "start": e.start, "stop": e.stop} for n, e in zip(names, entries)]
    idx = {"name": name, "run": run, "rank": rank, "world_size": world_size, "tensors": tensors,
           "data_offset": data_offset, "file_size": file_size, "lease": lease, "standalone": standalone}
    if owner is not None:
        idx["owner"] = owner
    if job is not None:
        idx["job"] = job
    return idx


def make_index(plan: Any, rank: int, name: str, run: str, *, lease: dict[str, Any] | None = None,
               standalone: bool = False, owner: dict[str, Any] | None = None,
               job: str | None = None) -> dict[str, Any]:
    """The MIndex of rank ``rank``'s shard of a :class:`~deepfreeze.shardplan.ShardPlan` (the image
    is laid out exactly like the shard file and the fused capture buffer of that rank)."""
    pieces = plan.for_rank(rank)
    raw = [fmt.Entry(p.tensor_id, plan.tensors[p.tensor_id].dtype, plan.tensors[p.tensor_id].shape, p.start, p.stop)
           for p in pieces]
    entries, data_offset, file_size = fmt.layout(raw)
    return index_for_entries(name, run, rank, plan.world_size, [plan.tensors[p.tensor_id].name for p in pieces],
                             entries, data_offset, file_size, lease=lease, standalone=standalone, owner=owner,
                             job=job)


def manifest_capacity(n_tensors: int, n_pieces: int, world_size: int) -> int:
    """Bytes to reserve per slot for the version's manifest: the largest one restore accepts for
    that shape (``format.manifest_size_limit``; ``n_pieces``: the items its plan record lists,
    ``format.plan_items``: none for a compact record but FSDP2's bounds and per-rank records), page
    aligned."""
    return _align(fmt.manifest_size_limit(n_tensors, n_pieces, world_size))


def _index_entries(idx: dict[str, Any]) -> list[fmt.Entry]:
    return [fmt.Entry(t["tensor_id"], t["dtype"], tuple(t["shape"]), t["start"], t["stop"], t["offset"], t["size"])
            for t in idx["tensors"]]


def _touch(mm: mmap.mmap, off: int, length: int) -> None:
    """Pre-fault [off, off + length) for writing: one read-modify-write of a byte per page
    (contents unchanged), so the first checkpoint does not pay for the page faults."""
    if length <= 0:
        return
    a = np.frombuffer(mm, dtype=np.uint8, count=length, offset=off)
    a[::PAGE] |= 0
    del a
