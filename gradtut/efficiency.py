"""Efficiency tricks for gradient computation, each with its reference (notebook 05).

- :func:`accumulated_gradients` and :func:`make_accumulating_train_step`: gradient accumulation
  with the arithmetic right (the mean over every example, ragged micro-batches included);
- :func:`peak_memory`: the allocator's peak for one call, in a fresh process when needed;
- :func:`checkpointed`: gradient checkpointing with ``tf.recompute_grad`` over segments;
- :func:`hvp` and :func:`hessian`: Hessian-vector products (forward-over-reverse and
  reverse-over-reverse) and the explicit Hessian they are checked against;
- :func:`compare_compilation`: eager, ``tf.function`` and XLA timed in one run.
"""
import collections.abc
import itertools
import os
import pickle
import sys
import tempfile

import keras
import numpy as np
import tensorflow as tf

from gradtut import data_parallel
from gradtut.checks import check_int, check_keras_model, check_loss_fn, check_real, checked_batch
from gradtut.data_parallel import regularization_gradients
from gradtut.data_parallel.steps import _refuse_call_losses
from gradtut.measure import compare_timings, peak_memory_bytes, time_callable
from gradtut.models import make_batch_gradient, mlp
from gradtut.per_example import per_example_gradients, per_example_losses
from gradtut.session import allocator_has_stats, allocator_statistics, run_in_subprocess

# --- gradient accumulation -----------------------------------------------------------------

def _summed_gradient_fn(model, loss_fn):
    """A compiled ``(x, y) -> gradients of the summed per-example losses``, one per
    (model, loss)."""
    cache = model.__dict__.setdefault("_gradtut_summed_gradient", {})
    if id(loss_fn) not in cache:
        @tf.function(reduce_retracing=True)
        def summed_gradient(x, y):
            with tf.GradientTape() as tape:
                total = tf.reduce_sum(per_example_losses(model, loss_fn, x, y, training=False))
            _refuse_call_losses(model, "accumulated_gradients")
            return tape.gradient(total, model.trainable_variables, unconnected_gradients="zero")
        cache[id(loss_fn)] = (loss_fn, summed_gradient)
    return cache[id(loss_fn)][1]


def accumulated_gradients(model, loss_fn, x, y, micro_batch_size):
    """The full-batch mean gradient, computed ``micro_batch_size`` examples at a time.

    Each micro-batch contributes the gradient of its *summed* per-example losses, and the total
    is divided once by the number of examples. A short last micro-batch is therefore weighted by
    its size, not as a full one (averaging micro-batch means would over-weight it). The model's
    weight regularisation losses are added once; losses its forward pass records (activity
    regularisers, ``add_loss``) are refused, as each is computed from one micro-batch (Keras
    divides an activity regulariser by its size). Only one micro-batch's activations are alive
    at a time, which is the point: the activations' memory
    follows ``micro_batch_size``, not the batch (the gradients and their running sum do not
    shrink: two copies of the weights, three while a micro-batch's gradients are computed next
    to the last one's).

    Args:
      model: a Keras model (called with ``training=False``).
      loss_fn: ``loss_fn(y_true, y_pred) -> [B]`` per-example losses (Keras losses with
        ``reduction=None``). A loss that reduces over the batch (the Keras default mean, or a
        sum) is refused: a mean arrives already divided by its micro-batch's size, so summing
        means would depend on the micro-batch size, and the function needs the ``[B]``
        losses to sum them and divide once itself.
      x, y: the whole batch, ``[batch, ...]`` (or nests of such tensors).
      micro_batch_size: examples per micro-batch, from 1 to the batch size.

    Returns:
      list of gradients lined up with ``model.trainable_variables``: equal, within float32
      round-off, to the gradient of the mean loss over the whole batch in one pass.

    Raises:
      ValueError: ``loss_fn`` does not return ``[B]`` (build it with ``reduction=None``) or is
        a loss name; x or y is None, empty, or of different lengths; ``micro_batch_size`` not
        an int from 1 to the batch size; the model records losses in its forward pass.
      TypeError: ``model`` is not a Keras model, or ``loss_fn`` cannot be called.

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
      >>> x, y = np.random.default_rng(0).normal(size=(10, 3)), np.arange(10) % 2
      >>> with tf.GradientTape() as tape:
      ...     mean = tf.reduce_mean(loss(y, model(x)))
      >>> one_pass = tape.gradient(mean, model.trainable_variables)
      >>> in_fours = accumulated_gradients(model, loss, x, y, micro_batch_size=4)  # 4 + 4 + 2
      >>> all(np.allclose(a, b, atol=1e-6) for a, b in zip(in_fours, one_pass))
      True
    """
    check_keras_model(model)
    check_loss_fn(loss_fn)
    x, y, batch = checked_batch(x, y)
    micro_batch_size = check_int(micro_batch_size, "micro_batch_size", maximum=batch,
                                 what_maximum="the batch size")
    gradient_of_sum = _summed_gradient_fn(model, loss_fn)
    sums = None
    for start in range(0, batch, micro_batch_size):
        part = slice(start, start + micro_batch_size)
        grads = gradient_of_sum(tf.nest.map_structure(lambda t, p=part: t[p], x),
                                tf.nest.map_structure(lambda t, p=part: t[p], y))
        sums = list(grads) if sums is None else [s + g for s, g in zip(sums, grads, strict=True)]
    regularization = regularization_gradients(model)
    return [s / batch + (0.0 if r is None else r)
            for s, r in zip(sums, regularization, strict=True)]


