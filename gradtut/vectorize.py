"""Vectorised maps, Jacobians and input gradients for large batches (notebook 02).

- :func:`vectorization_report` runs a function under ``tf.vectorized_map`` and says whether pfor
  fell back to a ``while_loop`` (TensorFlow only logs that), and for which ops.
- :func:`make_per_example_input_gradient` and :func:`make_batched_input_gradient` build one
  example's input gradient and the whole batch's; :func:`map_fn_timings` and
  :func:`threading_timings` measure ``tf.map_fn``'s ``parallel_iterations`` and TensorFlow's
  thread pools on them (thread-pool sizes are read once, when TensorFlow's runtime starts, so
  run :func:`threading_timings` in its own process with ``gradtut.session.run_in_subprocess``).
- :func:`input_gradients`, :func:`batch_jacobian` and :func:`integrated_gradients` compute
  per-example derivatives of a model's output with respect to its input, chunk by chunk, so
  TensorFlow's working memory stays at one chunk however many examples there are.

Why one backward pass gives every example's input gradient: example b's input ``x_b`` only
reaches output ``f(x)_b`` when examples do not interact, so ``d/dx_b sum_b' f(x)_b'`` is
``d f(x)_b / d x_b``. That fails for any op that mixes the batch: BatchNormalization in
*training* mode (batch statistics; these functions call the model with ``training=False``, so
it uses its moving statistics and is fine), or a custom layer that normalises, sorts, sums or
attends across axis 0 (a cumulative sum over the batch, say). Such models are detected on the
first two examples (example 0 alone must equal example 0 next to example 1, and changing either
example must leave the other's output unchanged) and refused with a ``ValueError``, unless
``batch_size=1``, which computes every example alone.

The chunked helpers (``input_gradients``, ``batch_jacobian``, ``integrated_gradients``)
return NumPy arrays, gathered on the host chunk by chunk; ``completeness_gap`` returns one too,
from two whole-batch calls of the model (not chunked). ``vectorization_report(...).result``
and the function ``make_batched_input_gradient`` builds return tensors.
"""
import inspect
import logging
import re
import weakref
from dataclasses import dataclass, field

import keras
import numpy as np
import tensorflow as tf

from gradtut.checks import check_int
from gradtut.measure import compare_timings

_cache = weakref.WeakKeyDictionary()  # model -> {key: tf.function}
_FALLBACK = re.compile(r"while_loop for converting (\w+)|(\w+) uses a while_loop")


# ------------------------------------------------------------------ vectorization_report


