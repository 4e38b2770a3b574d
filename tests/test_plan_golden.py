"""Golden shard plans: what a manifest's plan record means must never change.

``tests/plan_golden.json`` holds fixed tensor lists (mixed dtypes and sizes, scalars, a zero-size
tensor, tensors with fewer elements than ranks, pinned ones, FSDP2-style given bounds, the PyTorch
adapter's per-rank records) at world sizes 1 to 7, each with the plan record a manifest holds and
the pieces it means. The pieces were generated with the planner of format version 2 (which listed
every piece in the manifest) and are never regenerated: if the planner ever derives other pieces
from a recorded ``flat-v1`` record, an old manifest would mean another layout, and these tests
fail. A change to the rules is a new algorithm id, not an edit of this file.

``tests/legacy_checkpoint/old/v000000000005`` is a checkpoint written by DeepFreeze before the
compact record (format version 2, every piece listed; 3 ranks, a pinned tensor, split tensors):
it still restores bit-exact.
"""
from __future__ import annotations

import copy
import json
import os
import shutil

import numpy as np
import pytest

from deepfreeze import format as fmt
from deepfreeze.config import Config
from deepfreeze.errors import CorruptCheckpointError
from deepfreeze.tiers.base import plan_of
from deepfreeze.loader import load
from deepfreeze.shardplan import PLAN_ALGORITHM, Piece, ShardPlan, TensorSpec

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "plan_golden.json")) as _f:
    GOLDEN = json.load(_f)


def specs(name):
    return [TensorSpec(i, n, d, tuple(s)) for i, (n, d, s) in enumerate(GOLDEN["tensors"][name])]


def pieces(plan):
    return [[p.tensor_id, p.rank, p.start, p.stop] for p in plan.pieces]


def case_id(c):
    r = c["record"]
    return f"{c['tensors']}-w{r['world_size']}-m{r['min_shard_bytes']}" + ("-given" if r.get("given") else "")


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=case_id)
def test_recorded_plan_derives_the_golden_pieces(case):
    """Reading: a recorded record derives exactly the pieces it meant when it was written."""
    ts = specs(case["tensors"])
    plan = ShardPlan.from_json(ts, json.loads(json.dumps(case["record"])))
    assert pieces(plan) == case["pieces"]
    # the same pieces as an older manifest listing them: both forms mean one plan
    legacy = {"world_size": case["record"]["world_size"], "min_shard_bytes": case["record"]["min_shard_bytes"],
              "pieces": case["pieces"]}
    assert ShardPlan.from_json(ts, legacy) == plan


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=case_id)
def test_planner_writes_the_golden_record(case):
    """Writing: today's planner, given the recorded parameters, makes the golden pieces and writes
    the golden record (the compact form, with only the per-rank records explicit)."""
    rec = case["record"]
    assert rec["algorithm"] == PLAN_ALGORITHM == "flat-v1"
    ts = specs(case["tensors"])
    plan = ShardPlan.build(ts, rec["world_size"], min_shard_bytes=rec["min_shard_bytes"], pinned=rec["pinned"],
                           given={g[0]: g[1:] for g in rec["given"]})
    if rec["explicit"]:  # the PyTorch adapter's records: whole, each on its own rank
        over = {p[0]: Piece(*p) for p in rec["explicit"]}
        import dataclasses
        plan = dataclasses.replace(plan, pieces=tuple(over.get(p.tensor_id, p) for p in plan.pieces
                                                      if p.tensor_id not in over or p.start == 0))
        assert len(rec["explicit"]) == rec["world_size"]  # O(N), not O(T N)
    assert pieces(plan) == case["pieces"]
    assert plan.to_json() == rec


def test_golden_cases_cover_what_the_issue_asks():
    worlds = {c["record"]["world_size"] for c in GOLDEN["cases"]}
    assert worlds == set(range(1, 8))
    assert any(c["record"]["pinned"] for c in GOLDEN["cases"]) and any(c["record"]["given"] for c in GOLDEN["cases"])
    assert any(c["record"]["explicit"] for c in GOLDEN["cases"])
    dtypes = {d for ts in GOLDEN["tensors"].values() for _, d, _ in ts}
    assert {"float16", "bfloat16", "float64", "int8", "bool", "complex64", "int64"} <= dtypes


def test_manifest_grows_as_tensors_plus_ranks():
    """The encoded manifest of T split tensors over N ranks: linear in T + N (it was ~48 T N bytes)."""
    def size(t, n):
        ts = [TensorSpec(i, f"layer_{i:03d}/kernel:0", "float32", (1024, 1024)) for i in range(t)]
        plan = ShardPlan.build(ts, n)
        return len(fmt.encode_manifest(fmt.build_manifest("model", 1, 1, 0, plan, [f"node{r:04d}" for r in range(n)])))
    base = size(1, 1)
    per_tensor = size(101, 1) - base  # 100 tensors
    per_rank = size(1, 101) - base    # 100 ranks
    assert per_tensor < 100 * 200 and per_rank < 100 * 150, (per_tensor, per_rank)
    big = size(200, 1000)
    assert big <= 1.05 * (base + 2 * per_tensor + 10 * per_rank), big  # no T x N term (5 %: longer numbers)
    assert big < 200_000  # 10.4 MB when every piece was listed (experiments/manifest_size.py)


