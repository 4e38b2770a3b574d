"""Keras adapter of the model repository: stable ids of real Keras models, store_model / load_into
against the real embedded repository (deepfreeze.repo.store)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

try:
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
except RuntimeError:  # TF already initialized by an earlier test of the session
    pass

from deepfreeze.errors import ModelMismatchError, NameExistsError, RepositoryError  # noqa: E402
from deepfreeze.keras import LoadReport, load_into, store_model  # noqa: E402
from deepfreeze.keras.repo import model_graph  # noqa: E402
from deepfreeze.repo.graph import tensor_key  # noqa: E402
from deepfreeze.repo.store import EmbeddedRepository  # noqa: E402

L = tf.keras.layers
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "repo_ids.py")


@pytest.fixture
def repo(tmp_path):
    r = EmbeddedRepository(str(tmp_path / "repo"))
    yield r
    r.close()


def weights(model):
    """Every weight of the model by (layer name, k), copied."""
    return {(layer.name, k): v.numpy().copy() for layer in _leaves(model) for k, v in enumerate(layer.weights)}


def _leaves(model):
    return model_graph(model).layers


def assert_same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def randomize(model, seed):
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign(rng.uniform(0.1, 1.0, v.shape).astype(v.dtype.as_numpy_dtype))  # > 0: BN variances too


def trunk_model(head_units=3, input_dim=16, seed=0, head_name=None):
    """Input -> Dense -> BatchNorm (non-trainable moving stats) -> nested Sequential -> head."""
    inp = tf.keras.Input(shape=(input_dim,))
    x = L.Dense(32, activation="relu")(inp)
    x = L.BatchNormalization()(x)
    x = tf.keras.Sequential([tf.keras.Input(shape=(32,)), L.Dense(16, activation="relu")])(x)
    out = L.Dense(head_units, name=head_name)(x)
    m = tf.keras.Model(inp, out)
    randomize(m, seed)
    return m


def run_worker(*args):
    p = subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True, timeout=180,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_ids_equal_across_processes_and_construction_orders():
    a = run_worker("a")
    b = run_worker("b", "--freeze")
    # the auto-names differ (throwaway layers shifted them; heads and branches built in the other order)
    assert a["names"]["trunk"] != b["names"]["trunk"]
    assert a["names"]["head0"] == "dense_6" and b["names"]["head0"] == "dense_10"
    assert a["roles"] == b["roles"]
    assert a["graph"] == b["graph"]
    assert len(a["ids"]) == len(set(a["ids"])) == len(a["roles"]) == 12
    assert a["roles"]["head0"] != a["roles"]["head1"]     # twin heads: distinct ids
    assert a["roles"]["left2"] != a["roles"]["right2"]


def test_ids_unique_unchanged_by_freezing_and_names():
    m = trunk_model()
    mg = model_graph(m)
    before = [mg.ids[k] for k in range(len(mg.layers))]
    assert len(set(before)) == len(before) == 5           # input, dense, bn, nested dense, head
    assert [type(x).__name__ for x in mg.layers].count("InputLayer") == 1   # the nested Input is not a layer
    for layer in m.layers:
        layer.trainable = False
    after = model_graph(m)
    assert [after.ids[k] for k in range(len(after.layers))] == before
    renamed = trunk_model(head_name="my_head")            # names never enter an id
    assert sorted(model_graph(renamed).ids.values()) == sorted(before)


def test_twin_heads_built_in_both_orders():
    def build(swap):
        inp = tf.keras.Input(shape=(4,))
        x = L.Dense(8)(inp)
        h = [L.Dense(2), L.Dense(2)]
        if swap:
            h.reverse()      # the head created second becomes output 0
        return tf.keras.Model(inp, [h[0](x), h[1](x)]), h
    (m1, h1), (m2, h2) = build(False), build(True)
    g1, g2 = model_graph(m1), model_graph(m2)
    id1 = {layer.name: g1.ids[k] for k, layer in enumerate(g1.layers)}
    id2 = {layer.name: g2.ids[k] for k, layer in enumerate(g2.layers)}
    assert id1[h1[0].name] != id1[h1[1].name]
    assert (id1[h1[0].name], id1[h1[1].name]) == (id2[h2[0].name], id2[h2[1].name])


def test_shared_layer_and_nested_model_called_twice(repo):
    inp1, inp2 = tf.keras.Input(shape=(6,)), tf.keras.Input(shape=(6,))
    shared = L.Dense(5)
    sub = tf.keras.Sequential([tf.keras.Input(shape=(5,)), L.Dense(3)])
    out = L.Concatenate()([sub(shared(inp1)), sub(shared(inp2))])
    m = tf.keras.Model([inp1, inp2], out)
    randomize(m, 1)
    mg = model_graph(m)
    assert len(mg.layers) == 5                 # 2 inputs, shared dense, sub's dense, concatenate
    assert len(set(mg.ids.values())) == 5      # the two identical inputs told apart by position
    k_shared = mg.layers.index(shared)
    assert len(mg.nodes[k_shared].calls) == 2
    assert len(mg.nodes[mg.layers.index(sub.layers[0])].calls) == 2
    want = weights(m)
    store_model(repo, "shared", m)
    randomize(m, 2)
    r = load_into(repo, "shared", m, strict=True)
    assert sorted(r.loaded) == sorted([shared.name, sub.layers[0].name])
    for key, v in weights(m).items():
        assert_same(v, want[key])


def test_store_load_round_trip_bit_exact(repo):
    m = trunk_model(seed=0)
    m.compile(optimizer="adam", loss="mse")
    m.fit(np.ones((8, 16), np.float32), np.ones((8, 3), np.float32), epochs=1, verbose=0)  # optimizer state exists
    want = weights(m)
    res = store_model(repo, "trunk@v1", m)
    total = sum(v.nbytes for v in want.values())
    assert res["bytes"] == total
    stored = repo.get("trunk@v1")
    n_model_weights = len(m.weights)
    assert len(stored) == n_model_weights                 # every weight, trainable or not; no optimizer slot
    with pytest.raises(NameExistsError):
        store_model(repo, "trunk@v1", m)
    fresh = trunk_model(seed=7)                           # same architecture, other weights, other names
    r = load_into(repo, "trunk@v1", fresh, strict=True)
    assert isinstance(r, LoadReport)
    assert r.missing == [] and len(r.loaded) == 4 and r.bytes == total
    assert sorted(r.skipped) == sorted(x.name for x in _leaves(fresh) if not x.weights)
    got = weights(fresh)
    assert len(got) == len(want)
    order_m = [v for layer in _leaves(m) for v in layer.weights]
    order_f = [v for layer in _leaves(fresh) for v in layer.weights]
    for vm, vf in zip(order_m, order_f):
        assert_same(vf.numpy(), vm.numpy())
    # the stored graph carries the ids of the model
    g = repo.graph("trunk@v1")
    assert sorted(layer["id"] for layer in g["layers"]) == sorted(model_graph(m).ids.values())
    meta = model_graph(m).meta()
    assert repo.layer_meta(list(meta)) == meta             # class, canonical config, weight specs per id


def test_partial_load_trunk_into_new_head(repo):
    a = trunk_model(head_units=3, seed=0)
    store_model(repo, "a@1", a)
    b = trunk_model(head_units=5, seed=9)
    head_before = [v.numpy().copy() for v in b.layers[-1].weights]
    read_before = repo.bytes_read
    r = load_into(repo, "a@1", b)
    assert sorted(r.loaded) == sorted(x.name for x in _leaves(b) if x.weights and x is not b.layers[-1])
    assert r.missing == [b.layers[-1].name]
    trunk_bytes = sum(v.numpy().nbytes for layer in _leaves(a)[:-1] for v in layer.weights)
    assert r.bytes == trunk_bytes
    assert repo.bytes_read - read_before == trunk_bytes     # only the matched tensors were read
    for la, lb in zip(_leaves(a)[:-1], _leaves(b)[:-1]):
        for va, vb in zip(la.weights, lb.weights):
            assert_same(vb.numpy(), va.numpy())
    for v, before in zip(b.layers[-1].weights, head_before):
        assert_same(v.numpy(), before)                    # the new head is untouched
    # the same head size but another upstream (input 17 wide): nothing of the trunk matches
    c = trunk_model(head_units=3, input_dim=17, seed=3)
    before_c = weights(c)
    with pytest.raises(ModelMismatchError, match="nothing loaded") as e:
        load_into(repo, "a@1", c)
    for layer in _leaves(c):                                # the message names the layers
        assert (layer.name in str(e.value)) == bool(layer.weights)
    for key, v in weights(c).items():
        assert_same(v, before_c[key])


def test_requested_layers_and_mismatch_errors(repo):
    a = trunk_model(head_units=3, seed=0)
    store_model(repo, "a@1", a)
    b = trunk_model(head_units=5, seed=9)
    before = weights(b)
    trunk_dense = _leaves(b)[1]
    r = load_into(repo, "a@1", b, layers=[trunk_dense.name])
    assert r.loaded == [trunk_dense.name] and r.missing == []
    assert trunk_dense.name in [x.name for x in _leaves(b)] and len(r.skipped) == len(_leaves(b)) - 1
    assert r.bytes == sum(v.numpy().nbytes for v in trunk_dense.weights)
    b2 = trunk_model(head_units=5, seed=9)
    before2 = weights(b2)
    head = b2.layers[-1]
    with pytest.raises(ModelMismatchError, match=head.name):
        load_into(repo, "a@1", b2, layers=[_leaves(b2)[1], head])   # objects; the head does not match
    with pytest.raises(ModelMismatchError, match=f"strict.*{head.name}"):
        load_into(repo, "a@1", b2, strict=True)
    with pytest.raises(ModelMismatchError, match="no leaf layer named 'nope'"):
        load_into(repo, "a@1", b2, layers=["nope"])
    for key, v in weights(b2).items():            # never a half load
        assert_same(v, before2[key])
    del before


def test_unknown_model_and_graphless(repo):
    from deepfreeze.errors import ModelNotFoundError
    m = trunk_model()
    with pytest.raises(ModelNotFoundError):
        load_into(repo, "nothing", m)
    repo.put("raw", {"x": np.zeros(3, np.float32)})
    with pytest.raises(ModelMismatchError, match="without a layer graph"):
        load_into(repo, "raw", m)


def test_subclassed_model_is_refused(repo):
    class Sub(tf.keras.Model):
        def __init__(self):
            super().__init__()
            self.d = L.Dense(2)

        def call(self, x):
            return self.d(x)
    s = Sub()
    s(np.ones((1, 3), np.float32))
    with pytest.raises(RepositoryError, match="no layer graph"):
        store_model(repo, "sub", s)


def _two_dense(first_created_first: bool):
    """Input(8) -> Dense(8) -> Dense(8): the same model; the layer applied first is created first
    or second, so the auto-name 'dense' means the first layer in one model and the second in the other."""
    tf.keras.backend.clear_session()
    inp = tf.keras.Input(shape=(8,))
    if first_created_first:
        first, second = L.Dense(8), L.Dense(8)
    else:
        second, first = L.Dense(8), L.Dense(8)
    return tf.keras.Model(inp, second(first(inp))), first, second


def test_by_name_hdf5_picks_wrong_weights_load_into_does_not(repo, tmp_path):
    a, a_first, a_second = _two_dense(True)
    randomize(a, 0)
    assert (a_first.name, a_second.name) == ("dense", "dense_1")
    a.save_weights(str(tmp_path / "a.h5"))
    store_model(repo, "a", a)

    b, b_first, b_second = _two_dense(False)
    assert (b_first.name, b_second.name) == ("dense_1", "dense")   # same names, other layers
    b.load_weights(str(tmp_path / "a.h5"), by_name=True)            # Keras: silently wrong
    assert_same(b_first.kernel.numpy(), a_second.kernel.numpy())
    assert not np.array_equal(b_first.kernel.numpy(), a_first.kernel.numpy())

    c, c_first, c_second = _two_dense(False)
    r = load_into(repo, "a", c, strict=True)                        # by id: right
    assert sorted(r.loaded) == ["dense", "dense_1"]
    assert_same(c_first.kernel.numpy(), a_first.kernel.numpy())
    assert_same(c_second.kernel.numpy(), a_second.kernel.numpy())
    assert_same(c_second.bias.numpy(), a_second.bias.numpy())
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_array_equal(c(x).numpy(), a(x).numpy())


def test_transfer_learning_example(repo):
    """The docs/repository.md example: trunk of a stored model into a new head, frozen, train the
    head, store under a new tag; the frozen trunk stays bit-exact and is de-duplicated."""
    a = trunk_model(head_units=3, seed=0)
    store_model(repo, "clf@base", a)
    b = trunk_model(head_units=5, seed=4)
    r = load_into(repo, "clf@base", b)
    for layer in b.layers[:-1]:
        layer.trainable = False
    b.compile(optimizer="sgd", loss="mse")
    b.fit(np.ones((8, 16), np.float32), np.zeros((8, 5), np.float32), epochs=1, verbose=0)
    res = store_model(repo, "clf@head5", b)
    assert res["bytes"] == sum(v.numpy().nbytes for v in b.weights)
    got = repo.get("clf@head5")
    mb, ma = model_graph(b), model_graph(a)
    trunk_ids = {ma.ids[k] for k, layer in enumerate(ma.layers) if layer is not a.layers[-1]}
    assert trunk_ids <= set(mb.ids.values())               # the trunk kept its ids in the new model
    for k, layer in enumerate(ma.layers):
        if ma.ids[k] in trunk_ids:
            for j, v in enumerate(layer.weights):           # frozen: still a's weights, bit-exact
                assert_same(got[tensor_key(ma.ids[k], j)], v.numpy())
    assert len(r.loaded) == 3


def test_constant_call_arguments_are_part_of_the_id():
    """``x * 2.0`` and ``x * 3.0`` are the same TF-op layer config; the constant makes the difference."""
    def build(factor, dtype="float32", cut=3):
        inp = tf.keras.Input(shape=(4,))
        x = tf.cast(inp * factor, dtype)[:, :cut]
        return tf.keras.Model(inp, L.Dense(2, dtype=dtype)(x))

    def dense_id(m):
        mg = model_graph(m)
        return mg.ids[mg.layers.index(m.layers[-1])]
    base = dense_id(build(2.0))
    assert dense_id(build(2.0)) == base
    assert dense_id(build(3.0)) != base
    assert dense_id(build(2.0, cut=2)) != base
    mg = model_graph(build(2.0, dtype="float16"))
    meta = mg.meta()
    cast = [v for v in meta.values() if v["class_name"] == "TFOpLambda" and v["config"]["function"] == "cast"]
    assert cast and cast[0]["config"]["__call__"] == [{"args": [{"__tensor__": 0}, "float16"],
                                                       "kwargs": {}}]
    dense = [layer for layer in mg.layers if isinstance(layer, L.Dense)][0]
    assert "__call__" not in meta[mg.ids[mg.layers.index(dense)]]["config"]   # tensors only: config as is


def test_round_trip_dtypes_and_buffers_outlive_the_load(repo):
    """float16, float64 and bfloat16 weights round-trip bit-exact; the loaded variables stay
    right after every array of the load is gone, and train on."""
    def build(seed):
        inp = tf.keras.Input(shape=(4,))
        x = L.Dense(5, dtype="float16")(inp)
        x = L.Dense(3, dtype="float64")(x)
        x = L.Dense(2, dtype="bfloat16")(x)
        m = tf.keras.Model(inp, L.Dense(2)(tf.cast(x, "float32")))
        rng = np.random.default_rng(seed)
        for v in m.weights:
            v.assign(tf.cast(rng.uniform(0.1, 1.0, v.shape), v.dtype))
        return m
    a = build(0)
    store_model(repo, "dtypes", a)
    want = [(v.dtype, v.numpy().tobytes()) for v in a.weights]
    b = build(1)
    r = load_into(repo, "dtypes", b, strict=True)
    assert len(r.loaded) == 4
    import gc
    gc.collect()
    assert [(v.dtype, v.numpy().tobytes()) for v in b.weights] == want
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(b(x).numpy(), a(x).numpy())
    b.compile(optimizer="sgd", loss="mse")
    b.fit(x, np.zeros((2, 2), np.float32), epochs=1, verbose=0)
    assert [v.numpy().tobytes() for v in b.weights] != [w for _, w in want]   # trained in its buffers
    gc.collect()
    assert np.isfinite(b(x).numpy()).all()


def test_sequential_build_styles_and_batch_size_share_ids():
    """A Sequential model with an Input, built with build(), built by a call on a batch of 1, or
    with input_shape= on its first layer: the same layers, the same ids (the batch size is not
    part of a model's structure); another input width changes every id."""
    def ids(m):
        return sorted(model_graph(m).ids.values())
    s1 = tf.keras.Sequential([tf.keras.Input((4,)), L.Dense(3), L.Dense(2)])
    s2 = tf.keras.Sequential([L.Dense(3), L.Dense(2)])
    s2.build((None, 4))
    s3 = tf.keras.Sequential([L.Dense(3), L.Dense(2)])
    s3(np.ones((1, 4), np.float32))
    s4 = tf.keras.Sequential([L.Dense(3, input_shape=(4,)), L.Dense(2)])
    s5 = tf.keras.Sequential([L.Dense(3, input_shape=(5,)), L.Dense(2)])
    assert ids(s1) == ids(s2) == ids(s3) == ids(s4)
    assert not set(ids(s5)) & set(ids(s1))


def test_which_output_of_a_multi_output_layer_is_part_of_the_id():
    def head_id(which):
        inp = tf.keras.Input(shape=(4,))
        parts = tf.split(L.Dense(4)(inp), 2, axis=-1)      # one TF-op layer, two outputs
        m = tf.keras.Model(inp, L.Dense(3)(parts[which]))
        mg = model_graph(m)
        return mg.ids[mg.layers.index(m.layers[-1])]
    assert head_id(0) == head_id(0)
    assert head_id(0) != head_id(1)


@pytest.mark.parametrize("staging_max", [None, 1])
def test_loads_never_alias_the_staging_buffer_or_each_other(repo, staging_max, monkeypatch):
    """Loads through the reused staging buffer (and, with a tiny STAGING_MAX_BYTES, through fresh
    arrays) leave every model with its own memory: loading a second model, or training one, never
    changes another; the values are the stored ones bit for bit."""
    import deepfreeze.keras.repo as kr
    if staging_max is not None:
        monkeypatch.setattr(kr, "STAGING_MAX_BYTES", staging_max)
    src = trunk_model(seed=1)
    store_model(repo, "t@a", src)
    other = trunk_model(seed=2)
    store_model(repo, "t@b", other)
    a, b = trunk_model(seed=3), trunk_model(seed=4)
    load_into(repo, "t@a", a, strict=True)
    load_into(repo, "t@b", b, strict=True)  # reuses the staging buffer a's load used
    for (la, lb_), (lw, lsrc) in zip(zip(_leaves(a), _leaves(b)), zip(_leaves(src), _leaves(other))):
        for va, vsrc in zip(la.weights, lw.weights):
            assert_same(va.numpy(), vsrc.numpy())
        for vb, vo in zip(lb_.weights, lsrc.weights):
            assert_same(vb.numpy(), vo.numpy())
    before_b = [v.numpy().copy() for v in b.weights]
    for v in a.weights:  # an in-place update of a's variables
        v.assign_add(tf.ones_like(v))
    load_into(repo, "t@a", trunk_model(seed=5))  # and one more load through the staging buffer
    for v, w in zip(b.weights, before_b):
        assert_same(v.numpy(), w)


# ---------------------------------------------------------------- ids that survive a new head (issue 24)

TWINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "repo_twins.py")


