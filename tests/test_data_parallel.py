"""Data-parallel steps against single-device training on the global batch, on values."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from gradtut.checks import assert_gradients_close
from gradtut.data_parallel import (accumulating_train_step, make_train_step,
                                   replica_mean_loss_mistake, single_device_step)
from model_zoo import LOSS

TOL = {"rtol": 1e-5, "atol": 1e-6}


def strategy_with(replicas):
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)],
                                          cross_device_ops=tf.distribute.ReductionToOneDevice())


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
    step = accumulating_train_step(strategy, model, LOSS, optimizer, global_batch_size=8,
                                   accumulation_steps=3)
    applied = [step(batch)[1] for batch in distributed]
    assert applied == [False, False, True, False, False, True]
    for big in (slice(0, 24), slice(24, 48)):   # two updates: accumulators must reset between
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
        accumulating_train_step(strategy, model, LOSS, optimizer, 8, accumulation_steps=0)
    mean_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = make_train_step(strategy, model, mean_loss, optimizer, global_batch_size=8)
    distributed, _ = batches(strategy, *data(8), 8)
    with pytest.raises(ValueError, match=r"per-example losses of shape \[B\]"):
        step(next(iter(distributed)))
