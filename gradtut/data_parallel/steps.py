"""Correctly scaled data-parallel steps, the single-device reference they are checked
against, and the replica-mean mistake (notebook 03, sections 1-3).

Every replica holds a copy of the model, computes gradients on its shard of the global batch,
and the optimizer all-reduces (sums) them before one identical update everywhere. For that
sum to be the gradient of the *global* mean loss, each replica must divide its summed
per-example losses by the number of examples in the whole global batch, not by its own
shard's size: a plain ``tf.reduce_mean`` inside the replica function is off by the replica
count. The steps here divide by the global batch's actual size (summed over replicas at run
time), so a batch that does not split evenly, or a short final batch, is still weighted right.

Build the model and optimizer under ``strategy.scope()`` and feed the steps batches from
``strategy.experimental_distribute_dataset``. Under the default strategy
(``tf.distribute.get_strategy()``, one device) the same steps are ordinary single-device
training; ``gradtut.efficiency.make_accumulating_train_step`` is the accumulating step of
:mod:`gradtut.data_parallel.accumulation` used that way.
"""

import tensorflow as tf

from gradtut.checks import (
    check_int,
    check_keras_model,
    check_loss_fn,
    check_no_clipping_over_replicas,
    check_optimizer,
    checked_batch,
)
from gradtut.per_example import per_example_losses

_SUM = tf.distribute.ReduceOp.SUM


def _check_strategy(strategy):
    if not all(hasattr(strategy, name) for name in ("run", "reduce", "scope",
                                                     "num_replicas_in_sync")):
        raise TypeError(f"strategy must be a tf.distribute strategy, got "
                        f"{type(strategy).__name__}; pass e.g. tf.distribute.MirroredStrategy(), "
                        "or tf.distribute.get_strategy() for one device")


def _check_every_replica_gets_examples(strategy, examples, what):
    replicas = strategy.num_replicas_in_sync
    if examples < replicas:
        raise ValueError(
            f"{what} {examples} is smaller than the {replicas} replicas: some "
            "replicas would never see an example. Use a global batch of at least one example per "
            "replica (usually a multiple of the replica count).")


def _check_step_arguments(strategy, model, loss_fn, optimizer, global_batch_size):
    """What a step factory can check before its first batch; returns ``global_batch_size``."""
    _check_strategy(strategy)
    check_keras_model(model)
    check_loss_fn(loss_fn)
    check_optimizer(optimizer)
    check_no_clipping_over_replicas(optimizer, strategy.num_replicas_in_sync)
    global_batch_size = check_int(global_batch_size, "global_batch_size")
    _check_every_replica_gets_examples(strategy, global_batch_size, "global_batch_size")
    return global_batch_size


def _weight_regularization_losses(model):
    """The weight regularisers' losses (``kernel_regularizer`` and the like), computed from the
    weights as they are now: the same value on every replica, whatever the batch."""
    return [w.regularizer(w) for w in model.trainable_weights
            if getattr(w, "regularizer", None) is not None]


def _refuse_call_losses(model, where):
    """Refuse losses the forward pass just recorded (``activity_regularizer``, ``add_loss``)."""
    recorded = len(model.losses) - len(_weight_regularization_losses(model))
    if recorded:
        raise ValueError(
            f"the model recorded {recorded} loss(es) in its forward pass (activity_regularizer or "
            f"add_loss); {where} cannot weight them exactly: each is computed from the batch the "
            "layer sees (one replica's share, one micro-batch; Keras divides an activity "
            "regulariser by that batch's size), and replicas record them on the same shared "
            "layers. Remove them, or add the term to loss_fn; make_train_step keeps "
            "them on a single replica.")


def _regularization(model, replicas):
    """The model's losses, scaled for one of ``replicas`` replicas' share. Call after the
    forward pass: with one replica it includes the losses the pass recorded, which are the
    whole batch's; with more, those are refused."""
    if replicas > 1:
        _refuse_call_losses(model, f"a step over {replicas} replicas")
    if not model.losses:
        return 0.0
    return tf.add_n(model.losses) / replicas


