"""Storage levels, their directory layout and the commit protocol.

Layout::

    <scratch>/<name>/v<version:012d>/r<rank:06d>.dfs   one shard file per rank (format.py)
    <scratch>/<name>/v<version:012d>/h<holder>.r<src>.dfs  partner copy of rank src's shard (redundancy.py)
    <scratch>/<name>/v<version:012d>/x<holder>.dfx     parity block held by rank holder (redundancy.py)
    <scratch>/<name>/v<version:012d>/manifest.json     written by every local rank after its shard
    <persistent>/<name>/v<version:012d>/model.dfz      the assembled checkpoint (all tensors, whole)
    <persistent>/<name>/v<version:012d>/manifest.json  the commit marker, written last

Commit protocol (data first, marker last, atomically):

* **Scratch.** A rank writes its shard to ``.r<rank>.dfs.tmp<pid>`` and renames
  it to ``r<rank>.dfs`` (atomic on POSIX), then writes ``manifest.json`` the same
  way (same bytes on every rank). A shard is on scratch once its final name
  exists; a version is *complete on a scratch directory* when its manifest and
  every rank's shard are there. Scratch is not fsynced by default: node-local
  storage is lost with its node anyway, and a killed process loses nothing
  already written (the page cache belongs to the kernel).
* **Persistent.** Every node copies its ranks' pieces into the shared
  ``model.dfz.partial`` at offsets computed from the manifest alone (pieces of a
  tensor are contiguous, so each piece is one positional write), fsyncs it (and
  drops those durable pages from the node's page cache, which is the training's), then
  publishes ``done.r<rank>.json`` (piece checksums) by atomic rename. The node
  that sees the last ``done`` marker wins ``commit.lock`` (exclusive creation, as ``decision``; a lock
  left by a dead process on the same host is broken) and
  finalizes: it writes the header and index, fsyncs, renames ``model.dfz.partial``
  to ``model.dfz``, writes ``manifest.json`` via temp file + fsync + rename, and
  fsyncs the directory. **A version is committed on persistent if and only if
  its ``manifest.json`` exists**; anything else in a version directory is an
  unfinished flush that readers ignore.
* **Which versions go to persistent** (``persistent_interval`` seconds) is decided
  once per version by the first node to flush it, recorded in ``decision``
  (written to a temporary file and hard-linked into place, so it is created
  exclusively and never seen empty) (``flush`` or ``skip``) so every node follows the same choice
  without any collective; a version is flushed when at least the interval has
  passed since the newest earlier ``flush`` decision.
* **Retention** runs after a commit: ``max_versions`` newest committed versions
  stay on persistent; ``scratch_versions`` (else ``max_versions``) newest stay on
  scratch, each rank deleting only its own shards, oldest first.

Levels are classes so faults can be injected by subclassing one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from . import format as fmt
from .errors import CheckpointWriteError, CorruptCheckpointError
from .fsafe import read_regular
from .shardplan import ShardPlan, TensorSpec

__all__ = ["Level", "ScratchLevel", "PersistentLevel", "plan_of", "flush_job", "write_shard_file", "atomic_write"]

log = logging.getLogger("deepfreeze")
_VDIR = re.compile(r"^v(\d{12})$")
_SCRATCH_FILE = re.compile(r"^(?:r(\d{6})\.dfs|h(\d{6})\.r(\d{6})\.dfs|x(\d{6})\.dfx)$")
MANIFEST = "manifest.json"
ASSEMBLED = "model.dfz"


def _uniq() -> str:
    """Suffix for temporary names, unique across processes and threads."""
    return f"{os.getpid()}.{threading.get_ident()}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing_path(final: str) -> Iterator[str]:
    """Yield a temporary path beside ``final``; when the block ends, rename it to ``final``.
    On an error the temporary file is removed and nothing is left under ``final``."""
    tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.tmp{_uniq()}")
    try:
        yield tmp
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@contextlib.contextmanager
def _replacing(final: str, *, fsync: bool) -> Iterator[int]:
    """Yield the descriptor of an owner-only temporary file beside ``final``; when the block
    ends, fsync it (if asked), close it and rename it to ``final`` (:func:`replacing_path`)."""
    with replacing_path(final) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            yield fd
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: str, data: Any, *, fsync: bool) -> None:
    """Write ``data`` (bytes or an array) to ``path`` by temporary file and rename (and with
    ``fsync``, the file and its directory are flushed)."""
    with _replacing(path, fsync=fsync) as fd:
        _write_all(fd, data, 0)
    if fsync:
        _fsync_dir(os.path.dirname(path))


def _write_all(fd: int, buf: Any, offset: int) -> None:
    view = fmt.byte_view(buf)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + (1 << 30)], offset + done)


def plan_of(manifest: dict[str, Any]) -> ShardPlan:
    tensors = [TensorSpec(t["id"], t["name"], t["dtype"], tuple(t["shape"])) for t in manifest["tensors"]]
    plan = ShardPlan.from_json(tensors, manifest["plan"])
    if plan.world_size != manifest["world_size"]:
        raise CorruptCheckpointError("manifest world_size disagrees with its shard plan")
    return plan


def piece_entries(plan: ShardPlan, pieces: Iterable) -> list[fmt.Entry]:
    return [fmt.Entry(p.tensor_id, plan.tensors[p.tensor_id].dtype, plan.tensors[p.tensor_id].shape,
                      p.start, p.stop) for p in pieces]


class Level:
    """A directory tree of versions for checkpoint names."""

    kind = "level"

    def __init__(self, root: str) -> None:
        self.root = root

    def name_dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def version_dir(self, name: str, version: int) -> str:
        if not 0 <= version < 10 ** 12:
            raise ValueError(f"version {version} out of range [0, 1e12)")
        return os.path.join(self.root, name, f"v{version:012d}")

    def versions(self, name: str) -> list[int]:
        """Every version directory present (committed or not), ascending."""
        try:
            names = os.listdir(self.name_dir(name))
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _VDIR.match(n)))

    def read_manifest(self, name: str, version: int) -> dict[str, Any]:
        path = os.path.join(self.version_dir(name, version), MANIFEST)
        data = read_regular(path, fmt.MAX_MANIFEST_BYTES + 1)  # a FIFO or symlink: CorruptCheckpointError
        m = fmt.decode_manifest(data, path)
        if m["name"] != name or m["version"] != version:
            raise CorruptCheckpointError(f"{path}: manifest is for {m['name']!r} v{m['version']}, "
                                         f"found under {name!r} v{version}")
        return m

    def makedirs(self, path: str) -> None:
        """Create ``path`` and every missing parent owner-only (0700); existing ones are left alone."""
        missing = []
        p = os.path.abspath(path)
        while not os.path.isdir(p):
            missing.append(p)
            p = os.path.dirname(p)
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass


class ScratchLevel(Level):
    """Node-local first level: one shard file per rank and version."""

    kind = "scratch"

    def shard_path(self, name: str, version: int, rank: int) -> str:
        return os.path.join(self.version_dir(name, version), f"r{rank:06d}.dfs")

    def write_shard(self, name: str, version: int, rank: int, plan: ShardPlan,
                    arrays: Sequence[np.ndarray], *, chksum: bool, fsync: bool = False) -> str:
        """Write this rank's pieces (flat arrays, plan order) and commit them by rename."""
        vdir = self.version_dir(name, version)
        final = self.shard_path(name, version, rank)
        for attempt in (1, 2):
            self.makedirs(vdir)
            try:
                write_shard_file(final, version, rank, plan, arrays, chksum=chksum, fsync=fsync)
                return final
            except OSError as e:
                if isinstance(e, FileNotFoundError) and attempt == 1:
                    continue  # another rank's retention removed the empty directory meanwhile
                raise CheckpointWriteError(e.errno, f"writing shard of rank {rank} for {name!r} v{version} to "
                                           f"scratch {vdir} failed: {e.strerror}; nothing was committed. "
                                           "Free space or point 'scratch' elsewhere.") from e
        return final

    def partner_path(self, name: str, version: int, holder: int, src: int) -> str:
        return os.path.join(self.version_dir(name, version), f"h{holder:06d}.r{src:06d}.dfs")

    def parity_path(self, name: str, version: int, holder: int) -> str:
        return os.path.join(self.version_dir(name, version), f"x{holder:06d}.dfx")

    def inventory(self, name: str, version: int) -> dict[str, dict[int, str]]:
        """The files this scratch directory holds of ``version`` (the manifest is the caller's to
        read): ``{"shard": {rank: path}, "partner": {src: path}, "parity": {holder: path}}``."""
        vdir = self.version_dir(name, version)
        inv: dict[str, dict[int, str]] = {"shard": {}, "partner": {}, "parity": {}}
        for n in _listdir(vdir):
            m = _SCRATCH_FILE.match(n)
            if m is None:
                continue
            path = os.path.join(vdir, n)
            if m.group(1) is not None:
                inv["shard"][int(m.group(1))] = path
            elif m.group(3) is not None:
                inv["partner"][int(m.group(3))] = path
            else:
                inv["parity"][int(m.group(4))] = path
        return inv

    def committed(self, name: str) -> dict[int, tuple[dict[str, Any], dict[str, dict[int, str]]]]:
        """Versions with a valid manifest here -> (manifest, :meth:`inventory`)."""
        out = {}
        for v in self.versions(name):
            try:
                m = self.read_manifest(name, v)
            except (OSError, CorruptCheckpointError):
                continue
            out[v] = (m, self.inventory(name, v))
        return out

    def write_manifest(self, name: str, version: int, manifest: dict[str, Any]) -> None:
        atomic_write(os.path.join(self.version_dir(name, version), MANIFEST),
                      fmt.encode_manifest(manifest), fsync=False)

    def retain(self, name: str, rank: int, keep: int, upto: int) -> list[int]:
        """Delete this rank's shards of all but the newest ``keep`` versions up to ``upto``.

        Versions newer than ``upto`` (written by the client while the backend was
        still flushing ``upto``) are not counted: they have not been flushed yet.
        """
        if keep <= 0:
            return []
        removed = []
        for v in [v for v in self.versions(name) if v <= upto][:-keep]:
            vdir = self.version_dir(name, v)
            mine = [n for n in _listdir(vdir) if n == f"r{rank:06d}.dfs" or n == f"x{rank:06d}.dfx"
                    or (n.startswith(f"h{rank:06d}.r") and n.endswith(".dfs"))]
            for n in mine:  # own shard, partner copies and parity this rank holds
                try:
                    os.unlink(os.path.join(vdir, n))
                except FileNotFoundError:
                    pass
            if f"r{rank:06d}.dfs" in mine:
                removed.append(v)
            names = _listdir(vdir)
            if not any(n.endswith((".dfs", ".dfx")) or ".tmp" in n for n in names):
                # rmdir, not rmtree: a lagging rank on this node may create its file in the
                # directory after the listing; rmdir then fails and the directory stays
                # (that rank's own retention removes it later)
                if MANIFEST in names:
                    try:
                        os.unlink(os.path.join(vdir, MANIFEST))
                    except FileNotFoundError:
                        pass
                try:
                    os.rmdir(vdir)
                except OSError:
                    pass
        return removed


