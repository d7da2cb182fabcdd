"""Model parallelism: stages on devices, a measured GPipe pipeline, tensor splits, DTensor.

Introduced in notebook 04. Every form here splits one model over several devices and is
checked against the unsplit model:

- :func:`place_stages` puts consecutive layers on consecutive devices (naive model parallelism);
- :func:`pipeline_gradients` runs those stages on micro-batches with the GPipe schedule and
  records a measured timeline; :func:`simulate_pipeline` models the same schedule;
- :class:`ColumnParallelDense` and :class:`RowParallelDense` split one Dense kernel over devices
  (the Megatron-LM tensor split);
- :func:`make_mesh`, :func:`shard_mlp_params`, :func:`shard_batch` and :func:`sgd_step` train a
  small MLP on a DTensor ``batch`` x ``model`` mesh; :func:`describe_shards` shows the layout;
- :func:`model_memory_report` does the memory arithmetic that decides which split you need.

On one host the "devices" are virtual CPUs (``gradtut.setup(virtual_cpus=N)``) that share the
same cores and memory. They show the structure of each split exactly, and the pipeline's
overlap is real when each stage has a core of its own (``setup(intra_op_threads=1)`` on two
cores); memory per device cannot be measured separately there.
"""
import time

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor


# --- devices and stages -------------------------------------------------------------------

def _check_devices(devices):
    """Full names of ``devices`` (e.g. "CPU:1" -> "/device:CPU:1"); clear error if one is missing."""
    if isinstance(devices, str) or not devices:
        raise ValueError(f"devices must be a non-empty list of device names, got {devices!r}")
    available = {}
    for logical in tf.config.list_logical_devices():
        spec = tf.DeviceSpec.from_string(logical.name)
        available[(spec.device_type, spec.device_index)] = logical.name
    names = []
    for device in devices:
        try:
            spec = tf.DeviceSpec.from_string(device if device.startswith("/") else "/" + device)
        except (ValueError, AttributeError):
            spec = None
        key = None if spec is None else (spec.device_type, spec.device_index)
        if key not in available:
            have = ", ".join(sorted(available.values()))
            raise ValueError(
                f"device {device!r} does not exist in this process (it has: {have}). Use one of "
                "those, or create more with gradtut.setup(virtual_cpus=N) before TensorFlow "
                "starts (restart the kernel first).")
        names.append(available[key])
    return names


def _balanced_boundaries(costs, num_stages):
    """Cut points splitting ``costs`` into ``num_stages`` consecutive non-empty groups whose
    largest sum is as small as possible (the linear-partition dynamic programme)."""
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs, dtype=float)])
    # best[k][i]: smallest possible largest group when the first i items form k groups.
    best = np.full((num_stages + 1, n + 1), np.inf)
    cut = np.zeros((num_stages + 1, n + 1), dtype=int)
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    boundaries, i = [], n
    for k in range(num_stages, 1, -1):
        i = int(cut[k][i])
        boundaries.append(i)
    return sorted(boundaries)


def _check_boundaries(boundaries, num_layers, num_stages):
    boundaries = [int(b) for b in boundaries]
    cuts = [0] + boundaries + [num_layers]
    if len(boundaries) != num_stages - 1 or any(a >= b for a, b in zip(cuts, cuts[1:])):
        raise ValueError(
            f"boundaries={boundaries} must be {num_stages - 1} increasing layer indices "
            f"strictly between 0 and {num_layers}, so that each of the {num_stages} stages gets "
            "at least one layer (stage i runs layers boundaries[i-1] to boundaries[i]-1).")
    return boundaries


def _parameter_counts(layers, input_shape):
    """Parameters per layer; unbuilt layers are measured on a throw-away copy built for
    ``input_shape`` (one example, no batch axis), so the real layers stay unbuilt."""
    if all(layer.built for layer in layers):
        return [layer.count_params() for layer in layers]
    if input_shape is None:
        raise ValueError(
            "some layers are not built yet, so their parameter counts are unknown. Pass "
            "input_shape=(features...) (one example, without the batch axis), or boundaries=[...]"
            ", or build the layers first (e.g. model.build or one call on a batch).")
    counts, x = [], keras.KerasTensor((1,) + tuple(input_shape))
    for layer in layers:
        probe = layer if layer.built else type(layer).from_config(layer.get_config())
        x = probe(x)
        counts.append(probe.count_params())
    return counts


