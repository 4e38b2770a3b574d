"""Keras adapter of the model repository: :func:`store_model` and :func:`load_into`.

The layer graph of a built Keras model (functional or ``Sequential``; nested models flattened to
their leaf layers; the model's ``InputLayer`` s are layers too, so input shapes are part of every
id) is extracted from Keras' own node structure, given stable ids by the framework-neutral
:mod:`deepfreeze.repo.ids`, and stored with every weight of the model. A load matches layers by
id only, never by name. Guide: docs/repository.md.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from ..errors import ModelMismatchError, RepositoryError
from ..format import dtype_name
from ..repo.graph import tensor_key
from ..repo.ids import ID_SCHEME, Node, build_graph, build_meta, canonical_config, compute_ids

__all__ = ["LoadReport", "store_model", "load_into", "model_graph"]


@dataclass
class LoadReport:
    """What :func:`load_into` did, as layer names of the model loaded into.

    ``loaded``: layers with weights whose id is in the stored graph; all their weights were set.
    ``missing``: layers with weights (among those considered) whose id is not in the stored
    graph; left untouched. ``skipped``: the other leaf layers: layers without weights, and the
    layers not asked for when ``layers=`` is given; left untouched. ``bytes``: tensor bytes read
    from the repository."""
    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    bytes: int = 0


@dataclass
class ModelGraph:
    """A Keras model's leaf layers and their ids. ``layers[k]`` is the layer of node key ``k``."""
    layers: list[Any]
    nodes: dict[int, Node]
    outputs: list[int]
    ids: dict[int, str]

    def graph(self) -> tuple[dict[str, Any], list[int]]:
        """The plain-data graph and the node keys in its layer order."""
        return build_graph(self.nodes, self.outputs, self.ids)

    def meta(self) -> dict[str, dict[str, Any]]:
        """Layer metadata per id (:func:`deepfreeze.repo.ids.build_meta`)."""
        return build_meta(self.nodes, self.ids)


class _Key(int):
    """A node key (an int) whose repr is its layer's name."""
    def __new__(cls, k: int, name: str) -> "_Key":
        key = super().__new__(cls, k)
        key.name = name
        return key

    def __repr__(self) -> str:
        return repr(self.name)


def _is_model(layer: Any) -> bool:
    return isinstance(layer, tf.keras.Model)


