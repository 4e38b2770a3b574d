"""A hung backend (issue 11, case 6): stopped with SIGSTOP here; in real life a process in D state
on a stuck Lustre mount. No call waits on it without a bound: ``wait(timeout)`` raises in time, a
checkpoint replaces it after ``backend_timeout`` (leaving it alive) and the version commits
bit-exact, ``status``/``stop`` report it, and a new client does not wait on a backend that accepts
but never answers (a real listening socket of the test: a peer, not a mock of the code under test).
"""
import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import threading
import time

import pytest

from deepfreeze import Config, backend
from deepfreeze.backend import PROTOCOL, BackendClient, socket_path
from deepfreeze.node import process_state
from deepfreeze.engine import Engine
from deepfreeze.errors import BackendError, BackendUnresponsiveError, ConfigError
from deepfreeze.tiers.persistent import PersistentLevel, lock_record

from _util import lines_of, stop_process
from test_engine import assert_version, make_plan, model_arrays, pieces


def config(tmp_path, **kw):
    return Config.load(None, mode="async", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"), **kw)


def persistent_only(cfg, tmp_path):
    return Config.resolve(cfg, scratch=str(tmp_path / "elsewhere"))


@contextlib.contextmanager
def stopped(pid):
    """SIGSTOP ``pid`` (returns once every thread of it is stopped); always kill it at the end (a
    stopped process dies from SIGKILL)."""
    try:
        stop_process(pid)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)  # the backend is a child of this process (started by its first client)


def kill_quietly(pid):
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, 0)


@pytest.mark.scratch_files("holds v2's commit.lock so the backend's flush stays pending (written once, the writer itself would wait on the lock)")
def test_wait_with_timeout_returns_on_a_stopped_backend(tmp_path):
    """Flushes pending, backend stopped: wait(timeout=2) raises BackendError within 3 s, both when
    the writer thread is idle (the poll is not answered) and when it is itself blocked on the
    backend (its flush request is not answered). Once the backend is gone, close() finishes and
    every version commits bit-exact."""
    cfg = config(tmp_path)  # backend_timeout = 60: no replacement during this test
    plan = make_plan(1)
    e = Engine(cfg, "job", 0, plan)
    pid = e._backend.pid
    # v2's commit.lock held by this (live) process: the backend's flush of v2 waits for it, so the
    # flush is pending whatever the machine's speed
    lock = os.path.join(PersistentLevel(cfg.persistent).version_dir("job", 2), "commit.lock")
    os.makedirs(os.path.dirname(lock))
    with open(lock, "w") as f:
        f.write(lock_record("0123456789abcdef").decode())
    e.checkpoint(2, pieces(model_arrays(2), plan, 0), step=2, epoch=0)
    e.wait(persistent=False)  # the writer handed v2 to the backend
    assert e._pending, "the flush of v2 should not be known done yet"
    with stopped(pid):
        t0 = time.monotonic()
        with pytest.raises(BackendError, match="has not answered"):
            e.wait(timeout=2)  # idle writer; the poll is not answered
        assert time.monotonic() - t0 < 3
        e.checkpoint(4, pieces(model_arrays(4), plan, 0), step=4, epoch=0)  # the writer blocks on the backend
        t0 = time.monotonic()
        with pytest.raises(BackendError, match="waited more than 2s for the DeepFreeze backend"):
            e.wait(timeout=2)
        assert time.monotonic() - t0 < 3
        assert process_state(pid)[0] == "T"  # asked, never killed
    os.unlink(lock)
    # killed now: the connection breaks, the writer starts a new backend and re-sends
    e.close()
    assert e._backend is None
    assert PersistentLevel(cfg.persistent).committed_versions("job") == [2, 4]
    for v in (2, 4):
        assert_version(persistent_only(cfg, tmp_path), v, "persistent")


