"""Tensor parallelism: the Megatron-LM split of a Dense kernel over devices (notebook 04)."""
import keras
import numpy as np
import tensorflow as tf

from gradtut.model_parallel.placement import _check_devices


def _check_divisible(size, shards, what):
    if size % shards:
        raise ValueError(
            f"{what} is {size}, which does not split into {shards} equal shards: choose a size "
            f"divisible by {shards}, or use a device count that divides {size}")


_ROW_MIXING_ACTIVATIONS = ("softmax", "log_softmax", "glu", "sparsemax")


class ColumnParallelDense(keras.layers.Layer):
    """A Dense layer whose kernel is split by output columns over ``devices``.

    Device i holds ``kernel[:, i*u:(i+1)*u]`` and the matching bias slice, where
    ``u = units / len(devices)``, and computes its slice of the output from the whole input.
    The forward pass needs no communication once every device has the input (in Megatron-LM
    the all-reduce before it leaves it there; here each device reads it from where it lives,
    after a :class:`RowParallelDense` the first device); in the backward pass the input gradient is
    the sum of every device's contribution (the all-reduce Megatron-LM calls *f*; here
    TensorFlow's autodiff adds them).

    Args:
      units: output features; must be divisible by the number of devices.
      devices: one device name per shard.
      activation: applied to each shard, so it must act element by element (relu, gelu,
        tanh...); one that mixes the features of a row (softmax, log_softmax, glu, sparsemax)
        would differ from the unsplit layer's and is refused.
      gather_output: concatenate the shards into one ``[batch, units]`` tensor. Leave it False
        when a :class:`RowParallelDense` follows: it takes the list of shards as it is.
      kernel_initializer, bias_initializer: initialise the full kernel, which is then split,
        so the layer starts like an unsplit ``Dense``.

    Call: ``x`` of shape ``[batch, in]`` -> a list of ``len(devices)`` tensors
    ``[batch, units / len(devices)]`` (or one ``[batch, units]`` tensor with ``gather_output``).

    Raises:
      ValueError: ``units`` not divisible by the device count, a device that does not exist,
        or an activation that mixes the features of a row.

    Example:
      >>> layer = ColumnParallelDense(8, ["CPU:0", "CPU:1"], gather_output=True)
      >>> layer(tf.zeros((4, 3))).shape
      TensorShape([4, 8])
    """

    def __init__(self, units, devices, activation=None, gather_output=False,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        self.devices = _check_devices(devices)
        _check_divisible(units, len(self.devices), "units")
        self.units = units
        self.activation = keras.activations.get(activation)
        mixing = getattr(self.activation, "__name__", "")
        if mixing in _ROW_MIXING_ACTIVATIONS:
            raise ValueError(
                f"activation {mixing!r} mixes the features of a row, so applied to each of the "
                f"{len(self.devices)} shards it would differ from the unsplit layer's. Use "
                "activation=None here, gather_output=True, and apply it to the gathered output.")
        self.gather_output = gather_output
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def build(self, input_shape):
        with tf.init_scope():  # eager even when first called inside a tf.function
            kernel = np.asarray(self.kernel_initializer((input_shape[-1], self.units)))
            bias = np.asarray(self.bias_initializer((self.units,)))
        self.kernels, self.biases = [], []
        for i, (k, b) in enumerate(zip(np.split(kernel, len(self.devices), axis=1),
                                       np.split(bias, len(self.devices)), strict=True)):
            with tf.device(self.devices[i]):  # each shard's weights live on its device
                self.kernels.append(self.add_weight(shape=k.shape, name=f"kernel_{i}",
                                                    initializer=keras.initializers.Constant(k)))
                self.biases.append(self.add_weight(shape=b.shape, name=f"bias_{i}",
                                                   initializer=keras.initializers.Constant(b)))

    def call(self, x):
        shards = []
        for device, kernel, bias in zip(self.devices, self.kernels, self.biases, strict=True):
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
        for var, k in zip(self.kernels, np.split(np.asarray(kernel), n, axis=1), strict=True):
            var.assign(k)
        for var, b in zip(self.biases, np.split(np.asarray(bias), n), strict=True):
            var.assign(b)


class RowParallelDense(keras.layers.Layer):
    """A Dense layer whose kernel is split by input rows over ``devices``.

    Device i holds ``kernel[i*r:(i+1)*r, :]`` and multiplies it with its slice of the input
    features, which is exactly what a :class:`ColumnParallelDense` before it left on that
    device. The partial products are then summed on the first device, where the bias is added
    once and the result stays. (Megatron-LM's *g* is an all-reduce instead, NCCL on GPUs, which
    leaves the sum on every device; this layer does not do that.)

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
        n = len(self.devices)
        if isinstance(x, (list, tuple)):
            # Checked at every call, not only when built: zip would silently drop extra shards.
            if len(x) != n:
                raise ValueError(f"got {len(x)} input shards for {n} devices: pass one shard "
                                 "per device (a ColumnParallelDense's output) or one tensor")
            shards = x
        else:
            _check_divisible(x.shape[-1], n, "the number of input features")
            shards = tf.split(x, n, axis=-1)
        for i, (shard, kernel) in enumerate(zip(shards, self.kernels, strict=True)):
            if shard.shape[-1] != kernel.shape[0]:
                raise ValueError(f"input shard {i} has {shard.shape[-1]} features but this "
                                 f"layer was built for {kernel.shape[0]} per shard: call it on "
                                 "inputs shaped like those it was built on")
        partials = []
        for device, kernel, shard in zip(self.devices, self.kernels, shards, strict=True):
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
        for var, k in zip(self.kernels, np.split(np.asarray(kernel), len(self.devices), axis=0),
                          strict=True):
            var.assign(k)
        self.bias.assign(bias)
