"""A stream producer or consumer on a node of the test cluster (numpy only, no TensorFlow).

    stream_job.py produce SHARED RUN GENERATION FIRST_STEP [key=value ...]
    stream_job.py consume SHARED TAG [key=value ...]

Both take ``redis=redis://host:port`` (endpoints and notifications in Redis) and the token from
``$DEEPFREEZE_TOKEN``; the channel is ``chan``, persistent is ``SHARED/persistent``.

*produce*: one producer rank (world 1) of run RUN serves its ring over TCP on the node's own
address (``host=``, ``allow_remote``), publishing version (GENERATION, FIRST_STEP + i) every
``gap`` seconds until ``SHARED/stop-<RUN>`` exists or ``count`` versions. Before handing a version
over it records the SHA-256 of every model tensor in ``SHARED/expected/g<gen>s<step>.json`` (on
the shared directory, so it outlives the producer's node). A publish error (Redis unreachable,
say) is recorded and publishing goes on, as a training job would. Reports to
``SHARED/producer-<RUN>.json``.

*consume*: a :class:`~deepfreeze.stream.Subscriber` (``tier``, default ``tcp``; ``io_timeout``)
calls ``next(timeout=1)`` in a loop until ``SHARED/stop-<TAG>`` exists or ``seconds`` passed,
as a serving process would: every update delivered is recorded (version, SHA-256 of each tensor,
tier, time), every error (type, message) and the longest ``next`` call; errors do not end the
loop. The report ``SHARED/consumer-<TAG>.json`` is rewritten after every event (the test polls
it).
"""
import logging
import os
import sys
import time

import numpy as np

from results import atomic_json, digests  # tests/cluster/workers/results.py

from deepfreeze import node
from deepfreeze.errors import DeepFreezeError
from deepfreeze.fused import FusedLayout, FusedShard
from deepfreeze.lease import RunInfo, Version
from deepfreeze.shardplan import ShardPlan, TensorSpec
from deepfreeze.stream import Publisher, StreamOptions, Subscriber

SPECS = [TensorSpec(0, "dense/kernel", "float32", (512, 1024)), TensorSpec(1, "dense/bias", "float16", (1021,)),
         TensorSpec(2, "emb", "int64", (300, 7)), TensorSpec(3, "dense/kernel/momentum", "float32", (512, 1024))]
MODEL = 3  # the first three are the model's weights (published); the last is optimizer state


def produce(shared: str, run: str, generation: int, first: int, opts: dict) -> None:
    plan = ShardPlan.build(SPECS, 1, min_shard_bytes=0)
    host = node.host_name()
    options = StreamOptions(host=opts["host"], allow_remote=True, redis=opts.get("redis"),
                            io_timeout=float(opts.get("io_timeout", 5)))
    pub = Publisher("chan", f"{shared}/persistent", rank=0, world=1, run=RunInfo(run, generation), plan=plan,
                    model_tensors=MODEL, options=options)
    report = {"run": run, "host": host, "node": node.node_id(), "address": pub.address, "published": [],
              "errors": []}
    os.makedirs(f"{shared}/expected", exist_ok=True)
    layout = FusedLayout.build(plan, 0)
    seed = int.from_bytes(os.urandom(8), "little")
    gap, count = float(opts.get("gap", 0.3)), int(opts.get("count", 100000))
    atomic_json(f"{shared}/producer-{run}.json", report)
    for i in range(count):
        if os.path.exists(f"{shared}/stop-{run}"):
            break
        step = first + i
        rng = np.random.default_rng([seed, step])
        full = [rng.standard_normal(s.shape).astype(s.dtype) if s.dtype.startswith("float")
                else rng.integers(-1 << 40, 1 << 40, s.shape).astype(s.dtype) for s in SPECS]
        atomic_json(f"{shared}/expected/g{generation}s{step}.json",
                    {"run": run, "digests": digests({s.name: full[s.id] for s in SPECS[:MODEL]})})
        pieces = [full[s.piece.tensor_id].reshape(-1)[s.piece.start:s.piece.stop] for s in layout.segments]
        try:
            pub.publish(Version(generation, step), FusedShard.from_arrays(layout, pieces, 0))
            pub.wait(30)
            report["published"].append(step)
        except DeepFreezeError as e:
            report["errors"].append([time.time(), type(e).__name__, str(e)])
        atomic_json(f"{shared}/producer-{run}.json", report)
        time.sleep(gap)
    pub.close()
    report["closed"] = True
    atomic_json(f"{shared}/producer-{run}.json", report)


def consume(shared: str, tag: str, opts: dict) -> None:
    sub = Subscriber("chan", f"{shared}/persistent", tier=opts.get("tier", "tcp"), redis=opts.get("redis"),
                     io_timeout=float(opts.get("io_timeout", 5)), rescan=0.5)
    report = {"tag": tag, "host": node.host_name(), "node": node.node_id(), "updates": [], "errors": [],
              "longest_next": 0.0, "calls": 0}
    path = f"{shared}/consumer-{tag}.json"
    atomic_json(path, report)
    deadline = time.monotonic() + float(opts.get("seconds", 300))
    while time.monotonic() < deadline and not os.path.exists(f"{shared}/stop-{tag}"):
        t0 = time.monotonic()
        try:
            up = sub.next(1.0)
        except DeepFreezeError as e:  # a serving process logs it and asks again
            report["errors"].append([time.time(), type(e).__name__, str(e)])
            up = None
            time.sleep(0.2)
        report["longest_next"] = max(report["longest_next"], time.monotonic() - t0)
        report["calls"] += 1
        if up is not None:
            report["updates"].append({"generation": up.version.generation, "step": up.version.step,
                                      "tier": up.tier, "t": time.time(), "digests": digests(up.arrays)})
        if up is not None or report["calls"] % 5 == 0:
            atomic_json(path, report)
    sub.close()
    report["closed"] = True
    atomic_json(path, report)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("deepfreeze").setLevel(logging.INFO)
    cmd, shared = sys.argv[1], sys.argv[2]
    if cmd == "produce":
        run, generation, first = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        produce(shared, run, generation, first, dict(a.split("=", 1) for a in sys.argv[6:]))
    else:
        consume(shared, sys.argv[3], dict(a.split("=", 1) for a in sys.argv[4:]))


if __name__ == "__main__":
    main()
