"""Per-layer rules: per-example gradients from one forward and one backward pass (notebook 01).

A rule knows one Keras layer class. For one pass, each covered layer's ``call`` is replaced
by the rule's :meth:`LayerRule.forward`, which computes the same output and records, for that
call, the tensors the rule needs: ``a`` (what the weights multiply: the input, its image
patches, the normalised input) and ``z`` (the result of that product, on the path to the
output). One backward pass of the *summed* loss gives ``g = dL/dz``, whose row ``b`` depends on
example ``b`` only, so ``(a, g)`` row by row gives each example's gradient:

- :meth:`LayerRule.per_example`: ``[B, *variable.shape]`` per variable (required);
- :meth:`LayerRule.sq_norms`: ``[B]`` squared norms without materialising them ("ghost"),
  or ``None`` where materialising is cheaper (optional);
- :meth:`LayerRule.weighted_sum`: ``sum_b w[b] * grad_b`` as one contraction (optional).

Rules are registered against an exact layer class with :func:`register_rule`, so a subclass
that overrides ``call`` is never handled by its parent's rule; a layer without a rule is left
to ``tf.vectorized_map`` by the caller (:mod:`gradtut.per_example`). Readers add their own::

    @register_rule(MyScale)                 # y = x * w, w of shape [d]
    class MyScaleRule(LayerRule):
        def variables(self, layer):
            return [layer.w]

        def forward(self, layer, x):
            z = x * layer.w
            return z, x, z                  # (layer output, a, z)

        def per_example(self, layer, a, g):
            return [tf.reduce_sum(a * g, axis=list(range(1, a.shape.rank - 1)))]

Valid only because examples do not interact in the forward pass (no BatchNormalization in
training mode), and because a covered layer's variables are used only inside its own calls.
"""
import contextlib
import math

import keras
import tensorflow as tf

_RULES = {}  # exact Keras layer class -> LayerRule instance
_VERSION = [0]  # bumped whenever a rule is registered or removed, so callers can drop functions
# traced before


def registry_version():
    """A number that changes whenever a rule is registered or unregistered.

    Example:
      >>> isinstance(registry_version(), int)
      True
    """
    return _VERSION[0]


def _check_layer(layer, what, kind="layer"):
    if not isinstance(layer, keras.layers.Layer):
        raise TypeError(f"{what} needs a Keras {kind}, got {type(layer).__name__} {layer!r:.80}")


def register_rule(layer_class):
    """Class decorator: use this :class:`LayerRule` subclass for layers of exactly ``layer_class``.

    Registering again for the same class replaces the earlier rule.

    Raises:
      TypeError: ``layer_class`` is not a Keras layer class; the decorated class is not a
        :class:`LayerRule` subclass, or is a rule written for another layer type (its
        ``layer_class``).

    Example:
      >>> class Scale(keras.layers.Layer):  # y = x * w, one weight per feature
      ...     def build(self, input_shape):
      ...         self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")
      ...     def call(self, x):
      ...         return x * self.w
      >>> @register_rule(Scale)
      ... class ScaleRule(LayerRule):
      ...     name = "scale"
      ...     def variables(self, layer):
      ...         return [layer.w]
      ...     def forward(self, layer, x):
      ...         z = x * layer.w
      ...         return z, x, z
      ...     def per_example(self, layer, a, g):
      ...         return [tf.reduce_sum(a * g, axis=list(range(1, a.shape.rank - 1)))]
      >>> layer = Scale()
      >>> layer.build((None, 3))
      >>> rule_for(layer).name
      'scale'
    """
    if not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
        raise TypeError(f"register_rule needs a Keras layer class, got {layer_class!r}")

    def register(rule_class):
        if not (isinstance(rule_class, type) and issubclass(rule_class, LayerRule)):
            raise TypeError(f"@register_rule decorates a LayerRule subclass, got {rule_class!r}")
        if not issubclass(layer_class, rule_class.layer_class):
            raise TypeError(
                f"{rule_class.__name__} is written for {rule_class.layer_class.__name__} layers, "
                f"and {layer_class.__name__} is not one; subclass LayerRule for "
                f"{layer_class.__name__} instead")
        _RULES[layer_class] = rule_class()
        _VERSION[0] += 1
        return rule_class

    return register