def write_shard_file(final: str, version: int, rank: int, plan: ShardPlan, arrays: Sequence[np.ndarray], *,
                     chksum: bool, fsync: bool = False) -> None:
    """Write a rank's shard file (format.py) to ``final``: temporary name, then rename.
    Raises OSError (nothing left behind) or ValueError (arrays do not match the plan)."""
    pieces = plan.for_rank(rank)
    if len(arrays) != len(pieces):
        raise ValueError(f"rank {rank} holds {len(pieces)} pieces, got {len(arrays)} arrays")
    entries = []
    for p, e, a in zip(pieces, piece_entries(plan, pieces), arrays):
        if a.size != p.count or fmt.dtype_name(a.dtype) != e.dtype:
            raise ValueError(f"array for tensor {plan.tensors[p.tensor_id].name!r} piece "
                             f"[{p.start},{p.stop}) has {a.size} {a.dtype} elements")
        entries.append(e)
    entries, data_offset, size = fmt.layout(entries)
    if chksum:
        entries = [dataclasses.replace(e, crc=fmt.crc32(np.ascontiguousarray(a))) for e, a in zip(entries, arrays)]
    with _replacing(final, fsync=fsync) as fd:
        _write_all(fd, fmt.encode_index(fmt.KIND_SHARD, rank, plan.world_size, version, entries,
                                        data_offset, size, chksum), 0)
        for e, a in zip(entries, arrays):
            if e.length:
                _write_all(fd, np.ascontiguousarray(a), e.offset)
        os.ftruncate(fd, size)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