@dataclass
class VectorizationReport:
    """What ``tf.vectorized_map`` did with a function.

    Attributes:
      vectorized: True when pfor logged no ``while_loop`` fallback. A loop already in ``fn``
        (``tf.map_fn``, ``tf.while_loop``) stays a loop without a log line, and the wrong
        batched results of notebook 02's two exceptions leave none either.
      fallback_ops: op types pfor ran in a ``while_loop`` instead, in the order it said so.
      messages: the log lines TensorFlow emitted while converting that mention a
        ``while_loop`` (the fallbacks); its other lines are dropped.
      result: what ``tf.vectorized_map(fn, elems)`` returned.
    """

    vectorized: bool
    fallback_ops: list
    messages: list = field(repr=False)
    result: object = field(repr=False)

    def __post_init__(self):
        if not isinstance(self.fallback_ops, list) or not all(
                isinstance(op, str) for op in self.fallback_ops):
            raise ValueError(f"fallback_ops must be a list of op type names (str), got "
                             f"{self.fallback_ops!r}")
        if not isinstance(self.vectorized, bool):
            raise ValueError(f"vectorized must be a bool, got {self.vectorized!r}")
        if self.vectorized is not (not self.fallback_ops):
            raise ValueError(f"vectorized={self.vectorized!r} contradicts fallback_ops="
                             f"{self.fallback_ops!r}: vectorized is True exactly when no op fell "
                             "back to a while_loop (fallback_ops == [])")


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def vectorization_report(fn, elems):
    """Run ``fn`` over ``elems`` with ``tf.vectorized_map`` and report any ``while_loop`` fallback.

    pfor converts each op of ``fn`` into a batched op. Ops it has no rule for (or cannot batch
    with these inputs) run in a ``while_loop`` over the examples instead: correct, but as slow as
    a loop, and TensorFlow only mentions it in a log line that ``gradtut.setup`` hides (under
    ``tf.vectorized_map``, a warning for an op without a converter and for
    ``Conv2DBackpropFilter``'s converter, which loops by itself; a DEBUG line, hidden at
    TensorFlow's default level too, for the fallbacks other converters choose, such as one that
    needs an input to be the same for every example). This
    function traces ``fn`` afresh, captures those lines, and returns them.

    Args:
      fn: function of one element (a nest of tensors without the leading batch dimension).
      elems: a tensor or nest of tensors with a common leading dimension B (a tensor with a
        leading dimension of 1 is broadcast to B, as ``tf.vectorized_map`` does).

    Returns:
      :class:`VectorizationReport`.

    Raises:
      TypeError: ``fn`` is not callable.
      ValueError: ``elems`` is None, empty, a scalar (no leading axis to map over), or a nest
        whose tensors differ in their leading dimension (other than 1).

    Example:
      >>> report = vectorization_report(lambda v: tf.reduce_sum(v * v), tf.ones([4, 3]))
      >>> report.vectorized, report.fallback_ops
      (True, [])
    """
    _check_elems(fn, elems)
    logger = tf.get_logger()
    capture = _Capture()
    saved = logger.level, logger.handlers[:], logger.propagate
    logger.setLevel(logging.DEBUG)
    logger.handlers[:] = [capture]
    logger.propagate = False
    try:
        # A fresh tf.function, so pfor converts (and logs) again even for a function seen before.
        result = tf.function(lambda e: tf.vectorized_map(fn, e, warn=True))(elems)
    finally:
        logger.setLevel(saved[0])
        logger.handlers[:] = saved[1]
        logger.propagate = saved[2]
    messages = [m for m in capture.messages if "while_loop" in m]
    ops = [a or b for m in messages for a, b in _FALLBACK.findall(m)]
    return VectorizationReport(not ops, list(dict.fromkeys(ops)), messages, result)


def _check_elems(fn, elems):
    if not callable(fn):
        raise TypeError(f"fn must be a function of one element, got {type(fn).__name__}")
    leaves = tf.nest.flatten(elems)
    if elems is None or any(t is None for t in leaves):
        raise ValueError("elems is None (or holds None); pass the tensors to map over, with "
                         "the examples along axis 0")
    shapes = [tf.convert_to_tensor(t).shape for t in leaves]
    if not shapes or any(shape[0] == 0 for shape in shapes if shape.rank):
        raise ValueError("elems is empty: give at least one element to map over")
    if any(shape.rank == 0 for shape in shapes):
        raise ValueError("elems holds a scalar, which has no leading axis to map over; stack "
                         "the elements along axis 0 (tf.stack, or tf.reshape(x, [1]) for one)")
    sizes = {shape[0] for shape in shapes if shape.rank} - {None}
    if len(sizes - {1}) > 1:  # tf.vectorized_map broadcasts a leading dimension of 1
        raise ValueError(f"the tensors in elems have different leading dimensions "
                         f"{sorted(sizes)}; vectorized_map needs one element count B (or 1, "
                         "which it broadcasts)")


# ----------------------------------------------------------------- per-example input derivatives


def _check_eager(what):
    if tf.inside_function():
        raise ValueError(
            f"{what} runs eagerly: it gathers the result in NumPy chunk by chunk, so it cannot "
            "run inside a tf.function. Call it outside the tf.function, on concrete arrays.")


def _check_model(model):
    """A Keras model, or a callable ``model(x, training=False)``; anything else is refused."""
    if isinstance(model, keras.layers.Layer):
        inputs = getattr(model, "inputs", None) if isinstance(model, keras.Model) else None
        if inputs is not None and len(inputs) > 1:
            names = [getattr(t, "name", "?") for t in inputs]
            raise ValueError(
                f"model has {len(inputs)} inputs ({', '.join(names)}); these functions take a "
                "model with one input tensor x [N, ...]. To differentiate with respect to one "
                "input, wrap the model with the others fixed, e.g. lambda x, training=False: "
                "model([x, other], training=training); for several, use tf.GradientTape on "
                "each input")
        return
    if not callable(model):
        fix = ("wrap the layers in a model: keras.Sequential(layers)"
               if isinstance(model, (list, tuple)) else "pass a Keras model")
        raise TypeError(f"model must be a Keras model or a callable model(x, training=False), "
                        f"got {type(model).__name__}; {fix}")
    try:
        inspect.signature(model).bind(None, training=False)
    except TypeError:
        raise TypeError(
            f"model is called as model(x, training=False), but {model!r} does not take those "
            "arguments; wrap it, e.g. lambda x, training=False: f(x)") from None
    except ValueError:  # no signature to inspect (a builtin): let the call decide
        pass


