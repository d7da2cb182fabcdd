import os
import subprocess
import sys

import pytest

import gradtut
from gradtut.session import child_command, child_result, run_in_subprocess
from model_zoo import TEST_VIRTUAL_CPUS

AS_CONFTEST = {"virtual_cpus": TEST_VIRTUAL_CPUS}


def run_python(code, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=300)


def test_setup_is_idempotent_and_reports_the_allocator():
    first = gradtut.setup(seed=0, **AS_CONFTEST)
    again = gradtut.setup(seed=0, **AS_CONFTEST)
    assert first == again
    assert first["bfc_allocator"] is True
    assert first["tensorflow"].startswith("2.21.")


def test_setup_reseeds_so_a_rerun_cell_repeats_its_numbers():
    import tensorflow as tf
    gradtut.setup(seed=3, **AS_CONFTEST)
    a = tf.random.uniform([3]).numpy()
    gradtut.setup(seed=3, **AS_CONFTEST)
    assert (tf.random.uniform([3]).numpy() == a).all()
    gradtut.setup(seed=0, **AS_CONFTEST)


def test_a_different_device_count_in_the_same_process_says_restart():
    with pytest.raises(gradtut.RestartKernelError, match="Restart the kernel"):
        gradtut.setup(seed=0, virtual_cpus=2)
    with pytest.raises(gradtut.RestartKernelError, match="Restart the kernel"):
        gradtut.setup(seed=0)  # one CPU device, but this process started with 4


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True])
def test_virtual_cpus_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="positive int"):
        gradtut.setup(virtual_cpus=bad)


def test_setup_is_silent_and_creates_virtual_cpus():
    proc = run_python("import gradtut; info = gradtut.setup(virtual_cpus=3); "
                      "info2 = gradtut.setup(virtual_cpus=3); assert info == info2; "
                      "import tensorflow as tf; tf.reduce_sum(tf.ones(3)); print(info['devices'])")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.strip() == "['/device:CPU:0', '/device:CPU:1', '/device:CPU:2']"


def test_tensorflow_started_first_with_other_devices_says_restart():
    proc = run_python("import tensorflow as tf; tf.ones(1); import gradtut; "
                      "gradtut.setup(virtual_cpus=2, bfc_allocator=False)",
                      TF_CPP_MIN_LOG_LEVEL="3")
    assert proc.returncode != 0
    assert "RestartKernelError: TensorFlow already started with 1 CPU device(s)" in proc.stderr
    assert "Restart the kernel" in proc.stderr


