import numpy as np
import pytest
import tensorflow as tf

from gradtut.checks import assert_gradients_close, check_int, check_real, check_seed


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
