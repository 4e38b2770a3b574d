"""Fuzzed decoders (issue 32): every input DeepFreeze reads from disk or a socket, mutated.

One test function per decoder. Each builds a valid input with the real writer (an engine's
checkpoint, a torch Checkpointer's state record, a Publisher's endpoint and ring, a sealed
network frame, a repository, a memory-tier device, a lease, a job id file, an INI file), adds the
committed seed corpus (tests/fuzz/corpus/<decoder>/), then lets hypothesis mutate it: JSON-tree
edits (type swaps, huge and negative ints, deep nests, missing and extra keys) and byte edits
(flips, truncation, overwritten sizes and offsets), with the CRCs and MACs recomputed over the
mutated bytes so the mutation reaches the parser behind them. The decoder must either succeed
or raise a :class:`~deepfreeze.errors.DeepFreezeError` subclass, never another exception, and
allocate no more than a bound (tracemalloc's peak, :class:`_mutate.Bounded`).

Deterministic (``derandomize=True``, no example database): CI runs the same inputs every time.
``make test`` runs :data:`_mutate.SHORT` examples per decoder; ``test_campaign`` (slow) runs
:data:`_mutate.LONG` per decoder and prints how many inputs each decoder was fed.
"""
from __future__ import annotations

import io
import json
import os
import socket
import sqlite3
import struct
import time
import zlib
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

from deepfreeze import format as fmt
from deepfreeze.errors import DeepFreezeError

from _util import replace_record as _replace_record, reseal_shard as _reseal_shard
from _mutate import LONG, SHORT, TRIED, Bounded, corpus, deep_encoding, dumps, fuzz, mutate_bytes, mutate_json

pytestmark = pytest.mark.timeout(600)


# --------------------------------------------------------------------------- valid inputs, real writers

@pytest.fixture(scope="module")
def engine_ck(tmp_path_factory):
    """A real checkpoint (framework-neutral engine, one rank, sync): manifest and files."""
    from test_engine import run_job
    d = tmp_path_factory.mktemp("engine")
    cfg = run_job(d, "sync", world=1, versions=(2,), write_once="off")[0]  # a shard file on scratch to fuzz
    vdir = os.path.join(cfg.persistent, "job", "v000000000002")
    sdir = os.path.join(cfg.scratch, "job", "v000000000002")
    with open(os.path.join(vdir, "manifest.json"), "rb") as f:
        manifest = f.read()
    with open(os.path.join(vdir, "model.dfz"), "rb") as f:
        assembled = f.read()
    with open(os.path.join(sdir, "r000000.dfs"), "rb") as f:
        shard = f.read()
    return {"manifest": manifest, "assembled": assembled, "shard": shard}


@pytest.fixture(scope="module")
def torch_record(torch_ck):
    return torch_ck[0]


@pytest.fixture(scope="module")
def torch_ck(tmp_path_factory):
    """A real per-rank state record: a torch Checkpointer (one process, sync) with Adam, a
    scheduler and a state object, read back as the checkpoint's ``_deepfreeze/rank0`` bytes."""
    torch = pytest.importorskip("torch")
    from deepfreeze.loader import load
    from deepfreeze.torch import Checkpointer
    d = tmp_path_factory.mktemp("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)

    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n, "t": (1, 2.5, float("nan")), "b": b"\x00\xff", "dt": torch.bfloat16,
                    "a": np.arange(3), 7: [None, True, "s"]}

        def load_state_dict(self, sd):
            self.n = sd["n"]

    ck = Checkpointer(net, opt, name="fz", every_n_steps=1, state={"sched": sched, "c": Counter()}, mode="sync",
                      scratch=str(d / "s"), persistent=str(d / "p"))
    for _ in ck.iterate(range(2)):  # (the record then holds the loop position: pass, items, RNG at its start)
        opt.zero_grad()
        net(torch.ones(5, 4)).sum().backward()
        opt.step()
        sched.step()
    ck.close()
    from deepfreeze.config import Config
    ckpt = load(Config.load(None, mode="sync", scratch=str(d / "s"), persistent=str(d / "p")), "fz")
    return ckpt.arrays["_deepfreeze/rank0"].tobytes(), d, ckpt.version


def _write_new(path: str, data: bytes) -> None:
    """``data`` as a new owner-only file at ``path`` (what was there is removed first)."""
    if os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, data)
    os.close(fd)


