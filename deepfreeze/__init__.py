"""DeepFreeze: asynchronous, sharded, multi-level checkpoints for data-parallel training.

The core (this package) is framework-neutral and imports no TensorFlow; the Keras/Horovod
adapter lives in :mod:`deepfreeze.keras`, the PyTorch one in :mod:`deepfreeze.torch`.

This module is a lazy facade (PEP 562, layer L8 of docs/architecture.md): importing any
``deepfreeze.<module>`` runs it, and it imports nothing at that time, so a low module never
pulls in a higher one through the package. Its public names are loaded on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._lazy import facade

__version__ = "0.1.0"

__all__ = [
    "Config", "Checkpoint", "load", "list_versions", "restore",
    "DeepFreezeError", "ConfigError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "ModelMismatchError", "BackendError", "CheckpointWriteError", "VelocNotFoundError", "VelocError",
    "UnsafePathError", "UntrustedOwnerError", "CaptureMissedError",
]

__getattr__, __dir__ = facade(__name__, {
    "Config": ".config",
    "Checkpoint": ".loader", "load": ".loader", "list_versions": ".loader",
    **{n: ".errors" for n in ("DeepFreezeError", "ConfigError", "CheckpointNotFoundError", "CorruptCheckpointError",
                              "ModelMismatchError", "BackendError", "CheckpointWriteError", "VelocNotFoundError",
                              "VelocError", "UnsafePathError", "UntrustedOwnerError", "CaptureMissedError")},
})

if TYPE_CHECKING:  # for type checkers and IDEs only: at run time these load on first use
    from .config import Config
    from .errors import (BackendError, CaptureMissedError, CheckpointNotFoundError, CheckpointWriteError,
                         ConfigError, CorruptCheckpointError, DeepFreezeError, ModelMismatchError, UnsafePathError,
                         UntrustedOwnerError, VelocError, VelocNotFoundError)
    from .loader import Checkpoint, list_versions, load


def restore(model: Any, config: "str | Config | None" = None, *, name: str, version: int | None = None,
            engine: str | None = None, trust_owners: "list[str | int] | None" = None,
            input_spec: Any = None, **overrides: Any) -> tuple[int, int]:
    """Load the newest recoverable version (or ``version``) of ``name``'s weights into ``model``: a
    Keras model (:func:`deepfreeze.keras.restore`) or a ``torch.nn.Module``
    (:func:`deepfreeze.torch.restore`, weights only: no optimizer).

    Returns ``(version, step)``. Works in a plain process (no MPI) and at any
    world size; under Horovod with several ranks (or ``torch.distributed``) it is collective (every rank
    calls it): the ranks pool their nodes' scratch files (shards, partner copies,
    parity) before falling back to persistent. ``engine`` is accepted for symmetry
    with the callback (both engines write the same files; restore reads them the
    same way). Raises :class:`CheckpointNotFoundError` when nothing is committed
    and :class:`ModelMismatchError` naming the first tensor that does not match.
    ``trust_owners`` (user names or uids): also read persistent files these users own (by
    default only yours and root's; another owner is an error naming them).
    ``input_spec`` (Keras only): build an unbuilt model first from the data it will be fit on (a
    ``tf.data.Dataset`` or its ``element_spec``), as the checkpoint callback does at the first step.

    The model's kind is told without importing a framework: a PyTorch model never imports
    TensorFlow, and a Keras model never imports torch.
    """
    import sys
    from .tiers import ENGINES
    from .errors import ConfigError
    if engine is not None and engine not in ENGINES:
        raise ConfigError(f"engine = {engine!r}: use one of {ENGINES} (restore reads the same files for all)")
    torch = sys.modules.get("torch")  # a torch model exists only once torch is imported
    if torch is not None and isinstance(model, torch.nn.Module):
        if input_spec is not None:
            raise ConfigError("input_spec is for Keras models: build a torch.nn.Module before restoring into it")
        from .torch.state_loader import restore as restore_torch
        restored = restore_torch(model, None, config, name=name, version=version, trust_owners=trust_owners,
                                 **overrides)
        return restored.version, restored.step
    if not _is_keras(model):
        raise TypeError(f"deepfreeze.restore: {type(model).__module__}.{type(model).__qualname__} is neither a "
                        "Keras model nor a torch.nn.Module")
    from .keras.state_loader import restore_model  # the only TensorFlow-dependent step
    return restore_model(model, config, name=name, version=version, trust_owners=trust_owners,
                         input_spec=input_spec, **overrides)


def _is_keras(model: Any) -> bool:
    """Whether ``model``'s class (or a base) comes from Keras or TensorFlow; imports neither."""
    return any(str(getattr(c, "__module__", "")).split(".")[0] in ("keras", "tensorflow", "tf_keras")
               for c in type(model).__mro__)
