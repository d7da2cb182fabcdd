"""Measuring: time and peak memory, for ratios to a reference measured in the same run.

Introduced in notebook 01; notebooks 02-05 and ``python -m gradtut bench`` use it.
Wall-clock numbers on a shared 2-core machine drift from minute to minute, so
:func:`compare_timings` times the callables interleaved, round by round, and reports medians,
with ratios when a reference is named. :func:`time_callable` times one callable and
:func:`peak_memory_bytes` measures one call's peak in bytes; set those beside a reference
measured the same way yourself.
"""
import statistics
import time
from dataclasses import dataclass, field

import tensorflow as tf

from gradtut.checks import check_int
from gradtut.session import allocator_statistics


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
      TypeError: ``fn`` is not callable.

    Example:
      >>> t = time_callable(lambda: sum(range(1000)), repeats=5)
      >>> t.median_s > 0
      True
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}: pass the function and "
                        "its arguments, time_callable(f, x)")
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
      TypeError: a value that is not callable.

    Example:
      >>> [t.name for t in compare_timings({"a": lambda: 1, "b": lambda: 2}, "a", repeats=2)]
      ['a', 'b']
    """
    if not callables:
        raise ValueError("nothing to time: callables is empty")
    repeats, warmup = check_int(repeats, "repeats"), check_int(warmup, "warmup", minimum=0)
    not_callable = [name for name, fn in callables.items() if not callable(fn)]
    if not_callable:
        raise TypeError(f"{not_callable} are not callable: pass zero-argument functions, e.g. "
                        "lambda: f(x)")
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

    Needs allocator statistics of every block: on a CPU, the BFC allocator, which
    ``gradtut.setup()`` switches on (``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow
    starts). TensorFlow's default CPU allocator counts none (oneDNN off) or only blocks of
    256 kB and more (oneDNN on), which would give a peak too low; both are refused.

    Raises:
      TypeError: ``fn`` is not callable.
      RuntimeError: the allocator of ``device`` does not count every block, with the fix.

    Example:
      >>> peak_memory_bytes(lambda: tf.zeros([1024, 1024])) >= 4 * 1024 * 1024  # 4 MB of floats
      True
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}: pass the function and "
                        "its arguments, peak_memory_bytes(f, x)")
    statistics = allocator_statistics(device)
    if statistics != "all blocks":
        raise RuntimeError(
            f"the allocator of {device} does not count every block (its statistics: "
            f"{statistics}; see gradtut.session.allocator_statistics). On a CPU, start "
            "TensorFlow with TF_CPU_ALLOCATOR_USE_BFC=true: restart the kernel and call "
            "gradtut.setup() first (it sets this), or measure in a fresh process with "
            "gradtut.session.run_in_subprocess(...)."
        )
    tf.config.experimental.reset_memory_stats(device)
    start = tf.config.experimental.get_memory_info(device)["current"]
    _wait_for(fn(*args))
    return tf.config.experimental.get_memory_info(device)["peak"] - start


def format_table(rows, columns):
    """Render ``rows`` (dicts) as a fixed-width text table with the given column keys.

    Floats are shown with 3 significant digits; a missing key leaves its cell empty. Raises
    ValueError for no columns or rows that are not dicts. Example:
      >>> print(format_table([{"method": "batch", "ms": 4.0}], ["method", "ms"]))
      method  ms
      batch   4
    """
    if isinstance(columns, str) or not columns:
        raise ValueError(f"columns must be a non-empty list of keys, got {columns!r}")
    if any(not isinstance(r, dict) for r in rows):
        raise ValueError("rows must be dicts, one per table row")

    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    body = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths, strict=True)).rstrip() for b in body]
    return "\n".join(lines)
