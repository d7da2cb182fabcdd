"""Per-example gradients and DP-SGD on KerasHub's real architectures, built from tiny configs
(random weights, nothing downloaded): BERT, GPT-2 and Llama backbones under a classifier head,
GPT-2 as a language model whose tied embedding is read twice in one step, each with and without
Keras's LoRA. Every method is compared with the loop, computed after the method under test, on
fresh inputs."""
import re

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

from gradtut.checks import assert_gradients_close
from gradtut.layer_rules import onednn_enabled
from gradtut.per_example import (
    METHODS,
    clipped_gradient,
    per_example_gradient_norms,
    per_example_gradients,
    per_example_plan,
)
from gradtut.privacy import DPModel

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
TOL = {"rtol": 1e-4, "atol": 1e-5}
VOCAB, STEPS, CLASSES = 97, 8, 3
SMALL = {"vocabulary_size": VOCAB, "num_layers": 2, "num_heads": 2, "hidden_dim": 16,
         "intermediate_dim": 32, "dropout": 0.0}  # DPModel trains with training=True


def bert():
    return keras_hub.models.BertBackbone(**SMALL, max_sequence_length=STEPS)


def gpt2():
    return keras_hub.models.GPT2Backbone(**SMALL, max_sequence_length=STEPS)


def llama():  # RMS norms, rotary positions, an untied output embedding a classifier never reads
    config = {**SMALL, "num_query_heads": 2, "num_key_value_heads": 1}
    del config["num_heads"]
    return keras_hub.models.LlamaBackbone(**config, tie_word_embeddings=False)


def classifier(backbone):
    """token ids -> backbone -> mean over tokens -> Dense(3)."""
    inputs = {name: keras.Input((STEPS,), dtype="int32", name=name)
              for name in backbone.input if name in ("token_ids", "segment_ids", "padding_mask")}
    hidden = backbone(inputs)
    hidden = hidden["sequence_output"] if isinstance(hidden, dict) else hidden
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(pooled))


def language_model(backbone):
    """The next token after the sequence, from the tied embedding read in reverse: the
    ReversibleEmbedding's weights are used twice in one step (input and output)."""
    inputs = {name: keras.Input((STEPS,), dtype="int32", name=name)
              for name in ("token_ids", "padding_mask")}
    last = keras.layers.Lambda(lambda h: h[:, -1])(backbone(inputs))
    return keras.Model(inputs, backbone.token_embedding(last, reverse=True))


BUILDS = {"bert": (bert, classifier), "gpt2": (gpt2, classifier), "llama": (llama, classifier),
          "gpt2_lm": (gpt2, language_model)}
NAMES = [f"{name}{suffix}" for name in BUILDS for suffix in ("", "_lora")]


def build(name):
    base = name.removesuffix("_lora")
    backbone_fn, head = BUILDS[base]
    keras.utils.set_random_seed(len(name))
    backbone = backbone_fn()
    if name.endswith("_lora"):
        backbone.enable_lora(2)
        for v in backbone.trainable_variables:  # Keras starts B at 0, where A gets no gradient
            if v.name == "lora_kernel_b":
                v.assign(np.random.default_rng(1).normal(0, 0.3, v.shape).astype("float32"))
    return head(backbone)


@pytest.fixture(scope="module")
def models():
    return {}


def model_for(models, name):
    if name not in models:
        models[name] = build(name)
    return models[name]


_seeds = iter(range(5000, 10**6))


def fresh(model, batch_size, classes=CLASSES):
    rng = np.random.default_rng(next(_seeds))
    lengths = rng.integers(3, STEPS + 1, size=(batch_size, 1))
    x = {"token_ids": rng.integers(1, VOCAB, size=(batch_size, STEPS)).astype("int32"),
         "padding_mask": (np.arange(STEPS)[None] < lengths).astype("int32")}
    if "segment_ids" in model.input:
        x["segment_ids"] = rng.integers(0, 2, size=(batch_size, STEPS)).astype("int32")
    return x, rng.integers(0, classes, size=(batch_size,))


def classes_of(name):
    return VOCAB if name.startswith("gpt2_lm") else CLASSES


def loop(model, x, y):
    return per_example_gradients(model, LOSS, x, y, "loop")


def norms_of(per_example):
    return np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64)),
                              axis=tuple(range(1, g.shape.rank))) for g in per_example))


@pytest.mark.filterwarnings("ignore:the loss does not reach")
@pytest.mark.parametrize("method", [m for m in METHODS if m != "loop"])
@pytest.mark.parametrize("name", NAMES)
def test_every_method_matches_the_loop(models, name, method):
    model = model_for(models, name)
    x, y = fresh(model, 5, classes_of(name))
    if method == "vectorized" and onednn_enabled():  # the whole model inside vectorized_map
        with pytest.raises(ValueError, match=r"oneDNN.*tensorflow/tensorflow#117700"):
            per_example_gradients(model, LOSS, x, y, method)
        return
    got = per_example_gradients(model, LOSS, x, y, method)
    assert_gradients_close(got, loop(model, x, y), **TOL,
                           names=[v.path for v in model.trainable_variables])


