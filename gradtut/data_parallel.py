"""Data parallelism with ``tf.distribute``: correctly scaled steps and accumulation (notebook 03).

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
training; ``gradtut.efficiency.make_accumulating_train_step`` is this module's accumulating
step used that way.
"""
import functools
import json
import os
import time

import keras
import numpy as np
import tensorflow as tf

from gradtut.checks import (check_int, check_keras_model, check_loss_fn, check_optimizer,
                            check_real, check_seed, checked_batch)
from gradtut.per_example import per_example_losses


_SUM = tf.distribute.ReduceOp.SUM


# ------------------------------------------------------------------------- argument checks


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
    global_batch_size = check_int(global_batch_size, "global_batch_size")
    _check_every_replica_gets_examples(strategy, global_batch_size, "global_batch_size")
    return global_batch_size


# ------------------------------------------------------------------------------- the steps


def _regularization(model):
    """Model losses (weight decay, activity regularisers), scaled for one replica's share."""
    if not model.losses:
        return 0.0
    return tf.nn.scale_regularization_loss(tf.add_n(model.losses))


def regularization_gradients(model, replicas=1):
    """Gradients of the model's losses (weight decay, activity regularisers) divided by
    ``replicas`` (one replica's share), lined up with ``model.trainable_variables``; None for a
    variable they do not reach, and all None for a model without such losses.

    Raises:
      TypeError: ``model`` is not a Keras model. ValueError: ``replicas`` not a positive int.

    Example:
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> regularization_gradients(model)
      [None, None]
    """
    check_keras_model(model)
    replicas = check_int(replicas, "replicas")
    if not model.losses:
        return [None] * len(model.trainable_variables)
    with tf.GradientTape() as tape:
        total = tf.add_n(model.losses) / replicas
    return tape.gradient(total, model.trainable_variables)


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
        count; ``loss_fn`` is a loss name (a string); at the first call, a ``loss_fn`` that
        does not return ``[B]`` (a mean or sum over the batch: build it with ``reduction=None``).
      TypeError: ``strategy``, ``model`` or ``optimizer`` is not one, or ``loss_fn`` cannot be
        called.

    Example (one device here; notebook 03 uses a ``MirroredStrategy`` over virtual CPUs):
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
            loss = tf.reduce_sum(losses) / tf.maximum(examples, 1.0) + _regularization(model)
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
    grads = tape.gradient(total, model.trainable_variables, unconnected_gradients="zero")
    for s, g in zip(sums, grads):
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
             for s, r in zip(sums, regularization)]
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
    equals one step on the concatenated k micro-batches, ragged ones included (regularisation
    added once per update), and the accumulators are zeroed after it.
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
      ValueError: ``accumulation_steps`` is not a positive int, and as :func:`make_train_step`.
      TypeError: as :func:`make_train_step`.

    Example (one device here; notebook 03 uses a ``MirroredStrategy`` over virtual CPUs):
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


