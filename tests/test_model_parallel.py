"""The pipeline model against the GPipe bubble formula and hand-checked small cases."""
import pytest

from gradtut.model_parallel import activations_in_flight, schedule_order, simulate_pipeline


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
        assert all(a_end <= b_start + 1e-12 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
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


def test_plot_timeline_draws_one_box_per_event():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from gradtut.model_parallel import plot_timeline
    timeline = simulate_pipeline([1.0, 1.0, 1.0], 4)["timeline"]
    ax = plot_timeline(timeline, scale=1, xlabel="time (forward passes)")
    assert len(ax.collections) == len(timeline)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1", "stage 2"]
    assert ax.get_xlabel() == "time (forward passes)"
    plt.close(ax.figure)
