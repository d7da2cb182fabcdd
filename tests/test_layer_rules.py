"""The rule registry: a reader's own rule, exact-class matching, and the TensorFlow bug the rules
route around (reproduced in plain TensorFlow, in a child process because it can corrupt memory)."""
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradtut import layer_rules
from gradtut.checks import assert_gradients_close
from gradtut.layer_rules import (
    DenseRule,
    EinsumDenseRule,
    EmbeddingRule,
    GroupNormalizationRule,
    LayerNormalizationRule,
    LayerRule,
    LocalRule,
    LoraRule,
    PositionEmbeddingRule,
    ReversibleEmbeddingRule,
    RMSNormalizationRule,
    class_path,
    covered_layers,
    explain,
    ghost_sq_norms_of,
    layer_paths,
    one_pass,
    onednn_enabled,
    owned_trainable,
    per_example_of,
    recording,
    register_rule,
    registry_version,
    rule_for,
    squared_norms,
    unregister_rule,
    warn_unreached,
    weighted_sum_of,
)
from gradtut.layer_rules.lora import LoraCapable, equations
from gradtut.per_example import (
    clipped_gradient,
    per_example_gradient_norms,
    per_example_gradients,
    per_example_plan,
)
from model_zoo import LOSS

TOL = {"rtol": 1e-4, "atol": 1e-5}


class Scale(keras.layers.Layer):
    """y = x * w, one weight per feature: no rule until a test registers one."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w


class ScaleSubclass(Scale):
    def call(self, x):
        return x * self.w * 2.0


class ScaleChild(Scale):
    """Does not override call: computes what Scale does, so Scale's rule covers it."""


def scale_model(layer_class):
    keras.utils.set_random_seed(4)
    return keras.Sequential([keras.Input((3, 5)), keras.layers.Dense(5), layer_class(),
                             keras.layers.Flatten(), keras.layers.Dense(3)])


@pytest.fixture
def scale_rule():
    @register_rule(Scale)
    class ScaleRule(LayerRule):
        name = "scale"

        def variables(self, layer):
            return [layer.w]

        def forward(self, layer, x):
            z = x * layer.w
            return z, x, z

        def per_example(self, layer, a, g):
            return [tf.reduce_sum(a * g, axis=list(range(1, a.shape.rank - 1)))]

    yield ScaleRule
    assert unregister_rule(Scale) is not None


def test_a_registered_rule_for_a_custom_layer_matches_the_loop(scale_rule):
    model = scale_model(Scale)
    plan = per_example_plan(model)
    assert [row[2] for row in plan] == ["dense", "scale", "dense"]
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(7, 3, 5)).astype("float32"), rng.integers(0, 3, 7)
    got = per_example_gradients(model, LOSS, x, y, "outer")
    norms = per_example_gradient_norms(model, LOSS, x, y)
    clipped = clipped_gradient(model, LOSS, x, y, l2_norm_clip=1e6)
    expected = per_example_gradients(model, LOSS, x, y, "loop")
    assert_gradients_close(got, expected, **TOL)
    assert_gradients_close(norms, np.sqrt(sum(np.sum(np.square(g), axis=tuple(range(1, g.ndim)))
                                              for g in (e.numpy() for e in expected))), **TOL)
    assert_gradients_close(clipped, [tf.reduce_mean(g, 0) for g in expected], **TOL)


def test_a_rule_that_returns_the_wrong_number_of_gradients_is_named(scale_rule):
    class OneTooMany(scale_rule):
        def per_example(self, layer, a, g):
            return super().per_example(layer, a, g) * 2

    unregister_rule(Scale)
    register_rule(Scale)(OneTooMany)
    model = scale_model(Scale)
    x, y = np.ones((2, 3, 5), "float32"), np.zeros(2, "int64")
    with pytest.raises(ValueError, match=r"rule 'scale' .*per_example returned 2 tensors, but "
                                         r"its variables\(\) lists 1"):
        per_example_gradients(model, LOSS, x, y, "outer")


def test_a_subclass_that_overrides_call_never_gets_its_parents_rule(scale_rule):
    """ScaleSubclass overrides call: the Scale rule would compute the wrong output."""
    model = scale_model(ScaleSubclass)
    assert [row[2] for row in per_example_plan(model)][1] == (
        "layer-local (ScaleSubclass overrides call() of Scale, whose rule (scale) does not "
        "cover it)")
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(4, 3, 5)).astype("float32"), rng.integers(0, 3, 4)
    got = per_example_gradients(model, LOSS, x, y, "outer")
    assert_gradients_close(got, per_example_gradients(model, LOSS, x, y, "loop"), **TOL)


