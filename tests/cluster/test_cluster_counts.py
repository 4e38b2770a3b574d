"""Counts against node count (issue 27 item 5): the same checkpoint job on 1, 2, 4 and 8 nodes,
one rank each, counted by the library itself (:mod:`deepfreeze.counters`, ``DEEPFREEZE_COUNTERS``).

The job (workers/counts_job.py): T float32 tensors of E elements (B = 4 E bytes each, split in N
pieces of P = B / N bytes, a multiple of 4096), V versions, async mode (one backend per node),
XOR parity across the nodes (ec_interval 0), every version flushed to the shared directory.
The formulas below are derived from the protocol (docs/cluster.md, "Counts against node count",
gives the derivation and evaluates them at 1000 nodes). Four quantities depend on timing, not
only on N; the library counts them too, and the formulas are exact given them:

* L (``persistent.decide.locked``): flushes of a version that found no decision yet (1 <= L per
  version <= N); Lt of them (``persistent.decide.taken``) took the version's lock (the first one
  makes the decision, others that got the lock after it find it made under the lock), and the
  rest found the lock held and waited for the decision: W (``persistent.decide.waited``) re-reads
  of it in all, each after a pause, never queuing on the lock (1 <= Lt <= L);
* Kf (``persistent.finalize.locked``), F (``persistent.finalize.tries``): nodes that saw every done
  marker and tried / got the lock to finalize (1 <= Kf <= F <= N per version; one commits);
* Bz (``persistent.lock.busy``): rounds that found a version's lock held by another node.
"""
import glob
import json
import math
import os
import sys
import time
from collections import Counter

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PY = sys.executable
JOB = os.path.join(HERE, "workers", "counts_job.py")
T, E, V = 4, 1 << 14, 3  # 4 tensors of 64 KiB, 3 versions
B = 4 * E
HEAD = 4096  # format.DATA_ALIGN: header and index of a shard / the assembled file, then pieces at 4096-aligned offsets
SEGMENT = 64 << 20  # redundancy._SEGMENT


def _run(make_cluster, n):
    c = make_cluster(n)
    cdir = os.path.join(c.shared, "counters")
    os.makedirs(cdir)
    env = {"PYTHONPATH": ROOT, "DEEPFREEZE_BACKEND_IDLE": "1", "DEEPFREEZE_COUNTERS": cdir}
    c.mpirun(c.names, [PY, JOB, c.scratch, c.shared, str(T), str(E), str(V)], timeout=400, env=env)
    deadline = time.monotonic() + 60  # each node's backend dumps at its exit, 1 s after its last client left
    while len(glob.glob(os.path.join(cdir, "backend.*.json"))) < n:
        assert time.monotonic() < deadline, os.listdir(cdir)
        time.sleep(0.2)
    nodes = {}
    for f in glob.glob(os.path.join(cdir, "*.json")):
        with open(f) as fh:
            d = json.load(fh)
        node = nodes.setdefault(d["host"], {"counters": Counter(), "records": {}, "tags": []})
        node["counters"].update(d["counters"])
        node["tags"].append(d["tag"])
        for k, v in d["records"].items():
            node["records"].setdefault(k, []).extend(v)
    ranks = {}
    for r in range(n):
        with open(os.path.join(c.shared, f"counts.rank{r}.json")) as fh:
            ranks[r] = json.load(fh)
    assert sorted(nodes) == sorted(c.names) and all(sorted(x["tags"]) == ["backend", f"rank{int(h[1:]) - 1}"]
                                                    for h, x in nodes.items()), nodes
    assert [ranks[r]["host"] for r in range(n)] == c.names
    return c, nodes


def _shared(counts):
    """The counters of operations on the shared directory (sites persistent.*, run.*)."""
    return {k.split(".", 1)[1]: v for k, v in counts.items()
            if k.startswith("fs.") and k.split(":", 1)[1].split(".")[0] in ("persistent", "run")}


def manifest_bytes(t, n):
    """An upper bound of the committed manifest's size at T tensors and N ranks (docs/cluster.md):
    O(T + N), the plan record lists no piece (it listed T N of them, ~48 bytes each, before)."""
    return 800 + 110 * t + 110 * n


