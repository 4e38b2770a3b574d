"""Repository providers (deepfreeze.repo.provider) and their client (deepfreeze.repo.client):
real provider processes, real client processes, the arena, TCP, hostile requests, a provider
killed in the middle of a store."""
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from _util import ROOT, WORKERS, stop_process
from deepfreeze import net
from deepfreeze.errors import (AuthenticationError, ModelNotFoundError, NameExistsError, ProviderError,
                               ProviderTimeoutError, RepositoryError)
from deepfreeze.repo.arena import SHM_DIR
from deepfreeze.repo.client import RemoteRepository
from deepfreeze.repo.provider import placement

sys.path.insert(0, WORKERS)
from repo_client import make_tensors, model_name  # noqa: E402

TOKEN = "0123456789abcdef" * 4


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv(net.TOKEN_ENV, TOKEN)
    e = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    e[net.TOKEN_ENV] = TOKEN
    return e


class ProviderProc:
    """A provider process; ``addr`` once it listens."""

    def __init__(self, env, directory, *args, cmd=None, port=0):
        self.cmd = cmd or [sys.executable, "-m", "deepfreeze.repo.provider", "--dir", str(directory),
                           "--listen", f"127.0.0.1:{port}", *args]
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and not line:
            r, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if r:
                line = self.proc.stdout.readline()
                if not line:
                    break
        if not line.startswith("listening on "):
            self.proc.kill()
            pytest.fail(f"provider did not start: {line!r} {self.proc.stderr.read()[-3000:]}")
        self.addr = line.split()[-1]
        self.port = int(self.addr.rsplit(":", 1)[1])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def arena_files(self):
        return [n for n in os.listdir(SHM_DIR) if n.startswith(f"deepfreeze-arena-{os.getuid()}-{self.proc.pid}-")]


@pytest.fixture
def providers(env, tmp_path):
    started = []

    def start(n=2, *args, dirs=None):
        procs = [ProviderProc(env, (dirs or {}).get(i, tmp_path / f"p{i}"), *args) for i in range(n)]
        started.extend(procs)
        return procs

    yield start
    for p in started:
        p.stop()


