"""Stream model updates from training to inference consumers (Viper), framework-neutral.

:class:`Publisher` (one per producer rank) and :class:`Subscriber` (a consumer) move each
published version memory-first: a shared-memory slot ring on the producer's node
(:mod:`.slots`), a direct TCP transfer from every producer rank (:mod:`.wire`), the persistent
DeepFreeze checkpoint as the last resort; notifications are pushed (by each rank's server, or
Redis). :mod:`.predict` fits the learning curve and plans when to publish; :mod:`.serve` is
the consumers' double buffer. The Keras side (``PublishCallback``, ``ModelSubscriber``) is in
:mod:`deepfreeze.keras`, the PyTorch side (``Publisher``, ``Subscriber``) in
:mod:`deepfreeze.torch`. No TensorFlow here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import facade

__all__ = ["Publisher", "Subscriber", "Update", "StreamOptions", "read_endpoints"]

__getattr__, __dir__ = facade(__name__, {
    "Publisher": ".core",
    "Subscriber": ".core",
    "Update": ".core",
    "StreamOptions": ".core",
    "read_endpoints": ".core",
})

if TYPE_CHECKING:  # for type checkers and IDEs: at run time each name loads on first use
    from .core import Publisher, StreamOptions, Subscriber, Update, read_endpoints
