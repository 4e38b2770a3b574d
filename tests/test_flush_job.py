"""The typed flush job (:mod:`deepfreeze.tiers.job`) and the backend protocol's version (issue 43).

* :class:`FlushJob` round-trips through its encoding (JSON) for every source kind, and
  :meth:`FlushJob.decode` refuses, with :class:`CheckpointWriteError`, every field out of its bounds,
  unknown and missing keys (the fuzzed campaign: tests/fuzz/test_fuzz_decoders.py);
* the flush dispatches through the source table the tiers register into;
* a backend of another protocol gets no flush job: a real process speaking protocol 1
  (tests/workers/old_backend.py) on its own socket name is left alone while the engine's versions
  commit through a backend of this protocol; on this protocol's socket, a client that may start a
  backend replaces it, one that may not raises :class:`BackendError` naming both versions;
* the backend answers a malformed job, or a flush on a connection that said no protocol, with
  ``ok: false`` and keeps the connection.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from deepfreeze import Config
from deepfreeze.backend import PROTOCOL, BackendClient, socket_path
import deepfreeze.tiers.flush as flush_job_module
from deepfreeze.engine import Engine
from deepfreeze.errors import BackendError, CheckpointWriteError
from deepfreeze.tiers.flush import flush_job
from deepfreeze.tiers.memtier import SlotSource
from deepfreeze.tiers.persistent import PersistentLevel
from deepfreeze.tiers.job import SCRATCH, FlushJob, register, source, sources

from _util import WORKERS
from test_engine import assert_version, make_plan, model_arrays, pieces

RUN = "ab" * 8


def job(**kw) -> FlushJob:
    base = dict(name="job", version=3, rank=1, scratch="/tmp/s", persistent="/tmp/p", persistent_interval=0,
                keep_scratch=2, keep_persistent=0, manifest={"name": "job", "plan": {"x": [1, 2.5, None, True]}},
                run=RUN, lease_timeout=30, shared_group=True, watchdog_interval=5, t=12.5, interval=0.25,
                priority="normal", fsync=False)
    base.update(kw)
    return FlushJob(**base)


DEEP: list = [0]
for _ in range(40):
    DEEP = [DEEP]
SLOT = SlotSource("/dev/shm/tier", 4, 1, 3, RUN, 1)
DIRECT = {"nonce": "f" * 16, "has_crc": True, "crc32": "ewAAAAAAAAA="}  # the CRCs [123, 0]


@pytest.mark.parametrize("kind,spec", [(SCRATCH, None), ("memtier", SLOT), ("direct", DIRECT)])
def test_round_trip(kind, spec):
    j = job(source=kind, spec=spec)
    wire = json.loads(json.dumps(j.encode()))  # JSON-safe: what crosses the socket
    assert FlushJob.decode(wire) == j
    assert [k for k in ("memtier", "direct") if k in wire] == ([] if spec is None else [kind])
    assert "source" not in wire and "spec" not in wire
    # the defaults: a job of the required keys only
    req = {k: wire[k] for k in ("name", "version", "rank", "scratch", "persistent", "persistent_interval",
                                "keep_scratch", "keep_persistent", "manifest")}
    d = FlushJob.decode(req)
    assert (d.run, d.lease_timeout, d.shared_group, d.watchdog_interval, d.t, d.interval, d.priority, d.fsync,
            d.source, d.spec) == ("0" * 16, 60.0, False, 0.0, None, None, "low", True, SCRATCH, None)
    assert type(d.persistent_interval) is float and FlushJob.decode(d.encode()) == d


def _bad(obj, match):
    with pytest.raises(CheckpointWriteError, match=match) as e:
        FlushJob.decode(obj)
    assert e.value.errno == errno.EINVAL


@pytest.mark.parametrize("key,value,match", [
    ("name", "../x", "name"), ("name", "a" * 201, "name"), ("name", 7, "name"), ("name", "..", "name"),
    ("version", -1, "version"), ("version", 2 ** 63, "version"), ("version", True, "version"),
    ("version", 3.0, "version"), ("rank", 2 ** 31, "rank"), ("rank", "1", "rank"),
    ("scratch", "", "scratch"), ("scratch", "/a\x00b", "scratch"), ("persistent", "x" * 4097, "persistent"),
    ("persistent", None, "persistent"), ("persistent_interval", float("nan"), "persistent_interval"),
    ("persistent_interval", float("inf"), "persistent_interval"), ("persistent_interval", "0", "persistent_interval"),
    ("keep_scratch", -1, "keep_scratch"), ("keep_persistent", 2 ** 40, "keep_persistent"),
    ("manifest", [], "manifest"), ("manifest", {"a": {"d": DEEP}}, "deeper"),
    ("manifest", {"a": float("nan")}, "finite"), ("manifest", {"a": object()}, "not JSON"),
    ("run", "AB" * 8, "run"), ("run", "", "run"), ("lease_timeout", 0, "lease_timeout"),
    ("shared_group", 1, "shared_group"), ("watchdog_interval", -1, "watchdog_interval"), ("t", -1.0, "t"),
    ("interval", "1", "interval"), ("priority", "high", "priority"), ("fsync", None, "fsync"),
])
def test_decode_refuses_each_field_out_of_bounds(key, value, match):
    obj = job().encode()
    obj[key] = value
    _bad(obj, match)


def test_decode_refuses_keys_and_sources():
    obj = job().encode()
    _bad(dict(obj, extra=1), "unknown key")
    _bad(dict(obj, source="memtier"), "unknown key")  # the kind travels as its spec's key, not as a field
    for k in ("name", "manifest", "keep_persistent"):
        _bad({x: v for x, v in obj.items() if x != k}, "missing key")
    _bad(dict(obj, memtier=SLOT.to_job(), direct=DIRECT), "more than one source")
    _bad(dict(obj, memtier=None), "memory-tier source")
    _bad(dict(obj, memtier=dict(SLOT.to_job(), version=4)), "memory-tier source")  # not the job's version
    _bad(dict(obj, memtier=dict(SLOT.to_job(), device="rel/path")), "memory-tier source")
    _bad(dict(obj, memtier=dict(SLOT.to_job(), device="/a\x00")), "memory-tier source")
    _bad(dict(obj, memtier=dict(SLOT.to_job(), x=1)), "memory-tier source")
    _bad(dict(obj, direct=dict(DIRECT, crc32=[[0, 0, 1]])), "write-once record")  # protocol 2's list
    _bad(dict(obj, direct=dict(DIRECT, crc32="ewAAAAAAAAA")), "write-once record")  # not a multiple of 4
    _bad(dict(obj, direct=dict(DIRECT, crc32="ewAA\nAAAAAAA=")), "write-once record")  # not the alphabet
    _bad(dict(obj, direct={**DIRECT, "crcs": [[0, 0, 1]]}), "write-once record")  # an unknown key
    _bad(dict(obj, direct=dict(DIRECT, nonce="")), "write-once record")
    for hostile in (None, [], "job", 3, [obj]):
        _bad(hostile, "JSON object")
    with pytest.raises(CheckpointWriteError, match="unknown source kind"):
        job(source="tape")
    with pytest.raises(CheckpointWriteError, match="a spec expected"):
        job(source="memtier")
    with pytest.raises(CheckpointWriteError, match="takes no spec"):
        job(spec=DIRECT)


def test_a_connections_seen_manifest_parts_decide_as_a_walk_does():
    """``decode(seen=...)`` (the backend keeps one per connection): an entry equal to the last
    accepted job's is not walked again, and every job gets the answer the walk gives: a changed
    entry out of bounds is refused, an equal one accepted, and an integer beyond the range after a
    float of the same value (the one equal pair across a bound) is refused."""
    def wire(manifest):
        return json.loads(json.dumps(job(manifest=manifest).encode()))
    tensors = [{"id": i, "name": f"l{i}.w", "shape": [3, i]} for i in range(50)]
    seen: dict = {}
    first = FlushJob.decode(wire({"tensors": tensors, "version": 1}), seen=seen)
    assert first == FlushJob.decode(wire({"tensors": tensors, "version": 1}))
    assert set(seen) == {"tensors", "version"} and seen["tensors"][1] == 1 + 50 * 6
    again = FlushJob.decode(wire({"tensors": tensors, "version": 2}), seen=seen)  # parsed anew: equal, not identical
    assert again.manifest["version"] == 2 and seen["version"][0] == 2
    assert again.manifest["tensors"] is first.manifest["tensors"]  # the equal part: the last job's object
    bad_tensors = [dict(t) for t in tensors]
    bad_tensors[7]["shape"] = [3, 2 ** 64]
    deep = {"tensors": tensors, "version": 3, "x": DEEP}
    for manifest, match in (({"tensors": bad_tensors, "version": 3}, "integer outside"),
                            (deep, "deeper"), ({"tensors": tensors + [1.5] * 10, "v": [1.0] * 40}, None)):
        if match:
            with pytest.raises(CheckpointWriteError, match=match):
                FlushJob.decode(wire(manifest), seen=seen)
            with pytest.raises(CheckpointWriteError, match=match):
                FlushJob.decode(wire(manifest))
        else:
            assert FlushJob.decode(wire(manifest), seen=seen) == FlushJob.decode(wire(manifest))
    # the bounds of the whole object hold with parts taken from seen: the values are counted
    many = {"tensors": tensors, "more": list(range(2 ** 22 - 1 - (1 + 50 * 6)))}
    FlushJob.decode(wire({"tensors": tensors}), seen=seen)
    with pytest.raises(CheckpointWriteError, match="more than 4194304 values"):
        FlushJob.decode(wire(many), seen=seen)
    # 2.0**64 is a finite float (accepted); 2**64 == 2.0**64 in Python, but as an integer it is out of range
    FlushJob.decode(wire({"big": [2.0 ** 64]}), seen=seen)
    assert "big" not in seen  # an entry holding a float beyond the integers' range is not kept
    with pytest.raises(CheckpointWriteError, match="integer outside"):
        FlushJob.decode(wire({"big": [2 ** 64]}), seen=seen)


class CountingKey(json.JSONEncoder):
    """plan_of's key encoder, counting the manifests it encodes."""

    calls = 0

    def encode(self, o):
        CountingKey.calls += 1
        return super().encode(o)