def make_accumulating_train_step(model, loss_fn, optimizer, accumulation_steps):
    """A training step on one device that updates once every ``accumulation_steps`` micro-batches.

    Each call adds the micro-batch's summed-loss gradient to accumulators and counts its
    examples. On every ``accumulation_steps``-th call it applies the sum divided by the number
    of examples seen (plus the weight regularisation gradient, once), then zeroes the
    accumulators and the count. The update equals one optimizer step on the concatenated
    micro-batches, ragged ones included.

    It is :func:`gradtut.data_parallel.make_accumulating_train_step` under the current
    ``tf.distribute`` strategy (the default, one-device one outside any ``strategy.scope()``),
    taking ``(x, y)`` instead of a distributed batch: the accumulation logic lives there, once.

    Args:
      model, loss_fn: as :func:`accumulated_gradients` (the model is called with
        ``training=True``).
      optimizer: a Keras optimizer (built here on the model's trainable variables).
      accumulation_steps: micro-batches per update (positive int).

    Returns:
      ``step(x, y) -> (loss, applied)``: the micro-batch's mean loss (a tensor) and whether
      this call applied an update (a Python bool). ``step.accumulators`` and
      ``step.examples_seen`` are the state, for inspection.

    Raises:
      ValueError: ``accumulation_steps`` is not a positive int, ``loss_fn`` is a loss name; at
        the first call, a ``loss_fn`` that does not return ``[B]`` (build it with
        ``reduction=None``) or a model whose forward pass records losses (activity
        regularisers, ``add_loss``); at any call, x or y None, empty or of different lengths.
      TypeError: ``model`` or ``optimizer`` is not one, or ``loss_fn`` cannot be called.

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
      >>> step = make_accumulating_train_step(model, loss, keras.optimizers.SGD(0.1), 3)
      >>> x, y = np.ones((4, 3), "float32"), np.array([0, 1, 1, 0])
      >>> [step(x, y)[1] for _ in range(6)]
      [False, False, True, False, False, True]
    """
    strategy = tf.distribute.get_strategy()
    accumulate = data_parallel.make_accumulating_train_step(
        strategy, model, loss_fn, optimizer, accumulation_steps=accumulation_steps,
        global_batch_size=strategy.num_replicas_in_sync)  # checked only: the step counts examples

    def step(x, y):
        x, y, _ = checked_batch(x, y)
        return accumulate((x, y))

    step.accumulators, step.examples_seen = accumulate.accumulators, accumulate.examples_seen
    return step


# --- peak memory ---------------------------------------------------------------------------

