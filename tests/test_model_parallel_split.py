"""Stages, the measured pipeline, tensor splits and DTensor against the unsplit model."""
import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradtut import model_parallel as mp
from gradtut.checks import assert_gradients_close

DEVICES = {2: ["CPU:0", "CPU:1"], 4: ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]}
MEAN_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
PER_EXAMPLE_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def dense_layers(seed=0):
    keras.utils.set_random_seed(seed)
    return [keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(20, activation="relu"),
            keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(9, activation="relu"),
            keras.layers.Dense(3)], (10,)


def conv_layers(seed=0):
    keras.utils.set_random_seed(seed)
    return [keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(3, 3, strides=2, activation="tanh"),
            keras.layers.Flatten(), keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3)], (8, 8, 1)


MODELS = {"dense": dense_layers, "conv": conv_layers}


def data(input_shape, batch, seed=1):
    rng = np.random.RandomState(seed)
    return (rng.randn(batch, *input_shape).astype("float32"),
            rng.randint(0, 3, batch).astype("int32"))


def plain_loss_and_gradients(layers, variables, x, y, loss_fn=MEAN_LOSS):
    """The reference: the same layers applied in order on the default device, one tape."""
    with tf.GradientTape() as tape:
        h = tf.constant(x)
        for layer in layers:
            h = layer(h)
        loss = tf.reduce_mean(loss_fn(y, h))
    return float(loss), tape.gradient(loss, variables)


@pytest.mark.parametrize("num_devices", [2, 4])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_placed_stages_match_the_unsplit_layers(model, num_devices):
    layers, shape = MODELS[model]()
    staged = mp.place_stages(layers, DEVICES[num_devices], input_shape=shape)
    assert [layer for stage in staged.stages for layer in stage] == layers
    x, y = data(shape, 7)
    with tf.GradientTape() as tape:
        loss = MEAN_LOSS(y, staged(x))
    expected_loss, expected = plain_loss_and_gradients(layers, staged.trainable_variables, x, y)
    assert float(loss) == pytest.approx(expected_loss, rel=1e-6)
    assert_gradients_close(tape.gradient(loss, staged.trainable_variables), expected)


def test_unbuilt_layers_are_built_on_their_stage_device():
    layers, shape = dense_layers()
    staged = mp.place_stages(layers, DEVICES[4], input_shape=shape)
    for device, stage in zip(staged.devices, staged.stages, strict=True):
        for layer in stage:
            for variable in layer.weights:
                assert variable.value.device.endswith(device.split("/")[-1])


def test_balancing_finds_the_smallest_largest_stage():
    rng = np.random.RandomState(0)
    for n, stages in [(5, 2), (6, 3), (7, 4), (4, 4)]:
        costs = list(rng.randint(0, 100, n))
        cuts = mp.balanced_boundaries(costs, stages)
        def largest(c, n=n, costs=costs):
            edges = [0] + list(c) + [n]
            return max(sum(costs[a:b]) for a, b in itertools.pairwise(edges))
        brute = min(largest(c) for c in itertools.combinations(range(1, n), stages - 1))
        assert len(cuts) == stages - 1 and largest(cuts) == brute


def test_built_layers_and_explicit_boundaries():
    model = keras.Sequential([keras.Input((10,))] + dense_layers()[0])
    staged = mp.place_stages(model, DEVICES[2], boundaries=[1])
    assert [len(stage) for stage in staged.stages] == [1, 4]
    assert staged.parameter_counts() == [model.layers[0].count_params(),
                                         sum(layer.count_params() for layer in model.layers[1:])]
    assert staged.summary().splitlines()[0].startswith("stage 0 on /device:CPU:0: ")


