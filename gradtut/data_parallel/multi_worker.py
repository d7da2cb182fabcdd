"""Two real workers on this machine: ``MultiWorkerMirroredStrategy`` in separate processes,
checkpoints, and a killed worker's run resumed from them (notebook 03, sections 6-8)."""
import os
import time

import keras
import numpy as np
import tensorflow as tf

from gradtut.checks import check_int, check_seed
from gradtut.data_parallel.steps import make_train_step


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
      "replicas": int, "median_step_ms": float}`` (``replicas``: the strategy's replicas in
      sync, so 2 for two workers that formed one cluster; the step time leaves out the first,
      tracing, step).

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
    batches = _distributed_batches(strategy, x, y, global_batch_size, start)
    crash_at = crash_at_step if task == workers - 1 else None  # only the last worker fails
    step_seconds = _train_and_checkpoint(train_step, batches, step, manager, checkpoint_every,
                                         crash_at)
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"weights": [w.tolist() for w in model.get_weights()], "start_step": start,
            "steps": int(step.numpy()), "task": task,
            "replicas": strategy.num_replicas_in_sync,
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


def _distributed_batches(strategy, x, y, global_batch_size, start):
    """The global batches from number ``start`` on, distributed with the ``DATA`` auto-shard
    policy: with n workers (one replica each), worker i takes the i-th n-th of each batch."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch_size).skip(start)
    return strategy.experimental_distribute_dataset(batches.with_options(options))


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
