"""Safe on shared file systems: who owns a directory or file, and never following a symlink.

DeepFreeze runs as ordinary users and as root, with roots (``scratch``, ``persistent``, the
backend's runtime directory) that may sit in a directory every user can write in (``/tmp``,
a shared ``/scratch``). Another local user can then pre-create the directories DeepFreeze
will use, or plant symbolic links where its files go. The rules enforced here:

* **A root** (or, when it does not exist yet, its nearest existing parent, in which DeepFreeze
  creates it) must be owned by the user or by root and writable by nobody else, or be a
  sticky directory (``/tmp``-like, mode ``1777``), or be group-writable with the INI key
  ``shared_group = true`` (the user trusts every member of the group). No existing parent of
  a root may be writable by every user without the sticky bit.
* **An output directory** (the directory a user names for an export, ``deepfreeze export -o``,
  ``memtier dump -o``, ``deepfreeze.torch.hf.checkpoint_dir(output_dir=)``) follows the roots'
  rule (:func:`check_output_dir`, before a byte is written): its owner could otherwise swap
  what DeepFreeze writes there for their own files. What DeepFreeze creates in it is made
  ``0700`` (:func:`ensure_dir`).
* **Every directory DeepFreeze creates** below a root (``<root>/<name>``, version directories,
  a missing root and its missing parents) is created ``0700`` and, when it exists already,
  checked with ``lstat``: a symbolic link is an error (never followed), a directory owned by
  another user is an error naming that user, one writable by group or others is an error.
* **Files** DeepFreeze appends to or creates outside the commit protocol (the backend log) are
  opened with ``O_NOFOLLOW``, created ``0600`` and must be regular files owned by the user.
* **Removing** a directory tree (``deepfreeze gc``) goes through directory file descriptors
  opened with ``O_NOFOLLOW``: a symbolic link is removed, never descended into.
* **Owners of checkpoint files**: scratch files are restored only when owned by the user (or
  root); persistent files also when their owner is in ``trust_owners`` (:func:`trusted_uids`).
* **Files of the siblings** (issue 23): memory-tier devices, the repository's ``meta.db`` (and its
  ``-wal``/``-shm``/``-journal``) and packs, stream rings in ``/dev/shm``, token files, job id
  files (``<persistent>/<name>/job``, ``memtier.job_id``), the backend log: DeepFreeze's own
  files. They are opened with :func:`open_trusted` (``O_NOFOLLOW``,
  never a hang on a FIFO, then ``fstat``): a regular file owned by the user, else a clear error
  naming the path, its owner and the way out; created ``0600``; one of the user's own that other
  users may read or write is tightened to ``0600`` with one log line (a token file is refused
  instead: its secret may have leaked, and so is a stream ring, which its producer makes
  ``0600``). Files SQLite opens itself are checked by path first (:func:`check_existing`,
  ``lstat`` only: closing a descriptor of a file drops the process's POSIX locks on it, SQLite's
  too); they live in a directory of the user's own, so nobody else can swap them after the check.
  Stream endpoint files and their directory, found in a persistent directory, follow the
  persistent owner rule with the owners the reader passes (``trusted``; consumers: the user and
  root), and one of another trusted owner must not be writable by group or others. Memory-tier
  devices are the user's own for reading too (their owner could forge any version at any moment:
  ``trust_owners`` does not apply). Directories of the siblings (the repository,
  ``<persistent>/<channel>/stream``) follow the directory rules above (:func:`ensure_dir`).
* **Unix socket peers** (the node backend): both ends read the other's credentials with
  ``SO_PEERCRED`` (:func:`check_peer`) and talk only to a process of the same uid (root too only
  when it is the same uid: a root backend serves root's ranks only). A backend socket planted by
  another user is refused by the client; a connection of another user is closed by the backend
  before it reads a byte.

Errors are :class:`~deepfreeze.errors.UnsafePathError` and
:class:`~deepfreeze.errors.UntrustedOwnerError`, saying what, why and what to do.
"""
from __future__ import annotations

import errno
import logging
import os
import pwd
import socket
import stat
import struct
import threading
from typing import BinaryIO, Iterable

from . import counters
from . import crashpoints as cp
from . import fsafe
from .errors import BackendError, ConfigError, UnsafePathError, UntrustedOwnerError

