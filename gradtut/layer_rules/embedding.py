"""Rules for embeddings: ``Embedding``, ``ReversibleEmbedding`` (input and output embedding
sharing one table) and KerasHub's ``PositionEmbedding`` (notebook 01, section 6)."""
import keras
import tensorflow as tf

from gradtut.layer_rules.common import _ghost_is_cheaper, _gram_sq_norm, _rows
from gradtut.layer_rules.registry import LayerRule, register_rule


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


def _ids_and_grads(layer, a, g):
    return _rows(a[..., None], 1)[..., 0], _rows(g, layer.output_dim)


@register_rule(keras.layers.ReversibleEmbedding)
class ReversibleEmbeddingRule(LayerRule):
    """``call(ids)`` looks rows up in ``embeddings``; ``call(x, reverse=True)`` is the output
    projection ``x @ embeddings^T`` (tied) or ``x @ reverse_embeddings``, with an optional
    ``logit_soft_cap``. One step often holds both calls. The recorded ``a`` is
    ``(ids, None)`` or ``(None, x)``; the calls of one step merge into ``(ids, x)`` with
    ``g = (g_lookup, g_logits)``, and the norm of the tied table's gradient is
    ``||S||^2 + ||R||^2 + 2 <S, R>`` (S from the lookup, R from the projection), each without
    materialising: ``<S, R> = sum_ts (g_lookup_t . x_s) g_logits[s, id_t]``."""

    name = "reversible_embedding"
    layer_class = keras.layers.ReversibleEmbedding

    def variables(self, layer):
        return [layer.embeddings] + ([] if layer.tie_weights else [layer.reverse_embeddings])

    def record(self, layer, args, kwargs):
        reverse = kwargs.get("reverse", args[1] if len(args) > 1 else False)
        inputs = args[0]
        if not reverse:
            ids = tf.cast(inputs, tf.int32)
            z = tf.gather(layer.embeddings, ids)
            return tf.cast(z, layer.compute_dtype), (ids, None), z
        kernel = tf.transpose(layer.embeddings) if layer.tie_weights else layer.reverse_embeddings
        # As Keras's matmul: float16 inputs times the float32 table give float32 logits (the
        # layer does not autocast), unless reverse_dtype says otherwise.
        dtype = layer.reverse_dtype or keras.backend.result_type(inputs.dtype.name,
                                                                 layer.embeddings.dtype)
        x = tf.cast(inputs, dtype)
        z = tf.reshape(tf.matmul(tf.reshape(x, [-1, x.shape[-1]]), tf.cast(kernel, dtype)),
                       tf.concat([tf.shape(x)[:-1], [layer.input_dim]], 0))
        out = z
        if layer.logit_soft_cap is not None:
            out = tf.tanh(z / layer.logit_soft_cap) * layer.logit_soft_cap
        return out, (None, x), z

    def merge(self, layer, calls):
        ids = [a[0] for a, _ in calls if a[0] is not None]
        xs = [(a[1], g) for a, g in calls if a[1] is not None]
        g_ids = [g for a, g in calls if a[0] is not None]
        width = layer.output_dim
        merged_ids = (tf.concat([_rows(t[..., None], 1)[..., 0] for t in ids], 1) if ids else None)
        merged_g_ids = tf.concat([_rows(g, width) for g in g_ids], 1) if ids else None
        merged_x = tf.concat([_rows(x, width) for x, _ in xs], 1) if xs else None
        merged_g_x = tf.concat([_rows(g, layer.input_dim) for _, g in xs], 1) if xs else None
        return [((merged_ids, merged_x), (merged_g_ids, merged_g_x))]

    def _parts(self, layer, a, g):
        """``(ids [B,T], g_lookup [B,T,d], x [B,S,d], g_logits [B,S,V])``, None where absent."""
        ids, x = a
        if not isinstance(g, tuple):
            g = (g, None) if ids is not None else (None, g)
        g_ids, g_x = g
        if ids is not None:
            ids, g_ids = _rows(ids[..., None], 1)[..., 0], _rows(g_ids, layer.output_dim)
        if x is not None:
            x, g_x = _rows(x, layer.output_dim), _rows(g_x, layer.input_dim)
            x, g_x = tf.cast(x, g_x.dtype), g_x
        return ids, g_ids, x, g_x

    def per_example(self, layer, a, g):
        ids, g_ids, x, g_x = self._parts(layer, a, g)
        batch = tf.shape(ids if ids is not None else x)[0]
        vocab, width = layer.input_dim, layer.output_dim
        table = tf.zeros(tf.stack([batch, vocab, width]), layer.embeddings.dtype)
        if ids is not None:
            segments = tf.reshape(ids + tf.range(batch)[:, None] * vocab, [-1])
            table += tf.reshape(tf.math.unsorted_segment_sum(
                tf.reshape(g_ids, [-1, width]), segments, batch * vocab), [batch, vocab, width])
        reverse = tf.einsum("bsi,bsv->bvi", x, g_x) if x is not None else None
        if layer.tie_weights:
            return [table + tf.cast(reverse, table.dtype) if reverse is not None else table]
        untied = (tf.transpose(reverse, [0, 2, 1]) if reverse is not None
                  else tf.zeros(tf.stack([batch, width, vocab]), layer.reverse_embeddings.dtype))
        return [table, tf.cast(untied, layer.reverse_embeddings.dtype)]

    def weighted_sum(self, layer, a, g, weights):
        """``sum_b w_b grad_b`` without the ``[B, V, d]`` per-example tables: the lookup's
        weighted rows scattered into the table, plus ``x^T (w g_logits)`` for the projection."""
        ids, g_ids, x, g_x = self._parts(layer, a, g)
        vocab, width = layer.input_dim, layer.output_dim
        table = tf.zeros([vocab, width], layer.embeddings.dtype)
        if ids is not None:
            table += tf.cast(tf.math.unsorted_segment_sum(
                tf.reshape(g_ids * tf.cast(weights, g_ids.dtype)[:, None, None], [-1, width]),
                tf.reshape(ids, [-1]), vocab), table.dtype)
        reverse = (tf.einsum("bsi,bsv->vi", x, g_x * tf.cast(weights, g_x.dtype)[:, None, None])
                   if x is not None else None)
        if layer.tie_weights:
            return [table + tf.cast(reverse, table.dtype) if reverse is not None else table]
        untied = (tf.transpose(reverse) if reverse is not None
                  else tf.zeros([width, vocab], layer.reverse_embeddings.dtype))
        return [table, tf.cast(untied, layer.reverse_embeddings.dtype)]

    def ghost(self, layer, input_shape):
        steps = input_shape[1] if len(input_shape) == 2 else None
        return _ghost_is_cheaper(steps, layer.output_dim, layer.input_dim)

    def sq_norms(self, layer, a, g):
        ids, g_ids, x, g_x = self._parts(layer, a, g)
        parts = []
        if ids is not None:
            same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), g_ids.dtype)
            parts.append(tf.reduce_sum(same * tf.einsum("btd,bsd->bts", g_ids, g_ids), [1, 2]))
        if x is not None:
            if not _ghost_is_cheaper(x.shape[1], layer.output_dim, layer.input_dim):
                return None
            parts.append(_gram_sq_norm(x, g_x))
        if ids is not None and x is not None and layer.tie_weights:
            lookup_dot_x = tf.einsum("bti,bsi->bts", g_ids, x)
            logits_at_ids = tf.gather(g_x, ids, axis=2, batch_dims=1)  # [B, S, T]
            parts.append(2.0 * tf.reduce_sum(lookup_dot_x * tf.transpose(logits_at_ids,
                                                                         [0, 2, 1]), [1, 2]))
        return tf.add_n(parts)