def _equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_four_clients_two_providers_concurrently_bit_exact(env, providers):
    """4 client processes (2 through the arena, 2 over TCP) store and load at once on 2 providers;
    the models are spread over both, and every byte comes back."""
    p0, p1 = providers(2)
    location = f"dstore://{p0.addr},{p1.addr}"
    n = 3
    clients = [subprocess.Popen([sys.executable, os.path.join(WORKERS, "repo_client.py"), location, str(c),
                                 "auto" if c < 2 else "tcp", str(n)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for c in range(4)]
    outs = []
    for c in clients:
        out, err = c.communicate(timeout=300)
        assert c.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert [o["staging"] for o in outs] == [["arena", "arena"]] * 2 + [["tcp", "tcp"]] * 2
    assert all(o["bytes_read"] > 0 for o in outs)
    with RemoteRepository(location) as repo:
        names = {name for names in repo.list().values() for name in names}
        assert names == {model_name(c, j) for c in range(4) for j in range(n)}
        where = {placement(name, 2) for name in names}
        assert where == {0, 1}  # placement used both providers
        per = repo.info()["per_provider"]
        assert [d["names"] for d in per] == [sum(placement(x, 2) == i for x in names) for i in range(2)]
        for c in range(4):
            for j in range(n):
                t = make_tensors(100 * c + j)
                got = repo.get(model_name(c, j))
                assert all(_equal(got[k], t[k]) for k in t)
        with pytest.raises(NameExistsError):
            repo.put(model_name(0, 0), make_tensors(0))
    assert p0.stop() == 0 and p1.stop() == 0
    assert not p0.arena_files() and not p1.arena_files()  # SIGTERM: clean stop, arena unlinked


def test_interface_over_providers(env, providers):
    """graph, layer_meta, specs, info, delete, gc, bytes_read through the providers."""
    p0, p1 = providers(2)
    repo = RemoteRepository([p0.addr, p1.addr])
    lid = "ab" * 16
    graph = {"scheme": 1, "layers": [{"id": lid, "inputs": [], "tensors": 2}], "outputs": [0]}
    t = {f"{lid}/0": np.ones((4, 3), np.float32), f"{lid}/1": np.arange(3, dtype=np.float32)}
    meta = {lid: {"class": "Dense", "config": {"units": 3}}}
    res = repo.put("net@v1", t, graph, meta)
    assert res["bytes"] == 60
    assert repo.graph("net@v1") == graph
    assert repo.layer_meta([lid, "cd" * 16]) == meta
    assert repo.specs("net@v1") == {f"{lid}/0": ("float32", (4, 3)), f"{lid}/1": ("float32", (3,))}
    r0 = repo.bytes_read
    repo.get("net@v1", [f"{lid}/1"])
    assert repo.bytes_read - r0 == 12  # exactly the requested tensor's bytes
    info = repo.info("net@v1")
    assert info["bytes"] == 60 and info["tensors"] == 2
    res2 = repo.put("net@v2", t, graph, meta)
    total = repo.info()
    assert total["names"] == 2 and total["models"] == 1 and total["providers"] == [p0.addr, p1.addr]
    if placement("net@v1", 2) == placement("net@v2", 2):
        assert res2["deduplicated"] == 60
    freed = repo.delete("net@v1")  # what the provider's repository freed, as the embedded one says it
    assert set(freed) >= {"freed", "blobs_removed", "packs_removed"}
    if placement("net@v1", 2) != placement("net@v2", 2):
        assert freed["freed"] > 0  # nothing shared with net@v2 on that provider
    with pytest.raises(ModelNotFoundError):
        repo.get("net@v1")
    with pytest.raises(NameExistsError):
        repo.put("net@v1", t, graph, meta)
    assert repo.list() == {"net": ["net@v2"]}
    assert isinstance(repo.gc(), dict)
    with pytest.raises(ModelNotFoundError):
        repo.get("net@v2", ["nope"])
    with pytest.raises(RepositoryError):
        repo.put("../etc@x", t)
    big_endian = np.arange(6, dtype=">f4").reshape(2, 3)
    repo.put("be@1", {"x": big_endian})
    back = repo.get("be@1")["x"]
    assert back.dtype == np.float32 and np.array_equal(back, big_endian)
    repo.close()


def test_stopped_provider_is_a_bounded_error(env, providers):
    """A provider that stops answering (SIGSTOP): the client's request fails after its timeout."""
    (p,) = providers(1)
    repo = RemoteRepository([p.addr], timeout=1.0)
    repo.put("m@1", {"w": np.zeros(10)})
    try:
        stop_process(p.proc.pid)
        t0 = time.monotonic()
        with pytest.raises(ProviderTimeoutError):
            repo.get("m@1")
        assert time.monotonic() - t0 < 30
    finally:
        os.kill(p.proc.pid, signal.SIGCONT)
    assert repo.get("m@1")["w"].sum() == 0  # the next request reconnects
    repo.close()


def test_a_client_starts_with_a_provider_down_and_uses_the_others(env, providers, tmp_path, caplog):
    """One of two providers is stopped when a client is made: the client starts (one warning
    naming it), loads the model on the live provider bit-exact, gets a clear ProviderError naming
    the dead one for a model placed there, and uses it once it is back on the same address. With
    every provider down, the constructor raises."""
    p0, p1 = providers(2)
    location = [p0.addr, p1.addr]
    names = {}
    with RemoteRepository(location) as repo:
        for j in range(40):
            names.setdefault(placement(f"m{j}@v1", 2), f"m{j}@v1")
        want = {i: make_tensors(i) for i in (0, 1)}
        for i, name in names.items():
            repo.put(name, want[i])
    d0, port0 = tmp_path / "p0", p0.port
    assert p0.stop() == 0
    caplog.set_level("WARNING", logger="deepfreeze")
    repo = RemoteRepository(location, timeout=5.0)
    try:
        assert repo.unreachable == [p0.addr] and repo.staging[0] is None
        assert sum(f"provider {p0.addr} cannot be reached" in r.getMessage() for r in caplog.records) == 1
        got = repo.get(names[1])
        assert all(got[k].tobytes() == want[1][k].tobytes() for k in want[1])
        with pytest.raises(ProviderError, match=p0.addr.replace(".", r"\.")):
            repo.get(names[0])
        with pytest.raises(ProviderError, match=p0.addr.replace(".", r"\.")):
            repo.put(next(f"n{j}@v1" for j in range(99) if placement(f"n{j}@v1", 2) == 0), want[0])  # a put there too
        back = ProviderProc(env, d0, port=port0)  # the same directory and address
        try:
            assert repo.staging[0] is None
            got = repo.get(names[0])  # the next request connects, through the arena (this node, this user)
            assert repo.staging[0] == "arena"
            assert all(got[k].tobytes() == want[0][k].tobytes() for k in want[0]) and repo.unreachable == []
        finally:
            back.stop()
    finally:
        repo.close()
    assert p1.stop() == 0
    with pytest.raises(ProviderError, match="cannot connect"):
        RemoteRepository(location, timeout=5.0)


def test_client_with_another_provider_list_refused(env, providers):
    p0, p1 = providers(2)
    RemoteRepository([p0.addr, p1.addr]).close()  # fixes the list on both
    with pytest.raises(RepositoryError, match="provider list"):
        RemoteRepository([p1.addr, p0.addr])  # another order: another placement
    with pytest.raises(RepositoryError, match="provider list"):
        RemoteRepository([p0.addr])
    RemoteRepository(f"dstore://{p0.addr},{p1.addr}").close()  # the same list is fine


def test_wrong_token_refused(env, providers):
    (p0,) = providers(1)
    with pytest.raises(AuthenticationError):
        RemoteRepository([p0.addr], token="not-the-token")
    RemoteRepository([p0.addr]).close()


def test_provider_killed_mid_store_leaves_nothing_and_restarts(env, providers, tmp_path):
    """SIGKILL between the pack write and the commit: the name is not visible, the provider
    restarted on the same directory and port serves what was committed (and accepts the name)."""
    d = tmp_path / "slow"
    marker = tmp_path / "marker"
    slow = ProviderProc(env, d, cmd=[sys.executable, os.path.join(WORKERS, "repo_slow_provider.py"), str(d),
                                     str(marker)])
    try:
        repo = RemoteRepository([slow.addr], timeout=120)
        kept = make_tensors(1)
        repo.put("kept@v1", kept)
        errors = []

        def store():
            try:
                repo.put("slow@v1", make_tensors(2))
            except Exception as e:  # noqa: BLE001 - checked below
                errors.append(e)

        t = threading.Thread(target=store)
        t.start()
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the store never reached its commit"
        slow.proc.send_signal(signal.SIGKILL)
        slow.proc.wait(30)
        t.join(60)
        assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], ProviderError), errors
        repo.close()
    finally:
        slow.proc.kill()
        slow.proc.wait()
    assert slow.arena_files()  # a killed provider cannot unlink its arena...
    again = ProviderProc(env, d, port=slow.port)
    try:
        assert not slow.arena_files()  # ...the next one sweeps it
        with RemoteRepository([again.addr]) as repo:
            assert repo.list() == {"kept": ["kept@v1"]}
            got = repo.get("kept@v1")
            assert all(_equal(got[k], kept[k]) for k in kept)
            with pytest.raises(ModelNotFoundError):
                repo.get("slow@v1")
            repo.put("slow@v1", make_tensors(2))  # never committed: the name is free
            assert repo.get("slow@v1")["scalar"] == 2
    finally:
        again.stop()


