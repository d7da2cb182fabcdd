"""Asynchronous training with parameter servers (``gradtut.data_parallel.parameter_servers``):
it learns, survives a killed worker, times out when every worker is dead, and its synchronous
reference is the same computation on one device and on a mirrored pair."""
import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from gradtut.data_parallel import train_digits, train_with_parameter_servers
from model_zoo import gone

# A coordinator connects its whole TensorFlow runtime to the cluster, so each parameter-server
# run happens in a fresh Python process, never in the test process.
COORDINATOR = """
import json, os, sys
import gradtut
gradtut.setup(seed=0)
import tensorflow as tf
from gradtut.cluster import parameter_server_cluster
from gradtut.data_parallel import train_with_parameter_servers
tf.get_logger().setLevel("CRITICAL")
steps, kill_after, kill_all_first = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3] == "1"
with parameter_server_cluster(2, 1, timeout_s=120) as cluster:
    pids = cluster.pids()
    strategy = tf.distribute.experimental.ParameterServerStrategy(cluster.resolver())
    if kill_all_first:
        cluster.kill("worker", 0), cluster.kill("worker", 1)
        try:
            result = train_with_parameter_servers(strategy, steps, cluster=cluster, timeout_s=5)
        except TimeoutError as err:
            result = {"error": str(err)}
    else:
        result = train_with_parameter_servers(strategy, steps, kill_worker_after=kill_after,
                                              cluster=cluster)
print("@@" + json.dumps({**result, "pids": pids}), flush=True)
os._exit(0)  # the coordinator's threads may still wait for the dead workers
"""


def coordinate(steps, kill_after, kill_all_first=False):
    proc = subprocess.run([sys.executable, "-c", COORDINATOR, str(steps), json.dumps(kill_after),
                           "1" if kill_all_first else "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.rsplit("@@", 1)[1])


def test_parameter_server_training_learns_and_survives_a_killed_worker():
    steps = 120
    result = coordinate(steps, kill_after=60)
    # every scheduled step returned; an update may be applied twice (at-least-once), never lost
    assert len(result["losses"]) == steps and result["updates"] >= steps
    assert all(a >= 1 for a in result["attempts"]) and len(result["attempts"]) == steps
    assert result["updates"] <= sum(result["attempts"])  # an update per attempt at most
    assert result["held_out_loss"] < 1.2, result["held_out_loss"]  # from about 2.3 at the start
    assert sorted(set(result["worker"])) == [0, 1]  # task indices: both workers ran steps
    # the killed worker (task 1) started nothing after the kill
    assert not any(w == 1 and b > result["killed_at"]
                   for w, b in zip(result["worker"], result["began"], strict=True))
    # the version counter, read before the weights and again before the step's own update
    assert all(0 <= r <= r2 < result["updates"]
               for r, r2 in zip(result["read"], result["read_before_update"], strict=True))
    assert all(d.startswith("/job:ps/") for d in result["variables_on"]), result["variables_on"]
    assert result["killed_at"] is not None and result["wall_seconds"] < 120
    assert all(gone(pid) for pid in result["pids"]), "a cluster process outlived the block"


def test_parameter_server_training_with_every_worker_dead_times_out():
    result = coordinate(10, kill_after=None, kill_all_first=True)
    assert "did not finish within 5 s" in result["error"], result
    assert all(gone(pid) for pid in result["pids"]), "a cluster process outlived the block"


def test_the_digits_runs_refuse_bad_input():
    with pytest.raises(TypeError, match="strategy must be a tf.distribute strategy"):
        train_digits("mirrored", 10)
    with pytest.raises(ValueError, match="learning_rate must be > 0"):
        train_digits(tf.distribute.get_strategy(), 10, learning_rate=0.0)
    with pytest.raises(ValueError, match="kill_worker_after must be between 1 and steps - 1"):
        train_with_parameter_servers(tf.distribute.get_strategy(), 10, kill_worker_after=10)
    with pytest.raises(TypeError, match="strategy must be a ParameterServerStrategy"):
        train_with_parameter_servers(tf.distribute.get_strategy(), 10)
    with pytest.raises(ValueError, match="kill_worker_after needs cluster="):
        train_with_parameter_servers(tf.distribute.get_strategy(), 10, kill_worker_after=5)
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
        train_with_parameter_servers(tf.distribute.get_strategy(), 10, timeout_s=0)
    with pytest.raises(ValueError, match="timeout_s"):  # NaN would never time out
        train_with_parameter_servers(tf.distribute.get_strategy(), 10, timeout_s=float("nan"))


def test_one_device_and_mirrored_digits_training_are_the_same_computation():
    mirrored = train_digits(tf.distribute.MirroredStrategy(
        ["CPU:0", "CPU:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()), 30)
    single = train_digits(tf.distribute.get_strategy(), 30)  # the reference, computed after
    np.testing.assert_allclose(mirrored["losses"], single["losses"], rtol=1e-5)
    assert single["losses"][-1] < single["losses"][0]