def replica_mean_loss_mistake(strategy, model, loss_fn, x, y):
    """The loss a replica function with ``tf.reduce_mean`` reports, over the correct global mean.

    Returns ``(wrong, right)``: with a plain ``tf.reduce_mean`` per replica, summing the
    replicas (as the optimizer does with gradients) gives ``replicas x`` the global mean loss.
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


# --------------------------------------------------------------------- local multi-worker runs


def train_synthetic(steps, global_batch_size=16, checkpoint_dir=None, checkpoint_every=2,
                    crash_at_step=None, mirrored_replicas=None, seed=0):
    """A small, fully deterministic custom training loop, resumable from checkpoints.

    Runs under ``MultiWorkerMirroredStrategy`` when ``TF_CONFIG`` is set (as in
    :func:`launch_local_workers`), under ``MirroredStrategy`` over ``/cpu:0..`` when
    ``mirrored_replicas`` is given, else on one device. Trains an MLP 8-16-3 with Adam on
    fixed synthetic data, ``steps`` global batches in all.

    Fault tolerance: every ``checkpoint_every`` steps the model, the optimizer state and the
    step counter (which is also the data position) are saved with ``tf.train.CheckpointManager``
    to ``checkpoint_dir`` by the chief (worker 0); other workers write to a scratch directory,
    because every worker must take part in saving. A run that finds a checkpoint there resumes
    from it and skips the batches already trained on.

    Args:
      steps, global_batch_size, checkpoint_every: positive ints.
      crash_at_step: if set (an int >= 0), the last worker exits abruptly (``os._exit``) before
        that step, to simulate a machine failure.
      mirrored_replicas: None, or the number of virtual CPUs to mirror over (positive int).
      seed: the data's and the initial weights' seed (an int >= 0).

    Returns:
      dict ``{"weights": nested lists, "start_step": int, "steps": int, "task": int,
      "median_step_ms": float}`` (the step time leaves out the first, tracing, step).

    Raises:
      ValueError: an argument above is not an int in its range (bools refused).

    Example:
      >>> result = train_synthetic(2)
      >>> result["start_step"], result["steps"], result["task"]
      (0, 2, 0)
    """
    import shutil
    import statistics

    steps = check_int(steps, "steps")
    global_batch_size = check_int(global_batch_size, "global_batch_size")
    checkpoint_every = check_int(checkpoint_every, "checkpoint_every")
    if crash_at_step is not None:
        crash_at_step = check_int(crash_at_step, "crash_at_step", minimum=0)
    if mirrored_replicas is not None:
        mirrored_replicas = check_int(mirrored_replicas, "mirrored_replicas")
    seed = check_seed(seed, allow_none=False)
    strategy, task, workers = _synthetic_strategy(mirrored_replicas)
    x, y = _synthetic_data(steps * global_batch_size, seed)
    model, optimizer, step = _synthetic_model(strategy, seed)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
    manager, scratch = _resume_and_manage_checkpoints(checkpoint, checkpoint_dir, task)
    start = int(step.numpy())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    train_step = make_train_step(strategy, model, loss_fn, optimizer, global_batch_size)
    batches = _distributed_batches(strategy, x, y, global_batch_size, start, workers)
    crash_at = crash_at_step if task == workers - 1 else None  # only the last worker fails
    step_seconds = _train_and_checkpoint(train_step, batches, step, manager, checkpoint_every,
                                         crash_at)
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"weights": [w.tolist() for w in model.get_weights()], "start_step": start,
            "steps": int(step.numpy()), "task": task,
            "median_step_ms": 1e3 * statistics.median(step_seconds[1:] or step_seconds or [0.0])}


def _synthetic_strategy(mirrored_replicas):
    """``(strategy, task index, workers)``: multi-worker under ``TF_CONFIG``, else mirrored
    over ``mirrored_replicas`` virtual CPUs when given, else the default (one device)."""

    if "TF_CONFIG" in os.environ:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        return strategy, strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync
    if mirrored_replicas:
        strategy = tf.distribute.MirroredStrategy(
            [f"/cpu:{i}" for i in range(mirrored_replicas)],
            cross_device_ops=tf.distribute.ReductionToOneDevice())
        return strategy, 0, 1
    return tf.distribute.get_strategy(), 0, 1


def _synthetic_data(examples, seed):
    """``examples`` rows of 8 normal features and a label in 0..2, from ``seed``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 8)).astype("float32")
    return x, rng.integers(0, 3, size=examples)


def _synthetic_model(strategy, seed):
    """The MLP 8-16-3, its built Adam and a step counter, all under ``strategy.scope()``."""
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(3)])
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False)
    return model, optimizer, step


def _resume_and_manage_checkpoints(checkpoint, checkpoint_dir, task):
    """Restore the latest checkpoint in ``checkpoint_dir`` if there is one; return
    ``(manager, scratch)``: the CheckpointManager this worker saves with (the chief into
    ``checkpoint_dir``, the others into a scratch directory to remove at the end), or
    ``(None, None)`` without a directory."""
    if not checkpoint_dir:
        return None, None
    latest = tf.train.latest_checkpoint(checkpoint_dir)
    if latest:
        checkpoint.restore(latest).assert_consumed()
    directory = checkpoint_dir if task == 0 else os.path.join(checkpoint_dir, f".worker{task}")
    manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2)
    return manager, None if task == 0 else directory


def _distributed_batches(strategy, x, y, global_batch_size, start, workers):
    """The global batches from number ``start`` on, distributed; with several workers (one
    replica each), worker i takes rows i, i+n, ... of each batch."""
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch_size).skip(start)
    if workers == 1:
        return strategy.experimental_distribute_dataset(batches)

    def shard(context):
        return batches.map(lambda xb, yb: (xb[context.input_pipeline_id::workers],
                                           yb[context.input_pipeline_id::workers]))
    return strategy.distribute_datasets_from_function(shard)


