"""Every per-example method against the one-tape-per-example loop, on values, on a zoo of models.

Each call gets fresh random inputs, and the reference is computed *after* the method under
test: a broken kernel can leave an earlier, correct result in a reused buffer, and a test that
reused inputs or computed the reference first could then pass by luck.
"""
import itertools
import logging
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from gradtut.checks import assert_gradients_close
from gradtut.layer_rules import broadcast_matmul_hazards, onednn_enabled
from gradtut.per_example import (
    METHODS,
    Plan,
    check_model,
    clipped_gradient,
    ghost_norm_plan,
    make_clipped_sum,
    per_example_gradient_norms,
    per_example_gradients,
    per_example_plan,
)
from model_zoo import LOSS, MODELS, batch_for

FAST = [m for m in METHODS if m != "loop"]
BATCH_SIZES = [1, 5, 32]
TOL = {"rtol": 1e-4, "atol": 1e-5}
_seeds = itertools.count(1000)


def fresh(name, batch_size):
    return batch_for(name, batch_size, seed=next(_seeds))


def refusal(name, method, batch_size):
    """The error a method must raise on a zoo model (TensorFlow would be wrong there), or None."""
    if name == "grouped_conv" and method in ("vectorized", "jacobian"):
        return r"\['conv2d.*'conv2d.*\] are grouped convolutions.*method='loop' or 'map_fn'"
    if name == "einsum_variants" and method in ("vectorized", "jacobian"):
        return r"\['conv1d.*'\] are grouped convolutions"
    if (name in ("attention", "transformer", "lora_attention") and method == "vectorized"
            and batch_size > 1
            and onednn_enabled()):  # [B, 1, T, d] @ [d, n] inside vectorized_map
        return (r"oneDNN.*tensorflow/tensorflow#117700.*multi_head_attention"
                r".*TF_ENABLE_ONEDNN_OPTS=0")
    return None


@pytest.fixture(scope="module")
def models():
    keras.utils.set_random_seed(0)
    return {name: build() for name, build in MODELS.items()}


def loop(model, x, y, **kwargs):
    return per_example_gradients(model, LOSS, x, y, "loop", **kwargs)


def norms_of(per_example):
    return np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64)),
                              axis=tuple(range(1, g.shape.rank))) for g in per_example))


def loop_by_hand(model, x, y):
    """The most literal reference: eager, one tape per example, no tf.function, no helpers."""
    rows = []
    for i in range(len(y)):
        xi = [t[i:i + 1] for t in x] if isinstance(x, list) else x[i:i + 1]
        with tf.GradientTape() as tape:
            loss = LOSS(y[i:i + 1], model(xi))[0]
        rows.append(tape.gradient(loss, model.trainable_variables))
    variables = model.trainable_variables  # a variable the loss does not reach: zero
    return [tf.stack([tf.zeros_like(v) if r[j] is None else tf.convert_to_tensor(r[j])
                      for r in rows]) for j, v in enumerate(variables)]


@pytest.mark.parametrize("name", list(MODELS))
def test_loop_matches_hand_written_eager_loop(models, name):
    x, y = fresh(name, 3)
    got = loop(models[name], x, y)
    assert_gradients_close(got, loop_by_hand(models[name], x, y), **TOL)


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("method", FAST)
@pytest.mark.parametrize("name", list(MODELS))
def test_method_matches_loop(models, name, method, batch_size):
    model = models[name]
    x, y = fresh(name, batch_size)
    if refusal(name, method, batch_size):
        with pytest.raises(ValueError, match=refusal(name, method, batch_size)):
            per_example_gradients(model, LOSS, x, y, method)
        return
    grads = per_example_gradients(model, LOSS, x, y, method)
    expected = loop(model, x, y)
    assert [tuple(g.shape) for g in grads] == [(batch_size, *v.shape)
                                               for v in model.trainable_variables]
    assert_gradients_close(grads, expected, **TOL,
                           names=[v.path for v in model.trainable_variables])


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("name", list(MODELS))
def test_ghost_norms_and_clipped_gradient_match_the_loop(models, name, batch_size):
    model = models[name]
    x, y = fresh(name, batch_size)
    ghost = per_example_gradient_norms(model, LOSS, x, y)  # default method: ghost
    expected = norms_of(loop(model, x, y))
    assert ghost.shape == (batch_size,)
    assert_gradients_close(ghost, expected, **TOL)

    # A clip below the median norm: some examples clipped, some not (batch > 1).
    x, y = fresh(name, batch_size)
    clip = float(np.median(per_example_gradient_norms(model, LOSS, x, y))) * 0.9 or 1.0
    got = clipped_gradient(model, LOSS, x, y, l2_norm_clip=clip)
    per_example = loop(model, x, y)
    scale = np.minimum(1.0, clip / np.maximum(norms_of(per_example), 1e-12))
    assert_gradients_close(got, [np.tensordot(scale, g.numpy(), axes=1) / batch_size
                                 for g in per_example], **TOL)


