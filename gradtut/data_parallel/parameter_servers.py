"""Asynchronous training with parameter servers (``ClusterCoordinator``), against synchronous
training of the same model on the same digits (notebook 03, section 10)."""
import time

import keras
import numpy as np
import tensorflow as tf

from gradtut.checks import check_int, check_real, check_seed
from gradtut.data_parallel.digits import _DIGITS_LOSS, _digits, _digits_mlp
from gradtut.data_parallel.steps import _SUM, _check_strategy
from gradtut.per_example import per_example_losses


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
    after its update. ``read_before_update - read`` is, give or take one at each end, how many
    other updates landed while the step computed: how stale its gradient was (an update is
    counted just after its weights are written, so one written just before the first read can
    be counted, and one written after the second read is missed). (The two reads are plain
    reads: the value an increment returns is a separate read, which another worker's
    increment can overtake.)
    Each step also counts its attempts, so a step that ran more than once (an attempt lost
    with a killed worker, or cancelled because of it, then run again) shows ``attempts >= 2``.

    Args:
      strategy: a ``tf.distribute.experimental.ParameterServerStrategy`` (its cluster from
        ``gradtut.cluster.parameter_server_cluster``).
      steps: steps to schedule; ``batch_size``, ``learning_rate``, ``seed`` as in
        :func:`train_digits`.
      kill_worker_after: None, or ``k``: after ``k`` steps have finished, schedule the rest and
        SIGKILL worker 1 of ``cluster`` while they run. The coordinator reschedules the step
        it was running, if any, on the other worker.
      cluster: the :class:`gradtut.cluster.LocalCluster`: needed with ``kill_worker_after``;
        with it, ``"worker"`` holds task indices, without it process ids.
      timeout_s: seconds for the training; then ``TimeoutError`` (once every worker is dead,
        a coordinator otherwise waits for one to come back, forever if none does).

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
      TypeError: strategy must be a ParameterServerStrategy, got _DefaultDistributionStrategy; ...
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
        results.update(zip(range(first, steps), schedule(range(first, steps)), strict=True))
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
    different points (the id modulo the data size): ``gradtut.setup()`` sets a global seed in
    the coordinator, where the dataset function is traced, so a shuffle without its own seed
    would give both workers the same order."""
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
    """``coordinator.join()``, but raise TimeoutError at ``deadline`` instead of waiting forever
    for a worker to come back when none is left."""
    while not coordinator.done():  # done() raises a scheduled step's error, as join() does
        if time.monotonic() > deadline:
            raise TimeoutError(f"parameter-server training did not finish within {timeout_s} s: "
                               "are the workers alive? The coordinator waits for a dead worker "
                               "to come back")
        time.sleep(0.005)
    coordinator.join()


def _step_records(values, cluster):
    """Per-step lists from the values each step returned (see ``_parameter_server_step``)."""
    columns = list(zip(*[[float(v) for v in value] for value in values], strict=True))
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
    weights. TensorFlow does not order reads of different variables against each other, so
    explicit control dependencies put the counter's reads where they belong: the first before
    the weights are read, the second after the gradient is computed and before it is applied,
    and the increment after the update."""
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
