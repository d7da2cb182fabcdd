"""DP-SGD: accounting against dp_accounting and published figures, steps and DPModel against a
loop of tapes that clips each example by hand, the noise's scale on one device and on
replicas, and Poisson sampling."""
import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf
from dp_accounting import pld, rdp

from gradtut import privacy
from gradtut.checks import assert_gradients_close
from gradtut.privacy import (
    DPModel,
    epsilon,
    make_dp_train_step,
    noise_multiplier_for_epsilon,
    poisson_batches,
)
from model_zoo import LOSS, MODELS, batch_for, strategy_with

TOL = {"rtol": 1e-4, "atol": 1e-6}
# TF Privacy's and Opacus's MNIST example: sigma 1.1, batch 256 of 60,000, 60 epochs, delta 1e-5
MNIST = {"noise_multiplier": 1.1, "sample_rate": 256 / 60000, "steps": 60 * 60000 // 256,
         "delta": 1e-5}


def event(noise_multiplier, sample_rate, steps):
    return dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), steps)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("sigma,q,steps", [(1.1, 256 / 60000, 14062), (0.8, 0.01, 500),
                                           (2.0, 1.0, 3)])
def test_epsilon_is_dp_accountings(accountant, sigma, q, steps):
    got = epsilon(sigma, q, steps, 1e-5, accountant)
    account = rdp.RdpAccountant() if accountant == "rdp" else pld.PLDAccountant()
    account.compose(event(sigma, q, steps))
    assert got == pytest.approx(account.get_epsilon(1e-5), rel=1e-9)


def test_epsilon_at_many_step_counts_is_dp_accountings():
    # epsilon caches one step's RDP and scales it by the step count: every count must still
    # equal a fresh accountant's, computed afterwards
    sigma, q = 0.9, 0.02
    counts = [1, 7, 100, 2500, 7]
    got = [epsilon(sigma, q, n, 1e-5) for n in counts]
    for n, value in zip(counts, got, strict=True):
        account = rdp.RdpAccountant()
        account.compose(event(sigma, q, n))
        assert value == account.get_epsilon(1e-5)  # the same floating-point operations
    assert got[1] < got[2] < got[3]


def test_epsilon_agrees_with_the_published_mnist_figure():
    # TensorFlow Privacy's MNIST tutorial (tutorials/README.md) and Opacus's MNIST example quote
    # epsilon ~3.0 for these settings, from RDP with the classic conversion
    # eps = min_alpha rdp(alpha) + log(1/delta) / (alpha - 1) and TF Privacy's orders.
    orders = [1 + x / 10 for x in range(1, 100)] + list(range(12, 64))
    account = rdp.RdpAccountant(orders)
    account.compose(event(MNIST["noise_multiplier"], MNIST["sample_rate"], MNIST["steps"]))
    classic = min(r + np.log(1 / MNIST["delta"]) / (a - 1)
                  for a, r in zip(orders, account.rdp, strict=True))
    assert 2.9 <= classic <= 3.05
    # dp_accounting's tighter RDP conversion and PLD give less for the same training
    tighter = epsilon(**MNIST)
    assert tighter == pytest.approx(2.5966, abs=5e-4)  # dp_accounting 0.4-0.6
    assert tighter < classic and epsilon(**MNIST, accountant="pld") < tighter


def test_epsilon_grows_with_steps_and_shrinks_with_noise():
    assert epsilon(1.0, 0.01, 100, 1e-5) < epsilon(1.0, 0.01, 1000, 1e-5)
    assert epsilon(2.0, 0.01, 1000, 1e-5) < epsilon(1.0, 0.01, 1000, 1e-5)
    assert epsilon(0.0, 0.01, 10, 1e-5) == float("inf")


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("target", [1.0, 3.0, 8.0])
def test_noise_multiplier_for_epsilon_inverts_epsilon_within_one_percent(accountant, target):
    q, steps = 64 / 1500, 300
    sigma = noise_multiplier_for_epsilon(target, q, steps, 1e-5, accountant)
    assert epsilon(sigma, q, steps, 1e-5, accountant) <= target
    assert epsilon(0.99 * sigma, q, steps, 1e-5, accountant) > target


