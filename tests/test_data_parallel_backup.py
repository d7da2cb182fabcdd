"""``fit`` with ``BackupAndRestore`` (``gradtut.data_parallel.backup``): a run killed at a chosen
batch, resumed, against an uninterrupted run."""
import numpy as np
import pytest

from gradtut.cluster import run_until_marker_then_kill
from gradtut.data_parallel import CRASH_MARKER, fit_in_fresh_process, fit_with_backup
from gradtut.session import run_in_subprocess


@pytest.fixture(scope="module")
def uninterrupted_fit(tmp_path_factory):
    return run_in_subprocess("gradtut.data_parallel", "fit_with_backup",
                             {"backup_dir": str(tmp_path_factory.mktemp("a")), "epochs": 2},
                             timeout_s=300)


@pytest.mark.parametrize("save_freq, equal", [("epoch", True), (5, False)])
def test_backup_and_restore_resumes_at_the_start_of_the_interrupted_epoch(
        tmp_path, uninterrupted_fit, save_freq, equal):
    """Killed after batch 8 of epoch 1, the rerun starts epoch 1 from batch 0: Keras 3 restores
    the epoch, not the batch. With one backup per epoch nothing is repeated and the weights
    equal an uninterrupted run exactly; with a backup every 5 batches, batches 0-5 of epoch 1
    are trained twice."""
    run = {"backup_dir": str(tmp_path), "epochs": 2, "save_freq": save_freq}
    crash = run_until_marker_then_kill("gradtut.data_parallel", "fit_with_backup",
                                       {**run, "crash_at": [1, 8]}, CRASH_MARKER)
    assert crash["killed"]
    resumed = run_in_subprocess("gradtut.data_parallel", "fit_with_backup", run, timeout_s=300)
    assert resumed["backup"] == ({"epoch": 1, "batch": 0} if equal else {"epoch": 1, "batch": 5})
    assert resumed["batches_run"] == [[1, b] for b in range(24)]
    same = all(np.array_equal(a, b) for a, b in zip(resumed["weights"],
                                                     uninterrupted_fit["weights"], strict=True))
    assert same is equal


def test_the_backup_runs_refuse_bad_input(tmp_path):
    with pytest.raises(ValueError, match="backup_dir must be a folder path"):
        fit_in_fresh_process(None)
    with pytest.raises(ValueError, match="crash batch must be an int >= 0"):
        fit_in_fresh_process(str(tmp_path), crash_at=(1, -1))
    with pytest.raises(ValueError, match="crash_at epoch 3 is never reached in 3 epochs"):
        fit_in_fresh_process(str(tmp_path), crash_at=(3, 0))
    with pytest.raises(RuntimeError, match=r"without reaching crash_at=\(0, 99\)"):
        fit_in_fresh_process(str(tmp_path / "short"), crash_at=(0, 99), epochs=1)
    with pytest.raises(ValueError, match="save_freq must be a positive int"):
        fit_with_backup(str(tmp_path), save_freq="batch")
    with pytest.raises(ValueError, match="epochs must be a positive int"):
        fit_with_backup(str(tmp_path), epochs=0)
