"""One recorded forward and backward pass, and the per-layer results it gives (notebook 01,
sections 6-7)."""
import contextlib
import warnings
import weakref

import keras
import tensorflow as tf

from gradtut.layer_rules.local import LocalRule, is_recurrent, owned_trainable
from gradtut.layer_rules.registry import LayerRule, _check_layer, rule_for

# ---------------------------------------------------------------------- one recorded pass


@contextlib.contextmanager
def recording(layers, calls):
    """Route each ``(layer, rule)``'s ``call`` through ``rule.record``, appending
    ``(layer, rule, a, z)`` to ``calls`` on every call; restore the layers afterwards.

    Raises:
      TypeError: ``layers`` is not a list of ``(layer, rule)`` pairs (as
        :func:`covered_layers` returns), or ``calls`` is not a list.

    Example:
      >>> dense = keras.layers.Dense(2)
      >>> dense.build((None, 3))
      >>> calls = []
      >>> with recording([(dense, rule_for(dense))], calls):
      ...     _ = dense(tf.ones([4, 3]))
      >>> [(layer.name == dense.name, tuple(a.shape), tuple(z.shape)) for layer, _, a, z in calls]
      [(True, (4, 3), (4, 2))]
    """
    layers = list(layers) if isinstance(layers, (list, tuple)) else layers
    if not isinstance(layers, list) or not all(
            isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], keras.layers.Layer)
            and isinstance(pair[1], LayerRule) for pair in layers):
        raise TypeError(f"recording takes a list of (layer, rule) pairs, as covered_layers(model) "
                        f"returns; got {layers!r:.120}")
    if not isinstance(calls, list):
        raise TypeError(f"calls must be a list to append the recorded calls to, got "
                        f"{type(calls).__name__}")
    patched = []

    def recorder(layer, rule):
        def call(*args, **kwargs):
            out, a, z = rule.record(layer, args, kwargs)
            calls.append((layer, rule, a, z))
            return out

        return call

    try:
        for layer, rule in layers:
            layer.call = recorder(layer, rule)
            patched.append(layer)
        yield
    finally:
        for layer in patched:
            del layer.call


def covered_layers(model):
    """``[(layer, rule)]``: every layer of ``model`` (the model itself included) whose
    trainable variables a rule covers, and every layer that owns trainable variables without a
    rule, paired with a :class:`~gradtut.layer_rules.local.LocalRule`. A recurrent layer is one
    unit with its cell's variables; layers inside it are not listed.

    Raises:
      TypeError: ``model`` is not a Keras model (or layer).

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
      ...                           keras.layers.PReLU(), keras.layers.Dense(2)])
      >>> [rule.name for _, rule in covered_layers(model)]
      ['dense', 'layer-local', 'dense']
    """
    _check_layer(model, "covered_layers", "model")
    units, seen = [], set()

    def visit(layer):
        if id(layer) in seen:  # one layer reached twice (a shared or tied layer): one unit
            return
        seen.add(id(layer))
        if is_recurrent(layer):
            if layer.trainable_variables:
                units.append((layer, LocalRule()))
            return
        rule = rule_for(layer)
        if rule is not None:
            units.append((layer, rule))
        elif layer.trainable and owned_trainable(layer):
            units.append((layer, LocalRule()))
        for child in layer._flatten_layers(include_self=False, recursive=False):  # pylint: disable=protected-access
            visit(child)

    visit(model)
    for i, (layer, rule) in enumerate(units):  # a local layer re-runs its ruled sub-layers
        if isinstance(rule, LocalRule):
            inside = {id(sub) for sub in layer._flatten_layers(include_self=False)}  # pylint: disable=protected-access
            units[i] = (layer, LocalRule([(sub, r) for sub, r in units
                                          if id(sub) in inside and not isinstance(r, LocalRule)]))
    return units


