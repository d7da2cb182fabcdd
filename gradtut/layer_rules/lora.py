"""Keras LoRA on ``Dense`` and ``EinsumDense`` (``layer.enable_lora(rank)``): closed-form
per-example gradients of the adapters, with ghost norms (notebook 01, section 10).

Keras computes ``kernel = frozen + s * (A @ B)`` with ``s = lora_alpha / rank``,
``A: [*kernel.shape[:-1], r]`` and ``B: [r, kernel.shape[-1]]``. For a contraction
``z = einsum("I,K->O", x, kernel)`` whose last kernel letter ``j`` is an output letter, the
adapter path is two contractions of the same kind:

    u = einsum("I,K'->O'", x, A)        K' = K with j replaced by r, O' likewise
    z = einsum("I,K->O", x, frozen) + s * einsum("O',rj->O", u, B)

so with ``g = dL/dz`` each adapter's per-example gradient and Gram norm come from
:mod:`gradtut.layer_rules.einsum`: ``A`` from ``(x, s * g B^T)`` and ``B`` from ``(u, s * g)``.
"""
import tensorflow as tf

from gradtut.layer_rules import einsum
from gradtut.layer_rules.common import _apply_activation, _positions
from gradtut.layer_rules.registry import LayerRule, _check_layer


def equations(equation):
    """``(eq_a, eq_b, eq_back)`` for the adapters of a kernel contracted by ``equation``.

    Raises:
      ValueError: the kernel's last letter is not an output-only letter.

    Example:
      >>> equations("btd,dhk->bthk")
      ('btd,dha->btha', 'btha,ak->bthk', 'bthk,ak->btha')
    """
    inputs, kernel, out = einsum.parse(equation)
    j = kernel[-1]
    if j not in out or j in inputs:
        raise ValueError(f"LoRA on equation {equation!r}: the kernel's last axis {j!r} is not an "
                         "output-only axis")
    r = next(c for c in "abcdefghijklmnopqrstuvwxyz" if c not in equation)
    out_r = out.replace(j, r)
    return (f"{inputs},{kernel[:-1]}{r}->{out_r}", f"{out_r},{r}{j}->{out}",
            f"{out},{r}{j}->{out_r}")


