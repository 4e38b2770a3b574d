"""Restore: read a committed version back into numpy arrays (no TensorFlow here).

Order for the newest version (or the one asked for), VeloC's, with the memory tier first
(:data:`deepfreeze.tiers.base.READ_ORDER`, iterated here and by :mod:`deepfreeze.inventory`):
scratch (every rank's shard, from its own node or from the partner copy another node holds),
then reconstruction from XOR parity, then the assembled file on persistent. A
file that fails its checks (index, checksums) is dropped and the next source is
tried, with a log line. A version that cannot be read whole from any level is
skipped (when no version was asked for), never returned partially. Works in any
process, at any world size: the manifest's plan says where every piece is.

With a communicator (``comm=``, every rank of a restarted job) the scratch
directories of all participants are pooled: the participants agree, from an
all-gathered inventory, on which of them supplies which file, read and check
their files, report failures (all-gathered, so every participant takes the same
next step), then exchange the files; every participant ends with the whole
checkpoint. Without one, the process uses its own scratch directory.

Ranged reads (``rows=``, a resharding restore: each rank of an FSDP job takes its own dim-0 row
range of each tensor): the output array of such a tensor holds only those rows. From persistent
exactly those bytes are read from the assembled file (a piece read whole is checked against its
checksum; a piece read in part is not: its checksum covers the whole piece). From pooled
scratch, only the shard files holding wanted rows are read (each whole, and checked, by the
participant holding it), and each participant receives from the others only the byte ranges of
its own rows (one point-to-point exchange: a header ``[[tensor_id, start, stop], ...]`` of flat
element ranges, then their bytes; every range is checked against what the receiver asked for).
A shard rebuilt from parity is exchanged whole, as without ``rows``.

What is checked before a file is used: it must be readable whole: header, index, the index
matching the manifest's plan (version, rank, pieces) and run, dtypes and shapes, and (when the
file has checksums and ``verify`` is true) every piece's CRC32; a parity block is checked against
its header and CRC32, a shard rebuilt from parity against its own index and CRC32s. A file that
fails is logged (rank 0) and the next source is tried, then the next older version. Nothing
readable: :class:`~deepfreeze.errors.CorruptCheckpointError`; nothing committed:
:class:`~deepfreeze.errors.CheckpointNotFoundError`; with an explicit ``version`` only that
version is tried. With a communicator, the plan of which participant supplies which file is
computed identically on every participant from the all-gathered inventory (own shard, else a
partner copy, else an XOR rebuild), failures are all-gathered so every participant drops the same
files and re-plans the same way, the files are then all-gathered (``allgather_buffers``: one
buffer per participant, no extra copy) and every participant assembles the tensors; if scratch
cannot give the version whole, every participant reads the assembled file on persistent and its
errors are all-gathered too, so all return the same version or move on together (the algorithm
step by step: docs/guarantees.md, "Redundancy across failure domains"). ``tensors=[names]``
reads from scratch only the shards of the ranks holding a piece of them (so only those ranks'
shards, partner copies or parity are needed) and from the assembled file only their pieces; the
indexes of the files opened are validated, and only the pieces read are CRC-checked.
:func:`list_versions` reports ``scratch`` when this process's scratch directory alone can give a
version whole by the same recovery plan (:func:`scratch_recoverable`, which ``deepfreeze ls``
also uses) and ``persistent`` when it is committed there, reading only manifests and directory
entries. The memory tier (:mod:`deepfreeze.tiers.memtier`) is a level before scratch, pooled the
same way.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import struct
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from . import format as fmt
from .config import Config, validate_name
from . import ownership
from .errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, DeepFreezeError, UntrustedOwnerError
from .fsafe import open_regular_file, read_whole
from .jsonsafe import loads as bounded_loads
from .tiers.base import SHARD_SOURCES, TIER_ORDER, plan_of
from .tiers.persistent import ASSEMBLED, PersistentLevel
from .tiers.scratch import ScratchLevel
from .tiers import memtier as memtier_level
from .comm import Comm, LocalComm
from .redundancy import group_of, read_parity, xor_reconstruct

__all__ = ["Checkpoint", "load", "list_versions", "Rows", "load_persistent"]

log = logging.getLogger("deepfreeze")
# what reading a hostile or vanishing file can raise: the source is unreadable, the next one is tried
# (MemoryError is not here: sizes are checked against the files before anything is allocated)
T = TypeVar("T")
_UNREADABLE = (OSError, DeepFreezeError, ValueError, KeyError, IndexError, TypeError)
#: ``rows(name, shape)``: the dim-0 row range ``(start, stop)`` of a tensor to read, or None for all of it
Rows = Callable[[str, "tuple[int, ...]"], "tuple[int, int] | None"]


@dataclasses.dataclass
class Checkpoint:
    """A restored version: tensors by name (in model order) and where they came from."""

    name: str
    version: int
    step: int
    epoch: int
    level: str
    arrays: dict[str, np.ndarray]
    manifest: dict[str, Any]

    @property
    def model_tensors(self) -> int:
        """How many of the tensors (the first ones) are model weights; the rest is optimizer state."""
        n = self.manifest.get("model_tensors", len(self.manifest["tensors"]))
        return n if isinstance(n, int) and 0 <= n <= len(self.manifest["tensors"]) else len(self.manifest["tensors"])

    def model_arrays(self) -> dict[str, np.ndarray]:
        """The model's weights, by name, in ``model.get_weights()`` order."""
        names = [t["name"] for t in self.manifest["tensors"][:self.model_tensors]]
        return {n: self.arrays[n] for n in names if n in self.arrays}

    def optimizer_arrays(self) -> dict[str, np.ndarray]:
        """The optimizer's variables (iteration counter, slots), by name, in its order."""
        names = [t["name"] for t in self.manifest["tensors"][self.model_tensors:]]
        return {n: self.arrays[n] for n in names if n in self.arrays}