def _peak_in_fresh_process(path):
    """Run in the fresh process (with the BFC allocator): unpickle ``(fn, args)`` from
    ``path``, warm up once, and return the peak bytes of one more call."""
    import gradtut
    gradtut.setup(bfc_allocator=True)
    with open(path, "rb") as f:
        fn, args = pickle.load(f)
    fn(*args)  # warm-up: tracing, one-off buffers
    return peak_memory_bytes(fn, *args)


def peak_memory(fn, *args, fresh_process=None, timeout_s=600):
    """Peak bytes the TensorFlow CPU allocator held above its starting level during one
    ``fn(*args)`` call.

    Statistics of every block need the BFC allocator, which must be chosen before TensorFlow
    starts (``TF_CPU_ALLOCATOR_USE_BFC=true``; ``gradtut.setup()`` does it); TensorFlow's
    default CPU allocator counts none (oneDNN off) or only blocks of 256 kB and more (oneDNN
    on; notebook 05, section 9). In a process without them, or with ``fresh_process=True``,
    the call runs in a new Python process that has them, after one warm-up call there; the
    child is killed if it outlives ``timeout_s``.

    Args:
      fn: the callable. For a fresh process it must be importable (a module-level function,
        not a lambda) and ``args`` must pickle.
      fresh_process: None (only when needed), True or False.
      timeout_s: limit for the fresh process.

    Returns:
      int bytes.

    Raises:
      ValueError: ``fn`` cannot be sent to a fresh process (with the fix).
      RuntimeError: the fresh process failed or timed out (with its stderr), or
        ``fresh_process=False`` in a process whose allocator does not count every block.

    Example:
      >>> peak_memory(tf.zeros, [1024, 1024])  # doctest: +SKIP
      4194304
    """
    has_stats = allocator_has_stats()
    if fresh_process is None:
        fresh_process = not has_stats
    if not fresh_process:
        if not has_stats:
            raise RuntimeError("this process's CPU allocator does not count every block: start "
                               "it with gradtut.setup() (BFC allocator), or pass "
                               "fresh_process=True")
        return peak_memory_bytes(fn, *args)
    if getattr(fn, "__module__", None) == "__main__":
        raise ValueError(f"{fn.__name__!r} is defined in __main__ (a notebook or script), which a "
                         "fresh process cannot import: move it into a module")
    try:
        payload = pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise ValueError(f"{getattr(fn, '__name__', fn)!r} cannot run in a fresh process ({err}):"
                         " pass a module-level function and picklable arguments") from None
    with tempfile.NamedTemporaryFile(suffix=".pkl") as f:
        f.write(payload)
        f.flush()
        env = {"TF_CPU_ALLOCATOR_USE_BFC": "true",
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # import what we can
        return run_in_subprocess("gradtut.efficiency", "_peak_in_fresh_process",
                                 {"path": f.name}, env=env, timeout_s=timeout_s)


# --- gradient checkpointing ----------------------------------------------------------------

def _segments(layers, num_segments):
    cuts = np.linspace(0, len(layers), num_segments + 1).round().astype(int)
    return [layers[a:b] for a, b in itertools.pairwise(cuts)]


def checkpointed(layers, num_segments):
    """``f(x)``: the layers applied in order, with ``tf.recompute_grad`` over each of
    ``num_segments`` consecutive, near-equal segments.

    The forward pass keeps only each segment's input; the backward pass recomputes a segment's
    activations when it needs them. With n equal layers, about sqrt(n) segments keep the fewest
    activations in theory (sqrt(n) boundaries plus one segment's worth), for one extra forward
    pass; real layers differ in size, so measure (notebook 05, section 6, does). The
    saving shows inside a ``tf.function``; eager mode keeps what it keeps.

    Args:
      layers: Keras layers applied in order (a ``keras.Sequential``'s ``layers``). Unbuilt
        layers are built by the first call, which runs without checkpointing.
      num_segments: from 1 to ``len(layers)``.

    Returns:
      callable ``f(x)``; ``f.segments`` lists the layers of each segment.

    Raises:
      ValueError: no layers, or ``num_segments`` not an int from 1 to the number of layers.
      TypeError: ``layers`` is a model (pass ``model.layers``) or holds something that is not
        a Keras layer.

    Example:
      >>> model = keras.Sequential([keras.Input((3,))]
      ...                          + [keras.layers.Dense(3, activation="tanh") for _ in range(4)])
      >>> f = checkpointed(model.layers, num_segments=2)
      >>> [len(segment) for segment in f.segments]
      [2, 2]
      >>> x = np.ones((2, 3), "float32")
      >>> with tf.GradientTape() as tape:
      ...     loss = tf.reduce_sum(f(x))
      >>> with tf.GradientTape() as plain_tape:
      ...     plain = tf.reduce_sum(model(x))
      >>> all(np.allclose(a, b) for a, b in zip(tape.gradient(loss, model.trainable_variables),
      ...     plain_tape.gradient(plain, model.trainable_variables)))
      True
    """
    if isinstance(layers, keras.layers.Layer):
        raise TypeError(f"layers must be a list of Keras layers, got the {type(layers).__name__} "
                        f"{layers.name!r}; pass its layers: checkpointed(model.layers, ...)")
    if not isinstance(layers, collections.abc.Iterable):
        raise TypeError(f"layers must be a list of Keras layers, got {type(layers).__name__}; "
                        "pass e.g. model.layers")
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty: nothing to checkpoint")
    for i, layer in enumerate(layers):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(f"layers[{i}] is {type(layer).__name__}, not a Keras layer; pass "
                            "Keras layers, e.g. model.layers")
    segments = _segments(layers, check_int(num_segments, "num_segments", maximum=len(layers),
                                           what_maximum="the number of layers"))

    def segment_fn(segment):
        def run(x):
            for layer in segment:
                x = layer(x)
            return x
        return run

    plain = [segment_fn(s) for s in segments]
    recomputed = [tf.recompute_grad(fn) for fn in plain]

    def f(x):
        # Variables cannot be created inside recompute_grad: build with a plain first pass.
        fns = recomputed if all(layer.built for layer in layers) else plain
        for fn in fns:
            x = fn(x)
        return x

    f.segments = segments
    return f


# --- second order --------------------------------------------------------------------------

HVP_METHODS = ("forward_over_reverse", "reverse_over_reverse")


def _tf_variables(variables):
    """The ``tf.Variable`` behind each of ``variables``, after checking there is at least one.
    (``tf.autodiff.ForwardAccumulator`` rejects Keras 3 variables, whose dtype is a string:
    tensorflow/tensorflow#79523.)"""
    if isinstance(variables, (tf.Variable, keras.Variable)) or not isinstance(
            variables, collections.abc.Iterable):
        raise TypeError(f"variables must be a list of variables, got {type(variables).__name__}; "
                        "pass e.g. model.trainable_variables (or [w] for one)")
    variables = list(variables)
    if not variables:
        raise ValueError("variables is empty: pass the variables the loss reads, e.g. "
                         "model.trainable_variables (an unbuilt model has none yet: call it on "
                         "a batch first)")
    for i, v in enumerate(variables):
        if not isinstance(v, (tf.Variable, keras.Variable)):
            raise TypeError(f"variables[{i}] is {type(v).__name__}, not a variable; pass "
                            "tf.Variable or Keras variables, e.g. model.trainable_variables")
    return [v.value if isinstance(v, keras.Variable) else v for v in variables]


def _scalar_loss(loss_fn):
    """``loss_fn()``, after checking it is a callable that returns one number."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a zero-argument callable returning a scalar loss, got "
                        f"{loss_fn!r}; pass e.g. lambda: loss(y, model(x)) with a mean loss")
    loss = tf.convert_to_tensor(loss_fn())
    if loss.shape.rank != 0:
        raise ValueError(f"loss_fn must return a scalar; it returned shape {loss.shape}: reduce "
                         "it first (e.g. tf.reduce_mean), or build a Keras loss with its default "
                         "mean reduction")
    return loss


def _check_vector(variables, vector):
    variables = _tf_variables(variables)
    if not isinstance(vector, collections.abc.Iterable) or isinstance(vector, (tf.Tensor,
                                                                              np.ndarray)):
        raise TypeError(f"vector must be a list of tensors, one per variable, got "
                        f"{type(vector).__name__}")
    vector = list(vector)
    if len(vector) != len(variables):
        raise ValueError(f"vector has {len(vector)} parts but there are {len(variables)} "
                         "variables: pass one tensor per variable, in the same order")
    out = []
    for i, (v, u) in enumerate(zip(variables, vector, strict=True)):
        u = tf.convert_to_tensor(u, dtype=v.dtype)
        if u.shape != v.shape:
            raise ValueError(f"vector[{i}] has shape {u.shape} but variable {i} has shape "
                             f"{v.shape}: each part must match its variable")
        out.append(u)
    return variables, out


def hvp(loss_fn, variables, vector, method="forward_over_reverse"):
    """Hessian-vector product ``H v`` of a scalar loss, without forming ``H``.

    - ``"forward_over_reverse"``: a ``tf.autodiff.ForwardAccumulator`` pushes ``v`` through the
      gradient computation (one forward-mode pass over one backward pass);
    - ``"reverse_over_reverse"``: the gradient of ``<grad L, v>`` with a second tape.

    Both cost a small constant times one gradient; the explicit Hessian costs P of them (about
    2P gradients).

    Args:
      loss_fn: zero-argument callable returning a scalar (it reads ``variables``).
      variables: list of variables (at least one).
      vector: list of tensors lined up with ``variables`` (same shapes).
      method: one of :data:`HVP_METHODS`.

    Returns:
      list of tensors lined up with ``variables``.

    Raises:
      ValueError: unknown method, no variables, ``vector`` not lined up with ``variables``, or
        a loss that is not a scalar.
      TypeError: ``loss_fn`` cannot be called, or ``variables`` is not a list of variables.

    Example (``0.5 w^T A w`` has Hessian ``A``, so ``H [1, 0]`` is A's first column):
      >>> w = tf.Variable([1.0, -2.0])
      >>> a = tf.constant([[3.0, 1.0], [1.0, 2.0]])
      >>> hv = hvp(lambda: 0.5 * tf.tensordot(w, tf.linalg.matvec(a, w), 1), [w], [[1.0, 0.0]])
      >>> hv[0].numpy().tolist()
      [3.0, 1.0]
    """
    if method not in HVP_METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {HVP_METHODS}")
    variables, vector = _check_vector(variables, vector)
    if method == "forward_over_reverse":
        with tf.autodiff.ForwardAccumulator(variables, vector) as accumulator:
            with tf.GradientTape() as tape:
                loss = _scalar_loss(loss_fn)
            grads = tape.gradient(loss, variables, unconnected_gradients="zero")
        return [accumulator.jvp(g, unconnected_gradients="zero") for g in grads]
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            loss = _scalar_loss(loss_fn)
        grads = inner.gradient(loss, variables, unconnected_gradients="zero")
        dot = tf.add_n([tf.reduce_sum(g * u) for g, u in zip(grads, vector, strict=True)])
    return outer.gradient(dot, variables, unconnected_gradients="zero")


def hessian(loss_fn, variables):
    """The explicit Hessian of a scalar loss over all ``variables``, flattened and
    concatenated: a ``[P, P]`` tensor for P parameters. The slow reference for :func:`hvp`;
    only for small models (it costs P Hessian-vector products, about 2P gradients, and P^2 floats).
    It takes the same tape-over-tape route as ``"reverse_over_reverse"``, so notebook 05 also
    checks it against central differences of a float64 gradient, which use no second order.

    Raises:
      ValueError: no variables, or a loss that is not a scalar.
      TypeError: ``loss_fn`` cannot be called, or ``variables`` is not a list of variables.

    Example:
      >>> w = tf.Variable([1.0, -2.0])
      >>> a = tf.constant([[3.0, 1.0], [1.0, 2.0]])
      >>> hessian(lambda: 0.5 * tf.tensordot(w, tf.linalg.matvec(a, w), 1), [w]).numpy().tolist()
      [[3.0, 1.0], [1.0, 2.0]]
    """
    variables = _tf_variables(variables)
    with tf.GradientTape(persistent=True) as outer:
        with tf.GradientTape() as inner:
            loss = _scalar_loss(loss_fn)
        grads = inner.gradient(loss, variables, unconnected_gradients="zero")
        flat = tf.concat([tf.reshape(g, [-1]) for g in grads], axis=0)
    rows = outer.jacobian(flat, variables, unconnected_gradients="zero")
    del outer
    return tf.concat([tf.reshape(r, [flat.shape[0], -1]) for r in rows], axis=1)


# --- compilation ---------------------------------------------------------------------------

def _traced_call(function, name, args):
    """``function(*args)`` for a ``tf.function``; a clear error where ``fn`` cannot be traced
    (it calls ``.numpy()``, converts a tensor to a Python value, or uses NumPy on one)."""
    try:
        return function(*args)
    except (AttributeError, NotImplementedError, TypeError,
            tf.errors.OperatorNotAllowedInGraphError) as err:
        reason = str(err).strip().splitlines()[-1].strip()  # AutoGraph prefixes a traceback
        raise ValueError(
            f"fn cannot be traced by tf.function (needed for the {name} version): {reason}. Inside "
            "fn use TensorFlow ops only: no .numpy(), no float()/int()/bool() or np.* on a "
            "tensor, no Python if on a tensor's value (use tf.cond or tf.where)") from err


def compare_compilation(fn, *args, repeats=7, rtol=1e-2, atol=1e-6):
    """Time ``fn(*args)`` eagerly, as a ``tf.function`` and with ``jit_compile=True`` (XLA),
    interleaved in one run, after checking the three give the same result.

    Args:
      fn: a function of tensors (it must be traceable by ``tf.function``).
      repeats: timed calls of each (a positive int; after one checked call of each, which
        traces and compiles, and two untimed warm-up calls).
      rtol, atol: tolerance of the result check (real numbers >= 0): every output of a compiled
        version must be within ``rtol`` times the largest magnitude among all eager outputs,
        plus ``atol``. Fused kernels round differently, and backprop through many layers
        amplifies it: measured on a 16-layer ReLU MLP, XLA's gradients differ from eager by up
        to 3% of a small gradient's own size, and by 2e-5 of the largest value. The check is
        there to catch real disagreements (a Python side effect baked in at tracing, a wrong
        shape), not rounding; an output whose values are all far below the largest one is
        barely checked.

    Returns:
      dict ``{"eager" | "tf.function" | "xla": {"median_ms": float, "ratio": float}}``, where
      ``ratio`` is the median time over the eager median (below 1 means faster).

    Raises:
      AssertionError: the compiled versions disagree with eager beyond the tolerance, in an
        output's shape, or in the number of outputs.
      TypeError: ``fn`` cannot be called.
      ValueError: ``fn`` cannot be traced (it calls ``.numpy()``, or converts a tensor to a
        Python or NumPy value).
      ValueError: ``repeats`` is not a positive int, or a tolerance is not a real number >= 0.

    Example:
      >>> result = compare_compilation(lambda x: tf.reduce_sum(tf.tanh(x) ** 2), tf.ones((8, 8)),
      ...                              repeats=1)
      >>> sorted(result), result["eager"]["ratio"]
      (['eager', 'tf.function', 'xla'], 1.0)
      >>> # a timing, different on every run, so not checked as a doctest:
      >>> result["xla"]["ratio"]  # doctest: +SKIP
      0.31
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable of tensors, got {fn!r}")
    repeats = check_int(repeats, "repeats")
    for value, name in ((rtol, "rtol"), (atol, "atol")):
        if check_real(value, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    versions = {"eager": fn, "tf.function": tf.function(fn),
                "xla": tf.function(fn, jit_compile=True)}
    expected = [np.asarray(t) for t in tf.nest.flatten(fn(*args))]
    scale = max(float(np.max(np.abs(b), initial=0.0)) for b in expected)
    for name in ("tf.function", "xla"):
        got = [np.asarray(t) for t in tf.nest.flatten(_traced_call(versions[name], name, args))]
        if len(got) != len(expected):
            raise AssertionError(f"{name} disagrees with eager: it returns {len(got)} outputs "
                                 f"against {len(expected)}")
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            if a.shape != b.shape:
                raise AssertionError(f"{name} disagrees with eager in output {i}: shape "
                                     f"{a.shape} against {b.shape}")
            error = float(np.max(np.abs(a - b), initial=0.0))
            if error > rtol * scale + atol:
                raise AssertionError(f"{name} disagrees with eager in output {i}: max difference "
                                     f"{error:.3g} against a largest value of {scale:.3g}")
    timings = compare_timings({name: (lambda f=f: f(*args)) for name, f in versions.items()},
                              reference="eager", warmup=2, repeats=repeats)
    return {t.name: {"median_ms": t.median_ms, "ratio": t.ratio} for t in timings}


# --- the CPU allocator ---------------------------------------------------------------------

def large_intermediate_ms(size=2048, repeats=9):
    """Median ms of a compiled step that creates ``size x size`` float32 intermediates, and
    which blocks this process's allocator counts in its statistics
    (:func:`gradtut.session.allocator_statistics`). Meant to run in a fresh process (via
    ``gradtut.session.run_in_subprocess``) with ``TF_CPU_ALLOCATOR_USE_BFC`` set either way,
    since the allocator is chosen when TensorFlow starts.

    Raises:
      ValueError: ``size`` or ``repeats`` is not a positive int.

    Example:
      >>> sorted(large_intermediate_ms(size=16, repeats=1))
      ['allocator_stats', 'median_ms']
    """
    size, repeats = check_int(size, "size"), check_int(repeats, "repeats")
    x = tf.random.stateless_normal((size, size), seed=(1, 2))

    @tf.function
    def step(x):
        return tf.reduce_sum(tf.nn.relu(tf.matmul(x, x)) * 2.0 + x)

    timing = time_callable(step, x, repeats=repeats)
    return {"median_ms": 1e3 * timing.median_s, "allocator_stats": allocator_statistics()}


def allocator_workloads(size=2048, batch_size=256, repeats=7):
    """Both allocator workloads of notebook 05, section 9, timed in this process: the compiled
    step of :func:`large_intermediate_ms`, and per-example gradients materialised with
    ``method="outer"`` on the 784-256-10 MLP of :func:`gradtut.models.mlp` (fresh
    per-example gradients every call, ``batch_size x 203,530`` float32 numbers in all, almost
    all of them one ``[batch_size, 784, 256]`` kernel gradient), as a ratio to that MLP's batch
    gradient measured in the same rounds. Meant for ``run_in_subprocess`` with
    ``TF_CPU_ALLOCATOR_USE_BFC`` and ``TF_ENABLE_ONEDNN_OPTS`` set either way.

    Returns:
      dict with ``"large_intermediate_ms"``, ``"outer_ms"``, ``"outer_ratio"`` and
      ``"allocator_stats"``.

    Raises:
      ValueError: ``size``, ``batch_size`` or ``repeats`` is not a positive int.
    """
    size, repeats = check_int(size, "size"), check_int(repeats, "repeats")
    batch_size = check_int(batch_size, "batch_size")
    large = large_intermediate_ms(size, repeats)
    model = mlp()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    batch_gradient = make_batch_gradient(model, loss_fn)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(batch_size, 784)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=batch_size))
    timings = compare_timings(
        {"batch gradient": lambda: batch_gradient(x, y),
         "outer": lambda: per_example_gradients(model, loss_fn, x, y, "outer")},
        reference="batch gradient", warmup=1, repeats=repeats)
    outer = next(t for t in timings if t.name == "outer")
    return {"large_intermediate_ms": large["median_ms"], "outer_ms": outer.median_ms,
            "outer_ratio": outer.ratio, "allocator_stats": large["allocator_stats"]}
