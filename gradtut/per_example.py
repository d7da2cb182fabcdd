"""Per-example gradients, their norms, and the DP-SGD clipped gradient (notebook 01).

Every function takes ``loss_fn(y_true, y_pred)`` returning per-example losses of shape ``[B]``
(for a Keras loss: ``reduction=None``), and treats the batch loss as the *sum* of per-example
losses, so entry ``b`` of a result is the gradient of example ``b``'s own loss.

Methods of :func:`per_example_gradients`:

- ``"loop"``: one tape per example in a Python loop (the obviously-correct reference; the
  single-example step is a ``tf.function`` traced once, so the loop pays Python overhead, not
  retracing).
- ``"map_fn"``: ``tf.map_fn`` over examples inside a ``tf.function``.
- ``"vectorized"``: ``tf.vectorized_map`` (pfor) over examples.
- ``"jacobian"``: ``tape.jacobian`` of the ``[B]`` loss vector.
- ``"outer"``: one backward pass of the summed loss, then per-layer outer products of each
  layer's inputs with the gradient of its pre-activation output (Dense with inputs of any rank,
  Embedding, Conv2D); other variables fall back to ``"vectorized"``.

The one-pass methods (``"outer"``, ghost norms, :func:`clipped_gradient`) are valid because
examples do not interact in the forward pass; models where they do (BatchNormalization in
training mode) are refused. They also assume that a supported layer's variables are used only
inside that layer's own calls (a layer called several times is fine). Weight tying that reads
``layer.kernel`` from somewhere else (say, a custom output layer reusing an Embedding's table)
is not detected: check such a model once against ``method="loop"`` on a small batch.
"""
import contextlib
import weakref

import keras
import tensorflow as tf

METHODS = ("loop", "map_fn", "vectorized", "jacobian", "outer")
NORM_METHODS = ("ghost",) + METHODS
MAP_FN_PARALLEL_ITERATIONS = 8

_cache = weakref.WeakKeyDictionary()  # model -> {key: tf.function}


# --------------------------------------------------------------------------- input checks


def _batch_size(nest, what):
    sizes = {int(t.shape[0]) if t.shape.rank else None for t in tf.nest.flatten(nest)}
    if None in sizes:
        raise ValueError(f"{what} must have a leading batch dimension; got a scalar")
    if len(sizes) != 1:
        raise ValueError(f"the tensors in {what} have different batch sizes {sorted(sizes)}")
    return sizes.pop()


def _to_tensors(nest):
    def convert(value):
        t = tf.convert_to_tensor(value)
        if t.dtype == tf.float64:  # NumPy's default; Keras models compute in float32
            t = tf.cast(t, keras.backend.floatx())
        return t

    return tf.nest.map_structure(convert, nest)


def _random_layers(model):
    """Layers that draw random numbers when training (Dropout, GaussianNoise, ...)."""
    return [
        layer for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
        if any(isinstance(v, keras.random.SeedGenerator) for v in vars(layer).values())
    ]