@pytest.mark.parametrize("kwargs, message", [
    ({"devices": ["CPU:0", "CPU:1", "CPU:2"], "layers": 2}, "3 devices but only 2 layers"),
    ({"devices": ["CPU:0", "CPU:9"]}, "device 'CPU:9' does not exist"),
    ({"devices": ["GPU:0"]}, "device 'GPU:0' does not exist"),
    ({"devices": []}, "devices must be a non-empty list"),
    ({"devices": ["CPU:0", "CPU:1"], "boundaries": [0]}, "increasing layer indices"),
    ({"devices": ["CPU:0", "CPU:1"], "boundaries": [1, 2]}, "increasing layer indices"),
    ({"devices": ["CPU:0", "CPU:1"], "layers": 0}, "layers is empty"),
    ({"devices": ["CPU:0", "CPU:1"], "unbuilt": True}, "Pass input_shape"),
])
def test_bad_placements_get_clear_errors(kwargs, message):
    layers, shape = dense_layers()
    layers = layers[:kwargs.get("layers", len(layers))]
    input_shape = None if kwargs.get("unbuilt") or "boundaries" in kwargs else shape
    with pytest.raises(ValueError, match=message):
        mp.place_stages(layers, kwargs["devices"], boundaries=kwargs.get("boundaries"),
                        input_shape=input_shape)


@pytest.mark.parametrize("num_devices", [2, 4])
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("batch, microbatches", [(8, 1), (8, 4), (10, 4), (5, 5)])
def test_pipeline_gradients_equal_the_full_batch(model, num_devices, batch, microbatches):
    layers, shape = MODELS[model]()
    staged = mp.place_stages(layers, DEVICES[num_devices], input_shape=shape)
    x, y = data(shape, batch)
    loss, grads, timeline = mp.pipeline_gradients(staged, x, y, PER_EXAMPLE_LOSS, microbatches)
    # the reference after the method under test, so a reused buffer cannot pass for it
    expected_loss, expected = plain_loss_and_gradients(layers, staged.trainable_variables, x, y)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    assert_gradients_close(grads, expected)
    assert len(timeline) == 2 * num_devices * microbatches


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size"])
def test_pipeline_gradients_refuse_a_reduced_loss(reduction):
    # A summed loss would make the gradient grow with the micro-batch count; a mean loss
    # hides each micro-batch's size. Per-example losses only.
    layers, shape = dense_layers()
    staged = mp.place_stages(layers, DEVICES[2], input_shape=shape)
    x, y = data(shape, 8)
    reduced = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    for microbatches in (1, 4):
        with pytest.raises(ValueError, match=r"per-example losses of shape \[micro-batch\]"):
            mp.pipeline_gradients(staged, x, y, reduced, microbatches)


def test_the_measured_timeline_follows_the_gpipe_schedule():
    layers, shape = dense_layers()
    staged = mp.place_stages(layers, DEVICES[4], input_shape=shape)
    x, y = data(shape, 12)
    stages, m = 4, 6
    _, _, timeline = mp.pipeline_gradients(staged, x, y, PER_EXAMPLE_LOSS, m)
    span = {(e["stage"], e["microbatch"], e["phase"]): (e["start"], e["end"]) for e in timeline}
    assert set(span) == {(s, j, p) for s in range(stages) for j in range(m)
                         for p in ("forward", "backward")}
    assert min(start for start, _ in span.values()) == 0.0
    for s in range(stages):
        order = [(s, j, "forward") for j in range(m)] + [(s, j, "backward")
                                                          for j in reversed(range(m))]
        for a, b in itertools.pairwise(order):  # one thing at a time, in GPipe order
            assert span[a][0] <= span[a][1] <= span[b][0]
        for j in range(m):
            if s:
                assert span[s, j, "forward"][0] >= span[s - 1, j, "forward"][1]
            if s < stages - 1:
                assert span[s, j, "backward"][0] >= span[s + 1, j, "backward"][1]
    assert mp.activations_in_flight(timeline) == [m] * stages
    assert 0.0 < mp.bubble_fraction(timeline) < 1.0