def rule_for(layer):
    """The rule that covers ``layer``'s variables, or None (no rule, frozen, or refused).

    Raises:
      TypeError: ``layer`` is not a Keras layer.

    Example:
      >>> dense = keras.layers.Dense(3)
      >>> dense.build((None, 4))
      >>> rule_for(dense).name, rule_for(keras.layers.Flatten())
      ('dense', None)
    """
    _check_layer(layer, "rule_for")
    if not layer.trainable or not layer.trainable_variables:
        return None
    rule, reason = _lookup(layer)
    return rule if reason is None else None


def _lookup(layer):
    """``(rule, None)`` when a registered rule takes ``layer``; ``(None, why not)`` otherwise."""
    rule = _RULES.get(type(layer))
    if rule is None:
        return None, f"no rule registered for {type(layer).__name__}"
    reason = rule.unsupported(layer)
    return (rule, None) if reason is None else (None, reason)


def unregister_rule(layer_class):
    """Remove the rule registered for exactly ``layer_class``, so its layers fall back again;
    returns the removed rule, or None if there was none. Functions traced before are rebuilt,
    as after :func:`register_rule`.

    Raises:
      TypeError: ``layer_class`` is not a Keras layer class.

    Example:
      >>> class Twice(keras.layers.Layer):
      ...     pass
      >>> unregister_rule(Twice) is None
      True
    """
    if not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
        raise TypeError(f"unregister_rule needs a Keras layer class, got {layer_class!r}")
    rule = _RULES.pop(layer_class, None)
    _VERSION[0] += 1
    return rule


def explain(layer):
    """``(rule name or "vectorized fallback", why)`` for a layer that owns trainable variables.

    Raises:
      TypeError: ``layer`` is not a Keras layer.

    Example:
      >>> explain(keras.layers.PReLU())
      ('vectorized fallback', 'no rule registered for PReLU')
    """
    _check_layer(layer, "explain")
    rule, reason = _lookup(layer)
    return ("vectorized fallback", reason) if rule is None else (rule.name, "")


class LayerRule:
    """How one layer type's per-example gradients follow from ``(a, g)``; subclass and register.

    ``a`` and ``g`` arrive with the batch first, ``g`` cast to the variables' dtype.
    ``layer_class`` is the layer type the rule is written for: :func:`register_rule` refuses to
    register it for another, and :meth:`unsupported` refuses other layers.

    Raises:
      NotImplementedError: a required method (:meth:`variables`, :meth:`forward`,
        :meth:`per_example`) is not implemented by the subclass.
      TypeError: :meth:`unsupported` is given something that is not a ``layer_class`` layer.

    Example:
      >>> LayerRule().unsupported(keras.layers.Dense(3)) is None  # no LoRA, not quantized
      True
    """

    name = "custom"
    layer_class = keras.layers.Layer

    def unsupported(self, layer):
        """None if the rule applies to this layer's configuration, else the reason it does not."""
        _check_layer(layer, f"{type(self).__name__}.unsupported")
        if not isinstance(layer, self.layer_class):
            raise TypeError(
                f"{type(self).__name__} is the rule for {self.layer_class.__name__} layers, got "
                f"{type(layer).__name__} {layer.name!r}; rule_for(layer) finds a layer's rule")
        if getattr(layer, "lora_enabled", False):
            return "LoRA is enabled"
        if getattr(layer, "quantization_mode", None):
            return f"quantized ({layer.quantization_mode})"
        return None

    def variables(self, layer):
        """The variables the rule computes gradients for, in the order ``per_example`` returns."""
        raise NotImplementedError(self._missing("variables(layer)"))

    def forward(self, layer, inputs):
        """``(output, a, z)``: the layer's output computed from ``z``, and what to record."""
        raise NotImplementedError(self._missing("forward(layer, inputs)"))

    def per_example(self, layer, a, g):
        """List aligned with :meth:`variables`: ``[B, *variable.shape]`` each."""
        raise NotImplementedError(self._missing("per_example(layer, a, g)"))

    def _missing(self, method):
        return (f"{type(self).__name__} must implement {method}: a LayerRule subclass defines "
                "variables, forward and per_example (see the module docstring's example)")

    def sq_norms(self, layer, a, g):
        """``[B]`` squared norms over :meth:`variables` without materialising, or None."""
        return None

    def ghost(self, layer, input_shape):
        """Whether :meth:`sq_norms` takes its ghost form for inputs of this shape (for the plan)."""
        return False

    def weighted_sum(self, layer, a, g, weights):
        """``sum_b weights[b] * grad_b`` per variable; by default from :meth:`per_example`."""
        return [tf.tensordot(weights, t, axes=1) for t in self.per_example(layer, a, g)]

    def merge(self, layer, calls):
        """Combine the ``(a, g)`` of several calls of one layer, where the rule can (default: no)."""
        return calls


