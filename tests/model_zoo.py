"""Small models shared by the tests: each stands for a family of layers with or without a rule."""
import os
import subprocess

import keras
import numpy as np
import tensorflow as tf

# The test process runs with this many virtual CPUs, so data-parallel tests can use up to 4
# replicas; everything else runs on CPU:0 as usual.
TEST_VIRTUAL_CPUS = 4
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
CLASSES = 3
VOCAB = 20
L = keras.layers


def mlp(dtype=None):
    return keras.Sequential([keras.Input((12,)), L.Dense(8, activation="tanh", dtype=dtype),
                             L.Dense(CLASSES, dtype=dtype)], name="mlp")


def cnn():
    """A small CNN on 8x8 images: same and valid padding, a stride, a dilation."""
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        L.Conv2D(4, 3, padding="same", activation="relu"),
        L.Conv2D(3, 3, strides=2, padding="valid", activation="relu"),
        L.Conv2D(4, 2, dilation_rate=2, padding="same"),
        L.Conv2D(16, 2),  # 2x2 outputs: the Gram (ghost) form is the cheaper one here
        L.Flatten(),
        L.Dense(CLASSES),
    ], name="cnn")


def grouped_conv():
    """Conv2D(groups=2), with a stride, and no bias on the second."""
    return keras.Sequential([
        keras.Input((8, 8, 4)),
        L.Conv2D(4, 3, groups=2, padding="same", activation="relu"),
        L.Conv2D(6, 2, groups=2, strides=2, use_bias=False),
        L.GlobalAveragePooling2D(),
        L.Dense(CLASSES),
    ], name="grouped_conv")


def depthwise():
    return keras.Sequential([
        keras.Input((8, 8, 3)),
        L.DepthwiseConv2D(3, depth_multiplier=2, strides=2, padding="same", activation="relu"),
        L.DepthwiseConv2D(2, dilation_rate=2, use_bias=False),
        L.Flatten(),
        L.Dense(CLASSES),
    ], name="depthwise")


def conv1d():
    """Conv1D: causal with dilation on 24 channels (72 values per patch: the layer's own
    convolution), then strided valid on 4 (patches); RMS normalisation between."""
    layers = [keras.Input((10, 24)), L.Conv1D(4, 3, padding="causal", dilation_rate=2)]
    if hasattr(L, "RMSNormalization"):
        layers.append(L.RMSNormalization())
    layers += [L.Conv1D(3, 2, strides=2, activation="tanh"), L.GlobalAveragePooling1D(),
               L.Dense(CLASSES)]
    return keras.Sequential(layers, name="conv1d")


def conv3d():
    return keras.Sequential([keras.Input((4, 4, 4, 2)), L.Conv3D(3, 2, padding="same"),
                             L.Conv3D(2, 2, strides=2), L.Flatten(), L.Dense(CLASSES)],
                            name="conv3d")


def wide_conv():
    """Convolutions whose patches exceed 64 values, so the forward pass runs the layer's own
    convolution: one materialised (36 positions), one called twice, one strided with a
    cheaper ghost form (4 positions); and a Dense head whose bias is frozen, so that layer is
    materialised without it."""
    inputs = keras.Input((6, 6, 8))
    h = L.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    shared = L.Conv2D(8, 3, padding="same", activation="tanh")
    h = L.Conv2D(6, 3, strides=2)(shared(shared(h)))
    head = L.Dense(CLASSES)
    outputs = head(L.Flatten()(h))
    head.bias.trainable = False
    return keras.Model(inputs, outputs, name="wide_conv")


def layer_norm():
    return keras.Sequential([keras.Input((12,)), L.Dense(8), L.LayerNormalization(),
                             L.Dense(CLASSES)], name="layer_norm")


def group_norm():
    return keras.Sequential([keras.Input((6, 6, 2)), L.Conv2D(4, 3), L.GroupNormalization(2),
                             L.Flatten(), L.Dense(CLASSES)], name="group_norm")