def test_pipeline_steps_are_reused_and_bad_calls_are_refused():
    layers, shape = dense_layers()
    staged = mp.place_stages(layers, DEVICES[2], input_shape=shape)
    x, y = data(shape, 6)
    mp.pipeline_gradients(staged, x, y, PER_EXAMPLE_LOSS, 3)
    mp.pipeline_gradients(staged, x, y, PER_EXAMPLE_LOSS, 3)
    assert staged.compiled_pipelines == 1
    for bad in (0, 7, 2.0, True):
        with pytest.raises(ValueError, match="num_microbatches must be an int from 1 to"):
            mp.pipeline_gradients(staged, x, y, PER_EXAMPLE_LOSS, bad)
    with pytest.raises(ValueError, match="x has 6 examples but y has 5"):
        mp.pipeline_gradients(staged, x, y[:5], PER_EXAMPLE_LOSS, 2)
    with pytest.raises(ValueError, match="the batch is empty"):
        mp.pipeline_gradients(staged, x[:0], y[:0], PER_EXAMPLE_LOSS, 1)
    with pytest.raises(TypeError, match="place_stages"):
        mp.pipeline_gradients(layers, x, y, PER_EXAMPLE_LOSS, 2)


def test_timeline_helpers_agree_with_the_simulator():
    result = mp.simulate_pipeline([(1.0, 2.0), (3.0, 1.5), (2.0, 2.0)], 5)
    assert mp.bubble_fraction(result["timeline"]) == pytest.approx(result["bubble_fraction"])
    assert mp.stage_times(result["timeline"]) == [(1.0, 2.0), (3.0, 1.5), (2.0, 2.0)]
    assert mp.activations_in_flight(result["timeline"]) == [5, 5, 5]
    with pytest.raises(ValueError, match="timeline is empty"):
        mp.bubble_fraction([])


def tensor_parallel_pair(num_devices, hidden=8, seed=0):
    keras.utils.set_random_seed(seed)
    dense = [keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(3)]
    split = [mp.ColumnParallelDense(hidden, DEVICES[num_devices], activation="relu"),
             mp.RowParallelDense(3, DEVICES[num_devices])]
    x = tf.zeros((1, 10))
    dense[1](dense[0](x))
    split[1](split[0](x))
    for d, s in zip(dense, split, strict=True):
        s.load_dense_weights(*d.get_weights())
    return dense, split


def test_row_parallel_checks_the_shard_count_at_every_call():
    # Built for 2 devices; a later call with 3 shards would be cut short by zip without a check.
    _, split = tensor_parallel_pair(2)
    x = tf.random.normal((4, 10))
    shards = split[0](x)
    with pytest.raises(ValueError, match="got 3 input shards for 2 devices"):
        split[1](shards + [shards[0]])
    with pytest.raises(ValueError, match="input shard 0 has 2 features but this layer was built "
                                         "for 4 per shard"):
        split[1]([s[:, :2] for s in shards])
    with pytest.raises(ValueError, match="does not split into 2 equal shards"):
        split[1](tf.zeros((4, 7)))


@pytest.mark.parametrize("num_devices", [2, 4])
def test_column_and_row_split_mlp_matches_the_unsplit_one(num_devices):
    dense, split = tensor_parallel_pair(num_devices)
    x, y = data((10,), 9)
    with tf.GradientTape(persistent=True) as tape:
        expected_out = dense[1](dense[0](x))
        shards = split[0](x)
        out = split[1](shards)
        expected_loss, loss = MEAN_LOSS(y, expected_out), MEAN_LOSS(y, out)
    assert len(shards) == num_devices and shards[0].shape == (9, 8 // num_devices)
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-6)
    merged = []
    for layer in split:
        merged += layer.merge_shards(tape.gradient(loss, layer.trainable_variables))
    expected = tape.gradient(expected_loss, dense[0].trainable_variables +
                             dense[1].trainable_variables)
    assert_gradients_close(merged, expected)
    # merging the weights gives the Dense back
    for layer, reference in zip(split, dense, strict=True):
        assert_gradients_close(layer.merge_shards(layer.trainable_variables),
                               reference.get_weights())
    for i, device in enumerate(DEVICES[num_devices]):
        assert split[0].kernels[i].value.device.endswith(device)
        assert split[1].kernels[i].value.device.endswith(device)


