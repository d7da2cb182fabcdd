"""Data parallelism with ``tf.distribute``: correctly scaled steps and accumulation (notebook 03).

Every replica holds a copy of the model, computes gradients on its shard of the global batch,
and the optimizer all-reduces (sums) them before one identical update everywhere. For that
sum to be the gradient of the *global* mean loss, each replica must divide its summed
per-example losses by the number of examples in the whole global batch, not by its own
shard's size: a plain ``tf.reduce_mean`` inside the replica function is off by the replica
count. The steps here divide by the global batch's actual size (summed over replicas at run
time), so a batch that does not split evenly, or a short final batch, is still weighted right.

Build the model and optimizer under ``strategy.scope()`` and feed the steps batches from
``strategy.experimental_distribute_dataset``.
"""
import tensorflow as tf

_SUM = tf.distribute.ReduceOp.SUM


def _per_example_losses(model, loss_fn, x, y):
    losses = loss_fn(y, model(x, training=True))
    if losses.shape.rank != 1:
        raise ValueError(
            f"loss_fn must return per-example losses of shape [B]; it returned shape "
            f"{losses.shape}. Build Keras losses with reduction=None: the step divides by the "
            "global batch size itself.")
    return losses


def _regularization(model):
    """Model losses (weight decay, activity regularisers), scaled for one replica's share."""
    if not model.losses:
        return 0.0
    return tf.nn.scale_regularization_loss(tf.add_n(model.losses))


def _check_global_batch_size(strategy, global_batch_size):
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive int, got {global_batch_size!r}")
    replicas = strategy.num_replicas_in_sync
    if global_batch_size < replicas:
        raise ValueError(
            f"global_batch_size {global_batch_size} is smaller than the {replicas} replicas: some "
            "replicas would never see an example. Use a global batch of at least one example per "
            "replica (usually a multiple of the replica count).")


def make_train_step(strategy, model, loss_fn, optimizer, global_batch_size):
    """A ``tf.function`` training step for batches from ``strategy.experimental_distribute_dataset``.

    Each replica computes ``sum(per-example losses) / N`` where N is the number of examples in
    the whole global batch (counted at run time, so an uneven split or a short final batch is
    weighted exactly), adds ``tf.nn.scale_regularization_loss`` of the model's losses, and the
    optimizer sums the replicas' gradients. The update therefore equals one step of
    single-device training on the concatenated global batch.

    Args:
      strategy: a ``tf.distribute`` strategy (``MirroredStrategy``,
        ``MultiWorkerMirroredStrategy``, the default strategy, ...).
      model, optimizer: created under ``strategy.scope()``.
      loss_fn: ``loss_fn(y_true, y_pred) -> [B]`` per-example losses (Keras losses with
        ``reduction=None``).
      global_batch_size: the batch size the dataset was batched with (positive, at least the
        number of replicas); used to check arguments. The division uses the actual size.

    Returns:
      ``step(distributed_batch) -> scalar`` mean loss over the global batch (plus regularisation),
      reduced across replicas.

    Raises:
      ValueError: ``global_batch_size`` is not a positive int or is smaller than the replica
        count; at the first call, a ``loss_fn`` that does not return ``[B]``.

    Example:
      >>> with strategy.scope():  # doctest: +SKIP
      ...     model, optimizer = build_model(), keras.optimizers.SGD(0.1)
      >>> step = make_train_step(strategy, model, loss, optimizer, 64)  # doctest: +SKIP
      >>> for batch in strategy.experimental_distribute_dataset(ds.batch(64)):  # doctest: +SKIP
      ...     loss_value = step(batch)
    """
    _check_global_batch_size(strategy, global_batch_size)

    def replica_step(x, y):
        context = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            losses = _per_example_losses(model, loss_fn, x, y)
            examples = context.all_reduce(_SUM, tf.cast(tf.size(losses), losses.dtype))
            loss = tf.reduce_sum(losses) / tf.maximum(examples, 1.0) + _regularization(model)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    @tf.function
    def step(batch):
        x, y = batch
        return strategy.reduce(_SUM, strategy.run(replica_step, args=(x, y)), axis=None)

    return step


