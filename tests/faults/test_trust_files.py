"""Issue 23, item 1 and the backend socket of item 2: one trust check (deepfreeze.ownership) for
the siblings' files and the node backend's Unix socket.

"Another user" is the existing unprivileged account ``nobody``: as root, files are chowned to it to
stand for what that user planted, and real processes run as it (a child that drops to nobody with
setgid/setuid before it runs) where a peer must be a live process (the backend socket). Tests that
need it skip when not run as root; no OS user is ever created. Real files, real processes.
"""
import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from deepfreeze import backend, net
from deepfreeze.errors import (AuthenticationError, MemtierCorruptError, StreamError, UnsafePathError,
                               UntrustedOwnerError)
from deepfreeze.memtier import device as D
from deepfreeze.repo.store import EmbeddedRepository
from deepfreeze.lease import RunInfo, Version
from deepfreeze.shardplan import ShardPlan, TensorSpec
from deepfreeze.stream import Publisher, StreamOptions, Subscriber, read_endpoints
from deepfreeze.stream.core import endpoint_dir
from deepfreeze.stream.slots import SlotRing

from _util import nobody_ids




def chown_tree(path, uid, gid):
    os.chown(path, uid, gid, follow_symlinks=False)
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            os.chown(os.path.join(root, n), uid, gid, follow_symlinks=False)


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()




def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


# ------------------------------------------------------------------------------- memory tier

def test_memtier_device_precreated_by_another_user_is_refused(shared_dir, tmp_path):
    uid, gid = nobody_ids()
    path = os.path.join(shared_dir, "tier")
    D.create(path, "4M").close()  # a valid device: accepting it would "work"
    os.chown(path, uid, gid)      # ... made by nobody, first, in the sticky directory
    os.chmod(path, 0o600)
    before = digest(path)
    for writable in (True, False):  # for writing and for restore alike: its owner could forge any version
        with pytest.raises(UnsafePathError) as e:
            D.open(path, writable=writable)
        assert path in str(e.value) and "nobody" in str(e.value) and "choose another path" in str(e.value)
    with pytest.raises(UntrustedOwnerError, match="owned by nobody"):
        D.create(path, "4M")
    # a job configured with it refuses to start, before writing anything
    from deepfreeze.config import Config
    from deepfreeze.engine import Engine
    cfg = Config.load(None, mode="sync", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"), memtier=path)
    plan = ShardPlan.build([TensorSpec(0, "w", "float32", (64, 8))], 1, min_shard_bytes=0)
    with pytest.raises(UnsafePathError, match="nobody"):
        Engine(cfg, "job", 0, plan)
    assert digest(path) == before and os.stat(path).st_uid == uid  # nothing of ours written into it


def test_memtier_own_device_with_a_wide_mode_is_tightened_with_one_log_line(tmp_path, caplog):
    path = str(tmp_path / "tier")
    D.create(path, "4M").close()
    assert mode(path) == 0o600
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="deepfreeze"):
        D.open(path, writable=False).close()
        D.open(path).close()
    lines = [r.getMessage() for r in caplog.records if "tightened" in r.getMessage()]
    assert len(lines) == 1 and path in lines[0] and "0644" in lines[0]
    assert mode(path) == 0o600


def test_memtier_device_link_is_never_followed(tmp_path):
    real = str(tmp_path / "tier")
    D.create(real, "4M").close()
    link = str(tmp_path / "link")
    os.symlink(real, link)
    with pytest.raises(MemtierCorruptError, match="symbolic link"):
        D.open(link)


# ------------------------------------------------------------------------------- repository

def _weights(seed):
    r = np.random.default_rng(seed)
    return {"w": r.standard_normal((40, 10)).astype(np.float32), "b": r.standard_normal(10).astype(np.float32)}