def test_a_subclass_that_keeps_call_uses_its_parents_rule(scale_rule):
    model = scale_model(ScaleChild)
    assert [row[2] for row in per_example_plan(model)] == ["dense", "scale", "dense"]
    rng = np.random.default_rng(16)
    x, y = rng.normal(size=(4, 3, 5)).astype("float32"), rng.integers(0, 3, 4)
    got = per_example_gradients(model, LOSS, x, y, "outer")
    assert_gradients_close(got, per_example_gradients(model, LOSS, x, y, "loop"), **TOL)


def test_a_rule_registered_by_class_path_covers_that_class(scale_rule):
    @register_rule(layer_rules.class_path(ScaleSubclass))
    class DoubleScaleRule(LayerRule):
        name = "double_scale"

        def variables(self, layer):
            return [layer.w]

        def forward(self, layer, x):
            z = x * layer.w * 2.0
            return z, x * 2.0, z

        def per_example(self, layer, a, g):
            return [tf.reduce_sum(a * g, axis=list(range(1, a.shape.rank - 1)))]

    try:
        model = scale_model(ScaleSubclass)
        assert [row[2] for row in per_example_plan(model)][1] == "double_scale"
        rng = np.random.default_rng(17)
        x, y = rng.normal(size=(4, 3, 5)).astype("float32"), rng.integers(0, 3, 4)
        got = per_example_gradient_norms(model, LOSS, x, y, "outer")
        assert_gradients_close(got, per_example_gradient_norms(model, LOSS, x, y, "loop"), **TOL)
    finally:
        assert unregister_rule(layer_rules.class_path(ScaleSubclass)) is not None


def test_without_a_rule_the_layer_falls_back_and_is_still_right():
    model = scale_model(Scale)
    assert "no rule registered for Scale" in per_example_plan(model)[1][2]
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(4, 3, 5)).astype("float32"), rng.integers(0, 3, 4)
    got = per_example_gradients(model, LOSS, x, y, "outer")
    assert_gradients_close(got, per_example_gradients(model, LOSS, x, y, "loop"), **TOL)


def test_register_rule_refuses_what_is_not_a_layer_class_or_a_rule():
    with pytest.raises(TypeError, match="takes a Keras layer class or its 'module.QualName'"):
        register_rule("Dense")
    with pytest.raises(TypeError, match="needs a Keras layer class"):
        register_rule(int)
    with pytest.raises(TypeError, match="decorates a LayerRule subclass"):
        register_rule(Scale)(object)
    assert explain(Scale()) == ("layer-local", "no rule registered for Scale")
    with pytest.raises(TypeError, match="unregister_rule takes a Keras layer class"):
        unregister_rule("Scale")


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_lora_dense_has_closed_form_gradients_and_ghost_norms(rank):
    """Inputs [B, 6], [B, 4, 6], [B, 2, 3, 6]; B of the adapters made non-zero (Keras starts
    it at zero, where A's gradient is zero too)."""
    keras.utils.set_random_seed(8)
    shape = {1: (6,), 2: (4, 6), 3: (2, 3, 6)}[rank]
    model = keras.Sequential([keras.Input(shape), keras.layers.Dense(4), keras.layers.Flatten(),
                              keras.layers.Dense(3)])
    lora = model.layers[0]
    lora.enable_lora(2, lora_alpha=3)
    lora.lora_kernel_b.assign(tf.random.normal(lora.lora_kernel_b.shape))
    assert per_example_plan(model)[0][2] == "dense + lora"
    # before any norm is traced: the rule's own test (A 6 x 2, B 2 x 4; Gram at 1 position only)
    assert rule_for(lora).ghost(lora, (None, *shape)) == (rank == 1)
    assert [v.name for v in rule_for(lora).variables(lora)] == ["lora_kernel_a", "lora_kernel_b",
                                                                "bias"]
    rng = np.random.default_rng(9)
    x, y = rng.normal(size=(5, *shape)).astype("float32"), rng.integers(0, 3, 5)
    got = per_example_gradients(model, LOSS, x, y, "outer")
    norms = per_example_gradient_norms(model, LOSS, x, y)
    # the adapters' Gram forms: A 6 x 2, B 2 x 4; cheaper at 1 position, not at 4 or 6
    assert per_example_plan(model)[0][3] == ("ghost" if rank == 1 else "materialised")
    clipped = clipped_gradient(model, LOSS, x, y, l2_norm_clip=0.1)
    expected = per_example_gradients(model, LOSS, x, y, "loop")
    assert_gradients_close(got, expected, **TOL)
    expected_norms = np.sqrt(sum(np.sum(np.square(g.numpy()), axis=tuple(range(1, g.ndim)))
                                 for g in expected))
    assert_gradients_close(norms, expected_norms, **TOL)
    scale = np.minimum(1.0, 0.1 / expected_norms)
    assert_gradients_close(clipped, [np.tensordot(scale, g.numpy(), axes=1) / 5
                                     for g in expected], **TOL)


