"""The small models the notebooks teach on and ``python -m gradtut bench`` times (notebooks 01
and 02).

- :func:`mlp`: Dense, Dense on flat inputs (784-256-10 by default: the per-example benchmark);
- :func:`cnn`: two convolutions and a Dense layer on 8x8x1 digit images;
- :func:`transformer`: a one-block attention model on 8x8 digits read as 8 tokens;
- :func:`make_batch_gradient`: the batch gradient of a model's mean loss, the reference every
  per-example method's cost is measured against;
- :func:`bert_classifier`: KerasHub's ``BertBackbone`` from a config under a mean-over-tokens
  classifier, optionally with Keras LoRA (needs KerasHub, a test dependency).

``MODELS`` maps each name but BERT to ``(input shape, builder)``. Every builder seeds Keras, so
the same arguments give the same weights.
"""
import keras
import tensorflow as tf

from gradtut.checks import check_int, check_keras_model, check_loss_fn


def _check_sizes(**sizes):
    for name, value in sizes.items():
        check_int(value, name, minimum=0 if name == "seed" else 1)


def mlp(input_dim=784, hidden=256, classes=10, seed=0):
    """The benchmark model: Dense(hidden, relu) -> Dense(classes) logits, built on ``input_dim``.
    (Every size is a positive int, ``seed`` an int >= 0; ValueError otherwise.)"""
    _check_sizes(input_dim=input_dim, hidden=hidden, classes=classes, seed=seed)
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((input_dim,)),
                             keras.layers.Dense(hidden, activation="relu"),
                             keras.layers.Dense(classes)])


def cnn(classes=10, seed=0):
    """A small CNN on 8x8x1 digit images: two convolutions (the second strided), then Dense.
    (``classes`` a positive int, ``seed`` an int >= 0; ValueError otherwise.)"""
    _check_sizes(classes=classes, seed=seed)
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(classes)])


def transformer(classes=10, seed=0, width=32, heads=2):
    """A tiny transformer on 8x8 digit images read as 8 tokens of 8 pixels: a token embedding,
    one pre-norm block (LayerNormalization then multi-head attention, LayerNormalization then
    a feed-forward block),
    mean pooling, Dense logits. (Sizes positive ints, ``seed`` an int >= 0, and ``width``
    divisible by ``heads``; ValueError otherwise.)"""
    _check_sizes(classes=classes, seed=seed, width=width, heads=heads)
    if width % heads:
        raise ValueError(f"width {width} does not split into {heads} heads: choose a width "
                         "divisible by heads")
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((8, 8))
    h = keras.layers.Dense(width)(tokens)
    a = keras.layers.LayerNormalization()(h)
    h = h + keras.layers.MultiHeadAttention(heads, width // heads)(a, a)
    f = keras.layers.LayerNormalization()(h)
    h = h + keras.layers.Dense(width)(keras.layers.Dense(2 * width, activation="gelu")(f))
    return keras.Model(tokens, keras.layers.Dense(classes)(
        keras.layers.GlobalAveragePooling1D()(h)))


MODELS = {"mlp": ((784,), mlp), "cnn": ((8, 8, 1), cnn), "transformer": ((8, 8), transformer)}


def bert_classifier(lora_rank=None, layers=2, hidden=128, steps=64, vocabulary=1000, classes=3,
                    seed=0):
    """KerasHub's ``BertBackbone`` from a config (random weights, nothing downloaded), mean over
    tokens, ``Dense(classes)``; with ``lora_rank``, ``backbone.enable_lora(lora_rank)`` (Keras
    LoRA on the attention's query and value, everything else in the backbone frozen).
    Inputs: ``{"token_ids", "segment_ids", "padding_mask"}``, each ``[B, steps]`` int32.
    Needs KerasHub (``pip install -r requirements-dev.txt``).

    Raises:
      ValueError: a size that is not a positive int, a ``seed`` that is not an int >= 0, or a
        ``hidden`` that does not split into 2 heads.
    """
    import keras_hub  # pylint: disable=import-outside-toplevel

    _check_sizes(layers=layers, hidden=hidden, steps=steps, vocabulary=vocabulary,
                 classes=classes, seed=seed)
    if lora_rank is not None:
        check_int(lora_rank, "lora_rank")
    if hidden % 2:
        raise ValueError(f"hidden {hidden} does not split into 2 heads: choose an even hidden")
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=vocabulary, num_layers=layers, num_heads=2, hidden_dim=hidden,
        intermediate_dim=4 * hidden, max_sequence_length=steps, dropout=0.0)
    if lora_rank is not None:
        backbone.enable_lora(lora_rank)
    inputs = {name: keras.Input((steps,), dtype="int32", name=name)
              for name in ("token_ids", "segment_ids", "padding_mask")}
    pooled = keras.layers.GlobalAveragePooling1D()(backbone(inputs)["sequence_output"])
    return keras.Model(inputs, keras.layers.Dense(classes)(pooled))


def make_batch_gradient(model, loss_fn):
    """A ``tf.function`` ``(x, y) -> gradients of mean(loss_fn(y, model(x)))``, one tensor per
    trainable variable: the one backward pass that per-example methods are timed against.

    Raises:
      TypeError: ``model`` is not a Keras model or layer, or ``loss_fn`` cannot be called.
      ValueError: ``loss_fn`` is a loss given by name.

    Example:
      >>> model = mlp(input_dim=3, hidden=4, classes=2)
      >>> loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
      >>> grads = make_batch_gradient(model, loss_fn)(tf.ones([5, 3]), tf.zeros([5], tf.int32))
      >>> [tuple(g.shape) for g in grads]
      [(3, 4), (4,), (4, 2), (2,)]
    """
    check_keras_model(model)
    check_loss_fn(loss_fn)

    @tf.function(reduce_retracing=True)
    def batch_gradient(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(y, model(x)))
        return tape.gradient(loss, model.trainable_variables)

    return batch_gradient