def _checked_input(x):
    """``x`` as a NumPy array: a large batch stays on the host, and TensorFlow's allocator only
    ever sees one chunk of it."""
    if x is None:
        raise ValueError("x is None; pass the float inputs [N, ...] as an array or tensor")
    if isinstance(x, keras.KerasTensor):
        raise ValueError("x is a symbolic Keras tensor (from keras.Input); pass concrete inputs "
                         "[N, ...] as an array or tensor")
    x = x.numpy() if isinstance(x, (tf.Tensor, tf.Variable)) else np.asarray(x)
    if x.dtype == np.float64:
        x = x.astype(keras.backend.floatx())
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError("x must be floating point to differentiate with respect to it; "
                         f"got {x.dtype}")
    if x.ndim == 0 or x.shape[0] == 0:
        raise ValueError(f"x must be a non-empty batch [B, ...]; got shape {x.shape}")
    return x


def _target_rows(target, n, probe):
    """Validate ``target`` against the outputs ``probe`` of two examples.

    Returns ``(kind, rows)``: kind is "scalar", "index" or "callable"; rows is ``[n]`` int32
    class indices for kind "index", else None.
    """
    if target is None:
        if probe.shape.rank > 2 or (probe.shape.rank == 2 and probe.shape[1] != 1):
            raise ValueError(
                f"the model's output has shape {probe.shape[1:]} per example, not one scalar; "
                "pass target= a class index (int or [B] ints) or a callable outputs -> [B]")
        return "scalar", None
    if callable(target):
        chosen = target(probe)
        if chosen.shape.rank != 1:
            raise ValueError(f"target(outputs) must return a [B] vector; got shape {chosen.shape}")
        return "callable", None
    index = np.asarray(target)
    if not np.issubdtype(index.dtype, np.integer) or index.ndim > 1:
        raise ValueError("target must be None, an int class index, [B] ints or a callable; "
                         f"got {target!r}")
    if index.ndim == 1 and len(index) != n:
        raise ValueError(f"target has {len(index)} class indices for {n} examples")
    if probe.shape.rank != 2:
        raise ValueError(f"a class-index target needs [B, classes] outputs; got {probe.shape}")
    classes = probe.shape[1]
    if index.min() < 0 or index.max() >= classes:
        raise ValueError(f"target class indices must be in [0, {classes}); got "
                         f"{index.min()}..{index.max()}")
    return "index", np.broadcast_to(index, (n,)).astype(np.int32)


def _pick(outputs, kind, target, rows):
    """The ``[chunk]`` scalars to differentiate, one per example."""
    if kind == "scalar":
        return tf.reshape(outputs, [-1])
    if kind == "callable":
        return target(outputs)
    return tf.gather(outputs, rows, axis=1, batch_dims=1)


def _check_examples_independent(model, x):
    """Refuse models whose output for one example depends on the others in its batch: example
    0 alone must equal example 0 next to example 1, and moving either of the two must leave
    the other's output unchanged.

    Returns the model's outputs for the first two examples (used to validate the target).
    """
    together = model(x[:2], training=False)
    if x.shape[0] < 2:
        return together
    if _differs(together[:1], model(x[:1], training=False)):
        raise ValueError(
            "the model's output for one example depends on the other examples in the batch "
            "(example 0 alone differs from example 0 next to example 1), so a single backward pass "
            "cannot separate per-example input gradients. This happens with ops that mix the batch "
            "(batch statistics, sorting or attention across axis 0). Compute per example instead, "
            "with batch_size=1.")
    # A change to one example must not move the other's output (this catches a cumulative sum
    # over the batch, which leaves example 0 alone unchanged, even when example 0 is zeros).
    first_moved = model(np.concatenate([x[:1] + 1, x[1:2]]), training=False)
    second_moved = model(np.concatenate([x[:1], x[1:2] + 1]), training=False)
    if _differs(first_moved[1:], together[1:]) or _differs(second_moved[:1], together[:1]):
        raise ValueError(
            "the model mixes examples across the batch: changing example 0 of a batch changes "
            "the output for example 1, or the other way round (a cumulative sum, a scan or "
            "attention across axis 0), so a single backward pass cannot separate per-example "
            "input gradients. Compute per example instead, with batch_size=1, or fix the layer "
            "that reduces over axis 0.")
    return together


