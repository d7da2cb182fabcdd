"""Input gradients, Jacobians and integrated gradients against per-example tapes, on values."""
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradtut.checks import assert_gradients_close
from gradtut.vectorize import (
    VectorizationReport,
    batch_jacobian,
    completeness_gap,
    input_gradients,
    integrated_gradients,
    make_batched_input_gradient,
    make_per_example_input_gradient,
    map_fn_timings,
    threading_timings,
    vectorization_report,
)

TOL = {"rtol": 1e-5, "atol": 1e-6}


@functools.lru_cache(maxsize=None)
def model(name):
    keras.utils.set_random_seed(0)
    if name == "mlp":
        return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="tanh"),
                                 keras.layers.Dense(4)])
    if name == "cnn":
        return keras.Sequential([keras.Input((8, 8, 1)),
                                 keras.layers.Conv2D(6, 3, padding="same", activation="relu"),
                                 keras.layers.Conv2D(4, 3, strides=2, activation="relu"),
                                 keras.layers.Flatten(), keras.layers.Dense(4)])
    if name == "scalar":
        return keras.Sequential([keras.Input((12,)), keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(1)])
    raise KeyError(name)


def inputs(name, n, seed=0):
    shape = (8, 8, 1) if name == "cnn" else (12,)
    return np.random.default_rng(seed).normal(size=(n, *shape)).astype("float32")


def tape_per_example(model, x, pick):
    """The reference: one tape per example, differentiating pick(output of that example)."""
    rows = []
    for i in range(len(x)):
        xi = tf.constant(x[i:i + 1])
        with tf.GradientTape() as tape:
            tape.watch(xi)
            value = pick(model(xi)[0], i)
        rows.append(tape.gradient(value, xi)[0].numpy())
    return np.stack(rows)


@pytest.mark.parametrize("batch_size", [None, 1, 4, 7])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_input_gradients_of_a_class_per_example_match_tapes(name, batch_size):
    x = inputs(name, 10)
    labels = np.arange(10) % 4
    expected = tape_per_example(model(name), x, lambda out, i: out[labels[i]])
    got = input_gradients(model(name), x, target=labels, batch_size=batch_size)
    assert isinstance(got, np.ndarray) and got.shape == x.shape
    assert_gradients_close(got, expected, **TOL)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_one_class_index_and_a_callable_target(name):
    x = inputs(name, 5)
    expected = tape_per_example(model(name), x, lambda out, i: out[2])
    assert_gradients_close(input_gradients(model(name), x, target=2), expected, **TOL)
    expected = tape_per_example(model(name), x, lambda out, i: tf.reduce_max(out))
    got = input_gradients(model(name), x, target=lambda out: tf.reduce_max(out, axis=1))
    assert_gradients_close(got, expected, **TOL)


def test_scalar_output_needs_no_target():
    x = inputs("mlp", 6)
    expected = tape_per_example(model("scalar"), x, lambda out, i: out[0])
    assert_gradients_close(input_gradients(model("scalar"), x, batch_size=4), expected, **TOL)


@pytest.mark.parametrize("use_pfor", [True, False])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_batch_jacobian_rows_are_per_example_gradients(name, use_pfor):
    x = inputs(name, 5)
    jac = batch_jacobian(model(name), x, batch_size=2, use_pfor=use_pfor)
    assert jac.shape == (5, 4, *x.shape[1:])
    for k in range(4):
        expected = tape_per_example(model(name), x, lambda out, i, k=k: out[k])
        assert_gradients_close(jac[:, k], expected, **TOL)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_integrated_gradients_are_complete(name):
    x = inputs(name, 4, seed=1)
    labels = np.array([0, 1, 2, 3])

    def f(v):
        return model(name)(v).numpy()[np.arange(4), labels]

    delta = f(x) - f(np.zeros_like(x))
    attributions = integrated_gradients(model(name), x, target=labels, steps=64, batch_size=50)
    assert attributions.shape == x.shape
    gap = completeness_gap(model(name), x, attributions, target=labels)
    assert np.allclose(attributions.reshape(4, -1).sum(1) - delta, gap, atol=1e-5)
    assert np.all(np.abs(gap) <= 0.02 * np.abs(delta) + 1e-3), (gap, delta)
    coarse = integrated_gradients(model(name), x, target=labels, steps=4)
    assert np.abs(completeness_gap(model(name), x, coarse, target=labels)).sum() > np.abs(gap).sum()


