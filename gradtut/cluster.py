"""Processes on this machine that form a ``tf.distribute`` cluster over loopback (notebook 03).

- :func:`launch_local_workers`: ``MultiWorkerMirroredStrategy`` workers that each run a function
  and return its result;
- :func:`parameter_server_cluster`: worker and parameter-server processes (``tf.distribute``
  servers) for a ``ParameterServerStrategy`` coordinator in this process;
- :func:`run_until_marker_then_kill`: a function in a fresh process, killed from outside once it
  prints a marker (a crash at a chosen moment, to test resuming).

Every process started here is killed on the way out, on errors and timeouts too, and asks Linux
to kill it if its parent dies, so even a killed notebook kernel leaves none behind.

Security: TensorFlow's gRPC servers have **no authentication**: anyone who can reach a server's
port can run ops in it. The cluster addresses here are loopback only, but TensorFlow's server
listens on every interface (``*:port``; it has no setting to bind one address). The ports are
open only while the processes run; on a shared network, firewall them or use a network
namespace. On a real cluster keep workers and parameter servers on a private network.
"""
import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from gradtut.checks import check_int
from gradtut.session import child_command, child_result


class WorkerError(RuntimeError):
    """A worker process failed or timed out; every worker has been stopped."""


def ephemeral_port_range():
    """The range Linux takes ports for outgoing connections from (32768-60999 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_loopback_ports(count, rng=None):
    """``count`` distinct ports that are free now on every interface (TensorFlow's gRPC server
    listens on all of them, whatever TF_CONFIG says).

    Raises:
      ValueError: ``count`` is not a positive int. WorkerError: not enough free ports.

    Taken from below the ephemeral range, so that no outgoing connection (a browser, a Jupyter
    kernel's sockets, another test) can be given the same port between this check and the
    worker's bind: ``bind(("", 0))`` would pick from the ephemeral range itself.
    """
    import random

    count = check_int(count, "count")
    rng = rng or random.Random()
    low = ephemeral_port_range()[0]
    first = max(1024, min(20000, low - 2000))
    if first >= low:  # no room below the ephemeral range: let the kernel pick, as before
        return _kernel_picked_ports(count)
    found, tries = [], 0
    while len(found) < count:
        tries += 1
        if tries > 200 * count:
            raise WorkerError(f"could not find {count} free ports in {first}-{low - 1}; stop "
                              "other servers or use fewer workers")
        port = rng.randrange(first, low)
        if port in found:
            continue
        if all(_bindable(family, address, port)
               for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::"))):
            found.append(port)
    return found


def _kernel_picked_ports(count):

    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _bindable(family, address, port):

    try:
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # no IPv6 on this machine: nothing can listen there either
        return True
    with s:
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


class _PortTaken(WorkerError):
    """A worker's gRPC server could not listen: its port was taken after it was chosen."""


def _load_prctl():
    """libc's ``prctl``, looked up once here in the parent: the child calls it between fork and
    exec, where loading a library could deadlock on a lock another thread held at the fork."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: children are still killed on the way out
        return None


_PRCTL = _load_prctl()


def _die_with_parent(parent_pid):
    """In the child, before exec: ask Linux to SIGKILL this process when its parent dies, so
    even a killed notebook kernel leaves no worker behind; exit at once if the parent is
    already gone."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)  # pylint: disable=protected-access


def _tail(path, lines=20):
    with open(path, encoding="utf-8", errors="replace") as f:
        return "\n".join(f.read().strip().splitlines()[-lines:])


def launch_local_workers(target, num_workers, timeout_s, kwargs=None, ports=None, env=None):
    """Run ``target`` in ``num_workers`` processes that form a ``MultiWorkerMirroredStrategy``
    cluster on this machine, and return what each returned.

    Each process gets ``TF_CONFIG`` with a cluster of ``num_workers`` workers at
    ``127.0.0.1:<free port>`` and its own task index, so
    ``tf.distribute.MultiWorkerMirroredStrategy()`` inside ``target`` connects them.

    Security: TensorFlow's gRPC servers have **no authentication**: anyone who can reach a
    worker's port can run ops in it. The cluster addresses here are loopback only, so the
    workers talk over 127.0.0.1, but TensorFlow's server itself listens on every interface
    (``*:port``, seen with ``ss -ltn`` while workers run; TensorFlow has no setting to bind
    it to one address). The ports are open only while the workers run; on a shared network,
    firewall them or run inside a network namespace. On a real cluster keep workers on a
    private network.

    Args:
      target: ``"package.module:function"``, or a module-level function (not one defined in a
        notebook: the workers import it). It is called as ``function(**kwargs)`` and must return
        something JSON-serialisable. Or a path to a ``.py`` script, run as ``python script``.
      num_workers: positive int.
      timeout_s: seconds for the whole run; then every worker is killed. (A retry after a
        taken port, see ``ports``, starts the clock again: that attempt failed at start-up.)
      kwargs: JSON-serialisable keyword arguments for ``target``.
      ports: the ports to use (default: ports free on every interface, from below the
        ephemeral range; if one is taken before its worker listens, the launch is retried
        with fresh ports, at most three attempts in all).
      env: extra environment variables for every worker.

    Returns:
      list, one dict per worker: ``{"index", "returncode", "result", "stdout", "stderr"}`` (result
      is None for a script).

    Raises:
      ValueError: ``num_workers`` not a positive int, fewer ``ports`` than workers, a target
        that is not a ``"module:function"`` string, a ``.py`` path or a function a worker can
        import (one defined in ``__main__`` or inside a function). A module that does not
        import fails in the worker: WorkerError.
      WorkerError: a worker exited with an error, or the timeout passed. The message names the
        worker and shows the tail of its stderr; all workers are stopped first, so nothing hangs.

    Example:
      >>> # not run as a doctest: it starts two TensorFlow processes (several seconds)
      >>> results = launch_local_workers("gradtut.data_parallel:train_synthetic", 2, 120,
      ...                                kwargs={"steps": 4})  # doctest: +SKIP
    """
    num_workers = check_int(num_workers, "num_workers")
    if ports is not None and len(ports) < num_workers:
        raise ValueError(f"{num_workers} workers need {num_workers} ports; got {len(ports)} "
                         "(more workers than free ports)")
    command = _worker_command(target, kwargs)
    return _on_free_ports(num_workers, ports,
                          lambda chosen: _run_workers(command, chosen, timeout_s, env))


def _on_free_ports(count, ports, start):
    """``start(ports)`` with ``count`` free loopback ports. A port found free can be taken
    before a server listens on it (by any process on the machine); the server then fails at once
    with "Could not start gRPC server" (``_PortTaken``), and this tries again with fresh ports,
    three attempts in all. Ports the caller chose (``ports``) are used once, as they are."""
    attempts = 1 if ports is not None else 3
    for attempt in range(1, attempts + 1):
        chosen = list(ports[:count]) if ports is not None else free_loopback_ports(count)
        try:
            return start(chosen)
        except _PortTaken as err:
            if attempt == attempts:
                raise WorkerError(f"{err}\n(a task could not listen on its port {chosen}; "
                                  f"tried {attempts} time(s))") from None


def _worker_command(target, kwargs):
    """The command line each worker runs, for a ``"module:function"``, a module-level
    function, or a ``.py`` script."""
    if callable(target):
        if target.__module__ == "__main__" or "<locals>" in target.__qualname__:
            raise ValueError(f"workers cannot import {target.__qualname__!r} (defined in "
                             "__main__ or inside a function): move it to a module, or pass a "
                             "script")
        target = f"{target.__module__}:{target.__qualname__}"
    if not isinstance(target, str):
        raise ValueError(f"target must be 'module:function', a module-level function or a .py "
                         f"script path, got {target!r}")
    if target.endswith(".py"):
        return [sys.executable, target]
    module, _, function = target.partition(":")
    if not function:
        raise ValueError(f"target {target!r} must be 'module:function' or a .py script")
    return child_command(module, function, kwargs)


def _run_workers(command, ports, timeout_s, env):
    """Start one worker per port with its TF_CONFIG, wait, and collect what each printed.
    Every worker is killed, and its logs removed, on the way out, whatever happened."""
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    logs = tempfile.mkdtemp(prefix="gradtut-workers-")
    procs, files = [], []
    try:
        for index in range(len(ports)):
            procs.append(_start_worker(command, cluster, index, logs, env, files))
        _wait_for_workers(procs, logs, timeout_s)
        return [_worker_result(logs, index) for index in range(len(procs))]
    finally:
        _stop_workers(procs)
        for f in files:
            f.close()
        shutil.rmtree(logs, ignore_errors=True)


def _start_worker(command, cluster, index, logs, env, files):
    """Start MultiWorkerMirroredStrategy worker ``index`` of ``cluster`` (its TF_CONFIG set)."""
    tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
    return _start_process(command, logs, str(index), {**(env or {}), "TF_CONFIG": tf_config},
                          files)


def _start_process(command, logs, name, env, files):
    """Start ``command`` with its output in ``logs/name.out`` and ``.err``, in its own process
    group, killed by Linux if this process dies; returns the Popen."""
    child_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    out = open(os.path.join(logs, f"{name}.out"), "w+", encoding="utf-8")
    err = open(os.path.join(logs, f"{name}.err"), "w+", encoding="utf-8")
    files += [out, err]
    return subprocess.Popen(command, stdout=out, stderr=err, env=child_env,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=functools.partial(_die_with_parent, os.getpid()))


def _wait_for_workers(procs, logs, timeout_s):
    """Return when every worker exited with 0; raise WorkerError (or _PortTaken) as soon as
    one fails, or when ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            first = next(i for i, c in enumerate(codes) if c not in (None, 0))
            time.sleep(0.5)  # let the failures it causes in its peers show up too
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0) and i != first]
            which = "; ".join(f"worker {i} of {len(procs)} exited with code {codes[i]}"
                              for i in [first] + failed)  # the earliest is likely the cause
            tail = _tail(os.path.join(logs, f"{first}.err"))
            kind = _PortTaken if "Could not start gRPC server" in tail else WorkerError
            raise kind(f"{which}; stopped the others. Worker {first}'s stderr ends "
                       f"with:\n{tail}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            waiting = [i for i, c in enumerate(codes) if c is None]
            raise WorkerError(f"workers {waiting} still running after {timeout_s} s; stopped "
                              f"all of them. Worker {waiting[0]}'s stderr ends with:\n"
                              f"{_tail(os.path.join(logs, f'{waiting[0]}.err'))}")
        time.sleep(0.1)


def _worker_result(logs, index):
    """What worker ``index`` printed and returned, read from its log files."""
    with open(os.path.join(logs, f"{index}.out"), encoding="utf-8") as f:
        stdout, result = child_result(f.read())
    with open(os.path.join(logs, f"{index}.err"), encoding="utf-8") as f:
        stderr = f.read()
    return {"index": index, "returncode": 0, "result": result, "stdout": stdout,
            "stderr": stderr}


def _stop_workers(procs):
    """Kill every worker still running, with its children (each leads its own group)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


# --- parameter-server clusters -----------------------------------------------------------------

def serve(cluster, job, index):
    """Run this process as task ``index`` of ``job`` in ``cluster`` (a ``tf.distribute.Server``)
    until it is killed. The entry point of :func:`parameter_server_cluster`'s processes.

    Raises:
      ValueError: ``job`` is not ``"worker"`` or ``"ps"``, or ``cluster`` has no such task.
    """
    if job not in ("worker", "ps"):
        raise ValueError(f"job must be 'worker' or 'ps', got {job!r}")
    if not 0 <= check_int(index, "index", minimum=0) < len(cluster.get(job, [])):
        raise ValueError(f"no task {job}:{index} in the cluster {cluster}")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job,
                                  task_index=index, protocol="grpc", start=True)
    server.join()


