"""Splitting one MPI job into a source group and clone groups (:func:`split`).

Group ``g`` is a contiguous block of world ranks (group 0, the source, first). Each
group gets its own communicator (``Group.comm``, for ``hvd.init(comm=...)``); the
source and its clones talk over ``Group.bridge``, a duplicate of the parent
communicator that Horovod never sees. Both are made collectively on every rank of the
parent communicator by :func:`split`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ..errors import ConfigError

__all__ = ["Group", "split"]


@dataclasses.dataclass(frozen=True, eq=False)
class Group:
    """This rank's group of a :func:`split`.

    ``index``: 0 for the source group, 1.. for clone groups. ``rank``/``size``: within the
    group. ``comm``: the group's communicator (give it to ``hvd.init(comm=...)``).
    ``bridge``: a duplicate of the parent communicator for source <-> clone traffic.
    ``sizes``: every group's size; ``world_rank``: this rank in the parent communicator.
    """

    index: int
    rank: int
    size: int
    sizes: tuple[int, ...]
    world_rank: int
    comm: Any
    bridge: Any

    @property
    def is_source(self) -> bool:
        return self.index == 0

    def members(self, index: int) -> list[int]:
        """The parent-communicator ranks of group ``index``, in group-rank order."""
        if not 0 <= index < len(self.sizes):
            raise ValueError(f"group index {index} out of range: the job has {len(self.sizes)} groups")
        start = sum(self.sizes[:index])
        return list(range(start, start + self.sizes[index]))

    @property
    def source(self) -> list[int]:
        """The source group's ranks in the parent communicator."""
        return self.members(0)

    @property
    def clones(self) -> list[int]:
        """The indices of the clone groups (1 .. len(sizes) - 1)."""
        return list(range(1, len(self.sizes)))


def split(groups: int | None = None, sizes: Sequence[int] | None = None, *, comm: Any = None) -> Group:
    """Split ``comm`` (default ``MPI.COMM_WORLD``) into groups of contiguous ranks; collective.

    ``groups=G``: G equal groups (the world size must divide by G). ``sizes=(n0, n1, ...)``:
    groups of these sizes (they must add up to the world size). Group 0 is the source; the
    others are clone groups. Give exactly one of the two.
    """
    from mpi4py import MPI
    parent = comm if comm is not None else MPI.COMM_WORLD
    world = parent.Get_size()
    if (groups is None) == (sizes is None):
        raise ConfigError("split: give either groups=G (equal groups) or sizes=(n0, n1, ...), not both or neither")
    if groups is not None:
        if not isinstance(groups, int) or groups < 2:
            raise ConfigError(f"split: groups={groups!r}: use an integer >= 2 (a source group and at least one clone group)")
        if world % groups:
            raise ConfigError(f"split: {world} ranks do not divide into {groups} equal groups: start "
                              f"{groups} * N ranks, or give sizes=(...)")
        sizes = [world // groups] * groups
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) < 2 or any(s < 1 for s in sizes):
        raise ConfigError(f"split: sizes={sizes}: give at least two groups of at least one rank each")
    if sum(sizes) != world:
        raise ConfigError(f"split: sizes={sizes} add up to {sum(sizes)} ranks but the job has {world}: "
                          f"start mpirun with -np {sum(sizes)}")
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise ConfigError("split: MPI was initialized without MPI_THREAD_MULTIPLE; clone transfers send from "
                          "TensorFlow's threads while Horovod's thread runs collectives (mpi4py and Horovod "
                          "request it by default: do not set mpi4py.rc.thread_level)")
    me = parent.Get_rank()
    bounds, index = 0, 0
    for index, n in enumerate(sizes):
        if me < bounds + n:
            break
        bounds += n
    group_comm = parent.Split(color=index, key=me)  # key=parent rank: group rank r is the r-th of the block
    bridge = parent.Dup()
    return Group(index=index, rank=group_comm.Get_rank(), size=group_comm.Get_size(), sizes=sizes,
                 world_rank=me, comm=group_comm, bridge=bridge)