def _train_and_checkpoint(train_step, batches, step, manager, checkpoint_every, crash_at):
    """Train on every batch, counting in ``step`` and saving every ``checkpoint_every`` steps;
    exit the process abruptly before step ``crash_at`` (None: never). Returns the seconds of
    each step."""
    step_seconds = []
    for batch in batches:
        if crash_at is not None and int(step.numpy()) == crash_at:
            os._exit(17)  # pylint: disable=protected-access  (a simulated machine failure)
        began = time.perf_counter()
        float(train_step(batch))  # float(): wait for the step to finish
        step_seconds.append(time.perf_counter() - began)
        step.assign_add(1)
        if manager and int(step.numpy()) % checkpoint_every == 0:
            manager.save(checkpoint_number=int(step.numpy()))
    return step_seconds


def fit_under_multi_worker(steps=4, global_batch_size=16):
    """``model.fit`` under ``MultiWorkerMirroredStrategy``: fails with Keras 3 (keras issue 20585,
    tensorflow issue 72388). Kept so notebook 03 can show the real error from real workers.

    Raises:
      ValueError: ``steps`` or ``global_batch_size`` is not a positive int.
    """
    steps = check_int(steps, "steps")
    global_batch_size = check_int(global_batch_size, "global_batch_size")
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _synthetic_data(steps * global_batch_size, seed=0)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch_size)
    model.fit(dataset, epochs=1, verbose=0)
    return "fit finished"


# ---------------------------------------------------------------- the all-reduce cost model


def _non_negative(value, name):
    value = check_real(value, name)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def ring_allreduce_seconds(gradient_bytes, workers, bandwidth_bytes_per_s, latency_s=0.0):
    """Time of a ring all-reduce of ``gradient_bytes`` over ``workers``, by the standard model.

    Each worker sends and receives ``2 (N - 1) / N`` times the gradient's size (a
    reduce-scatter then an all-gather, each ``N - 1`` steps of ``1/N`` of the data), over links
    of ``bandwidth_bytes_per_s``, plus ``2 (N - 1)`` message latencies. A model, not a
    measurement: it ignores overlap with computation, congestion and protocol overhead.

    Raises:
      ValueError: ``workers`` is not a positive int; ``gradient_bytes`` or ``latency_s`` is
        not a real number >= 0; the bandwidth is not a positive real number.

    Example:
      >>> round(ring_allreduce_seconds(4e8, 8, 12.5e9), 4)   # 100M float32 over 100 Gb/s
      0.056
    """
    workers = check_int(workers, "workers")
    gradient_bytes = _non_negative(gradient_bytes, "gradient_bytes")
    latency_s = _non_negative(latency_s, "latency_s")
    if check_real(bandwidth_bytes_per_s, "bandwidth_bytes_per_s") <= 0:
        raise ValueError(f"bandwidth_bytes_per_s must be a positive bandwidth (bytes per second), "
                         f"got {bandwidth_bytes_per_s!r}")
    if workers == 1:
        return 0.0
    steps = 2 * (workers - 1)
    return steps / workers * gradient_bytes / bandwidth_bytes_per_s + steps * latency_s


def predicted_step_seconds(compute_seconds_per_example, global_batch_size, gradient_bytes,
                           workers, bandwidth_bytes_per_s, latency_s=0.0):
    """Data-parallel step time by a simple model: each worker's compute on its share of the
    global batch, then a ring all-reduce that does not overlap with it. A model, not a
    measurement; real frameworks overlap communication with the backward pass.

    Raises:
      ValueError: ``global_batch_size`` or ``workers`` is not a positive int,
        ``compute_seconds_per_example`` is not a real number >= 0, and as
        :func:`ring_allreduce_seconds`.

    Example:
      >>> round(predicted_step_seconds(1e-3, 1024, 4e8, 8, 12.5e9), 4)  # 0.128 s + 0.056 s
      0.184
    """
    compute_seconds_per_example = _non_negative(compute_seconds_per_example,
                                                "compute_seconds_per_example")
    global_batch_size = check_int(global_batch_size, "global_batch_size")
    communication = ring_allreduce_seconds(gradient_bytes, workers, bandwidth_bytes_per_s,
                                           latency_s)
    return compute_seconds_per_example * global_batch_size / workers + communication


