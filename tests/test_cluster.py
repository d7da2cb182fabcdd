"""The loopback clusters: MultiWorkerMirroredStrategy workers, parameter-server clusters, and a
crash at a chosen moment; every process they start is gone afterwards."""
import json
import subprocess
import tempfile

import pytest

from gradtut.cluster import (
    LocalCluster,
    WorkerError,
    free_loopback_ports,
    launch_local_workers,
    parameter_server_cluster,
    run_until_marker_then_kill,
    serve,
)
from model_zoo import gone, no_process_matches


def test_workers_get_a_loopback_cluster_in_tf_config():
    results = launch_local_workers("os:getenv", 3, timeout_s=60, kwargs={"key": "TF_CONFIG"})
    configs = [json.loads(r["result"]) for r in results]
    assert [c["task"] for c in configs] == [{"type": "worker", "index": i} for i in range(3)]
    addresses = configs[0]["cluster"]["worker"]
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert all(c["cluster"] == configs[0]["cluster"] for c in configs)


def test_a_target_that_raises_is_named_with_its_stderr():
    with pytest.raises(WorkerError,
                       match=r"(?s)worker \d of 2 exited with code 1.*JSONDecodeError"):
        launch_local_workers("json:loads", 2, timeout_s=60, kwargs={"s": "{"})


def test_a_hanging_worker_is_killed_at_the_timeout():
    with pytest.raises(WorkerError, match=r"still running after 2 s; stopped all of them"):
        launch_local_workers("signal:pause", 2, timeout_s=2)
    assert no_process_matches("signal pause")


def test_launcher_rejects_bad_arguments():
    with pytest.raises(ValueError, match="more workers than free ports"):
        launch_local_workers("os:getpid", 2, timeout_s=10, ports=[12345])
    with pytest.raises(ValueError, match="num_workers must be a positive int"):
        launch_local_workers("os:getpid", 0, timeout_s=10)
    with pytest.raises(ValueError, match="move it to a module"):
        launch_local_workers(lambda: 1, 1, timeout_s=10)
    with pytest.raises(ValueError, match="must be 'module:function' or a .py script"):
        launch_local_workers("os.getpid", 1, timeout_s=10)


def test_worker_error_is_a_runtime_error_with_its_message():
    """Notebooks may catch it as RuntimeError; the message is what the launcher composed."""
    with pytest.raises(RuntimeError, match="worker 1 of 2 exited with code 17"):
        raise WorkerError("worker 1 of 2 exited with code 17; stopped the others")


@pytest.mark.parametrize("start, pattern, count", [
    ("from gradtut.cluster import launch_local_workers; "
     "launch_local_workers('signal:pause', 2, timeout_s=600)", "signal pause", 2),
    ("import signal; from gradtut.cluster import parameter_server_cluster\n"
     "with parameter_server_cluster(2, 1, timeout_s=120): signal.pause()",
     "gradtut.cluster serve", 3)])
def test_cluster_processes_die_with_a_killed_parent(start, pattern, count):
    """A notebook kernel killed outright (no finally blocks run) still leaves no worker or
    parameter server behind."""
    import signal
    import sys
    import time

    parent = subprocess.Popen([sys.executable, "-c", start])
    try:
        for _ in range(300):  # wait until every process is up
            if subprocess.run(["pgrep", "-f", pattern], capture_output=True,
                              text=True).stdout.count("\n") >= count:
                break
            time.sleep(0.1)
        assert not no_process_matches(pattern)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        for _ in range(50):
            if no_process_matches(pattern):
                break
            time.sleep(0.1)
        assert no_process_matches(pattern)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_script_target_runs_in_every_worker(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("import json, os\n"
                      "print('task', json.loads(os.environ['TF_CONFIG'])['task']['index'])\n")
    results = launch_local_workers(str(script), 2, timeout_s=60)
    assert [r["stdout"].strip() for r in results] == ["task 0", "task 1"]
    assert [r["result"] for r in results] == [None, None]


def test_free_ports_are_free_on_every_interface_and_outside_the_ephemeral_range():
    import socket

    from gradtut.cluster import ephemeral_port_range, free_loopback_ports

    low, _ = ephemeral_port_range()
    ports = free_loopback_ports(4)
    assert len(set(ports)) == 4 and all(1024 <= p < low for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))