@pytest.mark.parametrize("target,q,steps,accountant", [
    (50.0, 0.01, 10, "rdp"),  # sigma below 1: found by halving
    (3.0, 256 / 60000, 14062, "rdp"),  # MNIST's setting
    (0.5, 0.01, 100, "rdp"),  # sigma above 1: found by doubling
    (2.0, 1.0, 1, "rdp"),  # every example in every step
    (1.0, 64 / 1500, 300, "pld")])
def test_noise_multiplier_for_epsilon_is_the_smallest_to_a_tenth_of_a_percent(
        target, q, steps, accountant, monkeypatch):
    calls = []

    def counted(*args):
        calls.append(args)
        return epsilon(*args)

    monkeypatch.setattr(privacy, "epsilon", counted)
    sigma = noise_multiplier_for_epsilon(target, q, steps, 1e-5, accountant)
    assert len(calls) <= 8  # bisection to 0.1% took 11 to 14
    assert epsilon(sigma, q, steps, 1e-5, accountant) <= target
    assert epsilon(0.999 * sigma, q, steps, 1e-5, accountant) > target


@pytest.mark.parametrize("call,match", [
    (lambda: epsilon(1.0, 0.1, 10, 0.0), "delta must be in"),
    (lambda: epsilon(1.0, 0.1, 10, 1.0), "delta must be in"),
    (lambda: epsilon(1.0, 0.0, 10, 1e-5), "sample_rate must be in"),
    (lambda: epsilon(1.0, 1.5, 10, 1e-5), "sample_rate must be in"),
    (lambda: epsilon(-1.0, 0.1, 10, 1e-5), "noise_multiplier must be >= 0"),
    (lambda: epsilon(1.0, 0.1, 0, 1e-5), "steps must be a positive int"),
    (lambda: epsilon(1.0, 0.1, 10, 1e-5, "moments"), "unknown accountant"),
    (lambda: noise_multiplier_for_epsilon(0.0, 0.1, 10, 1e-5), "target_epsilon must be positive"),
    (lambda: noise_multiplier_for_epsilon(0.01, 1.0, 10_000, 1e-9),
     r"out of reach: even .* gives epsilon"),
    (lambda: noise_multiplier_for_epsilon(1e20, 0.01, 10, 1e-5), "does not bound the noise"),
    (lambda: next(poisson_batches(np.zeros((4, 2)), np.zeros(4), 0.0, 0)),
     "sample_rate must be in"),
    (lambda: next(poisson_batches(np.zeros((4, 2)), np.zeros(3), 0.5, 0)),
     "4 examples but y has 3"),
    (lambda: DPModel(keras.Sequential([keras.layers.Dense(1)]), 0.0, 1.0, 8),
     "l2_norm_clip must be positive"),
])
def test_accounting_refuses_bad_arguments_with_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------- the reference


def clipped_by_hand(model, x, y, clip, expected_batch_size):
    """One tape per example, each gradient clipped with NumPy; summed, over the expected size."""
    variables = model.trainable_variables
    total = [np.zeros(v.shape) for v in variables]
    for i in range(len(y)):
        xi = [t[i:i + 1] for t in x] if isinstance(x, list) else x[i:i + 1]
        with tf.GradientTape() as tape:
            loss = LOSS(y[i:i + 1], model(xi, training=True))[0]
        grads = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, variables)]
        norm = np.sqrt(sum(np.sum(g.astype("float64") ** 2) for g in grads))
        total = [t + g * min(1.0, clip / norm) for t, g in zip(total, grads, strict=True)]
    return [t / expected_batch_size for t in total]