def _levels(config: Config, trust_owners: "Sequence[str | int] | None" = None
            ) -> tuple[ScratchLevel, PersistentLevel]:
    return ScratchLevel(config.scratch), PersistentLevel(config.persistent, trust_owners=trust_owners)


def list_versions(config: "str | os.PathLike | Config | None", name: str, *,
                  trust_owners: "Sequence[str | int] | None" = None) -> dict[int, list[str]]:
    """Committed versions -> levels this process can read them whole from: ``scratch``
    (its own scratch directory: shards, partner copies, parity reconstruction) and
    ``persistent``. ``config``: a :class:`Config`, or a VeloC INI path (``None``: the
    ``VELOC_<KEY>`` environment only), resolved by :meth:`Config.resolve`. Files of another
    user are not readable: on scratch never, on persistent unless their owner is in
    ``trust_owners`` (user names or uids; see :func:`load`)."""
    config = Config.resolve(config)
    validate_name(name)
    scratch, persistent = _levels(config, trust_owners)
    gen = persistent.generation(name)
    out: dict[int, list[str]] = {}
    listed = {"memtier": lambda: memtier_level.committed(config, name, gen, quiet=True),  # load() says what it ignores
              "scratch": lambda: scratch.committed(name, gen)}
    for tier in TIER_ORDER:
        found = persistent.committed_versions(name, gen) if tier == "persistent" else [
            v for v, (m, inv) in listed[tier]().items() if scratch_recoverable(m, inv)]
        for v in found:
            out.setdefault(v, []).append(tier)
    return dict(sorted(out.items()))


def load(config: "str | os.PathLike | Config | None", name: str, version: int | None = None, *,
         verify: bool = True, tensors: Sequence[str] | None = None, comm: Comm | None = None,
         trust_owners: "Sequence[str | int] | None" = None, rows: "Rows | None" = None) -> Checkpoint:
    """Load version ``version`` (default: the newest that can be read whole) of ``name``.

    ``config``: a :class:`Config`, or a VeloC INI path (``None``: the ``VELOC_<KEY>``
    environment only), resolved by :meth:`Config.resolve` (as :func:`deepfreeze.restore`).

    ``tensors`` restricts the read to those tensor names (the index locates each
    piece, so nothing else is read); by default every tensor is loaded.

    ``rows(name, shape)`` returns the dim-0 row range ``(start, stop)`` of a tensor to read (or
    None: all of it): that tensor's array then holds only those rows (shape ``(stop - start,
    *shape[1:])``) and only their bytes are read (module docstring: what is checksummed).
    Collective with ``comm``: each participant may ask for other rows.

    ``comm`` (collective; e.g. :class:`deepfreeze.comm.MPIComm` on every rank of a
    restarted job) pools the scratch directories of all participants: each reads the
    shards, partner copies and parity blocks its node holds, they exchange them, and
    every participant gets the whole checkpoint. Without it, this process's scratch
    directory and persistent are used. Order per version: memory-tier slots (INI
    ``memtier``: read in place, copied once, then checked not to have been rewritten
    meanwhile), scratch shards, partner copies, XOR reconstruction, persistent; the newest
    version that can be recovered
    whole wins; a damaged file (checksum) is dropped and the next source is tried,
    with a log line.

    Ownership (shared directories): a scratch file owned by another user is treated as
    missing (log line naming the owner; the next source is tried). Persistent files are read
    when owned by you, by root, or by a user in ``trust_owners`` (user names or uids);
    reaching a version whose persistent files another user owns raises
    :class:`~deepfreeze.errors.UntrustedOwnerError` naming that user and how to trust them.
    Symbolic links in version directories are never followed.
    """
    with memtier_level.reading():  # memory-tier slots are read as views, copied once, then rechecked
        return _load(config, name, version, verify=verify, tensors=tensors, comm=comm, trust_owners=trust_owners,
                     rows=rows)


def apply_loaded(config: "str | os.PathLike | Config | None", name: str, version: int | None,
                 apply: Callable[[Checkpoint], T], *, comm: Comm | None = None,
                 trust_owners: "Sequence[str | int] | None" = None) -> T:
    """``apply(load(...))`` with one copy fewer: a tensor held whole in one memory-tier slot is
    handed to ``apply`` as a read-only *view* of the slot (``apply`` must copy what it keeps, e.g.
    into a model's variables: the slot's bytes reach them in one copy). After ``apply``, every
    participant checks that no slot it viewed was rewritten meanwhile (the seqlock's second half);
    if one was, the version is loaded again with copies and applied again. Collective with
    ``comm``, as :func:`load`."""
    comm = comm or LocalComm()
    with memtier_level.reading():
        ck = _load(config, name, version, verify=True, tensors=None, comm=comm, trust_owners=trust_owners,
                   views=True)
        result = apply(ck)
        rewritten = [json.loads(b) for b in comm.allgather(json.dumps(memtier_level.changed()).encode())]
    if not any(rewritten):
        return result
    log.warning("deepfreeze: %s v%d: memory-tier slot(s) %s were rewritten while they were applied: loading "
                "again with copies", name, ck.version, sum(rewritten, []))
    return apply(load(config, name, ck.version, comm=comm, trust_owners=trust_owners))


