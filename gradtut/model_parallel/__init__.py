"""Model parallelism: stages on devices, a measured GPipe pipeline, tensor splits, DTensor.

Introduced in notebook 04. Every form here splits one model over several devices and is
checked against the unsplit model:

- :func:`place_stages` puts consecutive layers on consecutive devices (naive model parallelism);
- :func:`pipeline_gradients` runs those stages on micro-batches with the GPipe schedule and
  records a measured timeline; :func:`simulate_pipeline` models the same schedule;
- :class:`ColumnParallelDense` and :class:`RowParallelDense` split one Dense kernel over devices
  (the Megatron-LM tensor split);
- :func:`make_mesh`, :func:`shard_mlp_params`, :func:`shard_batch` and :func:`sgd_step` train a
  small MLP on a DTensor ``batch`` x ``model`` mesh; :func:`describe_shards` shows the layout;
- :func:`model_memory_report` does the memory arithmetic that decides which split you need.

On one host the "devices" are virtual CPUs (``gradtut.setup(virtual_cpus=N)``) that share the
same cores and memory. They show the structure of each split exactly, and the pipeline's
overlap is real when each stage has a core of its own (``setup(intra_op_threads=1)`` on two
cores); memory per device cannot be measured separately there.

One module per topic: ``placement``, ``pipeline`` (measured), ``simulator`` (modelled),
``tensor_parallel``, ``mesh`` (DTensor) and ``memory``; the timeline plot is in
:mod:`gradtut.plots`. Every public name is importable from ``gradtut.model_parallel``.
"""
from gradtut.model_parallel.memory import MEMORY_STRATEGIES, model_memory_report, optimizer_slots
from gradtut.model_parallel.mesh import (
                                             MLP_SHARDING,
                                             describe_shards,
                                             gather,
                                             make_mesh,
                                             mlp_loss,
                                             sgd_step,
                                             shard_batch,
                                             shard_mlp_params,
)
from gradtut.model_parallel.pipeline import (
                                             activations_in_flight,
                                             bubble_fraction,
                                             pipeline_gradients,
                                             stage_times,
)
from gradtut.model_parallel.placement import StagedModel, balanced_boundaries, place_stages
from gradtut.model_parallel.simulator import SCHEDULES, schedule_order, simulate_pipeline
from gradtut.model_parallel.tensor_parallel import ColumnParallelDense, RowParallelDense
from gradtut.plots import plot_timeline

__all__ = [
    'StagedModel', 'balanced_boundaries', 'place_stages', 'activations_in_flight',
    'bubble_fraction',
    'pipeline_gradients', 'stage_times', 'SCHEDULES', 'schedule_order', 'simulate_pipeline',
    'ColumnParallelDense', 'RowParallelDense', 'MLP_SHARDING', 'describe_shards', 'gather',
    'make_mesh', 'mlp_loss', 'sgd_step', 'shard_batch', 'shard_mlp_params',
    'MEMORY_STRATEGIES', 'model_memory_report', 'optimizer_slots', 'plot_timeline',
]