class StagedModel:
    """Consecutive groups of layers, each group (a *stage*) running on its own device.

    Calling it runs stage 0 on ``devices[0]``, copies the activations to ``devices[1]``, runs
    stage 1 there, and so on; the backward pass crosses back in reverse. Made by
    :func:`place_stages`.

    Attributes:
      stages: list of lists of Keras layers, one list per stage.
      devices: the full device name of each stage.
    """

    def __init__(self, stages, devices):
        self.stages = stages
        self.devices = devices
        self._pipelines = {}

    @property
    def layers(self):
        return [layer for stage in self.stages for layer in stage]

    @property
    def trainable_variables(self):
        """Every stage's trainable variables, in layer order (as in the unsplit model)."""
        return [v for layer in self.layers for v in layer.trainable_variables]

    def stage_variables(self, stage):
        return [v for layer in self.stages[stage] for v in layer.trainable_variables]

    def parameter_counts(self):
        """Parameters held by each stage."""
        return [sum(layer.count_params() for layer in stage) for stage in self.stages]

    def stage_forward(self, stage, x, training=False):
        """Run one stage on its device; ``x`` is copied there first."""
        with tf.device(self.devices[stage]):
            x = tf.identity(x)  # the device-to-device copy, made explicit
            for layer in self.stages[stage]:
                x = layer(x, training=training)
        return x

    def __call__(self, x, training=False):
        for stage in range(len(self.stages)):
            x = self.stage_forward(stage, x, training=training)
        return x

    def summary(self):
        """One line per stage: its device, its layers and its parameter count."""
        lines = []
        for s, (stage, count) in enumerate(zip(self.stages, self.parameter_counts())):
            names = ", ".join(layer.name for layer in stage)
            lines.append(f"stage {s} on {self.devices[s]}: {names} ({count:,} parameters)")
        return "\n".join(lines)


def place_stages(layers, devices, boundaries=None, input_shape=None):
    """Split ``layers`` into consecutive stages, one per device, and return a callable model.

    Stages are balanced by parameter count (the split that makes the largest stage as small as
    possible) unless ``boundaries`` gives the cut points. Forward and backward passes cross
    devices, and gradients equal those of the layers applied in order on one device.

    Args:
      layers: a list of Keras layers applied in order, or a ``keras.Sequential`` (its layers).
      devices: device names, one per stage, e.g. ``["CPU:0", "CPU:1"]``.
      boundaries: optional ``len(devices) - 1`` increasing layer indices where stages start.
      input_shape: shape of one example without the batch axis. Needed to balance unbuilt
        layers; unbuilt layers are then built on their stage's device, so their weights live
        there (layers already built keep their weights where they are).

    Returns:
      :class:`StagedModel`; ``staged(x)`` gives the model's output, ``staged.summary()`` the
      placement.

    Raises:
      ValueError: no layers, more devices than layers, a device that does not exist, bad
        boundaries, or unbuilt layers with neither ``input_shape`` nor ``boundaries``.

    Example:
      >>> layers = [keras.layers.Dense(64, "relu"), keras.layers.Dense(10)]  # doctest: +SKIP
      >>> staged = place_stages(layers, ["CPU:0", "CPU:1"], input_shape=(32,))  # doctest: +SKIP
      >>> staged(tf.zeros((8, 32))).shape  # doctest: +SKIP
      TensorShape([8, 10])
    """
    if isinstance(layers, keras.Model):
        layers = list(layers.layers)
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty: a model needs at least one layer to place")
    devices = _check_devices(devices)
    if len(devices) > len(layers):
        raise ValueError(
            f"{len(devices)} devices but only {len(layers)} layers: every stage needs at least "
            "one layer. Use fewer devices, or split the work inside layers instead (tensor "
            "parallelism: ColumnParallelDense / RowParallelDense).")
    if boundaries is None:
        boundaries = _balanced_boundaries(_parameter_counts(layers, input_shape), len(devices))
    boundaries = _check_boundaries(boundaries, len(layers), len(devices))
    cuts = [0] + boundaries + [len(layers)]
    staged = StagedModel([layers[a:b] for a, b in zip(cuts, cuts[1:])], devices)
    if input_shape is not None:
        x = tf.zeros((1,) + tuple(input_shape))
        for s in range(len(devices)):
            x = staged.stage_forward(s, x)  # builds each unbuilt layer on its stage's device
    return staged


# --- the GPipe pipeline, measured -----------------------------------------------------------

def _clock_after(*tensors):
    """Wall-clock seconds, read once ``tensors`` exist.

    ``tf.timestamp`` and ``tf.py_function`` are stateful, and ``tf.function`` runs stateful ops
    in program order, which would serialise every stage. A stateless ``numpy_function`` fed one
    element of each tensor runs as soon as they exist, and no sooner.
    """
    probe = tf.stack([tf.cast(tf.reshape(t, [-1])[0], tf.float64)
                      for t in tensors if t is not None])
    return tf.numpy_function(lambda _: time.perf_counter(), [probe], tf.float64, stateful=False)


def _microbatch_sizes(batch, num_microbatches):
    """Sizes of ``num_microbatches`` near-equal micro-batches (the first ones get the extra)."""
    small, extra = divmod(batch, num_microbatches)
    return [small + 1] * extra + [small] * (num_microbatches - extra)


def _weighted_loss(loss_fn, y, y_pred, size, batch):
    """This micro-batch's share of the full-batch mean loss."""
    loss = tf.cast(loss_fn(y, y_pred), tf.float32)
    if loss.shape.rank == 0:  # already the micro-batch mean
        return loss * (size / batch)
    return tf.reduce_sum(loss) / batch