class LocalCluster:
    """What :func:`parameter_server_cluster` started: ``spec`` (``{"worker": [...], "ps":
    [...]}``, addresses on 127.0.0.1), ``processes`` (``{(job, index): Popen}``), ``resolver()``
    for ``ParameterServerStrategy``, and ``kill(job, index)``."""

    def __init__(self, spec, processes):
        self.spec, self.processes = spec, processes

    def resolver(self):
        """A cluster resolver for ``tf.distribute.experimental.ParameterServerStrategy``."""
        import tensorflow as tf

        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.spec), rpc_layer="grpc")

    def kill(self, job, index):
        """SIGKILL one task, as a crash would; returns the time (``time.monotonic``) the task was
        dead, just after the signal and the wait for the process to be reaped.

        Raises:
          ValueError: no such task.
        """
        if (job, index) not in self.processes:
            raise ValueError(f"no task {job}:{index}; the cluster has "
                             f"{sorted(self.processes)}")
        _stop_workers([self.processes[job, index]])
        return time.monotonic()

    def pids(self):
        """The process id of every task, for checking that none is left behind."""
        return [p.pid for p in self.processes.values()]


@contextlib.contextmanager
def parameter_server_cluster(num_workers=2, num_ps=1, timeout_s=60):
    """Start ``num_workers`` worker and ``num_ps`` parameter-server processes on loopback, and
    yield a :class:`LocalCluster` once every one listens. The calling process is the
    coordinator (``ParameterServerStrategy(cluster.resolver())``); every task is killed when the
    block ends, whatever happened.

    Raises:
      ValueError: counts that are not positive ints.
      WorkerError: a task failed to start, or was not listening within ``timeout_s``.

    Example:
      >>> # not run as a doctest: a coordinator ties this process's TensorFlow to the cluster
      >>> with parameter_server_cluster(2, 1) as cluster:  # doctest: +SKIP
      ...     strategy = tf.distribute.experimental.ParameterServerStrategy(cluster.resolver())
    """
    num_workers, num_ps = check_int(num_workers, "num_workers"), check_int(num_ps, "num_ps")
    logs = tempfile.mkdtemp(prefix="gradtut-ps-")
    processes, files = {}, []
    try:
        spec = _on_free_ports(num_workers + num_ps, None, lambda ports: _start_servers(
            ports, num_workers, processes, logs, files, timeout_s))
        yield LocalCluster(spec, processes)
    finally:
        _stop_workers(list(processes.values()))
        for f in files:
            f.close()
        shutil.rmtree(logs, ignore_errors=True)