def test_mean_of_per_example_gradients_is_the_batch_gradient(models):
    for name in ("mlp", "transformer", "grouped_conv"):
        model = models[name]
        x, y = fresh(name, 8)
        per_example = per_example_gradients(model, LOSS, x, y, "outer")
        with tf.GradientTape() as tape:
            mean_loss = tf.reduce_mean(LOSS(y, model(x)))
        batch = tape.gradient(mean_loss, model.trainable_variables)
        assert_gradients_close([tf.reduce_mean(g, 0) for g in per_example], batch, **TOL)


def test_plan_shows_rules_fallbacks_and_ghost_choices(models):
    plan = ghost_norm_plan(models["no_rule"])
    assert sorted(plan.values()) == ["dense", "dense", "layer-local"]
    assert set(ghost_norm_plan(models["cnn"]).values()) == {"conv2d", "dense"}
    wide = {row[0]: row[3] for row in per_example_plan(models["wide_conv"])}
    assert list(wide.values()) == ["materialised", "materialised", "ghost", "materialised"]
    assert set(ghost_norm_plan(models["text"]).values()) == {"embedding", "dense"}
    assert "layer-local" not in ghost_norm_plan(models["transformer"]).values()
    assert set(ghost_norm_plan(models["attention"]).values()) == {"einsum_dense", "dense"}

    table = per_example_plan(models["no_rule"])
    assert [row[2] for row in table][::2] == ["dense", "dense"]
    # before a trace the path is not yet decided; after one, it is named
    assert re.fullmatch(r"layer-local(: vectorized_map)? \(no rule registered for PReLU\)",
                        table[1][2]), table[1][2]
    assert [row[3] for row in table] == ["ghost", "materialised", "ghost"]
    assert re.fullmatch(r"3 layers: 2 ghost, 0 materialised by its rule, 1 layer-local "
                        r"\(1 (vectorized_map|not yet traced)\), 0 unreached \(zero\)",
                        table.summary()), table.summary()
    text = str(table)
    assert text.splitlines()[0].split() == ["layer", "class", "rule", "norm"]
    assert "PReLU" in text
    frozen = per_example_plan(models["frozen"])
    assert frozen[0][1:] == ("Dense", "no trainable variables", "-")
    # convolutions: ghost only where the Gram form is the cheaper one (d p > T (d + p))
    cnn_norms = [row[3] for row in per_example_plan(models["cnn"])]
    assert cnn_norms == ["materialised"] * 3 + ["ghost", "ghost"], cnn_norms


@settings(max_examples=6, deadline=None)
@given(batch_size=st.integers(1, 12), steps=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_dense_on_sequences_matches_loop_for_any_shape(batch_size, steps, seed):
    """Dense on [B, T, d] inputs: the einsum (outer) and Gram (ghost) rules, any B and T."""
    model = _sequence_model()
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch_size, steps, 5)).astype("float32")
    y = rng.integers(0, 3, size=(batch_size,))
    got = per_example_gradients(model, LOSS, x, y, "outer")
    norms = per_example_gradient_norms(model, LOSS, x, y)
    expected = loop(model, x, y)
    assert_gradients_close(got, expected, **TOL)
    assert_gradients_close(norms, norms_of(expected), **TOL)


_SEQUENCE_MODEL = []


def _sequence_model():
    """Built once: hypothesis calls the test many times, and every build means a new trace."""
    if not _SEQUENCE_MODEL:
        _SEQUENCE_MODEL.append(keras.Sequential([
            keras.Input((None, 5)), keras.layers.Dense(4, activation="tanh"),
            keras.layers.GlobalMaxPooling1D(), keras.layers.Dense(3)]))
    return _SEQUENCE_MODEL[0]


def test_embedding_on_single_token_inputs():
    model = keras.Sequential([keras.Input((), dtype="int32"), keras.layers.Embedding(7, 3),
                              keras.layers.Dense(3)])
    x = np.array([1, 4, 4, 0, 6], dtype="int32")
    y = np.array([0, 1, 2, 1, 0])
    got = per_example_gradients(model, LOSS, x, y, "outer")
    norms = per_example_gradient_norms(model, LOSS, x, y)
    expected = loop(model, x, y)
    assert_gradients_close(got, expected, **TOL)
    assert_gradients_close(norms, norms_of(expected), **TOL)


