"""Every per-example method against the one-tape-per-example loop, on values."""
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings, strategies as st

from gradtut.checks import assert_gradients_close
from gradtut.per_example import (METHODS, clipped_gradient, ghost_norm_plan,
                                 per_example_gradient_norms, per_example_gradients)
from model_zoo import LOSS, MODELS, batch_for

FAST = [m for m in METHODS if m != "loop"]
BATCH_SIZES = [1, 3, 8]
TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def models():
    keras.utils.set_random_seed(0)
    return {name: build() for name, build in MODELS.items()}


@pytest.fixture(scope="module")
def reference(models):
    """Loop gradients per (model, batch size), computed once."""
    cache = {}

    def get(name, batch_size):
        if (name, batch_size) not in cache:
            x, y = batch_for(name, batch_size)
            cache[name, batch_size] = per_example_gradients(models[name], LOSS, x, y, "loop")
        return cache[name, batch_size]

    return get


def loop_by_hand(model, x, y):
    """The most literal reference: eager, one tape per example, no tf.function, no helpers."""
    rows = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = LOSS(y[i:i + 1], model(x[i:i + 1]))[0]
        rows.append(tape.gradient(loss, model.trainable_variables))
    return [tf.stack([tf.convert_to_tensor(r[j]) for r in rows])
            for j in range(len(model.trainable_variables))]


@pytest.mark.parametrize("name", list(MODELS))
def test_loop_matches_hand_written_eager_loop(models, name):
    x, y = batch_for(name, 3)
    expected = loop_by_hand(models[name], x, y)
    assert_gradients_close(per_example_gradients(models[name], LOSS, x, y, "loop"), expected, **TOL)


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("method", FAST)
@pytest.mark.parametrize("name", list(MODELS))
def test_method_matches_loop(models, reference, name, method, batch_size):
    model = models[name]
    x, y = batch_for(name, batch_size)
    grads = per_example_gradients(model, LOSS, x, y, method)
    assert [tuple(g.shape) for g in grads] == [(batch_size, *v.shape)
                                               for v in model.trainable_variables]
    assert_gradients_close(grads, reference(name, batch_size), **TOL,
                           names=[v.path for v in model.trainable_variables])


@pytest.mark.parametrize("name", list(MODELS))
def test_mean_of_per_example_gradients_is_the_batch_gradient(models, name):
    model = models[name]
    x, y = batch_for(name, 8)
    with tf.GradientTape() as tape:
        mean_loss = tf.reduce_mean(LOSS(y, model(x)))
    batch = tape.gradient(mean_loss, model.trainable_variables)
    per_example = per_example_gradients(model, LOSS, x, y, "outer")
    assert_gradients_close([tf.reduce_mean(g, 0) for g in per_example], batch, **TOL)


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("name", list(MODELS))
def test_ghost_norms_match_loop_norms(models, reference, name, batch_size):
    x, y = batch_for(name, batch_size)
    expected = np.sqrt(sum(np.sum(np.square(g.numpy()), axis=tuple(range(1, g.shape.rank)))
                           for g in reference(name, batch_size)))
    ghost = per_example_gradient_norms(models[name], LOSS, x, y)  # default method: ghost
    assert ghost.shape == (batch_size,)
    assert_gradients_close(ghost, expected, **TOL)


@pytest.mark.parametrize("method", FAST)
def test_norms_by_every_method_agree(models, method):
    x, y = batch_for("text", 4)
    assert_gradients_close(per_example_gradient_norms(models["text"], LOSS, x, y, method),
                           per_example_gradient_norms(models["text"], LOSS, x, y, "loop"), **TOL)


def test_ghost_plan_names_the_fallback_layer(models):
    plan = ghost_norm_plan(models["no_rule"])
    assert sorted(plan.values()) == ["dense", "dense", "vectorized"]
    assert plan[models["no_rule"].layers[1].name] == "vectorized"
    assert set(ghost_norm_plan(models["cnn"]).values()) == {"conv2d", "dense"}
    assert set(ghost_norm_plan(models["text"]).values()) == {"embedding", "dense"}