def expected_shared(n, L, Lt, W, Kf, Bz, R):
    """Every file-system call the job issues on the shared directory, summed over the nodes, for
    V versions on n nodes (R of the first flushes found the persistent root missing: each one more
    lstat of its parent, one more mkdir and the lstat after it)."""
    return {
        # decide: every flush reads the decision; L find none (makedirs: the root's lstat, mkdir +
        # lstat of the name and version directories); Lt take the lock and read it again under
        # the lock after the fence (the lease), W re-reads while waiting for it; V make it
        # (exclusive create: temp, link, unlink)
        "open:persistent.decision.read": n * V + Lt + W + 2 * V,
        "stat:persistent.mkdirs": 3 * L + 2 * R, "stat:persistent.mkdirs.root": L, "mkdir:persistent.mkdirs": 2 * L + R,
        "stat:persistent.decide.manifest": V,
        "create:persistent.decision.create": V, "link:persistent.decision.link": V,
        "unlink:persistent.decision.tmp": V,
        # the version lock: one round per take and per busy round (temp, link, unlink the temp; a
        # busy round reads the holder), released by read + unlink
        "create:persistent.lock.create": Lt + Kf + Bz, "link:persistent.lock.link": Lt + Kf + Bz,
        "unlink:persistent.lock.tmp": Lt + Kf + Bz, "open:persistent.lock.read": Lt + Kf + Bz,
        "unlink:persistent.lock.unlink": Lt + Kf,
        # the fence: under the decide lock, under the finalize lock, before the commit, before retention
        "open:run.lease.read": Lt + Kf + 2 * V,
        # flush of each rank: 2 stats, the partial opened with O_CREAT, fsync; its done marker
        # (temp create, fsync, rename, directory fsync); the marker listing
        "stat:persistent.flush.manifest": n * V, "stat:persistent.flush.assembled": n * V,
        "create:persistent.partial.create": n * V, "fsync:persistent.partial.fsync": n * V,
        "create:persistent.marker.create": n * V, "fsync:persistent.marker.fsync": n * V,
        "replace:persistent.marker.rename": n * V, "fsync:persistent.marker.dirsync": n * V,
        "listdir:persistent.finalize.markers": n * V,
        # finalize (Kf got the lock; one per version commits): n markers read, header written,
        # fsync, rename, manifest (create, fsync, rename, dirsync), n markers removed
        "stat:persistent.finalize.manifest": Kf,
        "open:persistent.finalize.marker": n * V, "stat:persistent.finalize.assembled": V,
        "open:persistent.final.open": V, "fsync:persistent.final.fsync": V, "replace:persistent.final.rename": V,
        "create:persistent.manifest.create": V, "fsync:persistent.manifest.fsync": V,
        "replace:persistent.manifest.rename": V, "fsync:persistent.manifest.dirsync": V,
        "unlink:persistent.cleanup.unlink": n * V,
        # retention after each commit (max_versions 0): the generation, two listings of the versions
        "open:run.generation.read": V, "listdir:persistent.versions": 2 * V,
    }


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_counts_against_node_count(make_cluster, n):
    c, nodes = _run(make_cluster, n)
    total = Counter()
    for x in nodes.values():
        total.update(x["counters"])
    P = B // n                   # one piece: each rank holds one piece of each tensor
    D = T * P                    # a rank's payload
    S = HEAD + D                 # its shard file (header and index in the first 4096 bytes)
    L, Lt, W, F, Kf, Bz = (total[f"persistent.{k}"] for k in ("decide.locked", "decide.taken", "decide.waited",
                                                                "finalize.tries", "finalize.locked", "lock.busy"))
    assert V <= Lt <= L <= n * V and V <= Kf <= F <= n * V and Bz >= 0, (L, Lt, F, Kf, Bz)
    # every lock attempt that did not take the lock found it held once (wait 0): a lost finalize
    # try, and each round of a flush waiting for the decision (one attempt before each re-read,
    # one more if the lock came free but a decision was there by the time it was read)
    assert Bz >= (F - Kf) + (L - Lt), (Bz, F, Kf, L, Lt)
    assert W >= L - Lt, (W, L, Lt)  # each flush that never took the lock re-read the decision at least once
    shared = _shared(total)
    # retention after the commit of version w looks at the manifest of every version directory present:
    # 1..w (committed in order: a version is committed before every marker of the next one exists),
    # plus those a faster node already made for later versions (at most V in all); it reads one
    # (open) only when its node's backend has not validated that file before, else a stat
    # (persistent.manifest.known, Level.committed_run); the node that committed a manifest never reads
    # it back (Level.remember_run at the commit, issue 45)
    reads = shared.pop("open:persistent.manifest.read", 0)
    m = reads + shared.pop("stat:persistent.manifest.known", 0)
    assert V * (V + 1) // 2 <= m <= V * V and reads <= m - V, (m, reads)
    # a busy round that could read the lock judges its age: lstat, then (unless the lock went away
    # in between) the file system's clock, a file created and removed (the holder is on another node)
    judged = shared.pop("stat:persistent.lock.stat", 0)
    clock = shared.pop("create:run.clock.create", 0)
    assert clock == shared.pop("unlink:run.clock.unlink", 0) <= judged <= Bz, (clock, judged, Bz)
    # (the skip sweep reads a decision only below the newest commit that is not committed: never here)
    # R: the first flushes that found the persistent root missing (they raced to create it)
    R = shared["mkdir:persistent.mkdirs"] - 2 * L
    assert 1 <= R <= n
    assert shared == expected_shared(n, L, Lt, W, Kf, Bz, R), (n, L, Lt, W, F, Kf, Bz, R)

    # the manifest grows as T + N (the compact plan record: no piece listed; docs/cluster.md):
    # ~500 bytes, ~95 per tensor, ~90 per rank (+ ~120 for the commit's keys on the shared directory)
    sizes = [os.path.getsize(p) for p in glob.glob(os.path.join(c.shared, "persistent", "job", "v*", "manifest.json"))]
    assert len(sizes) == V and max(sizes) <= manifest_bytes(T, n), (sizes, manifest_bytes(T, n))

    for h, x in nodes.items():
        r, k = int(h[1:]) - 1, x["counters"]
        # bytes moved by the node: its payload to scratch, the same to the shared directory, once per version
        assert k["bytes.scratch.data"] == V * D == V * T * B // n
        assert k["bytes.persistent.data"] == V * D
        # the offsets it writes in the assembled file: piece r of every tensor, each version
        want = Counter({(HEAD + t * B + r * P, P): V for t in range(T)})
        assert Counter(tuple(o) for o in x["records"]["offsets.persistent"]) == want, (h, x["records"])
        assert all(off % 4096 == 0 for off, _ in want)  # stripe/page aligned (PIECE_ALIGN, P % 4096 == 0)
        # scratch: shard, parity (n > 1) and manifest, each created and renamed once per version
        for what in ("shard", "manifest") + (("parity",) if n > 1 else ()):
            assert k[f"fs.create:scratch.{what}.create"] == k[f"fs.replace:scratch.{what}.rename"] == V, (h, what)
        # its per-version share of the shared directory's operations (independent of timing)
        for site, each in (("stat:persistent.flush.manifest", 1), ("create:persistent.partial.create", 1),
                           ("fsync:persistent.partial.fsync", 1), ("replace:persistent.marker.rename", 1),
                           ("listdir:persistent.finalize.markers", 1)):
            assert k["fs." + site] == each * V, (h, site)
        assert k["fs.open:persistent.decision.read"] >= V
        # messages per rank: one allgather (2 MPI collectives) of the failure domains, then per
        # version one allgather (sizes, wishes) and one exchange round: n - 1 chunks of c bytes
        # to the other members of its XOR group (all n ranks), n - 1 received
        if n == 1:
            assert k["comm.allgather"] == 1 and k["comm.exchange"] == 0 and k["bytes.scratch.redundancy"] == 0
            continue
        c_ = math.ceil(S / (n - 1))  # the XOR chunk: the largest shard file in n - 1 stripes
        assert k["comm.allgather"] == V + 1
        assert k["comm.exchange"] == V * math.ceil(c_ / SEGMENT)
        assert k["comm.send"] == k["comm.recv"] == V * (n - 1)
        assert k["comm.send.bytes"] == k["comm.recv.bytes"] == V * (n - 1) * c_
        # the parity file: 12 bytes of magic and length, a JSON header, the c parity bytes
        assert V * (c_ + 12) < k["bytes.scratch.redundancy"] < V * (c_ + 12 + 1024)
    print(json.dumps({"n": n, "L": L, "Lt": Lt, "W": W, "F": F, "Kf": Kf, "busy": Bz, "R": R, "manifest_looks": m, "manifest_reads": reads,
                      "judged": judged, "clock": clock, "shared_ops": sum(shared.values()) + m + judged + 2 * clock}))
