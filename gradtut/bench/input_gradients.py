"""Measurements behind notebook 02 that need a fresh process or a fixed workload.

Thread-pool sizes are read once, when TensorFlow's runtime starts, so
:func:`threading_timings` is meant to run in its own process
(``gradtut.session.run_in_subprocess``), one call per setting.
"""
import keras
import numpy as np
import tensorflow as tf

from gradtut.checks import check_int
from gradtut.measure import compare_timings


def _check_model(model):
    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a Keras model, got {type(model).__name__}: wrap layers "
                        "in keras.Sequential([...])")


def make_per_example_input_gradient(model):
    """``f(x_i) -> d sum(model(x_i)) / d x_i`` for one example without its batch dimension.

    Raises:
      TypeError: ``model`` is not a Keras model.
    """
    _check_model(model)

    def gradient(xi):
        xi = tf.convert_to_tensor(xi)[None]
        with tf.GradientTape() as tape:
            tape.watch(xi)
            value = tf.reduce_sum(model(xi, training=False))
        return tape.gradient(value, xi)[0]

    return gradient


def make_batched_input_gradient(model):
    """A ``tf.function`` ``x -> d sum(model(x)) / d x``: every example's input gradient at once.

    Raises:
      TypeError: ``model`` is not a Keras model.
    """
    _check_model(model)

    @tf.function
    def batched(v):
        with tf.GradientTape() as tape:
            tape.watch(v)
            value = tf.reduce_sum(model(v, training=False))
        return tape.gradient(value, v)

    return batched


def map_fn_timings(model, x, parallel_iterations=(1, 2, 4, 10), repeats=5, eager=True):
    """Median ms of ``tf.map_fn`` over ``x`` with the per-example input gradient.

    Returns dict ``{label: Timing}`` for eager (if asked) and each ``parallel_iterations`` in a
    ``tf.function``, plus ``"vectorized_map"`` and ``"one batched pass"``, all timed in the same
    interleaved rounds; ratios are against the eager map_fn (or the first graph variant).

    Raises:
      TypeError: ``model`` is not a Keras model.
      ValueError: ``x`` has no examples, a ``parallel_iterations`` or ``repeats`` that is not a
        positive int.
    """
    parallel_iterations = [check_int(p, "parallel_iterations") for p in parallel_iterations]
    repeats = check_int(repeats, "repeats")
    if not len(x):
        raise ValueError("x has no examples: pass a batch of at least one")
    one = make_per_example_input_gradient(model)
    x = tf.convert_to_tensor(x)
    calls = {}
    if eager:
        calls["map_fn, eager"] = lambda: tf.map_fn(one, x, parallel_iterations=1)
    for p in parallel_iterations:
        fn = tf.function(lambda v, p=p: tf.map_fn(one, v, parallel_iterations=p))
        calls[f"map_fn, tf.function, parallel_iterations={p}"] = lambda fn=fn: fn(x)
    vectorized = tf.function(lambda v: tf.vectorized_map(one, v))
    calls["vectorized_map"] = lambda: vectorized(x)
    batched = make_batched_input_gradient(model)
    calls["one batched pass"] = lambda: batched(x)
    return compare_timings(calls, reference=next(iter(calls)), warmup=1, repeats=repeats)