def text():
    """Embedding + Dense on 3-D inputs (the Gram-matrix rule) + pooling + Dense."""
    return keras.Sequential([
        keras.Input((6,), dtype="int32"),
        L.Embedding(VOCAB, 5),
        L.Dense(4, activation="tanh"),
        L.GlobalAveragePooling1D(),
        L.Dense(CLASSES),
    ], name="text")


def masked_text():
    """Embedding(mask_zero=True): the mask reaches the pooling; padded tokens add nothing."""
    return keras.Sequential([keras.Input((6,), dtype="int32"),
                             L.Embedding(VOCAB, 4, mask_zero=True),
                             L.GlobalAveragePooling1D(), L.Dense(CLASSES)], name="masked_text")


def attention():
    inputs = keras.Input((4, 8))
    h = L.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
    return keras.Model(inputs, L.Dense(CLASSES)(L.Flatten()(h)), name="attention")


def transformer():
    """One pre-norm transformer block: attention, LayerNormalization, a feed-forward block."""
    inputs = keras.Input((4, 8))
    h = L.LayerNormalization()(inputs)
    h = inputs + L.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
    f = L.LayerNormalization()(h)
    h = h + L.Dense(8)(L.Dense(16, activation="gelu")(f))
    return keras.Model(inputs, L.Dense(CLASSES)(L.GlobalAveragePooling1D()(h)),
                       name="transformer")


def two_inputs():
    a, b = keras.Input((5,), name="a"), keras.Input((3,), name="b")
    h = L.Concatenate()([L.Dense(4, activation="tanh")(a), L.Dense(4)(b)])
    return keras.Model([a, b], L.Dense(CLASSES)(h), name="two_inputs")


def shared_dense():
    """One Dense layer called twice (weight sharing): its per-example gradient sums both calls."""
    inputs = keras.Input((12,))
    shared = L.Dense(12, activation="tanh")
    outputs = L.Dense(CLASSES)(shared(shared(inputs)))
    return keras.Model(inputs, outputs, name="shared_dense")


class _DiscardsSecondCall(keras.Model):
    """A shared layer whose second call's output is thrown away."""

    def __init__(self):
        super().__init__(name="discarded_call")
        self.shared = L.Dense(6, activation="tanh")
        self.head = L.Dense(CLASSES)

    def call(self, x):
        h = self.shared(x)
        self.shared(x * 2.0)  # computed, never used
        return self.head(h)


def discarded_call():
    model = _DiscardsSecondCall()
    model(np.zeros((1, 6), "float32"))
    return model


def frozen():
    model = keras.Sequential([keras.Input((12,)), L.Dense(8, activation="tanh", name="frozen"),
                              L.Dense(6, activation="tanh"), L.Dense(CLASSES)], name="frozen")
    model.get_layer("frozen").trainable = False
    return model


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="subclassed")
        self.body = [L.Dense(8, activation="relu"), L.LayerNormalization()]
        self.head = L.Dense(CLASSES)

    def call(self, x):
        for layer in self.body:
            x = layer(x)
        return self.head(x)


def subclassed():
    model = _Subclassed()
    model(np.zeros((1, 12), "float32"))
    return model


def no_rule():
    """PReLU has no rule: its variables fall back to vectorized_map."""
    return keras.Sequential([keras.Input((12,)), L.Dense(8), L.PReLU(), L.Dense(CLASSES)],
                            name="no_rule")


def norm_variants():
    """LayerNormalization over two axes without an offset, and without a scale; a
    GroupNormalization on the channel axis of [B, C, T] (axis=1)."""
    return keras.Sequential([keras.Input((4, 3)), L.Dense(3),
                             L.LayerNormalization(axis=[1, 2], center=False),
                             L.Permute((2, 1)), L.GroupNormalization(groups=3, axis=1),
                             L.Permute((2, 1)), L.Dense(3), L.LayerNormalization(scale=False),
                             L.Flatten(), L.Dense(CLASSES)], name="norm_variants")


def einsum_variants():
    """EinsumDense with a bias on some output axes only, and a grouped and a depthwise Conv1D."""
    return keras.Sequential([
        keras.Input((6, 4)),
        L.EinsumDense("abc,cde->abde", output_shape=(6, 2, 3), bias_axes="d"),
        L.Reshape((6, 6)),
        L.Conv1D(4, 3, groups=2, padding="same"),
        L.DepthwiseConv1D(2, depth_multiplier=2, strides=2),
        L.Flatten(), L.Dense(CLASSES)], name="einsum_variants")


