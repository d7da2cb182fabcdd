"""``model.fit`` that survives a crash: ``keras.callbacks.BackupAndRestore``, a run killed at a
chosen batch, and the rerun that resumes it (notebook 03, section 9)."""
import json
import os
import time

import keras
import tensorflow as tf

from gradtut.checks import check_int
from gradtut.data_parallel.digits import _DIGITS_LOSS, _digits, _digits_mlp

CRASH_MARKER = "gradtut: crash point reached"


def fit_with_backup(backup_dir, epochs=3, batch_size=64, save_freq="epoch", crash_at=None,
                    seed=0, replicas=2):
    """``model.fit`` of the digits MLP under a ``MirroredStrategy`` of ``replicas`` virtual
    CPUs, with ``keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq)``. Meant
    for a fresh process (it calls ``gradtut.setup``): a second call with the same
    ``backup_dir`` resumes from the backup there.

    The data order is the same every epoch (``shuffle=False``), so an uninterrupted run and a
    resumed one see the same batches, unless the resume repeats some.

    Args:
      crash_at: None, or ``(epoch, batch)``: after that batch, print :data:`CRASH_MARKER` and
        wait to be killed from outside (``gradtut.cluster.run_until_marker_then_kill``).

    Returns:
      dict ``{"weights", "batches_run", "backup"}``: the final weights (nested lists), every
      ``(epoch, batch)`` this process trained on, and the backup's metadata at the start.

    Raises:
      ValueError: bad counts, ``save_freq`` not ``"epoch"`` or a positive int.
    """
    import gradtut  # pylint: disable=import-outside-toplevel

    epochs, batch_size = check_int(epochs, "epochs"), check_int(batch_size, "batch_size")
    if save_freq != "epoch":
        check_int(save_freq, "save_freq")
    gradtut.setup(seed=seed, virtual_cpus=check_int(replicas, "replicas"))
    metadata_path = os.path.join(backup_dir, "training_metadata.json")
    backup = None
    if os.path.exists(metadata_path):
        with open(metadata_path, encoding="utf-8") as f:
            backup = json.load(f)
    (x, y), _ = _digits()
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = _digits_mlp(seed)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=_DIGITS_LOSS)
    seen = _BatchesSeen(crash_at)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq),
                         seen])
    return {"weights": [w.tolist() for w in model.get_weights()],
            "batches_run": seen.batches, "backup": backup}


class _BatchesSeen(keras.callbacks.Callback):
    """Records every (epoch, batch) trained in this process; stops at ``crash_at`` to be killed."""

    def __init__(self, crash_at):
        super().__init__()
        self.crash_at, self.batches, self.epoch = crash_at and tuple(crash_at), [], 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append((self.epoch, batch))
        if (self.epoch, batch) == self.crash_at:
            print(CRASH_MARKER, flush=True)
            time.sleep(600)  # killed from outside before this ends


def fit_in_fresh_process(backup_dir, crash_at=None, timeout_s=300, **kwargs):
    """:func:`fit_with_backup` in a fresh Python process (it needs its own virtual CPUs).

    With ``crash_at=(epoch, batch)`` the process is killed from outside there
    (``gradtut.cluster.run_until_marker_then_kill``) and the result is
    ``{"killed": True, ...}``; otherwise it is :func:`fit_with_backup`'s result.

    Raises:
      ValueError: bad arguments (checked here, before a process starts), among them a
        ``crash_at`` epoch at or beyond ``epochs``.
      RuntimeError: the process failed, finished without reaching ``crash_at``, or timed out.
    """
    from gradtut.cluster import run_until_marker_then_kill  # pylint: disable=import-outside-toplevel
    from gradtut.session import run_in_subprocess  # pylint: disable=import-outside-toplevel

    if not isinstance(backup_dir, str) or not backup_dir:
        raise ValueError(f"backup_dir must be a folder path (a string), got {backup_dir!r}")
    if crash_at is not None:
        epoch, batch = crash_at
        crash_at = [check_int(epoch, "crash epoch", 0), check_int(batch, "crash batch", 0)]
        epochs = kwargs.get("epochs", 3)
        if isinstance(epochs, int) and crash_at[0] >= epochs:
            raise ValueError(f"crash_at epoch {crash_at[0]} is never reached in {epochs} "
                             "epochs (they count from 0): pass a smaller epoch")
        run = run_until_marker_then_kill(__name__, "fit_with_backup",
                                         {"backup_dir": backup_dir, "crash_at": crash_at,
                                          **kwargs}, CRASH_MARKER, timeout_s=timeout_s)
        if not run["killed"]:
            raise RuntimeError(f"the run finished without reaching crash_at={tuple(crash_at)} "
                               "(its epoch has fewer batches), so nothing was killed: pass a "
                               "smaller batch index")
        return run
    return run_in_subprocess(__name__, "fit_with_backup",
                             {"backup_dir": backup_dir, **kwargs}, timeout_s=timeout_s)
