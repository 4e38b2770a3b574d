"""Keras/Horovod adapter of DeepFreeze (imports TensorFlow; the core does not)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import facade

__all__ = ["DeepFreezeCheckpoint", "CaptureOptions", "restore", "CloneCallback", "receive_clone",
           "store_model", "load_into", "LoadReport", "PublishCallback", "ModelSubscriber"]

__getattr__, __dir__ = facade(__name__, {
    "DeepFreezeCheckpoint": ".callback",
    "CaptureOptions": ".callback",
    "CloneCallback": ".clone",
    "receive_clone": ".clone",
    "store_model": ".repo",
    "load_into": ".repo",
    "LoadReport": "..repo.loading",
    "restore": ".state_loader:restore_model",
    "PublishCallback": ".stream",
    "ModelSubscriber": ".stream",
})

if TYPE_CHECKING:  # for type checkers and IDEs: at run time each name loads on first use
    from .callback import CaptureOptions, DeepFreezeCheckpoint
    from .clone import CloneCallback, receive_clone
    from ..repo.loading import LoadReport
    from .repo import load_into, store_model
    from .state_loader import restore_model as restore
    from .stream import ModelSubscriber, PublishCallback
