"""Memory-tier capacity (issue 24, item 5): restarts on a device sized as the docs advise, a run's
regions reclaimed once a newer run of its job has a DONE version, finished jobs evicted when space
is needed (never a live one), a damaged entry quarantined, ``memtier rm``, ``repack`` exit codes.

Real processes (one per run, tests/workers/memtier_job.py), a real device under /dev/shm."""
import json
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from _util import ROOT, WORKERS
from deepfreeze import memtier
from deepfreeze.memtier import device as mdev
from deepfreeze.memtier import layout as mlayout
from deepfreeze.lease import Version, new_run_id
from deepfreeze.shardplan import ShardPlan, TensorSpec

sys.path.insert(0, WORKERS)
import memtier_job  # noqa: E402

JOB = os.path.join(WORKERS, "memtier_job.py")


def region_len():
    """Bytes of one 2-slot region of memtier_job's model (registered on a scratch device)."""
    path = f"/dev/shm/deepfreeze-test-cap-probe-{uuid.uuid4().hex[:8]}"
    try:
        with mdev.create(path, "8M") as dev:
            specs = [TensorSpec(i, f"t{i}", a.dtype.name, a.shape) for i, a in enumerate(memtier_job.state(0, 0))]
            plan = ShardPlan.build(specs, 1, min_shard_bytes=1024)
            run = new_run_id()
            idx = mlayout.make_index(plan, 0, "job", run)
            meta = mlayout.manifest_capacity(len(plan.tensors), len(plan.pieces), 1)
            r = dev.register_shard("job", run, 0, 1, index=idx, image_size=idx["file_size"], meta_cap=meta)
            return r.region_len, r.image_size
    finally:
        os.unlink(path)


@pytest.fixture
def sized():
    """A device whose data area is 2.2x one version of the job (1.1x its 2-slot region), as the
    docs advise; yields (path, region bytes)."""
    n, _ = region_len()
    path = f"/dev/shm/deepfreeze-test-cap-{uuid.uuid4().hex[:10]}"
    data_start = mdev._align(mlayout.PAGE + mdev.DEFAULT_TABLE_CAP * mdev.ENTRY_SIZE)
    mdev.create(path, data_start + mdev._align(int(1.1 * n))).close()
    yield path, n
    os.unlink(path)


def run_job(tmp_path, label, device, root, seed, role, versions=()):
    result = str(tmp_path / label)
    p = subprocess.run([sys.executable, JOB, result, device, str(root), str(seed), role,
                        ",".join(map(str, versions))], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-4000:]
    with open(f"{result}.r0.json") as f:
        row = json.load(f)
    assert row["error"] is None, (label, row["error"], p.stderr[-3000:])
    return row, p.stderr


def cli(*args):
    return subprocess.run([sys.executable, "-m", "deepfreeze.cli", "memtier", *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))


def test_restarts_on_a_device_sized_as_advised_all_succeed(tmp_path, sized):
    """Six runs of one job (a fresh one, then five resumes) on a device with room for one 2-slot
    region: every restart registers (the previous run's region is evicted once resume has read
    it), every resume restores the previous run's newest version from the tier, bit-exact."""
    device, _ = sized
    root = tmp_path / "a"
    prev, _ = run_job(tmp_path, "r0", device, root, 1, "train", [1, 2])
    for i in range(1, 6):
        vs = [2 * i + 1, 2 * i + 2]
        row, err = run_job(tmp_path, f"r{i}", device, root, 1, "resume", vs)
        got = row["restored"]
        assert (got["version"], got["level"]) == (2 * i, "memtier"), (i, got)
        assert got["sha"] == prev["written"][str(2 * i)]
        prev = row
    with mdev.open(device, writable=False) as dev:
        (r,) = dev.shards()  # only the last run's region is left
        assert r.run == prev["run"] and r.newest()[1].version == Version(0, 12)


def test_a_newer_run_reclaims_the_older_runs_regions(tmp_path):
    """With room for both, the older run's region is retired as soon as the newer run of the same
    job (same job id) has a DONE version; another job's finished region of the same name stays."""
    n, _ = region_len()
    device = f"/dev/shm/deepfreeze-test-cap-{uuid.uuid4().hex[:10]}"
    mdev.create(device, "24M").close()
    try:
        b, _ = run_job(tmp_path, "b", device, tmp_path / "b", 2, "train", [1])  # another job, same name
        a1, _ = run_job(tmp_path, "a1", device, tmp_path / "a", 1, "train", [1, 2])
        free = mdev.view(device)["free"]
        a2, _ = run_job(tmp_path, "a2", device, tmp_path / "a", 1, "resume", [3])
        info = mdev.view(device)
        assert sorted(m["run"] for m in info["models"]) == sorted([b["run"], a2["run"]])
        assert info["free"] == free  # a2's region took exactly what a1's gave back
        assert all(m["finished"] for m in info["models"])  # released leases: finished, not live
        assert cli("repack", device).returncode == 0  # finished: compacted to one slot each
        p = cli("repack", device, "--json")
        assert p.returncode == 1 and "nothing to free" in p.stderr  # nothing left: says so, exit 1
    finally:
        os.unlink(device)


