"""Lazy package facades (PEP 562), layer L0: a package ``__init__`` that imports nothing when it
runs and loads each public name from its module on first use.

Every package ``__init__`` of DeepFreeze is such a facade, so importing any module runs no module
above it (docs/architecture.md, "Floor plan"; tests/test_layers.py checks it)::

    __getattr__, __dir__ = facade(__name__, {"Publisher": ".core", "Subscriber": ".core"})
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

__all__ = ["facade"]


def facade(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``names`` maps each public name to the
    module (relative to ``package``, e.g. ``".core"``; ``"module:attr"`` when the attribute is
    named otherwise there) it is loaded from; a submodule's own name loads the submodule."""

    def __getattr__(name: str) -> Any:
        spec = names.get(name)
        if spec is None:
            if not name.startswith("__"):
                try:  # a submodule (``deepfreeze.repo.store``) reached as an attribute, as before
                    return importlib.import_module(f"{package}.{name}")
                except ModuleNotFoundError as e:
                    if e.name != f"{package}.{name}":
                        raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attr = spec.partition(":")
        value = getattr(importlib.import_module(module, package), attr or name)
        setattr(sys.modules[package], name, value)  # later lookups find it without __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__

