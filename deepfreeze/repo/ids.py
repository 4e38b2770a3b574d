"""Stable layer ids (DStore section 4, Alg. 1, with its traps fixed): framework-neutral, no TensorFlow.

A layer's id is a SHA-256 hash, truncated to 16 bytes (32 hex digits), of

* its *base*: the class name, the canonical config (:func:`canonical_config`: ``get_config()``
  without the deny-list ``name``, ``trainable``, ``dtype`` (dtype policies included) and every
  ``*_initializer``, ``*_regularizer``, ``*_constraint`` key, as JSON with sorted keys) and the
  shapes and dtypes of its weights, in weight order;
* folded with the ids of its inputs, in input order, for every call site of the layer in node
  order (a shared layer called twice folds both call sites). The fold is unconditional (the
  paper's Alg. 1 folds an input only the first time it is seen, which makes ids depend on the
  traversal order).

So an id depends on the layer and on its whole upstream down to the model's inputs (whose shapes
are part of their config), never on a Keras auto-name or on the order the layers were created.
Two layers of different models have the same id exactly when they and everything upstream of
them are identical: the transfer-learning prefix.

**Twins.** Structurally identical siblings on the same inputs (two identical heads on one trunk)
hash alike, since a hash sees only the upstream. Such a group is told apart by the layers'
position *downstream*: a label hashed from where each member's output goes (its indices among
the model's outputs, and for each consuming layer the call site, the input position and, in
turn, that consumer's own downstream label). The label is folded into the members' ids only, so
layers that are not twins keep their plain upstream id (and a trunk keeps its ids whatever heads
are put on it). Creation order never enters. Members still indistinguishable after that (same
upstream, same downstream position) raise :class:`RepositoryError` rather than share an id.

Everything is computed iteratively (a 1500-layer chain is fine); a cycle, which only a shared
layer can create, raises :class:`RepositoryError` naming the layers on it.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import struct
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, NamedTuple

from ..errors import RepositoryError
from .graph import check_graph

__all__ = ["ID_SCHEME", "Node", "canonical_config", "compute_ids", "topological_order",
           "build_graph", "build_meta", "DENY_KEYS", "DENY_SUFFIXES"]

ID_SCHEME = 1
"""Version of the id scheme below; recorded in every stored graph (``graph["scheme"]``)."""

DENY_KEYS = frozenset({"name", "trainable", "dtype"})
"""Config keys dropped before hashing: unstable labels (``name``), flags that flip when a model is
frozen (``trainable``), and the dtype policy (the weights' dtypes are hashed instead)."""
DENY_SUFFIXES = ("_initializer", "_regularizer", "_constraint")
"""Config key suffixes dropped before hashing: how weights are initialized or trained, not what
the layer computes."""

_TAG = b"deepfreeze-layer-id/1\0"


class Node(NamedTuple):
    """A leaf layer of the neutral graph :func:`compute_ids` takes.

    ``config``: :func:`canonical_config` bytes; ``weights``: ``(shape, dtype name)`` of each
    weight in weight order; ``calls``: one list of input node keys per call site, in node order
    (empty for a model input)."""
    class_name: str
    config: bytes
    weights: Sequence[tuple[Sequence[int], str]]
    calls: Sequence[Sequence[Hashable]]


def _strip(value: Any) -> Any:
    """``value`` with the deny-list keys dropped from every config dict in it: the dict itself and
    every nested dict (the configs of wrapped layers and other serialized objects)."""
    # iterative: a config nested deeply must not hit the recursion limit either
    root: list[Any] = [None]
    stack: list[tuple[Any, list[Any] | dict[Any, Any], Any]] = [(value, root, 0)]
    while stack:
        v, parent, slot = stack.pop()
        if isinstance(v, Mapping):
            out: dict[Any, Any] = {}
            for k, item in v.items():
                if isinstance(k, str) and (k in DENY_KEYS or k.endswith(DENY_SUFFIXES)):
                    continue
                out[k] = None
                stack.append((item, out, k))
            parent[slot] = out
        elif isinstance(v, (list, tuple)):
            lst: list[Any] = [None] * len(v)
            for i, item in enumerate(v):
                stack.append((item, lst, i))
            parent[slot] = lst
        else:
            parent[slot] = v
    return root[0]


def canonical_config(config: Mapping[str, Any], calls: Sequence[Any] | None = None) -> bytes:
    """The canonical bytes of a layer config: the deny-list keys (:data:`DENY_KEYS`, keys ending
    in :data:`DENY_SUFFIXES`) dropped at every level, then JSON with sorted keys and compact
    separators (UTF-8).

    ``calls``: the non-tensor arguments of each call site, when a layer has any (``x * 2.0``,
    ``tf.cast(x, "float16")``, slices): plain JSON values, added as given (no deny-list) under
    the key ``"__call__"`` so they are part of the id. :class:`RepositoryError` when the config
    holds a value JSON cannot represent (an array, an object, NaN or infinity): the layer's
    ``get_config()`` must return plain JSON values for it to get a stable id."""
    if not isinstance(config, Mapping):
        raise RepositoryError(f"a layer config must be a dict, not {type(config).__name__}")
    value = _strip(config)
    if calls is not None:
        value["__call__"] = list(calls)
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise RepositoryError(f"layer config is not plain JSON ({e}); a layer needs a get_config() of "
                              f"plain JSON values (numbers, strings, lists, dicts) to get a stable id") from e
    return text.encode("utf-8")


def _base(node: Node) -> bytes:
    """Digest of what a layer is on its own: class, canonical config, weight specs."""
    specs = [[[int(d) for d in shape], str(dtype)] for shape, dtype in node.weights]
    head = json.dumps([node.class_name, specs], separators=(",", ":")).encode("utf-8")
    h = hashlib.sha256(_TAG)
    h.update(struct.pack("<Q", len(head)))
    h.update(head)
    h.update(node.config)
    return h.digest()


def _fold(base: bytes, calls: Sequence[Sequence[Hashable]], ids: Mapping[Hashable, bytes]) -> bytes:
    """16-byte id of a layer: its base folded with its inputs' ids, every call site in order."""
    h = hashlib.sha256(base)
    h.update(struct.pack("<I", len(calls)))
    for site in calls:
        h.update(struct.pack("<I", len(site)))
        for k in site:
            h.update(ids[k])
    return h.digest()[:16]


def _check(nodes: Mapping[Hashable, Any], outputs: Sequence[Hashable]) -> dict[Hashable, Node]:
    out: dict[Hashable, Node] = {}
    for key, n in nodes.items():
        n = n if isinstance(n, Node) else Node(*n)
        if not isinstance(n.config, (bytes, bytearray)):
            raise RepositoryError(f"layer {key!r}: config must be canonical_config() bytes")
        for site in n.calls:
            for k in site:
                if k not in nodes:
                    raise RepositoryError(f"layer {key!r} takes input {k!r}, which is not a layer of the graph")
        out[key] = n
    for k in outputs:
        if k not in nodes:
            raise RepositoryError(f"model output {k!r} is not a layer of the graph")
    return out


def topological_order(nodes: Mapping[Hashable, Any], priority: Mapping[Hashable, Any] | None = None
                      ) -> list[Hashable]:
    """The node keys, every layer after all its inputs (Kahn's algorithm; ties broken by
    ``priority[key]`` when given, which makes the order independent of the dict's order).
    :class:`RepositoryError` naming the layers on a cycle (a shared layer fed, directly or not,
    by its own output)."""
    nodes = {k: (n if isinstance(n, Node) else Node(*n)) for k, n in nodes.items()}
    indeg = {k: 0 for k in nodes}
    users: dict[Hashable, list[Hashable]] = {k: [] for k in nodes}
    for k, n in nodes.items():
        for src in {s for site in n.calls for s in site}:
            indeg[k] += 1
            users[src].append(k)
    if priority is None:
        ready: list[Any] = [(0, i, k) for i, k in enumerate(nodes) if indeg[k] == 0]
        seq = {k: i for i, k in enumerate(nodes)}
    else:
        ready = [(priority[k], 0, k) for k in nodes if indeg[k] == 0]
        seq = {k: 0 for k in nodes}
    heapq.heapify(ready)
    order: list[Hashable] = []
    while ready:
        *_, k = heapq.heappop(ready)
        order.append(k)
        for u in users[k]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, (priority[u] if priority is not None else 0, seq[u], u))
    if len(order) != len(nodes):
        stuck = sorted((repr(k) for k in nodes if indeg[k] > 0))
        raise RepositoryError(f"the layer graph has a cycle (a shared layer fed by its own output) through "
                              f"{', '.join(stuck[:10])}{' ...' if len(stuck) > 10 else ''}; such a model has "
                              f"no stable layer ids")
    return order


