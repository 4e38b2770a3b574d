"""Keras adapter of the model repository: :func:`store_model` and :func:`load_into`.

The layer graph of a built Keras model (functional or ``Sequential``; nested models flattened to
their leaf layers; the model's ``InputLayer`` s are layers too, so the inputs' channels are part
of every id, and their order tells same-shape inputs apart) is extracted from Keras' own node
structure, given stable ids by the framework-neutral :mod:`deepfreeze.repo.ids`, and stored with
every weight of the model. A load matches layers by id, never by name, or by an explicit
``mapping=`` or ``match="shape"``. Guide: docs/repository.md.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from ..errors import ConfigError, ModelMismatchError, RepositoryError
from ..format import dtype_name
from ..repo.graph import tensor_key, tensor_keys
from ..repo.ids import (INPUT_SHAPE_KEY, SHAPE_DEPENDENT_CLASSES, Node, build_graph, build_meta,
                         canonical_config, compute_ids)
from ..repo.loading import (LoadReport, NamedKey, check_mapped_specs, mapping_target, pair_by_shape, signature,
                            stored_graph)

__all__ = ["ModelGraph", "store_model", "load_into", "model_graph", "layer_record",
           "release_staging", "STAGING_MAX_BYTES"]


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

    def weight_keys(self, keys: Iterable[int] | None = None) -> list[tuple[Any, str]]:
        """``(variable, tensor key)`` of every weight of the layers ``keys`` (default: all), in
        layer then ``layer.weights`` order: where :func:`store_model` puts each variable."""
        ks = range(len(self.layers)) if keys is None else keys
        return [(v, tensor_key(self.ids[k], j)) for k in ks for j, v in enumerate(self.layers[k].weights)]

    def meta(self) -> dict[str, dict[str, Any]]:
        """Layer metadata per id (:func:`deepfreeze.repo.ids.build_meta`)."""
        return build_meta(self.nodes, self.ids)


_IGNORED_KWARGS = ("training", "name")


def _call_arguments(node: Any, which: list[int]) -> Any:
    """What a call site passes besides the input layers, as JSON values, or None when it passes
    only the first (or only) outputs of its input layers. ``args``/``kwargs``: the non-tensor
    arguments (tensors as ``{"__tensor__": i}``, i their position among the call's tensor
    inputs); ``training=`` (a mode, not a computation on the weights) and an op's ``name=`` are
    ignored. ``outputs``: ``which``, the output index of each input in its layer, when one is not
    0 (``tf.split(x, 2)[1]`` is another input than ``[0]``)."""
    from keras.src.engine.node import is_keras_tensor  # the check Keras itself uses for node inputs
    count = [0]
    constant = [False]

    def conv(v: Any) -> Any:
        if is_keras_tensor(v):
            count[0] += 1
            return {"__tensor__": count[0] - 1}
        constant[0] = True
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, tf.DType):
            return {"__dtype__": v.name}
        if isinstance(v, tf.TensorShape):
            return {"__shape__": v.as_list()}
        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, (np.ndarray, tf.Tensor)):
            a = np.asarray(v)
            return {"__array__": a.tolist(), "dtype": a.dtype.name, "shape": list(a.shape)}
        raise RepositoryError(f"layer {node.layer.name!r} is called with an argument of type "
                              f"{type(v).__name__} that has no JSON form; it cannot get a stable id")

    kwargs = {k: v for k, v in node.call_kwargs.items() if k not in _IGNORED_KWARGS}
    if not kwargs and all(is_keras_tensor(a) for a in tf.nest.flatten(node.call_args)):
        return {"outputs": list(which)} if any(which) else None   # the common case, made fast
    args = tf.nest.map_structure(conv, list(node.call_args))
    kwargs = tf.nest.map_structure(conv, kwargs)
    if not constant[0] and not any(which):
        return None
    site: dict[str, Any] = {"args": args, "kwargs": kwargs} if constant[0] else {}
    if any(which):
        site["outputs"] = list(which)
    return site


def _layer_config(layer: Any) -> dict[str, Any]:
    """``layer.get_config()`` without the batch size: an ``InputLayer``'s batch dimension becomes
    None, and the ``batch_input_shape`` a first layer carries when built with ``input_shape=`` is
    dropped (the model's ``InputLayer`` holds the input shape); neither changes the weights."""
    try:
        config = dict(layer.get_config())
    except NotImplementedError as e:
        raise RepositoryError("has no get_config(); implement it to give the layer a stable id") from e
    shape = config.get("batch_input_shape")
    if isinstance(layer, tf.keras.layers.InputLayer):
        if isinstance(shape, (list, tuple)) and shape:
            config["batch_input_shape"] = [None, *shape[1:]]
    else:
        config.pop("batch_input_shape", None)
    return config


def _input_shapes(node: Any) -> list[Any]:
    """The shapes of a call site's input tensors without the batch dimension (None where unknown)."""
    out = []
    for t in tf.nest.flatten(node.input_tensors):
        shape = getattr(t, "shape", None)
        dims = shape.as_list() if isinstance(shape, tf.TensorShape) and shape.rank is not None else None
        out.append(None if dims is None else dims[1:])
    return out


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
    calls: dict[int, list[tuple[tuple[int, ...], list[int], Any, Any]]] = {}  # key -> (order, inputs, args, shapes)

    def key_of(layer: Any) -> int:
        k = keys.get(id(layer))
        if k is None:
            k = keys[id(layer)] = len(layers)
            layers.append(layer)
            calls[k] = []
        return k

    def walk(m: Any, bound: list[tuple[int, int]] | None, path: tuple[int, ...]) -> list[tuple[int, int]]:
        """(leaf node key, output index) of each of ``m``'s outputs; ``bound``: the same of its
        inputs (None: top level)."""
        if not getattr(m, "_is_graph_network", False):
            raise RepositoryError(
                f"model {m.name!r} has no layer graph (a subclassed model, or a Sequential model not "
                f"built on a known input shape): build it with the functional API or give Sequential "
                f"an Input so its layers get stable ids")
        src: dict[str, tuple[int, int]] = {}   # tensor -> (leaf node key, output index in the leaf)
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
                        for i, oid in enumerate(node.flat_output_ids):
                            src[oid] = (k, i)
                    continue
                ins = [src[i] for i in node.flat_input_ids]
                index = layer._inbound_nodes.index(node)
                if _is_model(layer):
                    outs = walk(layer, ins, path + (index,))
                else:
                    k = key_of(layer)
                    calls[k].append((path + (index,), [s for s, _ in ins],
                                     _call_arguments(node, [i for _, i in ins]), _input_shapes(node)))
                    outs = [(k, i) for i in range(len(node.flat_output_ids))]
                if len(outs) != len(node.flat_output_ids):
                    raise RepositoryError(f"layer {layer.name!r}: {len(outs)} outputs for "
                                          f"{len(node.flat_output_ids)} tensors; not supported")
                for oid, out in zip(node.flat_output_ids, outs):
                    src[oid] = out
        return [src[str(id(t))] for t in m.outputs]

    outputs = [k for k, _ in walk(model, None, ())]
    inputs = [keys[id(t._keras_history.layer)] for t in model.inputs]
    nodes: dict[int, Node] = {}
    for k, layer in enumerate(layers):
        sites = sorted(calls[k], key=lambda c: c[0])
        arguments = [c[2] for c in sites]
        config = _layer_config(layer)
        if type(layer).__name__ in SHAPE_DEPENDENT_CLASSES:   # they can turn spatial size into features
            config[INPUT_SHAPE_KEY] = [c[3] for c in sites]
        try:
            config = canonical_config(config, None if all(a is None for a in arguments) else arguments)
        except RepositoryError as e:
            raise RepositoryError(f"layer {layer.name!r} ({type(layer).__name__}): {e}") from e
        weights = [(tuple(int(d) for d in v.shape), dtype_name(v.dtype.as_numpy_dtype)) for v in layer.weights]
        nodes[k] = Node(type(layer).__name__, config, weights, [c[1] for c in sites])
    try:
        # keys that print as the layer name, so an error names the layers
        named = {NamedKey(k, layers[k].name): n for k, n in nodes.items()}
        ids = {int(k): v for k, v in compute_ids(named, outputs, inputs).items()}
    except RepositoryError as e:
        raise RepositoryError(f"model {model.name!r}: {e}") from e
    return ModelGraph(layers, nodes, outputs, ids)


def layer_record(model: Any) -> dict[str, Any]:
    """What a checkpoint manifest records for ``deepfreeze repo import`` (its ``"layers"`` key,
    :mod:`deepfreeze.repo.importer`): ``{"graph": <plain-data graph>, "tensors": [index in
    model.weights of the variable of each key of tensor_keys(graph)], "specs": {key: [dtype,
    shape]}}`` (``specs`` is used by ``import --model`` to check the model against the checkpoint;
    the callback leaves it out). :class:`RepositoryError` when the model has no layer graph or a
    layer weight is not in ``model.weights``."""
    mg = model_graph(model)
    graph, _order = mg.graph()
    position = {id(v): i for i, v in enumerate(model.weights)}
    by_key = {key: v for v, key in mg.weight_keys()}
    tensors, specs = [], {}
    for key in tensor_keys(graph):
        v = by_key[key]
        if id(v) not in position:
            raise RepositoryError(f"model {model.name!r}: weight {v.name!r} of its layer graph is not in model.weights")
        tensors.append(position[id(v)])
        specs[key] = [dtype_name(v.dtype.as_numpy_dtype), [int(d) for d in v.shape]]
    return {"graph": graph, "tensors": tensors, "specs": specs}


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
    # zero-copy: each array is a read-only view of the variable's own buffer (CPU), written to the
    # pack from there; the views are dropped when put returns, so the next in-place update of the
    # variable does not copy its buffer. The model must not train meanwhile (as for save_weights).
    # (np.ascontiguousarray would make a 0-d weight 1-d: np.require keeps its shape)
    tensors = {key: np.require(np.asarray(v.value()), requirements="C") for v, key in mg.weight_keys()}
    try:
        return repo.put(name, tensors, graph=graph, meta=mg.meta())
    finally:
        tensors.clear()


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


_ALIGN = 64  # TensorFlow (Eigen) requires tensor buffers aligned to EIGEN_MAX_ALIGN_BYTES (<= 64)


def _aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A new C-contiguous array whose buffer is aligned to 64 bytes, as TensorFlow needs to use it
    without a copy."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def _assign(variable: Any, array: np.ndarray) -> None:
    """``variable.assign(array)`` without the numpy-to-tensor copy where possible: the private,
    aligned ``array`` is wrapped as a tensor through DLPack (no copy), so TensorFlow either copies
    it once into the variable or adopts its buffer (the DLPack capsule keeps the array alive).
    Nobody else holds ``array``. Dtypes DLPack cannot carry (bfloat16) take the ordinary assign."""
    if array.ctypes.data % _ALIGN == 0 and array.flags.c_contiguous:
        try:
            value = tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        except (TypeError, ValueError, BufferError, RuntimeError, tf.errors.InvalidArgumentError):
            value = None
        if value is not None:
            variable.assign(value, read_value=False)
            return
    variable.assign(array, read_value=False)


#: load_into's client-side staging buffer (the paper's staging buffer, allocated once and reused):
#: a load of up to this many bytes is read into one reused, aligned host buffer and copied from
#: there into the variables' own buffers, so repeated loads touch no fresh memory (first-touch page
#: faults cost more than the copy: docs/performance-history.md). Bigger loads read into fresh arrays that
#: the variables take over. :func:`release_staging` frees the buffer.
STAGING_MAX_BYTES = 1 << 30


class _Staging:
    """The process's staging buffer for :func:`load_into` (grown on demand up to
    :data:`STAGING_MAX_BYTES`; one load at a time uses it, under ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.raw: np.ndarray | None = None

    def views(self, specs: list[tuple[tuple[int, ...], Any]]) -> list[np.ndarray] | None:
        """Aligned views for arrays of ``specs`` (shape, dtype), None when they do not fit."""
        sizes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize for shape, dt in specs]
        total = sum(n + (-n) % _ALIGN for n in sizes) + _ALIGN
        if total > STAGING_MAX_BYTES:
            return None
        if self.raw is None or self.raw.nbytes < total:
            self.raw = None  # the old one is freed first
            self.raw = np.empty(total, np.uint8)
        pos = (-self.raw.ctypes.data) % _ALIGN
        out = []
        for (shape, dt), n in zip(specs, sizes):
            out.append(self.raw[pos:pos + n].view(dt).reshape(shape))
            pos += n + (-n) % _ALIGN
        return out

    def check(self, variables: list[Any]) -> None:
        """Forget the buffer if a variable ended up using its memory (never reuse it then)."""
        if self.raw is None:
            return
        lo, hi = self.raw.ctypes.data, self.raw.ctypes.data + self.raw.nbytes
        for v in variables:
            view = np.asarray(v.value())  # transient: dropped before any update of the variable
            if view.nbytes and lo <= view.ctypes.data < hi:
                self.raw = None
                return


_STAGING = _Staging()


def release_staging() -> None:
    """Free :func:`load_into`'s staging buffer (it is allocated again by the next load)."""
    with _STAGING.lock:
        _STAGING.raw = None


def _copy_into(variable: Any, array: np.ndarray) -> None:
    """Copy ``array`` into ``variable``'s own buffer without adopting ``array``'s memory: a
    strided-slice assignment over the whole variable is an in-place update, which TensorFlow
    applies copy-on-write (a buffer shared with another tensor is copied first), so no other
    tensor changes. 0-d, empty and bfloat16 values are assigned from a private copy, and so are
    arrays not 64-byte aligned or not C-contiguous (TensorFlow aborts the process on a borrowed
    buffer that is not aligned: never hand it one)."""
    if array.ndim == 0 or array.size == 0 or array.ctypes.data % 64 or not array.flags.c_contiguous:
        variable.assign(array.copy(), read_value=False)
        return
    try:
        value = tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    except (TypeError, ValueError, BufferError, RuntimeError, tf.errors.InvalidArgumentError):
        variable.assign(array.copy(), read_value=False)
        return
    nd = array.ndim
    tf.raw_ops.ResourceStridedSliceAssign(ref=variable.handle, begin=[0] * nd, end=list(array.shape),
                                          strides=[1] * nd, value=value)


def _resolve_mapping(mg: ModelGraph, graph: dict[str, Any], mapping: Any) -> dict[int, str]:
    """node key -> stored layer id of ``mapping`` (keys: layer names or layer objects of the model
    loaded into; values: a stored layer id, or an index into the stored graph's ``"layers"``)."""
    if not isinstance(mapping, dict):
        raise ConfigError(f"mapping= must be a dict {{new layer or name: stored layer id or index}}, not "
                          f"{type(mapping).__name__}")
    ids = [layer["id"] for layer in graph["layers"]]
    known = set(ids)
    out: dict[int, str] = {}
    for key, target in mapping.items():
        ks = _requested(mg, [key])
        target = mapping_target(getattr(key, "name", key), target, ids, known)
        for k in ks:
            out[k] = target
    return out


def load_into(repo: Any, name: str, new_model: Any, layers: Iterable[Any] | None = None,
              strict: bool = False, mapping: dict | None = None, match: str = "id") -> LoadReport:
    """Set the weights of the layers of ``new_model`` that match the stored model ``name``.

    A layer matches when its id is in the stored graph: the layer and its upstream (down to the
    input shapes' channels) are identical, whatever the names or the construction order (the
    transfer-learning prefix). ``layers``: layer names or layer objects of ``new_model`` to
    consider (default: all its leaf layers). Relaxed loads, for layers whose id did not match:
    ``mapping={new layer (object or name): stored layer id or index into the stored graph's
    layers}`` loads the named stored layer into it; ``match="shape"`` pairs the remaining layers
    with weights and the remaining stored layers by class and weight shapes and dtypes, in
    topological order, leaving a signature whose count differs between the two models unmatched
    (``report.ambiguous``). Both report what they paired in ``report.mapped``; shapes and dtypes
    are checked before anything is set. :class:`ModelMismatchError`, before any weight is set,
    when no layer with weights matches, when a requested layer does not match (named), and with
    ``strict=True`` unless every considered layer with weights is loaded (the others named).
    Otherwise returns a :class:`LoadReport`. Only the loaded layers' tensors are read, in one
    ``repo.get``."""
    graph, foreign = stored_graph(repo, name, "keras", match=match, mapping=mapping)
    stored = {layer["id"]: layer["tensors"] for layer in graph["layers"]}
    mg = model_graph(new_model)
    considered = set(range(len(mg.layers))) if layers is None else _requested(mg, layers)
    maps = _resolve_mapping(mg, graph, mapping) if mapping else {}
    considered |= set(maps)   # a mapped layer is asked for
    source: dict[int, str] = {}     # node key -> stored id it loads from
    for k, layer in enumerate(mg.layers):
        if k not in considered or not layer.weights:
            continue
        if k in maps:
            source[k] = maps[k]
        elif mg.ids[k] in stored and not foreign:
            if stored[mg.ids[k]] != len(layer.weights):   # cannot happen unless the store is damaged
                raise ModelMismatchError(f"layer {layer.name!r}: {name!r} has {stored[mg.ids[k]]} tensors for its "
                                         f"id, the layer has {len(layer.weights)} weights")
            source[k] = mg.ids[k]
    specs = None
    ambiguous: list[int] = []
    if maps or match == "shape":
        specs = repo.specs(name)
    if match == "shape":
        _order_graph, order = mg.graph()
        used = set(source.values()) | set(maps.values())
        mine: dict[tuple, list[int]] = {}
        for k in order:
            if k in considered and k not in source and mg.layers[k].weights:
                mine.setdefault(signature(mg.nodes[k].class_name, mg.nodes[k].weights), []).append(k)
        pairs, ambiguous = pair_by_shape(repo, graph, specs, mine, used)
        source.update(pairs)
    if specs is not None:   # a mapped or shape-matched layer must have the stored shapes and dtypes
        for k, sid in source.items():
            if sid == mg.ids[k]:
                continue
            layer = mg.layers[k]
            want = [(dtype_name(v.dtype.as_numpy_dtype), tuple(int(d) for d in v.shape)) for v in layer.weights]
            check_mapped_specs(layer.name, sid, stored[sid], want, specs)
    report = LoadReport()
    unmatched: list[int] = []
    for k, layer in enumerate(mg.layers):
        if k not in considered or not layer.weights:
            report.skipped.append(layer.name)
            continue
        if k in source:
            report.loaded.append(layer.name)
            if source[k] != mg.ids[k]:
                report.mapped[layer.name] = source[k]
        else:
            report.missing.append(layer.name)
            if layers is not None:
                unmatched.append(k)
    report.ambiguous = [mg.layers[k].name for k in ambiguous]
    if unmatched:
        raise ModelMismatchError(f"requested layers do not match {name!r} (their upstream differs from every "
                                 f"stored layer): {', '.join(mg.layers[k].name for k in unmatched)}; nothing loaded")
    if not source:
        some = report.missing[:10] + (["..."] if len(report.missing) > 10 else [])
        raise ModelMismatchError(f"no layer with weights of model {new_model.name!r} matches {name!r} (not the "
                                 f"same layers on the same inputs, input shapes included): "
                                 f"{', '.join(some) or 'it has no layer with weights'} did not match; nothing "
                                 f"loaded (mapping= or match='shape' relax the match)")
    if strict and report.missing:
        raise ModelMismatchError(f"strict load of {name!r}: layers with weights that do not match: "
                                 f"{', '.join(report.missing)}; nothing loaded")
    targets = [(v, tensor_key(source[k], j)) for k in sorted(source) for j, v in enumerate(mg.layers[k].weights)]
    if specs is None and any(v.shape.rank == 0 for v, _ in targets):
        specs = repo.specs(name)
    keys = list(dict.fromkeys(key for _, key in targets))
    first = {}
    for v, key in targets:
        first.setdefault(key, v)
    shapes = {key: (tuple(specs[key][1]) if specs is not None and key in specs else
                    tuple(int(d) for d in first[key].shape)) for key in keys}
    for v, key in targets:   # a 0-d weight stored 1-d by DeepFreeze before 2026-11 loads back
        if shapes[key] != tuple(int(d) for d in v.shape) and not (v.shape.rank == 0 and shapes[key] == (1,)):
            raise ModelMismatchError(f"weight {v.name!r}: stored tensor {key} has shape {list(shapes[key])}, the "
                                     f"weight {v.shape.as_list()}; nothing loaded")
    kspecs = [(shapes[key], first[key].dtype.as_numpy_dtype) for key in keys]
    with _STAGING.lock:
        staged = _STAGING.views(kspecs)
        if staged is not None:  # read all (checked) into the staging buffer, then copy into the variables
            got = repo.get(name, tensors=keys, out=dict(zip(keys, staged)))
            for v, key in targets:
                _copy_into(v, got[key].reshape(v.shape))
            _STAGING.check([v for v, _ in targets])
        else:  # too big for the staging buffer: fresh arrays, taken over by the variables
            out = {key: _aligned_empty(spec[0], spec[1]) for key, spec in zip(keys, kspecs)}
            got = repo.get(name, tensors=keys, out=out)
            taken: set[str] = set()
            for v, key in targets:
                a = got[key].reshape(v.shape)
                _assign(v, a if key not in taken else a.copy())
                taken.add(key)
    report.bytes = sum(got[key].nbytes for key in keys)
    return report
