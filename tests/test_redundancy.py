"""Partner replication and XOR parity across simulated nodes (built-in engine, ec_interval).

Real MPI jobs of numpy-only ranks (tests/workers/numpy_job.py): every rank writes its shard
to its node's scratch, the writer threads exchange partner copies / parity over MPI,
then a node's scratch is wiped or a shard damaged and a collective restore must give
the newest version bit-exact from what is left.
"""
import json
import logging
import os
import shutil

import pytest

from deepfreeze import Config, ConfigError, CorruptCheckpointError, list_versions, load
from deepfreeze.redundancy import plan_redundancy, read_parity

from _util import WORKERS, mpirun

JOB = os.path.join(WORKERS, "numpy_job.py")


def write(root, scheme, nodes, ranks, versions="1,2,3", *opts):
    mpirun(ranks, JOB, "write", str(root), str(nodes), versions, f"ec_scheme={scheme}", *opts)


def restore(root, nodes, ranks, *extra, check=True):
    p = mpirun(ranks, JOB, "restore", str(root), str(nodes), *extra, check=check)
    return p, (json.load(open(root / "restored.json")) if p.returncode == 0 else None)


def node_cfg(root, node):
    return Config.load(None, mode="async", scratch=f"{root}/node{node}/scratch", persistent=f"{root}/persistent")


# -- planning: pure functions of the failure domains

def test_partner_plan_goes_to_the_next_domain():
    red = plan_redundancy(["a", "a", "b", "b", "c", "c"], "partner")
    assert red["holder"] == {"0": 2, "1": 3, "2": 4, "3": 5, "4": 0, "5": 1}
    assert red["unprotected"] == []


def test_xor_groups_hold_one_rank_per_domain():
    red = plan_redundancy(["a", "a", "b", "b", "c", "c"], "xor")
    assert red["groups"] == [[0, 2, 4], [1, 3, 5]]
    uneven = plan_redundancy(["a", "a", "a", "b"], "xor")
    assert uneven["groups"] == [[0, 3]] and uneven["unprotected"] == [1, 2]
    # partner still protects every rank of an uneven layout (holders take several copies)
    assert plan_redundancy(["a", "a", "a", "b"], "partner")["holder"] == {"0": 3, "1": 3, "2": 3, "3": 0}


def test_xor_groups_are_cut_to_ec_group_size():
    """One rank per domain on 10 domains: groups of at most 4, sizes differing by at most one
    (never a member left alone); 2 ranks per domain on 5 domains with 3: each row cut the same way."""
    ten = [f"n{i}" for i in range(10)]
    assert plan_redundancy(ten, "xor", 4)["groups"] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert plan_redundancy(ten, "xor", 0)["groups"] == [list(range(10))]  # 0: no limit
    assert plan_redundancy(ten, "xor", 10)["groups"] == [list(range(10))]
    red = plan_redundancy([d for d in "abcde" for _ in range(2)], "xor", 3)
    assert red["groups"] == [[0, 2, 4], [6, 8], [1, 3, 5], [7, 9]] and red["unprotected"] == []
    thousand = plan_redundancy([f"n{i}" for i in range(1000)], "xor", 8)["groups"]
    assert len(thousand) == 125 and {len(g) for g in thousand} == {8}
    assert sorted(r for g in thousand for r in g) == list(range(1000))
    with pytest.raises(ValueError, match="3 or more"):
        plan_redundancy(ten, "xor", 2)


