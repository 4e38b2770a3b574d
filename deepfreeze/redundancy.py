"""Partner replication and XOR parity across failure domains (VeloC's ``ec_interval`` level).

A node's scratch is lost with the node. This module protects the shards of a
version on scratch by copying data to *other* failure domains (nodes), so the
version stays recoverable from scratch when one domain is lost:

``partner``
    every rank's shard is copied to a rank of the next failure domain (cyclic
    over the domains, in order of first appearance). Space: one extra copy of the
    model on scratch (100 %). Survives the loss of any one failure domain (and of
    several, as long as no rank and its holder are both lost).
``xor``
    ranks form groups with one rank per failure domain (row ``j`` holds the
    ``j``-th rank of every domain); in a group of ``k`` members each shard is cut
    in ``k - 1`` chunks and member ``s`` keeps the parity (XOR) of stripe ``s``,
    RAID-5 style. Space: ``1 / (k - 1)`` of the shard size per rank (e.g. 33 %
    for ``k = 4``). Survives the loss of one member per group, i.e. of any one
    failure domain (and of several, one per group). A row longer than
    ``ec_group_size`` (default 8, as SCR's set size; 0: no limit) is cut into
    the fewest groups of at most that many, their sizes differing by at most
    one, so a job of 1000 nodes has 125 groups of 8 (7 messages of 1/7 of a
    shard each way per rank, parity 14 % of a shard), not one of 1000. Groups
    of one member (more ranks in one domain than in the others) cannot be
    protected; that is logged once.

Scratch files (all under ``<scratch>/<name>/v<version>/``, next to the shards)::

    h<holder:06d>.r<src:06d>.dfs   the partner copy of rank src's shard, held by rank holder
    x<holder:06d>.dfx              rank holder's parity block (header below, then the bytes)

Both are written tmp-then-rename before the version's scratch manifest, so a
manifest that names a redundancy scheme was written after the exchange ended.

Parity file: ``DFXPAR01``, a little-endian uint32 JSON length, the JSON header
(``name``, ``version``, ``holder``, ``group``, ``sizes`` of the members' shard
files, ``chunk`` bytes, ``crc`` of the parity bytes), then the ``chunk`` parity
bytes. Every field is bounds-checked on read.

The exchange runs in each rank's writer thread, collectively, through a
:class:`~deepfreeze.comm.Comm` (MPI via mpi4py for real jobs; :class:`~deepfreeze.comm.LocalComm`
for one process; both in :mod:`deepfreeze.comm`). Every rank takes part for every version it writes, even when its own
shard write failed (it then says so and nobody exchanges), so a failure never
leaves the others waiting.

Plan: :func:`plan_redundancy` is a pure function of the failure domains the adapter gathered
(``failure_domain``, default the host name), computed identically on every rank when the engine
is made: ``{"scheme": "partner", "holder": {src: holder}}`` or ``{"scheme": "xor", "groups":
[[ranks]]}``, plus ``unprotected`` (every rank with one failure domain; with ``xor``, ranks
alone in their row); rank 0 logs the unprotected ranks once. When: after its shard is renamed on
scratch, each rank's writer calls :func:`protect` with ``want`` (its view of ``ec_interval``
since the last protected version); one all-gather of a small JSON (``ok``, ``want``, shard
``size``) per version; rank 0's ``want`` decides for all; if any rank's shard write failed,
nobody exchanges (a warning) and the failing rank raises its own error afterwards. *Partner*:
one ``exchange``: each rank sends its whole shard file to its holder and writes what it receives
as ``h<holder>.r<src>.dfs`` (temporary name, rename). *XOR*: in a group of ``k`` each shard file
is cut into ``k - 1`` chunks of ``c = ceil(largest shard in the group / (k - 1))`` bytes
(zero-padded); stripe ``s`` is one chunk of every member except member ``s`` (member ``p``'s
chunk ``s`` if ``s < p``, else ``s - 1``); member ``s`` receives the others' chunks of stripe
``s`` and XORs them into its parity block. The exchange runs in segments of 64 MiB and every
rank runs the same number of rounds (groups may differ in chunk size). :func:`xor_reconstruct`
rebuilds a lost member's shard file from the other members' shard files and parity blocks.
When :func:`protect` returns true the manifest written next gets ``redundancy`` (the plan),
identical on every rank; restore uses it to find a rank's XOR group and uses partner copies
whenever they are present. ``ScratchLevel.retain`` deletes with a rank's own shard of an old
version the partner copies (``h<rank>.r*.dfs``) and the parity block (``x<rank>.dfx``) it holds.
"""
from __future__ import annotations