# ---------------------------------------------------------------- trainable set and dtypes


def test_freezing_and_unfreezing_a_layer_between_calls():
    """The cached functions follow the trainable set: no stale gradients for frozen layers."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.PReLU(), keras.layers.Dense(3)])
    first = model.layers[0]
    for trainable in (True, False, True, False):
        first.trainable = trainable
        for method in FAST:
            x, y = fresh("mlp", 4)
            x = x[:, :6]
            got = per_example_gradients(model, LOSS, x, y, method)
            expected = loop(model, x, y)
            assert len(got) == len(model.trainable_variables) == (5 if trainable else 3)
            assert_gradients_close(got, expected, **TOL)
        x, y = fresh("mlp", 4)
        x = x[:, :6]
        norms = per_example_gradient_norms(model, LOSS, x, y)
        clipped = clipped_gradient(model, LOSS, x, y, l2_norm_clip=1e6)
        expected = loop(model, x, y)
        assert_gradients_close(norms, norms_of(expected), **TOL)
        assert_gradients_close(clipped, [tf.reduce_mean(g, 0) for g in expected], **TOL)


def test_float64_models():
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh",
                                                                     dtype="float64"),
                              keras.layers.LayerNormalization(dtype="float64"),
                              keras.layers.Dense(3, dtype="float64")])
    x, y = fresh("mlp", 5)
    x = x[:, :6].astype("float64")
    got = per_example_gradients(model, LOSS, x, y, "outer")
    norms = per_example_gradient_norms(model, LOSS, x, y)
    clipped = clipped_gradient(model, LOSS, x, y, l2_norm_clip=0.5, noise_multiplier=1.0, seed=3)
    expected = loop(model, x, y)
    assert all(g.dtype == tf.float64 for g in got + clipped) and norms.dtype == tf.float64
    assert_gradients_close(got, expected, **TOL)
    assert_gradients_close(norms, norms_of(expected), **TOL)


def bf16_zoo_model(name, policy):
    """A small model whose hidden layers compute in ``policy`` (the output layer in float32)."""
    keras.utils.set_random_seed(3)
    L = keras.layers
    if name == "attention_bf16":
        inputs = keras.Input((4, 8))
        h = L.MultiHeadAttention(2, 4, dtype=policy)(inputs, inputs)
        return keras.Model(inputs, L.Dense(3, dtype="float32")(L.Flatten()(h)))
    body = {"mlp_bf16": [keras.Input((12,)), L.Dense(8, activation="tanh", dtype=policy),
                         L.LayerNormalization(dtype=policy)],
            "no_rule_bf16": [keras.Input((12,)), L.Dense(8, dtype=policy),
                             L.PReLU(dtype=policy)],
            # 1 channel: patches from the forward pass; 8 channels: the layer's convolution.
            # tanh, not relu: bfloat16 rounding moves activations across relu's kink, which
            # moves the float32 twin's gradients far more than bfloat16 precision (the
            # bfloat16 loop still agrees with the fast methods there)
            "cnn_bf16": [keras.Input((8, 8, 1)),
                         L.Conv2D(8, 3, padding="same", activation="tanh", dtype=policy),
                         L.Conv2D(4, 3, strides=2, dtype=policy), L.Flatten()]}[name]
    return keras.Sequential(body + [L.Dense(3, dtype="float32")])


@pytest.mark.parametrize("name", ["mlp_bf16", "no_rule_bf16", "attention_bf16", "cnn_bf16"])
def test_mixed_bfloat16_gives_float32_gradients_close_to_the_loop(name):
    """Under mixed_bfloat16 the variables are float32 and so are their gradients; the values
    agree to bfloat16 precision (8 bits of mantissa) with the loop on the same model and with
    a float32 twin (same weights). The tolerance is relative to each variable's largest
    gradient, with a floor of a tenth of the model's: attention's key bias has a gradient of
    exactly 0, which bfloat16 rounding turns into noise of about 1e-3 in the loop as in the fast
    methods (and differently with and without oneDNN)."""
    model = bf16_zoo_model(name, keras.DTypePolicy("mixed_bfloat16"))
    x, y = fresh({"attention_bf16": "attention", "cnn_bf16": "cnn"}.get(name, "mlp"), 6)
    got = per_example_gradients(model, LOSS, x, y, "outer")
    norms = per_example_gradient_norms(model, LOSS, x, y)
    clipped = clipped_gradient(model, LOSS, x, y, l2_norm_clip=1e6)
    expected = loop(model, x, y)
    twin = bf16_zoo_model(name, "float32")
    twin.set_weights(model.get_weights())
    exact = loop(twin, x, y)  # float32 arithmetic: the reference bfloat16 approximates
    assert all(g.dtype == tf.float32 for g in got + clipped) and norms.dtype == tf.float32
    scale = max(float(np.max(np.abs(e))) for e in exact)
    # per variable, with a floor for zero gradients
    for g, e, f in zip(got, expected, exact, strict=True):
        atol = 0.05 * max(float(np.max(np.abs(f))), 0.1 * scale)
        for reference in (e, f):
            assert_gradients_close(g, reference, rtol=0.05, atol=atol)
    assert_gradients_close(clipped, [tf.reduce_mean(e, 0) for e in exact], rtol=0.05,
                           atol=0.03 * scale)
    assert_gradients_close(norms, norms_of(exact), rtol=0.05, atol=1e-3 * scale)


# ------------------------------------------------------------------------------ the noise


def test_noise_is_seeded_and_has_the_dp_sgd_scale(models):
    model = models["mlp"]
    x, y = batch_for("mlp", 8)
    clean = clipped_gradient(model, LOSS, x, y, l2_norm_clip=0.5)
    a = clipped_gradient(model, LOSS, x, y, l2_norm_clip=0.5, noise_multiplier=4.0, seed=7)
    b = clipped_gradient(model, LOSS, x, y, l2_norm_clip=0.5, noise_multiplier=4.0, seed=7)
    c = clipped_gradient(model, LOSS, x, y, l2_norm_clip=0.5, noise_multiplier=4.0, seed=8)
    assert_gradients_close(a, b, rtol=0, atol=0)
    assert not np.allclose(a[0], c[0])
    noise = np.concatenate([(n - g).numpy().ravel() for n, g in zip(a, clean, strict=True)])
    expected_std = 4.0 * 0.5 / 8
    assert noise.size > 100
    assert abs(noise.std() / expected_std - 1) < 0.15
    assert abs(noise.mean()) < 3 * expected_std / np.sqrt(noise.size)


def test_clipped_gradient_with_a_huge_clip_is_the_batch_gradient(models):
    model = models["transformer"]
    x, y = fresh("transformer", 8)
    got = clipped_gradient(model, LOSS, x, y, l2_norm_clip=1e6)
    with tf.GradientTape() as tape:
        mean_loss = tf.reduce_mean(LOSS(y, model(x)))
    assert_gradients_close(got, tape.gradient(mean_loss, model.trainable_variables), **TOL)


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


@pytest.mark.parametrize("method", ("ghost",) + METHODS)
def test_a_rank_one_loss_that_is_not_per_example_is_refused(models, method):
    """A mean over axis 0 returns rank 1, but [classes], not [B]: outer would be 1/B too small
    and jacobian would have the wrong leading dimension if this were accepted."""
    x, y = batch_for("mlp", 4)

    def mean_over_batch(y_true, y_pred):
        return tf.reduce_mean(tf.nn.log_softmax(y_pred), axis=0)

    with pytest.raises(ValueError, match=r"shape \[B\] = \[(4|1)\]; it returned shape \(3,\)"):
        per_example_gradient_norms(models["mlp"], mean_over_batch, x, y, method)


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


def _model_with_unused_head():
    inputs = keras.Input((4,))
    unused = keras.layers.Dense(2, name="unused_head")
    unused.build((None, 4))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    model.unused_head = unused  # tracked, so its variables are trainable but never used
    return model


@pytest.mark.parametrize("method", METHODS)
def test_a_variable_the_loss_does_not_reach_gets_zero_and_one_warning(method):
    """A zero per-example gradient and a warning naming it (Keras's fit warns too), not a
    refusal; the other variables still match the hand-written loop."""
    model = _model_with_unused_head()
    x, y = np.random.default_rng(next(_seeds)).normal(size=(3, 4)).astype("float32"), np.array(
        [0, 1, 2])
    with pytest.warns(UserWarning, match=r"does not reach 2 trainable.*unused_head"):
        got = per_example_gradients(model, LOSS, x, y, method)
    expected = loop_by_hand(model, x, y)
    assert_gradients_close(got, expected, **TOL)
    unused = [i for i, v in enumerate(model.trainable_variables) if "unused_head" in v.path]
    assert len(unused) == 2 and all(not np.any(got[i].numpy()) for i in unused)


def test_map_fn_failing_inside_leaves_distribution_strategies_working():
    """tf.map_fn sets a caching device on the variable scope and, when its fn raises, leaves it
    set: every later MirroredStrategy().scope() then failed."""
    x, y = np.ones((2, 4), "float32"), np.array([0, 1])

    def loss_that_fails_per_example(labels, logits):
        if logits.shape[0] == 1:  # map_fn's function sees one example at a time
            raise ValueError("failing inside map_fn on purpose")
        return LOSS(labels, logits)

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="failing inside map_fn on purpose"):
        per_example_gradients(model, loss_that_fails_per_example, x, y, "map_fn")
    assert tf.compat.v1.get_variable_scope().caching_device is None
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
    assert len(strategy.experimental_local_results(layer.kernel.value)) == 2


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
    for method in FAST:
        x, y = fresh("mlp", 5)
        x = x[:, :4]
        got = per_example_gradients(model, LOSS, x, y, method)
        assert_gradients_close(got, loop(model, x, y), **TOL)


def dropout_model():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16),
                             keras.layers.Dropout(0.5, name="drop"), keras.layers.Dense(3)])


def dropout_model_with_fallback():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16), keras.layers.PReLU(),
                             keras.layers.Dropout(0.5, name="drop"), keras.layers.Dense(3)])


def test_dropout_in_a_vectorized_map_is_refused():
    x, y = np.ones((4, 6), "float32"), np.array([0, 1, 2, 0])
    with pytest.raises(ValueError, match=r"\['drop'\].*ONE mask for the whole batch"):
        per_example_gradients(dropout_model(), LOSS, x, y, "vectorized", training=True)


def replayer(dropout):
    """``replay(fn)``: run ``fn()`` with the Dropout layer's seed state reset to what it is now,
    so every call draws the same masks."""
    seeds = dropout.seed_generator.state
    start = seeds.numpy()

    def replay(fn):
        seeds.assign(start)
        return fn()

    return replay


def test_dropout_beside_a_layer_local_layer_reads_the_forward_masks():
    """PReLU has no rule: its layer-local gradient re-runs PReLU alone, never the Dropout, so
    'outer', ghost norms and the clipped gradient equal 'jacobian' on the same masks."""
    model = dropout_model_with_fallback()
    replay = replayer(model.get_layer("drop"))
    x = np.random.default_rng(next(_seeds)).normal(size=(6, 6)).astype("float32")
    y = np.array([0, 1, 2, 0, 1, 2])
    got = replay(lambda: per_example_gradients(model, LOSS, x, y, "outer", training=True))
    ghost = replay(lambda: per_example_gradient_norms(model, LOSS, x, y, training=True))
    clip = float(np.median(ghost))
    clipped = replay(lambda: clipped_gradient(model, LOSS, x, y, clip, training=True))
    expected = replay(lambda: per_example_gradients(model, LOSS, x, y, "jacobian", training=True))
    assert_gradients_close(got, expected, **TOL)
    norms = norms_of(expected)
    assert_gradients_close(ghost, norms, **TOL)
    by_hand = [np.tensordot(np.minimum(1, clip / norms), g.numpy(), axes=1) / 6 for g in expected]
    assert_gradients_close(clipped, by_hand, **TOL)


class _NoisyScale(keras.layers.Layer):
    """No rule, and dropout inside its own call: a layer-local re-run would draw new masks."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")
        self.drop = keras.layers.Dropout(0.5)

    def call(self, x, training=None):
        return self.drop(x * self.w, training=training)