def test_a_connections_jobs_find_their_plan_without_encoding_it(monkeypatch):
    """The jobs of one connection share the manifest's constant parts (``seen``), so plan_of finds
    the plan of the second and later jobs by identity, encoding nothing; a job whose tensors
    changed gets its own plan (derived again, not the last one)."""
    from deepfreeze.format import build_manifest
    from deepfreeze.shardplan import ShardPlan, TensorSpec
    from deepfreeze.tiers import base
    monkeypatch.setattr(base, "_PLAN_KEY", CountingKey(separators=(",", ":")))
    monkeypatch.setattr(base, "_LAST_PLAN", [])
    monkeypatch.setattr(base, "_PLANS", {})
    plan = ShardPlan.build([TensorSpec(i, f"t{i}", "float32", (4, 3)) for i in range(20)], 2)

    def wire(version, plan=plan):
        return json.loads(json.dumps(job(version=version, manifest=build_manifest("job", version, version, 0, plan,
                                                                                  ["a", "b"])).encode()))
    seen: dict = {}
    plans = [base.plan_of(FlushJob.decode(wire(v), seen=seen).manifest) for v in (1, 2, 3)]
    assert plans[0] is plans[1] is plans[2] and plans[0] == plan
    assert CountingKey.calls == 1, CountingKey.calls  # the first job only
    other = ShardPlan.build([TensorSpec(i, f"t{i}", "float32", (4, 5)) for i in range(20)], 2)
    got = base.plan_of(FlushJob.decode(wire(4, other), seen=seen).manifest)
    assert got == other and got != plan and CountingKey.calls == 2


