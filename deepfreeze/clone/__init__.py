"""DeepClone: fork a running data-parallel group into clone groups, state sent rank to rank.

Framework-neutral core (numpy + mpi4py, no TensorFlow): :func:`split` makes the groups,
:class:`ClonePlan` says who sends what, :class:`Sender`/:class:`Receiver` move it
(protocol in :mod:`deepfreeze.clone.transfer`), :func:`send`/:func:`receive` do a whole
transfer of numpy arrays; :mod:`deepfreeze.clone.wire` moves a clone between two independent jobs
over authenticated TCP (the PyTorch adapter's transport, :mod:`deepfreeze.torch.clone`). The Keras side (the in-graph sink, ``CloneCallback``,
``receive_clone``) is in :mod:`deepfreeze.keras.clone`. Guide: docs/clone.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import facade

__all__ = ["Group", "split", "ClonePlan", "Route", "Sender", "Receiver", "CloneInfo", "send", "receive",
           "plans_for", "DEFAULT_THRESHOLD", "DEFAULT_TIMEOUT"]

__getattr__, __dir__ = facade(__name__, {
    "Group": ".group", "split": ".group",
    "ClonePlan": ".plan", "Route": ".plan", "DEFAULT_THRESHOLD": ".plan",
    "Sender": ".transfer", "Receiver": ".transfer", "DEFAULT_TIMEOUT": ".transfer",
    "CloneInfo": ".api", "send": ".api", "receive": ".api", "plans_for": ".api",
})

if TYPE_CHECKING:  # for type checkers and IDEs: at run time each name loads on first use
    from .api import CloneInfo, plans_for, receive, send
    from .group import Group, split
    from .plan import DEFAULT_THRESHOLD, ClonePlan, Route
    from .transfer import DEFAULT_TIMEOUT, Receiver, Sender