class PersistentLevel(Level):
    """Shared last level: one assembled file per version, committed by its manifest."""

    kind = "persistent"

    def committed_versions(self, name: str) -> list[int]:
        """Versions whose manifest exists and is a valid manifest of this name and version."""
        out = []
        for v in self.versions(name):
            try:
                self.read_manifest(name, v)
            except (OSError, CorruptCheckpointError):
                continue
            out.append(v)
        return out

    def decide(self, name: str, version: int, interval: float) -> bool:
        """Flush ``version``? Decided once by the first node (exclusive create), followed by all."""
        if interval < 0:
            return False
        vdir = self.version_dir(name, version)
        self.makedirs(vdir)
        path = os.path.join(vdir, "decision")
        try:
            with open(path, "rb") as f:
                return f.read(8) == b"flush"
        except FileNotFoundError:
            pass
        flush = True
        if interval > 0:
            # time since the newest earlier version decided "flush" (its decision file's mtime)
            for v in reversed([v for v in self.versions(name) if v < version]):
                try:
                    with open(os.path.join(self.version_dir(name, v), "decision"), "rb") as f:
                        if f.read(8) != b"flush":
                            continue
                        flush = time.time() - os.fstat(f.fileno()).st_mtime >= interval
                        break
                except FileNotFoundError:
                    continue
        if not _create_exclusive(path, b"flush" if flush else b"skip"):
            with open(path, "rb") as f:  # another node decided first: follow it
                return f.read(8) == b"flush"
        return flush

    def mark_skipped(self, name: str, version: int) -> None:
        """Record ``skip`` for a version some node will not flush (unless a decision exists), so
        :meth:`retain` sweeps its directory once a newer version commits."""
        vdir = self.version_dir(name, version)
        if os.path.isdir(vdir):
            _create_exclusive(os.path.join(vdir, "decision"), b"skip")

    def assembled_layout(self, plan: ShardPlan) -> tuple[list[fmt.Entry], int, int]:
        return fmt.layout(piece_entries(plan, plan.pieces), contiguous_tensors=True)

    def flush_shard(self, name: str, version: int, rank: int, shard_path: str,
                    manifest: dict[str, Any], *, fsync: bool = True) -> bool:
        """Copy one rank's shard into the assembled file; finalize if it was the last one.

        Returns True if this call committed the version.
        """
        vdir = self.version_dir(name, version)
        if os.path.exists(os.path.join(vdir, MANIFEST)):
            return False  # already committed (a re-sent flush after a backend restart): nothing to do
        plan = plan_of(manifest)
        layout, _, size = self.assembled_layout(plan)
        where = {(e.tensor_id, e.start): e for e in layout}
        self.makedirs(vdir)
        crcs = []
        with open(shard_path, "rb") as src:
            idx = fmt.read_index(src, shard_path)
            expect = [(p.tensor_id, p.start, p.stop) for p in plan.for_rank(rank)]
            if [(e.tensor_id, e.start, e.stop) for e in idx.entries] != expect or idx.version != version:
                raise CorruptCheckpointError(f"{shard_path}: shard does not match the manifest's plan")
            dst = os.open(os.path.join(vdir, ASSEMBLED + ".partial"), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                for e in idx.entries:
                    _copy_range(src.fileno(), dst, e.length, e.offset, where[(e.tensor_id, e.start)].offset)
                    crcs.append([e.tensor_id, e.start, e.crc])
                if fsync:
                    os.fsync(dst)
                    _drop_cached(dst, [(where[(e.tensor_id, e.start)].offset, e.length) for e in idx.entries])
            finally:
                os.close(dst)
        marker = {"rank": rank, "has_crc": idx.has_crc, "crcs": crcs}
        atomic_write(os.path.join(vdir, f"done.r{rank:06d}.json"), json.dumps(marker).encode(), fsync=fsync)
        return self._try_finalize(name, version, manifest, plan, layout, size, fsync=fsync)

    def _try_finalize(self, name: str, version: int, manifest: dict[str, Any], plan: ShardPlan,
                      layout: list[fmt.Entry], size: int, *, fsync: bool) -> bool:
        vdir = self.version_dir(name, version)
        done = [n for n in _listdir(vdir) if n.startswith("done.r") and n.endswith(".json")]
        if len(done) < plan.world_size:
            return False
        if not self._take_lock(os.path.join(vdir, "commit.lock")):
            return False
        crc = {}
        has_crc = True
        for n in done:
            with open(os.path.join(vdir, n), "rb") as f:
                marker = json.loads(f.read(64 << 20))
            has_crc &= bool(marker["has_crc"])
            for tid, start, c in marker["crcs"]:
                crc[(tid, start)] = c
        entries = [dataclasses.replace(e, crc=crc.get((e.tensor_id, e.start), 0) if has_crc else 0)
                   for e in layout]
        _, data_offset, _ = fmt.layout(entries, contiguous_tensors=True)
        head = fmt.encode_index(fmt.KIND_ASSEMBLED, 0, 1, version, entries, data_offset, size, has_crc)
        partial = os.path.join(vdir, ASSEMBLED + ".partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            _write_all(fd, head, 0)
            os.ftruncate(fd, size)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, os.path.join(vdir, ASSEMBLED))
        final = dict(manifest, assembled={"file": ASSEMBLED, "bytes": size, "checksums": has_crc},
                     committed=time.time())
        atomic_write(os.path.join(vdir, MANIFEST), fmt.encode_manifest(final), fsync=fsync)
        for n in done + ["commit.lock"]:
            try:
                os.unlink(os.path.join(vdir, n))
            except FileNotFoundError:
                pass
        return True

    @staticmethod
    def _take_lock(path: str) -> bool:
        """Create ``path`` exclusively, holding ``host pid``. A lock left by a dead process
        on this host (a finalizer killed mid-commit) is broken and taken over."""
        me = f"{socket.gethostname()} {os.getpid()}".encode()
        for _ in range(2):
            if _create_exclusive(path, me):
                return True
            try:
                with open(path, "rb") as f:
                    host, _, pid = f.read(300).decode(errors="replace").partition(" ")
            except FileNotFoundError:
                continue
            if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
                log.warning("deepfreeze: breaking stale lock %s of dead process %s", path, pid)
                os.unlink(path)
                continue
            return False
        return False

    def retain(self, name: str, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` committed versions (0 = keep all), and the
        directories of versions decided ``skip`` that are older than the newest commit."""
        committed = self.committed_versions(name)
        for v in self.versions(name):
            if committed and v < committed[-1] and v not in committed:
                try:
                    with open(os.path.join(self.version_dir(name, v), "decision"), "rb") as f:
                        skipped = f.read(8) == b"skip"
                except FileNotFoundError:
                    skipped = False
                if skipped:
                    shutil.rmtree(self.version_dir(name, v), ignore_errors=True)
        if keep <= 0:
            return []
        old = committed[:-keep]
        for v in old:
            vdir = self.version_dir(name, v)
            os.unlink(os.path.join(vdir, MANIFEST))  # uncommit first: never a half-deleted "committed" version
            shutil.rmtree(vdir, ignore_errors=True)
        return old


def _create_exclusive(path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` unless it exists; atomic, and never visible empty:
    the content is written to a temporary file first, then hard-linked into place."""
    tmp = f"{path}.tmp{_uniq()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o600)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _drop_cached(fd: int, ranges: Iterable[tuple[int, int]]) -> None:
    """Drop durable (fsynced) byte ranges from the page cache: the node's memory is the training's
    (a parallel file system's client does not keep what it wrote either)."""
    for off, length in ranges:
        try:
            os.posix_fadvise(fd, off, length, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):
            return


def _copy_range(src: int, dst: int, length: int, src_off: int, dst_off: int) -> None:
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src, dst, length - done, src_off + done, dst_off + done)
        except OSError:
            n = 0
        if n <= 0:  # other file systems / old kernels: plain positional copy
            chunk = os.pread(src, min(8 << 20, length - done), src_off + done)
            if not chunk:
                raise CorruptCheckpointError("shard file ended before its index said")
            _write_all(dst, chunk, dst_off + done)
            n = len(chunk)
        done += n


def flush_job(job: dict[str, Any], scratch_cls: type = ScratchLevel,
              persistent_cls: type = PersistentLevel) -> dict[str, Any]:
    """Flush one rank's shard of one version (backend or sync mode). Same code in both modes."""
    name, version, rank = job["name"], job["version"], job["rank"]
    scratch, persistent = scratch_cls(job["scratch"]), persistent_cls(job["persistent"])
    result = {"flushed": False, "committed": False}
    if persistent.decide(name, version, job["persistent_interval"]):
        result["committed"] = persistent.flush_shard(
            name, version, rank, scratch.shard_path(name, version, rank), job["manifest"],
            fsync=job.get("fsync", True))
        result["flushed"] = True
        if result["committed"]:
            persistent.retain(name, job["keep_persistent"])
    elif job["persistent_interval"] >= 0:
        persistent.retain(name, job["keep_persistent"])  # sweeps skipped versions
    scratch.retain(name, rank, job["keep_scratch"], upto=version)
    return result
