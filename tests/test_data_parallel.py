"""Data-parallel steps against single-device training on the global batch, on values."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from gradtut.checks import assert_gradients_close
from gradtut.data_parallel import (make_accumulating_train_step, make_train_step,
                                   replica_mean_loss_mistake, single_device_step)
from model_zoo import LOSS, strategy_with

TOL = {"rtol": 1e-5, "atol": 1e-6}


def build(regularized):
    keras.utils.set_random_seed(0)
    reg = keras.regularizers.L2(0.01) if regularized else None
    return keras.Sequential([keras.Input((5,)),
                             keras.layers.Dense(8, activation="tanh", kernel_regularizer=reg),
                             keras.layers.Dense(3)])


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype("float32"), rng.integers(0, 3, size=n)


def twins(strategy, regularized=False, learning_rate=0.1):
    """A replicated model/optimizer and a single-device copy with the same initial weights."""
    with strategy.scope():
        model = build(regularized)
        optimizer = keras.optimizers.SGD(learning_rate)
    reference = build(regularized)
    reference.set_weights(model.get_weights())
    return model, optimizer, reference, keras.optimizers.SGD(learning_rate)


def batches(strategy, x, y, batch_size):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    return strategy.experimental_distribute_dataset(ds), [
        (x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x), batch_size)]


@pytest.mark.parametrize("regularized", [False, True])
@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_one_step_equals_single_device_training_on_the_global_batch(replicas, regularized):
    strategy = strategy_with(replicas)
    model, optimizer, reference, ref_optimizer = twins(strategy, regularized)
    x, y = data(16)
    distributed, plain = batches(strategy, x, y, 16)
    step = make_train_step(strategy, model, LOSS, optimizer, global_batch_size=16)
    loss = step(next(iter(distributed)))
    ref_loss = single_device_step(reference, LOSS, ref_optimizer, *plain[0])
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_gradients_close(model.get_weights(), reference.get_weights(), **TOL)
    assert not np.allclose(model.get_weights()[0], build(regularized).get_weights()[0])


@pytest.mark.parametrize("global_batch, n", [(10, 30), (8, 26)])
def test_uneven_splits_and_a_short_final_batch_are_weighted_exactly(global_batch, n):
    """10 over 4 replicas splits 3/3/2/2; 26 in batches of 8 ends with a batch of 2."""
    strategy = strategy_with(4)
    model, optimizer, reference, ref_optimizer = twins(strategy)
    x, y = data(n, seed=1)
    distributed, plain = batches(strategy, x, y, global_batch)
    step = make_train_step(strategy, model, LOSS, optimizer, global_batch_size=global_batch)
    for batch, (xb, yb) in zip(distributed, plain):
        step(batch)
        single_device_step(reference, LOSS, ref_optimizer, xb, yb)
    assert_gradients_close(model.get_weights(), reference.get_weights(), **TOL)


def test_reduce_mean_per_replica_is_off_by_the_replica_count():
    strategy = strategy_with(4)
    with strategy.scope():
        model = build(False)
    wrong, right = replica_mean_loss_mistake(strategy, model, LOSS, *data(16))
    x, y = data(16)
    assert right == pytest.approx(float(tf.reduce_mean(LOSS(y, model(x)))), rel=1e-5)
    assert wrong / right == pytest.approx(4.0, rel=1e-5)


@pytest.mark.parametrize("replicas", [1, 2])
def test_accumulation_equals_one_step_on_the_concatenated_batch(replicas):
    strategy = strategy_with(replicas)
    model, optimizer, reference, ref_optimizer = twins(strategy, regularized=True)
    x, y = data(48, seed=2)
    distributed, _ = batches(strategy, x, y, 8)
    step = make_accumulating_train_step(strategy, model, LOSS, optimizer, global_batch_size=8,
                                        accumulation_steps=3)
    applied = [step(batch)[1] for batch in distributed]
    assert applied == [False, False, True, False, False, True]
    for big in (slice(0, 24), slice(24, 48)):   # two updates: accumulators must reset between
        single_device_step(reference, LOSS, ref_optimizer, x[big], y[big])
    assert_gradients_close(model.get_weights(), reference.get_weights(), **TOL)


def test_accumulation_with_an_optimizer_that_has_slots():
    """Adam's moment slots are built under the strategy's scope when the step is made; built
    lazily inside the compiled apply, under MirroredStrategy, they failed at the first update."""
    strategy = strategy_with(2)
    with strategy.scope():
        model, optimizer = build(True), keras.optimizers.Adam(0.01)
    reference = build(True)
    reference.set_weights(model.get_weights())
    ref_optimizer = keras.optimizers.Adam(0.01)
    x, y = data(30, seed=5)
    step = make_accumulating_train_step(strategy, model, LOSS, optimizer, global_batch_size=8,
                                        accumulation_steps=2)
    applied = [step(batch)[1] for batch in batches(strategy, x, y, 8)[0]]
    assert applied == [False, True, False, True]   # 8 + 8, then 8 + 6 examples
    for big in (slice(0, 16), slice(16, 30)):
        single_device_step(reference, LOSS, ref_optimizer, x[big], y[big])
    assert_gradients_close(model.get_weights(), reference.get_weights(), **TOL)


def test_bad_arguments_get_clear_errors():
    strategy = strategy_with(4)
    model, optimizer, _, _ = twins(strategy)
    with pytest.raises(ValueError, match="smaller than the 4 replicas"):
        make_train_step(strategy, model, LOSS, optimizer, global_batch_size=3)
    with pytest.raises(ValueError, match="global_batch_size must be a positive int"):
        make_train_step(strategy, model, LOSS, optimizer, global_batch_size=8.0)
    with pytest.raises(ValueError, match="accumulation_steps must be a positive int"):
        make_accumulating_train_step(strategy, model, LOSS, optimizer, 8, accumulation_steps=0)
    mean_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = make_train_step(strategy, model, mean_loss, optimizer, global_batch_size=8)
    distributed, _ = batches(strategy, *data(8), 8)
    with pytest.raises(ValueError, match=r"per-example losses of shape \[B\]"):
        step(next(iter(distributed)))


def test_counts_accept_numpy_ints_with_the_same_result_and_refuse_bools():
    """One meaning for an integer argument (gradtut.checks.check_int): np.int64(3) is 3."""
    strategy = strategy_with(2)
    x, y = data(24, seed=4)
    final = []
    for steps, batch_size in ((3, 8), (np.int64(3), np.int64(8))):
        model, optimizer, _, _ = twins(strategy, regularized=True)
        step = make_accumulating_train_step(strategy, model, LOSS, optimizer,
                                            global_batch_size=batch_size,
                                            accumulation_steps=steps)
        applied = [step(batch)[1] for batch in batches(strategy, x, y, 8)[0]]
        assert applied == [False, False, True]
        final.append(model.get_weights())
    assert_gradients_close(final[1], final[0], rtol=0, atol=0)
    model, optimizer, _, _ = twins(strategy)
    make_train_step(strategy, model, LOSS, optimizer, global_batch_size=np.int64(8))
    with pytest.raises(ValueError, match=r"accumulation_steps must be a positive int, got True "
                                         r"\(a bool\)"):
        make_accumulating_train_step(strategy, model, LOSS, optimizer, 8, accumulation_steps=True)
    with pytest.raises(ValueError, match=r"global_batch_size must be a positive int, got True"):
        make_train_step(strategy, model, LOSS, optimizer, global_batch_size=True)
    with pytest.raises(ValueError, match=r"global_batch_size must be a positive int, got True"):
        make_accumulating_train_step(strategy, model, LOSS, optimizer, True, 2)


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size"])
def test_steps_refuse_a_loss_that_reduces_over_the_batch(reduction):
    """A sum or mean over the batch would make an accumulated update depend on how the batch
    is split into micro-batches (and a replica's on how it is sharded)."""
    strategy = strategy_with(2)
    model, optimizer, reference, ref_optimizer = twins(strategy)
    reducing = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    distributed, plain = batches(strategy, *data(8), 8)
    message = r"per-example losses of shape \[B\].*it returned shape \(\).*reduction=None"
    step = make_accumulating_train_step(strategy, model, reducing, optimizer, 8, 2)
    with pytest.raises(ValueError, match=message):
        step(next(iter(distributed)))
    with pytest.raises(ValueError, match=message):
        single_device_step(reference, reducing, ref_optimizer, *plain[0])
    with pytest.raises(ValueError, match=message):
        replica_mean_loss_mistake(strategy, model, reducing, *plain[0])


def test_factories_refuse_what_is_not_a_strategy_model_loss_or_optimizer():
    strategy = strategy_with(2)
    model, optimizer, _, _ = twins(strategy)
    for factory, extra in ((make_train_step, ()), (make_accumulating_train_step, (2,))):
        with pytest.raises(TypeError, match="model must be a Keras model"):
            factory(strategy, model.get_weights(), LOSS, optimizer, 8, *extra)
        with pytest.raises(ValueError, match=r"loss_fn is the string 'mse'.*reduction=None"):
            factory(strategy, model, "mse", optimizer, 8, *extra)
        with pytest.raises(TypeError, match="optimizer must be a Keras optimizer object"):
            factory(strategy, model, LOSS, "sgd", 8, *extra)
        with pytest.raises(TypeError, match="strategy must be a tf.distribute strategy"):
            factory("mirrored", model, LOSS, optimizer, 8, *extra)


def test_replica_mean_loss_mistake_refuses_bad_batches_and_arguments():
    strategy = strategy_with(4)
    with strategy.scope():
        model = build(False)
    x, y = data(16)
    with pytest.raises(ValueError, match="x has 16 examples but y has 15"):
        replica_mean_loss_mistake(strategy, model, LOSS, x, y[:15])
    with pytest.raises(ValueError, match="the batch is empty"):
        replica_mean_loss_mistake(strategy, model, LOSS, x[:0], y[:0])
    with pytest.raises(ValueError, match="the batch size 3 is smaller than the 4 replicas"):
        replica_mean_loss_mistake(strategy, model, LOSS, x[:3], y[:3])
    with pytest.raises(ValueError, match="y is None"):
        replica_mean_loss_mistake(strategy, model, LOSS, x, None)
    with pytest.raises(ValueError, match="loss_fn is the string 'sparse_categorical_crossentropy'"):
        replica_mean_loss_mistake(strategy, model, "sparse_categorical_crossentropy", x, y)
    with pytest.raises(TypeError, match="model must be a Keras model"):
        replica_mean_loss_mistake(strategy, lambda x: x, LOSS, x, y)
    with pytest.raises(TypeError, match="strategy must be a tf.distribute strategy"):
        replica_mean_loss_mistake(None, model, LOSS, x, y)


def test_single_device_step_refuses_bad_batches_and_arguments():
    model, x, y = build(False), *data(8)
    optimizer = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="y is None"):
        single_device_step(model, LOSS, optimizer, x, None)
    with pytest.raises(ValueError, match="x has 8 examples but y has 7"):
        single_device_step(model, LOSS, optimizer, x, y[:7])
    with pytest.raises(ValueError, match="the batch is empty"):
        single_device_step(model, LOSS, optimizer, x[:0], y[:0])
    with pytest.raises(ValueError, match="loss_fn is the string 'mse'"):
        single_device_step(model, "mse", optimizer, x, y)
    with pytest.raises(TypeError, match="model must be a Keras model"):
        single_device_step("model.keras", LOSS, optimizer, x, y)
    with pytest.raises(TypeError, match="optimizer must be a Keras optimizer object"):
        single_device_step(model, LOSS, "sgd", x, y)


