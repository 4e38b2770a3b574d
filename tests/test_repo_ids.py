"""Stable layer ids of the framework-neutral core (deepfreeze.repo.ids): no TensorFlow."""
import json
import subprocess
import sys

import numpy as np
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


def test_numpy_values_in_a_config_hash_as_their_plain_values():
    """Keras' ReLU(max_value=6.) (MobileNet) keeps a numpy array in its config."""
    import numpy as np
    a = canonical_config({"max_value": np.array(6.0, np.float32), "alpha": np.float64(0.5), "axes": np.arange(3)})
    assert a == canonical_config({"max_value": 6.0, "alpha": 0.5, "axes": [0, 1, 2]})
    with pytest.raises(RepositoryError, match="not plain JSON"):
        canonical_config({"table": np.zeros(10000)})


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


# ---------------------------------------------------------------- the cut: a property test on random graphs
#
# An independent oracle (exact structures, interned; no hashing, no levels) computes each twin group's
# distinguishing depth d(T) and its inside region (layers within d(T) consumer steps of a member). A change
# beyond the cut replaces a downstream-closed set S of layers outside every inside region by new layers fed
# from S's survivors and from layers not strictly inside a region (so no new layer lands within d(T) of a
# member); the kept layers' outputs keep their positions. Then every kept layer keeps its id, and ids stay
# unique. A change that makes a new twin of a kept layer (the same layer on the same inputs) is left out:
# such twins' first difference lies in the new head, and they cannot keep ids.

class _Oracle:
    def __init__(self, nodes, outputs, inputs):
        self.nodes, self.outputs, self.inputs = nodes, outputs, inputs
        self.table = {}
        self.order = self._order()
        self.uses = {k: [] for k in nodes}
        for c, n in nodes.items():
            for si, site in enumerate(n.calls):
                for pos, s in enumerate(site):
                    self.uses[s].append((c, si, pos))
        self.outpos = {k: tuple(i for i, o in enumerate(outputs) if o == k) for k in nodes}
        self.raw = {}
        for k in self.order:
            n = nodes[k]
            self.raw[k] = self.intern(("raw", n.class_name, n.config, tuple(map(tuple, n.weights)),
                                       tuple(tuple(self.raw[s] for s in site) for site in n.calls)))
        self._views = {}
        self.final, self.groups, self.ok = {}, [], True
        pos_of = {k: i for i, k in enumerate(inputs)}
        todo = list(self.order)
        while todo:   # rounds: every layer whose inputs are final; twins (same inputs) are in one round
            ready = [k for k in todo if all(s in self.final for site in nodes[k].calls for s in site)]
            todo = [k for k in todo if k not in ready]
            up = {}
            for k in ready:
                n = nodes[k]
                up[k] = self.intern(("up", n.class_name, n.config, tuple(map(tuple, n.weights)),
                                     tuple(tuple(self.final[s] for s in site) for site in n.calls)))
            for u in set(up.values()):
                members = [k for k in ready if up[k] == u]
                if len(members) == 1:
                    self.final[members[0]] = u
                elif all(not nodes[m].calls for m in members):
                    self.groups.append((members, 0, "input"))
                    for m in members:
                        self.final[m] = self.intern(("in", u, pos_of[m]))
                else:
                    d = 0
                    while len({self.view(m, d) for m in members}) < len(members):
                        d += 1
                        if d > len(nodes) + 1:
                            self.ok = False
                            return
                    self.groups.append((members, d, "twin"))
                    for m in members:
                        self.final[m] = self.intern(("twin", u, d, self.view(m, d)))

    def intern(self, t):
        return self.table.setdefault(t, len(self.table))

    def _order(self):
        done, order = set(), []
        while len(order) < len(self.nodes):
            for k, n in self.nodes.items():
                if k not in done and all(s in done for site in n.calls for s in site):
                    done.add(k)
                    order.append(k)
        return order

    def view(self, k, d):
        key = (k, d)
        if key not in self._views:
            below = () if d == 0 else tuple(sorted((self.raw[c], si, pos, self.view(c, d - 1))
                                                   for c, si, pos in self.uses[k]))
            self._views[key] = self.intern(("view", self.outpos[k], below))
        return self._views[key]

    def within(self, strict):
        """Layers within d(T) (strictly less with ``strict``) consumer steps of a twin's member."""
        inside = set()
        for members, d, kind in self.groups:
            frontier = {m: 0 for m in members}
            todo = list(members)
            while todo:
                k = todo.pop()
                for c, _si, _pos in self.uses[k]:
                    if frontier[k] + 1 <= d and (c not in frontier or frontier[c] > frontier[k] + 1):
                        frontier[c] = frontier[k] + 1
                        todo.append(c)
            inside |= {k for k, dist in frontier.items() if dist < d or (not strict and dist <= d)}
        return inside


