"""Data-parallel steps (``gradtut.data_parallel.steps``) against single-device training on the
global batch, on values; the replica-mean mistake measured; every step factory's bad input."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from gradtut.checks import assert_gradients_close
from gradtut.data_parallel import (
    make_accumulating_train_step,
    make_train_step,
    replica_mean_loss_mistake,
    single_device_step,
)
from model_zoo import LOSS, dp_batches, dp_data, dp_model, strategy_with, twins

TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("regularized", [False, True])
@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_one_step_equals_single_device_training_on_the_global_batch(replicas, regularized):
    strategy = strategy_with(replicas)
    model, optimizer, reference, ref_optimizer = twins(strategy, regularized)
    x, y = dp_data(16)
    distributed, plain = dp_batches(strategy, x, y, 16)
    step = make_train_step(strategy, model, LOSS, optimizer, global_batch_size=16)
    loss = step(next(iter(distributed)))
    ref_loss = single_device_step(reference, LOSS, ref_optimizer, *plain[0])
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_gradients_close(model.get_weights(), reference.get_weights(), **TOL)
    assert not np.allclose(model.get_weights()[0], dp_model(regularized).get_weights()[0])


@pytest.mark.parametrize("global_batch, n", [(10, 30), (8, 26)])
def test_uneven_splits_and_a_short_final_batch_are_weighted_exactly(global_batch, n):
    """10 over 4 replicas splits 3/3/2/2; 26 in batches of 8 ends with a batch of 2."""
    strategy = strategy_with(4)
    model, optimizer, reference, ref_optimizer = twins(strategy)
    x, y = dp_data(n, seed=1)
    distributed, plain = dp_batches(strategy, x, y, global_batch)
    step = make_train_step(strategy, model, LOSS, optimizer, global_batch_size=global_batch)
    for batch, (xb, yb) in zip(distributed, plain, strict=True):
        step(batch)
        single_device_step(reference, LOSS, ref_optimizer, xb, yb)
    assert_gradients_close(model.get_weights(), reference.get_weights(), **TOL)


def test_reduce_mean_per_replica_is_off_by_the_replica_count():
    strategy = strategy_with(4)
    with strategy.scope():
        model = dp_model(False)
    wrong, right = replica_mean_loss_mistake(strategy, model, LOSS, *dp_data(16))
    x, y = dp_data(16)
    assert right == pytest.approx(float(tf.reduce_mean(LOSS(y, model(x)))), rel=1e-5)
    assert wrong / right == pytest.approx(4.0, rel=1e-5)


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
    distributed, _ = dp_batches(strategy, *dp_data(8), 8)
    with pytest.raises(ValueError, match=r"per-example losses of shape \[B\]"):
        step(next(iter(distributed)))


def test_counts_accept_numpy_ints_with_the_same_result_and_refuse_bools():
    """One meaning for an integer argument (gradtut.checks.check_int): np.int64(3) is 3."""
    strategy = strategy_with(2)
    x, y = dp_data(24, seed=4)
    final = []
    for steps, batch_size in ((3, 8), (np.int64(3), np.int64(8))):
        model, optimizer, _, _ = twins(strategy, regularized=True)
        step = make_accumulating_train_step(strategy, model, LOSS, optimizer,
                                            global_batch_size=batch_size,
                                            accumulation_steps=steps)
        applied = [step(batch)[1] for batch in dp_batches(strategy, x, y, 8)[0]]
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
    distributed, plain = dp_batches(strategy, *dp_data(8), 8)
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
        model = dp_model(False)
    x, y = dp_data(16)
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
    model, x, y = dp_model(False), *dp_data(8)
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


def activity_model():
    """dp_model's shape with an activity regulariser (recorded in the forward pass) and a
    kernel regulariser (computed from the weights)."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(8, activation="tanh", activity_regularizer=keras.regularizers.L2(0.5),
                           kernel_regularizer=keras.regularizers.L2(0.01)),
        keras.layers.Dense(3)])


def test_losses_recorded_in_the_forward_pass_count_on_one_replica():
    """On one replica the activity loss is the whole batch's, so it is kept, and the step
    equals single-device training with it (which differs from training without it)."""
    strategy = strategy_with(1)
    with strategy.scope():
        model, optimizer = activity_model(), keras.optimizers.SGD(0.1)
    reference = activity_model()
    x, y = dp_data(16, seed=3)
    distributed, plain = dp_batches(strategy, x, y, 16)
    loss = make_train_step(strategy, model, LOSS, optimizer, 16)(next(iter(distributed)))
    ref_loss = single_device_step(reference, LOSS, keras.optimizers.SGD(0.1), *plain[0])
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert_gradients_close(model.get_weights(), reference.get_weights(), **TOL)
    without = dp_model(regularized=True)
    without_loss = single_device_step(without, LOSS, keras.optimizers.SGD(0.1), *plain[0])
    assert float(ref_loss) > float(without_loss) + 0.01  # the activity term is in the loss