def test_lora_einsum_dense_ghost_norms_equal_materialised_ones():
    """The Gram form of both adapters on the attention's query equation, against the norms of
    the materialised per-example gradients, where it is cheaper (one position); at longer
    lengths it costs more, and the rule declines (the engine then materialises the adapters),
    exactly where its plan says so."""
    keras.utils.set_random_seed(10)
    took_gram = {}
    for steps in (1, 3, 9):
        layer = keras.layers.EinsumDense("btd,dhk->bthk", output_shape=(None, 2, 16),
                                         bias_axes="hk")
        layer.build((None, steps, 16))
        layer.enable_lora(4)
        layer.lora_kernel_b.assign(tf.random.normal(layer.lora_kernel_b.shape))
        rule = rule_for(layer)
        x = tf.random.normal([5, steps, 16])
        _, a, z = rule.forward(layer, x)
        g = tf.random.normal(z.shape)
        ghost = rule.sq_norms(layer, a, g)
        took_gram[steps] = ghost is not None
        assert took_gram[steps] == rule.ghost(layer, (None, steps, 16)), steps
        if ghost is not None:
            materialised = sum(squared_norms(t) for t in rule.per_example(layer, a, g))
            assert_gradients_close(ghost, materialised, **TOL)
        np.testing.assert_allclose(rule.forward(layer, x)[0], layer(x), rtol=1e-5, atol=1e-5)
    assert took_gram == {1: True, 3: False, 9: False}


