"""Every per-example method against the one-tape-per-example loop, on values, on a zoo of models.

Each call gets fresh random inputs, and the reference is computed *after* the method under
test: a broken kernel can leave an earlier, correct result in a reused buffer, and a test that
reused inputs or computed the reference first could then pass by luck.
"""
import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings, strategies as st

from gradtut.checks import assert_gradients_close
from gradtut.per_example import (METHODS, _onednn_enabled, clipped_gradient, ghost_norm_plan,
                                 per_example_gradient_norms, per_example_gradients,
                                 per_example_plan)
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
    if (name in ("attention", "transformer") and method == "vectorized" and batch_size > 1
            and _onednn_enabled()):  # [B, 1, T, d] @ [d, n] inside vectorized_map
        return r"oneDNN.*tensorflow/tensorflow#117700.*multi_head_attention.*TF_ENABLE_ONEDNN_OPTS=0"
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
    return [tf.stack([tf.convert_to_tensor(r[j]) for r in rows])
            for j in range(len(model.trainable_variables))]


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
    assert_gradients_close(grads, expected, **TOL, names=[v.path for v in model.trainable_variables])


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
    assert sorted(plan.values()) == ["dense", "dense", "vectorized"]
    assert set(ghost_norm_plan(models["cnn"]).values()) == {"conv2d", "dense"}
    assert set(ghost_norm_plan(models["text"]).values()) == {"embedding", "dense"}
    assert "vectorized" not in ghost_norm_plan(models["transformer"]).values()
    assert set(ghost_norm_plan(models["attention"]).values()) == {"einsum_dense", "dense"}

    table = per_example_plan(models["no_rule"])
    assert [row[2] for row in table] == ["dense", "vectorized fallback (no rule registered for "
                                         "PReLU)", "dense"]
    assert [row[3] for row in table] == ["ghost", "materialised (vectorized_map)", "ghost"]
    text = str(table)
    assert text.splitlines()[0].split() == ["layer", "class", "rule", "norm"]
    assert "PReLU" in text
    frozen = per_example_plan(models["frozen"])
    assert frozen[0][1:] == ("Dense", "no trainable variables", "-")
    # convolutions: ghost only where the Gram matrix is the cheaper form (2 T^2 <= d p)
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


@pytest.mark.parametrize("name", ["mlp_bf16", "no_rule_bf16", "attention_bf16"])
def test_mixed_bfloat16_gives_float32_gradients_close_to_the_loop(name):
    """Under mixed_bfloat16 the variables are float32 and so are their gradients; the values
    agree with the loop to bfloat16 precision (8 bits of mantissa)."""
    policy = keras.DTypePolicy("mixed_bfloat16")
    keras.utils.set_random_seed(3)
    L = keras.layers
    body = {"mlp_bf16": [keras.Input((12,)), L.Dense(8, activation="tanh", dtype=policy),
                         L.LayerNormalization(dtype=policy)],
            "no_rule_bf16": [keras.Input((12,)), L.Dense(8, dtype=policy), L.PReLU(dtype=policy)],
            "attention_bf16": None}[name]
    if body is None:
        inputs = keras.Input((4, 8))
        h = L.MultiHeadAttention(2, 4, dtype=policy)(inputs, inputs)
        model = keras.Model(inputs, L.Dense(3, dtype="float32")(L.Flatten()(h)))
        x, y = fresh("attention", 6)
    else:
        model = keras.Sequential(body + [L.Dense(3, dtype="float32")])
        x, y = fresh("mlp", 6)
    got = per_example_gradients(model, LOSS, x, y, "outer")
    norms = per_example_gradient_norms(model, LOSS, x, y)
    clipped = clipped_gradient(model, LOSS, x, y, l2_norm_clip=1e6)
    expected = loop(model, x, y)
    assert all(g.dtype == tf.float32 for g in got + clipped) and norms.dtype == tf.float32
    for g, e in zip(got, expected):  # per variable: bfloat16 rounding, relative to its size
        assert_gradients_close(g, e, rtol=0.05, atol=0.02 * float(np.max(np.abs(e))) + 1e-6)
    assert_gradients_close(norms, norms_of(expected), rtol=0.05, atol=1e-4)


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
    noise = np.concatenate([(n - g).numpy().ravel() for n, g in zip(a, clean)])
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
def test_a_variable_without_gradient_is_named(method):
    x, y = np.ones((2, 4), "float32"), np.array([0, 1])
    with pytest.raises(ValueError, match=r"^variable '.*unused_head.*gets no gradient"):
        per_example_gradients(_model_with_unused_head(), LOSS, x, y, method)


def test_map_fn_failing_inside_leaves_distribution_strategies_working():
    """tf.map_fn sets a caching device on the variable scope and, when its fn raises, leaves it
    set: every later MirroredStrategy().scope() then failed."""
    x, y = np.ones((2, 4), "float32"), np.array([0, 1])
    with pytest.raises(ValueError, match="gets no gradient"):
        per_example_gradients(_model_with_unused_head(), LOSS, x, y, "map_fn")
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


def test_vectorized_method_has_no_silent_while_loop_on_dense_models(models):
    """pfor must convert every op of the MLP's per-example gradient: no while_loop fallback."""
    from gradtut.per_example import _one_example_gradients
    from gradtut.vectorize import vectorization_report

    model = models["mlp"]
    x, y = batch_for("mlp", 4)
    one = _one_example_gradients(model, LOSS, model.trainable_variables, False)
    report = vectorization_report(lambda xy: one(*xy), (tf.constant(x), tf.constant(y)))
    assert report.vectorized, report.fallback_ops
    assert_gradients_close(report.result, loop(model, x, y), **TOL)