def build(name, seed=0):
    keras.utils.set_random_seed(seed)
    model = MODELS[name]()
    x, _ = batch_for(name, 2)
    model(x)
    return model


def poisson_epoch(name, n, q, seed):
    x, y = batch_for(name, n, seed)
    if isinstance(x, list):
        raise NotImplementedError
    return list(poisson_batches(x, y, q, seed))


@pytest.mark.parametrize("name", ["mlp", "cnn", "text", "transformer"])
def test_dp_step_without_noise_equals_clipping_each_example_with_a_tape(name):
    seed = int(np.random.default_rng().integers(1000))
    print("data seed", seed)  # shown when the test fails
    batches = poisson_epoch(name, 24, 0.25, seed=seed)
    batches.append((batches[0][0][:0], batches[0][1][:0]))  # an empty batch passes through
    model, reference = build(name), build(name)
    step = make_dp_train_step(model, LOSS, keras.optimizers.SGD(0.5), l2_norm_clip=0.3,
                              noise_multiplier=0.0, expected_batch_size=6, seed=0)
    sizes = [int(step(xb, yb)) for xb, yb in batches]
    optimizer = keras.optimizers.SGD(0.5)
    for xb, yb in batches:  # the reference runs after the method under test
        grads = clipped_by_hand(reference, xb, yb, 0.3, 6)
        optimizer.apply([tf.constant(g, v.dtype)
                         for g, v in zip(grads, reference.trainable_variables, strict=True)],
                        reference.trainable_variables)
    assert sizes == [len(yb) for _, yb in batches]
    assert_gradients_close(model.trainable_variables, reference.trainable_variables, **TOL)


def test_dp_model_fit_for_one_epoch_equals_the_hand_written_loop():
    seed = int(np.random.default_rng().integers(1000))
    print("data seed", seed)
    x, y = batch_for("mlp", 30, seed=seed)
    dp = DPModel(build("mlp"), l2_norm_clip=0.2, noise_multiplier=0.0, expected_batch_size=8,
                 seed=0)
    dp.compile(optimizer=keras.optimizers.SGD(0.5), loss=LOSS)
    history = dp.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    reference, optimizer = build("mlp"), keras.optimizers.SGD(0.5)
    for start in range(0, 30, 8):
        grads = clipped_by_hand(reference, x[start:start + 8], y[start:start + 8], 0.2, 8)
        optimizer.apply([tf.constant(g, tf.float32) for g in grads], reference.trainable_variables)
    assert_gradients_close(dp.model.trainable_variables, reference.trainable_variables, **TOL)
    assert np.isfinite(history.history["loss"][0])
    assert dp.evaluate(x, y, verbose=0) == pytest.approx(float(np.mean(LOSS(y, dp(x)))), rel=1e-5)


def noise_std(strategy=None, seed=3, draws=12):
    """Std of (update with noise) - (update without), over ``draws`` steps of a 650-weight layer."""
    x, y = batch_for("mlp", 6, seed=1)
    scope = (strategy or tf.distribute.get_strategy()).scope
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)
    ds = strategy.experimental_distribute_dataset(ds) if strategy else ds
    runs = []
    for sigma in (2.0, 0.0):
        with scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(50),
                                      keras.layers.Dense(3)])
            optimizer = keras.optimizers.SGD(1.0)
        step = make_dp_train_step(model, LOSS, optimizer, 1.0, sigma, 10, strategy=strategy,
                                  seed=seed)
        start = [v.numpy() for v in model.trainable_variables]
        updates = []
        for _ in range(draws):
            model.set_weights(start)
            for batch in ds:
                step(*batch)
            updates.append(model.trainable_variables[0].numpy() - start[0])
        runs.append(np.array(updates))
    return float(np.std(runs[0] - runs[1]))


def test_noise_std_is_sigma_times_clip_over_the_expected_batch_size():
    # 12 draws x 600 weights: the sample std is within about 1% of the true one
    assert noise_std() == pytest.approx(2.0 * 1.0 / 10, rel=0.05)


