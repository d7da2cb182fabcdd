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
- ``"outer"``: one forward and one backward pass; each layer with a rule in
  :mod:`gradtut.layer_rules` (Dense, EinsumDense, Embedding, convolutions, normalisations)
  turns its recorded inputs and output gradients into per-example gradients; a layer without
  a rule takes the layer-local path (:mod:`gradtut.layer_rules.local`: that layer alone,
  vectorised, or looped over examples where vectorising it is unsafe). The whole model is
  never vectorised. :func:`per_example_plan` shows which layer takes which path.

The first four need no layer rules (they still use :mod:`gradtut.checks` and the oneDNN check
and unreached-variable warning of :mod:`gradtut.layer_rules`). The one-pass methods
(``"outer"``, ghost norms, :func:`clipped_gradient`) are valid because examples do not
interact in the forward pass; models where they do (BatchNormalization in training mode) are
refused. They also assume that
a covered layer's variables are used only inside that layer's own calls (a layer called
several times is fine, and a variable that two layers own, such as a tied table assigned to a
second layer, gets the sum of both). A variable read outside every recorded call gets its
per-example gradient from the Jacobian of the same pass (slow, but exact).

Where TensorFlow itself computes a wrong answer, gradtut refuses with an error that names the
workaround instead of returning it: see :func:`broadcast_matmul_hazards` (oneDNN) and grouped
convolutions under ``tf.vectorized_map``.
"""
import functools
import weakref

import keras
import tensorflow as tf

from gradtut import layer_rules
from gradtut.checks import (
    as_tensors,
    batch_size_of,
    check_keras_model,
    check_loss_fn,
    check_present,
    check_real,
    check_seed,
)

# onednn_enabled, broadcast_matmul_hazards and is_broadcast_matmul_hazard live in
# gradtut.layer_rules.onednn; they stay importable from here, where earlier versions had them.
from gradtut.layer_rules import (  # noqa: F401 (re-exported)
    broadcast_matmul_hazards,
    is_broadcast_matmul_hazard,
    onednn_enabled,
    owned_trainable,
)

METHODS = ("loop", "map_fn", "vectorized", "jacobian", "outer")
NORM_METHODS = ("ghost",) + METHODS
MAP_FN_PARALLEL_ITERATIONS = 8

_cache = weakref.WeakKeyDictionary()  # model -> {key: tf.function}
# layer -> "ghost" or "materialised", as the last traced norm chose (weak keys: a freed layer's
# entry goes with it)
_TRACED_NORMS = weakref.WeakKeyDictionary()


# --------------------------------------------------------------------------- input checks


def _layers(model):
    return model._flatten_layers(include_self=False)  # pylint: disable=protected-access


_RATE_ATTRIBUTES = ("rate", "dropout", "recurrent_dropout", "stddev", "_dropout")


def _random_layers(model):
    """Layers that draw random numbers when training (Dropout, GaussianNoise, ...): those with a
    seed generator, unless every rate they have is 0 (an ``LSTM`` with ``dropout=0`` holds a
    generator but draws nothing)."""
    found = []
    for layer in _layers(model):
        if not any(isinstance(v, keras.random.SeedGenerator) for v in vars(layer).values()):
            continue
        rates = [getattr(layer, name) for name in _RATE_ATTRIBUTES
                 if isinstance(getattr(layer, name, None), (int, float))]
        if not rates or any(rate > 0 for rate in rates):
            found.append(layer)
    return found


def _grouped_convolutions(model):
    return [layer for layer in _layers(model)
            if hasattr(layer, "filters") and getattr(layer, "groups", 1) > 1
            and layer.trainable and layer.trainable_variables]


def _check_call(model, loss_fn, x, y, training, method, methods):
    """Validate arguments and return ``(x, y, batch_size)`` as tensors. ``batch_size`` is None
    when traced with an unknown batch size; the batch checks then run with the graph."""
    if method not in methods:
        raise ValueError(f"unknown method {method!r}; choose one of {methods}")
    check_model(model, loss_fn, training, method)
    check_present(x, "x")
    check_present(y, "y")
    x, y = as_tensors(x), as_tensors(y)
    bx, by = batch_size_of(x, "x"), batch_size_of(y, "y")
    if None not in (bx, by) and bx != by:
        raise ValueError(f"x has {bx} examples but y has {by}; they must match")
    if bx == 0 or by == 0:
        raise ValueError("the batch is empty (0 examples); per-example gradients need at least one")
    if None in (bx, by):
        _assert_batch_at_run_time(x, y)
    if bx is None and method == "loop":
        raise ValueError(
            "method='loop' runs a Python loop over the examples, so it needs the batch size "
            "while tracing, but x has an unknown batch size (a tf.function traced with None "
            "batch). Give the tf.function an input_signature with a fixed batch size, e.g. "
            "tf.TensorSpec([32, ...]), call it eagerly, or use method='map_fn' (the same loop "
            "inside the graph).")
    return x, y, bx if bx is not None else by


def _assert_batch_at_run_time(x, y):
    """For a batch size unknown while tracing: x and y must agree and not be empty."""
    bx, by = tf.shape(tf.nest.flatten(x)[0])[0], tf.shape(tf.nest.flatten(y)[0])[0]
    tf.debugging.assert_equal(bx, by, message="x and y have different numbers of examples; "
                                              "they must match")
    tf.debugging.assert_positive(bx, message="the batch is empty (0 examples); per-example "
                                             "gradients need at least one")


def check_model(model, loss_fn, training, method):
    """Raise ValueError (TypeError for a model or loss of the wrong kind), naming the fix, for a
    loss or model that ``method`` would get wrong:
    a loss that reduces over the batch, grouped convolutions under pfor, BatchNormalization or
    random layers in training mode where they break per-example gradients. Shape checks
    need the batch and live in the callers.

    Raises:
      TypeError: ``model`` is not a Keras model or layer (a plain function, a list of
        layers), or ``loss_fn`` cannot be called.
      ValueError: ``loss_fn`` is a string (such as ``"sparse_categorical_crossentropy"``: pass
        the loss object with ``reduction=None``), or as described above.

    Example:
      >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
      >>> check_model(model, "mse", training=False,
      ...             method="outer")  # doctest: +NORMALIZE_WHITESPACE
      Traceback (most recent call last):
      ...
      ValueError: loss_fn is the string 'mse', but per-example gradients need a loss object that
      returns one loss per example: pass keras.losses.MeanSquaredError(reduction=None), or a
      function loss_fn(y_true, y_pred) -> [B].
    """
    check_keras_model(model)
    check_loss_fn(loss_fn)
    if not model.trainable_variables:
        raise ValueError(
            "the model has no trainable variables (is it built? call it once on a batch)")
    reduction = getattr(loss_fn, "reduction", None)
    if isinstance(loss_fn, keras.losses.Loss) and reduction not in (None, "none"):
        raise ValueError(
            f"loss_fn {type(loss_fn).__name__} reduces over the batch (reduction={reduction!r}), "
            "so it returns one number for the batch, not the one loss per example that "
            "per-example gradients need (with a mean, one-pass methods would get 1/B of each "
            "gradient). Pass "
            f"{type(loss_fn).__name__}(reduction=None), which returns one loss per example."
        )
    grouped = _grouped_convolutions(model)
    if method in ("outer", "ghost"):  # only those that fall back to vectorized_map
        grouped = [layer for layer in grouped if layer_rules.rule_for(layer) is None]
    if grouped and method != "loop" and method != "map_fn":
        names = [layer.name for layer in grouped]
        raise ValueError(
            f"layers {names} are grouped convolutions (groups > 1) that would go through "
            "TensorFlow's vectorised filter gradient (tf.vectorized_map, tape.jacobian), which "
            "ignores the groups and returns wrong numbers. Use method='loop' or 'map_fn'; or, "
            "for plain Conv layers (the rule covers groups), method='outer', ghost norms or "
            "clipped_gradient.")
    if training:
        for layer in _layers(model):
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
                raise ValueError(
                    f"layer {layer.name!r} is BatchNormalization in training mode: it normalises "
                    "with statistics of the whole batch, so one example's loss depends on every "
                    "other example: each example's gradient depends on the whole batch, so "
                    "clipping it no longer bounds one example's influence, and the one-pass "
                    "methods, which assume examples do not interact, would get it wrong. Use "
                    "training=False "
                    "(moving statistics), freeze the layer (trainable=False), or use "
                    "LayerNormalization / GroupNormalization instead."
                )
        random_layers = _random_layers(model)
        if random_layers and method == "vectorized":
            names = [layer.name for layer in random_layers]
            raise ValueError(
                f"layers {names} draw random numbers in training mode. Inside tf.vectorized_map "
                "(method 'vectorized') a Keras random layer draws ONE mask for the whole batch, "
                "so every example gets the same dropout pattern. Use method='outer' (layers "
                "with rules read the forward pass's own masks), 'jacobian', 'loop' or 'map_fn', "
                "or training=False."
            )


def per_example_losses(model, loss_fn, x, y, training=False):
    """``loss_fn(y, model(x, training=training))``, checked to be one loss per example.

    The one check, for the whole package, that a loss was built with ``reduction=None``:
    gradient accumulation, pipelines and DP-SGD all sum per-example losses themselves.

    Returns:
      tensor ``[B]``.

    Raises:
      ValueError: the loss has another shape (reduced over the batch, or one loss per time step
        or pixel), with the fix for each.

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> per_example_losses(model, keras.losses.MeanSquaredError(reduction=None),
      ...                    tf.zeros((5, 3)), tf.zeros((5, 2))).shape
      TensorShape([5])
    """
    losses = loss_fn(y, model(x, training=training))
    batch = tf.nest.flatten(x)[0].shape[0]
    message = (f"loss_fn must return per-example losses of shape [B] = [{batch}]; it returned "
               f"shape {losses.shape}. If it reduces over the batch (a mean or sum over axis 0), "
               "use reduction=None; if it returns one loss per time step or pixel, reduce over "
               "those axes inside loss_fn.")
    if losses.shape.rank != 1 or (None not in (batch, losses.shape[0]) and
                                  losses.shape[0] != batch):
        raise ValueError(message)
    if None in (batch, losses.shape[0]):  # shapes relaxed by tf.function: check when it runs
        tf.debugging.assert_equal(tf.shape(losses)[0], tf.shape(tf.nest.flatten(x)[0])[0],
                                  message=message)
    return losses


def _densify(grads, variables, batch_shape=None):
    """Gradients as dense tensors in each variable's dtype; a variable the loss does not reach
    gets zeros (``batch_shape + variable.shape``) and one warning (Keras's ``fit`` likewise
    warns, and skips such variables)."""
    layer_rules.warn_unreached([v for g, v in zip(grads, variables, strict=True) if g is None])
    return [tf.zeros(v.shape if batch_shape is None else tf.concat([batch_shape, v.shape], 0),
                     v.dtype) if g is None
            else tf.cast(tf.convert_to_tensor(g), v.dtype)
            for g, v in zip(grads, variables, strict=True)]


def _cached(model, key, build):
    """One traced function per model and key. The key includes the trainable set and the rule
    registry's version, so freezing or unfreezing a layer, or registering a rule, builds a new
    function instead of reusing a stale one."""
    per_model = _cache.setdefault(model, {})
    key = key + (tuple(id(v) for v in model.trainable_variables), layer_rules.registry_version())
    if key not in per_model:
        per_model[key] = build()
    return per_model[key]


# ------------------------------------------------------- a TensorFlow bug we refuse to return


def _refuse_hazards():
    """Raise, while a function is being traced, if its graph holds a hazardous matmul."""
    hazards = broadcast_matmul_hazards(tf.compat.v1.get_default_graph())
    if hazards:
        raise ValueError(
            "TensorFlow's oneDNN kernel computes this broadcast batch matmul wrongly, or "
            f"corrupts memory (tensorflow/tensorflow#117700): {hazards[:3]}. gradtut refuses "
            "rather than return its numbers. Use per_example_gradients with method='loop' or "
            "'map_fn', or the one-pass methods (outer, ghost norms, clipped_gradient), which "
            "never vectorise the whole model (per_example_plan shows each layer's path); or "
            "start Python with TF_ENABLE_ONEDNN_OPTS=0.")


def _checked_function(python_fn, **kwargs):
    """``tf.function(python_fn)``, whose graph is checked for :func:`broadcast_matmul_hazards`
    when it is traced, before it ever runs (so the check costs nothing per call)."""

    @functools.wraps(python_fn)  # keeps python_fn's signature: cheaper calls than *args
    def traced(*args):
        out = python_fn(*args)
        _refuse_hazards()
        return out

    function = tf.function(traced, **kwargs)

    def call(*args):
        try:
            return function(*args)
        except ValueError as err:  # raised while tracing: AutoGraph prefixes a traceback
            text = str(err)
            if not text.startswith("in user code"):
                raise
            raise ValueError(
                text[text.rfind("ValueError: ") + len("ValueError: "):].strip()) from err

    return call


# ------------------------------------------------------------- per-example, by differentiation


def _one_example_gradients(model, loss_fn, variables, training):
    """``f(x_i, y_i) -> [dL_i/dv for v in variables]`` for one example without batch dim."""

    def gradients(xi, yi):
        xb = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), xi)
        yb = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), yi)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(per_example_losses(model, loss_fn, xb, yb, training))
        return _densify(tape.gradient(loss, variables), variables)

    return gradients


def _loop(model, loss_fn, x, y, training, variables):
    step = _cached(model, ("loop", loss_fn, training), lambda: _checked_function(
        _one_example_gradients(model, loss_fn, variables, training)))
    batch = batch_size_of(x, "x")
    rows = [step(tf.nest.map_structure(lambda t, i=i: t[i], x),
                 tf.nest.map_structure(lambda t, i=i: t[i], y))
            for i in range(batch)]
    return [tf.stack(per_var) for per_var in zip(*rows, strict=True)]


def _vectorized_fn(model, loss_fn, training, variables):
    one = _one_example_gradients(model, loss_fn, variables, training)

    def vectorized(x, y):
        return tf.vectorized_map(lambda xy: one(*xy), (x, y), fallback_to_while_loop=True)

    # Traced for each batch shape (no shape relaxation), so that the graph carries the real
    # shapes that broadcast_matmul_hazards needs in order to tell a hazard from a safe matmul.
    return _checked_function(vectorized)


def _vectorized(model, loss_fn, x, y, training, variables):
    fn = _cached(model, ("vectorized", loss_fn, training),
                 lambda: _vectorized_fn(model, loss_fn, training, variables))
    return fn(x, y)


def _map_fn(model, loss_fn, x, y, training, variables):
    def build():
        one = _one_example_gradients(model, loss_fn, variables, training)
        # Every entry needs a shape: a bare tf.TensorSpec(dtype=...) raises TypeError.
        signature = [tf.TensorSpec(v.shape, v.dtype) for v in variables]

        def mapped(x, y):
            # tf.map_fn sets a caching device on the variable scope and resets it only when fn
            # returns; if fn raises, every later MirroredStrategy().scope() in the process
            # fails ("Caching devices is not yet supported"). Restore it whatever happens.
            scope = tf.compat.v1.get_variable_scope()
            before = scope.caching_device
            try:
                return tf.map_fn(lambda xy: one(*xy), (x, y), fn_output_signature=signature,
                                 parallel_iterations=MAP_FN_PARALLEL_ITERATIONS)
            finally:
                scope.set_caching_device(before)

        return _checked_function(mapped, reduce_retracing=True)

    return _cached(model, ("map_fn", loss_fn, training), build)(x, y)


def _jacobian(model, loss_fn, x, y, training, variables):
    def build():
        def jacobian(x, y):
            with tf.GradientTape() as tape:
                losses = per_example_losses(model, loss_fn, x, y, training)
            return _densify(tape.jacobian(losses, variables, experimental_use_pfor=True),
                            variables, tf.shape(losses))

        return _checked_function(jacobian)  # one trace per batch shape, as in _vectorized_fn

    return _cached(model, ("jacobian", loss_fn, training), build)(x, y)


# ------------------------------------------------ one backward pass: the layer rules


def _one_pass(model, loss_fn, x, y, training):
    return layer_rules.one_pass(model, lambda: per_example_losses(model, loss_fn, x, y, training))


def _outer(model, loss_fn, x, y, training, variables):
    def build():
        def outer(x, y):
            layers, losses, rest = _one_pass(model, loss_fn, x, y, training)
            found = {}
            for layer, rule, pairs in layers:  # a variable two units share: their sum
                _accumulate(found, layer_rules.per_example_of(layer, rule, pairs))
            _accumulate(found, {id(v): t for v, t in rest})
            batch = tf.shape(losses)[:1]
            return [tf.cast(found[id(v)], v.dtype) if id(v) in found
                    else tf.zeros(tf.concat([batch, v.shape], 0), v.dtype) for v in variables]

        return _checked_function(outer, reduce_retracing=True)

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
      and dtype ``var_i.dtype``, and entry i row b is ``d loss_b / d var_i``. Their mean over
      the batch is the gradient of the mean loss.

    Raises:
      ValueError: unknown method; a loss that reduces over the batch or does not return ``[B]``;
        x and y with different or zero batch sizes;
        BatchNormalization in training mode; random layers (Dropout) in training mode under a
        method that would share one mask across the batch; grouped convolutions under
        ``"vectorized"`` or ``"jacobian"``; a graph that hits TensorFlow's oneDNN matmul bug
        (:func:`broadcast_matmul_hazards`). Each message names the layer and the fix. Also
        ``x`` or ``y`` None; a loss given by name (``"sparse_categorical_crossentropy"``: pass
        the loss object with ``reduction=None``); ``method="loop"`` inside a ``tf.function``
        traced with an unknown batch size (the other methods work there).
      TypeError: ``model`` is not a Keras model (a plain function, a list of layers), or
        ``loss_fn`` cannot be called.

    Example:
      >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
      >>> loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
      >>> x, y = tf.ones([5, 4]), tf.constant([0, 1, 2, 0, 1])
      >>> grads = per_example_gradients(model, loss, x, y, method="outer")
      >>> [g.shape for g in grads]
      [TensorShape([5, 4, 3]), TensorShape([5, 3])]
    """
    x, y, _ = _check_call(model, loss_fn, x, y, training, method, METHODS)
    return _IMPLEMENTATIONS[method](model, loss_fn, x, y, training, model.trainable_variables)