def _start_servers(ports, num_workers, processes, logs, files, timeout_s):
    """Start a ``serve`` process per port (the first ``num_workers`` are workers, the rest
    parameter servers) into ``processes``, and return the cluster spec once all listen. If one
    fails, all are stopped (``processes`` emptied) before the error is raised."""
    spec = {"worker": [f"127.0.0.1:{p}" for p in ports[:num_workers]],
            "ps": [f"127.0.0.1:{p}" for p in ports[num_workers:]]}
    try:
        for job, addresses in spec.items():
            for index in range(len(addresses)):
                command = child_command("gradtut.cluster", "serve",
                                        {"cluster": spec, "job": job, "index": index})
                processes[job, index] = _start_process(command, logs, f"{job}{index}", {},
                                                       files)
        _wait_until_listening(processes, spec, logs, timeout_s)
    except BaseException:
        _stop_workers(list(processes.values()))
        processes.clear()
        raise
    return spec


def _wait_until_listening(processes, spec, logs, timeout_s):
    """Return once every task accepts connections; raise if one exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    waiting = dict(processes)
    while waiting:
        for (job, index), proc in list(waiting.items()):
            if proc.poll() is not None:
                tail = _tail(os.path.join(logs, f"{job}{index}.err"))
                kind = _PortTaken if "Could not start gRPC server" in tail else WorkerError
                raise kind(f"{job} {index} exited with code {proc.returncode} before it "
                           f"listened. Its stderr ends with:\n{tail}")
            port = int(spec[job][index].rsplit(":", 1)[1])
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    del waiting[job, index]
        if waiting and time.monotonic() > deadline:
            raise WorkerError(f"{sorted(waiting)} not listening after {timeout_s} s; stopped "
                              "every task")
        time.sleep(0.1)


# --- a crash at a chosen moment ----------------------------------------------------------------

def run_until_marker_then_kill(module, function, kwargs, marker, timeout_s=300, env=None):
    """Run ``module.function(**kwargs)`` in a fresh process, SIGKILL it from outside as soon as
    its standard output holds a line starting with ``marker``, and return what it printed.

    Used to crash a training run at a known point (the function prints the marker and then
    waits), the way a preempted machine would: no clean-up runs in the child.

    Returns:
      dict ``{"killed": True, "stdout", "stderr"}``, or ``{"killed": False, "result", ...}``
      if the function finished without printing the marker.

    Raises:
      ValueError: an empty marker. WorkerError: the child failed, or printed no marker
        within ``timeout_s``.
    """
    if not isinstance(marker, str) or not marker:
        raise ValueError(f"marker must be a non-empty string, got {marker!r}")
    logs = tempfile.mkdtemp(prefix="gradtut-crash-")
    files, proc = [], None
    try:
        proc = _start_process(child_command(module, function, kwargs), logs, "child", env, files)
        deadline = time.monotonic() + timeout_s
        out_path = os.path.join(logs, "child.out")
        while True:
            with open(out_path, encoding="utf-8", errors="replace") as f:
                printed = f.read()
            if any(line.startswith(marker) for line in printed.splitlines()):
                _stop_workers([proc])
                return {"killed": True, "stdout": printed,
                        "stderr": _tail(os.path.join(logs, "child.err"))}
            if proc.poll() is not None:
                if proc.returncode != 0:
                    raise WorkerError(f"{module}.{function} exited with code {proc.returncode} "
                                      f"before {marker!r}:\n"
                                      f"{_tail(os.path.join(logs, 'child.err'))}")
                text, result = child_result(printed)
                return {"killed": False, "stdout": text, "result": result,
                        "stderr": _tail(os.path.join(logs, "child.err"))}
            if time.monotonic() > deadline:
                raise WorkerError(f"{module}.{function} printed no {marker!r} within "
                                  f"{timeout_s} s; stopped it")
            time.sleep(0.05)
    finally:
        if proc is not None:
            _stop_workers([proc])
        for f in files:
            f.close()
        shutil.rmtree(logs, ignore_errors=True)