def lora_attention():
    """Keras LoRA inside MultiHeadAttention (EinsumDense) and on a Dense on sequences, the
    adapters' B made non-zero (Keras starts them at zero, where A gets no gradient)."""
    inputs = keras.Input((4, 8))
    attention_layer = L.MultiHeadAttention(num_heads=2, key_dim=4)
    h = attention_layer(inputs, inputs)
    dense = L.Dense(6)
    h = dense(h)
    model = keras.Model(inputs, L.Dense(CLASSES)(L.Flatten()(h)), name="lora_attention")
    for layer in (attention_layer.query_dense, attention_layer.value_dense,
                  attention_layer.output_dense, dense):
        layer.enable_lora(2)
        layer.lora_kernel_b.assign(np.random.default_rng(1).normal(
            0, 0.3, layer.lora_kernel_b.shape).astype("float32"))
    dense.bias.trainable = False  # adapters only here; the attention biases still train
    return model


def lstm():
    return keras.Sequential([keras.Input((5, 3)), L.LSTM(4), L.Dense(CLASSES)], name="lstm")


def gru():
    return keras.Sequential([keras.Input((5, 3)), L.GRU(4, return_sequences=True),
                             L.GlobalAveragePooling1D(), L.Dense(CLASSES)], name="gru")


def bidirectional():
    return keras.Sequential([keras.Input((5, 3)), L.Bidirectional(L.SimpleRNN(3)),
                             L.Dense(CLASSES)], name="bidirectional")


class _Unreached(keras.Model):
    """A head that never reads ``unused`` (as BERT's pooler under a token-level head)."""

    def __init__(self):
        super().__init__(name="unreached")
        self.body = L.Dense(6, activation="tanh")
        self.unused = L.Dense(4)
        self.head = L.Dense(CLASSES)

    def build(self, input_shape):
        self.body.build(input_shape)
        self.unused.build((None, 6))
        self.head.build((None, 6))

    def call(self, x):
        return self.head(self.body(x))


def unreached():
    model = _Unreached()
    model(np.zeros((1, 12), "float32"))
    return model


class ScaledBlock(L.Layer):
    """A custom layer with its own variable around two ruled sub-layers:
    ``dense_2(tanh(dense_1(x)) * gate)``, gate a per-feature weight it owns."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = L.Dense(6, activation="tanh")
        self.outer = L.Dense(5)

    def build(self, input_shape):
        self.inner.build(input_shape)
        self.outer.build((*input_shape[:-1], 6))
        self.gate = self.add_weight(shape=(6,), initializer="random_normal", name="gate")

    def call(self, x):
        return self.outer(self.inner(x) * self.gate)


def custom_block():
    return keras.Sequential([keras.Input((4, 3)), ScaledBlock(), L.Flatten(), L.Dense(CLASSES)],
                            name="custom_block")


class TiedHead(L.Layer):
    """Logits from the first CLASSES rows of an Embedding's table, assigned as this layer's
    own attribute: Keras tracks it as this layer's variable too, so two units own it."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.table = embedding.embeddings

    def call(self, h):
        return tf.matmul(h, self.table[:CLASSES], transpose_b=True)


def tied_head():
    tokens = keras.Input((6,), dtype="int32")
    embedding = L.Embedding(VOCAB, 5)
    h = L.GlobalAveragePooling1D()(L.Dense(5, activation="tanh")(embedding(tokens)))
    embedding.build((None, 6))
    return keras.Model(tokens, TiedHead(embedding)(h), name="tied_head")


def lora_unfrozen():
    """LoRA, then the common freeze and unfreeze: Keras makes the frozen kernel trainable
    again, and no rule covers it (it is read inside the LoRA layer's call)."""
    dense = L.Dense(6, activation="tanh")
    model = keras.Sequential([keras.Input((12,)), dense, L.Dense(CLASSES)], name="lora_unfrozen")
    dense.enable_lora(2)
    dense.lora_kernel_b.assign(np.random.default_rng(2).normal(
        0, 0.3, dense.lora_kernel_b.shape).astype("float32"))
    model.trainable = False
    model.trainable = True
    return model


