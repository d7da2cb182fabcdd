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
from gradtut.layer_rules import LayerRule, register_rule
from gradtut.per_example import (_onednn_enabled, clipped_gradient, per_example_gradient_norms,
                                 per_example_gradients, per_example_plan)
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
    del layer_rules._RULES[Scale]


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


def test_a_subclass_never_gets_its_parents_rule(scale_rule):
    """ScaleSubclass overrides call: the Scale rule would compute the wrong output."""
    model = scale_model(ScaleSubclass)
    assert [row[2] for row in per_example_plan(model)][1] == (
        "vectorized fallback (no rule registered for ScaleSubclass)")
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(4, 3, 5)).astype("float32"), rng.integers(0, 3, 4)
    got = per_example_gradients(model, LOSS, x, y, "outer")
    assert_gradients_close(got, per_example_gradients(model, LOSS, x, y, "loop"), **TOL)


def test_without_a_rule_the_layer_falls_back_and_is_still_right():
    model = scale_model(Scale)
    assert "no rule registered for Scale" in per_example_plan(model)[1][2]
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(4, 3, 5)).astype("float32"), rng.integers(0, 3, 4)
    got = per_example_gradients(model, LOSS, x, y, "outer")
    assert_gradients_close(got, per_example_gradients(model, LOSS, x, y, "loop"), **TOL)


def test_register_rule_refuses_what_is_not_a_layer_class_or_a_rule():
    with pytest.raises(TypeError, match="needs a Keras layer class"):
        register_rule("Dense")
    with pytest.raises(TypeError, match="decorates a LayerRule subclass"):
        register_rule(Scale)(object)
    assert Scale not in layer_rules._RULES


def test_lora_layers_fall_back_with_the_reason():
    keras.utils.set_random_seed(8)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(3)])
    model.layers[0].enable_lora(2)
    plan = per_example_plan(model)
    assert plan[0][2] == "vectorized fallback (LoRA is enabled)"
    rng = np.random.default_rng(9)
    x, y = rng.normal(size=(5, 6)).astype("float32"), rng.integers(0, 3, 5)
    got = per_example_gradients(model, LOSS, x, y, "outer")
    assert_gradients_close(got, per_example_gradients(model, LOSS, x, y, "loop"), **TOL)


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


@pytest.mark.xfail(_onednn_enabled(), strict=True, raises=AssertionError,
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
    from gradtut.per_example import _hazard, broadcast_matmul_hazards

    def matmuls(a_shape, b_shape):
        fn = tf.function(lambda a, b: tf.linalg.matmul(a, b))
        graph = fn.get_concrete_function(tf.TensorSpec(a_shape), tf.TensorSpec(b_shape)).graph
        return graph, [op for op in graph.get_operations() if "MatMul" in op.type]

    graph, ops = matmuls([8, 1, 4, 8], [8, 8])
    assert [_hazard(op) for op in ops] == [True]
    assert len(broadcast_matmul_hazards(graph)) == _onednn_enabled()  # only oneDNN is affected
    for safe in ([8, 4, 8], [8, 8]), ([8, 2, 4, 8], [8, 8]), ([8, 1, 4, 8], [8, 1, 8, 8]):
        assert [_hazard(op) for op in matmuls(*safe)[1]] == [False], safe


def test_registering_a_rule_rebuilds_functions_traced_before(scale_rule):
    """A model traced with the fallback must use a rule registered afterwards (and the plan and
    the numbers must agree), not a stale cached function."""
    del layer_rules._RULES[Scale]
    layer_rules._VERSION[0] += 1
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
            window = x[:, i * stride:i * stride + span:dilation, j * stride:j * stride + span:dilation]
            out[:, i, j] = window.reshape(b, -1)
    return out


@pytest.mark.parametrize("channels", [1, 3, 8])  # 9 * 8 = 72 > 64: the extract_patches path
@pytest.mark.parametrize("k,stride,dilation,padding",
                         [(3, 1, 1, "same"), (3, 2, 1, "valid"), (2, 1, 2, "same"), (3, 2, 1, "same")])
def test_both_patch_paths_match_explicit_patch_extraction(channels, k, stride, dilation, padding):
    x = np.random.default_rng().normal(size=(2, 7, 6, channels)).astype("float32")
    got = layer_rules._patches(tf.constant(x), (k, k), (stride, stride), padding,
                               (dilation, dilation)).numpy()
    np.testing.assert_allclose(got, _numpy_patches(x, k, stride, dilation, padding), rtol=0, atol=1e-6)