def _norm_dtype(model):
    return (tf.float64 if any(v.dtype == "float64" for v in model.trainable_variables)
            else tf.float32)


def _norms_from_grads(model, grads):
    dtype = _norm_dtype(model)
    return tf.sqrt(tf.add_n([tf.cast(layer_rules.squared_norms(g), dtype) for g in grads]))


def _accumulate(found, grads):
    """Add ``{id(variable): tensor}`` into ``found``: a variable that two units own (a tied
    weight assigned as an attribute of a second layer) gets the sum of their parts."""
    for key, t in grads.items():
        found[key] = found[key] + t if key in found else t


def _shared_variables(layers):
    """ids of variables that more than one recorded unit covers."""
    seen, shared = set(), set()
    for layer, rule, _ in layers:
        for v in rule.variables(layer):
            (shared if id(v) in seen else seen).add(id(v))
    return shared


def _ghost_sq_norms_fn(model, loss_fn, training):
    """A function returning (recorded layers, materialised per-example gradients, ``[B]``
    squared norms, ``[B]`` losses), for use inside a tf.function. The materialised gradients
    (``{id(variable): [B, *shape]}``) are those of covered layers without a cheaper ghost form
    and of the fallback variables: a clipped sum reuses them."""

    def ghost(x, y):
        layers, losses, rest = _one_pass(model, loss_fn, x, y, training)
        dtype = _norm_dtype(model)
        trainable = {id(v) for v in model.trainable_variables}
        shared = _shared_variables(layers)  # their norms need the summed gradient
        parts, materialised = [], {}
        for layer, rule, pairs in layers:
            sq = (None if any(id(v) in shared for v in rule.variables(layer))
                  else layer_rules.ghost_sq_norms_of(layer, rule, pairs, trainable))
            _TRACED_NORMS[layer] = "materialised" if sq is None else "ghost"
            if sq is None:
                _accumulate(materialised, {
                    k: t for k, t in layer_rules.per_example_of(layer, rule, pairs).items()
                    if k in trainable})
            else:
                parts.append(tf.cast(sq, dtype))
        _accumulate(materialised, {id(v): t for v, t in rest})
        parts += [tf.cast(layer_rules.squared_norms(t), dtype) for t in materialised.values()]
        sq = tf.add_n(parts) if parts else tf.zeros(tf.shape(losses), dtype)
        return layers, materialised, sq, losses

    return ghost


