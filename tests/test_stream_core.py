"""The stream's framework-neutral core: Publisher -> Subscriber over every tier, real threads,
sockets, shared-memory files and checkpoint files (no TensorFlow; also runs under numpy 2)."""
import json
import os
import stat
import time

import numpy as np
import pytest

from deepfreeze.errors import ConfigError
from deepfreeze.fused import FusedLayout, FusedShard
from deepfreeze.lease import RunInfo, Version
from deepfreeze.shardplan import ShardPlan, TensorSpec
from deepfreeze.stream import Publisher, StreamOptions, Subscriber, read_endpoints
from deepfreeze.stream.core import endpoint_dir, model_prefix

SPECS = [TensorSpec(0, "w", "float32", (300, 70)), TensorSpec(1, "b", "float16", (70,)),
         TensorSpec(2, "k", "int64", (5, 3)), TensorSpec(3, "w/momentum", "float32", (300, 70))]
MODEL = 3  # the first three tensors are the model's weights; the last is optimizer state


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv("DEEPFREEZE_TOKEN", "c" * 64)
    return "c" * 64


def arrays_of(step, rank_seed=0):
    rng = np.random.default_rng(step * 7 + rank_seed)
    out = []
    for s in SPECS:
        if s.dtype.startswith("int"):
            out.append(rng.integers(-1000, 1000, s.shape).astype(s.dtype))
        else:
            out.append(rng.standard_normal(s.shape).astype(s.dtype))
    return out


def shard_of(plan, rank, full):
    lay = FusedLayout.build(plan, rank)
    pieces = [full[s.piece.tensor_id].reshape(-1)[s.piece.start:s.piece.stop] for s in lay.segments]
    return FusedShard.from_arrays(lay, pieces, 0)


def publishers(tmp_path, world, run="ab" * 8, generation=0, **opt):
    plan = ShardPlan.build(SPECS, world, min_shard_bytes=0)
    opts = StreamOptions(shm_dir=str(tmp_path / "shm"), **opt)
    os.makedirs(opts.shm_dir, exist_ok=True)
    return plan, [Publisher("chan", str(tmp_path / "p"), rank=r, world=world, run=RunInfo(run, generation),
                            plan=plan, model_tensors=MODEL, options=opts) for r in range(world)]


def publish(plan, pubs, version, full):
    for r, p in enumerate(pubs):
        p.publish(version, shard_of(plan, r, full))
    for p in pubs:
        p.wait(30)


def check(update, full):
    assert list(update.arrays) == [s.name for s in SPECS[:MODEL]]
    for s in SPECS[:MODEL]:
        got = update.arrays[s.name]
        assert got.dtype == full[s.id].dtype and got.shape == full[s.id].shape
        assert got.tobytes() == full[s.id].tobytes()


@pytest.mark.parametrize("tier", ["shm", "tcp"])
@pytest.mark.parametrize("world", [1, 3])
def test_every_version_arrives_bit_exact(tmp_path, token, tier, world):
    plan, pubs = publishers(tmp_path, world)
    sub = Subscriber("chan", str(tmp_path / "p"), tier=tier)
    try:
        for step in (2, 4, 9):
            full = arrays_of(step)
            publish(plan, pubs, Version(0, step), full)
            up = sub.next(30)
            assert up is not None and up.version == Version(0, step)
            assert up.tier == tier
            check(up, full)
        if tier == "tcp":  # no funnel: each rank sent exactly its own shard's model bytes, per version
            model_bytes = sum(s.nbytes for s in SPECS[:MODEL])
            for p in pubs:
                deadline = time.monotonic() + 10  # the server counts a payload once its send returned
                while p.bytes_sent < 3 * p.prefix and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert p.bytes_sent == 3 * p.prefix
                assert p.prefix <= model_bytes / world + 4096  # its share (plus alignment), not the whole model
        assert sub.next(0.3) is None  # nothing newer
    finally:
        sub.close()
        for p in pubs:
            p.close()
    assert not os.listdir(tmp_path / "shm")  # rings removed on close
    assert read_endpoints(str(tmp_path / "p"), "chan") == {}