def _gpipe_step(staged, loss_fn, sizes, training):
    """A compiled GPipe step for micro-batches of ``sizes``; the events list is filled while
    tracing, in the order the step returns their clock readings."""
    stages, m, batch = len(staged.stages), len(sizes), sum(sizes)
    events = []

    @tf.function
    def step(x, y):
        events.clear()
        xs, ys = tf.split(x, sizes), tf.split(y, sizes)
        last = [None] * stages  # each device does one thing at a time, in schedule order
        clocks, saved = [], {}

        def record(stage, j, phase, start, end):
            events.append((stage, j, phase))
            clocks.append(tf.stack([start, end]))
            last[stage] = end
            return end

        for j in range(m):  # forward: micro-batch j flows through every stage
            h, handed_over = xs[j], None  # handed_over: when the previous stage finished it
            for s in range(stages):
                with tf.device(staged.devices[s]):
                    start = _clock_after(h, last[s], handed_over)
                    with tf.control_dependencies([start]):
                        h_in = tf.identity(h)
                        with tf.GradientTape() as tape:
                            tape.watch(h_in)
                            h = staged.stage_forward(s, h_in, training=training)
                            out = h
                            if s == stages - 1:
                                out = _weighted_loss(loss_fn, ys[j], h, sizes[j], batch)
                    handed_over = record(s, j, "forward", start, _clock_after(out))
                    saved[s, j] = tape, h_in, out
        totals = [tf.zeros_like(v) for v in staged.trainable_variables]
        offsets = np.cumsum([0] + [len(staged.stage_variables(s)) for s in range(stages)])
        loss = tf.add_n([saved[stages - 1, j][2] for j in range(m)])
        for j in reversed(range(m)):  # backward: GPipe runs them in reverse micro-batch order
            upstream = handed_over = None
            for s in reversed(range(stages)):
                tape, h_in, out = saved[s, j]
                variables = staged.stage_variables(s)
                with tf.device(staged.devices[s]):
                    start = _clock_after(upstream, last[s], handed_over)
                    with tf.control_dependencies([start]):
                        sources = variables if s == 0 else [h_in] + variables
                        grads = tape.gradient(out, sources, output_gradients=upstream,
                                              unconnected_gradients="zero")
                        if s > 0:
                            upstream, grads = grads[0], grads[1:]
                        for k, g in enumerate(grads):
                            totals[offsets[s] + k] = totals[offsets[s] + k] + g
                    handed_over = record(s, j, "backward", start, _clock_after(
                        *totals[offsets[s]:offsets[s + 1]], upstream))
        return loss, totals, tf.stack(clocks)

    return step, events


def pipeline_gradients(stages, x, y, loss_fn, num_microbatches, *, training=False):
    """Loss and gradients of a staged model, computed with the GPipe pipeline schedule.

    The batch is cut into ``num_microbatches`` micro-batches. Each stage runs the forward pass of
    every micro-batch in turn, handing each one to the next stage as soon as it is done, then
    the backward passes in reverse order, and the micro-batch gradients are summed. Each stage
    does one thing at a time on its own device; different stages work at the same time. The
    whole schedule is one ``tf.function``, traced once per batch size and micro-batch count.

    A batch that does not split evenly is handled exactly: micro-batch sizes differ by at most
    one, and each micro-batch's loss is weighted by its share of the batch, so the result is the
    full-batch mean gradient.

    Args:
      stages: a :class:`StagedModel` from :func:`place_stages`.
      x: inputs, shape ``[batch, ...]``.
      y: targets, shape ``[batch, ...]``.
      loss_fn: ``loss_fn(y_true, y_pred)`` returning per-example losses ``[batch]`` or their
        mean (a Keras loss with its default reduction).
      num_microbatches: micro-batches per step, ``1 <= num_microbatches <= batch``. With 1 this
        is naive model parallelism: one device works at a time.
      training: passed to the layers. BatchNormalization then normalises each micro-batch on
        its own (as in GPipe), which is not the full-batch result.

    Returns:
      ``(loss, gradients, timeline)``: the full-batch mean loss (float), the gradients (one
      tensor per ``stages.trainable_variables`` entry, in layer order), and the measured
      timeline, a list of ``{"stage", "microbatch", "phase", "start", "end"}`` in seconds from
      the first event (the same form as :func:`simulate_pipeline`'s).

    Raises:
      TypeError: ``stages`` is not a :class:`StagedModel`.
      ValueError: empty batch, ``x`` and ``y`` of different lengths, or ``num_microbatches``
        not an int between 1 and the batch size.

    Example:
      >>> staged = place_stages(layers, ["CPU:0", "CPU:1"], input_shape=(32,))  # doctest: +SKIP
      >>> loss, grads, timeline = pipeline_gradients(staged, x, y, loss_fn, 4)  # doctest: +SKIP
      >>> len(timeline) == 2 * 2 * 4  # stages x micro-batches x (forward, backward)  # doctest: +SKIP
      True
    """
    if not isinstance(stages, StagedModel):
        raise TypeError(f"stages must come from place_stages(layers, devices), got "
                        f"{type(stages).__name__}")
    x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
    batch = x.shape[0]
    if not batch:
        raise ValueError("the batch is empty: pass at least one example")
    if y.shape[0] != batch:
        raise ValueError(f"x has {batch} examples but y has {y.shape[0]}: they must match")
    if (not isinstance(num_microbatches, (int, np.integer)) or isinstance(num_microbatches, bool)
            or not 1 <= num_microbatches <= batch):
        raise ValueError(
            f"num_microbatches must be an int from 1 to the batch size ({batch}), got "
            f"{num_microbatches!r}: each micro-batch needs at least one example")
    sizes = _microbatch_sizes(batch, int(num_microbatches))
    key = (id(loss_fn), tuple(sizes), bool(training))
    if key not in stages._pipelines:
        stages._pipelines[key] = (loss_fn,) + _gpipe_step(stages, loss_fn, sizes, training)
    _, step, events = stages._pipelines[key]
    loss, grads, clocks = step(x, y)
    clocks = clocks.numpy()
    origin = clocks.min()
    timeline = [{"stage": s, "microbatch": j, "phase": phase, "start": float(a - origin),
                 "end": float(b - origin)} for (s, j, phase), (a, b) in zip(events, clocks)]
    timeline.sort(key=lambda e: (e["start"], e["stage"]))
    return float(loss), list(grads), timeline