def test_repository_directory_of_another_user_is_refused(shared_dir):
    uid, gid = nobody_ids()
    d = os.path.join(shared_dir, "repo")
    with EmbeddedRepository(d) as planted:  # nobody's repository, with their own meta.db and packs
        planted.put("model", _weights(666))
    chown_tree(d, uid, gid)
    os.chmod(d, 0o755)
    with pytest.raises(UnsafePathError) as e:
        EmbeddedRepository(d)
    assert d in str(e.value) and "nobody" in str(e.value)
    # the directory is ours, but nobody swapped in their meta.db (say, while it was group-writable)
    mine = os.path.join(shared_dir, "mine")
    with EmbeddedRepository(mine) as repo:
        repo.put("model", _weights(1))
    shutil.copy(os.path.join(d, "meta.db"), os.path.join(mine, "meta.db"))
    for p in os.listdir(os.path.join(d, "packs")):
        shutil.copy(os.path.join(d, "packs", p), os.path.join(mine, "packs", p))
    os.chown(os.path.join(mine, "meta.db"), uid, gid)
    with pytest.raises(UnsafePathError, match="meta.db .repository database. is owned by nobody"):
        EmbeddedRepository(mine)
    # their pack files among ours: never read
    os.chown(os.path.join(mine, "meta.db"), 0, 0)
    with EmbeddedRepository(mine) as repo:
        for p in os.listdir(os.path.join(mine, "packs")):
            os.chown(os.path.join(mine, "packs", p), uid, gid)
        with pytest.raises(UnsafePathError, match="repository pack. is owned by nobody"):
            repo.get("model")


def test_repository_files_are_private_and_wide_ones_tightened(tmp_path, caplog):
    old = os.umask(0o022)  # what a usual shell has: modes must not depend on it
    try:
        d = str(tmp_path / "repo")
        with EmbeddedRepository(d) as repo:
            repo.put("model", _weights(1))
            files = ["meta.db", "meta.db-wal", "meta.db-shm"]
            for f in files:
                assert mode(os.path.join(d, f)) == 0o600, f
            assert mode(d) == 0o700 and mode(os.path.join(d, "packs")) == 0o700
            packs = os.listdir(os.path.join(d, "packs"))
            assert packs and all(mode(os.path.join(d, "packs", p)) == 0o600 for p in packs)
        os.chmod(os.path.join(d, "meta.db"), 0o644)
        os.chmod(os.path.join(d, "packs", packs[0]), 0o644)
        with caplog.at_level(logging.WARNING, logger="deepfreeze"):
            with EmbeddedRepository(d) as repo:
                got = repo.get("model")
        assert all(got[k].tobytes() == v.tobytes() for k, v in _weights(1).items())
        lines = [r.getMessage() for r in caplog.records if "tightened" in r.getMessage()]
        assert len(lines) == 2 and any("meta.db" in x for x in lines) and any(packs[0] in x for x in lines)
        assert mode(os.path.join(d, "meta.db")) == 0o600 and mode(os.path.join(d, "packs", packs[0])) == 0o600
        # a link where meta.db goes is refused, never followed
        os.rename(os.path.join(d, "meta.db"), os.path.join(tmp_path, "elsewhere.db"))
        os.symlink(os.path.join(tmp_path, "elsewhere.db"), os.path.join(d, "meta.db"))
        with pytest.raises(UnsafePathError, match="symlink"):
            EmbeddedRepository(d)
    finally:
        os.umask(old)


# ------------------------------------------------------------------------------- stream

SPECS = [TensorSpec(0, "w", "float32", (50, 20)), TensorSpec(1, "b", "float32", (20,))]


def _full(step):
    r = np.random.default_rng(step)
    return [r.standard_normal(s.shape).astype(s.dtype) for s in SPECS]


def _publish(pub, plan, version, full):
    from deepfreeze.fused import FusedLayout, FusedShard
    lay = FusedLayout.build(plan, 0)
    pieces = [full[s.piece.tensor_id].reshape(-1)[s.piece.start:s.piece.stop] for s in lay.segments]
    pub.publish(version, FusedShard.from_arrays(lay, pieces, 0))
    pub.wait(30)