_CONFIGS = [canonical_config({"units": u}) for u in (2, 3)]


def _random_graph(rng):
    n_in = int(rng.integers(1, 4))
    nodes, inputs = {}, []
    for i in range(n_in):
        nodes[f"in{i}"] = inp((4,) if rng.random() < 0.8 else (5,), name=f"input_{i}")
        inputs.append(f"in{i}")
    keys = list(nodes)
    for j in range(int(rng.integers(4, 14))):
        k = f"n{j}"
        if j and rng.random() < 0.35:        # a twin of an earlier layer: same layer, same inputs
            src = nodes[keys[int(rng.integers(n_in, len(keys)))] if len(keys) > n_in else keys[0]]
            if src.calls:
                nodes[k] = src
                keys.append(k)
                continue
        kind = rng.random()
        if kind < 0.15:   # parallel identical branches of a few layers into one Concatenate
            src, length = keys[int(rng.integers(len(keys)))], int(rng.integers(1, 4))
            ends = []
            for b in range(2):
                prev = src
                for step in range(length):
                    nodes[f"{k}b{b}s{step}"] = Node("Dense", _CONFIGS[step % 2], [((4, 2), "float32")], [[prev]])
                    prev = f"{k}b{b}s{step}"
                    keys.append(prev)
                ends.append(prev)
            nodes[k] = Node("Concatenate", b"{}", [], [ends])
        elif kind < 0.6:
            nodes[k] = Node("Dense", _CONFIGS[int(rng.integers(2))], [((4, 2), "float32")],
                            [[keys[int(rng.integers(len(keys)))]]])
        elif kind < 0.85:
            picks = [keys[int(rng.integers(len(keys)))] for _ in range(2)]
            nodes[k] = Node("Concatenate", b"{}", [], [picks])
        else:   # a shared layer: two call sites
            nodes[k] = Node("Dense", _CONFIGS[0], [((4, 2), "float32")],
                            [[keys[int(rng.integers(len(keys)))]], [keys[int(rng.integers(len(keys)))]]])
        keys.append(k)
    used = {s for n in nodes.values() for site in n.calls for s in site}
    outputs = [k for k in keys if k not in used]
    rng.shuffle(outputs)
    return nodes, outputs, inputs


def _downstream(nodes, roots):
    users = {}
    for c, n in nodes.items():
        for site in n.calls:
            for s in site:
                users.setdefault(s, set()).add(c)
    seen, todo = set(roots), list(roots)
    while todo:
        for c in users.get(todo.pop(), ()):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return seen


def _cut_case(rng, debug=False):
    """One random graph, one change beyond its cut: what was checked ("refused", "skipped",
    "checked"; with the twin groups' depths)."""
    nodes, outputs, inputs = _random_graph(rng)
    oracle = _Oracle(nodes, outputs, inputs)
    try:
        ids = compute_ids(nodes, outputs, inputs)
    except RepositoryError as e:
        assert "cannot be told apart" in str(e)
        assert not oracle.ok or len(set(oracle.final.values())) < len(nodes)
        return "refused", []
    assert oracle.ok
    # the implementation and the oracle tell the same layers apart; ids are unique
    assert len(set(ids.values())) == len(nodes) == len(set(oracle.final.values()))
    depths = [d for _, d, _ in oracle.groups]
    inside = oracle.within(False)
    candidates = [k for k in nodes if k not in inside and nodes[k].calls]
    if not candidates:
        return "skipped", depths
    S = _downstream(nodes, [candidates[int(rng.integers(len(candidates)))]])
    if S & inside:
        return "skipped", depths
    kept = [k for k in nodes if k not in S]
    # the kept layers' outputs first, in their order: a change beyond the cut leaves their positions alone
    base_outputs = [o for o in outputs if o not in S] + [o for o in outputs if o in S]
    base = _Oracle(nodes, base_outputs, inputs)
    if not base.ok or S & base.within(False):
        return "skipped", depths
    strict = base.within(True)
    base_ids = compute_ids(nodes, base_outputs, inputs)
    # replace S by a new random head fed from layers not strictly inside a region
    new = {k: nodes[k] for k in kept}
    feeders = [k for k in kept if k not in strict]
    added = []
    for j in range(int(rng.integers(0, 6))):
        pool = feeders + added
        if not pool:
            break
        cfg = canonical_config({"units": int(rng.integers(2, 9)), "head": j})
        picks = [pool[int(rng.integers(len(pool)))] for _ in range(int(rng.integers(1, 3)))]
        new[f"h{j}"] = Node("Dense" if len(picks) == 1 else "Concatenate", cfg,
                            [((4, 3), "float16")] if len(picks) == 1 else [], [picks])
        added.append(f"h{j}")
    used = {s for n in new.values() for site in n.calls for s in site}
    new_outputs = [o for o in base_outputs if o not in S] + [k for k in added if k not in used]
    after = _Oracle(new, new_outputs, inputs)
    if any(set(g[0]) & set(added) and set(g[0]) & set(kept) for g in after.groups):
        return "skipped", depths   # a new twin of a kept layer: its first difference is in the new head
    new_ids = compute_ids(new, new_outputs, inputs)
    if debug:
        print(nodes, base_outputs, S, base.groups, new, new_outputs, after.groups, sep="\n")
    assert {k: new_ids[k] for k in kept} == {k: base_ids[k] for k in kept}
    assert len(set(new_ids.values())) == len(new)
    return "checked", depths


