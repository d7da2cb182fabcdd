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

import keras
import numpy as np
import tensorflow as tf

from gradtut.checks import (check_int, check_keras_model, check_loss_fn, check_optimizer,
                            check_real, check_seed, checked_batch)
from gradtut.per_example import per_example_losses
from gradtut.session import child_command, child_result

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


class WorkerError(RuntimeError):
    """A worker process failed or timed out; every worker has been stopped."""


def _ephemeral_port_range():
    """The range Linux takes ports for outgoing connections from (32768-60999 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _free_loopback_ports(count, rng=None):
    """``count`` distinct ports that are free now on every interface (TensorFlow's gRPC server
    listens on all of them, whatever TF_CONFIG says).

    Taken from below the ephemeral range, so that no outgoing connection (a browser, a Jupyter
    kernel's sockets, another test) can be given the same port between this check and the
    worker's bind: ``bind(("", 0))`` would pick from the ephemeral range itself.
    """
    import random
    import socket

    rng = rng or random.Random()
    low = _ephemeral_port_range()[0]
    first = max(1024, min(20000, low - 2000))
    if first >= low:  # no room below the ephemeral range: let the kernel pick, as before
        return _kernel_picked_ports(count)
    found, tries = [], 0
    while len(found) < count:
        tries += 1
        if tries > 200 * count:
            raise WorkerError(f"could not find {count} free ports in {first}-{low - 1}; stop "
                              "other servers or use fewer workers")
        port = rng.randrange(first, low)
        if port in found:
            continue
        if all(_bindable(family, address, port)
               for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::"))):
            found.append(port)
    return found


def _kernel_picked_ports(count):
    import socket

    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _bindable(family, address, port):
    import socket

    try:
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # no IPv6 on this machine: nothing can listen there either
        return True
    with s:
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


class _PortTaken(WorkerError):
    """A worker's gRPC server could not listen: its port was taken after it was chosen."""


def _die_with_parent():
    """In the child, before exec: ask Linux to SIGKILL this worker if its parent dies, so even a
    killed notebook kernel leaves no worker behind (elsewhere this is a no-op)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _tail(path, lines=20):
    with open(path, encoding="utf-8", errors="replace") as f:
        return "\n".join(f.read().strip().splitlines()[-lines:])


def launch_local_workers(target, num_workers, timeout_s, kwargs=None, ports=None, env=None):
    """Run ``target`` in ``num_workers`` processes that form a ``MultiWorkerMirroredStrategy``
    cluster on this machine, and return what each returned.

    Each process gets ``TF_CONFIG`` with a cluster of ``num_workers`` workers at
    ``127.0.0.1:<free port>`` and its own task index, so
    ``tf.distribute.MultiWorkerMirroredStrategy()`` inside ``target`` connects them.

    Security: TensorFlow's gRPC servers have **no authentication**: anyone who can reach a
    worker's port can run ops in it. The cluster addresses here are loopback only, so the
    workers talk over 127.0.0.1, but TensorFlow's server itself listens on every interface
    (``*:port``, seen with ``ss -ltn`` while workers run; TensorFlow has no setting to bind
    it to one address). The ports are open only while the workers run; on a shared network,
    firewall them or run inside a network namespace. On a real cluster keep workers on a
    private network.

    Args:
      target: ``"package.module:function"``, or a module-level function (not one defined in a
        notebook: the workers import it). It is called as ``function(**kwargs)`` and must return
        something JSON-serialisable. Or a path to a ``.py`` script, run as ``python script``.
      num_workers: positive int.
      timeout_s: seconds for the whole run; then every worker is killed. (A retry after a
        taken port, see ``ports``, starts the clock again: that attempt failed at start-up.)
      kwargs: JSON-serialisable keyword arguments for ``target``.
      ports: the ports to use (default: ports free on every interface, from below the
        ephemeral range; if one is taken before its worker listens, the launch is retried
        with fresh ports, at most three attempts in all).
      env: extra environment variables for every worker.

    Returns:
      list, one dict per worker: ``{"index", "returncode", "result", "stdout", "stderr"}`` (result
      is None for a script).

    Raises:
      ValueError: ``num_workers`` not a positive int, fewer ``ports`` than workers, a target
        that cannot be imported by a worker.
      WorkerError: a worker exited with an error, or the timeout passed. The message names the
        worker and shows the tail of its stderr; all workers are stopped first, so nothing hangs.

    Example:
      >>> results = launch_local_workers("gradtut.data_parallel:train_synthetic", 2, 120,
      ...                                kwargs={"steps": 4})  # doctest: +SKIP
    """
    num_workers = check_int(num_workers, "num_workers")
    if ports is not None and len(ports) < num_workers:
        raise ValueError(f"{num_workers} workers need {num_workers} ports; got {len(ports)} "
                         "(more workers than free ports)")
    command = _worker_command(target, kwargs)
    # A port found free can be taken before the worker listens on it (by any process on the
    # machine). The worker then fails at once with "Could not start gRPC server": try again
    # with fresh ports, twice at most. Ports the caller chose are used as they are.
    attempts = 1 if ports is not None else 3
    for attempt in range(1, attempts + 1):
        chosen = list(ports[:num_workers]) if ports is not None else _free_loopback_ports(
            num_workers)
        try:
            return _run_workers(command, chosen, timeout_s, env)
        except _PortTaken as err:
            if attempt == attempts:
                raise WorkerError(f"{err}\n(a worker could not listen on its port {chosen}; "
                                  f"tried {attempts} time(s))") from None


def _worker_command(target, kwargs):
    """The command line each worker runs, for a ``"module:function"``, a module-level
    function, or a ``.py`` script."""
    import sys

    if callable(target):
        if target.__module__ == "__main__" or "<locals>" in target.__qualname__:
            raise ValueError(f"workers cannot import {target.__qualname__!r} (defined in "
                             "__main__ or inside a function): move it to a module, or pass a script")
        target = f"{target.__module__}:{target.__qualname__}"
    if not isinstance(target, str):
        raise ValueError(f"target must be 'module:function', a module-level function or a .py "
                         f"script path, got {target!r}")
    if target.endswith(".py"):
        return [sys.executable, target]
    module, _, function = target.partition(":")
    if not function:
        raise ValueError(f"target {target!r} must be 'module:function' or a .py script")
    return child_command(module, function, kwargs)


def _run_workers(command, ports, timeout_s, env):
    """Start one worker per port with its TF_CONFIG, wait, and collect what each printed.
    Every worker is killed, and its logs removed, on the way out, whatever happened."""
    import shutil
    import tempfile

    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    logs = tempfile.mkdtemp(prefix="gradtut-workers-")
    procs, files = [], []
    try:
        for index in range(len(ports)):
            procs.append(_start_worker(command, cluster, index, logs, env, files))
        _wait_for_workers(procs, logs, timeout_s)
        return [_worker_result(logs, index) for index in range(len(procs))]
    finally:
        _stop_workers(procs)
        for f in files:
            f.close()
        shutil.rmtree(logs, ignore_errors=True)


def _start_worker(command, cluster, index, logs, env, files):
    """Start worker ``index`` of ``cluster`` with its output in ``logs``; returns the Popen."""
    import json
    import os
    import subprocess

    worker_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {}),
                  "TF_CONFIG": json.dumps({"cluster": cluster,
                                           "task": {"type": "worker", "index": index}})}
    out = open(os.path.join(logs, f"{index}.out"), "w+", encoding="utf-8")
    err = open(os.path.join(logs, f"{index}.err"), "w+", encoding="utf-8")
    files += [out, err]
    return subprocess.Popen(command, stdout=out, stderr=err, env=worker_env,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_die_with_parent)


def _wait_for_workers(procs, logs, timeout_s):
    """Return when every worker exited with 0; raise WorkerError (or _PortTaken) as soon as
    one fails, or when ``timeout_s`` passes."""
    import os
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            first = next(i for i, c in enumerate(codes) if c not in (None, 0))
            time.sleep(0.5)  # let the failures it causes in its peers show up too
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0) and i != first]
            which = "; ".join(f"worker {i} of {len(procs)} exited with code {codes[i]}"
                              for i in [first] + failed)  # the earliest is likely the cause
            tail = _tail(os.path.join(logs, f"{first}.err"))
            kind = _PortTaken if "Could not start gRPC server" in tail else WorkerError
            raise kind(f"{which}; stopped the others. Worker {first}'s stderr ends "
                       f"with:\n{tail}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            waiting = [i for i, c in enumerate(codes) if c is None]
            raise WorkerError(f"workers {waiting} still running after {timeout_s} s; stopped "
                              f"all of them. Worker {waiting[0]}'s stderr ends with:\n"
                              f"{_tail(os.path.join(logs, f'{waiting[0]}.err'))}")
        time.sleep(0.1)


def _worker_result(logs, index):
    """What worker ``index`` printed and returned, read from its log files."""
    import os

    with open(os.path.join(logs, f"{index}.out"), encoding="utf-8") as f:
        stdout, result = child_result(f.read())
    with open(os.path.join(logs, f"{index}.err"), encoding="utf-8") as f:
        stderr = f.read()
    return {"index": index, "returncode": 0, "result": result, "stdout": stdout,
            "stderr": stderr}


def _stop_workers(procs):
    """Kill every worker still running, with its children (each leads its own group)."""
    import os
    import signal

    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


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
    import os

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
    import os

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
    import os
    import time

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
