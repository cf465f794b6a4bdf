"""Export Keras models with tf2onnx, run inside a venv that has them (see bench/README.md §8).

    bench/out/keras-venv/bin/python bench/export_keras.py OUT_DIR

Writes, with fixed seeds and a symbolic batch: a two-layer Keras encoder (LayerNormalization,
MultiHeadAttention, tanh-GELU MLP) and a small CNN (Conv, BatchNormalization, swish,
depthwise Conv, ReLU6, squeeze-excitation, bilinear upsampling), each at opsets 13, 15 (the
tf2onnx default) and 17. tf2onnx writes Keras's LayerNormalization as TensorFlow's
batch_normalization: x * g + (beta - mean * g) with g = gamma / sqrt(var + eps), the means by
GlobalAveragePool.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import onnx  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf2onnx  # noqa: E402

keras = tf.keras


def encoder() -> keras.Model:
    tokens = keras.Input((16,), dtype="int32")
    x = keras.layers.Embedding(100, 64)(tokens)
    for _ in range(2):
        h = keras.layers.LayerNormalization(epsilon=1e-6)(x)
        x = x + keras.layers.MultiHeadAttention(num_heads=4, key_dim=16)(h, h)
        h = keras.layers.Dense(256)(keras.layers.LayerNormalization(epsilon=1e-6)(x))
        h = keras.layers.Activation(lambda t: keras.activations.gelu(t, approximate=True))(h)
        x = x + keras.layers.Dense(64)(h)
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization()(x))
    return keras.Model(tokens, keras.layers.Dense(10, activation="softmax")(x))


def cnn() -> keras.Model:
    image = keras.Input((32, 32, 3))
    x = keras.layers.Activation("swish")(keras.layers.BatchNormalization()(keras.layers.Conv2D(16, 3, padding="same")(image)))
    x = keras.layers.ReLU(6.0)(keras.layers.BatchNormalization()(keras.layers.DepthwiseConv2D(3, padding="same")(x)))
    x = keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu")(keras.layers.MaxPooling2D()(x))
    excite = keras.layers.Conv2D(32, 1, activation="sigmoid")(keras.layers.GlobalAveragePooling2D(keepdims=True)(x))
    x = keras.layers.UpSampling2D(interpolation="bilinear")(x * excite)
    return keras.Model(image, keras.layers.Dense(5)(keras.layers.GlobalAveragePooling2D()(x)))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    keras.utils.set_random_seed(0)
    specs = {
        "keras_encoder": (encoder, [tf.TensorSpec((None, 16), tf.int32)]),
        "keras_cnn": (cnn, [tf.TensorSpec((None, 32, 32, 3), tf.float32)]),
    }
    for name, (build, signature) in specs.items():
        model = build()
        function = tf.function(lambda *args, m=model: m(*args, training=False))
        for opset in (13, 15, 17):
            proto, _ = tf2onnx.convert.from_function(function, input_signature=signature, opset=opset)
            onnx.save(proto, out / f"{name}_op{opset}.onnx")
            print(out / f"{name}_op{opset}.onnx")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
