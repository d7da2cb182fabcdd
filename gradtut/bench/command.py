"""``python -m gradtut bench``: the collection's key measurements, on your hardware.

Each section runs in a fresh Python process, because some need TensorFlow started differently
(virtual CPUs for data parallelism, one thread per op for the pipeline). Every figure is a
median over interleaved repeats and a ratio to a reference measured in the same process.

- ``per_example`` (notebook 01): per-example gradient methods and ghost norms against one
  batch gradient, on an MLP, and the one-pass methods on a CNN, a small transformer and a
  KerasHub BERT (in full and with LoRA, with the clipped gradient's peak memory); a
  DP-SGD training step (``DPModel``) against a plain ``fit`` step on the MLP and the CNN;
- ``input_gradients`` (02): per-example input gradients, single pass against ``map_fn``,
  ``vectorized_map`` and a loop;
- ``data_parallel`` (03): a training step on 2 and 4 replicas against one device;
- ``pipeline`` (04): the GPipe step and its idle share, measured against (p-1)/(m+p-1) and the
  simulator;
- ``efficiency`` (05): eager against ``tf.function`` and XLA, accumulation memory, and
  checkpointing memory and time.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import time

SECTIONS = ("per_example", "input_gradients", "data_parallel", "pipeline", "efficiency")
RESULT_KEYS = ("created", "quick", "hardware", "python", "tensorflow", "keras", "devices",
               "sections")
ROW_KEYS = ("measurement", "value", "unit", "ratio", "reference")


def _row(measurement, value, unit, ratio, reference, **extra):
    return {"measurement": measurement, "value": float(value), "unit": unit,
            "ratio": float(ratio), "reference": reference, **extra}


def _default_device():
    import tensorflow as tf

    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU"


# --- sections: each runs in its own process and returns JSON --------------------------------

def _per_example(quick):
    import gradtut
    gradtut.setup(seed=0)
    from gradtut.bench.per_example import (
        ALL,
        benchmark_dp_step,
        benchmark_keras_hub,
        benchmark_per_example,
    )

    methods = (["vectorized", "outer", "ghost norms", "clipped", "matmul floor"] if quick
               else list(ALL))
    rows = benchmark_per_example([256] if quick else [32, 256, 1024], methods,
                                 repeats=3 if quick else 7, slow_max_batch=256)
    out = [_row(f"{r['method']}, batch {r['batch_size']}", r["median_ms"], "ms", r["ratio"],
                "batch gradient") for r in rows if r["method"] != "batch gradient"]
    # outer against the batched matmuls that write its kernels, from the same rounds
    medians = {(r["method"], r["batch_size"]): r["median_ms"] for r in rows}
    out += [_row(f"outer over its matmul floor, batch {b}", ms, "ms",
                 ms / medians["matmul floor", b],
                 "matmul floor") for (m, b), ms in medians.items()
            if m == "outer" and ("matmul floor", b) in medians]
    # The one-pass methods on a CNN and a transformer, at batch 256 (vectorized_map is refused
    # on attention with oneDNN on, and loops on convolutions: it is left out here).
    for model in ("cnn", "transformer"):
        rows = benchmark_per_example([256], ["outer", "ghost norms", "clipped"],
                                     repeats=3 if quick else 7, model=model)
        out += [_row(f"{model}: {r['method']}, batch {r['batch_size']}", r["median_ms"], "ms",
                     r["ratio"], "batch gradient") for r in rows
                if r["method"] != "batch gradient"]
    # A KerasHub BERT (2 layers, hidden 128, 64 tokens, batch 64), in full and with LoRA (rank
    # 4): each against its own batch gradient, in time and in the allocator's peak.
    for rank in (None, 4):
        name = "bert" if rank is None else f"bert + LoRA {rank}"
        rows = benchmark_keras_hub(rank, repeats=3 if quick else 7)
        out += [_row(f"{name}: {r['method']}, batch 64", r["median_ms"], "ms", r["ratio"],
                     "batch gradient") for r in rows if r["method"] != "batch gradient"]
        clipped = next(r for r in rows if r["method"] == "clipped")
        if clipped["peak_mb"] is not None:
            out.append(_row(f"{name}: clipped, peak memory", clipped["peak_mb"], "MB",
                            clipped["peak_ratio"], "batch gradient's peak"))
    for model in ("mlp", "cnn"):  # DP-SGD as a Keras user runs it: DPModel's step in fit
        r = benchmark_dp_step(model, repeats=5 if quick else 15)
        out.append(_row(f"{model}: DPModel training step, batch {r['batch_size']}",
                        r["median_ms"], "ms", r["ratio"], "plain fit step"))
        out.append(_row(f"{model}: the same step without its {r['parameters']:,} noise draws",
                        r["no_noise_ms"], "ms", r["no_noise_ratio"], "plain fit step"))
        out.append(_row(f"{model}: the DPModel step under a {r['canaries']:,}-canary audit",
                        r["audited_ms"], "ms", r["audited_ratio"], "DPModel step"))
    return _default_device(), out


def _input_gradients(quick):
    import gradtut
    gradtut.setup(seed=0)
    import keras
    import numpy as np

    from gradtut.bench.input_gradients import input_gradient_benchmark

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Flatten(), keras.layers.Dense(10)])
    batches = (512,) if quick else (32, 128, 512, 2048)
    x = np.random.default_rng(0).normal(size=(max(batches), 8, 8, 1)).astype("float32")
    target = np.arange(max(batches)) % 10
    rows = input_gradient_benchmark(model, x, target, batch_sizes=batches,
                                    loop_max_batch=0 if quick else 128,
                                    repeats=3 if quick else 5)
    return _default_device(), [
        _row(f"{r['method']}, batch {r['batch_size']}", r["median_ms"], "ms", r["ratio"],
             "single pass") for r in rows if r["method"] != "single pass"]


def _data_parallel(quick):
    import gradtut
    gradtut.setup(seed=0, virtual_cpus=4)
    from gradtut.data_parallel import train_synthetic

    steps = 20 if quick else 60
    configs = {"1 device": None, "2 replicas (MirroredStrategy)": 2,
               "4 replicas (MirroredStrategy)": 4}
    runs = {name: [] for name in configs}
    for _ in range(1 if quick else 3):  # interleaved rounds: each configuration once per round
        for name, replicas in configs.items():
            runs[name].append(train_synthetic(steps, mirrored_replicas=replicas)["median_step_ms"])
    ms = {name: statistics.median(times) for name, times in runs.items()}
    return "CPU (4 virtual devices sharing the cores)", [
        _row(name, ms[name], "ms per step", ms[name] / ms["1 device"], "1 device")
        for name in configs]


def _pipeline(quick):
    import gradtut
    gradtut.setup(seed=0, virtual_cpus=2, intra_op_threads=1)
    import keras
    import numpy as np

    from gradtut.model_parallel import (
        bubble_fraction,
        pipeline_gradients,
        place_stages,
        simulate_pipeline,
        stage_times,
    )

    width, batch = (1024, 512) if quick else (1024, 1024)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,))]
                             + [keras.layers.Dense(width, activation="relu") for _ in range(8)]
                             + [keras.layers.Dense(10)])
    staged = place_stages(model, ["CPU:0", "CPU:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, width)).astype("float32")
    y = rng.integers(0, 10, batch)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    counts = (1, 4) if quick else (1, 2, 4, 8, 16)
    runs = {m: [] for m in counts}
    for m in counts:
        pipeline_gradients(staged, x, y, loss_fn, m)  # trace
    for _ in range(3 if quick else 5):
        for m in counts:
            runs[m].append(pipeline_gradients(staged, x, y, loss_fn, m)[2])

    def makespan(timeline):
        return max(e["end"] for e in timeline)

    median = {m: sorted(t, key=makespan)[len(t) // 2] for m, t in runs.items()}
    rows = []
    for m, timeline in median.items():
        simulated = simulate_pipeline(stage_times(timeline), m)
        rows.append(_row(f"GPipe, 2 stages, {m} micro-batches", 1e3 * makespan(timeline), "ms",
                         makespan(timeline) / makespan(median[1]), "1 micro-batch",
                         idle_measured=bubble_fraction(timeline), idle_formula=1 / (m + 1),
                         idle_simulated=simulated["bubble_fraction"],
                         simulated_ms=1e3 * simulated["makespan"],
                         note=f"idle {bubble_fraction(timeline):.2f}, formula {1 / (m + 1):.2f}, "
                              f"simulated {simulated['bubble_fraction']:.2f}"))
    return "CPU (2 virtual devices, 1 thread per op)", rows


def _efficiency(quick):
    import gradtut
    gradtut.setup(seed=0)
    import keras
    import numpy as np
    import tensorflow as tf

    from gradtut.efficiency import (
        accumulated_gradients,
        checkpointed,
        compare_compilation,
        peak_memory,
    )

    keras.utils.set_random_seed(0)
    width, depth, batch = (512, 8, 1024) if quick else (512, 8, 2048)
    model = keras.Sequential([keras.Input((width,))]
                             + [keras.layers.Dense(width, activation="relu")
                                for _ in range(depth)] + [keras.layers.Dense(10)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, width)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")

    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        return tape.gradient(loss, model.trainable_variables)

    rows = []
    compiled = compare_compilation(gradients, x, y, repeats=3 if quick else 7)
    for mode in ("tf.function", "xla"):
        rows.append(_row(f"gradient step, {mode}", compiled[mode]["median_ms"], "ms",
                         compiled[mode]["ratio"], "eager"))
    per_example_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                  reduction=None)
    full = peak_memory(accumulated_gradients, model, per_example_loss, x, y, batch)
    for size in (batch // 8, batch // 2):
        peak = peak_memory(accumulated_gradients, model, per_example_loss, x, y, size)
        rows.append(_row(f"accumulation, micro-batch {size} of {batch}", peak / 1e6, "MB peak",
                         peak / full, "one batch"))

    def step_with(forward):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, forward(x))
            return tape.gradient(loss, model.trainable_variables)
        return step

    from gradtut.measure import compare_timings

    segments = int(round((depth + 1) ** 0.5))
    plain, checkpoint = step_with(model), step_with(checkpointed(model.layers, segments))
    plain_peak, checkpoint_peak = peak_memory(plain), peak_memory(checkpoint)
    timings = compare_timings({"plain": plain, "checkpointed": checkpoint}, reference="plain",
                              repeats=3 if quick else 7)
    rows.append(_row(f"checkpointing, {segments} segments: peak", checkpoint_peak / 1e6,
                     "MB peak", checkpoint_peak / plain_peak, "no checkpointing"))
    rows.append(_row(f"checkpointing, {segments} segments: time", timings[1].median_ms, "ms",
                     timings[1].ratio, "no checkpointing"))
    return _default_device(), rows


def run_section(name, quick):
    """Run one section in this process (meant for a fresh one); returns its JSON result.

    Raises:
      ValueError: ``name`` is not one of ``SECTIONS``.
    """
    if name not in SECTIONS:
        raise ValueError(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
    start = time.perf_counter()
    device, rows = globals()["_" + name](quick)
    return {"device": device, "seconds": time.perf_counter() - start, "rows": rows}


# --- the command ---------------------------------------------------------------------------

def hardware():
    """What this machine is: platform, CPU model, core count, memory."""
    info = {"platform": platform.platform(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "cpu": platform.processor() or None,
            "memory_gb": None}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu"] = names[0] if names else info["cpu"]
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
        info["memory_gb"] = round(kb / 2**20, 1)
    except (OSError, StopIteration):
        pass
    return info


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser():
    parser = _Parser(
        prog="python -m gradtut bench",
        description="Run gradtut's key measurements on this machine: medians and ratios to a "
                    "reference measured in the same run, a results.json and PNG plots.",
        epilog=f"sections: {', '.join(SECTIONS)}. Ratios below 1 mean faster (or smaller) "
               "than the reference named in each row.")
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes and fewer repeats (about 2 minutes on 2 cores)")
    parser.add_argument("--sections", nargs="+", metavar="NAME", default=list(SECTIONS),
                        help="sections to run (default: all)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="folder for results.json and plots (default: a new folder "
                             "gradtut-bench-DATE-TIME under the current directory)")
    return parser


def output_folder(out=None):
    """Create (if needed) and return the folder the results go to: ``out``, or a new folder
    ``gradtut-bench-DATE-TIME`` in the current directory.

    Raises:
      ValueError: the folder cannot be created or written to (the message says why).
    """
    if out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out, n = f"gradtut-bench-{stamp}", 1
        while os.path.exists(out):
            n += 1
            out = f"gradtut-bench-{stamp}-{n}"
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, ".write-test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        raise ValueError(f"cannot write to --out {out!r}: {err.strerror or err}") from None
    return out


def format_results(results):
    """The results as a text table, one line per measurement.

    Raises:
      ValueError: ``results`` is not what :func:`main` writes (no ``"sections"``, or a row
        without one of ``ROW_KEYS``).
    """
    if not isinstance(results, dict) or not isinstance(results.get("sections"), dict):
        raise ValueError("results must be the dict python -m gradtut bench writes to "
                         "results.json, with a 'sections' dict")
    for section in results["sections"].values():
        for r in section.get("rows", []):
            missing = [k for k in ROW_KEYS if k not in r]
            if missing:
                raise ValueError(f"a row of results is missing {missing}: {r}")
    lines = [f"{'section':16s} {'measurement':42s} {'median':>9s} {'unit':12s} {'ratio':>7s}  "
             "reference"]
    for name, section in results["sections"].items():
        if "error" in section:
            lines.append(f"{name:16s} failed: {section['error']}")
            continue
        for r in section["rows"]:
            note = f" ({r['note']})" if r.get("note") else ""
            lines.append(f"{name:16s} {r['measurement']:42s} {r['value']:9.2f} {r['unit']:12s} "
                         f"{r['ratio']:6.2f}x  {r['reference']}{note}")
    return "\n".join(lines)


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}")
    try:
        out = output_folder(args.out)
    except ValueError as err:
        parser.error(str(err))

    import gradtut
    info = gradtut.setup(seed=0)
    import tensorflow as tf

    from gradtut.plots import plot_ratios
    from gradtut.session import run_in_subprocess

    results = {"created": datetime.datetime.now().isoformat(timespec="seconds"),
               "quick": args.quick, "hardware": hardware(), "python": platform.python_version(),
               "tensorflow": info["tensorflow"], "keras": info["keras"],
               "devices": [d.name for d in tf.config.list_physical_devices()], "sections": {}}
    print(f"gradtut bench{' --quick' if args.quick else ''}: TensorFlow {info['tensorflow']}, "
          f"{results['hardware']['cpu']}, {results['hardware']['cpu_count']} cores, devices "
          f"{results['devices']}; writing to {out}/", flush=True)
    failed = False
    for i, name in enumerate(args.sections, 1):
        print(f"[{i}/{len(args.sections)}] {name} ...", end=" ", flush=True)
        start = time.perf_counter()
        try:
            section = run_in_subprocess("gradtut.bench.command", "run_section",
                                        {"name": name, "quick": args.quick},
                                        timeout_s=600 if args.quick else 3600)
        except RuntimeError as err:
            failed = True
            lines = [line for line in str(err).splitlines() if line.strip()]
            section = {"error": " ".join(dict.fromkeys([lines[0], lines[-1]]))}
            print(f"failed: {section['error']}", flush=True)
        else:
            import matplotlib
            matplotlib.use("Agg")  # files only, no window
            plot_ratios(section["rows"], f"{name} on {section['device']}",
                        os.path.join(out, f"{name}.png"))
            print(f"done in {time.perf_counter() - start:.0f} s on {section['device']}",
                  flush=True)
        results["sections"][name] = section
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(format_results(results))
    print(f"wrote {os.path.join(out, 'results.json')} and one PNG per section")
    return 1 if failed else 0