# --- asynchronous parameter-server training, against synchronous training ----------------------

def _digits(split_at=1500):
    """scikit-learn's bundled 8x8 digits, scaled to [0, 1]: the first ``split_at`` for
    training, the rest held out."""
    from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype("float32"), y.astype("int32")
    return (x[:split_at], y[:split_at]), (x[split_at:], y[split_at:])


def _digits_mlp(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(10)])


_DIGITS_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _check_training_run(steps, batch_size, learning_rate, seed):
    check_int(steps, "steps"), check_int(batch_size, "batch_size"), check_seed(seed)
    if not check_real(learning_rate, "learning_rate") > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")


def train_digits(strategy, steps, batch_size=32, learning_rate=0.1, seed=0):
    """Synchronous training of a 64-32-10 MLP on the digits, ``steps`` SGD updates of
    ``batch_size`` examples each (split over the strategy's replicas), the reference for
    :func:`train_with_parameter_servers`.

    Returns:
      dict ``{"losses", "seconds", "held_out_loss"}``: each update's mean training loss, its
      end in seconds from the first, and the final loss on the 297 held-out digits.

    Raises:
      TypeError, ValueError: a bad strategy, count, rate or seed.
    """
    _check_strategy(strategy)
    _check_training_run(steps, batch_size, learning_rate, seed)
    (x, y), (x_val, y_val) = _digits()
    with strategy.scope():
        model, optimizer = _digits_mlp(seed), keras.optimizers.SGD(learning_rate)
        optimizer.build(model.trainable_variables)
    batches = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed).repeat()
        .batch(batch_size, drop_remainder=True)))

    @tf.function
    def step(batch):
        def replica(xs, ys):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    per_example_losses(model, _unreduced(_DIGITS_LOSS), xs, ys, True),
                    global_batch_size=batch_size)
            optimizer.apply(tape.gradient(loss, model.trainable_variables),
                            model.trainable_variables)
            return loss
        return strategy.reduce(_SUM, strategy.run(replica, args=batch), axis=None)

    losses, seconds, start = [], [], time.perf_counter()
    for _ in range(steps):
        losses.append(float(step(next(batches))))
        seconds.append(time.perf_counter() - start)
    return {"losses": losses, "seconds": seconds,
            "held_out_loss": float(_DIGITS_LOSS(y_val, model(x_val)))}


def _unreduced(loss):
    """The same Keras loss with ``reduction=None``."""
    return type(loss).from_config({**loss.get_config(), "reduction": None})


