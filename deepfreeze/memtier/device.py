"""The memory-tier device: one preallocated, pre-faulted file holding many models' checkpoint slots.

A *device* (default under ``/dev/shm``) is laid out once, at :func:`create`, and then only
written through this module. Per (model, shard) it holds an *index* (MIndex) and ``nslots``
*slots*; a slot's image is exactly a :mod:`deepfreeze.format` shard file (header + index + data),
so everything that reads shard files reads a slot image unchanged.

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
        ``job`` is the id of the job the region belongs to (``deepfreeze.run.job_id``; absent or
        null: "job unknown", a region written before job ids existed)
      slot k at slot_off + k * slot_stride:
        header page: magic b"DFSLOT\\0\\0", state u32 (0 EMPTY, 1 ACTIVE, 2 DONE), pad u32, run 16s,
          generation u64, step u64 (the checkpoint version number), meta_len u32, pad u32,
          image_len u64, image_crc u32 (0: not computed), pad u32, written f64, hdr_crc u32
          (CRC32 of the header bytes before it)
        manifest [PAGE, PAGE + meta_cap): meta_len bytes, the version's checkpoint manifest (JSON)
        image [PAGE + meta_cap, + image_size): the format.py shard image of the version

**Model table protocol.** Every change of the table happens under an exclusive ``flock`` of the
device file (bounded wait, :class:`MemtierBusyError` naming the holder). Register: take the
first FREE entry (else reuse a RETIRED one: its state goes to WRITING first), state WRITING,
write the body, write the MIndex and an EMPTY header into every slot, pre-fault the region, msync,
then flip the state to VALID (one aligned 4-byte store) and msync. A crash before the flip leaves
a WRITING entry, which nothing reads and the next :meth:`Device.repack` retires. Retire: state
RETIRED. There is no allocator state on the device: free space is computed at open from the VALID
regions (first fit, page aligned).

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

Every offset and size read from the device is bounds-checked before use. A damaged superblock
raises :class:`MemtierCorruptError`; a damaged or hostile table entry (or index) is
*quarantined*: left out of the regions with a log line naming the entry and the reason, its
claimed bytes kept out of the free space when its body checksum holds (and it overlaps no valid
region), and every other model stays usable (:meth:`Device.refresh`; ``strict=True`` raises
instead). A hostile or damaged file never crashes the reader.

**Jobs and capacity.** Each region's MIndex records its job id (``deepfreeze.run.job_id``);
readers select by it (:func:`for_job`). The regions of a run that a newer run of the same job
superseded (a newer verified DONE version on every region of the newer run) are retired
(:meth:`Device.reclaim`, :meth:`Device.repack`); a registration that does not fit may evict
finished models (:meth:`Device._evict_for`: never a live one, each job's newest version last);
:meth:`Device.drop` is ``deepfreeze memtier rm``.
"""
from __future__ import annotations

import builtins
import contextlib
import dataclasses
import enum
import errno
import fcntl
import json
import logging
import math
import mmap
import os
import re
import struct
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .. import crashpoints as cp
from .. import format as fmt
from .. import node as _node
from ..jsonsafe import loads as bounded_loads
from ..errors import (CorruptCheckpointError, MemtierBusyError, MemtierCorruptError, MemtierError,
                      MemtierFullError, UntrustedOwnerError)
from ..lease import Version, valid_job_id
from . import jobs as _jobs

__all__ = ["PAGE", "create", "open", "view", "parse_size", "Device", "ShardRegion", "SlotHeader", "SlotState",
           "SlotWriter", "make_index", "index_for_entries", "manifest_capacity", "default_live",
           "FLOCK_TIMEOUT"]

log = logging.getLogger("deepfreeze")

PAGE = 4096
SB_MAGIC = b"DFMEMTR\0"
SLOT_MAGIC = b"DFSLOT\0\0"
DEVICE_FORMAT = 1
ENTRY_SIZE = 1024
DEFAULT_TABLE_CAP = 1024
MAX_INDEX_BYTES = 64 << 20
MAX_SLOTS = 64
MAX_NAME_BYTES = 255
#: seconds to wait for the device's flock before :class:`MemtierBusyError`
FLOCK_TIMEOUT = 30.0

_SB = struct.Struct("<8sIIQQIId")  # + crc u32
_BODY = struct.Struct("<H255s16sIIIQQQQQQQQd")  # + body_crc u32
_SLOT = struct.Struct("<8sII16sQQIIQIId")  # + hdr_crc u32
_U32 = struct.Struct("<I")
assert _SB.size + 4 <= PAGE and 4 + _BODY.size + 4 <= ENTRY_SIZE and _SLOT.size + 4 <= PAGE

FREE, WRITING, VALID, RETIRED, FINISHED = 0, 1, 2, 3, 4
_LIVE_STATES = (VALID, FINISHED)
builtins_open = builtins.open  # this module defines open()
_STATE_NAMES = {FREE: "free", WRITING: "writing", VALID: "valid", RETIRED: "retired", FINISHED: "finished"}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.]{1,200}$")  # config.validate_name's rule
_RUN_RE = re.compile(r"^[0-9a-f]{16}$")


class SlotState(enum.IntEnum):
    EMPTY = 0
    ACTIVE = 1
    DONE = 2


def _align(n: int, a: int = PAGE) -> int:
    return (n + a - 1) // a * a


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
          "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12}