def layer_paths(model):
    """``{id(layer): "block/sublayer/layer"}``: each layer's path of names inside ``model``
    (the model's own name left out, so paths do not depend on Keras's model counter).

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="out")])
      >>> [layer_paths(model)[id(layer)] for layer in model.layers]
      ['out']
    """
    _check_layer(model, "layer_paths", "model")
    paths = {id(model): model.name}

    def visit(layer, prefix):
        for child in layer._flatten_layers(include_self=False, recursive=False):  # pylint: disable=protected-access
            if id(child) not in paths:
                paths[id(child)] = prefix + child.name
                visit(child, paths[id(child)] + "/")

    visit(model, "")
    return paths


# id(variable) -> variable, for the variables the last traced call found unreached
# (per_example_plan shows them). Weak values: an entry goes when its variable does, so a new
# variable that reuses a freed one's id is never reported by mistake.
UNREACHED = weakref.WeakValueDictionary()


def warn_unreached(variables):
    """One warning naming the trainable variables the loss does not reach (their per-example
    gradients are zero; Keras's ``fit`` likewise warns, and skips such variables).

    Raises:
      TypeError: ``variables`` is not a list of Keras variables.
    """
    if not isinstance(variables, (list, tuple)) or not all(
            isinstance(v, keras.Variable) for v in variables):
        raise TypeError(f"warn_unreached takes a list of Keras variables (model.trainable_"
                        f"variables), got {variables!r:.80}")
    UNREACHED.update((id(v), v) for v in variables)
    if variables:
        warnings.warn(
            f"the loss does not reach {len(variables)} trainable variable(s): "
            f"{[v.path for v in variables]}. Their per-example gradients are zero and add "
            "nothing to the norms. Freeze them (variable.trainable = False, or the layer's) to "
            "silence this.", stacklevel=3)


def one_pass(model, per_example_losses):
    """Run ``per_example_losses()`` (a ``[B]`` tensor) once with covered layers recording, and
    backpropagate its sum once.

    Returns:
      ``(layers, losses, rest)``: ``layers`` is a list of ``(layer, rule, [(a, g), ...])``, one
      entry per covered layer whose output reaches the loss, with ``g`` cast to the layer's
      variable dtype (a list of gradients, one per floating output, for a layer-local one);
      calls whose output does not reach the loss are dropped (they add nothing). ``rest``
      is a list of ``(variable, [B, *variable.shape])`` for the trainable variables that no
      recorded call covers but the loss still reaches (a variable read outside its own
      layer's calls, or a LoRA layer's kernel made trainable again): their per-example
      gradients come from the Jacobian of the losses on this same pass's tape, one backward
      pass per example (slow, but the same forward pass: the same dropout masks, no second
      run of the model). Variables the loss does not reach at all get zero per-example
      gradients and one warning (:func:`warn_unreached`).

    Raises:
      TypeError: ``model`` is not a Keras model, or ``per_example_losses`` is not callable.
      ValueError: ``per_example_losses()`` did not return a ``[B]`` tensor.

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> layers, losses, rest = one_pass(model, lambda: tf.reduce_sum(model(tf.ones([4, 3])), 1))
      >>> [(rule.name, len(pairs)) for _, rule, pairs in layers], tuple(losses.shape), rest
      ([('dense', 1)], (4,), [])
    """
    _check_layer(model, "one_pass", "model")
    if not callable(per_example_losses):
        raise TypeError(f"per_example_losses must be a function () -> [B] losses, got "
                        f"{type(per_example_losses).__name__}")
    units = covered_layers(model)
    # A persistent tape only where a variable outside every unit may need the Jacobian below.
    # On the benchmark MLP at B = 256 (AVX-512 EPYC, medians of 15), outer took 1.10-1.17x a
    # batched-matmul write of its first kernel's per-example gradients with the tape kept
    # (3 runs), and 1.05-1.14x with one backward call on a tape that is not (6 runs).
    owned = {id(v) for layer, rule in units for v in rule.variables(layer)}
    return _one_pass(model, per_example_losses, units,
                     persistent=any(id(v) not in owned for v in model.trainable_variables))


