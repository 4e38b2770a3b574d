"""deepfreeze.counters: off by default (nothing counted, nothing written); with DEEPFREEZE_COUNTERS
a one-process sync-mode job counts its bytes, offsets and commit operations (the N = 1 case of
tests/cluster/test_cluster_counts.py, without namespaces)."""
import glob
import json
import os
import subprocess
import sys
import time

import pytest

from _util import ROOT

JOB = r"""
import sys
import numpy as np
from deepfreeze import Config, counters
from deepfreeze.run import make_engine
from deepfreeze.shardplan import ShardPlan, TensorSpec
root, T, E, V = sys.argv[1], 4, 1 << 14, 3
cfg = Config.load(None, mode="sync", scratch=root + "/s", persistent=root + "/p", persistent_interval=0,
                  max_versions=0, scratch_versions=0)
plan = ShardPlan.build([TensorSpec(i, f"t{i}", "float32", (E,)) for i in range(T)], 1, min_shard_bytes=1024)
eng = make_engine("builtin", cfg, "job", 0, plan)
for v in range(1, V + 1):
    eng.checkpoint(v, [np.full(E, v + i, np.float32) for i in range(T)], step=v, epoch=0)
eng.close()
print(counters.ENABLED)
"""


def _job(tmp_path, env):
    return subprocess.run([sys.executable, "-c", JOB, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT, **env), check=True).stdout.split()[-1]


