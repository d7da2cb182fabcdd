"""Gradient accumulation under a strategy (``gradtut.data_parallel.accumulation``): k micro-batches
then one update, against one single-device step on the concatenated batch."""
import keras
import pytest

from gradtut.checks import assert_gradients_close
from gradtut.data_parallel import make_accumulating_train_step, single_device_step
from model_zoo import LOSS, dp_batches, dp_data, dp_model, strategy_with, twins

TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("replicas", [1, 2])
def test_accumulation_equals_one_step_on_the_concatenated_batch(replicas):
    strategy = strategy_with(replicas)
    model, optimizer, reference, ref_optimizer = twins(strategy, regularized=True)
    x, y = dp_data(48, seed=2)
    distributed, _ = dp_batches(strategy, x, y, 8)
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
        model, optimizer = dp_model(True), keras.optimizers.Adam(0.01)
    reference = dp_model(True)
    reference.set_weights(model.get_weights())
    ref_optimizer = keras.optimizers.Adam(0.01)
    x, y = dp_data(30, seed=5)
    step = make_accumulating_train_step(strategy, model, LOSS, optimizer, global_batch_size=8,
                                        accumulation_steps=2)
    applied = [step(batch)[1] for batch in dp_batches(strategy, x, y, 8)[0]]
    assert applied == [False, True, False, True]   # 8 + 8, then 8 + 6 examples
    for big in (slice(0, 16), slice(16, 30)):
        single_device_step(reference, LOSS, ref_optimizer, x[big], y[big])
    assert_gradients_close(model.get_weights(), reference.get_weights(), **TOL)
