"""On-disk formats: the binary shard file and the JSON manifest.

Shard file (one per rank and version on scratch; the assembled file on
persistent uses the same layout with ``kind = ASSEMBLED``). Little-endian::

    header (72 bytes; 64 in format version 1, which has no run id and stays readable)
      magic        8s   b"DEEPFRZ\\0"
      version      u16  FORMAT_VERSION (2; 1 is read too)
      kind         u16  1 = shard, 2 = assembled
      flags        u32  bit 0: piece checksums present
      rank         u32  writer's rank (0 for assembled)
      world_size   u32
      ckpt_version u64  checkpoint version number
      n_entries    u32
      index_bytes  u32
      data_offset  u64  start of the data region (4096-aligned)
      file_size    u64  exact expected size of the file
      run_id       8s   id of the run that wrote the file (format version 2 only; run.py)
      index_crc    u32  CRC32 of the index bytes
      header_crc   u32  CRC32 of the header bytes before it
    index: n_entries entries of 48 + 8*ndim bytes
      tensor_id u32, dtype u8, ndim u8, pad u16,
      start u64, stop u64        flat element range [start, stop) of the tensor
      offset u64, length u64     where its bytes are, from the file start
      crc u32, pad u32           CRC32 of the bytes (0 unless flag bit 0)
      shape ndim x u64           full shape of the tensor
    data: raw C-order bytes of each piece (no labels, no pickle)

Names, the shard plan and the step live in the manifest (JSON, never pickle),
so the data path carries no per-tensor labels. Every size and offset read
from disk is bounds-checked against the file size before use; any violation
raises :class:`~deepfreeze.errors.CorruptCheckpointError`. One tensor (or one
piece) can be read alone: the index gives its offset and length.

Manifest limits (enforced by :func:`decode_manifest`; a manifest beyond them is
"not a valid manifest", i.e. the version is not committed there, never a crash):

* size: at most ``MAX_MANIFEST_BYTES`` (64 MiB) before it is parsed, and after
  parsing at most 64 KiB + 2 KiB per tensor + 128 bytes per item the plan record
  lists + 1 KiB per rank (:func:`manifest_size_limit`; the items: every piece of an
  older record, the explicit pieces and half the given bounds of a compact one,
  :func:`plan_items`; what DeepFreeze writes stays far below: :func:`encode_manifest`
  refuses to write a manifest beyond it). A compact plan record keeps a manifest
  O(T + N) (docs/cluster.md, "At 1000 nodes");
* a compact plan record derives at most ``MAX_ENTRIES`` (2**22) pieces, counted before
  any is made (:meth:`deepfreeze.shardplan.ShardPlan.from_json`);
* nesting depth at most ``MAX_JSON_DEPTH`` (32) arrays/objects;
* integers below 2**63 in magnitude: a number of more than 20 digits is refused
  before it is converted (Python's ``int()`` of a long digit string is
  quadratic), and so are ``NaN``/``Infinity`` and floats of more than 64 characters;
* every tensor at most 2**48 elements, at most ``MAX_NDIM`` dimensions;
* the decode is linear in the size: one pass of the C JSON parser with the
  hooks above, schema checks linear in the number of tensors, pieces and ranks,
  the size limit (deriving a compact plan's pieces, :func:`deepfreeze.tiers.base.plan_of`, is
  O(T log N + pieces)); the nesting depth is counted over the bytes before parsing
  (:func:`deepfreeze.jsonsafe.json_depth`, linear, C speed).

Why these limits: a manifest is read from a directory anyone with write access to the level
could have planted a file in. A parsed manifest costs about 25 times its size in memory (hence
the cap before parsing); what DeepFreeze writes takes about 200 bytes per tensor, 50 per listed
piece and 100 per rank (far below the limit after parsing); Python's parser recurses (hence the
depth); ``int()`` of a long digit string is quadratic and refused above 4300 digits (the
integer hook runs only when a run of 19+ digits occurs). The world size must be 1 to 2**20
ranks. A manifest beyond a limit is *invalid*: the version is not committed at that place
(restore tries the next level or version, retention leaves the directory alone, the command
reports it ``damaged`` in one line); no exception other than ``CorruptCheckpointError`` leaves
the decoder, whatever the bytes. A decoded manifest is not yet trusted for sizes: before
allocating its output arrays, restore checks that the tensors it declares fit in the files they
are read from (the assembled file's size; the shard files' total), so a manifest declaring a
4 TiB tensor is a ``CorruptCheckpointError`` and a fallback, not numpy's ``MemoryError``.
Every checkpoint file is opened with :func:`deepfreeze.fsafe.open_regular` (no FIFO wait, no
symlink followed; a file removed between listing and opening is a missing source).

Checksums and dtypes. Every checksum is zlib's CRC32 (:func:`crc32`), computed with ISA-L (the
``isal`` package, a dependency: about 17 GB/s against zlib's 2.2 GB/s on the test machine, the
same values); without it zlib's is used, and files stay compatible either way. The dtypes are
those of :data:`DTYPES`: float16/32/64, bfloat16 (``ml_dtypes``, imported only for bfloat16
tensors), signed and unsigned 8-64-bit integers, bool, complex64/128.

Pieces. In a shard file each piece starts at a ``PIECE_ALIGN`` (64-byte) aligned offset. In the
assembled file (``layout(..., contiguous_tensors=True)``) consecutive pieces of one tensor are
packed back to back, so a whole tensor is one contiguous byte range (each tensor starts 64-byte
aligned, and every piece lands with one positional write); tensors split among ranks come first,
then each rank's whole tensors together (``deepfreeze.tiers.shardbytes.assembled_order``: one
write for a rank's small tensors); it has exactly one index entry per piece of the plan, in plan
order (the offsets need not ascend: readers take them from the index), and ``rank = 0``, ``world_size = 1`` in its header. One tensor or piece is read
alone with :func:`read_index` then :func:`read_entry` (``deepfreeze.load(..., tensors=[...])``).

Manifest keys (``manifest.json``, built by ``build_manifest``, decoded by :func:`decode_manifest`
with a strict schema): ``format``, ``format_version``, ``run`` (``id``, ``generation``,
``resumed_from``: :func:`manifest_run`), ``name``, ``version``, ``step``, ``epoch``,
``world_size``, ``tensors`` (id, name, dtype, shape), ``plan`` (the shard plan record of
:meth:`deepfreeze.shardplan.ShardPlan.to_json`: in format version 3 a compact record, the plan
algorithm id ``"algorithm": "flat-v1"`` and its parameters ``world_size``, ``min_shard_bytes``,
``pinned``, ``given`` (FSDP2's bounds) plus the ``explicit`` pieces no rule derives, from which
a reader derives the pieces; in versions 1 and 2 every piece, ``"pieces": [[tensor id, rank,
start, stop], ...]``, still read; validated on read either way: the pieces must tile every
tensor; an unknown algorithm id is refused as written by a newer DeepFreeze), ``shards`` (per rank: file name, failure domain, bytes),
``total_bytes``. Optional: ``model_tensors`` (how many leading tensors are model weights, the rest
optimizer state; a manifest without it is weights only), ``epoch_step`` (the step within the
epoch after the checkpointed batch) and ``epoch_complete`` (whether that was the epoch's last
step; false when Keras did not know the epoch's length), ``layers`` (``{"graph": the compact
layer graph of docs/repository.md, "tensors": the tensor id of each layer weight}``: lets
``deepfreeze repo import`` make a repository model without the model at hand), ``framework``
(``"torch"`` for the PyTorch adapter), ``parent`` (the checkpoint a clone was forked from:
:func:`parent_problem`), ``redundancy`` (the partner or XOR plan the version was protected with,
:mod:`deepfreeze.redundancy`, identical on every rank). On persistent the committing node adds
``assembled`` (file, bytes, whether checksums are present) and ``committed`` (time of the commit).
None of the scratch manifest's keys depends on the writing rank or the time, and
:func:`encode_manifest` sorts the keys, so the scratch manifest has the same bytes on every rank.
File names in a manifest are plain names, never paths.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import os
import re
import struct
import zlib
from typing import Any, BinaryIO, Sequence

import numpy as np

from .errors import CorruptCheckpointError
from .jsonsafe import json_depth, loads as _bounded_loads

__all__ = [
    "MAGIC", "FORMAT_VERSION", "KIND_SHARD", "KIND_ASSEMBLED", "Entry", "ShardIndex",
    "DTYPES", "dtype_itemsize", "numpy_dtype", "dtype_name", "layout", "encode_index",
    "read_index", "read_entry", "crc32", "crc32_bytes", "encode_manifest", "decode_manifest", "MAX_MANIFEST_BYTES",
    "manifest_run", "run_id_bytes", "manifest_size_limit", "parent_problem", "manifest_parent",
    "build_manifest", "ANONYMOUS_RUN", "json_hooks", "ITEMSIZE", "plan_items", "MAX_ENTRIES",
    "encode_crcs", "decode_crcs", "crc_record_ok",
]

MAGIC = b"DEEPFRZ\0"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_VERSIONS = (1, 2, 3)  # 3: the compact plan record (shardplan.py); 2 and 1 list every piece
KIND_SHARD = 1
KIND_ASSEMBLED = 2
FLAG_CRC = 1
_HEADER_V1 = struct.Struct("<8sHHIIIQIIQQII")
assert _HEADER_V1.size == 64
_HEADER = struct.Struct("<8sHHIIIQIIQQ8sII")
assert _HEADER.size == 72
RUN_ID_BYTES = 8
_ENTRY = struct.Struct("<IBBHQQQQII")
assert _ENTRY.size == 48
DATA_ALIGN = 4096
PIECE_ALIGN = 64
MAX_NDIM = 32
_DIMS = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]  # an entry's shape, by its number of dims
MAX_ENTRIES = 1 << 22
MAX_MANIFEST_BYTES = 64 << 20  # hard cap before parsing (a parsed manifest costs ~25x its size in memory)
MAX_TENSOR_ELEMENTS = 1 << 48
_MANIFEST_BASE, _PER_TENSOR, _PER_PIECE, _PER_RANK = 64 << 10, 2 << 10, 128, 1 << 10
_MAX_INT_DIGITS = 20  # 2**63 has 19 digits; a sign makes 20 characters

# dtype code <-> name; names are numpy's (bfloat16 via ml_dtypes, which TF ships)
DTYPES: dict[int, str] = {
    1: "float32", 2: "float64", 3: "float16", 4: "bfloat16",
    5: "int8", 6: "int16", 7: "int32", 8: "int64",
    9: "uint8", 10: "uint16", 11: "uint32", 12: "uint64",
    13: "bool", 14: "complex64", 15: "complex128",
}
_CODES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "int16": 2,
             "int32": 4, "int64": 8, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
             "bool": 1, "complex64": 8, "complex128": 16}


def dtype_itemsize(name: str) -> int:
    try:
        return ITEMSIZE[name]
    except KeyError:
        raise CorruptCheckpointError(f"unsupported dtype {name!r}; supported: {sorted(ITEMSIZE)}") from None


def numpy_dtype(name: str) -> np.dtype:
    dtype_itemsize(name)
    if name == "bfloat16":
        import ml_dtypes  # shipped with TensorFlow; only needed for bfloat16 tensors
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def dtype_name(dtype: Any) -> str:
    name = np.dtype(dtype).name
    dtype_itemsize(name)
    return name


def byte_view(buf: Any) -> memoryview:
    """A flat byte view of a buffer without copying (numpy arrays of any dtype, bfloat16 included,
    whose dtype the buffer protocol cannot describe)."""
    if isinstance(buf, np.ndarray):
        return memoryview(np.ascontiguousarray(buf).reshape(-1).view(np.uint8))
    return memoryview(buf).cast("B")


try:  # ISA-L's CRC32 (same polynomial and values as zlib's, ~8x faster: 17 vs 2.2 GB/s here)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal has wheels for the usual platforms; zlib is the fallback
    _crc32 = zlib.crc32


def crc32(buf: Any, value: int = 0) -> int:
    """CRC32 (zlib's) of a buffer; both implementations release the GIL on large buffers."""
    return _crc32(byte_view(buf), value) & 0xFFFFFFFF


def crc32_bytes(view: "memoryview | bytes", value: int = 0) -> int:
    """:func:`crc32` of a flat byte buffer (a ``"B"`` memoryview or bytes) as it is: no view
    conversion, for callers that checksum thousands of small pieces of one buffer."""
    return _crc32(view, value) & 0xFFFFFFFF


#: a CRC record's text: base64 (standard alphabet, padded)
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}\Z")