def _twins_worker(*args):
    p = subprocess.run([sys.executable, TWINS, *args], capture_output=True, text=True, timeout=180,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode == 0, p.stderr


def test_twins_keep_ids_under_a_new_head_in_another_process(tmp_path):
    """Twins into a Concatenate, a two-input Siamese model (two inputs of one shape, identical towers)
    and hand-written q/k/v projections: stored with a 3-unit head in one process, loaded under a
    5-unit head in another; every trunk layer loads bit-exact, the head keeps its initial weights."""
    import hashlib
    repo_dir, kinds = str(tmp_path / "repo"), ["concat", "siamese", "qkv"]
    _twins_worker(",".join(kinds), "3", "store", repo_dir)
    _twins_worker(",".join(kinds), "5", "load", repo_dir, str(tmp_path / "r.json"))
    with open(tmp_path / "r.json") as f:
        results = json.load(f)
    with EmbeddedRepository(repo_dir) as repo:
        for kind in kinds:
            r = results[kind]
            assert r["missing"] == [r["head"]] and r["head_untouched"] and not r["mapped"], kind
            stored = repo.get(kind)
            head_id = {k.split("/")[0] for k in r["weights"]} - {k.split("/")[0] for k in stored}
            assert len(head_id) == 1                       # the new head alone is not in the stored model
            trunk = {k: v for k, v in r["weights"].items() if k.split("/")[0] not in head_id}
            assert len(trunk) == len(stored) - 2           # every stored tensor but the old head's kernel, bias
            for key, digest in trunk.items():
                assert hashlib.sha256(stored[key].tobytes()).hexdigest() == digest, (kind, key)
            assert r["bytes"] == sum(stored[k].nbytes for k in trunk)
            assert len(r["loaded"]) == {"concat": 5, "siamese": 5, "qkv": 3}[kind]


def test_efficientnet_round_trip_and_another_resolution(repo):
    """EfficientNetB0 has 0-d weights (its Normalization layer's count): stored, loaded back bit-exact
    (they used to be stored 1-d and fail on load with an out= error); the same network at another
    input resolution loads every layer (no weight depends on the spatial size)."""
    a = tf.keras.applications.EfficientNetB0(weights=None, input_shape=(32, 32, 3), classes=4)
    randomize(a, 0)
    assert any(v.shape.rank == 0 for v in a.weights)
    store_model(repo, "effnet", a)
    assert all(len(shape) == a_v.shape.rank for a_v, (_, shape) in
               zip(a.weights, (repo.specs("effnet")[k] for _, k in model_graph(a).weight_keys())))
    b = tf.keras.applications.EfficientNetB0(weights=None, input_shape=(64, 64, 3), classes=4)
    r = load_into(repo, "effnet", b, strict=True)
    assert r.missing == [] and r.bytes == sum(v.numpy().nbytes for v in a.weights)
    for va, vb in zip([v for layer in _leaves(a) for v in layer.weights],
                      [v for layer in _leaves(b) for v in layer.weights]):
        assert_same(vb.numpy(), va.numpy())


def _mlp(dropout=False, momentum=0.99, input_dim=8, head=3, flatten_from=None):
    inp = tf.keras.Input(shape=flatten_from or (input_dim,))
    x = L.Flatten()(inp) if flatten_from else inp
    x = L.Dense(6, activation="relu")(x)
    if dropout:
        x = L.Dropout(0.3)(x)
        x = L.GaussianNoise(0.1)(x)
    x = L.BatchNormalization(momentum=momentum)(x)
    x = L.Dense(5)(x)
    m = tf.keras.Model(inp, L.Dense(head)(x))
    return m


def test_dropout_inserted_batchnorm_momentum_and_resolution_still_load(repo):
    a = _mlp()
    randomize(a, 0)
    store_model(repo, "mlp", a)
    trunk = [v.numpy() for layer in _leaves(a)[:-1] for v in layer.weights]
    b = _mlp(dropout=True, momentum=0.9, head=7)      # Dropout + GaussianNoise inserted, momentum changed
    r = load_into(repo, "mlp", b)
    assert len(r.loaded) == 3 and r.missing == [b.layers[-1].name]
    for want, v in zip(trunk, [v for layer in _leaves(b)[:-1] for v in layer.weights]):
        assert_same(v.numpy(), want)
    ids_a, ids_b = model_graph(a).ids, model_graph(b).ids
    assert len(set(ids_b.values())) == len(ids_b)
    assert len(set(ids_a.values()) & set(ids_b.values())) == 4    # input, dense, bn, dense
    # a Flatten turns the spatial size into features: another resolution changes the Dense behind it
    c = _mlp(flatten_from=(2, 4, 1))
    d = _mlp(flatten_from=(4, 2, 1))                   # the same kernel shape, another meaning
    ic, id_ = model_graph(c), model_graph(d)
    dense_c = ic.ids[ic.layers.index(c.layers[2])]
    assert dense_c not in id_.ids.values()
    assert ic.ids[0] == id_.ids[0]                     # the inputs (rank and channels) are the same


def test_mapping_and_match_by_shape(repo):
    """Twins whose first difference lies in the replaced head cannot keep ids: two identical heads on
    one trunk, replaced by one; mapping= names the stored head to load, match='shape' pairs the
    remaining layers in topological order and leaves a shape that occurs a different number of
    times unmatched."""
    inp = tf.keras.Input(shape=(4,))
    x = L.Dense(6)(inp)
    h1, h2 = L.Dense(3), L.Dense(3)
    a = tf.keras.Model(inp, [h1(x), h2(x)])
    randomize(a, 0)
    store_model(repo, "two", a)
    ma = model_graph(a)
    id_h1 = ma.ids[ma.layers.index(h1)]

    inp = tf.keras.Input(shape=(4,))
    trunk = L.Dense(6)
    head = L.Dense(3)
    b = tf.keras.Model(inp, head(trunk(inp)))
    before = weights(b)
    r = load_into(repo, "two", b)
    assert r.loaded == [trunk.name] and r.missing == [head.name] and r.mapped == {}
    r = load_into(repo, "two", b, mapping={head: id_h1})
    assert sorted(r.loaded) == sorted([trunk.name, head.name]) and r.mapped == {head.name: id_h1}
    assert_same(head.kernel.numpy(), h1.kernel.numpy())
    r = load_into(repo, "two", b, mapping={head.name: 2 if repo.graph("two")["layers"][2]["id"] == id_h1 else 3})
    assert r.mapped == {head.name: id_h1}
    r = load_into(repo, "two", b, layers=[trunk], mapping={head: id_h1}, strict=True)   # a mapped layer is asked for
    assert sorted(r.loaded) == sorted([trunk.name, head.name])
    # match="shape": two stored 3-unit heads for one new one: the count differs, left unmatched
    b2 = tf.keras.Model(inp, L.Dense(3)(trunk(inp)))
    r = load_into(repo, "two", b2, match="shape")
    assert r.ambiguous == [b2.layers[-1].name] and r.missing == r.ambiguous and r.mapped == {}
    # a new model with another input width: nothing matches by id; by shape the heads pair in order
    inp5 = tf.keras.Input(shape=(5,))
    t5 = L.Dense(6)(inp5)
    g1, g2 = L.Dense(3), L.Dense(3)
    c = tf.keras.Model(inp5, [g1(t5), g2(t5)])
    r = load_into(repo, "two", c, match="shape")
    assert set(r.mapped) == {g1.name, g2.name} and r.missing == [c.layers[1].name]
    assert_same(np.sort(np.r_[g1.kernel.numpy().ravel(), g2.kernel.numpy().ravel()]),
                np.sort(np.r_[h1.kernel.numpy().ravel(), h2.kernel.numpy().ravel()]))
    # wrong shapes through mapping=: refused before anything is set
    with pytest.raises(ModelMismatchError, match="nothing loaded"):
        load_into(repo, "two", b, mapping={trunk: id_h1})
    with pytest.raises(ModelMismatchError, match="no layer"):
        load_into(repo, "two", b, mapping={trunk: "0" * 32})
    del before


SCHEME1_COMMIT = "f25fd75"   # the last commit whose code wrote layer ids of scheme 1


def test_repository_of_scheme_1_is_migrated(tmp_path):
    """A repository written by the code of commit f25fd75 (scheme-1 ids, a 0-d weight stored 1-d) is
    migrated when opened: fresh models load by id (twin branches included) bit-exact; a model with two
    inputs of one shape (their order was not recorded) loads through match='shape'."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    old = tmp_path / "old"
    old.mkdir()
    arch = None
    if root.returncode == 0:
        arch = subprocess.run(f"git archive {SCHEME1_COMMIT} deepfreeze | tar -x -C {old}", shell=True,
                              cwd=root.stdout.strip(), capture_output=True, text=True)
    if arch is None or arch.returncode != 0 or not (old / "deepfreeze").is_dir():
        pytest.skip(f"needs the git history (commit {SCHEME1_COMMIT}) to run the scheme-1 code")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "repo_scheme1.py")
    repo_dir, expected = str(tmp_path / "repo"), str(tmp_path / "want.npz")
    p = subprocess.run([sys.executable, worker, repo_dir, expected], capture_output=True, text=True, timeout=180,
                       env={**os.environ, "PYTHONPATH": str(old)})
    assert p.returncode == 0, p.stderr
    sys.path.insert(0, os.path.dirname(worker))
    try:
        from repo_scheme1 import build, build_siamese
    finally:
        sys.path.remove(os.path.dirname(worker))
    import sqlite3
    with sqlite3.connect(os.path.join(repo_dir, "meta.db")) as c:
        assert c.execute("SELECT value FROM settings WHERE key='id_scheme'").fetchone()[0] == "1"
    with EmbeddedRepository(repo_dir) as repo:
        assert repo.graph("old@1")["scheme"] == 2 and repo.info()["id_scheme"] == 2
        want = np.load(expected)
        same = build(head=3, seed=5)
        r = load_into(repo, "old@1", same, strict=True)
        assert r.mapped == {} and len(r.loaded) == 6
        got = [v.numpy() for v in same.weights]
        assert len(got) == len(want.files)
        for i, a in enumerate(got):
            b = want[f"arr_{i}"]
            assert a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
        head5 = build(head=5, seed=6)
        head_before = [v.numpy().copy() for v in head5.layers[-1].weights]
        r = load_into(repo, "old@1", head5)
        assert r.missing == [head5.layers[-1].name] and len(r.loaded) == 5   # both twin branches load
        for v, before in zip(head5.layers[-1].weights, head_before):
            assert_same(v.numpy(), before)
        # two inputs of one shape: their order is unknown, so nothing matches by id; by shape all does
        fresh = build_siamese()
        randomize(fresh, 3)
        with pytest.raises(ModelMismatchError, match="nothing loaded"):
            load_into(repo, "siamese@1", fresh)
        r = load_into(repo, "siamese@1", fresh, match="shape", strict=True)
        assert len(r.mapped) == 2
        stored = repo.get("siamese@1")
        assert sorted(v.numpy().tobytes() for v in fresh.weights) == sorted(a.tobytes() for a in stored.values())
        # a second open finds nothing to migrate; a new store uses the new scheme
        store_model(repo, "new@1", build(head=3, seed=7))
    with EmbeddedRepository(repo_dir) as repo:
        assert repo.graph("old@1")["scheme"] == repo.graph("new@1")["scheme"] == 2
