"""Stream model updates from training to inference consumers (Viper), framework-neutral.

:class:`Publisher` (one per producer rank) and :class:`Subscriber` (a consumer) move each
published version memory-first: a shared-memory slot ring on the producer's node
(:mod:`.slots`), a direct TCP transfer from every producer rank (:mod:`.wire`), the persistent
DeepFreeze checkpoint as the last resort; notifications are pushed (by each rank's server, or
Redis). :mod:`.predict` fits the learning curve and plans when to publish. The Keras side
(``PublishCallback``, ``ModelSubscriber``) is in :mod:`deepfreeze.keras`. No TensorFlow here.
"""
from __future__ import annotations

from .core import Publisher, StreamOptions, Subscriber, Update, read_endpoints

__all__ = ["Publisher", "Subscriber", "Update", "StreamOptions", "read_endpoints"]
