"""Job identity in the memory tier (issue 23, item 4).

Two jobs with one checkpoint name and different persistent directories share one node's device:
each restores, resumes, lists and verifies only its own versions (bit-exact against the SHA-256
the writing run recorded), a fresh third job restores neither, and regions written without a job
id (what DeepFreeze wrote before job ids: an MIndex without ``job``) stay readable by the
standalone tools but are never restored into a job that has an id. Real processes (one per job,
``mpirun -np 2`` for the 2-rank case), a real device under /dev/shm, real persistent directories.
"""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from _util import memtier_device, ROOT, WORKERS, mpirun
from deepfreeze import memtier
from deepfreeze.errors import CheckpointNotFoundError, MemtierError
from deepfreeze.memtier import device as mdev
from deepfreeze.lease import read_job_id, valid_job_id

sys.path.insert(0, WORKERS)
import memtier_job  # noqa: E402

JOB = os.path.join(WORKERS, "memtier_job.py")


@pytest.fixture
def device():
    with memtier_device("jobs", "48M") as path:
        yield path


def run_job(tmp_path, label, device, root, seed, role, versions=(), np_=1):
    """Run one job's worker (``np_`` ranks) and return its per-rank results."""
    result = str(tmp_path / f"{label}")
    args = [JOB, result, device, str(root), str(seed), role, ",".join(map(str, versions))]
    if np_ == 1:
        p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, PYTHONPATH=ROOT))
        assert p.returncode == 0, p.stderr[-4000:]
        stderr = p.stderr
    else:
        stderr = mpirun(np_, *args).stderr
    rows = []
    for r in range(np_):
        with open(f"{result}.r{r}.json") as f:
            row = json.load(f)
        assert row["error"] is None, (label, row["error"], stderr[-3000:])
        rows.append(row)
    return rows, stderr


def assert_restored(row, version, level, written):
    got = row["restored"]
    assert got is not None and "none" not in got, got
    assert (got["version"], got["level"]) == (version, level), got
    assert got["sha"] == written[str(version)]  # bit-exact: the bytes the writing run handed over