def test_a_layer_local_layer_that_draws_random_numbers_itself_is_refused():
    model = keras.Sequential([keras.Input((6,)), _NoisyScale(name="noisy"), keras.layers.Dense(3)])
    x, y = np.ones((4, 6), "float32"), np.array([0, 1, 2, 0])
    with pytest.raises(ValueError, match=r"'noisy'.*no rule.*draws random numbers.*training=False"):
        per_example_gradients(model, LOSS, x, y, "outer", training=True)
    with pytest.raises(ValueError, match=r"'noisy'.*draws random numbers"):
        clipped_gradient(model, LOSS, x, y, 1.0, training=True)
    got = per_example_gradients(model, LOSS, x, y, "outer", training=False)
    assert_gradients_close(got, loop(model, x, y), **TOL)


def test_one_pass_methods_handle_dropout_when_no_layer_falls_back():
    """With the dropout mask replayed (same seed state), 'outer', ghost norms and the clipped
    gradient equal what 'jacobian' computes from the same single forward pass."""
    model = dropout_model()
    replay = replayer(model.get_layer("drop"))
    x, y = batch_for("mlp", 6)
    x = x[:, :6]
    got = replay(lambda: per_example_gradients(model, LOSS, x, y, "outer", training=True))
    ghost = replay(lambda: per_example_gradient_norms(model, LOSS, x, y, training=True))
    expected = replay(lambda: per_example_gradients(model, LOSS, x, y, "jacobian", training=True))
    assert len({row.tobytes() for row in np.sign(expected[2].numpy()).reshape(6, -1)}) > 1
    assert_gradients_close(got, expected, **TOL)
    norms = norms_of(expected)
    assert_gradients_close(ghost, norms, **TOL)
    clip = float(np.median(norms))
    clipped = replay(lambda: clipped_gradient(model, LOSS, x, y, clip, training=True))
    by_hand = [np.tensordot(np.minimum(1, clip / norms), g.numpy(), axes=1) / 6 for g in expected]
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


