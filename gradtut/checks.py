"""Comparing gradients with a reference, with messages that say what differs and where; and
the package's checks for integer, real and seed arguments.

Introduced in notebook 01; every later notebook and test uses it to show a fast method agrees
with its slow, obviously-correct reference.
"""
import collections.abc
import math

import keras
import numpy as np
import tensorflow as tf


def _as_array(value):
    if isinstance(value, tf.IndexedSlices):
        value = tf.convert_to_tensor(value)
    return np.asarray(value)


def _label(i, names, expected):
    if names is not None:
        return f"#{i} ({names[i]})"
    name = getattr(expected, "path", None) or getattr(expected, "name", None)
    return f"#{i} ({name})" if isinstance(name, str) else f"#{i}"


def _describe(value):
    if isinstance(value, collections.abc.Mapping):
        return f"a dict with keys {sorted(map(str, value))}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a single {type(value).__name__}"


def _kind(value):
    if isinstance(value, collections.abc.Mapping):
        return "dict"
    if isinstance(value, (list, tuple)) or tf.nest.is_nested(value):
        return "sequence"  # a list and a tuple of the same entries count as the same nest
    return "leaf"


def _structure_difference(actual, expected, path="the top level"):
    """Where two nests first differ in structure (a message), or None. Lists and tuples are
    interchangeable (``tape.gradient`` returns whichever it was given); dicts must have the same
    keys; a dict never matches a list, nor a nest a single tensor."""
    kind = _kind(expected)
    if _kind(actual) != kind:
        return f"at {path}, actual is {_describe(actual)} but expected is {_describe(expected)}"
    if kind == "dict":
        if set(actual) != set(expected):
            extra = sorted(map(str, set(actual) - set(expected)))
            missing = sorted(map(str, set(expected) - set(actual)))
            return (f"at {path}, the dict keys differ: only in actual {extra}, only in expected "
                    f"{missing}")
        pairs = [(f"[{key!r}]", actual[key], expected[key]) for key in sorted(expected, key=str)]
    elif kind == "sequence":
        if not isinstance(expected, (list, tuple)):  # a namedtuple or attrs class: tf.nest decides
            try:
                tf.nest.assert_same_structure(actual, expected, check_types=True)
            except (TypeError, ValueError) as err:
                return f"at {path}: {err}"
            return None
        if len(actual) != len(expected):
            return f"at {path}, actual has {len(actual)} entries but expected has {len(expected)}"
        pairs = [(f"[{i}]", a, e) for i, (a, e) in enumerate(zip(actual, expected, strict=True))]
    else:
        return None
    for step, a, e in pairs:
        where = step if path == "the top level" else path + step
        difference = _structure_difference(a, e, where)
        if difference:
            return difference
    return None


def assert_gradients_close(actual, expected, rtol=1e-5, atol=1e-6, names=None):
    """Assert two nests of gradients are elementwise close: ``|a - e| <= atol + rtol * |e|``.

    Args:
      actual: a tensor, array, or list/tuple/dict nest of them (``tf.IndexedSlices`` allowed).
      expected: the reference, with the same nest structure and shapes. A list and a tuple
        with the same entries match (``tape.gradient`` returns whichever it was given); a dict
        matches only a dict with the same keys.
      rtol, atol: relative and absolute tolerance, as in ``numpy.allclose``.
      names: optional list of names, one per flattened entry (for example
        ``[v.path for v in model.trainable_variables]``), used in the failure message.

    Returns:
      The largest absolute error over all entries (a float), so a notebook can print it.

    Raises:
      AssertionError: the nests differ in length or structure (dict keys, a dict against a
        list), an entry differs in shape or is None, or values differ beyond tolerance. The
        message names the entry (index and name), its shapes, and the largest absolute and
        relative error and where it occurs.

    Example:
      >>> assert_gradients_close([np.ones(3)], [np.ones(3) + 1e-9])  # doctest: +ELLIPSIS
      1.0...e-09
      >>> assert_gradients_close({"w": np.ones(2)},
      ...                        {"kernel": np.ones(2)})  # doctest: +NORMALIZE_WHITESPACE
      Traceback (most recent call last):
      ...
      AssertionError: the gradients differ in structure: at the top level, the dict keys differ:
      only in actual ['w'], only in expected ['kernel']
    """
    flat_a = tf.nest.flatten(actual, expand_composites=False)
    flat_e = tf.nest.flatten(expected, expand_composites=False)
    if len(flat_a) != len(flat_e):
        raise AssertionError(f"got {len(flat_a)} gradients, expected {len(flat_e)}")
    difference = _structure_difference(actual, expected)
    if difference:
        raise AssertionError(f"the gradients differ in structure: {difference}")
    if names is not None and len(names) != len(flat_e):
        raise ValueError(f"names has {len(names)} entries for {len(flat_e)} gradients")
    worst = 0.0
    for i, (a, e) in enumerate(zip(flat_a, flat_e, strict=True)):
        label = _label(i, names, e)
        if a is None or e is None:
            raise AssertionError(
                f"gradient {label} is None ({'actual' if a is None else 'expected'})")
        a, e = _as_array(a), _as_array(e)
        if a.shape != e.shape:
            raise AssertionError(f"gradient {label}: shape {a.shape} != expected {e.shape}")
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        if a.size == 0:
            continue
        # NaN or inf anywhere, in either, counts as an infinite error, so it can never pass
        # silently (an expected inf would otherwise make its own tolerance infinite).
        finite = np.isfinite(a64) & np.isfinite(e64)
        with np.errstate(invalid="ignore", over="ignore"):
            abs_err = np.where(finite, np.abs(a64 - e64), np.inf)
            rel_err = abs_err / np.maximum(np.abs(e64), np.finfo(np.float64).tiny)
        bad = ~finite | ~(abs_err <= atol + rtol * np.where(finite, np.abs(e64), 0.0))
        worst = max(worst, float(abs_err.max()))
        if bad.any():
            at = np.unravel_index(int(np.argmax(np.where(bad, abs_err, -1.0))), a.shape)
            raise AssertionError(
                f"gradient {label}, shape {a.shape}: {int(bad.sum())} of {a.size} values differ "
                f"beyond rtol={rtol:g}, atol={atol:g}; largest absolute error "
                f"{abs_err.max():.3g} at index {tuple(int(j) for j in at)} "
                f"(actual {a64[at]:.6g}, expected {e64[at]:.6g}); largest relative error "
                f"{rel_err.max():.3g}"
            )
    return worst