def test_losses_recorded_in_the_forward_pass_are_refused_where_they_would_be_wrong():
    """Over replicas they came out 2-5% off (Keras divides by each replica's share, on layers
    the replicas share), and accumulation would drop them: both refuse."""
    from gradtut.efficiency import accumulated_gradients
    from gradtut.efficiency import make_accumulating_train_step as one_device_accumulation
    x, y = dp_data(16, seed=3)
    strategy = strategy_with(2)
    with strategy.scope():
        model, optimizer = activity_model(), keras.optimizers.SGD(0.1)
    distributed, _ = dp_batches(strategy, x, y, 16)
    with pytest.raises(ValueError, match="activity_regularizer or add_loss.*2 replicas"):
        make_train_step(strategy, model, LOSS, optimizer, 16)(next(iter(distributed)))
    accumulate = make_accumulating_train_step(strategy, model, LOSS, optimizer, 16, 2)
    with pytest.raises(ValueError, match="gradient accumulation"):
        accumulate(next(iter(distributed)))
    with pytest.raises(ValueError, match="accumulated_gradients"):
        accumulated_gradients(activity_model(), LOSS, x, y, 8)
    with pytest.raises(ValueError, match="gradient accumulation"):
        one_device_accumulation(activity_model(), LOSS, keras.optimizers.SGD(0.1), 2)(x, y)


def test_regularization_gradients_leave_out_the_losses_a_forward_pass_recorded():
    """After a forward pass, only the kernel regulariser's gradient (2 * 0.01 * kernel, over
    the replicas) is returned; the recorded activity loss belongs to that pass's batch."""
    from gradtut.data_parallel import regularization_gradients
    model = activity_model()
    model(dp_data(4)[0])
    assert len(model.losses) == 2  # the activity loss and the kernel's
    grads = regularization_gradients(model, replicas=2)
    np.testing.assert_allclose(grads[0], 2 * 0.01 * model.layers[0].kernel.numpy() / 2,
                               rtol=1e-6)
    assert grads[1:] == [None, None, None]


def clipped_twins(strategy, clipnorm=0.01):
    with strategy.scope():
        model, optimizer = dp_model(False), keras.optimizers.SGD(0.1, clipnorm=clipnorm)
    reference = dp_model(False)
    reference.set_weights(model.get_weights())
    return model, optimizer, reference, keras.optimizers.SGD(0.1, clipnorm=clipnorm)


def test_keras_clips_each_replica_share_so_a_clipping_optimizer_is_refused_over_replicas():
    x, y = dp_data(16)
    strategy = strategy_with(2)
    model, optimizer, reference, ref_optimizer = clipped_twins(strategy)
    distributed, plain = dp_batches(strategy, x, y, 16)
    for factory in (lambda: make_train_step(strategy, model, LOSS, optimizer, 16),
                    lambda: make_accumulating_train_step(strategy, model, LOSS, optimizer, 16, 2)):
        with pytest.raises(ValueError, match=r"clips \(clipnorm=0.01\) and there are 2 replicas"):
            factory()

    # Why: Keras's apply clips the replica's share, then sums. Each share's mean-loss gradient
    # over the global batch, applied inside the replicas, lands elsewhere than one clipped step.
    @tf.function
    def per_replica_apply(batch):
        def replica(xs, ys):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(LOSS(ys, model(xs, training=True))) / 16
            optimizer.apply(tape.gradient(loss, model.trainable_variables),
                            model.trainable_variables)
        strategy.run(replica, args=batch)

    per_replica_apply(next(iter(distributed)))
    single_device_step(reference, LOSS, ref_optimizer, *plain[0])
    assert not np.allclose(model.get_weights()[0], reference.get_weights()[0], rtol=1e-3)


def test_a_clipping_optimizer_on_one_replica_equals_single_device_training():
    x, y = dp_data(16)
    strategy = strategy_with(1)
    model, optimizer, reference, ref_optimizer = clipped_twins(strategy)
    distributed, plain = dp_batches(strategy, x, y, 16)
    make_train_step(strategy, model, LOSS, optimizer, 16)(next(iter(distributed)))
    single_device_step(reference, LOSS, ref_optimizer, *plain[0])
    assert_gradients_close(model.get_weights(), reference.get_weights(), **TOL)
    assert not np.allclose(model.get_weights()[0], dp_model(False).get_weights()[0])