def _pfor_fallback_lines(run):
    """``(run(), the while_loop fallback lines TensorFlow logged meanwhile)``."""
    lines = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = tf.get_logger()
    saved = logger.level, logger.handlers[:], logger.propagate
    logger.setLevel(logging.DEBUG)
    logger.handlers[:] = [handler]
    logger.propagate = False
    try:
        result = run()
    finally:
        logger.setLevel(saved[0])
        logger.handlers[:] = saved[1]
        logger.propagate = saved[2]
    return result, [line for line in lines if "while_loop" in line]


def test_vectorized_method_has_no_silent_while_loop_on_dense_models():
    """pfor must convert every op of the MLP's per-example gradient: no while_loop fallback.
    Seen through the public API, from what TensorFlow logs while per_example_gradients traces
    a fresh model; the CNN (whose filter gradient pfor cannot batch) shows the capture works."""
    keras.utils.set_random_seed(0)
    for name, falls_back in (("mlp", False), ("cnn", True)):
        model = MODELS[name]()
        x, y = fresh(name, 4)
        grads, lines = _pfor_fallback_lines(
            lambda: per_example_gradients(model, LOSS, x, y, "vectorized"))  # noqa: B023
        assert bool(lines) == falls_back, lines
        assert_gradients_close(grads, loop(model, x, y), **TOL)