def parse_size(size: "int | str") -> int:
    """Bytes of a size given as an int or a string: ``K``/``M``/``G``/``T`` and ``KiB``/``MiB``/
    ``GiB``/``TiB`` are binary (``10G`` = ``10GiB`` = 10 * 2**30 bytes), ``KB``/``MB``/``GB``/``TB``
    decimal (``10GB`` = 10**9 * 10 bytes), a plain number or ``B`` bytes; case does not matter."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?(?:i?B)?)\s*", str(size), re.IGNORECASE)
        unit = m.group(2).upper() if m else None
        if not m or unit not in _UNITS:
            raise ValueError(f"size {size!r} is not a number of bytes or a size such as '8G' (GiB), '512M' (MiB), "
                             "'10GB' (10**9 bytes)")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return n


# --------------------------------------------------------------------------- small helpers

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


def _mem_available() -> int | None:
    try:
        with builtins_open("/proc/meminfo", "rb") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _fs_type(directory: str) -> str:
    """File system type of the mount holding ``directory`` (``/proc/self/mountinfo``), or ``""``."""
    best, kind = "", ""
    real = os.path.realpath(directory)
    try:
        with builtins_open("/proc/self/mountinfo", "rb") as f:
            lines = f.read(1 << 22).decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    for line in lines:
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(parts) < 5 or not rparts:
            continue
        mnt = parts[4].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, kind = mnt, rparts[0]
    return kind


def _flock_holder(fd: int) -> str:
    """Who holds the flock of the file behind ``fd`` (from ``/proc/locks``), if it can be told."""
    try:
        st = os.fstat(fd)
        want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with builtins_open("/proc/locks", "rb") as f:
            for line in f.read(1 << 20).decode("ascii", "replace").splitlines():
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].lower() == want:
                    pid = parts[4]
                    try:
                        with builtins_open(f"/proc/{pid}/cmdline", "rb") as c:
                            cmd = c.read(200).replace(b"\0", b" ").decode("utf-8", "replace").strip()
                    except OSError:
                        cmd = "?"
                    return f"pid {pid} ({cmd})"
    except (OSError, ValueError):
        pass
    return "another process (unknown: /proc/locks did not say)"


_said_lock = threading.Lock()
_said_quarantine: set[tuple[str, int, str]] = set()


# --------------------------------------------------------------------------- records

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
        if not (isinstance(t, dict) and isinstance(t.get("name"), str) and t.get("dtype") in fmt.ITEMSIZE
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
    the id of the job it belongs to (:func:`deepfreeze.run.job_id`), None: job unknown."""
    if job is not None and not valid_job_id(job):
        raise ValueError(f"job {job!r} is not a job id (32 hex digits: deepfreeze.run.new_job_id)")
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
    that shape (``format.manifest_size_limit``), page aligned."""
    return _align(fmt.manifest_size_limit(n_tensors, n_pieces, world_size))


def _index_entries(idx: dict[str, Any]) -> list[fmt.Entry]:
    return [fmt.Entry(t["tensor_id"], t["dtype"], tuple(t["shape"]), t["start"], t["stop"], t["offset"], t["size"])
            for t in idx["tensors"]]


# --------------------------------------------------------------------------- device

def create(path: str, size: "int | str", *, force: bool = False, table_cap: int = DEFAULT_TABLE_CAP,
           progress: "Callable[[str, int, int], None] | None" = None) -> "Device":
    """Create a device file of ``size`` bytes (``"8G"`` = 8 GiB, ``"512M"``, ``"10GB"`` = 10**10
    bytes, or an int: :func:`parse_size`; rounded up to pages) at ``path``, allocated
    (``posix_fallocate``) and pre-faulted (every page touched through a mapping), mode 0600, and
    return it open. ``progress(phase, done, total)`` is called as the file is allocated
    (``"allocating"``) and pre-faulted (``"pre-faulting"``, every 64 MiB). On tmpfs the size is checked against
    ``MemAvailable`` and the file system's free space first (:class:`MemtierFullError`). An existing
    file is an error unless ``force`` (then it is replaced: every checkpoint on it is lost). The
    file appears under ``path`` only once complete (built under a temporary name, then linked)."""
    size = _align(parse_size(size))
    if not 1 <= table_cap <= 1 << 16:
        raise ValueError(f"table_cap {table_cap} out of range [1, 65536]")
    data_start = _align(PAGE + table_cap * ENTRY_SIZE)
    if size < data_start + 2 * PAGE:
        raise ValueError(f"a device of {size} bytes is too small: the superblock and model table alone take "
                         f"{data_start} bytes; give at least {data_start + 2 * PAGE}")
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    if os.path.lexists(path) and not force:
        lst = os.lstat(path)
        if lst.st_uid != os.getuid():
            from ..ownership import owner_name
            raise UntrustedOwnerError(f"{path} already exists and is owned by {owner_name(lst.st_uid)}, not by you: "
                                      "another user created it first (it could read and forge your checkpoints). "
                                      "Pick another path (or have its owner or root remove it)")
        raise MemtierError(f"{path} already exists: pass force=True (--force) to replace it, which destroys every "
                           "checkpoint on it, or pick another path")
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if os.path.lexists(path):
        with contextlib.suppress(OSError):
            free += os.stat(path).st_blocks * 512 if os.path.isfile(path) else 0
    kind = _fs_type(directory)
    if size > free:
        raise MemtierFullError(f"cannot create a {size}-byte memory-tier device in {directory}: the file system has "
                               f"{free} bytes free. Pick a smaller --size or free space there")
    if kind in ("tmpfs", "ramfs", "shm"):
        avail = _mem_available()
        if avail is not None and size > avail:
            raise MemtierFullError(f"cannot create a {size}-byte memory-tier device on {kind} ({directory}): the "
                                   f"machine has {avail} bytes of memory available (MemAvailable), and a tmpfs file "
                                   "lives in memory. Pick a smaller --size, or a disk/NVMe path")
    tmp = f"{path}.creating.{os.getpid()}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            if progress is not None:
                progress("allocating", 0, size)
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise MemtierFullError(f"cannot allocate {size} bytes for the memory-tier device {path}: "
                                       f"{os.strerror(e.errno)}. Pick a smaller --size") from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, size)
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            step = 64 << 20
            for off in range(0, size, step):
                if progress is not None:
                    progress("pre-faulting", off, size)
                _touch(mm, off, min(step, size - off))
            if progress is not None:
                progress("pre-faulting", size, size)
            created = time.time()
            sb = _SB.pack(SB_MAGIC, DEVICE_FORMAT, PAGE, size, PAGE, table_cap, ENTRY_SIZE, created)
            mm[0:_SB.size + 4] = sb + _U32.pack(fmt.crc32(sb))
            mm.flush()
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    try:
        if force:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if someone created it meanwhile
            os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return open(path)


def _touch(mm: mmap.mmap, off: int, length: int) -> None:
    """Pre-fault [off, off + length) for writing: one read-modify-write of a byte per page
    (contents unchanged), so the first checkpoint does not pay for the page faults."""
    if length <= 0:
        return
    a = np.frombuffer(mm, dtype=np.uint8, count=length, offset=off)
    a[::PAGE] |= 0
    del a


def open(path: str, *, writable: bool = True) -> "Device":  # noqa: A001 - the documented name
    """Open and validate a device (superblock, every table entry, region and index). A damaged
    table entry is quarantined (that model unreadable, shown by ``view``; everything else usable);
    a damaged superblock or overlapping valid regions: :class:`MemtierCorruptError`.
    ``writable=False`` maps it read-only (view, dump, restore)."""
    return Device(path, writable=writable)


class Device:
    """An open memory-tier device. Use as a context manager or call :meth:`close`.

    Thread-safe for the table operations (a lock plus the device flock); slot writes are the
    caller's (one writer per region)."""

    def __init__(self, path: str, *, writable: bool = True, strict: bool = False) -> None:
        from ..fsafe import open_regular
        from ..ownership import check_file
        self.path = os.path.abspath(path)
        self.writable = writable
        try:
            self._fd = open_regular(self.path, os.O_RDWR if writable else os.O_RDONLY)
        except CorruptCheckpointError as e:
            raise MemtierCorruptError(f"{self.path} is not a memory-tier device: {e}") from None
        try:  # the user's own file; a wider mode is tightened to 0600 (one log line); another user's
            # device is refused, for reading too: its owner could forge any version at any time
            check_file(self._fd, os.fstat(self._fd), self.path, kind="memory-tier device")
        except BaseException:
            os.close(self._fd)
            raise
        self._lock = threading.RLock()
        self._mm: mmap.mmap | None = None
        try:
            self.size = os.fstat(self._fd).st_size
            if self.size < PAGE:
                raise self._bad(f"{self.size} bytes, smaller than the superblock")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mm = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED, prot)
            self._read_superblock()
            #: problems found at open (damaged entries, quarantined: see :meth:`refresh`)
            self.problems: list[str] = []
            #: the quarantined entries: {"entry", "name", "rank", "reason"} (name/rank None if unreadable)
            self.quarantined: list[dict[str, Any]] = []
            self._reserved: list[tuple[int, int]] = []
            self._reserved_map: dict[int, tuple[int, int]] = {}
            self._strict = strict
            self._regions: list[ShardRegion] = []
            self._other: list[_Entry] = []  # WRITING / RETIRED entries (for view and repack)
            self.refresh()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- basics
    def _bad(self, why: str) -> MemtierCorruptError:
        return MemtierCorruptError(f"{self.path}: not a valid memory-tier device: {why}. The file is damaged or "
                                   "not a device: recreate it with 'deepfreeze memtier create PATH --size S --force' "
                                   "(after dumping what 'deepfreeze memtier view' still shows as valid)")

    def _read_superblock(self) -> None:
        raw = bytes(self.mm[0:_SB.size + 4])
        magic, ver, page, size, table_off, table_cap, entry_size, created = _SB.unpack_from(raw)
        if magic != SB_MAGIC:
            raise self._bad(f"wrong magic {magic!r}")
        if _U32.unpack_from(raw, _SB.size)[0] != fmt.crc32(raw[:_SB.size]):
            raise self._bad("superblock checksum mismatch")
        if ver != DEVICE_FORMAT:
            raise self._bad(f"device format {ver}, this DeepFreeze reads {DEVICE_FORMAT}: upgrade DeepFreeze")
        if page != PAGE or table_off != PAGE or entry_size != ENTRY_SIZE or not 1 <= table_cap <= 1 << 16:
            raise self._bad(f"page {page}, table offset {table_off}, entry size {entry_size} or table "
                            f"capacity {table_cap} unsupported")
        if size != self.size:
            raise self._bad(f"the file has {self.size} bytes, the superblock says {size} (truncated or grown)")
        self.table_off, self.table_cap, self.created = table_off, table_cap, created
        self.data_start = _align(table_off + table_cap * ENTRY_SIZE)
        if self.data_start > self.size:
            raise self._bad("the model table runs past the end of the file")

    @property
    def mm(self) -> mmap.mmap:
        if self._mm is None:
            raise MemtierError(f"device {self.path} is closed")
        return self._mm

    def fileno(self) -> int:
        """The descriptor of the device file this object checked and mapped at open (valid until
        :meth:`close`): read through it (``os.dup`` it to keep it longer), never by path again, so
        a file put at the path since is never read."""
        if self._fd < 0:
            raise MemtierError(f"device {self.path} is closed")
        return self._fd

    def close(self) -> None:
        """Unmap and close (views handed out keep the mapping alive until they are released)."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # exported views (a caller still holds a slot image): unmapped with them
                pass
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Device({self.path!r}, size={self.size}, shards={len(self._regions)})"

    # ---------------------------------------------------------------- table
    def _entry_off(self, no: int) -> int:
        return self.table_off + no * ENTRY_SIZE

    def _state(self, no: int) -> int:
        return _U32.unpack_from(self.mm, self._entry_off(no))[0]

    def refresh(self) -> None:
        """Re-read the model table (other processes may have registered or retired regions).

        A damaged or hostile entry is *quarantined*, not fatal: it is left out of the regions
        (that model cannot be read or written), named in :attr:`problems` and
        :attr:`quarantined` (logged once per process), and every other model stays usable. The
        bytes it claims stay reserved when its body checksum holds and its region lies in the
        data area (a damaged index does not free the space of its region); entries whose regions
        overlap are both quarantined. With ``strict=True`` (the constructor's) a problem raises
        :class:`MemtierCorruptError` instead, as before."""
        with self._lock:
            regions, other, problems, bad = [], [], [], set()
            quarantined: list[dict[str, Any]] = []
            reserved: dict[int, tuple[int, int]] = {}  # entry -> (offset, length) kept out of the free space
            mm = self.mm

            def quarantine(no: int, why: str, e: "_Entry | None") -> None:
                label = f"model table entry {no}" + (f" ({e.name!r} rank {e.rank})" if e is not None else "")
                problems.append(f"{label}: {why}")
                quarantined.append({"entry": no, "name": None if e is None else e.name,
                                    "rank": None if e is None else e.rank, "reason": why})
                if e is not None and self.data_start <= e.region_off and 0 < e.region_len \
                        and e.region_off + e.region_len <= self.size and not e.region_off % PAGE:
                    reserved[no] = (e.region_off, _align(e.region_len))

            for no in range(self.table_cap):
                off = self._entry_off(no)
                state = _U32.unpack_from(mm, off)[0]
                if state == FREE:
                    continue
                parsed = _parse_entry(no, bytes(mm[off:off + ENTRY_SIZE]))
                if state not in _STATE_NAMES:
                    quarantine(no, f"unknown state {state}", parsed if not isinstance(parsed, str) else None)
                    continue
                if isinstance(parsed, str):
                    if state in _LIVE_STATES:
                        quarantine(no, parsed, None)
                    continue  # WRITING/RETIRED entries may be torn: never read
                if state not in _LIVE_STATES:
                    other.append(parsed)
                    continue
                why = _entry_problem(parsed, self.data_start, self.size)
                if why is None:
                    try:
                        idx = self._read_index(parsed)
                    except MemtierCorruptError as e:
                        why = str(e)
                if why is not None:
                    quarantine(no, why, parsed)
                    continue
                regions.append(ShardRegion(self, parsed, idx))
            regions.sort(key=lambda r: r.region_off)
            end: ShardRegion | None = None  # the region reaching furthest so far
            for r in regions:
                if end is not None and end.region_off + end.region_len > r.region_off:
                    problems.append(f"model table entries {end.entry_no} ({end.name!r}) and {r.entry_no} "
                                    f"({r.name!r}): regions overlap")
                    bad |= {end.entry_no, r.entry_no}
                if end is None or r.region_off + r.region_len > end.region_off + end.region_len:
                    end = r
            for no, (o, n) in list(reserved.items()):  # a damaged entry never takes a valid region's place
                if any(r.region_off < o + n and o < r.region_off + r.region_len for r in regions):
                    del reserved[no]
            if problems and self._strict:
                raise self._bad("; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5
                                                           else ""))
            for r in regions:
                if r.entry_no in bad:
                    quarantined.append({"entry": r.entry_no, "name": r.name, "rank": r.rank,
                                        "reason": "its region overlaps another entry's"})
                    reserved[r.entry_no] = (r.region_off, r.region_len)
            regions = [r for r in regions if r.entry_no not in bad]
            self.problems = problems
            self.quarantined = quarantined
            self._reserved = sorted(reserved.values())
            self._reserved_map = reserved
            self._regions = sorted(regions, key=lambda r: (r.name, r.run, r.rank, r.entry_no))
            self._other = other
            for q in quarantined:
                key = (self.path, q["entry"], q["reason"])
                with _said_lock:
                    if key in _said_quarantine:
                        continue
                    _said_quarantine.add(key)
                log.warning("deepfreeze memtier: %s: model table entry %d%s is damaged (%s): quarantined (that model "
                            "cannot be read; every other model is usable). 'deepfreeze memtier view %s' shows it; "
                            "'deepfreeze memtier rm %s --entry %d' drops it", self.path, q["entry"],
                            f" ({q['name']!r} rank {q['rank']})" if q["name"] else "", q["reason"], self.path,
                            self.path, q["entry"])

    def _read_index(self, e: _Entry) -> dict[str, Any]:
        raw = bytes(self.mm[e.index_off:e.index_off + e.index_len + 4])
        if len(raw) != e.index_len + 4 or fmt.crc32(raw[:-4]) != _U32.unpack_from(raw, e.index_len)[0]:
            raise MemtierCorruptError("index checksum mismatch")
        idx = _decode_json(raw[:-4], "index")
        why = _index_problem(idx, e)
        if why:
            raise MemtierCorruptError(f"index: {why}")
        return idx

    def shards(self) -> "list[ShardRegion]":
        """The valid regions (as of the last :meth:`refresh`), sorted by (name, run, rank)."""
        return list(self._regions)

    def region(self, entry_no: int) -> "ShardRegion | None":
        """The valid region of model-table entry ``entry_no`` (as of the last :meth:`refresh`), or None."""
        return next((r for r in self._regions if r.entry_no == entry_no), None)

    def find(self, name: str, run: str | None = None, rank: int | None = None) -> "list[ShardRegion]":
        """Valid regions of ``name`` (and ``run``, ``rank`` when given), after a :meth:`refresh`."""
        self.refresh()
        return [r for r in self._regions if r.name == name and (run is None or r.run == run)
                and (rank is None or r.rank == rank)]

    def _free_gaps(self) -> list[tuple[int, int]]:
        gaps, pos = [], self.data_start
        used = sorted([(r.region_off, r._e.region_len) for r in self._regions] + list(self._reserved))
        for off, n in used:  # valid regions and the extents quarantined entries reserve
            if off > pos:
                gaps.append((pos, off - pos))
            pos = max(pos, off + n)
        if self.size > pos:
            gaps.append((pos, self.size - pos))
        return gaps

    def free_bytes(self) -> int:
        """Bytes of the data area not used by a valid region (not necessarily contiguous)."""
        return sum(n for _, n in self._free_gaps())

    @contextlib.contextmanager
    def locked(self, timeout: float = FLOCK_TIMEOUT) -> Iterator[None]:
        """Hold the device's exclusive flock (and this object's lock), waiting at most ``timeout`` s."""
        with self._lock:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise MemtierBusyError(
                            f"{self.path}: the device lock is held by {_flock_holder(self._fd)} for more than "
                            f"{timeout:.0f} s: wait for it to finish (a repack can take a while) or stop it") from None
                    time.sleep(0.01)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _need_writable(self) -> None:
        if not self.writable:
            raise MemtierError(f"{self.path} is open read-only: open it with writable=True to change it")

    def _flush(self, off: int, length: int) -> None:
        start = off // PAGE * PAGE
        self.mm.flush(start, _align(off + length) - start)

    def _set_state(self, no: int, state: int) -> None:
        off = self._entry_off(no)
        self.mm[off:off + 4] = _U32.pack(state)  # one aligned 4-byte store
        self._flush(off, 4)

    def _alloc(self, need: int) -> int | None:
        for off, n in self._free_gaps():
            if n >= need:
                return off
        return None

    def _layout(self, index_bytes: int, image_size: int, meta_cap: int, nslots: int) -> tuple[int, int, int]:
        """(slot_off - region_off, slot_stride, region_len) of a region."""
        slot_rel = _align(index_bytes + 4)
        stride = PAGE + meta_cap + _align(image_size)
        return slot_rel, stride, slot_rel + nslots * stride

    def register_shard(self, name: str, run: str, rank: int, world_size: int, *, index: dict[str, Any],
                       image_size: int, meta_cap: int | None = None, nslots: int = 2,
                       make_room: "Callable[[ShardRegion], bool] | None" = None) -> "ShardRegion":
        """Lay out a region for (``name``, ``run``, ``rank``): its MIndex (``index``, see
        :func:`make_index`) and ``nslots`` slots of ``image_size`` bytes (= ``index["file_size"]``)
        with ``meta_cap`` bytes for each version's manifest (default: :func:`manifest_capacity` of
        the index, enough for a world-1 model; an engine passes the capacity of its whole plan).
        Pre-faults the region. The same (name, run, rank) registered again with the same index
        returns the existing region. With ``make_room`` (a liveness rule such as
        :func:`default_live`), a region that does not fit first evicts finished models
        (:meth:`_evict_for`: never a live one; every job's newest version last). Raises
        :class:`MemtierFullError` (naming the bytes needed and free) when it does not fit."""
        self._need_writable()
        if _check_name(name):
            raise ValueError(_check_name(name))
        if not _RUN_RE.match(str(run)):
            raise ValueError(f"run {run!r} is not 16 hex digits (deepfreeze.run.new_run_id)")
        if not 1 <= nslots <= MAX_SLOTS:
            raise ValueError(f"nslots must be in [1, {MAX_SLOTS}], got {nslots}")
        why = _index_problem(index, None)
        if why is None and (index["name"], index["run"], index["rank"], index["world_size"]) != \
                (name, run, rank, world_size):
            why = "its name, run, rank or world size differ from the arguments"
        if why is None and index["file_size"] != image_size:
            why = f"its file_size {index['file_size']} differs from image_size {image_size}"
        if why:
            raise ValueError(f"invalid memory-tier index for {name!r} rank {rank}: {why}")
        if meta_cap is None:
            n_ids = len({t["tensor_id"] for t in index["tensors"]})
            meta_cap = manifest_capacity(n_ids, len(index["tensors"]), world_size)
        meta_cap = _align(meta_cap)
        data = json.dumps(index, sort_keys=True, separators=(",", ":")).encode("utf-8")
        if len(data) > MAX_INDEX_BYTES:
            raise ValueError(f"the index of {name!r} rank {rank} is {len(data)} bytes (at most {MAX_INDEX_BYTES})")
        slot_rel, stride, region_len = self._layout(len(data), image_size, meta_cap, nslots)
        with self.locked():
            self.refresh()
            for r in self._regions:
                if (r.name, r.run, r.rank) == (name, run, rank):
                    if r.index == json.loads(data) and r.nslots == nslots and r.meta_cap == meta_cap:
                        return r
                    raise MemtierError(f"{self.path}: {name!r} run {run} rank {rank} is already registered with "
                                       "another layout; a model of another shape needs another run id")
            off = self._alloc(region_len)
            if off is None and make_room is not None:
                self._evict_for(region_len, make_room, f"{name!r} rank {rank}")
                off = self._alloc(region_len)
            if off is None:
                gaps = self._free_gaps()
                largest = max((n for _, n in gaps), default=0)
                raise MemtierFullError(
                    f"{self.path}: no room for {name!r} rank {rank}: it needs {region_len} bytes ({nslots} slots of "
                    f"{stride} bytes + index), the device has {self.free_bytes()} bytes free ({largest} contiguous) "
                    f"of {self.size}. Run 'deepfreeze memtier repack {self.path}' to drop finished models, use "
                    "fewer slots, or create a bigger device")
            no = next((i for i in range(self.table_cap) if self._state(i) == FREE), None)
            if no is None:
                no = next((i for i in range(self.table_cap) if self._state(i) == RETIRED), None)
            if no is None:
                raise MemtierFullError(f"{self.path}: the model table is full ({self.table_cap} entries in use): "
                                       "create a new device (or a bigger table)")
            e = _Entry(no, WRITING, name, run, rank, world_size, nslots, off, region_len, off, len(data),
                       off + slot_rel, stride, meta_cap, image_size, time.time())
            mm = self.mm
            eoff = self._entry_off(no)
            self._set_state(no, WRITING)
            mm[eoff + 4:eoff + 4 + _BODY.size + 4] = e.pack_body()
            _touch(mm, off, region_len)
            mm[off:off + len(data) + 4] = data + _U32.pack(fmt.crc32(data))
            empty = _slot_header_bytes(SlotState.EMPTY, run, Version(0, 0), 0, 0, 0, 0.0)
            for k in range(nslots):
                so = e.slot_off + k * stride
                mm[so:so + len(empty)] = empty
            self._flush(off, region_len)
            self._flush(eoff, ENTRY_SIZE)
            cp.hit("memtier.table.valid")
            self._set_state(no, VALID)
            self.refresh()
            r = self.region(no)
            if r is not None:
                return r
            raise MemtierCorruptError(f"{self.path}: the entry just registered ({no}) does not read back valid: "
                                      f"{self.problems[:3]}")

    def retire(self, region: "ShardRegion") -> None:
        """Retire ``region`` (its entry goes RETIRED; its space is free for later registrations)."""
        self._need_writable()
        with self.locked():
            self._retire(region)
            self.refresh()

    def _retire(self, region: "ShardRegion") -> None:
        no = region.entry_no
        off = self._entry_off(no)
        if self._state(no) not in _LIVE_STATES or bytes(self.mm[off + 4:off + 4 + _BODY.size]) != region._e.body:
            raise MemtierError(f"{self.path}: entry {no} is no longer {region.name!r} rank {region.rank}: "
                               "someone else retired or replaced it")
        self._set_state(no, RETIRED)

    def finish(self, region: "ShardRegion") -> None:
        """Mark ``region``'s job finished (state FINISHED: still valid and restorable; repack may
        compact it). Used by :meth:`deepfreeze.memtier.api.Model.close`."""
        self._need_writable()
        with self.locked():
            no = region.entry_no
            off = self._entry_off(no)
            if self._state(no) == VALID and bytes(self.mm[off + 4:off + 4 + _BODY.size]) == region._e.body:
                self._set_state(no, FINISHED)
            self.refresh()

    # ---------------------------------------------------------------- capacity
    def _superseded(self, live: "Callable[[ShardRegion], bool]", name: str | None = None,
                    job: str | None = None) -> "list[list[ShardRegion]]":
        """:func:`~deepfreeze.memtier.jobs.superseded_runs` of this device's valid regions."""
        return _jobs.superseded_runs(self._regions, live, name=name, job=job)

    def reclaim(self, name: str, job: str, *, live: "Callable[[ShardRegion], bool] | None" = None) -> dict[str, int]:
        """Retire the regions of earlier runs of job ``job``'s ``name`` that a newer run of the job has
        superseded (:meth:`_superseded`): the engine calls this once its run has a DONE version in
        the tier. Returns ``{"retired", "freed_bytes"}``."""
        self._need_writable()
        retired = freed = 0
        with self.locked():
            self.refresh()
            for regions in self._superseded(live or default_live, name, job):
                for r in regions:
                    self._retire(r)
                    retired += 1
                    freed += r.region_len
                log.info("deepfreeze memtier: %s: run %s of %r reclaimed (%d region(s)): a newer run of its job has "
                         "a DONE version", self.path, regions[0].run, name, len(regions))
            self.refresh()
        return {"retired": retired, "freed_bytes": freed}

    def _evict_for(self, need: int, live: "Callable[[ShardRegion], bool]", what: str) -> int:
        """Under the lock: retire finished models (never a live one), a run at a time, until ``need``
        contiguous bytes are free. Order: runs whose job has a newer version elsewhere on the
        device first, then each job's newest version, oldest written first (so every job's newest
        version is kept as long as possible). Returns the bytes freed (0: nothing evictable)."""
        dead, order = _jobs.eviction_order(self._regions, live)
        freed, evicted = 0, []
        for n, run in order:
            if self._alloc(need) is not None:
                break
            for r in dead[(n, run)]:
                self._retire(r)
                freed += r.region_len
            evicted.append(f"{n!r} run {run}")
            self.refresh()
        if evicted:
            log.warning("deepfreeze memtier: %s full: evicted finished model(s) %s (%d bytes) to make room for %s",
                        self.path, ", ".join(evicted), freed, what)
        return freed

    def drop(self, name: str | None = None, *, run: str | None = None, job: str | None = None,
             entry: int | None = None, force: bool = False,
             live: "Callable[[ShardRegion], bool] | None" = None) -> dict[str, Any]:
        """Retire the regions of model ``name`` (only run ``run`` / job ``job`` when given), or the
        quarantined or valid entry ``entry``: ``deepfreeze memtier rm``. A live model (its run
        still holds its lease; a standalone model not closed whose owner runs) is refused with
        :class:`MemtierError` unless ``force``. Returns ``{"retired", "freed_bytes", "models"}``;
        :class:`~deepfreeze.errors.CheckpointNotFoundError` when nothing matches."""
        from ..errors import CheckpointNotFoundError
        self._need_writable()
        live = live or default_live
        with self.locked():
            self.refresh()
            if entry is not None:
                q = next((q for q in self.quarantined if q["entry"] == entry), None)
                r = self.region(entry)
                if q is None and r is None:
                    raise CheckpointNotFoundError(f"{self.path}: no valid or quarantined model-table entry {entry}")
                if r is not None and live(r) and not force:
                    raise MemtierError(f"{self.path}: entry {entry} ({r.name!r} run {r.run}) is live: stop its job "
                                       "first (or --force)")
                freed = r.region_len if r is not None else self._reserved_map.get(entry, (0, 0))[1]
                self._set_state(entry, RETIRED)
                self.refresh()
                return {"retired": 1, "freed_bytes": freed,
                        "models": [f"entry {entry}" + (f" ({r.name!r} run {r.run})" if r is not None else "")]}
            match = [r for r in self._regions if r.name == name and (run is None or r.run == run)]
            if job is not None and match:  # an id or a unique prefix: one that two jobs share drops nothing
                job = _jobs.pick_job([r.job or "unknown" for r in match], job, f"{self.path}: {name!r}")
                match = [r for r in match if (r.job or "unknown") == job]
            if not match:
                raise CheckpointNotFoundError(f"{self.path} holds no model {name!r}"
                                              + (f" of run {run}" if run else "") + (f" of job {job}" if job else "")
                                              + " ('deepfreeze memtier view' lists them)")
            busy = [r for r in match if live(r)]
            if busy and not force:
                raise MemtierError(f"{self.path}: {name!r} run(s) {', '.join(sorted({r.run for r in busy}))} are live "
                                   "(their job still runs): stop the job first, or pass --force (a live job then "
                                   "fails its next checkpoint into the tier)")
            for r in match:
                self._retire(r)
            self.refresh()
            return {"retired": len(match), "freed_bytes": sum(r.region_len for r in match),
                    "models": sorted({f"{r.name!r} run {r.run}" for r in match})}

    def repack(self, *, live: "Callable[[ShardRegion], bool] | None" = None) -> dict[str, int]:
        """Compact the device under its lock; returns ``{"retired", "moved", "freed_bytes"}``.

        Entries left WRITING by a crash are retired, and so are the regions of runs a newer run of
        the same job has superseded (:meth:`_superseded`). Regions for which ``live(region)`` is false
        (default :func:`default_live`: lease released or stale, standalone owner gone or model
        closed) keep only their newest valid DONE version: it is copied into slot 0 of a new
        one-slot region (registered WRITING, copied, msynced, flipped VALID), and only then is
        the old entry retired; a region without a valid DONE version is retired. A crash in
        between leaves two valid copies of one version (harmless: the next repack retires the
        extra one). Live regions are never touched (their ACTIVE slots are being written)."""
        self._need_writable()
        live = live or default_live
        retired = moved = freed = 0
        with self.locked():
            self.refresh()
            mm = self.mm
            for e in self._other:
                if e.state == WRITING:
                    self._set_state(e.entry_no, RETIRED)
                    retired += 1
            self.refresh()
            for regions in self._superseded(live):
                for r in regions:
                    self._retire(r)
                    retired += 1
                    freed += r.region_len
            self.refresh()
            dead = [r for r in self._regions if not live(r)]
            kept: dict[tuple[str, str, int], tuple[Version, ShardRegion]] = {}
            for r in sorted(dead, key=lambda r: (r.nslots != 1, r.entry_no)):  # compact copies first
                best = r.newest(verify=True)
                key = (r.name, r.run, r.rank)
                if best is None or (key in kept and kept[key][0] >= best[1].version):
                    self._retire(r)
                    retired += 1
                    freed += r._e.region_len
                    continue
                k, head = best
                if r.nslots == 1:
                    kept[key] = (head.version, r)
                    continue
                e = r._e
                slot_rel, stride, region_len = self._layout(e.index_len, e.image_size, e.meta_cap, 1)
                off = self._alloc(region_len)
                no = next((i for i in range(self.table_cap) if self._state(i) in (FREE, RETIRED)
                           and i != r.entry_no), None)
                if off is None or no is None:
                    log.warning("deepfreeze memtier repack: no room to compact %r rank %d (needs %d bytes): "
                                "left as is", r.name, r.rank, region_len)
                    kept[key] = (head.version, r)
                    continue
                ne = dataclasses.replace(e, entry_no=no, state=WRITING, nslots=1, region_off=off,
                                         region_len=region_len, index_off=off, slot_off=off + slot_rel,
                                         slot_stride=stride, created=time.time())
                eoff = self._entry_off(no)
                self._set_state(no, WRITING)
                mm[eoff + 4:eoff + 4 + _BODY.size + 4] = ne.pack_body()
                mm[off:off + e.index_len + 4] = mm[e.index_off:e.index_off + e.index_len + 4]
                src = e.slot_off + k * e.slot_stride
                n = PAGE + e.meta_cap + e.image_size
                mm[ne.slot_off:ne.slot_off + n] = mm[src:src + n]
                self._flush(off, region_len)
                self._flush(eoff, ENTRY_SIZE)
                cp.hit("memtier.table.valid")
                self._set_state(no, FINISHED)
                self._retire(r)
                retired += 1
                moved += 1
                freed += e.region_len - region_len
                self.refresh()
                new = next(x for x in self._regions if x.entry_no == no)
                kept[key] = (head.version, new)
            self.refresh()
        return {"retired": retired, "moved": moved, "freed_bytes": freed}


