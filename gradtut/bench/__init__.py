"""``python -m gradtut bench``: the command and its timing harnesses.

- :mod:`gradtut.bench.command`: the command (sections, output files, the results table);
- :mod:`gradtut.bench.per_example`: notebook 01's per-example and DP-SGD methods timed against
  the batch gradient (the models are :mod:`gradtut.models`);
- :mod:`gradtut.bench.input_gradients`: notebook 02's input-gradient methods timed against one
  batched pass (the ``map_fn`` workloads are in :mod:`gradtut.vectorize`).

The timing helpers themselves are in :mod:`gradtut.measure`. Nothing in the package imports
``bench``: it times what the topic modules define.
"""