def cli(*args):
    p = subprocess.run([sys.executable, "-m", "deepfreeze.cli", *args], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    return p


def cfg_args(root, device):
    return ["--set", f"scratch={root}/scratch-r0", "--set", f"persistent={root}/pfs", "--set", f"memtier={device}"]


def test_two_jobs_one_name_one_device(tmp_path, device):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    (wa,), _ = run_job(tmp_path, "a-train", device, a, 1, "train", [1, 2, 3])
    (wb,), _ = run_job(tmp_path, "b-train", device, b, 2, "train", [1, 2, 3, 4, 5])  # B is newer, same name
    assert valid_job_id(wa["job"]) and valid_job_id(wb["job"]) and wa["job"] != wb["job"]
    assert read_job_id(str(a / "pfs"), "job") == wa["job"]
    with mdev.open(device, writable=False) as dev:  # every region records its job
        assert sorted(r.job for r in dev.find("job")) == sorted([wa["job"], wb["job"]])

    # restore: each job its own newest version, from the memory tier, bit-exact
    (ra,), err_a = run_job(tmp_path, "a-restore", device, a, 1, "restore")
    assert_restored(ra, 3, "memtier", wa["written"])
    assert err_a.count("not of this job") == 1 and wb["run"] in err_a  # said once, naming what was ignored
    (rb,), _ = run_job(tmp_path, "b-restore", device, b, 2, "restore")
    assert_restored(rb, 5, "memtier", wb["written"])

    # a fresh third job (no job file yet) restores neither; its first run makes its own id
    (rc,), _ = run_job(tmp_path, "c-restore", device, c, 3, "restore")
    assert "none" in rc["restored"] and rc["job"] is None
    (wc,), _ = run_job(tmp_path, "c-resume", device, c, 3, "resume", [1])
    assert "none" in wc["restored"] and wc["job"] not in (wa["job"], wb["job"])

    # resume=True: A continues from its own v3 (not B's v5), then writes v4; A's restore gives v4
    (ma,), _ = run_job(tmp_path, "a-resume", device, a, 1, "resume", [4])
    assert_restored(ma, 3, "memtier", wa["written"])
    assert ma["job"] == wa["job"] and ma["run"] != wa["run"]
    (ra,), _ = run_job(tmp_path, "a-restore2", device, a, 1, "restore")
    assert_restored(ra, 4, "memtier", ma["written"])

    # ls and verify: the tier shows A's versions only, and says once which regions it ignored
    p = cli("ls", "--name", "job", "--json", *cfg_args(a, device))
    assert p.returncode == 0, p.stderr
    (ck,) = json.loads(p.stdout)["checkpoints"]
    tier = [v for v in ck["versions"] if v["level"] == "memtier"]
    # A's versions only: its resumed run's v4 (its first run's regions were reclaimed once v4 was DONE)
    assert [(v["version"], v["run"]) for v in tier] == [(4, ma["run"])]
    assert ck["newest_restorable"] == 4
    ignored = " ".join(ck["memtier_ignored"])
    assert wb["run"] in ignored and wc["run"] in ignored and "another job" in ignored
    assert "not of this job" not in p.stderr  # the listing says it, not a log line besides
    p = cli("ls", "--name", "job", *cfg_args(b, device))
    assert p.returncode == 0 and p.stdout.count("ignored") == 1 and ma["run"] in p.stdout  # (wa: reclaimed)
    assert "v5" in p.stdout.splitlines()[-1]  # newest restorable: B's own v5
    p = cli("verify", "--name", "job", "--json", *cfg_args(a, device))
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads(p.stdout)
    assert got["ok"] and {(r["level"], r["version"], r["status"]) for r in got["results"]} >= {("memtier", 4, "OK")}
    assert wb["run"] in " ".join(got["memtier_ignored"])
    # ls without --name lists the name for each job (its own regions), never for a job with none there
    p = cli("ls", "--json", *cfg_args(tmp_path / "d", device))
    assert p.returncode == 0 and json.loads(p.stdout)["checkpoints"] == []


def test_two_rank_jobs_one_device(tmp_path, device):
    """Both ranks of each job on one device (one node), 2-rank runs under mpirun."""
    a, b = tmp_path / "a", tmp_path / "b"
    wa, _ = run_job(tmp_path, "a-train", device, a, 11, "train", [1, 2], np_=2)
    wb, _ = run_job(tmp_path, "b-train", device, b, 12, "train", [1, 2, 3, 4], np_=2)
    assert wa[0]["job"] == wa[1]["job"] != wb[0]["job"] == wb[1]["job"]
    ma, _ = run_job(tmp_path, "a-resume", device, a, 11, "resume", [3], np_=2)
    for row in ma:  # every rank restored A's own v2 from the tier, bit-exact
        assert_restored(row, 2, "memtier", wa[0]["written"])
    (rb,), _ = run_job(tmp_path, "b-restore", device, b, 12, "restore")  # one rank reads both of B's regions
    assert_restored(rb, 4, "memtier", wb[0]["written"])
    (ra,), _ = run_job(tmp_path, "a-restore", device, a, 11, "restore")
    assert_restored(ra, 3, "memtier", ma[0]["written"])


def test_regions_without_a_job_id(tmp_path, device):
    """A device written by DeepFreeze before job ids: an engine region without ``job`` in its MIndex
    (an engine without a run and a name without a job file writes exactly that, as the code at
    main did for every engine), plus a standalone model without a job."""
    legacy = tmp_path / "legacy"
    (wl,), _ = run_job(tmp_path, "legacy", device, legacy, 5, "train-anon", [1, 2, 3])
    assert wl["job"] is None and not os.path.exists(legacy / "pfs" / "job" / "job")
    with mdev.open(device, writable=False) as dev:
        (r,) = dev.find("job")
        raw = bytes(dev.mm[r._e.index_off:r._e.index_off + r._e.index_len])
        assert b'"job":' not in raw and r.job is None  # the MIndex as the code at main wrote it
    # the standalone tools still read it: view, memtier.restore (job unknown), dump --job unknown
    info = memtier.view(device)
    (m,) = [m for m in info["models"] if m["name"] == "job"]
    assert m["job"] is None and not info["problems"]
    got, v = memtier.restore(device, "job")
    assert v.step == 3 and memtier_job.digests(got[f"t{i}"] for i in range(3)) == wl["written"]["3"]
    p = cli("memtier", "view", device)
    assert p.returncode == 0 and "unknown" in p.stdout
    # a reader without a job id (this persistent has no job file) still restores it from the tier
    (rl,), _ = run_job(tmp_path, "legacy-restore", device, legacy, 5, "restore")
    assert_restored(rl, 3, "memtier", wl["written"])
    # the name's first run with job ids makes one: the job-unknown region is never restored into it;
    # resume falls back to persistent (same bytes, flushed by the old run)
    (ml,), err = run_job(tmp_path, "legacy-resume", device, legacy, 5, "resume", [4])
    assert valid_job_id(ml["job"])
    assert_restored(ml, 3, "persistent", wl["written"])
    assert "job unknown" in err
    # another job with an id never sees it either
    (wa,), _ = run_job(tmp_path, "a-train", device, tmp_path / "a", 1, "train", [7])
    (ra,), err = run_job(tmp_path, "a-restore", device, tmp_path / "a", 1, "restore")
    assert_restored(ra, 7, "memtier", wa["written"])
    assert wl["run"] in err and "job unknown" in err
    # dump needs a job when several share the name; 'unknown' picks the old region
    out = tmp_path / "old.npz"
    with pytest.raises(MemtierError, match="jobs"):
        memtier.dump(device, "job", str(out))
    p = cli("memtier", "dump", device, "job", "-o", str(out), "--job", "unknown")
    assert p.returncode == 0, p.stderr
    with np.load(out) as z:
        assert memtier_job.digests(z[f"t{i}"] for i in range(3)) == wl["written"]["3"]
    p = cli("memtier", "dump", device, "job", "-o", str(tmp_path / "a.npz"), "--job", wa["job"][:12])
    assert p.returncode == 0, p.stderr
    with np.load(tmp_path / "a.npz") as z:
        assert memtier_job.digests(z[f"t{i}"] for i in range(3)) == wa["written"]["7"]


def test_standalone_job_ids(tmp_path, device, caplog):
    """Standalone models: job= at register and restore, ids kept in a file beside the program's data
    (memtier.job_id: made once, race-free, read back by every later call)."""
    ja, jb = memtier.job_id(str(tmp_path / "a.job")), memtier.job_id(str(tmp_path / "b.job"))
    assert ja == memtier.job_id(str(tmp_path / "a.job")) and ja != jb and valid_job_id(ja)
    sa = {"w": np.arange(1000, dtype=np.float32)}
    sb = {"w": np.arange(1000, dtype=np.float32) * -1}
    with memtier.register(device, "m", sa, job=ja) as ma, memtier.register(device, "m", sb, job=jb) as mb:
        assert ma.job == ja
        memtier.checkpoint(ma, sa, 1)
        memtier.checkpoint(mb, sb, 9)  # B newer
    with caplog.at_level(logging.WARNING, "deepfreeze"):
        got, v = memtier.restore(device, "m", job=ja)
        got2, v2 = memtier.restore(device, "m", job=ja)  # said once per process
    assert v.step == 1 and np.array_equal(got["w"], sa["w"]) and v2 == v
    assert sum("not of this job" in r.getMessage() for r in caplog.records) == 1
    got, v = memtier.restore(device, "m", job=jb)
    assert v.step == 9 and np.array_equal(got["w"], sb["w"])
    with pytest.raises(CheckpointNotFoundError, match="job unknown"):
        memtier.restore(device, "m")  # no job given: only models of unknown job, and there is none
    with pytest.raises(CheckpointNotFoundError):
        memtier.restore(device, "m", job=memtier.job_id(str(tmp_path / "c.job")))
    with pytest.raises(ValueError, match="job id"):
        memtier.restore(device, "m", job="../x")


def test_job_id_created_once_by_concurrent_runs(tmp_path):
    """Concurrent first runs agree on one job id: 16 processes race to create it."""
    code = ("import sys; from deepfreeze.lease import job_id; print(job_id(sys.argv[1], 'n'))")
    os.makedirs(tmp_path / "n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=ROOT)) for _ in range(16)]
    ids = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert len(ids) == 1 and valid_job_id(ids.pop())
    assert sorted(os.listdir(tmp_path / "n")) == ["job"]  # no temporary files left
    assert oct(os.stat(tmp_path / "n" / "job").st_mode & 0o777) == "0o600"
    (tmp_path / "n" / "job").write_text("not-a-job\n")
    with pytest.raises(Exception, match="not a job id"):
        read_job_id(str(tmp_path), "n")



def test_keras_jobs_one_name_one_device(tmp_path, device):
    """Through the Keras callback and the node backend: job B (same name, same device, more epochs,
    so newer versions) does not leak into job A's ``resume=True``."""
    worker = os.path.join(WORKERS, "memtier_keras_job.py")

    def keras(label, root, epochs, phase):
        out = tmp_path / label
        os.makedirs(out)
        p = subprocess.run([sys.executable, worker, str(out), device, str(root), str(epochs), phase],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
        assert p.returncode == 0, p.stderr[-4000:]
        with open(out / "result.json") as f:
            return json.load(f), out, p.stderr

    (ra, out_a, _), (rb, _, _) = keras("a1", tmp_path / "a", 2, "first"), keras("b1", tmp_path / "b", 3, "first")
    assert ra["job"] != rb["job"]
    newest_a = max(int(n[:-4].rsplit("-v", 1)[1]) for n in os.listdir(out_a / "expected"))
    assert newest_a == 12  # 2 epochs of 6 batches; B reached v18
    got, _, err = keras("a2", tmp_path / "a", 3, "resume")
    assert got["resumed_from"] == newest_a and got["job"] == ra["job"]
    with np.load(out_a / "expected" / f"{ra['run']}-v{newest_a}.npz") as want, \
            np.load(tmp_path / "a2" / "resumed.npz") as have:
        for k in want.files:  # bit-exact: the weights A's run recorded at its newest checkpoint
            assert want[k].tobytes() == have[k].tobytes()
    assert "not of this job" in err and rb["run"] in err
    # dump -o .h5 of A's newest version loads into the Keras model (weights only by default, issue 24);
    # --optimizer adds the optimizer state
    dumped = tmp_path / "a.h5"
    p = cli("memtier", "dump", device, "job", "-o", str(dumped), "--job", ra["job"])
    assert p.returncode == 0 and "optimizer" in p.stdout, p.stdout + p.stderr
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    pytest.importorskip("tensorflow")
    from models import build
    loaded = build()
    loaded.load_weights(str(dumped))
    newest = max(int(n[:-4].rsplit("-v", 1)[1]) for n in os.listdir(tmp_path / "a2" / "expected"))
    with np.load(tmp_path / "a2" / "expected" / f"{got['run']}-v{newest}.npz") as want:
        have = loaded.get_weights()
        assert len(want.files) == len(have)
        for i, w in enumerate(have):  # bit-exact: the weights A's resumed run recorded at its newest version
            assert want[f"arr_{i}"].tobytes() == w.tobytes()
    full = tmp_path / "a-opt.npz"
    p = cli("memtier", "dump", device, "job", "-o", str(full), "--job", ra["job"], "--optimizer")
    assert p.returncode == 0, p.stderr
    with np.load(full) as z:
        assert len(z.files) > len(want.files)


def test_repack_retires_only_runs_superseded_within_their_job(tmp_path, device):
    """Two jobs share a name; job B's second run is newer than everything of job A. Repack retires
    B's first run (superseded by a newer run of its own job) and never A's, whose newest version
    stays restorable for A, bit-exact."""
    ja, jb = memtier.job_id(str(tmp_path / "a.job")), memtier.job_id(str(tmp_path / "b.job"))
    sa = {"w": np.arange(1000, dtype=np.float32)}
    sb = {"w": np.arange(1000, dtype=np.float32) * -1}
    for job, state, steps in ((ja, sa, (1, 2)), (jb, sb, (8, 9)), (jb, sb, (10,))):
        with memtier.register(device, "m", state, job=job) as m:
            for step in steps:
                memtier.checkpoint(m, state, step)
    with mdev.open(device) as dev:
        b_first = [r.run for r in dev.find("m")
                   if r.job == jb and 9 in [h.version.step for _, h in r.restorable()]][0]
        out = dev.repack(live=mdev.default_live)
        left = {(r.job, r.run) for r in dev.find("m")}
    assert out["retired"] >= 1 and (jb, b_first) not in left
    assert sorted(j for j, _ in left) == sorted([ja, jb])
    got, v = memtier.restore(device, "m", job=ja)
    assert v.step == 2 and np.array_equal(got["w"], sa["w"])
    got, v = memtier.restore(device, "m", job=jb)
    assert v.step == 10 and np.array_equal(got["w"], sb["w"])


def test_rm_with_an_ambiguous_job_prefix_retires_nothing(tmp_path, device):
    """'memtier rm NAME --job PREFIX' takes an id or a *unique* prefix: a prefix two jobs share is
    refused, naming both, and nothing is retired (before, both jobs' models were dropped)."""
    ja, jb = "abcd" + "0" * 28, "abcd" + "1" * 28
    s = {"w": np.arange(100, dtype=np.float32)}
    for job in (ja, jb):
        with memtier.register(device, "m", s, job=job) as m:
            memtier.checkpoint(m, s, 1)
    p = cli("memtier", "rm", device, "m", "--job", "abcd")
    assert p.returncode != 0 and "more than one" in p.stderr and "abcd0000" in p.stderr, p.stderr
    with mdev.open(device, writable=False) as dev:
        assert sorted(r.job for r in dev.find("m")) == [ja, jb]
    p = cli("memtier", "rm", device, "m", "--job", "abcd1")
    assert p.returncode == 0, p.stderr
    with mdev.open(device, writable=False) as dev:
        assert [r.job for r in dev.find("m")] == [ja]