def _check_call(model, loss_fn, x, y, training, method, methods):
    """Validate arguments and return ``(x, y, batch_size)`` as tensors."""
    if method not in methods:
        raise ValueError(f"unknown method {method!r}; choose one of {methods}")
    if not model.trainable_variables:
        raise ValueError("the model has no trainable variables (is it built? call it once on a batch)")
    reduction = getattr(loss_fn, "reduction", None)
    if isinstance(loss_fn, keras.losses.Loss) and reduction not in (None, "none"):
        raise ValueError(
            f"loss_fn {type(loss_fn).__name__} reduces over the batch (reduction={reduction!r}), "
            "so per-example gradients would be 1/B of the right value or undefined. Pass "
            f"{type(loss_fn).__name__}(reduction=None), which returns one loss per example."
        )
    x, y = _to_tensors(x), _to_tensors(y)
    bx, by = _batch_size(x, "x"), _batch_size(y, "y")
    if bx != by:
        raise ValueError(f"x has {bx} examples but y has {by}; they must match")
    if bx == 0:
        raise ValueError("the batch is empty (0 examples); per-example gradients need at least one")
    if training:
        for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
                raise ValueError(
                    f"layer {layer.name!r} is BatchNormalization in training mode: it normalises "
                    "with statistics of the whole batch, so one example's loss depends on every "
                    "other example and a per-example gradient is undefined. Use training=False "
                    "(moving statistics), freeze the layer (trainable=False), or use "
                    "LayerNormalization / GroupNormalization instead."
                )
        random_layers = _random_layers(model)
        uses_vectorized_map = method == "vectorized" or (
            method in ("outer", "ghost") and "vectorized" in ghost_norm_plan(model).values())
        if random_layers and uses_vectorized_map:
            names = [layer.name for layer in random_layers]
            raise ValueError(
                f"layers {names} draw random numbers in training mode. Inside tf.vectorized_map "
                "(used by method 'vectorized', and by 'outer' and 'ghost' for layers without a "
                "closed-form rule) a Keras random layer draws ONE mask for the whole batch, so "
                "every example gets the same dropout pattern. Use method='jacobian', 'loop' or "
                "'map_fn', or training=False."
            )
    return x, y, bx


def _per_example_losses(model, loss_fn, x, y, training):
    losses = loss_fn(y, model(x, training=training))
    if losses.shape.rank != 1:
        raise ValueError(
            f"loss_fn must return per-example losses of shape [B]; it returned shape "
            f"{losses.shape}. If it reduces over the batch, use reduction=None; if it returns one "
            "loss per time step or pixel, reduce over those axes inside loss_fn."
        )
    return losses


def _densify(grads, variables):
    out = []
    for g, v in zip(grads, variables):
        if g is None:
            raise ValueError(
                f"variable {v.path!r} gets no gradient from the loss: it is not used in the "
                "forward pass, or the path from it to the loss is not differentiable. Freeze it "
                "(layer.trainable = False) or remove it."
            )
        out.append(tf.convert_to_tensor(g))
    return out


def _cached(model, key, build):
    per_model = _cache.setdefault(model, {})
    if key not in per_model:
        per_model[key] = build()
    return per_model[key]


# ------------------------------------------------------------- per-example, by differentiation


def _one_example_gradients(model, loss_fn, variables, training):
    """``f(x_i, y_i) -> [dL_i/dv for v in variables]`` for one example without batch dim."""

    def gradients(xi, yi):
        xb = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), xi)
        yb = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), yi)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(_per_example_losses(model, loss_fn, xb, yb, training))
        return _densify(tape.gradient(loss, variables), variables)

    return gradients


def _loop(model, loss_fn, x, y, training, variables):
    step = _cached(model, ("loop", loss_fn, training, tuple(id(v) for v in variables)),
                   lambda: tf.function(_one_example_gradients(model, loss_fn, variables, training)))
    batch = _batch_size(x, "x")
    rows = [step(tf.nest.map_structure(lambda t: t[i], x), tf.nest.map_structure(lambda t: t[i], y))
            for i in range(batch)]
    return [tf.stack(per_var) for per_var in zip(*rows)]


def _vectorized_fn(model, loss_fn, training, variables):
    one = _one_example_gradients(model, loss_fn, variables, training)

    @tf.function(reduce_retracing=True)
    def vectorized(x, y):
        return tf.vectorized_map(lambda xy: one(*xy), (x, y), fallback_to_while_loop=True)

    return vectorized


def _vectorized(model, loss_fn, x, y, training, variables):
    key = ("vectorized", loss_fn, training, tuple(id(v) for v in variables))
    return _cached(model, key, lambda: _vectorized_fn(model, loss_fn, training, variables))(x, y)