# ----------------------------------------------------------------------------------- helpers


def _apply_activation(layer, z):
    return layer.activation(z) if getattr(layer, "activation", None) is not None else z


def _rows(t, width):
    """``[B, ..., width] -> [B, T, width]``; T static where the shape is known."""
    middle = t.shape[1:-1]
    steps = middle.num_elements() if middle.is_fully_defined() else -1
    return tf.reshape(t, [tf.shape(t)[0], steps, width])


def _gram_sq_norm(a, g):
    """``||sum_t a_t g_t^T||^2 = sum_ts (a_t . a_s)(g_t . g_s)`` for ``a [B,T,m]``, ``g [B,T,n]``."""
    if a.shape[1] == 1:  # Goodfellow: ||a g^T||^2 = ||a||^2 ||g||^2
        return tf.reduce_sum(tf.square(a[:, 0]), 1) * tf.reduce_sum(tf.square(g[:, 0]), 1)
    return tf.reduce_sum(tf.einsum("bti,bsi->bts", a, a) * tf.einsum("btj,bsj->bts", g, g),
                         axis=[1, 2])


def _ghost_is_cheaper(steps, m, n):
    """The mixed ghost-clipping rule (Bu et al. 2022): Gram form costs ~2 T^2 per example,
    materialising costs m * n; ghost when ``2 T^2 <= m * n``."""
    return steps is not None and 2 * steps * steps <= m * n


def _sum_except(t, keep_axes):
    """Sum ``t [B, ...]`` over every axis but 0 and ``keep_axes`` (positive, sorted)."""
    axes = [i for i in range(1, t.shape.rank) if i not in keep_axes]
    return tf.reduce_sum(t, axis=axes) if axes else t


# --------------------------------------------------------------------------------- the rules


@register_rule(keras.layers.Dense)
class DenseRule(LayerRule):
    """``z = a @ kernel + bias`` on inputs of any rank ``[B, ..., d]``."""

    name = "dense"
    layer_class = keras.layers.Dense

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
        kernel = (a[:, 0, :, None] * g[:, 0, None, :] if a.shape[1] == 1
                  else tf.einsum("bti,btj->bij", a, g))
        return [kernel] + ([tf.reduce_sum(g, 1)] if layer.bias is not None else [])

    def ghost(self, layer, input_shape):
        steps = 1
        for s in input_shape[1:-1]:
            steps = None if s is None or steps is None else steps * s
        return _ghost_is_cheaper(steps, *layer.kernel.shape)

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