# ------------------------------------------------- inside a tf.function with unknown batch


def traced_call(model, method, signature_batch=None, **kwargs):
    """``method`` inside a tf.function whose input_signature has batch ``signature_batch``."""

    @tf.function(input_signature=[tf.TensorSpec([signature_batch, 12]),
                                  tf.TensorSpec([signature_batch], tf.int64)])
    def traced(x, y):
        if method == "ghost":
            return per_example_gradient_norms(model, LOSS, x, y)
        if method == "clipped":
            return clipped_gradient(model, LOSS, x, y, **kwargs)
        return per_example_gradients(model, LOSS, x, y, method)

    return traced


@pytest.mark.parametrize("method", FAST + ["ghost", "clipped"])
def test_methods_inside_a_tf_function_with_an_unknown_batch_size(models, method):
    """Traced once with batch None, then run on batches of 5 and 2: values as the loop."""
    model = models["no_rule"]  # Dense layers with a rule, and PReLU falling back to pfor
    traced = traced_call(model, method, l2_norm_clip=0.5)
    for batch_size in (5, 2):
        x, y = fresh("no_rule", batch_size)
        got = traced(x, y)
        expected = loop(model, x, y)
        if method == "ghost":
            expected = norms_of(expected)
        elif method == "clipped":
            scale = np.minimum(1.0, 0.5 / norms_of(expected))
            expected = [np.tensordot(scale, g.numpy(), axes=1) / batch_size for g in expected]
        assert_gradients_close(got, expected, **TOL)


def test_seeded_noise_inside_a_tf_function_equals_the_eager_noise(models):
    """The noise std noise_multiplier * C / B, with B known only when the graph runs."""
    model = models["mlp"]
    x, y = fresh("mlp", 6)
    traced = traced_call(model, "clipped", l2_norm_clip=0.5, noise_multiplier=2.0, seed=11)
    eager = clipped_gradient(model, LOSS, x, y, l2_norm_clip=0.5, noise_multiplier=2.0, seed=11)
    assert_gradients_close(traced(x, y), eager, rtol=1e-6, atol=1e-7)


def test_loop_needs_a_static_batch_size_and_says_how_to_give_one(models):
    model = models["mlp"]
    x, y = fresh("mlp", 3)
    with pytest.raises(ValueError,
                       match=r"method='loop' runs a Python loop.*unknown batch size.*"
                             r"input_signature with a fixed batch size.*method='map_fn'"):
        traced_call(model, "loop")(x, y)
    fixed = traced_call(model, "loop", signature_batch=3)
    assert_gradients_close(fixed(x, y), per_example_gradients(model, LOSS, x, y, "map_fn"), **TOL)


def test_unknown_batch_sizes_that_disagree_fail_when_the_graph_runs(models):
    x, y = fresh("mlp", 4)
    traced = traced_call(models["mlp"], "outer")
    with pytest.raises(tf.errors.InvalidArgumentError, match="x and y have different numbers"):
        traced(x, y[:3])
    with pytest.raises(tf.errors.InvalidArgumentError, match="the batch is empty"):
        traced(x[:0], y[:0])


