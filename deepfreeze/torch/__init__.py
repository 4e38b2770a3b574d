"""PyTorch adapter of DeepFreeze (imports torch; the core does not).

``Checkpointer`` captures DDP and FSDP2 checkpoints in the optimizer step; ``load`` returns a committed
version as CPU tensors keyed by ``get_state_dict`` FQNs in any process; ``restore`` puts one
into a model and its optimizers. See docs/torch.md.
"""
from __future__ import annotations

from ._dist import TorchComm
from .checkpointer import Checkpointer
from .restore import TorchState, load, load_state, restore

__all__ = ["Checkpointer", "load", "load_state", "restore", "TorchState", "TorchComm"]
