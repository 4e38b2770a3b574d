"""The scratch tier: node-local shard files, one per rank and version.

Layout::

    <scratch>/<name>/v<version:012d>/r<rank:06d>.dfs   one shard file per rank (format.py)
    <scratch>/<name>/v<version:012d>/h<holder>.r<src>.dfs  partner copy of rank src's shard (redundancy.py)
    <scratch>/<name>/v<version:012d>/x<holder>.dfx     parity block held by rank holder (redundancy.py)
    <scratch>/<name>/v<version:012d>/manifest.json     written by every local rank after its shard

A rank's shard is written to a temporary name and renamed into place, then the version's
``manifest.json`` (the commit protocol's "Scratch" step: :mod:`deepfreeze.tiers.persistent`). With
``ec_interval`` due, the partner/parity exchange (:func:`deepfreeze.redundancy.protect`) is a step
of this tier's write, between the shard's rename and the manifest (:meth:`ScratchLevel.write_version`):
scratch holds shard, partner copies or parity block, manifest, in that order. Retention deletes
a rank's own files (the partner copies and parity block it holds with its shard).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from .. import crashpoints as cp
from .. import format as fmt
from .. import ownership
from ..errors import CheckpointWriteError, DeepFreezeError, UnsafePathError, UntrustedOwnerError
from ..format import ANONYMOUS_RUN
from ..fsafe import atomic_write, open_regular
from ..fused import FusedShard
from ..redundancy import protect
from ..shardplan import ShardPlan
from .base import MANIFEST, Level
from .job import SCRATCH, register as register_source
from .shardbytes import _FdFile, _listdir, write_shard_file

__all__ = ["ScratchLevel"]

log = logging.getLogger("deepfreeze")
_SCRATCH_FILE = re.compile(r"^(?:r(\d{6})\.dfs|h(\d{6})\.r(\d{6})\.dfs|x(\d{6})\.dfx)$")


class ScratchLevel(Level):
    """Node-local first level: one shard file per rank and version."""

    kind = "scratch"

    def shard_path(self, name: str, version: int, rank: int) -> str:
        return os.path.join(self.version_dir(name, version), f"r{rank:06d}.dfs")

    def write_shard(self, name: str, version: int, rank: int, plan: ShardPlan,
                    arrays: "Sequence[np.ndarray] | FusedShard", *, chksum: bool, fsync: bool = False,
                    run: str = ANONYMOUS_RUN) -> str:
        """Write this rank's pieces (flat arrays, plan order, or one
        :class:`~deepfreeze.fused.FusedShard` of this plan and rank; :func:`write_shard_file`) and
        commit them by rename; the header carries ``run``, the id of the run that wrote it."""
        vdir = self.version_dir(name, version)
        final = self.shard_path(name, version, rank)
        for attempt in (1, 2):
            self.makedirs(vdir)
            try:
                write_shard_file(final, version, rank, plan, arrays, chksum=chksum, fsync=fsync, run=run)
                return final
            except OSError as e:
                if isinstance(e, FileNotFoundError) and attempt == 1:
                    continue  # another rank's retention removed the empty directory meanwhile
                raise CheckpointWriteError(e.errno, f"writing shard of rank {rank} for {name!r} v{version} to "
                                           f"scratch {vdir} failed: {e.strerror}; nothing was committed. "
                                           "Free space or point 'scratch' elsewhere.") from e
        return final

    def write_version(self, name: str, version: int, rank: int, plan: ShardPlan,
                      arrays: "Sequence[np.ndarray] | FusedShard", manifest: dict[str, Any], *, chksum: bool,
                      run: str = ANONYMOUS_RUN, comm: Any = None, redundancy: dict[str, Any] | None = None,
                      due: Callable[[], bool] | None = None) -> bool:
        """The scratch tier's write of one version by one rank: its shard (:meth:`write_shard`), then,
        with ``redundancy`` (:func:`deepfreeze.redundancy.plan_redundancy`), the collective partner
        or parity exchange over ``comm`` (:func:`deepfreeze.redundancy.protect`; ``due()``, asked once
        the shard is renamed into place, says whether this version is to be protected), then the
        version's manifest (naming the scheme when the exchange protected it). A rank whose shard
        write failed still takes part in the exchange, so nobody waits for it, then raises. True
        when the version was protected."""
        try:
            path: str | None = self.write_shard(name, version, rank, plan, arrays, chksum=chksum, run=run)
            failure = None
        except BaseException as e:  # still take part in the exchange below, so nobody waits for us
            path, failure = None, e
        protected = False
        if redundancy is not None:
            protected = protect(comm, self, name, version, rank, path, redundancy, want=due is None or due(), run=run)
            if protected:
                manifest = dict(manifest, redundancy=redundancy)
        if failure is not None:
            raise failure
        self.write_manifest(name, version, manifest)
        return protected

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
            if os.path.islink(path):
                continue  # never followed: not a file of this version
            if m.group(1) is not None:
                inv["shard"][int(m.group(1))] = path
            elif m.group(3) is not None:
                inv["partner"][int(m.group(3))] = path
            else:
                inv["parity"][int(m.group(4))] = path
        return inv

    def committed(self, name: str, generation: int | None = None
                  ) -> dict[int, tuple[dict[str, Any], dict[str, dict[int, str]]]]:
        """Versions with a valid manifest here (of ``generation``, when given) ->
        (manifest, :meth:`inventory`)."""
        out = {}
        for v in self.versions(name):
            try:
                m = self.read_manifest(name, v)
            except UntrustedOwnerError as e:
                log.warning("deepfreeze: %s v%d on scratch is ignored: %s", name, v, e)
                continue
            except (OSError, DeepFreezeError, ValueError):
                continue
            if generation is not None and fmt.manifest_run(m)[1] != generation:
                continue
            out[v] = (m, self.inventory(name, v))
        return out

    def write_manifest(self, name: str, version: int, manifest: dict[str, Any]) -> None:
        atomic_write(os.path.join(self.version_dir(name, version), MANIFEST),
                     fmt.encode_manifest(manifest), fsync=False, point="scratch.manifest")

    @staticmethod
    def _own_files(names: Iterable[str], rank: int) -> list[str]:
        return [n for n in names if n == f"r{rank:06d}.dfs" or n == f"x{rank:06d}.dfx"
                or (n.startswith(f"h{rank:06d}.r") and n.endswith(".dfs"))]

    def _remove_own(self, vdir: str, rank: int, point: str) -> bool:
        """Remove this rank's files in ``vdir`` (own shard, partner copies and parity it holds),
        then the manifest and the directory once no rank's file is left. True if the own shard
        was there."""
        try:  # through a descriptor of the directory: a symbolic link is never followed
            fd = ownership.open_dir_nofollow(vdir)
        except (FileNotFoundError, NotADirectoryError, UnsafePathError):
            return False
        try:
            names = os.listdir(fd)
            mine = self._own_files(names, rank)
            for n in mine:
                try:
                    cp.unlink(n, point, dir_fd=fd)
                except FileNotFoundError:
                    pass
            names = os.listdir(fd)
            if not any(n.endswith((".dfs", ".dfx")) or ".tmp" in n for n in names):
                # rmdir, not rmtree: a lagging rank on this node may create its file in the
                # directory after the listing; rmdir then fails and the directory stays
                # (that rank's own retention removes it later)
                if MANIFEST in names:
                    try:
                        cp.unlink(MANIFEST, "scratch.retain.manifest", dir_fd=fd)
                    except FileNotFoundError:
                        pass
                try:
                    cp.rmdir(vdir, "scratch.retain.rmdir")  # rmdir never follows a link
                except OSError:
                    pass
        finally:
            os.close(fd)
        return f"r{rank:06d}.dfs" in mine

    def retain(self, name: str, rank: int, keep: int, upto: int) -> list[int]:
        """Delete this rank's shards of all but the newest ``keep`` versions up to ``upto``.

        Versions newer than ``upto`` (written by the client while the backend was
        still flushing ``upto``) are not counted: they have not been flushed yet.
        """
        if keep <= 0:
            return []
        removed = []
        for v in [v for v in self.versions(name) if v <= upto][:-keep]:
            if self._remove_own(self.version_dir(name, v), rank, "scratch.retain.unlink"):
                removed.append(v)
        return removed

    def clear(self, name: str, rank: int, above: int | None = None) -> list[int]:
        """Remove this rank's files of every version above ``above`` (all when None): a new run
        that resumed from ``above`` (or overwrites the name) rewrites those numbers."""
        removed = []
        for v in self.versions(name):
            if above is None or v > above:
                if self._remove_own(self.version_dir(name, v), rank, "scratch.clear.unlink"):
                    removed.append(v)
        return removed


@contextlib.contextmanager
def _open_scratch(shard_path: str | None, source: None
                  ) -> Iterator[tuple[int, int, fmt.ShardIndex, str, Any]]:
    """The ``scratch`` source kind's opener (:mod:`deepfreeze.tiers.job`'s table): the rank's shard
    file, as ``(fd, base, index, label, recheck)`` (a scratch file is never rewritten: no recheck)."""
    fd = open_regular(shard_path)
    try:
        yield fd, 0, fmt.read_index(_FdFile(fd), shard_path), shard_path, (lambda: None)
    finally:
        os.close(fd)


# the scratch tier's source kind, the default (deepfreeze.tiers.job's table)
register_source(SCRATCH, open=_open_scratch)
