"""The bench command: a quick section end to end, its JSON, and its argument errors."""
import json
import os
import subprocess
import sys

import pytest

from gradtut.bench.command import RESULT_KEYS, ROW_KEYS, SECTIONS, output_folder


def gradtut_cli(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    return subprocess.run([sys.executable, "-m", "gradtut", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=600)


def test_quick_pipeline_section_writes_results_and_a_plot(tmp_path):
    out = tmp_path / "bench"
    proc = gradtut_cli("bench", "--quick", "--sections", "pipeline", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "[1/1] pipeline ... done in" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert set(RESULT_KEYS) <= set(results)
    assert results["quick"] is True and results["tensorflow"].startswith("2.21.")
    assert results["hardware"]["cpu_count"] >= 1 and results["devices"]
    section = results["sections"]["pipeline"]
    assert section["device"].startswith("CPU (2 virtual devices")
    rows = section["rows"]
    assert [r["measurement"] for r in rows] == ["GPipe, 2 stages, 1 micro-batches",
                                                "GPipe, 2 stages, 4 micro-batches"]
    for r in rows:
        assert set(ROW_KEYS) <= set(r) and r["value"] > 0
        assert 0.0 <= r["idle_measured"] < 1.0
    assert rows[0]["ratio"] == 1.0
    assert abs(rows[0]["idle_measured"] - 0.5) < 0.1  # one micro-batch: one stage at a time
    assert rows[1]["idle_formula"] == pytest.approx(0.2)
    assert (out / "pipeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_help_lists_the_sections():
    proc = gradtut_cli("bench", "--help")
    assert proc.returncode == 0
    assert all(name in proc.stdout for name in SECTIONS) and "--quick" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["bench", "--sections", "per_example", "nope"],
     "python -m gradtut bench: error: unknown section 'nope'; choose from per_example, "),
    (["bench", "--out", "/proc/gradtut-bench"], "python -m gradtut bench: error: cannot write "
                                                "to --out '/proc/gradtut-bench'"),
    (["bench", "--repeats", "3"], "python -m gradtut bench: error: unrecognized arguments"),
    (["train"], "python -m gradtut: error: unknown command 'train'"),
])
def test_bad_arguments_get_one_line_and_a_nonzero_exit(args, message):
    proc = gradtut_cli(*args)
    assert proc.returncode == 2
    assert proc.stderr.startswith(message)
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_an_existing_file_as_out_is_refused(tmp_path):
    target = tmp_path / "a-file"
    target.write_text("x")
    proc = gradtut_cli("bench", "--quick", "--sections", "pipeline", "--out", str(target))
    assert proc.returncode == 2 and "cannot write to --out" in proc.stderr


def test_the_default_out_is_a_new_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = output_folder()
    os.makedirs(first, exist_ok=True)
    second = output_folder()
    assert first.startswith("gradtut-bench-") and first != second
    assert (tmp_path / first).is_dir() and (tmp_path / second).is_dir()


def test_benchmark_helpers_reject_bad_arguments():
    import keras
    import numpy as np

    from gradtut.bench.input_gradients import input_gradient_benchmark
    from gradtut.bench.per_example import benchmark_per_example

    with pytest.raises(ValueError, match=r"unknown methods \['fastest'\]"):
        benchmark_per_example(batch_sizes=(4,), methods=("outer", "fastest"))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="x has 8 examples; the largest batch size is 32"):
        input_gradient_benchmark(model, np.zeros((8, 3), "float32"), np.zeros(8, "int64"),
                                 batch_sizes=(4, 32))


def test_input_gradient_benchmark_refuses_a_vectorized_map_that_falls_back():
    import keras
    import numpy as np
    import tensorflow as tf

    from gradtut.bench.input_gradients import input_gradient_benchmark

    def with_histogram(t):  # HistogramFixedWidth has no pfor rule: a while_loop fallback
        counts = tf.histogram_fixed_width(t, [0.0, 1.0], nbins=3)
        return t * tf.cast(counts[0], t.dtype)

    model = keras.Sequential([keras.Input((3,)), keras.layers.Lambda(with_histogram),
                              keras.layers.Dense(2)])
    with pytest.raises(RuntimeError, match=r"fell back to a while_loop.*HistogramFixedWidth"):
        input_gradient_benchmark(model, np.ones((8, 3), "float32"), np.zeros(8, "int64"),
                                 batch_sizes=(4,))


def test_the_command_and_its_workloads_refuse_bad_input_in_process(tmp_path):
    from gradtut.bench.command import format_results, main, run_section
    from gradtut.bench.per_example import benchmark_dp_step, benchmark_keras_hub

    with pytest.raises(SystemExit) as stop:
        main(["--sections", "nope"])
    assert stop.value.code == 2
    with pytest.raises(ValueError, match="unknown section 'nope'"):
        run_section("nope", quick=True)
    with pytest.raises(ValueError, match="with a 'sections' dict"):
        format_results({"rows": []})
    with pytest.raises(ValueError, match=r"a row of results is missing \['ratio', 'reference'\]"):
        format_results({"sections": {"x": {"rows": [{"measurement": "m", "value": 1.0,
                                                      "unit": "ms"}]}}})
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot write to --out"):
        output_folder(str(tmp_path / "file"))
    with pytest.raises(ValueError, match="unknown model 'resnet'; choose one of mlp, cnn"):
        benchmark_dp_step("resnet")
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        benchmark_dp_step("mlp", batch_size=0)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        benchmark_keras_hub(batch_size=0)


def test_the_keras_hub_benchmark_times_each_method_against_its_own_batch_gradient():
    from gradtut.bench.per_example import benchmark_keras_hub

    rows = benchmark_keras_hub(lora_rank=2, batch_size=4, steps=8, repeats=1)
    assert [r["method"] for r in rows] == ["batch gradient", "ghost norms", "clipped"]
    assert rows[0]["ratio"] == 1.0 and all(r["median_ms"] > 0 and r["ratio"] > 0 for r in rows)
    peaks = {r["method"]: r["peak_ratio"] for r in rows}
    assert peaks["ghost norms"] is None
    if peaks["clipped"] is not None:  # allocator statistics on (gradtut.setup() in conftest)
        assert peaks["batch gradient"] == 1.0 and peaks["clipped"] > 0


def test_the_matmul_floor_writes_each_dense_kernel_per_example():
    from gradtut.bench.per_example import _matmul_floor_fn, benchmark_per_example
    from gradtut.models import mlp

    model = mlp(input_dim=5, hidden=4, classes=3)
    out = _matmul_floor_fn(model, 6)()
    assert [tuple(t.shape) for t in out] == [(6, 5, 4), (6, 4, 3)]
    rows = benchmark_per_example(batch_sizes=(6,), methods=("outer", "matmul floor"), repeats=1,
                                 input_dim=5, hidden=4, classes=3)
    assert {r["method"] for r in rows} == {"batch gradient", "outer", "matmul floor"}


def test_the_dp_step_benchmark_times_the_audited_step_against_the_plain_one():
    from gradtut.bench.per_example import benchmark_dp_step

    r = benchmark_dp_step("mlp", batch_size=16, repeats=1, canaries=100)
    assert r["canaries"] == 100 and r["audited_ms"] > 0
    assert r["audited_ratio"] == pytest.approx(r["audited_ms"] / r["median_ms"])
