"""The GPipe pipeline, measured: stages run on micro-batches, with a recorded timeline and its
idle share (notebook 04)."""
import time

import numpy as np
import tensorflow as tf

from gradtut.checks import check_int
from gradtut.model_parallel.placement import StagedModel


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


def _weighted_loss(loss_fn, y, y_pred, batch):
    """This micro-batch's share of the full-batch mean loss: its per-example losses summed,
    over the full batch size. A loss that is already reduced is refused, so that this division
    is the only one: a mean would divide each micro-batch by its own size (wrong by that size),
    and a scalar sum, which would happen to give the same result, is refused with it for one
    simple rule: per-example losses in, the pipeline weighs them."""
    loss = tf.cast(loss_fn(y, y_pred), tf.float32)
    if loss.shape.rank != 1:
        raise ValueError(
            f"loss_fn must return per-example losses of shape [micro-batch]; it returned shape "
            f"{loss.shape}. Build Keras losses with reduction=None: the pipeline weights each "
            "micro-batch by its size itself.")
    return tf.reduce_sum(loss) / batch


class _Clocks:
    """What a traced GPipe step records: one (stage, micro-batch, phase) event and one
    (start, end) clock pair per box, and when each stage last finished something."""

    def __init__(self, stages, events):
        self.events, self.clocks, self.last = events, [], [None] * stages

    def record(self, stage, j, phase, start, end):
        self.events.append((stage, j, phase))
        self.clocks.append(tf.stack([start, end]))
        self.last[stage] = end
        return end


def _forward(staged, clocks, j, x, y, loss_fn, batch, training):
    """Micro-batch ``j`` through every stage; returns ``{stage: (tape, input, output)}``, the
    last output being the micro-batch's share of the loss."""
    saved, h, handed_over = {}, x, None  # handed_over: when the previous stage finished it
    last = len(staged.stages) - 1
    for s in range(last + 1):
        with tf.device(staged.devices[s]):
            start = _clock_after(h, clocks.last[s], handed_over)
            loss = (loss_fn, y, batch) if s == last else None
            tape, h_in, h, out = _taped_stage_forward(staged, s, h, start, training, loss)
            handed_over = clocks.record(s, j, "forward", start, _clock_after(out))
            saved[s] = tape, h_in, out
    return saved


def _taped_stage_forward(staged, s, h, start, training, loss=None):
    """Stage ``s`` on ``h``, after ``start``, on a tape that watches its input. Returns
    ``(tape, input, output, out)``: ``out`` is the output, or with ``loss=(loss_fn, y, batch)``
    the micro-batch's share of the loss."""
    with tf.control_dependencies([start]):
        h_in = tf.identity(h)
        with tf.GradientTape() as tape:
            tape.watch(h_in)
            h = staged.stage_forward(s, h_in, training=training)
            out = h if loss is None else _weighted_loss(loss[0], loss[1], h, loss[2])
    return tape, h_in, h, out


def _backward(staged, clocks, j, saved, totals, offsets):
    """Micro-batch ``j``'s gradients back through every stage, added into ``totals``."""
    upstream = handed_over = None
    for s in reversed(range(len(staged.stages))):
        with tf.device(staged.devices[s]):
            start = _clock_after(upstream, clocks.last[s], handed_over)
            upstream, grads = _stage_backward(saved[s], staged.stage_variables(s), upstream,
                                              start, first=s == 0)
            for k, g in enumerate(grads):
                totals[offsets[s] + k] = totals[offsets[s] + k] + g
            handed_over = clocks.record(s, j, "backward", start, _clock_after(
                start, *totals[offsets[s]:offsets[s + 1]], upstream))


def _stage_backward(saved, variables, upstream, start, first):
    """One stage's backward pass, after ``start``: ``(gradient for the stage before, or None
    for the first stage, gradients of its variables)``."""
    tape, h_in, out = saved
    with tf.control_dependencies([start]):
        sources = variables if first else [h_in] + variables
        grads = tape.gradient(out, sources, output_gradients=upstream,
                              unconnected_gradients="zero")
    return (None, grads) if first else (grads[0], grads[1:])


def _gpipe_step(staged, loss_fn, sizes, training):
    """A compiled GPipe step for micro-batches of ``sizes``; the events list is filled while
    tracing, in the order the step returns their clock readings."""
    stages, batch = len(staged.stages), sum(sizes)
    offsets = np.cumsum([0] + [len(staged.stage_variables(s)) for s in range(stages)])
    events = []

    @tf.function
    def step(x, y):
        events.clear()
        clocks = _Clocks(stages, events)  # each device does one thing at a time, in order
        xs, ys = tf.split(x, sizes), tf.split(y, sizes)
        saved = [_forward(staged, clocks, j, xs[j], ys[j], loss_fn, batch, training)
                 for j in range(len(sizes))]
        loss = tf.add_n([saved_j[stages - 1][2] for saved_j in saved])
        totals = [tf.zeros_like(v) for v in staged.trainable_variables]
        for j in reversed(range(len(sizes))):  # GPipe: backward in reverse micro-batch order
            _backward(staged, clocks, j, saved[j], totals, offsets)
        return loss, totals, tf.stack(clocks.clocks)

    return step, events


