"""The memory tier: a serialization-free checkpoint level in (persistent) memory, after Portus.

One preallocated, pre-faulted *device* file per node (default under ``/dev/shm``) holds a
three-level index (an append-only model table -> one index per (model, shard) with every
tensor's offset -> contiguous tensor data) and two (``memtier_slots``) slots per (model, shard),
written in the order header ACTIVE -> data -> flush -> header DONE, so a crash at any moment
leaves the previous version restorable. With ``memtier = PATH`` in the config the checkpoint
engine's shards go there: the node backend copies each rank's capture buffer straight from the
rank's memory (``process_vm_readv``) into a slot, then flushes from the slot to persistent.

Standalone use for any numpy state (no engine, no TensorFlow)::

    from deepfreeze import memtier
    dev = memtier.create("/dev/shm/tier", "8G")        # once; later memtier.open(path)
    model = memtier.register(dev, "state", arrays)     # layout once (MemtierFullError if too big)
    memtier.checkpoint(model, arrays, step=1)          # one copy into a slot, CRC while copying
    arrays, version = memtier.restore(dev, "state")    # newest DONE version, bit-exact
    memtier.view(dev.path)                             # models, shards, slots, free space

Modules: :mod:`~deepfreeze.memtier.device` (the device file, its model table protocol, repack),
:mod:`~deepfreeze.memtier.layout` (the on-device format: records and their checks),
:mod:`~deepfreeze.memtier.slot` (a region's slots: the slot commit protocol, readers),
:mod:`~deepfreeze.memtier.copy` (``process_vm_readv`` and in-process copiers, the memtier's only
native calls, through :mod:`deepfreeze._native`), :mod:`~deepfreeze.memtier.api` (standalone use),
:mod:`~deepfreeze.memtier.jobs` (whose regions a job reads; which runs are reclaimed or evicted),
:mod:`~deepfreeze.memtier.dumper` (export to .npz/.h5/.safetensors). The tier as a restore level and as
a tier of the write path is :mod:`deepfreeze.tiers.memtier`. docs/memtier.md has the details.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import facade

__all__ = ["create", "open", "register", "checkpoint", "restore", "view", "dump", "job_id",
           "Device", "Model", "ShardRegion", "SlotHeader", "SlotState"]

__getattr__, __dir__ = facade(__name__, {
    "register": ".api",
    "checkpoint": ".api",
    "restore": ".api",
    "view": ".api",
    "job_id": ".api",
    "Model": ".api",
    "create": ".device",
    "open": ".device",
    "Device": ".device",
    "ShardRegion": ".slot",
    "SlotHeader": ".layout",
    "SlotState": ".layout",
    "dump": ".dumper",
})

if TYPE_CHECKING:  # for type checkers and IDEs: at run time each name loads on first use
    from .api import Model, checkpoint, job_id, register, restore, view
    from .device import Device, create, open  # noqa: A004 - the documented name
    from .layout import SlotHeader, SlotState
    from .slot import ShardRegion
    from .dumper import dump
