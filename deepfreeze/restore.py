"""Restore: read a committed version back into numpy arrays (no TensorFlow here).

Order for the newest version (or the one asked for): the scratch directory
when every shard is there and valid, else the assembled file on persistent.
A version that cannot be read whole from any level is skipped with a log
line (when no version was asked for), never returned partially. Works in any
process, at any world size: the manifest's plan says where every piece is.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Sequence

import numpy as np

from . import format as fmt
from .config import Config, validate_name
from .errors import CheckpointNotFoundError, CorruptCheckpointError, DeepFreezeError
from .levels import ASSEMBLED, PersistentLevel, ScratchLevel, plan_of

__all__ = ["Checkpoint", "load", "list_versions"]

log = logging.getLogger("deepfreeze")


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


def _levels(config: Config) -> tuple[ScratchLevel, PersistentLevel]:
    return ScratchLevel(config.scratch), PersistentLevel(config.persistent)


def list_versions(config: Config, name: str) -> dict[int, list[str]]:
    """Committed versions -> levels that hold them complete (``scratch``, ``persistent``)."""
    validate_name(name)
    scratch, persistent = _levels(config)
    out: dict[int, list[str]] = {}
    for v in scratch.complete_versions(name):
        out.setdefault(v, []).append("scratch")
    for v in persistent.committed_versions(name):
        out.setdefault(v, []).append("persistent")
    return dict(sorted(out.items()))


def load(config: Config, name: str, version: int | None = None, *, verify: bool = True,
         tensors: Sequence[str] | None = None) -> Checkpoint:
    """Load version ``version`` (default: the newest that can be read whole) of ``name``.

    ``tensors`` restricts the read to those tensor names (the index locates each
    piece, so nothing else is read); by default every tensor is loaded.
    """
    validate_name(name)
    versions = list_versions(config, name)
    if version is not None:
        if version not in versions:
            raise CheckpointNotFoundError(
                f"version {version} of checkpoint {name!r} is not committed in scratch {config.scratch} "
                f"or persistent {config.persistent}; committed versions: {sorted(versions) or 'none'}")
        candidates = [version]
    else:
        candidates = sorted(versions, reverse=True)
        if not candidates:
            raise CheckpointNotFoundError(
                f"no committed checkpoint named {name!r} in scratch {config.scratch} or persistent "
                f"{config.persistent}: check 'name' and the config, or train with the callback first")
    scratch, persistent = _levels(config)
    errors = []
    for v in candidates:
        for level in versions[v]:
            try:
                if level == "scratch":
                    return _load_scratch(scratch, name, v, verify, tensors)
                return _load_persistent(persistent, name, v, verify, tensors)
            except CheckpointNotFoundError:
                raise  # a tensor name the checkpoint does not have: no other level will have it
            except (OSError, DeepFreezeError, ValueError) as e:
                log.warning("deepfreeze: %s v%d on %s is unreadable (%s); trying the next level/version",
                            name, v, level, e)
                errors.append(f"v{v} {level}: {e}")
    if version is not None and len(errors) == 1:
        raise CorruptCheckpointError(errors[0])
    raise CorruptCheckpointError(f"no version of {name!r} could be read whole: " + "; ".join(errors))


def _empty_arrays(manifest: dict[str, Any], wanted: Sequence[str] | None
                  ) -> tuple[list[np.ndarray | None], dict[str, np.ndarray]]:
    """Output arrays for the wanted tensors (None for the others), flat views and by name."""
    names = [t["name"] for t in manifest["tensors"]]
    if wanted is not None:
        missing = sorted(set(wanted) - set(names))
        if missing:
            raise CheckpointNotFoundError(f"{manifest['name']!r} v{manifest['version']} has no tensor named "
                                          f"{missing[0]!r}; it has {len(names)} tensors, e.g. {names[:3]}")
    flats: list[np.ndarray | None] = []
    named = {}
    for t in manifest["tensors"]:
        if wanted is not None and t["name"] not in wanted:
            flats.append(None)
            continue
        a = np.empty(t["shape"], dtype=fmt.numpy_dtype(t["dtype"]))
        flats.append(a.reshape(-1))
        named[t["name"]] = a
    return flats, named


def _fill(path: str, entries_expected: list[tuple[int, int, int]], flats: list[np.ndarray],
          manifest: dict[str, Any], verify: bool, version: int) -> None:
    with open(path, "rb") as f:
        idx = fmt.read_index(f, path)
        got = [(e.tensor_id, e.start, e.stop) for e in idx.entries]
        if got != entries_expected or idx.version != version:
            raise CorruptCheckpointError(f"{path}: its index does not match the manifest (another model "
                                         "or version wrote it)")
        for e in idx.entries:
            t = manifest["tensors"][e.tensor_id]
            if e.dtype != t["dtype"] or list(e.shape) != t["shape"]:
                raise CorruptCheckpointError(f"{path}: tensor {t['name']!r} is {e.dtype}{list(e.shape)} in the "
                                             f"file but {t['dtype']}{t['shape']} in the manifest")
            if flats[e.tensor_id] is not None:
                fmt.read_entry(f, e, flats[e.tensor_id][e.start:e.stop], verify=verify and idx.has_crc, path=path)


def _load_scratch(level: ScratchLevel, name: str, version: int, verify: bool,
                  wanted: Sequence[str] | None) -> Checkpoint:
    m = level.read_manifest(name, version)
    plan = plan_of(m)
    flats, named = _empty_arrays(m, wanted)
    for r in range(plan.world_size):
        expected = [(p.tensor_id, p.start, p.stop) for p in plan.for_rank(r)]
        if all(flats[p.tensor_id] is None for p in plan.for_rank(r)):
            continue  # this rank's shard holds none of the wanted tensors
        _fill(level.shard_path(name, version, r), expected, flats, m, verify, version)
    return Checkpoint(name, version, m["step"], m["epoch"], "scratch", named, m)


def _load_persistent(level: PersistentLevel, name: str, version: int, verify: bool,
                     wanted: Sequence[str] | None) -> Checkpoint:
    m = level.read_manifest(name, version)
    plan = plan_of(m)
    flats, named = _empty_arrays(m, wanted)
    path = os.path.join(level.version_dir(name, version), m.get("assembled", {}).get("file", ASSEMBLED))
    _fill(path, [(p.tensor_id, p.start, p.stop) for p in plan.pieces], flats, m, verify, version)
    return Checkpoint(name, version, m["step"], m["epoch"], "persistent", named, m)
