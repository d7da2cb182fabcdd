"""Per-example input gradients timed four ways against one batched pass (notebook 02, and the
``input_gradients`` section of ``python -m gradtut bench``)."""
import functools

import numpy as np
import tensorflow as tf

from gradtut.measure import compare_timings


def input_gradient_benchmark(model, x, target, batch_sizes=(32, 128, 512, 2048),
                             loop_max_batch=128, repeats=3):
    """Time four ways of computing per-example input gradients of ``target`` at each batch size.

    Methods: ``"loop"`` (one eager tape per example; skipped above ``loop_max_batch``),
    ``"map_fn"`` (``tf.function``, ``parallel_iterations=10``), ``"vectorized_map"`` (checked
    first to vectorise without a ``while_loop`` fallback) and
    ``"single pass"`` (one backward pass of the summed target, in a ``tf.function``: the pass
    ``gradtut.vectorize.input_gradients`` runs, checked against it, and ``map_fn`` and
    ``vectorized_map`` against it, once per batch size). All
    four take the same tensors and return a tensor, so none pays a host copy the others do not.
    Ratios are against the single pass, timed in the same interleaved rounds.

    Args:
      model: Keras classifier ``[B, ...] -> [B, classes]``.
      x: inputs ``[N, ...]`` with N >= max(batch_sizes); target: ``[N]`` class indices.

    Returns:
      list of dicts ``{"method", "batch_size", "median_ms", "ratio"}``.

    Raises:
      ValueError: ``x`` has fewer examples than the largest batch size.
      RuntimeError: pfor cannot vectorise the per-example function for this model (the
        ``vectorized_map`` row would time a ``while_loop``).
    """
    from gradtut.vectorize import input_gradients, vectorization_report

    if len(x) < max(batch_sizes):
        raise ValueError(f"x has {len(x)} examples; the largest batch size is {max(batch_sizes)}")

    def one(args):
        xi, ti = args
        xi = xi[None]
        with tf.GradientTape() as tape:
            tape.watch(xi)
            logits = model(xi, training=False)[0]
            # a one-hot product, not logits[ti]: pfor cannot batch the gradient of a slice that
            # starts at a per-example index, and would fall back to a while_loop
            value = tf.reduce_sum(logits * tf.one_hot(ti, tf.shape(logits)[-1],
                                                      dtype=logits.dtype))
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

    report = vectorization_report(one, (tf.constant(x[:2]), tf.constant(np.asarray(target[:2]))))
    if not report.vectorized:  # then the vectorized_map row would time a while_loop
        raise RuntimeError(f"pfor fell back to a while_loop for {report.fallback_ops}")
    rows = []
    for batch in batch_sizes:
        xb, tb = x[:batch], np.asarray(target[:batch])
        xt, tt = tf.constant(xb), tf.constant(tb)
        reference = single(xt, tt).numpy()
        np.testing.assert_allclose(reference, input_gradients(model, xb, target=tb),
                                   rtol=1e-4, atol=1e-6)
        for other in (vectorized, mapped):  # the timed methods compute the same gradients
            np.testing.assert_allclose(other(xt, tt).numpy(), reference, rtol=1e-4, atol=1e-6)
        methods = {"single pass": single, "vectorized_map": vectorized, "map_fn": mapped}
        if batch <= loop_max_batch:
            methods["loop"] = loop
        calls = {name: functools.partial(fn, xt, tt) for name, fn in methods.items()}
        for t in compare_timings(calls, reference="single pass", warmup=1, repeats=repeats):
            rows.append({"method": t.name, "batch_size": batch, "median_ms": t.median_ms,
                         "ratio": t.ratio})
    return rows
