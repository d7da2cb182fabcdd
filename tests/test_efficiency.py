"""Efficiency tricks against their slow references: one big batch, plain layers, the Hessian."""
import subprocess

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradtut import efficiency as eff
from gradtut.checks import assert_gradients_close
from model_zoo import CLASSES, LOSS, cnn, mlp

MEAN_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def regularized():
    return keras.Sequential([
        keras.Input((12,)),
        keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(0.01)),
        keras.layers.Dense(CLASSES)], name="regularized")


MODELS = {"mlp": (mlp, (12,)), "cnn": (cnn, (8, 8, 1)), "regularized": (regularized, (12,))}


def data(shape, batch, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(batch, *shape)).astype("float32"),
            rng.integers(0, CLASSES, size=batch).astype("int32"))


def full_batch_gradients(model, loss_fn, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(loss_fn(y, model(x, training=False)))
        if model.losses:
            loss += tf.add_n(model.losses)
    return tape.gradient(loss, model.trainable_variables)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("micro_batch_size", [1, 4, 7, 10])
def test_accumulated_gradients_equal_one_big_batch(name, micro_batch_size):
    build, shape = MODELS[name]
    keras.utils.set_random_seed(0)
    model = build()
    x, y = data(shape, 10)  # 7 leaves a ragged micro-batch of 3
    expected = full_batch_gradients(model, LOSS, x, y)
    got = eff.accumulated_gradients(model, LOSS, x, y, micro_batch_size)
    assert_gradients_close(got, expected)


def test_averaging_micro_batch_means_would_be_wrong_on_a_ragged_batch():
    # The reference is really sensitive to the weighting, so the test above can fail.
    keras.utils.set_random_seed(0)
    model = mlp()
    x, y = data((12,), 10)
    expected = full_batch_gradients(model, LOSS, x, y)
    means = [full_batch_gradients(model, LOSS, x[a:a + 7], y[a:a + 7]) for a in (0, 7)]
    naive = [(a + b) / 2 for a, b in zip(*means, strict=True)]
    with pytest.raises(AssertionError):
        assert_gradients_close(naive, expected)


@pytest.mark.parametrize("bad", [0, -1, 11, 2.5, True])
def test_bad_micro_batch_sizes_are_refused(bad):
    x, y = data((12,), 10)
    with pytest.raises(ValueError, match=r"micro_batch_size must be an int from 1 to the batch "
                                         r"size \(10\)"):
        eff.accumulated_gradients(mlp(), LOSS, x, y, bad)


def test_accumulation_refuses_empty_and_mismatched_batches():
    x, y = data((12,), 10)
    with pytest.raises(ValueError, match="the batch is empty"):
        eff.accumulated_gradients(mlp(), LOSS, x[:0], y[:0], 1)
    with pytest.raises(ValueError, match="x has 10 examples but y has 9"):
        eff.accumulated_gradients(mlp(), LOSS, x, y[:9], 2)


@pytest.mark.parametrize("name", ["mlp", "regularized"])
def test_accumulating_train_step_equals_big_batch_steps_and_resets(name):
    build, shape = MODELS[name]
    keras.utils.set_random_seed(1)
    model = build()
    reference = build()
    reference.set_weights(model.get_weights())
    step = eff.make_accumulating_train_step(model, LOSS, keras.optimizers.SGD(0.5), 3)
    reference_optimizer = keras.optimizers.SGD(0.5)
    x, y = data(shape, 26, seed=2)
    # Two updates of 3 micro-batches; the second group is ragged (4 + 4 + 2 examples).
    groups = [[(0, 8), (8, 16), (16, 24)], [(16, 20), (20, 24), (24, 26)]]
    for group in groups:
        applied = [bool(step(x[a:b], y[a:b])[1]) for a, b in group]
        assert applied == [False, False, True]
        assert float(step.examples_seen) == 0.0
        assert all(float(tf.reduce_max(tf.abs(s))) == 0.0 for s in step.accumulators)
        idx = np.concatenate([np.arange(a, b) for a, b in group])
        grads = full_batch_gradients(reference, LOSS, x[idx], y[idx])
        reference_optimizer.apply(grads, reference.trainable_variables)
        assert_gradients_close(model.get_weights(), reference.get_weights())


def test_accumulating_train_step_refuses_bad_step_counts():
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="accumulation_steps must be a positive int"):
            eff.make_accumulating_train_step(mlp(), LOSS, keras.optimizers.SGD(), bad)

