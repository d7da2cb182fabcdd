"""DTensor: a small MLP trained on a ``batch`` x ``model`` mesh (notebook 04)."""
import tensorflow as tf
from tensorflow.experimental import dtensor

from gradtut.checks import check_int
from gradtut.model_parallel.placement import _check_devices
from gradtut.model_parallel.tensor_parallel import _check_divisible


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
      >>> mesh = make_mesh(2, 2)  # needs 4 devices: gradtut.setup(virtual_cpus=4)
      >>> mesh.shape()
      [2, 2]
    """
    batch, model = check_int(batch, "batch"), check_int(model, "model")
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


def _check_params(params):
    missing = [k for k in MLP_SHARDING if not isinstance(params, dict) or k not in params]
    if missing:
        raise ValueError(f"params must be a dict with W1, b1, W2 and b2; missing {missing}")


def mlp_loss(params, x, y):
    """Mean softmax cross-entropy of a two-layer ReLU MLP. ``params`` has ``W1`` [in, hidden],
    ``b1`` [hidden], ``W2`` [hidden, classes], ``b2`` [classes]; ``y`` holds int labels.

    Raises:
      ValueError: a parameter is missing.
    """
    _check_params(params)
    hidden = tf.nn.relu(tf.matmul(x, params["W1"]) + params["b1"])
    logits = tf.matmul(hidden, params["W2"]) + params["b2"]
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))


def sgd_step(params, x, y, learning_rate):
    """One SGD step on :func:`mlp_loss` with a ``GradientTape``; returns the loss.

    The same code runs on plain ``tf.Variable`` s (the reference) and on DTensor ``DVariable`` s
    with sharded ``x`` and ``y``: DTensor works out the communication from the layouts.

    Raises:
      ValueError: a parameter is missing or is not a variable (it could not be updated).
    """
    _check_params(params)
    constants = sorted(k for k in MLP_SHARDING if not isinstance(params[k], tf.Variable))
    if constants:
        raise ValueError(f"params {constants} are not variables, so the step cannot update them:"
                         " wrap them in tf.Variable (or shard_mlp_params for DTensor)")
    with tf.GradientTape() as tape:
        loss = mlp_loss(params, x, y)
    names = sorted(params)
    grads = tape.gradient(loss, [params[n] for n in names])
    for name, grad in zip(names, grads, strict=True):
        params[name].assign_sub(learning_rate * grad)
    return loss


def _on_mesh(value, mesh, sharding):
    value = tf.convert_to_tensor(value)
    replicated = dtensor.copy_to_mesh(value, dtensor.Layout.replicated(mesh, value.shape.rank))
    return dtensor.relayout(replicated, dtensor.Layout(sharding, mesh))


def shard_mlp_params(params, mesh, sharding=None):
    """``DVariable`` copies of ``params`` laid out on ``mesh`` (default :data:`MLP_SHARDING`).

    Raises:
      ValueError: a dimension that does not divide by its mesh dimension's size; a parameter
        the sharding does not name, or a sharding whose rank differs from the parameter's.
    """
    sharding = sharding or MLP_SHARDING
    result = {}
    for name, value in params.items():
        shape = tf.convert_to_tensor(value).shape
        if name not in sharding:
            raise ValueError(f"the sharding has no entry for parameter {name!r} (it names "
                             f"{sorted(sharding)}): pass sharding={{..., {name!r}: [one mesh "
                             f"dimension or dtensor.UNSHARDED per axis of its {shape.rank}]}}")
        if len(sharding[name]) != shape.rank:
            raise ValueError(f"the sharding of {name!r} has {len(sharding[name])} entries but "
                             f"the parameter has rank {shape.rank} (shape {shape.as_list()}): "
                             "give one mesh dimension or dtensor.UNSHARDED per axis")
        for size, dim in zip(shape, sharding[name], strict=True):
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


def _layout(tensor):
    """The DTensor layout of ``tensor``, or a clear error for an ordinary tensor."""
    try:
        return dtensor.fetch_layout(tensor)
    except (ValueError, TypeError, tf.errors.InvalidArgumentError, AttributeError):
        raise ValueError(f"expected a DTensor (from shard_batch or shard_mlp_params), got an "
                         f"ordinary {type(tensor).__name__}: there are no shards to "
                         "describe or gather") from None


def gather(value):
    """The full value of a DTensor (or DVariable) as a NumPy array.

    Raises:
      ValueError: ``value`` is not a DTensor.
    """
    if isinstance(value, tf.Variable):
        value = value.read_value()
    layout = _layout(value)
    full = dtensor.relayout(value, dtensor.Layout.replicated(layout.mesh, layout.rank))
    return dtensor.unpack(full)[0].numpy()


def describe_shards(values):
    """Text table: for each named DTensor, its layout, then which slice each device holds.

    Args:
      values: dict ``{name: DTensor or DVariable}``.

    Returns:
      a string with one block per tensor and one line per device, e.g.
      ``CPU:1 (batch=0, model=1)  [0:8, 3:6]``.

    Raises:
      ValueError: ``values`` is not a dict, or holds something that is not a DTensor.
    """
    if not isinstance(values, dict):
        raise ValueError("values must be a dict {name: DTensor}")
    lines = []
    for name, value in values.items():
        tensor = value.read_value() if isinstance(value, tf.Variable) else value
        layout = _layout(tensor)
        mesh = layout.mesh
        shape = tensor.shape
        lines.append(f"{name} {list(shape)} sharded as {list(layout.sharding_specs)}")
        for device_id, device in enumerate(mesh.local_devices()):
            location = mesh.device_location(device_id)
            coords = dict(zip(mesh.dim_names, location, strict=True))
            slices = []
            for size, dim in zip(shape, layout.sharding_specs, strict=True):
                if dim == dtensor.UNSHARDED:
                    slices.append(f"0:{size}")
                else:
                    step = size // mesh.dim_size(dim)
                    slices.append(f"{coords[dim] * step}:{(coords[dim] + 1) * step}")
            where = ", ".join(f"{k}={v}" for k, v in coords.items())
            short = device.split("device:")[-1]
            lines.append(f"  {short} ({where})  [{', '.join(slices)}]")
    return "\n".join(lines)