class Raw:
    """A hand-driven protocol connection (for hostile requests)."""

    def __init__(self, addr, token=TOKEN, providers=None, index=0):
        self.sock = net.connect(addr, 10)
        from deepfreeze.node import node_id
        self.ch, self.hello = net.client_handshake(self.sock, token, {"op": "hello", "providers": providers or [addr],
                                                                      "index": index, "node": node_id(),
                                                                      "uid": os.getuid()},
                                                   deadline=time.monotonic() + 10)

    def send(self, header, payload=(), raw=None):
        if raw is not None:
            self.sock.sendall(raw)
        else:
            net.send_msg(self.ch, header, payload, deadline=time.monotonic() + 10)
        msg = net.recv_msg(self.ch, max_header=1 << 24, max_payload=1 << 30, deadline=time.monotonic() + 30)
        msg.discard()
        return msg.header

    def closed(self):
        try:
            self.sock.settimeout(10)
            return self.sock.recv(1) == b""
        except OSError:
            return True


def test_hostile_requests_rejected_provider_keeps_serving(env, providers):
    (p,) = providers(1, "--arena-bytes", str(1 << 20))
    addr = p.addr
    with RemoteRepository([addr]) as repo:
        repo.put("good@v1", {"w": np.arange(10, dtype=np.float32)})
    r = Raw(addr)
    assert r.hello["arena"]["size"] == 1 << 20
    seg = lambda key="w", dt="float32", shape=(4,), off=0, n=16: [key, dt, list(shape), off, n]  # noqa: E731
    cases = [
        ({"op": "get", "name": "../../etc/passwd", "staging": "tcp"}, (), "RepositoryError"),
        ({"op": "get", "name": "a/b", "staging": "tcp"}, (), "RepositoryError"),
        ({"op": "specs", "name": ".."}, (), "RepositoryError"),
        ({"op": "delete", "name": 7}, (), "RepositoryError"),
        ({"op": "get", "name": "good@v1", "tensors": ["nope"], "staging": "tcp"}, (), "ModelNotFoundError"),
        ({"op": "get", "name": "good@v1", "tensors": "w", "staging": "tcp"}, (), "RepositoryError"),
        ({"op": "get", "name": "good@v1", "staging": "file", "path": "/etc/passwd"}, (), "RepositoryError"),
        ({"op": "get", "name": "good@v1", "staging": "file", "path": "/dev/shm/../etc/passwd"}, (),
         "RepositoryError"),
        ({"op": "frobnicate"}, (), "RepositoryError"),
        ({"op": "layer_meta", "ids": ["../x"]}, (), "RepositoryError"),
        # a put whose lengths do not match its shapes, or the payload
        ({"op": "put", "name": "x@1", "staging": "tcp", "tensors": [seg(n=1 << 40)]}, [b"\0" * 16],
         "RepositoryError"),
        ({"op": "put", "name": "x@1", "staging": "tcp", "tensors": [seg()]}, [b"\0" * 32], "RepositoryError"),
        ({"op": "put", "name": "x@1", "staging": "tcp", "tensors": [seg(shape=[2] * 40, n=8 << 40)]}, (),
         "RepositoryError"),
        ({"op": "put", "name": "x@1", "staging": "tcp", "tensors": [seg(dt="object")]}, [b"\0" * 16],
         "RepositoryError"),
        ({"op": "put", "name": "x@1", "staging": "tcp", "tensors": [seg(shape=[-1], n=-4)]}, (), "RepositoryError"),
        ({"op": "put", "name": "x@1", "staging": "tcp", "tensors": [seg(), seg()]}, [b"\0" * 32], "RepositoryError"),
        ({"op": "put", "name": "x/../../y", "staging": "tcp", "tensors": [seg()]}, [b"\0" * 16], "RepositoryError"),
        # the arena: no extent held, then offsets outside the extent / the arena
        ({"op": "put", "name": "x@1", "staging": "arena", "tensors": [seg()]}, (), "RepositoryError"),
        ({"op": "alloc", "nbytes": 1 << 40}, (), "RepositoryError"),
        ({"op": "alloc", "nbytes": -1}, (), "RepositoryError"),
        ({"op": "release"}, (), "RepositoryError"),
        ({"op": "get", "name": "good@v1", "staging": "tcp", "verify": "yes"}, (), "RepositoryError"),
    ]
    for header, payload, err in cases:
        reply = r.send(header, payload)
        assert reply["ok"] is False and reply["type"] == err, (header, reply)
    for off in (1 << 20, (1 << 20) - 8, -16, 8192):  # outside the arena, across its end, negative, another extent
        ext = r.send({"op": "alloc", "nbytes": 16})
        assert ext["ok"] and ext["offset"] + ext["length"] <= 1 << 20
        reply = r.send({"op": "put", "name": "x@1", "staging": "arena", "tensors": [seg(off=ext["offset"] + off)]})
        assert reply["ok"] is False and reply["type"] == "RepositoryError", reply
    reply = r.send({"op": "list"})  # the connection still works
    assert reply["ok"] and reply["models"] == {"good": ["good@v1"]}
    # frames that cannot be read: answered (when possible) and the connection closed
    for raw in (struct_frame(1 << 30, 0), struct_frame(2, 1 << 50) + b"{}", b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 8):
        r2 = Raw(addr)
        with pytest.raises((ProviderError, RepositoryError)):
            net.raise_for_reply(r2.send(None, raw=raw))
        assert r2.closed()
    # a wrong token, and no hello at all
    with pytest.raises(AuthenticationError):
        Raw(addr, token="wrong")
    s = net.connect(addr, 10)  # a request without the handshake: closed, nothing answered
    s.sendall(net._plain({"op": "list"}))
    s.settimeout(10)
    assert s.recv(1 << 16) == b""
    s.close()
    # still serving, bit-exact
    with RemoteRepository([addr]) as repo:
        assert repo.get("good@v1")["w"].tobytes() == np.arange(10, dtype=np.float32).tobytes()
        assert repo.list() == {"good": ["good@v1"]}