def per_example_gradient_norms(model, loss_fn, x, y, method="ghost", *, training=False):
    """L2 norm, over all trainable variables together, of each example's gradient.

    Args:
      model, loss_fn, x, y, training: as in :func:`per_example_gradients`.
      method: ``"ghost"`` (default) or any method of :func:`per_example_gradients`. ``"ghost"``
        runs one forward and one backward pass. Layers whose plan says ghost (Embedding
        always; Dense, EinsumDense and convolutions whose gradient is larger than their record
        of the example, ``d_in d_out > T (d_in + d_out)``, which implies that the Gram form
        also saves memory) never materialise their per-example gradients;
        other covered layers, and layers without a rule (the layer-local path), materialise
        theirs.
        :func:`per_example_plan` shows which layer does what.

    Returns:
      ``[B]`` float tensor of norms (float32, or float64 for a float64 model).

    Raises:
      ValueError: as :func:`per_example_gradients`.

    Example:
      >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])
      >>> loss = lambda y, p: tf.reduce_sum(p, axis=1)  # per-example gradients: the rows of x
      >>> x, y = tf.constant([[3.0, 4.0], [0.3, 0.4]]), tf.zeros([2])
      >>> [round(float(n), 4) for n in per_example_gradient_norms(model, loss, x, y)]
      [5.0, 0.5]
    """
    x, y, _ = _check_call(model, loss_fn, x, y, training, method, NORM_METHODS)
    if method != "ghost":  # arguments are checked: go straight to the implementation
        return _norms_from_grads(model, _IMPLEMENTATIONS[method](
            model, loss_fn, x, y, training, model.trainable_variables))

    def build():
        ghost = _ghost_sq_norms_fn(model, loss_fn, training)
        return _checked_function(lambda x, y: tf.sqrt(ghost(x, y)[2]), reduce_retracing=True)

    return _cached(model, ("ghost", loss_fn, training), build)(x, y)