def regularization_gradients(model, replicas=1):
    """Gradients of the model's weight regularisation losses (``kernel_regularizer`` and the
    like) divided by ``replicas`` (one replica's share), lined up with
    ``model.trainable_variables``; None for a variable they do not reach, and all None for a
    model without them. Losses a forward pass records (activity regularisers, ``add_loss``)
    belong to that pass's batch and are not included.

    Raises:
      TypeError: ``model`` is not a Keras model. ValueError: ``replicas`` not a positive int.

    Example:
      >>> import keras
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> regularization_gradients(model)
      [None, None]
    """
    check_keras_model(model)
    replicas = check_int(replicas, "replicas")
    with tf.GradientTape() as tape:
        losses = _weight_regularization_losses(model)
        total = tf.add_n(losses) / replicas if losses else None
    if total is None:
        return [None] * len(model.trainable_variables)
    return tape.gradient(total, model.trainable_variables)


def make_train_step(strategy, model, loss_fn, optimizer, global_batch_size):
    """A ``tf.function`` training step for batches from
    ``strategy.experimental_distribute_dataset``.

    Each replica computes ``sum(per-example losses) / N`` where N is the number of examples in
    the whole global batch (counted at run time, so an uneven split or a short final batch is
    weighted exactly), adds the model's losses divided by the replica count (what
    ``tf.nn.scale_regularization_loss`` does), and the optimizer sums the replicas' gradients.
    The update therefore equals one step of single-device training on the concatenated global
    batch. Losses the forward pass records (``activity_regularizer``, ``add_loss``) are kept on
    one replica and refused on more: each is computed from the replica's share of the batch
    (Keras divides an activity regulariser by that share's size, and an ``add_loss`` term is
    whatever the layer computed from it), and the replicas record them on the same shared
    layers, so their sum is not the
    single-device value (on a small MLP with an L2 activity regulariser, the loss came out
    2-5% off over 2 and 4 replicas).

    Args:
      strategy: a ``tf.distribute`` strategy (``MirroredStrategy``,
        ``MultiWorkerMirroredStrategy``, the default strategy, ...).
      model, optimizer: a Keras model and optimizer, created under ``strategy.scope()``.
      loss_fn: ``loss_fn(y_true, y_pred) -> [B]`` per-example losses (Keras losses with
        ``reduction=None``).
      global_batch_size: the batch size the dataset was batched with (positive, at least the
        number of replicas); used to check arguments. The division uses the actual size.

    Returns:
      ``step(distributed_batch) -> scalar`` mean loss over the global batch (plus regularisation),
      reduced across replicas.

    Raises:
      ValueError: ``global_batch_size`` is not a positive int or is smaller than the replica
        count; ``loss_fn`` is a loss name (a string); over more than one replica, an optimizer
        that clips (Keras clips each replica's share before summing them); at the first call, a
        ``loss_fn`` that does not return ``[B]`` (a mean or sum over the batch: build it with
        ``reduction=None``), or, over more than one replica, a model whose forward pass records
        losses.
      TypeError: ``strategy``, ``model`` or ``optimizer`` is not one, or ``loss_fn`` cannot be
        called.

    Example (one device here; notebook 03 uses a ``MirroredStrategy`` over virtual CPUs):
      >>> import keras
      >>> import numpy as np
      >>> strategy = tf.distribute.get_strategy()
      >>> with strategy.scope():
      ...     model = keras.Sequential([keras.Input((3,)),
      ...                               keras.layers.Dense(2, kernel_initializer="zeros")])
      ...     optimizer = keras.optimizers.SGD(0.1)
      >>> loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
      >>> data = tf.data.Dataset.from_tensor_slices((np.ones((4, 3), "float32"), [0, 1, 1, 0]))
      >>> step = make_train_step(strategy, model, loss, optimizer, global_batch_size=4)
      >>> [round(float(step(batch)), 4) for batch in
      ...  strategy.experimental_distribute_dataset(data.batch(4))]  # ln 2: logits start at 0
      [0.6931]
    """
    _check_step_arguments(strategy, model, loss_fn, optimizer, global_batch_size)

    def replica_step(x, y):
        context = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            losses = per_example_losses(model, loss_fn, x, y, training=True)
            examples = context.all_reduce(_SUM, tf.cast(tf.size(losses), losses.dtype))
            loss = tf.reduce_sum(losses) / tf.maximum(examples, 1.0) + _regularization(
                model, context.num_replicas_in_sync)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return _summed_over_replicas(strategy, replica_step)