def test_integrated_gradients_with_one_steps_is_the_trapezoid_by_hand():
    x = inputs("mlp", 3)
    base = np.full(12, 0.5, "float32")
    grads = [input_gradients(model("mlp"), base + a * (x - base), target=1) for a in (0.0, 1.0)]
    expected = (x - base) * (grads[0] + grads[1]) / 2
    assert_gradients_close(integrated_gradients(model("mlp"), x, baseline=base, target=1, steps=1),
                           expected, **TOL)


# ------------------------------------------------------------------ vectorization_report


def per_example_weight_gradient(m):
    def fn(xi):
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(m(xi[None]))
        return tape.gradient(value, m.trainable_variables)
    return fn


def per_example_input_gradient(m):
    def fn(xi):
        xi = xi[None]
        with tf.GradientTape() as tape:
            tape.watch(xi)
            value = tf.reduce_sum(m(xi))
        return tape.gradient(value, xi)[0]
    return fn


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_input_gradients_vectorize_without_fallback(name):
    x = inputs(name, 6)
    report = vectorization_report(per_example_input_gradient(model(name)), tf.constant(x))
    assert report.vectorized, report.fallback_ops
    expected = tape_per_example(model(name), x, lambda out, i: tf.reduce_sum(out))
    assert_gradients_close(report.result, expected, **TOL)


def test_mlp_weight_gradients_vectorize_without_fallback():
    report = vectorization_report(per_example_weight_gradient(model("mlp")),
                                  tf.constant(inputs("mlp", 4)))
    assert report.vectorized and report.fallback_ops == []


def test_conv_weight_gradients_fall_back_and_the_report_says_so():
    report = vectorization_report(per_example_weight_gradient(model("cnn")),
                                  tf.constant(inputs("cnn", 4)))
    assert not report.vectorized
    assert "Conv2DBackpropFilter" in report.fallback_ops
    assert any("while_loop" in m for m in report.messages)


def test_report_leaves_the_logger_as_it_was():
    logger = tf.get_logger()
    before = logger.level, list(logger.handlers), logger.propagate
    vectorization_report(per_example_weight_gradient(model("cnn")), tf.constant(inputs("cnn", 2)))
    assert (logger.level, list(logger.handlers), logger.propagate) == before


# ------------------------------------------------------------------------------ bad input


class MixesTheBatch(keras.layers.Layer):
    def call(self, x):
        return x - tf.reduce_mean(x, axis=0, keepdims=True)


def test_a_model_that_mixes_the_batch_is_refused():
    mixing = keras.Sequential([keras.Input((12,)), MixesTheBatch(), keras.layers.Dense(2)])
    x = inputs("mlp", 4)
    for call in (lambda: input_gradients(mixing, x, target=0),
                 lambda: batch_jacobian(mixing, x),
                 lambda: integrated_gradients(mixing, x, target=0, steps=2)):
        with pytest.raises(ValueError, match="depends on the other examples in the batch"):
            call()


def test_batch_norm_runs_in_inference_mode_and_is_accepted():
    keras.utils.set_random_seed(0)
    bn = keras.Sequential([keras.Input((12,)), keras.layers.Dense(8),
                           keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    x = inputs("mlp", 5)
    expected = tape_per_example(bn, x, lambda out, i: out[1])
    assert_gradients_close(input_gradients(bn, x, target=1), expected, **TOL)


@pytest.mark.parametrize("kwargs, message", [
    ({"x": np.zeros((0, 12), "float32"), "target": 0}, "non-empty batch"),
    ({"x": np.zeros((2, 12), "int32"), "target": 0}, "must be floating point"),
    ({"target": 0, "batch_size": 0}, "batch_size must be a positive int"),
    ({"target": 4}, r"class indices must be in \[0, 4\)"),
    ({"target": [0, 1]}, "target has 2 class indices for 3 examples"),
    ({"target": 1.5}, "target must be None, an int class index"),
    ({}, r"not one scalar; pass target="),
    ({"target": lambda out: out}, r"must return a \[B\] vector"),
])
def test_input_gradients_reject_bad_input(kwargs, message):
    kwargs.setdefault("x", inputs("mlp", 3))
    with pytest.raises(ValueError, match=message):
        input_gradients(model("mlp"), **kwargs)


def test_integrated_gradients_reject_bad_input():
    x = inputs("mlp", 2)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        integrated_gradients(model("mlp"), x, target=0, steps=0)
    with pytest.raises(ValueError, match="baseline shape"):
        integrated_gradients(model("mlp"), x, baseline=np.zeros(5), target=0)
    with pytest.raises(ValueError, match="attributions shape"):
        completeness_gap(model("mlp"), x, np.zeros((2, 5)), target=0)


def test_vectorization_report_rejects_an_empty_batch():
    with pytest.raises(ValueError, match="elems is empty"):
        vectorization_report(lambda v: v, tf.zeros([0, 3]))


class CumsumOverBatch(keras.layers.Layer):
    """Example b's output is the sum of examples 0..b: example 0 alone is unchanged, so a
    check of example 0 alone does not see the mixing."""

    def call(self, x):
        return tf.cumsum(x, axis=0)


def cumsum_model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((12,)), CumsumOverBatch(), keras.layers.Dense(3)])


