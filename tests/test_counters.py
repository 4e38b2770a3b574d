"""deepfreeze.counters: off by default (nothing counted, nothing written); with DEEPFREEZE_COUNTERS
a one-process sync-mode job counts its bytes, offsets and commit operations (the N = 1 case of
tests/cluster/test_cluster_counts.py, without namespaces)."""
import glob
import json
import os
import subprocess
import sys

from _util import ROOT

JOB = r"""
import sys
import numpy as np
from deepfreeze import Config, counters
from deepfreeze.engine import make_engine
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
    assert k["persistent.decide.locked"] == k["persistent.finalize.locked"] == V and "persistent.lock.busy" not in k
    assert k["fs.open:persistent.decision.read"] == V + V + 2 * V
    assert k["fs.create:persistent.lock.create"] == k["fs.unlink:persistent.lock.unlink"] == 2 * V
    assert "comm.exchange" not in k  # no communicator, no redundancy