__all__ = ["owner_name", "trusted_uids", "check_owner", "check_root", "check_output_dir", "OUTPUT_RULE", "ensure_dir",
           "open_dir_nofollow",
           "open_private", "create_whole", "open_trusted", "open_trusted_file", "check_file", "check_dir", "check_existing",
           "peer_cred", "check_peer", "remove_tree_nofollow"]

log = logging.getLogger("deepfreeze.ownership")

_MAX_DEPTH = 32
_lock = threading.Lock()
#: roots accepted as group-writable with ``shared_group = true`` in this process: (st_dev, st_ino)
_shared_ok: set[tuple[int, int]] = set()


def owner_name(uid: int) -> str:
    """``alice (uid 1001)``, or ``uid 1001`` when the user database does not know it."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def trusted_uids(trust_owners: "Iterable[str | int] | None" = None) -> frozenset[int]:
    """The owners whose checkpoint files this process restores: itself, root (uid 0: root can
    write anything anyway) and each of ``trust_owners`` (user names or uids). An unknown user
    name is a :class:`~deepfreeze.errors.ConfigError`."""
    out = {os.getuid(), 0}
    if isinstance(trust_owners, (str, int)):
        trust_owners = [trust_owners]
    for o in trust_owners or ():
        if isinstance(o, bool) or not isinstance(o, (str, int)):
            raise ConfigError(f"trust_owners: {o!r} is neither a user name nor a uid")
        if isinstance(o, int) or o.isdigit():
            out.add(int(o))
            continue
        try:
            out.add(pwd.getpwnam(o).pw_uid)
        except KeyError:
            raise ConfigError(f"trust_owners: no user named {o!r} on this host; give a user name that "
                              "exists here or a numeric uid") from None
    return frozenset(out)


def check_owner(st: os.stat_result, path: str, trusted: frozenset[int], level: str) -> None:
    """Raise :class:`UntrustedOwnerError` unless the file ``st`` (``fstat`` of ``path``, opened
    without following a link) is owned by one of ``trusted``. ``level`` (scratch/persistent)
    picks the advice: scratch files of another user are never restored."""
    if st.st_uid in trusted:
        return
    who = owner_name(st.st_uid)
    if level == "scratch":
        raise UntrustedOwnerError(f"{path} is owned by {who}, not by you ({owner_name(os.getuid())}): scratch "
                                  "files of another user are never restored (they may have been planted); "
                                  "remove the file")
    raise UntrustedOwnerError(f"{path} is owned by {who}, a user you do not trust: not restoring it. If "
                              f"{_user(st.st_uid)} wrote this checkpoint and you trust them, pass "
                              f"trust_owners=[{_user(st.st_uid)!r}] (CLI: --trust-owner {_user(st.st_uid)})")


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def _group(gid: int) -> str:
    try:
        import grp
        return grp.getgrgid(gid).gr_name
    except (KeyError, ImportError):
        return str(gid)


def check_root(path: str, *, shared_group: bool = False) -> None:
    """Check an existing root directory (or the nearest existing parent a root is created in)
    and its parents: see the module docstring. Raises :class:`UnsafePathError`."""
    path = os.path.abspath(path)
    try:
        lst = os.lstat(path)
        st = os.stat(path) if stat.S_ISLNK(lst.st_mode) else lst
    except OSError as e:
        raise UnsafePathError(f"{path}: {e.strerror}; point the directory elsewhere") from e
    if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in (os.getuid(), 0):
        raise UnsafePathError(f"{path} is a symbolic link owned by {owner_name(lst.st_uid)}: not following a "
                              "link another user controls; use the real path of the directory")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{path} is not a directory; point the setting to a directory")
    _check_parents(os.path.dirname(path))
    mode = st.st_mode
    sticky = bool(mode & stat.S_ISVTX)
    if mode & 0o002 and not sticky:
        raise UnsafePathError(f"{path} is writable by every user and not sticky (mode {_mode(st)}): any user could "
                              "replace what DeepFreeze creates there. Use a directory of your own, or make it "
                              "sticky (chmod +t) as /tmp is")
    if mode & 0o020 and not sticky:
        key = (st.st_dev, st.st_ino)
        if shared_group:
            with _lock:
                _shared_ok.add(key)
            return
        with _lock:
            if key in _shared_ok:
                return
        raise UnsafePathError(f"{path} is writable by group {_group(st.st_gid)} (mode {_mode(st)}): every member "
                              "could replace what DeepFreeze creates there. If you trust every member of that "
                              "group, set 'shared_group = true' in the configuration; else use a directory of "
                              "your own (or chmod g-w)")
    if st.st_uid not in (os.getuid(), 0):  # also a sticky one: its owner can rename or remove any entry
        raise UnsafePathError(f"{path} is owned by {owner_name(st.st_uid)}, not by you ({owner_name(os.getuid())}) "
                              "or root: that user controls what is created in it. Use a directory of your own")


#: the rule an output directory is held to (:func:`check_output_dir`), as messages state it
OUTPUT_RULE = ("DeepFreeze writes only into a directory owned by you or root that nobody else can write in (a sticky "
               "one such as /tmp, or a group-writable one with 'shared_group = true', excepted), below no directory "
               "that every user can write in without the sticky bit")


def check_output_dir(path: str, *, what: str, shared_group: bool = False, create: bool = False) -> None:
    """Hold the directory ``path`` that an output is written into (``what`` names the output in
    messages, e.g. ``"export output /x/y.npz"``) to the roots' rule (:func:`check_root`,
    :data:`OUTPUT_RULE`), before anything is written: else :class:`UnsafePathError` naming the
    directory, its owner and mode, the rule and what to do. With ``create`` a missing ``path``
    is made (with its missing parents) ``0700`` by :func:`ensure_dir`, its nearest existing
    parent checked instead; without, a missing ``path`` is a FileNotFoundError."""
    path = os.path.abspath(path)
    d = path
    if create:
        while not os.path.lexists(d) and os.path.dirname(d) != d:
            d = os.path.dirname(d)
    elif not os.path.lexists(d):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    try:
        check_root(d, shared_group=shared_group)
    except UnsafePathError as e:
        try:
            st = os.stat(d)
            who = f"owned by {owner_name(st.st_uid)}, mode {_mode(st)}"
        except OSError:
            who = "unreadable"
        raise UnsafePathError(f"{what}: nothing written: {d} ({who}) breaks the rule for output directories "
                              f"({OUTPUT_RULE}): {e}") from e
    if create:
        ensure_dir(path, path, shared_group=shared_group, site="output.mkdirs")


def _check_parents(path: str) -> None:
    """No parent of a root may be writable by everyone without the sticky bit."""
    while True:
        try:
            st = os.stat(path)
        except OSError:
            st = None
        if st is not None and st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            raise UnsafePathError(f"{path} is writable by every user and not sticky (mode {_mode(st)}): any user "
                                  "could rename the directories below it. Use a path without such a parent, or "
                                  "make it sticky (chmod +t) as /tmp is")
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def _check_own_dir(path: str) -> None:
    """``path`` (a directory DeepFreeze creates) must be a real directory, owned by the user,
    writable by nobody else. Raises :class:`UnsafePathError` (NotADirectoryError for a file,
    FileNotFoundError when gone)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise UnsafePathError(f"{path} is a symbolic link (to {target}, owned by {owner_name(st.st_uid)}) where "
                              "DeepFreeze keeps its own directory: it never follows one (it could point into "
                              "another user's files). Remove the link, or use another checkpoint name or root")
    if not stat.S_ISDIR(st.st_mode):  # a plain error (the caller names the level and setting)
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
    if st.st_uid != os.getuid():
        raise UnsafePathError(f"{path} is owned by {owner_name(st.st_uid)}, not by you ({owner_name(os.getuid())}): "
                              "another user created the directory DeepFreeze would write into. Remove it (as its "
                              "owner or root), or use another checkpoint name or root")
    if st.st_mode & 0o022:
        raise UnsafePathError(f"{path} is writable by {'others' if st.st_mode & 0o002 else 'its group'} (mode "
                              f"{_mode(st)}): DeepFreeze's directories must be writable by you only. "
                              f"Run 'chmod go-w {path}', or remove it")


