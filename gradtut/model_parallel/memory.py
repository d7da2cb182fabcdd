"""Memory arithmetic: what each device holds under data, stage and tensor splits (notebook 04)."""
import itertools

import keras
import numpy as np

from gradtut.checks import check_int
from gradtut.model_parallel.placement import balanced_boundaries
from gradtut.model_parallel.tensor_parallel import _check_divisible


def _busiest_share(count, share):
    """Whole elements on the busiest of ``share`` devices holding ``count``: count / share,
    rounded up (10 over 4 devices is 3)."""
    return -(-count // share)


def _bytes(variables, share=1):
    """Bytes of ``variables``, each split ``share`` ways: the busiest device's whole
    elements (rounded up)."""
    return sum(_busiest_share(int(np.prod(v.shape)), share) * np.dtype(v.dtype).itemsize
               for v in variables)


def optimizer_slots(optimizer):
    """Values the optimizer keeps per trainable weight (Adam 2, SGD with momentum 1, plain
    SGD 0), found by building a copy of it on a one-element variable.

    Raises:
      TypeError: ``optimizer`` is not a Keras optimizer.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a Keras optimizer (e.g. keras.optimizers.Adam()), "
                        f"got {type(optimizer).__name__}")
    probe = type(optimizer).from_config(optimizer.get_config())
    probe.build([keras.Variable(np.zeros(1, "float32"))])
    return sum(int(np.prod(v.shape)) for v in probe.variables if tuple(v.shape) == (1,))


def _computing_layers(model):
    """The model's layers but its ``InputLayer`` (a functional model lists it; a Sequential
    does not)."""
    return [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]


def _activation_elements(model):
    """Elements per example that backprop keeps, per layer: each layer's output, and for the
    first layer also the model's input."""
    try:
        shapes = [layer.output.shape for layer in _computing_layers(model)]
        inputs = _input_elements(model)
    except (AttributeError, ValueError):
        raise ValueError(
            "the model's layer output shapes are unknown: build it on a keras.Input (a "
            "Sequential starting with keras.Input(shape), or a functional model)") from None
    elements = [int(np.prod(shape[1:])) for shape in shapes]
    elements[0] += inputs
    return elements


def _input_elements(model):
    """Elements per example of the model's inputs (already known to be built)."""
    return sum(int(np.prod(x.shape[1:])) for x in model.inputs)


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
      the GPipe schedule, its layers' activations for the whole batch, and every stage but
      the first also its copy of the activation it received. The busiest stage is reported;
    - ``"tensor"``: Megatron-LM pairs: the 1st, 3rd, ... layers with a kernel split by
      columns, the 2nd, 4th, ... by rows (a layer without a kernel keeps the split of the one
      before). Every weight is divided by the number of devices, and a column layer's output
      along its last axis, in whole elements: where they do not divide, the busiest device
      holds the larger share (Megatron-LM replicates the row biases; that excess is left out:
      small). A row layer's output, after Megatron-LM's all-reduce, is whole on every device
      (gradtut's RowParallelDense sums onto the first device only), and
      so is the model's input: those activations are not divided.

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
      >>> model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(10)])
      >>> report = model_memory_report(model, keras.optimizers.Adam(), 256, 4, "data")
      >>> report["optimizer_state"] == 2 * report["gradients"]
      True
    """
    if strategy not in MEMORY_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {MEMORY_STRATEGIES}")
    batch_size = check_int(batch_size, "batch_size")
    num_devices = check_int(num_devices, "num_devices")
    slots = optimizer_slots(optimizer)
    dtype_bytes = np.dtype(keras.backend.standardize_dtype(model.compute_dtype)).itemsize
    activations = [e * dtype_bytes for e in _activation_elements(model)]
    inputs = _input_elements(model) * dtype_bytes  # kept whole, by a tensor or stage split
    computing = _computing_layers(model)
    layers = [(_bytes(layer.weights), _bytes(layer.trainable_weights), act)
              for layer, act in zip(computing, activations, strict=True)]

    def device(group, examples):
        params = sum(p for p, _, _ in group)
        trainable = sum(t for _, t, _ in group)
        acts = sum(a for _, _, a in group) * examples
        entry = {"parameters": params, "gradients": trainable,
                 "optimizer_state": slots * trainable, "activations": acts}
        entry["total"] = sum(entry.values())
        return entry

    if strategy == "data":
        _check_divisible(batch_size, num_devices, "the batch size")
        per_device = [device(layers, batch_size // num_devices)] * num_devices
    elif strategy == "tensor":
        trainable = sum(_bytes(layer.trainable_weights, num_devices) for layer in computing)
        entry = {"parameters": sum(_bytes(layer.weights, num_devices) for layer in computing),
                 "gradients": trainable, "optimizer_state": slots * trainable}
        per_example, split, kernels = inputs, False, 0
        for i, (layer, act) in enumerate(zip(computing, activations, strict=True)):
            if getattr(layer, "kernel", None) is not None:  # pairs: a column, then a row layer
                split, kernels = kernels % 2 == 0, kernels + 1
            output = act - inputs if i == 0 else act  # other layers follow the one before
            if split:  # a column split divides the last axis: the busiest device's share
                *middle, width = layer.output.shape[1:]
                output = int(np.prod(middle)) * _busiest_share(width, num_devices) * dtype_bytes
            per_example += output
        entry["activations"] = per_example * batch_size
        entry["total"] = sum(entry[k] for k in
                             ("parameters", "gradients", "optimizer_state", "activations"))
        per_device = [entry] * num_devices
    else:
        if num_devices > len(layers):
            raise ValueError(f"{num_devices} stages but the model has only {len(layers)} "
                             "layers: every stage needs at least one layer")
        cuts = [0] + balanced_boundaries([p for p, _, _ in layers], num_devices) + [len(layers)]
        per_device = []
        for a, b in itertools.pairwise(cuts):
            entry = device(layers[a:b], batch_size)
            if a > 0:  # a later stage keeps its copy of what it received, for its first layer
                received = (activations[a - 1] - (inputs if a == 1 else 0)) * batch_size
                entry["activations"] += received
                entry["total"] += received
            per_device.append(entry)
    busiest = dict(max(per_device, key=lambda e: e["total"]))
    busiest.update(strategy=strategy, num_devices=num_devices, batch_size=batch_size,
                   per_device_total=[e["total"] for e in per_device])
    return busiest
