"""Rule for ``Dense``: ``z = a @ kernel + bias`` on inputs of any rank, with Keras LoRA
(notebook 01, sections 6-7)."""
import keras
import tensorflow as tf

from gradtut.layer_rules.common import (
    _apply_activation,
    _ghost_is_cheaper,
    _gram_sq_norm,
    _outer_products,
    _positions,
    _rows,
)
from gradtut.layer_rules.lora import LoraCapable
from gradtut.layer_rules.registry import LayerRule, register_rule


@register_rule(keras.layers.Dense)
class DenseRule(LoraCapable, LayerRule):
    """``z = a @ kernel + bias`` on inputs of any rank ``[B, ..., d]``."""

    name = "dense"
    layer_class = keras.layers.Dense

    # How LoraRule sees this layer: an einsum over rows [B, T, d].
    def lora_einsum(self, layer):
        return "bti,ij->btj"

    def lora_input(self, layer, inputs):
        return _rows(inputs, layer.kernel.shape[0])

    def lora_output(self, layer, inputs, z):
        return tf.reshape(z, tf.concat([tf.shape(inputs)[:-1], [layer.units]], 0))

    def lora_grad(self, layer, g):
        return _rows(g, layer.units)

    def bias_per_example(self, layer, g):
        return [tf.reduce_sum(_rows(g, layer.units), 1)] if layer.bias is not None else []

    def variables(self, layer):
        return [layer.kernel] + ([layer.bias] if layer.bias is not None else [])

    def forward(self, layer, inputs):
        # A 2-D matmul, whatever the input rank: TensorFlow's oneDNN kernel computes some
        # broadcast batch matmuls wrongly (tensorflow/tensorflow#117700).
        kernel = tf.cast(layer.kernel, inputs.dtype)
        if inputs.shape.rank == 2:
            z = tf.matmul(inputs, kernel)
        else:
            d, n = layer.kernel.shape
            z = tf.matmul(tf.reshape(inputs, [-1, d]), kernel)
            z = tf.reshape(z, tf.concat([tf.shape(inputs)[:-1], [n]], 0))
        if layer.bias is not None:
            z = z + tf.cast(layer.bias, z.dtype)
        return _apply_activation(layer, z), inputs, z

    def merge(self, layer, calls):  # the calls of a shared layer line up along T
        d, n = layer.kernel.shape
        return [(tf.concat([_rows(a, d) for a, _ in calls], 1),
                 tf.concat([_rows(g, n) for _, g in calls], 1))]

    def per_example(self, layer, a, g):
        d, n = layer.kernel.shape
        a, g = _rows(a, d), _rows(g, n)
        # One position: an outer product per example, written once (see _outer_products).
        kernel = (_outer_products(a[:, 0], g[:, 0]) if a.shape[1] == 1
                  else tf.einsum("bti,btj->bij", a, g))
        return [kernel] + ([tf.reduce_sum(g, 1)] if layer.bias is not None else [])

    def ghost(self, layer, input_shape):
        if len(input_shape) == 2:  # Goodfellow's product: ||a||^2 ||g||^2, from a and g alone
            return True
        return _ghost_is_cheaper(_positions(input_shape[1:-1]), *layer.kernel.shape)

    def sq_norms(self, layer, a, g):
        if a.shape.rank == 2:  # Goodfellow: ||a g^T||^2 = ||a||^2 ||g||^2, and ||g||^2 for the bias
            g_sq = tf.reduce_sum(tf.square(g), 1)
            a_sq = tf.reduce_sum(tf.square(a), 1)
            return g_sq * (a_sq + 1.0) if layer.bias is not None else g_sq * a_sq
        d, n = layer.kernel.shape
        a, g = _rows(a, d), _rows(g, n)
        if not _ghost_is_cheaper(a.shape[1], d, n):
            return None
        sq = _gram_sq_norm(a, g)
        if layer.bias is not None:
            sq += tf.reduce_sum(tf.square(tf.reduce_sum(g, 1)), 1)
        return sq

    def weighted_sum(self, layer, a, g, weights):
        d, n = layer.kernel.shape
        a, g = tf.reshape(a, [-1, d]), _rows(g, n)
        gw = g * weights[:, None, None]
        gw_flat = tf.reshape(gw, [-1, n])
        return ([tf.matmul(a, gw_flat, transpose_a=True)] +
                ([tf.reduce_sum(gw_flat, 0)] if layer.bias is not None else []))