@pytest.mark.parametrize("replicas", [2, 3])
def test_noise_on_replicas_is_added_once_not_once_per_replica(replicas):
    assert noise_std(strategy_with(replicas)) == pytest.approx(2.0 * 1.0 / 10, rel=0.05)


def test_seeds_make_runs_repeatable():
    x, y = batch_for("mlp", 8, seed=5)

    def run(seed):
        model = build("mlp")
        step = make_dp_train_step(model, LOSS, keras.optimizers.SGD(0.1), 1.0, 1.0, 8, seed=seed)
        for _ in range(3):
            step(x, y)
        return [v.numpy() for v in model.trainable_variables]

    first, again, other = run(7), run(7), run(8)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_dp_model_under_mirrored_strategy_equals_one_device():
    seed = int(np.random.default_rng().integers(1000))
    print("data seed", seed)
    x, y = batch_for("mlp", 24, seed=seed)
    strategy = strategy_with(2)
    with strategy.scope():
        dp = DPModel(build("mlp"), l2_norm_clip=0.2, noise_multiplier=0.0,
                     expected_batch_size=12, seed=0)
        dp.compile(optimizer=keras.optimizers.SGD(0.5), loss=LOSS)
    dp.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    single = DPModel(build("mlp"), 0.2, 0.0, 12, seed=0)
    single.compile(optimizer=keras.optimizers.SGD(0.5), loss=LOSS)
    single.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    assert_gradients_close(dp.model.trainable_variables, single.model.trainable_variables, **TOL)


def test_a_clipping_optimizer_is_refused_over_replicas_by_both_entry_points():
    # Keras clips each replica's share before summing: with the noise split over replicas,
    # the update would be neither the clipped sum plus one Gaussian draw nor post-processing of it
    x, y = batch_for("mlp", 24, seed=1)
    strategy = strategy_with(2)
    with strategy.scope():
        model = build("mlp")
        clipping = keras.optimizers.SGD(0.5, clipnorm=1.0)
    with pytest.raises(ValueError, match=r"clips \(clipnorm=1.0\) and there are 2 replicas"):
        make_dp_train_step(model, LOSS, clipping, 1.0, 1.0, 12, strategy=strategy, seed=0)
    with strategy.scope():
        dp = DPModel(build("mlp"), 0.2, 1.0, 12, seed=0)
        dp.compile(optimizer=keras.optimizers.SGD(0.5, global_clipnorm=1.0), loss=LOSS)
    with pytest.raises(ValueError, match=r"clips \(global_clipnorm=1.0\) and there are 2"):
        dp.fit(x, y, batch_size=12, epochs=1, verbose=0)
    one = DPModel(build("mlp"), 0.2, 1.0, 12, seed=0)  # one replica: clipping is allowed
    one.compile(optimizer=keras.optimizers.SGD(0.5, global_clipnorm=1.0), loss=LOSS)
    one.fit(x, y, batch_size=12, epochs=1, verbose=0)


def test_poisson_batches_sample_each_example_independently():
    x, y = np.arange(400)[:, None], np.arange(400)
    q = 0.05
    included = np.array([[np.isin(y, yb) for _, yb in poisson_batches(x, y, q, seed)]
                         for seed in range(10)]).reshape(-1, 400)  # 200 batches x 400 examples
    assert len(included) == 10 * round(1 / q)
    assert included.sum(axis=1).mean() == pytest.approx(q * 400, rel=0.1)
    together = (included[:, :200] & included[:, 200:]).mean()  # pairs of distinct examples
    assert together == pytest.approx(q * q, rel=0.25)
    sizes = [len(yb) for _, yb in poisson_batches(x[:20], y[:20], 0.01, seed=0)]
    assert 0 in sizes and len(set(sizes)) > 1
    first = [yb.tolist() for _, yb in poisson_batches(x, y, q, seed=3)]
    assert first == [yb.tolist() for _, yb in poisson_batches(x, y, q, seed=3)]


