"""Keras/Horovod adapter of DeepFreeze (imports TensorFlow; the core does not)."""
from __future__ import annotations

from .callback import CaptureOptions, DeepFreezeCheckpoint
from .clone import CloneCallback, receive_clone
from .repo import LoadReport, load_into, store_model
from .restore import restore_model as restore
from .stream import ModelSubscriber, PublishCallback

__all__ = ["DeepFreezeCheckpoint", "CaptureOptions", "restore", "CloneCallback", "receive_clone",
           "store_model", "load_into", "LoadReport", "PublishCallback", "ModelSubscriber"]