@register_rule(keras.layers.EinsumDense)
class EinsumDenseRule(LayerRule):
    """``z = einsum(equation, a, kernel) + bias``; the attention projections are EinsumDense."""

    name = "einsum_dense"
    layer_class = keras.layers.EinsumDense

    def unsupported(self, layer):
        reason = super().unsupported(layer)
        if reason is None:
            inputs, rest = layer.equation.split(",")
            kernel, out = rest.split("->")
            if inputs[0] in kernel or inputs[0] != out[0] or "." in layer.equation:
                reason = f"equation {layer.equation!r} does not keep the batch axis first"
        return reason

    def _specs(self, layer):
        inputs, rest = layer.equation.split(",")
        kernel, out = rest.split("->")
        return inputs, kernel, out

    def variables(self, layer):
        return [layer.kernel] + ([layer.bias] if layer.bias is not None else [])

    def forward(self, layer, inputs):
        z = tf.einsum(layer.equation, inputs, tf.cast(layer.kernel, inputs.dtype))
        if layer.bias is not None:
            z = z + tf.cast(layer.bias, z.dtype)
        return _apply_activation(layer, z), inputs, z

    def per_example(self, layer, a, g):
        inputs, kernel, out = self._specs(layer)
        grads = [tf.einsum(f"{inputs},{out}->{inputs[0]}{kernel}", a, g)]
        if layer.bias is not None:  # the bias broadcasts over the output's trailing axes
            rank, bias_rank = g.shape.rank, len(layer.bias.shape)
            b = _sum_except(g, list(range(rank - bias_rank, rank)))
            size_one = [i + 1 for i, s in enumerate(layer.bias.shape) if s == 1]
            if size_one:
                b = tf.reduce_sum(b, axis=size_one, keepdims=True)
            grads.append(b)
        return grads


@register_rule(keras.layers.Embedding)
class EmbeddingRule(LayerRule):
    """``z = table[ids]``: each example's gradient is a scatter-add of ``g`` into its rows."""

    name = "embedding"
    layer_class = keras.layers.Embedding

    def variables(self, layer):
        return [layer.embeddings]

    def forward(self, layer, inputs):
        ids = tf.cast(inputs, tf.int32)
        z = tf.gather(layer.embeddings, ids)
        return tf.cast(z, layer.compute_dtype), ids, z

    def merge(self, layer, calls):
        width = layer.output_dim
        return [(tf.concat([_rows(a[..., None], 1)[..., 0] for a, _ in calls], 1),
                 tf.concat([_rows(g, width) for _, g in calls], 1))]

    def per_example(self, layer, a, g):
        a, g = _rows(a[..., None], 1)[..., 0], _rows(g, layer.output_dim)
        batch, vocab = tf.shape(a)[0], layer.input_dim
        segments = tf.reshape(a + tf.range(batch)[:, None] * vocab, [-1])
        table = tf.math.unsorted_segment_sum(tf.reshape(g, [-1, layer.output_dim]), segments,
                                             batch * vocab)
        return [tf.reshape(table, [batch, vocab, layer.output_dim])]

    def ghost(self, layer, input_shape):
        return True

    def sq_norms(self, layer, a, g):  # rows add up where a token repeats in an example
        a, g = _rows(a[..., None], 1)[..., 0], _rows(g, layer.output_dim)
        same = tf.cast(tf.equal(a[:, :, None], a[:, None, :]), g.dtype)
        return tf.reduce_sum(same * tf.einsum("btd,bsd->bts", g, g), axis=[1, 2])

    def weighted_sum(self, layer, a, g, weights):
        a, g = _rows(a[..., None], 1)[..., 0], _rows(g, layer.output_dim)
        gw = g * weights[:, None, None]
        return [tf.math.unsorted_segment_sum(tf.reshape(gw, [-1, layer.output_dim]),
                                             tf.reshape(a, [-1]), layer.input_dim)]