def test_a_manifests_unchanged_entries_are_named_not_sent():
    """encode(last=) names the manifest's entries equal to the last accepted manifest's
    (``manifest_same``); decode(last=) rebuilds the very job. Refused: naming parts with no last
    manifest, a key the last manifest lacks, a key also sent or named twice, not a list."""
    def wire(obj):
        return json.loads(json.dumps(obj))
    tensors = [{"id": i, "name": f"l{i}.w", "shape": [3, i]} for i in range(50)]
    first = job(manifest={"tensors": tensors, "version": 1, "plan": {"w": 2}})
    second = job(version=2, manifest={"tensors": tensors, "version": 2, "plan": {"w": 2}})
    enc = second.encode(last=first.manifest)
    assert sorted(enc["manifest_same"]) == ["plan", "tensors"] and enc["manifest"] == {"version": 2}
    got = FlushJob.decode(wire(enc), last=wire(first.encode())["manifest"])
    assert got == second
    assert second.encode(last=None) == second.encode() and "manifest_same" not in second.encode()
    last = wire(first.encode())["manifest"]
    for hostile, why in ((wire(enc), None), (dict(wire(enc), manifest_same=["nope"]), last),
                         (dict(wire(enc), manifest_same=["version"]), last),
                         (dict(wire(enc), manifest_same=["plan", "plan"]), last),
                         (dict(wire(enc), manifest_same="plan"), last),
                         (dict(wire(enc), manifest_same=[["plan"]]), last),
                         (dict(wire(enc), manifest=[1]), last)):
        with pytest.raises(CheckpointWriteError, match="manifest_same"):
            FlushJob.decode(hostile, last=why)
    with pytest.raises(CheckpointWriteError, match="manifest_same"):
        flush_job_module.flush_job(wire(enc))  # sync mode's decode has no last manifest