def _tree(raw: bytes) -> Any:
    """The JSON of a seed input, None when it is not JSON (a hostile seed): then only bytes are mutated."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _record_parts(raw: bytes) -> tuple[Any, bytes]:
    (n,) = struct.unpack_from("<Q", raw, 8)
    return _tree(raw[16:16 + n]), raw[16 + n:]


def _record(tree_bytes: bytes, payload: bytes) -> bytes:
    return b"DFTS0001" + struct.pack("<Q", len(tree_bytes)) + tree_bytes + payload


# --------------------------------------------------------------------------- manifest

def _manifest(bounded, bases, data):
    from deepfreeze.tiers.base import plan_of
    from deepfreeze.repo.importer import checkpoint_layers
    base = bases[data.draw(st.integers(0, len(bases) - 1), label="base")]
    tree = _tree(base)
    raw = dumps(mutate_json(data, tree)) if tree is not None and data.draw(st.booleans()) else mutate_bytes(data, base)

    def decode():
        m = fmt.decode_manifest(raw, "fuzz/manifest.json")
        plan_of(m)              # restore's next step: the shard plan of the manifest
        checkpoint_layers(m)    # the Keras layers record (repository import)
        fmt.manifest_run(m)
        fmt.manifest_parent(m)
    bounded(decode, len(raw))


def run_manifest(engine_ck, n):
    # the engine's manifest holds the compact plan record (format 3, derived pieces); the corpus
    # adds one that lists every piece (format 2, still read) and a compact one with pinned, given
    # and explicit parts (compact_manifest.json)
    assert json.loads(engine_ck["manifest"])["plan"]["algorithm"] == "flat-v1" and any(b'"pieces"' in c for c in corpus("manifest"))
    assert any(b'"explicit": [\n   [' in c for c in corpus("manifest"))
    bases = [engine_ck["manifest"]] + corpus("manifest")
    with Bounded("manifest") as b:
        fuzz(_manifest, n, b, bases)


def test_fuzz_manifest(engine_ck):
    run_manifest(engine_ck, SHORT)


# --------------------------------------------------------------------------- shard header and index

def _shard(bounded, bases, path, data):
    base = bases[data.draw(st.integers(0, len(bases) - 1), label="base")]
    b = bytearray(mutate_bytes(data, base, protect=8 if data.draw(st.booleans()) else 0))
    if data.draw(st.booleans(), label="reseal"):
        _reseal_shard(b)
    raw = bytes(b)
    with open(path, "wb") as f:
        f.write(raw)

    def decode():
        si = fmt.read_index(raw, "fuzz/shard")  # bytes in memory (a partner copy)
        for e in si.entries:
            fmt.entry_view(raw, e, verify=True, path="fuzz/shard")
        with open(path, "rb") as f:  # an open file (restore)
            si = fmt.read_index(f, path)
            for e in si.entries:
                fmt.read_entry(f, e, verify=True, path=path)
    bounded(decode, len(raw))


def run_shard(engine_ck, tmp_path, n):
    bases = [engine_ck["shard"], engine_ck["assembled"]] + corpus("shard")
    with Bounded("shard") as b:
        fuzz(_shard, n, b, bases, str(tmp_path / "shard.dfs"))


def test_fuzz_shard_header(engine_ck, tmp_path):
    run_shard(engine_ck, tmp_path, SHORT)


# --------------------------------------------------------------------------- torch state record

def _torch(bounded, bases, data):
    import torch
    from deepfreeze.torch import _state
    from deepfreeze.torch.export import _weights_only
    base = bases[data.draw(st.integers(0, len(bases) - 1), label="base")]
    tree, payload = _record_parts(base)
    if tree is not None and data.draw(st.booleans(), label="json"):
        raw = _record(dumps(mutate_json(data, tree)), payload)
    else:
        raw = mutate_bytes(data, base, protect=8)

    def decode():
        rec = _state.decode_record(raw, "fuzz record")
        # the readers of issue 31's fields: the loop position (resume), tied FQNs, optimizer classes
        import importlib
        from deepfreeze.torch import _loop
        if "loop" in rec.get("a", {}):
            _loop.check_record(rec["a"]["loop"], "fuzz record")
        importlib.import_module("deepfreeze.torch.state_loader")._aliases(rec)
        # what export --format torch writes of it is readable with weights_only=True
        buf = io.BytesIO()
        torch.save({"optim": _weights_only({"param_groups": rec.get("param_groups"),
                                            "extra": rec.get("optim_extra"), "state": rec.get("state")})}, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    bounded(decode, len(raw))


def run_torch(torch_record, n):
    bases = [torch_record] + corpus("torch_record")
    with Bounded("torch_record") as b:
        fuzz(_torch, n, b, bases)


def test_fuzz_torch_state_record(torch_record):
    run_torch(torch_record, SHORT)


def test_torch_record_dtype_tag_is_allow_listed(torch_record):
    """The probe's records: {"dt": "save"} / "__builtins__" resolve no attribute of torch; a
    record whose JSON is [] or {"dt": "nope"} is refused; deep nesting is refused before parsing."""
    from deepfreeze.errors import CorruptCheckpointError
    from deepfreeze.torch import _state
    tree, payload = _record_parts(torch_record)
    for hostile in ({"dt": "save"}, {"dt": "__builtins__"}, {"dt": "nope"}, {"dt": ["float32"]},
                    {"dt": "Tensor"}, {"T": ["float32", [-1], 0, 4]}, {"b": [0]}, {"d": [[1]]}):
        t = dict(tree, state={"d": [["lr", hostile]]})
        with pytest.raises(CorruptCheckpointError):
            _state.decode_record(_record(dumps(t), payload))
    for whole in ([], {"dt": "nope"}, [[[[1]]]] * 3, "x", {"param_groups": "abc"}, {"a": []}):
        with pytest.raises(CorruptCheckpointError):
            _state.decode_record(_record(dumps(whole), payload))
    with pytest.raises(CorruptCheckpointError, match="nested deeper"):
        _state.decode_record(_record(b"[" * 100_000 + b"]" * 100_000, b""))
    import torch
    assert _state.decode(_record(dumps({"dt": "bfloat16"}), b"")) is torch.bfloat16


def test_export_torch_of_a_hostile_record_is_one_line(torch_ck, tmp_path):
    """``deepfreeze export --format torch``: a valid checkpoint gives a file that
    ``torch.load(weights_only=True)`` reads; a record with ``{"dt": "save"}`` (CRCs valid)
    gives one line ``deepfreeze: error: ...`` and exit 1, never a traceback."""
    import shutil
    import subprocess
    import sys
    import torch
    raw, d, version = torch_ck
    work = tmp_path / "ck"
    shutil.copytree(d / "p", work / "p")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))

    def export(out):
        return subprocess.run([sys.executable, "-m", "deepfreeze", "export", "--name", "fz", "--format", "torch",
                               "-o", str(out), "--set", "mode=sync", "--set", f"scratch={work / 's'}",
                               "--set", f"persistent={work / 'p'}"], capture_output=True, text=True, timeout=300,
                              env=env)
    p = export(tmp_path / "good.pt")
    assert p.returncode == 0, p.stderr
    got = torch.load(str(tmp_path / "good.pt"), weights_only=True)
    assert got["deepfreeze"]["version"] == version and got["optim"]["param_groups"]
    import re
    (n,) = struct.unpack_from("<Q", raw, 8)
    js, k = re.subn(rb'\["lr",[^\]]*\]', b'["lr",{"dt":"save"}]', raw[16:16 + n])  # the learning rate: torch.save
    assert k >= 1
    hostile = _record(js, raw[16 + n:])
    vdir = work / "p" / "fz" / f"v{version:012d}"
    _replace_record(str(vdir / "model.dfz"), hostile)
    p = export(tmp_path / "bad.pt")
    assert p.returncode == 1 and not (tmp_path / "bad.pt").exists()
    assert p.stderr.startswith("deepfreeze: error: ") and p.stderr.count("\n") == 1, p.stderr
    assert "not a torch dtype" in p.stderr and "Traceback" not in p.stderr


# --------------------------------------------------------------------------- Keras state (manifest "layers")

def _keras(bounded, bases, data):
    from deepfreeze.repo.graph import decode_graph, encode_graph
    from deepfreeze.repo.importer import checkpoint_layers
    m = json.loads(bases[data.draw(st.integers(0, len(bases) - 1), label="base")])
    mutated = mutate_json(data, m["layers"], "layers") if "layers" in m else mutate_json(data, m)
    m2 = dict(m, layers=mutated) if "layers" in m else mutated
    raw = dumps(m2)

    def decode():
        man = fmt.decode_manifest(raw, "fuzz/keras manifest")
        rec = checkpoint_layers(man, "fuzz")
        if rec is not None:
            decode_graph(encode_graph(rec["graph"]), "fuzz graph")
    bounded(decode, len(raw))


def run_keras(n):
    bases = corpus("keras_state")
    assert bases, "tests/fuzz/corpus/keras_state holds a Keras checkpoint's manifest"
    with Bounded("keras_state") as b:
        fuzz(_keras, n, b, bases)


def test_fuzz_keras_state():
    run_keras(SHORT)


# --------------------------------------------------------------------------- ring meta

@pytest.fixture(scope="module")
def ring_file(tmp_path_factory):
    from deepfreeze.stream.slots import SlotRing
    d = tmp_path_factory.mktemp("ring")
    path = str(d / "deepfreeze-stream-c-r0")
    r = SlotRing.create(path, 4096, 3, meta={"channel": "chan", "run": "ab" * 8, "rank": 0})
    r.close()
    with open(path, "rb") as f:
        return f.read()


def _ring(bounded, base, d, data):
    from deepfreeze.stream import slots
    meta_len = struct.unpack_from("<I", base, 12)[0]
    meta = json.loads(base[128:128 + meta_len])
    if data.draw(st.booleans(), label="json"):
        new_meta = dumps(mutate_json(data, meta))[:slots.MAX_META + 10]
        slots_n, capacity = struct.unpack_from("<IxxxxQ", base, 8)
        stride, records, locks, dat, size = slots._layout(slots_n, capacity, len(new_meta))
        head = bytearray(base[:128])
        head[12:16] = struct.pack("<I", len(new_meta))
        head[24:64] = struct.pack("<QQQQQ", stride, records, locks, dat, size)
        raw = bytearray(bytes(head) + new_meta + b"\0" * max(0, size - 128 - len(new_meta)))
        resealed = True
    else:
        raw = bytearray(mutate_bytes(data, base, protect=4))
        resealed = data.draw(st.booleans(), label="reseal")
    if len(raw) >= 128 and resealed:
        ml = struct.unpack_from("<I", raw, 12)[0]
        raw[64:68] = struct.pack("<I", zlib.crc32(bytes(raw[:64]) + bytes(raw[128:128 + ml])))
    path = os.path.join(d, "ring")
    _write_new(path, bytes(raw))

    def decode():
        r = slots.SlotRing.open(path, prefault=False)
        try:
            r.newest() if hasattr(r, "newest") else None
        finally:
            r.close()
    bounded(decode, len(raw))


def run_ring(ring_file, tmp_path, n):
    with Bounded("ring_meta") as b:
        fuzz(_ring, n, b, ring_file, str(tmp_path))


def test_fuzz_ring_meta(ring_file, tmp_path):
    run_ring(ring_file, tmp_path, SHORT)


# --------------------------------------------------------------------------- endpoint files and Redis records

@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    """A Publisher's real endpoint record (its file's bytes)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DEEPFREEZE_TOKEN", "c" * 64)
    try:
        from test_stream_core import publishers
        d = tmp_path_factory.mktemp("endpoint")
        plan, pubs = publishers(d, 1)
        with open(pubs[0].endpoint_path, "rb") as f:
            raw = f.read()
        for p in pubs:
            p.close()
    finally:
        mp.undo()
    return raw