def test_dp_training_refuses_what_would_break_privacy_with_the_fix():
    model = build("mlp")
    with pytest.raises(ValueError, match="reduces over the batch"):
        make_dp_train_step(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                           keras.optimizers.SGD(), 1.0, 1.0, 8)
    with pytest.raises(ValueError, match="l2_norm_clip must be positive"):
        make_dp_train_step(model, LOSS, keras.optimizers.SGD(), 0.0, 1.0, 8)
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0"):
        make_dp_train_step(model, LOSS, keras.optimizers.SGD(), 1.0, -1.0, 8)
    with pytest.raises(ValueError, match="expected_batch_size must be a positive int"):
        make_dp_train_step(model, LOSS, keras.optimizers.SGD(), 1.0, 1.0, 0)
    bn = keras.Sequential([keras.Input((12,)), keras.layers.Dense(4),
                           keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="BatchNormalization"):
        make_dp_train_step(bn, LOSS, keras.optimizers.SGD(), 1.0, 1.0, 8)
    dp = DPModel(bn, 1.0, 1.0, 8)
    with pytest.raises(ValueError, match="BatchNormalization"):
        dp.compile(optimizer="sgd", loss=LOSS)
    with pytest.raises(ValueError, match="reduces over the batch"):
        DPModel(model, 1.0, 1.0, 8).compile(
            optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="per-example loss"):
        DPModel(model, 1.0, 1.0, 8).compile(optimizer="sgd")
    with pytest.raises(ValueError, match="regularisation losses"):
        make_dp_train_step(keras.Sequential([keras.Input((12,)), keras.layers.Dense(
            3, kernel_regularizer="l2")]), LOSS, keras.optimizers.SGD(), 1.0, 1.0, 8)
    x, y = batch_for("mlp", 8)
    dp = DPModel(build("mlp"), 1.0, 1.0, 8, seed=0)
    dp.compile(optimizer="sgd", loss=LOSS)
    with pytest.raises(ValueError, match="does not take sample_weight"):
        dp.fit(x, y, sample_weight=np.ones(8), verbose=0)
    strategy = strategy_with(2)
    with strategy.scope():
        on_replicas = build("mlp")
    step = make_dp_train_step(on_replicas, LOSS, keras.optimizers.SGD(), 1.0, 1.0, 8,
                              strategy=strategy)
    with pytest.raises(ValueError, match="experimental_distribute_dataset"):
        step(x, y)


def dp_model_noise(strategy, recompile=False, steps=3):
    """The noise in each of ``steps`` DPModel updates: [steps, 600] (noisy minus noiseless)."""
    x, y = batch_for("mlp", 6, seed=1)
    updates = []
    for sigma in (2.0, 0.0):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            dp = DPModel(keras.Sequential([keras.Input((12,)), keras.layers.Dense(50),
                                           keras.layers.Dense(3)]), 1.0, sigma, 10, seed=5)
            dp.compile(optimizer=keras.optimizers.SGD(1.0), loss=LOSS)
        start = dp.model.get_weights()
        rows = []
        for _ in range(steps):
            if recompile:
                with strategy.scope():
                    dp.compile(optimizer=keras.optimizers.SGD(1.0), loss=LOSS)
            dp.model.set_weights(start)
            dp.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
            rows.append(dp.model.get_weights()[0].ravel() - start[0].ravel())
        updates.append(np.array(rows))
    return updates[0] - updates[1]


@pytest.mark.parametrize("replicas", [1, 2])
def test_dp_model_adds_fresh_noise_once_per_step_also_on_replicas(replicas):
    strategy = strategy_with(replicas) if replicas > 1 else tf.distribute.get_strategy()
    noise = dp_model_noise(strategy)
    assert noise.std() == pytest.approx(2.0 * 1.0 / 10, rel=0.1)
    assert abs(np.corrcoef(noise[0], noise[1])[0, 1]) < 0.15  # a new draw every step


def test_compiling_again_does_not_replay_the_noise():
    noise = dp_model_noise(tf.distribute.get_strategy(), recompile=True)
    assert abs(np.corrcoef(noise[0], noise[1])[0, 1]) < 0.15


# ------------------------------------------------------------------- arguments of every kind


def test_accounting_arguments_must_be_numbers_and_steps_an_int():
    with pytest.raises(ValueError, match=r"steps must be a positive int, got 10.0 \(float\)"):
        epsilon(1.0, 0.1, 10.0, 1e-5)
    with pytest.raises(ValueError, match=r"delta must be a real number.*got '1e-5' \(str\)"):
        epsilon(1.0, 0.1, 10, "1e-5")
    with pytest.raises(ValueError, match=r"noise_multiplier must be a real number.*got None"):
        epsilon(None, 0.1, 10, 1e-5)
    with pytest.raises(ValueError,
                       match=r"sample_rate must be a real number.*array of shape \(2,\)"):
        noise_multiplier_for_epsilon(3.0, np.array([0.1, 0.2]), 10, 1e-5)
    with pytest.raises(ValueError, match=r"target_epsilon must be a real number.*got '3'"):
        noise_multiplier_for_epsilon("3", 0.1, 10, 1e-5)
    with pytest.raises(ValueError, match=r"steps must be a positive int, got True \(a bool\)"):
        noise_multiplier_for_epsilon(3.0, 0.1, True, 1e-5)
    assert epsilon(1.0, np.float32(0.5), np.int64(10), 1e-5) == epsilon(1.0, 0.5, 10, 1e-5)


def test_poisson_batches_checks_its_arguments_when_called():
    x, y = np.zeros((4, 2)), np.zeros(4)
    with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\]"):
        poisson_batches(x, y, 1.5, seed=0)  # no next(): refused when the generator is made
    with pytest.raises(ValueError, match=r"seed must be an int >= 0, got 0.5 \(float\).*or None"):
        poisson_batches(x, y, 0.5, seed=0.5)
    with pytest.raises(ValueError, match=r"seed must be an int >= 0, got '1' \(str\)"):
        poisson_batches(x, y, 0.5, seed="1")
    with pytest.raises(ValueError, match="y is None; poisson_batches samples from arrays"):
        poisson_batches(x, None, 0.5, seed=0)
    with pytest.raises(ValueError, match="x has 4 examples but y has 3"):
        poisson_batches(x, y[:3], 0.5, seed=0)
    assert len(list(poisson_batches(x, y, 0.5, seed=None))) == 2  # documented: fresh batches