def test_ids_beyond_the_cut_change_nothing_random_graphs():
    rng = np.random.default_rng(20261125)
    seen = {"checked": 0, "skipped": 0, "refused": 0}
    twins = deep = 0
    for case in range(600):
        what, depths = _cut_case(rng)
        seen[what] += 1
        twins += bool(depths)
        deep += any(d > 1 for d in depths)
    # the generator exercises what it must: many cases, twins, twins told apart only a few steps down
    assert seen["checked"] >= 300 and twins >= 300 and deep >= 100, (seen, twins, deep)


# ---------------------------------------------------------------- the table: transparent classes, ignored keys

def _chain(extra=None, momentum=0.99, shape=(4,), flatten=None):
    """Input -> Dense -> [extra layers] -> BatchNormalization -> Dense (output)."""
    nodes = {"in": inp(shape), "d1": dense(8, [["in"]])}
    prev = "d1"
    for i, cls in enumerate(extra or []):
        nodes[f"x{i}"] = Node(cls, canonical_config({"rate": 0.5, "seed": i}), [], [[prev]])
        prev = f"x{i}"
    if flatten is not None:
        nodes["flat"] = Node("Flatten", canonical_config({"__input_shape__": [[flatten]]}), [], [[prev]])
        prev = "flat"
    nodes["bn"] = Node("BatchNormalization", canonical_config({"momentum": momentum, "epsilon": 1e-3}),
                       [((8,), "float32")] * 4, [[prev]])
    nodes["d2"] = dense(3, [["bn"]], fan_in=8)
    return nodes


def test_transparent_layers_and_ignored_keys():
    base = compute_ids(_chain(), ["d2"])
    for cls in ("Dropout", "SpatialDropout2D", "AlphaDropout", "GaussianDropout", "GaussianNoise",
                "ActivityRegularization"):
        ids = compute_ids(_chain([cls, "Dropout"]), ["d2"])
        assert {k: ids[k] for k in base} == base, cls
        assert len(set(ids.values())) == len(ids)
    # anything not in the table is not transparent; momentum is ignored, epsilon is not
    assert compute_ids(_chain(["Activation"]), ["d2"])["d2"] != base["d2"]
    assert compute_ids(_chain(momentum=0.5), ["d2"]) == base
    eps = _chain()
    eps["bn"] = eps["bn"]._replace(config=canonical_config({"momentum": 0.99, "epsilon": 1e-2}))
    assert compute_ids(eps, ["d2"])["bn"] != base["bn"]
    # a Dropout output: the model output is the layer behind it
    nodes = _chain()
    nodes["drop"] = Node("Dropout", canonical_config({"rate": 0.1}), [], [["d2"]])
    assert {k: v for k, v in compute_ids(nodes, ["drop"]).items() if k in base} == base


def test_input_resolution_and_input_positions():
    img = {"in": inp((32, 32, 3)), "conv": Node("Conv2D", canonical_config({"filters": 4}),
                                                [((3, 3, 3, 4), "float32")], [["in"]])}
    other = {"in": inp((64, 48, 3)), "conv": img["conv"]}
    assert compute_ids(img, ["conv"]) == compute_ids(other, ["conv"])          # spatial size left out
    assert compute_ids({"in": inp((32, 32, 4)), "conv": img["conv"]}, ["conv"]) != compute_ids(img, ["conv"])
    assert compute_ids({"in": inp((32, 3)), "conv": img["conv"]}, ["conv"]) != compute_ids(img, ["conv"])  # rank
    # a Flatten records its input shape: 2x4 and 4x2 give the Dense behind it the same kernel, not the same id
    a = compute_ids(_chain(flatten=[2, 4], shape=(2, 4, 1)), ["d2"])
    b = compute_ids(_chain(flatten=[4, 2], shape=(4, 2, 1)), ["d2"])
    assert a["in"] == b["in"] and a["flat"] != b["flat"] and a["d2"] != b["d2"]
    # two inputs of one shape: told apart by their position among the model's inputs, not by consumers
    def siamese(head_units):
        nodes = {"x": inp(), "y": inp(), "tx": dense(5, [["x"]]), "ty": dense(5, [["y"]])}
        nodes["cat"] = Node("Concatenate", b"{}", [], [["tx", "ty"]])
        nodes["head"] = dense(head_units, [["cat"]], fan_in=10)
        return nodes
    s3 = compute_ids(siamese(3), ["head"], ["x", "y"])
    s5 = compute_ids(siamese(5), ["head"], ["x", "y"])
    assert {k: s3[k] for k in ("x", "y", "tx", "ty", "cat")} == {k: s5[k] for k in ("x", "y", "tx", "ty", "cat")}
    swapped = compute_ids(siamese(3), ["head"], ["y", "x"])
    assert (swapped["x"], swapped["tx"]) == (s3["y"], s3["ty"])
    unknown = compute_ids(siamese(3), ["head"])      # positions unknown (a migrated graph): never equal ids
    assert unknown["x"] not in (s3["x"], s3["y"]) and unknown["tx"] not in (s3["tx"], s3["ty"])
    with pytest.raises(RepositoryError, match="not an input layer"):
        compute_ids(siamese(3), ["head"], ["x", "tx"])


