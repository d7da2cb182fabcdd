"""Per-example gradients of one einsum contraction ``z = einsum("I,K->O", a, kernel)``, the maths
that ``EinsumDense`` and Keras LoRA share (notebook 01, sections 7 and 10).

``I`` and ``O`` start with the batch letter; ``K`` does not hold it. Example ``b``'s kernel
gradient is ``einsum("I,O->bK", a, g)``. Its squared norm has a Gram form ("ghost") when the
contraction is a matmul repeated over shared positions: every kernel letter is in exactly one
of ``I`` and ``O``, and every other letter is in both. Then ``a`` reshapes to ``[B, T, m]``,
``g`` to ``[B, T, n]``, and ``||grad_b||^2 = sum_ts (a_t . a_s)(g_t . g_s)``.
"""
import math

import tensorflow as tf

from gradtut.layer_rules.common import _ghost_is_cheaper, _gram_sq_norm, _positions


def parse(equation):
    """``(I, K, O)`` of ``"I,K->O"``.

    Raises:
      TypeError: ``equation`` is not a string.
      ValueError: not of that form, with an ellipsis, or without a shared first (batch) letter
        that the kernel lacks. The functions below raise the same for their ``equation``.

    Example:
      >>> parse("btd,dhk->bthk")
      ('btd', 'dhk', 'bthk')
    """
    if not isinstance(equation, str):
        raise TypeError("equation must be an einsum string 'I,K->O', got "
                        f"{type(equation).__name__}")
    try:
        inputs, rest = equation.split(",")
        kernel, out = rest.split("->")
    except ValueError:
        raise ValueError(f"expected an einsum equation 'I,K->O', got {equation!r}") from None
    if "." in equation or not inputs or not out or inputs[0] != out[0] or inputs[0] in kernel:
        raise ValueError(f"equation {equation!r} does not keep the batch axis first in the input "
                         "and the output (or uses an ellipsis)")
    return inputs, kernel, out


def per_example(equation, a, g):
    """``[B, *kernel]``: each example's kernel gradient.

    Example:
      >>> per_example("bi,ij->bj", tf.ones([2, 3]), tf.ones([2, 4])).shape
      TensorShape([2, 3, 4])
    """
    inputs, kernel, out = parse(equation)
    return tf.einsum(f"{inputs},{out}->{inputs[0]}{kernel}", a, g)


def weighted_sum(equation, a, g, weights):
    """``sum_b weights[b] * grad_b``, as one contraction.

    Example:
      >>> weighted_sum("bi,ij->bj", tf.ones([2, 3]), tf.ones([2, 4]), tf.constant([1.0, 0.5])).shape
      TensorShape([3, 4])
    """
    inputs, kernel, out = parse(equation)
    g = g * tf.reshape(weights, [-1] + [1] * (g.shape.rank - 1))
    return tf.einsum(f"{inputs},{out}->{kernel}", a, g)


def gram_axes(equation):
    """``(shared, kernel_in, kernel_out)`` letters where the Gram form applies, else None."""
    inputs, kernel, out = parse(equation)
    k_in = [c for c in kernel if c in inputs and c not in out]
    k_out = [c for c in kernel if c in out and c not in inputs]
    if len(k_in) + len(k_out) != len(kernel):
        return None
    shared = [c for c in inputs[1:] if c not in kernel]
    if sorted(shared) != sorted(c for c in out[1:] if c not in kernel):
        return None
    return "".join(shared), "".join(k_in), "".join(k_out)


def positions(equation, sizes):
    """The shared positions of ``equation``'s Gram form, from a letter -> size map; None where
    the form does not apply or a size is unknown.

    Example (``t`` is the one shared letter: 5 positions; unknown, or a kernel indexed by
    ``t`` so that no Gram form applies):
      >>> sizes = {"b": 2, "t": 5, "d": 3, "e": 4}
      >>> (positions("btd,de->bte", sizes), positions("btd,de->bte", {}),
      ...  positions("bti,tij->btj", sizes))
      (5, None, None)
    """
    axes = gram_axes(equation)
    return None if axes is None else _positions([sizes.get(c) for c in axes[0]])


def ghost(equation, kernel_shape, steps):
    """Whether the Gram form is cheaper than materialising, for ``steps`` shared positions."""
    axes = gram_axes(equation)
    if axes is None:
        return False
    _, kernel, _ = parse(equation)
    size = dict(zip(kernel, kernel_shape, strict=True))
    m = math.prod(size[c] for c in axes[1])
    n = math.prod(size[c] for c in axes[2])
    return _ghost_is_cheaper(steps, m, n)


def sq_norms(equation, a, g, kernel_shape):
    """``[B]`` squared norms of the kernel gradients by the Gram form, or None where it does
    not apply or costs more than materialising.

    Example:
      >>> a, g = tf.ones([2, 2, 8]), tf.ones([2, 2, 8])  # 2 positions: 8 * 8 > 2 * (8 + 8)
      >>> sq_norms("bti,ij->btj", a, g, (8, 8)).numpy().tolist()  # 64 entries, each 2
      [256.0, 256.0]
      >>> sq_norms("bti,ij->btj", tf.ones([2, 5, 3]), tf.ones([2, 5, 4]), (3, 4)) is None
      True
    """
    axes = gram_axes(equation)
    if axes is None:
        return None
    shared, k_in, k_out = axes
    inputs, kernel, out = parse(equation)
    b = inputs[0]
    size = dict(zip(kernel, kernel_shape, strict=True))
    m = math.prod(size[c] for c in k_in)
    n = math.prod(size[c] for c in k_out)
    a = tf.einsum(f"{inputs}->{b}{shared}{k_in}", a)
    g = tf.einsum(f"{out}->{b}{shared}{k_out}", g)
    a = tf.reshape(a, [tf.shape(a)[0], -1, m])
    g = tf.reshape(g, [tf.shape(g)[0], -1, n])
    if not _ghost_is_cheaper(a.shape[1], m, n):
        return None
    return _gram_sq_norm(a, g)