def _differs(in_batch, alone):
    """Whether one example's output computed in a batch differs from it computed alone."""
    difference = float(tf.reduce_max(tf.abs(in_batch - alone)))
    return difference > 1e-4 * (float(tf.reduce_max(tf.abs(alone))) + 1e-6)


def _cached(model, key, build):
    per_model = _cache.setdefault(model, {})
    if key not in per_model:
        per_model[key] = build()
    return per_model[key]


def _prepare(model, x, target, batch_size, what):
    """Shared argument checks: returns ``(x as NumPy, chunk size, kind, rows)``."""
    _check_eager(what)
    _check_model(model)
    x = _checked_input(x)
    n = x.shape[0]
    chunk = _check_batch_size(batch_size, n)
    # One example per chunk computes every example alone: examples cannot interact then.
    kind, rows = _target_rows(target, n, _probe(model, x, independent=chunk > 1))
    return x, chunk, kind, rows


def _check_batch_size(batch_size, n):
    """Examples per chunk: ``batch_size``, checked, or all ``n`` for None."""
    if batch_size is None:
        return n
    try:
        return check_int(batch_size, "batch_size")
    except ValueError as err:
        raise ValueError(f"{err}; or None for one chunk") from None


def _probe(model, x, independent=True):
    """Outputs for two examples, after checking (where ``independent``) they do not interact;
    cached per model, since mixing the batch is a property of the architecture (the check
    costs four forward passes of one or two examples)."""
    per_model = _cache.setdefault(model, {})
    if "probe" in per_model:
        return per_model["probe"]
    if not independent:
        return model(x[:2], training=False)
    probe = _check_examples_independent(model, x[:2])
    if len(x) >= 2:  # one example cannot show mixing: check again next time
        per_model["probe"] = probe
    return probe


def _over_chunks(fn, x, chunk, rows):
    """Run ``fn(x_chunk, rows_chunk)`` over chunks, filling one preallocated NumPy array."""
    result = None
    for start in range(0, len(x), chunk):
        stop = min(start + chunk, len(x))
        part = fn(tf.constant(x[start:stop]),
                  tf.constant(rows[start:stop] if rows is not None else np.zeros(0, np.int32)))
        part = part.numpy()
        if result is None:
            result = np.empty((len(x), *part.shape[1:]), part.dtype)
        result[start:stop] = part
    return result


def _target_key(kind, target):
    return (kind, target if kind == "callable" else None)


def input_gradients(model, x, target=None, batch_size=None):
    """Per-example gradient of the model's (target) output with respect to its input.

    One backward pass of the output summed over the batch gives every example's gradient at
    once, which is valid only when examples do not interact (see the module docstring; models
    that mix the batch are detected and refused). The model runs with ``training=False``.

    Args:
      model: a Keras model (or any callable ``model(x, training=False)``) with one input tensor.
      x: float inputs ``[N, ...]`` (array or tensor).
      target: what to differentiate per example: None when the model returns one scalar per
        example (``[N]`` or ``[N, 1]``); an int class index, or ``[N]`` ints, to pick column(s)
        of ``[N, classes]`` outputs; or a callable ``outputs -> [N]`` for anything else.
      batch_size: examples per chunk, or None for one chunk. TensorFlow's working memory is
        that of one chunk; the result is gathered in a NumPy array on the host. With 1, every
        example is computed alone, so a model that mixes the batch is accepted.

    Returns:
      ``np.ndarray`` shaped like ``x``: row b is ``d target_b / d x_b``.

    Raises:
      ValueError: empty, None or non-float ``x``; ``batch_size`` not a positive int or None; a
        target that does not fit the outputs (out-of-range class, wrong length, a non-scalar
        output with no target); a model whose examples interact (unless ``batch_size=1``); a
        call inside a ``tf.function`` (these functions run eagerly, chunk by chunk).
      TypeError: ``model`` is neither a Keras model nor a callable ``model(x, training=False)``
        (a list of layers: wrap it in ``keras.Sequential``).

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer=
      ...     keras.initializers.Constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))])
      >>> grads = input_gradients(model, np.ones((4, 3), "float32"), target=1, batch_size=2)
      >>> grads.shape, grads[0].tolist()  # d out[b, 1] / d x[b]: the kernel's column 1
      ((4, 3), [2.0, 4.0, 6.0])
    """
    x, chunk, kind, rows = _prepare(model, x, target, batch_size, "input_gradients")

    def build():
        @tf.function(reduce_retracing=True)
        def gradients(xc, rows_c):
            with tf.GradientTape() as tape:
                tape.watch(xc)
                total = tf.reduce_sum(_pick(model(xc, training=False), kind, target, rows_c))
            return tape.gradient(total, xc)

        return gradients

    fn = _cached(model, ("input_gradients",) + _target_key(kind, target), build)
    return _over_chunks(fn, x, chunk, rows)