def _endpoints(bounded, bases, persistent, data):
    from deepfreeze.stream.core import _plan_of, endpoint_dir, read_endpoints
    base = bases[data.draw(st.integers(0, len(bases) - 1), label="base")]
    tree = _tree(base)
    raw = dumps(mutate_json(data, tree)) if tree is not None and data.draw(st.booleans()) else mutate_bytes(data, base)
    d = endpoint_dir(persistent, "chan")
    os.makedirs(d, mode=0o700, exist_ok=True)
    path = os.path.join(d, "r0.json")
    if os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, raw)
    os.close(fd)

    def decode():
        for recs in read_endpoints(persistent, "chan").values():  # skips a bad file with a warning
            for rec in recs.values():
                _plan_of(rec)
    bounded(decode, len(raw))


def run_endpoints(endpoint, tmp_path, n):
    with Bounded("endpoint") as b:
        fuzz(_endpoints, n, b, [endpoint] + corpus("endpoint"), str(tmp_path))


def test_fuzz_endpoint_files(endpoint, tmp_path):
    run_endpoints(endpoint, tmp_path, SHORT)


def _redis(bounded, base, data):
    from deepfreeze.stream import redis_notify as rn
    from deepfreeze.stream.core import _check_endpoint, _plan_of
    reader = rn._Reader("c" * 64)
    context = "df:chan:j:endpoints/r0"
    obj = mutate_json(data, json.loads(base))
    if isinstance(obj, dict) and data.draw(st.booleans(), label="seal"):
        with deep_encoding():  # the MAC recomputed: reaches the checks behind it
            raw = rn._sealed(reader._key, context, obj).encode()
    else:
        raw = mutate_bytes(data, rn._sealed(reader._key, context, json.loads(base)).encode())

    def decode():
        got = reader.by_rank({b"r0": raw}, "fuzz endpoints", "df:chan:j:endpoints")
        for rec in got.values():
            _plan_of(_check_endpoint(rec, "fuzz redis endpoint"))
    bounded(decode, len(raw))


def run_redis(endpoint, n):
    with Bounded("redis") as b:
        fuzz(_redis, n, b, endpoint)


def test_fuzz_redis_records(endpoint):
    run_redis(endpoint, SHORT)


# --------------------------------------------------------------------------- network frames and handshakes

_HEADER = {"op": "get", "version": [0, 3], "step": 30, "ranges": [[0, 0, 4096], [1, 64, 128]], "crc": 1234,
           "ok": True, "nbytes": 16}


def _frames(bounded, data):
    from deepfreeze import net
    a, b = socket.socketpair()
    k1, k2 = b"k" * 32, b"q" * 32
    ca, cb = net.Channel(a, k1, k2, "client"), net.Channel(b, k2, k1, "server")
    try:
        payload = b"p" * 16
        if data.draw(st.booleans(), label="json"):
            hdr = dumps(mutate_json(data, _HEADER))
            plen = data.draw(st.sampled_from([0, 16, 17, 1 << 40]), label="plen")
            fixed = net._FRAME.pack(net.MAGIC, net.VERSION, net._FLAG_MAC, len(hdr), plen)
            tag = ca._header_tag(ca._send_dir, ca._send_key, ca.send_seq, fixed, hdr)  # sealed: the MAC holds
            frame = fixed + hdr + tag
            if plen:
                mac = ca._payload_mac(ca._send_dir, ca._send_key, ca.send_seq, tag)
                mac.update(payload)
                frame += payload + mac.digest()
        else:
            frame = mutate_bytes(data, ca._seal_header(_HEADER, 16)[0] + payload + b"\0" * 16)
        a.sendall(frame[:1 << 20])
        a.shutdown(socket.SHUT_WR)

        def decode():
            msg = net.recv_msg(cb, deadline=time.monotonic() + 5, max_header=1 << 16, max_payload=1 << 20)
            if msg.remaining:
                msg.read(msg.remaining)
        bounded(decode, len(frame))
    finally:
        a.close()
        b.close()


def run_frames(n):
    with Bounded("net_frame") as b:
        fuzz(_frames, n, b)


def test_fuzz_network_frames():
    run_frames(SHORT)


