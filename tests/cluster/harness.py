"""A test cluster on one machine: N nodes made of Linux namespaces (docs/cluster-harness.md).

Every node is a persistent set of namespaces (network, mount, UTS, PID) made by ``unshare
--net=FILE --mount=FILE --uts=FILE --pid=FILE --fork --mount-proc`` onto files bind-mounted in
``<base>/ns`` (a private mount), so they outlive one command; commands enter them with
``nsenter`` on those files (``ip netns exec`` would make a fresh mount namespace every call).
A node has its own host name (``n1``, ``n2``, ...), its own ``/tmp`` (also its runtime
directory), ``/dev/shm``, a node-local scratch tmpfs at :attr:`Cluster.scratch` (one path, other
contents on every node), its own ``/proc`` and an ``/etc/hosts`` naming every node. Its pid 1 is
a small reaper; killing the PID namespace kills the node.

The network: a *head* namespace (network, mount, UTS; host name ``head``) holds a bridge; every
node has a veth link ``dfz0`` to it. Addresses exist only on those links (``<subnet>.<i>`` for
node ``n<i>``, ``<subnet>.254`` on the bridge), and there is no route out of them: nothing is
added to the machine's own network namespace, so no test traffic can go anywhere else.

Open MPI runs from the head (:meth:`Cluster.mpirun`, or :meth:`Cluster.head` with any command):
``plm_rsh_agent`` is ``<base>/agent`` (an ``nsenter`` into the named node), tree spawn is off and
``oob_tcp_if_include``/``btl_tcp_if_include`` name the cluster subnet, all set in the environment,
so ``mpirun -H n1:1,n2:1,n3:1 ...`` and Horovod jobs run unchanged.

Everything is under ``<base> = /var/tmp/dfz-cluster-<pid>-<random>`` (not under ``/tmp``, which
every node replaces); :func:`sweep` removes what a killed run left (its owner process is gone):
it kills the processes of its namespaces, unmounts its files and deletes the directory.
"""
from __future__ import annotations

import glob
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

__all__ = ["PREFIX", "Cluster", "ClusterError", "cannot_make_namespaces", "sweep", "torchrun_nodes"]

#: every directory the harness makes is ``<BASE_DIR>/<PREFIX>-<pid>-<random>``
PREFIX = "dfz-cluster"
BASE_DIR = "/var/tmp"
SUBNET = "10.231.7"
BRIDGE = "dfzbr0"
IFACE = "dfz0"
_KINDS = ("net", "mnt", "uts", "pid")
_NSENTER_FLAG = {"net": "--net", "mnt": "--mount", "uts": "--uts", "pid": "--pid"}
_TOOLS = ("unshare", "nsenter", "ip", "mount", "umount", "mpirun")

_INIT = r"""
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
open(sys.argv[1], "w").write(str(os.getpid()))
while True:  # pid 1 of the node: reap orphans (a backend in its own session ends up here)
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.5)
"""

# run as pid 1 of a fresh node (inside its namespaces), then exec the reaper
_SETUP = r"""set -e
name=$1 base=$2 scratch=$3 size=$4 py=$5 keep=$6
hostname "$name"
umount -l "$base/ns" 2>/dev/null || true   # no references from this node to the other nodes' namespaces
# directories under /tmp that every node must still see (the checkout and its venv, when a clone
# lives there): held aside, then bound again at the same path inside the node's own /tmp
i=0
for k in $keep; do i=$((i+1)); mkdir -p "$base/keep/$name.$i"; mount --bind "$k" "$base/keep/$name.$i"; done
mount -t tmpfs -o mode=1777,size=$size dfz-tmp /tmp
i=0
for k in $keep; do i=$((i+1)); mkdir -p "$k"; mount --bind "$base/keep/$name.$i" "$k"; umount -l "$base/keep/$name.$i"; done
mount -t tmpfs -o mode=1777,size=$size dfz-shm /dev/shm
mount -t tmpfs -o mode=0755,size=$size dfz-scratch "$scratch"
mount --bind "$base/hosts" /etc/hosts
exec "$py" -c "$(cat "$base/init.py")" "$base/nodes/$name.ready"
"""