def test_endpoint_planted_by_another_user_is_not_used(shared_dir, tmp_path, monkeypatch, caplog):
    uid, gid = nobody_ids()
    monkeypatch.setenv("DEEPFREEZE_TOKEN", "d" * 64)
    persistent = os.path.join(shared_dir, "pfs")  # a shared persistent directory
    os.mkdir(persistent, 0o700)
    plan = ShardPlan.build(SPECS, 1, min_shard_bytes=0)
    shm = tmp_path / "shm"
    shm.mkdir()
    opts = StreamOptions(shm_dir=str(shm))
    pub = Publisher("chan", persistent, rank=0, world=1, run=RunInfo("ab" * 8, 0), plan=plan, model_tensors=2,
                    options=opts)
    try:
        d = endpoint_dir(persistent, "chan")
        assert mode(d) == 0o700 and mode(os.path.join(d, "r0.json")) == 0o600
        # nobody's forged endpoint beside the real one: another run, pointing to their server
        rec = json.load(open(os.path.join(d, "r0.json")))
        forged = os.path.join(d, "r1.json")
        with open(forged, "w") as f:
            json.dump(dict(rec, run="ee" * 8, rank=0, world=1, address="127.0.0.1:9", t=time.time() + 1e6), f)
        os.chown(forged, uid, gid)
        with caplog.at_level(logging.WARNING, logger="deepfreeze"):
            eps = read_endpoints(persistent, "chan")
        assert set(eps) == {"ab" * 8}
        assert sum("nobody" in r.getMessage() and forged in r.getMessage() for r in caplog.records) == 1
        full = _full(3)
        _publish(pub, plan, Version(0, 3), full)
        with Subscriber("chan", persistent, tier="tcp") as sub:  # the real producer's version
            up = sub.next(30)
            assert up is not None and up.version == Version(0, 3)
            assert all(up.arrays[s.name].tobytes() == full[s.id].tobytes() for s in SPECS)
    finally:
        pub.close()
    # a whole channel directory nobody made first: the producer refuses it, consumers ignore it
    chan2 = os.path.join(persistent, "chan2")
    os.makedirs(os.path.join(chan2, "stream"))
    with open(os.path.join(chan2, "stream", "r0.json"), "w") as f:
        json.dump(dict(rec, channel="chan2"), f)
    chown_tree(chan2, uid, gid)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deepfreeze"):
        assert read_endpoints(persistent, "chan2") == {}
    assert any("owned by nobody" in r.getMessage() for r in caplog.records)
    with pytest.raises(UnsafePathError, match="owned by nobody"):
        Publisher("chan2", persistent, rank=0, world=1, run=RunInfo("cd" * 8, 0), plan=plan, model_tensors=2,
                  options=opts)
    assert os.listdir(os.path.join(chan2, "stream")) == ["r0.json"]
    assert not os.listdir(shm)  # the refused producer's ring was removed


def test_ring_of_another_user_in_shm_is_refused():
    uid, gid = nobody_ids()
    path = f"/dev/shm/deepfreeze-stream-trusttest-{os.getpid()}-r0"
    ring = SlotRing.create(path, 4096, 3)
    try:
        ring.write(Version(0, 1), np.arange(1024, dtype=np.float32))
        os.chown(path, uid, gid)
        with pytest.raises(StreamError, match="owned by nobody") as e:
            SlotRing.open(path)
        assert path in str(e.value)
        os.chown(path, 0, 0)
        os.chmod(path, 0o644)  # ours, but readable by every user: a ring is made 0600, refused as it is
        with pytest.raises(StreamError, match="chmod 600"):
            SlotRing.open(path)
    finally:
        ring.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# ------------------------------------------------------------------------------- token files

def test_token_files_of_another_user_loose_or_linked_are_refused(tmp_path):
    uid, gid = nobody_ids()
    path = str(tmp_path / "token")
    tok = net.create_token(path)
    assert net.load_token(path) == tok
    os.chown(path, uid, gid)
    with pytest.raises(UntrustedOwnerError) as e:
        net.load_token(path)
    assert path in str(e.value) and "nobody" in str(e.value) and "Remove it" in str(e.value)
    os.chown(path, 0, 0)
    os.chmod(path, 0o644)
    with pytest.raises(AuthenticationError, match="chmod 600") as e:
        net.load_token(path)
    assert mode(path) == 0o644  # a secret others could read is refused, not silently tightened
    os.chmod(path, 0o600)
    link = str(tmp_path / "link")
    os.symlink(path, link)
    with pytest.raises(AuthenticationError, match="symbolic link"):
        net.load_token(link)


# ------------------------------------------------------------------------------- backend socket

