import os
import subprocess
import sys
import time

import matplotlib
import pytest
import tensorflow as tf

from gradtut.benchmark import (compare_timings, format_table, peak_memory_bytes,
                               plot_method_vs_batch, run_in_subprocess, time_callable)

matplotlib.use("Agg")


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
    ({"callables": {"f": int}, "repeats": 0}, "repeats >= 1"),
    ({"callables": {"f": int}, "reference": "g"}, "reference 'g' is not one of"),
])
def test_compare_timings_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        compare_timings(**kwargs)


def test_peak_memory_sees_a_temporary_buffer():
    n = 4 * 1024 * 1024  # 16 MiB of float32, freed before the call returns

    def make_and_reduce():
        return tf.reduce_sum(tf.random.uniform([n]))

    peak = peak_memory_bytes(make_and_reduce)
    assert 4 * n <= peak < 3 * 4 * n


def test_peak_memory_without_allocator_stats_says_how_to_fix():
    # With oneDNN off, TensorFlow's default CPU allocator keeps no statistics.
    code = ("import tensorflow as tf; from gradtut.benchmark import peak_memory_bytes; "
            "peak_memory_bytes(lambda: tf.ones(3))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode != 0
    assert "TF_CPU_ALLOCATOR_USE_BFC=true" in proc.stderr


def test_run_in_subprocess_returns_the_result_and_reports_failures():
    assert run_in_subprocess("json", "loads", {"s": "[1, 2]"}) == [1, 2]
    with pytest.raises(RuntimeError, match=r"(?s)json.loads failed \(exit 1\):\n.*JSONDecodeError"):
        run_in_subprocess("json", "loads", {"s": "{"})
    with pytest.raises(RuntimeError, match="signal.pause did not finish within 1 s"):
        run_in_subprocess("signal", "pause", timeout_s=1)


def test_format_table_aligns_columns():
    text = format_table([{"method": "batch", "ms": 4.0}, {"method": "vectorized", "ms": 21.345}],
                        ["method", "ms"])
    assert text.splitlines() == ["method      ms", "batch       4", "vectorized  21.3"]


def test_plot_draws_one_line_per_method():
    rows = [{"method": m, "batch_size": b, "median_ms": float(b * k)}
            for k, m in enumerate(["a", "b"], 1) for b in (32, 64)]
    ax = plot_method_vs_batch(rows)
    assert [line.get_label() for line in ax.get_lines()] == ["a", "b"]
    assert list(ax.get_lines()[1].get_ydata()) == [64.0, 128.0]
    assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()


def test_benchmark_helpers_reject_bad_arguments():
    import keras
    import numpy as np

    from gradtut.bench_per_example import benchmark_per_example
    from gradtut.bench_vectorize import input_gradient_benchmark

    with pytest.raises(ValueError, match=r"unknown methods \['fastest'\]"):
        benchmark_per_example(batch_sizes=(4,), methods=("outer", "fastest"))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="x has 8 examples; the largest batch size is 32"):
        input_gradient_benchmark(model, np.zeros((8, 3), "float32"), np.zeros(8, "int64"),
                                 batch_sizes=(4, 32))