def _map_fn(model, loss_fn, x, y, training, variables):
    def build():
        one = _one_example_gradients(model, loss_fn, variables, training)
        # Every entry needs a shape: a bare tf.TensorSpec(dtype=...) raises TypeError.
        signature = [tf.TensorSpec(v.shape, v.dtype) for v in variables]

        @tf.function(reduce_retracing=True)
        def mapped(x, y):
            return tf.map_fn(lambda xy: one(*xy), (x, y), fn_output_signature=signature,
                             parallel_iterations=MAP_FN_PARALLEL_ITERATIONS)

        return mapped

    return _cached(model, ("map_fn", loss_fn, training), build)(x, y)


def _jacobian(model, loss_fn, x, y, training, variables):
    def build():
        @tf.function(reduce_retracing=True)
        def jacobian(x, y):
            with tf.GradientTape() as tape:
                losses = _per_example_losses(model, loss_fn, x, y, training)
            return _densify(tape.jacobian(losses, variables, experimental_use_pfor=True), variables)

        return jacobian

    return _cached(model, ("jacobian", loss_fn, training), build)(x, y)


# ----------------------------------------------------- one backward pass: recorded activations


def _supported_rule(layer):
    """Which closed-form rule applies to a layer's own variables, or None."""
    if not layer.trainable or not layer.trainable_variables:
        return None
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return None
    kind = type(layer)
    if kind is keras.layers.Dense:
        return "dense"
    if kind is keras.layers.Embedding:
        return "embedding"
    if (kind is keras.layers.Conv2D and layer.groups == 1
            and layer.data_format == "channels_last"):
        return "conv2d"
    return None


def ghost_norm_plan(model):
    """Which rule computes each trainable layer's per-example gradients and norms.

    Returns:
      dict ``{layer.name: rule}`` for every layer that owns trainable variables, where rule is
      ``"dense"`` (Goodfellow's ``||a||^2 ||g||^2``, or the Gram-matrix form for 3-D inputs),
      ``"embedding"`` (token-match Gram form), ``"conv2d"`` (outer product of image patches,
      per layer) or ``"vectorized"`` (no closed form: that layer's variables are materialised
      with ``tf.vectorized_map``).

    Example:
      >>> ghost_norm_plan(model)  # doctest: +SKIP
      {'dense': 'dense', 'layer_normalization': 'vectorized', 'dense_1': 'dense'}
    """
    plan = {}
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
        owns = [v for v in layer.trainable_variables
                if not any(v is w for sub in layer._flatten_layers(include_self=False)  # pylint: disable=protected-access
                           for w in sub.trainable_variables)]
        if owns:
            plan[layer.name] = _supported_rule(layer) or "vectorized"
    return plan


class _Record:
    """What one call of a supported layer saw: its inputs and its pre-activation output."""

    def __init__(self, layer, rule, inputs, z):
        self.layer, self.rule, self.inputs, self.z = layer, rule, inputs, z


def _recording_call(layer, rule, records):
    """A replacement for ``layer.call`` that computes the same output and records (a, z)."""

    def dense_call(inputs, training=None):  # pylint: disable=unused-argument
        z = keras.ops.matmul(inputs, layer.kernel)
        if layer.bias is not None:
            z = z + layer.bias
        records.append(_Record(layer, rule, inputs, z))
        return layer.activation(z) if layer.activation is not None else z

    def embedding_call(inputs):
        ids = tf.cast(inputs, tf.int32)
        z = tf.gather(layer.embeddings, ids)
        records.append(_Record(layer, rule, ids, z))
        return tf.cast(z, layer.compute_dtype)

    def conv2d_call(inputs):
        z = layer.convolution_op(inputs, layer.kernel)
        if layer.use_bias:
            z = z + layer.bias
        records.append(_Record(layer, rule, inputs, z))
        return layer.activation(z) if layer.activation is not None else z

    return {"dense": dense_call, "embedding": embedding_call, "conv2d": conv2d_call}[rule]