def test_older_checkpoint_listing_every_piece_restores(tmp_path):
    src = os.path.join(HERE, "legacy_checkpoint")
    shutil.copytree(src, tmp_path / "pfs")
    for root, dirs, files in os.walk(tmp_path / "pfs"):
        os.chmod(root, 0o700)
        for f in files:
            os.chmod(os.path.join(root, f), 0o600)
    cfg = Config.load(None, mode="sync", scratch=str(tmp_path / "scratch"), persistent=str(tmp_path / "pfs"))
    ck = load(cfg, "old", 5)
    m = ck.manifest
    assert m["format_version"] == 2 and "pieces" in m["plan"] and "algorithm" not in m["plan"]
    want = [np.arange(300, dtype=np.float32) * 0.5, np.arange(7, dtype=np.int32) - 3, np.arange(4.0).reshape(2, 2),
            np.arange(96, dtype=np.int16).reshape(12, 8)]
    assert ck.level == "persistent" and list(ck.arrays) == ["t0", "t1", "t2", "t3"]
    for a, b in zip(ck.arrays.values(), want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    plan = plan_of(m)
    assert [p.rank for p in plan.pieces if p.tensor_id == 2] == [0] and plan.pinned == ()
    # what this version writes for the same plan: the compact record, one plan
    again = ShardPlan.build(plan.tensors, 3, min_shard_bytes=128, pinned=[2])
    assert again == plan and again.to_json()["algorithm"] == "flat-v1" and again.to_json()["explicit"] == []


def _compact():
    ts = specs("mixed")
    plan = ShardPlan.build(ts, 3, min_shard_bytes=1024, pinned=[1])
    return ts, plan.to_json()


@pytest.mark.parametrize("edit, why", [
    (lambda r: r.update(algorithm="flat-v9"), "newer DeepFreeze"),
    (lambda r: r.update(algorithm=7), "newer DeepFreeze"),
    (lambda r: r.pop("pinned"), "malformed"),
    (lambda r: r.update(pinned=[1, 1]), "distinct"),
    (lambda r: r.update(pinned=[99]), "distinct"),
    (lambda r: r.update(given=[[0, 0, 64000]]), "bounds"),             # a row of the wrong length
    (lambda r: r.update(given=[[0, 0, 10, 5, 64000]]), "non-decreasing"),
    (lambda r: r.update(given=[[1, 0, 0, 0, 64]]), "pinned"),          # given bounds for a pinned tensor
    (lambda r: r.update(explicit=[[0, 0, 0, 10]]), "covers 10 of"),    # an override that does not cover
    (lambda r: r.update(explicit=[[40, 0, 0, 10]]), "names no tensor"),
    (lambda r: r.update(explicit=[[0, 5, 0, 64000]]), "tile"),         # rank out of range
    (lambda r: r.update(world_size=0), "world_size"),
    (lambda r: r.update(min_shard_bytes=-1), "min_shard_bytes"),
])
def test_hostile_compact_record_rejected(edit, why):
    ts, rec = _compact()
    rec = copy.deepcopy(rec)
    edit(rec)
    with pytest.raises(CorruptCheckpointError, match=why):
        ShardPlan.from_json(ts, rec)


def test_small_record_cannot_make_a_huge_plan():
    """The pieces are counted before any is made: a few hundred bytes declaring 2**20 ranks and
    big tensors is refused at once, not built."""
    ts = [TensorSpec(i, f"t{i}", "float32", (1 << 40,)) for i in range(8)]
    rec = {"algorithm": "flat-v1", "world_size": 1 << 20, "min_shard_bytes": 0, "pinned": [], "given": [],
           "explicit": []}
    with pytest.raises(CorruptCheckpointError, match="more than the"):
        ShardPlan.from_json(ts, rec)
    # whole tensors over many ranks: placed with a heap, not a scan of every rank per tensor
    ts = [TensorSpec(i, f"b{i}", "float32", (3,)) for i in range(2000)]
    rec["min_shard_bytes"] = 1 << 20
    plan = ShardPlan.from_json(ts, rec)
    assert len(plan.pieces) == 2000 and len({p.rank for p in plan.pieces}) == 2000


def test_manifest_limit_counts_listed_items_only():
    ts, rec = _compact()
    assert fmt.plan_items(rec) == 0
    assert fmt.plan_items({"world_size": 2, "pieces": [[0, 0, 0, 1]] * 5}) == 5
    assert fmt.plan_items(dict(rec, explicit=[[0, 0, 0, 1]] * 3, given=[[0] * 5])) == 3 + 3
    for junk in (None, [], {"algorithm": "flat-v1", "explicit": "x", "given": [1, "a"]}):
        assert fmt.plan_items(junk) == 0


def test_plan_of_remembers_a_plan_by_its_exact_content():
    """plan_of keeps a plan by the JSON text of (tensors, plan record, world size): the same content
    gives the same plan object; the same content with its keys in another order is derived again
    (an equal plan, another object); a number of another type (a shape's 4.0 where 4 was, equal
    under ``==``) is never answered from memory: it is derived as on a first read (where its
    manifest's own check refuses it)."""
    ts, record = _compact()
    manifest = {"tensors": [t.to_json() for t in ts], "plan": record, "world_size": 3}
    first = plan_of(manifest)
    again = plan_of(json.loads(json.dumps(manifest)))  # equal content, other objects (as a new flush job)
    assert again is first and first.pieces == ShardPlan.from_json(ts, record).pieces
    reordered = dict(manifest, tensors=[dict(reversed(list(t.items()))) for t in manifest["tensors"]])
    other = plan_of(reordered)
    assert other is not first and other == first
    floated = copy.deepcopy(manifest)
    k = next(i for i, t in enumerate(floated["tensors"]) if t["shape"])
    floated["tensors"][k]["shape"] = [float(d) for d in floated["tensors"][k]["shape"]]
    assert floated == manifest  # what an equality-keyed memory would have answered from the first plan
    assert plan_of(floated) is not first
