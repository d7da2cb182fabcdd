"""Per-example gradient methods and a DP-SGD step timed against the batch gradient and a plain
step (notebook 01, and the ``per_example`` section of ``python -m gradtut bench``).

Every figure is a median over ``repeats`` interleaved rounds, and every ratio is against the
plain batch gradient (one backward pass of the mean loss) measured in the same rounds.
"""
import functools
import warnings

import keras
import numpy as np
import tensorflow as tf

from gradtut.checks import check_int
from gradtut.measure import compare_timings
from gradtut.models import MODELS, bert_classifier, make_batch_gradient, mlp
from gradtut.per_example import clipped_gradient, per_example_gradient_norms, per_example_gradients

ALL = ("loop", "map_fn", "vectorized", "jacobian", "outer", "ghost norms", "clipped",
       "write floor", "matmul floor")
SLOW = ("loop", "jacobian")
REFERENCE = "batch gradient"


def _model_entry(model):
    """``(input shape, builder)`` of a benchmark model by name, or a clear error."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    return MODELS[model]


def _write_floor_fn(model):
    """Writes B x (number of parameters) floats once: what materialising must at least cost."""
    value = tf.Variable(1.0)
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)

    @tf.function(reduce_retracing=True)
    def write_floor(batch_size):
        return tf.broadcast_to(value.read_value(), [batch_size, params])

    return write_floor


def _matmul_floor_fn(model, batch_size):
    """Writes every Dense kernel's per-example gradient, ``[B, d, 1] @ [B, 1, n]`` for each
    Dense layer, from fixed random inputs: the batched-matmul way to write the products that
    ``outer`` writes, and nothing else (no forward or backward pass). A reference point, not
    a bound: ``outer`` writes them with XLA's broadcast multiply, which can be faster."""
    rng = np.random.default_rng(1)
    pairs = [(tf.constant(rng.normal(size=(batch_size, d, 1)).astype("float32")),
              tf.constant(rng.normal(size=(batch_size, 1, n)).astype("float32")))
             for d, n in (layer.kernel.shape for layer in model.layers
                          if isinstance(layer, keras.layers.Dense))]

    @tf.function
    def matmul_floor():
        return [tf.matmul(a, g) for a, g in pairs]

    return matmul_floor


