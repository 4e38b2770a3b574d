"""Golden layer ids: the ids of a fixed neutral graph and of a small Keras model, pinned, so a
change of the framework-neutral core (deepfreeze.repo.ids) or of the Keras adapter that moves a
stored id fails here (a stored model would no longer load by id). Values computed with the
DeepFreeze of 2026-11-28 (before the torch adapter joined the core) and unchanged since."""
import os

import pytest

from deepfreeze.repo.ids import Node, canonical_config, compute_ids

NEUTRAL = {
    "in": "a69216162c15a8695a91e3ce08eb96fe", "conv": "22ed98583f99776513561e0a7da6d680",
    "bn": "28ec540b296c75822b2725bda2a1523f", "flat": "4c25d0cb1314951009dd5ef515e2f60d",
    "drop": "112f33b33ec3944ea77fa5fefeae31e2", "t1": "c0bb64fe7ac7131a064b8d46ade40e30",
    "t2": "e52f3abeeb684f3302218c9f59f89163", "h1": "ba7f8b875a94e65ef8c2913983fd7ca1",
    "h2": "8d380c27cb0806030e04e74c3f3eae20", "side": "d38c6dab09537deeef8f880b035e2a02",
}


def _dense(units, calls, fan_in):
    cfg = {"name": f"d{units}", "units": units, "activation": "relu", "use_bias": True, "trainable": True,
           "kernel_initializer": {"class_name": "GlorotUniform"}}
    return Node("Dense", canonical_config(cfg), [((fan_in, units), "float32"), ((units,), "float32")], calls)


def test_neutral_ids_pinned():
    """Input resolution, BatchNorm momentum, a shape-dependent Flatten, a transparent Dropout,
    twins (t1, t2) told apart by their consumers, a layer with two consumers."""
    nodes = {
        "in": Node("InputLayer", canonical_config({"batch_input_shape": [None, 8, 8, 3], "name": "x"}), [], []),
        "conv": Node("Conv2D", canonical_config({"filters": 4, "kernel_size": [3, 3], "strides": [1, 1]}),
                     [((3, 3, 3, 4), "float32"), ((4,), "float32")], [["in"]]),
        "bn": Node("BatchNormalization", canonical_config({"axis": [3], "momentum": 0.99, "epsilon": 0.001}),
                   [((4,), "float32")] * 4, [["conv"]]),
        "flat": Node("Flatten", canonical_config({"__input_shape__": [[[8, 8, 4]]]}), [], [["bn"]]),
        "drop": Node("Dropout", canonical_config({"rate": 0.5}), [], [["flat"]]),
        "t1": _dense(2, [["drop"]], 256),
        "t2": _dense(2, [["drop"]], 256),
        "h1": _dense(3, [["t1"]], 2),
        "h2": _dense(5, [["t2"]], 2),
        "side": _dense(7, [["t1"]], 2),
    }
    assert compute_ids(nodes, ["h1", "h2", "side"], ["in"]) == NEUTRAL


KERAS = {
    "img": "6d0229c2181cd3fad83821c4ed825d5a", "conv": "534ccb282218e67080f83d2c7d7edc4b",
    "bn": "14df69baf24ff5167e0dfc5810df1750", "flat": "21d22789205742d84a089917dbd7658f",
    "drop": "c06196fb2cc65f5169c0f56ef95f61a5", "t1": "934ecdb2e3c83d7008ba7e067daf59fb",
    "t2": "373be5a1b56763286c134557a1b1a290", "h1": "5260fbdf728141ab972d8fbb31484b6c",
    "h2": "b0d3a6f137ce8795a41c7a660236b1b0",
}


def test_keras_ids_pinned():
    """A small functional Keras model (conv, BN, flatten, dropout, twin heads): its ids by layer
    name, pinned."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    tf = pytest.importorskip("tensorflow")
    from deepfreeze.keras.repo import model_graph
    L = tf.keras.layers
    inp = tf.keras.Input(shape=(6, 6, 2), name="img")
    x = L.Conv2D(3, 3, name="conv")(inp)
    x = L.BatchNormalization(name="bn")(x)
    x = L.Flatten(name="flat")(x)
    x = L.Dropout(0.2, name="drop")(x)
    t1 = L.Dense(4, name="t1")(x)
    t2 = L.Dense(4, name="t2")(x)
    model = tf.keras.Model(inp, [L.Dense(2, name="h1")(t1), L.Dense(3, name="h2")(t2)])
    mg = model_graph(model)
    got = {layer.name: mg.ids[k] for k, layer in enumerate(mg.layers)}
    assert got == KERAS
