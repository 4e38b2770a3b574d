"""Migration of stored layer graphs from id scheme 1 to the current scheme (:data:`ids.ID_SCHEME`).

A stored graph holds, per layer, its id, its inputs (every call site's inputs, concatenated) and
its number of tensors; the layer metadata holds what the id hashed besides the inputs. That is all
scheme 2 needs, except two things scheme 1 did not record, recovered or replaced as follows:

* **call sites** of a shared layer (the concatenation hides where one call's inputs end): each
  split is checked against the layer's stored scheme-1 id (the fold of its base with the inputs'
  ids), and the whole graph's scheme-1 ids are recomputed and compared with the stored ones before
  anything is rewritten; a graph that does not reproduce is left as it is (scheme 1) and reported;
* **the order of the model's inputs** (scheme 2 tells inputs of one shape apart by position):
  unknown, so such inputs get ids under another tag (:func:`ids.compute_ids` with
  ``inputs=None``) that never equal ids computed with the positions: the layers behind them load
  through ``mapping=`` or ``match="shape"``; and the **input shapes of shape-dependent layers**
  (Flatten, Reshape, Lambda, TF-op layers), replaced by the full shapes of the model inputs
  upstream of them (so such a layer and what follows it match only a migrated graph of the same
  model at the same resolution).
"""
from __future__ import annotations

import hashlib
import json
import sqlite3
import struct
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Callable

from ..errors import CorruptCheckpointError, RepositoryError
from ..jsonsafe import MAX_CONFIG_DEPTH, loads as bounded_loads
from .graph import decode_graph, encode_graph, tensor_key
from .ids import ID_SCHEME
from .maintenance import SQL_CHUNK
from .ids import Node, _base, _fold, build_graph, compute_ids, topological_order

__all__ = ["scheme1_ids", "migrate_graph", "migrate_repository"]


def scheme1_ids(nodes: Mapping[Hashable, Node], outputs: Sequence[Hashable]) -> dict[Hashable, str]:
    """The ids scheme 1 gave a neutral graph (twins told apart by their whole downstream cone)."""
    order = topological_order(nodes)
    base = {k: _base(n) for k, n in nodes.items()}
    raw: dict[Hashable, bytes] = {}
    depth: dict[Hashable, int] = {}
    for k in order:
        n = nodes[k]
        raw[k] = _fold(base[k], n.calls, raw)
        depth[k] = 1 + max((depth[s] for site in n.calls for s in site), default=-1)
    uses: dict[Hashable, list[tuple[bytes, int, int, Hashable]]] = {k: [] for k in nodes}
    for c, n in nodes.items():
        for si, site in enumerate(n.calls):
            for pos, s in enumerate(site):
                uses[s].append((raw[c], si, pos, c))
    out_pos: dict[Hashable, list[int]] = {k: [] for k in nodes}
    for i, k in enumerate(outputs):
        out_pos[k].append(i)
    down: dict[Hashable, bytes] = {}
    for k in reversed(order):
        entries = [b"o" + struct.pack("<I", i) for i in out_pos[k]]
        entries += [b"c" + rid + struct.pack("<II", si, pos) + down[c] for rid, si, pos, c in uses[k]]
        h = hashlib.sha256(b"down")
        for e in sorted(entries):
            h.update(e)
        down[k] = h.digest()
    levels: dict[int, list[Hashable]] = {}
    for k in order:
        levels.setdefault(depth[k], []).append(k)
    final: dict[Hashable, bytes] = {}
    for d in sorted(levels):
        groups: dict[bytes, list[Hashable]] = {}
        for k in levels[d]:
            groups.setdefault(_fold(base[k], nodes[k].calls, final), []).append(k)
        for fid, members in groups.items():
            if len(members) == 1:
                final[members[0]] = fid
            else:
                for k in members:
                    final[k] = hashlib.sha256(b"twin" + fid + down[k]).digest()[:16]
    return {k: v.hex() for k, v in final.items()}


def _splits(inputs: list[int], config: Mapping[str, Any]) -> list[list[list[int]]]:
    """Candidate call-site structures of a layer whose call sites' inputs were concatenated: one
    call first, then equal splits (the number of calls from ``"__call__"`` when recorded)."""
    n = len(inputs)
    calls = config.get("__call__")
    counts = [len(calls)] if isinstance(calls, list) and calls else []
    counts += [m for m in range(1, n + 1) if n % m == 0 and m not in counts]
    if 1 in counts:
        counts.remove(1)
    counts.insert(0, 1)
    out = []
    for m in counts:
        if n == 0 and m == 1:
            out.append([])
            continue
        size = n // m if m else 0
        if size and size * m == n:
            out.append([inputs[i * size:(i + 1) * size] for i in range(m)])
    return out


