"""The rule registry: which rule covers a layer, and how a reader adds one (notebook 01, section 6).

Rules are found through the layer's class and its parents (:func:`rule_for`). A parent's
rule covers a subclass only where no class between them overrides ``call``: a subclass with
its own ``call`` computes something else, so it takes the layer-local path
(:mod:`gradtut.layer_rules.local`) until a rule is registered for it.
"""
import keras
import tensorflow as tf

_RULES = {}  # Keras layer class, or "module.QualName" of one -> LayerRule instance
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
    """Class decorator: use this :class:`LayerRule` subclass for layers of ``layer_class``, and
    for its subclasses that do not override ``call``.

    ``layer_class`` is a Keras layer class, or the ``"module.QualName"`` string of one from a
    library gradtut does not import (KerasHub's ``PositionEmbedding``). Registering again for
    the same class replaces the earlier rule.

    Raises:
      TypeError: ``layer_class`` is not a Keras layer class or a dotted class path; the
        decorated class is not a
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
    _check_layer_class(layer_class, "register_rule")

    def register(rule_class):
        if not (isinstance(rule_class, type) and issubclass(rule_class, LayerRule)):
            raise TypeError(f"@register_rule decorates a LayerRule subclass, got {rule_class!r}")
        if isinstance(layer_class, type) and not issubclass(layer_class, rule_class.layer_class):
            raise TypeError(
                f"{rule_class.__name__} is written for {rule_class.layer_class.__name__} layers, "
                f"and {layer_class.__name__} is not one; subclass LayerRule for "
                f"{layer_class.__name__} instead")
        _RULES[layer_class] = rule_class()
        _VERSION[0] += 1
        return rule_class

    return register


def _check_layer_class(layer_class, what):
    if isinstance(layer_class, str):
        if "." not in layer_class:
            raise TypeError(f"{what} takes a Keras layer class or its 'module.QualName' path, "
                            f"got {layer_class!r}")
    elif not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
        raise TypeError(f"{what} needs a Keras layer class, got {layer_class!r}")


def class_path(cls):
    """``"module.QualName"`` of a class: how a rule for a class gradtut does not import is keyed.

    Raises:
      TypeError: ``cls`` is not a class.

    Example:
      >>> class_path(keras.layers.Dense)
      'keras.src.layers.core.dense.Dense'
    """
    if not isinstance(cls, type):
        raise TypeError(f"class_path needs a class (type(layer)), got {type(cls).__name__}")
    return f"{cls.__module__}.{cls.__qualname__}"


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
    """``(rule, None)`` when a registered rule takes ``layer``; ``(None, why not)`` otherwise.

    Walks the class's parents: the first registered one gives the rule, unless a class below
    it overrides ``call`` (it then computes something the rule does not know)."""
    overriding = None
    for cls in type(layer).__mro__:
        rule = _RULES.get(cls) or _RULES.get(class_path(cls))
        if rule is not None:
            if overriding is not None:
                return None, (f"{overriding.__name__} overrides call() of {cls.__name__}, whose "
                              f"rule ({rule.name}) does not cover it")
            rule = rule.for_layer(layer)
            reason = rule.unsupported(layer)
            return (rule, None) if reason is None else (None, reason)
        if cls is keras.layers.Layer:
            break
        if "call" in vars(cls) and overriding is None:
            overriding = cls
    return None, f"no rule registered for {type(layer).__name__}"


def unregister_rule(layer_class):
    """Remove the rule registered for exactly ``layer_class``, so its layers take the
    layer-local path again;
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
    _check_layer_class(layer_class, "unregister_rule")
    rule = _RULES.pop(layer_class, None)
    _VERSION[0] += 1
    return rule


def explain(layer):
    """``(rule name or "layer-local", why)`` for a layer that owns trainable variables.

    Raises:
      TypeError: ``layer`` is not a Keras layer.

    Example:
      >>> explain(keras.layers.PReLU())
      ('layer-local', 'no rule registered for PReLU')
    """
    _check_layer(layer, "explain")
    rule, reason = _lookup(layer)
    return ("layer-local", reason) if rule is None else (rule.name, "")


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
    supports_lora = False  # whether the rule covers Keras LoRA (layer.enable_lora)

    def for_layer(self, layer):
        """The rule to use for this layer's configuration (a LoRA variant, say); default self."""
        return self

    def unsupported(self, layer):
        """None if the rule applies to this layer's configuration, else the reason it does not."""
        _check_layer(layer, f"{type(self).__name__}.unsupported")
        if not isinstance(layer, self.layer_class):
            raise TypeError(
                f"{type(self).__name__} is the rule for {self.layer_class.__name__} layers, got "
                f"{type(layer).__name__} {layer.name!r}; rule_for(layer) finds a layer's rule")
        if getattr(layer, "lora_enabled", False) and not self.supports_lora:
            return "LoRA is enabled"
        if getattr(layer, "quantization_mode", None):
            return f"quantized ({layer.quantization_mode})"
        return None

    def variables(self, layer):
        """The variables the rule computes gradients for, in the order ``per_example`` returns."""
        raise NotImplementedError(self._missing("variables(layer)"))

    def record(self, layer, args, kwargs):
        """``(output, a, z)`` for one call ``layer.call(*args, **kwargs)``. By default
        :meth:`forward` of the first argument: override it where a keyword changes the
        computation (``ReversibleEmbedding``'s ``reverse``)."""
        return self.forward(layer, args[0])

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
        """Combine the ``(a, g)`` of several calls of one layer, where the rule can
        (default: no)."""
        return calls