def clipped_by_hand(per_example, clip):
    norms = np.sqrt(sum(np.sum(np.square(g.numpy()), axis=tuple(range(1, g.shape.rank)))
                        for g in per_example))
    scale = np.minimum(1.0, clip / norms)
    return [np.tensordot(scale, g.numpy(), axes=1) / len(norms) for g in per_example], norms


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("name", list(MODELS))
def test_clipped_gradient_matches_clipping_the_loop(models, reference, name, batch_size):
    x, y = batch_for(name, batch_size)
    per_example = reference(name, batch_size)
    _, norms = clipped_by_hand(per_example, 1.0)
    clip = float(np.median(norms)) * 0.9  # some examples clipped, some not (batch > 1)
    expected, _ = clipped_by_hand(per_example, clip)
    got = clipped_gradient(models[name], LOSS, x, y, l2_norm_clip=clip)
    assert_gradients_close(got, expected, **TOL)


def test_clipped_gradient_with_a_huge_clip_is_the_batch_gradient(models):
    x, y = batch_for("mlp", 8)
    model = models["mlp"]
    with tf.GradientTape() as tape:
        mean_loss = tf.reduce_mean(LOSS(y, model(x)))
    batch = tape.gradient(mean_loss, model.trainable_variables)
    assert_gradients_close(clipped_gradient(model, LOSS, x, y, l2_norm_clip=1e6), batch, **TOL)


def test_noise_is_seeded_and_has_the_dp_sgd_scale(models):
    model = models["mlp"]
    x, y = batch_for("mlp", 8)
    clean = clipped_gradient(model, LOSS, x, y, l2_norm_clip=0.5)
    a = clipped_gradient(model, LOSS, x, y, l2_norm_clip=0.5, noise_multiplier=4.0, seed=7)
    b = clipped_gradient(model, LOSS, x, y, l2_norm_clip=0.5, noise_multiplier=4.0, seed=7)
    c = clipped_gradient(model, LOSS, x, y, l2_norm_clip=0.5, noise_multiplier=4.0, seed=8)
    assert_gradients_close(a, b, rtol=0, atol=0)
    assert not np.allclose(a[0], c[0])
    noise = np.concatenate([(n - g).numpy().ravel() for n, g in zip(a, clean)])
    expected_std = 4.0 * 0.5 / 8
    assert noise.size > 100
    assert abs(noise.std() / expected_std - 1) < 0.15
    assert abs(noise.mean()) < 3 * expected_std / np.sqrt(noise.size)


@settings(max_examples=8, deadline=None)
@given(batch_size=st.integers(1, 12), steps=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_dense_on_sequences_matches_loop_for_any_shape(batch_size, steps, seed):
    """Dense on [B, T, d] inputs: the einsum (outer) and Gram (ghost) rules, any B and T."""
    model = _sequence_model()
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch_size, steps, 5)).astype("float32")
    y = rng.integers(0, 3, size=(batch_size,))
    expected = per_example_gradients(model, LOSS, x, y, "loop")
    assert_gradients_close(per_example_gradients(model, LOSS, x, y, "outer"), expected, **TOL)
    norms = np.sqrt(sum(np.sum(np.square(g.numpy()), axis=tuple(range(1, g.shape.rank)))
                        for g in expected))
    assert_gradients_close(per_example_gradient_norms(model, LOSS, x, y), norms, **TOL)