def struct_frame(hlen, plen):
    import struct
    return struct.pack("<4sHHIQ", net.MAGIC, net.VERSION, 0, hlen, plen)


def test_arena_exhaustion_waits_then_times_out(env, providers):
    (p,) = providers(1, "--arena-bytes", str(1 << 20))
    hog = Raw(p.addr)
    ext = hog.send({"op": "alloc", "nbytes": 1 << 20})  # the whole arena
    assert ext["ok"] and ext["length"] == 1 << 20
    repo = RemoteRepository([p.addr], timeout=1.0)
    assert repo.staging == ["arena"]
    t = {"w": np.arange(1000, dtype=np.float64)}
    t0 = time.monotonic()
    with pytest.raises(ProviderTimeoutError, match="arena"):
        repo.put("m@1", t)
    assert time.monotonic() - t0 >= 0.9  # it waited for space first
    released = threading.Timer(0.3, lambda: hog.send({"op": "release"}))
    released.start()
    repo.timeout = 30.0
    repo.put("m@1", t)  # waits until the hog releases, then goes through
    released.join()
    assert repo.get("m@1")["w"].tobytes() == t["w"].tobytes()
    repo.close()


class CountingRepository(RemoteRepository):
    rounds = 0

    def _get_arena(self, *args, **kwargs):
        type(self).rounds += 1
        return super()._get_arena(*args, **kwargs)