def compute_ids(nodes: Mapping[Hashable, Any], outputs: Sequence[Hashable]) -> dict[Hashable, str]:
    """The id (32 hex digits) of every node of a neutral layer graph.

    ``nodes``: key -> :class:`Node` (or a 4-tuple of its fields); ``outputs``: the keys of the
    model's outputs, in output order (an output listed twice counts twice). Keys are any hashable
    labels; they never enter an id. Ids are unique; see the module docstring for the scheme.
    :class:`RepositoryError` on a cycle, on a dangling input, or when two layers cannot be told
    apart."""
    nodes = _check(nodes, outputs)
    order = topological_order(nodes)
    base = {k: _base(n) for k, n in nodes.items()}

    # pass 1: plain upstream ids (no twin disambiguation) and the depth of every node
    raw: dict[Hashable, bytes] = {}
    depth: dict[Hashable, int] = {}
    for k in order:
        n = nodes[k]
        raw[k] = _fold(base[k], n.calls, raw)
        depth[k] = 1 + max((depth[s] for site in n.calls for s in site), default=-1)

    # pass 2: downstream labels, consumers first (reverse topological order)
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

    # pass 3: final ids level by level; a group of equal ids within a level (twins: same layer on
    # the same inputs) gets each member's downstream label folded in
    levels: dict[int, list[Hashable]] = {}
    for k in order:
        levels.setdefault(depth[k], []).append(k)
    final: dict[Hashable, bytes] = {}
    owner: dict[bytes, Hashable] = {}
    for d in sorted(levels):
        groups: dict[bytes, list[Hashable]] = {}
        for k in levels[d]:
            groups.setdefault(_fold(base[k], nodes[k].calls, final), []).append(k)
        for fid, members in groups.items():
            if len(members) == 1:
                final[members[0]] = fid
                continue
            labels: dict[bytes, Hashable] = {}
            for k in members:
                if down[k] in labels:
                    raise RepositoryError(
                        f"layers {labels[down[k]]!r} and {k!r} cannot be told apart: the same layer on the "
                        f"same inputs whose outputs go to the same places; give the model distinct outputs "
                        f"for them (or make them differ) so they get distinct ids")
                labels[down[k]] = k
                final[k] = hashlib.sha256(b"twin" + fid + down[k]).digest()[:16]
        for k in levels[d]:
            if final[k] in owner:  # a SHA-256 collision, or a twin label equal to another id
                raise RepositoryError(f"layers {owner[final[k]]!r} and {k!r} got the same id")
            owner[final[k]] = k
    return {k: v.hex() for k, v in final.items()}


