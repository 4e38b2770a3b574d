"""The repository's quarantine: where gc puts the packs it removes, for an operator to take back.

:meth:`~deepfreeze.repo.maintenance.Maintenance.gc` never unlinks a pack: a pack it removes (one
left without blobs, an orphan of a crashed store, the old copy of a compacted pack) is renamed
into ``<repository>/quarantine/`` as ``<seconds since the epoch>-<32 hex>.dfz`` (the time it was
moved, then the pack's own name). A later gc unlinks the entries older than the quarantine period
(:data:`DEFAULT_QUARANTINE_PERIOD`, 7 days, unless the repository or the gc call says otherwise),
and only when it found no damaged row. :func:`restore` moves an entry back into ``packs/``
under its own name (``deepfreeze repo gc REPO --restore FILE``).

Only names of exactly that form are ever touched here (a file of another name in the directory
stays), and every path is built from such a name, so nothing outside the repository can be
reached through a database row.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import time

from .. import ownership
from ..errors import RepositoryError

__all__ = ["DEFAULT_QUARANTINE_PERIOD", "QUARANTINE_DIR", "parse_entry", "entries", "move_in", "purge", "restore",
           "find"]

#: seconds a pack removed by gc stays in the quarantine before a later gc unlinks it (7 days)
DEFAULT_QUARANTINE_PERIOD = 7 * 86400.0
#: the quarantine directory, inside the repository directory
QUARANTINE_DIR = "quarantine"
_ENTRY_RE = re.compile(r"([0-9]{1,12})-([0-9a-f]{32}\.dfz)")
_PACK_RE = re.compile(r"[0-9a-f]{32}\.dfz")


def parse_entry(name: str) -> tuple[int, str] | None:
    """``(time moved, pack file name)`` of a quarantine entry name; None for any other name."""
    m = _ENTRY_RE.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else None


def entries(qdir: str, period: float) -> list[dict]:
    """The quarantine's entries, oldest first: ``{"file": pack name, "entry": name in the quarantine,
    "bytes": size, "since": time moved, "purge_after": since + period}`` (an absent directory, or a
    link in its place, which is never followed: [])."""
    if os.path.islink(qdir):
        return []
    try:
        names = os.listdir(qdir)
    except FileNotFoundError:
        return []
    out = []
    for fn in names:
        parsed = parse_entry(fn)
        if parsed is None:
            continue
        try:
            st = os.lstat(os.path.join(qdir, fn))
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        out.append({"file": parsed[1], "entry": fn, "bytes": st.st_size, "since": parsed[0],
                    "purge_after": parsed[0] + period})
    out.sort(key=lambda e: (e["since"], e["entry"]))
    return out


def _move(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst``, never replacing a file at ``dst`` (FileExistsError then): a hard
    link then an unlink where the file system has them, else a check and a rename."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOENT):
            raise
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst) from e
        os.rename(src, dst)
        return
    os.unlink(src)


def move_in(packs: str, qdir: str, root: str, file: str, now: float | None = None) -> str | None:
    """Move ``packs/<file>`` into the quarantine; its entry name, None when the pack was gone.
    OSError when it cannot be moved (it then stays where it was)."""
    if not _PACK_RE.fullmatch(file):  # (the callers check too: never a path from a row)
        raise RepositoryError(f"{file!r:.80} is not a pack name '<32 hex>.dfz'")
    ownership.ensure_dir(qdir, root)
    t = int(time.time() if now is None else now)
    for k in range(1000):  # the same pack quarantined twice within a second: the next free second
        entry = f"{t + k}-{file}"
        try:
            _move(os.path.join(packs, file), os.path.join(qdir, entry))
            return entry
        except FileNotFoundError:
            return None
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free quarantine entry name", os.path.join(qdir, file))


def _checked(qdir: str, root: str) -> bool:
    """Whether the quarantine exists; if so it must be an own directory of the user's (not a link:
    :class:`~deepfreeze.errors.UnsafePathError` otherwise), checked before anything in it changes."""
    if not os.path.lexists(qdir):
        return False
    ownership.ensure_dir(qdir, root)
    return True


def purge(qdir: str, root: str, period: float, now: float | None = None) -> tuple[list[str], int]:
    """Unlink the entries moved ``period`` seconds ago or earlier: (entries unlinked, bytes this
    released: a file with other hard links releases none)."""
    if not _checked(qdir, root):
        return [], 0
    now = time.time() if now is None else now
    gone: list[str] = []
    freed = 0
    for e in entries(qdir, period):
        if now - e["since"] < period:
            continue
        p = os.path.join(qdir, e["entry"])
        try:
            st = os.lstat(p)
            os.unlink(p)
        except OSError:  # gone, or not ours to unlink: the next gc tries again
            continue
        gone.append(e["entry"])
        freed += st.st_size if st.st_nlink == 1 else 0
    return gone, freed


def find(qdir: str, name: str) -> dict | None:
    """The entry ``name`` designates (an entry name, or a pack name: its newest entry); None if none."""
    found = [e for e in entries(qdir, 0.0) if name in (e["entry"], e["file"])]
    return found[-1] if found else None


def restore(packs: str, qdir: str, root: str, name: str) -> dict:
    """Move the quarantine entry ``name`` (an entry name, or a pack name: its newest entry) back
    to ``packs/<pack name>``; returns the entry (as :func:`entries` lists it). RepositoryError
    if there is no such entry, or a pack of that name is in ``packs/`` already."""
    if not isinstance(name, str) or not (_ENTRY_RE.fullmatch(name) or _PACK_RE.fullmatch(name)):
        raise RepositoryError(f"{name!r:.80} is neither a pack name '<32 hex>.dfz' nor a quarantine entry "
                              "'<seconds>-<32 hex>.dfz': give one that 'deepfreeze repo gc REPO' lists")
    e = find(qdir, name) if _checked(qdir, root) else None
    if e is None:
        raise RepositoryError(f"{name} is not in the quarantine {qdir} (entries older than the quarantine period are "
                              "unlinked by gc): 'deepfreeze repo gc REPO' lists what it holds")
    try:
        _move(os.path.join(qdir, e["entry"]), os.path.join(packs, e["file"]))
    except FileExistsError as ex:
        raise RepositoryError(f"cannot restore {e['entry']}: {os.path.join(packs, e['file'])} exists already "
                              "(nothing was changed)") from ex
    except OSError as ex:
        raise RepositoryError(f"cannot restore {e['entry']} into {packs}: {ex}") from ex
    return e