def make_clipped_sum(model, loss_fn, training=False, with_outputs=False):
    """``f(x, y, clip) -> sum_b g_b * min(1, clip / ||g_b||)``: the sum of per-example gradients
    clipped to norm ``clip``, one tensor per trainable variable (in its dtype), for use inside a
    ``tf.function``. Built from ghost norms and one reweighted sum per layer, so a layer whose
    norm is ghost in :func:`per_example_plan` never materialises its per-example gradients.
    The others (rules without a ghost form, or whose ghost form would cost more, such as a
    Dense layer on long sequences, and fallback variables)
    materialise theirs once, for their norms, and the weighted sum reuses them: they are held
    together until every norm is known, ``B x`` their parameter count in all
    (:func:`per_example_plan` shows which layers these are).

    With ``with_outputs=True``, ``f`` returns ``(gradients, losses, predictions)``: the
    ``[B]`` per-example losses and the model's outputs from the same forward pass (a training
    step reports them without a second forward pass).

    The model and loss are checked here (:func:`check_model`); ``x``, ``y`` and ``clip`` are
    not: :func:`clipped_gradient` and ``gradtut.privacy`` check them.

    Raises:
      TypeError, ValueError: as :func:`check_model`.

    Example:
      >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])
      >>> clipped_sum = make_clipped_sum(model, lambda y, p: tf.reduce_sum(p, axis=1))
      >>> x = tf.constant([[3.0, 4.0], [0.3, 0.4]])  # per-example gradients x_b: norms 5, 0.5
      >>> (kernel,) = clipped_sum(x, tf.zeros([2]), 1.0)  # the first is scaled by 1/5
      >>> [round(float(v), 4) for v in tf.reshape(kernel, [-1])]
      [0.9, 1.2]
    """
    check_model(model, loss_fn, training, "ghost")
    outputs = {}

    def recording_loss(y_true, y_pred):  # the one-pass forward calls it first: keep that call's
        outputs.setdefault("predictions", y_pred)
        return loss_fn(y_true, y_pred)

    ghost = _ghost_sq_norms_fn(model, recording_loss if with_outputs else loss_fn, training)

    def clipped_sum(x, y, clip):
        outputs.clear()
        layers, materialised, sq, losses = ghost(x, y)
        norms = tf.sqrt(sq)
        weights = tf.minimum(tf.ones_like(norms),
                             tf.cast(clip, norms.dtype) / tf.maximum(norms, 1e-12))
        found = {}
        for layer, rule, pairs in layers:
            if not any(id(v) in materialised for v in rule.variables(layer)):
                found.update(layer_rules.weighted_sum_of(layer, rule, pairs, weights))
        for key, t in materialised.items():  # sum_b w_b g_b from gradients already at hand
            found[key] = tf.tensordot(tf.cast(weights, t.dtype), t, axes=1)
        grads = [tf.cast(found[id(v)], v.dtype) if id(v) in found else tf.zeros_like(v)
                 for v in model.trainable_variables]
        return (grads, losses, outputs["predictions"]) if with_outputs else grads

    return clipped_sum


