"""Benchmark of per-example gradient methods against the batch gradient (notebook 01).

Run it as a script for your own hardware::

    python -m gradtut.bench_per_example --batch-sizes 32 256 1024 --repeats 7

Every figure is a median over ``repeats`` interleaved rounds, and every ratio is against the
plain batch gradient (one backward pass of the mean loss) measured in the same rounds.
"""
import argparse

if __name__ == "__main__":  # start TensorFlow quietly, with gradtut's settings, before it imports
    import gradtut

    gradtut.setup(seed=0)

import keras
import numpy as np
import tensorflow as tf

from gradtut.benchmark import compare_timings, format_table
from gradtut.per_example import (clipped_gradient, per_example_gradient_norms,
                                 per_example_gradients)

ALL = ("loop", "map_fn", "vectorized", "jacobian", "outer", "ghost norms", "clipped",
       "write floor")
SLOW = ("loop", "jacobian")
REFERENCE = "batch gradient"


def mlp(input_dim=784, hidden=256, classes=10, seed=0):
    """The benchmark model: Dense(hidden, relu) -> Dense(classes) logits, built on ``input_dim``."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((input_dim,)), keras.layers.Dense(hidden, activation="relu"),
                             keras.layers.Dense(classes)])


def cnn(classes=10, seed=0):
    """A small CNN on 8x8x1 digit images: two convolutions (the second strided), then Dense."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(classes)])


def transformer(classes=10, seed=0, width=32, heads=2):
    """A tiny transformer on 8x8 digit images read as 8 tokens of 8 pixels: a token embedding,
    one pre-norm block (multi-head attention, LayerNormalization, a feed-forward block),
    mean pooling, Dense logits."""
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


def _batch_gradient_fn(model, loss_fn):
    @tf.function(reduce_retracing=True)
    def batch_gradient(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(y, model(x)))
        return tape.gradient(loss, model.trainable_variables)

    return batch_gradient


def _write_floor_fn(model):
    """Writes B x (number of parameters) floats once: what materialising must at least cost."""
    value = tf.Variable(1.0)
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)

    @tf.function(reduce_retracing=True)
    def write_floor(batch_size):
        return tf.broadcast_to(value.read_value(), [batch_size, params])

    return write_floor


def benchmark_per_example(batch_sizes=(32, 256, 1024), methods=ALL, repeats=5,
                          input_dim=784, hidden=256, classes=10, slow_max_batch=None,
                          model="mlp"):
    """Time each method and the batch gradient at each batch size; return one row per pair.

    Args:
      batch_sizes: batch sizes to measure.
      methods: names from ``ALL``: the methods of ``per_example_gradients`` plus
        ``"ghost norms"`` (``per_example_gradient_norms``), ``"clipped"``
        (``clipped_gradient``) and ``"write floor"``: the time to fill a fresh
        ``[B, number of parameters]`` float32 tensor, a lower bound for any method that
        materialises per-example gradients.
      repeats: timed rounds per batch size (plus one warm-up round).
      input_dim, hidden, classes: the MLP's sizes (``classes`` for every model).
      model: ``"mlp"``, ``"cnn"`` or ``"transformer"`` (see ``MODELS``).
      slow_max_batch: skip the two slow methods (``SLOW``: the loop, linear in B, and
        ``jacobian``, quadratic in B) above this batch size; None measures them everywhere.

    Returns:
      list of dicts ``{"method", "batch_size", "median_ms", "min_ms", "max_ms", "ratio"}``, where
      ratio is the method's median over the batch gradient's median in the same interleaved
      rounds at the same batch size.
    """
    unknown = set(methods) - set(ALL)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; choose from {ALL}")
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {sorted(MODELS)}")
    shape, build = MODELS[model]
    if model == "mlp":
        shape, net = (input_dim,), mlp(input_dim, hidden, classes)
    else:
        net = build(classes)
    model = net
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    batch_gradient = _batch_gradient_fn(model, loss_fn)
    write_floor = _write_floor_fn(model)
    rng = np.random.default_rng(0)
    rows = []
    for batch in batch_sizes:
        x = tf.constant(rng.normal(size=(batch, *shape)).astype("float32"))
        y = tf.constant(rng.integers(0, classes, size=batch))
        calls = {REFERENCE: lambda: batch_gradient(x, y)}
        for method in methods:
            if method in SLOW and slow_max_batch is not None and batch > slow_max_batch:
                continue
            if method == "ghost norms":
                calls[method] = lambda: per_example_gradient_norms(model, loss_fn, x, y)
            elif method == "write floor":
                calls[method] = lambda: write_floor(tf.constant(batch))
            elif method == "clipped":
                calls[method] = lambda: clipped_gradient(model, loss_fn, x, y, l2_norm_clip=1.0)
            else:
                calls[method] = lambda m=method: per_example_gradients(model, loss_fn, x, y, m)
        for t in compare_timings(calls, reference=REFERENCE, warmup=1, repeats=repeats):
            rows.append({"method": t.name, "batch_size": batch, "median_ms": t.median_ms,
                         "min_ms": 1e3 * t.min_s, "max_ms": 1e3 * t.max_s, "ratio": t.ratio})
    return rows