def train_with_parameter_servers(strategy, steps, batch_size=32, learning_rate=0.1, seed=0,
                                 kill_worker_after=None, cluster=None, timeout_s=300):
    """Asynchronous parameter-server training of the digits MLP, with this process as the
    coordinator: the variables live on the parameter servers, and each scheduled step runs on
    whichever worker is free, reads the current weights, and applies its own update.

    Each step reads a version counter (on the parameter server) before it reads any weight,
    reads it again once its gradient is computed, just before applying it, and increments it
    after its update. ``read_before_update - read`` is how many other updates landed while the
    step computed: how stale its gradient was. (The two reads are plain reads: the value an
    increment returns is a separate read, which another worker's increment can overtake.)
    Each step also counts its attempts, so a step that ran more than once (an attempt lost
    with a killed worker, or cancelled because of it, then run again) shows ``attempts >= 2``.

    Args:
      strategy: a ``tf.distribute.experimental.ParameterServerStrategy`` (its cluster from
        ``gradtut.cluster.parameter_server_cluster``).
      steps: steps to schedule; ``batch_size``, ``learning_rate``, ``seed`` as in
        :func:`train_digits`.
      kill_worker_after: None, or ``k``: after ``k`` steps have finished, schedule the rest and
        SIGKILL worker 1 of ``cluster`` while they run. The coordinator reschedules the step
        it was running on the other worker.
      cluster: the :class:`gradtut.cluster.LocalCluster`: needed with ``kill_worker_after``;
        with it, ``"worker"`` holds task indices, without it process ids.
      timeout_s: seconds for the training; then ``TimeoutError`` (a coordinator otherwise
        waits for dead workers to come back, forever if none does).

    Returns:
      dict with, per step in scheduling order, ``"losses"``, ``"worker"`` (the task that ran
      it, or its process id), ``"began"`` and ``"seconds"`` (start and end on the worker,
      from the first step's start), ``"read"`` and ``"read_before_update"`` (the version
      counter) and ``"attempts"``; and ``"updates"`` (the counter at the end: every update
      applied, repeats included), ``"variables_on"`` (the devices of the model's variables),
      ``"held_out_loss"``, ``"killed_at"`` (seconds, or None) and ``"wall_seconds"``.

    Raises:
      TypeError, ValueError: bad arguments (``kill_worker_after`` must be in ``1..steps-1``).
      TimeoutError: the steps did not finish within ``timeout_s`` (checked between the
        coordinator's polls: one hung remote call can overrun it).

    Example:
      >>> train_with_parameter_servers(tf.distribute.get_strategy(), 10)
      Traceback (most recent call last):
      TypeError: strategy must be a ParameterServerStrategy, got _DefaultDistributionStrategy; for synchronous training use train_digits
    """
    _check_parameter_server_run(strategy, steps, batch_size, learning_rate, seed,
                                kill_worker_after, cluster, timeout_s)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    (x, y), (x_val, y_val) = _digits()
    with strategy.scope():
        model, optimizer = _digits_mlp(seed), keras.optimizers.SGD(learning_rate)
        optimizer.build(model.trainable_variables)
        version = tf.Variable(0, dtype=tf.int64, trainable=False)
        attempts = tf.Variable(tf.zeros([steps], tf.int64), trainable=False)
    order = np.random.default_rng(seed).permutation(len(x))
    per_worker = iter(coordinator.create_per_worker_dataset(
        _worker_batches(x[order], y[order], batch_size)))
    step = _parameter_server_step(strategy, model, optimizer, version, attempts)
    deadline = time.monotonic() + timeout_s

    def schedule(ids):
        return [coordinator.schedule(step, args=(per_worker, tf.constant(i, tf.int64)))
                for i in ids]

    start = time.time()  # for the wall time; the workers' tf.timestamp reads the same clock
    first = kill_worker_after or steps
    results, killed = {}, None
    if kill_worker_after is not None:
        _run_steps(coordinator, schedule, range(first), results, deadline, timeout_s)
        results.update(zip(range(first, steps), schedule(range(first, steps))))
        time.sleep(0.05)  # let the scheduled steps start on both workers
        cluster.kill("worker", 1)
        killed = time.time()
    _run_steps(coordinator, schedule, [i for i in range(steps) if i not in results], results,
               deadline, timeout_s)
    wall = time.time() - start
    out = _step_records([results[i].fetch() for i in range(steps)], cluster)
    t0 = min(out["began"])
    out["began"] = [t - t0 for t in out["began"]]
    out["seconds"] = [t - t0 for t in out["seconds"]]
    return {**out, "attempts": attempts.numpy().tolist(), "updates": int(version.numpy()),
            "variables_on": sorted({v.value.device for v in model.trainable_variables}),
            "held_out_loss": float(_DIGITS_LOSS(y_val, model(x_val))),
            "killed_at": None if killed is None else killed - t0, "wall_seconds": wall}


def _check_parameter_server_run(strategy, steps, batch_size, learning_rate, seed,
                                kill_worker_after, cluster, timeout_s):
    _check_training_run(steps, batch_size, learning_rate, seed)
    if kill_worker_after is not None:
        if not 0 < check_int(kill_worker_after, "kill_worker_after") < steps:
            raise ValueError(f"kill_worker_after must be between 1 and steps - 1 "
                             f"({steps - 1}), got {kill_worker_after}")
        if not hasattr(cluster, "kill"):
            raise ValueError("kill_worker_after needs cluster=, the LocalCluster to kill a "
                             "worker of")
    if not check_real(timeout_s, "timeout_s") > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        raise TypeError(f"strategy must be a ParameterServerStrategy, got "
                        f"{type(strategy).__name__}; for synchronous training use train_digits")


def _worker_batches(x, y, batch_size):
    """The per-worker dataset function. It runs in each worker's own process, so
    ``/proc/self/stat`` there starts with that worker's process id: each batch is tagged with
    it, to tell afterwards which worker ran a step. The workers also start the data at
    different points (the id modulo the data size): ``gradtut.setup()`` makes random ops
    deterministic, so an unseeded shuffle would give both workers the same batches."""
    def batches():
        pid = tf.strings.to_number(tf.strings.split(tf.io.read_file("/proc/self/stat"))[0],
                                   tf.int64)
        return (tf.data.Dataset.from_tensor_slices((x, y)).repeat().skip(pid % len(x))
                .batch(batch_size, drop_remainder=True)
                .map(lambda xs, ys: (xs, ys, tf.fill([batch_size], pid))))
    return batches


