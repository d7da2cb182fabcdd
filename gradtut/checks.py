"""Comparing gradients with a reference, with messages that say what differs and where.

Introduced in notebook 01; every later notebook and test uses it to show a fast method agrees
with its slow, obviously-correct reference.
"""
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


def assert_gradients_close(actual, expected, rtol=1e-5, atol=1e-6, names=None):
    """Assert two nests of gradients are elementwise close: ``|a - e| <= atol + rtol * |e|``.

    Args:
      actual: a tensor, array, or list/tuple/dict nest of them (``tf.IndexedSlices`` allowed).
      expected: the reference, with the same nest structure and shapes.
      rtol, atol: relative and absolute tolerance, as in ``numpy.allclose``.
      names: optional list of names, one per flattened entry (for example
        ``[v.path for v in model.trainable_variables]``), used in the failure message.

    Returns:
      The largest absolute error over all entries (a float), so a notebook can print it.

    Raises:
      AssertionError: the nests differ in length, an entry differs in shape or is None, or values
        differ beyond tolerance. The message names the entry (index and name), its shapes, and the
        largest absolute and relative error and where it occurs.

    Example:
      >>> assert_gradients_close([np.ones(3)], [np.ones(3) + 1e-9])  # doctest: +ELLIPSIS
      1.0...e-09
    """
    flat_a = tf.nest.flatten(actual, expand_composites=False)
    flat_e = tf.nest.flatten(expected, expand_composites=False)
    if len(flat_a) != len(flat_e):
        raise AssertionError(f"got {len(flat_a)} gradients, expected {len(flat_e)}")
    if names is not None and len(names) != len(flat_e):
        raise ValueError(f"names has {len(names)} entries for {len(flat_e)} gradients")
    worst = 0.0
    for i, (a, e) in enumerate(zip(flat_a, flat_e)):
        label = _label(i, names, e)
        if a is None or e is None:
            raise AssertionError(f"gradient {label} is None ({'actual' if a is None else 'expected'})")
        a, e = _as_array(a), _as_array(e)
        if a.shape != e.shape:
            raise AssertionError(f"gradient {label}: shape {a.shape} != expected {e.shape}")
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        if a.size == 0:
            continue
        # NaN or inf anywhere counts as an infinite error, so it can never pass silently.
        abs_err = np.nan_to_num(np.abs(a64 - e64), nan=np.inf)
        rel_err = abs_err / np.maximum(np.abs(e64), np.finfo(np.float64).tiny)
        bad = ~(abs_err <= atol + rtol * np.abs(e64))
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
