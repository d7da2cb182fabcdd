"""One idempotent set-up call for the first cell of every gradtut notebook.

Introduced in notebook 01. It must run before anything else touches TensorFlow, because three
of the settings it makes are read only once, when TensorFlow's runtime starts: the C++ log
level, the CPU allocator, and the number of virtual CPU devices.

This module does not import TensorFlow at module level, so ``import gradtut`` stays cheap and
leaves the start-up settings to :func:`setup`.
"""
import contextlib
import os
import random

_BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"
_applied = None  # the settings of the first successful call in this process


class RestartKernelError(RuntimeError):
    """TensorFlow already started with settings that can only change in a new process."""


class CapturedText:
    """What :func:`captured_stderr` caught; ``text`` is filled in when the block ends."""

    text = ""


@contextlib.contextmanager
def captured_stderr():
    """Catch what is written to file descriptor 2 inside the block (where C++ code logs; a
    notebook's Python ``sys.stderr`` is a different channel).

    TensorFlow's C++ runtime logs straight to fd 2, and some of its lines depend on the CPU
    ("oneDNN supports DT_HALF only on platforms with AVX-512 ..."). In a notebook they land in
    the cell's output, which nbval compares, so a cell that can trigger them catches them and
    prints them where the output may vary. Python exceptions still propagate normally.

    Example:
      >>> with captured_stderr() as said:
      ...     _ = os.write(2, b"a line from C++\\n")
      >>> said.text
      'a line from C++\\n'
    """
    import sys
    import tempfile

    caught = CapturedText()
    sys.stderr.flush()
    try:
        fd = os.dup(2)
    except OSError:  # no stderr at all: nothing to catch
        yield caught
        return
    with tempfile.TemporaryFile(mode="w+b") as sink:
        try:
            os.dup2(sink.fileno(), 2)
            try:
                yield caught
            finally:
                sys.stderr.flush()
                os.dup2(fd, 2)
        finally:
            os.close(fd)
            sink.seek(0)
            caught.text = sink.read().decode("utf-8", "replace")


def _runtime_started():
    """True once TensorFlow's eager context (and with it the allocator and devices) exists."""
    import sys

    if "tensorflow" not in sys.modules:
        return False
    from tensorflow.python.eager import context

    return context.context()._context_handle is not None  # pylint: disable=protected-access


def _positive_int(value, name):
    """``value`` as an int >= 1; bools and non-integers refused. A copy of
    ``gradtut.checks.check_int`` kept here on purpose: this module must not import TensorFlow
    (``checks`` does) before :func:`setup` has set the start-up options."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or value < 1:
        raise ValueError(f"{name} must be None or a positive int, got {value!r}; pass a "
                         "whole number such as 2")
    return int(value)


def _make_virtual_cpus(tf, virtual_cpus, started_before):
    """Split the CPU into ``virtual_cpus`` logical devices (a no-op when already so)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    wanted = [tf.config.LogicalDeviceConfiguration() for _ in range(virtual_cpus)]
    current = tf.config.get_logical_device_configuration(cpu)
    have = 1 if current is None else len(current)
    # Re-applying the same count is a no-op; TensorFlow refuses any change after start.
    if have != virtual_cpus or (current is None and not started_before):
        try:
            tf.config.set_logical_device_configuration(cpu, wanted)
        except RuntimeError as err:
            raise RestartKernelError(
                f"TensorFlow already started with {have} CPU device(s), so it cannot "
                f"create {virtual_cpus} virtual CPUs ({err}). Restart the kernel and "
                "run gradtut.setup(...) in the first cell, before any other TensorFlow "
                "code."
            ) from None


def _set_intra_op_threads(tf, intra_op_threads, started_before):
    """Set the intra-op thread count, or refuse if TensorFlow already runs with another."""
    current_threads = tf.config.threading.get_intra_op_parallelism_threads()
    if started_before and current_threads != intra_op_threads:
        raise RestartKernelError(
            f"TensorFlow already started with intra_op_threads={current_threads or 'default'}"
            f", so it cannot switch to {intra_op_threads}. Restart the kernel and run "
            "gradtut.setup(...) in the first cell.")
    if not started_before:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)


