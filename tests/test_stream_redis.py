"""deepfreeze.stream.redis_notify against a real redis-server (started here on a free port)."""
from __future__ import annotations

import multiprocessing as mp
import shutil
import socket
import statistics
import subprocess
import sys
import time

import pytest

from deepfreeze.errors import ConfigError, StreamError

redis = pytest.importorskip("redis", reason="the 'redis' client package is not installed (pip install redis)")
from deepfreeze.stream.redis_notify import RedisListener, RedisNotifier, key_prefix, safe_url  # noqa: E402

REDIS_SERVER = shutil.which("redis-server")
TOKEN = "k" * 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, tmp) -> None:
        if REDIS_SERVER is None:
            pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; 'make setup' does it "
                        "when run as root)")
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen([REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(tmp)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis-server did not start on port {self.port} (exit {self.proc.poll()})")
                time.sleep(0.05)
        self.client = client

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RedisServer(tmp_path_factory.mktemp("redis"))
    yield s
    s.stop()


def _chan(request) -> str:
    return "c-" + request.node.name.replace("[", "-").replace("]", "")


def test_endpoints_register_and_unregister(server, request):
    ch = _chan(request)
    with RedisNotifier(server.url, ch, token=TOKEN) as n0, RedisNotifier(server.url, ch, token=TOKEN) as n1, \
            RedisListener(server.url, ch, token=TOKEN) as li:
        assert li.endpoints() == {}
        n0.register(0, {"address": "127.0.0.1:7000", "node": "a", "ring": "/dev/shm/x"})
        n1.register(1, {"address": "127.0.0.1:7001", "node": "a"})
        assert li.endpoints() == {0: {"address": "127.0.0.1:7000", "node": "a", "ring": "/dev/shm/x"},
                                  1: {"address": "127.0.0.1:7001", "node": "a"}}
        n1.unregister(1)
        assert list(li.endpoints()) == [0]
        with pytest.raises(ValueError):
            n0.register(-1, {})


def test_notes_are_pushed_and_latest_catches_up(server, request):
    ch = _chan(request)
    with RedisNotifier(server.url, ch, token=TOKEN) as n:
        n.notify({"op": "ready", "rank": 0, "generation": 0, "step": 1})  # before any listener
        n.notify({"op": "ready", "rank": 1, "generation": 0, "step": 1})
        with RedisListener(server.url, ch, token=TOKEN) as li:
            assert li.next_note(0.2) is None  # what came before is not replayed ...
            assert li.latest() == {0: {"op": "ready", "rank": 0, "generation": 0, "step": 1},
                                   1: {"op": "ready", "rank": 1, "generation": 0, "step": 1}}  # ... but kept
            for step in (2, 3):
                for r in (0, 1):
                    n.notify({"op": "ready", "rank": r, "generation": 0, "step": step})
            got = [li.next_note(10) for _ in range(4)]
            assert [(x["rank"], x["step"]) for x in got] == [(0, 2), (1, 2), (0, 3), (1, 3)]
            assert {r: x["step"] for r, x in li.latest().items()} == {0: 3, 1: 3}
            assert li.next_note(0.1) is None
            assert li.fileno() is not None
    with RedisListener(server.url, "another", token=TOKEN) as other:  # channels do not mix
        assert other.latest() == {} and other.next_note(0.1) is None


def test_garbage_in_redis_is_skipped(server, request):
    ch = _chan(request)
    p = key_prefix(ch)
    with RedisListener(server.url, ch, token=TOKEN) as li, RedisNotifier(server.url, ch, token=TOKEN) as n:
        n.register(2, {"address": "h:1"})
        server.client.hset(f"{p}:endpoints", mapping={"r0": "not json", "r1": "[1, 2]", "rx": "{}",
                                                      "r01": "{}", "r3": '{"address": "h:1"}'})  # r3: no MAC
        assert li.endpoints() == {2: {"address": "h:1"}}
        server.client.hset(f"{p}:latest", "r3", "x" * (2 << 20))
        assert li.latest() == {}
        for bad in (b"\xff\xfe", b"{", b"[]", b"x" * (2 << 20)):
            server.client.publish(p, bad)
        n.notify({"rank": 0, "step": 7})
        assert li.next_note(10) == {"rank": 0, "step": 7}  # the garbage before it was skipped


def test_bad_configuration_is_refused(server, monkeypatch):
    with pytest.raises(ConfigError, match="redis URL"):
        RedisNotifier("http://127.0.0.1:1", "c", token=TOKEN)
    with pytest.raises(ConfigError, match="channel"):
        RedisListener(server.url, "with space", token=TOKEN)
    with pytest.raises(StreamError, match="cannot reach the Redis server") as e:
        RedisNotifier(f"redis://user:hunter2@127.0.0.1:{_free_port()}/0", "c", timeout=2, token=TOKEN)
    assert "hunter2" not in str(e.value) and "user:***@" in str(e.value)  # no password in messages
    assert safe_url("redis://:pw@h:1/0") == "redis://:***@h:1/0" and safe_url("redis://h:1") == "redis://h:1"
    monkeypatch.setitem(sys.modules, "redis", None)  # as if the optional package were not installed
    with pytest.raises(ConfigError, match="pip install"):
        RedisListener(server.url, "c", token=TOKEN)


def test_dead_server_gives_a_bounded_error(tmp_path):
    s = RedisServer(tmp_path)
    try:
        n = RedisNotifier(s.url, "dead", timeout=2, token=TOKEN)
        li = RedisListener(s.url, "dead", timeout=2, token=TOKEN)
        n.notify({"rank": 0, "step": 1})
        assert li.next_note(10)["step"] == 1
    finally:
        s.stop()
    with pytest.raises(StreamError):
        li.next_note(30)
    with pytest.raises(StreamError):
        n.notify({"rank": 0, "step": 2})
    li.close()
    n.close()


def _publisher(url: str, channel: str, count: int, gap: float) -> None:
    with RedisNotifier(url, channel, token=TOKEN) as n:
        for i in range(count):
            n.notify({"op": "ready", "rank": 0, "generation": 0, "step": i, "t": time.time()})
            time.sleep(gap)


def test_redis_notification_latency(server, request):
    """Prints the median latency of a note from a producer process through Redis pub/sub; never asserted."""
    ch, count = _chan(request), 200
    with RedisListener(server.url, ch, token=TOKEN) as li:
        proc = mp.get_context("spawn").Process(target=_publisher, args=(server.url, ch, count, 0.005), daemon=True)
        proc.start()
        lat = []
        try:
            for i in range(count):
                note = li.next_note(60)
                assert note is not None and note["step"] == i
                lat.append(time.time() - note["t"])
        finally:
            proc.join(30)
    lat.sort()
    print(f"\nredis notification latency over {count} notes: median {statistics.median(lat) * 1e6:.0f} us, "
          f"p90 {lat[int(0.9 * count)] * 1e6:.0f} us")
