"""Stable layer ids of the framework-neutral core (deepfreeze.repo.ids): no TensorFlow."""
import json
import subprocess
import sys

import pytest

from deepfreeze.errors import RepositoryError
from deepfreeze.repo.graph import check_graph, decode_graph, encode_graph
from deepfreeze.repo.ids import ID_SCHEME, Node, build_graph, build_meta, canonical_config, compute_ids


def dense(units, calls, fan_in=4, **extra):
    cfg = {"name": f"dense_{units}_{id(calls)}", "units": units, "trainable": True, "dtype": "float32",
           "kernel_initializer": {"class_name": "GlorotUniform", "config": {"seed": None}}, **extra}
    return Node("Dense", canonical_config(cfg), [((fan_in, units), "float32"), ((units,), "float32")], calls)


def inp(shape=(4,), name="input_1"):
    return Node("InputLayer", canonical_config({"name": name, "batch_input_shape": [None, *shape],
                                                "dtype": "float32"}), [], [])


def test_no_tensorflow_imported():
    code = "import sys, deepfreeze.repo.ids; sys.exit('tensorflow' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_canonical_config_deny_list():
    a = {"name": "dense_7", "trainable": False, "units": 3,
         "dtype": {"class_name": "Policy", "config": {"name": "mixed_float16"}},
         "kernel_initializer": {"class_name": "Ones"}, "bias_regularizer": None, "kernel_constraint": None,
         "activation": "relu",
         "layer": {"class_name": "LSTM", "config": {"name": "lstm_3", "units": 2, "trainable": True,
                                                    "recurrent_initializer": "orthogonal", "dtype": "float16"}}}
    b = {"units": 3, "activation": "relu", "layer": {"config": {"units": 2}, "class_name": "LSTM"}}
    assert canonical_config(a) == canonical_config(b)
    assert json.loads(canonical_config(a)) == b
    assert canonical_config(b) == b'{"activation":"relu","layer":{"class_name":"LSTM","config":{"units":2}},"units":3}'
    assert canonical_config({"units": 3}) != canonical_config({"units": 4})


def test_canonical_config_rejects_non_json():
    with pytest.raises(RepositoryError, match="not plain JSON"):
        canonical_config({"units": 3, "mean": object()})
    with pytest.raises(RepositoryError, match="not plain JSON"):
        canonical_config({"max_value": float("nan")})
    with pytest.raises(RepositoryError, match="must be a dict"):
        canonical_config([1, 2])


def test_ids_unchanged_by_trainable_and_names():
    a = {"i": inp(name="input_1"), "d": dense(8, [["i"]])}
    cfg = {"name": "other", "units": 8, "trainable": False, "dtype": "float32"}
    b = {"x": inp(name="input_9"),
         "y": Node("Dense", canonical_config(cfg), [((4, 8), "float32"), ((8,), "float32")], [["x"]])}
    ia, ib = compute_ids(a, ["d"]), compute_ids(b, ["y"])
    assert ia["d"] == ib["y"] and ia["i"] == ib["x"]
    assert all(len(v) == 32 and int(v, 16) >= 0 for v in ia.values())


def test_ancestry_input_shape_and_weight_specs_count():
    base = compute_ids({"i": inp((4,)), "d": dense(8, [["i"]])}, ["d"])
    other_input = compute_ids({"i": inp((5,)), "d": dense(8, [["i"]])}, ["d"])
    assert base["d"] != other_input["d"]
    f16 = {"i": inp((4,)), "d": Node("Dense", dense(8, []).config, [((4, 8), "float16"), ((8,), "float16")], [["i"]])}
    assert compute_ids(f16, ["d"])["d"] != base["d"]


def test_deep_chain_1500_iterative():
    nodes = {0: inp()}
    for k in range(1, 1501):
        nodes[k] = dense(4, [[k - 1]])
    ids = compute_ids(nodes, [1500])
    assert len(set(ids.values())) == 1501
    graph, order = build_graph(nodes, [1500], ids)
    assert order == list(range(1501))
    assert decode_graph(encode_graph(graph)) == graph
    # the same chain given in reverse dict order: same ids
    rev = {k: nodes[k] for k in reversed(range(1501))}
    assert compute_ids(rev, [1500]) == ids


def twin_heads(first_head_creates_first: bool):
    """Trunk -> two identical heads (outputs 0 and 1), each Dense -> Dense; created in either order."""
    nodes = {"in": inp(), "trunk": dense(8, [["in"]])}
    heads = ["A", "B"] if first_head_creates_first else ["B", "A"]
    for h in heads:
        nodes[h + "1"] = dense(6, [["trunk"]], fan_in=8)
    for h in heads:
        nodes[h + "2"] = dense(2, [[h + "1"]], fan_in=6)
    return nodes, ["A2", "B2"]   # A is output 0, B output 1