def _handshake(bounded, data):
    from deepfreeze import net
    auth = net._ServerAuth("c" * 64)
    hello = {"df": "auth", "protocol": net.VERSION, "nonce": "ab" * 16}
    if data.draw(st.booleans(), label="json"):
        hdr = dumps(mutate_json(data, hello))  # (net._plain's json.dumps cannot encode a deep nest)
        raw = net._FRAME.pack(net.MAGIC, net.VERSION, 0, len(hdr), 0) + hdr
    else:
        raw = mutate_bytes(data, net._plain(hello))

    def decode():  # the state machine never raises: a refusal sets .error
        out = auth.feed(raw, "fuzz peer")
        if auth.stage == 2 and not auth.error:
            auth.feed(net._plain({"df": "proof", "proof": "00" * 32}), "fuzz peer")
        if auth.error is not None:
            assert isinstance(auth.error, DeepFreezeError), auth.error
        return out
    bounded(decode, len(raw))


def run_handshake(n):
    with Bounded("handshake") as b:
        fuzz(_handshake, n, b)


def test_fuzz_handshakes():
    run_handshake(SHORT)


# --------------------------------------------------------------------------- the clone wire (issue 35)

def _clone_plan():
    from deepfreeze.clone.plan import ClonePlan
    from deepfreeze.shardplan import TensorSpec
    specs = [TensorSpec(0, "fc.weight", "float32", (64, 8)), TensorSpec(1, "bn.running_mean", "float32", (64,)),
             TensorSpec(2, "optim.state.fc.weight.exp_avg", "float32", (64, 8))]
    return ClonePlan(specs, 2, 2, whole=[1], threshold=256)


def _clone_wire(bounded, data):
    """The clone wire's decoders: a request, a hello and its plan, a data frame checked against
    the plan, the relay's peer hello and forward frame, and a whole connection of frames into a
    CloneListener's receiving loop."""
    from deepfreeze.clone import wire
    plan = _clone_plan()
    which = data.draw(st.sampled_from(["request", "hello", "data", "stream", "peer", "forward"]), label="decoder")
    if which == "peer":  # the relay between clone ranks (issue 44)
        from deepfreeze.clone import relay
        obj = mutate_json(data, {"df": "clone-peer", "rank": 1, "digest": plan.digest()})
        bounded(lambda: relay.check_peer_hello(obj, 2), len(dumps(obj)))
    elif which == "forward":
        from deepfreeze.clone import relay
        expected = {(r.tensor_id, r.start, r.stop): r for r in plan.routes if r.dst == 1}
        routes = [[r.tensor_id, r.start, r.stop] for r in expected.values()]
        obj = mutate_json(data, {"df": "clone-fwd", "routes": routes})
        total = sum((r.stop - r.start) * 4 for r in expected.values())
        payload = data.draw(st.sampled_from([total, 0, total - 4, 1 << 40]), label="payload")
        bounded(lambda: relay.check_forward(obj, plan, expected, payload), len(dumps(obj)))
    elif which == "request":
        obj = mutate_json(data, {"df": "clone-request", "n_clone": 2, "endpoints": ["127.0.0.1:1", "[::1]:2"]})
        bounded(lambda: wire.check_request(obj), len(dumps(obj)))
    elif which == "hello":
        obj = mutate_json(data, {"df": "clone-hello", "rank": 1, "plan": plan.describe(), "digest": plan.digest(),
                                 "header": {"step": 3, "model_tensors": 2, "aliases": {}}})

        def decode():
            _, describe, _, _ = wire.check_hello(obj)
            wire.plan_from(describe)
        bounded(decode, len(dumps(obj)))
    elif which == "data":
        expected = {(r.tensor_id, r.start, r.stop): r for r in plan.routes if r.src == 0 and r.dst == 0}
        r0 = next(iter(expected.values()))
        obj = mutate_json(data, {"df": "clone-data", "t": r0.tensor_id, "start": r0.start, "stop": r0.stop,
                                 "dtype": "float32"})
        payload = data.draw(st.sampled_from([(r0.stop - r0.start) * 4, 0, 1 << 40]), label="payload")
        bounded(lambda: wire.check_data(obj, plan, expected, payload), len(dumps(obj)))
    else:  # frames after a valid hello, sealed (the MACs hold), into the real receiving loop
        from deepfreeze import net
        a, b = socket.socketpair()
        k1, k2 = b"k" * 32, b"q" * 32
        ca, cb = net.Channel(a, k1, k2, "client"), net.Channel(b, k2, k1, "server")
        lst = wire.CloneListener.__new__(wire.CloneListener)  # its receiving state only (no socket listens)
        lst.rank, lst.timeout = 0, 5.0
        import threading
        lst._lock, lst._channels, lst.plan, lst.digest, lst.describe, lst.header = threading.Lock(), {}, None, "", {}, {}
        lst.buffers, lst.records, lst.bytes_received, lst.first_data_at = {}, {}, 0, None
        lst._refused, lst._left = None, {}
        try:
            hello = {"df": "clone-hello", "rank": 0, "plan": plan.describe(), "digest": plan.digest(),
                     "header": {"step": 3}}
            frames = [ca._seal_header(hello, 0)[0]]
            for r in plan.routes:
                if r.src == 0 and r.dst == 0:
                    h = mutate_json(data, {"df": "clone-data", "t": r.tensor_id, "start": r.start, "stop": r.stop,
                                           "dtype": "float32"})
                    body = b"\0" * ((r.stop - r.start) * 4)
                    try:  # (a mutant nested past what json can encode is no frame: not sent)
                        head, mac = ca._seal_header(h, len(body)) if isinstance(h, dict) else (b"", None)
                    except RecursionError:
                        head, mac = b"", None
                    if mac is not None:
                        mac.update(body)
                        frames.append(head + body + mac.digest())
            frames.append(ca._seal_header({"df": "clone-record", "rank": 0}, 4)[0])
            raw = b"".join(frames)
            a.sendall(raw[:1 << 20])
            a.shutdown(socket.SHUT_WR)

            def decode():
                try:
                    lst._serve(cb, 2, lambda p, h: None, time.monotonic() + 5)
                except DeepFreezeError:
                    raise
            bounded(decode, len(raw))
        finally:
            a.close()
            b.close()


def run_clone_wire(n):
    with Bounded("clone_wire") as b:
        fuzz(_clone_wire, n, b)


def test_fuzz_clone_wire():
    run_clone_wire(SHORT)


# --------------------------------------------------------------------------- repository rows and packs

@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory):
    from deepfreeze.repo.store import EmbeddedRepository
    d = tmp_path_factory.mktemp("repo") / "r"
    rng = np.random.default_rng(0)
    with EmbeddedRepository(str(d)) as repo:
        repo.put("m", {"a": rng.standard_normal((30, 7)).astype(np.float32), "b": np.arange(9, dtype=np.int64)})
    return str(d)


_ROW_EDITS = [("blobs", "offset"), ("blobs", "length"), ("blobs", "entry"), ("blobs", "n_entries"),
              ("blobs", "dtype"), ("blobs", "shape"), ("blobs", "crc"), ("packs", "file"), ("packs", "size"),
              ("models", "graph"), ("models", "n_tensors"), ("tensors", "key"), ("tensors", "pos"),
              ("settings", "value")]


