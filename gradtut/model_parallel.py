"""Model parallelism: pipeline schedules (notebook 04, in progress).

So far this module holds the discrete-event pipeline model that notebook 04 uses to plan and
check pipeline schedules; the TensorFlow parts (stage placement, a measured GPipe schedule,
tensor splits, DTensor) are still to come.
"""


def _stage_costs(stage_times, backward_factor):
    costs = []
    for i, t in enumerate(stage_times):
        forward, backward = (t if isinstance(t, (tuple, list)) else (t, backward_factor * t))
        if not forward > 0 or not backward > 0:
            raise ValueError(f"stage {i}: forward and backward times must be positive, got "
                             f"{forward!r} and {backward!r}")
        costs.append((float(forward), float(backward)))
    return costs


def simulate_pipeline(stage_times, num_microbatches, schedule="gpipe", backward_factor=2.0):
    """Discrete-event model of a pipeline-parallel training step.

    Stage s runs forward on micro-batch j once stage s-1 has finished it and stage s has
    finished micro-batch j-1 (one device per stage, one thing at a time). With the GPipe
    schedule every stage runs all its forwards, then the backwards in reverse micro-batch order,
    each starting once the next stage has sent that micro-batch's gradient back.

    Args:
      stage_times: per stage, the forward time of one micro-batch (its backward then takes
        ``backward_factor`` times as long), or a ``(forward, backward)`` pair.
      num_microbatches: micro-batches per step (positive int).
      schedule: ``"gpipe"`` (the only schedule modelled so far).
      backward_factor: backward / forward time when only forward times are given.

    Returns:
      dict with ``"timeline"``, a list of ``{"stage", "microbatch", "phase", "start", "end"}``
      (phase ``"forward"`` or ``"backward"``), ``"makespan"``, and ``"bubble_fraction"``: the
      share of device-time idle, ``1 - busy / (stages x makespan)``. For equal stages this is
      ``(p - 1) / (m + p - 1)`` for p stages and m micro-batches.

    Raises:
      ValueError: no stages, a non-positive time, ``num_microbatches < 1``, or an unknown
        schedule.

    Example:
      >>> round(simulate_pipeline([1.0] * 4, 8)["bubble_fraction"], 4)   # 3 / 11
      0.2727
    """
    if schedule != "gpipe":
        raise ValueError(f"unknown schedule {schedule!r}; modelled so far: 'gpipe'")
    if not stage_times:
        raise ValueError("stage_times is empty: a pipeline needs at least one stage")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    costs = _stage_costs(stage_times, backward_factor)
    stages, m = len(costs), num_microbatches
    forward_end = [[0.0] * m for _ in range(stages)]
    timeline = []
    for s, (forward, _) in enumerate(costs):
        free = 0.0
        for j in range(m):
            start = max(free, forward_end[s - 1][j] if s else 0.0)
            free = forward_end[s][j] = start + forward
            timeline.append({"stage": s, "microbatch": j, "phase": "forward", "start": start,
                             "end": free})
    backward_end = [[0.0] * m for _ in range(stages)]
    for s in reversed(range(stages)):
        free = forward_end[s][-1]  # GPipe: backwards start after the stage's last forward
        for j in reversed(range(m)):
            start = max(free, backward_end[s + 1][j] if s + 1 < stages else 0.0)
            free = backward_end[s][j] = start + costs[s][1]
            timeline.append({"stage": s, "microbatch": j, "phase": "backward", "start": start,
                             "end": free})
    makespan = max(event["end"] for event in timeline)
    busy = sum(event["end"] - event["start"] for event in timeline)
    timeline.sort(key=lambda e: (e["start"], e["stage"]))
    return {"timeline": timeline, "makespan": makespan,
            "bubble_fraction": 1.0 - busy / (stages * makespan)}
