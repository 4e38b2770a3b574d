"""The ``deepfreeze`` command, run for real as a subprocess on real checkpoints."""
import json
import os
import pty
import struct
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

from deepfreeze import Config
from deepfreeze.backend import BackendClient
from deepfreeze.engine import Engine
from deepfreeze.tiers.persistent import PersistentLevel
from deepfreeze.tiers.scratch import ScratchLevel
from deepfreeze.loader import load
from deepfreeze.shardplan import ShardPlan, TensorSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["dense/kernel", "dense/bias", "emb/table", "head/w", "head/scale", "mask/m", "empty/z", "step"]


def model_arrays(seed):
    r = np.random.default_rng(seed)
    return [r.standard_normal((64, 50)).astype(np.float32), r.standard_normal(50).astype(np.float32),
            r.integers(-100, 100, (3, 3), dtype=np.int32), r.standard_normal(5000),
            r.standard_normal(7).astype(np.float16), r.random((2, 2)) > 0.5, np.zeros((0, 3), np.uint8),
            np.array(seed, dtype=np.int64)]


def make_job(root, world=2, nodes=1, versions=(2, 4, 6), name="job", arrays_of=None, names=NAMES, **cfg):
    """``world`` simulated ranks, rank r on node r % nodes (own scratch, own failure domain)."""
    arrays_of = arrays_of or model_arrays
    tensors = [TensorSpec(i, n, a.dtype.name, a.shape) for i, (n, a) in enumerate(zip(names, arrays_of(0)))]
    plan = ShardPlan.build(tensors, world, min_shard_bytes=1024)
    domains = [f"node{r % nodes}" for r in range(world)]
    engines = [Engine(Config.load(None, mode="sync", scratch=str(root / f"node{r % nodes}"),
                                  persistent=str(root / "pfs"), failure_domain=domains[r], **cfg),
                      name, r, plan, domains) for r in range(world)]
    for v in versions:
        arrays = arrays_of(v)
        for r, e in enumerate(engines):
            e.checkpoint(v, [arrays[p.tensor_id].reshape(-1)[p.start:p.stop].copy() for p in plan.for_rank(r)],
                         step=v, epoch=v // 4)
    for e in engines:
        e.close()
    return ["--set", f"scratch={root / 'node0'}", "--set", f"persistent={root / 'pfs'}"]


def cli(*args, code=0, stdin=None):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("VELOC_MODE", None)
    p = subprocess.run([sys.executable, "-m", "deepfreeze.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode == code, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    assert "Traceback" not in p.stderr
    if code == 0:
        assert p.stderr == ""  # no progress output: stderr is not a terminal
    return p


def cli_json(*args, code=0):
    return json.loads(cli(*args, "--json", code=code).stdout)


def config_of(args):
    return Config.load(None, mode="sync", scratch=args[1].split("=", 1)[1], persistent=args[3].split("=", 1)[1])


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def tree(path):
    out = []
    for d, _, files in os.walk(path):
        out += [os.path.join(d, f) for f in files]
    return sorted(out)


# --------------------------------------------------------------------------- the installed command

def test_console_script_installed():
    exe = os.path.join(ROOT, ".venv", "bin", "deepfreeze")
    assert os.path.exists(exe), "run: .venv/bin/pip install --no-build-isolation --no-deps -e ."
    p = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    for cmd in ("ls", "inspect", "verify", "export", "gc", "backend"):
        assert cmd in p.stdout


# --------------------------------------------------------------------------- ls

@pytest.mark.scratch_files("lists the scratch status of each version")
def test_ls_statuses_text_and_json(tmp_path):
    s = make_job(tmp_path)
    # an abandoned flush on persistent (no manifest) and a shard without manifest on scratch
    pers, scratch = PersistentLevel(str(tmp_path / "pfs")), ScratchLevel(str(tmp_path / "node0"))
    os.makedirs(pers.version_dir("job", 3))
    with open(os.path.join(pers.version_dir("job", 3), "model.dfz.partial"), "wb") as f:
        f.write(b"\0" * 100)
    os.makedirs(scratch.version_dir("job", 8))
    os.link(scratch.shard_path("job", 6, 0), scratch.shard_path("job", 8, 0))

    out = cli("ls", *s).stdout
    assert "checkpoint 'job'" in out and "newest restorable: v6 (scratch, persistent)" in out
    rows = {(ln.split()[0], int(ln.split()[1])): ln.split() for ln in out.splitlines()
            if ln.split() and ln.split()[0] in ("scratch", "persistent")}
    assert rows[("scratch", 6)][2:4] == ["6", "2"] and rows[("scratch", 6)][5] == "complete"
    assert rows[("persistent", 6)][5] == "committed"
    assert rows[("persistent", 3)][5] == "incomplete" and rows[("scratch", 8)][5] == "incomplete"
    assert rows[("persistent", 6)][-1] == pers.version_dir("job", 6)
    assert rows[("persistent", 6)][6] == "0000000000000000" and rows[("persistent", 6)][7] == "-"  # run, resumed from
    assert "abandoned (v6 is committed)" in out

    d = cli_json("ls", *s)
    (ck,) = d["checkpoints"]
    assert ck["name"] == "job" and ck["newest_restorable"] == 6
    assert ck["restorable"] == {"2": ["scratch", "persistent"], "4": ["scratch", "persistent"],
                                "6": ["scratch", "persistent"]}
    st = {(v["level"], v["version"]): v for v in ck["versions"]}
    assert {k: v["status"] for k, v in st.items()} == {
        ("scratch", 2): "complete", ("scratch", 4): "complete", ("scratch", 6): "complete",
        ("scratch", 8): "incomplete", ("persistent", 2): "committed", ("persistent", 3): "incomplete",
        ("persistent", 4): "committed", ("persistent", 6): "committed"}
    p6 = st[("persistent", 6)]
    assert p6["step"] == 6 and p6["epoch"] == 1 and p6["tensor_bytes"] == sum(a.nbytes for a in model_arrays(0))
    assert p6["bytes"] == sum(os.path.getsize(f) for f in tree(p6["path"]))
    assert st[("scratch", 8)]["step"] is None and "rank 0" in st[("scratch", 8)]["detail"]


@pytest.mark.scratch_files("a node's scratch reported partial")
def test_ls_multi_node_partial_and_several_names(tmp_path):
    s = make_job(tmp_path, world=3, nodes=2)
    make_job(tmp_path, world=1, versions=(5,), name="other")
    d = cli_json("ls", *s)
    assert [c["name"] for c in d["checkpoints"]] == ["job", "other"]
    job = d["checkpoints"][0]
    sc = [v for v in job["versions"] if v["level"] == "scratch"]
    assert [v["status"] for v in sc] == ["partial"] * 3  # node0 holds ranks 0 and 2; rank 1 is on node1
    assert "rank 1 on the scratch of other failure domains (node1)" in sc[0]["detail"]
    assert job["restorable"]["6"] == ["persistent"]
    # one name is needed where a single checkpoint is meant
    p = cli("inspect", *s, code=2)
    assert p.stderr.startswith("deepfreeze: error: several checkpoints") and "--name" in p.stderr
    assert cli_json("inspect", *s, "--name", "other")["version"] == 5
    out = cli("verify", *s, "--name", "job").stdout  # exit 0: the other node's shard is not damage
    assert "job v6 scratch    PARTIAL" in out and "job v6 persistent OK" in out
    p = cli("ls", *s, "--name", "nothing", code=1)
    assert "no checkpoint named 'nothing'" in p.stderr and "found: job, other" in p.stderr


def test_versions_skipped_by_persistent_interval(tmp_path):
    s = make_job(tmp_path, versions=(1, 2, 3), persistent_interval=3600)  # only v1 goes to persistent
    st = {(v["level"], v["version"]): v["status"] for v in cli_json("ls", *s)["checkpoints"][0]["versions"]}
    assert st[("persistent", 1)] == "committed" and st[("persistent", 2)] == st[("persistent", 3)] == "skipped"
    d = cli_json("verify", *s, "--all")  # a skipped version is not damage
    assert d["ok"] and [r["status"] for r in d["results"] if r["level"] == "persistent"] == \
        ["OK", "SKIPPED", "SKIPPED"]


# --------------------------------------------------------------------------- inspect

@pytest.mark.scratch_files("inspects the version on both levels")
def test_inspect_text_and_json(tmp_path):
    s = make_job(tmp_path, world=3, nodes=2)
    d = cli_json("inspect", *s)
    assert (d["name"], d["version"], d["step"], d["epoch"], d["world_size"]) == ("job", 6, 6, 1, 3)
    arrays = model_arrays(6)
    assert [(t["name"], t["dtype"], t["shape"], t["bytes"]) for t in d["tensors"]] == \
        [(n, a.dtype.name, list(a.shape), a.nbytes) for n, a in zip(NAMES, arrays)]
    assert d["total_bytes"] == sum(a.nbytes for a in arrays)
    assert d["plan_algorithm"] == "flat-v1"  # the compact plan record: the pieces below are derived
    assert d["failure_domains"] == {"node0": [0, 2], "node1": [1]}
    assert sum(r["bytes"] for r in d["ranks"]) == d["total_bytes"]
    assert [r["file"] for r in d["ranks"]] == ["r000000.dfs", "r000001.dfs", "r000002.dfs"]
    for t in d["tensors"]:  # the pieces tile every tensor
        size = int(np.prod(t["shape"]))
        assert t["pieces"][0]["start"] == 0 and t["pieces"][-1]["stop"] == size
        assert all(a["stop"] == b["start"] for a, b in zip(t["pieces"], t["pieces"][1:]))
    kernel = d["tensors"][0]
    # split points on 64-byte boundaries (16 float32 elements): 3200 * r // 3 rounded down
    assert [(p["rank"], p["start"], p["stop"]) for p in kernel["pieces"]] == [(0, 0, 1056), (1, 1056, 2128),
                                                                               (2, 2128, 3200)]
    assert {lv["level"]: lv["status"] for lv in d["levels"]} == {"scratch": "partial", "persistent": "committed"}
    assert d["assembled"]["checksums"] is True
    assert cli_json("inspect", *s, "--version", "4")["step"] == 4

    out = cli("inspect", *s).stdout
    assert "checkpoint 'job' version 6: step 6, epoch 2" in out
    assert "world size 3; 8 tensors" in out and "failure domains: node0 (ranks 0, 2); node1 (rank 1)" in out
    assert "dense/kernel  r0 [0, 1056)  r1 [1056, 2128)  r2 [2128, 3200)" in out
    assert "checksums yes" in out
    assert "does not" not in out
    p = cli("inspect", *s, "--version", "5", code=1)
    assert p.stderr.startswith("deepfreeze: error: version 5 has no readable manifest")


# --------------------------------------------------------------------------- verify

@pytest.mark.scratch_files("verifies and damages the scratch shards")
def test_verify_ok_then_damaged_shard_then_damaged_assembled(tmp_path):
    s = make_job(tmp_path)
    cfg = config_of(s)
    out = cli("verify", *s).stdout
    assert "job v6 scratch    OK" in out and "job v6 persistent OK" in out and "checksums verified" in out
    d = cli_json("verify", *s, "--all")
    assert d["ok"] and len(d["results"]) == 6 and {r["status"] for r in d["results"]} == {"OK"}
    assert all(r["checksums"] for r in d["results"])

    scratch = ScratchLevel(cfg.scratch)
    shard = scratch.shard_path("job", 6, 1)
    flip_byte(shard, os.path.getsize(shard) - 5)  # inside the last piece's data
    p = cli("verify", *s, code=1)
    assert "job v6 scratch    DAMAGED" in p.stdout and "checksum mismatch" in p.stdout
    assert "job v6 persistent OK" in p.stdout
    d = cli_json("verify", *s, code=1)
    assert not d["ok"] and [r["status"] for r in d["results"]] == ["DAMAGED", "OK"]
    assert shard in d["results"][0]["reason"]

    assembled = os.path.join(PersistentLevel(cfg.persistent).version_dir("job", 6), "model.dfz")
    flip_byte(assembled, os.path.getsize(assembled) - 5)
    d = cli_json("verify", *s, code=1)
    assert [r["status"] for r in d["results"]] == ["DAMAGED", "DAMAGED"]
    assert "checksum mismatch" in d["results"][1]["reason"] and d["results"][1]["path"] == assembled
    # the older versions are untouched
    assert cli_json("verify", *s, "--version", "4")["ok"]
    d = cli_json("verify", *s, "--all", code=1)
    assert [(r["version"], r["status"]) for r in d["results"]] == [
        (2, "OK"), (2, "OK"), (4, "OK"), (4, "OK"), (6, "DAMAGED"), (6, "DAMAGED")]
    # restore agrees: v6 cannot be read whole from either level
    assert load(cfg, "job").version == 4


@pytest.mark.scratch_files("damages a scratch shard")
def test_verify_incomplete_and_header_damage(tmp_path):
    s = make_job(tmp_path, versions=(2, 4))
    cfg = config_of(s)
    scratch = ScratchLevel(cfg.scratch)
    os.unlink(scratch.shard_path("job", 4, 1))  # lost shard on a single-node scratch: damage, not "partial"
    os.makedirs(PersistentLevel(cfg.persistent).version_dir("job", 3))  # empty, abandoned: not damage
    os.makedirs(PersistentLevel(cfg.persistent).version_dir("job", 1))
    open(os.path.join(PersistentLevel(cfg.persistent).version_dir("job", 1), "model.dfz.partial"), "wb").close()
    flip_byte(scratch.shard_path("job", 2, 0), 20)  # header byte: the header checksum catches it
    make_job(tmp_path, versions=(7,))
    with open(os.path.join(scratch.version_dir("job", 7), "manifest.json"), "r+b") as f:
        f.write(b"[")  # not JSON any more
    d = cli_json("verify", *s, "--all", code=1)
    got = {(r["level"], r["version"]): r for r in d["results"]}
    assert got[("scratch", 7)]["status"] == "DAMAGED" and "manifest unreadable" in got[("scratch", 7)]["reason"]
    assert got[("persistent", 7)]["status"] == "OK"
    ls = {(v["level"], v["version"]): v for v in cli_json("ls", *s)["checkpoints"][0]["versions"]}
    assert ls[("scratch", 7)]["status"] == "damaged" and ls[("scratch", 4)]["status"] == "incomplete"
    assert got[("scratch", 4)]["status"] == "DAMAGED" and "missing shards of rank 1" in got[("scratch", 4)]["reason"]
    assert got[("persistent", 1)]["status"] == "DAMAGED" and "incomplete" in got[("persistent", 1)]["reason"]
    assert got[("persistent", 3)]["status"] == "EMPTY" and "empty directory" in got[("persistent", 3)]["reason"]
    assert ls[("persistent", 3)]["status"] == "empty"
    assert got[("scratch", 2)]["status"] == "DAMAGED" and "header checksum" in got[("scratch", 2)]["reason"]
    assert got[("persistent", 2)]["status"] == got[("persistent", 4)]["status"] == "OK"
    p = cli("verify", *s, "--version", "9", code=1)
    assert p.stderr.startswith("deepfreeze: error: version 9 of 'job' is on no level")


def test_verify_progress_only_on_a_terminal(tmp_path):
    s = make_job(tmp_path, versions=(2,))
    master, slave = pty.openpty()
    try:
        p = subprocess.run([sys.executable, "-m", "deepfreeze.cli", "verify", *s], stdout=subprocess.PIPE,
                           stderr=slave, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
        os.close(slave)
        slave = None
        seen = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the terminal's other end is closed
                break
            if not chunk:
                break
            seen += chunk
    finally:
        if slave is not None:
            os.close(slave)
        os.close(master)
    assert p.returncode == 0 and "OK" in p.stdout
    assert b"verifying job v2" in seen and b"deepfreeze: error" not in seen


@pytest.mark.scratch_files("verifies the copies on both levels")
def test_verify_without_checksums(tmp_path):
    s = make_job(tmp_path, versions=(2,), chksum=False)
    d = cli_json("verify", *s)
    assert d["ok"] and [r["checksums"] for r in d["results"]] == [False, False]
    assert cli("verify", *s).stdout.count("no checksums stored (chksum = false)") == 2


# --------------------------------------------------------------------------- export

def read_safetensors(path):
    """Parse the format by hand: u64 LE header length, JSON header, data."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    codes = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "I32": "<i4", "I64": "<i8", "U8": "u1", "BOOL": "?"}
    meta = header.pop("__metadata__")
    out, end = {}, 0
    for name, info in header.items():
        start, stop = info["data_offsets"]
        assert start == end  # contiguous, in order, no gaps
        end = stop
        out[name] = np.frombuffer(body[start:stop], dtype=codes[info["dtype"]]).reshape(info["shape"])
    assert end == len(body)
    return meta, list(header), out


@pytest.mark.scratch_files("exports from the scratch copy too")
def test_export_npz_and_safetensors_bit_exact(tmp_path):
    s = make_job(tmp_path)
    cfg = config_of(s)
    ref = load(cfg, "job", 4)
    npz, st = tmp_path / "m.npz", tmp_path / "m.safetensors"
    out = cli("export", *s, "--version", "4", "--format", "npz", "--output", npz).stdout
    assert f"exported 'job' v4 (step 4, {len(NAMES)} tensors" in out and str(npz) in out
    with np.load(npz, allow_pickle=False) as z:
        assert list(z.keys()) == NAMES
        for n in NAMES:
            assert z[n].dtype == ref.arrays[n].dtype and z[n].shape == ref.arrays[n].shape
            assert z[n].tobytes() == ref.arrays[n].tobytes()
    with zipfile.ZipFile(npz) as zf:
        assert [i.compress_type for i in zf.infolist()] == [zipfile.ZIP_STORED] * len(NAMES)

    cli("export", *s, "--version", "4", "--output", st)  # format from the suffix
    meta, order, arrays = read_safetensors(st)
    assert meta == {"name": "job", "version": "4", "step": "4", "epoch": "1", "format": "deepfreeze"}
    assert sorted(order) == sorted(NAMES)  # the safetensors library orders them (dtype size, then name)
    for n in NAMES:
        assert arrays[n].dtype == ref.arrays[n].dtype and arrays[n].shape == ref.arrays[n].shape
        assert arrays[n].tobytes() == ref.arrays[n].tobytes()
    try:
        from safetensors.numpy import load_file
    except ImportError:
        pass
    else:
        got = load_file(str(st))
        assert all(got[n].tobytes() == ref.arrays[n].tobytes() for n in NAMES)

    # default version: the newest; existing output refused without --force; no temp file left behind
    p = cli("export", *s, "--output", npz, code=2)
    assert "exists: pass --force" in p.stderr
    cli("export", *s, "--output", npz, "--force")
    with np.load(npz) as z:
        assert z["step"] == 6
    assert sorted(os.listdir(tmp_path)) == ["m.npz", "m.safetensors", "node0", "pfs"]
    assert "cannot tell the format" in cli("export", *s, "-o", tmp_path / "m.bin", code=2).stderr
    assert "not committed" in cli("export", *s, "--version", "3", "-o", tmp_path / "x.npz", code=1).stderr


def test_export_bfloat16_to_safetensors_only(tmp_path):
    # In-process: the engine cannot write bfloat16 shards yet (format.crc32 and fsafe.write_all take a
    # memoryview of the array, which numpy refuses for ml_dtypes' bfloat16), so the writers are tested alone.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from deepfreeze.export import ExportError, write_h5, write_npz, write_safetensors
    w = np.random.default_rng(1).standard_normal((4, 5)).astype(ml_dtypes.bfloat16)
    write_safetensors({"lm/w": w}, str(tmp_path / "w.safetensors"), {"step": 1})
    with open(tmp_path / "w.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        assert header == {"__metadata__": {"step": "1"},
                          "lm/w": {"dtype": "BF16", "shape": [4, 5], "data_offsets": [0, 40]}}
        assert f.read() == w.tobytes()
    for writer, out in ((write_npz, "w.npz"), (write_h5, "w.h5")):
        with pytest.raises(ExportError, match="bfloat16.*safetensors"):
            writer({"lm/w": w}, str(tmp_path / out))
        assert not os.path.exists(tmp_path / out)


def test_export_safetensors_layouts_and_refusals(tmp_path):
    # The library reads an array's memory by pointer: strided views, big-endian and 0-d arrays must
    # still come out as their values; refused dtypes/names leave no file behind.
    from deepfreeze.export import ExportError, write_safetensors
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    arrays = {"strided": base[:, ::2], "transposed": base.T, "big": np.arange(5, dtype=">i4"),
              "scalar": np.array(2.5), "empty": np.zeros((0, 3), np.uint8)}
    out = tmp_path / "l.safetensors"
    n = write_safetensors(arrays, str(out), {"a": 1})
    assert n == os.path.getsize(out)
    meta, order, got = read_safetensors(out)
    assert meta == {"a": "1"} and sorted(order) == sorted(arrays)
    for k, a in arrays.items():
        assert got[k].shape == a.shape and got[k].dtype == a.dtype.newbyteorder("<")
        assert got[k].tobytes() == np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()
    assert "exists: pass --force" in str(pytest.raises(ExportError, write_safetensors, arrays, str(out)).value)
    write_safetensors({"x": base}, str(out), force=True)
    meta, order, got = read_safetensors(out)
    assert meta == {} and order == ["x"] and got["x"].tobytes() == base.tobytes()
    write_safetensors({}, str(tmp_path / "none.safetensors"))  # a valid file with no tensor
    from safetensors.numpy import load_file
    assert load_file(str(tmp_path / "none.safetensors")) == {}
    for bad, match in (({"c": np.zeros(2, np.complex64)}, "complex64.*does not define"),
                       ({"__metadata__": base}, "reserves that key")):
        with pytest.raises(ExportError, match=match):
            write_safetensors(bad, str(tmp_path / "bad.safetensors"))
    assert sorted(os.listdir(tmp_path)) == ["l.safetensors", "none.safetensors"]


def other_users_dir(path) -> str:
    """``path`` made a directory (mode 0755) owned by the account ``nobody``: a real second user.
    Skips unless the tests run as root (only root can give a directory away) and ``nobody`` exists."""
    import pwd
    if os.getuid() != 0:
        pytest.skip("needs root: a directory owned by a real second user (the account 'nobody') is made with chown")
    try:
        who = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no account 'nobody' on this host (the real second user of this test)")
    os.mkdir(path, 0o755)
    os.chown(path, who.pw_uid, who.pw_gid)
    os.chmod(path, 0o755)
    return str(path)


def unsafe_output_dir(tmp_path, whose: str) -> tuple[str, str]:
    """(a directory another user controls, what the refusal names): ``nobody``'s own, or one of
    ours that every user may write in (mode 0777, not sticky)."""
    d = tmp_path / f"out-{whose}"
    if whose == "nobody":
        return other_users_dir(d), "owned by nobody"
    os.mkdir(d)
    os.chmod(d, 0o777)
    return str(d), "mode 0777"


@pytest.mark.parametrize("whose", ["nobody", "world-writable"])
def test_export_refuses_an_output_directory_another_user_controls(tmp_path, whose):
    """Issue 41, item 2: ``deepfreeze export -o`` into a directory of another user (or one every
    user may write in) is refused with an UnsafePathError naming the directory, its owner and mode
    and the rule, before a byte is written. Before: written there without a word (its owner could
    swap the file for their own)."""
    s = make_job(tmp_path, versions=(2,))
    d, names = unsafe_output_dir(tmp_path, whose)
    for fmt in ("npz", "safetensors"):
        p = cli("export", *s, "-o", os.path.join(d, f"m.{fmt}"), code=1)
        assert names in p.stderr and f"{d} (owned by " in p.stderr and "nothing written" in p.stderr, p.stderr
        assert "DeepFreeze writes only into a directory owned by you or root" in p.stderr, p.stderr
        assert os.listdir(d) == []
    ok = tmp_path / "mine"  # the same export into a directory of one's own is written
    ok.mkdir()
    cli("export", *s, "-o", ok / "m.npz")
    assert os.listdir(ok) == ["m.npz"]


def test_export_into_a_group_writable_directory_needs_shared_group(tmp_path):
    """Issue 41, item 2: a group-writable output directory is the user's choice to trust the group:
    refused by default, written with ``shared_group = true``."""
    s = make_job(tmp_path, versions=(2,))
    d = tmp_path / "group"
    d.mkdir()
    os.chmod(d, 0o770)
    p = cli("export", *s, "-o", d / "m.npz", code=1)
    assert "writable by group" in p.stderr and "shared_group = true" in p.stderr and str(d) in p.stderr, p.stderr
    assert os.listdir(d) == []
    cli("export", *s, "--set", "shared_group=true", "-o", d / "m.npz")
    assert os.listdir(d) == ["m.npz"]


def test_export_h5_loads_into_keras_bit_exact(tmp_path):
    tf = pytest.importorskip("tensorflow")
    h5py = pytest.importorskip("h5py")
    sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
    from models import build
    from deepfreeze.keras import DeepFreezeCheckpoint

    model = build()
    model.compile(optimizer=tf.keras.optimizers.SGD(0.05, momentum=0.9), loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="k", mode="sync", scratch=str(tmp_path / "node0"),
                                persistent=str(tmp_path / "pfs"), min_shard_bytes=0)
    r = np.random.default_rng(0)
    x, y = r.random((64, 12, 12, 1), dtype=np.float32), r.integers(0, 10, 64)
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt], verbose=0)
    ckpt.close()
    trained = model.get_weights()
    s = ["--set", f"scratch={tmp_path / 'node0'}", "--set", f"persistent={tmp_path / 'pfs'}", "--name", "k"]

    out = tmp_path / "weights.h5"
    cli("export", *s, "--format", "h5", "--output", out)
    fresh = build()
    assert any(a.tobytes() != b.tobytes() for a, b in zip(fresh.get_weights(), trained))
    fresh.load_weights(str(out))
    assert all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(fresh.get_weights(), trained))
    ck = load(config_of(s), "k")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(ck.model_arrays().values(), trained))

    # the same layout as model.save_weights writes (groups, attributes, dataset names and values)
    model.save_weights(str(tmp_path / "ref.h5"))

    def layout(path):
        items = {}
        with h5py.File(path, "r") as f:
            def visit(name, obj):
                attrs = {k: [str(v) for v in np.atleast_1d(obj.attrs[k])] for k in obj.attrs}
                data = obj[()].tobytes() if isinstance(obj, h5py.Dataset) else None
                items[name] = (type(obj).__name__, attrs, data)
            visit("/", f)
            f.visititems(visit)
        return items

    mine, ref = layout(out), layout(tmp_path / "ref.h5")
    for flat in [n for n in ref["/"][1]["layer_names"] if n.startswith("flatten")]:
        ref["/"][1]["layer_names"].remove(flat)  # a layer without weights: not in the checkpoint
        del ref[flat]
    assert mine == ref


# --------------------------------------------------------------------------- gc

@pytest.mark.scratch_files("gc of scratch versions")
def test_gc_dry_run_then_real(tmp_path):
    s = make_job(tmp_path, versions=(1, 2, 3, 4, 5))  # written keeping everything
    cfg = config_of(s)
    pers, scratch = PersistentLevel(cfg.persistent), ScratchLevel(cfg.scratch)
    os.makedirs(pers.version_dir("job", 0))  # an abandoned flush, older than the newest commit: removed
    with open(os.path.join(pers.version_dir("job", 0), "model.dfz.partial"), "wb") as f:
        f.write(b"x")
    os.makedirs(pers.version_dir("job", 9))  # newer than the newest commit (maybe in progress): kept
    keep = ["--set", "max_versions=2", "--set", "scratch_versions=1"]
    before = tree(tmp_path)

    dry = cli("gc", *s, *keep, "--dry-run").stdout
    assert tree(tmp_path) == before  # nothing removed
    would = sorted(ln.split(":")[0] for ln in dry.splitlines() if ln.startswith("would remove"))
    assert would == ["would remove persistent v0", "would remove persistent v1", "would remove persistent v2",
                     "would remove persistent v3", "would remove scratch v1", "would remove scratch v2",
                     "would remove scratch v3", "would remove scratch v4"]
    assert "nothing was removed" in dry

    real = cli("gc", *s, *keep).stdout
    assert sorted(ln.split(":")[0] for ln in real.splitlines() if ln.startswith("removed")) == \
        [w.replace("would remove", "removed") for w in would]
    assert pers.versions("job") == [4, 5, 9] and pers.committed_versions("job") == [4, 5]
    assert scratch.versions("job") == [5]
    assert cli("gc", *s, *keep).stdout.splitlines()[-1] == "nothing to remove"
    assert load(cfg, "job").version == 5


def test_gc_keeps_scratch_versions_not_yet_on_persistent(tmp_path):
    s = make_job(tmp_path, versions=(1, 2, 3), persistent_interval=-1)
    cfg = config_of(s)
    # with persistent_interval = -1 nothing goes to persistent: scratch retention counts every version
    cli("gc", *s, "--set", "scratch_versions=1", "--set", "persistent_interval=-1")
    assert ScratchLevel(cfg.scratch).versions("job") == [3]
    # with flushes expected but none committed yet, no scratch version is old enough to remove
    s2 = make_job(tmp_path / "b", versions=(1, 2, 3), persistent_interval=-1)
    out = cli("gc", *s2, "--set", "scratch_versions=1").stdout
    assert "a flush may still need it" in out and ScratchLevel(config_of(s2).scratch).versions("job") == [1, 2, 3]


# --------------------------------------------------------------------------- backend

def test_backend_status_and_stop(tmp_path):
    s = ["--set", f"scratch={tmp_path / 'node0'}", "--set", f"persistent={tmp_path / 'pfs'}"]
    assert "not running" in cli("backend", "status", *s).stdout
    assert "not running" in cli("backend", "stop", *s).stdout
    client = BackendClient(str(tmp_path / "node0"))  # starts one, as an async rank does
    try:
        d = cli_json("backend", "status", *s)
        assert d["running"] and d["pid"] == client.pid and d["pending"] == 0 and d["clients"] == 1
        assert f"running, pid {client.pid}" in cli("backend", "status", *s).stdout
        assert f"backend pid {client.pid} for scratch {tmp_path / 'node0'}: stopped" in \
            cli("backend", "stop", *s).stdout
    finally:
        client.close()
    assert "not running" in cli("backend", "status", *s).stdout


# --------------------------------------------------------------------------- errors

def test_errors_are_one_line_with_exit_codes(tmp_path):
    s = make_job(tmp_path, versions=(2,))
    bad_cfg = tmp_path / "bad.cfg"
    bad_cfg.write_text("mode = async\nscratch = /tmp/a\npersistent = /tmp/b\nmax_version = 3\n")
    cases = [
        (["ls", "--config", bad_cfg], 2, f"{bad_cfg}:4: unknown key 'max_version'"),
        (["ls", "--config", tmp_path / "missing.cfg"], 2, "does not exist"),
        (["ls", *s, "--set", "max_versions=three"], 2, "--set: max_versions = 'three' is invalid"),
        (["ls", *s, "--set", "nope=1"], 2, "unknown key 'nope'"),
        (["ls", *s, "--set", "scratch"], 2, "expected KEY=VALUE"),
        (["ls", "--set", "scratch=/tmp/x"], 2, "'persistent' is missing"),
        (["ls", *s, "--name", "../etc"], 2, "invalid checkpoint name"),
        (["inspect", *s, "--version", "-1"], 2, "invalid version"),
        (["verify", *s, "--all", "--version", "2"], 2, "not allowed with argument"),
        (["frobnicate"], 2, "invalid choice"),
        (["inspect", *s, "--version", "7"], 1, "version 7 has no readable manifest"),
        (["verify", "--set", f"scratch={tmp_path / 'e1'}", "--set", f"persistent={tmp_path / 'e2'}"], 1,
         "no checkpoints in scratch"),
    ]
    for args, code, text in cases:
        p = cli(*args, code=code)
        assert p.stderr.startswith("deepfreeze: error: ") and p.stderr.count("\n") == 1, (args, p.stderr)
        assert text in p.stderr, (args, p.stderr)
        assert p.stdout == ""
    # a config file works like the callback's; VELOC_<KEY> applies on top of it, --set on top of both
    good = tmp_path / "good.cfg"
    good.write_text(f"mode = async\nscratch = {tmp_path / 'node0'}\npersistent = /nonexistent\n")
    p = subprocess.run([sys.executable, "-m", "deepfreeze.cli", "ls", "--config", str(good), "--json"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT, VELOC_PERSISTENT=str(tmp_path / "pfs")))
    assert p.returncode == 0 and json.loads(p.stdout)["checkpoints"][0]["newest_restorable"] == 2


@pytest.mark.scratch_files("gc of a scratch version directory")
def test_gc_reports_only_what_it_removed(tmp_path):
    """Each "removed" line names what is gone, compared with before: a scratch directory that
    stays (a stray file in it; gc used to say "and the directory") is said to stay, with what it
    still holds; nothing is reported that is still there."""
    s = make_job(tmp_path, versions=(1, 2, 3, 4))
    cfg = config_of(s)
    pers, scratch = PersistentLevel(cfg.persistent), ScratchLevel(cfg.scratch)
    with open(os.path.join(scratch.version_dir("job", 1), "notes.txt"), "w") as f:
        f.write("mine")
    keep = ["--set", "max_versions=2", "--set", "scratch_versions=2"]
    dry = cli("gc", *s, *keep, "--dry-run").stdout
    assert "would remove persistent v1: directory" in dry and "would remove scratch v1" in dry, dry
    before = tree(tmp_path)
    out = cli("gc", *s, *keep).stdout
    gone = set(before) - set(tree(tmp_path))
    lines = out.splitlines()
    said = [ln for ln in lines if ln.startswith("removed ")]
    assert len(said) == 4, out  # persistent v1, v2; scratch v1, v2
    s1 = next(ln for ln in said if ln.startswith("removed scratch v1:"))
    assert "r000000.dfs" in s1 and "the directory stays, holding notes.txt" in s1, s1
    for v in (1, 2):
        assert f"removed persistent v{v}: directory (committed, older" in out and not os.path.exists(
            pers.version_dir("job", v))
    # every version named removed lost files; every file gone was in a version named removed
    named = {(ln.split()[1], int(ln.split()[2][1:-1])) for ln in said}
    dirs = {(lv, v): (pers if lv == "persistent" else scratch).version_dir("job", v) + os.sep for lv, v in named}
    assert all(any(g.startswith(d) for g in gone) for d in dirs.values()), (dirs, gone)
    assert all(any(g.startswith(d) for d in dirs.values()) for g in gone), (dirs, gone)
    assert os.path.exists(os.path.join(scratch.version_dir("job", 1), "notes.txt"))
    again = cli("gc", *s, *keep).stdout.splitlines()
    assert not [ln for ln in again if ln.startswith("removed ")], again  # nothing more is gone


def test_backend_removes_stale_start_locks_as_it_exits(tmp_path):
    """A backend that exits removes its own start lock and those left by killed backends (no
    socket, nobody holding them); a lock a starting client holds, or one whose socket is there,
    stays. A client whose lock file was removed under it takes the new one."""
    import fcntl
    from deepfreeze.backend import remove_stale_locks, runtime_dir, socket_path
    rd = runtime_dir()
    stale, held, live = (os.path.join(rd, f"backend-{k * 16}.sock.lock") for k in "abc")
    for p in (stale, held, live):
        open(p, "w").close()
    open(live[:-len(".lock")], "w").close()  # stands for a listening backend's socket
    holder = open(held)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a client starting a backend
    s = ["--set", f"scratch={tmp_path / 'node0'}", "--set", f"persistent={tmp_path / 'pfs'}"]
    own = socket_path(str(tmp_path / "node0")) + ".lock"
    try:
        client = BackendClient(str(tmp_path / "node0"))  # starts one, under its start lock
        assert os.path.exists(own)
        assert "stopped" in cli("backend", "stop", *s).stdout
        client.close()
        deadline = time.monotonic() + 10  # the backend removes them on its way out, after its socket
        while os.path.exists(own) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(own) and not os.path.exists(stale)
        assert os.path.exists(held) and os.path.exists(live)
        assert os.path.basename(held) not in remove_stale_locks(rd)  # the held one stays while held
        holder.close()
        assert os.path.basename(held) in remove_stale_locks(rd) and os.path.exists(live)
    finally:
        holder.close()
        os.unlink(live[:-len(".lock")])
    os.unlink(live)
    client = BackendClient(str(tmp_path / "node0"))  # a new start after the removal: works
    client.close()