def _repo(bounded, src, work, data):
    import shutil
    from deepfreeze.repo.store import EmbeddedRepository
    if os.path.exists(work):
        shutil.rmtree(work)
    shutil.copytree(src, work)
    db = [n for n in os.listdir(work) if n.endswith((".db", ".sqlite"))]
    if data.draw(st.booleans(), label="row") and db:
        table, col = data.draw(st.sampled_from(_ROW_EDITS), label="column")
        value = data.draw(st.sampled_from([None, -1, 0, 2 ** 62, 2 ** 63 - 1, "", "x", "[-1]", "[2e40]", "[[[[",
                                           "../../x", "0123456789abcdef0123456789abcdef.dfz", b"\xff" * 8,
                                           "[" * 5000, "float128", "[1,2,3]", 3.5]), label="value")
        with sqlite3.connect(os.path.join(work, db[0])) as conn:
            try:
                conn.execute(f"UPDATE {table} SET {col} = ?", (value,))
            except sqlite3.IntegrityError:
                pass
        conn.close()
    else:  # a pack file's bytes (its header and index CRCs recomputed)
        packs = [os.path.join(r, n) for r, _, ns in os.walk(work) for n in ns if n.endswith(".dfz")]
        p = packs[data.draw(st.integers(0, len(packs) - 1), label="pack")]
        with open(p, "rb") as f:
            b = bytearray(mutate_bytes(data, f.read()))
        if data.draw(st.booleans(), label="reseal"):
            _reseal_shard(b)
        with open(p, "wb") as f:
            f.write(b)

    def decode():
        with EmbeddedRepository(work) as repo:
            for name in repo.list().get("m", ["m"]) or ["m"]:
                repo.info(name)
            repo.specs("m")
            repo.get("m")
            repo.graph("m")
    bounded(decode, 1 << 16)


_ROW_VALUES = [-1, 2 ** 62, "x", "[" * 5000, b"\xff" * 8, None]


def _sweep_rows(bounded, src, work):
    """Every column of _ROW_EDITS set to each of _ROW_VALUES (deterministic, before hypothesis)."""
    for table, col in _ROW_EDITS:
        for value in _ROW_VALUES:
            fixed = iter([True, (table, col), value])

            class Fixed:  # a data object that answers the draws with the fixed edit
                @staticmethod
                def draw(strategy, label=None):
                    return next(fixed)
            _repo(bounded, src, work, Fixed)


def run_repo(repo_dir, tmp_path, n):
    with Bounded("repository") as b:
        _sweep_rows(b, repo_dir, str(tmp_path / "work"))
        fuzz(_repo, n, b, repo_dir, str(tmp_path / "work"))


def test_fuzz_repository_rows_and_packs(repo_dir, tmp_path):
    run_repo(repo_dir, tmp_path, SHORT)


# --------------------------------------------------------------------------- torch repository records

def _torch_net():
    """A small torch module with layers of distinct shapes (each layer's id is its own)."""
    import torch

    class TNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(6, 10)
            self.norm = torch.nn.LayerNorm(10)
            self.fc2 = torch.nn.Linear(10, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.norm(self.fc1(x))))
    return TNet()


@pytest.fixture(scope="module")
def torch_repo(tmp_path_factory):
    """A repository holding one module stored by ``deepfreeze.torch.store_model`` (its graph,
    layer metadata, tensor rows and pack), and the stored module's state dict."""
    torch = pytest.importorskip("torch")
    from deepfreeze.repo.store import EmbeddedRepository
    from deepfreeze.torch import store_model
    d = str(tmp_path_factory.mktemp("trepo") / "r")
    torch.manual_seed(0)
    net = _torch_net()
    with EmbeddedRepository(d) as repo:
        store_model(repo, "m", net)
    return d, {k: v.detach().clone() for k, v in net.state_dict().items()}


_TORCH_ROW_EDITS = [("models", "graph"), ("models", "n_tensors"), ("layer_meta", "meta"), ("layer_meta", "id"),
                    ("tensors", "key"), ("tensors", "pos"), ("blobs", "offset"), ("blobs", "length"),
                    ("blobs", "dtype"), ("blobs", "shape"), ("blobs", "crc"), ("blobs", "entry"),
                    ("packs", "file"), ("packs", "size")]


def _torch_repo(bounded, src, work, data):
    """One mutation of what store_model wrote, then load_into a fresh module: a DeepFreezeError, or
    a load whose every loaded tensor equals the stored one (the others untouched)."""
    import shutil
    import torch
    from deepfreeze.repo.store import EmbeddedRepository
    from deepfreeze.torch import load_into
    src, stored = src
    if os.path.exists(work):
        shutil.rmtree(work)
    shutil.copytree(src, work)
    db = os.path.join(work, next(n for n in os.listdir(work) if n.endswith((".db", ".sqlite"))))
    what = data.draw(st.sampled_from(["row", "graph", "meta", "pack"]), label="what")
    with sqlite3.connect(db) as conn:
        if what == "row":
            table, col = data.draw(st.sampled_from(_TORCH_ROW_EDITS), label="column")
            value = data.draw(st.sampled_from([None, -1, 0, 2 ** 62, 2 ** 63 - 1, "", "x", "[-1]", "[[[[",
                                               "../../x", b"\xff" * 8, "[" * 5000, "float128", "{}", 3.5]),
                              label="value")
            try:
                conn.execute(f"UPDATE {table} SET {col} = ?", (value,))
            except sqlite3.IntegrityError:
                pass
        elif what == "graph":  # the compact graph record's bytes (ids, input indices, tensor counts)
            (g,) = conn.execute("SELECT graph FROM models").fetchone()
            conn.execute("UPDATE models SET graph = ?", (mutate_bytes(data, bytes(g), label="graph"),))
        elif what == "meta":  # one layer's metadata (class name, config, weight specs) as a JSON tree
            rows = conn.execute("SELECT id, meta FROM layer_meta ORDER BY id").fetchall()
            lid, meta = rows[data.draw(st.integers(0, len(rows) - 1), label="layer")]
            tree = _tree(meta.encode() if isinstance(meta, str) else bytes(meta))
            new = dumps(mutate_json(data, tree, label="meta")) if tree is not None else \
                mutate_bytes(data, meta.encode())
            conn.execute("UPDATE layer_meta SET meta = ? WHERE id = ?", (new.decode(errors="replace"), lid))
    conn.close()
    if what == "pack":
        packs = [os.path.join(r, n) for r, _, ns in os.walk(work) for n in ns if n.endswith(".dfz")]
        p = packs[data.draw(st.integers(0, len(packs) - 1), label="pack")]
        with open(p, "rb") as f:
            b = bytearray(mutate_bytes(data, f.read()))
        if data.draw(st.booleans(), label="reseal"):
            _reseal_shard(b)
        with open(p, "wb") as f:
            f.write(b)
    match = data.draw(st.sampled_from(["id", "shape"]), label="match")
    torch.manual_seed(1)
    net = _torch_net()
    before = {k: v.detach().clone() for k, v in net.state_dict().items()}

    def decode():
        with EmbeddedRepository(work) as repo:
            return load_into(repo, "m", net, match=match)
    report = bounded(decode, 1 << 16)
    if isinstance(report, DeepFreezeError):
        assert str(report).strip(), f"{type(report).__name__} without a message"
        for k, v in net.state_dict().items():  # nothing set before the error
            assert torch.equal(v, before[k]), f"{k} changed by a load that failed: {report}"
        return
    for k, v in net.state_dict().items():
        layer = k.rsplit(".", 1)[0]
        if layer in report.loaded:
            assert torch.equal(v, stored[k]), f"{k} loaded from a damaged repository differs from what was stored"
        else:
            assert torch.equal(v, before[k]), f"{k} changed, but its layer {layer!r} was not loaded"