def batch_jacobian(model, x, batch_size=None, use_pfor=True):
    """Per-example Jacobian of the model's output with respect to its input.

    Uses ``tape.batch_jacobian``, which relies on the same independence of examples as
    :func:`input_gradients` (checked the same way).

    Args:
      model: a Keras model with one input tensor, run with ``training=False``.
      x: float inputs ``[N, *in_shape]``.
      batch_size: examples per chunk, or None for one chunk.
      use_pfor: vectorise the backward passes with pfor (``experimental_use_pfor``); False runs
        one backward pass per output unit in a ``while_loop`` (slower, less memory).

    Returns:
      ``np.ndarray`` ``[N, *out_shape, *in_shape]``; entry ``[b, i..., j...]`` is
      ``d out[b, i...] / d x[b, j...]``. Its size is N x out x in floats: mind the memory.

    Raises:
      ValueError, TypeError: as :func:`input_gradients` (empty or non-float x, bad batch_size,
        a model whose examples interact, not a model).

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer=
      ...     keras.initializers.Constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))])
      >>> jac = batch_jacobian(model, np.ones((4, 3), "float32"), batch_size=2)
      >>> jac.shape, jac[0].tolist()  # the kernel, transposed, for every example
      ((4, 2, 3), [[1.0, 3.0, 5.0], [2.0, 4.0, 6.0]])
    """
    x, chunk, _, _ = _prepare(model, x, lambda out: tf.zeros(tf.shape(out)[:1]), batch_size,
                              "batch_jacobian")

    def build():
        @tf.function(reduce_retracing=True)
        def jacobian(xc, rows_c):  # pylint: disable=unused-argument
            with tf.GradientTape() as tape:
                tape.watch(xc)
                out = model(xc, training=False)
            return tape.batch_jacobian(out, xc, experimental_use_pfor=use_pfor)

        return jacobian

    fn = _cached(model, ("batch_jacobian", bool(use_pfor)), build)
    return _over_chunks(fn, x, chunk, None)


def integrated_gradients(model, x, baseline=None, target=None, steps=64, batch_size=None):
    """Integrated gradients (Sundararajan et al., 2017): attribution of each input feature.

    ``(x - baseline) * mean over a in [0, 1] of grad f(baseline + a (x - baseline))``, with the
    path integral approximated by the trapezoidal rule on ``steps`` intervals. Completeness:
    the attributions of an example add up to ``f(x) - f(baseline)``; the error tends to shrink
    as ``steps`` grows, not monotonically for ReLU models (below 2% of
    ``|f(x) - f(baseline)|``, plus 1e-3, at 64 steps for the smooth and ReLU models in the
    tests, which assert it; check it on yours with :func:`completeness_gap`).

    Args:
      model, target: as in :func:`input_gradients`.
      x: float inputs ``[N, ...]``.
      baseline: ``[N, ...]`` or one example ``[...]`` to start the path from; None means zeros.
      steps: number of intervals on the path (>= 1); the model runs on ``steps + 1`` points.
      batch_size: how many path points (examples x (steps + 1)) per chunk, or None for all at
        once.

    Returns:
      ``np.ndarray`` shaped like ``x``.

    Raises:
      ValueError: ``steps`` not a positive int, a baseline whose shape does not fit ``x``, and
        as :func:`input_gradients`.
      TypeError: as :func:`input_gradients`.

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer=
      ...     keras.initializers.Constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))])
      >>> integrated_gradients(model, np.ones((2, 3), "float32"), target=1, steps=4).tolist()
      [[2.0, 4.0, 6.0], [2.0, 4.0, 6.0]]
    """
    steps = check_int(steps, "steps")
    _check_eager("integrated_gradients")
    _check_model(model)
    x = _checked_input(x)
    baseline = np.zeros_like(x) if baseline is None else np.asarray(baseline, x.dtype)
    if baseline.shape == x.shape[1:]:
        baseline = np.broadcast_to(baseline, x.shape)
    if baseline.shape != x.shape:
        raise ValueError(f"baseline shape {baseline.shape} fits neither x {x.shape} nor one "
                         f"example {x.shape[1:]}")
    alphas = np.linspace(0.0, 1.0, steps + 1, dtype=x.dtype)
    # Path points, example-major: [N * (steps + 1), ...].
    alphas = alphas.reshape(1, -1, *([1] * (x.ndim - 1)))
    path = (baseline[:, None] + alphas * (x - baseline)[:, None]).reshape(-1, *x.shape[1:])
    if target is not None and not callable(target):
        target = np.repeat(np.broadcast_to(np.asarray(target), (len(x),)), steps + 1)
    grads = input_gradients(model, path, target=target, batch_size=batch_size)
    grads = grads.reshape(len(x), steps + 1, *x.shape[1:])
    weights = np.full(steps + 1, 1.0 / steps, x.dtype)
    weights[[0, -1]] /= 2  # trapezoidal rule
    average = np.tensordot(weights, np.moveaxis(grads, 1, 0), axes=1)
    return (x - baseline) * average


