"""The compact architecture graph of a stored model, as plain data and as bytes.

Plain data (what :meth:`Repository.put` takes and :meth:`Repository.graph` returns)::

    {"scheme": 2,                                   # the layer-id scheme (ids.ID_SCHEME)
     "layers": [{"id": "<32 hex>",                  # stable layer id (16 bytes)
                 "inputs": [i, ...],                # indices into "layers" of its input layers
                 "tensors": n,                      # number of weights of the layer
                 "name": "<name>"},                 # optional: the layer's name in the stored model
                ...],
     "outputs": [i, ...]}                           # indices of the model's output layers

The ``k``-th weight of a layer is stored under the tensor key ``"<id>/<k>"`` (:func:`tensor_key`),
so the graph holds ``id -> input ids`` and ``id -> tensor index``, and, where the adapter gives
them, the layers' names in the model that was stored (the PyTorch adapter: a module's qualified
name, a direct parameter's FQN), which a load by name (``match="name"``) finds the target's layers
by without tracing it; ids never depend on names. Layer metadata (class, canonical config, weight
shapes) is stored once per id, apart from the graph.

Bytes (what the repository keeps per model; little-endian, every count and index bounds-checked
on decode)::

    magic b"DFG1", scheme u16, flags u16, n_layers u32, n_outputs u32
    per layer: id 16s, n_inputs u16, n_tensors u16, n_inputs x u32 input index
    n_outputs x u32 output index
    flags & 1 (names): per layer, name length u16 (0: no name) and its UTF-8 bytes

A graph without names is encoded exactly as before names existed (flags 0); a DeepFreeze older
than names rejects a graph with them as damaged (it expects the end after the outputs).
"""
from __future__ import annotations

import re
import struct
from typing import Any

from ..errors import CorruptCheckpointError, RepositoryError

__all__ = ["tensor_key", "split_key", "check_graph", "tensor_keys", "encode_graph", "decode_graph",
           "ID_HEX_RE", "MAX_LAYERS"]

ID_HEX_RE = re.compile(r"[0-9a-f]{32}")
MAX_LAYERS = 1 << 20
_HEAD = struct.Struct("<4sHHII")
_LAYER = struct.Struct("<16sHH")
_MAGIC = b"DFG1"
_KEY_RE = re.compile(r"([0-9a-f]{32})/(\d{1,5})")
_NAMES = 1            # flags: a names section follows the outputs
MAX_NAME_BYTES = 4096  # a layer name's UTF-8 bytes


def tensor_key(layer_id: str, k: int) -> str:
    """Key of the ``k``-th weight of layer ``layer_id``."""
    return f"{layer_id}/{k}"


def split_key(key: str) -> tuple[str, int] | None:
    """``(layer id, k)`` of a layer tensor key, None for any other key."""
    m = _KEY_RE.fullmatch(key)
    return (m.group(1), int(m.group(2))) if m else None


_LAYER_KEYS = {"id", "inputs", "tensors", "name"}


def _utf8(name: str) -> bytes:
    """``name``'s UTF-8 bytes; a string that has none (a lone surrogate) gives more than any limit."""
    try:
        return name.encode()
    except UnicodeEncodeError:
        return bytes(MAX_NAME_BYTES + 1)


def check_graph(graph: Any) -> dict[str, Any]:
    """``graph`` when it is a valid plain-data graph; :class:`RepositoryError` saying what is wrong."""
    def bad(why: str) -> RepositoryError:
        return RepositoryError(f"invalid layer graph: {why}")
    if not isinstance(graph, dict) or set(graph) != {"scheme", "layers", "outputs"}:
        raise bad("expected a dict with exactly the keys 'scheme', 'layers', 'outputs'")
    if not isinstance(graph["scheme"], int) or not 0 < graph["scheme"] < 1 << 16:
        raise bad(f"scheme {graph['scheme']!r} is not a positive integer")
    layers, outputs = graph["layers"], graph["outputs"]
    if not isinstance(layers, list) or len(layers) > MAX_LAYERS:
        raise bad(f"'layers' must be a list of at most {MAX_LAYERS} layers")
    n = len(layers)
    seen: set[str] = set()
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict) or not {"id", "inputs", "tensors"} <= set(layer) <= _LAYER_KEYS:
            raise bad(f"layer {i}: expected a dict with exactly 'id', 'inputs', 'tensors' (and optionally 'name')")
        if "name" in layer:
            nm = layer["name"]
            if not isinstance(nm, str) or not nm or "\x00" in nm or len(_utf8(nm)) > MAX_NAME_BYTES:
                raise bad(f"layer {i}: name {nm!r:.80} must be a non-empty string of at most {MAX_NAME_BYTES} bytes "
                          "without NUL")
        lid, inputs, nt = layer["id"], layer["inputs"], layer["tensors"]
        if not isinstance(lid, str) or not ID_HEX_RE.fullmatch(lid):
            raise bad(f"layer {i}: id {lid!r} is not 32 lowercase hex digits")
        if lid in seen:
            raise bad(f"layer {i}: id {lid} appears twice")
        seen.add(lid)
        if not isinstance(inputs, list) or len(inputs) >= 1 << 16 or not all(
                type(j) is int and 0 <= j < n for j in inputs):
            raise bad(f"layer {i} ({lid}): inputs must be a list of layer indices below {n}")
        if type(nt) is not int or not 0 <= nt < 1 << 16:
            raise bad(f"layer {i} ({lid}): tensors must be a count in [0, 65535]")
    if not isinstance(outputs, list) or len(outputs) > n or not all(type(j) is int and 0 <= j < n for j in outputs):
        raise bad(f"outputs must be a list of layer indices below {n}")
    return graph


