"""``python -m gradtut bench`` and the workloads it times, in one place.

- :mod:`gradtut.bench.command`: the command (sections, output files, the results table);
- :mod:`gradtut.bench.per_example`: notebook 01's models and per-example/DP-SGD timings;
- :mod:`gradtut.bench.input_gradients`: notebook 02's input-gradient and ``map_fn`` timings.

The timing helpers themselves are in :mod:`gradtut.measure`.
"""
