"""Small models shared by the tests: each stands for a family of layers with or without a rule."""
import keras
import numpy as np

# The test process runs with this many virtual CPUs, so data-parallel tests can use up to 4
# replicas; everything else runs on CPU:0 as usual.
TEST_VIRTUAL_CPUS = 4
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
CLASSES = 3


def mlp():
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(CLASSES)], name="mlp")


def cnn():
    """A small CNN on 8x8 images: same and valid padding, a stride and a dilation."""
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(3, 3, strides=2, padding="valid", activation="relu"),
        keras.layers.Conv2D(2, 2, dilation_rate=2, padding="same"),
        keras.layers.Flatten(),
        keras.layers.Dense(CLASSES),
    ], name="cnn")


def text():
    """Embedding + Dense on 3-D inputs (the Gram-matrix rule) + pooling + Dense."""
    return keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(20, 5),
        keras.layers.Dense(4, activation="tanh"),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(CLASSES),
    ], name="text")


def no_rule():
    """LayerNormalization has no closed-form rule: its variables fall back to vectorized_map."""
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(8),
                             keras.layers.LayerNormalization(), keras.layers.Dense(CLASSES)],
                            name="no_rule")


def shared_dense():
    """One Dense layer called twice (weight sharing): its per-example gradient sums both calls."""
    inputs = keras.Input((12,))
    shared = keras.layers.Dense(12, activation="tanh")
    outputs = keras.layers.Dense(CLASSES)(shared(shared(inputs)))
    return keras.Model(inputs, outputs, name="shared_dense")


MODELS = {"mlp": mlp, "cnn": cnn, "text": text, "no_rule": no_rule, "shared_dense": shared_dense}
INPUT_SHAPES = {"mlp": (12,), "cnn": (8, 8, 1), "text": (6,), "no_rule": (12,),
                "shared_dense": (12,)}


def batch_for(name, batch_size, seed=0):
    rng = np.random.default_rng(seed)
    if name == "text":
        x = rng.integers(0, 20, size=(batch_size, 6)).astype("int32")
        x[:, 3] = x[:, 0]  # repeated tokens exercise the embedding rule's cross terms
    else:
        x = rng.normal(size=(batch_size, *INPUT_SHAPES[name])).astype("float32")
    y = rng.integers(0, CLASSES, size=(batch_size,))
    return x, y
