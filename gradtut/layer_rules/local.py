"""The layer-local path: per-example gradients of one layer without a rule, from its own recorded
inputs and output gradients (notebook 01, section 6).

For a layer without a rule, the one recorded pass keeps the arguments of each call and the
gradient ``g`` of the loss with respect to each of its outputs. Example ``b``'s gradient of the
layer's *own* variables is then the vector-Jacobian product of that layer alone::

    grad_b = d/dw  sum( layer.call(inputs_b) * g_b )

computed for all examples with ``tf.vectorized_map``. The rest of the network is never
re-run, and sub-layers that have rules keep them (they run through their rule's forward, which
avoids the matmul shape TensorFlow's oneDNN kernel gets wrong). Where that one layer cannot be
vectorised correctly (``vectorized_map`` fails on it, as on ``LSTM``'s loop over time steps, or
its graph holds the oneDNN hazard), the same product runs in a ``tf.map_fn`` loop over the
examples, for that layer only. A layer that draws random numbers (dropout in training mode)
inside its own computation is refused: re-running it would draw other numbers than the
forward pass did.

Which arguments of a call are per-example is read from their shapes: a tensor whose first
axis has the batch size (or an unknown size) is sliced per example, anything else is passed
whole. A non-batch tensor argument whose first axis happens to equal the batch size (a
``[T, T]`` mask with ``B == T``) would be sliced wrongly: pass such constants as attributes of
the layer, or give the layer a rule.

Recurrent layers (``keras.layers.RNN`` and its subclasses ``SimpleRNN``, ``GRU``, ``LSTM``)
are one unit with all their cell's variables, because the cell runs inside a loop over time
steps whose tensors cannot be recorded one call at a time. This is the Opacus functorch
fallback (``grad_sample/functorch.py``) in TensorFlow.
"""
import weakref

import keras
import tensorflow as tf

from gradtut.layer_rules.onednn import broadcast_matmul_hazards
from gradtut.layer_rules.registry import LayerRule, _check_layer

MAP_FN_PARALLEL_ITERATIONS = 8


def owned_trainable(layer):
    """The trainable variables a layer owns itself (not through a sub-layer).

    Raises:
      TypeError: ``layer`` is not a Keras layer.

    Example:
      >>> dense = keras.layers.Dense(2)
      >>> dense.build((None, 3))
      >>> [v.name for v in owned_trainable(dense)]
      ['kernel', 'bias']
    """
    _check_layer(layer, "owned_trainable")
    inner = {id(w) for sub in layer._flatten_layers(include_self=False)  # pylint: disable=protected-access
             for w in sub.trainable_variables}
    return [v for v in layer.trainable_variables if id(v) not in inner]


def is_recurrent(layer):
    """Whether the layer runs its cell in a loop over time steps (``keras.layers.RNN``).

    Raises:
      TypeError: ``layer`` is not a Keras layer.

    Example:
      >>> is_recurrent(keras.layers.LSTM(2)), is_recurrent(keras.layers.Dense(2))
      (True, False)
    """
    _check_layer(layer, "is_recurrent")
    return isinstance(layer, keras.layers.RNN)


def _walk_functions(graph, seen=None):
    """The graph and every function graph it calls."""
    seen = set() if seen is None else seen
    if id(graph) in seen:
        return
    seen.add(id(graph))
    yield graph
    for function in getattr(graph, "_functions", {}).values():
        if getattr(function, "graph", None) is not None:
            yield from _walk_functions(function.graph, seen)


def _reached_ops(graph):
    """The ops of ``graph`` that its outputs depend on (data or control), and every op of the
    functions those call. Keras's LSTM traces its dropout mask even with ``training=False``
    and never uses it; such dead ops do not run."""
    todo = [t.op for t in graph.outputs] + list(getattr(graph, "control_outputs", []))
    seen, ops = set(), []
    while todo:
        op = todo.pop()
        if id(op) in seen:
            continue
        seen.add(id(op))
        ops.append(op)
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    called = set()
    for op in ops:
        for attr in op.node_def.attr.values():
            names = [attr.func.name] if attr.HasField("func") else [
                f.name for f in attr.list.func]
            called.update(n for n in names if n)
    functions = getattr(graph, "_functions", {})
    nested = [op for name in called if name in functions
              for g in _walk_functions(functions[name].graph) for op in g.get_operations()]
    return ops + nested


def random_ops(graph):
    """Types of the ops of ``graph`` that draw random numbers and that its outputs depend on.

    Raises:
      TypeError: ``graph`` is not a ``tf.Graph`` (pass ``fn.get_concrete_function(...).graph``).

    Example:
      >>> fn = tf.function(lambda x: x + tf.random.uniform([2]))
      >>> random_ops(fn.get_concrete_function(tf.TensorSpec([2])).graph)
      ['RandomUniform']
    """
    if not isinstance(graph, tf.Graph):
        raise TypeError(f"random_ops needs a tf.Graph (fn.get_concrete_function(...).graph), got "
                        f"{type(graph).__name__}")
    return sorted({op.type for op in _reached_ops(graph)
                   if "Random" in op.type or op.type.startswith("Rng")})


