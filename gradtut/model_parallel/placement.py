"""Naive model parallelism: consecutive layers as stages on consecutive devices (notebook 04)."""
import itertools

import keras
import numpy as np
import tensorflow as tf

from gradtut.checks import check_int


def _check_devices(devices):
    """Full names of ``devices`` (e.g. "CPU:1" -> "/device:CPU:1"); clear error if one is
    missing."""
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


def balanced_boundaries(costs, num_stages):
    """Cut points splitting ``costs`` into ``num_stages`` consecutive non-empty groups whose
    largest sum is as small as possible (the linear-partition dynamic programme).

    :func:`place_stages` uses it with each layer's parameter count as its cost.

    Args:
      costs: one non-negative number per layer, in order.
      num_stages: groups wanted (a positive int, at most ``len(costs)``).

    Returns:
      sorted list of ``num_stages - 1`` indices: group ``k`` is ``costs[cut[k-1]:cut[k]]``.

    Raises:
      ValueError: fewer costs than stages, a negative or non-finite cost, or a bad count.

    Example:
      >>> balanced_boundaries([4, 1, 1, 1, 1], 2)
      [1]
    """
    num_stages = check_int(num_stages, "num_stages")
    costs = [float(c) for c in costs]
    if len(costs) < num_stages:
        raise ValueError(f"{len(costs)} costs cannot form {num_stages} non-empty stages: use "
                         "at most as many stages as layers")
    if not all(np.isfinite(c) and c >= 0 for c in costs):
        raise ValueError(f"costs must be finite and >= 0, got {costs}")
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
    if len(boundaries) != num_stages - 1 or any(
            a >= b for a, b in itertools.pairwise(cuts)):
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
        if len(stages) != len(devices) or not all(stages):
            raise ValueError(f"need one non-empty list of layers per device: got "
                             f"{len(stages)} stages for {len(devices)} devices. Build it with "
                             "place_stages(layers, devices)")
        self.stages = stages
        self.devices = devices
        self._pipelines = {}  # compiled GPipe steps, one per (loss, micro-batch sizes, mode)

    @property
    def layers(self):
        return [layer for stage in self.stages for layer in stage]

    @property
    def trainable_variables(self):
        """Every stage's trainable variables, in layer order (as in the unsplit model)."""
        return [v for layer in self.layers for v in layer.trainable_variables]

    def stage_variables(self, stage):
        return [v for layer in self.stages[stage] for v in layer.trainable_variables]

    @property
    def compiled_pipelines(self):
        """How many compiled pipeline steps this model holds (one per loss, micro-batch split
        and training flag; repeated calls reuse them)."""
        return len(self._pipelines)

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
        for s, (stage, count) in enumerate(zip(self.stages, self.parameter_counts(), strict=True)):
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
      >>> layers = [keras.layers.Dense(64, "relu"), keras.layers.Dense(10)]
      >>> staged = place_stages(layers, ["CPU:0", "CPU:1"], input_shape=(32,))
      >>> staged(tf.zeros((8, 32))).shape
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
        boundaries = balanced_boundaries(_parameter_counts(layers, input_shape), len(devices))
    boundaries = _check_boundaries(boundaries, len(layers), len(devices))
    cuts = [0] + boundaries + [len(layers)]
    staged = StagedModel([layers[a:b] for a, b in itertools.pairwise(cuts)], devices)
    if input_shape is not None:
        x = tf.zeros((1,) + tuple(input_shape))
        for s in range(len(devices)):
            x = staged.stage_forward(s, x)  # builds each unbuilt layer on its stage's device
    return staged
