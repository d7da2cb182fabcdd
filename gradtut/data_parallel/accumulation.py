"""Gradient accumulation under a strategy: k micro-batches summed on every replica, then one
update that equals one step on the concatenated batch (notebook 03, section 5)."""
import functools

import tensorflow as tf

from gradtut.checks import (
    check_int,
)
from gradtut.data_parallel.steps import (
    _SUM,
    _check_step_arguments,
    _refuse_call_losses,
    _summed_over_replicas,
    regularization_gradients,
)
from gradtut.per_example import per_example_losses


def _applying_every(accumulation_steps, accumulate, apply):
    """``step(batch) -> (loss, applied)``: ``accumulate(batch)`` on every call, then
    ``apply()`` on every ``accumulation_steps``-th."""
    calls = [0]

    def step(batch):
        loss = accumulate(batch)
        calls[0] += 1
        if calls[0] % accumulation_steps:
            return loss, False
        apply()
        return loss, True

    return step


def _replica_accumulators(strategy, model):
    """``(sums, seen)``: per-replica gradient sums, one per trainable variable, and a
    per-replica example count. Read outside a replica, each sums over the replicas."""
    local = dict(trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                 aggregation=tf.VariableAggregation.SUM)
    with strategy.scope():
        sums = [tf.Variable(tf.zeros(v.shape, v.dtype), **local) for v in model.trainable_variables]
        seen = tf.Variable(0.0, **local)
    return sums, seen


def _accumulate_on_replica(model, loss_fn, sums, seen, x, y):
    """Add this replica's summed-loss gradient to ``sums`` and its example count to ``seen``;
    return its share of the micro-batch's mean loss over all replicas."""
    with tf.GradientTape() as tape:
        losses = per_example_losses(model, loss_fn, x, y, training=True)
        total = tf.reduce_sum(losses)
    _refuse_call_losses(model, "gradient accumulation")
    grads = tape.gradient(total, model.trainable_variables, unconnected_gradients="zero")
    for s, g in zip(sums, grads, strict=True):
        s.assign_add(tf.convert_to_tensor(g))
    count = tf.cast(tf.size(losses), tf.float32)
    seen.assign_add(count)
    examples = tf.distribute.get_replica_context().all_reduce(_SUM, count)
    return total / tf.cast(tf.maximum(examples, 1.0), total.dtype)


def _apply_accumulated_on_replica(model, optimizer, sums, seen):
    """Divide this replica's sums by the examples seen on all replicas, add its share of the
    regularisation gradient, apply (the optimizer sums the replicas), and zero the state."""
    context = tf.distribute.get_replica_context()
    examples = tf.maximum(context.all_reduce(_SUM, seen.read_value()), 1.0)
    regularization = regularization_gradients(model, context.num_replicas_in_sync)
    grads = [s.read_value() / examples + (0.0 if r is None else r)
             for s, r in zip(sums, regularization, strict=True)]
    optimizer.apply(grads, model.trainable_variables)
    for s in sums:
        s.assign(tf.zeros_like(s))
    seen.assign(0.0)


def make_accumulating_train_step(strategy, model, loss_fn, optimizer, global_batch_size,
                                 accumulation_steps):
    """A training step that applies one update every ``accumulation_steps`` micro-batches.

    Keras's ``optimizer.gradient_accumulation_steps`` fails under ``tf.distribute`` (keras
    issue 20582), so accumulation happens here, in a custom loop: each replica adds the
    gradient of its *summed* per-example losses to its own accumulators and counts its
    examples; on the k-th micro-batch it divides by the number of examples in all k global
    micro-batches and applies, and the optimizer's all-reduce sums the replicas. The update
    equals one step on the concatenated k micro-batches, ragged ones included (weight
    regularisation added once per update), and the accumulators are zeroed after it.
    ``gradtut.efficiency.make_accumulating_train_step`` is this step under the default
    strategy, taking ``(x, y)``.

    Args:
      strategy, model, loss_fn, optimizer, global_batch_size: as :func:`make_train_step`
        (``global_batch_size`` is the micro-batch size). The optimizer is built here, under
        ``strategy.scope()``.
      accumulation_steps: micro-batches per update (positive int).

    Returns:
      ``step(distributed_batch) -> (loss, applied)``: the micro-batch's mean per-example loss
      (a tensor) and whether this call applied an update (a Python bool). ``step.accumulators``
      (the gradient sums) and ``step.examples_seen`` are the state, for inspection; read
      outside a replica, each is summed over the replicas.

    Raises:
      ValueError: ``accumulation_steps`` is not a positive int; at the first call, a model
        whose forward pass records losses (on any number of replicas); and as
        :func:`make_train_step`.
      TypeError: as :func:`make_train_step`.

    Example (one device here; notebook 03 uses a ``MirroredStrategy`` over virtual CPUs):
      >>> import keras
      >>> import numpy as np
      >>> strategy = tf.distribute.get_strategy()
      >>> with strategy.scope():
      ...     model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      ...     optimizer = keras.optimizers.SGD(0.1)
      >>> loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
      >>> data = tf.data.Dataset.from_tensor_slices((np.ones((8, 3), "float32"), np.arange(8) % 2))
      >>> step = make_accumulating_train_step(strategy, model, loss, optimizer, 4,
      ...                                     accumulation_steps=2)
      >>> [step(batch)[1] for batch in strategy.experimental_distribute_dataset(data.batch(4))]
      [False, True]
      >>> float(step.examples_seen)  # zeroed by the update
      0.0
    """
    _check_step_arguments(strategy, model, loss_fn, optimizer, global_batch_size)
    accumulation_steps = check_int(accumulation_steps, "accumulation_steps")
    if not optimizer.built:  # here, not lazily inside `apply`, where slots (Adam's) fail
        with strategy.scope():
            optimizer.build(model.trainable_variables)
    sums, seen = _replica_accumulators(strategy, model)
    accumulate = _summed_over_replicas(
        strategy, functools.partial(_accumulate_on_replica, model, loss_fn, sums, seen),
        reduce_retracing=True)  # a ragged last micro-batch: one more trace, not one per size
    apply_on_replica = functools.partial(_apply_accumulated_on_replica, model, optimizer, sums,
                                         seen)
    step = _applying_every(accumulation_steps, accumulate,
                           tf.function(lambda: strategy.run(apply_on_replica)))
    step.accumulators, step.examples_seen = sums, seen
    return step