def test_twin_heads_distinct_and_order_independent():
    n1, o1 = twin_heads(True)
    n2, o2 = twin_heads(False)
    i1, i2 = compute_ids(n1, o1), compute_ids(n2, o2)
    assert i1 == i2
    assert len(set(i1.values())) == len(i1)
    # a trunk keeps its ids whatever heads sit on it: twins only perturb the twins
    single = compute_ids({"in": inp(), "trunk": dense(8, [["in"]]), "h": dense(6, [["trunk"]], fan_in=8)}, ["h"])
    assert single["trunk"] == i1["trunk"] and single["in"] == i1["in"]
    assert single["h"] not in (i1["A1"], i1["B1"])
    # swapping output positions swaps the twins' ids
    i3 = compute_ids(n1, ["B2", "A2"])
    assert (i3["A1"], i3["B1"]) == (i1["B1"], i1["A1"])
    g1, _ = build_graph(n1, o1, i1)
    g2, _ = build_graph(n2, o2, i2)
    assert g1 == g2  # the graph's layer order does not depend on construction order either


def test_twins_told_apart_by_input_position():
    for order in (["a", "b"], ["b", "a"]):
        nodes = {"in": inp(), "trunk": dense(8, [["in"]])}
        for h in order:
            nodes[h] = dense(6, [["trunk"]], fan_in=8)
        nodes["cat"] = Node("Concatenate", canonical_config({"axis": -1}), [], [["a", "b"]])
        ids = compute_ids(nodes, ["cat"])
        assert ids["a"] != ids["b"]
        if order == ["a", "b"]:
            first = ids
        else:
            assert ids == first
    # identical twin inputs (two Inputs of one shape) told apart by position too
    nodes = {"x": inp(), "y": inp(), "add": Node("Subtract", b"{}", [], [["x", "y"]])}
    ids = compute_ids(nodes, ["add"])
    assert ids["x"] != ids["y"]


def test_indistinguishable_twins_raise():
    nodes = {"in": inp(), "a": dense(3, [["in"]]), "b": dense(3, [["in"]]),
             "add": Node("Add", b"{}", [], [["a"], ["b"]])}
    ids = compute_ids(nodes, ["add"])    # call sites differ: fine
    assert ids["a"] != ids["b"]
    nodes["add"] = Node("Add", b"{}", [], [["a", "b"]])
    ids = compute_ids(nodes, ["add"])    # input positions differ: fine
    assert ids["a"] != ids["b"]
    nodes = {"in": inp(), "a": dense(3, [["in"]]), "b": dense(3, [["in"]])}
    ids = compute_ids(nodes, ["a", "a"])  # a is an output (twice), b goes nowhere: told apart
    assert ids["a"] != ids["b"]
    with pytest.raises(RepositoryError, match="cannot be told apart"):
        compute_ids({"in": inp(), "a": dense(3, [["in"]]), "b": dense(3, [["in"]])}, [])


def test_shared_layer_folds_every_call_site_in_order():
    def model(order):
        nodes = {"x": inp(name="x"), "y": inp((6,), name="y"),
                 "px": dense(4, [["x"]]), "py": Node("Dense", dense(4, []).config,
                                                     [((6, 4), "float32"), ((4,), "float32")], [["y"]])}
        nodes["shared"] = dense(5, [[order[0]], [order[1]]])
        return nodes
    a = compute_ids(model(["px", "py"]), ["shared"])
    b = compute_ids(model(["py", "px"]), ["shared"])
    assert a["shared"] != b["shared"]           # node order is part of a shared layer's id
    assert a["px"] == b["px"] and a["py"] == b["py"]
    one = compute_ids({"x": inp(name="x"), "px": dense(4, [["x"]]), "shared": dense(5, [["px"]])}, ["shared"])
    assert one["shared"] != a["shared"]         # the second call site counts
    g, order = build_graph(model(["px", "py"]), ["shared"], a)
    shared = g["layers"][order.index("shared")]
    assert shared["inputs"] == [order.index("px"), order.index("py")]


def test_cycle_through_shared_layer_raises():
    nodes = {"in": inp(), "s": dense(4, [["in"], ["t"]]), "t": dense(4, [["s"]])}
    with pytest.raises(RepositoryError, match="cycle"):
        compute_ids(nodes, ["t"])
    with pytest.raises(RepositoryError, match="not a layer of the graph"):
        compute_ids({"in": inp(), "d": dense(4, [["nope"]])}, ["d"])


def test_graph_and_meta():
    nodes, outs = twin_heads(True)
    ids = compute_ids(nodes, outs)
    graph, order = build_graph(nodes, outs, ids)
    check_graph(graph)
    assert graph["scheme"] == ID_SCHEME
    assert [graph["layers"][i]["id"] for i in graph["outputs"]] == [ids["A2"], ids["B2"]]
    pos = {k: i for i, k in enumerate(order)}
    for k, n in nodes.items():
        layer = graph["layers"][pos[k]]
        assert layer["tensors"] == len(n.weights)
        assert all(pos[s] < pos[k] for s in (x for site in n.calls for x in site))
    meta = build_meta(nodes, ids)
    assert meta[ids["trunk"]] == {"class_name": "Dense", "config": {"units": 8},
                                  "weights": [[[4, 8], "float32"], [[8], "float32"]]}
    json.dumps(meta)