@pytest.mark.filterwarnings("ignore:the loss does not reach")
@pytest.mark.parametrize("name", NAMES)
def test_ghost_norms_and_clipped_gradient_match_the_loop(models, name):
    model = model_for(models, name)
    x, y = fresh(model, 6, classes_of(name))
    norms = per_example_gradient_norms(model, LOSS, x, y)
    assert_gradients_close(norms, norms_of(loop(model, x, y)), **TOL)

    x, y = fresh(model, 6, classes_of(name))
    clip = float(np.median(per_example_gradient_norms(model, LOSS, x, y)))
    got = clipped_gradient(model, LOSS, x, y, l2_norm_clip=clip)
    per_example = loop(model, x, y)
    scale = np.minimum(1.0, clip / norms_of(per_example))
    assert 0 < np.sum(scale < 1) < 6  # some examples clipped, some not
    assert_gradients_close(got, [np.tensordot(scale, g.numpy(), axes=1) / 6 for g in per_example],
                           **TOL)


def clipped_by_hand(model, x, y, clip, expected_batch_size):
    """One tape per example, each gradient clipped with NumPy, summed, over the expected size."""
    variables = model.trainable_variables
    total = [np.zeros(v.shape) for v in variables]
    for i in range(len(y)):
        xi = {k: t[i:i + 1] for k, t in x.items()}
        with tf.GradientTape() as tape:
            loss = LOSS(y[i:i + 1], model(xi, training=True))[0]
        grads = [np.zeros(v.shape) if g is None else tf.convert_to_tensor(g).numpy()
                 for g, v in zip(tape.gradient(loss, variables), variables, strict=True)]
        norm = np.sqrt(sum(np.sum(g.astype("float64") ** 2) for g in grads))
        total = [t + g * min(1.0, clip / norm) for t, g in zip(total, grads, strict=True)]
    return [t / expected_batch_size for t in total]


@pytest.mark.filterwarnings("ignore:the loss does not reach")
@pytest.mark.parametrize("name", ["bert", "gpt2_lora"])
def test_one_dp_model_step_equals_a_hand_clipped_step(name):
    """DPModel.fit for one batch (noise 0) moves the weights as SGD on the hand-clipped sum."""
    model, reference = build(name), build(name)
    x, y = fresh(model, 6)
    dp = DPModel(model, l2_norm_clip=0.05, noise_multiplier=0.0, expected_batch_size=8, seed=0)
    dp.compile(optimizer=keras.optimizers.SGD(0.5), loss=LOSS)
    dp.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    grads = clipped_by_hand(reference, x, y, 0.05, 8)
    keras.optimizers.SGD(0.5).apply([tf.constant(g, tf.float32) for g in grads],
                                    reference.trainable_variables)
    assert_gradients_close(model.trainable_variables, reference.trainable_variables, **TOL)
    moved = [np.any(a.numpy() != b) for a, b in zip(model.trainable_variables,
                                                    build(name).trainable_variables, strict=True)]
    assert sum(moved) > len(moved) // 2  # the step changed most variables


def backbone_name(model):
    """The backbone's name in ``model`` (Keras numbers it after the first one in a process)."""
    return next(layer.name for layer in model.layers
                if isinstance(layer, keras_hub.models.Backbone))


def test_unreached_variables_are_zero_named_once_and_counted_in_the_plan(models):
    """BERT's pooler never reaches a mean-over-tokens head: zero, one warning, not a refusal."""
    model = model_for(models, "bert")
    x, y = fresh(model, 4)
    with pytest.warns(UserWarning, match=r"does not reach 2 trainable.*pooled_dense") as caught:
        got = per_example_gradients(model, LOSS, x, y, "outer")
    assert len([w for w in caught if "does not reach" in str(w.message)]) == 1
    pooler = [g for g, v in zip(got, model.trainable_variables, strict=True)
              if "pooled_dense" in v.path]
    assert len(pooler) == 2 and not any(np.any(g.numpy()) for g in pooler)
    rows = {row[0]: row for row in per_example_plan(model)}
    assert rows[f"{backbone_name(model)}/pooled_dense"][3] == "zero (unreached)"


@pytest.mark.filterwarnings("ignore:the loss does not reach")
def test_plan_names_layers_by_path_and_sums_up(models):
    model = model_for(models, "bert")
    x, y = fresh(model, 4)
    per_example_gradient_norms(model, LOSS, x, y)  # traced: the plan reports what ran
    plan = per_example_plan(model)
    paths = [row[0] for row in plan]
    assert len(paths) == len(set(paths))  # every row tells its layer apart
    bert = backbone_name(model)  # bert_backbone, or bert_backbone_1 if one was built before
    assert f"{bert}/transformer_layer_0/self_attention_layer/query" in paths
    assert f"{bert}/transformer_layer_1/self_attention_layer/query" in paths
    rows = {row[0]: row[1:] for row in plan}
    assert rows[f"{bert}/token_embedding"][:2] == ("ReversibleEmbedding", "reversible_embedding")
    assert rows[f"{bert}/position_embedding"][1] == "position_embedding"
    assert all(row[2] != "layer-local" for row in plan)
    assert re.fullmatch(r"22 layers: \d+ ghost, \d+ materialised by its rule, 0 layer-local, "
                        r"1 unreached \(zero\)", plan.summary()), plan.summary()

    lora = model_for(models, "bert_lora")
    rules = {row[2] for row in per_example_plan(lora)}
    assert rules == {"einsum_dense + lora", "dense", "no trainable variables"}, rules
