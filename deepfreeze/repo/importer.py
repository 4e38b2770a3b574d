"""``repo import``: a DeepFreeze checkpoint version into a repository, without re-serializing.

The Keras callback records, in every manifest it writes, the model's compact layer graph and
which checkpoint tensor holds each layer weight (the manifest key ``"layers"``)::

    "layers": {"graph": <plain-data graph, deepfreeze.repo.graph>,
               "tensors": [checkpoint tensor id of each key of tensor_keys(graph), in that order]}

so a checkpoint imports with no model at hand. An older checkpoint (no ``"layers"``) imports with
a ``layers`` record computed from a model built the same way (``deepfreeze repo import --model
module:function``, :func:`deepfreeze.keras.repo.layer_record`).

Into an embedded repository, a version committed on persistent is imported by adding its
assembled file as a pack (a hard link on the same file system, else a copy; the file already is in
the DeepFreeze format with a per-tensor index): no tensor is decoded or re-encoded, and only the
model weights are referenced (the optimizer's bytes stay unreferenced in the pack, shared with the
checkpoint when linked). Otherwise (a remote repository, or a version readable only from scratch)
the weights are read with :func:`deepfreeze.load` (checksums verified) and stored with ``put``.
"""
from __future__ import annotations

import os
from typing import Any

from ..config import Config, validate_name
from ..errors import CheckpointNotFoundError, ModelMismatchError, RepositoryError
from ..tiers.persistent import ASSEMBLED, PersistentLevel
from .graph import check_graph, tensor_keys
from .ids import ID_SCHEME
from .names import check_name
from .store import tensor_entries

__all__ = ["checkpoint_layers", "import_checkpoint"]


def checkpoint_layers(manifest: dict[str, Any], where: str = "<manifest>") -> dict[str, Any] | None:
    """The validated ``"layers"`` record of a manifest, None when it has none."""
    rec = manifest.get("layers")
    if rec is None:
        return None
    try:
        if not isinstance(rec, dict) or set(rec) != {"graph", "tensors"}:
            raise RepositoryError("expected exactly the keys 'graph' and 'tensors'")
        graph = check_graph(rec["graph"])
        if graph["scheme"] != ID_SCHEME:
            raise RepositoryError(f"its layer ids are of scheme {graph['scheme']}, this DeepFreeze computes "
                                  f"scheme {ID_SCHEME}")
        keys = tensor_keys(graph)
        ids = rec["tensors"]
        n = manifest.get("model_tensors", len(manifest["tensors"]))
        if not isinstance(ids, list) or len(ids) != len(keys) or not all(  # types first: set() needs hashables
                type(i) is int and 0 <= i < min(n, len(manifest["tensors"])) for i in ids) or len(set(ids)) != len(ids):
            raise RepositoryError(f"'tensors' must be {len(keys)} distinct model tensor ids")
    except RepositoryError as e:
        raise RepositoryError(f"{where}: the recorded layer graph is malformed ({e}); import the version with "
                              "--model MODULE:FUNCTION to compute it from the model instead") from e
    return rec


def _check_shapes(manifest: dict[str, Any], layers: dict[str, Any]) -> None:
    meta = layers.get("specs")
    if meta is None:
        return
    for key, tid in zip(tensor_keys(layers["graph"]), layers["tensors"]):
        t = manifest["tensors"][tid]
        want = meta.get(key)
        if want is not None and (tuple(want[1]) != tuple(t["shape"]) or want[0] != t["dtype"]):
            raise ModelMismatchError(f"checkpoint tensor {t['name']!r} is {t['dtype']}{tuple(t['shape'])} but the "
                                     f"model's weight {key} is {want[0]}{tuple(want[1])}: the model given with "
                                     "--model is not the one that was checkpointed")


def import_checkpoint(repo: Any, name: str, config: "str | os.PathLike[str] | Config | None", checkpoint: str, *,
                      version: int | None = None, layers: dict[str, Any] | None = None,
                      trust_owners: Any = None) -> dict[str, Any]:
    """Store version ``version`` (default: the newest restorable) of checkpoint ``checkpoint`` as
    repository model ``name``. ``layers``: the record to use when the manifest has none (see the
    module docstring; it may carry ``"specs"``: key -> (dtype, shape), checked against the
    checkpoint). Returns ``{"name", "version", "step", "how", "bytes"}``: ``how`` is ``"linked"`` or ``"copied"``
    (the assembled file added as a pack: a hard link, or a copy across file systems) or ``"stored"``
    (read and put)."""
    from ..loader import list_versions, load

    check_name(name)
    cfg = Config.resolve(config)
    validate_name(checkpoint)
    versions = list_versions(cfg, checkpoint, trust_owners=trust_owners)
    if not versions:
        raise CheckpointNotFoundError(f"checkpoint {checkpoint!r} has no restorable version in scratch "
                                      f"{cfg.scratch} or persistent {cfg.persistent}")
    if version is None:
        version = max(versions)
    elif version not in versions:
        raise CheckpointNotFoundError(f"checkpoint {checkpoint!r} has no restorable version {version}: pick one of "
                                      f"the restorable versions {', '.join(map(str, sorted(versions)))} (or leave "
                                      "the version out for the newest)")
    pers = PersistentLevel(cfg.persistent, trust_owners=trust_owners)
    add_pack = getattr(repo, "add_pack", None)
    if "persistent" in versions[version] and add_pack is not None:
        manifest = pers.read_manifest(checkpoint, version)
        rec = checkpoint_layers(manifest, f"{checkpoint} v{version}") or layers
        if rec is None:
            raise RepositoryError(f"checkpoint {checkpoint!r} v{version} records no layer graph (written before "
                                  "DeepFreeze recorded one, or the model's graph could not be computed): import it "
                                  "with --model MODULE:FUNCTION building the same model")
        _check_shapes(manifest, rec)
        vdir = pers.version_dir(checkpoint, version)
        path = os.path.join(vdir, (manifest.get("assembled") or {}).get("file", ASSEMBLED))
        entries = tensor_entries(path)
        mapping = {}
        for key, tid in zip(tensor_keys(rec["graph"]), rec["tensors"]):
            if tid not in entries:
                raise RepositoryError(f"{path}: tensor {tid} ({manifest['tensors'][tid]['name']!r}) is not in the "
                                      "assembled file although the manifest lists it: this version is damaged; "
                                      "import another version (--version)")
            mapping[key] = entries[tid]
        out = add_pack(name, path, mapping, rec["graph"], None)
        return {"name": name, "version": version, "step": manifest["step"], "how": out.get("how", "linked"),
                "bytes": out["bytes"]}
    ck = load(cfg, checkpoint, version, trust_owners=trust_owners)
    rec = checkpoint_layers(ck.manifest, f"{checkpoint} v{version}") or layers
    if rec is None:
        raise RepositoryError(f"checkpoint {checkpoint!r} v{version} records no layer graph: import it with "
                              "--model MODULE:FUNCTION building the same model")
    _check_shapes(ck.manifest, rec)
    tensors = {key: ck.arrays[ck.manifest["tensors"][tid]["name"]]
               for key, tid in zip(tensor_keys(rec["graph"]), rec["tensors"])}
    repo.put(name, tensors, rec["graph"])
    return {"name": name, "version": version, "step": ck.step, "how": "stored",
            "bytes": sum(a.nbytes for a in tensors.values())}
