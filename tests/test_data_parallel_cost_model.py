"""The ring all-reduce cost model (``gradtut.data_parallel.cost_model``) against its arithmetic
done by hand."""
import numpy as np
import pytest

from gradtut.data_parallel import predicted_step_seconds, ring_allreduce_seconds


def test_ring_allreduce_moves_two_n_minus_one_over_n_of_the_gradient():
    gb = 1e9
    assert ring_allreduce_seconds(gb, 1, 1e9) == 0.0
    assert ring_allreduce_seconds(gb, 2, 1e9) == pytest.approx(1.0)        # 2 * 1/2
    assert ring_allreduce_seconds(gb, 4, 1e9) == pytest.approx(1.5)        # 2 * 3/4
    assert ring_allreduce_seconds(gb, 4, 1e9, latency_s=0.01) == pytest.approx(1.5 + 6 * 0.01)
    assert ring_allreduce_seconds(gb, 1000, 1e9) < 2.0


def test_predicted_step_time_adds_split_compute_and_communication():
    assert predicted_step_seconds(1e-3, 1024, 0, 4, 1e9) == pytest.approx(0.256)
    assert predicted_step_seconds(1e-3, 1024, 1e9, 2, 1e9) == pytest.approx(0.512 + 1.0)
    with pytest.raises(ValueError, match="positive bandwidth"):
        ring_allreduce_seconds(1e9, 2, 0)
    with pytest.raises(ValueError, match="workers must be a positive int, got 0"):
        ring_allreduce_seconds(1e9, 0, 1e9)


def test_cost_model_arguments_are_checked():
    with pytest.raises(ValueError, match=r"workers must be a positive int, got 2.5 \(float\)"):
        ring_allreduce_seconds(1e9, 2.5, 1e9)
    with pytest.raises(ValueError, match=r"workers must be a positive int, got True \(a bool\)"):
        ring_allreduce_seconds(1e9, True, 1e9)
    with pytest.raises(ValueError, match="gradient_bytes must be >= 0, got -1"):
        ring_allreduce_seconds(-1, 2, 1e9)
    with pytest.raises(ValueError, match="latency_s must be >= 0"):
        ring_allreduce_seconds(1e9, 2, 1e9, latency_s=-0.1)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be a real number"):
        ring_allreduce_seconds(1e9, 2, "10 GB/s")
    with pytest.raises(ValueError, match="workers must be a positive int, got 0"):
        predicted_step_seconds(1e-3, 1024, 1e9, 0, 1e9)
    with pytest.raises(ValueError, match=r"global_batch_size must be a positive int, got 1024.0"):
        predicted_step_seconds(1e-3, 1024.0, 1e9, 4, 1e9)
    with pytest.raises(ValueError, match="compute_seconds_per_example must be >= 0"):
        predicted_step_seconds(-1e-3, 1024, 1e9, 4, 1e9)
    assert ring_allreduce_seconds(1e9, np.int64(4), 1e9) == ring_allreduce_seconds(1e9, 4, 1e9)
    assert predicted_step_seconds(1e-3, np.int64(1024), 1e9, np.int64(4), 1e9) == \
        predicted_step_seconds(1e-3, 1024, 1e9, 4, 1e9)