def test_checkpoint_replaces_a_stopped_backend_after_backend_timeout(tmp_path, caplog):
    """backend_timeout = 3, two ranks on one node: checkpoints whose flush requests are not answered
    log, declare the backend dead and start ONE new backend on the same socket (the stopped
    process keeps its listening socket and is left alive); every version commits on persistent
    bit-exact."""
    caplog.set_level(logging.WARNING, logger="deepfreeze")
    cfg = config(tmp_path, backend_timeout=3)
    plan = make_plan(2)
    engines = [Engine(cfg, "job", r, plan) for r in range(2)]
    for e in engines:
        e.checkpoint(2, pieces(model_arrays(2), plan, e.rank), step=2, epoch=0)
    for e in engines:
        e.wait()
    old = engines[0]._backend.pid
    assert engines[1]._backend.pid == old
    new = None
    with stopped(old):
        for v in (4, 6):  # v6 waits for v4's writer
            for e in engines:
                e.checkpoint(v, pieces(model_arrays(v), plan, e.rank), step=v, epoch=0)
        for e in engines:
            e.wait(timeout=30)
        new = engines[0]._backend.pid
        assert new != old and engines[1]._backend.pid == new  # one new backend for the node
        assert process_state(old)[0] == "T"  # left running, not killed
        now = BackendClient(cfg.scratch, start=False, answer_timeout=5)
        assert now.pid == new  # the socket path is the new one's
        now.close()
        for e in engines:
            e.close()
    msgs = "\n".join(r.getMessage() for r in caplog.records)
    assert f"backend pid {old}" in msgs and "declaring it dead" in msgs and "left running, not killed" in msgs
    assert PersistentLevel(cfg.persistent).committed_versions("job") == [2, 4, 6]
    for v in (2, 4, 6):
        assert_version(persistent_only(cfg, tmp_path), v, "persistent")
    if new is not None:
        kill_quietly(new)


def _ptrace(request, tid):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    if libc.ptrace(request, tid, None, None) != 0:
        return os.strerror(ctypes.get_errno())
    return None


@contextlib.contextmanager
def thread_stopped(pid, *tids):
    """Stop threads of ``pid`` (PTRACE_SEIZE + PTRACE_INTERRUPT: the other threads run on), as
    threads blocked in uninterruptible I/O on a hung file system would be; kill ``pid`` at the end."""
    seized = []
    try:
        for tid in tids:
            why = _ptrace(0x4206, tid)  # PTRACE_SEIZE
            if why is not None:
                pytest.skip(f"ptrace is not permitted here ({why}): cannot stop one thread of the backend")
            seized.append(tid)
            assert _ptrace(0x4207, tid) is None  # PTRACE_INTERRUPT
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        for tid in seized:  # every traced thread's exit is reported to us, its tracer, before pid's
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(tid, 0x40000000)  # __WALL
        kill_quietly(pid)


def test_backend_whose_flusher_is_stuck_is_replaced(tmp_path, caplog):
    """The real-life hang: the backend's flusher thread is stuck (here stopped alone with ptrace; on
    a cluster, in D state on a hung mount) while its other threads still answer. Its polls report
    how long the flusher has made no progress; after backend_timeout the rank replaces it (left
    alive), re-sends, and the version commits bit-exact."""
    caplog.set_level(logging.WARNING, logger="deepfreeze")
    cfg = config(tmp_path, backend_timeout=3)
    plan = make_plan(1)
    e = Engine(cfg, "job", 0, plan)
    e.checkpoint(2, pieces(model_arrays(2), plan, 0), step=2, epoch=0)
    e.wait()
    old = e._backend.pid
    st = backend.status(cfg.scratch)
    tids = st["flusher"]["tids"]  # both lanes (deepfreeze.priority): a job may run on either
    assert st["flusher"]["stalled"] == 0.0  # idle
    with thread_stopped(old, *tids):
        e.checkpoint(4, pieces(model_arrays(4), plan, 0), step=4, epoch=0)
        e.wait(timeout=60)
        assert e._backend.pid != old
        assert process_state(old)[0] in "SR"  # the process itself runs (and answers): left alone
        e.close()
    assert "answers, but its flusher has made no progress" in caplog.text
    assert "left running, not killed" in caplog.text
    assert PersistentLevel(cfg.persistent).committed_versions("job") == [2, 4]
    for v in (2, 4):
        assert_version(persistent_only(cfg, tmp_path), v, "persistent")


