"""Data parallelism with ``tf.distribute``: correctly scaled steps, accumulation, real workers,
the all-reduce's cost, fault tolerance and parameter servers.

Introduced in notebook 03. Every replica holds a copy of the model and computes gradients on
its shard of the global batch; the steps here divide by the global batch's size, so the summed
gradients equal single-device training on the global batch, and the tests check that they do.

One module per topic, in the order notebook 03 teaches them:

- ``steps`` (sections 1-3): :func:`make_train_step`, the single-device reference
  :func:`single_device_step`, :func:`regularization_gradients`, and the replica-mean mistake
  :func:`replica_mean_loss_mistake`;
- ``cost_model`` (section 4 and the answer to exercise 3): :func:`ring_allreduce_seconds` and
  :func:`predicted_step_seconds`;
- ``accumulation`` (section 5): :func:`make_accumulating_train_step`;
- ``multi_worker`` (sections 6-8): :func:`train_synthetic` in real worker processes, with
  checkpoints and resumption, and :func:`fit_under_multi_worker`;
- ``backup`` (section 9): :func:`fit_with_backup` and :func:`fit_in_fresh_process`
  (``BackupAndRestore``), with :data:`CRASH_MARKER`;
- ``parameter_servers`` (section 10): :func:`train_with_parameter_servers` against
  synchronous :func:`train_digits`; ``digits`` holds the task both sections 9 and 10 train.

Every public name is importable from ``gradtut.data_parallel``. A new topic gets its own module
here, imports only from modules of earlier sections, and adds its names below.
"""
from gradtut.data_parallel.accumulation import make_accumulating_train_step
from gradtut.data_parallel.backup import CRASH_MARKER, fit_in_fresh_process, fit_with_backup
from gradtut.data_parallel.cost_model import predicted_step_seconds, ring_allreduce_seconds
from gradtut.data_parallel.multi_worker import fit_under_multi_worker, train_synthetic
from gradtut.data_parallel.parameter_servers import train_digits, train_with_parameter_servers
from gradtut.data_parallel.steps import (
                                         make_train_step,
                                         regularization_gradients,
                                         replica_mean_loss_mistake,
                                         single_device_step,
)

__all__ = [
    "make_train_step", "regularization_gradients", "replica_mean_loss_mistake",
    "single_device_step", "predicted_step_seconds", "ring_allreduce_seconds",
    "make_accumulating_train_step", "fit_under_multi_worker", "train_synthetic",
    "CRASH_MARKER", "fit_in_fresh_process", "fit_with_backup", "train_digits",
    "train_with_parameter_servers",
]