def _load(config: "str | os.PathLike | Config | None", name: str, version: int | None, *, verify: bool,
          tensors: Sequence[str] | None, comm: Comm | None, trust_owners: "Sequence[str | int] | None",
          views: bool = False, rows: "Rows | None" = None) -> Checkpoint:
    config = Config.resolve(config)
    validate_name(name)
    comm = comm or LocalComm()
    scratch, persistent = _levels(config, trust_owners)
    gen = persistent.generation(name)  # only the current generation's versions exist for readers
    local = scratch.committed(name, gen)  # version -> (manifest, files held here)
    memtier_level.merge(local, memtier_level.committed(config, name, gen), name)  # TIER_ORDER: memory first
    committed = persistent.committed_versions(name, gen)
    for v in [v for v in local if v in committed]:
        # a scratch copy of another run than persistent's same version (a node left out of the run
        # that resumed below it): another timeline, never mixed in, never preferred
        try:
            prun = fmt.manifest_run(persistent.read_manifest(name, v))[0]
        except _UNREADABLE:
            continue
        srun = fmt.manifest_run(local[v][0])[0]
        if srun != prun:
            log.warning("deepfreeze: %s v%d on scratch %s is of run %s, on persistent of run %s: the scratch copy "
                        "is ignored", name, v, config.scratch, srun or "?", prun or "?")
            del local[v]
    summary = {"scratch": {str(v): {k: sorted(d) for k, d in inv.items()} for v, (_, inv) in local.items()},
               "persistent": committed,
               "untrusted": {str(v): str(e) for v, e in persistent.untrusted.items()}}
    infos = [json.loads(b) for b in comm.allgather(json.dumps(summary).encode())]
    have: dict[int, dict[tuple[str, int], list[int]]] = {}
    for p, info in enumerate(infos):
        for v, inv in info["scratch"].items():
            for kind, keys in inv.items():
                for key in keys:
                    have.setdefault(int(v), {}).setdefault((kind, int(key)), []).append(p)
    # a version whose directories hold a manifest but no shard, partner copy or parity on any
    # participant (retention interrupted, a purge of large files) is not on scratch: not in ``have``
    on_persistent = set(infos[0]["persistent"])
    untrusted = {int(v): e for v, e in infos[0].get("untrusted", {}).items()}
    known = sorted(set(have) | on_persistent | set(untrusted), reverse=True)
    if version is not None:
        if version not in known:
            raise CheckpointNotFoundError(
                f"version {version} of checkpoint {name!r} is not committed in scratch {config.scratch} "
                f"or persistent {config.persistent}; committed versions: {sorted(known) or 'none'}")
        candidates = [version]
    else:
        candidates = known
        if not candidates:
            raise CheckpointNotFoundError(
                f"no committed checkpoint named {name!r} in scratch {config.scratch} or persistent "
                f"{config.persistent}: check 'name' and the config, or train with the callback first")
    errors: list[str] = []
    for v in candidates:
        if have.get(v):  # a manifest with no file of the version on any participant: not on scratch
            ck = _load_scratch(comm, local.get(v), have[v], name, v, verify, tensors, errors, views, rows)
            if ck is not None:
                return ck
        if v in untrusted and v not in on_persistent:
            raise UntrustedOwnerError(f"{name!r} v{v} on persistent: {untrusted[v]}")
        if v in on_persistent:
            try:
                ck = load_persistent(persistent, name, v, verify, tensors, rows)
                err = ""
            except (CheckpointNotFoundError, UntrustedOwnerError, ConfigError):
                raise  # a tensor name the checkpoint does not have / an owner not trusted / bad rows: no fallback
            except _UNREADABLE as e:  # also a file that vanished (retention) since the listing
                ck, err = None, str(e) or type(e).__name__
            errs = [b.decode() for b in comm.allgather(err.encode())]
            if not any(errs):
                return ck
            for e in filter(None, errs):
                log.warning("deepfreeze: %s v%d on persistent is unreadable (%s); trying the next version",
                            name, v, e)
                errors.append(f"v{v} persistent: {e}")
    if version is not None and len(errors) == 1:
        raise CorruptCheckpointError(errors[0])
    raise CorruptCheckpointError(f"no version of {name!r} could be read whole: " + ("; ".join(errors) or
                                 "scratch holds neither every shard nor enough partner copies/parity (a node lost, or a rank died "
                                 "before writing its shard) and nothing is committed on persistent; if that is expected "
                                 "(a job killed in its first checkpoint), start over with overwrite=True"))


def scratch_recoverable(manifest: dict[str, Any], inventory: dict[str, dict[int, str]]) -> bool:
    """Can every shard of ``manifest`` be read from these files (one scratch directory's
    :meth:`~deepfreeze.tiers.scratch.ScratchLevel.inventory`), directly, from partner copies or
    by XOR reconstruction? (Files are not opened: checksums are checked on load.)"""
    have = {(k, key): [0] for k, d in inventory.items() for key in d}
    return _recovery_plan(manifest, have, range(manifest["world_size"])) is not None


