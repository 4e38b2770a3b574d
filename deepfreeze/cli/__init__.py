"""``deepfreeze``: list, inspect, verify, export and clean up checkpoints; talk to the backend.

    deepfreeze --version
    deepfreeze ls       [--config FILE] [--name NAME] [--set KEY=VALUE ...] [--json]
    deepfreeze inspect  [...] [--version V] [--json]
    deepfreeze verify   [...] [--version V | --all] [--json]
    deepfreeze export   [...] [--version V] --format h5|npz|safetensors --output PATH [--force]
    deepfreeze gc       [...] [--dry-run]
    deepfreeze backend  status|stop [...]
    deepfreeze repo     ls|info|rm|gc|import|serve|token ...   (the model repository)
    deepfreeze memtier  create|view|dump|repack ...             (the memory tier)
    deepfreeze import   --format dcp DIR --name NAME --step S [...] (PyTorch: from a DCP checkpoint)

A package of thin command modules (``ls``, ``inspect``, ``verify``, ``export``,
``gc``, ``backend``, ``repo``, ``memtier``; shared helpers in ``_common``) over the core: scanning,
describing, verifying and gc planning live in :mod:`deepfreeze.inventory`,
reading in :mod:`deepfreeze.loader`. The configuration is built as the training
side builds it: ``Config.resolve(--config, **--set)``, so ``VELOC_<KEY>``
environment variables apply between the file and ``--set``. Imports no
TensorFlow. Exit codes: 0 success, 1 damaged / not found / I/O error, 2 usage
or configuration error; every error is one line on stderr, never a traceback.
Documented in docs/cli.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import facade

__all__ = ["main", "build_parser", "load_config", "EXIT_OK", "EXIT_FAIL", "EXIT_USAGE"]

__getattr__, __dir__ = facade(__name__, {
    "main": ".app", "build_parser": ".app",
    **{n: "._common" for n in ("load_config", "EXIT_OK", "EXIT_FAIL", "EXIT_USAGE")},
})

if TYPE_CHECKING:  # for type checkers and IDEs: at run time each name loads on first use
    from ._common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, load_config
    from .app import build_parser, main