def _one_pass(model, per_example_losses, units, persistent):
    calls = []
    with recording(units, calls), tf.GradientTape(persistent=persistent) as tape:
        losses = per_example_losses()
        if losses.shape.rank != 1:
            raise ValueError(f"per_example_losses() must return one loss per example, shape "
                             f"[B]; it returned shape {losses.shape}")
        total = tf.reduce_sum(losses)
    called = {id(v) for layer, rule, _, _ in calls for v in rule.variables(layer)}
    outside = [v for v in model.trainable_variables if id(v) not in called]
    grads = tape.gradient(total, [z for _, _, _, z in calls] + outside)
    grads, outside_grads = grads[:len(calls)], grads[len(calls):]
    by_layer = {}
    for (layer, rule, a, z), g in zip(calls, grads, strict=True):
        if isinstance(rule, LocalRule):  # one gradient per floating output
            g = None if all(t is None for t in g) else [
                tf.zeros_like(zi) if t is None else t for t, zi in zip(g, z, strict=True)]
        by_layer.setdefault(id(layer), (layer, rule, []))[2].append((a, g))
    layers = []
    for layer, rule, pairs in by_layer.values():
        if isinstance(rule, LocalRule):
            used = [(a, g) for a, g in pairs if g is not None]
        else:
            dtype = rule.variables(layer)[0].dtype
            used = [(_cast_floating(a, dtype), _cast_floating(g, dtype))
                    for a, g in pairs if g is not None]
        if used:
            layers.append((layer, rule, rule.merge(layer, used) if len(used) > 1 else used))
    covered = {id(v) for layer, rule, _ in layers for v in rule.variables(layer)}
    # Variables of a called unit none of whose calls reached the loss get no gradient; the
    # others outside every call were differentiated above, in the same backward pass.
    by_id = {id(v): g for v, g in zip(outside, outside_grads, strict=True)}
    others = [v for v in model.trainable_variables if id(v) not in covered]
    reached = [by_id.get(id(v)) for v in others]
    rest = [v for v, g in zip(others, reached, strict=True) if g is not None]
    if rest and not persistent:  # a unit's variable read outside its (uncalled) layer: again,
        del tape                 # keeping the tape; this pass's results are not used
        return _one_pass(model, per_example_losses, units, persistent=True)
    # A while loop of backward passes, not pfor: vectorising the backward pass of the whole
    # model is what hits tensorflow/tensorflow#117700.
    jacobians = tape.jacobian(losses, rest, experimental_use_pfor=False) if rest else []
    del tape
    unreached = {id(v) for v, g in zip(others, reached, strict=True) if g is None}
    for v in model.trainable_variables:  # reached in this pass: no longer reported unreached
        if id(v) not in unreached:
            UNREACHED.pop(id(v), None)
    warn_unreached([v for v, g in zip(others, reached, strict=True) if g is None])
    return layers, losses, [(v, tf.convert_to_tensor(j))
                            for v, j in zip(rest, jacobians, strict=True)]


def _cast_floating(a, dtype):
    if isinstance(a, (tuple, list)):
        return tuple(_cast_floating(t, dtype) for t in a)
    return tf.cast(a, dtype) if isinstance(a, tf.Tensor) and a.dtype.is_floating else a


def _check_pairs(layer, rule, pairs, what):
    """The arguments of the per-layer functions below: as :func:`one_pass` returns them."""
    _check_layer(layer, what)
    if not isinstance(rule, LayerRule):
        raise TypeError(f"{what} needs the layer's LayerRule (rule_for(layer)), got "
                        f"{type(rule).__name__}")
    if not isinstance(pairs, (list, tuple)) or not pairs or not all(
            isinstance(pair, (tuple, list)) and len(pair) == 2 for pair in pairs):
        raise ValueError(f"{what} needs a non-empty list of (a, g) pairs, one per call of the "
                         f"layer, as one_pass returns them; got {pairs!r:.120}")