@pytest.mark.parametrize("make, shape", [
    (lambda: keras.layers.Dense(1), (5, 4)),  # 2-D: Goodfellow's product, even at 4 x 1
    (lambda: keras.layers.Dense(6, use_bias=False), (5, 9)),
    (lambda: keras.layers.Dense(1), (5, 3, 4)),  # 4 * 1 <= 3 * (4 + 1): materialised
    (lambda: keras.layers.Dense(16), (5, 2, 16)),
    (lambda: keras.layers.Dense(16), (5, 9, 16)),
    (lambda: keras.layers.EinsumDense("btd,de->bte", output_shape=(None, 12), bias_axes="e"),
     (5, 2, 12)),
    (lambda: keras.layers.EinsumDense("btd,de->bte", output_shape=(None, 12)), (5, 7, 12)),
    (lambda: keras.layers.Conv1D(8, 3), (5, 6, 4)),
    (lambda: keras.layers.Conv1D(8, 3), (5, 30, 4)),
    (lambda: keras.layers.Conv2D(4, 2, groups=2), (5, 3, 3, 4)),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else "")
def test_the_plans_ghost_label_is_the_form_sq_norms_takes(make, shape):
    """rule.ghost (what ghost_norm_plan prints before any trace) says Gram form exactly where
    rule.sq_norms takes it, and that form equals the materialised gradients' norms."""
    keras.utils.set_random_seed(11)
    layer = make()
    layer.build((None,) + shape[1:])
    rule = rule_for(layer)
    _, a, z = rule.forward(layer, tf.random.normal(shape))
    g = tf.random.normal(z.shape)
    sq = rule.sq_norms(layer, a, g)
    assert rule.ghost(layer, (None,) + shape[1:]) == (sq is not None)
    if sq is not None:
        assert_gradients_close(sq, sum(squared_norms(t) for t in rule.per_example(layer, a, g)),
                               **TOL)


def test_einsum_positions_count_the_rows_each_example_contributes():
    """positions() against a count made without it: the rows in the per-example matmul of a
    Gram form are the input's elements per example over the kernel's input letters."""
    from gradtut.layer_rules import einsum

    for equation, shape, kernel_in in (("btd,de->bte", (2, 5, 3), 3),
                                       ("bthd,de->bthe", (2, 4, 3, 6), 6),
                                       ("bd,de->be", (2, 7), 7),
                                       ("btd,dhk->bthk", (2, 6, 8), 8)):
        sizes = dict(zip(equation.split(",")[0], shape, strict=True))
        rows = int(np.prod(shape[1:])) // kernel_in
        assert einsum.positions(equation, sizes) == rows, equation
        unknown = einsum.positions(equation, {**sizes, "t": None})
        assert unknown == (None if "t" in sizes else rows), equation
    assert einsum.positions("bti,tij->btj", {"b": 2, "t": 3, "i": 4}) is None  # no Gram form


REPRODUCTION = textwrap.dedent("""
    import numpy as np, tensorflow as tf
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 8)).astype("float32")
    worst = 0.0
    for _ in range(10):
        a = rng.normal(size=(8, 1, 4, 8)).astype("float32")  # [B, 1, T, d], as vectorized_map makes
        worst = max(worst, float(np.max(np.abs(tf.linalg.matmul(a, w).numpy() - a @ w))))
    print("largest error", worst)
    assert worst < 1e-4, worst
""")


@pytest.mark.xfail(onednn_enabled(), strict=True, raises=AssertionError,
                   reason="TensorFlow 2.21's oneDNN BatchMatMul broadcasts [8, 1, 4, 8] @ [8, 8] "
                          "wrongly or corrupts the heap (tensorflow/tensorflow#117700, fixed "
                          "upstream by PR #120199). gradtut refuses such graphs; when this "
                          "passes, TensorFlow is fixed and the refusal can go.")
def test_plain_tensorflow_reproduction_of_the_onednn_broadcast_matmul_bug():
    """One op, no gradtut: rank-4 [8, 1, 4, 8] @ rank-2 [8, 8]. With oneDNN on it returns wrong
    numbers (and with the default allocator can abort the process), so it runs in a child."""
    done = subprocess.run([sys.executable, "-c", REPRODUCTION], capture_output=True, text=True,
                          timeout=120, env={"TF_CPP_MIN_LOG_LEVEL": "2",
                                            "TF_CPU_ALLOCATOR_USE_BFC": "true",
                                            "PATH": "/usr/bin:/bin", **{
                                                k: v for k, v in os.environ.items()
                                                if k in ("TF_ENABLE_ONEDNN_OPTS",
                                                         "TF_DISABLE_MKL")}})
    if "largest error" not in done.stdout and done.returncode >= 0:  # not the bug: say so
        raise RuntimeError(f"the reproduction did not run: {done.stderr[-500:]}")
    assert done.returncode == 0, done.stdout[-300:] + done.stderr[-300:]


def test_the_hazard_check_flags_that_op_and_not_its_safe_neighbours():
    from gradtut.layer_rules import broadcast_matmul_hazards, is_broadcast_matmul_hazard

    def matmuls(a_shape, b_shape):
        fn = tf.function(lambda a, b: tf.linalg.matmul(a, b))
        graph = fn.get_concrete_function(tf.TensorSpec(a_shape), tf.TensorSpec(b_shape)).graph
        return graph, [op for op in graph.get_operations() if "MatMul" in op.type]

    graph, ops = matmuls([8, 1, 4, 8], [8, 8])
    assert [is_broadcast_matmul_hazard(op) for op in ops] == [True]
    assert len(broadcast_matmul_hazards(graph)) == onednn_enabled()  # only oneDNN is affected
    for safe in ([8, 4, 8], [8, 8]), ([8, 2, 4, 8], [8, 8]), ([8, 1, 4, 8], [8, 1, 8, 8]):
        assert [is_broadcast_matmul_hazard(op) for op in matmuls(*safe)[1]] == [False], safe
    with pytest.raises(TypeError, match="op must be a tf.Operation of a graph"):
        is_broadcast_matmul_hazard(ops[0].outputs[0])


def test_registering_a_rule_rebuilds_functions_traced_before(scale_rule):
    """A model traced with the fallback must use a rule registered afterwards (and the plan and
    the numbers must agree), not a stale cached function."""
    unregister_rule(Scale)
    model = scale_model(Scale)
    rng = np.random.default_rng(10)
    x, y = rng.normal(size=(4, 3, 5)).astype("float32"), rng.integers(0, 3, 4)
    per_example_gradient_norms(model, LOSS, x, y)  # traced with Scale falling back

    class CountingRule(scale_rule):
        calls = 0

        def per_example(self, layer, a, g):
            type(self).calls += 1
            return super().per_example(layer, a, g)

    register_rule(Scale)(CountingRule)
    norms = per_example_gradient_norms(model, LOSS, x, y)
    assert CountingRule.calls >= 1 and per_example_plan(model)[1][2] == "scale"
    expected = per_example_gradients(model, LOSS, x, y, "loop")
    assert_gradients_close(norms, np.sqrt(sum(np.sum(np.square(g.numpy()),
                                                     axis=tuple(range(1, g.shape.rank)))
                                              for g in expected)), **TOL)


def _numpy_patches(x, k, stride, dilation, padding):
    """Explicit 2-D patch extraction, one output position at a time: the reference."""
    b, h, w, c = x.shape
    span = (k - 1) * dilation + 1
    if padding == "same":
        out_h, out_w = -(-h // stride), -(-w // stride)
        pad_h = max((out_h - 1) * stride + span - h, 0)
        pad_w = max((out_w - 1) * stride + span - w, 0)
        x = np.pad(x, [(0, 0), (pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2),
                       (0, 0)])
    else:
        out_h, out_w = (h - span) // stride + 1, (w - span) // stride + 1
    out = np.zeros((b, out_h, out_w, k * k * c), x.dtype)
    for i in range(out_h):
        for j in range(out_w):
            window = x[:, i * stride:i * stride + span:dilation,
                       j * stride:j * stride + span:dilation]
            out[:, i, j] = window.reshape(b, -1)
    return out


@pytest.mark.parametrize("channels", [1, 3, 8])  # 9 * 8 = 72 > 64: the extract_patches path
@pytest.mark.parametrize("k,stride,dilation,padding",
                         [(3, 1, 1, "same"), (3, 2, 1, "valid"), (2, 1, 2, "same"),
                          (3, 2, 1, "same")])
def test_both_patch_paths_match_explicit_patch_extraction(channels, k, stride, dilation, padding):
    x = np.random.default_rng().normal(size=(2, 7, 6, channels)).astype("float32")
    got = layer_rules.conv_patches(tf.constant(x), (k, k), (stride, stride), padding,
                                   (dilation, dilation)).numpy()
    np.testing.assert_allclose(got, _numpy_patches(x, k, stride, dilation, padding), rtol=0,
                               atol=1e-6)


@pytest.mark.parametrize("make,shape,patches", [
    (lambda: keras.layers.Conv2D(5, 3, padding="same", activation="relu"), (8, 8, 1), True),
    (lambda: keras.layers.Conv2D(4, 3, strides=2, dilation_rate=1), (7, 6, 3), True),
    (lambda: keras.layers.Conv2D(4, 3, padding="same"), (6, 6, 8), False),  # 72 values > 64
    (lambda: keras.layers.Conv1D(3, 3, padding="causal", dilation_rate=2), (10, 3), True),
    (lambda: keras.layers.Conv3D(2, 2, strides=2), (4, 4, 4, 2), True),
    (lambda: keras.layers.Conv2D(4, 3, groups=2, padding="same"), (6, 6, 4), False)])  # groups
def test_a_recorded_convolution_gives_the_layers_own_output(make, shape, patches):
    """Small patches (at most 64 values) make the recorded forward patches @ kernel instead of
    the layer's convolution (and record the patches, padding None): both forms must give the
    layer's own output, computed afterwards."""
    layer = make()
    x = tf.constant(np.random.default_rng(20 + len(shape)).normal(size=(3, *shape))
                    .astype("float32"))
    layer(x)
    calls = []
    with recording([(layer, rule_for(layer))], calls):
        got = layer(x)
    assert (calls[0][2][1] is None) == patches
    np.testing.assert_allclose(got.numpy(), layer(x).numpy(), rtol=1e-5, atol=1e-5)


def test_ghost_sq_norms_of_is_the_materialised_norm_where_cheaper_and_none_elsewhere():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, padding="same"),
                              keras.layers.Conv2D(8, 3, strides=4), keras.layers.Flatten(),
                              keras.layers.Dense(3)])
    rng = np.random.default_rng(12)
    x = tf.constant(rng.normal(size=(5, 8, 8, 1)).astype("float32"))
    y = tf.constant(rng.integers(0, 3, 5))
    layers, _, _ = one_pass(model, lambda: LOSS(y, model(x)))
    trainable = {id(v) for v in model.trainable_variables}
    ghost = [ghost_sq_norms_of(*entry, trainable) for entry in layers]
    assert ghost[0] is None  # 64 positions: materialising 9 x 4 values is cheaper than the Gram
    for entry, sq in zip(layers[1:], ghost[1:], strict=True):
        want = tf.add_n([squared_norms(t) for t in per_example_of(*entry).values()])
        np.testing.assert_allclose(sq.numpy(), want.numpy(), rtol=1e-4)
    kernel_only = {id(model.layers[1].kernel)}  # as if its bias were frozen: materialise
    assert ghost_sq_norms_of(*layers[1], kernel_only) is None