def ensure_dir(path: str, root: str, *, shared_group: bool = False, site: str = "mkdirs") -> None:
    """Create ``path`` and every missing parent owner-only (0700) and check them: ``root`` (a
    level's root; ``path`` itself when ``path`` is not below it) follows :func:`check_root`
    (its nearest existing parent, when it does not exist), every directory below follows the
    rules for directories DeepFreeze creates. Raises :class:`UnsafePathError`."""
    path, root = os.path.abspath(path), os.path.abspath(root)
    if path != root and not path.startswith(root.rstrip(os.sep) + os.sep):
        root = path
    below = [] if path == root else os.path.relpath(path, root).split(os.sep)
    missing = []
    p = root
    while True:
        counters.fs("stat", site)
        if os.path.lexists(p):
            break
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    counters.fs("stat", site + ".root")  # check_root: lstat of the root and of each parent up to /
    check_root(p, shared_group=shared_group)
    for d in reversed(missing):
        _mkdir(d, site)
    d = root
    for part in below:
        d = os.path.join(d, part)
        _mkdir(d, site)


def _mkdir(path: str, site: str = "mkdirs") -> None:
    counters.fs("mkdir", site)
    counters.fs("stat", site)  # _check_own_dir
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    _check_own_dir(path)


def open_dir_nofollow(path: str, dir_fd: int | None = None) -> int:
    """A descriptor of directory ``path`` (relative to ``dir_fd`` if given), never through a
    symbolic link: :class:`UnsafePathError` if ``path`` is one, NotADirectoryError if it is
    something else, FileNotFoundError if it is gone."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno == errno.ENOTDIR and _is_link(path, dir_fd)):
            raise UnsafePathError(f"{path} is a symbolic link where a directory should be: not following it") from e
        raise


def _is_link(path: str, dir_fd: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def create_whole(path: str, data: bytes, *, fsync_point: str | None = None, link_point: str | None = None) -> None:
    """Create the small file ``path`` (``0600``, whatever the umask) holding ``data``, whole or not
    at all: written and fsynced under a temporary name in the same directory (``O_EXCL``,
    ``O_NOFOLLOW``), then hard-linked into place, so a reader never sees it half-written and an
    existing file is never replaced (``FileExistsError``: a concurrent creator won, or the file was
    there). ``fsync_point``/``link_point``: the :mod:`deepfreeze.crashpoints` of the two steps."""
    d, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(d, f".{base}.tmp-{os.getpid()}-{threading.get_ident()}-{os.urandom(6).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, data)
            if fsync_point:
                cp.fsync(fd, fsync_point)
            else:
                os.fsync(fd)
        finally:
            os.close(fd)
        if link_point:
            cp.link(tmp, path, link_point)
        else:
            os.link(tmp, path)
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def open_private(path: str, flags: int) -> int:
    """Open (or create, ``0600``) a file of the user's own, such as a log: :func:`open_trusted`."""
    return open_trusted(path, flags, kind="file")