def tensor_keys(graph: dict[str, Any]) -> list[str]:
    """Every tensor key the graph's layers own, in layer order."""
    return [tensor_key(layer["id"], k) for layer in graph["layers"] for k in range(layer["tensors"])]


def encode_graph(graph: dict[str, Any]) -> bytes:
    """The compact bytes of a (valid) graph."""
    check_graph(graph)
    named = any("name" in layer for layer in graph["layers"])
    out = [_HEAD.pack(_MAGIC, graph["scheme"], _NAMES if named else 0, len(graph["layers"]), len(graph["outputs"]))]
    for layer in graph["layers"]:
        out.append(_LAYER.pack(bytes.fromhex(layer["id"]), len(layer["inputs"]), layer["tensors"]))
        out.append(struct.pack(f"<{len(layer['inputs'])}I", *layer["inputs"]))
    out.append(struct.pack(f"<{len(graph['outputs'])}I", *graph["outputs"]))
    if named:
        for layer in graph["layers"]:
            b = layer.get("name", "").encode()
            out.append(struct.pack("<H", len(b)) + b)
    return b"".join(out)


def decode_graph(data: bytes, where: str = "<graph>") -> dict[str, Any]:
    """The plain-data graph of :func:`encode_graph`'s bytes; :class:`CorruptCheckpointError` when
    they are truncated, oversized or inconsistent (every count and index is checked)."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: not a valid layer graph ({why}); the repository's metadata "
                                      f"is damaged: restore it from a backup or delete the model")
    if not isinstance(data, (bytes, bytearray, memoryview)):  # a database row may hold any type
        raise bad(f"a {type(data).__name__}, not bytes")
    mv = memoryview(data)
    if len(mv) < _HEAD.size:
        raise bad("truncated header")
    magic, scheme, flags, n_layers, n_outputs = _HEAD.unpack_from(mv, 0)
    if magic != _MAGIC:
        raise bad(f"magic {bytes(magic)!r}")
    if flags & ~_NAMES:
        raise bad(f"flags {flags:#x}: written by a newer DeepFreeze (update it to read this model)")
    # each layer needs at least _LAYER.size bytes and each output 4: bound the counts by the size
    if n_layers > MAX_LAYERS or _HEAD.size + n_layers * _LAYER.size + 4 * n_outputs > len(mv):
        raise bad(f"{n_layers} layers and {n_outputs} outputs do not fit in {len(mv)} bytes")
    pos = _HEAD.size
    layers = []
    for _ in range(n_layers):
        if pos + _LAYER.size > len(mv):
            raise bad("truncated layer")
        lid, n_in, n_t = _LAYER.unpack_from(mv, pos)
        pos += _LAYER.size
        if pos + 4 * n_in > len(mv):
            raise bad("truncated inputs")
        inputs = list(struct.unpack_from(f"<{n_in}I", mv, pos))
        pos += 4 * n_in
        layers.append({"id": lid.hex(), "inputs": inputs, "tensors": n_t})
    end = pos + 4 * n_outputs
    if end > len(mv) or (end != len(mv) and not flags & _NAMES):
        raise bad(f"{len(mv) - pos} bytes left for {n_outputs} outputs")
    outputs = list(struct.unpack_from(f"<{n_outputs}I", mv, pos))
    pos = end
    if flags & _NAMES:
        for layer in layers:
            if pos + 2 > len(mv):
                raise bad("truncated names")
            (n,) = struct.unpack_from("<H", mv, pos)
            pos += 2
            if n > MAX_NAME_BYTES or pos + n > len(mv):
                raise bad(f"a name of {n} bytes does not fit")
            if n:
                try:
                    layer["name"] = bytes(mv[pos:pos + n]).decode()
                except UnicodeDecodeError as e:
                    raise bad("a layer name is not UTF-8") from e
            pos += n
        if pos != len(mv):
            raise bad(f"{len(mv) - pos} bytes after the names")
    graph = {"scheme": scheme, "layers": layers, "outputs": outputs}
    try:
        return check_graph(graph)
    except RepositoryError as e:
        raise bad(str(e)) from e