def test_conv_patches_refuses_mismatched_ranks():
    x = tf.zeros([2, 7, 6, 3])
    with pytest.raises(ValueError, match=r"needs x of rank 3 .* for a 1-D kernel"):
        layer_rules.conv_patches(x, (3,), (1,), "same", (1,))
    with pytest.raises(ValueError, match="2 strides and dilation rates for a 2-D kernel"):
        layer_rules.conv_patches(x, (3, 3), (1,), "same", (1, 1))


# ------------------------------------------------------------------------------ bad input


def dense_model():
    keras.utils.set_random_seed(11)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def recorded_dense():
    """``(layer, rule, pairs)`` of a Dense layer, as one_pass returns them."""
    model = dense_model()
    layers, _, _ = one_pass(model, lambda: tf.reduce_sum(model(tf.ones([4, 3])), 1))
    return layers[0]


def test_registry_version_takes_no_arguments_and_changes_on_registration(scale_rule):
    before = registry_version()
    register_rule(Scale)(scale_rule)
    assert registry_version() == before + 1
    with pytest.raises(TypeError, match="takes 0 positional arguments but 1 was given"):
        registry_version(Scale)


def test_a_rule_is_refused_for_a_layer_type_it_was_not_written_for():
    with pytest.raises(TypeError, match="DenseRule is written for Dense layers, and Conv2D is not "
                                        "one; subclass LayerRule for Conv2D instead"):
        register_rule(keras.layers.Conv2D)(DenseRule)
    assert explain(keras.layers.Conv2D(2, 3)) == ("conv2d", "")
    conv, dense = keras.layers.Conv2D(2, 3), keras.layers.Dense(2)
    with pytest.raises(TypeError, match="DenseRule is the rule for Dense layers, got Conv2D"):
        DenseRule().unsupported(conv)
    with pytest.raises(TypeError, match="EinsumDenseRule is the rule for EinsumDense layers"):
        EinsumDenseRule().unsupported(dense)
    with pytest.raises(TypeError, match="EmbeddingRule is the rule for Embedding layers"):
        EmbeddingRule().unsupported(dense)
    with pytest.raises(TypeError,
                       match="LayerNormalizationRule is the rule for LayerNormalization"):
        LayerNormalizationRule().unsupported(dense)
    with pytest.raises(TypeError,
                       match="GroupNormalizationRule is the rule for GroupNormalization"):
        GroupNormalizationRule().unsupported(dense)
    with pytest.raises(TypeError, match="RMSNormalizationRule is the rule for RMSNormalization"):
        RMSNormalizationRule().unsupported(dense)
    with pytest.raises(TypeError, match=r"LayerRule.unsupported needs a Keras layer, got str"):
        LayerRule().unsupported("dense")