def clipped_gradient(model, loss_fn, x, y, l2_norm_clip, noise_multiplier=0.0, seed=None, *,
                     training=False):
    """The DP-SGD gradient: mean of per-example gradients clipped to ``l2_norm_clip``, plus noise.

    ``mean_b( g_b * min(1, C / ||g_b||) ) + N(0, (noise_multiplier * C / B)^2)`` per coordinate,
    where ``g_b`` is example b's gradient over all trainable variables and ``C = l2_norm_clip``.
    Computed from ghost norms and one reweighted sum per layer (for Dense: a matmul of the
    recorded layer inputs with the clip-weighted output gradients), so per-example gradients
    of layers whose norm is ghost in :func:`per_example_plan` are never materialised.

    Args:
      model, loss_fn, x, y, training: as in :func:`per_example_gradients`.
      l2_norm_clip: positive float C.
      noise_multiplier: non-negative float; 0 gives the clipped mean with no noise.
      seed: int for reproducible noise (stateless random), or None.

    Returns:
      list aligned with ``model.trainable_variables``, each shaped like its variable, in its
      dtype.

    Raises:
      ValueError: ``l2_norm_clip`` not a positive number (None, a string, an array) or
        ``noise_multiplier`` not a number ``>= 0``; ``seed`` not None or an int ``>= 0``; and as
        :func:`per_example_gradients`.

    Example:
      >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])
      >>> loss = lambda y, p: tf.reduce_sum(p, axis=1)  # per-example gradients: the rows of x
      >>> x, y = tf.constant([[3.0, 4.0], [0.3, 0.4]]), tf.zeros([2])
      >>> (kernel,) = clipped_gradient(model, loss, x, y, l2_norm_clip=1.0)
      >>> [round(float(v), 4) for v in tf.reshape(kernel, [-1])]  # mean of [.6, .8], [.3, .4]
      [0.45, 0.6]
      >>> noisy = clipped_gradient(model, loss, x, y, 1.0, noise_multiplier=1.1, seed=0)
      >>> noisy[0].shape
      TensorShape([2, 1])
    """
    l2_norm_clip, noise_multiplier = _check_clip_and_noise(l2_norm_clip, noise_multiplier)
    seed = check_seed(seed)
    x, y, _ = _check_call(model, loss_fn, x, y, training, "ghost", NORM_METHODS)

    def build():
        clipped_sum = make_clipped_sum(model, loss_fn, training)

        def clipped(x, y, clip, noise, seed):
            batch = tf.shape(tf.nest.flatten(x)[0])[0]
            grads = [g / tf.cast(batch, g.dtype) for g in clipped_sum(x, y, clip)]
            if noise is None:
                return grads
            noise_std = noise / tf.cast(batch, noise.dtype)  # noise_multiplier * C / B
            if seed is None:  # traced once per case: a Python None is part of the signature
                return [g + tf.random.normal(tf.shape(g), stddev=tf.cast(noise_std, g.dtype),
                                             dtype=g.dtype) for g in grads]
            return [g + tf.random.stateless_normal(tf.shape(g), seed=tf.stack([seed, i]),
                                                   stddev=tf.cast(noise_std, g.dtype),
                                                   dtype=g.dtype)
                    for i, g in enumerate(grads)]

        return _checked_function(clipped, reduce_retracing=True)

    fn = _cached(model, ("clipped", loss_fn, training), build)
    noise = noise_multiplier * l2_norm_clip
    return fn(x, y, tf.constant(l2_norm_clip, tf.float64),
              tf.constant(noise, tf.float64) if noise else None,
              None if seed is None else tf.constant(seed, tf.int64))


