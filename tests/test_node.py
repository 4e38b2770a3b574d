"""What DeepFreeze calls a node (deepfreeze/node.py), and the rules that rely on it."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from deepfreeze import node
from deepfreeze.errors import ConfigError, LeaseHeldError
from deepfreeze.lease import Lease, read_lease

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


def test_node_id_has_one_address():
    from deepfreeze import net
    assert "node_id" not in getattr(net, "__all__") and node.node_id.__module__ == "deepfreeze.node"


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
    from deepfreeze.tiers.persistent import LOCK, PersistentLevel
    monkeypatch.delenv(node.NODE_ENV, raising=False)
    level = PersistentLevel.__new__(PersistentLevel)
    vdir = tmp_path / "v"
    vdir.mkdir()
    pid = _dead_pid()
    (vdir / LOCK).write_bytes(f"other-node {pid} 0123456789abcdef".encode())
    with level.locked(str(vdir), wait=0.2, stale_after=60) as taken:
        assert not taken
    me = node.process_identity()  # this node, boot and PID namespace: the dead pid frees it at once
    (vdir / LOCK).write_bytes(f"{node.node_id()} {pid} 0123456789abcdef {me['boot']} {me['pidns']} 1".encode())
    with level.locked(str(vdir), wait=0.2, stale_after=60) as taken:
        assert taken


# -- process identity: a holder's pid is judged only in its own node, boot and PID namespace

def _try_lease(tmp_path, holder_record):
    """Plant a fresh lease with ``holder_record`` over this process's lease content; try to take it."""
    lease = Lease(str(tmp_path), "job", "a" * 16, timeout=30)
    os.makedirs(lease.dir, exist_ok=True)
    rec = dict(json.loads(lease._content()), **holder_record)
    rec = {k: v for k, v in rec.items() if v is not None}
    with open(lease.path + ".w", "w") as f:
        json.dump(rec, f)
    os.rename(lease.path + ".w", lease.path)
    newcomer = Lease(str(tmp_path), "job", "b" * 16, timeout=30)
    try:
        newcomer.acquire()
    except LeaseHeldError as e:
        return e
    newcomer.release()
    os.unlink(newcomer.path)
    return None


def test_a_pid_is_gone_only_when_node_boot_and_pid_namespace_are_this_process_s(tmp_path, monkeypatch):
    from deepfreeze.errors import NodeIdConflictError
    monkeypatch.delenv(node.NODE_ENV, raising=False)
    me = node.process_identity()
    assert me["pid"] == os.getpid() and me["boot"] == node.boot_id()
    assert me["pidns"] == os.stat("/proc/self/ns/pid").st_ino and me["start"] == node.process_start(os.getpid())
    # a live process of this PID namespace: held; its pid reused by another process (start time): gone
    assert isinstance(_try_lease(tmp_path, {}), LeaseHeldError)
    assert _try_lease(tmp_path, {"start": me["start"] + 1}) is None
    assert _try_lease(tmp_path, {"pid": _dead_pid()}) is None
    # the same dead pid recorded in another PID namespace, another boot, or without the fields
    # (an older DeepFreeze's lease): never judged by its pid here
    for other in ({"pidns": me["pidns"] + 1}, {"boot": "0" * 8}):
        e = _try_lease(tmp_path, dict(other, pid=_dead_pid()))
        assert isinstance(e, NodeIdConflictError) and "must be unique per node" in str(e), e
    e = _try_lease(tmp_path, {"pid": _dead_pid(), "boot": None, "pidns": None, "start": None})
    assert isinstance(e, LeaseHeldError) and not isinstance(e, NodeIdConflictError), e
    # a commit.lock the same way: only the full record of a dead pid of this PID space is broken at once
    from deepfreeze.tiers.persistent import LOCK, PersistentLevel, lock_record, parse_lock
    level = PersistentLevel.__new__(PersistentLevel)
    assert parse_lock(lock_record("0123456789abcdef")) == {"node": node.node_id(), **me}
    dead = _dead_pid()
    for content, broken in ((f"{node.node_id()} {dead} t {me['boot']} {me['pidns']} 5", True),
                            (f"{node.node_id()} {dead} t {me['boot']} {me['pidns'] + 1} 5", False),
                            (f"{node.node_id()} {dead} t", False), (f"{node.host_name()} {dead} t", False)):
        (tmp_path / LOCK).write_text(content)
        with level.locked(str(tmp_path), wait=0.2, stale_after=60) as taken:
            assert taken == broken, content
        if not broken:
            os.unlink(tmp_path / LOCK)


def _hold(tmp_path, env):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, f"{ROOT}/tests/workers/lease_holder.py", "hold", str(out),
                               str(tmp_path / "p")], env=env)
    deadline = time.monotonic() + 60
    while not (out / "ready").exists():
        assert holder.poll() is None and time.monotonic() < deadline, "the holder did not start"
        time.sleep(0.05)
    return holder, out


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1) for a PID namespace")
def test_a_job_in_another_pid_namespace_with_the_same_node_id_never_fences_the_live_holder(tmp_path):
    """Issue 32 case 4: a job started with ``unshare --pid`` and the holder's DEEPFREEZE_NODE_ID
    found "process N on this host, which is gone" and took the lease and the commit.lock at once.
    Now it is refused with NodeIdConflictError (the id must be unique per node), the lock is not
    broken, and the holder keeps both, heartbeat and all."""
    env = dict(os.environ, PYTHONPATH=ROOT, DEEPFREEZE_NODE_ID="shared-node")
    holder, out = _hold(tmp_path, env)
    try:
        p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                            f"{ROOT}/tests/workers/lease_holder.py", "try", str(out), str(tmp_path / "p")],
                           env=env, capture_output=True, text=True, timeout=60)
        if p.returncode != 0 and "Operation not permitted" in p.stderr:
            pytest.skip("unshare --pid not permitted here")
        assert p.returncode == 0, p.stderr
        tried = json.loads((out / "try.json").read_text())
        assert tried["lock"] is False, tried  # the live holder's commit.lock is not broken
        kind, msg = tried["lease"]
        assert kind == "NodeIdConflictError" and "'shared-node'" in msg and "must be unique per node" in msg, msg
        assert f"pid {holder.pid}" in msg, msg
        time.sleep(1.5)  # a heartbeat or two more (every second)
    finally:
        (out / "stop").touch()
        holder.wait(timeout=60)
    held = json.loads((out / "holder.json").read_text())
    assert held == {"pid": holder.pid, "lost": None, "lock_is_mine": True, "lease_run_is_mine": True}, held


def test_a_holder_gone_in_this_pid_namespace_is_still_taken_over_at_once(tmp_path):
    """The regression side: the same node id and PID namespace, the holder SIGKILLed (a real
    process): its lease (timeout 3 s, never stale here) and its commit.lock are taken at once."""
    env = dict(os.environ, PYTHONPATH=ROOT, DEEPFREEZE_NODE_ID="shared-node")
    holder, out = _hold(tmp_path, env)
    holder.kill()
    holder.wait(timeout=30)
    t0 = time.monotonic()
    subprocess.run([sys.executable, f"{ROOT}/tests/workers/lease_holder.py", "try", str(out), str(tmp_path / "p")],
                   env=env, check=True, timeout=60)
    tried = json.loads((out / "try.json").read_text())
    assert tried == {"lease": "taken", "lock": True}, tried
    assert time.monotonic() - t0 < 20  # a process start, not a heartbeat timeout (3 s) waited out