def _recovery_plan(manifest: dict[str, Any], have: dict[tuple[str, int], list[int]], need: Any
                   ) -> tuple[dict[tuple[str, int], int], list[int]] | None:
    """Which participant supplies which file so that the shards of ranks ``need`` can be
    read: (``{(kind, key): participant}``, ranks to rebuild from parity), or None."""
    fetch: dict[tuple[str, int], int] = {}
    copies, parity = SHARD_SOURCES[:2], SHARD_SOURCES[2]  # own shard, partner copy; then an XOR rebuild

    def supply(r: int) -> bool:
        if any((kind, r) in fetch for kind in copies):
            return True
        for kind in copies:
            if have.get((kind, r)):
                fetch[(kind, r)] = have[(kind, r)][0]
                return True
        return False

    rebuild = [r for r in need if not supply(r)]
    red = manifest.get("redundancy") or {}
    for r in rebuild:
        group = group_of(red, r) if red.get("scheme") == "xor" else None
        if group is None:
            return None
        for m in group:
            if m == r:
                continue
            if m in rebuild or not supply(m) or not have.get((parity, m)):
                return None
            fetch[(parity, m)] = have[(parity, m)][0]
    return fetch, rebuild


def _needed_ranks(manifest: dict[str, Any], wanted: Sequence[str] | None, rows: "Rows | None" = None) -> list[int]:
    plan = plan_of(manifest)
    if wanted is None and rows is None:
        return list(range(plan.world_size))
    spans = _spans(manifest, wanted, rows)
    return [r for r in range(plan.world_size)
            if any(p.tensor_id in spans and _overlap(spans[p.tensor_id], (p.start, p.stop)) for p in plan.for_rank(r))]


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1]) or (a[0] == a[1] == b[0] == b[1] == 0)


def _spans(manifest: dict[str, Any], wanted: Sequence[str] | None, rows: "Rows | None") -> dict[int, tuple[int, int]]:
    """Tensor id -> the flat element range ``[start, stop)`` to read, for every wanted tensor.
    ConfigError for a row range outside the tensor (checked before anything is read)."""
    want = None if wanted is None else set(wanted)
    out = {}
    for t in manifest["tensors"]:
        if want is not None and t["name"] not in want:
            continue
        shape, size = tuple(t["shape"]), math.prod(t["shape"])
        r = rows(t["name"], shape) if rows is not None else None
        if r is None:
            out[t["id"]] = (0, size)
            continue
        if not (len(shape) >= 1 and isinstance(r, tuple) and len(r) == 2 and all(type(x) is int for x in r)
                and 0 <= r[0] <= r[1] <= shape[0]):
            raise ConfigError(f"rows of tensor {t['name']!r} {list(shape)}: {r!r} is not a (start, stop) range of "
                              "its first dimension")
        per_row = size // shape[0] if shape[0] else 0
        out[t["id"]] = (r[0] * per_row, r[1] * per_row)
    return out


def _read_item(inv: dict[str, dict[int, str]], kind: str, key: int, version: int, verify: bool,
               run: str = "", limit: int | None = None) -> np.ndarray:
    """Read and check one scratch file of this participant (a shard, partner copy or parity)
    written by run ``run`` (the manifest's; "" for a format-1 checkpoint)."""
    path = inv[kind][key]
    if memtier_level.is_item(path):  # a slot of the memory tier: a shard image, checked below like a file
        data = memtier_level.read_item(path, version, run)
    else:
        data = _read_owned(path, ownership.trusted_uids(), "scratch", limit)
    if kind == "parity":
        h, _ = read_parity(data, path)
        if h.get("version") != version or h.get("run", "") != run:
            raise CorruptCheckpointError(f"{path}: parity of v{h.get('version')} run {h.get('run') or '?'}, "
                                         f"expected v{version} run {run or '?'}")
        return data
    idx = fmt.read_index(data, path)
    if idx.version != version or idx.rank != key:
        raise CorruptCheckpointError(f"{path}: holds rank {idx.rank} v{idx.version}, expected rank {key} v{version}")
    if idx.run != run:
        raise CorruptCheckpointError(f"{path}: written by run {idx.run or '?'}, the manifest is run {run or '?'}'s "
                                     "(a file left by another run): not mixing them")
    if verify and idx.has_crc:
        for e in idx.entries:
            fmt.entry_view(data, e, verify=True, path=path)
    return data


def _file_limit(manifest: dict[str, Any]) -> int:
    """The most bytes a scratch file of ``manifest`` (a shard, a partner copy, a parity block) can
    hold: every tensor byte, plus a header and index for every piece, plus alignment."""
    pieces = len(plan_of(manifest).pieces)  # (derived from a compact plan record; validated by the caller)
    tensors = sum(math.prod(t["shape"]) * fmt.dtype_itemsize(t["dtype"]) for t in manifest["tensors"])
    return tensors + (1 << 20) + (pieces + len(manifest["tensors"])) * (48 + 8 * fmt.MAX_NDIM + fmt.PIECE_ALIGN)


def _read_owned(path: str, trusted: frozenset[int], level: str, limit: int | None = None) -> np.ndarray:
    """The bytes of a regular file (never through a symbolic link, no FIFO) owned by one of
    ``trusted`` (:func:`deepfreeze.ownership.check_owner`) and, with ``limit``, of at most that
    many bytes (checked before anything is allocated: a sparse 4 TiB file is refused)."""
    def check(st: os.stat_result) -> None:
        ownership.check_owner(st, path, trusted, level)
        if limit is not None and st.st_size > limit:
            raise CorruptCheckpointError(f"{path} is {st.st_size} bytes, more than the {limit} its checkpoint's "
                                         "manifest allows: not reading it")
    return read_whole(path, check)