def test_a_model_that_sums_over_the_batch_is_refused():
    mixing = cumsum_model()
    x = inputs("mlp", 5)
    message = "mixes examples across the batch.*batch_size=1"
    with pytest.raises(ValueError, match=message):
        input_gradients(mixing, x, target=0)
    with pytest.raises(ValueError, match=message):
        batch_jacobian(mixing, x, batch_size=2)
    with pytest.raises(ValueError, match=message):
        integrated_gradients(mixing, x, target=0, steps=2)
    with pytest.raises(ValueError, match=message):
        completeness_gap(mixing, x, np.zeros_like(x), target=0)


@pytest.mark.parametrize("layer", [CumsumOverBatch, MixesTheBatch])
def test_batch_size_one_computes_each_example_alone_as_the_refusal_advises(layer):
    keras.utils.set_random_seed(2)
    mixing = keras.Sequential([keras.Input((12,)), layer(),
                               keras.layers.Dense(3, activation="tanh")])
    x = inputs("mlp", 4, seed=3)
    expected = tape_per_example(mixing, x, lambda out, i: out[1])  # each example alone
    assert_gradients_close(input_gradients(mixing, x, target=1, batch_size=1), expected, **TOL)
    jac = batch_jacobian(mixing, x, batch_size=1)
    assert_gradients_close(jac[:, 1], expected, **TOL)


def test_what_is_not_a_model_is_refused_and_a_plain_function_is_accepted():
    x = inputs("mlp", 3)
    layers = [keras.layers.Dense(2)]
    with pytest.raises(TypeError,
                       match=r"model must be a Keras model.*got list.*keras.Sequential\(layers\)"):
        input_gradients(layers, x, target=0)
    with pytest.raises(TypeError, match=r"got str; pass a Keras model"):
        batch_jacobian("mlp", x)

    def no_training_argument(v):
        return model("mlp")(v)

    with pytest.raises(TypeError, match=r"does not take those arguments.*lambda x, training=False"):
        integrated_gradients(no_training_argument, x, target=0)
    # documented: any callable model(x, training=False) is fine
    function = lambda v, training=False: model("mlp")(v, training=training)  # noqa: E731
    assert_gradients_close(input_gradients(function, x, target=2),
                           input_gradients(model("mlp"), x, target=2), **TOL)
    with pytest.raises(TypeError, match=r"model must be a Keras model or a callable"):
        completeness_gap(None, x, np.zeros_like(x), target=0)
    a, b = keras.Input((4,), name="left"), keras.Input((4,), name="right")
    two = keras.Model([a, b], keras.layers.Dense(1)(keras.layers.Concatenate()([a, b])))
    with pytest.raises(ValueError, match=r"model has 2 inputs \(left, right\); these functions "
                                         r"take a model with one input.*lambda x, training=False"):
        input_gradients(two, np.zeros((3, 4), "float32"))


@pytest.mark.parametrize("batch_size, message", [
    (True, r"batch_size must be a positive int, got True \(a bool\).*or None"),
    (2.0, r"got 2.0 \(float\)"), ("4", r"got '4' \(str\)"), (-1, "got -1"),
])
def test_batch_size_must_be_an_int_or_none(batch_size, message):
    x = inputs("mlp", 3)
    with pytest.raises(ValueError, match=message):
        input_gradients(model("mlp"), x, target=0, batch_size=batch_size)
    with pytest.raises(ValueError, match=message):
        batch_jacobian(model("mlp"), x, batch_size=batch_size)


def test_numpy_ints_are_counts():
    x = inputs("mlp", 5)
    assert_gradients_close(input_gradients(model("mlp"), x, target=1, batch_size=np.int64(2)),
                           input_gradients(model("mlp"), x, target=1), **TOL)
    assert_gradients_close(integrated_gradients(model("mlp"), x, target=1, steps=np.int32(3)),
                           integrated_gradients(model("mlp"), x, target=1, steps=3), **TOL)