def _run_steps(coordinator, schedule, ids, results, deadline, timeout_s):
    """Schedule steps ``ids`` into ``results`` (``{id: RemoteValue}``) and wait until every
    step in ``results`` has finished, scheduling again the ones a lost worker took down.

    The coordinator reschedules a step by itself when it recognises the error as a lost
    worker. A worker killed in the middle of a message can instead surface as
    ``InternalError: Unable to parse request``, which TensorFlow 2.21's coordinator does not
    count as one (``_is_worker_failure`` in ``cluster_coordinator.py``): it then cancels every
    scheduled step ("Please reschedule the function"), and this reschedules what did not
    finish."""
    todo = list(ids)
    for _ in range(3):
        try:
            for i in todo:  # schedule() itself raises an error the coordinator holds
                results[i] = schedule([i])[0]
            return _join_before(coordinator, deadline, timeout_s)
        except tf.errors.InternalError as err:
            if "/job:worker" not in str(err):
                raise
        todo = [i for i in sorted(results) if not _finished(results[i])]
        todo += [i for i in ids if i not in results]
    return _join_before(coordinator, deadline, timeout_s)


def _finished(remote_value):
    try:
        remote_value.fetch()
    except tf.errors.OpError:  # cancelled, or the step that met the error
        return False
    return True


def _join_before(coordinator, deadline, timeout_s):
    """``coordinator.join()``, but raise TimeoutError at ``deadline`` instead of waiting for a
    dead worker forever."""
    while not coordinator.done():  # done() raises a scheduled step's error, as join() does
        if time.monotonic() > deadline:
            raise TimeoutError(f"parameter-server training did not finish within {timeout_s} s: "
                               "are the workers alive? The coordinator waits for a dead worker "
                               "to come back")
        time.sleep(0.005)
    coordinator.join()


def _step_records(values, cluster):
    """Per-step lists from the values each step returned (see ``_parameter_server_step``)."""
    columns = list(zip(*[[float(v) for v in value] for value in values]))
    loss, read, before_update, began, ended, pid = columns
    tasks = {} if cluster is None else {
        proc.pid: index for (job, index), proc in cluster.processes.items() if job == "worker"}
    workers = [tasks.get(int(p), int(p)) for p in pid]
    if tasks and not set(workers) <= set(tasks.values()):
        raise RuntimeError(f"steps ran in processes {sorted(set(workers) - set(tasks.values()))} "
                           f"that are not the cluster's workers {sorted(tasks)}")
    return {"losses": list(loss), "read": [int(v) for v in read],
            "read_before_update": [int(v) for v in before_update], "worker": workers,
            "began": list(began),
            "seconds": list(ended)}


