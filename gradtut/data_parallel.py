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


_WORKER_MAIN = """
import importlib, json, os, sys
module_name, function_name, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
result = getattr(importlib.import_module(module_name), function_name)(**kwargs)
sys.stdout.write("\\n@@RESULT@@" + json.dumps(result))
"""


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
    import json
    import sys

    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
    if callable(target):
        if target.__module__ == "__main__" or "<locals>" in target.__qualname__:
            raise ValueError(f"workers cannot import {target.__qualname__!r} (defined in "
                             "__main__ or inside a function): move it to a module, or pass a script")
        target = f"{target.__module__}:{target.__qualname__}"
    if ports is not None and len(ports) < num_workers:
        raise ValueError(f"{num_workers} workers need {num_workers} ports; got {len(ports)} "
                         "(more workers than free ports)")
    if target.endswith(".py"):
        command = [sys.executable, target]
    else:
        module, _, function = target.partition(":")
        if not function:
            raise ValueError(f"target {target!r} must be 'module:function' or a .py script")
        command = [sys.executable, "-c", _WORKER_MAIN, module, function, json.dumps(kwargs or {})]
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


def _run_workers(command, ports, timeout_s, env):
    """Start one worker per port with its TF_CONFIG, wait, and collect what each printed."""
    import json
    import os
    import signal
    import subprocess
    import tempfile
    import time

    num_workers = len(ports)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    logs = tempfile.mkdtemp(prefix="gradtut-workers-")
    procs, files = [], []
    try:
        for index in range(num_workers):
            worker_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {}),
                          "TF_CONFIG": json.dumps({"cluster": cluster,
                                                   "task": {"type": "worker", "index": index}})}
            out = open(os.path.join(logs, f"{index}.out"), "w+", encoding="utf-8")
            err = open(os.path.join(logs, f"{index}.err"), "w+", encoding="utf-8")
            files += [out, err]
            procs.append(subprocess.Popen(command, stdout=out, stderr=err, env=worker_env,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=_die_with_parent))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                first = failed[0]  # the earliest failure is most likely the root cause
                time.sleep(0.5)  # let the failures it causes in its peers show up too
                codes = [p.poll() for p in procs]
                failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
                which = "; ".join(f"worker {i} of {num_workers} exited with code {codes[i]}"
                                  for i in [first] + [i for i in failed if i != first])
                tail = _tail(os.path.join(logs, f"{first}.err"))
                kind = _PortTaken if "Could not start gRPC server" in tail else WorkerError
                raise kind(f"{which}; stopped the others. Worker {first}'s stderr ends "
                           f"with:\n{tail}")
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                waiting = [i for i, c in enumerate(codes) if c is None]
                raise WorkerError(f"workers {waiting} still running after {timeout_s} s; stopped "
                                  f"all of them. Worker {waiting[0]}'s stderr ends with:\n"
                                  f"{_tail(os.path.join(logs, f'{waiting[0]}.err'))}")
            time.sleep(0.1)
        results = []
        for index in range(num_workers):
            with open(os.path.join(logs, f"{index}.out"), encoding="utf-8") as f:
                stdout = f.read()
            with open(os.path.join(logs, f"{index}.err"), encoding="utf-8") as f:
                stderr = f.read()
            result = (json.loads(stdout.rsplit("@@RESULT@@", 1)[1])
                      if "@@RESULT@@" in stdout else None)
            results.append({"index": index, "returncode": 0, "result": result,
                            "stdout": stdout.split("\n@@RESULT@@")[0], "stderr": stderr})
        return results
    finally:
        for p in procs:  # each worker leads its own process group: stop it and its children
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        for f in files:
            f.close()
        for name in os.listdir(logs):
            os.remove(os.path.join(logs, name))
        os.rmdir(logs)


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
      crash_at_step: if set, the last worker exits abruptly (``os._exit``) before that step, to
        simulate a machine failure.

    Returns:
      dict ``{"weights": nested lists, "start_step": int, "steps": int, "task": int,
      "median_step_ms": float}`` (the step time leaves out the first, tracing, step).
    """
    import os
    import shutil
    import statistics
    import time

    import keras
    import numpy as np

    if "TF_CONFIG" in os.environ:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        task, workers = strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync
    elif mirrored_replicas:
        strategy = tf.distribute.MirroredStrategy(
            [f"/cpu:{i}" for i in range(mirrored_replicas)],
            cross_device_ops=tf.distribute.ReductionToOneDevice())
        task, workers = 0, 1
    else:
        strategy, task, workers = tf.distribute.get_strategy(), 0, 1
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * global_batch_size, 8)).astype("float32")
    y = rng.integers(0, 3, size=steps * global_batch_size)
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(3)])
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
    manager = scratch = None
    if checkpoint_dir:
        if tf.train.latest_checkpoint(checkpoint_dir):
            checkpoint.restore(tf.train.latest_checkpoint(checkpoint_dir)).assert_consumed()
        directory = checkpoint_dir if task == 0 else os.path.join(checkpoint_dir, f".worker{task}")
        scratch = None if task == 0 else directory
        manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2)
    start = int(step.numpy())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    train_step = make_train_step(strategy, model, loss_fn, optimizer, global_batch_size)
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch_size).skip(start)
    if workers > 1:  # one replica per worker: worker i takes rows i, i+n, ... of each batch
        def shard(context):
            return batches.map(lambda xb, yb: (xb[context.input_pipeline_id::workers],
                                               yb[context.input_pipeline_id::workers]))
        distributed = strategy.distribute_datasets_from_function(shard)
    else:
        distributed = strategy.experimental_distribute_dataset(batches)
    step_seconds = []
    for batch in distributed:
        if crash_at_step is not None and int(step.numpy()) == crash_at_step and task == workers - 1:
            os._exit(17)  # pylint: disable=protected-access  (a simulated machine failure)
        began = time.perf_counter()
        float(train_step(batch))  # float(): wait for the step to finish
        step_seconds.append(time.perf_counter() - began)
        step.assign_add(1)
        if manager and int(step.numpy()) % checkpoint_every == 0:
            manager.save(checkpoint_number=int(step.numpy()))
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"weights": [w.tolist() for w in model.get_weights()], "start_step": start,
            "steps": int(step.numpy()), "task": task,
            "median_step_ms": 1e3 * statistics.median(step_seconds[1:] or step_seconds or [0.0])}


def fit_under_multi_worker(steps=4, global_batch_size=16):
    """``model.fit`` under ``MultiWorkerMirroredStrategy``: fails with Keras 3 (keras issue 20585,
    tensorflow issue 72388). Kept so notebook 03 can show the real error from real workers."""
    import keras
    import numpy as np

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * global_batch_size, 8)).astype("float32")
    y = rng.integers(0, 3, size=steps * global_batch_size)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch_size)
    model.fit(dataset, epochs=1, verbose=0)
    return "fit finished"


# ---------------------------------------------------------------- the all-reduce cost model


def ring_allreduce_seconds(gradient_bytes, workers, bandwidth_bytes_per_s, latency_s=0.0):
    """Time of a ring all-reduce of ``gradient_bytes`` over ``workers``, by the standard model.

    Each worker sends and receives ``2 (N - 1) / N`` times the gradient's size (a
    reduce-scatter then an all-gather, each ``N - 1`` steps of ``1/N`` of the data), over links
    of ``bandwidth_bytes_per_s``, plus ``2 (N - 1)`` message latencies. A model, not a
    measurement: it ignores overlap with computation, congestion and protocol overhead.

    Example:
      >>> round(ring_allreduce_seconds(4e8, 8, 12.5e9), 4)   # 100M float32 over 100 Gb/s
      0.056
    """
    if workers < 1 or gradient_bytes < 0 or bandwidth_bytes_per_s <= 0:
        raise ValueError("need workers >= 1, gradient_bytes >= 0 and a positive bandwidth")
    if workers == 1:
        return 0.0
    steps = 2 * (workers - 1)
    return steps / workers * gradient_bytes / bandwidth_bytes_per_s + steps * latency_s


def predicted_step_seconds(compute_seconds_per_example, global_batch_size, gradient_bytes,
                           workers, bandwidth_bytes_per_s, latency_s=0.0):
    """Data-parallel step time by a simple model: each worker's compute on its share of the
    global batch, then a ring all-reduce that does not overlap with it. A model, not a
    measurement; real frameworks overlap communication with the backward pass."""
    compute = compute_seconds_per_example * global_batch_size / workers
    return compute + ring_allreduce_seconds(gradient_bytes, workers, bandwidth_bytes_per_s,
                                            latency_s)