def bubble_fraction(timeline):
    """Share of device-time idle in a timeline: ``1 - busy / (stages x makespan)``.

    Works for measured timelines (from :func:`pipeline_gradients`) and modelled ones (from
    :func:`simulate_pipeline`, which reports the same number).
    """
    if not timeline:
        raise ValueError("the timeline is empty")
    stages = len({e["stage"] for e in timeline})
    makespan = max(e["end"] for e in timeline) - min(e["start"] for e in timeline)
    busy = sum(e["end"] - e["start"] for e in timeline)
    return 1.0 - busy / (stages * makespan)


def stage_times(timeline):
    """Median (forward, backward) seconds of each stage in a timeline, ready for
    :func:`simulate_pipeline` to replay."""
    stages = sorted({e["stage"] for e in timeline})
    result = []
    for s in stages:
        pair = []
        for phase in ("forward", "backward"):
            spans = [e["end"] - e["start"] for e in timeline
                     if e["stage"] == s and e["phase"] == phase]
            pair.append(float(np.median(spans)))
        result.append(tuple(pair))
    return result


def activations_in_flight(timeline):
    """Most micro-batches whose activations each stage holds at once (forward done, backward
    not yet): the activation memory a schedule needs, in micro-batches."""
    peaks = {}
    for s in sorted({e["stage"] for e in timeline}):
        changes = []
        for e in timeline:
            if e["stage"] == s:
                changes.append((e["end"], 1) if e["phase"] == "forward" else (e["end"], -1))
        held = peak = 0
        for _, change in sorted(changes):
            held += change
            peak = max(peak, held)
        peaks[s] = peak
    return [peaks[s] for s in sorted(peaks)]


# --- the GPipe schedule, modelled ----------------------------------------------------------

def _stage_costs(stage_times, backward_factor):
    costs = []
    for i, t in enumerate(stage_times):
        forward, backward = (t if isinstance(t, (tuple, list)) else (t, backward_factor * t))
        if not forward > 0 or not backward > 0:
            raise ValueError(f"stage {i}: forward and backward times must be positive, got "
                             f"{forward!r} and {backward!r}")
        costs.append((float(forward), float(backward)))
    return costs


SCHEDULES = ("gpipe", "1f1b")


def schedule_order(schedule, stage, num_stages, num_microbatches):
    """The order in which one stage runs its work: a list of ``(phase, microbatch)``.

    - ``"gpipe"``: every forward, then every backward in reverse micro-batch order;
    - ``"1f1b"`` (PipeDream-Flush): ``num_stages - stage - 1`` warm-up forwards, then one
      forward and one backward in turn, then the remaining backwards. Same bubble as GPipe, but
      a stage never holds more than ``num_stages - stage`` micro-batches' activations.
    """
    m = num_microbatches
    if schedule == "gpipe":
        return [("forward", j) for j in range(m)] + [("backward", j) for j in reversed(range(m))]
    if schedule == "1f1b":
        warmup = min(num_stages - stage - 1, m)
        order = [("forward", j) for j in range(warmup)]
        for j in range(m - warmup):
            order += [("forward", warmup + j), ("backward", j)]
        return order + [("backward", j) for j in range(m - warmup, m)]
    raise ValueError(f"unknown schedule {schedule!r}; modelled: {', '.join(SCHEDULES)}")


