"""The shared models (``gradtut.models``): builders are deterministic and check their sizes, and
the batch gradient that the benchmarks time equals a tape over the mean loss."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from gradtut.checks import assert_gradients_close
from gradtut.models import MODELS, bert_classifier, cnn, make_batch_gradient, mlp, transformer

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_builder_is_seeded_and_builds_on_its_input_shape(name):
    shape, build = MODELS[name]
    first, second = build(seed=3), build(seed=3)
    assert first.input_shape[1:] == shape
    for a, b in zip(first.weights, second.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert not all(np.array_equal(a.numpy(), b.numpy())
                   for a, b in zip(first.weights, build(seed=4).weights, strict=True))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_batch_gradient_equals_a_tape_over_the_mean_loss(name):
    shape, build = MODELS[name]
    model = build(classes=4)
    batch_gradient = make_batch_gradient(model, LOSS)
    rng = np.random.default_rng(7)
    for batch in (1, 5):  # fresh inputs each call; the reference computed after
        x = tf.constant(rng.normal(size=(batch, *shape)).astype("float32"))
        y = tf.constant(rng.integers(0, 4, size=batch))
        got = batch_gradient(x, y)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(LOSS(y, model(x)))
        assert_gradients_close(got, tape.gradient(loss, model.trainable_variables),
                               rtol=1e-5, atol=1e-6)


def test_the_builders_and_the_batch_gradient_refuse_bad_input():
    with pytest.raises(ValueError, match="classes must be a positive int"):
        cnn(classes=0)
    with pytest.raises(ValueError, match="hidden must be a positive int"):
        mlp(hidden=2.5)
    with pytest.raises(ValueError, match="seed must be"):
        mlp(seed=-1)
    with pytest.raises(ValueError, match="width 30 does not split into 4 heads"):
        transformer(width=30, heads=4)
    with pytest.raises(ValueError, match="hidden 127 does not split into 2 heads"):
        bert_classifier(hidden=127)
    with pytest.raises(ValueError, match="lora_rank must be a positive int"):
        bert_classifier(lora_rank=0)
    with pytest.raises(TypeError, match="keras.Sequential"):
        make_batch_gradient([keras.layers.Dense(2)], LOSS)
    with pytest.raises(ValueError, match="loss_fn is the string 'mse'"):
        make_batch_gradient(mlp(input_dim=3, hidden=2), "mse")