def test_dp_step_arguments_get_errors_that_name_the_fix():
    model, sgd = build("mlp"), keras.optimizers.SGD()
    with pytest.raises(ValueError, match=r"loss_fn is the string 'sparse_categorical_crossentropy'"
                                         r".*SparseCategoricalCrossentropy\(reduction=None\)"):
        make_dp_train_step(model, "sparse_categorical_crossentropy", sgd, 1.0, 1.0, 8)
    with pytest.raises(ValueError, match=r"loss_fn is None: DP-SGD needs a per-example loss"):
        make_dp_train_step(model, None, sgd, 1.0, 1.0, 8)
    with pytest.raises(TypeError, match=r"model must be a Keras model.*got function"):
        make_dp_train_step(lambda v: model(v), LOSS, sgd, 1.0, 1.0, 8)
    with pytest.raises(TypeError, match=r"optimizer must be a Keras optimizer object, got 'sgd'"):
        make_dp_train_step(model, LOSS, "sgd", 1.0, 1.0, 8)
    for clip, message in [(None, r"got None"), ("1", r"got '1' \(str\)"),
                          (np.ones(2), r"an array of shape \(2,\)")]:
        with pytest.raises(ValueError, match="l2_norm_clip must be a real number.*" + message):
            make_dp_train_step(model, LOSS, sgd, clip, 1.0, 8)
    with pytest.raises(ValueError, match=r"expected_batch_size must be a positive int, got 8.0 "
                                         r"\(float\).*sample rate x the number of examples"):
        make_dp_train_step(model, LOSS, sgd, 1.0, 1.0, 8.0)
    for seed, message in [("0", r"got '0' \(str\)"), (0.5, r"got 0.5 \(float\)"), (-1, "got -1")]:
        with pytest.raises(ValueError, match=f"seed must be an int >= 0, {message}"):
            make_dp_train_step(model, LOSS, sgd, 1.0, 1.0, 8, seed=seed)
    step = make_dp_train_step(model, LOSS, sgd, 1.0, 1.0, np.int64(8), seed=np.int64(3))
    x, y = batch_for("mlp", 4)
    with pytest.raises(ValueError, match=r"step\(x, y\) got y=None; DP-SGD needs inputs x and one "
                                         r"target per example y"):
        step(x, None)
    assert int(step(x, y)) == 4