def _sweep_torch_rows(bounded, src, work):
    """Every column of _TORCH_ROW_EDITS set to each of _ROW_VALUES (deterministic, before hypothesis)."""
    for table, col in _TORCH_ROW_EDITS:
        for value in _ROW_VALUES:
            fixed = iter(["row", (table, col), value, "id"])

            class Fixed:  # a data object that answers the draws with the fixed edit
                @staticmethod
                def draw(strategy, label=None):
                    return next(fixed)
            _torch_repo(bounded, src, work, Fixed)


def run_torch_repo(torch_repo, tmp_path, n):
    with Bounded("torch_repository") as b:
        _sweep_torch_rows(b, torch_repo, str(tmp_path / "twork"))
        fuzz(_torch_repo, n, b, torch_repo, str(tmp_path / "twork"))


def test_fuzz_torch_repository_records(torch_repo, tmp_path):
    """What deepfreeze.torch.store_model writes (the graph record, the layer metadata, the tensor
    and blob rows, the pack) mutated, read back by deepfreeze.torch.load_into: a DeepFreezeError
    with a message and nothing set, or a load of exactly the stored weights; never another
    exception, a hang or an unbounded allocation."""
    run_torch_repo(torch_repo, tmp_path, SHORT)


# --------------------------------------------------------------------------- memory-tier device

@pytest.fixture(scope="module")
def memtier_image(tmp_path_factory):
    """A real device file: one registered shard, one finished slot."""
    from deepfreeze.memtier import device as D
    from test_memtier_device import _arrays, _put, _register
    path = f"/dev/shm/dffuzz-{os.getpid()}.dev"
    try:
        D.create(path, "8M", table_cap=8)
        with D.open(path) as dev:
            region, plan = _register(dev, nslots=2)
            _put(region, plan, _arrays(), 2)
        with open(path, "rb") as f:
            return f.read()
    finally:
        if os.path.lexists(path):
            os.unlink(path)


def _memtier(bounded, base, path, data):
    from deepfreeze.memtier import device as D
    from deepfreeze.memtier import layout as mlayout
    b = bytearray(base)
    table_off = mlayout.PAGE
    part = data.draw(st.sampled_from(["superblock", "entry", "index", "slot", "bytes"]), label="part")
    if part == "superblock":
        f = list(D._SB.unpack_from(b, 0))
        i = data.draw(st.integers(1, len(f) - 1), label="field")
        f[i] = data.draw(st.sampled_from([0, 1, 4095, 1 << 16, 1 << 31, (1 << 32) - 1]) if i in (1, 2, 5, 6)
                         else st.sampled_from([0, 1, 1 << 40, (1 << 63) - 1, (1 << 64) - 1])
                         if i in (3, 4) else st.sampled_from([0.0, -1.0, 1e300]))
        sb = D._SB.pack(*f)
        b[:len(sb) + 4] = sb + struct.pack("<I", zlib.crc32(sb))
    elif part == "entry":
        off = table_off
        body = bytes(b[off + 4:off + 4 + D._BODY.size])
        f = list(D._BODY.unpack(body))
        i = data.draw(st.integers(0, len(f) - 1), label="field")
        if isinstance(f[i], bytes):
            f[i] = data.draw(st.binary(max_size=20))
        elif isinstance(f[i], float):
            f[i] = data.draw(st.sampled_from([0.0, -1.0, 1e300]))
        else:
            width = (1 << 16) - 1 if i == 0 else (1 << 32) - 1 if i in (3, 4, 5) else (1 << 64) - 1
            f[i] = min(data.draw(st.sampled_from([0, 1, 7, 4096, 1 << 20, width])), width)  # (the field's width)
        nb = D._BODY.pack(*f)
        b[off + 4:off + 4 + len(nb) + 4] = nb + struct.pack("<I", zlib.crc32(nb))
    elif part == "index":
        body = D._BODY.unpack(bytes(b[table_off + 4:table_off + 4 + D._BODY.size]))
        index_off, index_len = body[8], body[9]
        idx = json.loads(bytes(b[index_off:index_off + index_len]))
        new = dumps(mutate_json(data, idx))[:index_len]  # (cut: not JSON any more)
        new = new + b" " * (index_len - len(new))
        b[index_off:index_off + index_len + 4] = new + struct.pack("<I", zlib.crc32(new))
    elif part == "slot":
        body = D._BODY.unpack(bytes(b[table_off + 4:table_off + 4 + D._BODY.size]))
        slot_off, stride = body[10], body[11]
        k = data.draw(st.integers(0, 1), label="slot")
        off = slot_off + k * stride
        f = list(mlayout._SLOT.unpack_from(b, off))
        i = data.draw(st.integers(1, len(f) - 1), label="field")
        if isinstance(f[i], bytes):
            f[i] = data.draw(st.binary(min_size=16, max_size=16))
        elif isinstance(f[i], float):
            f[i] = -1.0
        else:
            f[i] = data.draw(st.sampled_from([0, 1, 3, 5, 1 << 20, (1 << 31) - 1]))
        sh = mlayout._SLOT.pack(*f)
        b[off:off + len(sh) + 4] = sh + struct.pack("<I", zlib.crc32(sh))
    else:
        b = bytearray(mutate_bytes(data, bytes(b)))
    _write_new(path, bytes(b))

    def decode():
        with D.Device(path, writable=False) as dev:
            for r in dev.shards():
                for k, h in r.restorable():
                    r.manifest(k, h)
                    r.read_image(k, verify=True)
    bounded(decode, len(b))


def run_memtier(memtier_image, n):
    path = f"/dev/shm/dffuzz-{os.getpid()}-w.dev"
    try:
        with Bounded("memtier") as b:
            fuzz(_memtier, n, b, memtier_image, path)
    finally:
        if os.path.lexists(path):
            os.unlink(path)


def test_fuzz_memtier_device(memtier_image):
    run_memtier(memtier_image, SHORT)


# --------------------------------------------------------------------------- job-id and lease files