class SilentPeer:
    """A real listening socket at the backend's path that speaks the protocol until ``silent`` is
    set (``hello``, ``flush`` -> an id, ``poll`` -> nothing done), then answers nothing more.
    ``answer=False``: accepts connections and never answers at all."""

    def __init__(self, path, answer=True):
        self.path, self.answer = path, answer
        self.silent = threading.Event()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.inode = os.stat(path).st_ino
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        next_id = 0
        for line in lines_of(conn):
            if not self.answer or self.silent.is_set():
                continue
            req = json.loads(line)
            if req["op"] == "hello":
                resp = {"ok": True, "pid": os.getpid(), "protocol": PROTOCOL}
            elif req["op"] == "flush":
                resp, next_id = {"ok": True, "id": next_id}, next_id + 1
            else:
                resp = {"ok": True, "done": [], "errors": []}
            conn.sendall(json.dumps(resp).encode() + b"\n")

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.scratch_files("v2 waits on scratch while its flush hangs in the silent backend (written once, it has no scratch copy to wait for)")
def test_pending_flushes_are_resent_to_the_replacement(tmp_path, caplog):
    """The backend took v2's flush (it has an id) and then went silent: after backend_timeout the
    engine starts a real backend, re-sends v2 and sends v4; both commit bit-exact."""
    caplog.set_level(logging.WARNING, logger="deepfreeze")
    cfg = config(tmp_path, backend_timeout=2)
    os.makedirs(cfg.scratch)
    peer = SilentPeer(socket_path(cfg.scratch))
    plan = make_plan(1)
    try:
        e = Engine(cfg, "job", 0, plan)
        assert e._backend.pid == os.getpid()  # the peer answered hello
        e.checkpoint(2, pieces(model_arrays(2), plan, 0), step=2, epoch=0)
        e.wait(persistent=False)
        assert list(e._pending) == [0]
        peer.silent.set()
        e.checkpoint(4, pieces(model_arrays(4), plan, 0), step=4, epoch=0)
        e.close()
    finally:
        peer.close()
    assert "declaring it dead" in caplog.text and "re-sending 1 pending flush(es)" in caplog.text
    assert PersistentLevel(cfg.persistent).committed_versions("job") == [2, 4]
    for v in (2, 4):
        assert_version(persistent_only(cfg, tmp_path), v, "persistent")


def test_replacement_that_fails_too_is_a_backend_error(tmp_path):
    """The silent backend is declared dead but no new backend can start (the socket directory became
    unsafe): the checkpoint's error is a BackendError, surfaced at the next call (where the
    callback's on_error applies), not a hang."""
    cfg = config(tmp_path, backend_timeout=1)
    os.makedirs(cfg.scratch)
    path = socket_path(cfg.scratch)
    peer = SilentPeer(path)
    plan = make_plan(1)
    rundir = os.path.dirname(path)
    try:
        e = Engine(cfg, "job", 0, plan)
        peer.silent.set()
        os.chmod(rundir, 0o755)  # runtime_dir() refuses it: no new backend can be started
        try:
            e.checkpoint(2, pieces(model_arrays(2), plan, 0), step=2, epoch=0)
            with pytest.raises(BackendError, match="declared dead .*replacement failed too.*mode 0700"):
                e.wait(timeout=30)
        finally:
            os.chmod(rundir, 0o700)
        e.close(wait=False)
    finally:
        peer.close()