def simulate_pipeline(stage_times, num_microbatches, schedule="gpipe", backward_factor=2.0):
    """Discrete-event model of a pipeline-parallel training step.

    Each stage is one device doing one thing at a time, in the order its schedule gives
    (:func:`schedule_order`). A forward on micro-batch j starts once the previous stage has
    finished it; a backward once the next stage has sent that micro-batch's gradient back (the
    last stage's once its own forward is done).

    Args:
      stage_times: per stage, the forward time of one micro-batch (its backward then takes
        ``backward_factor`` times as long), or a ``(forward, backward)`` pair.
      num_microbatches: micro-batches per step (positive int).
      schedule: ``"gpipe"`` or ``"1f1b"``.
      backward_factor: backward / forward time when only forward times are given.

    Returns:
      dict with ``"timeline"``, a list of ``{"stage", "microbatch", "phase", "start", "end"}``
      (phase ``"forward"`` or ``"backward"``), ``"makespan"``, and ``"bubble_fraction"``: the
      share of device-time idle, ``1 - busy / (stages x makespan)``. For equal stages this is
      ``(p - 1) / (m + p - 1)`` for p stages and m micro-batches, for both schedules.

    Raises:
      ValueError: no stages, a non-positive time, ``num_microbatches < 1``, or an unknown
        schedule.

    Example:
      >>> round(simulate_pipeline([1.0] * 4, 8)["bubble_fraction"], 4)   # 3 / 11
      0.2727
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; modelled: {', '.join(SCHEDULES)}")
    if not stage_times:
        raise ValueError("stage_times is empty: a pipeline needs at least one stage")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    costs = _stage_costs(stage_times, backward_factor)
    stages, m = len(costs), num_microbatches
    orders = [schedule_order(schedule, s, stages, m) for s in range(stages)]
    done, free, position, timeline = {}, [0.0] * stages, [0] * stages, []

    def dependency(s, phase, j):
        if phase == "forward":
            return (s - 1, "forward", j) if s else None
        return (s + 1, "backward", j) if s + 1 < stages else (s, "forward", j)

    while len(timeline) < 2 * stages * m:
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                phase, j = orders[s][position[s]]
                needs = dependency(s, phase, j)
                if needs is not None and needs not in done:
                    break
                start = max(free[s], done[needs] if needs else 0.0)
                free[s] = done[s, phase, j] = start + costs[s][phase == "backward"]
                timeline.append({"stage": s, "microbatch": j, "phase": phase, "start": start,
                                 "end": free[s]})
                position[s] += 1
                progressed = True
        if not progressed:  # cannot happen for the schedules above; guards future ones
            raise RuntimeError(f"schedule {schedule!r} deadlocks")
    timeline.sort(key=lambda e: (e["start"], e["stage"]))
    return {"timeline": timeline, "makespan": max(event["end"] for event in timeline),
            "bubble_fraction": bubble_fraction(timeline)}


# --- tensor parallelism: the Megatron-LM split of a Dense kernel ------------------------------

def _check_divisible(size, shards, what):
    if size % shards:
        raise ValueError(
            f"{what} is {size}, which does not split into {shards} equal shards: choose a size "
            f"divisible by {shards}, or use a device count that divides {size}")


class ColumnParallelDense(keras.layers.Layer):
    """A Dense layer whose kernel is split by output columns over ``devices``.

    Device i holds ``kernel[:, i*u:(i+1)*u]`` and the matching bias slice, where
    ``u = units / len(devices)``, and computes its slice of the output from the whole input.
    No communication is needed in the forward pass; in the backward pass the input gradient is
    the sum of every device's contribution (the all-reduce Megatron-LM calls *f*; here
    TensorFlow's autodiff adds them).

    Args:
      units: output features; must be divisible by the number of devices.
      devices: one device name per shard.
      activation: applied to each shard (element-wise, so sharding does not change it).
      gather_output: concatenate the shards into one ``[batch, units]`` tensor. Leave it False
        when a :class:`RowParallelDense` follows: it takes the list of shards as it is.
      kernel_initializer, bias_initializer: initialise the full kernel, which is then split,
        so the layer starts like an unsplit ``Dense``.

    Call: ``x`` of shape ``[batch, in]`` -> a list of ``len(devices)`` tensors
    ``[batch, units / len(devices)]`` (or one ``[batch, units]`` tensor with ``gather_output``).

    Raises:
      ValueError: ``units`` not divisible by the device count, or a device that does not exist.

    Example:
      >>> layer = ColumnParallelDense(8, ["CPU:0", "CPU:1"], gather_output=True)  # doctest: +SKIP
      >>> layer(tf.zeros((4, 3))).shape  # doctest: +SKIP
      TensorShape([4, 8])
    """

    def __init__(self, units, devices, activation=None, gather_output=False,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        self.devices = _check_devices(devices)
        _check_divisible(units, len(self.devices), "units")
        self.units = units
        self.activation = keras.activations.get(activation)
        self.gather_output = gather_output
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def build(self, input_shape):
        with tf.init_scope():  # eager even when first called inside a tf.function
            kernel = np.asarray(self.kernel_initializer((input_shape[-1], self.units)))
            bias = np.asarray(self.bias_initializer((self.units,)))
        self.kernels, self.biases = [], []
        for i, (k, b) in enumerate(zip(np.split(kernel, len(self.devices), axis=1),
                                       np.split(bias, len(self.devices)))):
            with tf.device(self.devices[i]):  # each shard's weights live on its device
                self.kernels.append(self.add_weight(shape=k.shape, name=f"kernel_{i}",
                                                    initializer=keras.initializers.Constant(k)))
                self.biases.append(self.add_weight(shape=b.shape, name=f"bias_{i}",
                                                   initializer=keras.initializers.Constant(b)))

    def call(self, x):
        shards = []
        for device, kernel, bias in zip(self.devices, self.kernels, self.biases):
            with tf.device(device):
                shards.append(self.activation(tf.matmul(x, kernel) + bias))
        if self.gather_output:
            with tf.device(self.devices[0]):
                return tf.concat(shards, axis=-1)
        return shards

    def merge_shards(self, values):
        """``(kernel, bias)`` of the unsplit layer from values lined up with
        ``trainable_variables`` (the weights themselves, or their gradients)."""
        values = [tf.convert_to_tensor(v) for v in values]
        return tf.concat(values[0::2], axis=1), tf.concat(values[1::2], axis=0)

    def load_dense_weights(self, kernel, bias):
        """Copy an unsplit Dense layer's ``kernel`` [in, units] and ``bias`` [units] in."""
        n = len(self.devices)
        for var, k in zip(self.kernels, np.split(np.asarray(kernel), n, axis=1)):
            var.assign(k)
        for var, b in zip(self.biases, np.split(np.asarray(bias), n)):
            var.assign(b)