def test_consumer_that_falls_behind_skips_to_the_newest(tmp_path, token):
    plan, pubs = publishers(tmp_path, 2)
    sub = Subscriber("chan", str(tmp_path / "p"))
    try:
        publish(plan, pubs, Version(0, 1), arrays_of(1))
        assert sub.next(30).version == Version(0, 1)
        for step in range(2, 8):
            full = arrays_of(step)
            publish(plan, pubs, Version(0, step), full)
        time.sleep(0.5)  # every notification arrives
        up = sub.next(30)
        assert up.version == Version(0, 7)  # 2..6 skipped
        check(up, full)
    finally:
        sub.close()
        for p in pubs:
            p.close()


def test_a_consumer_that_starts_late_catches_up(tmp_path, token):
    plan, pubs = publishers(tmp_path, 2)
    try:
        for step in (3, 5):
            full = arrays_of(step)
            publish(plan, pubs, Version(0, step), full)
        with Subscriber("chan", str(tmp_path / "p")) as sub:
            up = sub.next(30)
            assert up.version == Version(0, 5)
            check(up, full)
    finally:
        for p in pubs:
            p.close()


def test_handing_over_faster_than_the_copy_coalesces_and_never_blocks(tmp_path, token):
    plan, pubs = publishers(tmp_path, 1)
    p = pubs[0]
    try:
        shards = [shard_of(plan, 0, arrays_of(s)) for s in range(1, 41)]
        for s, sh in enumerate(shards, 1):
            p.publish(Version(0, s), sh)
        p.wait(30)
        assert p.published[-1] == Version(0, 40)
        assert len(p.published) + p.coalesced == 40
        with Subscriber("chan", str(tmp_path / "p")) as sub:
            check(sub.next(30), arrays_of(40))
        with pytest.raises(ConfigError):
            p.publish(Version(0, 40), shards[-1])  # versions grow
    finally:
        p.close()


def test_a_new_generation_is_followed(tmp_path, token):
    plan, pubs = publishers(tmp_path, 1, run="a1" * 8)
    sub = Subscriber("chan", str(tmp_path / "p"), rescan=0.1)
    try:
        publish(plan, pubs, Version(0, 50), arrays_of(50))
        assert sub.next(30).version == Version(0, 50)
        pubs[0].close()
        plan, pubs = publishers(tmp_path, 1, run="b2" * 8, generation=1)  # overwrite: steps restart
        full = arrays_of(3)
        publish(plan, pubs, Version(1, 3), full)
        up = sub.next(30)
        assert up.version == Version(1, 3)
        check(up, full)
    finally:
        sub.close()
        for p in pubs:
            p.close()


@pytest.mark.parametrize("where", ["files", "redis"])
def test_a_new_run_replacing_a_silent_one_is_followed(tmp_path, token, where):
    """Run A stays open but goes silent (as a producer whose node vanished: no connection of the
    consumer ever fails); run B of the same channel starts and its records replace A's. The
    consumer, connected to A, follows B from its next version (it re-reads the registered
    endpoints every 5 x rescan while waiting; with Redis at once on B's note). Before, it stayed
    on A until a connection failed (files: TCP keepalive, minutes across nodes; Redis: never).
    tests/cluster/test_cluster_siblings.py does it across real nodes."""
    server = None
    opts = {}
    if where == "redis":
        pytest.importorskip("redis", reason="the redis client is not installed (pip install redis)")
        from test_stream_redis import RedisServer
        (tmp_path / "redis").mkdir()
        server = RedisServer(tmp_path / "redis")
        opts = {"redis": server.url}
    plan, pubs_a = publishers(tmp_path, 1, run="a1" * 8, **opts)
    pubs_b = []
    sub = Subscriber("chan", str(tmp_path / "p"), rescan=0.1, **opts)
    try:
        publish(plan, pubs_a, Version(0, 5), arrays_of(5))
        assert sub.next(30).version == Version(0, 5)
        plan, pubs_b = publishers(tmp_path, 1, run="b2" * 8, **opts)  # resumed: same generation, later steps
        full = arrays_of(9)
        publish(plan, pubs_b, Version(0, 9), full)
        up = sub.next(30)
        assert up is not None and up.version == Version(0, 9)
        check(up, full)
    finally:
        sub.close()
        for p in pubs_a + pubs_b:
            p.close()
        if server is not None:
            server.stop()


