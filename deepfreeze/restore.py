"""Deprecated alias of :mod:`deepfreeze.loader` (the module that reads versions back), kept for
one release: ``from deepfreeze.restore import load`` warns and works.

``deepfreeze.restore`` is the public function (:func:`deepfreeze.restore`); importing this
module makes the package attribute of that name this module, so the module is callable and
calls that function: ``deepfreeze.restore(model, ...)`` works whatever was imported first.
"""
from __future__ import annotations

import sys
import warnings

from ._lazy import callable_module
from .loader import *  # noqa: F401,F403  the names the module had
from .loader import __all__  # noqa: F401

warnings.warn("the module deepfreeze.restore is renamed deepfreeze.loader: import load, list_versions and "
              "Checkpoint from deepfreeze.loader (or deepfreeze); this alias goes in the next release",
              DeprecationWarning, stacklevel=2)


callable_module(__name__, lambda: sys.modules["deepfreeze"]._restore_function)