def _refuser(kind: str):
    def refuse(path: str, what: str) -> UnsafePathError:
        return UnsafePathError(f"{path} ({kind}) is {what}, not a regular file: DeepFreeze opens only regular "
                               "files here and never follows a link (it could point into another user's files). "
                               "Remove it or choose another path")
    return refuse


def _check_owner_of(st: os.stat_result, path: str, kind: str, trusted: "frozenset[int] | None") -> None:
    me = os.getuid()
    if st.st_uid == me or st.st_uid in (trusted or ()):
        return
    hint = ""
    if trusted and trusted - {me}:
        hint = (f"; if {_user(st.st_uid)} wrote it and you trust them, pass trust_owners=[{_user(st.st_uid)!r}] "
                f"(CLI: --trust-owner {_user(st.st_uid)})")
    # what must be the user's own: UnsafePathError; what the caller named owners for: UntrustedOwnerError
    raise (UnsafePathError if trusted is None else UntrustedOwnerError)(
        f"{path} ({kind}) is owned by {owner_name(st.st_uid)}, not by you ({owner_name(me)}): another user may have "
        "created it to read or forge what DeepFreeze keeps there; not using it. Remove it (as its owner or root) "
        f"or choose another path{hint}")


def check_dir(st: os.stat_result, path: str, *, kind: str, trusted: "frozenset[int] | None" = None) -> None:
    """The rule for a directory DeepFreeze reads from (``st``: its ``lstat``, or the ``fstat`` of
    a descriptor opened with ``O_NOFOLLOW``): not a link, owned by the user or one of ``trusted``
    (as :func:`check_file`), writable by nobody else. Never tightened (readers do not chmod)."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{path} ({kind}) is a symbolic link: never followed (it could point into another "
                              "user's files). Remove it or choose another path")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{path} ({kind}) is {fsafe.describe_mode(st.st_mode)}, not a directory. Remove it or "
                              "choose another path")
    _check_owner_of(st, path, kind, trusted)
    if st.st_mode & 0o022:
        raise UnsafePathError(f"{path} ({kind}) is writable by {'others' if st.st_mode & 0o002 else 'its group'} "
                              f"(mode {_mode(st)}): anyone could plant files there. Run 'chmod go-w {path}', or "
                              "remove it")


def check_file(fd: "int | None", st: os.stat_result, path: str, *, kind: str,
               trusted: "frozenset[int] | None" = None, loose: str = "tighten") -> None:
    """The owner and mode rule for one file, opened as ``fd`` without following a link (``st``: its
    ``fstat``; ``fd=None``: ``st`` is an ``lstat`` of a regular file, tightened by path). Owner: the
    user, or one of ``trusted``, else :class:`UntrustedOwnerError` (``trusted=None``: the user only,
    else :class:`UnsafePathError`). Mode: a file of another (trusted) owner must not be writable by
    group or others (:class:`UnsafePathError`); one of the user's own that group or others may read
    or write is made ``0600`` with one log line (``loose="tighten"``) or refused
    (``loose="refuse"``: a secret that may have leaked). ``kind`` names the file in messages."""
    me = os.getuid()
    m = stat.S_IMODE(st.st_mode)
    _check_owner_of(st, path, kind, trusted)
    if st.st_uid != me:
        if m & 0o022:
            raise UnsafePathError(f"{path} ({kind}) is owned by {owner_name(st.st_uid)} and writable by "
                                  f"{'others' if m & 0o002 else 'its group'} (mode {m:04o}): anyone could have changed "
                                  f"it; not using it. Ask its owner to run 'chmod go-w {path}', or choose another path")
        return
    if m & 0o077:
        if loose == "refuse":
            raise UnsafePathError(f"{path} ({kind}) has mode {m:04o}: other users may read or change it. Run "
                                  f"'chmod 600 {path}' (and replace what it holds if that may have leaked)")
        if fd is None:
            os.chmod(path, 0o600)
        else:
            os.fchmod(fd, 0o600)
        log.warning("deepfreeze: %s (%s) had mode %04o, open to other users: tightened to 0600", path, kind, m)


def open_trusted(path: str, flags: int = os.O_RDONLY, *, kind: str, trusted: "frozenset[int] | None" = None,
                 create_mode: int = 0o600, loose: str = "tighten") -> int:
    """Open ``path`` (a descriptor; ``flags`` may create it, mode ``create_mode``) with
    ``O_NOFOLLOW`` and ``O_NONBLOCK`` (:func:`deepfreeze.fsafe.open_regular`: a link, FIFO,
    socket or directory is an :class:`UnsafePathError`, never waited on), then apply
    :func:`check_file` to what was opened. ``FileNotFoundError`` when it does not exist (and
    ``flags`` does not create it)."""
    fd = fsafe.open_regular(path, flags, create_mode, refuse=_refuser(kind))
    try:
        check_file(fd, os.fstat(fd), path, kind=kind, trusted=trusted, loose=loose)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_trusted_file(path: str, *, kind: str, trusted: "frozenset[int] | None" = None) -> BinaryIO:
    """:func:`open_trusted` for reading, as a binary file object."""
    fd = open_trusted(path, os.O_RDONLY, kind=kind, trusted=trusted)
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_existing(path: str, *, kind: str, trusted: "frozenset[int] | None" = None, loose: str = "tighten") -> bool:
    """The rule of :func:`open_trusted` for a file another library opens by name (SQLite), checked
    with ``lstat`` only: never opened, because closing a descriptor of a file drops every POSIX
    lock this process holds on it (SQLite's among them). False when nothing is there. The check
    holds as long as nobody else can replace the entry, i.e. in a directory of the user's own
    (:func:`ensure_dir`)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise _refuser(kind)(path, fsafe.describe_mode(st.st_mode))
    check_file(None, st, path, kind=kind, trusted=trusted, loose=loose)
    return True


_CRED = struct.Struct("3i")


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket
    (``SO_PEERCRED``: for the connecting side, the listener's credentials when it called
    ``listen``; for the accepting side, the connecting process's when it called ``connect``)."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def check_peer(sock: socket.socket, what: str) -> int:
    """The peer's pid, when it runs as this process's uid; else :class:`UntrustedOwnerError`
    naming ``what`` (e.g. the socket's path), the peer's pid and owner. Root is no exception: a
    root backend serves root only, a user's backend that user only."""
    try:
        pid, uid, _gid = peer_cred(sock)
    except OSError as e:
        raise UntrustedOwnerError(f"{what}: cannot read the peer's credentials (SO_PEERCRED: {e.strerror}): "
                                  "refusing the connection") from e
    if uid != os.getuid():
        raise UntrustedOwnerError(f"{what}: the process at the other end (pid {pid}) runs as {owner_name(uid)}, not "
                                  f"as you ({owner_name(os.getuid())}): refusing it (a process of another user must "
                                  "never send you requests or answer yours). Remove a socket another user planted, "
                                  "or choose another runtime directory (DEEPFREEZE_RUNTIME_DIR)")
    return pid


def remove_tree_nofollow(path: str, *, unlink_point: str = "persistent.retire.unlink",
                         rmdir_point: str = "persistent.retire.rmdir") -> None:
    """Remove ``path`` and everything below it, through directory descriptors opened with
    ``O_NOFOLLOW``: a symbolic link (``path`` itself or anything inside) is removed as a link,
    never followed, so nothing outside ``path`` is touched. A missing ``path`` is no error.
    File operations go through :mod:`deepfreeze.crashpoints` (``unlink_point``, ``rmdir_point``)."""
    path = os.path.abspath(path)
    parent, base = os.path.split(path)
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            st = os.stat(base, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            cp.unlink(base, unlink_point, dir_fd=pfd)
            return
        _remove_below(pfd, base, st, unlink_point, rmdir_point, 0)
        cp.rmdir(base, rmdir_point, dir_fd=pfd)
    finally:
        os.close(pfd)


def _remove_below(parent_fd: int, name: str, st: os.stat_result, unlink_point: str, rmdir_point: str,
                  depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise UnsafePathError(f"{name}: more than {_MAX_DEPTH} nested directories: not a DeepFreeze version "
                              "directory; remove it by hand")
    fd = open_dir_nofollow(name, parent_fd)
    try:
        got = os.fstat(fd)
        if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
            raise UnsafePathError(f"{name} was replaced while being removed: stopping")
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for n, is_dir in entries:
            try:
                if is_dir:
                    _remove_below(fd, n, os.stat(n, dir_fd=fd, follow_symlinks=False), unlink_point,
                                  rmdir_point, depth + 1)
                    cp.rmdir(n, rmdir_point, dir_fd=fd)
                else:
                    cp.unlink(n, unlink_point, dir_fd=fd)
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)


def runtime_dir() -> str:
    """This user's private runtime directory on this node (``$DEEPFREEZE_RUNTIME_DIR``, else
    ``$XDG_RUNTIME_DIR``, else ``/tmp``, then ``deepfreeze-<uid>``; mode 0700, never a link): the
    backend's sockets live there. ``BackendError`` when it is not safe."""
    base = os.environ.get("DEEPFREEZE_RUNTIME_DIR") or os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    path = os.path.join(base, f"deepfreeze-{os.getuid()}")
    try:  # base may be sticky (/tmp); the directory itself must be ours, never a link (deepfreeze.ownership)
        ensure_dir(path, base, site="runtime.mkdirs")
    except UnsafePathError as e:
        raise BackendError(f"unsafe backend runtime directory: {e}") from e
    st = os.lstat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise BackendError(f"{path} must be a directory owned by you with mode 0700 (it holds the backend "
                           "socket); remove it or set DEEPFREEZE_RUNTIME_DIR to a private directory")
    return path