# ------------------------------------------------------------------ local multi-worker runs

from gradtut.cluster import WorkerError, launch_local_workers  # noqa: E402
from gradtut.data_parallel import train_synthetic  # noqa: E402
from model_zoo import no_process_matches  # noqa: E402


def test_two_workers_end_identical_and_equal_a_two_replica_mirrored_run():
    results = launch_local_workers("gradtut.data_parallel:train_synthetic", 2, timeout_s=240,
                                   kwargs={"steps": 6})
    w0, w1 = ([np.array(w) for w in r["result"]["weights"]] for r in results)
    assert all(np.array_equal(a, b) for a, b in zip(w0, w1))
    mirrored = train_synthetic(6, mirrored_replicas=2)["weights"]
    assert_gradients_close(w0, [np.array(w) for w in mirrored], **TOL)
    single = train_synthetic(6)["weights"]
    assert_gradients_close(w0, [np.array(w) for w in single], **TOL)


def test_a_killed_worker_fails_fast_and_the_rerun_resumes_from_the_checkpoint(tmp_path):
    kwargs = {"steps": 8, "checkpoint_dir": str(tmp_path), "checkpoint_every": 2}
    with pytest.raises(WorkerError, match=r"worker 1 of 2 exited with code 17"):
        launch_local_workers("gradtut.data_parallel:train_synthetic", 2, timeout_s=120,
                             kwargs={**kwargs, "crash_at_step": 5})
    assert no_process_matches("train_synthetic")
    results = launch_local_workers("gradtut.data_parallel:train_synthetic", 2, timeout_s=240,
                                   kwargs=kwargs)
    assert [r["result"]["start_step"] for r in results] == [4, 4]
    uninterrupted = train_synthetic(8)["weights"]
    assert_gradients_close([np.array(w) for w in results[0]["result"]["weights"]],
                           [np.array(w) for w in uninterrupted], **TOL)


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, "steps must be a positive int, got 0"),
    ({"steps": 2.0}, r"steps must be a positive int, got 2.0 \(float\)"),
    ({"steps": 2, "global_batch_size": True}, r"global_batch_size must be a positive int, got True"),
    ({"steps": 2, "checkpoint_every": 0}, "checkpoint_every must be a positive int, got 0"),
    ({"steps": 2, "crash_at_step": -1}, "crash_at_step must be an int >= 0, got -1"),
    ({"steps": 2, "mirrored_replicas": 2.5}, "mirrored_replicas must be a positive int"),
    ({"steps": 2, "seed": "0"}, "seed must be an int >= 0, got '0'"),
])
def test_train_synthetic_refuses_bad_arguments_before_starting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        train_synthetic(**kwargs)


