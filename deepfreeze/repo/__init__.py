"""DeepFreeze model repository (DStore): stable layer ids, a compact architecture graph, partial loads.

Framework-neutral (numpy; no TensorFlow). ``Repository(path)`` is embedded (one directory, no
server); ``Repository("dstore://host1:7000,host2:7000")`` talks to provider processes
(``deepfreeze repo serve``). The Keras adapter (``deepfreeze.keras.store_model`` /
``load_into``) extracts the layer graph from a model.
"""
from __future__ import annotations

from .graph import decode_graph, encode_graph, tensor_key, tensor_keys
from .names import parse_name

__all__ = ["Repository", "parse_name", "tensor_key", "tensor_keys", "encode_graph", "decode_graph"]


def Repository(location: str, **options):  # noqa: N802 - the public name of a factory (lead fills in)
    """Open a repository: a directory path (embedded) or ``dstore://host:port[,host:port...]``."""
    raise NotImplementedError