def test_a_rule_without_its_required_methods_says_which():
    class Incomplete(LayerRule):
        pass

    layer = keras.layers.Dense(2)
    with pytest.raises(NotImplementedError, match=r"LayerRule must implement variables\(layer\)"):
        LayerRule().variables(layer)
    with pytest.raises(NotImplementedError, match=r"Incomplete must implement forward\(layer, "
                                                  r"inputs\)"):
        Incomplete().forward(layer, tf.ones([1, 3]))
    with pytest.raises(NotImplementedError, match=r"must implement per_example\(layer, a, g\)"):
        Incomplete().per_example(layer, None, None)


def test_rule_for_and_explain_need_a_layer():
    with pytest.raises(TypeError, match="rule_for needs a Keras layer, got str 'dense'"):
        rule_for("dense")
    with pytest.raises(TypeError, match="explain needs a Keras layer, got type"):
        explain(keras.layers.Dense)
    assert explain(keras.layers.PReLU()) == ("layer-local", "no rule registered for PReLU")


def test_recording_covered_layers_and_one_pass_refuse_bad_arguments():
    model = dense_model()
    with pytest.raises(TypeError, match=r"recording takes a list of \(layer, rule\) pairs, as "
                                        r"covered_layers\(model\) returns"):
        with recording(model.layers, []):
            pass
    with pytest.raises(TypeError, match="calls must be a list to append the recorded calls to, got "
                                        "tuple"):
        with recording(covered_layers(model), ()):
            pass
    with pytest.raises(TypeError, match="covered_layers needs a Keras model, got list"):
        covered_layers(model.layers)
    with pytest.raises(TypeError, match="one_pass needs a Keras model, got function"):
        one_pass(lambda v: v, lambda: tf.ones([2]))
    with pytest.raises(TypeError, match=r"per_example_losses must be a function \(\) -> \[B\] "
                                        r"losses, got EagerTensor"):
        one_pass(model, tf.ones([2]))
    with pytest.raises(ValueError, match=r"per_example_losses\(\) must return one loss per "
                                         r"example, shape \[B\]; it returned shape \(\)"):
        one_pass(model, lambda: tf.reduce_sum(model(tf.ones([4, 3]))))
    assert model.layers[0].call.__func__ is keras.layers.Dense.call  # restored after the error


