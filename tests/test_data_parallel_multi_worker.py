"""Two real worker processes (``gradtut.data_parallel.multi_worker``) against a mirrored run and
single-device training on the same batches; a killed worker's rerun resumes from the checkpoint."""
import numpy as np
import pytest

from gradtut.checks import assert_gradients_close
from gradtut.cluster import WorkerError, launch_local_workers
from gradtut.data_parallel import fit_under_multi_worker, train_synthetic
from model_zoo import no_process_matches

TOL = {"rtol": 1e-5, "atol": 1e-6}


def test_two_workers_end_identical_and_equal_a_two_replica_mirrored_run():
    results = launch_local_workers("gradtut.data_parallel:train_synthetic", 2, timeout_s=240,
                                   kwargs={"steps": 6})
    assert [(r["result"]["task"], r["result"]["replicas"]) for r in results] == [(0, 2), (1, 2)]
    w0, w1 = ([np.array(w) for w in r["result"]["weights"]] for r in results)
    assert all(np.array_equal(a, b) for a, b in zip(w0, w1, strict=True))
    mirrored = train_synthetic(6, mirrored_replicas=2)["weights"]
    assert_gradients_close(w0, [np.array(w) for w in mirrored], **TOL)
    single = train_synthetic(6)["weights"]
    assert_gradients_close(w0, [np.array(w) for w in single], **TOL)


def test_a_killed_worker_fails_fast_and_the_rerun_resumes_from_the_checkpoint(tmp_path):
    kwargs = {"steps": 8, "checkpoint_dir": str(tmp_path), "checkpoint_every": 2}
    with pytest.raises(WorkerError, match=r"worker 1 of 2 exited with code 17"):
        launch_local_workers("gradtut.data_parallel:train_synthetic", 2, timeout_s=120,
                             kwargs={**kwargs, "crash_at_step": 5})
    assert no_process_matches("train_synthetic")
    results = launch_local_workers("gradtut.data_parallel:train_synthetic", 2, timeout_s=240,
                                   kwargs=kwargs)
    assert [r["result"]["start_step"] for r in results] == [4, 4]
    uninterrupted = train_synthetic(8)["weights"]
    assert_gradients_close([np.array(w) for w in results[0]["result"]["weights"]],
                           [np.array(w) for w in uninterrupted], **TOL)


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, "steps must be a positive int, got 0"),
    ({"steps": 2.0}, r"steps must be a positive int, got 2.0 \(float\)"),
    ({"steps": 2, "global_batch_size": True},
     r"global_batch_size must be a positive int, got True"),
    ({"steps": 2, "checkpoint_every": 0}, "checkpoint_every must be a positive int, got 0"),
    ({"steps": 2, "crash_at_step": -1}, "crash_at_step must be an int >= 0, got -1"),
    ({"steps": 2, "mirrored_replicas": 2.5}, "mirrored_replicas must be a positive int"),
    ({"steps": 2, "seed": "0"}, "seed must be an int >= 0, got '0'"),
])
def test_train_synthetic_refuses_bad_arguments_before_starting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        train_synthetic(**kwargs)


def test_train_synthetic_accepts_numpy_ints_with_the_same_result():
    plain = train_synthetic(2, global_batch_size=8)
    numpy = train_synthetic(np.int64(2), global_batch_size=np.int64(8))
    assert numpy["weights"] == plain["weights"] and numpy["steps"] == 2


def test_fit_under_multi_worker_refuses_bad_arguments_before_starting():
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        fit_under_multi_worker(steps=0)
    with pytest.raises(ValueError, match="global_batch_size must be a positive int, got True"):
        fit_under_multi_worker(global_batch_size=True)
