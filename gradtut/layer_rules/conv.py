"""Rules for convolutions, Conv1D/2D/3D and depthwise ones: per-example kernel gradients
from image patches (notebook 01, section 6)."""
import math

import keras
import tensorflow as tf

from gradtut.layer_rules.common import (
    _apply_activation,
    _channels_last,
    _ghost_is_cheaper,
    _gram_sq_norm,
    _positions,
    _rows,
)
from gradtut.layer_rules.registry import LayerRule, register_rule

ONE_HOT_PATCH_LIMIT = 64


def conv_patches(x, kernel_size, strides, padding, dilation_rate):
    """Image patches of a channels-last ``x [B, *spatial, C]`` for any spatial rank:
    ``[B, *out_spatial, K * C]`` with K = prod(kernel_size), ordered (kernel position,
    channel) like a kernel's ``[*kernel_size, C]``: ``patches @ kernel.reshape([K * C, -1])``
    is the convolution.

    A convolution with a one-hot ``[*kernel_size, C, K * C]`` kernel copies each patch into
    the channels, so strides, dilation and padding follow the layer's own convolution
    exactly; it serves 3-D, and 1-D/2-D patches up to 64 wide. Wider 2-D patches use
    ``extract_patches`` (a gather): on this CPU the one-hot convolution was 2-5x faster for
    3x3 kernels on 1-3 channels and no faster from 8 channels on.

    Raises:
      ValueError: ``x``'s rank is not 2 + len(kernel_size), or ``strides`` or
        ``dilation_rate`` have another length than ``kernel_size``.

    Example:
      >>> x = tf.reshape(tf.range(16.0), [1, 4, 4, 1])
      >>> conv_patches(x, (2, 2), (2, 2), "valid", (1, 1))[0, 0, 0].numpy().tolist()
      [0.0, 1.0, 4.0, 5.0]
    """
    spatial = len(kernel_size)
    if ((x.shape.rank is not None and x.shape.rank != spatial + 2)
            or len(strides) != spatial or len(dilation_rate) != spatial):
        raise ValueError(f"conv_patches needs x of rank {spatial + 2} ([B, *spatial, C]) and "
                         f"{spatial} strides and dilation rates for a {spatial}-D kernel; got x "
                         f"of shape {x.shape}, strides {tuple(strides)}, dilation "
                         f"{tuple(dilation_rate)}")
    if spatial == 1:  # a 1-D signal is a 2-D image of height 1
        return conv_patches(x[:, None], (1, *kernel_size), (1, *strides), padding,
                        (1, *dilation_rate))[:, 0]
    channels = x.shape[-1]
    k = math.prod(kernel_size)
    if len(kernel_size) == 2 and k * channels > ONE_HOT_PATCH_LIMIT:
        return tf.image.extract_patches(x, sizes=[1, *kernel_size, 1], strides=[1, *strides, 1],
                                        rates=[1, *dilation_rate, 1], padding=padding.upper())
    eye = tf.reshape(tf.eye(k * channels, dtype=x.dtype), [*kernel_size, channels, k * channels])
    return keras.ops.conv(x, eye, strides=list(strides), padding=padding,
                          dilation_rate=dilation_rate, data_format="channels_last")