def test_per_layer_functions_refuse_what_one_pass_would_not_return():
    layer, rule, pairs = recorded_dense()
    trainable = {id(v) for v in layer.trainable_variables}
    with pytest.raises(ValueError,
                       match=r"per_example_of needs a non-empty list of \(a, g\) pairs"):
        per_example_of(layer, rule, [])
    with pytest.raises(TypeError, match=r"ghost_sq_norms_of needs the layer's LayerRule "
                                        r"\(rule_for\(layer\)\), got str"):
        ghost_sq_norms_of(layer, "dense", pairs, trainable)
    with pytest.raises(TypeError, match="weighted_sum_of needs a Keras layer, got str"):
        weighted_sum_of("dense", rule, pairs, tf.ones([4]))
    with pytest.raises(ValueError, match=r"weights must be a \[B\] vector, one weight per example; "
                                         r"got shape \(\)"):
        weighted_sum_of(layer, rule, pairs, tf.constant(1.0))
    with pytest.raises(ValueError, match=r"squared_norms needs per-example values \[B, \.\.\.\] "
                                         r"with the batch first; got a scalar"):
        squared_norms(tf.constant(3.0))
    assert squared_norms(tf.constant([3.0, -2.0])).numpy().tolist() == [9.0, 4.0]


def test_the_package_helpers_refuse_bad_arguments():
    from gradtut.layer_rules import einsum
    from gradtut.layer_rules.local import is_recurrent, random_ops

    dense = keras.layers.Dense(2)
    bad = r"einsum equation 'I,K->O'|batch axis first"
    with pytest.raises(ValueError, match=bad):
        einsum.parse("bi,ij")
    with pytest.raises(ValueError, match=bad):
        einsum.gram_axes("bi;ij->bj")
    with pytest.raises(ValueError, match=bad):
        einsum.positions("bti,ij", {"t": 3})  # no "->" output
    with pytest.raises(ValueError, match=bad):
        einsum.ghost("bi,ij->cj", (3, 4), 2)  # the batch letter not kept
    with pytest.raises(ValueError, match=bad):
        einsum.sq_norms("...i,ij->...j", tf.ones([2, 3]), tf.ones([2, 4]), (3, 4))
    with pytest.raises(ValueError, match=bad):
        einsum.weighted_sum("bi,bij->bj", tf.ones([2, 3]), tf.ones([2, 4]), tf.ones([2]))
    with pytest.raises(TypeError, match="equation must be an einsum string 'I,K->O', got int"):
        einsum.parse(3)
    with pytest.raises(ValueError, match="the kernel's last axis 'j' is not an output-only axis"):
        equations("bi,ij->bi")
    with pytest.raises(TypeError, match="LoraRule wraps the rule of a LoRA-capable layer"):
        LoraRule(EmbeddingRule())
    with pytest.raises(TypeError, match="DenseRule.for_layer needs a Keras layer, got str"):
        LoraCapable.for_layer(DenseRule(), "dense")
    with pytest.raises(TypeError, match=r"LocalRule takes the \(layer, rule\) pairs"):
        LocalRule([dense])
    with pytest.raises(TypeError, match="ReversibleEmbeddingRule is the rule for "
                                        "ReversibleEmbedding layers, got Dense"):
        ReversibleEmbeddingRule().unsupported(dense)
    with pytest.raises(TypeError, match="PositionEmbeddingRule.unsupported needs a Keras layer"):
        PositionEmbeddingRule().unsupported("position_embedding")
    with pytest.raises(TypeError, match="layer_paths needs a Keras model, got list"):
        layer_paths([dense])
    with pytest.raises(TypeError, match="warn_unreached takes a list of Keras variables"):
        warn_unreached(["kernel"])
    with pytest.raises(TypeError, match="is_recurrent needs a Keras layer, got type"):
        is_recurrent(keras.layers.LSTM)
    with pytest.raises(TypeError, match="owned_trainable needs a Keras layer, got str"):
        owned_trainable("dense")
    with pytest.raises(TypeError, match=r"random_ops needs a tf.Graph \(fn.get_concrete_function"):
        random_ops(tf.function(lambda: 1))
    with pytest.raises(TypeError, match=r"class_path needs a class \(type\(layer\)\), got Dense"):
        class_path(dense)