@functools.lru_cache(maxsize=None)
def _sequence_model():
    """Built once: hypothesis calls the test many times, and every build means a new trace."""
    return keras.Sequential([keras.Input((None, 5)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.GlobalMaxPooling1D(), keras.layers.Dense(3)])


def test_embedding_on_single_token_inputs(models):
    model = keras.Sequential([keras.Input((), dtype="int32"), keras.layers.Embedding(7, 3),
                              keras.layers.Dense(3)])
    x = np.array([1, 4, 4, 0, 6], dtype="int32")
    y = np.array([0, 1, 2, 1, 0])
    expected = per_example_gradients(model, LOSS, x, y, "loop")
    assert_gradients_close(per_example_gradients(model, LOSS, x, y, "outer"), expected, **TOL)
    assert_gradients_close(per_example_gradient_norms(model, LOSS, x, y),
                           per_example_gradient_norms(model, LOSS, x, y, "loop"), **TOL)


# ------------------------------------------------------------------------------ bad input


def test_a_loss_that_reduces_over_the_batch_is_refused(models):
    x, y = batch_for("mlp", 4)
    mean_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for call in (per_example_gradients, per_example_gradient_norms):
        with pytest.raises(ValueError, match=r"reduces over the batch.*reduction=None"):
            call(models["mlp"], mean_loss, x, y)


@pytest.mark.parametrize("method", METHODS)
def test_a_plain_function_returning_a_scalar_is_refused(models, method):
    x, y = batch_for("mlp", 4)

    def mean_loss(y_true, y_pred):
        return tf.reduce_mean(LOSS(y_true, y_pred))

    with pytest.raises(ValueError, match=r"per-example losses of shape \[B\]"):
        per_example_gradients(models["mlp"], mean_loss, x, y, method)


def test_mismatched_and_empty_batches_are_refused(models):
    x, y = batch_for("mlp", 4)
    with pytest.raises(ValueError, match="x has 4 examples but y has 3"):
        per_example_gradients(models["mlp"], LOSS, x, y[:3])
    with pytest.raises(ValueError, match="empty"):
        per_example_gradients(models["mlp"], LOSS, x[:0], y[:0])
    with pytest.raises(ValueError, match="empty"):
        clipped_gradient(models["mlp"], LOSS, x[:0], y[:0], l2_norm_clip=1.0)


def test_unknown_method_and_bad_clip_are_refused(models):
    x, y = batch_for("mlp", 2)
    with pytest.raises(ValueError, match="unknown method 'fast'"):
        per_example_gradients(models["mlp"], LOSS, x, y, "fast")
    with pytest.raises(ValueError, match="unknown method 'ghost'"):
        per_example_gradients(models["mlp"], LOSS, x, y, "ghost")
    with pytest.raises(ValueError, match="l2_norm_clip must be positive"):
        clipped_gradient(models["mlp"], LOSS, x, y, l2_norm_clip=0.0)
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0"):
        clipped_gradient(models["mlp"], LOSS, x, y, l2_norm_clip=1.0, noise_multiplier=-1.0)


@pytest.mark.parametrize("method", METHODS)
def test_a_variable_without_gradient_is_named(method):
    inputs = keras.Input((4,))
    unused = keras.layers.Dense(2, name="unused_head")
    unused.build((None, 4))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    model.unused_head = unused  # tracked, so its variables are trainable but never used
    x, y = np.ones((2, 4), "float32"), np.array([0, 1])
    with pytest.raises(ValueError, match=r"unused_head.*(no gradient|gets no gradient)"):
        per_example_gradients(model, LOSS, x, y, method)


def batch_norm_model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
                             keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(3)])


@pytest.mark.parametrize("method", METHODS)
def test_batch_norm_in_training_mode_is_refused(method):
    model = batch_norm_model()
    x, y = np.ones((4, 4), "float32"), np.array([0, 1, 2, 0])
    with pytest.raises(ValueError, match="'bn' is BatchNormalization in training mode"):
        per_example_gradients(model, LOSS, x, y, method, training=True)
    with pytest.raises(ValueError, match="BatchNormalization in training mode"):
        per_example_gradient_norms(model, LOSS, x, y, training=True)