def threading_timings(intra_op=None, inter_op=None, batch=256, features=1024, repeats=5):
    """Set TensorFlow's thread pools, then time three workloads in interleaved rounds.

    Setting a pool size must happen before TensorFlow's runtime starts in this process (use
    ``run_in_subprocess``); None keeps TensorFlow's default (0: one thread per core).

    Returns:
      dict with the settings and the median ms of: ``"matmul_ms"``, one 2048 x 2048 matmul (a
      single large op); ``"batched_ms"``, per-example input gradients of an MLP
      (``features``-1024-10) on ``batch`` examples as one batched computation; ``"map_fn_ms"``,
      the same as ``tf.map_fn`` with ``parallel_iterations=10`` in a ``tf.function``.

    Raises:
      ValueError: a thread count, size or ``repeats`` that is not a positive int.
    """
    for name, value in (("intra_op", intra_op), ("inter_op", inter_op)):
        if value is not None:
            check_int(value, name)
    for name, value in (("batch", batch), ("features", features), ("repeats", repeats)):
        check_int(value, name)
    if intra_op is not None:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op)
    if inter_op is not None:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(1024, activation="tanh"),
                              keras.layers.Dense(10)])
    x = tf.constant(np.random.default_rng(0).normal(size=(batch, features)).astype("float32"))
    one = make_per_example_input_gradient(model)
    square = tf.random.stateless_normal([2048, 2048], seed=[0, 0])
    matmul = tf.function(lambda: tf.matmul(square, square))
    mapped = tf.function(lambda v: tf.map_fn(one, v, parallel_iterations=10))
    batched = make_batched_input_gradient(model)
    timings = compare_timings({"matmul": matmul, "batched": lambda: batched(x),
                               "map_fn": lambda: mapped(x)}, warmup=1, repeats=repeats)
    return {"intra_op": intra_op or "default", "inter_op": inter_op or "default",
            **{f"{t.name}_ms": t.median_ms for t in timings}}


def input_gradient_benchmark(model, x, target, batch_sizes=(32, 128, 512, 2048),
                             loop_max_batch=128, repeats=3):
    """Time four ways of computing per-example input gradients of ``target`` at each batch size.

    Methods: ``"loop"`` (one eager tape per example; skipped above ``loop_max_batch``),
    ``"map_fn"`` (``tf.function``, ``parallel_iterations=10``), ``"vectorized_map"`` and
    ``"single pass"`` (one backward pass of the summed target, in a ``tf.function``: the pass
    ``gradtut.vectorize.input_gradients`` runs, checked against it once per batch size). All
    four take the same tensors and return a tensor, so none pays a host copy the others do not.
    Ratios are against the single pass, timed in the same interleaved rounds.

    Args:
      model: Keras classifier ``[B, ...] -> [B, classes]``.
      x: inputs ``[N, ...]`` with N >= max(batch_sizes); target: ``[N]`` class indices.

    Returns:
      list of dicts ``{"method", "batch_size", "median_ms", "ratio"}``.
    """
    from gradtut.vectorize import input_gradients

    if len(x) < max(batch_sizes):
        raise ValueError(f"x has {len(x)} examples; the largest batch size is {max(batch_sizes)}")

    def one(args):
        xi, ti = args
        xi = xi[None]
        with tf.GradientTape() as tape:
            tape.watch(xi)
            value = model(xi, training=False)[0, ti]
        return tape.gradient(value, xi)[0]

    mapped = tf.function(lambda xb, tb: tf.map_fn(one, (xb, tb), fn_output_signature=xb.dtype,
                                                  parallel_iterations=10))
    vectorized = tf.function(lambda xb, tb: tf.vectorized_map(one, (xb, tb)))

    @tf.function(reduce_retracing=True)
    def single(xb, tb):
        with tf.GradientTape() as tape:
            tape.watch(xb)
            total = tf.reduce_sum(tf.gather(model(xb, training=False), tb, batch_dims=1))
        return tape.gradient(total, xb)

    def loop(xb, tb):
        return tf.stack([one((xb[i], tb[i])) for i in range(len(xb))])

    rows = []
    for batch in batch_sizes:
        xb, tb = x[:batch], np.asarray(target[:batch])
        xt, tt = tf.constant(xb), tf.constant(tb)
        np.testing.assert_allclose(single(xt, tt).numpy(), input_gradients(model, xb, target=tb),
                                   rtol=1e-4, atol=1e-6)
        calls = {"single pass": lambda: single(xt, tt),
                 "vectorized_map": lambda: vectorized(xt, tt),
                 "map_fn": lambda: mapped(xt, tt)}
        if batch <= loop_max_batch:
            calls["loop"] = lambda: loop(xt, tt)
        for t in compare_timings(calls, reference="single pass", warmup=1, repeats=repeats):
            rows.append({"method": t.name, "batch_size": batch, "median_ms": t.median_ms,
                         "ratio": t.ratio})
    return rows
