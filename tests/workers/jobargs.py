"""The command line of a worker that runs several jobs one after the other in one launch (a module
fixture's shared job): the arguments of each job, separated by ``sep``. Imports nothing heavy."""
from __future__ import annotations


def split(argv: list[str], sep: str = "+") -> list[list[str]]:
    """``argv`` cut at each ``sep``: one list of arguments per job, in order (at least one)."""
    out, cur = [], []
    for a in argv:
        if a == sep:
            out.append(cur)
            cur = []
        else:
            cur.append(a)
    return out + [cur]