def migrate_graph(graph: Mapping[str, Any], meta: Mapping[str, Mapping[str, Any]]
                  ) -> tuple[dict[str, Any], dict[str, str]]:
    """The scheme-2 graph of a stored scheme-1 ``graph`` and ``{old id: new id}``, from the graph
    and the layers' stored metadata. :class:`RepositoryError` when the metadata is missing or the
    scheme-1 ids cannot be reproduced (then nothing may be rewritten)."""
    layers = graph["layers"]
    ids = [layer["id"] for layer in layers]
    missing = [i for i in ids if i not in meta]
    if missing:
        raise RepositoryError(f"no layer metadata for {len(missing)} layer(s) (e.g. {missing[0]})")
    stored = {i: bytes.fromhex(lid) for i, lid in enumerate(ids)}
    nodes: dict[int, Node] = {}
    for i, layer in enumerate(layers):
        m = meta[ids[i]]
        try:
            config = json.dumps(m["config"], sort_keys=True, separators=(",", ":"), allow_nan=False,
                                ensure_ascii=False).encode("utf-8")
            weights = [(tuple(int(d) for d in shape), str(dtype)) for shape, dtype in m["weights"]]
            proto = Node(str(m["class_name"]), config, weights, [])
        except (KeyError, TypeError, ValueError) as e:
            raise RepositoryError(f"layer {ids[i]}: metadata is not a scheme-1 layer record ({e})") from e
        if len(weights) != layer["tensors"]:
            raise RepositoryError(f"layer {ids[i]}: {layer['tensors']} tensors, metadata lists {len(weights)} weights")
        candidates = _splits(list(layer["inputs"]), m["config"] if isinstance(m["config"], dict) else {})
        chosen = candidates[0]
        for sites in candidates:   # the split whose fold is the stored id (not for twins: checked below)
            if _fold(_base(proto), sites, stored)[:16] == stored[i]:
                chosen = sites
                break
        nodes[i] = proto._replace(calls=chosen)
    outputs = list(graph["outputs"])
    try:
        again = scheme1_ids(nodes, outputs)
    except RepositoryError as e:
        raise RepositoryError(f"the scheme-1 graph is not consistent ({e})") from e
    if any(again[i] != ids[i] for i in nodes):
        bad = [ids[i] for i in nodes if again[i] != ids[i]]
        raise RepositoryError(f"the scheme-1 ids of {len(bad)} layer(s) (e.g. {bad[0]}) cannot be reproduced from "
                              f"the stored graph and metadata")
    new = compute_ids(nodes, outputs, None)
    new_graph, _order = build_graph(nodes, outputs, new)
    return new_graph, {ids[i]: new[i] for i in nodes}


def migrate_repository(conn: "sqlite3.Connection", db: str, rollback: Callable[[Any], None]) -> None:
    """Rewrite the layer ids of a repository written with id scheme 1 (this module): each
    live model's graph, tensor keys and layer metadata get scheme-2 ids recomputed from its
    stored graph and metadata, in one transaction, once (settings ``id_scheme`` becomes the
    current scheme). A model whose scheme-1 ids cannot be reproduced keeps its graph (scheme
    1: loaded through ``mapping=`` or ``match="shape"`` only) and is listed in settings
    ``id_migration_failed``."""
    row = conn.execute("SELECT value FROM settings WHERE key='id_scheme'").fetchone()
    if row is None or row[0] != "1" or ID_SCHEME == 1:
        return
    failed: list[str] = []
    try:
        conn.execute("BEGIN IMMEDIATE")
        row = conn.execute("SELECT value FROM settings WHERE key='id_scheme'").fetchone()
        if row is None or row[0] != "1":   # another process migrated meanwhile
            conn.execute("COMMIT")
            return
        models = conn.execute("SELECT id, name, graph FROM models WHERE graph IS NOT NULL AND deleted=0").fetchall()
        for mid, name, blob in models:
            try:
                graph = decode_graph(blob, f"{db}: graph of {name!r}")
            except CorruptCheckpointError:   # a damaged row: reported by reads of that model, left as it is
                failed.append(name)
                continue
            if graph["scheme"] != 1:
                continue
            ids = [layer["id"] for layer in graph["layers"]]
            meta: dict[str, dict] = {}
            texts: dict[str, str] = {}
            for i in range(0, len(ids), SQL_CHUNK):
                chunk = ids[i:i + SQL_CHUNK]
                for lid, text in conn.execute(
                        f"SELECT id, meta FROM layer_meta WHERE id IN ({','.join('?' * len(chunk))})", chunk):
                    try:
                        meta[lid] = bounded_loads(text, "layer meta", max_bytes=len(text.encode()), max_depth=MAX_CONFIG_DEPTH)
                        texts[lid] = text
                    except ValueError:
                        pass
            try:
                new_graph, remap = migrate_graph(graph, meta)
            except RepositoryError:
                failed.append(name)
                continue
            counts = {layer["id"]: layer["tensors"] for layer in graph["layers"]}
            conn.executemany("UPDATE tensors SET key=? WHERE model=? AND key=?",
                             [(tensor_key(new, k), mid, tensor_key(old, k))
                              for old, new in remap.items() for k in range(counts[old])])
            conn.execute("UPDATE models SET graph=? WHERE id=?", (encode_graph(new_graph), mid))
            conn.executemany("INSERT OR IGNORE INTO layer_meta VALUES (?, ?)",
                             [(new, texts[old]) for old, new in remap.items()])
        conn.execute("UPDATE settings SET value=? WHERE key='id_scheme'", (str(ID_SCHEME),))
        if failed:
            conn.execute("INSERT OR REPLACE INTO settings VALUES ('id_migration_failed', ?)", (json.dumps(failed),))
        conn.execute("COMMIT")
    except sqlite3.DatabaseError as e:
        rollback(conn)
        raise RepositoryError(f"{db}: cannot migrate the repository's layer ids to scheme {ID_SCHEME} "
                              f"({e}); nothing was changed. Open it with the DeepFreeze that wrote it, or "
                              f"restore it from a backup") from e