def test_gathered_column_output_and_a_full_row_input():
    dense, split = tensor_parallel_pair(2)
    gathered = mp.ColumnParallelDense(8, DEVICES[2], activation="relu", gather_output=True)
    gathered(tf.zeros((1, 10)))
    gathered.load_dense_weights(*dense[0].get_weights())
    x, _ = data((10,), 4)
    hidden = gathered(x)
    np.testing.assert_allclose(hidden, dense[0](x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(split[1](hidden), dense[1](hidden), rtol=1e-5, atol=1e-6)


def test_split_layers_can_be_built_inside_a_tf_function():
    column = mp.ColumnParallelDense(8, DEVICES[2], activation="relu")
    row = mp.RowParallelDense(3, DEVICES[2])
    x = tf.ones((2, 5))
    out = tf.function(lambda: row(column(x)))()
    kernel, bias = row.merge_shards(row.trainable_variables)
    hidden = tf.concat(column(x), axis=-1)
    np.testing.assert_allclose(out, hidden @ kernel + bias, rtol=1e-5, atol=1e-6)


def test_kernel_dimensions_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="units is 10, which does not split into 4 equal"):
        mp.ColumnParallelDense(10, DEVICES[4])
    with pytest.raises(ValueError, match="input features is 6, which does not split into 4"):
        mp.RowParallelDense(3, DEVICES[4])(tf.zeros((2, 6)))
    with pytest.raises(ValueError, match="got 2 input shards for 4 devices"):
        mp.RowParallelDense(3, DEVICES[4])([tf.zeros((2, 4)), tf.zeros((2, 4))])
    with pytest.raises(ValueError, match="device 'CPU:7' does not exist"):
        mp.ColumnParallelDense(4, ["CPU:0", "CPU:7"])


@pytest.mark.parametrize("activation", ["softmax", "log_softmax", "glu", "sparsemax"])
def test_an_activation_that_mixes_a_row_is_refused_on_a_column_split(activation):
    with pytest.raises(ValueError, match=f"activation '{activation}' mixes the features of a row"):
        mp.ColumnParallelDense(8, DEVICES[2], activation=activation)


def test_why_a_row_mixing_activation_is_refused():
    # softmax per shard normalises each half on its own: each half sums to one, the whole to two
    dense = keras.layers.Dense(8)
    x, _ = data((10,), 4)
    logits = dense(x)
    halves = [keras.activations.softmax(h) for h in tf.split(logits, 2, axis=-1)]
    per_shard = tf.concat(halves, axis=-1)
    np.testing.assert_allclose(tf.reduce_sum(per_shard, axis=-1), 2.0, rtol=1e-5)
    assert not np.allclose(per_shard, keras.activations.softmax(logits), atol=1e-3)


def mlp_params(seed=0, features=10, hidden=8, classes=3):
    rng = np.random.RandomState(seed)
    return {"W1": (0.3 * rng.randn(features, hidden)).astype("float32"),
            "b1": (0.1 * rng.randn(hidden)).astype("float32"),
            "W2": (0.3 * rng.randn(hidden, classes)).astype("float32"),
            "b2": (0.1 * rng.randn(classes)).astype("float32")}


@pytest.mark.parametrize("batch_dim, model_dim", [(2, 2), (1, 4), (4, 1)])
def test_dtensor_step_equals_the_unsharded_step(batch_dim, model_dim):
    mesh = mp.make_mesh(batch_dim, model_dim)
    params = mlp_params()
    x, y = data((10,), 12, seed=2)
    reference = {k: tf.Variable(v) for k, v in params.items()}
    sharded = mp.shard_mlp_params(params, mesh)
    step = tf.function(mp.sgd_step)
    for _ in range(2):
        loss = step(sharded, mp.shard_batch(x, mesh), mp.shard_batch(y, mesh), 0.5)
        expected_loss = float(mp.sgd_step(reference, x, y, 0.5))  # the reference after it
        assert float(mp.gather(loss)) == pytest.approx(expected_loss, rel=1e-6)
    assert_gradients_close([mp.gather(sharded[k]) for k in sorted(params)],
                           [reference[k] for k in sorted(params)])


def test_describe_shards_names_each_devices_slice():
    sharded = mp.shard_mlp_params(mlp_params(), mp.make_mesh(2, 2))
    text = mp.describe_shards({"W1": sharded["W1"], "b2": sharded["b2"]}).splitlines()
    assert text[0] == "W1 [10, 8] sharded as ['unsharded', 'model']"
    assert text[1:5] == ["  CPU:0 (batch=0, model=0)  [0:10, 0:4]",
                         "  CPU:1 (batch=0, model=1)  [0:10, 4:8]",
                         "  CPU:2 (batch=1, model=0)  [0:10, 0:4]",
                         "  CPU:3 (batch=1, model=1)  [0:10, 4:8]"]
    assert text[5] == "b2 [3] sharded as ['unsharded']"
    assert text[6:] == [f"  CPU:{i} (batch={i // 2}, model={i % 2})  [0:3]" for i in range(4)]


def test_dtensor_errors_name_the_problem():
    mesh = mp.make_mesh(2, 2)
    with pytest.raises(ValueError, match="the batch size is 5, which does not split into 2"):
        mp.shard_batch(np.zeros((5, 10), "float32"), mesh)
    with pytest.raises(ValueError, match="W1's size along 'model' is 7"):
        mp.shard_mlp_params(mlp_params(hidden=7), mesh)
    with pytest.raises(ValueError, match=r"the sharding has no entry for parameter 'W3'.*pass "
                                         r"sharding="):
        mp.shard_mlp_params({**mlp_params(), "W3": np.zeros((4, 4), "float32")}, mesh)
    with pytest.raises(ValueError, match=r"the sharding of 'W1' has 1 entries but the parameter "
                                         r"has rank 2"):
        mp.shard_mlp_params(mlp_params(), mesh, sharding={**mp.MLP_SHARDING, "W1": ["model"]})
    with pytest.raises(ValueError, match="needs 8 devices but this process has 4"):
        mp.make_mesh(2, 4)
    with pytest.raises(ValueError, match="batch must be a positive int"):
        mp.make_mesh(0, 2)


def with_dropout(model):
    """``model``'s layers with a Dropout after the first."""
    first, *rest = model.layers
    return keras.Sequential([keras.Input((64,)), first, keras.layers.Dropout(0.1), *rest])


def memory_model():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])


