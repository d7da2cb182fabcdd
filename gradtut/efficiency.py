"""Efficiency tricks for gradient computation, each with its reference (notebook 05).

- :func:`accumulated_gradients` and :func:`make_accumulating_train_step`: gradient accumulation
  with the arithmetic right (the mean over every example, ragged micro-batches included);
- :func:`peak_memory`: the allocator's peak for one call, in a fresh process when needed;
- :func:`checkpointed`: gradient checkpointing with ``tf.recompute_grad`` over segments;
- :func:`hvp` and :func:`hessian`: Hessian-vector products (forward-over-reverse and
  reverse-over-reverse) and the explicit Hessian they are checked against;
- :func:`compare_compilation`: eager, ``tf.function`` and XLA timed in one run.
"""
import os
import pickle
import subprocess
import sys
import tempfile

import keras
import numpy as np
import tensorflow as tf

from gradtut.benchmark import compare_timings, peak_memory_bytes


# --- gradient accumulation -----------------------------------------------------------------

def _summed_loss(loss_fn, y, y_pred):
    """Sum of per-example losses; a scalar (mean) loss is scaled back up by the batch size."""
    loss = tf.cast(loss_fn(y, y_pred), tf.float32)
    if loss.shape.rank == 0:
        return loss * tf.cast(tf.shape(y_pred)[0], tf.float32)
    return tf.reduce_sum(loss)


def _regularization_gradients(model):
    with tf.GradientTape() as tape:
        total = tf.add_n([tf.cast(l, tf.float32) for l in model.losses]) if model.losses else None
    if total is None:
        return [None] * len(model.trainable_variables)
    return tape.gradient(total, model.trainable_variables)


def _check_batch(x, y):
    x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
    if not x.shape[0]:
        raise ValueError("the batch is empty: pass at least one example")
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"x has {x.shape[0]} examples but y has {y.shape[0]}: they must match")
    return x, y


def _summed_gradient_fn(model, loss_fn):
    """A compiled ``(x, y) -> (summed loss, gradients of it)``, one per (model, loss)."""
    cache = model.__dict__.setdefault("_gradtut_summed_gradient", {})
    if id(loss_fn) not in cache:
        @tf.function(reduce_retracing=True)
        def summed_gradient(x, y):
            with tf.GradientTape() as tape:
                total = _summed_loss(loss_fn, y, model(x, training=False))
            return total, tape.gradient(total, model.trainable_variables,
                                        unconnected_gradients="zero")
        cache[id(loss_fn)] = (loss_fn, summed_gradient)
    return cache[id(loss_fn)][1]


def accumulated_gradients(model, loss_fn, x, y, micro_batch_size):
    """The full-batch mean gradient, computed ``micro_batch_size`` examples at a time.

    Each micro-batch contributes the gradient of its *summed* per-example losses, and the total
    is divided once by the number of examples. A short last micro-batch is therefore weighted by
    its size, not as a full one (averaging micro-batch means would over-weight it). The model's
    regularisation losses are added once. Only one micro-batch's activations are alive at a
    time, which is the point: peak memory follows ``micro_batch_size``, not the batch.

    Args:
      model: a Keras model.
      loss_fn: ``loss_fn(y_true, y_pred)`` returning per-example losses or their mean.
      x, y: the whole batch, ``[batch, ...]``.
      micro_batch_size: examples per micro-batch, from 1 to the batch size.

    Returns:
      list of gradients lined up with ``model.trainable_variables``: equal, within float32
      round-off, to the gradient of the mean loss over the whole batch in one pass.

    Raises:
      ValueError: empty batch, ``x``/``y`` length mismatch, or ``micro_batch_size`` not an int
        from 1 to the batch size.

    Example:
      >>> grads = accumulated_gradients(model, loss_fn, x, y, micro_batch_size=32)  # doctest: +SKIP
    """
    x, y = _check_batch(x, y)
    batch = x.shape[0]
    if (not isinstance(micro_batch_size, (int, np.integer)) or isinstance(micro_batch_size, bool)
            or not 1 <= micro_batch_size <= batch):
        raise ValueError(f"micro_batch_size must be an int from 1 to the batch size ({batch}), "
                         f"got {micro_batch_size!r}")
    step = _summed_gradient_fn(model, loss_fn)
    sums = None
    for start in range(0, batch, int(micro_batch_size)):
        _, grads = step(x[start:start + micro_batch_size], y[start:start + micro_batch_size])
        sums = list(grads) if sums is None else [s + g for s, g in zip(sums, grads)]
    regularization = _regularization_gradients(model)
    return [s / batch + (0.0 if r is None else r) for s, r in zip(sums, regularization)]