class LocalRule(LayerRule):
    """The layer-local path as a rule: ``a`` is ``(args, kwargs)`` of one call, ``g`` the list
    of gradients of the call's floating outputs. Its norms are always materialised.

    ``paths`` records, per layer, which way its gradients were computed and why (the plan
    shows it): ``("vectorized_map", None)`` or ``("loop over examples", why)``.
    """

    name = "layer-local"
    paths = weakref.WeakKeyDictionary()  # layer -> (path, why); a freed layer's entry goes

    def __init__(self, ruled_sublayers=()):
        pairs = list(ruled_sublayers) if isinstance(ruled_sublayers, (list, tuple)) else None
        if pairs is None or not all(
                isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], keras.layers.Layer)
                and isinstance(p[1], LayerRule) for p in pairs):
            raise TypeError(f"LocalRule takes the (layer, rule) pairs of the layer's ruled "
                            f"sub-layers, as covered_layers returns them; got "
                            f"{ruled_sublayers!r:.80}")
        self.ruled_sublayers = pairs

    def unsupported(self, layer):
        return None

    def variables(self, layer):
        return layer.trainable_variables if is_recurrent(layer) else owned_trainable(layer)

    def record(self, layer, args, kwargs):
        out = type(layer).call(layer, *args, **kwargs)
        flat = tf.nest.flatten(out)
        zs, new = [], []
        for t in flat:
            if isinstance(t, tf.Tensor) and t.dtype.is_floating:
                z = tf.identity(t)
                mask = getattr(t, "_keras_mask", None)
                if mask is not None:
                    z._keras_mask = mask  # pylint: disable=protected-access
                zs.append(z)
                new.append(z)
            else:
                new.append(t)
        return tf.nest.pack_sequence_as(out, new), (args, kwargs), zs

    def merge(self, layer, calls):
        return calls

    def per_example(self, layer, a, g):
        from gradtut.layer_rules.engine import recording  # pylint: disable=import-outside-toplevel

        args, kwargs = a
        variables = self.variables(layer)
        leaves = tf.nest.flatten((args, kwargs))
        batch = g[0].shape[0]
        batched = [i for i, t in enumerate(leaves)
                   if isinstance(t, tf.Tensor) and t.shape.rank and t.shape.rank >= 1
                   and (batch is None or t.shape[0] in (None, batch))]
        elems = ([tf.stop_gradient(leaves[i]) for i in batched], list(g))

        def one(example):
            example_leaves, example_g = example
            full = list(leaves)
            for i, t in zip(batched, example_leaves, strict=True):
                full[i] = t[None]
            args_b, kwargs_b = tf.nest.pack_sequence_as((args, kwargs), full)
            with tf.GradientTape() as tape:
                with recording(self.ruled_sublayers, []):
                    # Through __call__, which reads the variables in the compute dtype under
                    # mixed precision, as the recorded forward pass did.
                    out = layer(*args_b, **kwargs_b)
                outs = [t for t in tf.nest.flatten(out)
                        if isinstance(t, tf.Tensor) and t.dtype.is_floating]
                total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)
                                                * tf.cast(gb[None], tf.float32))
                                  for o, gb in zip(outs, example_g, strict=True)])
            grads = tape.gradient(total, variables)
            return [tf.zeros(v.shape, v.dtype) if d is None else tf.cast(d, v.dtype)
                    for d, v in zip(grads, variables, strict=True)]

        def vectorized(example_leaves, gs):
            return tf.vectorized_map(one, (example_leaves, gs), fallback_to_while_loop=True)

        def looped(example_leaves, gs):
            signature = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
            scope = tf.compat.v1.get_variable_scope()
            before = scope.caching_device  # tf.map_fn can leave one set if fn raises
            try:
                return tf.map_fn(one, (example_leaves, gs), fn_output_signature=signature,
                                 parallel_iterations=MAP_FN_PARALLEL_ITERATIONS)
            finally:
                scope.set_caching_device(before)

        specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), elems)
        path, why = "vectorized_map", None
        try:
            concrete = tf.function(vectorized).get_concrete_function(*specs)
            hazards = broadcast_matmul_hazards(concrete.graph)
            if hazards:
                path, why = "loop over examples", ("vectorised, its matmul "
                                                   f"{hazards[0].split(': ')[-1]} hits "
                                                   "tensorflow/tensorflow#117700 (oneDNN)")
        except Exception as err:  # pylint: disable=broad-except
            path = "loop over examples"
            why = (f"vectorized_map cannot convert it ({type(err).__name__}: "
                   f"{str(err).splitlines()[0][:80]})")
        if path != "vectorized_map":
            concrete = tf.function(looped).get_concrete_function(*specs)
        drawn = random_ops(concrete.graph)
        if drawn:
            raise ValueError(
                f"layer {layer.name!r} ({type(layer).__name__}) has no rule, and it draws random "
                f"numbers ({', '.join(drawn[:3])}) in its own computation, such as dropout in "
                "training mode. Its layer-local gradient would re-run it and draw other numbers "
                "than the forward pass did. Use training=False, set its dropout to 0, use "
                "per_example_gradients with method='loop', 'map_fn' or 'jacobian', or register "
                "a rule for the layer.")
        LocalRule.paths[layer] = (path, why)
        return concrete(*elems)