def encode_crcs(crcs: "Sequence[int] | np.ndarray") -> str:
    """One rank's piece CRCs (in plan order) as one record: the base64 text of little-endian
    uint32s. What write once hands the flush (the job's ``direct``) and what a done marker holds:
    one string, decoded and checked once (:func:`decode_crcs`), not a JSON list per piece."""
    return base64.b64encode(np.asarray(crcs, dtype="<u4").tobytes()).decode("ascii")


def crc_record_ok(text: Any, max_count: int = MAX_ENTRIES) -> bool:
    """Whether ``text`` has the shape of a CRC record (:func:`encode_crcs`) of at most
    ``max_count`` CRCs; its count is checked against the plan by :func:`decode_crcs`."""
    return (type(text) is str and len(text) % 4 == 0 and len(text) <= 4 * -(-4 * max_count // 3)
            and _BASE64.match(text) is not None)


def decode_crcs(text: Any, count: int) -> "np.ndarray | None":
    """The ``count`` CRCs of a record (:func:`encode_crcs`) as a read-only uint32 array; None if
    ``text`` is not a record of exactly ``count`` CRCs (the length is checked before decoding)."""
    if type(text) is not str or len(text) != 4 * -(-4 * count // 3):
        return None
    try:
        raw = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError):
        return None
    if len(raw) != 4 * count:
        return None
    return np.frombuffer(raw, dtype="<u4")


@dataclasses.dataclass(frozen=True)
class Entry:
    tensor_id: int
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int
    offset: int = 0
    length: int = 0
    crc: int = 0

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * dtype_itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class ShardIndex:
    kind: int
    rank: int
    world_size: int
    version: int
    has_crc: bool
    data_offset: int
    file_size: int
    entries: tuple[Entry, ...]
    run: str = ""  #: hex id of the run that wrote it ("" for format version 1 files)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def index_data_offset(entries: Sequence[Entry]) -> int:
    """Where the data region of a file of ``entries`` starts: after the header and index, aligned."""
    return _align(_HEADER.size + sum(_ENTRY.size + 8 * len(e.shape) for e in entries), DATA_ALIGN)


def layout(entries: Sequence[Entry], *, contiguous_tensors: bool = False) -> tuple[list[Entry], int, int]:
    """Assign offsets to ``entries`` (in order). Returns (entries, data_offset, file_size).

    With ``contiguous_tensors`` (assembled files), consecutive pieces of one tensor
    are packed back to back so the whole tensor is one contiguous byte range.
    """
    data_offset = index_data_offset(entries)
    pos = data_offset
    out = []
    prev: Entry | None = None
    size = ITEMSIZE
    for e in entries:  # (Entry(...), not dataclasses.replace: 5x less CPU for 1000s of pieces)
        if not (contiguous_tensors and prev is not None and prev.tensor_id == e.tensor_id
                and prev.stop == e.start):
            pos = -(-pos // PIECE_ALIGN) * PIECE_ALIGN
        n = (e.stop - e.start) * size[e.dtype] if e.dtype in size else e.nbytes
        out.append(Entry(e.tensor_id, e.dtype, e.shape, e.start, e.stop, pos, n, e.crc))
        pos += n
        prev = e
    return out, data_offset, pos


def run_id_bytes(run: str) -> bytes:
    """The 8 header bytes of a run id (16 hex digits, :func:`deepfreeze.lease.new_run_id`)."""
    try:
        raw = bytes.fromhex(run)
    except (ValueError, TypeError):
        raw = b""
    if len(raw) != RUN_ID_BYTES:
        raise ValueError(f"run id {run!r} is not {2 * RUN_ID_BYTES} hex digits")
    return raw


def encode_index(kind: int, rank: int, world_size: int, version: int, entries: Sequence[Entry],
                 data_offset: int, file_size: int, has_crc: bool, run: str,
                 crcs: "Sequence[int] | None" = None) -> bytes:
    """Header + index bytes (to be written at offset 0, padded up to ``data_offset``);
    ``run`` is the writing run's id. ``crcs``: the entries' CRCs, in their order, instead of
    each entry's ``crc`` (no new :class:`Entry` per piece: ``dataclasses.replace`` of thousands of
    small pieces cost more than their write)."""
    parts = []
    pack, code = _ENTRY.pack, _CODES
    for k, e in enumerate(entries):
        nd = len(e.shape)
        if nd > MAX_NDIM:
            raise ValueError(f"tensor {e.tensor_id} has {nd} dims; at most {MAX_NDIM} supported")
        parts.append(pack(e.tensor_id, code[e.dtype], nd, 0, e.start, e.stop, e.offset, e.length,
                          e.crc if crcs is None else crcs[k], 0))
        parts.append(_DIMS[nd].pack(*e.shape))
    index = b"".join(parts)
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, kind, FLAG_CRC if has_crc else 0, rank, world_size,
                        version, len(entries), len(index), data_offset, file_size, run_id_bytes(run),
                        crc32(index), 0)
    head = head[:-4] + struct.pack("<I", crc32(head[:-4]))
    return head + index


def read_index(f: "BinaryIO | bytes | memoryview | np.ndarray", path: str = "<file>") -> ShardIndex:
    """Read and validate the header and index of an open shard/assembled file, or of its
    bytes held in memory (a partner copy received over the network)."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: not a valid DeepFreeze file: {why}. The file is damaged "
                                      "or not DeepFreeze's; restore falls back to another level or version.")
    if isinstance(f, (bytes, bytearray, memoryview, np.ndarray)):
        mem = byte_view(f)
        size = len(mem)

        def read(off: int, n: int) -> bytes:
            return bytes(mem[off:off + n])
    else:
        size = os.fstat(f.fileno()).st_size

        def read(off: int, n: int) -> bytes:
            f.seek(off)
            return f.read(n)
    raw = read(0, _HEADER.size)
    if len(raw) < _HEADER_V1.size:
        raise bad(f"{size} bytes, shorter than the {_HEADER_V1.size}-byte header")
    if raw[:8] != MAGIC:
        raise bad(f"wrong magic {raw[:8]!r}")
    fver = struct.unpack_from("<H", raw, 8)[0]
    if fver not in READABLE_VERSIONS:
        raise bad(f"format version {fver}, this DeepFreeze reads {list(READABLE_VERSIONS)}: upgrade DeepFreeze")
    header = _HEADER if fver == 2 else _HEADER_V1
    if len(raw) < header.size:
        raise bad(f"{size} bytes, shorter than the {header.size}-byte header")
    raw = raw[:header.size]
    fields = header.unpack(raw)
    (magic, fver, kind, flags, rank, world, version, n, index_bytes, data_offset, file_size) = fields[:11]
    run = fields[11].hex() if fver == 2 else ""
    index_crc, header_crc = fields[-2:]
    if magic != MAGIC:
        raise bad(f"wrong magic {magic!r}")
    if crc32(raw[:-4]) != header_crc:
        raise bad("header checksum mismatch")
    if kind not in (KIND_SHARD, KIND_ASSEMBLED) or not 1 <= world <= 1 << 20 or rank >= world:
        raise bad(f"kind {kind}, rank {rank}, world size {world} out of range")
    if n > MAX_ENTRIES or index_bytes > n * (_ENTRY.size + 8 * MAX_NDIM) or index_bytes < n * _ENTRY.size:
        raise bad(f"{n} entries in {index_bytes} index bytes is impossible")
    if file_size != size:
        raise bad(f"size is {size} bytes, the header says {file_size} (truncated or padded)")
    if not header.size + index_bytes <= data_offset <= file_size:
        raise bad(f"data offset {data_offset} outside the file")
    index = read(header.size, index_bytes)
    if len(index) != index_bytes or crc32(index) != index_crc:
        raise bad("index checksum mismatch")
    entries = []
    pos = 0
    for i in range(n):
        if pos + _ENTRY.size > index_bytes:
            raise bad(f"entry {i} runs past the index")
        tid, code, ndim, _, start, stop, off, length, crc, _ = _ENTRY.unpack_from(index, pos)
        pos += _ENTRY.size
        if code not in DTYPES or ndim > MAX_NDIM or pos + 8 * ndim > index_bytes:
            raise bad(f"entry {i}: dtype code {code} or ndim {ndim} invalid")
        shape = struct.unpack_from(f"<{ndim}Q", index, pos)
        pos += 8 * ndim
        dtype = DTYPES[code]
        if any(d > 1 << 48 for d in shape):
            raise bad(f"entry {i}: absurd shape {shape}")
        total = math.prod(shape)
        if not start <= stop <= total or length != (stop - start) * ITEMSIZE[dtype] \
                or not data_offset <= off or off + length > file_size:
            raise bad(f"entry {i} (tensor {tid}): range [{start},{stop}) of {total}, bytes "
                      f"[{off},{off + length}) do not fit the tensor or the file")
        entries.append(Entry(tid, dtype, tuple(shape), start, stop, off, length, crc))
    if pos != index_bytes:
        raise bad("index has trailing bytes")
    return ShardIndex(kind, rank, world, version, bool(flags & FLAG_CRC), data_offset, file_size,
                      tuple(entries), run)


def read_entry(f: BinaryIO, entry: Entry, out: np.ndarray | None = None, *, verify: bool = True,
               path: str = "<file>") -> np.ndarray:
    """Read one piece's bytes into ``out`` (a flat array of ``entry`` dtype) or a new array."""
    dtype = numpy_dtype(entry.dtype)
    count = entry.stop - entry.start
    if out is None:
        out = np.empty(count, dtype=dtype)
    if out.dtype != dtype or out.size != count or not out.flags.c_contiguous:
        raise ValueError("output buffer does not match the entry")
    view = memoryview(out.reshape(-1).view(np.uint8))
    got = os.preadv(f.fileno(), [view], entry.offset) if entry.length else 0
    while got < entry.length:  # preadv may return short reads
        n = os.preadv(f.fileno(), [view[got:]], entry.offset + got)
        if n <= 0:
            raise CorruptCheckpointError(f"{path}: unexpected end of file in tensor {entry.tensor_id}")
        got += n
    if verify and crc32(view) != entry.crc:
        raise CorruptCheckpointError(
            f"{path}: checksum mismatch in tensor {entry.tensor_id} elements [{entry.start},{entry.stop}): "
            "the data was damaged after it was written")
    return out


def entry_view(buf: Any, entry: Entry, *, verify: bool = True, path: str = "<memory>") -> np.ndarray:
    """One piece of an in-memory file (checked by :func:`read_index`) as a flat array view."""
    mem = byte_view(buf)[entry.offset:entry.offset + entry.length]
    if len(mem) != entry.length:
        raise CorruptCheckpointError(f"{path}: tensor {entry.tensor_id} runs past the end of the data")
    if verify and crc32(mem) != entry.crc:
        raise CorruptCheckpointError(
            f"{path}: checksum mismatch in tensor {entry.tensor_id} elements [{entry.start},{entry.stop}): "
            "the data was damaged after it was written")
    return np.frombuffer(mem, dtype=numpy_dtype(entry.dtype))


# --------------------------------------------------------------------------- manifest

_FILE_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_RUN_RE = re.compile(r"^[0-9a-f]{16}$")


_PARENT_NAME_RE = re.compile(r"^[A-Za-z0-9_.]{1,200}$")  # a checkpoint name (config.validate_name)


def parent_problem(parent: Any) -> str | None:
    """What is wrong with a clone's ``parent`` record (None: it is valid). A valid record is
    ``{"name": checkpoint name or None, "run": 16 hex digits, "" or None, "step": int >= 0}``
    and nothing else: the source checkpoint a clone was forked from (``"parent"`` in a
    manifest, ``model._deepfreeze_parent`` on a cloned model)."""
    if not isinstance(parent, dict):
        return f"not an object but {type(parent).__name__}"
    extra = sorted(str(k)[:40] for k in parent if k not in ("name", "run", "step"))
    if extra:
        return f"unknown key(s) {extra[:5]} (allowed: name, run, step)"
    name, run, step = parent.get("name"), parent.get("run"), parent.get("step")
    if not (name is None or (isinstance(name, str) and _PARENT_NAME_RE.match(name) and name not in (".", ".."))):
        return "'name' is not a checkpoint name (letters, digits, '_', '.'; at most 200 characters) or null"
    if not (run is None or (isinstance(run, str) and (run == "" or _RUN_RE.match(run)))):
        return "'run' is not a run id (16 hex digits), '' or null"
    if not (type(step) is int and 0 <= step < 1 << 62):
        return "'step' is not an integer in [0, 2**62)"
    return None


def manifest_parent(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The ``parent`` record of a decoded manifest (``{"name", "run", "step"}``: the checkpoint
    a clone was forked from), or None for a model that was not cloned."""
    parent = manifest.get("parent")
    return dict(parent) if isinstance(parent, dict) else None


def manifest_run(manifest: dict[str, Any]) -> tuple[str, int, int | None]:
    """(run id, generation, resumed-from step) of a decoded manifest; ("", 0, None) for a
    format-version-1 manifest, written before runs had ids."""
    run = manifest.get("run") or {}
    return run.get("id", ""), run.get("generation", 0), run.get("resumed_from")


def plan_items(plan: Any) -> int:
    """How many items a manifest's plan record lists, what :func:`manifest_size_limit` allows 128
    bytes for: every piece of an older record (``pieces``); the ``explicit`` pieces plus half the
    ``given`` bounds of a compact one (a bound takes about 20 bytes as written). 0 for anything
    that is not a plan record (its validation, :func:`deepfreeze.tiers.base.plan_of`, says why)."""
    if not isinstance(plan, dict):
        return 0
    if "algorithm" not in plan:
        pieces = plan.get("pieces")
        return len(pieces) if isinstance(pieces, list) else 0
    explicit, given = plan.get("explicit"), plan.get("given")
    n = len(explicit) if isinstance(explicit, list) else 0
    if isinstance(given, list):
        n += sum((len(g) + 1) // 2 for g in given if isinstance(g, list))
    return n


def manifest_size_limit(n_tensors: int, n_pieces: int, world_size: int) -> int:
    """The largest manifest (bytes) accepted for a checkpoint of this shape (see the module docstring):
    ``n_pieces`` is the number of items its plan record lists (:func:`plan_items`)."""
    return min(MAX_MANIFEST_BYTES,
               _MANIFEST_BASE + _PER_TENSOR * n_tensors + _PER_PIECE * n_pieces + _PER_RANK * world_size)


def encode_manifest(obj: dict[str, Any]) -> bytes:
    """The manifest's bytes: compact JSON, keys sorted (the same bytes on every rank). Not indented:
    ``json.dumps`` with ``indent`` runs the pure-Python encoder, about 5x the CPU of the C one
    (42 against 9 ms for a 3000-tensor manifest); ``deepfreeze inspect`` shows it to people."""
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")
    limit = manifest_size_limit(len(obj.get("tensors", ())), plan_items(obj.get("plan")),
                                int(obj.get("world_size", 1)))
    if len(data) > limit:  # never write a manifest restore would refuse
        raise ValueError(f"the manifest of {obj.get('name')!r} v{obj.get('version')} would be {len(data)} bytes, "
                         f"above the {limit}-byte limit for its tensors, pieces and ranks (tensor names "
                         "too long?): see 'Manifest limits' in the docstring of deepfreeze/format.py")
    return data


class _Refused(Exception):
    """Raised by the JSON hooks: a token beyond the manifest limits."""


def _parse_int(s: str) -> int:
    if len(s) > _MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(s)} digits (the limit is below 2**63)")
    v = int(s)
    if not -(1 << 63) < v < 1 << 63:
        raise _Refused(f"integer {v} is not below 2**63 in magnitude")
    return v


def _parse_float(s: str) -> float:
    if len(s) > 64:
        raise _Refused(f"a number of {len(s)} characters")
    return float(s)


def _parse_constant(s: str) -> Any:
    raise _Refused(f"{s} is not a JSON number")


_DIGITS_TO_0 = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_19_ZEROS = b"0" * 19
_json_depth = json_depth  # the name memtier/device.py used


def json_hooks(data: bytes) -> dict[str, Any]:
    """The parser hooks of a manifest's JSON (for :func:`deepfreeze.jsonsafe.loads`): no NaN or
    infinity, long integers converted with checks. Used for every JSON DeepFreeze keeps beside
    tensors (manifests; the memory tier's entries)."""
    hooks: dict[str, Any] = {"parse_float": _parse_float, "parse_constant": _parse_constant}
    # 19 digits in a row, found by a translation (digits to "0", the rest to " ") and a substring
    # search: both C loops, ~10x faster than the regular expression's search on a large manifest
    if _19_ZEROS in bytes(data).translate(_DIGITS_TO_0):  # 19+ digits (or digits in names): ints checked
        hooks["parse_int"] = _parse_int  # (the fast path's ints have at most 18 digits: below 2**63)
    return hooks


def decode_manifest(data: bytes, path: str = "<manifest>") -> dict[str, Any]:
    """Parse and validate a manifest (JSON, strict schema, the limits of the module docstring).

    Any problem, whatever the input, raises :class:`CorruptCheckpointError` (never
    another exception): the caller treats the version as not committed there."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: invalid DeepFreeze manifest: {why}")
    data = bytes(data)
    hooks = json_hooks(data)
    # size, then nesting depth (a linear scan), checked before the parser runs; any refusal says "invalid"
    obj = _bounded_loads(data, f"{path}: invalid DeepFreeze manifest", max_bytes=MAX_MANIFEST_BYTES, hooks=hooks,
                         advice="the version is not committed in this place (restore falls back to another "
                                "level or version)")
    try:
        obj = _check_manifest(obj, bad)
    except CorruptCheckpointError:
        raise
    except Exception as e:  # a schema check tripping on an unexpected type: still just "invalid"
        raise bad(f"malformed ({type(e).__name__}: {e})") from e
    limit = manifest_size_limit(len(obj["tensors"]), plan_items(obj["plan"]), obj["world_size"])
    if len(data) > limit:
        raise bad(f"{len(data)} bytes is larger than the {limit}-byte limit for {len(obj['tensors'])} tensors "
                  f"and {obj['world_size']} ranks (64 KiB + 2 KiB per tensor + 128 bytes per item the plan "
                  "record lists + 1 KiB per rank)")
    return obj


def _check_manifest(obj: Any, bad: Any) -> dict[str, Any]:
    if not isinstance(obj, dict) or obj.get("format") != "deepfreeze-manifest":
        raise bad("'format' is not 'deepfreeze-manifest'")
    if obj.get("format_version") not in MANIFEST_VERSIONS:
        raise bad(f"format_version {obj.get('format_version')!r}, this DeepFreeze reads {list(MANIFEST_VERSIONS)}")
    run = obj.get("run")
    if obj["format_version"] >= 2 and not (
            isinstance(run, dict) and isinstance(run.get("id"), str) and _RUN_RE.match(run["id"])
            and type(run.get("generation", 0)) is int and 0 <= run.get("generation", 0) < 1 << 62
            and (run.get("resumed_from") is None or (type(run["resumed_from"]) is int
                                                     and 0 <= run["resumed_from"] < 1 << 62))):
        raise bad("'run' malformed (an object with a 16-hex-digit 'id', 'generation' and 'resumed_from')")
    for key, typ in (("name", str), ("version", int), ("step", int), ("epoch", int),
                     ("world_size", int), ("tensors", list), ("plan", dict), ("shards", list)):
        if not isinstance(obj.get(key), typ) or isinstance(obj.get(key), bool):
            raise bad(f"'{key}' missing or not {typ.__name__}")
    if not 1 <= obj["world_size"] <= 1 << 20:
        raise bad(f"world_size {obj['world_size']} out of range [1, 2**20]")
    names = set()
    for i, t in enumerate(obj["tensors"]):
        if not (isinstance(t, dict) and t.get("id") == i and isinstance(t.get("name"), str)
                and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list)
                and len(t["shape"]) <= MAX_NDIM
                and all(type(d) is int and 0 <= d <= 1 << 48 for d in t["shape"])
                and math.prod(t["shape"]) <= MAX_TENSOR_ELEMENTS):
            raise bad(f"tensor entry {i} malformed (id, name, dtype, or a shape of at most {MAX_NDIM} "
                      "dimensions and 2**48 elements)")
        if t["dtype"] not in ITEMSIZE:
            raise bad(f"tensor {t['name']!r} has unsupported dtype {t['dtype']!r}")
        if t["name"] in names:
            raise bad(f"duplicate tensor name {t['name']!r}")
        names.add(t["name"])
    for s in obj["shards"]:
        if not (isinstance(s, dict) and type(s.get("rank")) is int and isinstance(s.get("file"), str)
                and _FILE_RE.match(s["file"]) and s["file"] not in (".", "..")):
            raise bad(f"shard entry {s!r} malformed (file names must be plain names, no paths)")
    asm = obj.get("assembled")
    if asm is not None and not (isinstance(asm, dict) and isinstance(asm.get("file"), str)
                                and _FILE_RE.match(asm["file"]) and asm["file"] not in (".", "..")):
        raise bad("'assembled' malformed (file names must be plain names, no paths)")
    red = obj.get("redundancy")
    if red is not None and not _valid_redundancy(red, obj["world_size"]):
        raise bad("'redundancy' malformed (scheme partner with holder ranks, or xor with disjoint groups "
                  "of at least 2 ranks, all below world_size)")
    # optional keys the readers use: their documented types (a wrong type would surface later as a raw error)
    mt = obj.get("model_tensors", len(obj["tensors"]))
    if type(mt) is not int or not 0 <= mt <= len(obj["tensors"]):
        raise bad(f"'model_tensors' {str(mt)[:40]!r} is not an int in [0, {len(obj['tensors'])}]")
    tb = obj.get("total_bytes", 0)
    if type(tb) is not int or not 0 <= tb < 1 << 62:
        raise bad(f"'total_bytes' {str(tb)[:40]!r} is not a non-negative int")
    for key, typ in (("framework", str), ("epoch_complete", bool), ("layers", dict)):
        if obj.get(key) is not None and not isinstance(obj[key], typ):
            raise bad(f"'{key}' is not a {typ.__name__}")
    parent = obj.get("parent")
    if parent is not None:
        why = parent_problem(parent)
        if why is not None:
            raise bad(f"'parent' malformed: {why}")
    return obj


def _valid_redundancy(red: Any, world: int) -> bool:
    def rank(x: Any) -> bool:
        return type(x) is int and 0 <= x < world
    if not isinstance(red, dict) or not isinstance(red.get("unprotected", []), list):
        return False
    if red.get("scheme") == "partner":
        h = red.get("holder")
        return isinstance(h, dict) and all(k.isdigit() and len(k) <= 7 and rank(int(k)) and rank(v)
                                           for k, v in h.items())
    if red.get("scheme") == "xor":
        g = red.get("groups")
        if not isinstance(g, list) or not all(isinstance(x, list) and len(x) >= 2 and all(map(rank, x)) for x in g):
            return False
        flat = [r for x in g for r in x]
        return len(flat) == len(set(flat))
    return False


#: the run id of work done without a run (an Engine built directly, without
#: :class:`~deepfreeze.run.Run`): such work is never combined with a real run's, and is fenced off
#: while a real run holds the lease (:mod:`deepfreeze.lease`)
ANONYMOUS_RUN = "0" * 16


def build_manifest(name: str, version: int, step: int, epoch: int, plan: Any,
                   domains: Sequence[str], extra: dict[str, Any] | None = None,
                   run: Any = None) -> dict[str, Any]:
    """A version's manifest (docs/format.md) before the commit adds what the writers report:
    ``plan`` a :class:`~deepfreeze.shardplan.ShardPlan`, ``domains`` every rank's failure domain,
    ``run`` the :class:`~deepfreeze.lease.RunInfo` writing it (None: the anonymous run)."""
    run_json = run.to_json() if run is not None else {"id": ANONYMOUS_RUN, "generation": 0, "resumed_from": None}
    record = plan.to_json()
    return {  # format version 3: a compact plan record; 2: a record listing every piece (a plan no rule gives)
        "format": "deepfreeze-manifest", "format_version": 3 if "algorithm" in record else 2, "run": run_json,
        "name": name, "version": version, "step": step, "epoch": epoch, "world_size": plan.world_size,
        "tensors": [t.to_json() for t in plan.tensors], "plan": record,
        "shards": [{"rank": r, "file": f"r{r:06d}.dfs", "domain": domains[r], "bytes": b}
                   for r, b in enumerate(plan.rank_bytes())],
        "total_bytes": plan.total_bytes, **(extra or {}),
    }