def test_finished_jobs_are_evicted_when_space_is_needed_never_live_ones(tmp_path, sized):
    device, n = sized
    x, _ = run_job(tmp_path, "x", device, tmp_path / "x", 3, "train", [1, 2])  # finished job X
    y, err = run_job(tmp_path, "y", device, tmp_path / "y", 4, "train", [5])  # job Y needs X's space
    assert "evicted finished model" in err and x["run"] in err
    ry, _ = run_job(tmp_path, "y-restore", device, tmp_path / "y", 4, "restore")
    assert ry["restored"]["level"] == "memtier" and ry["restored"]["sha"] == y["written"]["5"]
    # a live model (a standalone one of this process, not closed) is never evicted
    with mdev.open(device, writable=False) as dev:
        (yr,) = dev.shards()
        y_len = yr.region_len
    cli("rm", device, "job")
    arrays = {"w": np.zeros(y_len // 5 // 8, np.float64)}  # its region: well under half the device
    with memtier.register(device, "live", arrays) as live_model:
        memtier.checkpoint(live_model, arrays, 1)
        root = tmp_path / "z"
        result = str(tmp_path / "z")
        p = subprocess.run([sys.executable, JOB, result, device, str(root), "5", "train", "1"], capture_output=True,
                           text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
        assert os.path.exists(f"{result}.r0.json"), p.stderr[-3000:]
        with open(f"{result}.r0.json") as f:
            assert "MemtierFullError" in json.load(f)["error"]
        got, v = memtier.restore(device, "live")
        assert v.step == 1


def test_rm_and_repack_exit_codes(tmp_path):
    device = f"/dev/shm/deepfreeze-test-cap-{uuid.uuid4().hex[:10]}"
    mdev.create(device, "16M").close()
    try:
        a1, _ = run_job(tmp_path, "a1", device, tmp_path / "a", 1, "train", [1])
        b, _ = run_job(tmp_path, "b", device, tmp_path / "b", 2, "train", [1])
        arrays = {"w": np.arange(10.0)}
        with memtier.register(device, "m", arrays):  # live: rm refuses it
            p = cli("rm", device, "m")
            assert p.returncode == 1 and "live" in p.stderr
        p = cli("rm", device, "job", "--run", a1["run"], "--json")
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        assert out["retired"] == 1 and out["freed_bytes"] > 0
        assert sorted(x["run"] for x in mdev.view(device)["models"] if x["name"] == "job") == [b["run"]]
        p = cli("rm", device, "job", "--run", a1["run"])
        assert p.returncode == 1 and "no model" in p.stderr
        p = cli("rm", device, "m")
        assert p.returncode == 0 and "retired 1" in p.stdout
        free = mdev.view(device)["free"]
        p = cli("repack", device, "--json")  # b is finished: compacted to one slot
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        assert out["moved"] == 1 and mdev.view(device)["free"] - free == out["freed_bytes"] > 0  # frees what it says
        p = cli("repack", device)
        assert p.returncode == 1 and "nothing to free" in p.stderr
    finally:
        os.unlink(device)


def test_damaged_entry_is_quarantined(tmp_path):
    """One damaged table entry: that model unreadable, everything else usable (restore, a new job's
    run), view shows it, rm --entry drops it."""
    device = f"/dev/shm/deepfreeze-test-cap-{uuid.uuid4().hex[:10]}"
    mdev.create(device, "16M").close()
    try:
        a, _ = run_job(tmp_path, "a", device, tmp_path / "a", 1, "train", [1, 2])
        b, _ = run_job(tmp_path, "b", device, tmp_path / "b", 2, "train", [3])
        with mdev.open(device) as dev:
            (ra,) = [r for r in dev.shards() if r.run == a["run"]]
            no = ra.entry_no
            dev.mm[ra._e.index_off + 5] ^= 0xFF  # the index of A's entry: checksum fails
        info = mdev.view(device)
        assert [q["entry"] for q in info["quarantined"]] == [no] and [m["run"] for m in info["models"]] == [b["run"]]
        p = cli("view", device)
        assert p.returncode == 0 and f"entry {no}" in p.stdout
        rb, _ = run_job(tmp_path, "b-restore", device, tmp_path / "b", 2, "restore")
        assert rb["restored"]["level"] == "memtier" and rb["restored"]["sha"] == b["written"]["3"]
        ra_, _ = run_job(tmp_path, "a-restore", device, tmp_path / "a", 1, "restore")  # from persistent instead
        assert ra_["restored"]["level"] == "persistent" and ra_["restored"]["sha"] == a["written"]["2"]
        c, _ = run_job(tmp_path, "c", device, tmp_path / "c", 3, "train", [1])  # new registrations work
        p = cli("rm", device, "--entry", str(no))
        assert p.returncode == 0, p.stderr
        assert mdev.view(device)["quarantined"] == []
    finally:
        os.unlink(device)