class RowParallelDense(keras.layers.Layer):
    """A Dense layer whose kernel is split by input rows over ``devices``.

    Device i holds ``kernel[i*r:(i+1)*r, :]`` and multiplies it with its slice of the input
    features, which is exactly what a :class:`ColumnParallelDense` before it left on that
    device. The partial products are then summed (Megatron-LM's all-reduce *g*; on one host it
    is a sum on the first device, on GPUs an NCCL all-reduce so every device gets the result)
    and the bias is added once.

    Args:
      units: output features.
      devices: one device name per shard.
      activation: applied after the sum.
      kernel_initializer, bias_initializer: as for :class:`ColumnParallelDense`.

    Call: a list of ``len(devices)`` tensors ``[batch, in / len(devices)]`` (or one
    ``[batch, in]`` tensor, which is split) -> ``[batch, units]``.

    Raises:
      ValueError: input features not divisible by the device count, a shard list of the wrong
        length, or a device that does not exist.
    """

    def __init__(self, units, devices, activation=None, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        self.devices = _check_devices(devices)
        self.units = units
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def _features(self, input_shape):
        n = len(self.devices)
        if isinstance(input_shape, (list, tuple)) and input_shape and isinstance(
                input_shape[0], (list, tuple)):
            if len(input_shape) != n:
                raise ValueError(f"got {len(input_shape)} input shards for {n} devices: pass "
                                 "one shard per device (a ColumnParallelDense's output) or one "
                                 "tensor")
            return sum(shape[-1] for shape in input_shape)
        return input_shape[-1]

    def build(self, input_shape):
        features = self._features(input_shape)
        _check_divisible(features, len(self.devices), "the number of input features")
        with tf.init_scope():
            kernel = np.asarray(self.kernel_initializer((features, self.units)))
        self.kernels = []
        for i, k in enumerate(np.split(kernel, len(self.devices), axis=0)):
            with tf.device(self.devices[i]):
                self.kernels.append(self.add_weight(shape=k.shape, name=f"kernel_{i}",
                                                    initializer=keras.initializers.Constant(k)))
        with tf.device(self.devices[0]):
            self.bias = self.add_weight(shape=(self.units,), name="bias",
                                        initializer=self.bias_initializer)

    def call(self, x):
        shards = x if isinstance(x, (list, tuple)) else tf.split(x, len(self.devices), axis=-1)
        partials = []
        for device, kernel, shard in zip(self.devices, self.kernels, shards):
            with tf.device(device):
                partials.append(tf.matmul(shard, kernel))
        with tf.device(self.devices[0]):
            return self.activation(tf.add_n(partials) + self.bias)

    def merge_shards(self, values):
        """``(kernel, bias)`` of the unsplit layer from values lined up with
        ``trainable_variables``."""
        values = [tf.convert_to_tensor(v) for v in values]
        return tf.concat(values[:-1], axis=0), values[-1]

    def load_dense_weights(self, kernel, bias):
        """Copy an unsplit Dense layer's ``kernel`` [in, units] and ``bias`` [units] in."""
        for var, k in zip(self.kernels, np.split(np.asarray(kernel), len(self.devices), axis=0)):
            var.assign(k)
        self.bias.assign(bias)


# --- DTensor: a batch x model mesh --------------------------------------------------------

def make_mesh(batch, model, devices=None):
    """A 2-D DTensor mesh with dimensions ``"batch"`` (data parallel) and ``"model"`` (tensor
    parallel) over ``batch * model`` devices.

    Args:
      batch, model: sizes of the two mesh dimensions (positive ints).
      devices: device names, row-major over (batch, model); default the first
        ``batch * model`` logical CPUs.

    Raises:
      ValueError: sizes not positive, or not enough devices (create virtual CPUs with
        ``gradtut.setup(virtual_cpus=N)``).

    Example:
      >>> mesh = make_mesh(2, 2)  # doctest: +SKIP
      >>> mesh.shape()  # doctest: +SKIP
      [2, 2]
    """
    if not all(isinstance(n, int) and n >= 1 for n in (batch, model)):
        raise ValueError(f"mesh sizes must be positive ints, got batch={batch!r}, model={model!r}")
    if devices is None:
        cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
        if len(cpus) < batch * model:
            raise ValueError(
                f"a {batch} x {model} mesh needs {batch * model} devices but this process has "
                f"{len(cpus)} CPU device(s): create more with "
                f"gradtut.setup(virtual_cpus={batch * model}) (restart the kernel first)")
        devices = cpus[:batch * model]
    devices = _check_devices(devices)
    if len(devices) != batch * model:
        raise ValueError(f"a {batch} x {model} mesh needs {batch * model} devices, got "
                         f"{len(devices)}")
    return dtensor.create_mesh([("batch", batch), ("model", model)], devices=devices)


# The Megatron-LM split of a two-layer MLP: W1 by columns and W2 by rows over "model".
MLP_SHARDING = {"W1": [dtensor.UNSHARDED, "model"], "b1": ["model"],
                "W2": ["model", dtensor.UNSHARDED], "b2": [dtensor.UNSHARDED]}


def mlp_loss(params, x, y):
    """Mean softmax cross-entropy of a two-layer ReLU MLP. ``params`` has ``W1`` [in, hidden],
    ``b1`` [hidden], ``W2`` [hidden, classes], ``b2`` [classes]; ``y`` holds int labels."""
    hidden = tf.nn.relu(tf.matmul(x, params["W1"]) + params["b1"])
    logits = tf.matmul(hidden, params["W2"]) + params["b2"]
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))