_AGENT = r"""#!/bin/sh
# Open MPI's plm_rsh_agent for the test cluster: [ssh options] HOST COMMAND... -> run COMMAND on HOST
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host=$1; shift
ns=%(ns)s
[ -e "$ns/$host.pid" ] || { echo "dfz agent: no node $host" >&2; exit 255; }
# the head has a mount namespace of its own (its /etc/hosts), where the namespace files are plain
# files: open them from the mount namespace of the process that owns the cluster
exec nsenter --mount=/proc/%(owner)d/ns/mnt -- nsenter --net="$ns/$host.net" --mount="$ns/$host.mnt" --uts="$ns/$host.uts" --pid="$ns/$host.pid" \
    -- /bin/sh -c "$*"
"""


def _kept_under_tmp() -> list[str]:
    """The directories under ``/tmp`` every node must still see although it gets a ``/tmp`` of its
    own: this checkout (tests, workers, the package) and the Python environment, when they live
    there (e.g. a CI clone in ``/tmp``). Paths with spaces are not supported (ClusterError)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out: list[str] = []
    for p in sorted({root, os.path.realpath(root), sys.prefix, os.path.realpath(sys.prefix)}):
        if p == "/tmp" or not p.startswith("/tmp/") or any(p == q or p.startswith(q + "/") for q in out):
            continue
        if any(c.isspace() for c in p):
            raise ClusterError(f"{p}: a path with spaces under /tmp cannot be kept on the test cluster's nodes; "
                               "clone the repository elsewhere")
        out.append(p)
    return out


class ClusterError(RuntimeError):
    """The cluster could not be made, or a command on it failed."""


def cannot_make_namespaces() -> str | None:
    """Why no cluster can be made here (a skip reason), or None."""
    if os.getuid() != 0:
        return "the test cluster needs root (namespaces, tmpfs mounts, veth links)"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"the test cluster needs {', '.join(missing)} (apt-get install iproute2 util-linux openmpi-bin)"
    probe = subprocess.run(["unshare", "--net", "--mount", "--uts", "--pid", "--fork", "true"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"unshare cannot make namespaces here: {probe.stderr.strip()[:200]}"
    probe = subprocess.run(["unshare", "--net", "sh", "-c", f"ip link add {BRIDGE} type bridge && "
                            f"ip link add dfzv0 type veth peer name dfzv1"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot make a bridge and veth links in a network namespace: {probe.stderr.strip()[:200]}"
    return None


def _proc_start(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[19].decode()
    except (OSError, IndexError):
        return None


def _mounts_under(path: str) -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp == path or mp.startswith(path + "/"):
                out.append(mp)
    return out


def _ns_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def pids_in(inodes: dict[str, set[int]]) -> list[int]:
    """Host pids of every process in one of the namespaces ``{kind: {inode}}`` (kind: net, pid, mnt, uts)."""
    found = []
    for d in glob.glob("/proc/[0-9]*"):
        pid = int(d[6:])
        for kind, inos in inodes.items():
            try:
                link = os.readlink(f"{d}/ns/{kind}")
            except OSError:
                continue
            if int(link[link.index("[") + 1:-1]) in inos:
                found.append(pid)
                break
    return found


def _kill_all(inodes: dict[str, set[int]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p in pids_in(inodes) if p != os.getpid()]
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise ClusterError(f"processes {pids} of the cluster survive SIGKILL")
        time.sleep(0.05)


def _remove_base(base: str) -> None:
    """Kill every process of ``base``'s namespaces, unmount its files, delete it."""
    inodes: dict[str, set[int]] = {k: set() for k in _KINDS}
    for f in glob.glob(os.path.join(base, "ns", "*.*")):
        kind = f.rsplit(".", 1)[1]
        ino = _ns_inode(f)
        if kind in inodes and ino is not None and f in _mounts_under(f):
            inodes[kind].add(ino)
    _kill_all(inodes)
    for mp in sorted(_mounts_under(base), key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], capture_output=True, timeout=30)
    if _mounts_under(base):
        raise ClusterError(f"mounts under {base} survive umount: {_mounts_under(base)}")
    shutil.rmtree(base, ignore_errors=True)