class LoraRule(LayerRule):
    """The adapters ``lora_kernel_a``, ``lora_kernel_b`` (and a trainable bias) of a LoRA
    layer; ``base`` (the layer's own rule) says how its input and output map onto an einsum
    (``lora_einsum``) and what its bias gradient is (``bias_per_example``)."""

    supports_lora = True

    def __init__(self, base):
        if not (isinstance(base, LayerRule) and hasattr(base, "lora_einsum")):
            raise TypeError(f"LoraRule wraps the rule of a LoRA-capable layer (DenseRule(), "
                            f"EinsumDenseRule()), got {base!r:.80}")
        self.base = base
        self.name = f"{base.name} + lora"
        self.layer_class = base.layer_class

    def unsupported(self, layer):
        reason = super().unsupported(layer)
        if reason is None:
            try:
                equations(self.base.lora_einsum(layer))
            except ValueError as err:
                reason = str(err)
        return reason

    def variables(self, layer):
        return [layer.lora_kernel_a, layer.lora_kernel_b] + self._bias(layer)

    @staticmethod
    def _bias(layer):
        """The bias, where it trains alongside the adapters (frozen, it has no gradient here)."""
        return [layer.bias] if layer.bias is not None and layer.bias.trainable else []

    def _bias_per_example(self, layer, g):
        return self.base.bias_per_example(layer, g) if self._bias(layer) else []

    def forward(self, layer, inputs):
        equation = self.base.lora_einsum(layer)
        eq_a, eq_b, _ = equations(equation)
        x = self.base.lora_input(layer, inputs)
        dtype = x.dtype
        scale = layer.lora_alpha / layer.lora_rank
        u = tf.einsum(eq_a, x, tf.cast(layer.lora_kernel_a, dtype))
        z = (tf.einsum(equation, x, tf.cast(layer._kernel, dtype))  # pylint: disable=protected-access
             + scale * tf.einsum(eq_b, u, tf.cast(layer.lora_kernel_b, dtype)))
        z = self.base.lora_output(layer, inputs, z)
        if layer.bias is not None:
            z = z + tf.cast(layer.bias, z.dtype)
        return _apply_activation(layer, z), (x, u), z

    def _pairs(self, layer, a, g):
        """``((eq_a, x, g_u), (eq_b, u, s * g))``: the adapters' two contractions."""
        equation = self.base.lora_einsum(layer)
        eq_a, eq_b, eq_back = equations(equation)
        x, u = a
        scale = layer.lora_alpha / layer.lora_rank
        g_e = self.base.lora_grad(layer, g) * scale
        g_u = tf.einsum(eq_back, g_e, tf.cast(layer.lora_kernel_b, g_e.dtype))
        return (eq_a, x, g_u), (eq_b, u, g_e)

    def per_example(self, layer, a, g):
        grads = [einsum.per_example(*pair) for pair in self._pairs(layer, a, g)]
        return grads + self._bias_per_example(layer, g)

    def weighted_sum(self, layer, a, g, weights):
        sums = [einsum.weighted_sum(*pair, weights) for pair in self._pairs(layer, a, g)]
        return sums + [tf.tensordot(weights, t, axes=1)
                       for t in self._bias_per_example(layer, g)]

    def _axis_sizes(self, layer, input_shape):
        """The size of each letter of the layer's einsum that the input shape fixes."""
        inputs, _, out = einsum.parse(self.base.lora_einsum(layer))
        if hasattr(self.base, "_steps"):  # EinsumDense: its own equation's axes
            sizes = dict(zip(inputs, input_shape, strict=True))
            for c, size in zip(out, layer.compute_output_shape(tuple(input_shape)), strict=True):
                if sizes.get(c) is None:  # the input's sizes win: the output may leave them open
                    sizes[c] = size
            return sizes
        # Dense, seen as rows "bti,ij->btj": t is every axis between batch and features
        return {"t": _positions(input_shape[1:-1])}

    def ghost(self, layer, input_shape):
        """Whether both adapters take the Gram form (the same test as :meth:`sq_norms`)."""
        sizes = self._axis_sizes(layer, input_shape)
        for eq, kernel in zip(equations(self.base.lora_einsum(layer))[:2],
                              (layer.lora_kernel_a, layer.lora_kernel_b), strict=True):
            if not einsum.ghost(eq, tuple(kernel.shape), einsum.positions(eq, sizes)):
                return False
        return True

    def sq_norms(self, layer, a, g):
        """Both adapters by their Gram form, or None where either costs less materialised (on
        sequences longer than the rank, usually): the engine then materialises the adapters'
        per-example gradients, which are small (``A`` is ``[*, r]``, ``B`` is ``[r, n]``), and
        reuses them in the clipped sum. A full-kernel gradient is never materialised."""
        kernels = (layer.lora_kernel_a.shape, layer.lora_kernel_b.shape)
        parts = []
        for (eq, x, gz), shape in zip(self._pairs(layer, a, g), kernels, strict=True):
            sq = einsum.sq_norms(eq, x, gz, shape)
            if sq is None:
                return None
            parts.append(sq)
        bias = self._bias_per_example(layer, g)
        return tf.add_n(parts + [tf.reduce_sum(tf.square(tf.reshape(t, [tf.shape(t)[0], -1])), 1)
                                 for t in bias])


class LoraCapable:
    """Mixin for the rule of a layer type with Keras LoRA (``Dense``, ``EinsumDense``): a layer
    with LoRA enabled gets :class:`LoraRule` around this rule, which supplies ``lora_einsum``,
    ``lora_input``, ``lora_output``, ``lora_grad`` and ``bias_per_example``."""

    supports_lora = True

    def for_layer(self, layer):
        """This rule, or :class:`LoraRule` around it for a layer with LoRA enabled.

        Raises:
          TypeError: ``layer`` is not a Keras layer.
        """
        _check_layer(layer, f"{type(self).__name__}.for_layer")
        return LoraRule(self) if getattr(layer, "lora_enabled", False) else self