def _lease(bounded, persistent, data):
    from deepfreeze import lease as R
    d = os.path.join(persistent, "job")
    os.makedirs(d, mode=0o700, exist_ok=True)
    for n in os.listdir(d):
        os.unlink(os.path.join(d, n))
    lease = R.Lease(persistent, "job", "ab" * 8, timeout=30)
    base = lease._content()
    which = data.draw(st.sampled_from(["lease", "job"]), label="file")
    if which == "lease":
        raw = dumps(mutate_json(data, json.loads(base))) if data.draw(st.booleans()) else mutate_bytes(data, base)
    else:
        raw = mutate_bytes(data, (R.new_job_id() + "\n").encode())
    fd = os.open(os.path.join(d, R.LEASE if which == "lease" else R.JOB), os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, raw)
    os.close(fd)

    def decode():
        if which == "job":
            R.read_job_id(persistent, "job")
            return
        got = R.read_lease(persistent, "job")
        if got is not None:
            R.describe_holder(got[0])
        R.fence_holder(persistent, "job", "cd" * 8)
        other = R.Lease(persistent, "job", "cd" * 8, timeout=30)
        try:
            other.acquire(wait=0)  # the holder judged from the file: taken over or LeaseHeldError
        finally:
            other._stop.set()
    bounded(decode, len(raw))


def run_lease(tmp_path, n):
    with Bounded("lease_job") as b:
        fuzz(_lease, n, b, str(tmp_path / "pfs"))


def test_fuzz_job_id_and_lease_files(tmp_path):
    run_lease(tmp_path, SHORT)


# --------------------------------------------------------------------------- the backend's flush job

def _flush_jobs(engine_ck) -> list[bytes]:
    """Flush jobs as the engine builds them (its manifest, each source kind), as the backend's
    socket carries them: one JSON line of ``{"op": "flush", "job": ...}``."""
    from deepfreeze.tiers.memtier import SlotSource
    from deepfreeze.tiers.job import SCRATCH, FlushJob
    manifest = json.loads(engine_ck["manifest"])
    common = dict(name="job", version=2, rank=0, scratch="/tmp/s", persistent="/tmp/p", persistent_interval=0.0,
                  keep_scratch=2, keep_persistent=0, manifest=manifest, run=manifest["run"]["id"], lease_timeout=30.0,
                  watchdog_interval=0.0, t=1234.5, interval=0.5, priority="low")
    jobs = [FlushJob(**common),
            FlushJob(**common, source=SlotSource.kind, spec=SlotSource("/dev/shm/t", 0, 1, 2, common["run"], 0)),
            FlushJob(**common, source="direct", spec={"nonce": "ab" * 8, "has_crc": True,
                                                       "crc32": "TQAAAE0AAABNAAAA"})]  # three CRCs of 77
    assert jobs[0].source == SCRATCH
    return [dumps({"op": "flush", "job": j.encode()}) for j in jobs]


def _flush_job(bounded, bases, data):
    from deepfreeze.errors import CheckpointWriteError, CorruptCheckpointError
    from deepfreeze.jsonsafe import loads
    from deepfreeze.tiers.job import FlushJob
    import deepfreeze.backend  # noqa: F401  (the server's imports: every tier's source kind registered)
    base = bases[data.draw(st.integers(0, len(bases) - 1), label="base")]
    tree = _tree(base)
    raw = dumps(mutate_json(data, tree)) if tree is not None and data.draw(st.booleans()) else mutate_bytes(data, base)

    def job_of(data):  # what the backend's reader does first
        msg = loads(data, "backend message", max_bytes=256 << 20)
        return msg.get("job") if isinstance(msg, dict) else msg

    def decode():
        obj = job_of(raw)
        try:
            job = FlushJob.decode(obj)
        except DeepFreezeError as e:
            assert isinstance(e, CheckpointWriteError), type(e)  # the job's one typed error
            raise
        again = FlushJob.decode(json.loads(json.dumps(job.encode())))  # what it decoded crosses again unchanged
        assert again == job, (again, job)
        return job
    out = bounded(decode, len(raw))
    assert isinstance(out, (FlushJob, CheckpointWriteError, CorruptCheckpointError)), type(out)
    if not isinstance(out, CorruptCheckpointError):  # after the base, on one connection: the same answer
        seen: dict = {}
        try:
            FlushJob.decode(job_of(base), seen=seen)
        except DeepFreezeError:
            pass
        try:
            second = FlushJob.decode(job_of(raw), seen=seen)
        except CheckpointWriteError as e:
            second = e
        assert type(second) is type(out) and (str(second) == str(out) if isinstance(out, Exception) else second == out)


def run_flush_job(engine_ck, n):
    bases = _flush_jobs(engine_ck) + corpus("flush_job")
    with Bounded("flush_job") as b:
        fuzz(_flush_job, n, b, bases)


def test_fuzz_flush_job(engine_ck):
    run_flush_job(engine_ck, SHORT)


# --------------------------------------------------------------------------- the INI file

_INI = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "veloc_cfg", "local.cfg")


def _ini(bounded, bases, path, data):
    from deepfreeze.config import Config
    base = bases[data.draw(st.integers(0, len(bases) - 1), label="base")]
    lines = base.split(b"\n")
    if data.draw(st.booleans(), label="value"):
        i = data.draw(st.integers(0, len(lines) - 1), label="line")
        key = lines[i].split(b"=")[0] if b"=" in lines[i] else b"mode"
        value = data.draw(st.sampled_from([b"", b"-1", b"0", b"1e400", b"99999999999999999999999", b"nan", b"x",
                                           b"async", b"/", b"\xff\xfe", b"yes", b"1k", b"1P", b"=", b"[x]"]))
        lines[i] = key + b" = " + value
        raw = b"\n".join(lines)
    else:
        raw = mutate_bytes(data, base)
    with open(path, "wb") as f:
        f.write(raw)

    def decode():
        Config.load(path)
    bounded(decode, len(raw))


def run_ini(tmp_path, n):
    with open(_INI, "rb") as f:
        bases = [f.read()] + corpus("ini")
    with Bounded("ini") as b:
        fuzz(_ini, n, b, bases, str(tmp_path / "df.cfg"))


def test_fuzz_ini_file(tmp_path):
    run_ini(tmp_path, SHORT)


# --------------------------------------------------------------------------- a DCP directory (import_dcp)

@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    """A real ``dcp.save`` directory (model and SGD-momentum state): its ``.metadata`` and data file."""
    pytest.importorskip("torch")
    from test_torch_dcp_import import _small_dcp
    d = str(tmp_path_factory.mktemp("dcp") / "src")
    _small_dcp(d)
    return {name: open(os.path.join(d, name), "rb").read() for name in sorted(os.listdir(d))}


def _dcp(bounded, files, root, data):
    import importlib
    reader = importlib.import_module("deepfreeze.torch.dcp_import")
    name = data.draw(st.sampled_from(sorted(files)), label="file")  # .metadata (a pickle) or a .distcp file
    raw = mutate_bytes(data, files[name], label=name)
    d = os.path.join(root, "d")
    if os.path.isdir(d):
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
    else:
        os.makedirs(d)
    for f, b in files.items():
        with open(os.path.join(d, f), "wb") as out:
            out.write(raw if f == name else b)
    bounded(lambda: reader._read(d, "model", "optim", {}), len(raw))


