"""DeepFreeze's multi-node promises across real node boundaries (issue 27 item 4): every node has
its own backend, scratch, /dev/shm, pids and network; persistent is the shared directory."""
import glob
import json
import os
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PY = sys.executable
JOB = os.path.join(HERE, "workers", "ckpt_job.py")
ENV = {"PYTHONPATH": ROOT, "DEEPFREEZE_BACKEND_IDLE": "1"}


def _job(cluster, hosts, cmd, *args, timeout=240, check=True):
    for f in glob.glob(os.path.join(cluster.shared, f"{cmd}.rank*.json")):
        os.unlink(f)
    p = cluster.mpirun(hosts, [PY, JOB, cmd, cluster.scratch, cluster.shared, *args], timeout=timeout, env=ENV,
                       check=check)
    if not check:
        return p
    out = []
    for r in range(sum(hosts.values()) if isinstance(hosts, dict) else len(hosts)):
        with open(os.path.join(cluster.shared, f"{cmd}.rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def _ls(cluster, name, path):
    return cluster.run(name, ["sh", "-c", f"if cd {path} 2>/dev/null; then find . -type f | sort; fi"], timeout=30).stdout.split()


def _reset(cluster):
    shutil.rmtree(os.path.join(cluster.shared, "persistent"), ignore_errors=True)
    for n in cluster.names:
        cluster.run(n, ["rm", "-rf", f"{cluster.scratch}/ckpt"], timeout=30)


def test_per_node_backends_and_scratch_restored_bit_exact(cluster3):
    """2 ranks on each of 3 nodes: one backend per node (its own socket in the node's /tmp),
    each node's scratch holds its own ranks' shards only; restore from the nodes' scratch and,
    with every scratch gone, from persistent: bit-exact on every rank."""
    _reset(cluster3)
    hosts = {"n1": 2, "n2": 2, "n3": 2}
    wrote = _job(cluster3, hosts, "write", "1,2,3")
    assert [w["host"] for w in wrote] == ["n1", "n1", "n2", "n2", "n3", "n3"]
    assert [w["domain"] for w in wrote] == ["n1", "n1", "n2", "n2", "n3", "n3"]
    for i, n in enumerate(cluster3.names):
        files = _ls(cluster3, n, f"{cluster3.scratch}/ckpt")
        assert "./.deepfreeze-backend.log" in files, files  # this node's own backend
        shards = [f for f in files if f.endswith(".dfs")]
        assert len(shards) == 2 * 3, (n, files)  # 3 versions x its 2 ranks
        assert {int(f[-10:-4]) for f in shards} == {2 * i, 2 * i + 1}, (n, shards)
    assert os.listdir(cluster3.scratch) == []  # nothing of it on the machine itself
    got = _job(cluster3, hosts, "restore")
    assert {(g["version"], g["level"], g["bit_exact"]) for g in got} == {(3, "scratch", True)}, got
    got = _job(cluster3, hosts, "restore", "2")
    assert {(g["version"], g["bit_exact"]) for g in got} == {(2, True)}
    for n in cluster3.names:
        cluster3.run(n, ["rm", "-rf", f"{cluster3.scratch}/ckpt"], timeout=30)
    got = _job(cluster3, hosts, "restore")
    assert {(g["version"], g["level"], g["bit_exact"]) for g in got} == {(3, "persistent", True)}, got


@pytest.mark.parametrize("scheme", ["xor", "partner"])
def test_scratch_only_versions_survive_a_real_node_loss(make_cluster, scheme):
    """Versions only on the nodes' scratch (persistent_interval < 0), protected across nodes; n2
    is lost (its PID namespace killed, its scratch, /dev/shm and /tmp dropped) and comes back
    empty: the collective restore rebuilds its shards from the survivors, bit-exact; and at
    another node count (2 nodes) too."""
    c = make_cluster(3)
    hosts = {"n1": 1, "n2": 1, "n3": 1}
    opts = [f"ec_scheme={scheme}", "ec_interval=0", "persistent_interval=-1", "scratch_versions=2"]
    _job(c, hosts, "write", "1,2", *opts)
    before = _ls(c, "n2", f"{c.scratch}/ckpt")
    assert any(f.endswith(".dfs") for f in before), before
    c.lose("n2")
    c.start_node("n2")
    assert _ls(c, "n2", f"{c.scratch}/ckpt") == []
    assert glob.glob(os.path.join(c.shared, "persistent", "job", "v*")) == []  # on scratch only
    got = _job(c, hosts, "restore", *opts)
    assert {(g["version"], g["level"], g["bit_exact"]) for g in got} == {(2, "scratch", True)}, got
    got = _job(c, {"n1": 1, "n3": 1}, "restore", *opts)
    assert {(g["version"], g["level"], g["bit_exact"]) for g in got} == {(2, "scratch", True)}, got


def test_without_protection_a_real_node_loss_loses_the_scratch_only_versions(make_cluster):
    """The control of the test above: the node loss is real (nothing of n2's scratch survives)."""
    c = make_cluster(3)
    hosts = {"n1": 1, "n2": 1, "n3": 1}
    opts = ["ec_interval=-1", "persistent_interval=-1", "scratch_versions=2"]
    _job(c, hosts, "write", "1,2", *opts)
    c.lose("n2")
    c.start_node("n2")
    p = _job(c, hosts, "restore", *opts, check=False)
    assert p.returncode != 0 and "no version of 'job' could be read whole" in p.stderr, p.stderr[-3000:]
    assert glob.glob(os.path.join(c.shared, "restore.rank*.json")) == []


def test_per_node_memory_tier_devices_restored_bit_exact(make_cluster):
    """A memory-tier device in each node's own /dev/shm (one path, three devices): each holds
    its node's ranks only; restore reads them (level memtier), bit-exact; with the devices gone
    (the nodes' /dev/shm dropped), from persistent."""
    c = make_cluster(3)
    dev = "/dev/shm/dfz-tier"
    for n in c.names:
        c.run(n, [PY, "-m", "deepfreeze", "memtier", "create", dev, "--size", "16M"], timeout=60, env=ENV)
    hosts = {"n1": 1, "n2": 1, "n3": 1}
    opts = [f"memtier={dev}", "ec_interval=-1", "persistent_interval=0"]
    _job(c, hosts, "write", "1,2", *opts)
    assert not os.path.exists(dev)  # the machine's own /dev/shm has none of it
    for i, n in enumerate(c.names):
        view = json.loads(c.run(n, [PY, "-m", "deepfreeze", "memtier", "view", dev, "--json"], timeout=60,
                                env=ENV).stdout)
        shards = [(m["name"], s["rank"], s["newest"]["version"]) for m in view["models"] for s in m["shards"]]
        assert shards == [("job", i, 2)], (n, view)
    got = _job(c, hosts, "restore", *opts)
    assert {(g["version"], g["level"], g["bit_exact"]) for g in got} == {(2, "memtier", True)}, got
    for n in c.names:
        c.run(n, ["rm", "-f", dev], timeout=30)
        c.run(n, ["rm", "-rf", f"{c.scratch}/ckpt"], timeout=30)
    got = _job(c, hosts, "restore", "ec_interval=-1")
    assert {(g["version"], g["level"], g["bit_exact"]) for g in got} == {(2, "persistent", True)}, got


KERAS = os.path.join(HERE, "workers", "keras_job.py")


def test_horovod_keras_job_resumes_bit_exact_after_a_real_node_loss(make_cluster):
    """A Horovod Keras job launched by a plain ``mpirun -H n1:1,n2:1,n3:1``: XOR parity across
    the nodes, only the first version on persistent (persistent_interval 1 h). n2 is lost and
    comes back empty; ``resume=True`` on the three nodes resumes the newest version (rebuilt from
    the survivors' shards and parity, not persistent's older one), bit-exact."""
    import numpy as np
    c = make_cluster(3)
    opts = ["ec_interval=0", "ec_scheme=xor", "persistent_interval=3600"]
    c.run("head", ["mpirun", "-H", "n1:1,n2:1,n3:1", "-np", "3", PY, KERAS, c.scratch, c.shared, "first", *opts],
          timeout=400, env=ENV)
    expected = sorted(glob.glob(os.path.join(c.shared, "expected", "*-v*.npz")),
                      key=lambda p: int(p.rsplit("-v", 1)[1][:-4]))
    newest = int(expected[-1].rsplit("-v", 1)[1][:-4])
    from deepfreeze import Config, list_versions
    committed = list_versions(Config.load(None, mode="async", scratch=c.scratch,
                                          persistent=os.path.join(c.shared, "persistent")),
                              "keras")
    assert committed == {2: ["persistent"]}, committed  # the others on the nodes' scratch only
    assert newest == 12
    c.lose("n2")
    c.start_node("n2")
    c.run("head", ["mpirun", "-H", "n1:1,n2:1,n3:1", "-np", "3", PY, KERAS, c.scratch, c.shared, "resume", *opts],
          timeout=400, env=ENV)
    with open(os.path.join(c.shared, "resume.json")) as f:
        assert json.load(f)["resumed_from"] == newest
    want, got = np.load(expected[-1]), np.load(os.path.join(c.shared, "resumed.npz"))
    assert len(want.files) == len(got.files)
    for k in want.files:
        assert want[k].tobytes() == got[k].tobytes(), k


LEASE = os.path.join(HERE, "workers", "lease_job.py")


def _committed(c, name):
    from deepfreeze.tiers.persistent import PersistentLevel
    out = {}
    for v in PersistentLevel(os.path.join(c.shared, "persistent")).committed_versions(name):
        v = getattr(v, "step", v)
        with open(os.path.join(c.shared, "persistent", name, f"v{v:012d}", "manifest.json")) as f:
            out[v] = json.load(f)["run"]["id"]
    return out


def test_lease_when_the_holders_node_is_stopped(make_cluster):
    """Run A on n1 holds the lease; every process of n1 is stopped (SIGSTOP). ``resume=True`` on
    n2 waits for A's heartbeat to go stale (lease_timeout), takes the name over and commits its
    versions. n1 resumed (SIGCONT): A is fenced: it stops with an error and commits nothing more."""
    import signal
    import subprocess
    import time
    c = make_cluster(3)
    logs = {t: open(os.path.join(c.base, f"{t}.log"), "w+") for t in ("A", "B")}
    a = c.popen("head", ["mpirun", "-H", "n1:1", "-np", "1", PY, LEASE, c.scratch, c.shared, "A", "first"],
                env=ENV, stdout=logs["A"], stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while len(_committed(c, "lease")) < 2:
            assert a.poll() is None and time.monotonic() < deadline, open(logs["A"].name).read()[-3000:]
            time.sleep(0.5)
        c.signal("n1", signal.SIGSTOP)
        before = _committed(c, "lease")
        run_a = next(iter(before.values()))
        b = c.run("head", ["mpirun", "-H", "n2:1", "-np", "1", PY, LEASE, c.scratch, c.shared, "B", "resume",
                           "stop_after=2"], timeout=300, env=ENV)
        with open(os.path.join(c.shared, "B.json")) as f:
            rb = json.load(f)
        assert rb["error"] is None and rb["resumed_from"] is not None and rb["run"] != run_a, rb
        # taken over because its heartbeat went stale (B waits for that when it starts sooner than
        # lease_timeout), never because A's pid, which means nothing on n2, looked dead there
        assert "has had no heartbeat" in b.stderr and "taking it over" in b.stderr, b.stderr[-3000:]
        assert "which is gone" not in b.stderr, b.stderr[-3000:]
        c.signal("n1", signal.SIGCONT)
        a.wait(timeout=240)
        with open(os.path.join(c.shared, "A.json")) as f:
            ra = json.load(f)
        assert ra["run"] == run_a and ra["error"] is not None, ra
        assert ra["error"][0] in ("LeaseHeldError", "FencedError") and "taken over" in ra["error"][1], ra
        after = _committed(c, "lease")
        by_a = {v for v, r in after.items() if r == run_a}
        assert by_a <= set(before), (before, after)  # A committed nothing once its node was stopped
        assert {v for v, r in after.items() if r == rb["run"]} and \
            all(r == rb["run"] for v, r in after.items() if v > rb["resumed_from"]), after
    finally:
        if a.poll() is None:
            c.signal("n1", signal.SIGCONT)
            a.kill()
            a.wait(timeout=30)
        for f in logs.values():
            f.close()