def _check_clip_and_noise(l2_norm_clip, noise_multiplier):
    """``(l2_norm_clip, noise_multiplier)`` as floats, checked: C > 0 and sigma >= 0, finite."""
    l2_norm_clip = check_real(l2_norm_clip, "l2_norm_clip")
    if not l2_norm_clip > 0:
        raise ValueError(f"l2_norm_clip must be positive, got {l2_norm_clip!r}; pass the clip "
                         "norm C, such as 1.0")
    noise_multiplier = check_real(noise_multiplier, "noise_multiplier")
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}; pass 0.0 "
                         "for no noise")
    return l2_norm_clip, noise_multiplier


# ------------------------------------------------------------------------------- the plan


def ghost_norm_plan(model):
    """Which rule computes each trainable layer's per-example gradients and norms.

    Returns:
      dict ``{layer path: rule}`` for every unit of :func:`gradtut.layer_rules.covered_layers`
      (layers that own trainable variables, and recurrent layers), where rule is a rule name
      from :mod:`gradtut.layer_rules` (``"dense"``, ``"einsum_dense"``, ``"embedding"``,
      ``"conv2d"``, ``"layer_normalization"``, ...) or ``"layer-local"`` (no rule: that layer's
      own variables are materialised from its own recorded inputs).

    Raises:
      TypeError: ``model`` is not a Keras model.

    Example:
      >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="hidden"),
      ...                           keras.layers.PReLU(name="prelu"),
      ...                           keras.layers.Dense(3, name="out")])
      >>> ghost_norm_plan(model)
      {'hidden': 'dense', 'prelu': 'layer-local', 'out': 'dense'}
    """
    check_keras_model(model)
    paths = layer_rules.layer_paths(model)
    return {paths[id(layer)]: rule.name for layer, rule in layer_rules.covered_layers(model)}


