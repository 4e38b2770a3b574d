"""The test cluster itself (tests/cluster/harness.py): three nodes that are really apart."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cluster.harness import PREFIX, pids_in, sweep

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PY = sys.executable
ENV = {"PYTHONPATH": ROOT}


def _py(cluster, name, code, timeout=60, **kw):
    return cluster.run(name, [PY, "-c", code], timeout=timeout, env=ENV, **kw)


def test_hostnames_and_node_ids_differ_per_node(cluster3):
    code = "import json; from deepfreeze import node; print(json.dumps([node.host_name(), node.node_id(), node.boot_id()]))"
    seen = {n: json.loads(_py(cluster3, n, code).stdout) for n in cluster3.names}
    assert [seen[n][0] for n in cluster3.names] == ["n1", "n2", "n3"]
    ids = {seen[n][1] for n in cluster3.names}
    from deepfreeze import node
    assert len(ids) == 3 and node.node_id() not in ids
    assert {seen[n][2] for n in cluster3.names} == {node.boot_id()}  # one kernel: the boot id alone cannot tell them apart


def test_tmp_shm_and_scratch_are_private_to_a_node(cluster3):
    s = cluster3.scratch
    cluster3.run("n1", ["sh", "-c", f"echo n1 > /tmp/dfz-mark && echo n1 > /dev/shm/dfz-mark && echo n1 > {s}/dfz-mark"],
                 timeout=30)
    for n in ("n1", "n2", "n3"):
        got = cluster3.run(n, ["sh", "-c", f"cat /tmp/dfz-mark /dev/shm/dfz-mark {s}/dfz-mark 2>/dev/null; true"],
                           timeout=30).stdout
        assert got == ("n1\n" * 3 if n == "n1" else "")
    assert not os.path.exists("/dev/shm/dfz-mark") and not os.path.exists(os.path.join(s, "dfz-mark"))
    # the parallel file system is one directory for every node and the test
    cluster3.run("n2", ["sh", "-c", f"echo from-n2 > {cluster3.shared}/pfs-mark"], timeout=30)
    assert cluster3.run("n3", ["cat", f"{cluster3.shared}/pfs-mark"], timeout=30).stdout == "from-n2\n"
    with open(os.path.join(cluster3.shared, "pfs-mark")) as f:
        assert f.read() == "from-n2\n"


SERVE_UNIX = """
import socket, sys
s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(4)
a = socket.socket(socket.AF_UNIX); a.bind("\\0dfz-abstract-test"); a.listen(4)
print("ready", flush=True)
c, _ = s.accept(); c.sendall(b"hello from the node's backend"); c.close()
sys.stdin.read()
"""
CONNECT_UNIX = """
import socket, sys
for addr in (sys.argv[1], "\\0dfz-abstract-test"):
    c = socket.socket(socket.AF_UNIX)
    try:
        c.connect(addr)
        print("connected", c.recv(100).decode() if addr == sys.argv[1] else "")
    except OSError as e:
        print("refused", type(e).__name__)
"""


def test_a_backend_socket_on_one_node_is_not_reachable_from_another(cluster3):
    path = "/tmp/deepfreeze-0-test.sock"  # where a node's backend socket lives (its runtime directory)
    srv = cluster3.popen("n1", [PY, "-c", SERVE_UNIX, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout.readline().strip() == "ready"
        other = cluster3.run("n2", [PY, "-c", CONNECT_UNIX, path], timeout=30).stdout.split("\n")
        assert other[0] == "refused FileNotFoundError" and other[1] == "refused ConnectionRefusedError"
        same = cluster3.run("n1", [PY, "-c", CONNECT_UNIX, path], timeout=30).stdout.split("\n")
        assert same[0] == "connected hello from the node's backend" and same[1].startswith("connected")
    finally:
        srv.kill()
        srv.communicate(timeout=30)


SERVE_TCP = """
import socket
s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen(4); s.settimeout(30)
print(s.getsockname()[1], flush=True)
c, peer = s.accept(); c.sendall(("hello " + peer[0]).encode()); c.close()
"""
CONNECT_TCP = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
    print("got", c.recv(100).decode())
except OSError as e:
    print("failed", type(e).__name__, e.errno)
"""