# ------------------------------------------------------------------- arguments of every kind


def sequential(*layers):
    return keras.Sequential([keras.Input((12,)), *layers])


@pytest.mark.parametrize("method", METHODS)
def test_y_or_x_none_is_refused_with_the_fix(models, method):
    x, y = batch_for("mlp", 2)
    with pytest.raises(ValueError, match=r"y is None; pass one target per example.*placeholder"):
        per_example_gradients(models["mlp"], LOSS, x, None, method)
    with pytest.raises(ValueError, match=r"x is None; pass the inputs"):
        per_example_gradients(models["mlp"], LOSS, None, y, method)


def test_none_in_every_public_function(models):
    x, y = batch_for("two_inputs", 2)
    with pytest.raises(ValueError, match=r"x holds None \(entries \[1\] of its flattened nest\)"):
        per_example_gradients(models["two_inputs"], LOSS, [x[0], None], y)
    x, y = batch_for("mlp", 2)
    with pytest.raises(ValueError, match="y is None"):
        per_example_gradient_norms(models["mlp"], LOSS, x, None)
    with pytest.raises(ValueError, match="y is None"):
        clipped_gradient(models["mlp"], LOSS, x, None, l2_norm_clip=1.0)


def test_a_python_list_of_labels_is_read_as_a_nest_and_the_error_says_so(models):
    x, _ = batch_for("mlp", 2)
    with pytest.raises(ValueError, match=r"y must have a leading batch dimension; got a scalar "
                                         r"\(a Python list is a nest.*np\.asarray"):
        per_example_gradients(models["mlp"], LOSS, x, [0, 1])


LOSS_BY_NAME = (r"loss_fn is the string 'sparse_categorical_crossentropy'.*pass keras\.losses\."
                r"SparseCategoricalCrossentropy\(reduction=None\) \(with from_logits=True")


def test_a_loss_given_by_name_is_refused_with_the_loss_object_to_pass(models):
    x, y = batch_for("mlp", 2)
    name = "sparse_categorical_crossentropy"
    with pytest.raises(ValueError, match=LOSS_BY_NAME):
        per_example_gradients(models["mlp"], name, x, y)
    with pytest.raises(ValueError, match=LOSS_BY_NAME):
        per_example_gradient_norms(models["mlp"], name, x, y)
    with pytest.raises(ValueError, match=LOSS_BY_NAME):
        clipped_gradient(models["mlp"], name, x, y, l2_norm_clip=1.0)
    with pytest.raises(ValueError, match=LOSS_BY_NAME):
        make_clipped_sum(models["mlp"], name)
    with pytest.raises(ValueError,
                       match=r"'mse'.*keras\.losses\.MeanSquaredError\(reduction=None\), or"):
        check_model(models["mlp"], "mse", training=False, method="outer")
    with pytest.raises(TypeError,
                       match=r"loss_fn must be a callable loss_fn\(y_true, y_pred\).*got 3"):
        per_example_gradients(models["mlp"], 3, x, y)


def test_what_is_not_a_keras_model_is_refused_with_the_fix(models):
    x, y = batch_for("mlp", 2)
    layers = models["mlp"].layers
    with pytest.raises(TypeError, match=r"model must be a Keras model.*got list; wrap the layers "
                                        r"in a model: keras\.Sequential\(layers\)"):
        per_example_gradients(layers, LOSS, x, y)
    with pytest.raises(TypeError,
                       match=r"got function; a plain function has no trainable variables"):
        per_example_gradient_norms(lambda v: models["mlp"](v), LOSS, x, y)
    with pytest.raises(TypeError, match=r"got str; pass a built Keras model"):
        clipped_gradient("mlp", LOSS, x, y, l2_norm_clip=1.0)
    with pytest.raises(TypeError, match="got function"):
        make_clipped_sum(lambda v: v, LOSS)
    with pytest.raises(TypeError, match="got list"):
        check_model(layers, LOSS, training=False, method="outer")
    with pytest.raises(TypeError, match="got function"):
        ghost_norm_plan(lambda v: v)
    with pytest.raises(TypeError, match="got list"):
        per_example_plan(layers)


@pytest.mark.parametrize("clip, message", [
    (None, r"got None \(NoneType\)"), ("1.0", r"got '1.0' \(str\)"),
    (np.array([1.0, 2.0]), r"an array of shape \(2,\)"), (float("inf"), "be finite, got inf"),
    (-1.0, "be positive, got -1.0"), (True, r"\(a bool\)"),
])
def test_l2_norm_clip_must_be_one_positive_number(models, clip, message):
    x, y = batch_for("mlp", 2)
    with pytest.raises(ValueError, match="l2_norm_clip must (be a real number.*)?" + message):
        clipped_gradient(models["mlp"], LOSS, x, y, l2_norm_clip=clip)