def benchmark_per_example(batch_sizes=(32, 256, 1024), methods=ALL, repeats=5,
                          input_dim=784, hidden=256, classes=10, slow_max_batch=None,
                          model="mlp"):
    """Time each method and the batch gradient at each batch size; return one row per pair.

    Args:
      batch_sizes: batch sizes to measure.
      methods: names from ``ALL``: the methods of ``per_example_gradients`` plus
        ``"ghost norms"`` (``per_example_gradient_norms``), ``"clipped"``
        (``clipped_gradient``) and ``"write floor"``: the time to fill a fresh
        ``[B, number of parameters]`` float32 tensor, what any method that materialises
        per-example gradients must at least write (a reference, not a strict bound: timings
        vary); ``"matmul floor"``: the batched matmuls that write each Dense kernel's
        per-example gradient (the MLP's kernels), a reference point for ``"outer"``, not a
        bound (``outer`` writes the same products another way and can beat it).
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
    shape, build = _model_entry(model)
    if model == "mlp":
        shape, net = (input_dim,), mlp(input_dim, hidden, classes)
    else:
        net = build(classes)
    model = net
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    batch_gradient = make_batch_gradient(model, loss_fn)
    write_floor = _write_floor_fn(model)
    rng = np.random.default_rng(0)
    rows = []
    for batch in batch_sizes:
        x = tf.constant(rng.normal(size=(batch, *shape)).astype("float32"))
        y = tf.constant(rng.integers(0, classes, size=batch))
        calls = {REFERENCE: functools.partial(batch_gradient, x, y)}
        for method in methods:
            if method in SLOW and slow_max_batch is not None and batch > slow_max_batch:
                continue
            if method == "ghost norms":
                calls[method] = functools.partial(per_example_gradient_norms, model, loss_fn, x, y)
            elif method == "write floor":
                calls[method] = functools.partial(write_floor, tf.constant(batch))
            elif method == "matmul floor":
                calls[method] = _matmul_floor_fn(model, batch)
            elif method == "clipped":
                calls[method] = functools.partial(clipped_gradient, model, loss_fn, x, y,
                                                  l2_norm_clip=1.0)
            else:
                calls[method] = functools.partial(per_example_gradients, model, loss_fn, x, y,
                                                  method)
        for t in compare_timings(calls, reference=REFERENCE, warmup=1, repeats=repeats):
            rows.append({"method": t.name, "batch_size": batch, "median_ms": t.median_ms,
                         "min_ms": 1e3 * t.min_s, "max_ms": 1e3 * t.max_s, "ratio": t.ratio})
    return rows


def benchmark_dp_step(model="mlp", batch_size=256, repeats=7, noise_multiplier=1.0,
                      canaries=1000):
    """Time one DP-SGD training step (``gradtut.privacy.DPModel``, through ``train_on_batch``,
    the step ``fit`` runs) against one ordinary Keras training step of the same model, in
    interleaved rounds.

    Also times the same step with noise_multiplier 0 (the difference is the Gaussian draw),
    and the step under a ``CanaryAudit`` with ``canaries`` canaries (sample rate
    ``batch_size / 60000``), whose ratio is against the plain DPModel step.

    Returns:
      dict ``{"model", "batch_size", "median_ms", "reference_ms", "ratio", "no_noise_ms",
      "no_noise_ratio", "audited_ms", "audited_ratio", "canaries", "parameters"}``.

    Raises:
      ValueError: an unknown model, or a size or count that is not a positive int.
    """
    from gradtut.privacy import CanaryAudit, DPModel  # pylint: disable=import-outside-toplevel

    shape, build = _model_entry(model)
    batch_size, repeats = check_int(batch_size, "batch_size"), check_int(repeats, "repeats")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size, *shape)).astype("float32")
    y = rng.integers(0, 10, size=batch_size)
    plain = build()
    plain.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    private, clip_only, audited = (DPModel(build(), l2_norm_clip=1.0, noise_multiplier=sigma,
                                           expected_batch_size=batch_size, seed=0)
                                    for sigma in (noise_multiplier, 0.0, noise_multiplier))
    for m in (private, clip_only, audited):
        m.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                  reduction=None))
    # sigma = 0 skips the noise: the difference is the Gaussian draw (one value per
    # parameter per step), which no DP-SGD implementation can avoid.
    audit = CanaryAudit(canaries, sample_rate=batch_size / 60000, delta=1e-5, seed=0)
    audit.set_model(audited)
    audit.on_train_begin()  # what fit(callbacks=[audit]) does first: the canaries go in
    timings = compare_timings({"plain fit step": lambda: plain.train_on_batch(x, y),
                               "DPModel step": lambda: private.train_on_batch(x, y),
                               "without noise": lambda: clip_only.train_on_batch(x, y),
                               "audited": lambda: audited.train_on_batch(x, y)},
                              reference="plain fit step", warmup=2, repeats=repeats)
    dp, quiet, checked = (next(t for t in timings if t.name == n)
                          for n in ("DPModel step", "without noise", "audited"))
    return {"model": model, "batch_size": batch_size, "median_ms": dp.median_ms,
            "reference_ms": timings[0].median_ms, "ratio": dp.ratio,
            "no_noise_ms": quiet.median_ms, "no_noise_ratio": quiet.ratio,
            "audited_ms": checked.median_ms, "audited_ratio": checked.median_ms / dp.median_ms,
            "canaries": canaries,
            "parameters": int(sum(np.prod(v.shape) for v in private.model.trainable_variables))}


def benchmark_keras_hub(lora_rank=None, batch_size=64, steps=64, repeats=7):
    """The one-pass methods on :func:`bert_classifier` (2 layers, hidden 128) against the same
    model's batch gradient, in interleaved rounds, and the allocator's peak memory of the
    clipped gradient against the batch gradient's. With ``lora_rank`` every figure is the LoRA
    model's, against the LoRA model's own batch gradient.

    Returns:
      list of dicts ``{"method", "median_ms", "ratio", "peak_mb", "peak_ratio"}`` for
      ``"batch gradient"``, ``"ghost norms"`` and ``"clipped"`` (peaks for the batch gradient
      and the clipped gradient only; None elsewhere). Peak memory needs allocator statistics
      (``gradtut.setup()``); without them the peaks are None.

    Raises:
      ValueError: a size or count that is not a positive int.
    """
    from gradtut.measure import peak_memory_bytes  # pylint: disable=import-outside-toplevel

    for name, value in (("batch_size", batch_size), ("steps", steps), ("repeats", repeats)):
        check_int(value, name)
    model = bert_classifier(lora_rank, steps=steps)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    batch_gradient = make_batch_gradient(model, loss_fn)
    rng = np.random.default_rng(0)
    x = {"token_ids": tf.constant(rng.integers(1, 1000, (batch_size, steps)), tf.int32),
         "segment_ids": tf.constant(rng.integers(0, 2, (batch_size, steps)), tf.int32),
         "padding_mask": tf.ones((batch_size, steps), tf.int32)}
    y = tf.constant(rng.integers(0, 3, size=batch_size))
    calls = {REFERENCE: lambda: batch_gradient(x, y),
             "ghost norms": lambda: per_example_gradient_norms(model, loss_fn, x, y),
             "clipped": lambda: clipped_gradient(model, loss_fn, x, y, l2_norm_clip=1.0)}
    with warnings.catch_warnings():  # BERT's pooler is unreached under this head: zero, named once
        warnings.filterwarnings("ignore", "the loss does not reach")
        timings = compare_timings(calls, reference=REFERENCE, warmup=2, repeats=repeats)
        try:
            peaks = {name: peak_memory_bytes(calls[name]) / 1e6 for name in (REFERENCE, "clipped")}
        except RuntimeError:
            peaks = {}
    return [{"method": t.name, "median_ms": t.median_ms, "ratio": t.ratio,
             "peak_mb": peaks.get(t.name),
             "peak_ratio": peaks[t.name] / peaks[REFERENCE] if t.name in peaks else None}
            for t in timings]
