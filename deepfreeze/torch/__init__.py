"""PyTorch adapter of DeepFreeze (imports torch; the core does not).

``Checkpointer`` captures DDP and FSDP2 checkpoints in the optimizer step; ``load`` returns a committed
version as CPU tensors keyed by ``get_state_dict`` FQNs in any process; ``restore`` puts one
into a model and its optimizers; ``Reader`` is a ``torch.distributed.checkpoint``
StorageReader over DeepFreeze checkpoints and ``import_dcp`` makes a version from a DCP
checkpoint directory (both imported on first use: they import DCP). See docs/torch.md.
"""
from __future__ import annotations

from typing import Any

from ._dist import TorchComm
from .checkpointer import Checkpointer
from .restore import Restored, TorchState, load, load_state, restore

__all__ = ["Checkpointer", "load", "load_state", "restore", "TorchState", "Restored", "TorchComm", "Reader",
           "import_dcp"]


def __getattr__(name: str) -> Any:
    if name == "Reader":  # torch.distributed.checkpoint costs ~0.5 s to import: only when asked for
        from .dcp import Reader
        return Reader
    if name == "import_dcp":  # imports DCP too
        from .dcp_import import import_dcp
        return import_dcp
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
