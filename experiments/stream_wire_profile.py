"""Where a 102 MB stream fetch over TCP goes (issue 44's cross-node target): on loopback, nothing
else running, the same bytes as a raw socket transfer, as the authenticated fetch of a
:class:`deepfreeze.stream.wire.RankClient` from a :class:`~deepfreeze.stream.wire.RankServer` in
another process (its CRC32 checked), and Poly1305, CRC32 and one copy alone. A profile, not a
comparison: medians of 6 transfers (5 for the primitives), one run.

    python experiments/stream_wire_profile.py --out experiments/results/stream_wire_profile.json
"""
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import numpy as np  # noqa: E402
N = 102_400_000
TOKEN = "5" * 64
if sys.argv[1:] == ["server"]:
    from deepfreeze.stream.slots import SlotRing
    from deepfreeze.stream.wire import RankServer
    from deepfreeze.lease import RunInfo, Version
    path = f"/dev/shm/wireprof-{os.getpid()}"
    ring = SlotRing.create(path, N, 4)
    ring.write(Version(0, 1), np.random.default_rng(0).integers(0, 255, N, dtype=np.uint8))
    run = RunInfo("wireprof", 0)
    srv = RankServer(ring, channel="wp", rank=0, world=1, run=run, token=TOKEN)
    # raw socket server
    ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(1)
    print(srv.address, ls.getsockname()[1], flush=True)
    c, _ = ls.accept()
    buf = memoryview(np.random.default_rng(1).integers(0, 255, N, dtype=np.uint8))
    for _ in range(6):
        c.recv(1); c.sendall(buf)
    sys.stdin.read(); ring.close(); ring.unlink()
    sys.exit(0)
out_path = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
load0 = os.getloadavg()
p = subprocess.Popen([sys.executable, __file__, "server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
addr, port = p.stdout.readline().split()
from deepfreeze.stream.wire import RankClient  # noqa: E402
from deepfreeze.lease import Version  # noqa: E402
from deepfreeze.format import crc32  # noqa: E402
out = np.empty(N, np.uint8)
res = {}
s = socket.create_connection(("127.0.0.1", int(port)))
t = []
mv = memoryview(out)
for _ in range(6):
    t0 = time.perf_counter(); s.send(b"x"); got = 0
    while got < N:
        got += s.recv_into(mv[got:], N - got)
    t.append(time.perf_counter() - t0)
res["raw_tcp_ms"] = sorted(t)[len(t)//2] * 1e3
c = RankClient(addr, TOKEN, channel="wp", timeout=30)
t = []
for _ in range(6):
    t0 = time.perf_counter(); c.fetch(Version(0, 1), out); t.append(time.perf_counter() - t0)
res["auth_fetch_with_crc_ms"] = sorted(t)[len(t)//2] * 1e3
t = []
for _ in range(5):
    t0 = time.perf_counter(); crc32(out); t.append(time.perf_counter() - t0)
res["crc32_ms"] = sorted(t)[2] * 1e3
from cryptography.hazmat.primitives.poly1305 import Poly1305
t = []
for _ in range(5):
    t0 = time.perf_counter(); m = Poly1305(b"k" * 32); m.update(out); m.finalize(); t.append(time.perf_counter() - t0)
res["poly1305_ms"] = sorted(t)[2] * 1e3
dst = np.empty_like(out)
t = []
for _ in range(5):
    t0 = time.perf_counter(); np.copyto(dst, out); t.append(time.perf_counter() - t0)
res["copy_ms"] = sorted(t)[2] * 1e3
c.close()
p.stdin.close()
p.wait(10)
doc = {"experiment": "stream_wire_profile", "bytes": N, "statistic": "median of 6 transfers / 5 primitive runs",
       "load_avg_start": load0, "ms": {k: round(v, 1) for k, v in res.items()}}
print(json.dumps(doc["ms"]))
if out_path:
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