SUM_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
REDUCES = r"per-example losses of shape \[B\].*it returned shape \(\).*reduction=None"


@pytest.mark.parametrize("reducing", [SUM_LOSS, MEAN_LOSS], ids=["sum", "mean"])
def test_a_loss_that_reduces_over_the_batch_is_refused(reducing):
    """With reduction="sum" the accumulated gradient grew with the number of micro-batches
    (|g| = 0.47, 0.94, 1.87 for micro-batches of 1, 2, 4 of the same data); a mean loss was
    scaled back by guessing. Both are refused, naming the fix."""
    x, y = data((12,), 8)
    with pytest.raises(ValueError, match=REDUCES):
        eff.accumulated_gradients(mlp(), reducing, x, y, 2)
    step = eff.make_accumulating_train_step(mlp(), reducing, keras.optimizers.SGD(0.1), 2)
    with pytest.raises(ValueError, match=REDUCES):
        step(x[:4], y[:4])


def test_per_example_losses_give_one_gradient_whatever_the_micro_batch_size():
    """Fresh random inputs every run (the seed is in the failure message); the reference tape
    runs after the method under test, so a method that changed the model would be caught."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    x, y = data((12,), 8, seed=seed)
    keras.utils.set_random_seed(seed)
    model = regularized()
    got = {size: eff.accumulated_gradients(model, LOSS, x, y, size) for size in (1, 2, 4, 8)}
    expected = full_batch_gradients(model, LOSS, x, y)
    for size, grads in got.items():
        try:
            assert_gradients_close(grads, expected)
        except AssertionError as err:
            raise AssertionError(f"micro_batch_size {size}, seed {seed}: {err}") from None


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4, 8])
def test_accumulating_step_is_one_big_batch_step_whatever_the_micro_batch_size(
        micro_batch_size):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    x, y = data((12,), 8, seed=seed)
    keras.utils.set_random_seed(seed)
    model = regularized()
    reference = regularized()
    reference.set_weights(model.get_weights())
    step = eff.make_accumulating_train_step(model, LOSS, keras.optimizers.SGD(0.5),
                                            8 // micro_batch_size)
    applied = [step(x[a:a + micro_batch_size], y[a:a + micro_batch_size])[1]
               for a in range(0, 8, micro_batch_size)]
    assert applied == [False] * (len(applied) - 1) + [True]
    grads = full_batch_gradients(reference, LOSS, x, y)
    keras.optimizers.SGD(0.5).apply(grads, reference.trainable_variables)
    try:
        assert_gradients_close(model.get_weights(), reference.get_weights())
    except AssertionError as err:
        raise AssertionError(f"seed {seed}: {err}") from None


def test_counts_accept_numpy_ints_with_the_same_result_and_refuse_bools():
    """One meaning for an integer argument (gradtut.checks.check_int): np.int64(4) is 4."""
    keras.utils.set_random_seed(0)
    model = mlp()
    x, y = data((12,), 10)
    assert_gradients_close(eff.accumulated_gradients(model, LOSS, x, y, np.int64(4)),
                           eff.accumulated_gradients(model, LOSS, x, y, 4), rtol=0, atol=0)
    final = []
    for steps in (2, np.int64(2)):
        keras.utils.set_random_seed(0)
        model = mlp()
        step = eff.make_accumulating_train_step(model, LOSS, keras.optimizers.SGD(0.5), steps)
        assert [step(x[a:a + 5], y[a:a + 5])[1] for a in (0, 5)] == [False, True]
        final.append(model.get_weights())
    assert_gradients_close(final[1], final[0], rtol=0, atol=0)
    layers = deep_mlp(depth=2).layers
    assert len(eff.checkpointed(layers, np.int64(2)).segments) == 2
    with pytest.raises(ValueError, match=r"accumulation_steps must be a positive int, got True "
                                         r"\(a bool\)"):
        eff.make_accumulating_train_step(mlp(), LOSS, keras.optimizers.SGD(), True)
    with pytest.raises(ValueError, match=r"micro_batch_size must be an int from 1 to the batch "
                                         r"size \(10\), got True"):
        eff.accumulated_gradients(model, LOSS, x, y, True)
    with pytest.raises(ValueError, match=r"num_segments must be an int from 1 to the number of "
                                         r"layers \(3\), got True"):
        eff.checkpointed(layers, True)


def test_accumulation_refuses_what_is_not_a_model_a_loss_or_labels():
    x, y = data((12,), 10)
    with pytest.raises(ValueError, match="y is None"):
        eff.accumulated_gradients(mlp(), LOSS, x, None, 2)
    with pytest.raises(ValueError, match="x is None"):
        eff.accumulated_gradients(mlp(), LOSS, None, y, 2)
    with pytest.raises(ValueError, match="loss_fn is the string 'sparse_categorical_crossentropy'"):
        eff.accumulated_gradients(mlp(), "sparse_categorical_crossentropy", x, y, 2)
    with pytest.raises(TypeError, match="model must be a Keras model"):
        eff.accumulated_gradients(mlp().layers, LOSS, x, y, 2)
    with pytest.raises(ValueError, match="loss_fn is the string 'mse'"):
        eff.make_accumulating_train_step(mlp(), "mse", keras.optimizers.SGD(), 2)
    with pytest.raises(TypeError, match="model must be a Keras model"):
        eff.make_accumulating_train_step(None, LOSS, keras.optimizers.SGD(), 2)
    with pytest.raises(TypeError, match="optimizer must be a Keras optimizer object"):
        eff.make_accumulating_train_step(mlp(), LOSS, "sgd", 2)
    step = eff.make_accumulating_train_step(mlp(), LOSS, keras.optimizers.SGD(), 2)
    with pytest.raises(ValueError, match="y is None"):
        step(x, None)
    with pytest.raises(ValueError, match="x has 10 examples but y has 9"):
        step(x, y[:9])



def deep_mlp(depth=6, width=16, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((12,))]
                            + [keras.layers.Dense(width, activation="tanh") for _ in range(depth)]
                            + [keras.layers.Dense(CLASSES)])


@pytest.mark.parametrize("num_segments", [1, 2, 3, 7])
@pytest.mark.parametrize("compiled", [False, True])
def test_checkpointed_gradients_equal_plain(num_segments, compiled):
    model = deep_mlp()
    x, y = data((12,), 9)
    f = eff.checkpointed(model.layers, num_segments)
    assert sum(len(s) for s in f.segments) == 7 and len(f.segments) == num_segments

    def grads_of(forward):
        with tf.GradientTape() as tape:
            loss = MEAN_LOSS(y, forward(x))
        return tape.gradient(loss, model.trainable_variables)

    run = tf.function(lambda: grads_of(f)) if compiled else (lambda: grads_of(f))
    assert_gradients_close(run(), grads_of(model))


def test_checkpointed_builds_unbuilt_layers_on_the_first_call():
    layers = [keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)]
    f = eff.checkpointed(layers, 2)
    x, y = data((12,), 4)
    f(x)
    with tf.GradientTape() as tape:
        loss = MEAN_LOSS(y, f(x))
    variables = [v for layer in layers for v in layer.trainable_variables]
    with tf.GradientTape() as plain_tape:
        plain = MEAN_LOSS(y, layers[1](layers[0](x)))
    assert_gradients_close(tape.gradient(loss, variables), plain_tape.gradient(plain, variables))


def test_checkpointed_refuses_bad_segment_counts():
    model = deep_mlp(depth=2)
    with pytest.raises(ValueError, match=r"num_segments must be an int from 1 to the number of "
                                         r"layers \(3\), got 4"):
        eff.checkpointed(model.layers, 4)
    with pytest.raises(ValueError, match="got 0"):
        eff.checkpointed(model.layers, 0)
    with pytest.raises(ValueError, match="layers is empty"):
        eff.checkpointed([], 1)
    with pytest.raises(TypeError, match=r"pass its layers: checkpointed\(model.layers"):
        eff.checkpointed(model, 2)
    with pytest.raises(TypeError, match=r"layers\[1\] is function, not a Keras layer"):
        eff.checkpointed([model.layers[0], tf.nn.relu], 1)
    with pytest.raises(TypeError, match="layers must be a list of Keras layers, got NoneType"):
        eff.checkpointed(None, 1)


def test_checkpointing_lowers_the_peak_inside_a_tf_function():
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(256, activation="tanh") for _ in range(16)]
    model = keras.Sequential([keras.Input((256,))] + layers)
    x = tf.random.normal((1024, 256), seed=1)

    def step_with(forward):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(forward(x) ** 2)
            return tape.gradient(loss, model.trainable_variables)
        return step

    plain, segmented = step_with(model), step_with(eff.checkpointed(model.layers, 4))
    plain(), segmented()
    assert eff.peak_memory(segmented) < 0.8 * eff.peak_memory(plain)


def small_problem(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                              keras.layers.Dense(CLASSES)])
    x, y = data((4,), 6, seed=seed)
    return model, (lambda: MEAN_LOSS(y, model(x)))


@pytest.mark.parametrize("method", eff.HVP_METHODS)
@pytest.mark.parametrize("seed", [0, 1])
def test_hvp_equals_the_explicit_hessian_times_v(method, seed):
    model, loss_fn = small_problem(seed)
    variables = model.trainable_variables
    rng = np.random.default_rng(seed)
    vector = [rng.normal(size=v.shape).astype("float32") for v in variables]
    flat_v = np.concatenate([u.ravel() for u in vector])
    h = eff.hessian(loss_fn, variables).numpy()
    assert h.shape == (flat_v.size, flat_v.size)
    np.testing.assert_allclose(h, h.T, atol=1e-5)
    expected = h @ flat_v
    got = np.concatenate([np.asarray(t).ravel() for t in eff.hvp(loss_fn, variables, vector,
                                                                  method)])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_hessian_of_a_quadratic_is_known():
    w = tf.Variable([1.0, -2.0])
    a = tf.constant([[3.0, 1.0], [1.0, 2.0]])
    h = eff.hessian(lambda: 0.5 * tf.tensordot(w, tf.linalg.matvec(a, w), 1), [w])
    np.testing.assert_allclose(h, a)
    np.testing.assert_allclose(eff.hvp(lambda: 0.5 * tf.tensordot(w, tf.linalg.matvec(a, w), 1),
                                       [w], [tf.constant([1.0, 0.0])])[0], [3.0, 1.0])


def test_hvp_errors():
    model, loss_fn = small_problem()
    variables = model.trainable_variables
    vector = [tf.zeros_like(v) for v in variables]
    with pytest.raises(ValueError, match="unknown method 'exact'"):
        eff.hvp(loss_fn, variables, vector, method="exact")
    with pytest.raises(ValueError, match="vector has 3 parts but there are 4 variables"):
        eff.hvp(loss_fn, variables, vector[:3])
    with pytest.raises(ValueError, match=r"vector\[1\] has shape"):
        eff.hvp(loss_fn, variables, [vector[0], tf.zeros((5,))] + vector[2:])
    with pytest.raises(ValueError, match="variables is empty"):
        eff.hvp(loss_fn, [], [])
    unbuilt = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="an unbuilt model has none yet"):
        eff.hvp(loss_fn, unbuilt.trainable_variables, [])
    with pytest.raises(TypeError, match="variables must be a list of variables, got Sequential"):
        eff.hvp(loss_fn, model, vector)
    with pytest.raises(TypeError, match="loss_fn must be a zero-argument callable"):
        eff.hvp("mse", variables, vector)
    with pytest.raises(TypeError, match="vector must be a list of tensors, one per variable, "
                                        "got NoneType"):
        eff.hvp(loss_fn, variables, None)
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    x, y = data((4,), 6)
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar; it returned shape \(6,\)"):
        eff.hvp(lambda: per_example(y, model(x)), variables, vector)


def test_hessian_errors():
    model, loss_fn = small_problem()
    with pytest.raises(ValueError, match="variables is empty"):
        eff.hessian(loss_fn, [])
    with pytest.raises(TypeError, match=r"variables\[0\] is ndarray, not a variable"):
        eff.hessian(loss_fn, [np.zeros(3)])
    with pytest.raises(TypeError, match="loss_fn must be a zero-argument callable"):
        eff.hessian(None, model.trainable_variables)
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        eff.hessian(lambda: model.trainable_variables[0] * 2.0, model.trainable_variables)


def peak_of_a_matrix(n):
    """Module-level, so that peak_memory can send it to a fresh process."""
    return tf.reduce_sum(tf.ones((n, n)))


def test_peak_memory_in_this_process_and_in_a_fresh_one():
    here = eff.peak_memory(peak_of_a_matrix, 512)
    fresh = eff.peak_memory(peak_of_a_matrix, 512, fresh_process=True)
    assert here >= 512 * 512 * 4 and fresh >= 512 * 512 * 4
    assert fresh <= 4 * 512 * 512 * 4


def test_peak_memory_errors_and_no_process_left_behind():
    with pytest.raises(ValueError, match="cannot run in a fresh process"):
        eff.peak_memory(lambda: tf.ones(3), fresh_process=True)

    def in_a_notebook():
        return tf.ones(3)
    in_a_notebook.__module__ = "__main__"
    with pytest.raises(ValueError, match="defined in __main__"):
        eff.peak_memory(in_a_notebook, fresh_process=True)
    with pytest.raises(RuntimeError, match="did not finish within 1 s"):
        eff.peak_memory(peak_of_a_matrix, 4, fresh_process=True, timeout_s=1)
    leftover = subprocess.run(["pgrep", "-f", "gradtut.efficiency import _child_main"],
                              capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


def test_compare_compilation_checks_agreement_and_returns_ratios():
    model, _ = small_problem()
    x = tf.random.normal((32, 4), seed=0)

    def gradient_norm(x):
        with tf.GradientTape() as tape:
            out = tf.reduce_sum(model(x) ** 2)
        return tf.linalg.global_norm(tape.gradient(out, model.trainable_variables))

    result = eff.compare_compilation(gradient_norm, x, repeats=3)
    assert set(result) == {"eager", "tf.function", "xla"}
    assert result["eager"]["ratio"] == 1.0
    assert all(r["median_ms"] > 0 for r in result.values())

    calls = []

    def differs_when_traced(x):
        calls.append(1)
        return x * (2.0 if len(calls) > 1 else 1.0)  # a Python side effect: wrong when traced

    with pytest.raises(AssertionError, match="tf.function disagrees with eager"):
        eff.compare_compilation(differs_when_traced, x, repeats=1)
    def keeps_an_axis_when_traced(x):  # the same values, shape (1, 4) against (4,)
        return x[0] if tf.executing_eagerly() else x[:1]

    with pytest.raises(AssertionError, match=r"tf.function disagrees with eager in output 0: "
                                             r"shape \(1, 4\) against \(4,\)"):
        eff.compare_compilation(keeps_an_axis_when_traced, x, repeats=1)
    def drops_an_output_when_traced(x):
        return (x, x + 1) if tf.executing_eagerly() else (x,)

    with pytest.raises(AssertionError, match="tf.function disagrees with eager: it returns 1 "
                                             "outputs against 2"):
        eff.compare_compilation(drops_an_output_when_traced, x, repeats=1)
    with pytest.raises(TypeError, match="fn must be a callable of tensors, got 'step'"):
        eff.compare_compilation("step", x)
    with pytest.raises(ValueError, match=r"fn cannot be traced by tf.function \(needed for the "
                                         r"tf.function version\).*no \.numpy\(\)"):
        eff.compare_compilation(lambda v: tf.constant(v.numpy() * 2), x, repeats=1)
    with pytest.raises(ValueError, match="repeats must be a positive int, got 0"):
        eff.compare_compilation(gradient_norm, x, repeats=0)
    with pytest.raises(ValueError, match="rtol must be >= 0, got -0.1"):
        eff.compare_compilation(gradient_norm, x, rtol=-0.1)


def test_large_intermediate_ms_reports_the_allocator():
    result = eff.large_intermediate_ms(size=64, repeats=2)
    assert result["median_ms"] > 0
    assert result["allocator_stats"] == "all blocks"  # this test process runs with BFC
    with pytest.raises(ValueError, match="size must be a positive int, got 0"):
        eff.large_intermediate_ms(size=0)
    with pytest.raises(ValueError, match=r"repeats must be a positive int, got 2.0 \(float\)"):
        eff.large_intermediate_ms(size=8, repeats=2.0)


def test_allocator_workloads_time_both_workloads_against_their_references():
    result = eff.allocator_workloads(size=64, batch_size=8, repeats=2)
    assert set(result) == {"large_intermediate_ms", "outer_ms", "outer_ratio", "allocator_stats"}
    assert result["large_intermediate_ms"] > 0 and result["outer_ms"] > 0
    assert result["outer_ratio"] > 0 and result["allocator_stats"] == "all blocks"  # BFC
    with pytest.raises(ValueError, match=r"batch_size must be a positive int, got True"):
        eff.allocator_workloads(size=64, batch_size=True, repeats=2)
