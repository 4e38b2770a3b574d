"""What the frame MAC of :mod:`deepfreeze.net` (issue 23) costs: stream and repository-provider
throughput and small-message rate, MAC on vs off, side by side in one run.

    python experiments/net_mac.py            # ~2-3 min; writes experiments/results/net_mac.json and .png
    python experiments/net_mac.py --reps 7 --mib 64 --count 16

**Primitives** (one core, one 64 MiB buffer, best-of-3 per repetition): CRC32 (isal, what the
format uses), Poly1305 (the payload MAC chosen), HMAC-SHA256 (the header MAC, and the payload
MAC of the first design), keyed BLAKE2b-128 and keyed BLAKE2s-128 (the alternatives). A MAC over header + the payload's CRC32 would cost about the CRC (its
end-to-end cost lies between "MAC off" and "MAC on" below, close to "off"), but CRC32 is not
collision-resistant: an on-path attacker can change the payload and keep its CRC, so that
design is forgeable; only a MAC over the bytes is measured end to end.

**End to end** (loopback TCP, one server process forked per mode, the client in this process):

- ``stream``: a :class:`~deepfreeze.stream.wire.RankServer` over a ``/dev/shm`` slot ring
  holding one version of ``--mib`` MiB; :meth:`RankClient.fetch` of it ``--count`` times
  (``--mib`` x ``--count`` = 1 GiB per repetition by default) -> MB/s.
- ``stream-small``: ``--small`` fetches of a 1 KiB version (request + answer) -> messages/s.
- ``provider``: :func:`deepfreeze.repo.provider.serve` (no arena: TCP staging) holding one
  model with one tensor of ``--mib`` MiB; ``RemoteRepository.get`` ``--count`` times -> MB/s.
- ``provider-small``: ``--small`` ``specs`` requests of a stored model -> requests/s.

"MAC off" sets ``deepfreeze.net.MAC = False`` in both processes: the same frames and handshake
with tags of zeros, i.e. the cost of everything but the MAC. On and off alternate inside every
repetition (they share the machine's noise); statistic: the median over ``--reps`` repetitions
with its standard error (1.2533 sigma / sqrt(n)); the ratio off/on is "not resolvable" when the
difference is within one combined standard error.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from deepfreeze import net  # noqa: E402
from deepfreeze.format import crc32  # noqa: E402

TOKEN = "e" * 64
OUT = os.path.join(ROOT, "experiments", "results")


def med_se(xs: list[float]) -> tuple[float, float]:
    m = statistics.median(xs)
    se = 1.2533 * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
    return m, se


# --------------------------------------------------------------------------- primitives

def primitives(reps: int, mib: int) -> dict:
    buf = memoryview(np.random.default_rng(0).integers(0, 256, mib << 20, np.uint8))
    key = os.urandom(32)
    from cryptography.hazmat.primitives.poly1305 import Poly1305
    fns = {
        "crc32 (isal)": lambda: crc32(buf),
        "Poly1305 (payload tags)": lambda: Poly1305.generate_tag(key, buf),
        "HMAC-SHA256": lambda: hmac.new(key, buf, "sha256").digest(),
        "BLAKE2b-128 keyed": lambda: hashlib.blake2b(buf, key=key, digest_size=16).digest(),
        "BLAKE2s-128 keyed": lambda: hashlib.blake2s(buf, key=key, digest_size=16).digest(),
    }
    out = {}
    for name, fn in fns.items():
        speeds = []
        for _ in range(reps):
            best = min(_timed(fn) for _ in range(3))
            speeds.append(buf.nbytes / best / 1e6)
        m, se = med_se(speeds)
        out[name] = {"MBps": m, "se": se, "samples": speeds}
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- servers

def _stream_server(conn, mac: bool, mib: int) -> None:
    net.MAC = mac
    from deepfreeze.lease import RunInfo, Version
    from deepfreeze.stream.slots import SlotRing
    from deepfreeze.stream.wire import RankServer
    path = f"/dev/shm/deepfreeze-net-mac-{os.getpid()}"
    ring = SlotRing.create(path, mib << 20, 3)
    try:
        data = np.random.default_rng(1).integers(0, 256, mib << 20, np.uint8)
        ring.write(Version(0, 1), data)
        ring.write(Version(0, 2), data[:1024])
        server = RankServer(ring, channel="mac", rank=0, world=1, run=RunInfo("ab" * 8, 0), token=TOKEN)
        conn.send(server.address)
        conn.recv()  # until told to stop
        server.close()
    finally:
        ring.close()
        os.unlink(path)


def _provider_server(conn, mac: bool, mib: int, directory: str) -> None:
    net.MAC = mac
    from deepfreeze.repo.provider import serve
    from deepfreeze.repo.store import EmbeddedRepository
    with EmbeddedRepository(directory) as repo:
        repo.put("big@v1", {"w": np.random.default_rng(2).integers(0, 256, mib << 20, np.uint8)})
        repo.put("small@v1", {"w": np.arange(256, dtype=np.float32)})
    stop = threading.Event()
    threading.Thread(target=lambda: (conn.recv(), stop.set()), daemon=True).start()
    serve(directory, token=TOKEN, arena_bytes=0, ready=conn.send, stop=stop)


def start(target, *args) -> tuple:
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=target, args=(b, *args), daemon=True)
    proc.start()
    if not a.poll(120):
        raise RuntimeError(f"{target.__name__} did not start")
    return proc, a, a.recv()


# --------------------------------------------------------------------------- runs

def run(a: argparse.Namespace) -> dict:
    from deepfreeze.repo.client import RemoteRepository
    from deepfreeze.lease import Version
    from deepfreeze.stream.wire import RankClient
    doc: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                             "load_before": os.getloadavg()},
                 "params": vars(a), "statistic": "median over reps, standard error 1.2533*sd/sqrt(n)"}
    t0 = time.monotonic()
    doc["primitives"] = primitives(a.reps, a.mib)
    tmp = tempfile.mkdtemp(prefix="net-mac-")
    servers = {}
    for mac in (True, False):
        servers[("stream", mac)] = start(_stream_server, mac, a.mib)
        servers[("provider", mac)] = start(_provider_server, mac, a.mib, os.path.join(tmp, f"repo-{mac}"))
    samples: dict = {k: {True: [], False: []} for k in ("stream", "stream-small", "provider", "provider-small")}
    out = np.empty(a.mib << 20, np.uint8)
    try:
        for rep in range(a.reps):
            for mac in ((True, False) if rep % 2 == 0 else (False, True)):
                net.MAC = mac
                with RankClient(servers[("stream", mac)][2], TOKEN, channel="mac", timeout=60) as c:
                    c.fetch(Version(0, 1), out, verify=False)  # warm
                    t = time.perf_counter()
                    for _ in range(a.count):
                        c.fetch(Version(0, 1), out, verify=False)
                    samples["stream"][mac].append(a.count * (a.mib << 20) / (time.perf_counter() - t) / 1e6)
                    t = time.perf_counter()
                    for _ in range(a.small):
                        c.fetch(Version(0, 2), out, verify=False)
                    samples["stream-small"][mac].append(a.small / (time.perf_counter() - t))
                with RemoteRepository([servers[("provider", mac)][2]], token=TOKEN, staging="tcp",
                                      verify=False) as repo:
                    repo.get("big@v1")
                    t = time.perf_counter()
                    for _ in range(a.count):
                        repo.get("big@v1")
                    samples["provider"][mac].append(a.count * (a.mib << 20) / (time.perf_counter() - t) / 1e6)
                    t = time.perf_counter()
                    for _ in range(a.small):
                        repo._providers[0].call({"op": "specs", "name": "small@v1"})
                    samples["provider-small"][mac].append(a.small / (time.perf_counter() - t))
            print(f"rep {rep + 1}/{a.reps} done ({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        net.MAC = True
        for proc, conn, _addr in servers.values():
            try:
                conn.send("stop")
            except OSError:
                pass
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    units = {"stream": "MB/s", "stream-small": "msg/s", "provider": "MB/s", "provider-small": "req/s"}
    doc["end_to_end"] = {}
    for k, by in samples.items():
        on, se_on = med_se(by[True])
        off, se_off = med_se(by[False])
        diff_se = math.hypot(se_on, se_off)
        doc["end_to_end"][k] = {"unit": units[k], "mac_on": on, "se_on": se_on, "mac_off": off, "se_off": se_off,
                                "on_over_off": on / off, "resolvable": abs(on - off) > diff_se,
                                "samples_on": by[True], "samples_off": by[False]}
    doc["seconds"] = time.monotonic() - t0
    doc["machine"]["load_after"] = os.getloadavg()
    return doc


def table(doc: dict) -> str:
    lines = ["| primitive (64 MiB, one core) | MB/s |", "|---|---|"]
    for name, r in doc["primitives"].items():
        lines.append(f"| {name} | {r['MBps']:.0f} ± {r['se']:.0f} |")
    lines += ["", "| path | MAC on | MAC off | on / off |", "|---|---|---|---|"]
    for k, r in doc["end_to_end"].items():
        ratio = f"{r['on_over_off']:.2f}" + ("" if r["resolvable"] else " (not resolvable)")
        lines.append(f"| {k} ({r['unit']}) | {r['mac_on']:.0f} ± {r['se_on']:.0f} | "
                     f"{r['mac_off']:.0f} ± {r['se_off']:.0f} | {ratio} |")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    names = list(doc["primitives"])
    axes[0].bar(range(len(names)), [doc["primitives"][n]["MBps"] for n in names],
                yerr=[doc["primitives"][n]["se"] for n in names], color=["#888", "#c44e52", "#dd8452", "#4c72b0", "#55a868"])
    axes[0].set_xticks(range(len(names)), names, rotation=15)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("MB/s (one core, 64 MiB)")
    axes[0].set_title("MAC primitives")
    keys = list(doc["end_to_end"])
    x = np.arange(len(keys))
    on = [doc["end_to_end"][k]["on_over_off"] for k in keys]
    e2e = doc["end_to_end"]
    err = [e2e[k]["on_over_off"] * math.hypot(e2e[k]["se_on"] / e2e[k]["mac_on"], e2e[k]["se_off"] / e2e[k]["mac_off"])
           for k in keys]
    axes[1].bar(x, on, yerr=err, color="#c44e52")
    axes[1].axhline(1.0, color="k", lw=0.8, ls="--")
    axes[1].set_xticks(x, [f"{k}\n({doc['end_to_end'][k]['unit']})" for k in keys])
    axes[1].set_ylabel("MAC on / MAC off (1 = free)")
    axes[1].set_title(f"end to end, median of {doc['params']['reps']} reps ± SE")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


class _HmacPayloadMac:
    """The first design's payload tag: HMAC-SHA256 under the direction's key over the header tag
    and the payload (for the comparison only; never used by the library)."""

    def __init__(self, key: bytes, direction: bytes, seq: int, header_tag: bytes) -> None:
        self._h = hmac.new(key, direction + seq.to_bytes(8, "little") + header_tag, "sha256")

    def update(self, data) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()


def _use_hmac_payload_tags() -> None:
    net._PayloadMac = _HmacPayloadMac
    net._PTAG = 32


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mib", type=int, default=64, help="large payload size in MiB")
    ap.add_argument("--count", type=int, default=16, help="large payloads per repetition")
    ap.add_argument("--small", type=int, default=2000, help="small messages per repetition")
    ap.add_argument("--payload-mac", choices=("poly1305", "hmac-sha256"), default="poly1305",
                    help="hmac-sha256: the first design's payload tag (HMAC-SHA256 over the header tag and the "
                         "payload, 32 bytes), to compare with; default: what deepfreeze.net uses")
    ap.add_argument("--out", default=None, help="default experiments/results/net_mac[-hmac].json")
    a = ap.parse_args(argv)
    if a.out is None:
        a.out = os.path.join(OUT, "net_mac.json" if a.payload_mac == "poly1305" else "net_mac-hmac.json")
    if a.payload_mac == "hmac-sha256":
        _use_hmac_payload_tags()  # before the servers fork: both ends use it
    doc = run(a)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    plot(doc, a.out[:-5] + ".png")
    print(table(doc))
    print(f"wrote {a.out} and {a.out[:-5]}.png ({doc['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
