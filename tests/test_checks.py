import keras
import numpy as np
import pytest
import tensorflow as tf

from gradtut.checks import (
    assert_gradients_close,
    check_int,
    check_no_clipping_over_replicas,
    check_real,
    check_seed,
)


def test_close_nests_pass_and_return_the_largest_error():
    a = {"w": tf.constant([[1.0, 2.0]]), "b": [tf.constant(3.0)]}
    e = {"w": np.array([[1.0, 2.0 + 1e-7]]), "b": [np.float32(3.0)]}
    worst = assert_gradients_close(a, e, rtol=1e-6, atol=0)
    assert worst == pytest.approx(1e-7, rel=1e-3)


def test_failure_names_the_variable_shape_and_errors():
    actual = [np.zeros(4), np.array([[0.0, 0.0, 0.5], [0.0, 0.0, 0.0]])]
    expected = [np.zeros(4), np.zeros((2, 3))]
    with pytest.raises(AssertionError) as err:
        assert_gradients_close(actual, expected, names=["bias", "kernel"])
    msg = str(err.value)
    assert "#1 (kernel)" in msg
    assert "shape (2, 3)" in msg
    assert "1 of 6 values" in msg
    assert "largest absolute error 0.5 at index (0, 2)" in msg
    assert "largest relative error" in msg


def test_names_come_from_expected_variables_when_not_given():
    v = tf.Variable([1.0, 2.0], name="my_bias")
    with pytest.raises(AssertionError, match=r"#0 \(my_bias"):
        assert_gradients_close([tf.constant([1.0, 3.0])], [v])


def test_relative_tolerance_scales_with_the_value():
    assert_gradients_close([1000.0 + 1e-3], [1000.0], rtol=1e-5, atol=0)
    with pytest.raises(AssertionError):
        assert_gradients_close([1e-3 + 1e-3], [1e-3], rtol=1e-5, atol=0)


@pytest.mark.parametrize("actual, expected, message", [
    ([np.ones(2)], [np.ones(2), np.ones(2)], "got 1 gradients, expected 2"),
    ([np.ones(2)], [np.ones(3)], r"shape \(2,\) != expected \(3,\)"),
    ([None], [np.ones(3)], "is None"),
    ([np.array([np.nan])], [np.array([1.0])], "1 of 1 values differ"),
    # an expected inf made its own tolerance infinite: 1.0 and -inf passed against it
    ([np.array([1.0, 2.0])], [np.array([np.inf, 2.0])], "1 of 2 values differ.*error inf"),
    ([np.array([-np.inf])], [np.array([np.inf])], "1 of 1 values differ"),
    ([np.array([np.inf])], [np.array([np.inf])], "1 of 1 values differ"),
])
def test_structural_mismatches_fail_clearly(actual, expected, message):
    with pytest.raises(AssertionError, match=message):
        assert_gradients_close(actual, expected)


def test_indexed_slices_are_compared_densely():
    slices = tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([1]), tf.constant([3, 2]))
    assert_gradients_close([slices], [np.array([[0, 0], [1.0, 2.0], [0, 0]])])


def test_wrong_number_of_names_is_a_usage_error():
    with pytest.raises(ValueError, match="names has 2 entries for 1 gradients"):
        assert_gradients_close([1.0], [1.0], names=["a", "b"])


# ------------------------------------------------------------------------- nest structure


@pytest.mark.parametrize("actual, expected, message", [
    ({"w": np.ones(2), "b": np.ones(1)}, {"w": np.ones(2), "c": np.ones(1)},
     r"dict keys differ: only in actual \['b'\], only in expected \['c'\]"),
    ([np.ones(2)], {"w": np.ones(2)}, r"actual is a list of 1 but expected is a dict"),
    ({"w": np.ones(2)}, [np.ones(2)], r"actual is a dict with keys \['w'\] but expected is a list"),
    ([[np.ones(2)], np.ones(1)], [np.ones(2), [np.ones(1)]],
     r"at \[0\], actual is a list of 1 but expected is a single ndarray"),
    (np.ones(2), [np.ones(2)], "actual is a single ndarray but expected is a list of 1"),
    ({"a": [np.ones(1), {"k": np.ones(1)}]}, {"a": [np.ones(1), {"j": np.ones(1)}]},
     r"at \['a'\]\[1\], the dict keys differ"),
])
def test_different_structures_with_the_same_leaves_fail(actual, expected, message):
    """Same number of leaves, same shapes: the structure alone must make these fail (they
    passed with 0.0 before)."""
    with pytest.raises(AssertionError, match="the gradients differ in structure: .*" + message):
        assert_gradients_close(actual, expected)


def test_a_list_and_a_tuple_of_the_same_gradients_match():
    """Documented choice: tape.gradient returns a list or a tuple, whichever it was given."""
    assert assert_gradients_close((np.ones(2), [np.ones(1)]), [np.ones(2), (np.ones(1),)]) == 0.0
    assert assert_gradients_close({"w": (np.ones(2),)}, {"w": [np.ones(2)]}) == 0.0


# ------------------------------------------------------------------------ argument checks


@pytest.mark.parametrize("value", [np.int64(3), np.int32(3), 3])
def test_check_int_takes_python_and_numpy_ints(value):
    assert check_int(value, "steps") == 3 and type(check_int(value, "steps")) is int