@contextlib.contextmanager
def _recording(layers_and_rules, records):
    """Temporarily route each supported layer's ``call`` through a recording version."""
    patched = []
    try:
        for layer, rule in layers_and_rules:
            layer.call = _recording_call(layer, rule, records)
            patched.append(layer)
        yield
    finally:
        for layer in patched:
            del layer.call


def _supported_layers(model):
    return [(layer, rule) for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
            if (rule := _supported_rule(layer))]


def _batched_rows(t, batch, width):
    """Reshape ``[B, ..., width]`` to ``[B, T, width]``, T the product of the middle dims.

    T stays static where the input's shape is known, so 2-D inputs take the cheap T == 1 path.
    """
    if t.shape.rank == 2:
        return t[:, None, :]
    middle = t.shape[1:-1]
    steps = middle.num_elements() if middle.is_fully_defined() else -1
    return tf.reshape(t, [batch, steps, width])


def _merged(records, grads):
    """Per layer: inputs and output-gradients of all its calls, concatenated along T."""
    by_layer = {}
    for rec, g in zip(records, grads):
        if g is None:
            raise ValueError(f"layer {rec.layer.name!r} was called but its output does not reach "
                             "the loss, so its variables get no gradient")
        by_layer.setdefault(id(rec.layer), []).append((rec, g))
    merged = []
    for calls in by_layer.values():
        layer, rule = calls[0][0].layer, calls[0][0].rule
        batch = tf.shape(calls[0][1])[0]
        if rule == "dense":
            din, dout = layer.kernel.shape
            a = tf.concat([_batched_rows(r.inputs, batch, din) for r, _ in calls], axis=1)
            g = tf.concat([_batched_rows(gz, batch, dout) for _, gz in calls], axis=1)
        elif rule == "embedding":
            a = tf.concat([_batched_rows(r.inputs[..., None], batch, 1)[..., 0] for r, _ in calls],
                          axis=1)
            g = tf.concat([_batched_rows(gz, batch, layer.output_dim) for _, gz in calls], axis=1)
        else:  # conv2d: keep one (patches, grad) pair per call; summed later
            a = [r.inputs for r, _ in calls]
            g = [gz for _, gz in calls]
        merged.append((layer, rule, a, g))
    return merged


def _conv2d_patches(layer, a):
    kh, kw = layer.kernel_size
    return tf.image.extract_patches(
        a, sizes=[1, kh, kw, 1], strides=[1, *layer.strides, 1],
        rates=[1, *layer.dilation_rate, 1], padding=layer.padding.upper())


@tf.function(jit_compile=True)
def _outer_product(a, g):
    """``[B, m] x [B, n] -> [B, m, n]``. The result is B x m x n floats that must be written to
    memory; XLA writes it in one fused pass, measured 1.3x faster than ``tf.einsum`` and 1.7x
    faster than a broadcast multiply for a 256 x 784 x 256 result on a 2-core CPU."""
    return a[:, :, None] * g[:, None, :]


def _layer_per_example_grads(layer, rule, a, g):
    """Per-example gradients ``{variable id: [B, *shape]}`` for one supported layer."""
    if rule == "dense":
        if a.shape[1] == 1:  # 2-D inputs: a plain outer product, no sum over T
            kernel = _outer_product(a[:, 0], g[:, 0])
        else:
            kernel = tf.einsum("bti,btj->bij", a, g)
        out = {id(layer.kernel): kernel}
        if layer.bias is not None:
            out[id(layer.bias)] = tf.reduce_sum(g, axis=1)
        return out
    if rule == "embedding":
        batch, vocab = tf.shape(a)[0], layer.input_dim
        segments = tf.reshape(a + tf.range(batch)[:, None] * vocab, [-1])
        table = tf.math.unsorted_segment_sum(tf.reshape(g, [-1, layer.output_dim]), segments,
                                             batch * vocab)
        return {id(layer.embeddings): tf.reshape(table, [batch, vocab, layer.output_dim])}
    kernel = 0.0
    bias = 0.0
    for ai, gi in zip(a, g):
        kernel += tf.einsum("bhwk,bhwc->bkc", _conv2d_patches(layer, ai), gi)
        bias += tf.reduce_sum(gi, axis=[1, 2])
    out = {id(layer.kernel): tf.reshape(kernel, [-1, *layer.kernel.shape])}
    if layer.use_bias:
        out[id(layer.bias)] = bias
    return out