def test_requests_larger_than_the_arena_are_chunked_bit_exact(env, providers):
    (p,) = providers(1, "--arena-size", str(1 << 20))  # 1 MiB arena (the CLI's spelling)
    rng = np.random.default_rng(5)
    t = {f"t{i}": rng.standard_normal(75_000).astype(np.float32) for i in range(10)}  # 10 x 300 KB
    t["huge"] = rng.standard_normal(600_000).astype(np.float32)  # 2.4 MB: bigger than the arena
    with CountingRepository([p.addr]) as repo:
        assert repo.staging == ["arena"]
        repo.put("big@1", t)  # 5.4 MB: goes over TCP (documented)
        got = repo.get("big@1")
        assert all(_equal(got[k], t[k]) for k in t)
        assert CountingRepository.rounds >= 4  # 3 MB of small tensors through a 1 MiB arena
        small = {f"t{i}": t[f"t{i}"] for i in range(3)}
        repo.put("small@1", small)  # fits: through the arena
        assert all(_equal(repo.get("small@1")[k], small[k]) for k in small)


@pytest.mark.parametrize("staging", ["tcp", "ondemand"])
def test_other_stagings_bit_exact(env, providers, staging):
    (p,) = providers(1, "--fsync")
    t = make_tensors(9)
    with RemoteRepository([p.addr], staging=staging) as repo:
        assert repo.staging == [staging]
        repo.put("s@1", t)
        got = repo.get("s@1")
        assert all(_equal(got[k], t[k]) for k in t)
        out = {"emb": np.zeros((50, 7), np.int64)}
        repo.get("s@1", ["emb"], out=out)
        assert _equal(out["emb"], t["emb"])
    od = [n for n in os.listdir(SHM_DIR) if n.startswith(f"deepfreeze-od-{os.getuid()}-{os.getpid()}-")]
    assert not od  # on-demand files are removed after each request


