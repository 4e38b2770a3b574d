"""Stable layer ids (DStore section 4, Alg. 1, with its traps fixed): framework-neutral, no TensorFlow.

Scheme 2 (:data:`ID_SCHEME`); docs/repository.md ("Layer ids") is the reference. A layer's id is
a SHA-256 hash, truncated to 16 bytes (32 hex digits), of

* its *base*: the class name, its *id config* and the shapes and dtypes of its weights, in weight
  order. The id config is the canonical config (:func:`canonical_config`: ``get_config()``
  without the deny-list ``name``, ``trainable``, ``dtype`` and every ``*_initializer``,
  ``*_regularizer``, ``*_constraint`` key, as JSON with sorted keys) with the keys of
  :data:`IGNORED_CONFIG_KEYS` dropped (BatchNormalization ``momentum``), a model input's spatial
  dimensions left out (an ``InputLayer``'s ``batch_input_shape`` of rank 3 or more keeps only its
  rank and its last dimension, so weights that do not depend on the input's spatial size keep
  their ids at another resolution) and, for the layers of :data:`SHAPE_DEPENDENT_CLASSES`
  (Flatten, Reshape, Lambda, TF-op layers: they can turn spatial size into features), the full
  shapes of their inputs (``"__input_shape__"`` in their config, which the adapter records);
* folded with the ids of its inputs, in input order, for every call site of the layer in node
  order (a shared layer called twice folds both call sites). Which output of a multi-output layer
  a call takes is in the config (``"__call__"``).

Layers of :data:`TRANSPARENT_CLASSES` (the Dropout family, GaussianNoise, ActivityRegularization:
the identity at inference, no weights) are *transparent*: their consumers see through them to
their input, so inserting or removing one changes no other id.

**Twins** (layers with the same id so far: the same layer on the same inputs) are told apart by
their *first distinguishing consumers*: the downstream view of a member at depth ``d`` is what
lies within ``d`` consumer steps of it (each consumer's *raw* id, the id it would have if no twins
were told apart, the call site and the input position, and the model-output positions of the
member and of those consumers). The group's depth is the smallest ``d`` at which the members'
views are pairwise different; each member's id is its id so far folded with its view at that
depth. Nothing further downstream enters: everything strictly downstream of the first
distinguishing consumers (the *cut*) can change without changing any id of the layers inside it.
Model inputs with the same id (the same shape) are told apart by their position among the model's
inputs instead (``inputs=``). Members indistinguishable at every depth raise
:class:`RepositoryError` rather than share an id.

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

import numpy as np

from ..errors import RepositoryError
from .graph import check_graph

__all__ = ["ID_SCHEME", "Node", "canonical_config", "compute_ids", "topological_order", "id_config",
           "build_graph", "build_meta", "DENY_KEYS", "DENY_SUFFIXES", "TRANSPARENT_CLASSES",
           "IGNORED_CONFIG_KEYS", "SHAPE_DEPENDENT_CLASSES", "INPUT_CLASSES", "INPUT_SHAPE_KEY"]

ID_SCHEME = 2
"""Version of the id scheme below; recorded in every stored graph (``graph["scheme"]``). Scheme 1
(until DeepFreeze 2026-11): twins told apart by their whole downstream cone, input shapes and every
config key hashed, no transparent layers; repositories of scheme 1 are migrated when opened
(:mod:`deepfreeze.repo.migrate`)."""

DENY_KEYS = frozenset({"name", "trainable", "dtype"})
"""Config keys dropped before hashing: unstable labels (``name``), flags that flip when a model is
frozen (``trainable``), and the dtype policy (the weights' dtypes are hashed instead)."""
DENY_SUFFIXES = ("_initializer", "_regularizer", "_constraint")
"""Config key suffixes dropped before hashing: how weights are initialized or trained, not what
the layer computes."""

TRANSPARENT_CLASSES = frozenset({"Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D",
                                 "AlphaDropout", "GaussianDropout", "GaussianNoise", "ActivityRegularization",
                                 # the torch adapter's modules (deepfreeze.torch.repo: class names "torch.<class>")
                                 "torch.Dropout", "torch.Dropout1d", "torch.Dropout2d", "torch.Dropout3d",
                                 "torch.AlphaDropout", "torch.FeatureAlphaDropout", "torch.Identity"})
"""Layer classes their consumers see through (the identity at inference, no weights): inserting or
removing one changes no other layer's id. The table in docs/repository.md lists exactly these."""
IGNORED_CONFIG_KEYS: Mapping[str, tuple[str, ...]] = {"BatchNormalization": ("momentum",)}
"""Config keys of a class left out of its id (how a weight is updated in training, not what the
layer computes)."""
SHAPE_DEPENDENT_CLASSES = frozenset({"Flatten", "Reshape", "Lambda", "TFOpLambda", "SlicingOpLambda"})
"""Layer classes whose id includes the full shapes of their inputs (``"__input_shape__"`` in their
config): they can turn the input's spatial size into features (a Dense behind a Flatten)."""
INPUT_CLASSES = frozenset({"InputLayer"})
"""Model inputs: their ``batch_input_shape`` of rank >= 3 enters ids as its rank and last
dimension only (the spatial size does not)."""
INPUT_SHAPE_KEY = "__input_shape__"
"""Config key under which an adapter records a shape-dependent layer's input shapes (batch
dimension left out), one list per input tensor of each call site."""

_TAG = b"deepfreeze-layer-id/1\0"
_TAG2 = b"deepfreeze-layer-id/2\0"


class Node(NamedTuple):
    """A leaf layer of the neutral graph :func:`compute_ids` takes.

    ``config``: :func:`canonical_config` bytes; ``weights``: ``(shape, dtype name)`` of each
    weight in weight order; ``calls``: one list of input node keys per call site, in node order
    (empty for a model input)."""
    class_name: str
    config: bytes
    weights: Sequence[tuple[Sequence[int], str]]
    calls: Sequence[Sequence[Hashable]]


#: a numpy array in a layer config (a clipping bound, a small table) is hashed as its values up to
#: this many elements; a bigger one is refused as not plain JSON
_MAX_ARRAY_IN_CONFIG = 4096


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
        elif isinstance(v, np.ndarray) and v.size <= _MAX_ARRAY_IN_CONFIG:
            stack.append((v.tolist(), parent, slot))  # e.g. ReLU(max_value=6.) keeps an array
        elif isinstance(v, np.generic):
            parent[slot] = v.item()  # numpy scalars are their plain value
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


def _is_transparent(n: Node) -> bool:
    """A layer its consumers see through: a class of :data:`TRANSPARENT_CLASSES` without weights,
    called once on one input's first output."""
    return (n.class_name in TRANSPARENT_CLASSES and not n.weights and len(n.calls) == 1 and len(n.calls[0]) == 1
            and b'"__call__"' not in n.config)


def id_config(class_name: str, config: bytes) -> tuple[bytes, bool]:
    """The config bytes an id hashes (scheme 2) from the canonical config, and whether the layer
    is shape-dependent without recorded input shapes (then the full shapes of the model inputs
    upstream of it are hashed instead: graphs migrated from scheme 1)."""
    ignored = IGNORED_CONFIG_KEYS.get(class_name, ())
    shape_dep = class_name in SHAPE_DEPENDENT_CLASSES
    if class_name not in INPUT_CLASSES and not ignored and not shape_dep:
        return bytes(config), False
    try:
        cfg = json.loads(config)
    except ValueError as e:
        raise RepositoryError(f"a {class_name} config is not canonical JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise RepositoryError(f"a {class_name} config is not a JSON object")
    for k in ignored:
        cfg.pop(k, None)
    if class_name in INPUT_CLASSES:
        shape = cfg.get("batch_input_shape")
        if isinstance(shape, list) and len(shape) >= 3:
            cfg["batch_input_shape"] = {"rank": len(shape), "last": shape[-1]}
    text = json.dumps(cfg, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    return text.encode("utf-8"), shape_dep and INPUT_SHAPE_KEY not in cfg


def _base2(node: Node, resolution: bytes | None) -> bytes:
    """Digest of what a layer is on its own (scheme 2): class, id config, weight specs."""
    config, needs_resolution = id_config(node.class_name, node.config)
    specs = [[[int(d) for d in shape], str(dtype)] for shape, dtype in node.weights]
    head = json.dumps([node.class_name, specs], separators=(",", ":")).encode("utf-8")
    h = hashlib.sha256(_TAG2)
    h.update(struct.pack("<Q", len(head)))
    h.update(head)
    h.update(config)
    if needs_resolution:
        h.update(b"resolution")
        h.update(resolution or b"")
    return h.digest()


def compute_ids(nodes: Mapping[Hashable, Any], outputs: Sequence[Hashable],
                inputs: Sequence[Hashable] | None = None) -> dict[Hashable, str]:
    """The id (32 hex digits) of every node of a neutral layer graph (scheme 2).

    ``nodes``: key -> :class:`Node` (or a 4-tuple of its fields); ``outputs``: the keys of the
    model's outputs, in output order (an output listed twice counts twice); ``inputs``: the keys
    of the model's inputs in input order (model inputs of the same shape are told apart by their
    position there; None when unknown, as in a graph migrated from scheme 1: such inputs are then
    told apart by their downstream view under another tag, so their ids and everything behind
    them never equal ids computed with the positions). Keys are any hashable labels; they never
    enter an id. Ids are unique; see the module docstring for the scheme.
    :class:`RepositoryError` on a cycle, on a dangling input, or when two layers cannot be told
    apart."""
    nodes = _check(nodes, outputs)
    order = topological_order(nodes)
    in_pos: dict[Hashable, int] | None = None
    if inputs is not None:
        in_pos = {}
        for i, k in enumerate(inputs):
            if k not in nodes or nodes[k].calls:
                raise RepositoryError(f"model input {k!r} is not an input layer of the graph")
            in_pos.setdefault(k, i)

    # transparent layers: their consumers (and the model's outputs) see their input instead
    eff: dict[Hashable, Hashable] = {}
    for k in order:
        n = nodes[k]
        eff[k] = eff[n.calls[0][0]] if _is_transparent(n) else k
    opaque = [k for k in order if eff[k] == k]
    calls = {k: [[eff[s] for s in site] for site in nodes[k].calls] for k in opaque}
    outs = [eff[k] for k in outputs]

    # the full shapes of the model inputs upstream of each layer (for migrated shape-dependent layers)
    resolution: dict[Hashable, bytes] = {}
    for k in opaque:
        h = hashlib.sha256(b"res")
        if not calls[k]:
            h.update(nodes[k].config)
        for site in calls[k]:
            for s in site:
                h.update(resolution[s])
        resolution[k] = h.digest()
    base = {k: _base2(nodes[k], resolution[k]) for k in opaque}

    # raw ids (no twins told apart) and depths
    raw: dict[Hashable, bytes] = {}
    depth: dict[Hashable, int] = {}
    for k in opaque:
        raw[k] = _fold(base[k], calls[k], raw)
        depth[k] = 1 + max((depth[s] for site in calls[k] for s in site), default=-1)

    uses: dict[Hashable, list[tuple[Hashable, int, int]]] = {k: [] for k in opaque}
    for c in opaque:
        for si, site in enumerate(calls[c]):
            for pos, s in enumerate(site):
                uses[s].append((c, si, pos))
    out_pos: dict[Hashable, bytes] = {k: b"" for k in opaque}
    for i, k in enumerate(outs):
        out_pos[k] += struct.pack("<I", i)
    views: list[dict[Hashable, bytes]] = []    # views[d][k]: k's downstream view at depth d
    classes: list[int] = []                    # number of distinct views at each depth

    def view(d: int) -> dict[Hashable, bytes] | None:
        """Views at depth ``d``, None once they no longer refine (nothing further can tell apart)."""
        while len(views) <= d:
            prev = views[-1] if views else None
            if prev is not None and len(classes) > 1 and classes[-1] == classes[-2]:
                return None
            cur: dict[Hashable, bytes] = {}
            for k in opaque:
                h = hashlib.sha256(b"view")
                h.update(struct.pack("<I", len(out_pos[k])))
                h.update(out_pos[k])
                if prev is not None:
                    for e in sorted(raw[c] + struct.pack("<II", si, pos) + prev[c] for c, si, pos in uses[k]):
                        h.update(e)
                cur[k] = h.digest()
            views.append(cur)
            classes.append(len(set(cur.values())))
        return views[d]

    levels: dict[int, list[Hashable]] = {}
    for k in opaque:
        levels.setdefault(depth[k], []).append(k)
    final: dict[Hashable, bytes] = {}
    for lv in sorted(levels):
        groups: dict[bytes, list[Hashable]] = {}
        for k in levels[lv]:
            groups.setdefault(_fold(base[k], calls[k], final), []).append(k)
        for fid, members in groups.items():
            if len(members) == 1:
                final[members[0]] = fid
                continue
            if in_pos is not None and all(not calls[k] and k in in_pos for k in members):
                for k in members:   # model inputs of one shape: their position among the inputs
                    final[k] = hashlib.sha256(b"input" + fid + struct.pack("<I", in_pos[k])).digest()[:16]
                continue
            tag = b"twin" if any(calls[k] for k in members) else b"input-unordered"
            d = 0
            while True:
                v = view(d)
                if v is None:
                    a, b = _first_equal(members, views[-1])
                    raise RepositoryError(
                        f"layers {a!r} and {b!r} cannot be told apart: the same layer on the same inputs "
                        f"whose outputs go to the same places; give the model distinct outputs for them (or "
                        f"make them differ) so they get distinct ids")
                if len({v[k] for k in members}) == len(members):
                    break
                d += 1
            for k in members:
                final[k] = hashlib.sha256(tag + fid + struct.pack("<I", d) + v[k]).digest()[:16]

    # transparent layers get ids of their own (never loaded: no weights), from their input and
    # where their output goes, consumers first
    users: dict[Hashable, list[tuple[Hashable, int, int]]] = {k: [] for k in nodes}
    for c, n in nodes.items():
        for si, site in enumerate(n.calls):
            for pos, s in enumerate(site):
                users[s].append((c, si, pos))
    raw_out: dict[Hashable, list[int]] = {k: [] for k in nodes}
    for i, k in enumerate(outputs):
        raw_out[k].append(i)
    for k in reversed(order):
        if eff[k] == k:
            continue
        n = nodes[k]
        h = hashlib.sha256(b"transparent")
        h.update(_base(n))
        h.update(final[eff[k]])
        h.update(struct.pack(f"<{len(raw_out[k])}I", *raw_out[k]))
        for e in sorted(final[c] + struct.pack("<II", si, pos) for c, si, pos in users[k]):
            h.update(e)
        final[k] = h.digest()[:16]

    owner: dict[bytes, Hashable] = {}
    for k in order:
        if final[k] in owner:  # a SHA-256 collision, or layers nothing tells apart (dead twins)
            raise RepositoryError(f"layers {owner[final[k]]!r} and {k!r} cannot be told apart (they got the same "
                                  f"id): the same layer on the same inputs whose outputs go to the same places")
        owner[final[k]] = k
    return {k: v.hex() for k, v in final.items()}


def _first_equal(members: Sequence[Hashable], view: Mapping[Hashable, bytes]) -> tuple[Hashable, Hashable]:
    seen: dict[bytes, Hashable] = {}
    for k in members:
        if view[k] in seen:
            return seen[view[k]], k
        seen[view[k]] = k
    return members[0], members[1]  # pragma: no cover


def build_graph(nodes: Mapping[Hashable, Any], outputs: Sequence[Hashable],
                ids: Mapping[Hashable, str], names: Mapping[Hashable, str] | None = None
                ) -> tuple[dict[str, Any], list[Hashable]]:
    """The plain-data graph (:mod:`deepfreeze.repo.graph`) of a neutral graph with its ids, and
    the node keys in graph layer order.

    Layers are in topological order, ties broken by id, so the order does not depend on how the
    model was built. A layer's ``inputs`` are the graph indices of its inputs, every call site
    in node order, concatenated; ``tensors`` is its number of weights; ``name`` its entry in
    ``names`` where it has one; ``outputs`` are the graph indices of the model's outputs, in order."""
    nodes = {k: (n if isinstance(n, Node) else Node(*n)) for k, n in nodes.items()}
    order = topological_order(nodes, priority=ids)
    index = {k: i for i, k in enumerate(order)}
    names = names or {}
    layers = [{"id": ids[k], "inputs": [index[s] for site in nodes[k].calls for s in site],
               "tensors": len(nodes[k].weights), **({"name": names[k]} if k in names else {})} for k in order]
    graph = {"scheme": ID_SCHEME, "layers": layers, "outputs": [index[k] for k in outputs]}
    return check_graph(graph), order


def build_meta(nodes: Mapping[Hashable, Any], ids: Mapping[Hashable, str]) -> dict[str, dict[str, Any]]:
    """Layer metadata to store once per id: ``id -> {"class_name", "config" (the canonical config
    as a dict), "weights": [[shape, dtype], ...]}`` (what the id is computed from besides the inputs:
    the canonical config before :func:`id_config` drops ignored keys and spatial sizes)."""
    meta: dict[str, dict[str, Any]] = {}
    for k, n in nodes.items():
        n = n if isinstance(n, Node) else Node(*n)
        meta[ids[k]] = {"class_name": n.class_name, "config": json.loads(n.config),
                        "weights": [[[int(d) for d in shape], str(dtype)] for shape, dtype in n.weights]}
    return meta