def _frame(head: Any, parts: Sequence[np.ndarray]) -> np.ndarray:
    """One buffer: uint32 length of the JSON ``head``, the JSON, then the ``parts``' bytes."""
    js = json.dumps(head).encode()
    out = np.empty(4 + len(js) + sum(a.nbytes for a in parts), dtype=np.uint8)
    out[:4] = np.frombuffer(struct.pack("<I", len(js)), dtype=np.uint8)
    out[4:4 + len(js)] = np.frombuffer(js, dtype=np.uint8)
    pos = 4 + len(js)
    for a in parts:
        out[pos:pos + a.nbytes] = a.reshape(-1).view(np.uint8)
        pos += a.nbytes
    return out


def _pack(items: dict[tuple[str, int], np.ndarray]) -> np.ndarray:
    """One buffer (:func:`_frame`): header ``[[kind, key, length], ...]``, the files' bytes."""
    return _frame([[k, key, int(a.nbytes)] for (k, key), a in items.items()], list(items.values()))


def _unframe(blob: np.ndarray, what: str) -> tuple[Any, int]:
    """The JSON header of a :func:`_frame` buffer and where its parts begin (its lengths checked)."""
    if blob.size < 4:
        raise CorruptCheckpointError(f"{what}: {blob.size} bytes, no header")
    (n,) = struct.unpack_from("<I", blob[:4].tobytes(), 0)
    if 4 + n > blob.size:
        raise CorruptCheckpointError(f"{what}: a header of {n} bytes in {blob.size}")
    return bounded_loads(blob[4:4 + n].tobytes(), what, max_bytes=n), 4 + n


def _unpack(blob: np.ndarray) -> dict[tuple[str, int], np.ndarray]:
    head, pos = _unframe(blob, "the files a participant sent")
    out = {}
    for kind, key, length in head:
        out[(kind, key)] = blob[pos:pos + length]
        pos += length
    return out


def _load_scratch(comm: Comm, local: tuple[dict[str, Any], dict[str, dict[int, str]]] | None,
                  have: dict[tuple[str, int], list[int]], name: str, version: int, verify: bool,
                  wanted: Sequence[str] | None, errors: list[str], views: bool = False,
                  rows: "Rows | None" = None) -> Checkpoint | None:
    """Collective: recover ``version`` from the participants' scratch files, or None.
    ``local``: this participant's (manifest, files) of the version, if it holds any. ``views``:
    tensors held whole in one memory-tier slot read here are views of it (:func:`apply_loaded`)."""
    owners = sorted({p for ps in have.values() for p in ps})
    if not owners:  # no file of this version on any participant: not on scratch
        return None
    inv = local[1] if local is not None else None
    mine = json.dumps(local[0]).encode() if local is not None else b""
    blob = comm.allgather(mine if comm.rank == owners[0] else b"")[owners[0]]
    try:  # the same bytes on every participant: they all take the same branch
        manifest = json.loads(blob)
        plan_of(manifest)
        for t in manifest["tensors"]:  # (numbers: the row ranges below cannot fail on some participants only)
            math.prod(t["shape"])
    except _UNREADABLE as e:
        errors.append(f"v{version} scratch: {e}")
        log.warning("deepfreeze: %s v%d on scratch has an unusable manifest (%s)", name, version, e)
        return None
    bad = ""
    try:  # each participant may ask for other rows: the files needed are those any of them needs
        spans, need = _spans(manifest, wanted, rows), _needed_ranks(manifest, wanted, rows)
    except ConfigError as e:
        spans, need, bad = {}, [], str(e)
    ranged = rows is not None
    if comm.size > 1:
        asks = [json.loads(b) for b in comm.allgather(json.dumps(
            {"need": need, "bad": bad, "ranged": ranged, "spans": [[k, *v] for k, v in spans.items()]}).encode())]
        bad = next((a["bad"] for a in asks if a["bad"]), "")
        need = sorted({r for a in asks for r in a["need"]})
        ranged = any(a["ranged"] for a in asks)
        wants = [{k: (a, b) for k, a, b in x["spans"]} for x in asks]
    if bad:
        raise ConfigError(bad)
    while True:
        planned = _recovery_plan(manifest, have, need)
        if planned is None:
            return None
        fetch, rebuild = planned
        items, failed = {}, []
        read_here = from_tier = 0  # files this participant reads, and how many of them are memory-tier slots
        mine_tier: set[int] = set()  # ranks whose shard this participant reads from a memory-tier slot
        memtier_level.forget()
        limit = _file_limit(manifest)
        for (kind, key), p in fetch.items():
            if p != comm.rank:
                continue
            read_here += 1
            if memtier_level.is_item(inv[kind][key]):
                from_tier += 1
                if kind == "shard":
                    mine_tier.add(key)
            try:
                items[(kind, key)] = _read_item(inv, kind, key, version, verify, fmt.manifest_run(manifest)[0],
                                                limit)
            except _UNREADABLE as e:  # damaged, not a regular file, or removed by retention meanwhile
                failed.append([kind, key, str(e) or type(e).__name__])
        gathered = [json.loads(b) for b in comm.allgather(json.dumps(
            {"failed": failed, "tier": from_tier == read_here, "any_tier": from_tier > 0}).encode())]
        reports = [g["failed"] for g in gathered]
        source = "memtier" if all(g["tier"] for g in gathered) else "scratch"
        recheck = any(g["any_tier"] for g in gathered)  # slots were read in place: recheck after copying
        if any(reports):
            bad = [(p, kind, key, why) for p, rep in enumerate(reports) for kind, key, why in rep]
            for p, kind, key, why in bad:
                errors.append(f"v{version} {kind} r{key}: {why}")
                have[(kind, key)] = [q for q in have[(kind, key)] if q != p]
            if comm.rank == 0:  # one line per version and round, however many files (a broken directory)
                p, kind, key, why = bad[0]
                more = f" (and {len(bad) - 1} more file(s))" if len(bad) > 1 else ""
                log.warning("deepfreeze: %s v%d: %s of rank %d on participant %d is unreadable (%s)%s; "
                            "trying the next source", name, version, kind, key, p, why, more)
            continue
        if comm.size > 1 and ranged and not rebuild:  # each participant gets only the bytes of its own rows
            return _load_ranged(comm, items, wants, manifest, version, wanted, rows, recheck, name, errors)
        if comm.size > 1:
            for blob in comm.allgather_buffers(_pack(items)):
                items.update(_unpack(blob))
        files = {r: items.get(("shard", r), items.get(("partner", r))) for r in need if r not in rebuild}
        try:
            for r in rebuild:
                group = group_of(manifest["redundancy"], r)
                heads = {m: read_parity(items[("parity", m)]) for m in group if m != r}
                for m, (h, _) in heads.items():
                    if (h["group"] != group or h["holder"] != m or h.get("version") != version
                            or h.get("run", "") != fmt.manifest_run(manifest)[0]):
                        raise CorruptCheckpointError(f"parity block of rank {m} is for group {h['group']} "
                                                     f"v{h.get('version')}, the manifest says {group} v{version}")
                sizes = next(iter(heads.values()))[0]["sizes"]
                files[r] = xor_reconstruct(group, r, {m: items.get(("shard", m), items.get(("partner", m)))
                                                      for m in group if m != r},
                                           {m: p for m, (_, p) in heads.items()}, sizes)
                if comm.rank == 0:
                    log.warning("deepfreeze: %s v%d: rebuilt the shard of rank %d from XOR parity",
                                name, version, r)
            viewable = {r for r in files if r in mine_tier} if views else set()
            ck = _assemble(manifest, files, wanted, verify, version, rebuilt=set(rebuild), level=source,
                           views=viewable, rows=rows)
            if recheck:  # the seqlock's second half: a slot a writer began to rewrite meanwhile is not trusted
                rewritten = [json.loads(b) for b in comm.allgather(json.dumps(memtier_level.changed()).encode())]
                if any(rewritten):
                    raise CorruptCheckpointError(f"memory-tier slot(s) {sum(rewritten, [])} rewritten while they "
                                                 "were read")
            return ck
        except (CheckpointNotFoundError, ConfigError):
            raise  # a tensor name the checkpoint does not have
        except _UNREADABLE as e:  # e.g. a rebuilt shard failing its checksums
            errors.append(f"v{version} scratch: {e}")
            log.warning("deepfreeze: %s v%d cannot be assembled from scratch (%s)", name, version, e)
            return None