def test_endpoint_files_are_private_and_hostile_ones_are_skipped(tmp_path, token):
    plan, pubs = publishers(tmp_path, 2)
    d = endpoint_dir(str(tmp_path / "p"), "chan")
    try:
        for r in range(2):
            st = os.stat(os.path.join(d, f"r{r}.json"))
            assert stat.S_IMODE(st.st_mode) == 0o600
        assert stat.S_IMODE(os.stat(pubs[0].ring_path).st_mode) == 0o600
        with open(os.path.join(d, "r7.json"), "w") as f:  # garbage from someone else
            f.write("{not json")
        rec = json.load(open(os.path.join(d, "r0.json")))
        rec.update(run="ff" * 8, world=2, rank=1, plan={"pieces": "nonsense"})
        with open(os.path.join(d, "r9.json"), "w") as f:  # a plausible record with a malformed plan
            json.dump(dict(rec, rank=5), f)
        eps = read_endpoints(str(tmp_path / "p"), "chan")
        assert set(eps) == {"ab" * 8}  # the bad rank (5 >= world) is refused
        full = arrays_of(4)
        publish(plan, pubs, Version(0, 4), full)
        with Subscriber("chan", str(tmp_path / "p")) as sub:
            check(sub.next(30), full)
    finally:
        for p in pubs:
            p.close()


def test_wrong_token_is_refused(tmp_path, token, monkeypatch):
    plan, pubs = publishers(tmp_path, 1)
    try:
        publish(plan, pubs, Version(0, 1), arrays_of(1))
        monkeypatch.setenv("DEEPFREEZE_TOKEN", "d" * 64)
        with Subscriber("chan", str(tmp_path / "p"), tier="tcp", rescan=0.1) as sub:
            assert sub.next(1.0) is None  # refused (logged), no version, no hang
    finally:
        for p in pubs:
            p.close()


def test_options_are_validated():
    with pytest.raises(ConfigError):
        StreamOptions(slots=2)
    with pytest.raises(ConfigError):
        StreamOptions(host="0.0.0.0")
    StreamOptions(host="0.0.0.0", allow_remote=True)
    with pytest.raises(ConfigError):
        Subscriber("chan", "/nonexistent", tier="carrier-pigeon")


def test_model_prefix_is_the_model_part_of_every_rank(tmp_path):
    plan = ShardPlan.build(SPECS, 3, min_shard_bytes=0)
    total = 0
    for r in range(3):
        lay = FusedLayout.build(plan, r)
        n = model_prefix(lay, MODEL)
        assert all(s.offset + s.nbytes - 4096 <= n for s in lay.segments if s.piece.tensor_id < MODEL)
        total += sum(s.nbytes for s in lay.segments if s.piece.tensor_id < MODEL)
    assert total == sum(s.nbytes for s in SPECS[:MODEL])