def test_numpy_numbers_are_fine_for_the_clip_and_the_noise(models):
    x, y = batch_for("mlp", 3)
    got = clipped_gradient(models["mlp"], LOSS, x, y, np.float32(0.5), np.float64(1.0),
                           seed=np.int64(4))
    assert_gradients_close(got, clipped_gradient(models["mlp"], LOSS, x, y, 0.5, 1.0, seed=4),
                           rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed, message", [
    ("0", r"got '0' \(str\)"), (1.5, r"got 1.5 \(float\)"), (-3, "got -3"),
    (True, r"\(a bool\)"), (2**64, "below 2\\*\\*63"),
])
def test_a_bad_seed_is_refused(models, seed, message):
    x, y = batch_for("mlp", 2)
    with pytest.raises(ValueError, match="seed must be .*" + message):
        clipped_gradient(models["mlp"], LOSS, x, y, 1.0, noise_multiplier=1.0, seed=seed)
    with pytest.raises(ValueError, match=r"noise_multiplier must be a real number.*got '1'"):
        clipped_gradient(models["mlp"], LOSS, x, y, 1.0, noise_multiplier="1")


def test_make_clipped_sum_is_the_sum_that_clipped_gradient_averages(models):
    model = models["cnn"]
    x, y = fresh("cnn", 4)
    sums = tf.function(make_clipped_sum(model, LOSS))(tf.constant(x), tf.constant(y), 0.3)
    assert_gradients_close([s / 4 for s in sums],
                           clipped_gradient(model, LOSS, x, y, l2_norm_clip=0.3), **TOL)


def test_broadcast_matmul_hazards_needs_a_graph():
    fn = tf.function(lambda a: tf.linalg.matmul(a, tf.ones([8, 8])))
    with pytest.raises(TypeError, match=r"graph must be a tf\.Graph, got Function \(a tf\.function"
                                        r": pass fn\.get_concrete_function\(\*args\)\.graph\)"):
        broadcast_matmul_hazards(fn)
    with pytest.raises(TypeError, match="graph must be a tf.Graph, got str$"):
        broadcast_matmul_hazards("graph")
    graph = fn.get_concrete_function(tf.TensorSpec([8, 4, 8])).graph
    assert broadcast_matmul_hazards(graph) == []


def test_plan_rows_must_be_four_tuples():
    assert str(Plan([("d", "Dense", "dense", "ghost")])).splitlines()[1].split() == [
        "d", "Dense", "dense", "ghost"]
    with pytest.raises(ValueError, match=r"each Plan row must be a 4-tuple \(layer, class, rule, "
                                         r"norm\), got \('dense', 'Dense'\)"):
        Plan([("dense", "Dense")])
    with pytest.raises(TypeError, match="Plan takes an iterable of .* rows, got int"):
        Plan(4)


def test_a_lora_kernel_made_trainable_again_comes_from_the_same_pass_with_its_masks():
    """After enable_lora, model.trainable = False then True makes Keras's frozen kernel
    trainable again; no rule covers it, so its per-example gradient comes from the Jacobian of
    the same recorded pass: with dropout in training mode, the same masks as the rules see."""
    dense = keras.layers.Dense(6, activation="tanh")
    model = keras.Sequential([keras.Input((5,)), dense, keras.layers.Dropout(0.4, name="drop"),
                              keras.layers.Dense(3)])
    dense.enable_lora(2)
    dense.lora_kernel_b.assign(np.random.default_rng(3).normal(0, 0.3, (2, 6)).astype("float32"))
    model.trainable = False
    model.trainable = True
    assert dense._kernel.trainable  # pylint: disable=protected-access
    replay = replayer(model.get_layer("drop"))
    x = np.random.default_rng(next(_seeds)).normal(size=(6, 5)).astype("float32")
    y = np.array([0, 1, 2, 0, 1, 2])
    got = replay(lambda: per_example_gradients(model, LOSS, x, y, "outer", training=True))
    ghost = replay(lambda: per_example_gradient_norms(model, LOSS, x, y, training=True))
    expected = replay(lambda: per_example_gradients(model, LOSS, x, y, "jacobian", training=True))
    assert_gradients_close(got, expected, **TOL)
    assert_gradients_close(ghost, norms_of(expected), **TOL)
    assert got[0].shape == (6, 5, 6)  # the kernel itself, not only its adapters
