"""Dump a model from a memory-tier device to a standard file: ``.npz``, ``.h5`` (Keras weights),
``.safetensors`` (the writers of :mod:`deepfreeze.export`: temporary file, then rename).

Refusal rules (Portus's ``dump`` must not trust what is being written):

* the version to dump is the one asked for, else the newest one any slot header names (an
  ACTIVE slot included); if that version is not DONE and intact on every rank (ACTIVE: being
  written or interrupted; a DONE slot whose image fails its checks), the dump is refused, naming
  the slot and the newest valid version, unless ``force`` (then the registered layout is read
  as it is, unchecked, and the result says ``verified: False``);
* a slot whose header fails its checksum may hold a newer version: refused unless ``version``
  is given or ``force``;
* a multi-rank model whose other ranks' regions are not on this device (other nodes' devices)
  is always refused, naming the missing ranks: ``deepfreeze export`` assembles it from the
  flushed checkpoint instead;
* by default only the model's weights are written (an engine model's manifest records how many
  of its tensors are weights, ``model_tensors``): the file Keras ``load_weights`` takes;
  ``optimizer=True`` adds the optimizer state;
* a name held by models of several jobs (two jobs sharing a checkpoint name on one device) is
  refused, naming the jobs, unless ``job`` picks one (an id, a unique prefix of one as ``view``
  shows it, or ``"unknown"`` for models written before job ids).
"""
from __future__ import annotations

import logging
from typing import Any

from ..errors import CheckpointNotFoundError, MemtierCorruptError, MemtierError
from ..export import ExportError, export, format_from_path
from ..lease import Version
from . import device as mdev
from . import layout as mlayout
from .jobs import job_text, pick_job
from .api import _device, _ranges, assemble, select

__all__ = ["dump"]

log = logging.getLogger("deepfreeze")


def _pick_job(regions: list, job: str | None, name: str, path: str) -> list:
    jobs = sorted({r.job or "unknown" for r in regions})
    if job is None:
        if len(jobs) > 1:
            raise MemtierError(f"{path}: {name!r} is held by models of {len(jobs)} jobs ({', '.join(job_text(j) if j != 'unknown' else j for j in jobs)}): "
                               "pick one with job= (--job ID; 'deepfreeze memtier view' shows each model's job)")
        return regions
    got = pick_job(jobs, job, f"{path}: {name!r}")
    return [r for r in regions if (r.job or "unknown") == got]