@pytest.mark.parametrize("value, message", [
    (True, r"got True \(a bool\)"), (np.bool_(True), r"\(a bool\)"), (4.0, r"got 4.0 \(float\)"),
    ("4", r"got '4' \(str\)"), (None, r"got None \(NoneType\)"), (0, "got 0"),
])
def test_check_int_refuses_what_is_not_a_count(value, message):
    with pytest.raises(ValueError, match="num_workers must be .*" + message):
        check_int(value, "num_workers")


def test_check_int_minimum():
    assert check_int(0, "retries", minimum=0) == 0
    with pytest.raises(ValueError, match="retries must be an int >= 0, got -1"):
        check_int(-1, "retries", minimum=0)


@pytest.mark.parametrize("value", [0.5, np.float32(0.5), np.float64(0.5)])
def test_check_real_takes_python_and_numpy_numbers(value):
    assert check_real(value, "l2_norm_clip") == 0.5
    assert check_real(2, "l2_norm_clip") == 2.0 and type(check_real(2, "x")) is float


@pytest.mark.parametrize("value, message", [
    (None, r"got None \(NoneType\)"), ("1.0", r"got '1.0' \(str\)"), (True, r"\(a bool\)"),
    (np.array([1.0]), r"an array of shape \(1,\) \(use float\(x\)"),
    (tf.constant(1.0), r"an array of shape \(\)"), ([1.0], r"\(list\)"),
])
def test_check_real_refuses_what_is_not_one_number(value, message):
    with pytest.raises(ValueError, match="l2_norm_clip must be a real number.*" + message +
                       ".*pass a number such as 1.0"):
        check_real(value, "l2_norm_clip")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -np.inf])
def test_check_real_refuses_nan_and_infinity(value):
    with pytest.raises(ValueError, match="noise_multiplier must be finite"):
        check_real(value, "noise_multiplier")


def test_check_seed():
    assert check_seed(None) is None
    assert check_seed(np.uint32(7)) == 7 and check_seed(0) == 0
    for bad, message in [("0", r"got '0' \(str\)"), (1.5, r"got 1.5 \(float\)"),
                         (-1, "got -1"), (True, r"got True \(a bool\)")]:
        with pytest.raises(ValueError, match=f"seed must be an int >= 0, {message}.*or None"):
            check_seed(bad)
    with pytest.raises(ValueError, match="seed must be below 2\\*\\*63"):
        check_seed(2**63)
    with pytest.raises(ValueError, match=r"data_seed must be an int >= 0, got None \(NoneType\)"
                                         r"; pass a whole number such as 1$"):
        check_seed(None, "data_seed", allow_none=False)


def test_the_shared_input_checks_name_the_problem():
    import keras

    from gradtut.checks import (
        as_tensors,
        batch_size_of,
        check_keras_model,
        check_loss_fn,
        check_optimizer,
        check_present,
        checked_batch,
    )
    with pytest.raises(ValueError, match="x holds no tensors"):
        batch_size_of([], "x")
    with pytest.raises(ValueError, match="different batch sizes \\[3, 4\\]"):
        batch_size_of([tf.zeros((3, 1)), tf.zeros((4, 1))], "x")
    with pytest.raises(ValueError, match="cannot turn object into a tensor"):
        as_tensors([object()])
    with pytest.raises(ValueError, match=r"y holds None \(entries \[1\]"):
        check_present([np.zeros(2), None], "y")
    with pytest.raises(TypeError, match="wrap the layers in a model"):
        check_keras_model([keras.layers.Dense(2)])
    with pytest.raises(TypeError, match="loss_fn must be a callable"):
        check_loss_fn(3)
    with pytest.raises(TypeError, match="optimizer must be a Keras optimizer object"):
        check_optimizer("sgd")
    with pytest.raises(ValueError, match="x has 3 examples but y has 2"):
        checked_batch(np.zeros((3, 1)), np.zeros(2))
    with pytest.raises(ValueError, match="the batch is empty"):
        checked_batch(np.zeros((0, 1)), np.zeros(0))


def test_per_example_losses_and_regularization_gradients_refuse_bad_input():
    import keras

    from gradtut.data_parallel import regularization_gradients
    from gradtut.per_example import per_example_losses
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
        2, kernel_regularizer=keras.regularizers.L2(0.5))])
    x = tf.random.normal((5, 3))
    with pytest.raises(ValueError, match=r"per-example losses of shape \[B\] = \[5\]"):
        per_example_losses(model, keras.losses.MeanSquaredError(), x, tf.zeros((5, 2)))
    kernel = model.trainable_variables[0]
    grads = regularization_gradients(model, replicas=2)
    np.testing.assert_allclose(grads[0], 0.5 * kernel.numpy(), rtol=1e-6)  # d(0.5|W|^2)/dW / 2
    assert grads[1] is None
    with pytest.raises(ValueError, match="replicas must be a positive int"):
        regularization_gradients(model, replicas=0)
    with pytest.raises(TypeError, match="model must be a Keras model"):
        regularization_gradients("model")


@pytest.mark.parametrize("clipping", [{"clipnorm": 1.0}, {"clipvalue": 0.5},
                                      {"global_clipnorm": 2.0}])
def test_a_clipping_optimizer_is_refused_over_replicas_only(clipping):
    optimizer = keras.optimizers.SGD(0.1, **clipping)
    check_no_clipping_over_replicas(optimizer, 1)  # one replica: the clip sees the whole gradient
    name, value = next(iter(clipping.items()))
    with pytest.raises(ValueError, match=rf"clips \({name}={value}\) and there are 2 replicas"):
        check_no_clipping_over_replicas(optimizer, 2)
    check_no_clipping_over_replicas(keras.optimizers.SGD(0.1), 4)  # no clipping: any count
