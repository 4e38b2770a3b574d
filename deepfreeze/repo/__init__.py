"""DeepFreeze model repository (DStore): stable layer ids, a compact architecture graph, partial loads.

Framework-neutral (numpy; no TensorFlow). ``Repository(path)`` is embedded (one directory, no
server, the same code the providers run); ``Repository("dstore://host1:7000,host2:7000")`` talks to
provider processes (``deepfreeze repo serve``), each model living whole on one of them. The Keras
adapter (:func:`deepfreeze.keras.store_model`, :func:`deepfreeze.keras.load_into`) extracts the
layer graph from a model. Documented in docs/repository.md.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .._lazy import facade
from ..errors import RepositoryError

__all__ = ["Repository", "SCHEME", "parse_name", "tensor_key", "tensor_keys", "encode_graph", "decode_graph"]

__getattr__, __dir__ = facade(__name__, {
    **{n: ".graph" for n in ("decode_graph", "encode_graph", "tensor_key", "tensor_keys")},
    "parse_name": ".names",
})

if TYPE_CHECKING:  # for type checkers and IDEs: at run time each name loads on first use
    from .graph import decode_graph, encode_graph, tensor_key, tensor_keys
    from .names import parse_name

#: URL scheme of a repository served by provider processes
SCHEME = "dstore://"


def Repository(location: "str | os.PathLike[str]", **options: Any) -> Any:  # noqa: N802 - a class-like factory
    """Open a repository.

    ``location``: a directory (embedded: created ``0700`` when missing; options ``fsync=False``,
    ``verify=True``) or ``"dstore://host:port[,host:port...]"`` (providers; options ``token=None``
    (else ``DEEPFREEZE_TOKEN``, the token text itself, or the file ``DEEPFREEZE_TOKEN_FILE`` names, or
    ``~/.deepfreeze/token``), ``timeout=60.0``, ``staging=None``:
    ``"arena"`` on the providers' node, ``"tcp"`` otherwise). Both kinds have the same methods:
    ``put``, ``get``, ``specs``, ``graph``, ``layer_meta``, ``list``, ``info``, ``delete``, ``gc``,
    ``close``, and are context managers.
    """
    loc = os.fspath(location)
    if not isinstance(loc, str) or not loc:
        raise RepositoryError(f"repository location {location!r}: give a directory or '{SCHEME}host:port,...'")
    if loc.startswith(SCHEME):
        from .client import RemoteRepository
        return RemoteRepository(loc, **options)
    if "://" in loc:
        raise RepositoryError(f"repository location {loc!r}: unknown scheme; use a directory path or "
                              f"'{SCHEME}host:port[,host:port...]'")
    from .store import EmbeddedRepository
    return EmbeddedRepository(loc, **options)