class _ReadsTheTable(keras.Model):
    """An Embedding that is never called: its table is read directly (a unit's variable
    outside its own calls), next to a Dense layer that is."""

    def __init__(self):
        super().__init__(name="reads_the_table")
        self.table = keras.layers.Embedding(5, 3)
        self.dense = keras.layers.Dense(3)

    def build(self, input_shape):
        self.table.build((None,))
        self.dense.build(input_shape)

    def call(self, x):
        return self.dense(x) + tf.matmul(x, self.table.embeddings[:3])


def test_a_variable_read_outside_its_uncalled_layer_comes_from_the_jacobian():
    model = _ReadsTheTable()
    x = np.random.default_rng(7).normal(size=(5, 3)).astype("float32")
    y = np.array([0, 1, 2, 0, 1])
    model(x)
    layers, _, rest = one_pass(model, lambda: LOSS(y, model(x)))
    assert [rule.name for _, rule, _ in layers] == ["dense"]
    assert [v.path for v, _ in rest] == [model.table.embeddings.path]
    got = per_example_gradients(model, LOSS, x, y, "outer")
    norms = per_example_gradient_norms(model, LOSS, x, y)
    expected = per_example_gradients(model, LOSS, x, y, "loop")
    assert_gradients_close(got, expected, **TOL)
    assert_gradients_close(norms, np.sqrt(sum(np.sum(np.square(g.numpy()), axis=tuple(
        range(1, g.shape.rank))) for g in expected)), **TOL)


def test_tensorflow_jacobian_of_a_grouped_convolution_ignores_the_groups():
    """Upstream, TensorFlow 2.21: ``tape.jacobian`` of a batch's losses through a
    ``Conv2D(groups=2)`` gets the filter gradient wrong (pfor's ``Conv2DBackpropFilter`` converter,
    in its branch for an input shared by every iteration), or raises with oneDNN off. This is why
    gradtut refuses grouped convolutions under its vectorising methods (notebook 02, section 3);
    if this test starts failing, TensorFlow fixed it and the refusal can go."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6, 6, 4)), keras.layers.Conv2D(4, 3, groups=2),
                              keras.layers.Flatten(), keras.layers.Dense(2)])
    kernel = model.layers[0].kernel
    x = tf.constant(np.random.default_rng(1).normal(size=(5, 6, 6, 4)).astype("float32"))
    try:
        with tf.GradientTape() as tape:
            losses = tf.reduce_sum(model(x) ** 2, axis=1)
        jacobian = tape.jacobian(losses, kernel)
    except tf.errors.OpError:
        assert not onednn_enabled(), "the jacobian raised with oneDNN on"
        return
    loop = []
    for i in range(len(x)):  # the reference, after the method
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x[i:i + 1]) ** 2)
        loop.append(tape.gradient(loss, kernel))
    relative_error = float(tf.norm(jacobian - tf.stack(loop)) / tf.norm(tf.stack(loop)))
    assert relative_error > 0.5, relative_error