def test_tcp_goes_between_nodes_over_the_bridge_only(cluster3):
    srv = cluster3.popen("n2", [PY, "-c", SERVE_TCP], stdout=subprocess.PIPE, text=True)
    try:
        port = srv.stdout.readline().strip()
        # the machine itself has no route to the cluster (nothing was added to its network)
        out = subprocess.run([PY, "-c", CONNECT_TCP, cluster3.address("n2"), port], capture_output=True,
                             text=True, timeout=30).stdout
        assert out.startswith("failed"), out
        got = cluster3.run("n1", [PY, "-c", CONNECT_TCP, "n2", port], timeout=30).stdout
        assert got == f"got hello {cluster3.address('n1')}\n"
        srv.wait(timeout=30)
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.communicate(timeout=30)
    for n in cluster3.names:  # no default route, no address but the link's
        routes = cluster3.run(n, ["ip", "-4", "route"], timeout=30).stdout.strip().splitlines()
        assert routes == [f"{cluster3.subnet}.0/24 dev dfz0 proto kernel scope link src {cluster3.address(n)}"]
        addrs = cluster3.run(n, ["ip", "-4", "-o", "addr"], timeout=30).stdout
        assert sorted(line.split()[3] for line in addrs.splitlines()) == sorted(["127.0.0.1/8", f"{cluster3.address(n)}/24"])
    # from a node, the machine's own addresses are unreachable
    host_ip = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=30).stdout
    others = [line.split()[3].split("/")[0] for line in host_ip.splitlines() if not line.split()[3].startswith("127.")]
    for ip in others[:2]:
        out = cluster3.run("n1", [PY, "-c", CONNECT_TCP, ip, "22"], timeout=30).stdout
        assert out.startswith("failed") and "101" in out, out  # ENETUNREACH


def test_plain_mpirun_reports_three_distinct_node_ids(cluster3, tmp_path):
    out = os.path.join(cluster3.shared, "node_report")
    os.makedirs(out, exist_ok=True)
    cluster3.run("head", ["mpirun", "-H", "n1:1,n2:1,n3:1", "-np", "3", PY,
                          os.path.join(HERE, "workers", "node_report.py"), out], timeout=120, env=ENV)
    ranks = []
    for r in range(3):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    assert [r["host"] for r in ranks] == ["n1", "n2", "n3"]
    nodes = [r["node"] for r in ranks]
    assert len(set(nodes)) == 3 and all(r["gathered"] == nodes for r in ranks)
    assert len({r["pid_ns"] for r in ranks}) == 3 and len({r["net_ns"] for r in ranks}) == 3


def test_a_lost_node_is_gone_and_comes_back_empty_and_reachable(cluster3):
    """lose(): every process of the node killed, its /tmp, /dev/shm and scratch dropped;
    start_node(): a fresh node at the same name and address, reachable at once from the other
    nodes and from mpirun on the head (the bridge and links keep their MAC addresses)."""
    s = cluster3.scratch
    cluster3.run("n2", ["sh", "-c", f"echo x > /dev/shm/dfz-lost && echo x > {s}/dfz-lost && echo x > /tmp/dfz-lost"],
                 timeout=30)
    sleeper = cluster3.popen("n2", ["sleep", "600"])
    pid_ns = os.stat(os.path.join(cluster3.ns, "n2.pid")).st_ino
    cluster3.lose("n2")
    sleeper.wait(timeout=30)
    assert pids_in({"pid": {pid_ns}}) == []
    cluster3.start_node("n2")
    left = cluster3.run("n2", ["sh", "-c", f"ls /dev/shm /tmp {s}"], timeout=30).stdout
    assert "dfz-lost" not in left
    srv = cluster3.popen("n2", [PY, "-c", SERVE_TCP], stdout=subprocess.PIPE, text=True)
    try:
        port = srv.stdout.readline().strip()
        got = cluster3.run("n1", [PY, "-c", CONNECT_TCP, "n2", port], timeout=30).stdout
        assert got == f"got hello {cluster3.address('n1')}\n"
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.communicate(timeout=30)
    p = cluster3.run("head", ["mpirun", "-H", "n1:1,n2:1,n3:1", "-np", "3", "hostname"], timeout=60)
    assert sorted(p.stdout.split()) == ["n1", "n2", "n3"]