def model_graph(model: Any) -> ModelGraph:
    """The neutral layer graph of a built Keras model and its layer ids.

    Walks each (nested) functional graph the way Keras runs it (``_nodes_by_depth``, deepest
    first), binding a nested model's inputs to the tensors it is called on, so nested models
    flatten to leaf layers and a nested model called twice makes its layers shared layers. Only
    nodes of this model count (a layer also used by another model keeps its other nodes out).
    :class:`RepositoryError` for a model without a layer graph (subclassed, or not built)."""
    if not _is_model(model):
        raise RepositoryError(f"expected a Keras Model, got {type(model).__name__}")
    keys: dict[int, int] = {}                  # id(layer) -> node key
    layers: list[Any] = []
    calls: dict[int, list[tuple[tuple[int, ...], list[int]]]] = {}   # key -> (order key, inputs)

    def key_of(layer: Any) -> int:
        k = keys.get(id(layer))
        if k is None:
            k = keys[id(layer)] = len(layers)
            layers.append(layer)
            calls[k] = []
        return k

    def walk(m: Any, bound: list[int] | None, path: tuple[int, ...]) -> list[int]:
        """Leaf node keys of ``m``'s outputs; ``bound``: the sources of its inputs (None: top level)."""
        if not getattr(m, "_is_graph_network", False):
            raise RepositoryError(
                f"model {m.name!r} has no layer graph (a subclassed model, or a Sequential model not "
                f"built on a known input shape): build it with the functional API or give Sequential "
                f"an Input so its layers get stable ids")
        src: dict[str, int] = {}
        inputs = list(m.inputs)
        if bound is not None:
            if len(bound) != len(inputs):
                raise RepositoryError(f"nested model {m.name!r} called on {len(bound)} tensors but has "
                                      f"{len(inputs)} inputs; not supported")
            for t, s in zip(inputs, bound):
                src[str(id(t))] = s
        for depth in sorted(m._nodes_by_depth, reverse=True):
            for node in m._nodes_by_depth[depth]:
                layer = node.layer
                if isinstance(layer, tf.keras.layers.InputLayer):
                    if bound is None:      # the model's own inputs are layers of the graph
                        k = key_of(layer)
                        for oid in node.flat_output_ids:
                            src[oid] = k
                    continue
                ins = [src[i] for i in node.flat_input_ids]
                index = layer._inbound_nodes.index(node)
                if _is_model(layer):
                    outs = walk(layer, ins, path + (index,))
                else:
                    k = key_of(layer)
                    calls[k].append((path + (index,), ins))
                    outs = [k] * len(node.flat_output_ids)
                if len(outs) != len(node.flat_output_ids):
                    raise RepositoryError(f"layer {layer.name!r}: {len(outs)} outputs for "
                                          f"{len(node.flat_output_ids)} tensors; not supported")
                for oid, k in zip(node.flat_output_ids, outs):
                    src[oid] = k
        return [src[str(id(t))] for t in m.outputs]

    outputs = walk(model, None, ())
    nodes: dict[int, Node] = {}
    for k, layer in enumerate(layers):
        try:
            config = canonical_config(layer.get_config())
        except NotImplementedError as e:
            raise RepositoryError(f"layer {layer.name!r} ({type(layer).__name__}) has no get_config(); "
                                  f"implement it to give the layer a stable id") from e
        except RepositoryError as e:
            raise RepositoryError(f"layer {layer.name!r} ({type(layer).__name__}): {e}") from e
        weights = [(tuple(int(d) for d in v.shape), dtype_name(v.dtype.as_numpy_dtype)) for v in layer.weights]
        sites = [ins for _, ins in sorted(calls[k], key=lambda c: c[0])]
        nodes[k] = Node(type(layer).__name__, config, weights, sites)
    try:
        # keys that print as the layer name, so an error names the layers
        named = {_Key(k, layers[k].name): n for k, n in nodes.items()}
        ids = {int(k): v for k, v in compute_ids(named, outputs).items()}
    except RepositoryError as e:
        raise RepositoryError(f"model {model.name!r}: {e}") from e
    return ModelGraph(layers, nodes, outputs, ids)


def store_model(repo: Any, name: str, model: Any) -> dict:
    """Store every weight of a built Keras model (trainable or not; not the optimizer) with its
    layer graph and layer metadata under ``name`` (``<model>[@<tag>]``, write-once).

    Weight ``k`` of the layer with id ``i`` (in ``layer.weights`` order) is stored under
    ``graph.tensor_key(i, k)``. Returns what ``repo.put`` returns (bytes, written, deduplicated).
    :class:`RepositoryError` when the model has no layer graph or holds weights no leaf layer
    owns; ``NameExistsError`` when the name exists or existed."""
    mg = model_graph(model)
    owned = {id(v) for layer in mg.layers for v in layer.weights}
    stray = [v.name for v in model.weights if id(v) not in owned]
    if stray:
        raise RepositoryError(f"model {model.name!r}: weights {stray[:5]} belong to no leaf layer of its graph; "
                              f"store_model stores layers' weights only")
    graph, _order = mg.graph()
    tensors: dict[str, np.ndarray] = {}
    for k, layer in enumerate(mg.layers):
        for j, v in enumerate(layer.weights):
            tensors[tensor_key(mg.ids[k], j)] = np.ascontiguousarray(v.numpy())
    return repo.put(name, tensors, graph=graph, meta=mg.meta())