def check_int(value, name, minimum=1, maximum=None, what_maximum=None):
    """``value`` as a Python int, after checking it is an integer ``>= minimum`` (and
    ``<= maximum``, when given).

    The one meaning of "a positive int" across gradtut: Python and NumPy integers pass; bools
    (``True`` would count as 1), floats (even ``4.0``) and strings are refused.

    Args:
      value: the argument to check.
      name: its name, used in the error message.
      minimum: the smallest allowed value (1 for counts, 0 for "none allowed").
      maximum: None, or the largest allowed value; ``what_maximum`` says what it is, for the
        message ("the batch size").

    Returns:
      ``int(value)``.

    Raises:
      ValueError: ``value`` is not an integer, is a bool, or is below ``minimum``. The message
        names the argument, what it got and what to pass instead.

    Example:
      >>> check_int(np.int64(4), "accumulation_steps")
      4
      >>> check_int(True, "num_workers")  # doctest: +NORMALIZE_WHITESPACE
      Traceback (most recent call last):
      ...
      ValueError: num_workers must be a positive int, got True (a bool); pass a whole number
      such as 1
      >>> check_int(5, "num_microbatches", maximum=4, what_maximum="the batch size")
      Traceback (most recent call last):
      ...
      ValueError: num_microbatches must be an int from 1 to the batch size (4), got 5
    """
    if maximum is not None:
        wanted = f"an int from {minimum} to {what_maximum or 'its maximum'} ({maximum})"
    else:
        wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        kind = "a bool" if isinstance(value, (bool, np.bool_)) else type(value).__name__
        raise ValueError(f"{name} must be {wanted}, got {value!r} ({kind}); pass a whole "
                         f"number such as {max(minimum, 1)}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {wanted}, got {value}")
    return int(value)


def check_real(value, name):
    """``value`` as a Python float, after checking it is one finite real number.

    Python and NumPy ints and floats pass; bools, strings, None, arrays and tensors (even 0-d)
    are refused, as are NaN and infinity. Range checks (positive, at most 1, ...) stay with the
    caller, whose message can say what the number means.

    Args:
      value: the argument to check.
      name: its name, used in the error message.

    Returns:
      ``float(value)``.

    Raises:
      ValueError: ``value`` is not a finite real number. The message names the argument, what
        it got and what to pass instead.

    Example:
      >>> check_real(np.float32(0.5), "l2_norm_clip")
      0.5
      >>> check_real("1.0", "l2_norm_clip")  # doctest: +NORMALIZE_WHITESPACE
      Traceback (most recent call last):
      ...
      ValueError: l2_norm_clip must be a real number (a Python or NumPy int or float), got '1.0'
      (str); pass a number such as 1.0
    """
    if isinstance(value, (bool, np.bool_)):
        got = f"{value!r} (a bool)"
    elif isinstance(value, (np.ndarray, tf.Tensor, tf.Variable)):
        got = f"an array of shape {tuple(value.shape)} (use float(x) for a one-element array)"
    elif not isinstance(value, (int, float, np.integer, np.floating)):
        got = f"{value!r} ({type(value).__name__})"
    else:
        got = None
    if got:
        raise ValueError(f"{name} must be a real number (a Python or NumPy int or float), got "
                         f"{got}; pass a number such as 1.0")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}; pass a number such as 1.0")
    return float(value)