class Plan(list):
    """Rows ``(layer, class, rule, norm)``; prints as a table.

    Raises:
      TypeError: ``rows`` is not an iterable of rows.
      ValueError: a row is not a 4-tuple ``(layer, class, rule, norm)``.

    Example:
      >>> print(Plan([("dense", "Dense", "dense", "ghost")]))
      layer  class  rule   norm
      dense  Dense  dense  ghost
      1 layers: 1 ghost, 0 materialised by its rule, 0 layer-local, 0 unreached (zero)
    """

    def __init__(self, rows=()):
        try:
            rows = list(rows)
        except TypeError:
            raise TypeError(f"Plan takes an iterable of (layer, class, rule, norm) rows, got "
                            f"{type(rows).__name__}") from None
        for row in rows:
            if not isinstance(row, tuple) or len(row) != 4:
                raise ValueError(f"each Plan row must be a 4-tuple (layer, class, rule, norm), "
                                 f"got {row!r}")
        super().__init__(rows)

    def __str__(self):
        header = ("layer", "class", "rule", "norm")
        widths = [max(len(str(r[i])) for r in [header, *self]) for i in range(4)]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                 for row in [header, *self]]
        return "\n".join(lines + [self.summary()])

    def summary(self):
        """One line: how many layers are ghost, materialised by a rule, layer-local (by
        path), unreached and frozen."""
        count = {"ghost": 0, "rule": 0, "local": 0, "unreached": 0, "frozen": 0}
        paths = {}
        for _, _, rule, norm in self:
            if norm == "zero (unreached)":
                count["unreached"] += 1
            elif norm == "-":
                count["frozen"] += 1
            elif str(rule).startswith("layer-local"):
                count["local"] += 1
                path = str(rule).split(": ", 1)[1].split(" (")[0] if ": " in str(rule) else (
                    "not yet traced")
                paths[path] = paths.get(path, 0) + 1
            elif norm == "ghost":
                count["ghost"] += 1
            else:
                count["rule"] += 1
        local = ", ".join(f"{n} {path}" for path, n in paths.items())
        line = (f"{len(self)} layers: {count['ghost']} ghost, {count['rule']} materialised by "
                f"its rule, {count['local']} layer-local" + (f" ({local})" if local else "")
                + f", {count['unreached']} unreached (zero)")
        return line + (f", {count['frozen']} frozen" if count["frozen"] else "")

    def _repr_pretty_(self, printer, cycle):  # IPython shows the table
        printer.text(str(self))