def _load_ranged(comm: Comm, items: dict[tuple[str, int], np.ndarray], wants: list[dict[int, tuple[int, int]]],
                 manifest: dict[str, Any], version: int, wanted: Sequence[str] | None, rows: "Rows | None",
                 recheck: bool, name: str, errors: list[str]) -> Checkpoint | None:
    """Collective: every participant sends each other one the elements of its ``wants`` (tensor
    id -> flat range) that the files it read (``items``, checked when read) hold, and assembles
    its own rows from what it receives; None (on every participant) if any of them fails."""
    me = comm.rank
    try:
        blobs, err = _slices(items, wants, manifest, version), ""
    except _UNREADABLE as e:
        blobs, err = [], f"participant {me}: {str(e) or type(e).__name__}"
    told = [json.loads(b) for b in comm.allgather(json.dumps({"err": err, "sizes": [int(x.size) for x in blobs]})
                                                  .encode())]
    err = next((t["err"] for t in told if t["err"]), "")
    ck = None
    if not err:
        got = comm.exchange({q: blobs[q] for q in range(comm.size) if q != me},
                            {p: int(told[p]["sizes"][me]) for p in range(comm.size) if p != me})
        got[me] = blobs[me]
        try:
            parts = [x for p in sorted(got) for x in _unpack_ranges(got[p], wants[me], manifest, p)]
            ck = _assemble_ranges(manifest, parts, wanted, rows, version)
        except _UNREADABLE as e:
            err = f"participant {me}: {str(e) or type(e).__name__}"
        changed = memtier_level.changed() if recheck else []  # the seqlock's second half, as _load_scratch
        told = [json.loads(b) for b in comm.allgather(json.dumps({"err": err, "changed": changed}).encode())]
        err = next((t["err"] for t in told if t["err"]), "")
        if not err and any(t["changed"] for t in told):
            err = f"memory-tier slot(s) {sum((t['changed'] for t in told), [])} rewritten while they were read"
    if err:
        errors.append(f"v{version} scratch: {err}")
        log.warning("deepfreeze: %s v%d cannot be assembled from scratch (%s)", name, version, err)
        return None
    return ck