def check_seed(seed, name="seed", allow_none=True):
    """``seed`` as a Python int in ``[0, 2**63)`` (what NumPy and TensorFlow's stateless random
    ops both take), or None where ``allow_none`` (a fresh seed from the operating system).

    Raises:
      ValueError: a bool, float, string, negative or too large seed; None where not allowed.

    Example:
      >>> check_seed(np.int32(7)), check_seed(None)
      (7, None)
      >>> check_seed(-1)
      Traceback (most recent call last):
      ...
      ValueError: seed must be an int >= 0, got -1; or None for a fresh random seed
    """
    if seed is None and allow_none:
        return None
    try:
        seed = check_int(seed, name, minimum=0)
    except ValueError as err:
        hint = "; or None for a fresh random seed" if allow_none else ""
        raise ValueError(f"{err}{hint}") from None
    if seed >= 2**63:
        raise ValueError(f"{name} must be below 2**63 (TensorFlow's int64), got {seed}")
    return seed


# --- the inputs every gradient function takes: model, loss, batch --------------------------

def batch_size_of(nest, what):
    """The common leading dimension of the tensors in ``nest``: an int, or None when every
    tensor is traced with an unknown batch size (a ``tf.function`` with ``None`` batch).

    Raises:
      ValueError: no tensors, a scalar, or tensors with different batch sizes; ``what`` names
        the argument in the message.

    Example:
      >>> batch_size_of({"a": tf.zeros((4, 2)), "b": tf.zeros((4,))}, "x")
      4
    """
    shapes = [t.shape for t in tf.nest.flatten(nest)]
    if not shapes:
        raise ValueError(f"{what} holds no tensors; pass a batch [B, ...] (or a nest of them)")
    if any(shape.rank == 0 for shape in shapes):
        raise ValueError(f"{what} must have a leading batch dimension; got a scalar (a Python "
                         "list is a nest of separate tensors: pass np.asarray(...) for a batch)")
    sizes = {shape[0] if shape.rank is not None else None for shape in shapes}
    known = sizes - {None}
    if len(known) > 1:
        raise ValueError(f"the tensors in {what} have different batch sizes {sorted(known)}")
    return known.pop() if known else None


def as_tensors(nest):
    """``nest`` with every leaf a tensor; float64 arrays (NumPy's default) become Keras's
    float type, so they mix with the model's weights.

    Raises:
      ValueError: a leaf TensorFlow cannot convert (the message names it).

    Example:
      >>> as_tensors(np.zeros(2)).dtype
      tf.float32
    """
    def convert(value):
        try:
            t = tf.convert_to_tensor(value)
        except (ValueError, TypeError) as err:
            raise ValueError(f"cannot turn {type(value).__name__} into a tensor ({err}); pass "
                             "NumPy arrays or tensors") from None
        if t.dtype == tf.float64 and keras.backend.floatx() != "float64":
            t = tf.cast(t, keras.backend.floatx())  # NumPy's default; Keras computes in floatx
        return t

    return tf.nest.map_structure(convert, nest)


def check_present(value, name):
    """Refuse None for ``x`` or ``y`` (or inside their nests), naming the fix.

    Example:
      >>> check_present(None, "y")  # doctest: +NORMALIZE_WHITESPACE
      Traceback (most recent call last):
      ...
      ValueError: y is None; pass one target per example, [B, ...] like x (for a loss that needs
      no targets, pass a placeholder such as np.zeros(B) and ignore it in loss_fn)
    """
    what = ("the inputs [B, ...]" if name == "x" else "one target per example, [B, ...] "
            "like x (for a loss that needs no targets, pass a placeholder such as np.zeros(B) "
            "and ignore it in loss_fn)")
    if value is None:
        raise ValueError(f"{name} is None; pass {what}")
    where = [i for i, t in enumerate(tf.nest.flatten(value)) if t is None]
    if where:
        raise ValueError(f"{name} holds None (entries {where} of its flattened nest); pass {what}")


def check_keras_model(model, name="model"):
    """Refuse anything that is not a Keras layer or model, with the fix for what it is (a
    list of layers, a plain function, anything else): TypeError.

    Example:
      >>> check_keras_model(keras.layers.Dense(2))  # passes silently
    """
    if isinstance(model, keras.layers.Layer):
        return
    if isinstance(model, (list, tuple)) and model and all(
            isinstance(layer, keras.layers.Layer) for layer in model):
        fix = "wrap the layers in a model: keras.Sequential(layers)"
    elif callable(model):
        fix = ("a plain function has no trainable variables to differentiate: put the "
               "computation in a keras.layers.Layer or keras.Model")
    else:
        fix = "pass a built Keras model, e.g. keras.Sequential([keras.Input(...), ...])"
    raise TypeError(f"{name} must be a Keras model (keras.Model, or any keras.layers.Layer), got "
                    f"{type(model).__name__}; {fix}")


