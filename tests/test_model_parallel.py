"""The pipeline model against the GPipe bubble formula and hand-checked small cases."""
import itertools

import pytest

from gradtut.model_parallel import (
    activations_in_flight,
    balanced_boundaries,
    bubble_fraction,
    schedule_order,
    simulate_pipeline,
    stage_times,
)


def spans_of(timeline):
    """{(stage, micro-batch, phase): (start, end)} for every event of a timeline."""
    return {(e["stage"], e["microbatch"], e["phase"]): (e["start"], e["end"]) for e in timeline}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 7, 16])
def test_equal_stages_match_the_gpipe_bubble_formula(stages, microbatches, schedule):
    result = simulate_pipeline([1.0] * stages, microbatches, schedule=schedule)
    expected = (stages - 1) / (microbatches + stages - 1)
    assert result["bubble_fraction"] == pytest.approx(expected)
    assert result["makespan"] == pytest.approx(3.0 * (microbatches + stages - 1))  # f + 2f


def test_two_stages_two_microbatches_by_hand():
    timeline = simulate_pipeline([(1.0, 1.0), (1.0, 1.0)], 2)["timeline"]
    spans = spans_of(timeline)
    assert spans == {
        (0, 0, "forward"): (0.0, 1.0), (0, 1, "forward"): (1.0, 2.0),
        (1, 0, "forward"): (1.0, 2.0), (1, 1, "forward"): (2.0, 3.0),
        (1, 1, "backward"): (3.0, 4.0), (1, 0, "backward"): (4.0, 5.0),
        (0, 1, "backward"): (4.0, 5.0), (0, 0, "backward"): (5.0, 6.0),
    }


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_no_stage_runs_two_things_at_once_and_dependencies_hold(schedule):
    result = simulate_pipeline([1.0, 3.0, 2.0], 5, schedule=schedule)
    by_stage = {}
    for e in result["timeline"]:
        by_stage.setdefault(e["stage"], []).append((e["start"], e["end"]))
    for spans in by_stage.values():
        spans.sort()
        assert all(a_end <= b_start + 1e-12
                   for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    end = {(e["stage"], e["microbatch"], e["phase"]): e["end"] for e in result["timeline"]}
    start = {(e["stage"], e["microbatch"], e["phase"]): e["start"] for e in result["timeline"]}
    for j in range(5):
        assert start[1, j, "forward"] >= end[0, j, "forward"]
        assert start[1, j, "backward"] >= end[2, j, "backward"]
        assert start[2, j, "backward"] >= end[2, j, "forward"]


def test_a_slow_stage_sets_the_pace():
    balanced = simulate_pipeline([2.0, 2.0], 8)["makespan"]
    unbalanced = simulate_pipeline([1.0, 3.0], 8)["makespan"]
    assert unbalanced > balanced


@pytest.mark.parametrize("kwargs, message", [
    ({"stage_times": [], "num_microbatches": 2}, "stage_times is empty"),
    ({"stage_times": [1.0, 0.0], "num_microbatches": 2}, "stage 1: forward and backward times"),
    ({"stage_times": [1.0], "num_microbatches": 0}, "num_microbatches must be a positive int"),
    ({"stage_times": [1.0], "num_microbatches": 2, "schedule": "zero-bubble"}, "unknown schedule"),
])
def test_bad_arguments_get_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulate_pipeline(**kwargs)


def test_1f1b_by_hand_and_its_activation_memory():
    timeline = simulate_pipeline([(1.0, 1.0), (1.0, 1.0)], 3, schedule="1f1b")["timeline"]
    spans = spans_of(timeline)
    assert spans == {
        (0, 0, "forward"): (0.0, 1.0), (1, 0, "forward"): (1.0, 2.0),
        (0, 1, "forward"): (1.0, 2.0), (1, 0, "backward"): (2.0, 3.0),
        (1, 1, "forward"): (3.0, 4.0), (0, 0, "backward"): (3.0, 4.0),
        (0, 2, "forward"): (4.0, 5.0), (1, 1, "backward"): (4.0, 5.0),
        (0, 1, "backward"): (5.0, 6.0), (1, 2, "forward"): (5.0, 6.0),
        (1, 2, "backward"): (6.0, 7.0), (0, 2, "backward"): (7.0, 8.0),
    }
    held_1f1b = activations_in_flight(simulate_pipeline([1.0] * 4, 8, schedule="1f1b")["timeline"])
    held_gpipe = activations_in_flight(simulate_pipeline([1.0] * 4, 8)["timeline"])
    assert held_1f1b == [4, 3, 2, 1] and held_gpipe == [8, 8, 8, 8]


def test_schedule_order_covers_every_microbatch_once():
    for schedule in ("gpipe", "1f1b"):
        for stage in range(4):
            order = schedule_order(schedule, stage, 4, 6)
            assert sorted(order) == sorted((p, j) for p in ("forward", "backward")
                                           for j in range(6))


def event(stage, phase, start, end, microbatch=0):
    return {"stage": stage, "microbatch": microbatch, "phase": phase, "start": start, "end": end}


def test_schedule_order_refuses_a_stage_outside_the_pipeline():
    with pytest.raises(ValueError, match="stage 5 does not exist in a pipeline of 2 stages"):
        schedule_order("gpipe", 5, 2, 4)
    with pytest.raises(ValueError, match="stage must be an int >= 0"):
        schedule_order("1f1b", -1, 2, 4)
    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        schedule_order("gpipe", 0, 2, True)


def test_numpy_integers_count_as_ints():
    import numpy as np
    assert simulate_pipeline([1.0, 1.0], np.int64(4)) == simulate_pipeline([1.0, 1.0], 4)
    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        simulate_pipeline([1.0, 1.0], 4.0)


@pytest.mark.parametrize("analysis", [bubble_fraction, stage_times, activations_in_flight])
def test_timeline_analyses_refuse_empty_malformed_or_zero_length_timelines(analysis):
    with pytest.raises(ValueError, match="the timeline is empty"):
        analysis([])
    with pytest.raises(ValueError, match="timeline events are dicts with keys"):
        analysis([{"stage": 0, "phase": "forward"}])
    with pytest.raises(ValueError, match="ends before it starts"):
        analysis([event(0, "forward", 2.0, 1.0)])
    with pytest.raises(ValueError, match="zero length"):
        analysis([event(0, "forward", 1.0, 1.0), event(0, "backward", 1.0, 1.0)])


def test_stage_times_name_a_missing_phase_instead_of_returning_nan():
    forward_only = [event(0, "forward", 0.0, 1.0), event(1, "forward", 1.0, 2.0)]
    with pytest.raises(ValueError, match="stage 0 has no backward event"):
        stage_times(forward_only)
    whole = simulate_pipeline([1.0, 2.0], 3)["timeline"]  # and a whole step replays exactly
    assert stage_times(whole) == [(1.0, 2.0), (2.0, 4.0)]


def test_balanced_boundaries_refuses_impossible_splits():
    assert balanced_boundaries([4, 1, 1, 1, 1], 2) == [1]
    with pytest.raises(ValueError, match="3 costs cannot form 4 non-empty stages"):
        balanced_boundaries([1, 2, 3], 4)
    with pytest.raises(ValueError, match="costs must be finite and >= 0"):
        balanced_boundaries([1, -2, 3], 2)
    with pytest.raises(ValueError, match="num_stages must be a positive int"):
        balanced_boundaries([1, 2, 3], 0)
