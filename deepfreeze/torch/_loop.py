"""The passes of :meth:`Checkpointer.iterate <deepfreeze.torch.Checkpointer.iterate>`: where a
pass over a loader stands, kept in the state record, and how a resumed pass gets back there.

A pass is one ``iterate(iterable)`` (an epoch of a ``DataLoader``). At each boundary (before the
next item is fetched, and when the iterable is exhausted) the Checkpointer's state record may
take :meth:`Pass.record`: ``{"pass": index, "yielded": items fetched, "done": bool}`` plus either
``"loader"`` (the iterable's ``state_dict()``: torchdata's ``StatefulDataLoader``) or ``"rng"``
(the process's RNG states, and the loader's ``generator`` state, when the pass began). The first
pass after a resume (:meth:`Passes.resume_from`) is placed there: a stateful loader is given its
state back; any other iterable is replayed from the RNG states of its pass's start (the same base
seed, sampler order and worker seeds are drawn) and the items already fetched are fetched again
and dropped; then the checkpoint's own RNG states (restored by resume) are set again.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from ..errors import CorruptCheckpointError, ModelMismatchError
from . import _state

__all__ = ["Pass", "Passes"]


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _generator_of(iterable: Any) -> "torch.Generator | None":
    g = getattr(iterable, "generator", None)
    return g if isinstance(g, torch.Generator) else None


class Pass:
    """One pass of ``iterate`` over an iterable."""

    __slots__ = ("index", "yielded", "rng", "loader", "done")

    def __init__(self, index: int, rng: "dict[str, Any] | None", loader: Any) -> None:
        self.index, self.yielded, self.rng, self.loader, self.done = index, 0, rng, loader, False

    def record(self) -> dict[str, Any]:
        """What the state record keeps of it (taken at a boundary)."""
        out: dict[str, Any] = {"pass": self.index, "yielded": self.yielded, "done": self.done}
        if self.loader is not None:
            out["loader"] = self.loader.state_dict()
        else:
            out["rng"] = self.rng
        return out


def check_record(loop: Any, where: str) -> dict[str, Any]:
    """The ``loop`` entry of a state record (:meth:`Pass.record`), its types checked."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: its state record's loop position is damaged ({why}): restore "
                                      "another version, or resume without iterate()")
    if not isinstance(loop, dict):
        raise bad(f"a {type(loop).__name__}, not a dict")
    for key in ("pass", "yielded"):
        v = loop.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 62:
            raise bad(f"{key} = {str(v)[:40]!r}")
    if "loader" not in loop:
        rng = loop.get("rng")
        if not isinstance(rng, dict) or not isinstance(rng.get("process"), dict) \
                or not {"torch", "numpy", "python"} <= set(rng["process"]) \
                or not isinstance(rng.get("generator", torch.empty(0, dtype=torch.uint8)), torch.Tensor):
            raise bad("no RNG states of its pass's start")
    return loop


class Passes:
    """The passes of one Checkpointer: how many began, the current one, the resumed position."""

    def __init__(self) -> None:
        self.begun = 0  # passes begun (the resumed checkpoint's count included)
        self.current: Pass | None = None  # the current (or last) pass
        self._resume: "dict[str, Any] | None" = None  # the resumed record's pass, for the next iterate()

    def resume_from(self, loop: Any, where: str) -> int:
        """Place the next pass where the resumed record's was; its index (the epoch to resume)."""
        self._resume = check_record(loop, where)
        return self._resume["pass"]

    def iterate(self, iterable: Any, end_iteration: Callable[[], None], name: str) -> Iterator[Any]:
        """The items of ``iterable``, ``end_iteration()`` before each next one is fetched."""
        resume, self._resume = self._resume, None
        stateful = _stateful(iterable)
        gen = _generator_of(iterable)
        skip, at_boundary = 0, None
        if resume is not None:
            at_boundary = _state.rng_state()  # the checkpoint's, restored by resume: set again once placed
            if stateful and "loader" in resume:
                iterable.load_state_dict(resume["loader"])  # (its iter() draws a seed again: undone below)
            elif not stateful and resume.get("rng") is not None:
                skip = resume["yielded"]
                try:
                    _state.set_rng_state(resume["rng"]["process"])
                    if gen is not None and "generator" in resume["rng"]:
                        gen.set_state(resume["rng"]["generator"])
                except (TypeError, ValueError, RuntimeError) as e:
                    _state.set_rng_state(at_boundary)
                    raise CorruptCheckpointError(f"checkpoint {name!r}: the RNG states of its pass's start cannot "
                                                 f"be set ({type(e).__name__}: {e}): restore another version") from e
            self.begun = resume["pass"]
        start = None
        if not stateful:
            start = {"process": _state.rng_state()}
            if gen is not None:
                start["generator"] = gen.get_state()
        p = self.current = Pass(self.begun, start, iterable if stateful else None)
        self.begun += 1
        it = iter(iterable)
        for k in range(skip):
            try:
                next(it)
            except StopIteration:
                raise ModelMismatchError(
                    f"checkpoint {name!r}: its pass {p.index} had fetched {skip} items, this iterable has {k}: "
                    "resume with the same data, batch size and sampler (or a StatefulDataLoader)") from None
        p.yielded = skip
        if at_boundary is not None:
            _state.set_rng_state(at_boundary)
        while True:
            try:
                item = next(it)
            except StopIteration:
                break
            p.yielded += 1
            yield item
            end_iteration()
        p.done = True