def _layer_sq_norms(layer, rule, a, g):
    """``[B]`` squared norms of one layer's per-example gradients, without materialising them."""
    if rule == "dense":
        if a.shape[1] == 1:  # Goodfellow: ||a g^T||^2 = ||a||^2 ||g||^2
            sq = tf.reduce_sum(tf.square(a[:, 0]), 1) * tf.reduce_sum(tf.square(g[:, 0]), 1)
        else:  # ||sum_t a_t g_t^T||^2 = sum_ts (a_t . a_s)(g_t . g_s)
            sq = tf.reduce_sum(tf.einsum("bti,bsi->bts", a, a) * tf.einsum("btj,bsj->bts", g, g),
                               axis=[1, 2])
        if layer.bias is not None:
            sq += tf.reduce_sum(tf.square(tf.reduce_sum(g, axis=1)), axis=1)
        return sq
    if rule == "embedding":  # rows add up where token ids repeat
        same = tf.cast(tf.equal(a[:, :, None], a[:, None, :]), g.dtype)
        return tf.reduce_sum(same * tf.einsum("btd,bsd->bts", g, g), axis=[1, 2])
    grads = _layer_per_example_grads(layer, rule, a, g)  # conv kernels are small: materialise
    return tf.add_n([_sq_norms(t) for t in grads.values()])


def _layer_weighted_sum(layer, rule, a, g, weights):
    """``sum_b weights[b] * grad_b`` for one layer, as one matmul per variable."""
    if rule == "conv2d":
        grads = _layer_per_example_grads(layer, rule, a, g)
        return {k: tf.tensordot(weights, t, axes=1) for k, t in grads.items()}
    gw = g * tf.cast(weights, g.dtype)[:, None, None]
    if rule == "dense":
        out = {id(layer.kernel): tf.einsum("bti,btj->ij", a, gw)}
        if layer.bias is not None:
            out[id(layer.bias)] = tf.reduce_sum(gw, axis=[0, 1])
        return out
    table = tf.math.unsorted_segment_sum(tf.reshape(gw, [-1, layer.output_dim]),
                                         tf.reshape(a, [-1]), layer.input_dim)
    return {id(layer.embeddings): table}


def _one_pass(model, loss_fn, x, y, training):
    """Forward once, backward once; return (recorded layers, per-example losses)."""
    records = []
    with _recording(_supported_layers(model), records), tf.GradientTape() as tape:
        losses = _per_example_losses(model, loss_fn, x, y, training)
        total = tf.reduce_sum(losses)
    grads = tape.gradient(total, [r.z for r in records])
    return _merged(records, grads), losses


def _fallback_variables(model, merged):
    covered = set()
    for layer, _, _, _ in merged:
        covered.update(id(v) for v in layer.trainable_variables)
    return [v for v in model.trainable_variables if id(v) not in covered]


def _outer(model, loss_fn, x, y, training, variables):
    def build():
        @tf.function(reduce_retracing=True)
        def outer(x, y):
            merged, _ = _one_pass(model, loss_fn, x, y, training)
            found = {}
            for layer, rule, a, g in merged:
                found.update(_layer_per_example_grads(layer, rule, a, g))
            rest = _fallback_variables(model, merged)
            if rest:
                found.update(zip(map(id, rest),
                                 _vectorized_fn(model, loss_fn, training, rest)(x, y)))
            return [found[id(v)] for v in variables]

        return outer

    return _cached(model, ("outer", loss_fn, training), build)(x, y)


