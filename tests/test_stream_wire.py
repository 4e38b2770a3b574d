"""deepfreeze.stream.wire: the per-rank stream server and its client, with real processes.

The producer (a SlotRing in /dev/shm + RankServer) runs in a spawned process driven through a pipe;
the test process (and, where said, other spawned processes) is the consumer."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import statistics
import struct
import threading
import time

import numpy as np
import pytest

from deepfreeze import net
from deepfreeze.errors import AuthenticationError, ConfigError, StreamError, StreamTimeoutError, VersionGoneError
from deepfreeze.format import crc32
from deepfreeze.node import node_id
from deepfreeze.lease import RunInfo, Version
from deepfreeze.stream.slots import SlotRing
from deepfreeze.stream.wire import RankClient, RankServer, ready_note

TOKEN = "t" * 64
CHANNEL = "nt3"
RUN = "0123456789abcdef"


def pattern(version: Version, rank: int, nbytes: int) -> np.ndarray:
    """Each (version, rank) has its own bytes."""
    return np.random.default_rng([version.generation, version.step, rank]).integers(0, 256, nbytes, np.uint8)


def _producer_main(conn, path: str, rank: int, world: int, capacity: int, slots: int, opts: dict) -> None:
    ring = SlotRing.create(path, capacity, slots)
    server = RankServer(ring, channel=CHANNEL, rank=rank, world=world, run=RunInfo(RUN, 0), token=TOKEN,
                        **opts)
    conn.send(("ready", server.address, os.getpid()))
    while True:
        cmd, *args = conn.recv()
        if cmd == "publish":  # write the version completely, then notify
            g, s, n = args
            v = Version(g, s)
            data = pattern(v, rank, n)
            slot = ring.write(v, data)
            if slot is not None:
                server.notify(ready_note(v, n, crc32(data)))
            conn.send(("ok", slot))
        elif cmd == "write_latest":  # write (n None: nothing), then notify_latest()
            g, s, n = args
            if n is not None:
                ring.write(Version(g, s), pattern(Version(g, s), rank, n))
            conn.send(("ok", server.notify_latest()))
        elif cmd == "flood":  # notify n (padded) notes with a gap, never waiting for a subscriber
            n, gap, pad = args
            worst = 0.0
            for i in range(n):
                t0 = time.perf_counter()
                server.notify(ready_note(Version(1, i), 0, 0, pad="x" * pad))
                worst = max(worst, time.perf_counter() - t0)
                time.sleep(gap)
            conn.send(("ok", worst))
        elif cmd == "latency":  # n small versions, each complete before its note
            n, gap, start, busy = args
            done = threading.Event()

            def spin() -> None:  # a thread of pure Python: it holds the GIL but for the switch interval
                x = 0
                while not done.is_set():
                    x += 1

            spinner = threading.Thread(target=spin, daemon=True)
            if busy:
                spinner.start()
            for i in range(n):
                v = Version(0, start + i)
                data = pattern(v, rank, 4096)
                ring.write(v, data)
                server.notify(ready_note(v, 4096, crc32(data)))
                time.sleep(gap)
            done.set()
            conn.send(("ok", None))
        elif cmd == "stats":
            conn.send(("ok", {"subscribers": server.subscribers, "bytes_sent": server.bytes_sent,
                              "connections": server.connections, "skipped": ring.skipped,
                              "stalled_copies": server.stalled_copies, "threads": threading.active_count(),
                              "pending": server._acceptor.pending, "unauthenticated_closed": server._acceptor.dropped}))
        elif cmd == "close":
            server.close()
            ring.close()
            conn.send(("ok", [t.name for t in threading.enumerate() if t.name.startswith("deepfreeze-stream")]))
            return


class Producer:
    count = 0

    def __init__(self, rank: int = 0, world: int = 1, capacity: int = 1 << 20, slots: int = 4, **opts) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        Producer.count += 1
        self.path = f"/dev/shm/deepfreeze-test-wire-{os.getpid()}-{Producer.count}"
        self.proc = ctx.Process(target=_producer_main, args=(child, self.path, rank, world, capacity, slots, opts),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            raise RuntimeError("the producer process did not start")
        _, self.address, self.pid = self.conn.recv()
        self.rank = rank

    def call(self, *cmd, timeout: float = 60):
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise RuntimeError(f"the producer did not answer {cmd[0]!r}")
        status, value = self.conn.recv()
        assert status == "ok"
        return value

    def publish(self, g: int, s: int, n: int) -> int | None:
        return self.call("publish", g, s, n)

    def stats(self) -> dict:
        return self.call("stats")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        os.kill(self.pid, sig)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.pid, signal.SIGCONT)
            except OSError:
                pass
            self.proc.kill()
        self.proc.join(10)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


@pytest.fixture
def producers():
    made: list[Producer] = []

    def make(**kw) -> Producer:
        p = Producer(**kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.stop()


def _wait_for(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# ----------------------------------------------------------------------------- tests

def test_token_channel_and_run_are_checked(producers):
    p = producers()
    with pytest.raises(AuthenticationError, match="token"):
        RankClient(p.address, "wrong-token", channel=CHANNEL, timeout=10)
    with pytest.raises(StreamError, match="publishes channel 'nt3'"):
        RankClient(p.address, TOKEN, channel="other", timeout=10)
    with pytest.raises(StreamError, match="run"):
        RankClient(p.address, TOKEN, channel=CHANNEL, run="ffffffffffffffff", timeout=10)
    with RankClient(p.address, TOKEN, channel=CHANNEL, run=RUN, timeout=10) as c:  # the server still serves
        assert (c.hello["rank"], c.hello["world"], c.hello["run"], c.hello["channel"]) == (0, 1, RUN, CHANNEL)
        assert c.hello["capacity"] == 1 << 20 and c.hello["node"] == node_id()


def test_notification_after_data_complete_and_fetch_bit_exact(producers):
    p = producers(capacity=1 << 22)
    sub = RankClient(p.address, TOKEN, channel=CHANNEL, subscribe=True, timeout=10)
    assert sub.next_note(0.2) is None  # nothing published: no catch-up note, no note
    out = np.empty(1 << 22, np.uint8)
    for step, n in [(10, 3_000_001), (20, 1), (30, 0), (40, 1 << 22)]:
        p.publish(0, step, n)
        note = sub.next_note(30)
        v = Version(note["generation"], note["step"])
        assert v == Version(0, step) and note["nbytes"] == n and note["op"] == "ready"
        assert (note["channel"], note["run"], note["rank"], note["world"]) == (CHANNEL, RUN, 0, 1)
        assert note["crc"] == crc32(pattern(v, 0, n))
        # the note came after the data was complete: that exact version is there, bit for bit
        got, nbytes, crc = sub.fetch(v, out)
        assert (got, nbytes, crc) == (v, n, note["crc"])
        assert np.array_equal(out[:n], pattern(v, 0, n))
    # several gets on one connection; None = the newest; a version no longer held: VersionGoneError
    for _ in range(3):
        assert sub.fetch(None, out)[0] == Version(0, 40)
    for step in (50, 60, 70, 80):
        p.publish(0, step, 100)
    with pytest.raises(VersionGoneError):
        sub.fetch(Version(0, 10), out)
    assert sub.fetch(Version(0, 80), out)[:2] == (Version(0, 80), 100)  # the connection goes on
    sub.close()


def test_catch_up_note_at_subscribe(producers):
    p = producers()
    for step in (1, 2, 3):
        p.publish(2, step, 1000)
    with RankClient(p.address, TOKEN, channel=CHANNEL, subscribe=True, timeout=10) as sub:
        note = sub.next_note(30)
        assert (note["generation"], note["step"], note["nbytes"]) == (2, 3, 1000) and note["catchup"] is True
        assert sub.next_note(0.2) is None  # once
        p.publish(3, 0, 10)  # a new generation is newer
        note = sub.next_note(30)
        assert (note["generation"], note["step"]) == (3, 0) and "catchup" not in note


def test_notify_latest_names_the_complete_newest_version_once(producers):
    p = producers()
    with RankClient(p.address, TOKEN, channel=CHANNEL, subscribe=True, timeout=10) as sub:
        assert p.call("write_latest", 0, 0, None) is None  # an empty ring: nothing to announce
        sent = p.call("write_latest", 0, 5, 77)
        note = sub.next_note(30)
        assert note == sent and (note["step"], note["nbytes"]) == (5, 77)
        assert note["crc"] == crc32(pattern(Version(0, 5), 0, 77))
        assert p.call("write_latest", 0, 0, None)["step"] == 5  # the same version again ...
        assert sub.next_note(0.3) is None  # ... is not announced twice
        assert p.call("write_latest", 0, 6, 1)["step"] == 6
        assert sub.next_note(30)["step"] == 6


def test_fetch_into_a_small_buffer_is_refused_before_reading(producers):
    p = producers()
    p.publish(0, 1, 5000)
    with RankClient(p.address, TOKEN, channel=CHANNEL, timeout=10) as c:
        small = np.full(4999, 7, np.uint8)
        with pytest.raises(StreamError, match="more than the 4999 bytes"):
            c.fetch(None, small)
        assert (small == 7).all()
        with pytest.raises(ValueError, match="writable"):
            c.fetch(None, bytes(5000))
        out = bytearray(5000)  # a fresh connection after the refused payload
        assert c.fetch(Version(0, 1), out)[1] == 5000 and bytes(out) == pattern(Version(0, 1), 0, 5000).tobytes()


def test_slow_subscriber_does_not_block_notify(producers):
    p = producers(max_queue=64)
    slow = RankClient(p.address, TOKEN, channel=CHANNEL, subscribe=True, timeout=10)  # never reads
    fast = RankClient(p.address, TOKEN, channel=CHANNEL, subscribe=True, timeout=10)
    _wait_for(lambda: p.stats()["subscribers"] == 2)
    got: list[int] = []

    def read() -> None:
        while True:
            note = fast.next_note(30)
            got.append(note["step"])
            if note["step"] == 399:
                return

    reader = threading.Thread(target=read)
    reader.start()
    worst = p.call("flood", 400, 0.002, 100_000)  # 400 notes of ~100 KB: far over the socket buffers
    reader.join(60)
    assert got == list(range(400))  # the fast one got every note, in order
    assert p.stats()["subscribers"] == 1  # the slow one was dropped, not waited for
    print(f"\nslowest notify() during the flood: {worst * 1e3:.3f} ms")
    with pytest.raises(StreamError):  # the dropped one sees the end, after what was buffered
        while True:
            slow.next_note(30)
    slow.close()
    fast.close()


def _subscriber(address: str, started) -> None:
    """Subscribes, then waits to be killed."""
    sub = RankClient(address, TOKEN, channel=CHANNEL, subscribe=True, timeout=10)
    started.set()
    time.sleep(600)
    sub.close()


def test_killed_subscriber_is_forgotten(producers):
    p = producers()
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    proc = ctx.Process(target=_subscriber, args=(p.address, started), daemon=True)
    proc.start()
    assert started.wait(60)
    assert p.stats()["subscribers"] == 1
    proc.kill()
    proc.join(10)
    _wait_for(lambda: p.stats()["subscribers"] == 0)  # its thread saw the connection end
    for step in range(1, 4):
        assert p.publish(0, step, 10) is not None  # notify() goes on


def test_killed_server_gives_bounded_errors(producers):
    p = producers()
    p.publish(0, 1, 100)
    sub = RankClient(p.address, TOKEN, channel=CHANNEL, subscribe=True, timeout=2)
    assert sub.next_note(30)["step"] == 1
    p.kill(signal.SIGSTOP)  # hung: requests time out
    try:
        with pytest.raises(StreamTimeoutError):
            sub.fetch(None, np.empty(100, np.uint8))
        assert sub.next_note(0.2) is None  # silence is not an error
    finally:
        p.kill(signal.SIGCONT)
    p.kill(signal.SIGKILL)  # gone: EOF on the notification socket, refused connections
    with pytest.raises(StreamError, match="closed the connection"):
        sub.next_note(30)
    p.proc.join(30)
    with pytest.raises(StreamError, match="cannot connect"):
        sub.fetch(None, np.empty(100, np.uint8))
    with pytest.raises(StreamError, match="cannot connect"):
        RankClient(p.address, TOKEN, channel=CHANNEL, timeout=2)


def _greedy_consumer(address: str, started) -> None:
    """Asks for the newest version, takes the reply header and nothing more (killed by the test)."""
    raw = net.connect(address, 10)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock, _ = net.client_handshake(raw, TOKEN, {"op": "hello", "channel": CHANNEL}, deadline=time.monotonic() + 10)
    net.send_msg(sock, {"op": "get", "generation": None, "step": None}, deadline=time.monotonic() + 10)
    net.recv_msg(sock, max_payload=1 << 30, deadline=time.monotonic() + 10)  # sent from the pinned slot
    started.set()
    time.sleep(600)


def test_consumer_killed_mid_fetch_releases_the_slot(producers):
    p = producers(capacity=32 << 20, slots=3)
    p.publish(0, 1, 32 << 20)  # far more than the socket buffers hold
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    proc = ctx.Process(target=_greedy_consumer, args=(p.address, started), daemon=True)
    proc.start()
    out = np.empty(32 << 20, np.uint8)
    with RankClient(p.address, TOKEN, channel=CHANNEL, timeout=10) as c:
        try:
            assert started.wait(60)
            for step in range(2, 8):  # the writer goes on in the two other slots ...
                assert p.publish(0, step, 1000) is not None
            assert c.fetch(Version(0, 1), out)[1] == 32 << 20  # ... and never takes the pinned one
        finally:
            proc.kill()
            proc.join(10)
        deadline = time.monotonic() + 30
        while True:  # the failed send released the pin: the next writes may take that slot
            p.publish(0, step := step + 1, 1000)
            try:
                c.fetch(Version(0, 1), out)
            except VersionGoneError:
                break
            assert time.monotonic() < deadline, "version 1 stayed pinned after its reader was killed"
            time.sleep(0.05)
        assert p.stats()["skipped"] == 0
        assert c.fetch(None, out)[0] == Version(0, step)


def test_hostile_requests_are_refused_and_the_server_goes_on(producers):
    p = producers()
    p.publish(0, 1, 10)

    def hello() -> net.Channel:
        s = net.connect(p.address, 10)
        return net.client_handshake(s, TOKEN, {"op": "hello", "channel": CHANNEL}, deadline=time.monotonic() + 10)[0]

    def closed(s: net.Channel) -> bool:
        s.sock.settimeout(10)
        try:
            while True:
                if not s.sock.recv(1 << 16):
                    return True
        except ConnectionResetError:
            return True

    s = hello()  # a header of 2**31 bytes announced
    s.sock.sendall(struct.pack("<4sHHIQ", net.MAGIC, net.VERSION, 1, 1 << 31, 0))
    assert closed(s)
    s = hello()  # a request with a payload
    raw = b'{"op":"get"}'
    with contextlib.suppress(ConnectionResetError):  # the server may close before the payload is sent
        s.sock.sendall(struct.pack("<4sHHIQ", net.MAGIC, net.VERSION, 1, len(raw), 100) + raw + b"x" * 100)
    assert closed(s)
    s = hello()  # bad arguments and unknown ops: an error answer, and the connection goes on
    for req in ({"op": "get", "generation": -1, "step": 0}, {"op": "get", "generation": 0},
                {"op": "get", "generation": "0", "step": 1}, {"op": "delete"}):
        net.send_msg(s, req, deadline=time.monotonic() + 10)
        rep = net.recv_msg(s, max_payload=0, deadline=time.monotonic() + 10).header
        assert rep["ok"] is False and rep["type"] == "StreamError"
    net.send_msg(s, {"op": "get", "generation": 0, "step": 1}, deadline=time.monotonic() + 10)
    msg = net.recv_msg(s, max_payload=10, deadline=time.monotonic() + 10)
    assert msg.header["nbytes"] == 10 and msg.read(10) == pattern(Version(0, 1), 0, 10).tobytes()
    s.close()
    s = net.connect(p.address, 10)  # no hello: the first frame must be the hello
    with pytest.raises(StreamError, match="first request must be 'hello'"):
        net.client_handshake(s, TOKEN, {"op": "get"}, deadline=time.monotonic() + 10)
    s.close()
    with RankClient(p.address, TOKEN, channel=CHANNEL, timeout=10) as c:
        assert c.fetch(None, bytearray(10))[0] == Version(0, 1)


class _FakeServer:
    """A hostile 'stream server' in a thread: answers the hello with `hello`, then every request
    with `reply` (header, announced payload length, bytes actually sent)."""

    def __init__(self, hello: dict, reply: tuple[dict, int, bytes] | None = None) -> None:
        self.sock = net.listen("127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.hello, self.reply = hello, reply
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            ch, _hello = net.server_handshake(conn, TOKEN, deadline=time.monotonic() + 10)
            net.send_msg(ch, self.hello, deadline=time.monotonic() + 10)
            try:
                while True:
                    net.recv_msg(ch, deadline=time.monotonic() + 10)
                    hdr, plen, data = self.reply
                    head, mac = ch._seal_header(hdr, plen)  # a token holder: its frames are sealed, their content lies
                    mac.update(data)
                    conn.sendall(head + data + (mac.digest() if plen and len(data) == plen else b""))
                    if len(data) < plen:
                        return  # closes in the middle of the payload
            except Exception:
                return

    def close(self) -> None:
        self.sock.close()


GOOD_HELLO = {"ok": True, "rank": 0, "world": 1, "run": RUN, "generation": 0, "channel": CHANNEL, "capacity": 1024}


@pytest.mark.parametrize("hello", [
    {**GOOD_HELLO, "capacity": -1}, {**GOOD_HELLO, "capacity": 1 << 60}, {**GOOD_HELLO, "rank": 1},
    {**GOOD_HELLO, "world": "1"}, {**GOOD_HELLO, "channel": "other"}, {k: v for k, v in GOOD_HELLO.items() if k != "run"}])
def test_hostile_hello_is_refused(hello):
    fake = _FakeServer(hello)
    with pytest.raises(StreamError, match="hello"):
        RankClient(fake.address, TOKEN, channel=CHANNEL, timeout=5)
    fake.close()


@pytest.mark.parametrize("reply, match", [
    (({"ok": True, "generation": 0, "step": 1, "nbytes": 1 << 40, "crc": 0}, 1 << 40, b""), "over the limit of 1024"),
    (({"ok": True, "generation": 0, "step": 1, "nbytes": 100, "crc": 0}, 10, b"x" * 10), "malformed"),
    (({"ok": True, "generation": 0, "step": 1, "nbytes": 10, "crc": 0}, 10, b"x" * 10), "CRC32"),
    (({"ok": True, "generation": 0, "step": 2, "nbytes": 0, "crc": 0}, 0, b""), "for a request of"),
    (({"ok": True, "generation": 0, "step": 1, "nbytes": 10, "crc": crc32(b"x" * 10)}, 10, b"x" * 3),
     "closed the connection"),
])
def test_hostile_get_replies_are_refused(reply, match):
    fake = _FakeServer(GOOD_HELLO, reply)
    with RankClient(fake.address, TOKEN, channel=CHANNEL, timeout=5) as c:
        out = np.zeros(2048, np.uint8)
        with pytest.raises(StreamError, match=match):
            c.fetch(Version(0, 1), out)
    fake.close()


def test_each_rank_sends_its_own_bytes(producers):
    sizes = [3_000_000, 1_000_000]
    ps = [producers(rank=r, world=2, capacity=4 << 20) for r in range(2)]
    for p, n in zip(ps, sizes):
        p.publish(0, 5, n)
    clients = [RankClient(p.address, TOKEN, channel=CHANNEL, timeout=10) for p in ps]
    whole = np.empty(sum(sizes), np.uint8)
    pos = 0
    for c, n in zip(clients, sizes):
        assert c.hello["rank"] == clients.index(c) and c.hello["world"] == 2
        assert c.fetch(Version(0, 5), whole[pos:pos + n])[1] == n
        pos += n
    assert np.array_equal(whole, np.concatenate([pattern(Version(0, 5), r, n) for r, n in enumerate(sizes)]))
    assert [p.stats()["bytes_sent"] for p in ps] == sizes  # no funnel: each rank served its own shard
    for c in clients:
        c.close()


def test_close_ends_threads_and_subscribers(producers):
    p = producers()
    sub = RankClient(p.address, TOKEN, channel=CHANNEL, subscribe=True, timeout=10)
    data = RankClient(p.address, TOKEN, channel=CHANNEL, timeout=10)
    _wait_for(lambda: p.stats()["connections"] == 2)
    assert p.call("close") == []  # every deepfreeze-stream thread ended
    with pytest.raises(StreamError):
        sub.next_note(30)
    with pytest.raises(StreamError):
        data.fetch(None, bytearray(10))
    sub.close()
    data.close()


@pytest.mark.parametrize("busy", [False, True], ids=["idle-producer", "producer-python-thread-busy"])
def test_notification_latency(producers, busy):
    """Prints the median push latency (producer's time.time() in the note -> consumer wakes up)
    and the consumer's CPU share while it waits; never asserted. ``busy``: another producer
    thread runs pure Python all the time (the worst case for the GIL handoff to the sender)."""
    p = producers()
    n = 200
    with RankClient(p.address, TOKEN, channel=CHANNEL, subscribe=True, timeout=10) as sub:
        _wait_for(lambda: p.stats()["subscribers"] == 1)
        p.conn.send(("latency", n, 0.005, 1, busy))
        lat = []
        cpu0, wall0 = time.process_time(), time.monotonic()
        while len(lat) < n:
            note = sub.next_note(30)
            lat.append(time.time() - note["t"])
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        assert p.conn.poll(30) and p.conn.recv()[0] == "ok"
        cpu0, wall0 = time.process_time(), time.monotonic()
        assert sub.next_note(1.0) is None  # nothing published: blocked in poll
        idle = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    lat.sort()
    print(f"\nnotification latency over {n} notes ({'a producer thread busy in Python' if busy else 'idle producer'}):"
          f" median {statistics.median(lat) * 1e6:.0f} us, "
          f"p90 {lat[int(0.9 * n)] * 1e6:.0f} us, max {lat[-1] * 1e6:.0f} us; "
          f"consumer CPU {100 * cpu / wall:.1f} % of one core while receiving 200 notes/s, "
          f"{100 * idle:.2f} % while waiting with none")


def test_listen_address_and_advertised_address(tmp_path):
    ring = SlotRing.create(str(tmp_path / "ring"), 4096, 3)
    try:
        with pytest.raises(ConfigError, match="allow_remote"):
            RankServer(ring, channel=CHANNEL, rank=0, world=1, run=RunInfo(RUN), token=TOKEN, host="0.0.0.0")
        with RankServer(ring, channel=CHANNEL, rank=0, world=1, run=RunInfo(RUN), token=TOKEN, host="0.0.0.0",
                        allow_remote=True) as s:
            host, port = net.parse_address(s.address)
            assert host == socket.getfqdn() and port > 0  # a wildcard is no address to give consumers
        with RankServer(ring, channel=CHANNEL, rank=0, world=1, run=RunInfo(RUN), token=TOKEN,
                        advertise="node7.example") as s:
            assert s.address.startswith("node7.example:")
        with pytest.raises(ConfigError, match="rank"):
            RankServer(ring, channel=CHANNEL, rank=1, world=1, run=RunInfo(RUN), token=TOKEN)
    finally:
        ring.close()


def test_consumer_with_more_than_1024_descriptors(producers):
    """A process of a big framework may hold descriptors past FD_SETSIZE: poll, not select."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"the hard limit of open files is {hard}: cannot open 1300 descriptors")
    p = producers()
    p.publish(0, 3, 10)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1300) if hard == resource.RLIM_INFINITY
                                                else min(max(soft, 1300), hard), hard))
    fds = []
    try:
        while len(fds) < 1100:
            fds.append(os.open(os.devnull, os.O_RDONLY))
        with RankClient(p.address, TOKEN, channel=CHANNEL, subscribe=True, timeout=10) as sub:
            assert sub.fileno() > 1024
            assert sub.next_note(30)["step"] == 3
            p.publish(0, 4, 10)
            assert sub.next_note(30)["step"] == 4
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
