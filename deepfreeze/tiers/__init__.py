"""Storage tiers: where a version's shards go, and the one place that decides it.

A version leaves the writer by one of four ways out; each is one module of this package:

* :mod:`~deepfreeze.tiers.scratch`: a shard file per rank on node-local scratch (with partner
  copies or XOR parity as a step of its write), flushed to persistent by the node's backend;
* :mod:`~deepfreeze.tiers.memtier`: a slot of the node's memory-tier device (``memtier``),
  registered when the engine starts, flushed from the slot;
* :mod:`~deepfreeze.tiers.direct`: write once, from memory into persistent's partial (a version
  decided ``flush``, ``write_once`` in effect);
* VeloC's own files (``engine="veloc"``: :class:`deepfreeze.veloc_engine.VelocEngine`, an engine
  of its own that uses the scratch tier's layout and the persistent tier's finalize).

:mod:`~deepfreeze.tiers.persistent` is the last tier, with the commit protocol;
:mod:`~deepfreeze.tiers.flush` runs one rank's flush; :mod:`~deepfreeze.tiers.shardbytes` holds
the byte helpers; :mod:`~deepfreeze.tiers.base` the :class:`~deepfreeze.tiers.base.Tier`
interface, the layout every directory tier shares and the pooled read order
(:data:`~deepfreeze.tiers.base.READ_ORDER`).

:func:`choose` decides, once per engine, the tier set and the per-version route; every rule lives
here: the engine (:func:`resolve_engine`: built-in or VeloC), the memory tier's refusal of VeloC
(and ``engine='auto'`` taking the built-in engine when ``memtier`` is set), the memory tier's
device check, and whether write once is in effect (:func:`write_once`). Per version the writer
then follows :meth:`Tiers.route`: the memory tier when set; else, with write once, the version's
decision (taken by the writer itself): ``flush`` goes direct, ``skip`` or a lost lease to
scratch; else scratch. :func:`deepfreeze.run.make_engine` and :class:`deepfreeze.engine.Engine`
ask :func:`choose`; neither decides itself.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os

from ..config import Config
from ..errors import ConfigError

__all__ = ["Tiers", "choose", "resolve_engine", "write_once", "ENGINES"]

log = logging.getLogger("deepfreeze")

#: the engine names ``engine=`` accepts
ENGINES = ("builtin", "veloc", "auto")


def resolve_engine(engine: str | None) -> str:
    """``builtin`` or ``veloc`` for ``engine`` (``None``: ``$DEEPFREEZE_ENGINE``, else builtin;
    ``auto``: VeloC when its library can be loaded, else builtin)."""
    engine = engine or os.environ.get("DEEPFREEZE_ENGINE") or "builtin"
    if engine not in ENGINES:
        raise ConfigError(f"engine = {engine!r}: use 'builtin' (no dependency), 'veloc' (a VeloC install pointed "
                          "to by DEEPFREEZE_VELOC_PREFIX) or 'auto' (VeloC when found, else builtin)")
    if engine == "auto":
        from deepfreeze.bindings.veloc import available
        why = available()
        if why is not None:
            log.info("deepfreeze: engine='auto' uses the built-in engine: %s", why)
        return "builtin" if why is not None else "veloc"
    if engine == "veloc":
        from deepfreeze.bindings.veloc import available
        from ..errors import VelocNotFoundError
        why = available()
        if why is not None:
            raise VelocNotFoundError(why)
    return engine


def write_once(config: Config) -> tuple[bool, str]:
    """Whether ``config``'s built-in engine writes versions decided ``flush`` once into persistent,
    and why (INI ``write_once``; :mod:`deepfreeze.tiers.direct`). Logged once per process and
    configuration (INFO)."""
    return _write_once(config.write_once, config.scratch, config.persistent, config.ec_interval >= 0,
                       config.memtier is not None, config.persistent_interval < 0)


@functools.lru_cache(maxsize=64)
def _write_once(mode: str, scratch: str, persistent: str, ec: bool, memtier: bool,
                no_persistent: bool) -> tuple[bool, str]:
    if mode == "off":
        on, why = False, "write_once = off"
    elif no_persistent:
        on, why = False, "persistent_interval < 0: nothing goes to persistent"
    elif memtier:
        on, why = False, "memtier is set: the memory tier already writes each version once"
    elif ec:
        on, why = False, "ec_interval >= 0: partner copies and parity protect scratch files"
    elif mode == "on":
        on, why = True, "write_once = on"
    else:
        from .direct import same_file_system
        on, why = same_file_system(scratch, persistent)
        why = f"write_once = auto: scratch {scratch} and persistent {persistent}: {why}"
    log.info("deepfreeze: versions decided 'flush' are written %s (%s)",
             "once, straight into persistent" if on else "to scratch, then copied to persistent", why)
    return on, why


@dataclasses.dataclass(frozen=True)
class Tiers:
    """The tier set of one engine and its per-version route (:func:`choose`)."""

    #: ``builtin`` or ``veloc`` (VeloC replaces both the writer and the flusher)
    engine: str
    #: versions go to memory-tier slots (the rank's shard registered when the engine starts)
    memtier: bool
    #: versions decided ``flush`` are written once, from memory into persistent
    write_once: bool

    @property
    def wants_decision(self) -> bool:
        """Whether the writer decides each version itself before :meth:`route` (write once in
        effect: :func:`deepfreeze.tiers.direct.decide`, the flush's own call)."""
        return self.write_once and not self.memtier

    def route(self, decision: str | None = None) -> str:
        """Where one version goes, named as the flush job's source kind (:mod:`deepfreeze.tiers.job`):
        ``memtier``; ``direct`` when write once is in effect and the writer's decision
        (:func:`deepfreeze.tiers.direct.decide`, taken by this run) is ``flush``; else (``skip``, no
        decision, the lease lost) ``scratch``. The engine's writer follows it and nothing else."""
        if self.memtier:
            return "memtier"
        if self.write_once and decision == "flush":
            return "direct"
        return "scratch"


def choose(config: Config, engine: str | None = None, *, resolved: bool = False) -> Tiers:
    """The tiers an engine for ``config`` writes to, with ``engine`` (``None``:
    ``$DEEPFREEZE_ENGINE``, else builtin; ``auto``; :func:`resolve_engine`). The memory tier is the
    built-in engine's: with ``memtier`` set, ``veloc`` is a :class:`ConfigError` and ``auto`` takes
    the built-in engine (decided before looking for VeloC); the device must exist
    (:meth:`Config.check_memtier`; its content is checked when the tier registers the shard).
    ``resolved``: ``engine`` is the kind of an engine being built (``builtin`` or ``veloc``, already
    resolved by :func:`deepfreeze.run.make_engine` or chosen by the class): not looked up again."""
    requested = engine or os.environ.get("DEEPFREEZE_ENGINE") or "builtin"
    if config.memtier is not None:
        if requested == "veloc":
            raise ConfigError(f"memtier = {config.memtier} ({config.where('memtier')}) needs the built-in engine: "
                              "with engine='veloc' the shards go through VeloC's files; leave memtier out or use "
                              "engine='builtin'")
        if requested == "auto":
            log.info("deepfreeze: engine='auto' uses the built-in engine: memtier is set")
            requested = "builtin"
        config.check_memtier()
    kind = requested if resolved else resolve_engine(requested)
    direct = kind == "builtin" and config.memtier is None and write_once(config)[0]
    return Tiers(engine=kind, memtier=config.memtier is not None, write_once=direct)