def test_non_loopback_listen_refused(env, tmp_path):
    p = subprocess.run([sys.executable, "-m", "deepfreeze.repo.provider", "--dir", str(tmp_path / "r"),
                        "--listen", "0.0.0.0:0"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "allow-remote" in p.stderr


def test_client_survives_a_provider_restart(env, providers, tmp_path):
    """A provider stopped and restarted on the same port: the same client object reconnects and
    maps the new arena (never the old one's stale memory); everything stays bit-exact."""
    (p,) = providers(1, dirs={0: tmp_path / "r"})
    repo = RemoteRepository([p.addr])
    a, b = make_tensors(11), make_tensors(12)
    repo.put("a@1", a)
    old_arena = repo._providers[0].arena_path
    assert p.stop() == 0
    with pytest.raises(ProviderError):
        repo.get("a@1")  # the provider is gone
    q = ProviderProc(env, tmp_path / "r", port=p.port)
    try:
        repo.put("b@1", b)
        assert repo.staging == ["arena"] and repo._providers[0].arena_path != old_arena
        got = {**repo.get("a@1"), **{f"b-{k}": v for k, v in repo.get("b@1").items()}}
        assert all(_equal(got[k], a[k]) and _equal(got[f"b-{k}"], b[k]) for k in a)
        repo.close()
    finally:
        q.stop()


def test_arena_allocator_size_classes_threads_and_cleanup():
    """The buddy allocator: power-of-two page classes, no two live extents overlap under
    concurrent alloc/free, everything merges back, the file is 0600 and removed on close."""
    import random
    import stat as stat_
    from deepfreeze.repo.arena import PAGE, Arena
    arena = Arena(40 * PAGE)  # not a power of two: blocks of 32 + 8 pages
    try:
        st = os.stat(arena.path)
        assert stat_.S_IMODE(st.st_mode) == 0o600 and st.st_size == 40 * PAGE
        assert os.path.basename(arena.path).startswith(f"deepfreeze-arena-{os.getuid()}-{os.getpid()}-")
        assert arena.max_extent == 32 * PAGE
        e = arena.alloc(3 * PAGE + 1, 0)
        assert e.length == 4 * PAGE and e.offset % e.length == 0
        arena.free(e)
        with pytest.raises(RepositoryError):
            arena.free(e)  # twice
        with pytest.raises(RepositoryError, match="split"):
            arena.alloc(33 * PAGE, 0)
        live, lock, failures = {}, threading.Lock(), []

        def worker(seed):
            rng = random.Random(seed)
            for _ in range(300):
                n = rng.randint(1, 6 * PAGE)
                try:
                    ext = arena.alloc(n, 5.0)
                except Exception as ex:  # noqa: BLE001 - reported below
                    failures.append(ex)
                    return
                view = arena.view(ext.offset, ext.length)
                view[:] = seed
                with lock:
                    for other in live.values():
                        if ext.offset < other.offset + other.length and other.offset < ext.offset + ext.length:
                            failures.append(("overlap", ext, other))
                    live[ext] = ext
                if not (view == seed).all():
                    failures.append(("overwritten", ext))
                with lock:
                    del live[ext]
                arena.free(ext)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(1, 9)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures[:3]
        assert arena.free_bytes == 40 * PAGE
        whole = arena.alloc(32 * PAGE, 0)  # merged back into the biggest block
        arena.free(whole)
    finally:
        arena.close()
    assert not os.path.exists(arena.path)


def test_one_client_used_by_several_threads(env, providers):
    """Threads sharing one RemoteRepository: arena sequences (alloc, copy, put/get, release) on
    one connection never interleave."""
    (p,) = providers(1)
    repo = RemoteRepository([p.addr])
    errors = []

    def work(i):
        try:
            for j in range(5):
                t = make_tensors(1000 + 10 * i + j)
                repo.put(f"t{i}@{j}", t)
                got = repo.get(f"t{i}@{j}")
                assert all(_equal(got[k], t[k]) for k in t)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert sum(len(v) for v in repo.list().values()) == 20
    repo.close()


def test_put_over_the_providers_limit_is_a_clear_error(env, providers):
    (p,) = providers(1, "--max-request-bytes", str(1 << 20))
    with RemoteRepository([p.addr], staging="tcp") as repo:
        with pytest.raises(RepositoryError, match="over the limit of 1048576"):
            repo.put("big@1", {"w": np.zeros(8 << 20, np.uint8)})  # 8 MiB over TCP
        repo.put("small@1", {"w": np.ones(1000, np.uint8)})  # the next request reconnects
        assert repo.get("small@1")["w"].sum() == 1000