def test_memory_report_arithmetic():
    model = memory_model()
    weights = 4 * model.count_params()
    activations_per_example = 4 * (64 + 128 + 256 + 10)
    single = mp.model_memory_report(model, keras.optimizers.Adam(), 32, 1, "data")
    assert single["parameters"] == single["gradients"] == weights
    assert single["optimizer_state"] == 2 * weights
    assert single["activations"] == 32 * activations_per_example
    assert single["total"] == 4 * weights + 32 * activations_per_example
    data = mp.model_memory_report(model, keras.optimizers.Adam(), 32, 4, "data")
    assert data["parameters"] == weights and data["activations"] == 8 * activations_per_example
    tensor = mp.model_memory_report(model, keras.optimizers.SGD(momentum=0.9), 32, 2, "tensor")
    assert tensor["parameters"] == weights // 2 and tensor["optimizer_state"] == weights // 2
    # Megatron pairs: the input and the row layer's output (256) are whole on every device
    assert tensor["activations"] == 32 * 4 * (64 + 128 // 2 + 256 + 10 // 2)
    assert tensor["total"] == 2 * (weights // 2) + weights // 2 + tensor["activations"]
    # over 4 devices the 10 logits do not divide: the busiest device holds 3 of them; over 3,
    # every weight's elements round up on the busiest device (64 * 128 = 8192 -> 2731, ...)
    four = mp.model_memory_report(model, keras.optimizers.SGD(), 32, 4, "tensor")
    assert four["activations"] == 32 * 4 * (64 + 128 // 4 + 256 + 3)
    three = mp.model_memory_report(model, keras.optimizers.SGD(), 32, 3, "tensor")
    sizes = [64 * 128, 128, 128 * 256, 256, 256 * 10, 10]
    assert three["parameters"] == 4 * sum(-(-n // 3) for n in sizes) > weights // 3
    assert three["activations"] == 32 * 4 * (64 + 43 + 256 + 4)
    # a column split divides only the last axis: [B, 3, 10] over 4 holds 3 x 3 per example
    tokens = keras.Sequential([keras.Input((3, 8)), keras.layers.Dense(10),
                               keras.layers.Dense(8)])
    split = mp.model_memory_report(tokens, keras.optimizers.SGD(), 2, 4, "tensor")
    assert split["activations"] == 2 * 4 * (3 * 8 + 3 * 3 + 3 * 8)
    # the same model built functionally (which lists an InputLayer), and with a Dropout after
    # the column layer (whose output it keeps split): the same arithmetic
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(128, activation="relu")(inputs)
    functional = keras.Model(inputs, keras.layers.Dense(10)(
        keras.layers.Dense(256, activation="relu")(hidden)))
    functional.set_weights(model.get_weights())
    for other, extra in ((functional, 0), (with_dropout(model), 128 // 2)):
        report = mp.model_memory_report(other, keras.optimizers.SGD(momentum=0.9), 32, 2,
                                        "tensor")
        assert report["activations"] == tensor["activations"] + 32 * 4 * extra
    stage = mp.model_memory_report(model, keras.optimizers.SGD(), 32, 2, "stage")
    assert stage["optimizer_state"] == 0
    # stages [Dense 128] and [Dense 256, Dense 10]: the second also keeps the 128 it received
    assert sum(stage["per_device_total"]) == 2 * weights + 32 * (activations_per_example + 4 * 128)
    assert stage["total"] == max(stage["per_device_total"])


def test_memory_report_weights_match_the_allocator():
    def in_use():
        return tf.config.experimental.get_memory_info("CPU:0")["current"]
    before = in_use()
    model = keras.Sequential([keras.Input((300,)), keras.layers.Dense(512),
                              keras.layers.Dense(512), keras.layers.Dense(10)])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    measured = in_use() - before
    report = mp.model_memory_report(model, optimizer, 64, 1, "data")
    estimate = report["parameters"] + report["optimizer_state"]
    # The BFC allocator rounds each buffer up, so it holds somewhat more than the bytes asked.
    assert estimate <= measured <= 1.5 * estimate
    del model, optimizer


@pytest.mark.parametrize("args, message", [
    ((32, 2, "pipeline"), "unknown strategy 'pipeline'"),
    ((30, 4, "data"), "the batch size is 30, which does not split into 4"),
    ((32, 4, "stage"), "4 stages but the model has only 3 layers"),
    ((0, 1, "data"), "batch_size must be a positive int"),
    ((32, 0, "tensor"), "num_devices must be a positive int"),
])
def test_memory_report_errors(args, message):
    with pytest.raises(ValueError, match=message):
        mp.model_memory_report(memory_model(), keras.optimizers.Adam(), *args)


def test_memory_report_needs_known_shapes():
    model = keras.Sequential([keras.layers.Dense(4)])
    with pytest.raises(ValueError, match="build it on a keras.Input"):
        mp.model_memory_report(model, keras.optimizers.Adam(), 8, 1, "data")


def test_dtensor_and_memory_helpers_refuse_what_they_cannot_use():
    with pytest.raises(ValueError, match=r"missing \['b2'\]"):
        mp.mlp_loss({k: v for k, v in mlp_params().items() if k != "b2"}, None, None)
    x, y = data((10,), 4)
    with pytest.raises(ValueError, match="are not variables"):
        mp.sgd_step(mlp_params(), x, y, 0.1)
    with pytest.raises(ValueError, match="expected a DTensor"):
        mp.gather(tf.ones(3))
    with pytest.raises(ValueError, match="expected a DTensor"):
        mp.describe_shards({"x": tf.ones(3)})
    with pytest.raises(ValueError, match="values must be a dict"):
        mp.describe_shards([tf.ones(3)])
    with pytest.raises(TypeError, match="optimizer must be a Keras optimizer"):
        mp.optimizer_slots("adam")
    with pytest.raises(ValueError, match="one non-empty list of layers per device"):
        mp.StagedModel([dense_layers()], ["/device:CPU:0", "/device:CPU:1"])
