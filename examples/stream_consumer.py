"""Consumer of the docs/stream.md example: serves the newest version of channel "mnistish".

    python examples/stream_consumer.py        # start it before or while the producer runs
"""
import numpy as np

from deepfreeze.keras import ModelSubscriber

from stream_producer import build

if __name__ == "__main__":
    sub = ModelSubscriber("mnistish", persistent="/tmp/deepfreeze/persistent", build=build)
    sub.on_update(lambda v: print("now serving", v, flush=True))
    x = np.random.default_rng(1).random((8, 28, 28), dtype=np.float32)
    live = sub.wait(0, timeout=120)               # the first version (any step)
    while True:
        try:
            live = sub.wait(None, timeout=15)     # the next one; TimeoutError once the producer stops
        except TimeoutError:
            break
        y, version = sub.predict(x)               # one whole version answers each request
        print(f"{version}: class of sample 0 = {int(np.argmax(y[0]))}")
    weights, version = sub.get_weights()
    print("done; last version", version, "weights", [w.shape for w in weights])
    sub.close()