def per_example_plan(model):
    """A table, one row per layer that has variables of its own: how its per-example gradients
    are computed, and whether its norm is ghost (never materialised) or materialised; then one
    summary line.

    Rows are ``(layer path, class name, rule, norm)``. ``rule`` is the registered rule's name;
    ``"layer-local: vectorized_map (why)"`` or ``"layer-local: loop over examples (why)"`` for
    a layer without a rule (``"layer-local (no rule: ...)"`` until a function using it has
    been traced, which decides the path); or ``"no trainable variables"`` (a frozen layer).
    ``norm`` is ``"ghost"``, ``"materialised"``, ``"zero (unreached)"`` (the loss did not
    reach its variables in a traced call) or ``"-"``. For convolutions, Dense and EinsumDense
    on sequences the choice is the one the last traced ghost norm or clipped gradient made,
    and before any, the one the layer's built input shape gives (ghost when
    ``d p > T (d + p)``, see ``layer_rules.common._ghost_is_cheaper``;
    materialised where a length was unknown when built). A layer with a frozen variable
    (``variable.trainable = False``) is materialised. So is a layer called several times whose
    rule cannot merge the calls (a convolution), which the plan cannot see: it follows the
    built shape there.

    Raises:
      TypeError: ``model`` is not a Keras model.

    Example:
      >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="hidden"),
      ...                           keras.layers.LayerNormalization(name="norm"),
      ...                           keras.layers.PReLU(name="prelu")])
      >>> print(per_example_plan(model))  # doctest: +NORMALIZE_WHITESPACE
      layer   class               rule                                        norm
      hidden  Dense               dense                                       ghost
      norm    LayerNormalization  layer_normalization                         materialised
      prelu   PReLU               layer-local (no rule registered for PReLU)  materialised
      3 layers: 1 ghost, 1 materialised by its rule, 1 layer-local (1 not yet traced),
      0 unreached (zero)
    """
    check_keras_model(model)
    rows = Plan()
    units = {id(layer): rule for layer, rule in layer_rules.covered_layers(model)}
    inside_rnn = {id(sub) for layer in [model, *_layers(model)] if layer_rules.is_recurrent(layer)
                  for sub in layer._flatten_layers(include_self=False)}  # pylint: disable=protected-access
    paths = layer_rules.layer_paths(model)
    for layer in [model, *_layers(model)]:
        if id(layer) in inside_rnn:
            continue
        rule = units.get(id(layer))
        own = rule.variables(layer) if rule is not None else owned_trainable(layer)
        if own:
            rows.append((paths[id(layer)], type(layer).__name__, _plan_rule_name(layer, rule),
                         _plan_norm(layer, rule, own)))
        elif layer is not model and not layer_rules.is_recurrent(layer) and _owns_weights(layer):
            rows.append((paths[id(layer)], type(layer).__name__, "no trainable variables", "-"))
    return rows


def _owns_weights(layer):
    """Whether the layer holds variables of its own (frozen ones included), not only through
    sub-layers (a Flatten, or a block made of sub-layers, has none)."""
    inner = {id(w) for sub in layer._flatten_layers(include_self=False)  # pylint: disable=protected-access
             for w in sub.weights}
    return any(id(v) not in inner for v in layer.weights)


def _plan_norm(layer, rule, own):
    """The plan's norm column for a layer whose variables ``own`` train."""
    if all(id(v) in layer_rules.engine.UNREACHED for v in own):
        return "zero (unreached)"
    if isinstance(rule, layer_rules.LocalRule):
        return "materialised"
    if layer in _TRACED_NORMS:  # what the last traced norm chose
        return _TRACED_NORMS[layer]
    shape = next(iter((getattr(layer, "_build_shapes_dict", None) or {}).values()), None)
    ghost = (shape is not None and rule.ghost(layer, tuple(shape))
             and all(v.trainable for v in rule.variables(layer)))
    return "ghost" if ghost else "materialised"


def _plan_rule_name(layer, rule):
    """The plan's rule column: the rule's name, or the layer-local path and why."""
    if not isinstance(rule, layer_rules.LocalRule):
        return rule.name
    why = ("recurrent: its cell runs in a loop over time steps"
           if layer_rules.is_recurrent(layer) else layer_rules.explain(layer)[1])
    path, detail = layer_rules.LocalRule.paths.get(layer, (None, None))
    why = f"{why}; {detail}" if detail else why
    return f"layer-local: {path} ({why})" if path else f"layer-local ({why})"