import json
import logging
import math
import os
import struct
from typing import Any, Sequence

import numpy as np

from . import format as fmt
from .errors import CorruptCheckpointError
from .fsafe import read_whole
from .jsonsafe import loads as bounded_loads
from .comm import Comm
from .fsafe import atomic_write

__all__ = ["plan_redundancy", "protect", "read_parity", "xor_reconstruct",
           "SCHEMES"]

log = logging.getLogger("deepfreeze")
SCHEMES = ("partner", "xor")
PARITY_MAGIC = b"DFXPAR01"
_SEGMENT = 64 << 20  # XOR stripes are exchanged in segments of this many bytes (bounds memory)


# -- planning (pure functions of the failure domains; every rank computes the same)

def _rows(domains: Sequence[str]) -> tuple[list[str], dict[str, list[int]]]:
    order: list[str] = []
    members: dict[str, list[int]] = {}
    for r, d in enumerate(domains):
        if d not in members:
            order.append(d)
            members[d] = []
        members[d].append(r)
    return order, members


def plan_redundancy(domains: Sequence[str], scheme: str, group_size: int = 0) -> dict[str, Any]:
    """Who protects whom: ``{"scheme", "holder": {src: holder}}`` (partner) or
    ``{"scheme", "groups": [[ranks]]}`` (xor, groups of at most ``group_size`` ranks when it is
    not 0); ``unprotected`` lists ranks left out.

    Raises ValueError for an unknown scheme or a ``group_size`` of 1 or 2."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown redundancy scheme {scheme!r}: use one of {SCHEMES}")
    if group_size != 0 and group_size < 3:
        raise ValueError(f"group_size = {group_size}: XOR groups need 3 or more members (0: no limit)")
    order, members = _rows(domains)
    if scheme == "partner":
        holder: dict[int, int] = {}
        if len(order) > 1:
            for i, d in enumerate(order):
                nxt = members[order[(i + 1) % len(order)]]
                for j, r in enumerate(members[d]):
                    holder[r] = nxt[j % len(nxt)]
        return {"scheme": "partner", "holder": {str(k): v for k, v in sorted(holder.items())},
                "unprotected": sorted(set(range(len(domains))) - set(holder))}
    groups, alone = [], []
    for j in range(max((len(m) for m in members.values()), default=0)):
        row = [members[d][j] for d in order if j < len(members[d])]
        if len(row) < 2:
            alone.append(row)
            continue
        n = -(-len(row) // group_size) if group_size else 1  # the fewest groups of at most group_size
        q, extra = divmod(len(row), n)  # sizes q or q + 1 (>= 2 since group_size >= 3)
        start = 0
        for i in range(n):
            size = q + (i < extra)
            groups.append(row[start:start + size])
            start += size
    return {"scheme": "xor", "groups": groups, "unprotected": sorted(r for row in alone for r in row)}


def group_of(redundancy: dict[str, Any], rank: int) -> list[int] | None:
    for g in redundancy.get("groups", []):
        if rank in g:
            return g
    return None


def _stripe_of_chunk(pos: int, j: int) -> int:
    """Stripe (member position) that chunk ``j`` of the member at ``pos`` belongs to."""
    return j if j < pos else j + 1


def _chunk_of_stripe(pos: int, s: int) -> int:
    return s if s < pos else s - 1


def _chunk(data: np.ndarray, j: int, c: int, lo: int, hi: int) -> np.ndarray:
    """Bytes [lo, hi) of chunk ``j`` (size ``c``) of ``data``, zero-padded."""
    out = np.zeros(hi - lo, dtype=np.uint8)
    a, b = j * c + lo, min(j * c + hi, len(data))
    if b > a:
        out[:b - a] = data[a:b]
    return out


# -- protecting a version (writer thread, collective)

def protect(comm: Comm, scratch: Any, name: str, version: int, rank: int, shard_path: str | None,
            redundancy: dict[str, Any], *, want: bool = True, run: str = "") -> bool:
    """Copy this rank's shard to its partner / compute this rank's parity block, collectively.

    ``want`` is this rank's view of ``ec_interval``; rank 0's view decides for all (one
    small all-gather, so every rank follows the same choice). ``shard_path`` is None when
    this rank's shard write failed: it still takes part (so nobody waits for it) and
    every rank skips the exchange. Returns True when the version got protected.
    """
    try:
        data = read_whole(shard_path) if shard_path is not None else None  # a regular file, never a FIFO
    except (OSError, CorruptCheckpointError) as e:
        log.warning("deepfreeze: cannot read back %s for protection: %s", shard_path, e)
        data = None
    info = json.dumps({"ok": data is not None, "want": bool(want),
                       "size": 0 if data is None else int(data.size)}).encode()
    infos = [json.loads(b) for b in comm.allgather(info)]
    if not infos[0]["want"]:
        return False
    if not all(i["ok"] for i in infos):
        log.warning("deepfreeze: %s v%d is not partner/parity protected: a rank's shard write failed", name, version)
        return False
    sizes = [i["size"] for i in infos]
    vdir = scratch.version_dir(name, version)
    if redundancy["scheme"] == "partner":
        holder = {int(k): v for k, v in redundancy["holder"].items()}
        sends = {holder[rank]: data} if rank in holder else {}
        srcs = {s: sizes[s] for s, h in holder.items() if h == rank}
        got = comm.exchange(sends, srcs)
        for s, buf in got.items():
            atomic_write(os.path.join(vdir, f"h{rank:06d}.r{s:06d}.dfs"), buf, fsync=False, point="scratch.partner")
        return True
    group = group_of(redundancy, rank)
    if group is None:
        return True  # a rank alone in its row: nothing to exchange (logged by the engine)
    # every member computes the same chunk size, hence the same rounds (point-to-point within the group)
    k, pos = len(group), group.index(rank)
    c = math.ceil(max(sizes[m] for m in group) / (k - 1))
    parity = np.zeros(c, dtype=np.uint8)
    for lo in range(0, c, _SEGMENT):
        hi = min(c, lo + _SEGMENT)
        sends = {group[s]: _chunk(data, _chunk_of_stripe(pos, s), c, lo, hi) for s in range(k) if s != pos}
        got = comm.exchange(sends, {m: hi - lo for m in group if m != rank})
        for buf in got.values():
            np.bitwise_xor(parity[lo:hi], buf, out=parity[lo:hi])
    header = json.dumps({"name": name, "version": version, "run": run, "holder": rank, "group": group,
                         "sizes": [sizes[m] for m in group], "chunk": c, "crc": fmt.crc32(parity)}).encode()
    atomic_write(os.path.join(vdir, f"x{rank:06d}.dfx"),
                 PARITY_MAGIC + struct.pack("<I", len(header)) + header + parity.tobytes(), fsync=False,
                 point="scratch.parity")
    return True


# -- reading and reconstructing

def read_parity(raw: Any, path: str = "<parity>") -> tuple[dict[str, Any], np.ndarray]:
    """Decode and check a parity file (bytes or a uint8 array, not copied): (header, parity bytes)."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: not a valid DeepFreeze parity file ({why})")
    raw = fmt.byte_view(raw)
    if len(raw) < 12 or bytes(raw[:8]) != PARITY_MAGIC:
        raise bad("bad magic")
    (n,) = struct.unpack_from("<I", raw, 8)
    if n > 1 << 20 or 12 + n > len(raw):
        raise bad(f"header length {n} out of bounds")
    try:
        h = bounded_loads(bytes(raw[12:12 + n]), "parity header", max_bytes=1 << 20, kind=dict)
        group, sizes, c, crc = h["group"], h["sizes"], h["chunk"], h["crc"]
        ok = (isinstance(group, list) and isinstance(sizes, list) and len(group) == len(sizes) >= 2
              and all(isinstance(x, int) and x >= 0 for x in group + sizes + [c, crc]))
    except (ValueError, KeyError, TypeError) as e:
        raise bad(f"header: {e}") from e
    if not ok:
        raise bad("header fields out of range")
    body = np.frombuffer(raw, dtype=np.uint8, offset=12 + n)
    if len(body) != c:
        raise bad(f"{len(body)} parity bytes, header says {c}")
    if fmt.crc32(body) != crc:
        raise bad("checksum mismatch")
    return h, body


def xor_reconstruct(group: Sequence[int], lost: int, shards: dict[int, np.ndarray],
                    parities: dict[int, np.ndarray], sizes: Sequence[int]) -> np.ndarray:
    """Rebuild member ``lost``'s shard file from the other members' shards and parities."""
    k, pos = len(group), list(group).index(lost)
    c = len(next(iter(parities.values())))
    out = np.zeros((k - 1) * c, dtype=np.uint8)
    for j in range(k - 1):
        s = _stripe_of_chunk(pos, j)
        acc = parities[group[s]].copy()
        for mpos, m in enumerate(group):
            if m in (lost, group[s]):
                continue
            np.bitwise_xor(acc, _chunk(shards[m], _chunk_of_stripe(mpos, s), c, 0, c), out=acc)
        out[j * c:(j + 1) * c] = acc
    return out[:sizes[pos]]