def dump(device: "mdev.Device | str", name: str, out_path: str, *, force: bool = False,
         version: "Version | int | None" = None, overwrite: bool = False, job: str | None = None,
         optimizer: bool = False) -> dict[str, Any]:
    """Write version ``version`` (default: the newest) of model ``name`` on ``device`` to
    ``out_path``, in the format its suffix names (``.npz``, ``.h5``/``.hdf5``, ``.safetensors``).
    See the module docstring for what is refused and what ``force`` does; ``overwrite`` replaces
    an existing output. ``job`` picks one job's models when several share the name (see the
    module docstring). ``optimizer``: an engine model's optimizer state is written too (by default
    only the model's weights, which is what Keras ``load_weights`` takes from an ``.h5``).
    Returns ``{"path", "format", "name", "run", "job", "version", "tensors", "bytes", "verified"}``. Errors: :class:`~deepfreeze.errors.CheckpointNotFoundError` (nothing of
    that name or version), :class:`~deepfreeze.errors.MemtierError` (refused),
    :class:`~deepfreeze.export.ExportError` (format or output)."""
    kind = format_from_path(out_path)
    if kind is None:
        raise ExportError(f"{out_path}: cannot tell the format from the name: use .npz, .h5 or .safetensors")
    dev, owns = _device(device, False)
    try:
        regions = dev.find(name)
        if not regions:
            raise CheckpointNotFoundError(f"{dev.path} holds no model named {name!r} ('deepfreeze memtier view' "
                                          "lists them)")
        regions = _pick_job(regions, job, name, dev.path)
        the_job = regions[0].job
        want = version if version is None or isinstance(version, Version) else None

        def match(v: Version) -> bool:
            return version is None or (v == want if want is not None else v.step == version)

        # every slot of every run: (version, run) of the headers that hold one
        headers = []
        torn = []
        for r in regions:
            for k in range(r.nslots):
                h = r.slot_header(k)
                if h is None:
                    torn.append(f"rank {r.rank} slot {k}")
                elif h.state != mlayout.SlotState.EMPTY and h.run == r.run and match(h.version):
                    headers.append((h.version, h.written, r.run))
        if not headers:
            what = f"version {version}" if version is not None else "version"
            raise CheckpointNotFoundError(f"{dev.path} holds no {what} of {name!r}"
                                          + (f" (damaged slot headers: {', '.join(torn[:4])})" if torn else ""))
        target, _, run = max(headers)
        mine = [r for r in regions if r.run == run]
        world = mine[0].world_size
        missing = sorted(set(range(world)) - {r.rank for r in mine})
        if missing:
            raise MemtierError(f"{name!r} (run {run}) has {world} ranks and ranks {_ranges(missing)} are not on "
                               f"{dev.path} (they are on other nodes' devices): a dump needs every rank. Use "
                               f"'deepfreeze export' on the flushed checkpoint instead")
        cands, _ = select(dev, name, the_job, quiet=True)
        good = [c for c in cands if c[2][0][0].run == run]
        newest_valid = good[0][0] if good else None
        problem = None
        if torn and version is None:
            problem = (f"slot header(s) {', '.join(torn[:4])} of {name!r} fail their checksum (a torn write or "
                       "damage) and may hold a newer version")
        else:
            for v, _, slots in good:
                if v == target:
                    try:
                        arrays, manifest = assemble(slots, verify=True)
                    except MemtierCorruptError as e:
                        problem = f"version {target} is damaged ({e})"
                        break
                    return _write(arrays, kind, out_path, overwrite, name, run, target, True, manifest,
                                  optimizer=optimizer, job=the_job)
            if problem is None:
                states = []
                for r in mine:
                    for k in range(r.nslots):
                        h = r.slot_header(k)
                        if h is not None and h.version == target and h.run == run:
                            states.append(f"rank {r.rank} slot {k} {h.state.name}")
                problem = (f"version {target} is not complete and DONE ({', '.join(states) or 'missing on some rank'}; "
                           "ACTIVE: being written or interrupted by a crash)")
        if not force:
            hint = (f"the newest valid version is {newest_valid}: dump it with version={newest_valid.step} "
                    f"(--version {newest_valid.step})" if newest_valid is not None and newest_valid != target
                    else "no other valid version")
            raise MemtierError(f"refusing to dump {name!r} from {dev.path}: {problem}; {hint}, or pass force=True "
                               "(--force) to dump the bytes unchecked")
        slots = {}
        for r in mine:
            for k in range(r.nslots):
                h = r.slot_header(k)
                if h is not None and h.version == target and h.run == run and h.state != mlayout.SlotState.EMPTY:
                    slots[r.rank] = (r, k)
        if len(slots) != world:
            raise MemtierError(f"cannot dump {name!r} {target} even forced: not every rank has a slot for it")
        log.warning("deepfreeze memtier dump: %s %s forced: %s; its bytes are dumped unchecked", name, target, problem)
        arrays, _ = assemble(slots, verify=False)
        r0, k0 = slots[0]
        try:  # which tensors are the model's weights (unverified, as everything here)
            manifest = r0.manifest(k0)
        except MemtierCorruptError:
            manifest = None
        return _write(arrays, kind, out_path, overwrite, name, run, target, False, manifest, optimizer=optimizer,
                      job=the_job, manifest_verified=False)
    finally:
        if owns:
            dev.close()


def weights_only(arrays: dict, manifest: dict | None) -> tuple[dict, int]:
    """``arrays`` without the optimizer state: the manifest's first ``model_tensors`` tensors (what
    the Keras callback records); everything when the manifest does not say (a standalone model).
    Returns (arrays, how many were left out)."""
    n = manifest.get("model_tensors") if manifest is not None else None
    tensors = manifest.get("tensors") if manifest is not None else None
    if not (type(n) is int and isinstance(tensors, list) and 0 < n <= len(tensors)):
        return arrays, 0
    keep = [t.get("name") for t in tensors[:n] if isinstance(t, dict)]
    out = {k: arrays[k] for k in keep if k in arrays}
    return out, len(arrays) - len(out)


def _write(arrays: dict, kind: str, path: str, overwrite: bool, name: str, run: str, version: Version,
           verified: bool, manifest: dict | None, *, optimizer: bool = False, job: str | None = None,
           manifest_verified: bool = True) -> dict[str, Any]:
    meta = {"name": name, "run": run, "version": str(version), "source": "deepfreeze memtier dump",
            "verified": str(verified).lower()}
    if job is not None:
        meta["job"] = job
    if manifest is not None and manifest_verified:
        meta["step"] = str(manifest.get("step"))
    left_out = 0
    if not optimizer:
        arrays, left_out = weights_only(arrays, manifest)
    if left_out:
        meta["optimizer"] = "left out (dump with --optimizer to include it)"
    size = export(arrays, kind, path, metadata=meta, force=overwrite)
    return {"path": path, "format": kind, "name": name, "run": run, "job": job, "version": str(version),
            "tensors": len(arrays), "optimizer_tensors_left_out": left_out, "bytes": size, "verified": verified}
