"""Build a small Keras CNN (random weights) and export it with tf2onnx to models/keras/.

Needs TensorFlow and tf2onnx, which cannot live beside the project's torch: use a separate
environment, e.g.

    python3 -m venv .venv-tf && . .venv-tf/bin/activate && pip install tensorflow-cpu tf2onnx
    python tools/keras_export.py

The committed `models/keras/keras_cnn.onnx` is what this wrote; the tests prune it with
onnxshrink (tests/test_prune.py) and tools/groups_to_masks.py builds Keras masks from its groups.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def build(seed: int = 0):
    import tensorflow as tf
    from tensorflow import keras

    tf.random.set_seed(seed)
    x = keras.Input((16, 16, 3), name="image")
    y = keras.layers.Conv2D(16, 3, padding="same", use_bias=False, name="stem")(x)
    y = keras.layers.BatchNormalization(name="stem_bn")(y)
    y = keras.layers.ReLU(name="stem_relu")(y)
    r = keras.layers.Conv2D(24, 3, padding="same", name="conv1")(y)
    r = keras.layers.ReLU(name="relu1")(r)
    r = keras.layers.Conv2D(16, 3, padding="same", name="conv2")(r)
    y = keras.layers.Add(name="residual")([y, r])
    y = keras.layers.DepthwiseConv2D(3, padding="same", name="dw")(y)
    y = keras.layers.Conv2D(32, 1, name="project")(y)
    y = keras.layers.ReLU(name="relu2")(y)
    y = keras.layers.GlobalAveragePooling2D(name="pool")(y)
    y = keras.layers.Dense(20, activation="relu", name="fc1")(y)
    y = keras.layers.Dense(5, name="fc2")(y)
    model = keras.Model(x, y, name="keras_cnn")
    rng = np.random.default_rng(seed)
    for layer in model.layers:  # random values for every weight, BN statistics included
        ws = layer.get_weights()
        if not ws:
            continue
        new = []
        for w in ws:
            if isinstance(layer, keras.layers.BatchNormalization) and w is ws[3]:
                new.append(rng.uniform(0.5, 1.5, w.shape).astype(w.dtype))  # variance
            else:
                new.append((rng.standard_normal(w.shape) * 0.3).astype(w.dtype))
        layer.set_weights(new)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", default=str(Path(__file__).parents[1] / "models/keras/keras_cnn.onnx"))
    args = p.parse_args()
    import tensorflow as tf
    import tf2onnx

    model = build()
    spec = (tf.TensorSpec((1, 16, 16, 3), tf.float32, name="image"),)
    onnx_model, _ = tf2onnx.convert.from_keras(model, input_signature=spec, opset=17)
    Path(args.output).write_bytes(onnx_model.SerializeToString())
    x = np.random.default_rng(1).standard_normal((1, 16, 16, 3)).astype(np.float32)
    np.save(Path(args.output).with_suffix(".expected.npy"), model(x).numpy())
    np.save(Path(args.output).with_suffix(".input.npy"), x)
    print(f"wrote {args.output} ({Path(args.output).stat().st_size} bytes)")


if __name__ == "__main__":
    main()