def _loss_class_for(name):
    """The Keras loss class named by ``name`` (``"mse"`` -> ``"MeanSquaredError"``), or None."""
    try:
        found = keras.losses.get(name)
    except (ValueError, TypeError):
        return None
    base = getattr(found, "__name__", None) or type(found).__name__
    cls = "".join(part[:1].upper() + part[1:] for part in base.split("_"))
    return cls if isinstance(getattr(keras.losses, cls, None), type) else None


def check_loss_fn(loss_fn, name="loss_fn"):
    """Refuse a loss given by name (ValueError) or anything that cannot be called (TypeError),
    naming the loss object to pass instead. (Whether it returns one loss per example is
    checked when it runs: ``gradtut.per_example.per_example_losses``.)

    Example:
      >>> check_loss_fn("mse")  # doctest: +NORMALIZE_WHITESPACE
      Traceback (most recent call last):
      ...
      ValueError: loss_fn is the string 'mse', but per-example gradients need a loss object that
      returns one loss per example: pass keras.losses.MeanSquaredError(reduction=None), or a
      function loss_fn(y_true, y_pred) -> [B].
    """
    if isinstance(loss_fn, str):
        cls = _loss_class_for(loss_fn)
        suggestion = (f"keras.losses.{cls}(reduction=None)" if cls else
                      "a keras.losses.Loss object with reduction=None")
        if cls is None or "Crossentropy" in cls:
            suggestion += " (with from_logits=True if the model outputs logits)"
        raise ValueError(
            f"{name} is the string {loss_fn!r}, but per-example gradients need a loss object that "
            f"returns one loss per example: pass {suggestion}, or a function "
            "loss_fn(y_true, y_pred) -> [B].")
    if not callable(loss_fn):
        raise TypeError(
            f"{name} must be a callable loss_fn(y_true, y_pred) returning [B] per-example "
            f"losses, got {loss_fn!r} ({type(loss_fn).__name__}); pass e.g. "
            "keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)")


def check_optimizer(optimizer):
    """Refuse anything but a Keras optimizer object (TypeError; a name such as ``"sgd"`` works
    only in ``model.compile``).

    Example:
      >>> check_optimizer(keras.optimizers.SGD(0.1))  # passes silently
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a Keras optimizer object, got {optimizer!r}; pass "
                        "e.g. keras.optimizers.SGD(0.1) (names such as 'sgd' work only in "
                        "model.compile)")


def check_no_clipping_over_replicas(optimizer, replicas):
    """Refuse an optimizer that clips (``clipnorm``, ``clipvalue``, ``global_clipnorm``) when
    ``replicas > 1`` (ValueError). Keras 3's ``Optimizer.apply`` clips the gradients it is
    given and only then all-reduces them (``_clip_gradients``, then ``_backend_update_step``),
    so under a strategy each replica clips its own share, and the sum of clipped shares is
    not the clipped global gradient.

    Example:
      >>> check_no_clipping_over_replicas(keras.optimizers.SGD(0.1, clipnorm=1.0), 1)  # passes
    """
    clipping = [name for name in ("clipnorm", "clipvalue", "global_clipnorm")
                if getattr(optimizer, name, None) is not None]
    if clipping and replicas > 1:
        raise ValueError(
            f"the optimizer clips ({', '.join(f'{n}={getattr(optimizer, n)}' for n in clipping)})"
            f" and there are {replicas} replicas: Keras 3 clips each replica's share of the "
            "gradient before it sums the replicas, so the update would not be the clipped "
            "global gradient's. Build the optimizer without clipping, or clip the summed "
            "gradient yourself before optimizer.apply in a step of your own.")


def checked_batch(x, y):
    """``(x, y, examples)``: the batch as (nests of) tensors and its size, after refusing None,
    x and y of different lengths, and an empty batch (ValueError). Inside a ``tf.function``
    traced with an unknown batch size, ``examples`` is None.

    Example:
      >>> x, y, examples = checked_batch(np.zeros((3, 2)), np.zeros(3))
      >>> examples
      3
    """
    check_present(x, "x")
    check_present(y, "y")
    x, y = as_tensors(x), as_tensors(y)
    examples, labels = batch_size_of(x, "x"), batch_size_of(y, "y")
    if examples is None or labels is None:  # traced with an unknown batch: checked when run
        return x, y, examples
    if examples != labels:
        raise ValueError(f"x has {examples} examples but y has {labels}: they must match")
    if not examples:
        raise ValueError("the batch is empty: pass at least one example")
    return x, y, examples