def test_ec_group_size_is_validated_when_the_config_is_built(tmp_path):
    base = dict(mode="async", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    assert Config.load(None, **base).ec_group_size == 8  # SCR's default set size
    assert Config.load(None, **base, ec_group_size="0").ec_group_size == 0
    for bad, why in (("2", "use 3 or more"), ("1", "use 3 or more"), ("-1", "use 3 or more"), ("x", "not an integer")):
        with pytest.raises(ConfigError, match=why):
            Config.load(None, **base, ec_group_size=bad)


def test_one_failure_domain_protects_nothing():
    assert plan_redundancy(["n", "n", "n"], "partner")["unprotected"] == [0, 1, 2]
    assert plan_redundancy(["n", "n"], "xor")["groups"] == []
    with pytest.raises(ValueError, match="unknown redundancy scheme"):
        plan_redundancy(["a", "b"], "raid6")


def test_hostile_parity_files_are_rejected():
    for raw, why in [(b"nope", "magic"), (b"DFXPAR01" + (10 ** 8).to_bytes(4, "little"), "out of bounds"),
                     (b"DFXPAR01" + (2).to_bytes(4, "little") + b"{}", "header"),
                     (b"DFXPAR01" + (60).to_bytes(4, "little") +
                      b'{"group":[0,1],"sizes":[4,4],"chunk":9,"crc":0}'.ljust(60) + b"abcd", "parity bytes")]:
        with pytest.raises(CorruptCheckpointError, match=why):
            read_parity(raw)


# -- real MPI jobs

@pytest.mark.mpi
def test_partner_copies_survive_the_loss_of_a_node(tmp_path):
    write(tmp_path, "partner", 2, 4)
    shutil.rmtree(tmp_path / "node1")  # node 1 (ranks 2, 3) is gone with its scratch
    _, got = restore(tmp_path, 2, 4)
    assert got == {"version": 3, "level": "scratch", "bit_exact": True, "size": 4}
    # node 0 alone holds its own shards and the partner copies of node 1's: a single process restores
    assert list_versions(node_cfg(tmp_path, 0), "job") == {2: ["scratch"], 3: ["scratch"]}
    ck = load(node_cfg(tmp_path, 0), "job")
    assert ck.version == 3 and ck.level == "scratch"
    # the retention of scratch_versions = 2 removed the partner copies of v1 with the shards
    assert not (tmp_path / "node0/scratch/job/v000000000001").exists()


@pytest.mark.mpi
def test_xor_parity_rebuilds_a_lost_node_at_the_same_and_another_world_size(tmp_path):
    write(tmp_path, "xor", 3, 6)
    shards = sorted(os.listdir(tmp_path / "node0/scratch/job/v000000000003"))
    assert shards == ["manifest.json", "r000000.dfs", "r000001.dfs", "x000000.dfx", "x000001.dfx"]
    size = os.path.getsize(tmp_path / "node0/scratch/job/v000000000003/r000000.dfs")
    parity = os.path.getsize(tmp_path / "node0/scratch/job/v000000000003/x000000.dfx")
    assert parity < 0.6 * size  # groups of 3: parity is half a shard, not a copy
    shutil.rmtree(tmp_path / "node1")
    p, got = restore(tmp_path, 3, 6)
    assert got == {"version": 3, "level": "scratch", "bit_exact": True, "size": 6}
    assert "rebuilt the shard of rank 2 from XOR parity" in p.stderr + p.stdout
    # a restarted job of 3 ranks (one per node, node 1 replaced by an empty one) pools the same files
    _, got = restore(tmp_path, 3, 3)
    assert got == {"version": 3, "level": "scratch", "bit_exact": True, "size": 3}


@pytest.mark.mpi
def test_xor_groups_of_ec_group_size_survive_a_lost_node_in_each(tmp_path):
    """6 nodes, one rank each, ec_group_size = 3: groups {0,1,2} and {3,4,5}. Nodes 1 and 4 are
    lost (one per group): both shards are rebuilt from parity (one group of 6 could not)."""
    write(tmp_path, "xor", 6, 6, "1,2", "ec_group_size=3")
    with open(tmp_path / "node0/scratch/job/v000000000002/x000000.dfx", "rb") as f:
        header, _ = read_parity(f.read())
    assert header["group"] == [0, 1, 2]
    shutil.rmtree(tmp_path / "node1")
    shutil.rmtree(tmp_path / "node4")
    p, got = restore(tmp_path, 6, 6)
    assert got == {"version": 2, "level": "scratch", "bit_exact": True, "size": 6}
    for r in (1, 4):
        assert f"rebuilt the shard of rank {r} from XOR parity" in p.stderr + p.stdout


@pytest.mark.mpi
def test_two_lost_nodes_fall_back_to_persistent(tmp_path):
    write(tmp_path, "xor", 3, 3, "1,2", "persistent_interval=0", "mode=sync")
    shutil.rmtree(tmp_path / "node1")
    shutil.rmtree(tmp_path / "node2")  # parity tolerates one lost member per group, not two
    p, got = restore(tmp_path, 3, 3)
    assert got == {"version": 2, "level": "persistent", "bit_exact": True, "size": 3}


@pytest.mark.mpi
def test_two_lost_nodes_without_persistent_fail_clearly(tmp_path):
    write(tmp_path, "xor", 3, 3, "1,2")
    shutil.rmtree(tmp_path / "node1")
    shutil.rmtree(tmp_path / "node2")
    p, _ = restore(tmp_path, 3, 3, check=False)
    assert p.returncode != 0
    assert "CorruptCheckpointError" in p.stderr and "could be read whole" in p.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("scheme", ["partner", "xor"])
def test_a_damaged_shard_falls_back_to_its_redundancy(tmp_path, scheme):
    write(tmp_path, scheme, 2, 4)
    path = tmp_path / "node1/scratch/job/v000000000003/r000002.dfs"
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF  # in the data of the last piece: only the checksum can tell
    path.write_bytes(bytes(raw))
    p, got = restore(tmp_path, 2, 4)
    assert got == {"version": 3, "level": "scratch", "bit_exact": True, "size": 4}
    assert "shard of rank 2 on participant 2 is unreadable" in p.stderr + p.stdout
    assert "checksum mismatch" in p.stderr + p.stdout


def test_single_process_restore_uses_local_redundancy_and_logs_it(tmp_path, caplog):
    """Without MPI: a node's scratch with a damaged shard and the partner copy of it."""
    root = tmp_path
    write(root, "partner", 2, 2, "5")  # rank 0 on node0, rank 1 on node1
    # gather both nodes' files into one directory, as if both ranks had been on one node
    src, dst = root / "node1/scratch/job/v000000000005", root / "node0/scratch/job/v000000000005"
    shutil.copy(src / "r000001.dfs", dst / "r000001.dfs")
    raw = bytearray((dst / "r000001.dfs").read_bytes())
    raw[-10] ^= 1
    (dst / "r000001.dfs").write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING, "deepfreeze")
    ck = load(node_cfg(root, 0), "job")
    assert ck.version == 5 and ck.level == "scratch"
    assert "shard of rank 1 on participant 0 is unreadable" in caplog.text
    import importlib.util
    spec = importlib.util.spec_from_file_location("ecw", JOB)
    ecw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ecw)
    assert all(ck.arrays[f"t{i}"].tobytes() == a.tobytes() for i, a in enumerate(ecw.arrays(5)))


@pytest.mark.parametrize("red", [{"scheme": "xor", "groups": [[0, 9]]}, {"scheme": "xor", "groups": [[0, 1], [1, 0]]},
                                 {"scheme": "partner", "holder": {"0": -1}}, {"scheme": "raid6"}, "xor"])
def test_hostile_redundancy_in_a_manifest_is_rejected(red):
    import json
    from deepfreeze.format import decode_manifest
    m = {"format": "deepfreeze-manifest", "format_version": 1, "name": "j", "version": 1, "step": 1, "epoch": 0,
         "world_size": 2, "tensors": [], "plan": {}, "shards": [], "redundancy": red}
    with pytest.raises(CorruptCheckpointError, match="'redundancy' malformed"):
        decode_manifest(json.dumps(m).encode())
