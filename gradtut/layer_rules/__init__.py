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

Rules are registered against a layer class with :func:`register_rule`; a subclass uses its
parent's rule only if it does not override ``call``. A layer without a rule takes the
layer-local path (:mod:`gradtut.layer_rules.local`): a vectorised vector-Jacobian product of
that layer alone, on its own recorded inputs. Readers add their own rules::

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

One module per layer family, as Opacus's ``grad_sample/``:

- :mod:`~gradtut.layer_rules.registry`: :class:`LayerRule`, :func:`register_rule`, lookup;
- :mod:`~gradtut.layer_rules.engine`: the recorded pass and the per-layer results;
- :mod:`~gradtut.layer_rules.dense`, :mod:`~gradtut.layer_rules.einsum_dense`,
  :mod:`~gradtut.layer_rules.lora`, :mod:`~gradtut.layer_rules.embedding`,
  :mod:`~gradtut.layer_rules.conv`, :mod:`~gradtut.layer_rules.normalization`: the rules;
- :mod:`~gradtut.layer_rules.local`: the layer-local path for layers without a rule;
- :mod:`~gradtut.layer_rules.onednn`: the TensorFlow bug the rules route around.
"""
from gradtut.layer_rules.conv import ONE_HOT_PATCH_LIMIT, conv_patches
from gradtut.layer_rules.dense import DenseRule
from gradtut.layer_rules.einsum_dense import EinsumDenseRule
from gradtut.layer_rules.embedding import (
                                           EmbeddingRule,
                                           PositionEmbeddingRule,
                                           ReversibleEmbeddingRule,
)
from gradtut.layer_rules.engine import (
                                           covered_layers,
                                           ghost_sq_norms_of,
                                           layer_paths,
                                           one_pass,
                                           per_example_of,
                                           recording,
                                           squared_norms,
                                           warn_unreached,
                                           weighted_sum_of,
)
from gradtut.layer_rules.local import LocalRule, is_recurrent, owned_trainable
from gradtut.layer_rules.lora import LoraRule
from gradtut.layer_rules.normalization import (
                                           GroupNormalizationRule,
                                           LayerNormalizationRule,
                                           RMSNormalizationRule,
)
from gradtut.layer_rules.onednn import (
                                           broadcast_matmul_hazards,
                                           is_broadcast_matmul_hazard,
                                           onednn_enabled,
)
from gradtut.layer_rules.registry import (
                                           LayerRule,
                                           class_path,
                                           explain,
                                           register_rule,
                                           registry_version,
                                           rule_for,
                                           unregister_rule,
)

__all__ = [
    "ONE_HOT_PATCH_LIMIT", "DenseRule", "EinsumDenseRule", "EmbeddingRule",
    "GroupNormalizationRule", "LayerNormalizationRule", "LayerRule", "LocalRule", "LoraRule",
    "PositionEmbeddingRule", "RMSNormalizationRule", "ReversibleEmbeddingRule",
    "broadcast_matmul_hazards", "class_path", "conv_patches", "covered_layers", "explain",
    "ghost_sq_norms_of", "is_broadcast_matmul_hazard", "is_recurrent", "layer_paths",
    "onednn_enabled", "one_pass",
    "owned_trainable", "per_example_of", "recording", "register_rule", "registry_version",
    "rule_for", "squared_norms", "unregister_rule", "warn_unreached", "weighted_sum_of",
]
