import os
import subprocess
import sys
import time

import pytest
import tensorflow as tf

from gradtut.measure import compare_timings, format_table, peak_memory_bytes, time_callable


def test_time_callable_reports_median_and_spread():
    t = time_callable(time.sleep, 0.01, warmup=0, repeats=3, name="sleep")
    assert t.name == "sleep"
    assert len(t.times_s) == 3
    assert 0.009 < t.min_s <= t.median_s <= t.max_s < 0.5


def test_compare_timings_ratios_are_against_the_reference():
    timings = compare_timings({"fast": lambda: time.sleep(0.002), "slow": lambda: time.sleep(0.02)},
                              reference="fast", warmup=0, repeats=3)
    by_name = {t.name: t for t in timings}
    assert by_name["fast"].ratio == 1.0
    assert 3 < by_name["slow"].ratio < 30


def test_compare_timings_counts_warmups_and_repeats():
    calls = []
    compare_timings({"f": lambda: calls.append(1)}, warmup=2, repeats=3)
    assert len(calls) == 5


@pytest.mark.parametrize("kwargs, message", [
    ({"callables": {}}, "nothing to time"),
    ({"callables": {"f": int}, "repeats": 0}, "repeats must be a positive int"),
    ({"callables": {"f": int}, "repeats": True}, "repeats must be a positive int"),
    ({"callables": {"f": int}, "warmup": -1}, "warmup must be an int >= 0"),
    ({"callables": {"f": int}, "reference": "g"}, "reference 'g' is not one of"),
])
def test_compare_timings_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        compare_timings(**kwargs)


def test_measuring_something_that_is_not_callable_says_so():
    with pytest.raises(TypeError, match=r"\['x'\] are not callable"):
        compare_timings({"x": 3})
    with pytest.raises(TypeError, match="fn must be callable"):
        time_callable(None)
    with pytest.raises(TypeError, match="fn must be callable"):
        peak_memory_bytes(tf.zeros([4]))


def test_format_table_refuses_no_columns_and_rows_that_are_not_dicts():
    with pytest.raises(ValueError, match="columns must be a non-empty list"):
        format_table([{"a": 1}], "a")
    with pytest.raises(ValueError, match="rows must be dicts"):
        format_table([("a", 1)], ["a"])


def test_peak_memory_sees_a_temporary_buffer():
    n = 4 * 1024 * 1024  # 16 MiB of float32, freed before the call returns

    def make_and_reduce():
        return tf.reduce_sum(tf.random.uniform([n]))

    peak = peak_memory_bytes(make_and_reduce)
    assert 4 * n <= peak < 3 * 4 * n


@pytest.mark.parametrize("onednn, counted", [
    ("0", "none"),  # oneDNN off: TensorFlow's default CPU allocator keeps no statistics
    ("1", "large blocks only"),  # oneDNN on: none of blocks under 256 kB, so 2 kB tensors read 0
])
def test_peak_memory_refuses_an_allocator_that_misses_blocks(onednn, counted):
    code = ("import tensorflow as tf; from gradtut.measure import peak_memory_bytes; "
            "peak_memory_bytes(lambda: [tf.ones(512) for _ in range(100)])")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS=onednn)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode != 0
    assert f"does not count every block (its statistics: {counted}" in proc.stderr
    assert "TF_CPU_ALLOCATOR_USE_BFC=true" in proc.stderr


def test_format_table_aligns_columns():
    text = format_table([{"method": "batch", "ms": 4.0}, {"method": "vectorized", "ms": 21.345}],
                        ["method", "ms"])
    assert text.splitlines() == ["method      ms", "batch       4", "vectorized  21.3"]
