"""DP-SGD you can check: epsilon during fit (PrivacyBudget) against epsilon(), DPModel saved and
loaded against the model that never left memory, and the one-run audit's bound against closed
forms, a direct sum and a simulation, and on real DPModel runs, honest and broken."""
import math

import keras
import numpy as np
import pytest
import scipy.special
import scipy.stats
import tensorflow as tf
from test_privacy import clipped_by_hand

from gradtut.checks import assert_gradients_close
from gradtut.privacy import (
    CanaryAudit,
    DPModel,
    PrivacyBudget,
    audit_from_scores,
    audit_p_value,
    epsilon,
    epsilon_lower_bound,
    poisson_batches,
)
from model_zoo import LOSS, batch_for

TOL = {"rtol": 1e-4, "atol": 1e-6}


def wide_mlp(seed=0):
    """515 parameters: room for a few hundred Dirac canaries."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="tanh"),
                             keras.layers.Dense(3)])


def poisson_data(n, q, seed, passes=1):
    x, y = batch_for("mlp", n, seed=seed)

    def batches():
        for p in range(passes):
            yield from poisson_batches(x, y, q, seed=seed * 100 + p)
    return tf.data.Dataset.from_generator(batches, output_signature=(
        tf.TensorSpec([None, 12], tf.float32), tf.TensorSpec([None], tf.int64))).apply(
        tf.data.experimental.assert_cardinality(passes * round(1 / q)))


def dp_model(cls=None, sigma=1.0, batch=8, seed=0, optimizer=None):
    dp = (cls or DPModel)(wide_mlp(), l2_norm_clip=1.0, noise_multiplier=sigma,
                          expected_batch_size=batch, seed=seed)
    dp.compile(optimizer=optimizer or keras.optimizers.Adam(0.01), loss=LOSS)
    return dp


class ForgetsTheNoise(DPModel):
    """The bug the audit must catch: it claims noise_multiplier but adds no noise."""

    def noise_stddev(self):
        return 0.0


# ------------------------------------------------------------------------- PrivacyBudget


def test_budget_logs_epsilon_of_the_models_own_step_count_each_epoch():
    seed = int(np.random.default_rng().integers(1000))
    print("data seed", seed)
    dp, q = dp_model(sigma=1.3), 0.1
    budget = PrivacyBudget(q, 1e-5, num_examples=80)
    history = dp.fit(poisson_data(80, q, seed, passes=2), epochs=3, verbose=0, shuffle=False,
                     callbacks=[budget])
    steps = dp.dp_steps
    assert steps == 3 * 2 * 10
    expected = [epsilon(1.3, q, k * 20, 1e-5) for k in (1, 2, 3)]  # after the method
    assert history.history["epsilon"] == pytest.approx(expected, rel=1e-12)
    assert budget.epsilon == pytest.approx(expected[-1], rel=1e-12)
    again = PrivacyBudget(q, 1e-5, accountant="pld")  # a second fit counts on from 60 steps
    more = dp.fit(poisson_data(80, q, seed + 1), epochs=1, verbose=0, callbacks=[again])
    assert more.history["epsilon"] == pytest.approx([epsilon(1.3, q, 70, 1e-5, "pld")],
                                                    rel=1e-9)


def test_budget_stops_before_the_step_that_would_exceed_the_target():
    q, target = 0.1, 4.0 + float(np.random.default_rng().random())
    dp = dp_model(sigma=1.0)
    budget = PrivacyBudget(q, 1e-5, target_epsilon=target)
    history = dp.fit(poisson_data(80, q, 1, passes=10), epochs=5, verbose=0, shuffle=False,
                     callbacks=[budget])
    steps = dp.dp_steps
    assert epsilon(1.0, q, steps, 1e-5) <= target < epsilon(1.0, q, steps + 1, 1e-5)
    assert history.history["epsilon"][-1] == pytest.approx(epsilon(1.0, q, steps, 1e-5))
    assert max(history.history["epsilon"]) <= target
    assert len(history.history["epsilon"]) < 5  # it stopped inside an epoch
    with pytest.raises(ValueError, match=r"the privacy budget is spent: after \d+ steps one more "
                                         r"would give epsilon .* > target_epsilon"):
        dp.fit(poisson_data(80, q, 2), epochs=1, verbose=0, callbacks=[budget])


def test_budget_refuses_bad_input_with_the_fix():
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        PrivacyBudget(0.1, 1.0)
    with pytest.raises(ValueError, match="target_epsilon must be > 0"):
        PrivacyBudget(0.1, 1e-5, target_epsilon=0)
    with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\]"):
        PrivacyBudget(1.5, 1e-5)
    with pytest.raises(ValueError, match="unknown accountant"):
        PrivacyBudget(0.1, 1e-5, accountant="moments")
    x, y = batch_for("mlp", 16)
    plain = wide_mlp()
    plain.compile(optimizer="sgd", loss=LOSS)
    with pytest.raises(TypeError, match=r"PrivacyBudget works with a gradtut.privacy.DPModel, got "
                                        r"Sequential: wrap your model"):
        plain.fit(x, y, epochs=1, verbose=0, callbacks=[PrivacyBudget(0.1, 1e-5)])
    dp = dp_model()
    with pytest.raises(ValueError, match=r"sample_rate 0.2 does not match the model: its "
                                         r"expected_batch_size 8 over 80 examples is 0.1"):
        dp.fit(x, y, epochs=1, verbose=0,
               callbacks=[PrivacyBudget(0.2, 1e-5, num_examples=80)])
    noiseless = dp_model(sigma=0.0)
    with pytest.raises(ValueError, match="noise_multiplier 0 gives epsilon = inf: no step fits"):
        noiseless.fit(x, y, epochs=1, verbose=0,
                      callbacks=[PrivacyBudget(0.1, 1e-5, target_epsilon=10)])
    assert dp.dp_steps == 0 and noiseless.dp_steps == 0  # nothing ran


def test_budget_refuses_more_steps_per_call_than_the_budget_has_left():
    q = 0.1
    last = 1 + max(k for k in range(1, 60) if epsilon(1.0, q, k, 1e-5) <= 4.0) - 1
    dp = DPModel(wide_mlp(), 1.0, 1.0, 8, seed=0)
    dp.compile(optimizer="sgd", loss=LOSS, steps_per_execution=last + 1)
    with pytest.raises(ValueError, match=rf"only {last} steps are left in the budget, but the "
                                         rf"model runs {last + 1} per call"):
        dp.fit(poisson_data(80, q, 0, passes=10), epochs=1, verbose=0,
               callbacks=[PrivacyBudget(q, 1e-5, target_epsilon=4.0)])
    assert dp.dp_steps == 0


# -------------------------------------------------------------------------------- saving


@pytest.mark.parametrize("seed", [7, None])
def test_dp_model_saves_and_loads_and_training_resumes_with_the_next_noise(tmp_path, seed):
    x, y = batch_for("mlp", 16, seed=int(np.random.default_rng().integers(1000)))
    dp = dp_model(sigma=0.7, seed=seed)
    dp.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "dp.keras")
    dp.save(path)
    back = keras.models.load_model(path)  # no custom_objects: gradtut registers DPModel
    assert type(back) is DPModel
    assert (back.l2_norm_clip, back.noise_multiplier, back.expected_batch_size) == (1.0, 0.7, 8)
    assert back.dp_steps == 2
    assert all(np.array_equal(a, b)
               for a, b in zip(back.get_weights(), dp.get_weights(), strict=True))
    assert ("seed" in back.get_config()) == (seed is not None)
    dp.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)   # step 3 of the original
    back.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)  # step 3 after loading
    if seed is not None:  # the same step's noise and optimizer state: the same weights
        assert_gradients_close(back.get_weights(), dp.get_weights(), **TOL)
    else:  # a seed drawn from entropy is never written: a fresh one, fresh noise
        assert back.seed != dp.seed
        assert not np.allclose(back.model.get_weights()[0], dp.model.get_weights()[0])


def test_a_config_without_its_model_is_refused():
    with pytest.raises(ValueError, match="has no 'model' entry"):
        DPModel.from_config({"l2_norm_clip": 1.0, "noise_multiplier": 1.0,
                             "expected_batch_size": 8})


# ---------------------------------------------------------------------- the audit's bound


def p_value_by_hand(eps, r, v, m, delta):
    """Theorem 5.2 of Steinke, Nasr and Jagielski (2023), term by term."""
    p = math.exp(eps) / (1 + math.exp(eps))
    pmf = [math.comb(r, k) * p**k * (1 - p)**(r - k) for k in range(r + 1)]
    tail = sum(pmf[v:])
    window = max((sum(pmf[v - i:v]) / i for i in range(1, v + 1)), default=0.0)
    return min(1.0, tail + 2 * m * delta * window)


def test_every_guess_right_gives_the_closed_form():
    rng = np.random.default_rng()
    for _ in range(5):
        r, confidence = int(rng.integers(10, 2000)), float(rng.uniform(0.8, 0.99))
        p = (1 - confidence) ** (1 / r)  # P[Bin(r, p) >= r] = p^r = 1 - confidence
        bound = epsilon_lower_bound(r, r, r + 10, 0.0, confidence)
        assert bound == pytest.approx(math.log(p / (1 - p)), rel=1e-9)


def test_every_guess_wrong_or_a_coin_toss_proves_nothing():
    assert epsilon_lower_bound(500, 0, 1000, 1e-5) == 0.0
    assert epsilon_lower_bound(500, 250, 1000, 1e-5) == 0.0
    assert epsilon_lower_bound(0, 0, 1000) == 0.0


@pytest.mark.parametrize("delta", [0.0, 1e-5, 1e-3])
def test_the_bound_sits_on_the_binomial_boundary(delta):
    rng = np.random.default_rng()
    r = int(rng.integers(50, 300))
    v = int(rng.integers(int(0.7 * r), r))
    m = int(rng.integers(r, 3 * r))
    bound = epsilon_lower_bound(r, v, m, delta, 0.95)
    if delta == 0:  # P[Bin(r, p) >= v] = I_p(v, r - v + 1): invert the incomplete beta
        p = scipy.special.betaincinv(v, r - v + 1, 0.05)
        assert bound == pytest.approx(math.log(p / (1 - p)), rel=1e-7)
    assert bound > 0
    assert (p_value_by_hand(bound - 1e-6, r, v, m, delta) < 0.05
            <= p_value_by_hand(bound + 1e-6, r, v, m, delta))
    assert audit_p_value(bound, r, v, m, delta) == pytest.approx(
        p_value_by_hand(bound, r, v, m, delta), rel=1e-9)
    assert epsilon_lower_bound(r, v, m, delta + 1e-3, 0.95) <= bound  # more delta, less proof


def test_the_bound_holds_for_randomized_response_in_simulation():
    """An eps0-DP guesser (right with probability e^eps0 / (1 + e^eps0)): the 90% bound may
    exceed eps0 in at most about 10% of runs, and it is not trivially loose."""
    rng = np.random.default_rng()
    eps0, r, runs = 1.0, 1000, 300
    right = rng.binomial(r, math.exp(eps0) / (1 + math.exp(eps0)), size=runs)
    bounds = np.array([epsilon_lower_bound(r, int(v), r, 0.0, 0.9) for v in right])
    assert np.mean(bounds > eps0) <= 0.1 + 3 * math.sqrt(0.09 / runs)
    assert np.mean(bounds) > 0.7 * eps0


def test_guesses_are_the_top_and_bottom_scores():
    included = np.array([True, False] * 60)
    scores = np.where(included, 1.0, -1.0)
    scores[0], scores[1] = -5.0, 5.0  # one included canary at the very bottom, one out at top
    result = audit_from_scores(scores, included, delta=0.0, guesses=20)
    assert (result.guesses, result.correct, result.canaries) == (20, 18, 120)
    assert result.epsilon == epsilon_lower_bound(20, 18, 120)
    assert "18 of 20 guesses right on 120 canaries" in str(result)


def test_the_bound_refuses_bad_input_with_the_fix():
    with pytest.raises(ValueError, match="need correct <= guesses <= canaries"):
        epsilon_lower_bound(10, 11, 100)
    with pytest.raises(ValueError, match=r"delta must be in \[0, 1\)"):
        epsilon_lower_bound(10, 5, 100, delta=1.0)
    with pytest.raises(ValueError, match=r"confidence must be in \(0, 1\)"):
        epsilon_lower_bound(10, 5, 100, confidence=1.0)
    with pytest.raises(ValueError, match="epsilon_value must be >= 0"):
        audit_p_value(-1.0, 10, 5, 100)
    with pytest.raises(ValueError, match="need correct <= guesses <= canaries"):
        audit_p_value(1.0, 200, 5, 100)
    with pytest.raises(ValueError, match="50 canaries are too few"):
        audit_from_scores(np.zeros(50), np.zeros(50, bool), 1e-5)
    with pytest.raises(ValueError, match="one score per canary"):
        audit_from_scores(np.zeros(200), np.zeros(199, bool), 1e-5)
    with pytest.raises(ValueError, match="not finite"):
        audit_from_scores(np.full(200, np.nan), np.zeros(200, bool), 1e-5)
    with pytest.raises(ValueError, match="guesses must be between 2 and the 200 canaries"):
        audit_from_scores(np.zeros(200), np.zeros(200, bool), 1e-5, guesses=201)


# -------------------------------------------------------------------- the audit on DPModel


def audited_run(cls, sigma, canaries=200, q=0.04, passes=6, seed=0, confidence=0.95,
                optimizer=None):
    dp = dp_model(cls, sigma=sigma, optimizer=optimizer)
    audit = CanaryAudit(canaries, sample_rate=q, delta=1e-5, confidence=confidence, seed=seed)
    dp.fit(poisson_data(200, q, int(np.random.default_rng().integers(1000)), passes), epochs=1,
           verbose=0, callbacks=[audit])
    return dp, audit.result, epsilon(sigma, q, passes * 25, 1e-5)


def test_an_honest_run_audits_below_the_accountant_and_a_noiseless_one_above():
    # sigma 0.7: strong enough canaries that the bound is not 0 (scoring them with the wrong
    # sigma, or without subtracting the data's part, would show), yet below the accountant
    _, honest, eps = audited_run(DPModel, sigma=0.7, confidence=0.99)
    assert 0 < honest.epsilon <= eps
    _, broken, eps = audited_run(ForgetsTheNoise, sigma=3.0)
    # 150 steps at q = 0.04: an included canary goes unsampled with probability 0.2%, so the
    # noiseless run gives its canaries away; 40 right guesses prove at most about 2.55
    assert broken.correct >= broken.guesses - 1
    assert broken.epsilon > 1.9 > 2 * eps


def test_the_audit_adds_each_sampled_canary_once_and_scores_it_exactly():
    from gradtut.privacy import _Canaries
    variables = [tf.Variable(tf.zeros([6, 5])), tf.Variable(tf.zeros([5]))]
    canaries = _Canaries(variables, 20, sample_rate=0.5, clip=2.0, noise_multiplier=1.5, seed=3)
    data = [tf.random.normal([6, 5]), tf.random.normal([5])]
    step = tf.constant(4, tf.int64)
    with_canaries = canaries.add(data, step)
    # the reference: which canaries this step samples, from the same stateless draw
    draw = tf.random.stateless_uniform([20], tf.stack([canaries.seed, step])).numpy()
    sampled = (draw < 0.5) & canaries.included
    added = np.concatenate([(w - d).numpy().ravel()
                            for w, d in zip(with_canaries, data, strict=True)])
    assert np.count_nonzero(added) == sampled.sum()
    assert sorted(added[added != 0]) == pytest.approx([2.0] * sampled.sum())
    # released without noise: each sampled canary shows its full size C, the others nothing,
    # so the scores are two known values, and the high one marks exactly the sampled canaries
    canaries.observe(with_canaries, data)
    mu = 1 / 1.5
    high, low = (np.log(0.5 + 0.5 * np.exp(mu * c / 1.5 - mu**2 / 2)) for c in (1.0, 0.0))
    scores = canaries.scores.numpy()
    assert scores == pytest.approx(np.where(sampled, high, low), rel=1e-5)
    # and a release with noise only on the sampled canaries' parameters (found from `added`,
    # not from the canaries' own bookkeeping) moves exactly those scores, by the formula
    bump = np.where(added != 0, 3.0, 0.0)
    parts = np.split(bump, [30])
    canaries.observe([w + tf.constant(b.reshape(w.shape), tf.float32)
                      for w, b in zip(with_canaries, parts, strict=True)], data)
    again = np.log(0.5 + 0.5 * np.exp(mu * (2.0 + 3.0) / (1.5 * 2.0) - mu**2 / 2))
    assert canaries.scores.numpy() - scores == pytest.approx(np.where(sampled, again, low),
                                                             rel=1e-5)


def test_after_the_audit_the_model_trains_without_canaries_even_if_fit_failed():
    x, y = batch_for("mlp", 16, seed=int(np.random.default_rng().integers(1000)))
    dp, _, _ = audited_run(ForgetsTheNoise, sigma=0.5, passes=1,
                           optimizer=keras.optimizers.SGD(0.5))
    with pytest.raises(ValueError, match="does not match the model"):  # after the canaries went in
        dp.fit(x, y, verbose=0, callbacks=[CanaryAudit(200, 0.04, 1e-5),
                                           PrivacyBudget(0.5, 1e-5, num_examples=200)])
    reference = wide_mlp()
    reference.set_weights(dp.model.get_weights())
    dp.fit(x, y, batch_size=16, epochs=1, verbose=0)  # no canaries now, and (the bug) no noise
    grads = clipped_by_hand(reference, x, y, 1.0, 8)
    keras.optimizers.SGD(0.5).apply([tf.constant(g, tf.float32) for g in grads],
                                    reference.trainable_variables)
    assert_gradients_close(dp.model.trainable_variables, reference.trainable_variables, **TOL)


def test_the_audit_refuses_bad_input_with_the_fix():
    with pytest.raises(ValueError, match="50 canaries are too few"):
        CanaryAudit(50, 0.04, 1e-5)
    with pytest.raises(ValueError, match=r"delta must be in \[0, 1\)"):
        CanaryAudit(200, 0.04, 1.0)
    with pytest.raises(ValueError, match="guesses must be between 2 and the 200 canaries"):
        CanaryAudit(200, 0.04, 1e-5, guesses=1)
    x, y = batch_for("mlp", 16)
    plain = wide_mlp()
    plain.compile(optimizer="sgd", loss=LOSS)
    with pytest.raises(TypeError, match="CanaryAudit works with a gradtut.privacy.DPModel"):
        plain.fit(x, y, verbose=0, callbacks=[CanaryAudit(200, 0.04, 1e-5)])
    with pytest.raises(ValueError, match="noise_multiplier is 0: the model claims no privacy"):
        dp_model(sigma=0.0).fit(x, y, verbose=0, callbacks=[CanaryAudit(200, 0.04, 1e-5)])
    with pytest.raises(ValueError, match=r"600 canaries but only 515 trainable parameters"):
        dp_model().fit(x, y, verbose=0, callbacks=[CanaryAudit(600, 0.001, 1e-5)])
    with pytest.raises(ValueError, match=r"300 canaries but only 200 examples"):
        dp_model().fit(x, y, verbose=0, callbacks=[CanaryAudit(300, 0.04, 1e-5)])
    with pytest.raises(ValueError, match=r"sample_rate 0.04 does not match the model: its "
                                         r"expected_batch_size 8 over 400 examples is 0.02"):
        dp_model().fit(x, y, verbose=0,
                       callbacks=[CanaryAudit(200, 0.04, 1e-5, num_examples=400)])
