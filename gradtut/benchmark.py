"""Timing, peak memory and plots, always as ratios to a reference measured in the same run.

Introduced in notebook 01; notebooks 02-05 and ``python -m gradtut.bench_per_example`` use it.
Wall-clock numbers on a shared 2-core machine drift from minute to minute, so every helper
here measures the reference alongside the methods (interleaved, round by round) and reports
medians and ratios rather than single timings.
"""
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import tensorflow as tf


@dataclass
class Timing:
    """Seconds per call of one callable: the median, the spread, and every repeat."""

    name: str
    median_s: float
    min_s: float
    max_s: float
    times_s: list = field(repr=False, default_factory=list)

    @property
    def median_ms(self):
        return 1e3 * self.median_s


def _wait_for(result):
    """Block until ``result`` is computed (GPU kernels run asynchronously), cheaply."""
    leaves = [t for t in tf.nest.flatten(result) if isinstance(t, (tf.Tensor, tf.Variable))]
    if leaves:
        tf.reshape(leaves[-1], [-1])[:1].numpy()
    return result


def _timing(name, times):
    return Timing(name, statistics.median(times), min(times), max(times), list(times))


def time_callable(fn, *args, warmup=1, repeats=7, name=None):
    """Time ``fn(*args)``: ``warmup`` untimed calls (tracing, allocation), then ``repeats`` timed.

    Args:
      fn: the callable; its result is waited for (``.numpy()`` of one element) before the clock
        stops.
      warmup: untimed calls first (>= 0); at least 1 for a ``tf.function``, which traces then.
      repeats: timed calls (>= 1).

    Returns:
      :class:`Timing` with median, min, max and all times in seconds.

    Raises:
      ValueError: ``repeats < 1`` or ``warmup < 0``.

    Example:
      >>> t = time_callable(lambda: sum(range(1000)), repeats=5)
      >>> t.median_s > 0
      True
    """
    return compare_timings({name or getattr(fn, "__name__", "fn"): lambda: fn(*args)},
                           warmup=warmup, repeats=repeats)[0]


def compare_timings(callables, reference=None, warmup=1, repeats=7):
    """Time several zero-argument callables in one run, interleaved round by round.

    Interleaving means slow drift of the machine (another process, thermal state) hits every
    method alike, so the ratios stay meaningful even when the absolute times move.

    Args:
      callables: dict ``{name: fn}`` of zero-argument callables.
      reference: name of the callable the others are compared with, or None.
      warmup, repeats: as in :func:`time_callable`.

    Returns:
      list of :class:`Timing` in the order given; when ``reference`` is set each carries a
      ``ratio`` attribute, its median over the reference's median.

    Raises:
      ValueError: an empty dict, ``repeats < 1``, ``warmup < 0``, or an unknown reference.
    """
    if not callables:
        raise ValueError("nothing to time: callables is empty")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if reference is not None and reference not in callables:
        raise ValueError(f"reference {reference!r} is not one of {list(callables)}")
    for fn in callables.values():
        for _ in range(warmup):
            _wait_for(fn())
    times = {name: [] for name in callables}
    for _ in range(repeats):
        for name, fn in callables.items():
            start = time.perf_counter()
            _wait_for(fn())
            times[name].append(time.perf_counter() - start)
    timings = [_timing(name, t) for name, t in times.items()]
    if reference is not None:
        ref = timings[list(callables).index(reference)].median_s
        for t in timings:
            t.ratio = t.median_s / ref
    return timings


def peak_memory_bytes(fn, *args, device="CPU:0"):
    """Peak bytes the TensorFlow allocator held above its starting level during ``fn(*args)``.

    Needs allocator statistics: on a CPU that means the BFC allocator, which
    ``gradtut.setup()`` switches on (``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow starts).

    Raises:
      RuntimeError: the allocator of ``device`` keeps no statistics, with the fix.

    Example:
      >>> peak_memory_bytes(lambda: tf.zeros([1024, 1024]))  # doctest: +SKIP
      4194304
    """
    try:
        tf.config.experimental.reset_memory_stats(device)
        start = tf.config.experimental.get_memory_info(device)["current"]
    except (ValueError, RuntimeError) as err:
        raise RuntimeError(
            f"the allocator of {device} keeps no statistics ({err}). On a CPU, start TensorFlow "
            "with TF_CPU_ALLOCATOR_USE_BFC=true: restart the kernel and call gradtut.setup() "
            "first (it sets this), or measure in a subprocess with run_in_subprocess(...)."
        ) from None
    _wait_for(fn(*args))
    return tf.config.experimental.get_memory_info(device)["peak"] - start


def run_in_subprocess(module, function, kwargs=None, env=None, timeout_s=600):
    """Call ``module.function(**kwargs)`` in a fresh Python process and return its JSON result.

    Settings that TensorFlow reads once at start-up (the CPU allocator, virtual devices) can
    only be compared across processes; this runs each side in its own.

    Args:
      module: importable module name, e.g. ``"gradtut.bench_per_example"``.
      function: name of a function in it returning something JSON-serialisable.
      kwargs: JSON-serialisable keyword arguments.
      env: extra environment variables for the child (merged over this process's).
      timeout_s: the child is killed after this many seconds.

    Raises:
      RuntimeError: the child failed or timed out; the message has the tail of its stderr.
    """
    code = (f"import json, sys, {module} as m; "
            f"r = m.{function}(**json.loads(sys.argv[1])); "
            "sys.stdout.write('\\n@@RESULT@@' + json.dumps(r))")
    child_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs or {})],
                              capture_output=True, text=True, env=child_env, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{module}.{function} did not finish within {timeout_s} s") from None
    if proc.returncode != 0 or "@@RESULT@@" not in proc.stdout:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{module}.{function} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout.rsplit("@@RESULT@@", 1)[1])


def format_table(rows, columns):
    """Render ``rows`` (dicts) as a fixed-width text table with the given column keys.

    Floats are shown with 3 significant digits. Example:
      >>> print(format_table([{"method": "batch", "ms": 4.0}], ["method", "ms"]))
      method  ms
      batch   4
    """
    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    body = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)).rstrip() for b in body]
    return "\n".join(lines)


def plot_method_vs_batch(rows, value="median_ms", title="Time per call by batch size",
                         ylabel="median time per call (ms)", ax=None):
    """Log-log plot of ``value`` against ``batch_size``, one line per ``method``.

    Args:
      rows: iterable of dicts with keys ``"method"``, ``"batch_size"`` and ``value``.
      ax: a matplotlib Axes to draw on, or None for a new figure.

    Returns:
      the matplotlib Axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for method in methods:
        points = sorted((r["batch_size"], r[value]) for r in rows if r["method"] == method)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (examples)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    return ax