def pipeline_gradients(stages, x, y, loss_fn, num_microbatches, *, training=False):
    """Loss and gradients of a staged model, computed with the GPipe pipeline schedule.

    The batch is cut into ``num_microbatches`` micro-batches. Each stage runs the forward pass of
    every micro-batch in turn, handing each one to the next stage as soon as it is done, then
    the backward passes in reverse order, and the micro-batch gradients are summed. Each stage
    does one thing at a time on its own device; different stages work at the same time. The
    whole schedule is one ``tf.function``, traced once per loss, micro-batch split and
    ``training`` flag.

    A batch that does not split evenly is handled exactly: micro-batch sizes differ by at most
    one, and each micro-batch's loss is weighted by its share of the batch, so the result is the
    full-batch mean gradient.

    Args:
      stages: a :class:`StagedModel` from :func:`place_stages`.
      x: inputs, shape ``[batch, ...]``.
      y: targets, shape ``[batch, ...]``.
      loss_fn: ``loss_fn(y_true, y_pred)`` returning per-example losses ``[batch]`` (a Keras
        loss built with ``reduction=None``); a reduced (scalar) loss is refused.
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
      ValueError: empty batch, ``x`` and ``y`` of different lengths, ``num_microbatches``
        not an int between 1 and the batch size, or a loss that is not per-example.

    Example:
      >>> import keras
      >>> from gradtut.model_parallel import place_stages
      >>> layers = [keras.layers.Dense(16, "relu"), keras.layers.Dense(3)]
      >>> staged = place_stages(layers, ["CPU:0", "CPU:1"], input_shape=(4,))
      >>> x, y = np.zeros((8, 4), "float32"), np.zeros(8, "int32")
      >>> loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
      >>> loss, grads, timeline = pipeline_gradients(staged, x, y, loss_fn, 4)
      >>> len(timeline)  # stages x micro-batches x (forward, backward)
      16
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
    num_microbatches = check_int(num_microbatches, "num_microbatches", maximum=batch,
                                 what_maximum="the batch size")  # one example each at least
    sizes = _microbatch_sizes(batch, num_microbatches)
    key = (id(loss_fn), tuple(sizes), bool(training))
    if key not in stages._pipelines:
        stages._pipelines[key] = (loss_fn,) + _gpipe_step(stages, loss_fn, sizes, training)
    _, step, events = stages._pipelines[key]
    loss, grads, clocks = step(x, y)
    clocks = clocks.numpy()
    origin = clocks.min()
    timeline = [{"stage": s, "microbatch": j, "phase": phase, "start": float(a - origin),
                 "end": float(b - origin)}
                for (s, j, phase), (a, b) in zip(events, clocks, strict=True)]
    timeline.sort(key=lambda e: (e["start"], e["stage"]))
    return float(loss), list(grads), timeline


_EVENT_KEYS = ("stage", "microbatch", "phase", "start", "end")


def _check_timeline(timeline):
    """Refuse what would give a division by zero or a NaN: no events, an event without the
    keys of a timeline, one that ends before it starts, or a timeline of zero length."""
    if not timeline:
        raise ValueError("the timeline is empty: pass the 'timeline' of pipeline_gradients(...) "
                         "or simulate_pipeline(...)")
    for e in timeline:
        if not isinstance(e, dict) or any(k not in e for k in _EVENT_KEYS):
            raise ValueError(f"timeline events are dicts with keys {_EVENT_KEYS}, got {e!r}")
        if e["end"] < e["start"]:
            raise ValueError(f"an event ends before it starts: {e}")
    if max(e["end"] for e in timeline) <= min(e["start"] for e in timeline):
        raise ValueError("the timeline has zero length: every event starts and ends at once")


def bubble_fraction(timeline):
    """Share of device-time idle in a timeline: ``1 - busy / (stages x makespan)``.

    Works for measured timelines (from :func:`pipeline_gradients`) and modelled ones (from
    :func:`simulate_pipeline`, which reports the same number).

    Raises:
      ValueError: an empty or malformed timeline, or one of zero length.

    Example:
      >>> bubble_fraction([{"stage": 0, "microbatch": 0, "phase": "forward", "start": 0.0,
      ...                   "end": 1.0}, {"stage": 1, "microbatch": 0, "phase": "forward",
      ...                   "start": 1.0, "end": 2.0}])
      0.5
    """
    _check_timeline(timeline)
    stages = len({e["stage"] for e in timeline})
    makespan = max(e["end"] for e in timeline) - min(e["start"] for e in timeline)
    busy = sum(e["end"] - e["start"] for e in timeline)
    return 1.0 - busy / (stages * makespan)


def stage_times(timeline):
    """Median (forward, backward) seconds of each stage in a timeline, ready for
    :func:`simulate_pipeline` to replay.

    Raises:
      ValueError: a malformed timeline, or a stage with no forward or no backward event.
    """
    _check_timeline(timeline)
    stages = sorted({e["stage"] for e in timeline})
    result = []
    for s in stages:
        pair = []
        for phase in ("forward", "backward"):
            spans = [e["end"] - e["start"] for e in timeline
                     if e["stage"] == s and e["phase"] == phase]
            if not spans:
                raise ValueError(f"stage {s} has no {phase} event in the timeline: pass a whole "
                                 "training step's timeline (forward and backward)")
            pair.append(float(np.median(spans)))
        result.append(tuple(pair))
    return result


def activations_in_flight(timeline):
    """Most micro-batches whose activations each stage holds at once (forward done, backward
    not yet): the activation memory a schedule needs, in micro-batches.

    Raises:
      ValueError: an empty or malformed timeline.
    """
    _check_timeline(timeline)
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
