import numpy as np
import pytest
import tensorflow as tf

from gradtut.checks import assert_gradients_close


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