def test_status_and_stop_report_an_unresponsive_backend(tmp_path):
    cfg = config(tmp_path)
    client = BackendClient(cfg.scratch)
    pid = client.pid
    client.close()
    try:
        st = backend.status(cfg.scratch, timeout=1)
        assert st["state"] == "running" and st["pid"] == pid
        with stopped(pid):
            t0 = time.monotonic()
            st = backend.status(cfg.scratch, timeout=1)
            assert time.monotonic() - t0 < 2.5  # its timeout, plus a margin for a loaded machine
            assert st["state"] == "unresponsive" and st["pid"] == pid and st["process"].startswith("T")
            assert f"unresponsive, pid {pid}" in st["message"]
            t0 = time.monotonic()
            sp = backend.stop(cfg.scratch, timeout=5, answer_timeout=1)
            assert time.monotonic() - t0 < 2.5
            assert sp["state"] == "unresponsive" and not sp["stop_requested"]
            assert "not stopped" in sp["message"] and f"kill -9 {pid}" in sp["message"]
            assert process_state(pid)[0] == "T"  # never killed by stop
            os.kill(pid, signal.SIGCONT)  # it wakes up: stop works again
            sp = backend.stop(cfg.scratch, timeout=20, answer_timeout=10)
            assert sp["state"] == "stopped" and sp["pid"] == pid
        assert backend.status(cfg.scratch)["state"] == "none"
    finally:
        kill_quietly(pid)


def test_new_client_does_not_wait_on_a_socket_that_never_answers(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="deepfreeze")
    cfg = config(tmp_path)
    os.makedirs(cfg.scratch)
    path = socket_path(cfg.scratch)
    peer = SilentPeer(path, answer=False)
    try:
        t0 = time.monotonic()
        with pytest.raises(BackendUnresponsiveError) as ei:
            BackendClient(cfg.scratch, start=False, answer_timeout=1)
        assert time.monotonic() - t0 < 2
        assert ei.value.pid == os.getpid()  # known from the socket's credentials, without an answer
        assert backend.status(cfg.scratch, timeout=1)["state"] == "unresponsive"
        client = BackendClient(cfg.scratch, answer_timeout=1)  # starts a real backend on the same path
        try:
            assert client.pid != os.getpid()
            assert os.stat(path).st_ino != peer.inode
            assert client.request({"op": "status"})["pid"] == client.pid
        finally:
            client.close()
            kill_quietly(client.pid)
        assert "treating it as unresponsive and starting a new backend" in caplog.text
    finally:
        peer.close()