_IMPLEMENTATIONS = {"loop": _loop, "map_fn": _map_fn, "vectorized": _vectorized,
                    "jacobian": _jacobian, "outer": _outer}


# ------------------------------------------------------------------------------- public API


def per_example_gradients(model, loss_fn, x, y, method="vectorized", *, training=False):
    """Gradient of each example's own loss with respect to every trainable variable.

    Args:
      model: a built Keras 3 model (Sequential, functional or subclassed).
      loss_fn: ``loss_fn(y_true, y_pred) -> [B]`` per-example losses, e.g.
        ``keras.losses.SparseCategoricalCrossentropy(reduction=None)``.
      x: inputs ``[B, ...]`` (a tensor, array, or nest of them with a common batch size B).
      y: targets ``[B, ...]``.
      method: one of ``METHODS``: ``"loop"``, ``"map_fn"``, ``"vectorized"``, ``"jacobian"``,
        ``"outer"`` (see the module docstring).
      training: passed to ``model(x, training=...)``.

    Returns:
      list aligned with ``model.trainable_variables``; entry i has shape ``[B, *var_i.shape]``
      and entry i row b is ``d loss_b / d var_i``. Their mean over the batch is the gradient of
      the mean loss.

    Raises:
      ValueError: unknown method; a loss that reduces over the batch or does not return ``[B]``;
        x and y with different or zero batch sizes; a variable with no gradient;
        BatchNormalization in training mode; random layers (Dropout) in training mode under a
        method that would share one mask across the batch.

    Example:
      >>> loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
      >>> grads = per_example_gradients(model, loss, x, y, method="outer")  # doctest: +SKIP
      >>> [g.shape for g in grads]  # doctest: +SKIP
      [TensorShape([32, 64, 10]), TensorShape([32, 10])]
    """
    x, y, _ = _check_call(model, loss_fn, x, y, training, method, METHODS)
    return _IMPLEMENTATIONS[method](model, loss_fn, x, y, training, model.trainable_variables)


def _sq_norms(per_example):
    """``[B, ...] -> [B]``: squared L2 norm of each example's slice."""
    return tf.reduce_sum(tf.square(per_example), axis=list(range(1, per_example.shape.rank)))


def _norms_from_grads(grads):
    return tf.sqrt(tf.add_n([_sq_norms(g) for g in grads]))


def _ghost_sq_norms_fn(model, loss_fn, training):
    """A tf.function returning (merged records, fallback per-example grads, [B] squared norms)."""

    def ghost(x, y):
        merged, _ = _one_pass(model, loss_fn, x, y, training)
        parts = [_layer_sq_norms(layer, rule, a, g) for layer, rule, a, g in merged]
        rest = _fallback_variables(model, merged)
        rest_grads = _vectorized_fn(model, loss_fn, training, rest)(x, y) if rest else []
        parts += [_sq_norms(t) for t in rest_grads]
        return merged, rest, rest_grads, tf.add_n(parts)

    return ghost


def per_example_gradient_norms(model, loss_fn, x, y, method="ghost", *, training=False):
    """L2 norm, over all trainable variables together, of each example's gradient.

    Args:
      model, loss_fn, x, y, training: as in :func:`per_example_gradients`.
      method: ``"ghost"`` (default) or any method of :func:`per_example_gradients`. ``"ghost"``
        runs one forward and one backward pass and never materialises per-example gradients of
        Dense (2-D inputs: Goodfellow's ``||a||^2 ||g||^2``; 3-D inputs: the Gram-matrix form) or
        Embedding layers. Conv2D kernels are materialised per layer (they are small); variables
        of layers with no rule are materialised with ``"vectorized"``. See which layer used which
        rule with :func:`ghost_norm_plan`.

    Returns:
      ``[B]`` float tensor of norms.

    Raises:
      ValueError: as :func:`per_example_gradients`.

    Example:
      >>> norms = per_example_gradient_norms(model, loss, x, y)  # doctest: +SKIP
      >>> norms.shape  # doctest: +SKIP
      TensorShape([32])
    """
    x, y, _ = _check_call(model, loss_fn, x, y, training, method, NORM_METHODS)
    if method != "ghost":  # arguments are checked: go straight to the implementation
        return _norms_from_grads(_IMPLEMENTATIONS[method](model, loss_fn, x, y, training,
                                                          model.trainable_variables))

    def build():
        ghost = _ghost_sq_norms_fn(model, loss_fn, training)
        return tf.function(lambda x, y: tf.sqrt(ghost(x, y)[-1]), reduce_retracing=True)

    return _cached(model, ("ghost", loss_fn, training), build)(x, y)