def _slices(items: dict[tuple[str, int], np.ndarray], wants: list[dict[int, tuple[int, int]]],
            manifest: dict[str, Any], version: int) -> list[np.ndarray]:
    """Per participant q, one buffer (:func:`_frame`) of the elements of ``wants[q]`` the shard
    files ``items`` hold: header ``[[tensor_id, start, stop], ...]``, their bytes."""
    plan = plan_of(manifest)
    heads: list[list[list[int]]] = [[] for _ in wants]
    parts: list[list[np.ndarray]] = [[] for _ in wants]
    for (kind, key), data in items.items():
        if kind == "parity":
            continue
        path = f"{kind} of rank {key}"
        idx = fmt.read_index(data, path)
        _check_index(idx, [(p.tensor_id, p.start, p.stop) for p in plan.for_rank(key)], manifest, version, path)
        for e in idx.entries:
            raw = np.frombuffer(fmt.byte_view(data), dtype=np.uint8)[e.offset:e.offset + e.length]
            item = fmt.dtype_itemsize(e.dtype)
            for q, want in enumerate(wants):
                span = want.get(e.tensor_id)
                if span is None:
                    continue
                a, b = max(span[0], e.start), min(span[1], e.stop)
                if a < b:
                    heads[q].append([e.tensor_id, a, b])
                    parts[q].append(raw[(a - e.start) * item:(b - e.start) * item])
    return [_frame(heads[q], parts[q]) for q in range(len(wants))]


def _unpack_ranges(blob: np.ndarray, want: dict[int, tuple[int, int]], manifest: dict[str, Any], src: int
                   ) -> list[tuple[int, int, int, np.ndarray]]:
    """The ranges participant ``src`` sent (:func:`_slices`), each checked against what
    was asked for and against the blob's length."""
    what = f"the rows participant {src} sent"
    head, pos = _unframe(blob, what)
    out = []
    for tid, a, b in head:
        span = want.get(tid) if type(tid) is int else None
        if span is None or not (type(a) is int and type(b) is int and span[0] <= a < b <= span[1]):
            raise CorruptCheckpointError(f"{what}: elements [{a}, {b}) of tensor {tid}, not asked for")
        nb = (b - a) * fmt.dtype_itemsize(manifest["tensors"][tid]["dtype"])
        if pos + nb > blob.size:
            raise CorruptCheckpointError(f"{what}: runs past its {blob.size} bytes")
        out.append((tid, a, b, blob[pos:pos + nb]))
        pos += nb
    return out


def _assemble_ranges(manifest: dict[str, Any], got: list[tuple[int, int, int, np.ndarray]],
                     wanted: Sequence[str] | None, rows: "Rows | None",
                     version: int) -> Checkpoint:
    """This participant's arrays (its ``rows``) from the ranges it received; every wanted element
    must have come exactly once (the ranges tile what was asked for)."""
    flats, named, spans = _empty_arrays(manifest, wanted, sum(int(x.nbytes) for *_, x in got),
                                        "the rows received", rows)
    came: dict[int, list[tuple[int, int]]] = {tid: [] for tid in spans}
    for tid, a, b, raw in got:
        out, (lo, _) = flats[tid], spans[tid]
        out[a - lo:b - lo] = raw.view(out.dtype)
        came[tid].append((a, b))
    for tid, (lo, hi) in spans.items():
        pos = lo
        for a, b in sorted(came[tid]):
            pos = b if a == pos else -1  # a gap or an overlap: never tiles
        if pos != hi:
            raise CorruptCheckpointError(f"tensor {manifest['tensors'][tid]['name']!r}: elements [{lo}, {hi}) "
                                         f"were asked for, {sorted(came[tid])[:8]} received")
    return Checkpoint(manifest["name"], version, manifest["step"], manifest["epoch"], "scratch", named, manifest)


def _assemble(manifest: dict[str, Any], files: dict[int, np.ndarray], wanted: Sequence[str] | None,
              verify: bool, version: int, rebuilt: set[int], level: str = "scratch",
              views: "set[int] | None" = None, rows: "Rows | None" = None) -> Checkpoint:
    """Fill the output arrays from whole shard files in memory. Files read from disk were
    verified by their reader; rebuilt ones are verified here. A tensor held whole by one piece of
    a shard in ``views`` (ranks) is returned as a view of that shard's buffer, not a copy."""
    plan = plan_of(manifest)
    flats, named, spans = _empty_arrays(manifest, wanted, sum(int(d.nbytes) for d in files.values()),
                                        f"the shard files of ranks {sorted(files)}", rows)
    for r, data in files.items():
        path = f"shard of rank {r}"
        idx = fmt.read_index(data, path)
        expected = [(p.tensor_id, p.start, p.stop) for p in plan.for_rank(r)]
        _check_index(idx, expected, manifest, version, path)
        for e in idx.entries:
            if flats[e.tensor_id] is None:
                continue
            lo, hi = spans[e.tensor_id]
            if max(lo, e.start) >= min(hi, e.stop):
                continue  # none of the wanted rows
            piece = fmt.entry_view(data, e, verify=verify and idx.has_crc and r in rebuilt, path=path)
            if views and r in views and e.start == 0 and e.stop == flats[e.tensor_id].size \
                    and (lo, hi) == (0, e.stop):
                t = manifest["tensors"][e.tensor_id]
                named[t["name"]] = piece.reshape(t["shape"])  # the slot's bytes, not copied (apply_loaded)
                continue
            a, b = max(lo, e.start), min(hi, e.stop)
            flats[e.tensor_id][a - lo:b - lo] = piece[a - e.start:b - e.start]
    return Checkpoint(manifest["name"], version, manifest["step"], manifest["epoch"], level, named, manifest)