# Patches of at most this many values come from a one-hot convolution (see conv_patches), and
# a convolution layer with such patches records them from its forward pass.
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
            shape = ((1,) * (layer.rank + 1) + (layer.filters,) if layer.data_format == "channels_last"
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
        steps = 1
        for s in spatial:
            steps = None if s is None or steps is None else steps * s
        return _ghost_is_cheaper(steps, math.prod(layer.kernel.shape[:-1]), layer.filters)

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


def _channels_last(t):
    return tf.transpose(t, [0, *range(2, t.shape.rank), 1])




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


if hasattr(keras.layers, "RMSNormalization"):

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


# ---------------------------------------------------------------------- one recorded pass


@contextlib.contextmanager
def recording(layers, calls):
    """Route each ``(layer, rule)``'s ``call`` through ``rule.forward``, appending
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
        def call(inputs, *args, **kwargs):  # pylint: disable=unused-argument
            out, a, z = rule.forward(layer, inputs)
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
    """``[(layer, rule)]`` for every layer of ``model`` that a rule covers.

    Raises:
      TypeError: ``model`` is not a Keras model (or layer).

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
      ...                           keras.layers.PReLU(), keras.layers.Dense(2)])
      >>> [rule.name for _, rule in covered_layers(model)]
      ['dense', 'dense']
    """
    _check_layer(model, "covered_layers", "model")
    return [(layer, rule) for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
            if (rule := rule_for(layer)) is not None]


def one_pass(model, per_example_losses):
    """Run ``per_example_losses()`` (a ``[B]`` tensor) once with covered layers recording, and
    backpropagate its sum once.

    Returns:
      ``(layers, losses)``: ``layers`` is a list of ``(layer, rule, [(a, g), ...])``, one entry
      per covered layer whose output reaches the loss, with ``g`` cast to the layer's variable
      dtype; calls whose output does not reach the loss are dropped (they add nothing).

    Raises:
      TypeError: ``model`` is not a Keras model, or ``per_example_losses`` is not callable.
      ValueError: a covered layer was called but none of its calls reaches the loss;
        ``per_example_losses()`` did not return a ``[B]`` tensor.

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> layers, losses = one_pass(model, lambda: tf.reduce_sum(model(tf.ones([4, 3])), 1))
      >>> [(rule.name, len(pairs)) for _, rule, pairs in layers], tuple(losses.shape)
      ([('dense', 1)], (4,))
    """
    _check_layer(model, "one_pass", "model")
    if not callable(per_example_losses):
        raise TypeError(f"per_example_losses must be a function () -> [B] losses, got "
                        f"{type(per_example_losses).__name__}")
    calls = []
    with recording(covered_layers(model), calls), tf.GradientTape() as tape:
        losses = per_example_losses()
        if losses.shape.rank != 1:
            raise ValueError(f"per_example_losses() must return one loss per example, shape "
                             f"[B]; it returned shape {losses.shape}")
        total = tf.reduce_sum(losses)
    grads = tape.gradient(total, [z for _, _, _, z in calls])
    by_layer = {}
    for (layer, rule, a, _), g in zip(calls, grads):
        by_layer.setdefault(id(layer), (layer, rule, []))[2].append((a, g))
    layers = []
    for layer, rule, pairs in by_layer.values():
        dtype = rule.variables(layer)[0].dtype
        used = [(_cast_floating(a, dtype), tf.cast(g, dtype)) for a, g in pairs if g is not None]
        if not used:
            raise ValueError(
                f"layer {layer.name!r} is called, but none of its outputs reaches the loss, so "
                "its variables get no gradient. Freeze it (layer.trainable = False) or remove it.")
        layers.append((layer, rule, rule.merge(layer, used) if len(used) > 1 else used))
    return layers, losses


def _cast_floating(a, dtype):
    if isinstance(a, tuple):
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
      >>> layers, _ = one_pass(model, lambda: tf.reduce_sum(model(tf.ones([4, 3])), 1))
      >>> [tuple(t.shape) for t in per_example_of(*layers[0]).values()]
      [(4, 3, 2), (4, 2)]
    """
    _check_pairs(layer, rule, pairs, "per_example_of")
    total = None
    for a, g in pairs:
        grads = rule.per_example(layer, a, g)
        total = grads if total is None else [t + u for t, u in zip(total, grads)]
    return dict(zip(map(id, rule.variables(layer)), total))


def ghost_sq_norms_of(layer, rule, pairs, trainable_ids):
    """``[B]`` squared norm of one layer's per-example gradient by the rule's ghost form, or
    None where it has none, where it costs more than materialising (then use
    :func:`per_example_of`), or where the layer has several calls or frozen variables.

    Raises:
      TypeError, ValueError: as :func:`per_example_of`.

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> layers, _ = one_pass(model, lambda: tf.reduce_sum(model(tf.ones([4, 3])), 1))
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
      >>> layers, _ = one_pass(model, lambda: tf.reduce_sum(model(tf.ones([4, 3])), 1))
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
        total = sums if total is None else [t + u for t, u in zip(total, sums)]
    return dict(zip(map(id, rule.variables(layer)), total))


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