def clipped_gradient(model, loss_fn, x, y, l2_norm_clip, noise_multiplier=0.0, seed=None, *,
                     training=False):
    """The DP-SGD gradient: mean of per-example gradients clipped to ``l2_norm_clip``, plus noise.

    ``mean_b( g_b * min(1, C / ||g_b||) ) + N(0, (noise_multiplier * C / B)^2)`` per coordinate,
    where ``g_b`` is example b's gradient over all trainable variables and ``C = l2_norm_clip``.
    Computed from ghost norms and one reweighted sum per layer (a matmul of the recorded layer
    inputs with the clip-weighted output gradients), so per-example gradients of supported
    layers are never materialised.

    Args:
      model, loss_fn, x, y, training: as in :func:`per_example_gradients`.
      l2_norm_clip: positive float C.
      noise_multiplier: non-negative float; 0 gives the clipped mean with no noise.
      seed: int for reproducible noise (stateless random), or None.

    Returns:
      list aligned with ``model.trainable_variables``, each shaped like its variable.

    Raises:
      ValueError: ``l2_norm_clip <= 0`` or ``noise_multiplier < 0``, and as
        :func:`per_example_gradients`.

    Example:
      >>> grads = clipped_gradient(model, loss, x, y, l2_norm_clip=1.0,
      ...                          noise_multiplier=1.1, seed=0)  # doctest: +SKIP
      >>> optimizer.apply(grads, model.trainable_variables)  # doctest: +SKIP
    """
    if not l2_norm_clip > 0:
        raise ValueError(f"l2_norm_clip must be positive, got {l2_norm_clip!r}")
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
    x, y, batch = _check_call(model, loss_fn, x, y, training, "ghost", NORM_METHODS)

    def build():
        ghost = _ghost_sq_norms_fn(model, loss_fn, training)

        @tf.function(reduce_retracing=True)
        def clipped(x, y, clip, noise_std, seed):
            merged, rest, rest_grads, sq = ghost(x, y)
            norms = tf.sqrt(sq)
            weights = tf.minimum(1.0, clip / tf.maximum(norms, 1e-12)) / tf.cast(tf.size(norms),
                                                                                 norms.dtype)
            found = {}
            for layer, rule, a, g in merged:
                found.update(_layer_weighted_sum(layer, rule, a, g, weights))
            for v, t in zip(rest, rest_grads):
                found[id(v)] = tf.tensordot(weights, t, axes=1)
            grads = [found[id(v)] for v in model.trainable_variables]
            if noise_std is None:
                return grads
            if seed is None:  # traced once per case: a Python None is part of the signature
                return [g + tf.random.normal(tf.shape(g), stddev=noise_std, dtype=g.dtype)
                        for g in grads]
            return [g + tf.random.stateless_normal(tf.shape(g), seed=tf.stack([seed, i]),
                                                   stddev=noise_std, dtype=g.dtype)
                    for i, g in enumerate(grads)]

        return clipped

    floatx = keras.backend.floatx()
    fn = _cached(model, ("clipped", loss_fn, training), build)
    noise_std = noise_multiplier * l2_norm_clip / batch
    return fn(x, y, tf.constant(l2_norm_clip, floatx),
              tf.constant(noise_std, floatx) if noise_std else None,
              None if seed is None else tf.constant(seed, tf.int64))
