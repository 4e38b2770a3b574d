"""PyTorch adapter of DeepFreeze (imports torch; the core does not).

``Checkpointer`` captures DDP and FSDP2 checkpoints in the optimizer step; ``load`` returns a committed
version as CPU tensors keyed by ``get_state_dict`` FQNs in any process; ``restore`` puts one
into a model and its optimizers; ``Reader`` is a ``torch.distributed.checkpoint``
StorageReader over DeepFreeze checkpoints (imported on first use: it imports DCP). See
docs/torch.md.
"""
from __future__ import annotations

from typing import Any

from ._dist import TorchComm
from .checkpointer import Checkpointer
from .restore import Restored, TorchState, load, load_state, restore

__all__ = ["Checkpointer", "load", "load_state", "restore", "TorchState", "Restored", "TorchComm", "Reader"]


def __getattr__(name: str) -> Any:
    if name == "Reader":  # torch.distributed.checkpoint costs ~0.5 s to import: only when asked for
        from .dcp import Reader
        return Reader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