MODELS = {f.__name__: f for f in (
    mlp, two_inputs, cnn, grouped_conv, depthwise, conv1d, conv3d, wide_conv, layer_norm,
    group_norm,
    text, masked_text, attention, transformer, shared_dense, discarded_call, frozen,
    subclassed, no_rule, norm_variants, einsum_variants, lora_attention, lstm, gru,
    bidirectional, unreached, custom_block, tied_head, lora_unfrozen)}
INPUT_SHAPES = {"mlp": (12,), "cnn": (8, 8, 1), "grouped_conv": (8, 8, 4),
                "depthwise": (8, 8, 3), "conv1d": (10, 24), "conv3d": (4, 4, 4, 2),
                "wide_conv": (6, 6, 8),
                "layer_norm": (12,), "group_norm": (6, 6, 2), "text": (6,), "masked_text": (6,),
                "attention": (4, 8), "transformer": (4, 8), "shared_dense": (12,),
                "discarded_call": (6,), "frozen": (12,), "subclassed": (12,), "no_rule": (12,),
                "norm_variants": (4, 3), "einsum_variants": (6, 4), "lora_attention": (4, 8),
                "lstm": (5, 3), "gru": (5, 3), "bidirectional": (5, 3), "unreached": (12,),
                "custom_block": (4, 3), "lora_unfrozen": (12,)}


def batch_for(name, batch_size, seed=0):
    """A batch for model ``name``: ``(x, y)``; a new seed gives fresh values."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, size=(batch_size,))
    if name == "two_inputs":
        return [rng.normal(size=(batch_size, 5)).astype("float32"),
                rng.normal(size=(batch_size, 3)).astype("float32")], y
    if name in ("text", "masked_text", "tied_head"):
        x = rng.integers(0, VOCAB, size=(batch_size, 6)).astype("int32")
        x[:, 3] = x[:, 0]  # repeated tokens exercise the embedding rule's cross terms
        if name == "masked_text":
            x[:, 4:] = 0  # padding
        return x, y
    return rng.normal(size=(batch_size, *INPUT_SHAPES[name])).astype("float32"), y


def strategy_with(replicas):
    """A MirroredStrategy over the first ``replicas`` virtual CPUs. It reduces through one
    device, so strategies of different sizes can live in one test process (collective ops
    keep their group size per process)."""
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)],
                                          cross_device_ops=tf.distribute.ReductionToOneDevice())


def no_process_matches(pattern):
    """True when no process's command line matches ``pattern`` (pgrep -f)."""
    return subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode == 1


def gone(pid):
    """Whether no process has this pid any more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# The data-parallel tests: a replicated model, its single-device twin, and their batches.


def dp_model(regularized):
    """The data-parallel tests' model: Dense(8, tanh) -> Dense(3) on 5 features, seeded."""
    keras.utils.set_random_seed(0)
    reg = keras.regularizers.L2(0.01) if regularized else None
    return keras.Sequential([keras.Input((5,)),
                             keras.layers.Dense(8, activation="tanh", kernel_regularizer=reg),
                             keras.layers.Dense(3)])


def dp_data(n, seed=0):
    """``n`` examples for :func:`dp_model`: features and labels as NumPy arrays."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype("float32"), rng.integers(0, 3, size=n)


def twins(strategy, regularized=False, learning_rate=0.1):
    """A replicated model/optimizer and a single-device copy with the same initial weights."""
    with strategy.scope():
        model = dp_model(regularized)
        optimizer = keras.optimizers.SGD(learning_rate)
    reference = dp_model(regularized)
    reference.set_weights(model.get_weights())
    return model, optimizer, reference, keras.optimizers.SGD(learning_rate)


def dp_batches(strategy, x, y, batch_size):
    """The same batches distributed over ``strategy`` and as plain ``(x, y)`` slices."""
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    return strategy.experimental_distribute_dataset(ds), [
        (x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x), batch_size)]