def test_a_port_taken_before_the_worker_listens_is_retried_with_fresh_ports(monkeypatch):
    """The race behind a notebook-03 failure: a port found free is taken by another process
    before TensorFlow's gRPC server binds it. The launcher retries with fresh ports; ports the
    caller chose are not retried, and the error says the port could not be used."""
    import socket

    from gradtut import cluster

    with socket.socket() as blocker:
        blocker.bind(("0.0.0.0", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        real = cluster.free_loopback_ports
        handed_out = []

        def first_taken(count):
            ports = [taken] + real(count - 1) if not handed_out else real(count)
            handed_out.append(ports)
            return ports

        monkeypatch.setattr(cluster, "free_loopback_ports", first_taken)
        results = launch_local_workers("gradtut.data_parallel:train_synthetic", 2,
                                       timeout_s=120, kwargs={"steps": 2})
        assert len(handed_out) == 2 and taken in handed_out[0]
        assert results[0]["result"]["weights"] == results[1]["result"]["weights"]
        with pytest.raises(WorkerError, match=r"could not listen on its port.*tried 1 time"):
            launch_local_workers("gradtut.data_parallel:train_synthetic", 2, timeout_s=120,
                                 kwargs={"steps": 2}, ports=[taken, real(1)[0]])


def test_the_cluster_is_gone_after_an_error_in_the_block():
    with pytest.raises(RuntimeError, match="boom"):
        with parameter_server_cluster(1, 1, timeout_s=120) as cluster:
            pids = cluster.pids()
            assert len(pids) == 2 and not any(gone(pid) for pid in pids)
            raise RuntimeError("boom")
    assert all(gone(pid) for pid in pids)


def test_parameter_server_helpers_refuse_bad_input():
    with pytest.raises(ValueError, match="num_workers must be a positive int"):
        with parameter_server_cluster(0, 1):
            pass
    with pytest.raises(ValueError, match="num_ps must be a positive int"):
        with parameter_server_cluster(1, True):
            pass
    with pytest.raises(ValueError, match="count must be a positive int"):
        free_loopback_ports(0)
    with pytest.raises(ValueError, match=r"no task worker:5"):
        LocalCluster({"worker": ["127.0.0.1:1"]}, {}).kill("worker", 5)
    with pytest.raises(ValueError, match="job must be 'worker' or 'ps'"):
        serve({"worker": ["127.0.0.1:1"]}, "chief", 0)
    with pytest.raises(ValueError, match="no task worker:3 in the cluster"):
        serve({"worker": ["127.0.0.1:1"]}, "worker", 3)


def test_run_until_marker_then_kill_kills_at_the_marker_and_reports_the_rest():
    out = run_until_marker_then_kill("builtins", "print", {"end": "\n"}, marker="never")
    assert out["killed"] is False and out["result"] is None
    crash = run_until_marker_then_kill(
        "gradtut.data_parallel", "fit_with_backup",
        {"backup_dir": tempfile.mkdtemp(), "epochs": 1, "crash_at": [0, 2]},
        marker="gradtut: crash point reached")
    assert crash["killed"] is True and "crash point reached" in crash["stdout"]
    with pytest.raises(WorkerError, match=r"json.loads exited with code 1 before 'x'"):
        run_until_marker_then_kill("json", "loads", {"s": "{"}, marker="x")
    with pytest.raises(WorkerError, match="printed no 'x' within 1 s; stopped it"):
        run_until_marker_then_kill("signal", "pause", {}, marker="x", timeout_s=1)
    with pytest.raises(ValueError, match="marker must be a non-empty string"):
        run_until_marker_then_kill("signal", "pause", {}, marker="")
