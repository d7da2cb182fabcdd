"""The GPipe and 1F1B schedules, modelled: a timeline from stage times alone (notebook 04)."""
from gradtut.checks import check_int
from gradtut.model_parallel.pipeline import bubble_fraction


def _stage_costs(stage_times, backward_factor):
    costs = []
    for i, t in enumerate(stage_times):
        forward, backward = (t if isinstance(t, (tuple, list)) else (t, backward_factor * t))
        if not forward > 0 or not backward > 0:
            raise ValueError(f"stage {i}: forward and backward times must be positive, got "
                             f"{forward!r} and {backward!r}")
        costs.append((float(forward), float(backward)))
    return costs


SCHEDULES = ("gpipe", "1f1b")


def schedule_order(schedule, stage, num_stages, num_microbatches):
    """The order in which one stage runs its work: a list of ``(phase, microbatch)``.

    - ``"gpipe"``: every forward, then every backward in reverse micro-batch order;
    - ``"1f1b"`` (PipeDream-Flush): ``num_stages - stage - 1`` warm-up forwards, then one
      forward and one backward in turn, then the remaining backwards. Same bubble as GPipe, but
      a stage never holds more than ``num_stages - stage`` micro-batches' activations.

    Raises:
      ValueError: an unknown schedule, counts that are not positive ints, or a ``stage``
        outside ``0 .. num_stages - 1``.

    Example:
      >>> schedule_order("1f1b", 0, 2, 2)
      [('forward', 0), ('forward', 1), ('backward', 0), ('backward', 1)]
    """
    num_stages = check_int(num_stages, "num_stages")
    m = check_int(num_microbatches, "num_microbatches")
    stage = check_int(stage, "stage", minimum=0)
    if stage >= num_stages:
        raise ValueError(f"stage {stage} does not exist in a pipeline of {num_stages} stages: "
                         f"stages are numbered 0 to {num_stages - 1}")
    if schedule == "gpipe":
        return [("forward", j) for j in range(m)] + [("backward", j) for j in reversed(range(m))]
    if schedule == "1f1b":
        warmup = min(num_stages - stage - 1, m)
        order = [("forward", j) for j in range(warmup)]
        for j in range(m - warmup):
            order += [("forward", warmup + j), ("backward", j)]
        return order + [("backward", j) for j in range(m - warmup, m)]
    raise ValueError(f"unknown schedule {schedule!r}; modelled: {', '.join(SCHEDULES)}")


def simulate_pipeline(stage_times, num_microbatches, schedule="gpipe", backward_factor=2.0):
    """Discrete-event model of a pipeline-parallel training step.

    Each stage is one device doing one thing at a time, in the order its schedule gives
    (:func:`schedule_order`). A forward on micro-batch j starts once the previous stage has
    finished it; a backward once the next stage has sent that micro-batch's gradient back (the
    last stage's once its own forward is done).

    Args:
      stage_times: per stage, the forward time of one micro-batch (its backward then takes
        ``backward_factor`` times as long), or a ``(forward, backward)`` pair.
      num_microbatches: micro-batches per step (positive int).
      schedule: ``"gpipe"`` or ``"1f1b"``.
      backward_factor: backward / forward time when only forward times are given.

    Returns:
      dict with ``"timeline"``, a list of ``{"stage", "microbatch", "phase", "start", "end"}``
      (phase ``"forward"`` or ``"backward"``), ``"makespan"``, and ``"bubble_fraction"``: the
      share of device-time idle, ``1 - busy / (stages x makespan)``. For equal stages this is
      ``(p - 1) / (m + p - 1)`` for p stages and m micro-batches, for both schedules.

    Raises:
      ValueError: no stages, a non-positive time, ``num_microbatches < 1``, or an unknown
        schedule.

    Example:
      >>> round(simulate_pipeline([1.0] * 4, 8)["bubble_fraction"], 4)   # 3 / 11
      0.2727
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; modelled: {', '.join(SCHEDULES)}")
    if not stage_times:
        raise ValueError("stage_times is empty: a pipeline needs at least one stage")
    num_microbatches = check_int(num_microbatches, "num_microbatches")
    costs = _stage_costs(stage_times, backward_factor)
    stages, m = len(costs), num_microbatches
    orders = [schedule_order(schedule, s, stages, m) for s in range(stages)]
    done, free, position, timeline = {}, [0.0] * stages, [0] * stages, []

    def dependency(s, phase, j):
        if phase == "forward":
            return (s - 1, "forward", j) if s else None
        return (s + 1, "backward", j) if s + 1 < stages else (s, "forward", j)

    while len(timeline) < 2 * stages * m:
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                phase, j = orders[s][position[s]]
                needs = dependency(s, phase, j)
                if needs is not None and needs not in done:
                    break
                start = max(free[s], done[needs] if needs else 0.0)
                free[s] = done[s, phase, j] = start + costs[s][phase == "backward"]
                timeline.append({"stage": s, "microbatch": j, "phase": phase, "start": start,
                                 "end": free[s]})
                position[s] += 1
                progressed = True
        if not progressed:  # cannot happen for the schedules above; guards future ones
            raise RuntimeError(f"schedule {schedule!r} deadlocks")
    timeline.sort(key=lambda e: (e["start"], e["stage"]))
    return {"timeline": timeline, "makespan": max(event["end"] for event in timeline),
            "bubble_fraction": bubble_fraction(timeline)}