def test_dp_model_arguments_get_errors_that_name_the_fix():
    model = build("mlp")
    with pytest.raises(TypeError,
                       match=r"model must be a Keras model.*got list.*keras\.Sequential"):
        DPModel(model.layers, 1.0, 1.0, 8)
    with pytest.raises(ValueError, match=r"l2_norm_clip must be a real number.*got '1.0'"):
        DPModel(model, "1.0", 1.0, 8)
    with pytest.raises(ValueError, match=r"noise_multiplier must be a real number.*got 'high'"):
        DPModel(model, 1.0, "high", 8)
    with pytest.raises(ValueError, match=r"expected_batch_size must be a positive int, got True"):
        DPModel(model, 1.0, 1.0, True)
    with pytest.raises(ValueError, match=r"seed must be an int >= 0, got 1.5"):
        DPModel(model, 1.0, 1.0, 8, seed=1.5)
    with pytest.raises(ValueError, match=r"loss is the string 'sparse_categorical_crossentropy'.*"
                                         r"SparseCategoricalCrossentropy\(reduction=None\)"):
        DPModel(model, 1.0, 1.0, 8).compile(optimizer="sgd",
                                            loss="sparse_categorical_crossentropy")
    dp = DPModel(model, 1.0, 1.0, 8, seed=0)
    dp.compile(optimizer="sgd", loss=LOSS)
    x, _ = batch_for("mlp", 8)
    with pytest.raises(ValueError, match=r"DPModel.fit got y=None; DP-SGD needs inputs x and one "
                                         r"target per example y"):
        dp.fit(x, epochs=1, verbose=0)


class _AddsALoss(keras.layers.Layer):
    """A layer that records a loss in its forward pass (``add_loss``): invisible before a call."""

    def call(self, x):
        self.add_loss(tf.reduce_mean(tf.square(x)))
        return x


def test_dp_training_refuses_losses_it_would_leave_out_also_those_seen_only_in_a_call():
    """An activity regulariser is found on the layer before any call; an ``add_loss`` only
    after the first forward pass. Both were left out of DP-SGD silently before."""
    x, y = np.ones((8, 5), "float32"), np.arange(8) % 3
    def activity():
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(
            4, activity_regularizer=keras.regularizers.L2(0.5)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="regularisation losses"):
        make_dp_train_step(activity(), LOSS, keras.optimizers.SGD(), 1.0, 1.0, 8)
    with pytest.raises(ValueError, match="regularisation losses"):
        DPModel(activity(), 1.0, 1.0, 8).compile(optimizer="sgd", loss=LOSS)
    adds = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), _AddsALoss(),
                             keras.layers.Dense(3)])
    step = make_dp_train_step(adds, LOSS, keras.optimizers.SGD(), 1.0, 1.0, 8)
    with pytest.raises(ValueError, match="regularisation losses"):
        step(x, y)
