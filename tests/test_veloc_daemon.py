"""VeloC's daemon and leftovers (issue 11, item 8): `backend status/stop` see it, the daemon
DeepFreeze started is stopped at close() when no DeepFreeze job uses it, and what a dead daemon
and VeloC's flushes leave behind is cleaned. The file-level cases run everywhere; the cases
that need a real VeloC skip, with the reason, when it cannot be loaded."""
import contextlib
import fcntl
import os
import socket

import pytest

from deepfreeze import Config, backend
from deepfreeze.veloc_daemon import (READY_FILE, clean_veloc_leftovers, stop_veloc_daemon, veloc_backend,
                                     veloc_daemon_status)

# the one VeloC daemon of a user on this machine: its tests run on one xdist worker, one at a time
pytestmark = pytest.mark.xdist_group("veloc")


def _veloc_missing():
    try:
        from deepfreeze.bindings.veloc import available
    except ImportError as e:  # an install without the bindings package
        return str(e)
    return available()


def test_dangling_veloc_symlinks_are_removed_and_nothing_else(tmp_path):
    pfs = tmp_path / "pfs"
    (pfs / "job" / "v2").mkdir(parents=True)
    kept_target = pfs / "job" / "v2" / "r000001.dfs"
    kept_target.write_bytes(b"x")
    outside = tmp_path / "outside.dat"
    outside.write_bytes(b"keep me")
    os.symlink(pfs / "job" / "v2" / "r000000.dfs", pfs / "job-0-2.dat")  # target assembled and deleted
    os.symlink(kept_target, pfs / "job-1-2.dat")  # target still there
    os.symlink(pfs / "gone", pfs / "other-0-2.dat")  # another checkpoint name
    os.symlink(pfs / "gone", pfs / "notveloc.dat")  # not VeloC's name pattern
    (pfs / "job-0-4.dat").write_bytes(b"a regular file is never VeloC's link")
    os.symlink(outside, pfs / "job-3-2.dat")
    removed = clean_veloc_leftovers(str(pfs), "job")
    assert [os.path.basename(p) for p in removed] == ["job-0-2.dat"]
    assert sorted(os.listdir(pfs)) == ["job", "job-0-4.dat", "job-1-2.dat", "job-3-2.dat", "notveloc.dat",
                                       "other-0-2.dat"]
    assert outside.read_bytes() == b"keep me" and kept_target.read_bytes() == b"x"
    assert [os.path.basename(p) for p in clean_veloc_leftovers(str(pfs))] == ["other-0-2.dat"]


@pytest.fixture
def no_veloc_daemon():
    """The real /dev/shm names; skipped if this user has any VeloC file there (never touched)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    uid = os.getuid()
    ready = READY_FILE.format(uid=uid)
    sock = f"/dev/shm/veloc-socket-{socket.gethostname()}-{uid}"
    for p in (ready, sock):
        if os.path.lexists(p):
            pytest.skip(f"{p} exists (a VeloC daemon of this user, or its leftover): not touched by tests")
    yield ready, sock
    for p in (ready, sock):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def test_stale_ready_file_and_socket_of_a_dead_daemon_are_removed(no_veloc_daemon):
    ready, sock = no_veloc_daemon
    with open(ready, "wb") as f:
        f.write(os.getpid().to_bytes(4, "little"))  # a live pid that is not a veloc-backend
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sock)
    s.close()  # the file stays, nothing listens: VeloC's bind would fail
    assert veloc_backend() is None and veloc_daemon_status() is None
    assert sorted(clean_veloc_leftovers()) == sorted([ready, sock])
    assert not os.path.lexists(ready) and not os.path.lexists(sock)


def test_files_of_a_starting_or_listening_daemon_are_kept(no_veloc_daemon):
    ready, sock = no_veloc_daemon
    with open(ready, "wb") as f:
        f.write(b"")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sock)
    s.listen(1)
    try:
        with open(ready, "rb") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # a daemon starting: it holds its ready file locked
            assert clean_veloc_leftovers() == []
        assert os.path.lexists(ready) and os.path.lexists(sock)
    finally:
        s.close()


def test_backend_status_and_stop_without_a_veloc_daemon(tmp_path, no_veloc_daemon):
    scratch = str(tmp_path / "s")
    st = backend.status(scratch)
    assert st["state"] == "none" and st["veloc"] is None
    assert "not running" in st["message"]
    sp = backend.stop(scratch, timeout=1)
    assert sp["state"] == "none" and sp["veloc"] is None and not sp["stop_requested"]
    assert stop_veloc_daemon() is None


@pytest.fixture
def veloc():
    why = _veloc_missing()
    if why:
        pytest.skip(f"VeloC not found: {why}")
    from deepfreeze.veloc_daemon import stop_backend
    stop_backend()
    yield
    stop_backend()


def test_veloc_daemon_started_by_deepfreeze_is_stopped_at_close(tmp_path, veloc):
    """One async VelocEngine (one per process: VELOC_Init once): while it runs, `backend status`
    shows the daemon as DeepFreeze's and in use, and `stop` leaves it; after close() it is gone,
    and no dangling VeloC symlink is left on persistent."""
    from test_engine import make_plan, model_arrays, pieces
    from deepfreeze.veloc_engine import VelocEngine
    cfg = Config.load(None, mode="async", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    plan = make_plan(1)
    e = VelocEngine(cfg, "job", 0, plan)
    try:
        for v in (2, 4):
            e.checkpoint(v, pieces(model_arrays(v), plan, 0), step=v, epoch=0)
        e.wait()
        st = backend.status(cfg.scratch)["veloc"]
        assert st["state"] == "running" and st["deepfreeze"] and st["in_use"]
        assert backend.stop(cfg.scratch, timeout=2)["veloc"]["state"] == "in use"
        pid = st["pid"]
    finally:
        e.close()
    assert veloc_backend() is None, f"the VeloC daemon pid {pid} outlived the job"
    assert not [n for n in os.listdir(cfg.persistent) if os.path.islink(os.path.join(cfg.persistent, n))]
