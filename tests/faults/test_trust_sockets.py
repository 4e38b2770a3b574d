"""Sockets and tokens (issue 23, items 2 and 3): planted servers, relays, floods, stalled readers,
racing token creators and forged Redis records, against the real stream server (a spawned
producer process), the real repository provider and a real redis-server.

Every attacker here is a process or thread of the same user that does NOT hold the token (a
planted server, a relay on the path, a flood of connections, a Redis writer), except where a
test says "token holder" (stalled readers). Another OS user's planted endpoint file is helper
B's (ownership checks), not tested here."""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import socket
import threading
import time

import numpy as np
import pytest

from deepfreeze import net
from deepfreeze.errors import (AuthenticationError, FrameAuthenticationError, ProtocolVersionError, ProviderError,
                               StreamError)
from deepfreeze.lease import Version
from deepfreeze.stream.wire import DEFAULT_HANDSHAKE_TIMEOUT, RankClient

import test_stream_wire as _wire
from test_stream_wire import CHANNEL, TOKEN, _wait_for, pattern

producers = _wire.producers  # the fixture of the stream-wire suite (spawned producer processes)

pytestmark = pytest.mark.timeout(300)


class Recorder:
    """A planted server without the token: logs every byte it receives on every connection and
    answers the handshake with a forged challenge (a random nonce and a random 'proof'), then,
    if the client went on, forged sealed-looking frames."""

    def __init__(self) -> None:
        self.sock = net.listen("127.0.0.1", 0)
        self.address = net.format_address(*self.sock.getsockname()[:2])
        self.received: list[bytes] = []
        self.connections = 0
        self.sock.settimeout(0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            self.connections += 1
            with conn:
                conn.settimeout(2)
                got = b""
                try:
                    got += conn.recv(1 << 16)
                    conn.sendall(net._plain({"df": "challenge", "protocol": net.VERSION,
                                             "nonce": os.urandom(32).hex(), "proof": os.urandom(32).hex()}))
                    # forged "sealed" frames: a hello answer and a note, MACed with a key it made up
                    fake = net.Channel(conn, os.urandom(32), os.urandom(32), "server")
                    conn.sendall(fake.frame({"ok": True, "rank": 0, "world": 1, "run": "f" * 16, "generation": 9,
                                             "channel": CHANNEL, "capacity": 1 << 20}))
                    while chunk := conn.recv(1 << 16):
                        got += chunk
                except OSError:
                    pass
                self.received.append(got)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def test_planted_server_receives_no_token_and_is_refused(producers):
    """The client refuses a server that cannot prove it knows the token before sending anything
    but its random nonce; nothing it received opens the real server."""
    fake = Recorder()
    try:
        for subscribe in (False, True):
            with pytest.raises(AuthenticationError, match="did not prove that it knows the token"):
                RankClient(fake.address, TOKEN, channel=CHANNEL, timeout=5, subscribe=subscribe)
        _wait_for(lambda: len(fake.received) == 2, 60)
    finally:
        fake.close()
    token_derived = {TOKEN.encode(), TOKEN.encode().hex().encode()}
    for raw in fake.received:
        assert not any(t in raw for t in token_derived)
        frame = json.loads(raw[20:])  # exactly one frame: the client's first handshake message
        assert len(raw) == 20 + int.from_bytes(raw[8:12], "little")
        assert set(frame) == {"df", "protocol", "nonce"} and frame["df"] == "auth"
    # what it got (a nonce) is worth nothing to the real server: replaying the client's opening
    # gets a fresh challenge whose proof only a token holder can answer
    p = producers()
    s = net.connect(p.address, 10)
    try:
        s.sendall(fake.received[0])
        challenge = net._recv_plain(s, time.monotonic() + 10)
        assert challenge["df"] == "challenge" and challenge["nonce"] != frame["nonce"]
        s.sendall(net._plain({"df": "proof", "proof": os.urandom(32).hex()}))
        with pytest.raises(AuthenticationError, match="token"):
            net.raise_for_reply(net._recv_plain(s, time.monotonic() + 10))
    finally:
        s.close()
    with RankClient(p.address, TOKEN, channel=CHANNEL, timeout=10) as c:  # the real server still serves
        assert c.hello["channel"] == CHANNEL


class Relay:
    """A TCP relay on the path between a client and a real server. ``tamper(direction, offset,
    data)`` may rewrite the bytes flowing (direction "down": server to client); by default it
    rewrites nothing."""

    def __init__(self, upstream: str, tamper=None) -> None:
        self.upstream, self.tamper = upstream, tamper
        self.sock = net.listen("127.0.0.1", 0)
        self.address = net.format_address(*self.sock.getsockname()[:2])
        self.sock.settimeout(0.2)
        self.stop = threading.Event()
        self.changed = 0
        threading.Thread(target=self.run, daemon=True).start()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            u = net.connect(self.upstream, 10)
            for a, b, d in ((c, u, "up"), (u, c, "down")):
                threading.Thread(target=self.pump, args=(a, b, d), daemon=True).start()

    def pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        offset = 0
        try:
            while data := src.recv(1 << 16):
                if self.tamper is not None:
                    new = self.tamper(direction, offset, bytearray(data))
                    if new != data:
                        self.changed += 1
                    data = bytes(new)
                offset += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def _flip_after(start: int):
    """Rewrite one byte of the server-to-client stream at ``start`` (inside a large payload)."""
    def tamper(direction, offset, data):
        if direction == "down" and offset <= start < offset + len(data):
            data[start - offset] ^= 0x5A
        return data
    return tamper


def test_relay_rewriting_payload_bytes_is_refused_stream(producers):
    n = 3 << 20
    p = producers(capacity=4 << 20)
    p.publish(0, 1, n)
    out = np.empty(4 << 20, np.uint8)
    honest = Relay(p.address)  # the control: a relay that changes nothing is invisible
    try:
        with RankClient(honest.address, TOKEN, channel=CHANNEL, timeout=10) as c:
            assert c.fetch(Version(0, 1), out)[1] == n
            assert np.array_equal(out[:n], pattern(Version(0, 1), 0, n))
    finally:
        honest.close()
    relay = Relay(p.address, _flip_after(1 << 20))  # well inside the payload of the first get
    try:
        with RankClient(relay.address, TOKEN, channel=CHANNEL, timeout=10) as c:
            with pytest.raises(StreamError, match="payload of frame .* failed its MAC check") as ei:
                c.fetch(Version(0, 1), out)
            assert net.is_transport_error(ei.value)
            assert isinstance(ei.value.__cause__, FrameAuthenticationError)
        assert relay.changed == 1
    finally:
        relay.close()
    with RankClient(p.address, TOKEN, channel=CHANNEL, timeout=10) as c:  # the producer goes on
        assert c.fetch(Version(0, 1), out)[1] == n


def test_relay_rewriting_a_note_header_is_refused(producers):
    """A relay that rewrites the step of a pushed note (header bytes) is refused as well."""
    p = producers()
    p.publish(0, 1, 100)

    def tamper(direction, offset, data):
        i = data.find(b'"step":2,')
        if direction == "down" and i >= 0:
            data[i + 7] = ord("9")
        return data

    relay = Relay(p.address, tamper)
    try:
        with RankClient(relay.address, TOKEN, channel=CHANNEL, subscribe=True, timeout=10) as sub:
            assert sub.next_note(30)["step"] == 1  # catch-up, untouched
            p.publish(0, 2, 100)
            with pytest.raises(StreamError, match="failed its MAC check"):
                sub.next_note(30)
        assert relay.changed == 1
    finally:
        relay.close()


def _provider_thread(tmp_path):
    from deepfreeze.repo.provider import serve
    ready, stop = [], threading.Event()
    t = threading.Thread(target=serve, args=(str(tmp_path / "repo"),), daemon=True,
                         kwargs=dict(token=TOKEN, arena_bytes=0, ready=ready.append, stop=stop))
    t.start()
    _wait_for(lambda: ready, 60)
    return ready[0], stop, t


def test_relay_rewriting_payload_bytes_is_refused_repository(tmp_path):
    from deepfreeze.repo.client import RemoteRepository
    addr, stop, t = _provider_thread(tmp_path)
    relay = Relay(addr, None)
    w = np.random.default_rng(3).standard_normal(1 << 20).astype(np.float32)  # 4 MiB
    try:
        with RemoteRepository([relay.address], token=TOKEN, staging="tcp", timeout=30) as repo:
            repo.put("m@v1", {"w": w})
            assert repo.get("m@v1")["w"].tobytes() == w.tobytes()
            seen = [0]

            def tamper(direction, offset, data):  # from now on: one byte of the next large answer
                if direction == "down":
                    if seen[0] == 0 and len(data) > 1000:
                        data[len(data) // 2] ^= 1
                        seen[0] = 1
                return data

            relay.tamper = tamper
            with pytest.raises(ProviderError, match="failed its MAC check"):
                repo.get("m@v1")
            relay.tamper = None
            assert repo.get("m@v1")["w"].tobytes() == w.tobytes()  # a fresh connection: bit-exact again
        assert relay.changed == 1
    finally:
        relay.close()
        stop.set()
        t.join(30)


def test_protocol_version_mismatch_is_a_clear_error(producers):
    p = producers()
    s = net.connect(p.address, 10)  # a DeepFreeze of protocol 1 (the token in its hello)
    try:
        s.sendall(net._plain({"op": "hello", "token": TOKEN, "channel": CHANNEL}, version=1))
        s.settimeout(10)
        raw = s.recv(1 << 16)
        reply = json.loads(raw[20:])
        assert int.from_bytes(raw[4:6], "little") == 1  # in the old client's own frame version
        assert reply["ok"] is False and "version 2" in reply["error"] and "client 1" in reply["error"]
    finally:
        s.close()
    old = net.listen("127.0.0.1", 0)  # a protocol-1 server: closes at a frame version it does not know

    def serve_old():
        c, _ = old.accept()
        with c:
            c.recv(1 << 16)

    t = threading.Thread(target=serve_old, daemon=True)
    t.start()
    with pytest.raises(StreamError, match="an older DeepFreeze there"):
        RankClient(net.format_address(*old.getsockname()[:2]), TOKEN, channel=CHANNEL, timeout=10)
    t.join(10)
    old.close()
    s = net.connect(p.address, 10)  # a later protocol: the server names both versions
    try:
        s.sendall(net._plain({"df": "auth", "protocol": 3, "nonce": "00" * 32}, version=3))
        with pytest.raises(ProtocolVersionError, match="version 3, this side 2"):
            net._recv_plain(s, time.monotonic() + 10)
    finally:
        s.close()


def _slow_loris(address: str, n: int, stop: threading.Event) -> None:
    """n connections that send a valid-looking handshake opening one byte at a time."""
    opening = net._plain({"df": "auth", "protocol": net.VERSION, "nonce": "ab" * 32})
    socks = []
    for _ in range(n):
        try:
            socks.append((net.connect(address, 10), [0]))
        except ProviderError:
            pass
    while not stop.is_set():
        for s, pos in socks:
            try:
                s.send(opening[pos[0] % len(opening):][:1])
                pos[0] += 1
            except OSError:
                pass
        stop.wait(0.2)
    for s, _ in socks:
        s.close()


def test_500_idle_and_slow_loris_connections_do_not_lock_out_a_consumer(producers):
    """The bound of issue 23: with 500 idle and 20 slow-loris connections open, a consumer that
    knows the token connects, subscribes and gets every new version within the handshake
    deadline + its io_timeout; the server keeps one thread for all unauthenticated connections."""
    io_timeout = 10.0
    bound = DEFAULT_HANDSHAKE_TIMEOUT + io_timeout
    p = producers()
    idle = []
    stop = threading.Event()
    loris = threading.Thread(target=_slow_loris, args=(p.address, 20, stop), daemon=True)
    try:
        for _ in range(500):
            idle.append(net.connect(p.address, 30))
        loris.start()
        threads = p.stats()["threads"]
        assert threads < 20, f"{threads} threads in the producer with 520 unauthenticated connections"
        sub = RankClient(p.address, TOKEN, channel=CHANNEL, subscribe=True, timeout=bound)
        data = RankClient(p.address, TOKEN, channel=CHANNEL, timeout=bound)
        out = np.empty(1 << 20, np.uint8)
        for step in range(1, 6):
            idle.append(net.connect(p.address, 30))  # and the flood goes on
            p.publish(0, step, 1000)
            note = sub.next_note(bound)
            assert note is not None and note["step"] == step, note
            assert data.fetch(Version(0, step), out)[:2] == (Version(0, step), 1000)
            assert np.array_equal(out[:1000], pattern(Version(0, step), 0, 1000))
        st = p.stats()
        assert st["pending"] <= 64 and st["unauthenticated_closed"] >= 500 - 64
        sub.close()
        data.close()
    finally:
        stop.set()
        loris.join(10)
        for s in idle:
            s.close()


def _greedy(address: str, rcvbuf: int = 4096) -> net.Channel:
    """A token holder that asks for the newest version and never reads the answer."""
    raw = net.connect(address, 10)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    ch, _ = net.client_handshake(raw, TOKEN, {"op": "hello", "channel": CHANNEL}, deadline=time.monotonic() + 10)
    net.send_msg(ch, {"op": "get", "generation": None, "step": None}, deadline=time.monotonic() + 10)
    return ch


def test_stalled_readers_cost_others_nothing(producers):
    """Three token holders that subscribe and never read, three that request a version and never
    read it (each pinning a different slot of a 4-slot ring at first), and one real consumer:
    the consumer gets every version the producer published while it was subscribed, bit-exact,
    counted against the producer's own record, and no write is skipped once the stalled
    requests have been moved off their slots."""
    n = 8 << 20  # more than the socket buffers hold: the stalled sends block
    p = producers(capacity=n, slots=4)
    lazy_subs = [RankClient(p.address, TOKEN, channel=CHANNEL, subscribe=True, timeout=10) for _ in range(3)]
    for s in lazy_subs:
        s.sock.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    real = RankClient(p.address, TOKEN, channel=CHANNEL, subscribe=True, timeout=30)
    greedy = []
    for step in (1, 2, 3):  # each asks for the newest: three different slots
        assert p.publish(0, step, n) is not None
        greedy.append(_greedy(p.address))
        _wait_for(lambda: p.stats()["stalled_copies"] == step, 60)  # its pin released after PIN_TIMEOUT
    skipped0 = p.stats()["skipped"]
    published, got = [1, 2, 3], []
    out = np.empty(n, np.uint8)
    try:
        while got != [1, 2, 3]:  # the first three, from the notes that were waiting
            note = real.next_note(30)
            v = Version(note["generation"], note["step"])
            assert real.fetch(v, out)[0] == v
            got.append(v.step)
        for step in range(4, 24):
            if p.publish(0, step, n) is not None:
                published.append(step)
            note = real.next_note(30)
            v = Version(note["generation"], note["step"])
            got.append(v.step)
            assert real.fetch(v, out)[:2] == (v, n)  # CRC-checked against the producer's, MAC-checked
            if step % 5 == 0:
                assert np.array_equal(out, pattern(v, 0, n))
        assert got == published == list(range(1, 24))
        assert p.stats()["skipped"] == skipped0 == 0
    finally:
        for c in greedy:
            c.close()
        for s in lazy_subs:
            s.close()
        real.close()


def _creator(path: str, go, out_dir: str, i: int) -> None:
    go.wait(60)
    try:
        result = {"token": net.ensure_token(path)}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(e).__name__}: {e}"}
    with open(os.path.join(out_dir, f"creator-{i}.json"), "w") as f:
        json.dump(result, f)


def _reader(path: str, go, out_dir: str, i: int) -> None:
    go.wait(60)
    seen, errors = set(), set()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        try:
            seen.add(net.load_token(path))
        except AuthenticationError as e:
            errors.add(str(e).split(":")[0][:80] if "does not exist" not in str(e) else "missing")
            if "cannot read" in str(e) or "No such file" in str(e):
                errors.discard(str(e).split(":")[0][:80])
                errors.add("missing")
    with open(os.path.join(out_dir, f"reader-{i}.json"), "w") as f:
        json.dump({"seen": sorted(seen), "errors": sorted(errors)}, f)


def test_80_concurrent_token_creators_agree_and_no_reader_sees_a_partial_file(tmp_path, monkeypatch):
    monkeypatch.delenv(net.TOKEN_ENV, raising=False)
    path = str(tmp_path / "home" / ".deepfreeze" / "token")
    out = tmp_path / "out"
    out.mkdir()
    ctx = mp.get_context("fork")  # processes, not threads; fork: 80 of them start in a moment
    go = ctx.Event()
    procs = [ctx.Process(target=_creator, args=(path, go, str(out), i)) for i in range(80)]
    procs += [ctx.Process(target=_reader, args=(path, go, str(out), i)) for i in range(4)]
    for pr in procs:
        pr.start()
    go.set()
    for pr in procs:
        pr.join(120)
        assert pr.exitcode == 0
    created = [json.loads((out / f"creator-{i}.json").read_text()) for i in range(80)]
    assert [c for c in created if "error" in c] == []
    tokens = {c["token"] for c in created}
    assert len(tokens) == 1 and tokens == {net.load_token(path)}
    for i in range(4):
        r = json.loads((out / f"reader-{i}.json").read_text())
        assert set(r["seen"]) <= tokens  # never a partial or empty token
        assert set(r["errors"]) <= {"missing"}, r["errors"]
    assert os.listdir(os.path.dirname(path)) == ["token"]  # no temporary file left behind


def test_redis_record_and_notes_without_the_token_are_ignored(tmp_path, monkeypatch, caplog):
    """Someone without the token overwrites the endpoint record in a real redis-server and
    publishes forged notes: ignored with one warning per key and cause; the consumer goes on
    getting the real producer's versions, bit-exact, and never connects to the forged address."""
    pytest.importorskip("redis", reason="the redis client is not installed (pip install redis)")
    from test_stream_core import arrays_of, check, publish, publishers
    from test_stream_redis import RedisServer
    from deepfreeze.stream import Subscriber
    monkeypatch.setenv("DEEPFREEZE_TOKEN", "c" * 64)
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    fake = Recorder()
    caplog.set_level(logging.WARNING, logger="deepfreeze.stream")
    try:
        plan, pubs = publishers(tmp_path, 1, redis=server.url)
        try:
            publish(plan, pubs, Version(0, 1), arrays_of(1))
            # rescan=0.2: the consumer re-reads the registered endpoints every second while connected
            with Subscriber("chan", str(tmp_path / "p"), redis=server.url, tier="tcp", rescan=0.2) as sub:
                assert sub.next(30).version == Version(0, 1)
                prefix = "deepfreeze:stream:chan"
                rec = json.loads(server.client.hget(f"{prefix}:endpoints", "r0"))
                forged = {**rec, "address": fake.address, "mac": "00" * 32}
                server.client.hset(f"{prefix}:endpoints", "r0", json.dumps(forged))  # overwritten
                for step in range(50, 70):  # forged notes of newer versions: with a bad MAC, or none
                    note = {"op": "ready", "channel": "chan", "run": rec["run"], "rank": 0, "world": 1,
                            "generation": 0, "step": step, "nbytes": rec["nbytes"], "crc": 0, "t": time.time()}
                    if step % 2:
                        note["mac"] = "ab" * 32
                    server.client.publish(prefix, json.dumps(note))
                    server.client.hset(f"{prefix}:latest", "r0", json.dumps(note))
                # past the next check of the registered endpoints, which finds only the forged
                # record: the connection stays (it is no sign the producer went away)
                assert sub.next(1.5) is None
                for step in (2, 3):
                    full = arrays_of(step)
                    publish(plan, pubs, Version(0, step), full)
                    up = sub.next(30)
                    assert up.version == Version(0, step)
                    check(up, full)
            with Subscriber("chan", str(tmp_path / "p"), redis=server.url, tier="tcp", rescan=0.2) as late:
                assert late.next(1.5) is None  # the only record there is forged: ignored, no connection
        finally:
            for p in pubs:
                p.close()
    finally:
        fake.close()
        server.stop()
    assert fake.connections == 0
    mac_warnings = [r.getMessage() for r in caplog.records if "no valid MAC" in r.getMessage()]
    assert sum("a message on" in m for m in mac_warnings) == 1, mac_warnings  # 20 forged notes, one warning
    assert sum(":endpoints r0" in m for m in mac_warnings) >= 1
    assert len(mac_warnings) <= 4, mac_warnings  # per key and cause (and per listener), never per message