def build_graph(nodes: Mapping[Hashable, Any], outputs: Sequence[Hashable],
                ids: Mapping[Hashable, str]) -> tuple[dict[str, Any], list[Hashable]]:
    """The plain-data graph (:mod:`deepfreeze.repo.graph`) of a neutral graph with its ids, and
    the node keys in graph layer order.

    Layers are in topological order, ties broken by id, so the order does not depend on how the
    model was built. A layer's ``inputs`` are the graph indices of its inputs, every call site
    in node order, concatenated; ``tensors`` is its number of weights; ``outputs`` are the graph
    indices of the model's outputs, in order."""
    nodes = {k: (n if isinstance(n, Node) else Node(*n)) for k, n in nodes.items()}
    order = topological_order(nodes, priority=ids)
    index = {k: i for i, k in enumerate(order)}
    layers = [{"id": ids[k], "inputs": [index[s] for site in nodes[k].calls for s in site],
               "tensors": len(nodes[k].weights)} for k in order]
    graph = {"scheme": ID_SCHEME, "layers": layers, "outputs": [index[k] for k in outputs]}
    return check_graph(graph), order


def build_meta(nodes: Mapping[Hashable, Any], ids: Mapping[Hashable, str]) -> dict[str, dict[str, Any]]:
    """Layer metadata to store once per id: ``id -> {"class_name", "config" (the canonical config
    as a dict), "weights": [[shape, dtype], ...]}`` (what the id hashes, besides the inputs)."""
    meta: dict[str, dict[str, Any]] = {}
    for k, n in nodes.items():
        n = n if isinstance(n, Node) else Node(*n)
        meta[ids[k]] = {"class_name": n.class_name, "config": json.loads(n.config),
                        "weights": [[[int(d) for d in shape], str(dtype)] for shape, dtype in n.weights]}
    return meta