# --------------------------------------------------------------------------- regions and slots

def _slot_header_bytes(state: SlotState, run: str, version: Version, meta_len: int, image_len: int,
                       image_crc: int, written: float) -> bytes:
    raw = _SLOT.pack(SLOT_MAGIC, int(state), 0, run.encode("ascii"), version.generation, version.step,
                     meta_len, 0, image_len, image_crc, 0, written)
    return raw + _U32.pack(fmt.crc32(raw))


class ShardRegion:
    """One (model, run, rank) region of a device: its index and slots."""

    def __init__(self, device: Device, e: _Entry, index: dict[str, Any]) -> None:
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
            raise TypeError("version must be a deepfreeze.run.Version(generation, version number)")
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


# --------------------------------------------------------------------------- liveness and view

def _proc_start(pid: int) -> int | None:
    return _node.process_start(pid)


def owner_record() -> dict[str, Any]:
    """This process as the owner of a standalone model (pid, start time, boot id, node)."""
    return {"pid": os.getpid(), "start": _proc_start(os.getpid()) or 0, "boot": _node.boot_id(),
            "node": _node.node_id()}


def default_live(region: ShardRegion) -> bool:
    """Is ``region``'s job still running? FINISHED regions: no. Engine regions (index ``lease``):
    the run's lease on persistent is held by that run, not released and not older than its timeout
    (persistent unreachable: assumed live). Standalone regions: the owner process (pid, start time,
    boot) is alive. Anything else is assumed live (never compacted)."""
    if region.finished:
        return False
    idx = region.index
    lease = idx.get("lease")
    if lease:
        from ..lease import read_lease
        if not os.path.isdir(os.path.join(lease["persistent"], region.name)):
            return not os.path.isdir(lease["persistent"])  # reachable persistent without the name: not live
        try:
            got = read_lease(lease["persistent"], region.name)
        except OSError:
            return True
        if got is None:
            return False
        holder, mtime = got
        if _node.holder_gone(holder):  # its process provably no longer exists (run.py's rule)
            return False
        return holder.get("run") == region.run and not holder.get("released") \
            and time.time() - mtime <= float(lease["timeout"])
    owner = idx.get("owner")
    if owner:
        if owner["boot"] != _node.boot_id():
            return False  # the kernel rebooted since: its process is gone
        if isinstance(owner.get("node"), str) and owner["node"] != _node.node_id():
            return True  # another node on this kernel (its own pids): cannot be checked here
        return _proc_start(owner["pid"]) == owner["start"]
    return True