def completeness_gap(model, x, attributions, baseline=None, target=None):
    """``sum(attributions_b) - (f(x_b) - f(baseline_b))`` per example: 0 for exact attributions.

    Args:
      model, x, baseline, target: as given to :func:`integrated_gradients`.
      attributions: its result, shaped like ``x``.

    Returns:
      ``np.ndarray`` ``[N]``.

    Raises:
      ValueError: ``attributions`` None or not shaped like ``x``, and as
        :func:`input_gradients` (the model is checked for examples that interact).
      TypeError: as :func:`input_gradients`.

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer=
      ...     keras.initializers.Constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))])
      >>> x = np.ones((2, 3), "float32")
      >>> attributions = integrated_gradients(model, x, target=1, steps=4)
      >>> completeness_gap(model, x, attributions, target=1).tolist()  # exact for a linear model
      [0.0, 0.0]
    """
    _check_eager("completeness_gap")
    _check_model(model)
    x = _checked_input(x)
    if attributions is None:
        raise ValueError("attributions is None; pass the result of integrated_gradients")
    attributions = np.asarray(attributions)
    if attributions.shape != x.shape:
        raise ValueError(f"attributions shape {attributions.shape} != x shape {x.shape}")
    baseline = np.zeros_like(x) if baseline is None else np.broadcast_to(
        np.asarray(baseline, x.dtype), x.shape)
    kind, rows = _target_rows(target, len(x), _probe(model, x))

    def value(inputs):
        return _pick(model(inputs, training=False), kind, target, rows).numpy()

    sums = attributions.reshape(len(x), -1).sum(axis=1, dtype=np.float64)
    return sums - (value(x).astype(np.float64) - value(baseline).astype(np.float64))


# ------------------------------------------------- map_fn against one batched pass, measured


def make_per_example_input_gradient(model):
    """``f(x_i) -> d sum(model(x_i)) / d x_i`` for one example without its batch dimension.

    ``model`` is a Keras model with one input, or a callable ``model(x, training=False)``, as
    for :func:`input_gradients`.

    Raises:
      TypeError: ``model`` is neither (a list of layers, a function of ``x`` alone).
      ValueError: a Keras model with several inputs.
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
      TypeError, ValueError: as :func:`make_per_example_input_gradient`.
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

    Returns a list of ``Timing`` (``.name`` the label, ``.median_ms``, ``.ratio``) in this
    order: eager (if asked), each ``parallel_iterations`` in a ``tf.function``, then
    ``"vectorized_map"`` and ``"one batched pass"``, all timed in the same interleaved rounds;
    ratios are against the eager map_fn (or the first graph variant).

    Raises:
      TypeError: as :func:`make_per_example_input_gradient`.
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
    ``run_in_subprocess``); None keeps TensorFlow's default (0: TensorFlow picks, one thread per
    logical CPU).

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