def accumulating_train_step(strategy, model, loss_fn, optimizer, global_batch_size,
                            accumulation_steps):
    """A training step that applies one update every ``accumulation_steps`` micro-batches.

    Keras's ``optimizer.gradient_accumulation_steps`` fails under ``tf.distribute`` (keras
    issue 20582), so accumulation happens here, in a custom loop: each replica adds the
    gradient of its *summed* per-example losses to its own accumulators and counts its
    examples; on the k-th micro-batch it divides by the number of examples in all k global
    micro-batches and applies, and the optimizer's all-reduce sums the replicas. The update
    equals one step on the concatenated k micro-batches (regularisation added once per update),
    and the accumulators are zeroed after it.

    Args:
      strategy, model, loss_fn, optimizer, global_batch_size: as :func:`make_train_step`
        (``global_batch_size`` is the micro-batch size).
      accumulation_steps: micro-batches per update (positive int).

    Returns:
      ``step(distributed_batch) -> (loss, applied)``: the micro-batch's mean per-example loss and
      whether this call applied an update.

    Raises:
      ValueError: ``accumulation_steps`` is not a positive int, and as :func:`make_train_step`.
    """
    _check_global_batch_size(strategy, global_batch_size)
    if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be a positive int, got {accumulation_steps!r}")
    local = dict(trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                 aggregation=tf.VariableAggregation.SUM)
    with strategy.scope():
        sums = [tf.Variable(tf.zeros(v.shape, v.dtype), **local) for v in model.trainable_variables]
        seen = tf.Variable(0.0, **local)

    def replica_accumulate(x, y):
        context = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            losses = _per_example_losses(model, loss_fn, x, y)
            total = tf.reduce_sum(losses)
        for s, g in zip(sums, tape.gradient(total, model.trainable_variables)):
            s.assign_add(tf.convert_to_tensor(g))
        count = tf.cast(tf.size(losses), losses.dtype)
        seen.assign_add(count)
        return total / tf.maximum(context.all_reduce(_SUM, count), 1.0)

    def replica_apply():
        context = tf.distribute.get_replica_context()
        examples = tf.maximum(context.all_reduce(_SUM, seen.read_value()), 1.0)
        with tf.GradientTape() as tape:
            regularization = _regularization(model)
        reg_grads = tape.gradient(regularization, model.trainable_variables) if model.losses \
            else [None] * len(sums)
        grads = [s.read_value() / examples + (0.0 if r is None else r)
                 for s, r in zip(sums, reg_grads)]
        optimizer.apply(grads, model.trainable_variables)
        for s in sums:
            s.assign(tf.zeros_like(s))
        seen.assign(0.0)

    @tf.function
    def accumulate(batch):
        x, y = batch
        return strategy.reduce(_SUM, strategy.run(replica_accumulate, args=(x, y)), axis=None)

    @tf.function
    def apply():
        strategy.run(replica_apply)

    calls = [0]

    def step(batch):
        loss = accumulate(batch)
        calls[0] += 1
        if calls[0] % accumulation_steps:
            return loss, False
        apply()
        return loss, True

    return step


def replica_mean_loss_mistake(strategy, model, loss_fn, x, y):
    """The loss a replica function with ``tf.reduce_mean`` reports, over the correct global mean.

    Returns ``(wrong, right)``: with a plain ``tf.reduce_mean`` per replica, summing the
    replicas (as the optimizer does with gradients) gives ``replicas x`` the global mean loss.
    Used by notebook 03 and the tests to show the classic mistake's factor.
    """
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x))
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

    def replica(xs, ys):
        losses = _per_example_losses(model, loss_fn, xs, ys)
        right = tf.nn.compute_average_loss(losses, global_batch_size=len(x))
        return tf.reduce_mean(losses), right

    wrong, right = strategy.run(replica, args=batch)
    return (float(strategy.reduce(_SUM, wrong, axis=None)),
            float(strategy.reduce(_SUM, right, axis=None)))


def single_device_step(model, loss_fn, optimizer, x, y):
    """The reference: one step of ordinary training on the whole (global) batch, one device."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(_per_example_losses(model, loss_fn, x, y))
        if model.losses:
            loss += tf.add_n(model.losses)
    optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return loss

