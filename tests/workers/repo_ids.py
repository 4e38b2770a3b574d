"""Builds one model in a chosen construction order and prints its layer ids as JSON.

usage: repo_ids.py ORDER [--freeze]
ORDER "a": layers created in the natural order. ORDER "b": throwaway layers and an Input created
first (every Keras auto-name shifts), the two branches and the twin heads created in the other
order. The model is the same either way: Input -> Dense -> BatchNorm -> nested Sequential ->
[left branch, right branch] -> Concatenate (left at position 0) plus two identical Dense heads on
the trunk (outputs 1 and 2). --freeze: trunk layers set non-trainable before the ids are computed.
Output: {"roles": {role: id}, "names": {role: Keras name}, "graph": plain-data graph}.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)

from deepfreeze.keras.repo import model_graph  # noqa: E402

L = tf.keras.layers


def build(order: str):
    if order == "b":
        tf.keras.Input(shape=(3,))
        for _ in range(3):
            L.Dense(5)
        L.BatchNormalization()
        L.Concatenate()
    inp = tf.keras.Input(shape=(16,))
    roles = {"input": None}
    trunk = L.Dense(32, activation="relu")
    bn = L.BatchNormalization()
    nested = tf.keras.Sequential([tf.keras.Input(shape=(32,)), L.Dense(16), L.Dropout(0.1)])
    roles.update(trunk=trunk, bn=bn, nested_dense=nested.layers[0], nested_dropout=nested.layers[1])
    y = nested(bn(trunk(inp)))

    def left():
        a, b = L.Dense(8, activation="relu"), L.Dense(4)
        roles.update(left1=a, left2=b)
        return b(a(y))

    def right():
        a, b = L.Dense(8, activation="tanh"), L.Dense(4)
        roles.update(right1=a, right2=b)
        return b(a(y))

    if order == "a":
        lo, ro = left(), right()
        h0, h1 = L.Dense(3), L.Dense(3)
    else:
        ro, lo = right(), left()
        h1, h0 = L.Dense(3), L.Dense(3)
    cat = L.Concatenate()
    roles.update(cat=cat, head0=h0, head1=h1)
    model = tf.keras.Model(inp, [cat([lo, ro]), h0(y), h1(y)])
    roles["input"] = model.layers[0]
    return model, roles


def main() -> None:
    order = sys.argv[1]
    model, roles = build(order)
    if "--freeze" in sys.argv:
        for layer in (roles["trunk"], roles["bn"], roles["nested_dense"]):
            layer.trainable = False
    mg = model_graph(model)
    key = {id(layer): k for k, layer in enumerate(mg.layers)}
    graph, _ = mg.graph()
    print(json.dumps({"roles": {r: mg.ids[key[id(layer)]] for r, layer in roles.items()},
                      "names": {r: layer.name for r, layer in roles.items()},
                      "ids": sorted(mg.ids.values()), "graph": graph}))


if __name__ == "__main__":
    main()