def sgd_step(params, x, y, learning_rate):
    """One SGD step on :func:`mlp_loss` with a ``GradientTape``; returns the loss.

    The same code runs on plain ``tf.Variable`` s (the reference) and on DTensor ``DVariable`` s
    with sharded ``x`` and ``y``: DTensor works out the communication from the layouts.
    """
    with tf.GradientTape() as tape:
        loss = mlp_loss(params, x, y)
    names = sorted(params)
    grads = tape.gradient(loss, [params[n] for n in names])
    for name, grad in zip(names, grads):
        params[name].assign_sub(learning_rate * grad)
    return loss


def _on_mesh(value, mesh, sharding):
    value = tf.convert_to_tensor(value)
    replicated = dtensor.copy_to_mesh(value, dtensor.Layout.replicated(mesh, value.shape.rank))
    return dtensor.relayout(replicated, dtensor.Layout(sharding, mesh))


def shard_mlp_params(params, mesh, sharding=None):
    """``DVariable`` copies of ``params`` laid out on ``mesh`` (default :data:`MLP_SHARDING`).

    Raises:
      ValueError: a dimension that does not divide by its mesh dimension's size.
    """
    sharding = sharding or MLP_SHARDING
    result = {}
    for name, value in params.items():
        shape = tf.convert_to_tensor(value).shape
        for size, dim in zip(shape, sharding[name]):
            if dim != dtensor.UNSHARDED:
                _check_divisible(size, mesh.dim_size(dim), f"{name}'s size along '{dim}'")
        result[name] = dtensor.DVariable(_on_mesh(value, mesh, sharding[name]))
    return result


def shard_batch(x, mesh):
    """``x`` split along its first axis over the mesh's ``"batch"`` dimension (replicated
    over ``"model"``).

    Raises:
      ValueError: the batch does not split evenly over the ``"batch"`` dimension.
    """
    x = tf.convert_to_tensor(x)
    _check_divisible(x.shape[0], mesh.dim_size("batch"), "the batch size")
    return _on_mesh(x, mesh, ["batch"] + [dtensor.UNSHARDED] * (x.shape.rank - 1))


def gather(value):
    """The full value of a DTensor (or DVariable) as a NumPy array."""
    if isinstance(value, tf.Variable):
        value = value.read_value()
    layout = dtensor.fetch_layout(value)
    full = dtensor.relayout(value, dtensor.Layout.replicated(layout.mesh, layout.rank))
    return dtensor.unpack(full)[0].numpy()


def describe_shards(values):
    """Text table: for each named DTensor, its layout, then which slice each device holds.

    Args:
      values: dict ``{name: DTensor or DVariable}``.

    Returns:
      a string with one block per tensor and one line per device, e.g.
      ``CPU:1 (batch=0, model=1)  [0:8, 3:6]``.
    """
    lines = []
    for name, value in values.items():
        tensor = value.read_value() if isinstance(value, tf.Variable) else value
        layout = dtensor.fetch_layout(tensor)
        mesh = layout.mesh
        shape = tensor.shape
        lines.append(f"{name} {list(shape)} sharded as {list(layout.sharding_specs)}")
        for device_id, device in enumerate(mesh.local_devices()):
            location = mesh.device_location(device_id)
            coords = dict(zip(mesh.dim_names, location))
            slices = []
            for size, dim in zip(shape, layout.sharding_specs):
                if dim == dtensor.UNSHARDED:
                    slices.append(f"0:{size}")
                else:
                    step = size // mesh.dim_size(dim)
                    slices.append(f"{coords[dim] * step}:{(coords[dim] + 1) * step}")
            where = ", ".join(f"{k}={v}" for k, v in coords.items())
            short = device.split("device:")[-1]
            lines.append(f"  {short} ({where})  [{', '.join(slices)}]")
    return "\n".join(lines)


# --- memory arithmetic ---------------------------------------------------------------------

def _bytes(variables):
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


def optimizer_slots(optimizer):
    """Values the optimizer keeps per trainable weight (Adam 2, SGD with momentum 1, plain
    SGD 0), found by building a copy of it on a one-element variable."""
    probe = type(optimizer).from_config(optimizer.get_config())
    probe.build([keras.Variable(np.zeros(1, "float32"))])
    return sum(int(np.prod(v.shape)) for v in probe.variables if tuple(v.shape) == (1,))


def _activation_elements(model):
    """Elements per example that backprop keeps, per layer: each layer's output, and for the
    first layer also the model's input."""
    try:
        shapes = [layer.output.shape for layer in model.layers]
        inputs = [x.shape for x in model.inputs]
    except (AttributeError, ValueError):
        raise ValueError(
            "the model's layer output shapes are unknown: build it on a keras.Input (a "
            "Sequential starting with keras.Input(shape), or a functional model)") from None
    elements = [int(np.prod(shape[1:])) for shape in shapes]
    elements[0] += sum(int(np.prod(shape[1:])) for shape in inputs)
    return elements