def test_train_synthetic_accepts_numpy_ints_with_the_same_result():
    plain = train_synthetic(2, global_batch_size=8)
    numpy = train_synthetic(np.int64(2), global_batch_size=np.int64(8))
    assert numpy["weights"] == plain["weights"] and numpy["steps"] == 2


def test_fit_under_multi_worker_refuses_bad_arguments_before_starting():
    from gradtut.data_parallel import fit_under_multi_worker

    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        fit_under_multi_worker(steps=0)
    with pytest.raises(ValueError, match="global_batch_size must be a positive int, got True"):
        fit_under_multi_worker(global_batch_size=True)


# ----------------------------------------------------------------------- all-reduce model

from gradtut.data_parallel import predicted_step_seconds, ring_allreduce_seconds  # noqa: E402


def test_ring_allreduce_moves_two_n_minus_one_over_n_of_the_gradient():
    gb = 1e9
    assert ring_allreduce_seconds(gb, 1, 1e9) == 0.0
    assert ring_allreduce_seconds(gb, 2, 1e9) == pytest.approx(1.0)        # 2 * 1/2
    assert ring_allreduce_seconds(gb, 4, 1e9) == pytest.approx(1.5)        # 2 * 3/4
    assert ring_allreduce_seconds(gb, 4, 1e9, latency_s=0.01) == pytest.approx(1.5 + 6 * 0.01)
    assert ring_allreduce_seconds(gb, 1000, 1e9) < 2.0