@register_rule("keras_hub.src.layers.modeling.position_embedding.PositionEmbedding")
class PositionEmbeddingRule(LayerRule):
    """KerasHub's ``PositionEmbedding``: rows ``start_index ... start_index + T`` of
    ``position_embeddings [L, d]``, broadcast to the input ``[B, ..., T, d]``. Example b's
    gradient is its output gradient summed over the broadcast axes, in those rows."""

    name = "position_embedding"

    def variables(self, layer):
        return [layer.position_embeddings]

    def record(self, layer, args, kwargs):
        inputs = args[0]
        start = kwargs.get("start_index", args[1] if len(args) > 1 else 0)
        if kwargs.get("positions") is not None:
            raise ValueError(f"layer {layer.name!r}: PositionEmbedding with explicit positions "
                             "is not covered by gradtut's rule; call it with start_index")
        shape = tf.shape(inputs)
        table = tf.slice(tf.convert_to_tensor(layer.position_embeddings), tf.stack([start, 0]),
                         tf.stack([shape[-2], shape[-1]]))
        z = tf.broadcast_to(table, shape)
        return z, tf.cast(start, tf.int32), z

    def _rows(self, layer, g):
        """``[B, T, d]``: the output gradient summed over the axes the table broadcasts over."""
        if g.shape.rank > 3:
            g = tf.reduce_sum(g, axis=list(range(1, g.shape.rank - 2)))
        return g

    def _place(self, layer, start, rows):
        length = layer.position_embeddings.shape[0]
        steps = tf.shape(rows)[-2]
        pad = [[0, 0]] * (rows.shape.rank - 2) + [[start, length - start - steps], [0, 0]]
        return tf.pad(rows, pad)

    def per_example(self, layer, a, g):
        return [self._place(layer, a, self._rows(layer, g))]

    def ghost(self, layer, input_shape):
        return True

    def sq_norms(self, layer, a, g):
        return tf.reduce_sum(tf.square(self._rows(layer, g)), [1, 2])

    def weighted_sum(self, layer, a, g, weights):
        return [self._place(layer, a, tf.tensordot(weights, self._rows(layer, g), axes=1))]
