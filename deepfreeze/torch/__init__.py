"""PyTorch adapter of DeepFreeze (imports torch; the core does not).

``Checkpointer`` captures DDP and FSDP2 checkpoints in the optimizer step; ``load`` returns a committed
version as CPU tensors keyed by ``get_state_dict`` FQNs in any process; ``restore`` puts one
into a model and its optimizers; ``Reader`` is a ``torch.distributed.checkpoint``
StorageReader over DeepFreeze checkpoints and ``import_dcp`` makes a version from a DCP
checkpoint directory (both imported on first use: they import DCP). ``Publisher`` streams the
weights to serving processes, where ``Subscriber`` swaps each version into a module.
``store_model`` and ``load_into`` put modules into a model repository and load matching layers
back (``.repo``). ``CloneServer`` serves clones of a running job to another job, whose ranks take
them with ``deepfreeze.torch.clone.receive`` (``.clone``). See docs/torch.md (the loop) and torch-trainers.md, torch-siblings.md, torch-reference.md beside it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import facade

__all__ = ["Checkpointer", "load", "load_state", "restore", "TorchState", "Restored", "TorchComm", "Reader",
           "import_dcp", "Publisher", "Subscriber", "ModelSubscriber", "store_model", "load_into", "LoadReport",
           "CloneServer", "clone"]

# Reader and import_dcp import torch.distributed.checkpoint (~0.5 s): they, like every name here,
# load on first use.
__getattr__, __dir__ = facade(__name__, {
    "TorchComm": "._dist",
    "Checkpointer": ".checkpointer",
    **{n: ".state_loader" for n in ("Restored", "TorchState", "load", "load_state", "restore")},
    "Reader": ".dcp",
    "import_dcp": ".dcp_import",
    **{n: ".stream" for n in ("Publisher", "Subscriber", "ModelSubscriber")},
    **{n: ".repo" for n in ("store_model", "load_into")},
    "LoadReport": "..repo.loading",
    "CloneServer": ".clone",
})

if TYPE_CHECKING:  # for type checkers and IDEs: at run time each name loads on first use
    from ._dist import TorchComm
    from .checkpointer import Checkpointer
    from .dcp import Reader
    from .dcp_import import import_dcp
    from ..repo.loading import LoadReport
    from .repo import load_into, store_model
    from .state_loader import Restored, TorchState, load, load_state, restore
    from .clone import CloneServer
    from .stream import ModelSubscriber, Publisher, Subscriber