def _empty_arrays(manifest: dict[str, Any], wanted: Sequence[str] | None, available: int, source: str,
                  rows: "Rows | None" = None
                  ) -> tuple[list[np.ndarray | None], dict[str, np.ndarray], dict[int, tuple[int, int]]]:
    """Output arrays for the wanted tensors (None for the others), flat views and by name, and
    the flat element range each one holds (all of the tensor, or its ``rows``).

    ``available`` is how many bytes the files the tensors are read from hold (``source`` names
    them): a manifest declaring more tensor bytes than that is corrupt (a hostile 4 TiB shape),
    refused before anything is allocated."""
    names = [t["name"] for t in manifest["tensors"]]
    if wanted is not None:
        missing = sorted(set(wanted) - set(names))
        if missing:
            raise CheckpointNotFoundError(f"{manifest['name']!r} v{manifest['version']} has no tensor named "
                                          f"{missing[0]!r}; it has {len(names)} tensors, e.g. {names[:3]}")
    want = None if wanted is None else set(wanted)
    spans = _spans(manifest, wanted, rows)
    declared = sum((spans[t["id"]][1] - spans[t["id"]][0]) * fmt.dtype_itemsize(t["dtype"])
                   for t in manifest["tensors"] if t["id"] in spans)
    if declared > available:
        raise CorruptCheckpointError(f"{manifest['name']!r} v{manifest['version']}: the manifest declares "
                                     f"{declared} bytes of tensors but {source} hold only {available} bytes: "
                                     "the manifest is damaged or hostile; nothing was allocated")
    flats: list[np.ndarray | None] = []
    named = {}
    for t in manifest["tensors"]:
        if want is not None and t["name"] not in want:
            flats.append(None)
            continue
        lo, hi = spans[t["id"]]
        shape = t["shape"] if (lo, hi) == (0, math.prod(t["shape"])) else \
            [(hi - lo) // (math.prod(t["shape"][1:]) or 1), *t["shape"][1:]]
        a = np.empty(shape, dtype=fmt.numpy_dtype(t["dtype"]))
        flats.append(a.reshape(-1))
        named[t["name"]] = a
    return flats, named, spans


def _check_index(idx: fmt.ShardIndex, expected: list[tuple[int, int, int]], manifest: dict[str, Any],
                 version: int, path: str) -> None:
    got = [(e.tensor_id, e.start, e.stop) for e in idx.entries]
    if got != expected or idx.version != version:
        raise CorruptCheckpointError(f"{path}: its index does not match the manifest (another model "
                                     "or version wrote it)")
    if idx.run != fmt.manifest_run(manifest)[0]:
        raise CorruptCheckpointError(f"{path}: written by run {idx.run or '?'}, the manifest is run "
                                     f"{fmt.manifest_run(manifest)[0] or '?'}'s: not mixing two runs")
    for e in idx.entries:
        t = manifest["tensors"][e.tensor_id]
        if e.dtype != t["dtype"] or list(e.shape) != t["shape"]:
            raise CorruptCheckpointError(f"{path}: tensor {t['name']!r} is {e.dtype}{list(e.shape)} in the "
                                         f"file but {t['dtype']}{t['shape']} in the manifest")


def _fill(f: Any, path: str, idx: fmt.ShardIndex, flats: list[np.ndarray | None], verify: bool,
          spans: "dict[int, tuple[int, int]] | None" = None) -> None:
    """Read the wanted elements of every entry: a whole piece with :func:`fmt.read_entry` (its
    checksum checked), part of one (``spans``: rows) with one bounded read of just those bytes.
    In the order of the file's bytes (an assembled file lays a rank's whole tensors together, not
    in index order: :func:`deepfreeze.tiers.shardbytes.assembled_order`), so the reads go forward."""
    for e in sorted(idx.entries, key=lambda e: e.offset):
        out = flats[e.tensor_id]
        if out is None:
            continue
        lo, hi = spans[e.tensor_id] if spans is not None else (0, out.size)
        a, b = max(lo, e.start), min(hi, e.stop)
        if (a, b) == (e.start, e.stop):
            fmt.read_entry(f, e, out[a - lo:b - lo], verify=verify and idx.has_crc, path=path)
        elif a < b:  # (the entry lies within the file: read_index checked it)
            item = fmt.dtype_itemsize(e.dtype)
            _pread_into(f, out[a - lo:b - lo], e.offset + (a - e.start) * item, path)


def _pread_into(f: Any, out: np.ndarray, offset: int, path: str) -> None:
    view = memoryview(out.view(np.uint8))
    got = 0
    while got < len(view):  # preadv may return short reads
        n = os.preadv(f.fileno(), [view[got:]], offset + got)
        if n <= 0:
            raise CorruptCheckpointError(f"{path}: unexpected end of file at offset {offset + got}")
        got += n


def load_persistent(level: PersistentLevel, name: str, version: int, verify: bool,
                     wanted: Sequence[str] | None, rows: "Rows | None" = None) -> Checkpoint:
    m = level.read_manifest(name, version)
    plan = plan_of(m)
    path = os.path.join(level.version_dir(name, version), (m.get("assembled") or {}).get("file", ASSEMBLED))
    with open_regular_file(path, lambda st: ownership.check_owner(st, path, level.trusted, "persistent")) as f:  # a FIFO or symlink is refused, never waited on
        idx = fmt.read_index(f, path)   # every entry within the file
        _check_index(idx, [(p.tensor_id, p.start, p.stop) for p in plan.pieces], m, version, path)
        flats, named, spans = _empty_arrays(m, wanted, idx.file_size, path, rows)
        _fill(f, path, idx, flats, verify, spans)
    return Checkpoint(name, version, m["step"], m["epoch"], "persistent", named, m)