def view(path: str) -> dict[str, Any]:
    """A JSON-able description of the device: size, free bytes, problems found (damaged entries:
    ``quarantined``), and per model (name, run; its job; ``finished``: closed or its job over, by
    :func:`default_live`, i.e. not live) its shards with every slot's state, version, size and whether it is restorable
    (an ACTIVE slot never is; a DONE one only if its header checksum holds and its image verifies)."""
    with Device(path, writable=False, strict=False) as dev:
        models: dict[tuple[str, str], dict[str, Any]] = {}
        for r in dev.shards():
            # finished: closed (FINISHED), or its job is over (lease released / taken over / stale,
            # owner process gone): what repack may compact, the same rule (default_live)
            done = r.finished or not default_live(r)
            m = models.setdefault((r.name, r.run), {"name": r.name, "run": r.run, "job": r.job,
                                                   "world_size": r.world_size,
                                                   "standalone": bool(r.index.get("standalone")),
                                                   "finished": done, "shards": []})
            m["finished"] = m["finished"] and done
            slots = []
            for k in range(r.nslots):
                h = r.slot_header(k)
                if h is None:
                    slots.append({"slot": k, "state": "INVALID", "valid": False, "reason": "header checksum"})
                    continue
                s: dict[str, Any] = {"slot": k, "state": h.state.name, "generation": h.version.generation,
                                     "version": h.version.step, "written": h.written,
                                     "bytes": h.image_len if h.state == SlotState.DONE else 0}
                if h.state == SlotState.DONE:
                    why = r.verify_slot(k, h) if h.run == r.run else "another run's"
                    s["valid"] = why is None
                    if why:
                        s["reason"] = why
                    else:
                        with contextlib.suppress(MemtierCorruptError):
                            s["step"] = r.manifest(k, h).get("step")
                else:
                    s["valid"] = False
                    s["reason"] = "being written or interrupted" if h.state == SlotState.ACTIVE else "empty"
                slots.append(s)
            newest = max((s for s in slots if s["valid"]), key=lambda s: (s["generation"], s["version"]), default=None)
            m["shards"].append({"rank": r.rank, "entry": r.entry_no, "region_off": r.region_off,
                                "region_bytes": r.region_len, "image_bytes": r.image_size,
                                "tensors": len(r.entries), "slots": slots,
                                "newest": None if newest is None else
                                {"generation": newest["generation"], "version": newest["version"]}})
        return {"path": dev.path, "size": dev.size, "free": dev.free_bytes(), "table_cap": dev.table_cap,
                "created": dev.created, "problems": list(dev.problems), "quarantined": list(dev.quarantined),
                "models": list(models.values())}