def _summed_over_replicas(strategy, replica_fn, **tf_function_options):
    """A ``tf.function`` ``(distributed_batch) -> replica_fn(x, y)`` run on every replica and
    summed over them."""
    @tf.function(**tf_function_options)
    def run(batch):
        x, y = batch
        return strategy.reduce(_SUM, strategy.run(replica_fn, args=(x, y)), axis=None)

    return run


def replica_mean_loss_mistake(strategy, model, loss_fn, x, y):
    """The loss a replica function with ``tf.reduce_mean`` reports, over the correct global mean.

    Returns ``(wrong, right)``: with a plain ``tf.reduce_mean`` per replica, summing the
    replicas (as the optimizer does with gradients) gives ``replicas x`` the global mean loss
    (exactly so for equal shards).
    Used by notebook 03 and the tests to show the classic mistake's factor.

    Args:
      strategy: a ``tf.distribute`` strategy; model: a Keras model built under its scope.
      loss_fn: per-example losses, as :func:`make_train_step`.
      x, y: one global batch (at least one example per replica).

    Raises:
      ValueError: x or y is None, they differ in length, the batch is empty or smaller than the
        replica count, ``loss_fn`` is a loss name, or it does not return ``[B]``.
      TypeError: ``strategy`` or ``model`` is not one, or ``loss_fn`` cannot be called.

    Example (with one replica the mistake costs nothing; 4 replicas give 4.0, notebook 03):
      >>> import keras
      >>> import numpy as np
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
      >>> x, y = np.ones((4, 3), "float32"), np.array([0, 1, 1, 0])
      >>> wrong, right = replica_mean_loss_mistake(tf.distribute.get_strategy(), model, loss, x, y)
      >>> round(wrong / right, 6)
      1.0
    """
    _check_strategy(strategy)
    check_keras_model(model)
    check_loss_fn(loss_fn)
    x, y, examples = checked_batch(x, y)
    _check_every_replica_gets_examples(strategy, examples, "the batch size")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(examples)
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

    def replica(xs, ys):
        losses = per_example_losses(model, loss_fn, xs, ys, training=True)
        right = tf.nn.compute_average_loss(losses, global_batch_size=examples)
        return tf.reduce_mean(losses), right

    wrong, right = strategy.run(replica, args=batch)
    return (float(strategy.reduce(_SUM, wrong, axis=None)),
            float(strategy.reduce(_SUM, right, axis=None)))


def single_device_step(model, loss_fn, optimizer, x, y):
    """The reference: one step of ordinary training on the whole (global) batch, one device.

    Returns the mean loss (plus the model's losses) before the update.

    Raises:
      ValueError: x or y is None, they differ in length, the batch is empty, ``loss_fn`` is a
        loss name or does not return ``[B]``.
      TypeError: ``model`` or ``optimizer`` is not one, or ``loss_fn`` cannot be called.

    Example:
      >>> import keras
      >>> import numpy as np
      >>> model = keras.Sequential([keras.Input((3,)),
      ...                           keras.layers.Dense(2, kernel_initializer="zeros")])
      >>> loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
      >>> x, y = np.ones((4, 3), "float32"), np.array([0, 1, 1, 0])
      >>> round(float(single_device_step(model, loss, keras.optimizers.SGD(0.1), x, y)), 4)
      0.6931
    """
    check_keras_model(model)
    check_loss_fn(loss_fn)
    check_optimizer(optimizer)
    x, y, _ = checked_batch(x, y)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(per_example_losses(model, loss_fn, x, y, training=True))
        if model.losses:
            loss += tf.add_n(model.losses)
    optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return loss