class _ConvRule(LayerRule):
    """Conv1D/2D/3D: ``z = conv(a, kernel) + bias``, with strides, dilation, padding (causal
    too) and groups. Per-example kernel gradients are patches^T @ g, per group. The recorded
    ``a`` is ``(inputs, padding)``, or ``(patches, None)`` where the forward pass computed
    ``z`` as patches @ kernel (small patches, see ``_small_patches``)."""

    def unsupported(self, layer):
        return super().unsupported(layer)

    def variables(self, layer):
        return [layer.kernel] + ([layer.bias] if layer.use_bias else [])

    def forward(self, layer, inputs):
        padding = layer.padding
        if padding == "causal":
            inputs = keras.ops.pad(inputs, layer._compute_causal_padding())  # pylint: disable=protected-access
            padding = "valid"
        kernel = tf.cast(layer.kernel, inputs.dtype)
        if self._small_patches(layer, inputs):
            # Every per-example rule needs these patches. Built by one small convolution, they
            # cost about what the layer's own convolution does, and patches @ kernel is then
            # that convolution for little more (on a 2-core AVX2-only AMD EPYC: 8x8x1 images,
            # 3x3 kernel, 16 filters, batch 256: 1.6-1.9 ms per convolution, 0.6 ms for the
            # matmul). Record the patches (padding None) instead of the inputs.
            p = conv_patches(inputs, layer.kernel_size, layer.strides, padding,
                             layer.dilation_rate)
            z = tf.tensordot(p, tf.reshape(kernel, [-1, layer.filters]), axes=1)
            inputs, padding = p, None
        else:
            z = keras.ops.conv(inputs, kernel, strides=list(layer.strides), padding=padding,
                               dilation_rate=layer.dilation_rate, data_format=layer.data_format)
        if layer.use_bias:
            shape = ((1,) * (layer.rank + 1) + (layer.filters,)
                     if layer.data_format == "channels_last"
                     else (1, layer.filters) + (1,) * layer.rank)
            z = z + tf.reshape(tf.cast(layer.bias, z.dtype), shape)
        return _apply_activation(layer, z), (inputs, padding), z

    @staticmethod
    def _small_patches(layer, inputs):
        """Patches narrow enough (``ONE_HOT_PATCH_LIMIT`` values) to come from a one-hot
        convolution, for a channels-last layer without groups."""
        return (layer.groups == 1 and layer.data_format == "channels_last"
                and inputs.shape[-1] is not None
                and math.prod(layer.kernel_size) * inputs.shape[-1] <= ONE_HOT_PATCH_LIMIT)

    def _patches_and_grads(self, layer, a, g):
        x, padding = a
        if padding is None:  # forward recorded the patches themselves
            p = x
        else:
            if layer.data_format == "channels_first":
                x, g = _channels_last(x), _channels_last(g)
            p = conv_patches(x, layer.kernel_size, layer.strides, padding, layer.dilation_rate)
        k_c = p.shape[-1]
        return _rows(p, k_c), _rows(g, layer.filters)

    def _kernel_sum(self, layer, p, g, per_example):
        """Patches ``[B, T, K*C]`` times output gradients ``[B, T, F]``, summed over positions
        (and over the batch unless ``per_example``), per group, in the kernel's layout."""
        if layer.groups == 1:
            return tf.einsum("btk,btf->bkf" if per_example else "btk,btf->kf", p, g)
        equation = "btkgc,btgf->bkcgf" if per_example else "btkgc,btgf->kcgf"
        groups, channels = layer.groups, layer.kernel.shape[-2] * layer.groups
        k = p.shape[-1] // channels
        p = tf.reshape(p, [tf.shape(p)[0], -1, k, groups, channels // groups])
        g = tf.reshape(g, [tf.shape(g)[0], -1, groups, layer.filters // groups])
        return tf.einsum(equation, p, g)

    def per_example(self, layer, a, g):
        p, g = self._patches_and_grads(layer, a, g)
        kernel = self._kernel_sum(layer, p, g, per_example=True)
        kernel = tf.reshape(kernel, [-1, *layer.kernel.shape])
        return [kernel] + ([tf.reduce_sum(g, 1)] if layer.use_bias else [])

    def weighted_sum(self, layer, a, g, weights):
        p, g = self._patches_and_grads(layer, a, g)
        gw = g * weights[:, None, None]
        kernel = self._kernel_sum(layer, p, gw, per_example=False)
        return ([tf.reshape(kernel, layer.kernel.shape)] +
                ([tf.reduce_sum(gw, [0, 1])] if layer.use_bias else []))

    def ghost(self, layer, input_shape):
        if layer.groups != 1:
            return False
        out = layer.compute_output_shape(input_shape)
        spatial = out[1:-1] if layer.data_format == "channels_last" else out[2:]
        return _ghost_is_cheaper(_positions(spatial), math.prod(layer.kernel.shape[:-1]),
                                 layer.filters)

    def sq_norms(self, layer, a, g):
        if layer.groups != 1:
            return None
        p, g = self._patches_and_grads(layer, a, g)
        if not _ghost_is_cheaper(p.shape[1], p.shape[-1], layer.filters):
            return None
        sq = _gram_sq_norm(p, g)
        if layer.use_bias:
            sq += tf.reduce_sum(tf.square(tf.reduce_sum(g, 1)), 1)
        return sq


class _DepthwiseRule(LayerRule):
    """DepthwiseConv1D/2D: each input channel c has its own ``depth_multiplier`` filters."""

    def variables(self, layer):
        return [layer.kernel] + ([layer.bias] if layer.use_bias else [])

    def forward(self, layer, inputs):
        z = keras.ops.depthwise_conv(inputs, tf.cast(layer.kernel, inputs.dtype),
                                     strides=layer.strides, padding=layer.padding,
                                     dilation_rate=layer.dilation_rate,
                                     data_format=layer.data_format)
        if layer.use_bias:
            out = layer.bias.shape[0]
            shape = ((1,) * (layer.rank + 1) + (out,) if layer.data_format == "channels_last"
                     else (1, out) + (1,) * layer.rank)
            z = z + tf.reshape(tf.cast(layer.bias, z.dtype), shape)
        return _apply_activation(layer, z), inputs, z

    def per_example(self, layer, a, g):
        if layer.data_format == "channels_first":
            a, g = _channels_last(a), _channels_last(g)
        channels, multiplier = layer.kernel.shape[-2], layer.kernel.shape[-1]
        p = conv_patches(a, layer.kernel_size, layer.strides, layer.padding, layer.dilation_rate)
        p = tf.reshape(_rows(p, p.shape[-1]), [tf.shape(a)[0], -1, p.shape[-1] // channels,
                                               channels])
        g = _rows(g, channels * multiplier)
        gg = tf.reshape(g, [tf.shape(g)[0], -1, channels, multiplier])
        kernel = tf.reshape(tf.einsum("btkc,btcm->bkcm", p, gg), [-1, *layer.kernel.shape])
        return [kernel] + ([tf.reduce_sum(g, 1)] if layer.use_bias else [])


# One rule class serves each family; each layer class gets its own named subclass.
for _layer_class, _rule_class, _name in (
        (keras.layers.Conv1D, _ConvRule, "conv1d"), (keras.layers.Conv2D, _ConvRule, "conv2d"),
        (keras.layers.Conv3D, _ConvRule, "conv3d"),
        (keras.layers.DepthwiseConv1D, _DepthwiseRule, "depthwise_conv1d"),
        (keras.layers.DepthwiseConv2D, _DepthwiseRule, "depthwise_conv2d")):
    register_rule(_layer_class)(type(f"{_layer_class.__name__}Rule", (_rule_class,),
                                     {"name": _name, "layer_class": _layer_class}))
