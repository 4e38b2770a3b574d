
import pytest

from deepfreeze.errors import CorruptCheckpointError
from deepfreeze.shardplan import ShardPlan, TensorSpec


def specs(*shapes, dtype="float32"):
    return [TensorSpec(i, f"t{i}", dtype, s) for i, s in enumerate(shapes)]


def check_tiles(plan):
    for t in plan.tensors:
        ps = sorted((p for p in plan.pieces if p.tensor_id == t.id), key=lambda p: p.start)
        pos = 0
        for p in ps:
            assert p.start == pos and p.stop >= p.start and 0 <= p.rank < plan.world_size
            pos = p.stop
        assert pos == t.size
        assert len({p.rank for p in ps}) == len(ps)  # at most one piece per rank and tensor


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7])
def test_plan_tiles_and_balances(world):
    ts = specs((1000, 300), (300,), (20, 1, 128), (128,), (), (0, 5), (3,), (60483, 4), (2, 2))
    plan = ShardPlan.build(ts, world, min_shard_bytes=1024)
    check_tiles(plan)
    loads = plan.rank_bytes()
    assert sum(loads) == plan.total_bytes
    big = max(t.nbytes for t in ts if t.nbytes < 1024) if world > 1 else 0
    assert max(loads) - min(loads) <= max(big, 4 * world)  # within one small tensor
    assert ShardPlan.from_json(ts, plan.to_json()) == plan


def test_small_scalar_and_tiny_tensors_are_whole():
    ts = specs((4,), (), (3,), (1 << 20,))
    plan = ShardPlan.build(ts, 8, min_shard_bytes=64)
    for tid in (0, 1, 2):
        assert len([p for p in plan.pieces if p.tensor_id == tid]) == 1
    assert len([p for p in plan.pieces if p.tensor_id == 3]) == 8


def test_dim_smaller_than_world_and_pinned():
    ts = specs((3, 100000), (2,))
    plan = ShardPlan.build(ts, 4, pinned=[1])
    check_tiles(plan)
    assert [p.rank for p in plan.pieces if p.tensor_id == 1] == [0]
    assert len([p for p in plan.pieces if p.tensor_id == 0]) == 4


def test_plan_is_deterministic():
    ts = specs(*[(i * 37 + 1, 3) for i in range(50)])
    a = ShardPlan.build(ts, 3, min_shard_bytes=2000)
    b = ShardPlan.build(list(ts), 3, min_shard_bytes=2000)
    assert a == b


@pytest.mark.parametrize("pieces", [
    [[0, 0, 0, 5]],                       # does not cover
    [[0, 0, 0, 6], [0, 1, 6, 12]],        # overruns
    [[0, 0, 0, 10], [0, 5, 10, 10]],      # rank out of range
    [[0, 0, 0, 10], [1, 0, 0, 1]],        # unknown tensor
    [[0, 0, 0, "10"]],                    # wrong type
])
def test_hostile_plan_rejected(pieces):
    ts = specs((10,))
    with pytest.raises(CorruptCheckpointError):
        ShardPlan.from_json(ts, {"world_size": 2, "pieces": pieces})


def test_bad_ids_rejected():
    with pytest.raises(ValueError):
        ShardPlan.build([TensorSpec(1, "a", "float32", (3,))], 2)


def test_check_tensor_names_refuses_reserved_and_repeated_names():
    """The writers' plan-time check (issue 41): a name under ``_deepfreeze/`` and a name given to
    two tensors are ConfigErrors naming the key; other names pass."""
    from deepfreeze.errors import ConfigError
    from deepfreeze.shardplan import TensorSpec, check_tensor_names
    ok = [TensorSpec(0, "a", "float32", (2,)), TensorSpec(1, "deepfreeze/b", "float32", (2,)),
          TensorSpec(2, "x._deepfreeze/rank0", "uint8", (1,))]
    check_tensor_names(ok, "checkpoint 'n'")
    with pytest.raises(ConfigError, match=r"checkpoint 'n': tensor '_deepfreeze/rank0'.*reserved"):
        check_tensor_names(ok + [TensorSpec(3, "_deepfreeze/rank0", "uint8", (1,))], "checkpoint 'n'")
    with pytest.raises(ConfigError, match=r"two tensors are named 'a'"):
        check_tensor_names(ok + [TensorSpec(3, "a", "float32", (1,))])