def test_persistent_fallback_without_a_producer(tmp_path, write_once):
    """No producer endpoint: the newest committed checkpoint of the channel is served, on both write
    paths of the checkpoint (the write_once fixture)."""
    from deepfreeze.config import Config
    from deepfreeze.engine import Engine
    cfg = Config.load(None, mode="sync", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    plan = ShardPlan.build(SPECS, 1, min_shard_bytes=0)
    eng = Engine(cfg, "chan", 0, plan)
    assert eng.write_once is (write_once == "auto")
    full = arrays_of(6)
    eng.checkpoint(6, shard_of(plan, 0, full), step=6, epoch=0, extra={"model_tensors": MODEL})
    eng.close()
    with Subscriber("chan", str(tmp_path / "p"), rescan=0.1) as sub:
        up = sub.next(10)
        assert up.tier == "persistent" and up.version == Version(0, 6)
        check(up, full)
        assert sub.next(0.3) is None


def test_redis_endpoints_and_notifications(tmp_path, token):
    """With a Redis server named, consumers find the endpoints and get the notifications there
    (a real redis-server on a free port; skipped with the reason without one)."""
    pytest.importorskip("redis", reason="the redis client is not installed (pip install redis)")
    from test_stream_redis import RedisServer
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    try:
        plan, pubs = publishers(tmp_path, 2, redis=server.url)
        os.rename(endpoint_dir(str(tmp_path / "p"), "chan"), tmp_path / "hidden")  # only Redis knows them
        try:
            full = arrays_of(3)
            publish(plan, pubs, Version(0, 3), full)
            with Subscriber("chan", str(tmp_path / "p"), redis=server.url) as sub:
                up = sub.next(30)  # catch-up from Redis' latest notes
                assert up.version == Version(0, 3)
                check(up, full)
                full = arrays_of(8)
                publish(plan, pubs, Version(0, 8), full)
                up = sub.next(30)  # pushed through Redis pub/sub
                assert up.version == Version(0, 8) and up.sent_at > 0
                check(up, full)
        finally:
            for p in pubs:
                p.close()
        assert server.client.hgetall("deepfreeze:stream:chan:endpoints") == {}  # unregistered on close
    finally:
        server.stop()


def test_a_channel_nobody_publishes_is_reported_once(tmp_path, caplog):
    """No producer and no committed version: after warn_after seconds one warning names the channel
    and where the subscriber looked; it keeps looking (and quietly serves a version that appears)."""
    import logging
    caplog.set_level(logging.WARNING, logger="deepfreeze")
    with Subscriber("ghost", str(tmp_path / "p"), rescan=0.05, warn_after=0.2) as sub:
        assert sub.next(0.1) is None and not sub.nobody_publishes  # not yet: within the bounded wait
        assert sub.next(0.5) is None and sub.nobody_publishes
        assert sub.next(0.3) is None
        lines = [r.getMessage() for r in caplog.records if "nobody publishes" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "'ghost'" in lines[0] and os.path.join(str(tmp_path / "p"), "ghost", "stream") in lines[0]
        assert "committed checkpoints in" in lines[0]
        assert sub.where() in lines[0]
    with pytest.raises(ConfigError):
        Subscriber("ghost", str(tmp_path / "p"), warn_after=-1)


class _CountingSubscriber(Subscriber):
    """Counts its looks for producers (each reads the endpoint files)."""

    scans = 0

    def _endpoints(self):
        self.scans += 1
        return super()._endpoints()


def _warnings_naming(caplog, path):
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and path in r.getMessage()]


def test_an_unusable_endpoint_file_is_warned_about_once_per_path_and_cause(tmp_path, caplog, token):
    """Issue 32 case 5: an unusable endpoint was warned about at every rescan. Now once per
    (path, cause) per consumer: a new cause (the file rewritten) is one more warning."""
    import logging
    persistent = str(tmp_path / "p")
    d = endpoint_dir(persistent, "chan")
    os.makedirs(d, mode=0o700)
    os.chmod(os.path.dirname(d), 0o700)
    bad = os.path.join(d, "r0.json")
    with open(os.open(bad, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("{not json")
    with caplog.at_level(logging.WARNING, logger="deepfreeze"):
        with _CountingSubscriber("chan", persistent, tier="tcp", rescan=0.05, warn_after=1000) as sub:
            assert sub.next(1.0) is None
            assert sub.scans >= 5, sub.scans  # several rescans, each of which read the file
            assert len(_warnings_naming(caplog, bad)) == 1, _warnings_naming(caplog, bad)
            with open(bad, "w") as f:
                f.write("[]")  # valid JSON, not an endpoint: another cause
            seen = sub.scans
            assert sub.next(0.6) is None and sub.scans >= seen + 3
    msgs = _warnings_naming(caplog, bad)
    assert len(msgs) == 2 and "Expecting property name" in msgs[0] and "not a DeepFreeze stream endpoint" in msgs[1], msgs
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deepfreeze"):  # one-off calls: each one says it
        read_endpoints(persistent, "chan")
        read_endpoints(persistent, "chan")
    assert len(_warnings_naming(caplog, bad)) == 2


def test_a_planted_endpoint_directory_is_warned_about_once(tmp_path, caplog, token):
    """The probe's case: an endpoint directory of another user, warned about 6 times in 10 s."""
    import logging
    from _util import nobody_ids
    uid, gid = nobody_ids()
    persistent = str(tmp_path / "p")
    d = endpoint_dir(persistent, "chan")
    os.makedirs(d, mode=0o700)
    os.chmod(os.path.dirname(d), 0o700)
    os.chown(d, uid, gid)
    with caplog.at_level(logging.WARNING, logger="deepfreeze"):
        with _CountingSubscriber("chan", persistent, tier="tcp", rescan=0.05, warn_after=1000) as sub:
            assert sub.next(1.0) is None
            assert sub.scans >= 5, sub.scans
    msgs = _warnings_naming(caplog, d)
    assert len(msgs) == 1 and "owned by nobody" in msgs[0], msgs