def _requested(mg: ModelGraph, layers: Iterable[Any]) -> set[int]:
    by_name: dict[str, list[int]] = {}
    for k, layer in enumerate(mg.layers):
        by_name.setdefault(layer.name, []).append(k)
    by_obj = {id(layer): k for k, layer in enumerate(mg.layers)}
    want: set[int] = set()
    for item in layers:
        if isinstance(item, str):
            ks = by_name.get(item)
            if not ks:
                raise ModelMismatchError(f"layers=: the model has no leaf layer named {item!r} "
                                         f"(nested models count by their leaf layers)")
            want.update(ks)
        elif _is_model(item):
            raise ModelMismatchError(f"layers=: {item.name!r} is a model; name its leaf layers")
        else:
            k = by_obj.get(id(item))
            if k is None:
                raise ModelMismatchError(f"layers=: {getattr(item, 'name', item)!r} is not a leaf layer of the "
                                         f"model loaded into")
            want.add(k)
    return want


def load_into(repo: Any, name: str, new_model: Any, layers: Iterable[Any] | None = None,
              strict: bool = False) -> LoadReport:
    """Set the weights of the layers of ``new_model`` that match the stored model ``name``.

    A layer matches when its id is in the stored graph: the layer and its whole upstream (down to
    the input shapes) are identical, whatever the names or the construction order (the
    transfer-learning prefix). ``layers``: layer names or layer objects of ``new_model`` to
    consider (default: all its leaf layers). :class:`ModelMismatchError`, before any weight is
    set, when no layer with weights matches, when a requested layer does not match (named), and
    with ``strict=True`` unless every considered layer with weights matched (the others named).
    Otherwise returns a :class:`LoadReport`. Only the matched layers' tensors are read, in one
    ``repo.get``."""
    graph = repo.graph(name)
    if graph is None:
        raise ModelMismatchError(f"{name!r} was stored without a layer graph; read its tensors with repo.get")
    if graph.get("scheme") != ID_SCHEME:
        raise ModelMismatchError(f"{name!r} has layer ids of scheme {graph.get('scheme')}, this DeepFreeze "
                                 f"computes scheme {ID_SCHEME}; ids of different schemes never match")
    stored = {layer["id"]: layer["tensors"] for layer in graph["layers"]}
    mg = model_graph(new_model)
    considered = set(range(len(mg.layers))) if layers is None else _requested(mg, layers)
    report = LoadReport()
    matched: list[int] = []
    unmatched: list[int] = []
    for k, layer in enumerate(mg.layers):
        if k not in considered:
            report.skipped.append(layer.name)
            continue
        hit = mg.ids[k] in stored
        if layers is not None and not hit:
            unmatched.append(k)
        if hit and stored[mg.ids[k]] != len(layer.weights):   # cannot happen unless the store is damaged
            raise ModelMismatchError(f"layer {layer.name!r}: {name!r} has {stored[mg.ids[k]]} tensors for its "
                                     f"id, the layer has {len(layer.weights)} weights")
        if not layer.weights:
            report.skipped.append(layer.name)
        elif hit:
            matched.append(k)
            report.loaded.append(layer.name)
        else:
            report.missing.append(layer.name)
    if unmatched:
        raise ModelMismatchError(f"requested layers do not match {name!r} (their upstream differs from every "
                                 f"stored layer): {', '.join(mg.layers[k].name for k in unmatched)}; nothing loaded")
    if not matched:
        raise ModelMismatchError(f"no layer with weights of model {new_model.name!r} matches {name!r}: not the "
                                 f"same layers on the same inputs; nothing loaded")
    if strict and report.missing:
        raise ModelMismatchError(f"strict load of {name!r}: layers with weights that do not match: "
                                 f"{', '.join(report.missing)}; nothing loaded")
    out: dict[str, np.ndarray] = {}
    targets: list[tuple[Any, str]] = []
    for k in matched:
        for j, v in enumerate(mg.layers[k].weights):
            key = tensor_key(mg.ids[k], j)
            out[key] = np.empty(tuple(v.shape), dtype=v.dtype.as_numpy_dtype)
            targets.append((v, key))
    got = repo.get(name, tensors=list(out), out=out)
    for v, key in targets:
        v.assign(got[key], read_value=False)
    report.bytes = sum(got[key].nbytes for _, key in targets)
    return report