def test_predicted_step_time_adds_split_compute_and_communication():
    assert predicted_step_seconds(1e-3, 1024, 0, 4, 1e9) == pytest.approx(0.256)
    assert predicted_step_seconds(1e-3, 1024, 1e9, 2, 1e9) == pytest.approx(0.512 + 1.0)
    with pytest.raises(ValueError, match="positive bandwidth"):
        ring_allreduce_seconds(1e9, 2, 0)
    with pytest.raises(ValueError, match="workers must be a positive int, got 0"):
        ring_allreduce_seconds(1e9, 0, 1e9)


def test_cost_model_arguments_are_checked():
    with pytest.raises(ValueError, match=r"workers must be a positive int, got 2.5 \(float\)"):
        ring_allreduce_seconds(1e9, 2.5, 1e9)
    with pytest.raises(ValueError, match=r"workers must be a positive int, got True \(a bool\)"):
        ring_allreduce_seconds(1e9, True, 1e9)
    with pytest.raises(ValueError, match="gradient_bytes must be >= 0, got -1"):
        ring_allreduce_seconds(-1, 2, 1e9)
    with pytest.raises(ValueError, match="latency_s must be >= 0"):
        ring_allreduce_seconds(1e9, 2, 1e9, latency_s=-0.1)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be a real number"):
        ring_allreduce_seconds(1e9, 2, "10 GB/s")
    with pytest.raises(ValueError, match="workers must be a positive int, got 0"):
        predicted_step_seconds(1e-3, 1024, 1e9, 0, 1e9)
    with pytest.raises(ValueError, match=r"global_batch_size must be a positive int, got 1024.0"):
        predicted_step_seconds(1e-3, 1024.0, 1e9, 4, 1e9)
    with pytest.raises(ValueError, match="compute_seconds_per_example must be >= 0"):
        predicted_step_seconds(-1e-3, 1024, 1e9, 4, 1e9)
    assert ring_allreduce_seconds(1e9, np.int64(4), 1e9) == ring_allreduce_seconds(1e9, 4, 1e9)
    assert predicted_step_seconds(1e-3, np.int64(1024), 1e9, np.int64(4), 1e9) == \
        predicted_step_seconds(1e-3, 1024, 1e9, 4, 1e9)




# ------------------------------------------------------------------ fit that survives a crash

from gradtut.cluster import run_until_marker_then_kill  # noqa: E402
from gradtut.data_parallel import (CRASH_MARKER, fit_with_backup, train_digits,  # noqa: E402
                                   train_with_parameter_servers)
from gradtut.session import run_in_subprocess  # noqa: E402


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
                                                     uninterrupted_fit["weights"]))
    assert same is equal


def test_the_training_runs_refuse_bad_input(tmp_path):
    from gradtut.data_parallel import fit_in_fresh_process
    with pytest.raises(ValueError, match="backup_dir must be a folder path"):
        fit_in_fresh_process(None)
    with pytest.raises(ValueError, match="crash batch must be an int >= 0"):
        fit_in_fresh_process(str(tmp_path), crash_at=(1, -1))
    with pytest.raises(ValueError, match="save_freq must be a positive int"):
        fit_with_backup(str(tmp_path), save_freq="batch")
    with pytest.raises(ValueError, match="epochs must be a positive int"):
        fit_with_backup(str(tmp_path), epochs=0)
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