def setup(seed=0, virtual_cpus=None, bfc_allocator=True, deterministic=True,
          intra_op_threads=None):
    """Prepare TensorFlow for a notebook: quiet logs, seeds, determinism, allocator, devices.

    Call it once, first, in a notebook's set-up cell; calling it again with the same arguments
    changes nothing but the seeds, which it sets again (so a re-run cell gives the same
    numbers).

    Args:
      seed: int seed for Python's ``random``, NumPy and TensorFlow
        (``keras.utils.set_random_seed``).
      virtual_cpus: None to keep TensorFlow's one CPU device, or N >= 1 to split the physical CPU
        into N logical devices ``/device:CPU:0`` ... ``CPU:N-1`` (data- and model-parallel
        notebooks use these). They share the machine's cores: more devices than cores show
        structure, not speed; with ``intra_op_threads=1`` each op uses one core, so up to one
        device per core can work at once (notebook 04).
      bfc_allocator: use TensorFlow's BFC allocator on the CPU (``TF_CPU_ALLOCATOR_USE_BFC=true``).
        It reuses freed memory instead of asking the OS for fresh pages, and it makes
        ``tf.config.experimental.get_memory_info("CPU:0")`` (peak memory) count every block
        (with oneDNN on, the default allocator counts only blocks of 256 kB and more; without
        oneDNN it counts none; notebook 05, section 9). x86-64 Linux
        builds with oneDNN on (TensorFlow's default on Linux on CPUs with AVX512_VNNI,
        AVX512_BF16, AVX_VNNI or AMX, tensorflow/core/util/port.cc) already hand large blocks
        to a BFC allocator (mkl_cpu_allocator.h); where oneDNN is off
        (``TF_ENABLE_ONEDNN_OPTS=0``, AVX2-only CPUs, builds without it) notebook 05, section 9,
        measures materialised per-example gradients several times faster with it (2x-7x
        across runs). Where it did not help it cost at most 8% in those runs, so it is on by
        default.
      deterministic: call ``tf.config.experimental.enable_op_determinism()``.
      intra_op_threads: None for TensorFlow's default (every core works on each op), or N >= 1
        threads per op. Notebook 04 uses 1: each op then uses one core, so two pipeline
        stages' ops can run at once, roughly as on two real devices (the stages still share
        the two cores: a stage's independent ops can run side by side).

    Returns:
      dict with ``"tensorflow"``, ``"keras"``, ``"devices"`` (logical device names) and
      ``"bfc_allocator"`` (whether the allocator reports memory statistics).

    Raises:
      RestartKernelError: TensorFlow already started in this process with a different device
        count, or (with ``bfc_allocator=True``) with its default CPU allocator, whose
        statistics count no blocks (oneDNN off) or only blocks of 256 kB and more (oneDNN on);
        the message says to restart the kernel and run this cell first.
      ValueError: ``virtual_cpus`` or ``intra_op_threads`` is not a positive integer.

    Example:
      >>> import gradtut
      >>> # skipped when run: the settings are fixed once per process, and the tests made them
      >>> info = gradtut.setup(seed=0, virtual_cpus=4)  # doctest: +SKIP
      >>> info["devices"]  # doctest: +SKIP
      ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2', '/device:CPU:3']
    """
    global _applied
    if virtual_cpus is not None:
        virtual_cpus = _positive_int(virtual_cpus, "virtual_cpus")
    if intra_op_threads is not None:
        intra_op_threads = _positive_int(intra_op_threads, "intra_op_threads")
    settings = (virtual_cpus, bool(bfc_allocator), bool(deterministic), intra_op_threads)
    if _applied is not None and _applied != settings:
        raise RestartKernelError(
            f"gradtut.setup() already ran in this process with virtual_cpus={_applied[0]}, "
            f"bfc_allocator={_applied[1]}, deterministic={_applied[2]}, "
            f"intra_op_threads={_applied[3]}; TensorFlow cannot change these once it has "
            "started. Restart the kernel (Kernel > Restart Kernel) and run the set-up cell first."
        )

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    started_before = _runtime_started()
    if bfc_allocator and not started_before:
        os.environ[_BFC_ENV] = "true"

    # TensorFlow's C++ side logs "oneDNN custom operations are on", "Could not find cuda
    # drivers" and "failed call to cuInit" through absl *before* absl's logging is initialised,
    # and those lines ignore TF_CPP_MIN_LOG_LEVEL (abseil/abseil-cpp#1718, #1957). In a notebook
    # they would land in the cell's stderr, which nbval compares: catch and drop them.
    with captured_stderr():
        import keras
        import tensorflow as tf  # noqa: F401  (imported here so the log-level setting applies)

        tf.get_logger().setLevel("ERROR")
        if virtual_cpus is not None:
            _make_virtual_cpus(tf, virtual_cpus, started_before)
        if intra_op_threads is not None:
            _set_intra_op_threads(tf, intra_op_threads, started_before)
        devices = [d.name for d in tf.config.list_logical_devices()]  # starts the runtime

    statistics = allocator_statistics()
    has_stats = statistics == "all blocks"
    if bfc_allocator and not has_stats:
        counted = "no blocks" if statistics == "none" else "only blocks of 256 kB and more"
        raise RestartKernelError(
            "TensorFlow already started with its default CPU allocator, whose statistics count "
            f"{counted}, so the BFC allocator ({_BFC_ENV}=true) cannot be switched on now. "
            "Restart the kernel and run gradtut.setup(...) first, or pass bfc_allocator=False."
        )
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    random.seed(seed)
    keras.utils.set_random_seed(seed)
    _applied = settings
    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "devices": devices,
        "bfc_allocator": has_stats,
    }