def benchmark_dp_step(model="mlp", batch_size=256, repeats=7, noise_multiplier=1.0):
    """Time one DP-SGD training step (``gradtut.privacy.DPModel``, through ``train_on_batch``,
    the step ``fit`` runs) against one ordinary Keras training step of the same model, in
    interleaved rounds.

    Also times the same step with noise_multiplier 0: the difference is the Gaussian draw.

    Returns:
      dict ``{"model", "batch_size", "median_ms", "reference_ms", "ratio", "no_noise_ms",
      "no_noise_ratio", "parameters"}``.
    """
    from gradtut.privacy import DPModel  # pylint: disable=import-outside-toplevel

    shape, build = MODELS[model]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size, *shape)).astype("float32")
    y = rng.integers(0, 10, size=batch_size)
    plain = build()
    plain.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    private, clip_only = (DPModel(build(), l2_norm_clip=1.0, noise_multiplier=sigma,
                                  expected_batch_size=batch_size, seed=0)
                           for sigma in (noise_multiplier, 0.0))
    for m in (private, clip_only):
        m.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                  reduction=None))
    # sigma = 0 skips the noise: the difference is the Gaussian draw (one value per
    # parameter per step), which no DP-SGD implementation can avoid.
    timings = compare_timings({"plain fit step": lambda: plain.train_on_batch(x, y),
                               "DPModel step": lambda: private.train_on_batch(x, y),
                               "without noise": lambda: clip_only.train_on_batch(x, y)},
                              reference="plain fit step", warmup=2, repeats=repeats)
    dp, quiet = (next(t for t in timings if t.name == n) for n in ("DPModel step",
                                                                   "without noise"))
    return {"model": model, "batch_size": batch_size, "median_ms": dp.median_ms,
            "reference_ms": timings[0].median_ms, "ratio": dp.ratio,
            "no_noise_ms": quiet.median_ms, "no_noise_ratio": quiet.ratio,
            "parameters": int(sum(np.prod(v.shape) for v in private.model.trainable_variables))}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--methods", nargs="+", default=list(ALL), choices=ALL)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--slow-max-batch", type=int, default=None,
                        help="skip the loop and jacobian above this batch size (default: never)")
    args = parser.parse_args(argv)
    import gradtut

    info = gradtut.setup(seed=0)  # a no-op when run as a script: it already ran above
    rows = benchmark_per_example(args.batch_sizes, args.methods, args.repeats,
                                 slow_max_batch=args.slow_max_batch)
    print(f"TensorFlow {info['tensorflow']}, Keras {info['keras']}, "
          f"BFC allocator: {info['bfc_allocator']}, devices: {info['devices']}")
    print(format_table(rows, ["method", "batch_size", "median_ms", "ratio"]))


if __name__ == "__main__":
    main()