def test_bad_steps_x_and_attributions_are_refused():
    x = inputs("mlp", 2)
    with pytest.raises(ValueError, match=r"steps must be a positive int, got 4.0 \(float\)"):
        integrated_gradients(model("mlp"), x, target=0, steps=4.0)
    with pytest.raises(ValueError, match=r"steps must be a positive int, got True \(a bool\)"):
        integrated_gradients(model("mlp"), x, target=0, steps=True)
    with pytest.raises(ValueError, match="x is None; pass the float inputs"):
        input_gradients(model("mlp"), None, target=0)
    with pytest.raises(ValueError, match="x is a symbolic Keras tensor"):
        batch_jacobian(model("mlp"), keras.Input((12,)))
    with pytest.raises(ValueError, match="attributions is None; pass the result of integrated"):
        completeness_gap(model("mlp"), x, None, target=0)


def test_calls_inside_a_tf_function_are_refused_with_the_fix():
    @tf.function(input_signature=[tf.TensorSpec([None, 12])])
    def traced(v):
        return input_gradients(model("mlp"), v, target=0)

    with pytest.raises(ValueError,
                       match="input_gradients runs eagerly.*Call it outside the tf.function"):
        traced(tf.constant(inputs("mlp", 3)))


def test_vectorization_report_broadcasts_a_leading_one_like_vectorized_map():
    x = tf.random.normal([5, 3])
    w = tf.random.normal([1, 3])
    report = vectorization_report(lambda e: tf.reduce_sum(e[0] * e[1]), (x, w))
    by_hand = [float(tf.reduce_sum(x[i] * w[0])) for i in range(5)]  # the reference, after
    np.testing.assert_allclose(report.result.numpy(), by_hand, rtol=1e-6)


def test_vectorization_report_refuses_scalars_and_other_bad_elems():
    with pytest.raises(ValueError, match="elems holds a scalar, which has no leading axis"):
        vectorization_report(lambda v: v * 2, tf.constant(3.0))
    with pytest.raises(ValueError, match="elems holds a scalar"):
        vectorization_report(lambda e: e[0] * e[1], (tf.ones([3]), 2.0))
    with pytest.raises(ValueError, match=r"different leading dimensions \[2, 3\]"):
        vectorization_report(lambda e: e[0], (tf.ones([3, 2]), tf.ones([2])))
    with pytest.raises(ValueError, match="elems is None"):
        vectorization_report(lambda v: v, None)
    with pytest.raises(TypeError, match="fn must be a function of one element, got .*Tensor"):
        vectorization_report(tf.ones([3]), tf.ones([3]))


def test_a_report_that_contradicts_itself_is_refused():
    assert VectorizationReport(False, ["Conv2DBackpropFilter"], [], None).fallback_ops
    with pytest.raises(ValueError, match=r"vectorized=True contradicts fallback_ops=\['Conv2D"):
        VectorizationReport(True, ["Conv2DBackpropFilter"], [], None)
    with pytest.raises(ValueError, match="fallback_ops must be a list of op type names"):
        VectorizationReport(False, "Conv2DBackpropFilter", [], None)
    with pytest.raises(ValueError, match="vectorized must be a bool, got 1"):
        VectorizationReport(1, [], [], None)


# ----------------------------------------------- map_fn against one batched pass (section 5)


def test_one_example_and_the_batched_input_gradient_match_a_tape_per_example():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                              keras.layers.Dense(3)])
    x = np.random.default_rng(3).normal(size=(5, 4)).astype("float32")
    one = make_per_example_input_gradient(model)
    got_one = np.stack([one(xi).numpy() for xi in x])
    got_batched = make_batched_input_gradient(model)(tf.constant(x)).numpy()
    expected = []
    for xi in x:  # the reference, computed after
        xi = tf.constant(xi[None])
        with tf.GradientTape() as tape:
            tape.watch(xi)
            value = tf.reduce_sum(model(xi))
        expected.append(tape.gradient(value, xi)[0].numpy())
    np.testing.assert_allclose(got_one, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_batched, expected, rtol=1e-5, atol=1e-6)


def test_the_map_fn_workloads_refuse_bad_input():
    with pytest.raises(TypeError, match="does not take those arguments"):
        make_per_example_input_gradient(lambda x: x)
    with pytest.raises(TypeError, match="model must be a Keras model"):
        make_batched_input_gradient([keras.layers.Dense(2)])
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="parallel_iterations must be a positive int"):
        map_fn_timings(model, [[0.0, 0.0, 0.0]], parallel_iterations=(0,))
    with pytest.raises(ValueError, match="x has no examples"):
        map_fn_timings(model, [])
    with pytest.raises(ValueError, match="repeats must be a positive int"):
        threading_timings(repeats=0)