def test_a_hung_holder_of_the_spawn_lock_does_not_block_a_newcomer(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="deepfreeze")
    cfg = config(tmp_path)
    lockpath = socket_path(cfg.scratch) + ".lock"
    with open(lockpath, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another open file description: conflicts, as another process would
        client = BackendClient(cfg.scratch, timeout=2)
    try:
        assert client.pid != os.getpid()
        assert "backend start lock" in caplog.text and f"by pid {os.getpid()}" in caplog.text
    finally:
        client.close()
        kill_quietly(client.pid)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_backend_timeout_is_validated(tmp_path, value):
    ini = tmp_path / "c.cfg"
    ini.write_text(f"mode = async\nscratch = {tmp_path}/s\npersistent = {tmp_path}/p\nbackend_timeout = {value}\n")
    with pytest.raises(ConfigError, match="backend_timeout"):
        Config.load(ini)


def test_backend_timeout_default_and_ini(tmp_path):
    assert config(tmp_path).backend_timeout == 60
    ini = tmp_path / "c.cfg"
    ini.write_text(f"mode = async\nscratch = {tmp_path}/s\npersistent = {tmp_path}/p\nbackend_timeout = 2.5\n")
    assert Config.load(ini).backend_timeout == 2.5


@pytest.mark.scratch_files("v2 waits on scratch while its flush hangs in the silent backend (written once, it has no scratch copy to wait for)")
def test_wait_with_timeout_replaces_only_with_time_to_spare(tmp_path, caplog):
    """backend_timeout = 1: wait(timeout=2) on a silent backend raises in time without starting a
    new one (no time left to start it); wait(timeout=30) replaces it and v2 commits bit-exact."""
    caplog.set_level(logging.WARNING, logger="deepfreeze")
    cfg = config(tmp_path, backend_timeout=1)
    os.makedirs(cfg.scratch)
    peer = SilentPeer(socket_path(cfg.scratch))
    plan = make_plan(1)
    try:
        e = Engine(cfg, "job", 0, plan)
        e.checkpoint(2, pieces(model_arrays(2), plan, 0), step=2, epoch=0)
        e.wait(persistent=False)
        assert list(e._pending) == [0]
        peer.silent.set()
        t0 = time.monotonic()
        with pytest.raises(BackendError, match="has not answered"):
            e.wait(timeout=2)
        assert time.monotonic() - t0 < 3
        assert "declaring it dead" not in caplog.text
        e.wait(timeout=30)
        assert e._backend.pid != os.getpid() and "declaring it dead" in caplog.text
        new = e._backend.pid
        e.close()
    finally:
        peer.close()
    assert_version(persistent_only(cfg, tmp_path), 2, "persistent")
    kill_quietly(new)


def test_a_client_that_stops_reading_does_not_block_the_backend(tmp_path):
    """One client floods requests and never reads an answer: its connection thread waits (at most
    the server's send timeout) without holding anything others need; other clients are answered
    and flushes commit meanwhile."""
    cfg = config(tmp_path)
    plan = make_plan(1)
    e = Engine(cfg, "job", 0, plan)
    pid = e._backend.pid
    flooder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    flooder.connect(socket_path(cfg.scratch))
    flooder.settimeout(5)
    sent = []

    def flood():
        line = json.dumps({"op": "status"}).encode() + b"\n"
        try:
            for _ in range(200000):
                flooder.sendall(line)
                sent.append(1)
        except OSError:
            pass

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    t.join(10)  # the server stopped reading it: its answers fill the socket buffer
    assert not t.is_alive() and len(sent) < 200000
    try:
        st = backend.status(cfg.scratch, timeout=5)
        assert st["state"] == "running" and st["pid"] == pid
        e.checkpoint(2, pieces(model_arrays(2), plan, 0), step=2, epoch=0)
        e.wait(timeout=30)
        e.close()
    finally:
        flooder.close()
    assert_version(persistent_only(cfg, tmp_path), 2, "persistent")


@pytest.mark.scratch_files("holds v2's commit.lock so the backend's flush stays pending (written once, the writer itself would wait on the lock)")
def test_wait_with_timeout_keeps_its_bound_when_the_backend_died(tmp_path):
    """kill -9 of the backend with a flush pending: wait(timeout=2) does not start a replacement it
    has no time for (BackendError within 3 s); a wait without timeout then starts one, re-sends,
    and the version commits bit-exact."""
    cfg = config(tmp_path)
    plan = make_plan(1)
    e = Engine(cfg, "job", 0, plan)
    pid = e._backend.pid
    lock = os.path.join(PersistentLevel(cfg.persistent).version_dir("job", 2), "commit.lock")
    os.makedirs(os.path.dirname(lock))
    with open(lock, "w") as f:  # held by this live process: the flush of v2 stays pending
        f.write(lock_record("0123456789abcdef").decode())
    e.checkpoint(2, pieces(model_arrays(2), plan, 0), step=2, epoch=0)
    e.wait(persistent=False)
    assert e._pending
    kill_quietly(pid)
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="too little time left|has not answered|not finished within"):
        e.wait(timeout=2)
    assert time.monotonic() - t0 < 3
    os.unlink(lock)
    e.close()  # no deadline: a new backend, the flush re-sent
    assert PersistentLevel(cfg.persistent).committed_versions("job") == [2]
    assert_version(persistent_only(cfg, tmp_path), 2, "persistent")