def test_the_source_table():
    """Each tier registered its kind from its own module; the flush opens a shard through the
    table (a kind registered later is used: a new tier is one new registration)."""
    table = sources()
    assert set(table) >= {SCRATCH, "memtier", "direct"}
    assert table[SCRATCH].open is not None and table[SCRATCH].decode is None
    assert table["memtier"].open is not None and not table["memtier"].scratch_files
    assert table["direct"].open is None  # written once into persistent's partial: no copy
    with pytest.raises(ValueError):
        register("name", decode=lambda s, j: s, encode=dict)  # a kind with a spec may not shadow a field
    with pytest.raises(ValueError):
        register("half", decode=lambda s, j: s)


def test_flush_dispatches_through_the_table(tmp_path, monkeypatch):
    """A sync flush of a scratch version opens the shard with the ``scratch`` kind's opener (the
    one in the table, replaced here by a wrapper that counts), and commits bit-exact."""
    cfg = Config.load(None, mode="sync", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"), write_once="off")
    plan = make_plan(1)
    e = Engine(cfg, "job", 0, plan)
    jobs = []
    import deepfreeze.tiers.flush as levels
    real = levels.flush_job

    def spy(j, **kw):
        jobs.append(j)
        return real(j, **kw)
    monkeypatch.setattr("deepfreeze.engine.flush_job", spy)
    entry = source(SCRATCH)
    opened = []

    def counting(path, spec):
        opened.append(path)
        return entry.open(path, spec)
    register(SCRATCH, open=counting)
    try:
        e.checkpoint(2, pieces(model_arrays(2), plan, 0), step=2, epoch=0)
        e.close()
    finally:
        register(SCRATCH, open=entry.open)
    assert [type(j) for j in jobs] == [FlushJob] and jobs[0].source == SCRATCH and jobs[0].run == e.run.id
    assert opened == [os.path.join(cfg.scratch, "job", "v000000000002", "r000000.dfs")]
    assert_version(cfg, 2) and PersistentLevel(cfg.persistent).committed_versions("job") == [2]
    # the job the engine built is what the backend would decode from its encoding
    assert FlushJob.decode(json.loads(json.dumps(jobs[0].encode()))) == jobs[0]


# ----------------------------------------------------------------------------- the protocol version

class OldBackend:
    """tests/workers/old_backend.py on ``path``: a real process of protocol 1."""

    def __init__(self, path: str, log: str) -> None:
        self.path, self.log = path, log
        self.proc = subprocess.Popen([sys.executable, os.path.join(WORKERS, "old_backend.py"), path, log],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "listening"

    def requests(self) -> list[dict]:
        if not os.path.exists(self.log):
            return []
        with open(self.log) as f:
            return [json.loads(line) for line in f]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _config(tmp_path, **kw):
    return Config.load(None, mode="async", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"), **kw)


def test_old_backend_on_its_own_socket_gets_no_job(tmp_path):
    """A backend of protocol 1 runs on the node (its socket name has no version): the engine's
    client starts a backend of this protocol on its own socket, every version commits, and the
    old backend received nothing; it keeps serving its own clients."""
    cfg = _config(tmp_path)
    os.makedirs(cfg.scratch, mode=0o700)
    old = OldBackend(socket_path(cfg.scratch, protocol=1), str(tmp_path / "old.log"))
    try:
        assert socket_path(cfg.scratch, protocol=1) != socket_path(cfg.scratch)
        plan = make_plan(1)
        e = Engine(cfg, "job", 0, plan)
        assert e._backend.pid != old.proc.pid and e._backend.path == socket_path(cfg.scratch)
        for v in (2, 4):
            e.checkpoint(v, pieces(model_arrays(v), plan, 0), step=v, epoch=0)
        e.close()
        for v in (2, 4):
            assert_version(cfg, v)
        assert PersistentLevel(cfg.persistent).committed_versions("job") == [2, 4]
        assert old.requests() == []
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # an old client still gets its old backend
        s.settimeout(10)
        s.connect(old.path)
        s.sendall(b'{"op": "hello"}\n')
        assert json.loads(s.makefile().readline()) == {"ok": True, "pid": old.proc.pid}
        s.close()
    finally:
        old.close()


def test_old_backend_on_this_socket_gets_no_job(tmp_path, caplog):
    """A backend of protocol 1 on this protocol's socket: a client that may not start a backend
    raises BackendError naming both versions; one that may starts its own on the path (the old
    process left running), and its jobs go there; the old backend got no flush."""
    cfg = _config(tmp_path)
    os.makedirs(cfg.scratch, mode=0o700)
    old = OldBackend(socket_path(cfg.scratch), str(tmp_path / "old.log"))
    try:
        with pytest.raises(BackendError, match=f"speaks protocol 1, this client protocol {PROTOCOL}"):
            BackendClient(cfg.scratch, start=False, answer_timeout=5)
        caplog.set_level(logging.WARNING, logger="deepfreeze")
        plan = make_plan(1)
        e = Engine(cfg, "job", 0, plan)
        assert e._backend.pid != old.proc.pid and e._backend.started
        assert "speaks protocol 1" in caplog.text
        e.checkpoint(2, pieces(model_arrays(2), plan, 0), step=2, epoch=0)
        e.close()
        assert_version(cfg, 2) and PersistentLevel(cfg.persistent).committed_versions("job") == [2]
        assert [r["op"] for r in old.requests()] == ["hello", "hello"]  # each client's hello; no flush
        assert old.proc.poll() is None  # left running
    finally:
        old.close()


def test_backend_refuses_an_old_client_and_a_malformed_job(tmp_path):
    """The backend side: a flush on a connection whose hello named no protocol (an old client)
    is refused naming both versions; a malformed job is refused; the connection stays for both."""
    cfg = _config(tmp_path)
    os.makedirs(cfg.scratch, mode=0o700)
    client = BackendClient(cfg.scratch, answer_timeout=10)  # starts a real backend of this protocol
    try:
        good = job(scratch=cfg.scratch, persistent=cfg.persistent, version=9, rank=0, run="0" * 16).encode()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(client.path)
        f = s.makefile("rb")

        def ask(obj):
            s.sendall(json.dumps(obj).encode() + b"\n")
            return json.loads(f.readline())
        hello = ask({"op": "hello"})
        assert hello["ok"] and hello["protocol"] == PROTOCOL
        r = ask({"op": "flush", "job": good})
        assert not r["ok"] and f"protocol {PROTOCOL}" in r["error"] and "no flush job taken" in r["error"]
        assert ask({"op": "hello", "protocol": PROTOCOL})["ok"]
        r = ask({"op": "flush", "job": dict(good, rank=-1)})
        assert not r["ok"] and "rank" in r["error"] and "malformed flush job" in r["error"]
        r = ask({"op": "flush"})
        assert not r["ok"] and "JSON object" in r["error"]
        st = ask({"op": "status"})
        assert st["ok"] and st["jobs"] == 0  # nothing was queued
        s.close()
        with pytest.raises(BackendError, match="malformed flush job"):
            client.request({"op": "flush", "job": dict(good, version="9")})  # refused: BackendError
    finally:
        client.close()


def test_sync_flush_of_a_dict_is_checked(tmp_path):
    """flush_job of a dict (tests, experiments) decodes it first: a malformed one flushes nothing."""
    with pytest.raises(CheckpointWriteError, match="unknown key"):
        flush_job(dict(job(scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p")).encode(), memtier_=1))
    assert not os.path.exists(tmp_path / "p") or PersistentLevel(str(tmp_path / "p")).versions("job") == []