def per_example_of(layer, rule, pairs):
    """``{id(variable): [B, *shape]}`` for one layer, summed over its calls.

    Raises:
      TypeError, ValueError: arguments that are not ``(layer, rule, pairs)`` as
        :func:`one_pass` returns them (an empty ``pairs``, a rule that is not a LayerRule).

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> layers, _, _ = one_pass(model, lambda: tf.reduce_sum(model(tf.ones([4, 3])), 1))
      >>> [tuple(t.shape) for t in per_example_of(*layers[0]).values()]
      [(4, 3, 2), (4, 2)]
    """
    _check_pairs(layer, rule, pairs, "per_example_of")
    total = None
    for a, g in pairs:
        grads = _one_per_variable(layer, rule, rule.per_example(layer, a, g), "per_example")
        total = grads if total is None else [t + u for t, u in zip(total, grads, strict=True)]
    return dict(zip(map(id, rule.variables(layer)), total, strict=True))


def _one_per_variable(layer, rule, tensors, method):
    """``tensors``, checked to hold one tensor per variable of ``rule.variables(layer)``."""
    expected = len(rule.variables(layer))
    if len(tensors) != expected:
        raise ValueError(f"rule {rule.name!r} for layer {layer.name!r}: {method} returned "
                         f"{len(tensors)} tensors, but its variables() lists {expected}; "
                         "return one per variable, in the same order")
    return tensors


def ghost_sq_norms_of(layer, rule, pairs, trainable_ids):
    """``[B]`` squared norm of one layer's per-example gradient by the rule's ghost form, or
    None where it has none, where it costs more than materialising (then use
    :func:`per_example_of`), or where the layer has several calls or frozen variables.

    Raises:
      TypeError, ValueError: as :func:`per_example_of`.

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> layers, _, _ = one_pass(model, lambda: tf.reduce_sum(model(tf.ones([4, 3])), 1))
      >>> trainable = {id(v) for v in model.trainable_variables}
      >>> ghost_sq_norms_of(*layers[0], trainable).numpy().tolist()  # (3 + 1) inputs x 2 outputs
      [8.0, 8.0, 8.0, 8.0]
    """
    _check_pairs(layer, rule, pairs, "ghost_sq_norms_of")
    if len(pairs) == 1 and all(id(v) in trainable_ids for v in rule.variables(layer)):
        return rule.sq_norms(layer, *pairs[0])
    return None


def weighted_sum_of(layer, rule, pairs, weights):
    """``{id(variable): sum_b weights[b] * grad_b}`` for one layer, summed over its calls.

    Raises:
      TypeError, ValueError: as :func:`per_example_of`, and ``weights`` not a ``[B]`` vector.

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> layers, _, _ = one_pass(model, lambda: tf.reduce_sum(model(tf.ones([4, 3])), 1))
      >>> sums = weighted_sum_of(*layers[0], tf.constant([1.0, 0.5, 0.5, 0.0]))
      >>> [t.numpy().tolist() for t in sums.values()][1]  # the bias: sum of the weights
      [2.0, 2.0]
    """
    _check_pairs(layer, rule, pairs, "weighted_sum_of")
    if tf.convert_to_tensor(weights).shape.rank != 1:
        raise ValueError(f"weights must be a [B] vector, one weight per example; got shape "
                         f"{tf.convert_to_tensor(weights).shape}")
    dtype = rule.variables(layer)[0].dtype
    total = None
    for a, g in pairs:
        sums = rule.weighted_sum(layer, a, g, tf.cast(weights, dtype))
        sums = _one_per_variable(layer, rule, sums, "weighted_sum")
        total = sums if total is None else [t + u for t, u in zip(total, sums, strict=True)]
    return dict(zip(map(id, rule.variables(layer)), total, strict=True))


def squared_norms(per_example):
    """``[B, ...] -> [B]``: squared L2 norm of each example's slice.

    Raises:
      ValueError: ``per_example`` is a scalar (no batch axis).

    Example:
      >>> squared_norms(tf.constant([[3.0, 4.0], [1.0, 0.0]])).numpy().tolist()
      [25.0, 1.0]
    """
    per_example = tf.convert_to_tensor(per_example)
    if per_example.shape.rank == 0:
        raise ValueError("squared_norms needs per-example values [B, ...] with the batch first; "
                         "got a scalar")
    return tf.reduce_sum(tf.square(per_example), axis=list(range(1, per_example.shape.rank)))