def run_dcp(dcp_dir, root, n):
    with Bounded("dcp_import") as b:
        fuzz(_dcp, n, b, dcp_dir, str(root))


def test_fuzz_dcp_import(dcp_dir, tmp_path):
    """import_dcp's reading of a DCP directory (the metadata through the allow-list unpickler and
    its checks, then DCP's reader with weights_only loads): only DeepFreezeErrors, bounded memory."""
    run_dcp(dcp_dir, tmp_path, SHORT)


@pytest.fixture(scope="module")
def dcp_state_dir(tmp_path_factory):
    """A real ``dcp.save`` directory with a ``state=`` dict holding a list of tensors (whose keys'
    planner-data paths end in list indices): its files."""
    pytest.importorskip("torch")
    import torch
    from test_torch_dcp_import import _small_dcp
    d = str(tmp_path_factory.mktemp("dcpstate") / "src")
    _small_dcp(d, {"sched": {"n": 3, "t": [torch.ones(2), torch.zeros(3), torch.ones(1)], "d": {"x": torch.ones(1)}}})
    return {name: open(os.path.join(d, name), "rb").read() for name in sorted(os.listdir(d))}


def _dcp_planner(bounded, files, root, data):
    """The ``planner_data`` mutator: 1 to 3 edits of the (self-made, trusted) metadata's paths of
    the ``state=``-mapped keys: an integer part set to anything in [-2^63, 2^63], a part added or
    dropped, a string part made an integer; then the import's read with ``state={"s": "sched"}``."""
    import importlib
    import pickle
    reader = importlib.import_module("deepfreeze.torch.dcp_import")
    md = pickle.loads(files[".metadata"])
    keys = sorted(k for k in md.planner_data if k.startswith("sched."))
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        k = data.draw(st.sampled_from(keys), label="key")
        path = list(md.planner_data[k])
        i = data.draw(st.integers(0, len(path)), label="part")
        big = data.draw(st.one_of(st.integers(-2 ** 63, 2 ** 63), st.sampled_from([2 ** 63, 2 ** 63 - 1, 2 * 10 ** 7,
                                                                                     len(keys), -1, 0])), label="int")
        op = data.draw(st.sampled_from(["set", "insert", "drop"]), label="op")
        if op == "set" and i < len(path):
            path[i] = big
        elif op == "insert":
            path.insert(i, big)
        elif path:
            del path[min(i, len(path) - 1)]
        md.planner_data[k] = tuple(path)
    raw = pickle.dumps(md)
    d = os.path.join(root, "p")
    os.makedirs(d, exist_ok=True)
    for f, b in files.items():
        with open(os.path.join(d, f), "wb") as out:
            out.write(raw if f == ".metadata" else b)
    bounded(lambda: reader._read(d, "model", "optim", {"s": "sched"}), len(raw))


def run_dcp_planner(dcp_state_dir, root, n):
    with Bounded("dcp_planner_data") as b:
        fuzz(_dcp_planner, n, b, dcp_state_dir, str(root))


def test_fuzz_dcp_planner_data(dcp_state_dir, tmp_path):
    """import_dcp's placing of ``state=`` values by their planner-data paths (issue 41): integer
    parts up to 2^63 are refused before anything is allocated, never a list grown to them. Half of
    :data:`_mutate.SHORT` (each example reads the directory through DCP: ~0.2 s); the campaign
    runs :data:`_mutate.LONG`."""
    run_dcp_planner(dcp_state_dir, tmp_path, max(SHORT // 2, 1))


# --------------------------------------------------------------------------- the long campaign

@pytest.mark.slow
def test_campaign(engine_ck, torch_record, ring_file, endpoint, repo_dir, memtier_image, dcp_dir, dcp_state_dir,
                  torch_repo, tmp_path):
    """Every decoder with :data:`_mutate.LONG` examples (``DEEPFREEZE_FUZZ_LONG``); prints the
    inputs fed to each."""
    TRIED.clear()
    run_manifest(engine_ck, LONG)
    run_shard(engine_ck, tmp_path, LONG)
    run_torch(torch_record, LONG)
    run_keras(LONG)
    run_ring(ring_file, tmp_path, LONG)
    run_endpoints(endpoint, tmp_path / "ep", LONG)
    run_redis(endpoint, LONG)
    run_frames(LONG)
    run_handshake(LONG)
    run_clone_wire(LONG)
    run_repo(repo_dir, tmp_path, LONG // 10)
    run_memtier(memtier_image, LONG)
    run_lease(tmp_path, LONG)
    run_ini(tmp_path, LONG)
    run_flush_job(engine_ck, LONG)
    run_dcp(dcp_dir, tmp_path / "dcp", LONG)
    run_dcp_planner(dcp_state_dir, tmp_path / "dcpp", LONG)
    run_torch_repo(torch_repo, tmp_path, LONG // 10)
    print("fuzz campaign, inputs per decoder:", json.dumps(TRIED, sort_keys=True))
    assert all(v >= LONG // 20 for v in TRIED.values()), TRIED


def test_deep_ring_meta_and_endpoint_file_are_stream_errors(ring_file, tmp_path, caplog):
    """The probe's cases: a ring whose meta is nested 5000 deep (header CRC valid) is a
    StreamError from SlotRing.open; an endpoint file nested 3000 deep is skipped by
    read_endpoints with a warning (RecursionError before issue 32)."""
    from deepfreeze.errors import StreamError
    from deepfreeze.stream import slots
    from deepfreeze.stream.core import endpoint_dir, read_endpoints
    meta = b"[" * 5000 + b"]" * 5000
    slots_n, capacity = struct.unpack_from("<IxxxxQ", ring_file, 8)
    lay = slots._layout(slots_n, capacity, len(meta))
    head = bytearray(ring_file[:128])
    head[12:16] = struct.pack("<I", len(meta))
    head[24:64] = struct.pack("<QQQQQ", *lay)
    raw = bytearray(bytes(head) + meta + b"\0" * (lay[4] - 128 - len(meta)))
    raw[64:68] = struct.pack("<I", zlib.crc32(bytes(raw[:64]) + meta))
    path = tmp_path / "ring"
    _write_new(str(path), bytes(raw))
    with pytest.raises(StreamError, match="nested deeper than 32"):
        slots.SlotRing.open(str(path), prefault=False)
    d = endpoint_dir(str(tmp_path / "p"), "chan")
    os.makedirs(d, mode=0o700)
    fd = os.open(os.path.join(d, "r0.json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, corpus("endpoint")[0])
    os.close(fd)
    skipped = []
    assert read_endpoints(str(tmp_path / "p"), "chan", skipped=skipped) == {} and len(skipped) == 1
    assert "nested deeper than 32" in caplog.text