def _parameter_server_step(strategy, model, optimizer, version, attempts):
    """The step a worker runs: one batch from its own dataset, one update of the shared
    weights. TensorFlow orders stateful ops only within one variable, so the explicit control
    dependencies put the counter's reads where they belong: the first before the weights are
    read, the second after the gradient is computed and before it is applied, and the
    increment after the update."""
    @tf.function
    def step(iterator, step_id):
        # counted first, before the batch is fetched: a worker killed at any point of the step
        # leaves the attempt on the parameter server
        counted = attempts.assign_add(tf.one_hot(step_id, tf.shape(attempts)[0],
                                                 dtype=tf.int64))
        with tf.control_dependencies([counted]):
            batch = next(iterator)

        def replica(xs, ys, worker):
            with tf.control_dependencies([counted]):
                begin, read = tf.timestamp(), version.read_value()
            with tf.control_dependencies([read]), tf.GradientTape() as tape:
                loss = _DIGITS_LOSS(ys, model(xs, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            with tf.control_dependencies(grads):
                before_update = version.read_value()
            with tf.control_dependencies([before_update]):
                optimizer.apply(grads, model.trainable_variables)
            with tf.control_dependencies([tf.identity(v.value)
                                          for v in model.trainable_variables]):
                counted_update = version.assign_add(1, read_value=False)
            with tf.control_dependencies([counted_update]):
                end = tf.timestamp()
            return (loss, tf.cast(read, tf.float64), tf.cast(before_update, tf.float64), begin,
                    end, tf.cast(worker[0], tf.float64))
        return strategy.run(replica, args=batch)
    return step


# --- Keras fit that survives a crash -----------------------------------------------------------

CRASH_MARKER = "gradtut: crash point reached"


def fit_with_backup(backup_dir, epochs=3, batch_size=64, save_freq="epoch", crash_at=None,
                    seed=0, replicas=2):
    """``model.fit`` of the digits MLP under a ``MirroredStrategy`` of ``replicas`` virtual
    CPUs, with ``keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq)``. Meant
    for a fresh process (it calls ``gradtut.setup``): a second call with the same
    ``backup_dir`` resumes from the backup there.

    The data order is the same every epoch (``shuffle=False``), so an uninterrupted run and a
    resumed one see the same batches, unless the resume repeats some.

    Args:
      crash_at: None, or ``(epoch, batch)``: after that batch, print :data:`CRASH_MARKER` and
        wait to be killed from outside (``gradtut.cluster.run_until_marker_then_kill``).

    Returns:
      dict ``{"weights", "batches_run", "backup"}``: the final weights (nested lists), every
      ``(epoch, batch)`` this process trained on, and the backup's metadata at the start.

    Raises:
      ValueError: bad counts, ``save_freq`` not ``"epoch"`` or a positive int.
    """
    import gradtut  # pylint: disable=import-outside-toplevel

    epochs, batch_size = check_int(epochs, "epochs"), check_int(batch_size, "batch_size")
    if save_freq != "epoch":
        check_int(save_freq, "save_freq")
    gradtut.setup(seed=seed, virtual_cpus=check_int(replicas, "replicas"))
    metadata_path = os.path.join(backup_dir, "training_metadata.json")
    backup = None
    if os.path.exists(metadata_path):
        with open(metadata_path, encoding="utf-8") as f:
            backup = json.load(f)
    (x, y), _ = _digits()
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = _digits_mlp(seed)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=_DIGITS_LOSS)
    seen = _BatchesSeen(crash_at)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq),
                         seen])
    return {"weights": [w.tolist() for w in model.get_weights()],
            "batches_run": seen.batches, "backup": backup}


class _BatchesSeen(keras.callbacks.Callback):
    """Records every (epoch, batch) trained in this process; stops at ``crash_at`` to be killed."""

    def __init__(self, crash_at):
        super().__init__()
        self.crash_at, self.batches, self.epoch = crash_at and tuple(crash_at), [], 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append((self.epoch, batch))
        if (self.epoch, batch) == self.crash_at:
            print(CRASH_MARKER, flush=True)
            time.sleep(600)  # killed from outside before this ends


def fit_in_fresh_process(backup_dir, crash_at=None, timeout_s=300, **kwargs):
    """:func:`fit_with_backup` in a fresh Python process (it needs its own virtual CPUs).

    With ``crash_at=(epoch, batch)`` the process is killed from outside there
    (``gradtut.cluster.run_until_marker_then_kill``) and the result is
    ``{"killed": True, ...}``; otherwise it is :func:`fit_with_backup`'s result.

    Raises:
      ValueError: bad arguments (checked here, before a process starts).
      RuntimeError: the process failed, did not reach ``crash_at``, or timed out.
    """
    from gradtut.cluster import run_until_marker_then_kill  # pylint: disable=import-outside-toplevel
    from gradtut.session import run_in_subprocess  # pylint: disable=import-outside-toplevel

    if not isinstance(backup_dir, str) or not backup_dir:
        raise ValueError(f"backup_dir must be a folder path (a string), got {backup_dir!r}")
    if crash_at is not None:
        epoch, batch = crash_at
        crash_at = [check_int(epoch, "crash epoch", 0), check_int(batch, "crash batch", 0)]
        return run_until_marker_then_kill("gradtut.data_parallel", "fit_with_backup",
                                          {"backup_dir": backup_dir, "crash_at": crash_at,
                                           **kwargs}, CRASH_MARKER, timeout_s=timeout_s)
    return run_in_subprocess("gradtut.data_parallel", "fit_with_backup",
                             {"backup_dir": backup_dir, **kwargs}, timeout_s=timeout_s)