def test_migration_recovers_call_sites_and_checks_scheme_1_ids():
    from deepfreeze.repo.migrate import migrate_graph, scheme1_ids
    nodes = {"x": inp(name="x"), "y": inp(name="y"), "px": dense(4, [["x"]]),
             "shared": dense(4, [["px"], ["y"]]), "a": dense(2, [["shared"]]), "b": dense(2, [["shared"]])}
    nodes["cat"] = Node("Concatenate", b"{}", [], [["a", "b"]])
    old = scheme1_ids(nodes, ["cat"])
    graph, order = build_graph(nodes, ["cat"], old)
    graph["scheme"] = 1
    meta = build_meta(nodes, old)
    new_graph, remap = migrate_graph(graph, meta)
    assert new_graph["scheme"] == ID_SCHEME
    fresh = compute_ids(nodes, ["cat"], None)   # input order unknown: as compute_ids without inputs=
    assert {remap[old[k]] for k in nodes} == set(fresh.values())
    assert remap[old["shared"]] == fresh["shared"]  # two call sites recovered from the concatenated inputs
    # a graph whose ids do not reproduce (tampered metadata) is refused, not half migrated
    bad = dict(meta)
    bad[old["px"]] = {**meta[old["px"]], "config": {"units": 5}}
    with pytest.raises(RepositoryError, match="cannot be reproduced"):
        migrate_graph(graph, bad)
    del order


def test_store_migrates_scheme_1_models_on_open(tmp_path):
    """A repository whose graphs are of scheme 1 gets scheme-2 ids when opened (graph, tensor keys,
    metadata, the repository's id scheme), in one go; a model whose ids cannot be reproduced (here: no
    metadata) keeps its scheme-1 graph and is listed; a second open changes nothing."""
    import sqlite3
    from deepfreeze.repo.graph import tensor_keys
    from deepfreeze.repo.migrate import scheme1_ids
    from deepfreeze.repo.store import EmbeddedRepository
    nodes, outs = twin_heads(True)
    old = scheme1_ids(nodes, outs)
    graph, _ = build_graph(nodes, outs, old)
    graph["scheme"] = 1
    rng = np.random.default_rng(0)
    tensors = {k: rng.standard_normal((3,)).astype(np.float32) for k in tensor_keys(graph)}
    bare = {"scheme": 1, "layers": [{"id": "ab" * 16, "inputs": [], "tensors": 1}], "outputs": [0]}
    d = str(tmp_path / "repo")
    with EmbeddedRepository(d) as repo:
        repo.put("m@1", tensors, graph=graph, meta=build_meta(nodes, old))
        repo.put("bare@1", {"ab" * 16 + "/0": np.zeros(2, np.float32)}, graph=bare)
        assert repo.info()["id_scheme"] == 1
    with EmbeddedRepository(d) as repo:
        new = compute_ids(nodes, outs, None)
        g = repo.graph("m@1")
        assert g["scheme"] == ID_SCHEME and {layer["id"] for layer in g["layers"]} == set(new.values())
        got = repo.get("m@1")
        for k in nodes:
            for j in range(len(nodes[k].weights)):
                assert got[f"{new[k]}/{j}"].tobytes() == tensors[f"{old[k]}/{j}"].tobytes()
        assert repo.layer_meta([new["trunk"]])[new["trunk"]] == build_meta(nodes, old)[old["trunk"]]
        assert repo.graph("bare@1")["scheme"] == 1 and repo.info()["id_scheme"] == ID_SCHEME
    with sqlite3.connect(f"{d}/meta.db") as c:
        failed = c.execute("SELECT value FROM settings WHERE key='id_migration_failed'").fetchone()[0]
        assert json.loads(failed) == ["bare@1"]
    with EmbeddedRepository(d) as repo:
        assert repo.graph("m@1") == g