def make_accumulating_train_step(model, loss_fn, optimizer, accumulation_steps):
    """A compiled training step that updates once every ``accumulation_steps`` micro-batches.

    Each call adds the micro-batch's summed-loss gradient to accumulators and counts its
    examples. On every ``accumulation_steps``-th call it applies the sum divided by the number
    of examples seen (plus the regularisation gradient, once), then zeroes the accumulators and
    the count. The update equals one optimizer step on the concatenated micro-batches, ragged
    ones included.

    Args:
      model, loss_fn: as :func:`accumulated_gradients`.
      optimizer: a Keras optimizer (built here on the model's trainable variables).
      accumulation_steps: micro-batches per update (positive int).

    Returns:
      ``step(x, y) -> (loss, applied)``: the micro-batch's mean loss and whether this call
      applied an update (both tensors). ``step.accumulators`` and ``step.examples_seen`` are the
      state, for inspection.

    Raises:
      ValueError: ``accumulation_steps`` is not a positive int.

    Example:
      >>> step = make_accumulating_train_step(model, loss_fn, keras.optimizers.SGD(0.1), 4)  # doctest: +SKIP
      >>> for xb, yb in micro_batches:  # doctest: +SKIP
      ...     loss, applied = step(xb, yb)
    """
    if (not isinstance(accumulation_steps, (int, np.integer)) or isinstance(accumulation_steps, bool)
            or accumulation_steps < 1):
        raise ValueError(f"accumulation_steps must be a positive int, got {accumulation_steps!r}")
    variables = model.trainable_variables
    optimizer.build(variables)
    sums = [tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False) for v in variables]
    seen = tf.Variable(0.0, trainable=False)
    calls = tf.Variable(0, dtype=tf.int64, trainable=False)

    def apply_and_reset():
        regularization = _regularization_gradients(model)
        grads = [s / seen + (0.0 if r is None else r) for s, r in zip(sums, regularization)]
        optimizer.apply(grads, variables)
        for s in sums:
            s.assign(tf.zeros_like(s))
        seen.assign(0.0)
        return tf.constant(True)

    @tf.function(reduce_retracing=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            total = _summed_loss(loss_fn, y, model(x, training=True))
        for s, g in zip(sums, tape.gradient(total, variables, unconnected_gradients="zero")):
            s.assign_add(g)
        count = tf.cast(tf.shape(x)[0], tf.float32)
        seen.assign_add(count)
        calls.assign_add(1)
        applied = tf.cond(calls % accumulation_steps == 0, apply_and_reset,
                          lambda: tf.constant(False))
        return total / count, applied

    step.accumulators = sums
    step.examples_seen = seen
    return step


# --- peak memory ---------------------------------------------------------------------------

def _allocator_has_stats(device="CPU:0"):
    try:
        tf.config.experimental.get_memory_info(device)
    except (ValueError, RuntimeError):
        return False
    return True


def _child_main(path):
    """Entry point of the fresh process: unpickle ``(fn, args)``, measure, print the bytes."""
    import gradtut
    gradtut.setup(bfc_allocator=True)
    with open(path, "rb") as f:
        fn, args = pickle.load(f)
    fn(*args)  # warm-up: tracing, one-off buffers
    print(f"@@PEAK@@{peak_memory_bytes(fn, *args)}")


def peak_memory(fn, *args, fresh_process=None, timeout_s=600):
    """Peak bytes the TensorFlow CPU allocator held above its starting level during one
    ``fn(*args)`` call.

    Allocator statistics need the BFC allocator, which must be chosen before TensorFlow starts
    (``TF_CPU_ALLOCATOR_USE_BFC=true``; ``gradtut.setup()`` does it). In a process without it,
    or with ``fresh_process=True``, the call runs in a new Python process that has it, after one
    warm-up call there; the child is killed if it outlives ``timeout_s``.

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
        ``fresh_process=False`` in a process without allocator statistics.

    Example:
      >>> peak_memory(tf.zeros, [1024, 1024])  # doctest: +SKIP
      4194304
    """
    has_stats = _allocator_has_stats()
    if fresh_process is None:
        fresh_process = not has_stats
    if not fresh_process:
        if not has_stats:
            raise RuntimeError("this process's CPU allocator keeps no statistics: start it with "
                               "gradtut.setup() (BFC allocator), or pass fresh_process=True")
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
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_CPU_ALLOCATOR_USE_BFC": "true",
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # import what we can
        code = f"from gradtut.efficiency import _child_main; _child_main({f.name!r})"
        try:
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  env=env, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:  # subprocess.run has killed the child
            raise RuntimeError(f"the fresh process did not finish within {timeout_s} s") from None
    if proc.returncode != 0 or "@@PEAK@@" not in proc.stdout:
        tail = "\n".join(proc.stderr.strip().splitlines()[-10:])
        raise RuntimeError(f"the fresh process failed (exit {proc.returncode}):\n{tail}")
    return int(proc.stdout.rsplit("@@PEAK@@", 1)[1].split()[0])


# --- gradient checkpointing ----------------------------------------------------------------

def _segments(layers, num_segments):
    cuts = np.linspace(0, len(layers), num_segments + 1).round().astype(int)
    return [layers[a:b] for a, b in zip(cuts, cuts[1:])]


def checkpointed(layers, num_segments):
    """``f(x)``: the layers applied in order, with ``tf.recompute_grad`` over each of
    ``num_segments`` consecutive, near-equal segments.

    The forward pass keeps only each segment's input; the backward pass recomputes a segment's
    activations when it needs them. With n layers, about sqrt(n) segments keep the fewest
    activations (sqrt(n) boundaries plus one segment's worth) for one extra forward pass. The
    saving shows inside a ``tf.function``; eager mode keeps what it keeps.

    Args:
      layers: Keras layers applied in order (a ``keras.Sequential``'s ``layers``). Unbuilt
        layers are built by the first call, which runs without checkpointing.
      num_segments: from 1 to ``len(layers)``.

    Returns:
      callable ``f(x)``; ``f.segments`` lists the layers of each segment.

    Raises:
      ValueError: no layers, or ``num_segments`` not an int from 1 to the number of layers.

    Example:
      >>> f = checkpointed(model.layers, num_segments=4)  # doctest: +SKIP
      >>> with tf.GradientTape() as tape:  # doctest: +SKIP
      ...     loss = loss_fn(y, f(x))
    """
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty: nothing to checkpoint")
    if (not isinstance(num_segments, (int, np.integer)) or isinstance(num_segments, bool)
            or not 1 <= num_segments <= len(layers)):
        raise ValueError(f"num_segments must be an int from 1 to the number of layers "
                         f"({len(layers)}), got {num_segments!r}")
    segments = _segments(layers, int(num_segments))

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


def _check_vector(variables, vector):
    # tf.autodiff.ForwardAccumulator rejects Keras 3 variables (their dtype is a string;
    # tensorflow/tensorflow#79523), so work on the tf.Variable inside each one.
    variables = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    vector = list(vector)
    if len(vector) != len(variables):
        raise ValueError(f"vector has {len(vector)} parts but there are {len(variables)} "
                         "variables: pass one tensor per variable, in the same order")
    out = []
    for i, (v, u) in enumerate(zip(variables, vector)):
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

    Both cost a small constant times one gradient; the explicit Hessian costs P gradients.

    Args:
      loss_fn: zero-argument callable returning a scalar (it reads ``variables``).
      variables: list of variables.
      vector: list of tensors lined up with ``variables`` (same shapes).
      method: one of :data:`HVP_METHODS`.

    Returns:
      list of tensors lined up with ``variables``.

    Raises:
      ValueError: unknown method, or ``vector`` not lined up with ``variables``.

    Example:
      >>> hv = hvp(lambda: loss_fn(y, model(x)), model.trainable_variables, v)  # doctest: +SKIP
    """
    if method not in HVP_METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {HVP_METHODS}")
    variables, vector = _check_vector(variables, vector)
    if method == "forward_over_reverse":
        with tf.autodiff.ForwardAccumulator(variables, vector) as accumulator:
            with tf.GradientTape() as tape:
                loss = loss_fn()
            grads = tape.gradient(loss, variables, unconnected_gradients="zero")
        return [accumulator.jvp(g, unconnected_gradients="zero") for g in grads]
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            loss = loss_fn()
        grads = inner.gradient(loss, variables, unconnected_gradients="zero")
        dot = tf.add_n([tf.reduce_sum(g * u) for g, u in zip(grads, vector)])
    return outer.gradient(dot, variables, unconnected_gradients="zero")


def hessian(loss_fn, variables):
    """The explicit Hessian of a scalar loss over all ``variables``, flattened and
    concatenated: a ``[P, P]`` tensor for P parameters. The slow reference for :func:`hvp`;
    only for small models (it costs P gradient evaluations and P^2 floats)."""
    variables = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    with tf.GradientTape(persistent=True) as outer:
        with tf.GradientTape() as inner:
            loss = loss_fn()
        grads = inner.gradient(loss, variables, unconnected_gradients="zero")
        flat = tf.concat([tf.reshape(g, [-1]) for g in grads], axis=0)
    rows = outer.jacobian(flat, variables, unconnected_gradients="zero")
    del outer
    return tf.concat([tf.reshape(r, [flat.shape[0], -1]) for r in rows], axis=1)


# --- compilation ---------------------------------------------------------------------------

def compare_compilation(fn, *args, repeats=7, rtol=1e-2, atol=1e-6):
    """Time ``fn(*args)`` eagerly, as a ``tf.function`` and with ``jit_compile=True`` (XLA),
    interleaved in one run, after checking the three give the same result.

    Args:
      fn: a function of tensors (it must be traceable by ``tf.function``).
      repeats: timed calls of each (after two warm-up calls that trace and compile).
      rtol, atol: tolerance of the result check: every output of a compiled version must be
        within ``rtol`` times the largest magnitude among all eager outputs, plus ``atol``.
        Fused kernels round differently, and backprop through many layers amplifies it:
        measured on a 16-layer ReLU MLP, XLA's gradients differ from eager by up to 3% of a
        small gradient's own size, and by 2e-5 of the largest value. The check is there to
        catch real disagreements (a Python side effect baked in at tracing, a wrong
        shape), not rounding.

    Returns:
      dict ``{"eager" | "tf.function" | "xla": {"median_ms": float, "ratio": float}}``, where
      ``ratio`` is the median time over the eager median (below 1 means faster).

    Raises:
      AssertionError: the compiled versions disagree with eager beyond the tolerance.

    Example:
      >>> compare_compilation(step, x, y)["xla"]["ratio"]  # doctest: +SKIP
      0.31
    """
    versions = {"eager": fn, "tf.function": tf.function(fn),
                "xla": tf.function(fn, jit_compile=True)}
    expected = [np.asarray(t) for t in tf.nest.flatten(fn(*args))]
    scale = max(float(np.max(np.abs(b), initial=0.0)) for b in expected)
    for name in ("tf.function", "xla"):
        got = [np.asarray(t) for t in tf.nest.flatten(versions[name](*args))]
        for i, (a, b) in enumerate(zip(got, expected)):
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
    whether this process's allocator keeps statistics. Meant to run in a fresh process (via
    ``gradtut.benchmark.run_in_subprocess``) with ``TF_CPU_ALLOCATOR_USE_BFC`` set either way,
    since the allocator is chosen when TensorFlow starts.
    """
    import time

    x = tf.random.stateless_normal((size, size), seed=(1, 2))

    @tf.function
    def step(x):
        return tf.reduce_sum(tf.nn.relu(tf.matmul(x, x)) * 2.0 + x)

    step(x).numpy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(x).numpy()
        times.append(time.perf_counter() - start)
    return {"median_ms": 1e3 * float(np.median(times)), "allocator_stats": _allocator_has_stats()}


def allocator_workloads(size=2048, batch_size=256, repeats=7):
    """Both allocator workloads of notebook 05, section 9, timed in this process: the compiled
    step of :func:`large_intermediate_ms`, and per-example gradients materialised with
    ``method="outer"`` on the 784-256-10 MLP of ``gradtut.bench_per_example`` (a fresh
    ``[batch_size, 203,530]`` float32 result every call), as a ratio to that MLP's batch
    gradient measured in the same rounds. Meant for ``run_in_subprocess`` with
    ``TF_CPU_ALLOCATOR_USE_BFC`` and ``TF_ENABLE_ONEDNN_OPTS`` set either way.

    Returns:
      dict with ``"large_intermediate_ms"``, ``"outer_ms"``, ``"outer_ratio"`` and
      ``"allocator_stats"``.
    """
    from gradtut.bench_per_example import benchmark_per_example  # pylint: disable=import-outside-toplevel

    large = large_intermediate_ms(size, repeats)
    rows = benchmark_per_example([batch_size], ["outer"], repeats=repeats)
    outer = next(r for r in rows if r["method"] == "outer")
    return {"large_intermediate_ms": large["median_ms"], "outer_ms": outer["median_ms"],
            "outer_ratio": outer["ratio"], "allocator_stats": large["allocator_stats"]}
