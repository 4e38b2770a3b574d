"""What DeepFreeze calls a node (deepfreeze/node.py), and the rules that rely on it."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from deepfreeze import node
from deepfreeze.errors import ConfigError, LeaseHeldError
from deepfreeze.run import Lease, read_lease

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    return p.pid


def test_node_id_is_host_name_and_boot_id(monkeypatch):
    monkeypatch.delenv(node.NODE_ENV, raising=False)
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    assert node.boot_id() == boot
    assert node.node_id() == f"{node.host_name()}/{boot}"
    import socket
    assert node.host_name() == socket.gethostname()


def test_node_id_override_and_its_validation(monkeypatch):
    monkeypatch.setenv(node.NODE_ENV, "rack3-n17")
    assert node.node_id() == "rack3-n17"
    for bad in ("", "two words", "x" * 201, "n\u00e9ud", "tab\there"):
        monkeypatch.setenv(node.NODE_ENV, bad)
        with pytest.raises(ConfigError, match="DEEPFREEZE_NODE_ID"):
            node.node_id()


def test_net_node_id_is_the_same_function():
    from deepfreeze import net
    assert net.node_id is node.node_id


def test_is_here_compares_node_ids_and_falls_back_to_the_host_for_old_records(monkeypatch):
    monkeypatch.delenv(node.NODE_ENV, raising=False)
    assert node.is_here({"node": node.node_id(), "host": "elsewhere"})
    assert not node.is_here({"node": "other/" + node.boot_id(), "host": node.host_name()})
    assert node.is_here({"host": node.host_name()})          # written before node ids
    assert not node.is_here({"host": "elsewhere"})
    assert not node.is_here({})


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1) for a UTS namespace")
def test_another_uts_namespace_is_another_node(monkeypatch):
    """Same kernel (same boot id), own host name: another node. Before node ids, both were one
    node (boot id only), so a stream consumer there tried the producer's /dev/shm ring."""
    monkeypatch.delenv(node.NODE_ENV, raising=False)
    code = ("import json, socket; socket.sethostname('dfz-node-test'); from deepfreeze import node; "
            "print(json.dumps([node.node_id(), node.boot_id(), node.host_name()]))")
    p = subprocess.run(["unshare", "--uts", sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    if p.returncode != 0 and "Operation not permitted" in p.stderr:
        pytest.skip("unshare --uts not permitted here")
    assert p.returncode == 0, p.stderr
    there, boot, host = json.loads(p.stdout)
    assert boot == node.boot_id() and host == "dfz-node-test"
    assert there != node.node_id() and there == f"dfz-node-test/{boot}"


def _plant_lease(tmp_path, monkeypatch, node_env, pid):
    if node_env is None:
        monkeypatch.delenv(node.NODE_ENV, raising=False)
    else:
        monkeypatch.setenv(node.NODE_ENV, node_env)
    lease = Lease(str(tmp_path), "job", "a" * 16, timeout=30)
    with open(lease.path + ".w", "wb") as f:
        rec = json.loads(lease._content())
        rec["pid"] = pid
        f.write(json.dumps(rec).encode())
    os.makedirs(lease.dir, exist_ok=True)
    os.rename(lease.path + ".w", lease.path)
    monkeypatch.delenv(node.NODE_ENV, raising=False)


def test_lease_of_a_dead_pid_on_another_node_with_the_same_host_name_is_not_taken_at_once(tmp_path, monkeypatch):
    """The holder's pid means nothing here when it ran on another node, even one with this host
    name: its lease is held until its heartbeat is older than the timeout."""
    os.makedirs(tmp_path / "job")
    _plant_lease(tmp_path, monkeypatch, "another-node", _dead_pid())
    holder, _ = read_lease(str(tmp_path), "job")
    assert holder["host"] == node.host_name() and holder["node"] == "another-node"
    with pytest.raises(LeaseHeldError):
        Lease(str(tmp_path), "job", "b" * 16, timeout=30).acquire()
    # on this node, the same dead pid frees the lease at once
    _plant_lease(tmp_path, monkeypatch, None, _dead_pid())
    mine = Lease(str(tmp_path), "job", "c" * 16, timeout=30)
    mine.acquire()
    try:
        assert read_lease(str(tmp_path), "job")[0]["run"] == "c" * 16
    finally:
        mine.release()


def test_commit_lock_of_a_dead_pid_on_another_node_is_not_broken_at_once(tmp_path, monkeypatch):
    from deepfreeze.levels import LOCK, PersistentLevel
    monkeypatch.delenv(node.NODE_ENV, raising=False)
    level = PersistentLevel.__new__(PersistentLevel)
    vdir = tmp_path / "v"
    vdir.mkdir()
    pid = _dead_pid()
    (vdir / LOCK).write_bytes(f"other-node {pid} 0123456789abcdef".encode())
    with level.locked(str(vdir), wait=0.2, stale_after=60) as taken:
        assert not taken
    (vdir / LOCK).write_bytes(f"{node.node_id()} {pid} 0123456789abcdef".encode())
    with level.locked(str(vdir), wait=0.2, stale_after=60) as taken:
        assert taken