def sweep(base_dir: str = BASE_DIR) -> list[str]:
    """Remove what killed test runs left: every ``<base_dir>/dfz-cluster-*`` whose owner process
    is gone. Clusters of live processes (other test runs at the same time) are left alone.
    Returns the directories removed."""
    removed = []
    for base in glob.glob(os.path.join(base_dir, PREFIX + "-*")):
        try:
            with open(os.path.join(base, "owner")) as f:
                pid, start = f.read().split()
            if _proc_start(int(pid)) == start:
                continue  # its run is alive
        except (OSError, ValueError):
            # no owner file yet: being made right now, unless old
            try:
                if time.time() - os.lstat(base).st_mtime < 120:
                    continue
            except OSError:
                continue
        _remove_base(base)
        removed.append(base)
    return removed


class Cluster:
    """``n`` nodes ``n1`` .. ``n<n>`` on one machine (see the module docstring).

    Use as a context manager, or call :meth:`start` (idempotent) and :meth:`close` (leaves
    nothing: processes, namespaces, links, mounts, files)."""

    def __init__(self, n: int = 3, *, tmpfs_size: str = "512m", subnet: str = SUBNET,
                 base_dir: str = BASE_DIR) -> None:
        if not 1 <= n <= 200:
            raise ValueError("1 to 200 nodes")
        self.n = n
        self.names = [f"n{i}" for i in range(1, n + 1)]
        self.tmpfs_size, self.subnet = tmpfs_size, subnet
        self.base = os.path.join(base_dir, f"{PREFIX}-{os.getpid()}-{secrets.token_hex(4)}")
        self.ns = os.path.join(self.base, "ns")
        #: the parallel file system: one directory every node (and the test) sees
        self.shared = os.path.join(self.base, "shared")
        #: node-local scratch: one path, a tmpfs of its own on every node (empty on the machine itself)
        self.scratch = os.path.join(self.base, "scratch")
        self.agent = os.path.join(self.base, "agent")
        self._holders: dict[str, subprocess.Popen] = {}
        self._started = False

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def address(self, name: str) -> str:
        """The node's address on the cluster link (``head``: the bridge's)."""
        return f"{self.subnet}.254" if name == "head" else f"{self.subnet}.{int(name[1:])}"

    def _nsfile(self, name: str, kind: str) -> str:
        return os.path.join(self.ns, f"{name}.{kind}")

    def _sh(self, argv: list[str], timeout: float = 30) -> None:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()[:500]}")

    def _head_net(self, *ip_args: str) -> None:
        self._sh(["nsenter", f"--net={self._nsfile('head', 'net')}", "ip", *ip_args])

    def start(self) -> "Cluster":
        """Make the head, the bridge and every node not yet up (idempotent)."""
        if self._started:
            for name in self.names:
                if not self.is_up(name):
                    self.start_node(name)
            return self
        sweep(os.path.dirname(self.base))
        try:
            for d in (self.ns, self.shared, self.scratch, os.path.join(self.base, "nodes")):
                os.makedirs(d, exist_ok=True)
            os.chmod(self.shared, 0o1777)
            with open(os.path.join(self.base, "owner"), "w") as f:
                f.write(f"{os.getpid()} {_proc_start(os.getpid())}")
            self._sh(["mount", "--bind", self.ns, self.ns])
            self._sh(["mount", "--make-private", self.ns])
            with open(os.path.join(self.base, "hosts"), "w") as f:
                f.write("127.0.0.1 localhost\n" + f"{self.address('head')} head\n"
                        + "".join(f"{self.address(n)} {n}\n" for n in self.names))
            with open(os.path.join(self.base, "init.py"), "w") as f:
                f.write(_INIT)
            with open(os.path.join(self.base, "setup.sh"), "w") as f:
                f.write(_SETUP)
            with open(self.agent, "w") as f:
                f.write(_AGENT % {"ns": self.ns, "owner": os.getpid()})
            os.chmod(self.agent, 0o755)
            # the head: network (bridge), mount (/etc/hosts), UTS (host name "head")
            for kind in ("net", "mnt", "uts"):
                open(self._nsfile("head", kind), "w").close()
            self._sh(["unshare", f"--net={self._nsfile('head', 'net')}", f"--mount={self._nsfile('head', 'mnt')}",
                      f"--uts={self._nsfile('head', 'uts')}", "sh", "-c",
                      f"hostname head && mount --bind {self.base}/hosts /etc/hosts && ip link set lo up"])
            # a fixed MAC: a bridge otherwise takes the lowest of its ports' and changes it when a
            # node's link is replaced (lose, start_node), black-holing every node's packets to the
            # head (mpirun) until their ARP entries go stale
            self._head_net("link", "add", BRIDGE, "address", "02:df:00:00:ff:fe", "type", "bridge")
            self._head_net("addr", "add", f"{self.address('head')}/24", "dev", BRIDGE)
            self._head_net("link", "set", BRIDGE, "up")
            self._started = True
            for name in self.names:
                self.start_node(name)
        except BaseException:
            self.close()
            raise
        return self

    def start_node(self, name: str, timeout: float = 30) -> None:
        """Make node ``name`` (fresh: empty /tmp, /dev/shm and scratch) and link it to the bridge."""
        files = {k: self._nsfile(name, k) for k in _KINDS}
        for f in files.values():
            open(f, "w").close()
        ready = os.path.join(self.base, "nodes", f"{name}.ready")
        if os.path.exists(ready):
            os.unlink(ready)
        log = open(os.path.join(self.base, "nodes", f"{name}.log"), "wb")
        self._holders[name] = subprocess.Popen(
            ["unshare", *(f"{_NSENTER_FLAG[k]}={f}" for k, f in files.items()), "--fork", "--mount-proc",
             "sh", os.path.join(self.base, "setup.sh"), name, self.base, self.scratch, self.tmpfs_size,
             sys.executable, " ".join(_kept_under_tmp())], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while not os.path.exists(ready):
            if self._holders[name].poll() is not None or time.monotonic() > deadline:
                with open(os.path.join(self.base, "nodes", f"{name}.log"), errors="replace") as f:
                    raise ClusterError(f"node {name} did not come up: {f.read()[-2000:]}")
            time.sleep(0.02)
        veth = f"v{name}"
        # the same MAC address for a node that comes back (start_node after lose): the others' ARP
        # caches still hold it, and a new one would black-hole their packets until the entry goes stale
        i = int(name[1:])
        mac = f"02:df:00:00:{i >> 8:02x}:{i & 0xff:02x}"
        self._head_net("link", "add", veth, "address", f"02:df:00:01:{i >> 8:02x}:{i & 0xff:02x}", "type", "veth",
                       "peer", "name", IFACE, "address", mac, "netns", files["net"])
        self._head_net("link", "set", veth, "master", BRIDGE, "up")
        self.run(name, ["sh", "-c", f"ip link set lo up && ip addr add {self.address(name)}/24 dev {IFACE} && "
                                    f"ip link set {IFACE} up"], timeout=30)

    def is_up(self, name: str) -> bool:
        h = self._holders.get(name)
        return h is not None and h.poll() is None

    def lose(self, name: str) -> None:
        """Node loss: kill every process of the node's PID namespace, drop its link, and its
        namespaces with their tmpfs (scratch, /dev/shm, /tmp are gone)."""
        inodes = {k: {i} for k in ("pid", "net") if (i := _ns_inode(self._nsfile(name, k))) is not None}
        _kill_all(inodes)
        h = self._holders.pop(name, None)
        if h is not None:
            h.wait(timeout=10)
        subprocess.run(["nsenter", f"--net={self._nsfile('head', 'net')}", "ip", "link", "del", f"v{name}"],
                       capture_output=True, timeout=30)
        for kind in _KINDS:
            f = self._nsfile(name, kind)
            if _mounts_under(f):
                self._sh(["umount", f])
            if os.path.exists(f):
                os.unlink(f)

    def signal(self, name: str, sig: int) -> list[int]:
        """Send ``sig`` to every process of node ``name`` (``SIGSTOP``: the node's processes are
        stopped, as a node that hangs; ``SIGCONT``: resumed). Returns the host pids signalled."""
        ino = _ns_inode(self._nsfile(name, "pid"))
        if ino is None:
            raise ClusterError(f"no node {name}")
        pids = pids_in({"pid": {ino}})
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        return pids

    def partition(self, name: str) -> None:
        """Cut node ``name`` off the network (its link on the bridge down): its processes live on,
        nothing reaches it or leaves it. :meth:`heal` reconnects it."""
        self._head_net("link", "set", f"v{name}", "down")

    def heal(self, name: str) -> None:
        """Undo :meth:`partition`."""
        self._head_net("link", "set", f"v{name}", "up")

    def limit(self, name: str, rate: str | None) -> None:
        """Rate-limit node ``name``'s link in both directions with a token bucket (``tc ... tbf``;
        ``rate`` as tc writes it, e.g. ``"8mbit"``); ``None`` removes the limit."""
        for where, dev in (("head", f"v{name}"), (name, IFACE)):
            if rate is None:
                self.run(where, ["tc", "qdisc", "del", "dev", dev, "root"], timeout=30, check=False)
            else:
                self.run(where, ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                                 "burst", "32kb", "latency", "400ms"], timeout=30)

    def namespace_inodes(self) -> dict[str, set[int]]:
        """``{kind: {inode}}`` of every namespace of the cluster (to check that none is left)."""
        out: dict[str, set[int]] = {k: set() for k in _KINDS}
        for f in glob.glob(os.path.join(self.ns, "*.*")):
            kind = f.rsplit(".", 1)[1]
            if kind in out and _mounts_under(f):
                out[kind].add(os.stat(f).st_ino)
        return out

    def close(self) -> None:
        """Tear everything down: processes, namespaces (with their links and tmpfs), mounts, files."""
        _remove_base(self.base)
        for h in self._holders.values():
            try:
                h.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._holders.clear()
        self._started = False

    # ------------------------------------------------------------------ commands
    def nsenter(self, name: str, cwd: str | None = None) -> list[str]:
        """The command prefix that runs something on node ``name`` (or ``head``) in directory
        ``cwd`` (default: the current one; entering a mount namespace would otherwise start at /)."""
        kinds = ("net", "mnt", "uts") if name == "head" else _KINDS
        return ["nsenter", *(f"{_NSENTER_FLAG[k]}={self._nsfile(name, k)}" for k in kinds),
                f"--wd={os.path.abspath(cwd or os.getcwd())}", "--"]

    def env(self, extra: dict | None = None) -> dict:
        """The environment for commands on the cluster: Open MPI's launcher and interfaces, root allowed."""
        env = dict(os.environ)
        for k in list(env):
            if k.startswith(("OMPI_", "PMIX_", "HOROVOD_")):
                del env[k]
        env.update({
            "OMPI_MCA_plm_rsh_agent": self.agent,
            "OMPI_MCA_plm_rsh_no_tree_spawn": "1",
            "OMPI_MCA_oob_tcp_if_include": f"{self.subnet}.0/24",
            "OMPI_MCA_btl_tcp_if_include": f"{self.subnet}.0/24",
            "OMPI_MCA_btl": "self,vader,tcp",
            "OMPI_MCA_rmaps_base_oversubscribe": "1",
            "OMPI_MCA_mpi_yield_when_idle": "1",  # every node shares this machine's cores: wait, don't poll
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2",
        })
        env.pop("DEEPFREEZE_RUNTIME_DIR", None)  # each node's own /tmp
        env.pop("XDG_RUNTIME_DIR", None)
        env.pop("DEEPFREEZE_NODE_ID", None)
        env.update(extra or {})
        return env

    def run(self, name: str, argv: list[str], *, timeout: float, env: dict | None = None, check: bool = True,
            cwd: str | None = None, input: str | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` on node ``name`` (or ``head``), bounded by ``timeout`` seconds."""
        try:
            p = subprocess.run(self.nsenter(name, cwd) + list(argv), capture_output=True, text=True,
                               timeout=timeout, env=self.env(env), input=input)
        except subprocess.TimeoutExpired as e:
            out, err = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
            raise ClusterError(f"on {name}: {' '.join(argv)} did not end within {timeout} s\nstdout:\n{out[-3000:]}"
                               f"\nstderr:\n{err[-5000:]}") from None
        if check and p.returncode != 0:
            raise ClusterError(f"on {name}: {' '.join(argv)} exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}"
                               f"\nstderr:\n{p.stderr[-5000:]}")
        return p

    def popen(self, name: str, argv: list[str], *, env: dict | None = None, cwd: str | None = None,
              **kw) -> subprocess.Popen:
        """Start ``argv`` on node ``name`` in the background (the caller waits with a timeout)."""
        return subprocess.Popen(self.nsenter(name, cwd) + list(argv), env=self.env(env), **kw)

    def mpirun(self, hosts: dict[str, int] | list[str], argv: list[str], *, timeout: float,
               env: dict | None = None, check: bool = True, cwd: str | None = None) -> subprocess.CompletedProcess:
        """``mpirun -H n1:1,n2:1,... argv`` from the head (``hosts``: names, or ``{name: slots}``)."""
        if not isinstance(hosts, dict):
            hosts = {h: 1 for h in hosts}
        spec = ",".join(f"{h}:{k}" for h, k in hosts.items())
        cmd = ["mpirun", "-H", spec, "-np", str(sum(hosts.values())), *argv]
        return self.run("head", cmd, timeout=timeout, env=env, check=check, cwd=cwd)


# ---------------------------------------------------------------------- torchrun across nodes
#: the c10d rendezvous port on the first node (every node has a network of its own: no clash)
TORCHRUN_PORT = 29400


def torchrun_nodes(cluster: Cluster, nodes: list[str], argv: list[str], *, timeout: float,
                   env: dict | None = None, nproc: int = 1) -> list[subprocess.CompletedProcess]:
    """``torchrun --nnodes len(nodes) --node-rank i --nproc-per-node nproc`` on each of ``nodes`` at
    once, c10d rendezvous on the first node's address on the cluster link, gloo on the node's link
    (``GLOO_SOCKET_IFNAME``); ``argv`` is the training script and its arguments. Every node's
    command must end within ``timeout`` seconds with status 0 (:class:`ClusterError` otherwise,
    with every node's output; the others are killed)."""
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    base = [exe] if os.path.exists(exe) else [sys.executable, "-m", "torch.distributed.run"]
    extra = {"GLOO_SOCKET_IFNAME": IFACE, "OMP_NUM_THREADS": "1", "TORCHELASTIC_ERROR_FILE": "",
             "PYTHONWARNINGS": "ignore", **(env or {})}
    procs = []
    for i, name in enumerate(nodes):
        cmd = [*base, "--nnodes", str(len(nodes)), "--node-rank", str(i), "--nproc-per-node", str(nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.address(nodes[0])}:{TORCHRUN_PORT}",
               "--rdzv-id", "dfz", "--max-restarts", "0", *argv]
        procs.append(cluster.popen(name, cmd, env=extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    outs: list[tuple[str, str] | None] = [None] * len(procs)
    failed = False
    for k, p in enumerate(procs):
        try:
            outs[k] = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            failed = True
            break
        if p.returncode != 0:
            failed = True
            break
    if failed:
        for k, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
            if outs[k] is None:
                try:
                    outs[k] = p.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    outs[k] = ("", "(no output)")
        raise ClusterError("torchrun across " + ", ".join(nodes) + " failed:\n" + "\n".join(
            f"--- {n}: exit {p.returncode}\nstdout:\n{o[0][-2000:]}\nstderr:\n{o[1][-4000:]}"
            for n, p, o in zip(nodes, procs, outs)))
    return [subprocess.CompletedProcess(p.args, p.returncode, o[0], o[1]) for p, o in zip(procs, outs)]
