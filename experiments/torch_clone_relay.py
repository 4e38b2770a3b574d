"""What the torch clone's relay hop costs per byte: two processes swap ``--mb`` MB each way in 2 MB
chunks, by gloo broadcasts (what the clone's rebuild used before issue 44) and over the
authenticated wire (:mod:`deepfreeze.net` channels with their Poly1305 payload MAC, what
:mod:`deepfreeze.clone.relay` uses), alternated ``--reps`` times; wall and CPU seconds per rank.
A profile for docs/performance.md's clone section (issue 44, item 3), not a target.

    python -m experiments.torch_clone_relay                 # 63 MB each way (half the 40 MB model's state), 3 reps
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHUNK = 2 << 20


def _worker(mb: float, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    sys.path.insert(0, ROOT)
    from deepfreeze import net
    dist.init_process_group("gloo")
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    n = int(mb * (1 << 20)) // CHUNK * CHUNK
    mine = torch.full((n,), rank + 1, dtype=torch.uint8)
    other = torch.empty(n, dtype=torch.uint8)
    token = "r" * 64
    sock = net.listen("127.0.0.1", 0)
    ports = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(ports, torch.tensor([sock.getsockname()[1]]))
    ready: list = []
    acceptor = net.Acceptor(sock, token, ready.append, name="relay-cost")
    client = net.connect(f"127.0.0.1:{int(ports[peer])}", 30)

    def answer() -> None:
        while not ready:
            time.sleep(0.001)
        ready[0].recv(max_payload=0, deadline=time.monotonic() + 30)
        ready[0].send({"ok": True}, deadline=time.monotonic() + 30)
    t = threading.Thread(target=answer)
    t.start()
    out_ch, _ = net.client_handshake(client, token, {"df": "relay-cost"}, deadline=time.monotonic() + 30)
    t.join()
    in_ch = ready[0]

    def gloo() -> None:
        bufs = [mine, other] if rank == 0 else [other, mine]
        for j in range(2):
            for k in range(0, n, CHUNK):
                dist.broadcast(bufs[j][k:k + CHUNK], src=j)

    def wire() -> None:
        def recv() -> None:
            mv = other.numpy()
            for k in range(0, n, CHUNK):
                in_ch.recv(max_header=4096, max_payload=CHUNK, deadline=time.monotonic() + 60).recv_into(
                    mv[k:k + CHUNK])
        r = threading.Thread(target=recv)
        r.start()
        mv = mine.numpy()
        for k in range(0, n, CHUNK):
            out_ch.send({"k": k}, [mv[k:k + CHUNK]], deadline=time.monotonic() + 60)
        r.join()

    rows = []
    for i in range(reps):
        for name, fn in (("gloo", gloo), ("wire", wire)) if i % 2 == 0 else (("wire", wire), ("gloo", gloo)):
            other.zero_()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            rows.append({"how": name, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0})
            assert int(other[0]) == peer + 1 and int(other[-1]) == peer + 1
    with open(f"{out}.r{rank}", "w") as f:
        json.dump(rows, f)
    acceptor.close()
    dist.destroy_process_group()


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=63.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.mb, args.reps, args.worker)
        return 0
    import tempfile
    out = os.path.join(tempfile.mkdtemp(prefix="df-relay-cost-"), "rows")
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    cmd = [exe or sys.executable, *([] if exe else ["-m", "torch.distributed.run"]), "--standalone",
           "--nproc-per-node", "2", os.path.abspath(__file__), "--mb", str(args.mb), "--reps", str(args.reps),
           "--worker", out]
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    rows = [dict(r, rank=k) for k in range(2) for r in json.load(open(f"{out}.r{k}"))]
    for how in ("gloo", "wire"):
        w = [r["wall_s"] for r in rows if r["how"] == how]
        c = [r["cpu_s"] for r in rows if r["how"] == how]
        print(f"{how}: {args.mb:g} MB each way, wall {1000 * sum(w) / len(w):.0f} ms [{1000 * min(w):.0f}, "
              f"{1000 * max(w):.0f}], CPU per rank {1000 * sum(c) / len(c):.0f} ms [{1000 * min(c):.0f}, "
              f"{1000 * max(c):.0f}] over {len(w)} rank-runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