MEMORY_STRATEGIES = ("data", "stage", "tensor")


def model_memory_report(model, optimizer, batch_size, num_devices, strategy):
    """Estimated bytes per device of training ``model`` with ``optimizer``, split over devices.

    - parameters: every weight of the model;
    - gradients: one value per trainable weight;
    - optimizer_state: the optimizer's slots (Adam keeps 2 per trainable weight);
    - activations: every layer's output for the batch (what backprop keeps), in the compute
      dtype. It is an estimate: backprop frees activations as it goes and adds temporaries, so
      a measured peak can be lower or higher (notebook 04 compares the two).

    Per strategy:

    - ``"data"``: each device holds everything and ``batch_size / num_devices`` examples;
    - ``"stage"``: layers split into ``num_devices`` consecutive stages balanced by parameter
      count (as :func:`place_stages` does); each device keeps its stage's weights and, with
      the GPipe schedule, its layers' activations for the whole batch. The busiest stage is
      reported;
    - ``"tensor"``: every weight and activation split evenly (the Megatron-LM ideal; the
      replicated inputs, biases and norms it leaves out are small).

    Args:
      model: a built Keras model whose layers have known output shapes.
      optimizer: a Keras optimizer (built or not; it is not modified).
      batch_size: global batch size.
      num_devices: devices to split over (1 for a single device).
      strategy: ``"data"``, ``"stage"`` or ``"tensor"``.

    Returns:
      dict with ``"parameters"``, ``"gradients"``, ``"optimizer_state"``, ``"activations"``
      and ``"total"`` bytes on the busiest device, plus ``"strategy"``, ``"num_devices"``,
      ``"batch_size"`` and ``"per_device_total"`` (bytes on each device).

    Raises:
      ValueError: unknown strategy, sizes that are not positive, a batch that does not split
        over the devices (``"data"``), or more stages than layers (``"stage"``).

    Example:
      >>> report = model_memory_report(model, keras.optimizers.Adam(), 256, 4, "data")  # doctest: +SKIP
      >>> report["optimizer_state"] == 2 * report["gradients"]  # doctest: +SKIP
      True
    """
    if strategy not in MEMORY_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {MEMORY_STRATEGIES}")
    for name, value in (("batch_size", batch_size), ("num_devices", num_devices)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    slots = optimizer_slots(optimizer)
    dtype_bytes = np.dtype(keras.backend.standardize_dtype(model.compute_dtype)).itemsize
    activations = [e * dtype_bytes for e in _activation_elements(model)]
    layers = [(_bytes(layer.weights), _bytes(layer.trainable_weights), act)
              for layer, act in zip(model.layers, activations)]

    def device(group, examples, share=1):
        params = sum(p for p, _, _ in group) // share
        trainable = sum(t for _, t, _ in group) // share
        acts = sum(a for _, _, a in group) * examples // share
        entry = {"parameters": params, "gradients": trainable,
                 "optimizer_state": slots * trainable, "activations": acts}
        entry["total"] = sum(entry.values())
        return entry

    if strategy == "data":
        _check_divisible(batch_size, num_devices, "the batch size")
        per_device = [device(layers, batch_size // num_devices)] * num_devices
    elif strategy == "tensor":
        per_device = [device(layers, batch_size, share=num_devices)] * num_devices
    else:
        if num_devices > len(layers):
            raise ValueError(f"{num_devices} stages but the model has only {len(layers)} "
                             "layers: every stage needs at least one layer")
        cuts = [0] + _balanced_boundaries([p for p, _, _ in layers], num_devices) + [len(layers)]
        per_device = [device(layers[a:b], batch_size) for a, b in zip(cuts, cuts[1:])]
    busiest = dict(max(per_device, key=lambda e: e["total"]))
    busiest.update(strategy=strategy, num_devices=num_devices, batch_size=batch_size,
                   per_device_total=[e["total"] for e in per_device])
    return busiest


# --- plots ---------------------------------------------------------------------------------

def plot_timeline(timeline, ax=None, title="Pipeline timeline", scale=1e3, xlabel="time (ms)"):
    """Gantt chart of a timeline: one row per stage, forward and backward boxes labelled with
    their micro-batch. Times are multiplied by ``scale`` (1e3: seconds to ms; use 1 and your
    own ``xlabel`` for a simulated timeline). Returns the matplotlib axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stages = len({e["stage"] for e in timeline})
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.8 + 0.55 * stages))
    colors = {"forward": "tab:blue", "backward": "tab:orange"}
    width = max(e["end"] for e in timeline) * scale
    for e in timeline:
        start, length = e["start"] * scale, (e["end"] - e["start"]) * scale
        ax.broken_barh([(start, length)], (e["stage"] - 0.4, 0.8),
                       facecolors=colors[e["phase"]], edgecolor="white")
        if length > 0.025 * width:
            ax.text(start + length / 2, e["stage"], str(e["microbatch"]), ha="center",
                    va="center", color="white", fontsize=8)
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=p) for p, c in colors.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax
