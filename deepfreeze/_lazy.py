"""Lazy package facades (PEP 562), layer L0: a package ``__init__`` that imports nothing when it
runs and loads each public name from its module on first use.

Every package ``__init__`` of DeepFreeze is such a facade, so importing any module runs no module
above it (docs/architecture.md, "Floor plan"; tests/test_layers.py checks it)::

    __getattr__, __dir__ = facade(__name__, {"Publisher": ".core", "Subscriber": ".core"})
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Callable

__all__ = ["facade", "callable_module"]


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


class _CallableModule(types.ModuleType):
    """A module that is also its package's function of the same name (see :func:`callable_module`)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["__deepfreeze_call__"]()(*args, **kwargs)


def callable_module(module: str, function: Callable[[], Callable[..., Any]]) -> None:
    """Make the module ``module`` callable as the function ``function()`` returns.

    For a package whose public function and one of its modules share a name
    (``deepfreeze.restore``, ``deepfreeze.keras.restore``, ``deepfreeze.torch.restore``): importing
    the module makes the package attribute of that name the module (Python's import system sets
    it after the module ran), so calling ``package.name(...)`` must work on the module too,
    whatever was imported first."""
    mod = sys.modules[module]
    mod.__dict__["__deepfreeze_call__"] = function
    mod.__class__ = _CallableModule