def test_tensorflow_started_first_with_the_plain_allocator_says_restart():
    # With oneDNN off (as on builds without it), TensorFlow's default CPU allocator is the
    # plain one: no statistics, and no way to switch to BFC once the runtime has started.
    started_first = "import tensorflow as tf; tf.ones(1); import gradtut; "
    proc = run_python(started_first + "gradtut.setup()",
                      TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")
    assert proc.returncode != 0
    assert "cannot be switched on now. Restart the kernel" in proc.stderr
    ok = run_python(started_first + "print(gradtut.setup(bfc_allocator=False)['bfc_allocator'])",
                    TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "False"


def test_tensorflow_started_first_with_onednn_allocator_says_restart():
    # With oneDNN on, TensorFlow's default CPU allocator answers get_memory_info, but its
    # blocks under 256 kB go to a pool without statistics: peaks from it would be too low.
    started_first = ("import tensorflow as tf; tf.ones(1); import gradtut; "
                     "from gradtut.session import allocator_statistics; "
                     "print(tf.config.experimental.get_memory_info('CPU:0')['current'] >= 0, "
                     "allocator_statistics()); ")
    proc = run_python(started_first + "gradtut.setup()",
                      TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="1")
    assert proc.returncode != 0
    assert proc.stdout.strip() == "True large blocks only"
    assert "count only blocks of 256 kB and more" in proc.stderr
    assert "cannot be switched on now. Restart the kernel" in proc.stderr
    ok = run_python(started_first + "print(gradtut.setup(bfc_allocator=False)['bfc_allocator'])",
                    TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="1")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == ["True", "large", "blocks", "only", "False"]


def test_allocator_statistics_names_each_allocator():
    code = ("import tensorflow as tf; from gradtut.session import allocator_statistics; "
            "print(allocator_statistics())")
    answers = {run_python(code, TF_CPP_MIN_LOG_LEVEL="3", **env).stdout.strip()
               for env in ({"TF_ENABLE_ONEDNN_OPTS": "0"}, {"TF_ENABLE_ONEDNN_OPTS": "1"},
                           {"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPU_ALLOCATOR_USE_BFC": "true"})}
    assert answers == {"none", "large blocks only", "all blocks"}


def test_setup_first_gives_allocator_statistics_even_without_onednn():
    proc = run_python("import gradtut; print(gradtut.setup()['bfc_allocator'])",
                      TF_ENABLE_ONEDNN_OPTS="0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


@pytest.mark.parametrize("bad", [0, -2, 1.0, "1", True])
def test_intra_op_threads_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="intra_op_threads must be None or a positive int"):
        gradtut.setup(intra_op_threads=bad, **AS_CONFTEST)


def test_intra_op_threads_is_applied_and_cannot_change_later():
    proc = run_python("import gradtut; gradtut.setup(virtual_cpus=2, intra_op_threads=1); "
                      "import tensorflow as tf; tf.ones(1); "
                      "print(tf.config.threading.get_intra_op_parallelism_threads())")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1"
    with pytest.raises(gradtut.RestartKernelError, match="intra_op_threads"):
        gradtut.setup(intra_op_threads=1, **AS_CONFTEST)  # this process started with default


def test_captured_stderr_catches_the_file_descriptor_and_restores_it(capfd):
    with gradtut.captured_stderr() as said:
        os.write(2, b"from C++\n")
    os.write(2, b"after\n")
    assert said.text == "from C++\n"
    assert capfd.readouterr().err == "after\n"


def test_captured_stderr_keeps_what_it_caught_when_the_block_raises():
    with pytest.raises(ValueError, match="boom"):
        with gradtut.captured_stderr() as said:
            os.write(2, b"before the error\n")
            raise ValueError("boom")
    assert said.text == "before the error\n"


def test_run_in_subprocess_returns_the_result_and_reports_failures():
    assert run_in_subprocess("json", "loads", {"s": "[1, 2]"}) == [1, 2]
    with pytest.raises(RuntimeError, match=r"(?s)json.loads failed \(exit 1\):\n.*JSONDecodeError"):
        run_in_subprocess("json", "loads", {"s": "{"})
    with pytest.raises(RuntimeError, match="signal.pause did not finish within 1 s"):
        run_in_subprocess("signal", "pause", timeout_s=1)


def test_the_child_protocol_round_trips_and_refuses_bad_arguments():
    command = child_command("json", "dumps", {"obj": {"a": [1, 2]}})
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    assert child_result(proc.stdout) == ("", '{"a": [1, 2]}')
    assert child_result("no result here") == ("no result here", None)
    with pytest.raises(ValueError, match="must be JSON-serialisable"):
        child_command("json", "dumps", {"obj": object()})
    with pytest.raises(ValueError, match="module must be a non-empty name"):
        run_in_subprocess("", "dumps")
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        run_in_subprocess("json", "dumps", {"obj": 1}, timeout_s=0)
    with pytest.raises(ValueError, match="decode bytes first"):
        child_result(b"\n@@RESULT@@1")


def test_allocator_has_stats_names_a_bad_device():
    from gradtut.session import allocator_has_stats, allocator_statistics
    assert allocator_has_stats("CPU:0") is True  # the tests run after gradtut.setup()
    assert allocator_statistics("CPU:0") == "all blocks"
    with pytest.raises(ValueError, match="device must be a device name"):
        allocator_has_stats(0)
    with pytest.raises(ValueError, match="device must be a device name"):
        allocator_statistics("")