def allocator_statistics(device="CPU:0"):
    """Which blocks TensorFlow's allocator on ``device`` counts in its memory statistics.

    Returns ``"all blocks"`` (the BFC allocator, which :func:`setup` chooses on a CPU),
    ``"large blocks only"`` (oneDNN's CPU allocator, TensorFlow's default where oneDNN is on:
    blocks under 256 kB go straight to ``malloc``, without statistics, ``mkl_cpu_allocator.h``,
    so its peaks miss them; notebook 05, section 9) or ``"none"`` (the plain allocator, oneDNN off).
    A 4 kB probe tensor, which only the first counts, tells the first two apart.

    Example:
      >>> allocator_statistics("CPU:0") in ("all blocks", "large blocks only", "none")
      True
    """
    if not isinstance(device, str) or not device:
        raise ValueError(f"device must be a device name such as 'CPU:0', got {device!r}")
    import tensorflow as tf

    try:
        before = tf.config.experimental.get_memory_info(device)["current"]
    except (ValueError, RuntimeError):
        return "none"
    with tf.device(device):
        probe = tf.random.stateless_uniform([1024], seed=[0, 0])  # 4 kB, on the device
    counted = tf.config.experimental.get_memory_info(device)["current"] > before
    del probe
    return "all blocks" if counted else "large blocks only"


def allocator_has_stats(device="CPU:0"):
    """Whether TensorFlow's allocator on ``device`` keeps memory statistics of every block (on
    a CPU, the BFC allocator, chosen before TensorFlow starts, as :func:`setup` does; see
    :func:`allocator_statistics` for the allocators that count fewer or none).

    Example:
      >>> allocator_has_stats("CPU:0") in (True, False)
      True
    """
    return allocator_statistics(device) == "all blocks"


# --- running a function in a fresh Python process -------------------------------------------
# The package's one way to do it: run_in_subprocess (one child, wait for it), and the
# cluster launchers in gradtut.cluster (several children at once), both build the
# child's command with child_command and read its answer with child_result.

_RESULT_MARK = "@@RESULT@@"
_CHILD_MAIN = f"""
import importlib, json, sys
module_name, function_name, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
result = getattr(importlib.import_module(module_name), function_name)(**kwargs)
sys.stdout.write("\\n{_RESULT_MARK}" + json.dumps(result))
"""


def child_command(module, function, kwargs=None):
    """The command line that runs ``module.function(**kwargs)`` in a new Python process and
    prints its JSON result where :func:`child_result` finds it.

    Raises:
      ValueError: ``kwargs`` is not JSON-serialisable, or a name is not a non-empty string.

    Example:
      >>> child_command("json", "dumps", {"obj": [1, 2]})[-3:]
      ['json', 'dumps', '{"obj": [1, 2]}']
    """
    import json
    import sys

    for what, name in (("module", module), ("function", function)):
        if not isinstance(name, str) or not name:
            raise ValueError(f"{what} must be a non-empty name (a string), got {name!r}")
    try:
        arguments = json.dumps(kwargs or {})
    except TypeError as err:
        raise ValueError(f"kwargs for {module}.{function} must be JSON-serialisable ({err}): "
                         "pass numbers, strings, lists and dicts") from None
    return [sys.executable, "-c", _CHILD_MAIN, module, function, arguments]


def child_result(stdout):
    """``(printed text, result)`` from the standard output of a :func:`child_command` process;
    the result is None when the child printed none (it failed, or ran a script).

    Example:
      >>> child_result('hello\\n@@RESULT@@{"a": 1}')
      ('hello', {'a': 1})
    """
    import json

    if not isinstance(stdout, str):
        raise ValueError(f"stdout must be the child's output as text, got "
                         f"{type(stdout).__name__}: decode bytes first")
    marker = "\n" + _RESULT_MARK
    if marker not in stdout:
        return stdout, None
    text, _, result = stdout.rpartition(marker)
    return text, json.loads(result)


def run_in_subprocess(module, function, kwargs=None, env=None, timeout_s=600):
    """Call ``module.function(**kwargs)`` in a fresh Python process and return its JSON result.

    Settings that TensorFlow reads once at start-up (the CPU allocator, virtual devices,
    oneDNN) can only be compared across processes; this runs each side in its own.

    Args:
      module: importable module name, e.g. ``"gradtut.efficiency"``.
      function: name of a function in it returning something JSON-serialisable.
      kwargs: JSON-serialisable keyword arguments.
      env: extra environment variables for the child (merged over this process's).
      timeout_s: the child is killed after this many seconds.

    Raises:
      ValueError: bad names or kwargs (see :func:`child_command`), or ``timeout_s <= 0``.
      RuntimeError: the child failed or timed out; the message has the tail of its stderr.

    Example:
      >>> run_in_subprocess("json", "dumps", {"obj": [1, 2]})
      '[1, 2]'
    """
    import subprocess

    command = child_command(module, function, kwargs)
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    child_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=child_env,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:  # subprocess.run has killed the child
        raise RuntimeError(f"{module}.{function} did not finish within {timeout_s} s") from None
    _, result = child_result(proc.stdout)
    if proc.returncode != 0 or "\n" + _RESULT_MARK not in proc.stdout:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{module}.{function} failed (exit {proc.returncode}):\n{tail}")
    return result
