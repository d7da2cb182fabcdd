"""Rules for LayerNormalization, GroupNormalization and RMSNormalization: the scale and
offset of a normalised input (notebook 01, section 6)."""
import keras
import tensorflow as tf

from gradtut.layer_rules.common import _sum_except
from gradtut.layer_rules.registry import LayerRule, register_rule


class _AffineNormRule(LayerRule):
    """``z = normalised(a) * scale + offset``: the scale's per-example gradient is
    ``sum(g * normalised)`` and the offset's ``sum(g)`` over every axis the parameter does not
    have. ``a`` recorded here is the normalised input, which depends on its own example only."""

    def axes(self, layer, rank):
        """The input axes (positive) the parameters run along."""
        axis = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        return sorted(a % rank for a in axis)

    def params(self, layer):
        """``(scale or None, offset or None)``."""
        raise NotImplementedError

    def normalise(self, layer, inputs):
        raise NotImplementedError

    def variables(self, layer):
        return [v for v in self.params(layer) if v is not None]

    def forward(self, layer, inputs):
        # Like Keras: normalise and apply the affine step in at least float32 (the parameters
        # stay float32 under mixed precision), and cast only the output.
        dtype = tf.float64 if inputs.dtype == tf.float64 else tf.float32
        x_hat = tf.cast(self.normalise(layer, tf.cast(inputs, dtype)), dtype)
        rank = inputs.shape.rank
        axes = self.axes(layer, rank)
        shape = [inputs.shape[i] if i in axes else 1 for i in range(rank)]
        scale, offset = self.params(layer)
        z = x_hat
        if scale is not None:
            z = z * tf.reshape(tf.cast(scale, dtype), shape)
        if offset is not None:
            z = z + tf.reshape(tf.cast(offset, dtype), shape)
        return tf.cast(z, layer.compute_dtype), x_hat, z

    def per_example(self, layer, a, g):
        axes = self.axes(layer, g.shape.rank)
        scale, offset = self.params(layer)
        grads = []
        if scale is not None:
            grads.append(tf.reshape(_sum_except(g * tf.cast(a, g.dtype), axes),
                                    [-1, *scale.shape]))
        if offset is not None:
            grads.append(tf.reshape(_sum_except(g, axes), [-1, *offset.shape]))
        return grads


@register_rule(keras.layers.LayerNormalization)
class LayerNormalizationRule(_AffineNormRule):
    name = "layer_normalization"
    layer_class = keras.layers.LayerNormalization

    def unsupported(self, layer):
        if getattr(layer, "rms_scaling", False):
            return "rms_scaling=True (deprecated in Keras; use RMSNormalization)"
        return super().unsupported(layer)

    def params(self, layer):
        return getattr(layer, "gamma", None), getattr(layer, "beta", None)

    def normalise(self, layer, inputs):
        return keras.ops.layer_normalization(inputs, None, None, layer.axis, layer.epsilon)


@register_rule(keras.layers.GroupNormalization)
class GroupNormalizationRule(_AffineNormRule):
    name = "group_normalization"
    layer_class = keras.layers.GroupNormalization

    def params(self, layer):
        return getattr(layer, "gamma", None), getattr(layer, "beta", None)

    def normalise(self, layer, inputs):
        # Keras's own arithmetic, without the scale and offset (moments in at least float32).
        rank = inputs.shape.rank
        axis = layer.axis % rank
        shape = tf.shape(inputs)
        grouped = tf.concat([shape[:axis], [layer.groups, shape[axis] // layer.groups],
                             shape[axis + 1:]], 0)
        x = tf.reshape(tf.cast(inputs, tf.float32 if inputs.dtype != tf.float64 else tf.float64),
                       grouped)
        reduce = [i for i in range(1, rank + 1) if i != axis]
        mean, variance = tf.nn.moments(x, axes=reduce, keepdims=True)
        x_hat = (x - mean) * tf.math.rsqrt(variance + layer.epsilon)
        return tf.cast(tf.reshape(x_hat, shape), inputs.dtype)


@register_rule(keras.layers.RMSNormalization)
class RMSNormalizationRule(_AffineNormRule):
    name = "rms_normalization"
    layer_class = keras.layers.RMSNormalization

    def unsupported(self, layer):
        reason = super().unsupported(layer)  # first: it checks the layer's type
        # Keras multiplies by `scale` with trailing broadcasting, whatever the axis.
        axis = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        if sorted(a if a < 0 else a - 10**6 for a in axis) != list(range(-len(axis), 0)):
            return (f"axis={layer.axis}: the rule covers the trailing axes given as "
                    "negative numbers (-1, -2, ...)")
        return reason

    def params(self, layer):
        return layer.scale, None

    def normalise(self, layer, inputs):
        return keras.ops.rms_normalization(inputs, None, layer.axis, layer.epsilon)