def test_partition_and_rate_limit_of_a_node(cluster3):
    """partition(): nothing reaches the node (connects time out), the others are unaffected;
    heal() reconnects it. limit(): a tbf qdisc on both ends of its link; traffic still flows."""
    servers = {n: cluster3.popen(n, [PY, "-c", SERVE_TCP], stdout=subprocess.PIPE, text=True) for n in ("n2", "n3")}
    try:
        ports = {n: s.stdout.readline().strip() for n, s in servers.items()}
        cluster3.partition("n2")
        try:
            cut = cluster3.run("n1", [PY, "-c", CONNECT_TCP, "n2", ports["n2"]], timeout=30).stdout
            assert cut.startswith("failed"), cut
            ok = cluster3.run("n1", [PY, "-c", CONNECT_TCP, "n3", ports["n3"]], timeout=30).stdout
            assert ok == f"got hello {cluster3.address('n1')}\n"
        finally:
            cluster3.heal("n2")
        cluster3.limit("n2", "8mbit")
        try:
            for where in ("head", "n2"):
                dev = "vn2" if where == "head" else "dfz0"
                assert " tbf " in cluster3.run(where, ["tc", "qdisc", "show", "dev", dev], timeout=30).stdout
            back = cluster3.run("n1", [PY, "-c", CONNECT_TCP, "n2", ports["n2"]], timeout=30).stdout
            assert back == f"got hello {cluster3.address('n1')}\n"
        finally:
            cluster3.limit("n2", None)
        assert " tbf " not in cluster3.run("head", ["tc", "qdisc", "show", "dev", "vn2"], timeout=30).stdout
    finally:
        for s in servers.values():
            if s.poll() is None:
                s.kill()
            s.communicate(timeout=30)


def _machine_state():
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30).stdout
    return sorted(line.split(":")[1].strip() for line in links.splitlines())


def _leftovers(base, inodes):
    with open("/proc/self/mountinfo") as f:
        mounts = [line for line in f if base in line]
    return {"mounts": mounts, "pids": pids_in(inodes), "dir": os.path.exists(base)}


def test_teardown_leaves_nothing(make_cluster):
    links = _machine_state()
    c = make_cluster(3)
    stray = c.popen("n2", ["sleep", "600"])  # a process left running on a node
    c.run("n3", ["sh", "-c", "echo x > /dev/shm/left && echo y > /tmp/left"], timeout=30)
    inodes = c.namespace_inodes()
    assert sum(len(v) for v in inodes.values()) == 3 * 4 + 3  # 3 nodes x 4 kinds, head net/mnt/uts
    assert pids_in(inodes)
    c.close()
    stray.wait(timeout=30)
    assert _leftovers(c.base, inodes) == {"mounts": [], "pids": [], "dir": False}
    assert _machine_state() == links
    c.close()  # idempotent


KILLED_RUN = """
import sys, time
sys.path.insert(0, sys.argv[1])
from cluster.harness import Cluster
c = Cluster(2).start()
c.popen("n1", ["sleep", "600"])
print(c.base, flush=True)
time.sleep(600)
"""


def test_sweep_removes_what_a_killed_run_left(cluster_reason):
    if cluster_reason:
        pytest.skip(cluster_reason)
    links = _machine_state()
    run = subprocess.Popen([PY, "-c", KILLED_RUN, os.path.dirname(HERE)], stdout=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        base = run.stdout.readline().strip()
        assert os.path.basename(base).startswith(PREFIX)
        ns = os.path.join(base, "ns")
        inodes = {k: {os.stat(os.path.join(ns, x)).st_ino for x in os.listdir(ns) if x.endswith("." + k)}
                  for k in ("net", "pid")}
        assert pids_in(inodes)
        assert base not in sweep()  # its owner is alive: not a leftover
        os.killpg(run.pid, signal.SIGKILL)  # the test run is killed: no teardown
        run.wait(timeout=30)
        deadline = time.monotonic() + 30
        while base not in sweep():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert _leftovers(base, inodes) == {"mounts": [], "pids": [], "dir": False}
        assert _machine_state() == links
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=30)
        run.stdout.close()
