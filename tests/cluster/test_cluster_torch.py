"""torchrun across the test cluster's nodes (issue 27): a DDP job launched by ``torchrun`` on
each node (``--nnodes``, ``--node-rank``, c10d rendezvous on n1's address on the cluster link),
checkpointing with :class:`deepfreeze.torch.Checkpointer` (one backend per node on its own
scratch, partner copies across the nodes over the checkpointer's gloo groups); a node is lost
and ``resume=True`` on the surviving nodes (another node count) continues from the newest
version, rebuilt from the survivors' scratch, bit-exact against the state the run recorded."""
import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PY = sys.executable
JOB = os.path.join(HERE, "workers", "torch_job.py")
ENV = {"PYTHONPATH": ROOT, "DEEPFREEZE_BACKEND_IDLE": "1"}
from cluster.harness import torchrun_nodes  # noqa: E402 (tests/ is on the path: conftest.py)


def _npz(path):
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def _info(out, r):
    with open(os.path.join(out, f"r{r}", "info.json")) as f:
        return json.load(f)


def test_torchrun_ddp_across_nodes_resumes_bit_exact_after_a_node_loss(make_cluster):
    c = make_cluster(3)
    scratch, persistent = f"{c.scratch}/tt", os.path.join(c.shared, "persistent")
    first, second = os.path.join(c.shared, "first"), os.path.join(c.shared, "second")
    # 3 nodes, 9 steps: versions 3, 6, 9; only the first on the shared directory (the persistent
    # interval is an hour), the others on the nodes' scratch with their partner copies
    torchrun_nodes(c, c.names, [JOB, first, scratch, persistent, "steps=9", "persistent_interval=3600"],
                   timeout=300, env=ENV)
    infos = [_info(first, r) for r in range(3)]
    assert [i["host"] for i in infos] == ["n1", "n2", "n3"] and [i["group_rank"] for i in infos] == ["0", "1", "2"]
    assert len(set(infos[0]["domains"])) == 3, infos[0]["domains"]  # one failure domain per node
    assert all(i["step"] == 9 and i["last_version"] == 9 and not i["failures"] for i in infos), infos
    from deepfreeze import Config, list_versions
    committed = list_versions(Config.load(None, mode="async", scratch=scratch, persistent=persistent), "tt")
    assert committed == {3: ["persistent"]}, committed  # v6 and v9 live on the nodes' scratch only
    c.lose("n2")  # its processes, scratch, /dev/shm and /tmp are gone
    torchrun_nodes(c, ["n1", "n3"], [JOB, second, scratch, persistent, "steps=9", "resume=1"], timeout=300, env=ENV)
    want = _npz(os.path.join(first, "r0", "v9.npz"))
    for r in range(2):
        i = _info(second, r)
        assert i["size"] == 2 and i["resumed_from"] == 9 and i["start_step"] == 9 and i["it"] == 9, i
        got = _npz(os.path.join(second, f"r{r}", "final.npz"))  # the state exactly as resumed
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), (r, k)