def test_batch_norm_in_inference_mode_matches_loop():
    model = batch_norm_model()
    x, y = batch_for("mlp", 5)
    x = x[:, :4]
    expected = per_example_gradients(model, LOSS, x, y, "loop")
    for method in FAST:
        assert_gradients_close(per_example_gradients(model, LOSS, x, y, method), expected, **TOL)


def dropout_model():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16),
                             keras.layers.Dropout(0.5, name="drop"), keras.layers.Dense(3)])


def dropout_model_with_fallback():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16),
                             keras.layers.LayerNormalization(), keras.layers.Dropout(0.5, name="drop"),
                             keras.layers.Dense(3)])


@pytest.mark.parametrize("method", ["vectorized", "outer"])
def test_dropout_in_a_vectorized_map_is_refused(method):
    x, y = np.ones((4, 6), "float32"), np.array([0, 1, 2, 0])
    model = dropout_model() if method == "vectorized" else dropout_model_with_fallback()
    with pytest.raises(ValueError, match=r"\['drop'\].*ONE mask for the whole batch"):
        per_example_gradients(model, LOSS, x, y, method, training=True)
    with pytest.raises(ValueError, match="ONE mask"):
        clipped_gradient(dropout_model_with_fallback(), LOSS, x, y, 1.0, training=True)


def test_one_pass_methods_handle_dropout_when_no_layer_falls_back():
    """With the dropout mask replayed (same seed state), 'outer', ghost norms and the clipped
    gradient equal what 'jacobian' computes from the same single forward pass."""
    model = dropout_model()
    seeds = model.get_layer("drop").seed_generator.state
    start = seeds.numpy()
    x, y = batch_for("mlp", 6)
    x = x[:, :6]

    def replay(fn):
        seeds.assign(start)
        return fn()

    expected = replay(lambda: per_example_gradients(model, LOSS, x, y, "jacobian", training=True))
    assert len({row.tobytes() for row in np.sign(expected[2].numpy()).reshape(6, -1)}) > 1
    got = replay(lambda: per_example_gradients(model, LOSS, x, y, "outer", training=True))
    assert_gradients_close(got, expected, **TOL)
    norms = np.sqrt(sum(np.sum(np.square(g.numpy()), axis=tuple(range(1, g.shape.rank)))
                        for g in expected))
    ghost = replay(lambda: per_example_gradient_norms(model, LOSS, x, y, training=True))
    assert_gradients_close(ghost, norms, **TOL)
    clip = float(np.median(norms))
    by_hand = [np.tensordot(np.minimum(1, clip / norms), g.numpy(), axes=1) / 6 for g in expected]
    clipped = replay(lambda: clipped_gradient(model, LOSS, x, y, clip, training=True))
    assert_gradients_close(clipped, by_hand, **TOL)


def test_dropout_under_jacobian_draws_a_mask_per_example():
    """Identical examples must still get different gradients: each has its own mask."""
    model = dropout_model()
    x, y = np.ones((6, 6), "float32"), np.zeros(6, "int64")
    grads = per_example_gradients(model, LOSS, x, y, "jacobian", training=True)
    kernel = grads[0].numpy().reshape(6, -1)
    assert len({row.tobytes() for row in kernel}) > 1
    same = per_example_gradients(model, LOSS, x, y, "jacobian", training=False)[0].numpy()
    assert np.allclose(same, same[:1])


def test_vectorized_method_has_no_silent_while_loop_on_dense_models(models):
    """pfor must convert every op of the MLP's per-example gradient: no while_loop fallback."""
    from gradtut.per_example import _one_example_gradients
    from gradtut.vectorize import vectorization_report

    model = models["mlp"]
    x, y = batch_for("mlp", 4)
    one = _one_example_gradients(model, LOSS, model.trainable_variables, False)
    report = vectorization_report(lambda xy: one(*xy), (tf.constant(x), tf.constant(y)))
    assert report.vectorized, report.fallback_ops
    assert_gradients_close(report.result, per_example_gradients(model, LOSS, x, y, "loop"), **TOL)
