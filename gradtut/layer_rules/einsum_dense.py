"""Rule for ``EinsumDense`` (the attention projections), with Keras LoRA (notebook 01,
section 10)."""
import keras
import tensorflow as tf

from gradtut.layer_rules import einsum
from gradtut.layer_rules.common import _apply_activation, _sum_except
from gradtut.layer_rules.lora import LoraCapable
from gradtut.layer_rules.registry import LayerRule, register_rule


@register_rule(keras.layers.EinsumDense)
class EinsumDenseRule(LoraCapable, LayerRule):
    """``z = einsum(equation, a, kernel) + bias``; the attention projections are EinsumDense."""

    name = "einsum_dense"
    layer_class = keras.layers.EinsumDense


    def unsupported(self, layer):
        reason = super().unsupported(layer)
        if reason is None:
            try:
                einsum.parse(layer.equation)
            except ValueError as err:
                reason = str(err)
        return reason

    def variables(self, layer):
        return [layer.kernel] + ([layer.bias] if layer.bias is not None else [])

    def forward(self, layer, inputs):
        z = tf.einsum(layer.equation, inputs, tf.cast(layer.kernel, inputs.dtype))
        if layer.bias is not None:
            z = z + tf.cast(layer.bias, z.dtype)
        return _apply_activation(layer, z), inputs, z

    def per_example(self, layer, a, g):
        return [einsum.per_example(layer.equation, a, g)] + self.bias_per_example(layer, g)

    def bias_per_example(self, layer, g):
        """The bias broadcasts over the output's trailing axes: sum ``g`` over the others."""
        if layer.bias is None:
            return []
        rank, bias_rank = g.shape.rank, len(layer.bias.shape)
        b = _sum_except(g, list(range(rank - bias_rank, rank)))
        size_one = [i + 1 for i, s in enumerate(layer.bias.shape) if s == 1]
        if size_one:
            b = tf.reduce_sum(b, axis=size_one, keepdims=True)
        return [b]

    def weighted_sum(self, layer, a, g, weights):
        return ([einsum.weighted_sum(layer.equation, a, g, weights)]
                + [tf.tensordot(weights, t, axes=1) for t in self.bias_per_example(layer, g)])

    def _steps(self, layer, input_shape, equation):
        """The number of shared positions (for the Gram form), from the input shape."""
        inputs, _, _ = einsum.parse(layer.equation)
        return einsum.positions(equation, dict(zip(inputs, input_shape, strict=True)))

    def ghost(self, layer, input_shape):
        return einsum.ghost(layer.equation, layer.kernel.shape,
                            self._steps(layer, input_shape, layer.equation))

    def sq_norms(self, layer, a, g):
        sq = einsum.sq_norms(layer.equation, a, g, layer.kernel.shape)
        if sq is None:
            return None
        for t in self.bias_per_example(layer, g):
            sq += tf.reduce_sum(tf.square(tf.reshape(t, [tf.shape(t)[0], -1])), 1)
        return sq

    # How LoraRule sees this layer: its own einsum.
    def lora_einsum(self, layer):
        return layer.equation

    def lora_input(self, layer, inputs):
        return inputs

    def lora_output(self, layer, inputs, z):
        return z

    def lora_grad(self, layer, g):
        return g