def test_off_by_default(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DEEPFREEZE_COUNTERS"}
    p = subprocess.run([sys.executable, "-c", "from deepfreeze import counters as c; c.add('x'); c.record('y', 1); "
                        "print(c.ENABLED, c.snapshot(), c.dump('t'))"], capture_output=True, text=True,
                       timeout=60, env=dict(env, PYTHONPATH=ROOT), check=True)
    assert p.stdout.split("\n")[0] == "False {'counters': {}, 'records': {}} None"


@pytest.mark.scratch_files("counts the scratch write's bytes and operations")
def test_a_one_process_job_is_counted(tmp_path):
    out = tmp_path / "counters"
    out.mkdir()
    assert _job(tmp_path, {"DEEPFREEZE_COUNTERS": str(out)}) == "True"
    files = glob.glob(str(out / "rank0.*.json"))
    assert len(files) == 1 and not glob.glob(str(out / "backend.*"))  # sync mode: the rank flushes itself
    with open(files[0]) as f:
        d = json.load(f)
    k, V, T, B = d["counters"], 3, 4, 4 << 14
    assert k["bytes.scratch.data"] == k["bytes.persistent.data"] == V * T * B
    assert sorted(map(tuple, d["records"]["offsets.persistent"])) == sorted((4096 + t * B, B) for t in range(T)
                                                                            for _ in range(V))
    for site in ("link:persistent.decision.link", "replace:persistent.marker.rename", "fsync:persistent.partial.fsync",
                 "replace:persistent.final.rename", "replace:persistent.manifest.rename",
                 "unlink:persistent.cleanup.unlink", "replace:scratch.shard.rename", "replace:scratch.manifest.rename",
                 "listdir:persistent.finalize.markers", "open:run.generation.read"):
        assert k["fs." + site] == V, site
    # one process: every flush decides under the lock and finalizes; nobody else ever holds the lock
    assert k["persistent.decide.locked"] == k["persistent.decide.taken"] == k["persistent.finalize.locked"] == V
    assert "persistent.lock.busy" not in k and "persistent.decide.waited" not in k
    assert k["fs.open:persistent.decision.read"] == V + V + 2 * V
    assert k["fs.create:persistent.lock.create"] == k["fs.unlink:persistent.lock.unlink"] == 2 * V
    assert "comm.exchange" not in k  # no communicator, no redundancy
    # retention after each commit reads only the manifests this process has not written or validated
    # before (Level.committed_run): here none, as this process committed every version and remembered
    # each manifest's run when it wrote it (Level.remember_run, issue 45: no read back of what was just
    # written); its V (V + 1) / 2 looks are a stat each
    assert "fs.open:persistent.manifest.read" not in k
    assert k["fs.stat:persistent.manifest.known"] == V * (V + 1) // 2


HERD = r"""
import json, os, sys, time
from deepfreeze import counters
from deepfreeze.tiers.persistent import PersistentLevel
root, role, out = sys.argv[1], sys.argv[2], sys.argv[3]

class SlowDecider(PersistentLevel):
    # the deciding node's metadata operations are slow: it holds the version lock until released
    def _due(self, name, version, interval):
        while not os.path.exists(os.path.join(root, "release")):
            time.sleep(0.005)
        return super()._due(name, version, interval)

level = (SlowDecider if role == "decider" else PersistentLevel)(os.path.join(root, "p"))
open(out + ".ready", "w").close()
t0 = time.monotonic()
d = level.decide("job", 1, 0, "run-a")
with open(out + ".tmp", "w") as f:
    json.dump({"decision": d, "counters": counters.snapshot()["counters"], "seconds": time.monotonic() - t0}, f)
os.rename(out + ".tmp", out)
"""


def test_flushes_wait_for_the_decision_instead_of_queuing_on_the_lock(tmp_path):
    """The decide herd (docs/cluster.md, "At 1000 nodes"): while one node holds a version's lock
    to make its decision, the other nodes' flushes re-read the decision with a growing pause and
    follow it, instead of queuing on the lock (each taking it in turn) while polling it every
    10 ms. Six followers start while the decider (its metadata made slow by subclassing) holds
    the lock, and wait ~0.6 s for it."""
    env = dict(os.environ, PYTHONPATH=ROOT, DEEPFREEZE_COUNTERS=str(tmp_path / "counters"))
    out = {who: str(tmp_path / f"{who}.json") for who in ["decider"] + [f"f{i}" for i in range(6)]}
    procs = {"decider": subprocess.Popen([sys.executable, "-c", HERD, str(tmp_path), "decider", out["decider"]],
                                         env=env)}
    lock = tmp_path / "p" / "job" / f"v{1:012d}" / "commit.lock"
    try:
        deadline = time.monotonic() + 60
        while not lock.exists():
            assert procs["decider"].poll() is None and time.monotonic() < deadline, "the decider never took the lock"
            time.sleep(0.01)
        for who in out:
            if who != "decider":
                procs[who] = subprocess.Popen([sys.executable, "-c", HERD, str(tmp_path), "follower", out[who]],
                                              env=env)
        while not all(os.path.exists(out[w] + ".ready") for w in out):
            assert time.monotonic() < deadline, "the followers did not start"
            time.sleep(0.01)
        time.sleep(0.6)  # every follower is in decide() now, finding the lock held
        (tmp_path / "release").touch()
        for p in procs.values():
            assert p.wait(60) == 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    res = {w: json.load(open(f)) for w, f in out.items()}
    made = res["decider"]["decision"]
    took = "fs.unlink:persistent.lock.unlink"  # a release: one per take of the lock
    assert res["decider"]["counters"][took] == 1 and made["decision"] == "flush"
    followers = [r for w, r in res.items() if w != "decider"]
    assert all(r["decision"] == made for r in followers)  # one decision, its nonce, followed by all
    taken = [r["counters"].get(took, 0) for r in followers]
    waited = [r["counters"].get("persistent.decide.waited", 0) for r in followers]
    busy = [r["counters"].get("persistent.lock.busy", 0) for r in followers]
    # queuing on the lock, every follower would take it in turn (6) after ~60 busy rounds each
    seconds = [r["seconds"] for r in followers]
    print(json.dumps({"taken": taken, "waited": waited, "busy": busy, "seconds": seconds}))
    assert sum(taken) <= 1, taken  # (one may find the lock free in the instant after the release)
    assert all(b <= w + 1 for b, w in zip(busy, waited)), (waited, busy)
    # the pause doubles from 10 ms to 200 ms (jittered down to half): at most 5 rounds in the first
    # ~0.15 s, then one per 0.1 s at least; polling every 10 ms would be ~10 times as many
    assert all(1 <= w <= 7 + s / 0.1 for w, s in zip(waited, seconds)), (waited, seconds)