_PEER = r"""
import json, socket, sys
path = sys.argv[1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(path)
except OSError as e:
    print(json.dumps({"connect": e.strerror})); sys.exit(0)
try:
    s.sendall(b'{"op": "hello"}\n')
    data = s.recv(4096)
    print(json.dumps({"connect": "ok", "answer": data.decode(errors="replace")}))
except OSError as e:
    print(json.dumps({"connect": "ok", "error": e.strerror}))
"""

_FAKE_SERVER = r"""
import json, os, socket, sys
path, log = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path); os.chmod(path, 0o666); s.listen(8); s.settimeout(20)
got = b""
try:
    c, _ = s.accept(); c.settimeout(2)
    try:
        while True:
            d = c.recv(4096)
            if not d:
                break
            got += d
            c.sendall(b'{"ok": true, "pid": 1}\n')
    except OSError:
        pass
except OSError:
    pass
with open(log, "w") as f:
    f.write(json.dumps({"received": got.decode(errors="replace")}))
"""


def _plain_python():
    """An interpreter the other user can run (the venv's may sit below a directory only root can
    enter); the scripts it runs use the standard library only."""
    for p in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if os.path.isfile(p) and os.stat(p).st_mode & 0o001:
            return p
    pytest.skip("no python3 that the user 'nobody' may run (/usr/bin/python3)")


def _as_nobody(uid, gid):
    def drop():
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    return drop


def _wait_for(path, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def test_backend_refuses_a_connection_from_another_user(shared_dir):
    uid, gid = nobody_ids()
    d = os.path.join(shared_dir, "run")  # a directory nobody can reach, for this test only (the real
    os.mkdir(d, 0o755)                   # runtime dir is 0700: layer one, nobody cannot even get there)
    sock = os.path.join(d, "backend.sock")
    env = dict(os.environ, DEEPFREEZE_BACKEND_IDLE="30")
    proc = subprocess.Popen([sys.executable, "-m", "deepfreeze.backend", "--socket", sock, "--idle", "30"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_for(sock)

        def peer(preexec):
            out = subprocess.run([_plain_python(), "-c", _PEER, sock], capture_output=True, timeout=60,
                                 preexec_fn=preexec, check=True)
            return json.loads(out.stdout)
        assert mode(sock) == 0o600
        assert peer(_as_nobody(uid, gid)) == {"connect": "Permission denied"}  # layer two: the socket's mode
        os.chmod(sock, 0o666)  # this test only: let nobody's connect through, to reach the SO_PEERCRED check
        got = peer(_as_nobody(uid, gid))
        assert got.get("connect") == "ok" and not got.get("answer")  # closed, nothing answered
        mine = peer(None)  # a process of the backend's own user is served
        assert json.loads(mine["answer"])["ok"] is True
    finally:
        with contextlib.suppress(OSError):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(sock)
            s.sendall(b'{"op": "stop"}\n')
            s.recv(100)
            s.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    err = proc.stderr.read().decode()
    assert "refused a connection" in err and "nobody" in err


def test_client_refuses_a_backend_socket_of_another_user(shared_dir, tmp_path, monkeypatch):
    uid, gid = nobody_ids()
    base = os.path.join(shared_dir, "xdg")
    os.mkdir(base, 0o755)
    monkeypatch.setenv("DEEPFREEZE_RUNTIME_DIR", base)
    scratch = str(tmp_path / "scratch")
    os.mkdir(scratch)
    target = backend.socket_path(scratch)  # in our 0700 runtime directory
    theirs = os.path.join(shared_dir, "theirs")
    os.mkdir(theirs)
    os.chown(theirs, uid, gid)
    fake, log = os.path.join(theirs, "s"), os.path.join(theirs, "log")
    proc = subprocess.Popen([_plain_python(), "-c", _FAKE_SERVER, fake, log], preexec_fn=_as_nobody(uid, gid))
    try:
        _wait_for(fake)
        os.rename(fake, target)  # planted where our backend's socket goes (only root could; a stand-in)
        with pytest.raises(UntrustedOwnerError) as e:
            backend.BackendClient(scratch, start=False, answer_timeout=5)
        assert target in str(e.value) and "nobody" in str(e.value)
    finally:
        proc.wait(30)
    with open(log) as f:
        assert json.load(f) == {"received": ""}  # not one byte of ours reached it
