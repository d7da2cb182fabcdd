"""The ring all-reduce cost model: seconds to sum a gradient over workers, and the step time
it predicts (notebook 03, section 4 and the answer to exercise 3)."""
from gradtut.checks import check_int, check_real


def _non_negative(value, name):
    value = check_real(value, name)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def ring_allreduce_seconds(gradient_bytes, workers, bandwidth_bytes_per_s, latency_s=0.0):
    """Time of a ring all-reduce of ``gradient_bytes`` over ``workers``, by the standard model.

    Each worker sends and receives ``2 (N - 1) / N`` times the gradient's size (a
    reduce-scatter then an all-gather, each ``N - 1`` steps of ``1/N`` of the data), over links
    of ``bandwidth_bytes_per_s``, plus ``2 (N - 1)`` message latencies. A model, not a
    measurement: it ignores overlap with computation, congestion and protocol overhead.

    Raises:
      ValueError: ``workers`` is not a positive int; ``gradient_bytes`` or ``latency_s`` is
        not a real number >= 0; the bandwidth is not a positive real number.

    Example:
      >>> round(ring_allreduce_seconds(4e8, 8, 12.5e9), 4)   # 100M float32 over 100 Gb/s
      0.056
    """
    workers = check_int(workers, "workers")
    gradient_bytes = _non_negative(gradient_bytes, "gradient_bytes")
    latency_s = _non_negative(latency_s, "latency_s")
    if check_real(bandwidth_bytes_per_s, "bandwidth_bytes_per_s") <= 0:
        raise ValueError(f"bandwidth_bytes_per_s must be a positive bandwidth (bytes per second), "
                         f"got {bandwidth_bytes_per_s!r}")
    if workers == 1:
        return 0.0
    steps = 2 * (workers - 1)
    return steps / workers * gradient_bytes / bandwidth_bytes_per_s + steps * latency_s


def predicted_step_seconds(compute_seconds_per_example, global_batch_size, gradient_bytes,
                           workers, bandwidth_bytes_per_s, latency_s=0.0):
    """Data-parallel step time by a simple model: each worker's compute on its share of the
    global batch, then a ring all-reduce that does not overlap with it. A model, not a
    measurement; real frameworks overlap communication with the backward pass.

    Raises:
      ValueError: ``global_batch_size`` or ``workers`` is not a positive int,
        ``compute_seconds_per_example`` is not a real number >= 0, and as
        :func:`ring_allreduce_seconds`.

    Example:
      >>> round(predicted_step_seconds(1e-3, 1024, 4e8, 8, 12.5e9), 4)  # 0.128 s + 0.056 s
      0.184
    """
    compute_seconds_per_example = _non_negative(compute_seconds_per_example,
                                                "compute_seconds_per_example")
    global_batch_size = check_int(global_batch_size, "global_batch_size")
    communication = ring_allreduce_seconds(gradient_bytes, workers, bandwidth_bytes_per_s,
                                           latency_s)
    return compute_seconds_per_example * global_batch_size / workers + communication
