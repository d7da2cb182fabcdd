"""DP-SGD a practitioner can ship: privacy accounting, Poisson batches, a training step and a
Keras model whose ``fit`` trains privately (notebook 01, section 9).

The guarantee is that of Abadi et al. (2016): each step samples every example independently
with probability ``sample_rate`` (Poisson sampling), clips each example's gradient to norm
``l2_norm_clip``, adds Gaussian noise of standard deviation ``noise_multiplier * l2_norm_clip``
to the sum, once, and divides by the *expected* batch size. :func:`epsilon` turns
``(noise_multiplier, sample_rate, steps, delta)`` into the epsilon of that guarantee, with
Google's ``dp_accounting`` library (the accountant TensorFlow Privacy and jax_privacy use).

Clipping uses :func:`gradtut.per_example.make_clipped_sum`: ghost norms and one reweighted sum
per layer, so a layer whose norm is ghost (:func:`gradtut.per_example.per_example_plan`'s
norm column) never materialises its per-example gradients; the others (normalisations, LoRA
adapters, Dense layers on long sequences, layer-local fallbacks) materialise theirs once.

Example:
  >>> sigma = noise_multiplier_for_epsilon(3.0, sample_rate=64 / 1500, steps=500, delta=1e-5)
  >>> round(sigma, 2)
  1.66
  >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
  >>> dp = DPModel(model, l2_norm_clip=1.0, noise_multiplier=sigma, expected_batch_size=64)
  >>> dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
  ...     from_logits=True, reduction=None))
"""
import collections
import contextlib
import functools
import logging
import math

import dp_accounting
import keras
import numpy as np
import scipy.stats
import tensorflow as tf
from dp_accounting import pld, rdp

from gradtut import checks, per_example
from gradtut.checks import check_int, check_real, check_seed

ACCOUNTANTS = ("rdp", "pld")
_MAX_NOISE = 1e3  # the search for a noise multiplier stops here


# ------------------------------------------------------------------------------- accounting


class _DropNonConvergingOrders(logging.Filter):
    """dp_accounting's RDP accountant logs a warning for each fractional Renyi order whose
    series does not converge, and then leaves that order out. Leaving an order out can only
    make epsilon larger (it is a minimum over orders), so the result stays a valid bound; the
    warnings would only fill a notebook's output. Every other message passes."""

    def filter(self, record):
        return "failed to converge" not in record.getMessage()


@contextlib.contextmanager
def _without_order_warnings():
    logger, drop = logging.getLogger("absl"), _DropNonConvergingOrders()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _check_accounting(sample_rate, steps, delta, accountant):
    """``(sample_rate, steps, delta)`` as float, int, float, after checking their ranges."""
    delta = check_real(delta, "delta")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r} (a common choice: below 1/N)")
    sample_rate = _check_sample_rate(sample_rate)
    steps = check_int(steps, "steps")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}; choose one of {ACCOUNTANTS}")
    return sample_rate, steps, delta


def _check_sample_rate(sample_rate):
    sample_rate = check_real(sample_rate, "sample_rate")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r} (expected batch "
                         "size / number of examples)")
    return sample_rate


def _poisson_gaussian(noise_multiplier, sample_rate):
    """One DP-SGD step as dp_accounting sees it: a Gaussian mechanism on a Poisson sample."""
    return dp_accounting.PoissonSampledDpEvent(
        sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier))


@functools.lru_cache(maxsize=1024)
def _rdp_of_one_step(noise_multiplier, sample_rate):
    """``(orders, rdp)``: the Renyi DP of one step at dp_accounting's default orders (read-only
    arrays). RDP adds up over steps: for ``steps`` steps dp_accounting's accountant computes
    exactly ``steps * rdp`` (its ``SelfComposedDpEvent``). Computing one step takes about 0.2 s,
    so the cache turns epsilon at many step counts (a plot) into one computation per noise
    multiplier and sample rate."""
    account = rdp.RdpAccountant()
    with _without_order_warnings():
        account.compose(_poisson_gaussian(noise_multiplier, sample_rate))
    orders, one_step = account.orders, account.rdp
    orders.setflags(write=False)
    one_step.setflags(write=False)
    return orders, one_step


def epsilon(noise_multiplier, sample_rate, steps, delta, accountant="rdp"):
    """Epsilon of DP-SGD with Poisson sampling: ``steps`` compositions of the Gaussian
    mechanism with ``noise_multiplier``, each on a Poisson sample of rate ``sample_rate``.

    Args:
      noise_multiplier: sigma >= 0 (noise std over the clip norm); 0 gives ``inf``.
      sample_rate: q in (0, 1], the probability that a step includes a given example.
      steps: number of steps, a positive int.
      delta: in (0, 1).
      accountant: ``"rdp"`` (Renyi DP, Mironov 2017, with the tighter conversion to
        (epsilon, delta) of Canonne et al. 2020) or ``"pld"`` (privacy loss distributions,
        tighter still).

    Returns:
      float epsilon, for the add-or-remove-one neighbouring relation.

    Raises:
      ValueError: an argument that is not a number (steps: not an int) or outside its range.

    Example:
      >>> round(epsilon(1.1, 256 / 60000, 14062, 1e-5), 2)
      2.6
    """
    sample_rate, steps, delta = _check_accounting(sample_rate, steps, delta, accountant)
    noise_multiplier = check_real(noise_multiplier, "noise_multiplier")
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
    if noise_multiplier == 0:
        return math.inf
    if accountant == "rdp":
        orders, one_step = _rdp_of_one_step(noise_multiplier, sample_rate)
        eps = float(rdp.compute_epsilon(orders, steps * one_step, delta)[0])
    else:
        account = pld.PLDAccountant()
        account.compose(dp_accounting.SelfComposedDpEvent(
            _poisson_gaussian(noise_multiplier, sample_rate), steps))
        eps = float(account.get_epsilon(delta))
    if not eps > 0:  # dp_accounting returns 0 when it meets a negative Renyi divergence
        raise RuntimeError(f"dp_accounting returned epsilon {eps} for noise_multiplier "
                           f"{noise_multiplier}, which is not a valid bound; try the other "
                           "accountant")
    return eps


def noise_multiplier_for_epsilon(target_epsilon, sample_rate, steps, delta, accountant="rdp"):
    """The smallest noise multiplier whose :func:`epsilon` is at most ``target_epsilon``, to
    0.1% (the result always meets the target).

    The search keeps a bracket: ``low`` misses the target, ``high`` meets it. Doubling or
    halving from 1 finds one; then regula falsi on ``log(epsilon)`` against ``log(sigma)``
    (nearly a straight line) narrows it, with the Illinois rule so that both ends move. For a
    sigma within about 8x of 1 that takes 5 to 8 evaluations of :func:`epsilon`, plus one per
    further doubling or halving, where bisection to the same 0.1% took 11 to 14. That counts
    with PLD: 0.5 to 13 s per evaluation on 2 cores, the more the smaller sigma.

    Raises:
      ValueError: a non-positive target, an argument outside its range, a target that no
        noise multiplier up to 1000 reaches (the message gives the best reachable epsilon;
        with RDP, small targets are limited by delta and the largest Renyi order), or a target
        so large that even a noise multiplier of 1e-9 meets it (it does not bound the noise).

    Example:
      >>> sigma = noise_multiplier_for_epsilon(3.0, sample_rate=0.01, steps=100, delta=1e-5)
      >>> round(sigma, 2), epsilon(sigma, 0.01, 100, 1e-5) <= 3.0
      (0.71, True)
    """
    sample_rate, steps, delta = _check_accounting(sample_rate, steps, delta, accountant)
    target_epsilon = check_real(target_epsilon, "target_epsilon")
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be positive, got {target_epsilon!r}")

    def excess(sigma):  # > 0: sigma misses the target; <= 0: it meets it
        return math.log(epsilon(sigma, sample_rate, steps, delta, accountant) / target_epsilon)

    (low, e_low), (high, e_high) = _bracket(excess, target_epsilon)
    moved = None
    while high - low > 1e-3 * high:
        mid = math.exp((math.log(low) * e_high - math.log(high) * e_low) / (e_high - e_low))
        if not low < mid < high:  # rounding, in a bracket this narrow
            mid = (low + high) / 2
        e_mid = excess(mid)
        if e_mid <= 0:  # Illinois: an end that stays put twice in a row counts half
            high, e_high, e_low = mid, e_mid, e_low / 2 if moved == "high" else e_low
            moved = "high"
        else:
            low, e_low, e_high = mid, e_mid, e_high / 2 if moved == "low" else e_high
            moved = "low"
    return high


def _bracket(excess, target_epsilon):
    """``((low, excess(low)), (high, excess(high)))`` with ``low`` missing the target
    (``excess > 0``) and ``high`` (at most ``2 * low``) meeting it, by doubling or halving
    from 1.

    Raises:
      ValueError: even :data:`_MAX_NOISE` misses the target, or even 1e-9 meets it.
    """
    sigma, value = 1.0, excess(1.0)
    while True:
        if value > 0 and sigma >= _MAX_NOISE:
            raise ValueError(
                f"epsilon {target_epsilon} is out of reach: even noise_multiplier {sigma:g} "
                f"gives epsilon {target_epsilon * math.exp(value):.4g} with these settings. Use "
                "fewer steps, a smaller sample_rate or a larger delta, or accept a larger epsilon.")
        if value <= 0 and sigma < 1e-9:
            raise ValueError(
                f"epsilon {target_epsilon} does not bound the noise: even noise_multiplier "
                f"{sigma:.2g} gives epsilon {target_epsilon * math.exp(value):.4g}, within the "
                "target. Ask for a smaller epsilon (DP-SGD is usually run at epsilon 1 to 10).")
        other = min(2 * sigma, _MAX_NOISE) if value > 0 else sigma / 2
        other_value = excess(other)
        if (other_value > 0) != (value > 0):
            return sorted([(sigma, value), (other, other_value)])
        sigma, value = other, other_value


# ------------------------------------------------------------------------------- sampling


def poisson_batches(x, y, sample_rate, seed):
    """Batches in which each example is included independently with probability
    ``sample_rate``: the sampling the accountant assumes. Yields ``round(1 / sample_rate)``
    batches (one pass over the data in expectation) of ``(x[mask], y[mask])``; sizes vary,
    and a batch can be empty.

    Why not shuffled fixed-size batches: with them an example is in exactly one batch per
    epoch, never in two and never left out, so the steps are not independent samples and the
    Poisson-subsampling amplification that :func:`epsilon` counts on does not apply as
    computed. Their guarantee needs a different (and weaker, for the same noise) analysis.

    Use a new seed for every pass: the same seed gives the same batches again, and repeated
    samples are not the independent ones the accountant counts (``fit(epochs=E)`` over one
    generator with a fixed seed does exactly that; chain E passes with seeds
    ``seed * 1000 + e`` into one epoch instead, as notebook 01 does, so that runs with
    different seeds never share a pass).

    The sampling must also be secret: the amplification that :func:`epsilon` counts on holds
    only if nobody can tell which batches an example joined. A fixed seed is for repeatable
    experiments; for a model you publish, draw the batches with ``seed=None``, as well as
    the noise (``DPModel(seed=None)``).

    Args:
      x, y: arrays with the same first dimension N.
      sample_rate: q in (0, 1].
      seed: int, for a repeatable (and so public) sequence of batches; None draws fresh,
        secret ones, which a model you publish needs.

    Returns:
      a generator of ``(x_batch, y_batch)``. The arguments are checked when it is made.

    Raises:
      ValueError: ``sample_rate`` outside (0, 1], a bad ``seed``, x or y None, or x and y of
        different lengths.

    Example:
      >>> batches = list(poisson_batches(np.arange(8)[:, None], np.arange(8), 0.5, seed=0))
      >>> len(batches), all(len(xb) == len(yb) for xb, yb in batches)
      (2, True)
    """
    sample_rate = _check_sample_rate(sample_rate)
    seed = check_seed(seed)
    if x is None or y is None:
        raise ValueError(f"{'x' if x is None else 'y'} is None; poisson_batches samples from "
                         "arrays x and y with the same first dimension N")
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim == 0 or y.ndim == 0:
        raise ValueError(f"x and y must be arrays of N examples; got shapes {x.shape} and "
                         f"{y.shape}")
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} examples but y has {len(y)}; they must match")
    return _poisson_batches(x, y, sample_rate, seed)


def _poisson_batches(x, y, sample_rate, seed):
    rng = np.random.default_rng(seed)
    for _ in range(max(1, round(1 / sample_rate))):
        mask = rng.random(len(x)) < sample_rate
        yield x[mask], y[mask]


# ------------------------------------------------------------------------------ training


def _check_settings(l2_norm_clip, noise_multiplier, expected_batch_size):
    """The numbers of a DP-SGD step, checked: ``(C, sigma, expected_batch_size)``."""
    l2_norm_clip, noise_multiplier = per_example._check_clip_and_noise(  # pylint: disable=protected-access
        l2_norm_clip, noise_multiplier)
    try:
        expected_batch_size = check_int(expected_batch_size, "expected_batch_size")
    except ValueError as err:
        raise ValueError(f"{err} (the sample rate x the number of examples, rounded)") from None
    return l2_norm_clip, noise_multiplier, expected_batch_size


def _check_training(model, loss_fn, l2_norm_clip, noise_multiplier, expected_batch_size,
                    loss_name="loss_fn"):
    _check_settings(l2_norm_clip, noise_multiplier, expected_batch_size)
    if loss_fn is None:
        where = "compile(loss=...)" if loss_name == "loss" else f"{loss_name} is None: DP-SGD"
        raise ValueError(f"{where} needs a per-example loss, e.g. keras.losses."
                         "SparseCategoricalCrossentropy(from_logits=True, reduction=None)")
    checks.check_loss_fn(loss_fn, loss_name)  # pylint: disable=protected-access
    # the engine's own checks: a reducing loss, BatchNormalization in training, grouped
    # convolutions and random layers where the one-pass methods would get them wrong
    per_example.check_model(model, loss_fn, training=True, method="ghost")
    _refuse_model_losses(model)


def _refuse_model_losses(model):
    """Refuse regularisation losses: those of the weights, activity regularisers (found on the
    layers before any call) and losses a forward pass recorded (``add_loss``; call after one)."""
    layers = model._flatten_layers(include_self=True)  # pylint: disable=protected-access
    if model.losses or any(getattr(layer, "activity_regularizer", None) is not None
                           for layer in layers):
        raise ValueError(
            "the model has regularisation losses (kernel_regularizer, activity_regularizer or "
            "add_loss); DP-SGD here clips and noises only the per-example data loss, so they "
            "would be left out of training. Remove them; for weight decay use the optimizer's "
            "weight_decay argument, which acts on the weights, not on the data.")


def _empty_outputs(model, loss_fn):
    """Zero losses and predictions for an empty batch, or None where the model's output shape
    is not known in advance (a subclassed model)."""
    try:
        shape = model.output_shape
    except (AttributeError, ValueError):
        return None
    if not isinstance(shape, tuple) or not all(isinstance(d, (int, type(None))) for d in shape):
        return None  # several outputs
    outputs = getattr(model, "outputs", None)
    out_dtype = outputs[0].dtype if outputs else model.compute_dtype
    return (tf.zeros([0], getattr(loss_fn, "dtype", None) or "float32"),
            tf.zeros([0, *shape[1:]], out_dtype))


def _dp_gradients_fn(model, loss_fn, l2_norm_clip, std, expected_batch_size, seed,
                     canaries=None):
    """``f(x, y, step) -> (gradients, per-example losses, predictions)`` for the calling
    replica (or the only one): the clipped sum plus this replica's share of the noise (std
    ``std``), over ``expected_batch_size``. The noise is drawn from ``(seed, step)``,
    identically on every replica, and each replica adds ``1/R`` of it; the optimizer's sum over
    replicas then holds the noise exactly once. With ``canaries`` (a :class:`_Canaries`, one
    replica only), the sampled canaries join the clipped sum before the noise, and the noisy
    sum is scored for them."""
    clipped_sum = per_example.make_clipped_sum(model, loss_fn, training=True, with_outputs=True)

    def gradients(x, y, step):
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        empty = _empty_outputs(model, loss_fn)
        if empty is None:
            sums, losses, predictions = clipped_sum(x, y, l2_norm_clip)
        else:
            # An empty batch (Poisson sampling makes them) contributes zeros. It must not
            # reach the model: TensorFlow's convolutions reject a batch of 0.
            sums, losses, predictions = tf.cond(
                tf.shape(tf.nest.flatten(x)[0])[0] > 0,
                lambda: clipped_sum(x, y, l2_norm_clip),
                lambda: ([tf.zeros_like(v) for v in model.trainable_variables], *empty))
        _refuse_model_losses(model)  # add_loss shows only now, after a forward pass
        data_sums = sums
        if canaries is not None:
            sums = canaries.add(sums, step)
        noisy = []
        for i, s in enumerate(sums):
            if std:
                seed_i = tf.random.experimental.stateless_fold_in(tf.stack([seed, step]), i)
                s = s + tf.random.stateless_normal(tf.shape(s), seed=seed_i,
                                                   stddev=std / replicas, dtype=s.dtype)
            noisy.append(s)
        if canaries is not None:
            canaries.observe(noisy, data_sums)
        grads = [s / tf.cast(expected_batch_size, s.dtype) for s in noisy]
        per_example._refuse_hazards()  # pylint: disable=protected-access
        return grads, losses, predictions

    return gradients


def _seed(seed):
    """``seed`` as an int, or a fresh one from the operating system's entropy for None."""
    seed = check_seed(seed)
    return int(np.random.default_rng().integers(2**31)) if seed is None else seed


def _check_batch(x, y, where):
    """Refuse a batch without inputs or targets, before it reaches a traced function."""
    for value, name in ((x, "x"), (y, "y")):
        if value is None:
            raise ValueError(f"{where} got {name}=None; DP-SGD needs inputs x and one target per "
                             "example y (batches of (x, y), e.g. from poisson_batches)")


def make_dp_train_step(model, loss_fn, optimizer, l2_norm_clip, noise_multiplier,
                       expected_batch_size, *, strategy=None, seed=None):
    """A DP-SGD step for custom loops: ``step(x, y) -> number of examples in the batch``.

    Each example's gradient is clipped to ``l2_norm_clip``; the clipped gradients are summed;
    Gaussian noise with std ``noise_multiplier * l2_norm_clip`` is added **once** to the sum;
    the result is divided by ``expected_batch_size`` (the Poisson-sampling convention: the
    realised batch size would leak how many examples were sampled) and applied with
    ``optimizer``. Batches from :func:`poisson_batches` vary in size; an empty batch applies
    noise only.

    With ``strategy`` (e.g. ``MirroredStrategy``; create the model and optimizer under its
    scope and pass batches from ``strategy.experimental_distribute_dataset``), each replica
    clips its own examples and the noise is still added once to the all-reduced sum, not once
    per replica: every replica draws the same noise from ``(seed, step)`` and adds ``1/R`` of
    it before the optimizer sums the replicas' gradients. (Independent noise per replica, or
    the full noise on each, would give sqrt(R) or R times the intended noise in the mean.)

    Args:
      model: a built Keras model.
      loss_fn: per-example loss (a Keras loss with ``reduction=None``).
      optimizer: a Keras optimizer.
      l2_norm_clip, noise_multiplier: C > 0 and sigma >= 0.
      expected_batch_size: sample rate x number of examples (a positive int).
      seed: int for repeatable noise (tests, tutorials); None draws a fresh one. Anyone who
        knows the seed can recompute and subtract the noise, so a known seed voids the
        guarantee: train models you publish with None, and never reuse a seed.

    Raises:
      ValueError: bad arguments (``l2_norm_clip`` not a positive number, ``expected_batch_size``
        not a positive int, a bad ``seed``, a loss given by name); a trainable BatchNormalization
        layer (it normalises with batch statistics in training); a reducing loss; and as
        :func:`gradtut.per_example.clipped_gradient` for layers the engine refuses; an
        optimizer that clips (``clipnorm`` and the like) over more than one replica (Keras
        clips each replica's share before summing). ``step(x, y)`` refuses ``x`` or ``y``
        None.
      TypeError: ``model`` is not a Keras model, or ``optimizer`` is not a Keras optimizer.

    Example:
      >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
      >>> loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
      >>> step = make_dp_train_step(model, loss, keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
      ...                           noise_multiplier=1.1, expected_batch_size=8, seed=0)
      >>> int(step(np.ones((6, 4), "float32"), np.array([0, 1, 2, 0, 1, 2])))
      6
    """
    _check_training(model, loss_fn, l2_norm_clip, noise_multiplier, expected_batch_size)
    l2_norm_clip, noise_multiplier, expected_batch_size = _check_settings(
        l2_norm_clip, noise_multiplier, expected_batch_size)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a Keras optimizer object, got {optimizer!r} "
                        f"({type(optimizer).__name__}); pass e.g. keras.optimizers.SGD(0.1)")
    strategy = strategy or tf.distribute.get_strategy()
    checks.check_no_clipping_over_replicas(optimizer, strategy.num_replicas_in_sync)
    seed = _seed(seed)
    with strategy.scope():
        counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                              aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    gradients = _dp_gradients_fn(model, loss_fn, l2_norm_clip, noise_multiplier * l2_norm_clip,
                                 expected_batch_size, tf.constant(seed, tf.int64))

    def replica_step(x, y, step):
        optimizer.apply(gradients(x, y, step)[0], model.trainable_variables)
        return tf.shape(tf.nest.flatten(x)[0])[0]

    @tf.function(reduce_retracing=True)
    def compiled_step(x, y):
        counter.assign_add(1)
        batches = strategy.run(replica_step, args=(x, y, counter.read_value()))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, batches, axis=None)

    def step(x, y):
        _check_batch(x, y, "step(x, y)")
        if strategy.num_replicas_in_sync > 1 and not all(
                isinstance(t, tf.distribute.DistributedValues) for t in tf.nest.flatten((x, y))):
            raise ValueError(
                f"with {strategy.num_replicas_in_sync} replicas, pass batches from "
                "strategy.experimental_distribute_dataset: a plain tensor would reach every "
                "replica whole, so each example would be counted once per replica and the "
                "noise would be too small for the stated epsilon")
        return compiled_step(x, y)

    return step


@keras.saving.register_keras_serializable(package="gradtut")
class DPModel(keras.Model):
    """A ``keras.Model`` whose ``fit`` trains ``model`` with DP-SGD.

    ``compile(optimizer, loss=...)`` with a per-example loss (``reduction=None``), then ``fit``,
    callbacks and ``evaluate`` as usual. Each ``train_step`` clips, sums, adds the noise once
    and divides by ``expected_batch_size``, as :func:`make_dp_train_step`; under
    ``MirroredStrategy.scope()`` the noise is still added once. Feed it Poisson batches
    (:func:`poisson_batches`, e.g. through ``tf.data.Dataset.from_generator``, a new seed per
    pass; ``seed=None`` for a model you publish, since the guarantee needs the sampling kept
    secret) for the guarantee that :func:`epsilon` computes. ``seed`` as in
    :func:`make_dp_train_step`: None for models you publish. The loss and metrics that
    ``fit`` reports are computed on the private batches and are not covered by epsilon.
    ``sample_weight``, ``class_weight`` and regularisation losses are refused.

    It saves like any Keras model: ``save("m.keras")`` and ``keras.models.load_model`` (no
    ``custom_objects`` once ``gradtut.privacy`` is imported) give back a ``DPModel`` with the
    same weights, clip norm, noise multiplier, expected batch size, optimizer state and step
    counter, so training resumes with the next step's noise. The seed is saved only if you
    passed one; a model trained with ``seed=None`` draws a fresh seed when loaded.

    Raises:
      TypeError: ``model`` is not a Keras model.
      ValueError: ``l2_norm_clip``, ``noise_multiplier``, ``expected_batch_size`` or ``seed``
        as :func:`make_dp_train_step`; ``compile`` checks the loss and the model as it does,
        and ``fit`` refuses data without targets, ``sample_weight``, and an optimizer that
        clips over more than one replica.

    Example:
      >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
      >>> dp = DPModel(model, l2_norm_clip=1.0, noise_multiplier=1.1,
      ...              expected_batch_size=64, seed=0)
      >>> dp.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.
      ...            SparseCategoricalCrossentropy(from_logits=True, reduction=None))
      >>> # Not run as a doctest: fit needs a dataset, and tracing its step takes seconds.
      >>> dp.fit(dataset, epochs=3)  # doctest: +SKIP
    """

    def __init__(self, model, l2_norm_clip, noise_multiplier, expected_batch_size, seed=None,
                 **kwargs):
        super().__init__(**kwargs)
        checks.check_keras_model(model)  # pylint: disable=protected-access
        l2_norm_clip, noise_multiplier, expected_batch_size = _check_settings(
            l2_norm_clip, noise_multiplier, expected_batch_size)
        self.model = model
        self.l2_norm_clip = l2_norm_clip
        self.noise_multiplier = noise_multiplier
        self.expected_batch_size = expected_batch_size
        self.seed = _seed(seed)
        self._seed_given = seed is not None
        self._canaries_in = False
        self._dp_gradients = None
        self._per_example_loss = None
        # The noise of step t is drawn from (seed, t). The counter is a weight of this model:
        # created once (compiling again does not restart it, which would replay the noise),
        # saved and restored with the weights, and, created under a strategy's scope, one
        # value shared by all replicas.
        self._dp_steps = self.add_weight(shape=(), dtype="int64", initializer="zeros",
                                         trainable=False, aggregation="only_first_replica",
                                         name="dp_steps")
        self.built = self.model.built  # its weights exist now: nothing for build to create

    def call(self, inputs, training=False):
        return self.model(inputs, training=training)

    @property
    def dp_steps(self):
        """The DP-SGD steps this model has taken, over every ``fit`` (saved with it; step t's
        noise is drawn from ``(seed, t)``)."""
        return int(self._dp_steps.numpy())

    def noise_stddev(self):
        """The standard deviation of the Gaussian noise added to each step's clipped sum:
        ``noise_multiplier * l2_norm_clip``. (A subclass that returns something else, e.g. 0
        while still claiming ``noise_multiplier``, is the kind of bug :class:`CanaryAudit`
        catches.)"""
        return self.noise_multiplier * self.l2_norm_clip

    def get_config(self):
        config = {"name": self.name, "trainable": self.trainable,
                  "model": keras.saving.serialize_keras_object(self.model),
                  "l2_norm_clip": self.l2_norm_clip, "noise_multiplier": self.noise_multiplier,
                  "expected_batch_size": self.expected_batch_size}
        if self._seed_given:  # a seed drawn from entropy stays secret: never written
            config["seed"] = self.seed
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        if "model" not in config:
            raise ValueError("this DPModel config has no 'model' entry; it was not written by "
                             "DPModel.get_config. Save the model with DPModel.save('m.keras')")
        model = keras.saving.deserialize_keras_object(config.pop("model"),
                                                      custom_objects=custom_objects)
        return cls(model, **config)

    def compile_from_config(self, config):
        # Keras skips a custom compile when loading; this one only adds checks, so run it.
        self.compile(**keras.saving.deserialize_keras_object(config))
        self.optimizer.build(self.model.trainable_variables)  # so its saved state can load

    def _build_dp_gradients(self, canaries=None):
        self._dp_gradients = _dp_gradients_fn(
            self.model, self._per_example_loss, self.l2_norm_clip, self.noise_stddev(),
            self.expected_batch_size, tf.constant(self.seed, tf.int64), canaries)

    def _use_canaries(self, canaries):
        """Train with ``canaries`` (a :class:`_Canaries`), or without for None."""
        self._canaries_in = canaries is not None
        self._build_dp_gradients(canaries)
        self.make_train_function(force=True)

    def fit(self, *args, **kwargs):  # pylint: disable=signature-differs
        try:
            return super().fit(*args, **kwargs)
        finally:  # an audit interrupted by an error must not leave its canaries in training
            if getattr(self, "_canaries_in", False):
                self._use_canaries(None)

    def compile(self, optimizer="rmsprop", loss=None, **kwargs):  # pylint: disable=arguments-differ
        _check_training(self.model, loss, self.l2_norm_clip, self.noise_multiplier,
                        self.expected_batch_size, loss_name="loss")
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        self._per_example_loss = loss
        self._build_dp_gradients()

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        _check_batch(x, y, "DPModel.fit")
        if sample_weight is not None:
            raise ValueError("DPModel does not take sample_weight or class_weight: a weight "
                             "above 1 would let one example move the model by more than the "
                             "clip norm. Resample the data instead.")
        checks.check_no_clipping_over_replicas(
            self.optimizer, tf.distribute.get_replica_context().num_replicas_in_sync)
        self._dp_steps.assign_add(1)
        grads, losses, y_pred = self._dp_gradients(x, y, tf.identity(self._dp_steps.value))
        self.optimizer.apply(grads, self.model.trainable_variables)
        mean_loss = tf.math.divide_no_nan(tf.reduce_sum(losses),
                                          tf.cast(tf.size(losses), losses.dtype))
        for metric in self.metrics:  # metrics from the step's own forward pass, as Keras does
            if metric.name == "loss":  # batches vary in size: weight each by its examples
                metric.update_state(mean_loss, sample_weight=tf.cast(tf.size(losses), tf.float32))
        return self.compute_metrics(x, y, y_pred, None)


# ------------------------------------------------------------------------ epsilon during fit


def _check_target(target_epsilon):
    if target_epsilon is None:
        return None
    target_epsilon = check_real(target_epsilon, "target_epsilon")
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon!r} (or None to only "
                         "log epsilon)")
    return target_epsilon


def _check_dp_model(model, who):
    if not isinstance(model, DPModel):
        raise TypeError(f"{who} works with a gradtut.privacy.DPModel, got "
                        f"{type(model).__name__}: wrap your model, DPModel(model, l2_norm_clip, "
                        "noise_multiplier, expected_batch_size), and fit that")


def _check_rate_matches(sample_rate, num_examples, expected_batch_size, consequence):
    """Refuse a sample rate that is not ``expected_batch_size / num_examples`` (rounded)."""
    if num_examples is not None and round(sample_rate * num_examples) != expected_batch_size:
        raise ValueError(
            f"sample_rate {sample_rate:g} does not match the model: its expected_batch_size "
            f"{expected_batch_size} over {num_examples} examples is "
            f"{expected_batch_size / num_examples:g}. {consequence}: pass sample_rate = "
            "expected_batch_size / num_examples")


def _last_step_within(epsilon_at, target, limit=2**40):
    """The largest step count whose epsilon is at most ``target`` (epsilon grows with the
    step count); ``limit`` where even that many steps stay within it."""
    if epsilon_at(1) > target:
        return 0
    low, high = 1, 2
    while high < limit and epsilon_at(high) <= target:
        low, high = high, 2 * high
    if high >= limit:
        return limit
    while high - low > 1:  # epsilon_at(low) <= target < epsilon_at(high)
        middle = (low + high) // 2
        low, high = (middle, high) if epsilon_at(middle) <= target else (low, middle)
    return low


class PrivacyBudget(keras.callbacks.Callback):
    """Logs the epsilon spent so far after every epoch of ``DPModel.fit``, and with
    ``target_epsilon`` stops training before the step that would exceed it.

    Epsilon is :func:`epsilon` at the model's own DP step counter (all steps it has taken, over
    every ``fit`` call and across saving), its ``noise_multiplier``, this ``sample_rate`` and
    ``delta``. It appears as ``logs["epsilon"]`` and in ``history.history["epsilon"]``, and as
    ``budget.epsilon``. With a target, training stops after the last step whose epsilon is at
    most the target, so the last logged epsilon never exceeds it; a model that has already
    spent the budget is refused before it takes a step.

    Args:
      sample_rate: q in (0, 1], the Poisson sampling rate of the batches fed to ``fit``.
      delta: in (0, 1).
      target_epsilon: None (only log), or a number > 0.
      accountant: ``"rdp"`` or ``"pld"``, as :func:`epsilon`.
      num_examples: the size of the private data set, if you want ``sample_rate`` checked:
        ``sample_rate * num_examples`` must round to the model's ``expected_batch_size``.

    Raises:
      ValueError: an argument out of range (as :func:`epsilon`; ``target_epsilon`` <= 0), a
        ``sample_rate`` that does not match ``expected_batch_size / num_examples``, or a
        budget already spent when ``fit`` starts.
      TypeError: ``fit`` of a model that is not a :class:`DPModel`.

    Example:
      >>> budget = PrivacyBudget(sample_rate=64 / 1500, delta=1e-5, target_epsilon=3.0)
      >>> history = dp.fit(batches, callbacks=[budget])  # doctest: +SKIP
      >>> history.history["epsilon"]  # one per epoch  # doctest: +SKIP
    """

    def __init__(self, sample_rate, delta, target_epsilon=None, accountant="rdp", *,
                 num_examples=None):
        super().__init__()
        self.sample_rate, _, self.delta = _check_accounting(sample_rate, 1, delta, accountant)
        self.accountant = accountant
        self.target_epsilon = _check_target(target_epsilon)
        self.num_examples = None if num_examples is None else check_int(num_examples,
                                                                         "num_examples")
        self.epsilon = None
        self.last_step = None

    def steps(self):
        """The DP steps the model has taken (its counter, saved with it)."""
        return self.model.dp_steps

    def epsilon_at(self, steps):
        """Epsilon after ``steps`` steps of this model's noise at this sample rate (0 for 0)."""
        if steps == 0:
            return 0.0
        return epsilon(self.model.noise_multiplier, self.sample_rate, steps, self.delta,
                       self.accountant)

    def on_train_begin(self, logs=None):
        _check_dp_model(self.model, "PrivacyBudget")
        batch = self.model.expected_batch_size
        _check_rate_matches(self.sample_rate, self.num_examples, batch, "Epsilon would be "
                            "computed for batches the model does not take")
        self.last_step = None
        if self.target_epsilon is not None and not self.model.noise_multiplier > 0:
            raise ValueError("noise_multiplier 0 gives epsilon = inf: no step fits a "
                             "target_epsilon. Train with noise, or drop the target")
        if self.target_epsilon is not None:
            self.last_step = _last_step_within(self.epsilon_at, self.target_epsilon)
            done, per_call = self.steps(), self._steps_per_call()
            if done >= self.last_step:
                raise ValueError(
                    f"the privacy budget is spent: after {done} steps one more would give "
                    f"epsilon {self.epsilon_at(done + 1):.4g} > target_epsilon "
                    f"{self.target_epsilon:g}. Stop training, or set a larger target (the "
                    "guarantee then is the larger epsilon)")
            if done + per_call > self.last_step:  # Keras cannot stop inside one execution
                raise ValueError(
                    f"only {self.last_step - done} steps are left in the budget, but the model "
                    f"runs {per_call} per call (steps_per_execution): compile it with "
                    f"steps_per_execution <= {self.last_step - done}")

    def _steps_per_call(self):
        return int(getattr(self.model, "steps_per_execution", 1) or 1)

    def on_train_batch_end(self, batch, logs=None):
        if self.last_step is not None and self.steps() + self._steps_per_call() > self.last_step:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        self.epsilon = self.epsilon_at(self.steps())
        if logs is not None:
            logs["epsilon"] = self.epsilon


# --------------------------------------------------------------------- a one-run privacy audit

MIN_CANARIES = 100  # below this no guess count gives a bound worth reporting


def _binomial_tail_and_window(guesses, correct, p):
    """``P[Bin(r, p) >= v]`` and ``max_{i=1..v} P[v - i <= Bin(r, p) < v] / i``."""
    tail = float(scipy.stats.binom.sf(correct - 1, guesses, p))
    if correct == 0:
        return tail, 0.0
    below = scipy.stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, p)  # v-1, ..., 0
    window = float(np.max(np.cumsum(below) / np.arange(1, correct + 1)))
    return tail, window


def audit_p_value(epsilon_value, guesses, correct, canaries, delta=0.0):
    """The probability that an (epsilon, delta)-DP training run lets an auditor make at least
    ``correct`` right guesses out of ``guesses``, when each of ``canaries`` canaries was
    included independently with probability 1/2 (Steinke, Nasr and Jagielski 2023, "Privacy
    Auditing with One (1) Training Run", Theorem 5.2):

    ``P[Bin(r, p) >= v] + 2 m delta max_{i=1..v} P[v - i <= Bin(r, p) < v] / i``,
    with ``p = e^eps / (1 + e^eps)``, capped at 1.

    Raises:
      ValueError: ``epsilon_value`` not a number >= 0, and as :func:`epsilon_lower_bound`.

    Example:
      >>> round(audit_p_value(1.0, guesses=100, correct=80, canaries=1000), 3)
      0.072
    """
    epsilon_value = check_real(epsilon_value, "epsilon_value")
    if not epsilon_value >= 0:
        raise ValueError(f"epsilon_value must be >= 0, got {epsilon_value!r}")
    guesses, correct, canaries, delta, _ = _check_audit_counts(guesses, correct, canaries,
                                                               delta, 0.5)
    return _p_value(epsilon_value, guesses, correct, canaries, delta)


def _p_value(epsilon_value, guesses, correct, canaries, delta):
    p = 1.0 / (1.0 + math.exp(-epsilon_value))
    tail, window = _binomial_tail_and_window(guesses, correct, p)
    return min(1.0, tail + 2 * canaries * delta * window)


def _check_audit_counts(guesses, correct, canaries, delta, confidence):
    canaries = check_int(canaries, "canaries")
    guesses = check_int(guesses, "guesses", minimum=0)
    correct = check_int(correct, "correct", minimum=0)
    if not correct <= guesses <= canaries:
        raise ValueError(f"need correct <= guesses <= canaries, got {correct}, {guesses}, "
                         f"{canaries}: the auditor guesses at most once per canary")
    delta = check_real(delta, "delta")
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta!r}: the delta of the guarantee "
                         "you are testing, e.g. 1e-5")
    confidence = check_real(confidence, "confidence")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}, e.g. 0.95")
    return guesses, correct, canaries, delta, confidence


def epsilon_lower_bound(guesses, correct, canaries, delta=0.0, confidence=0.95):
    """The epsilon a one-run audit proves: with probability ``confidence``, a training run that
    lets an auditor get ``correct`` of ``guesses`` in/out guesses right about ``canaries``
    canaries (each included with probability 1/2) is **not** (epsilon, delta)-DP for any
    epsilon below this. 0 when the guesses prove nothing.

    It is the largest epsilon whose :func:`audit_p_value` is below ``1 - confidence``. With
    every guess right and ``delta = 0`` it is ``logit((1 - confidence) ** (1 / guesses))``,
    about ``log(guesses / 3)`` at 95%: a one-run audit cannot prove more than that, however
    broken the run.

    Args:
      guesses: r, the canaries the auditor guessed on (the rest it abstained on).
      correct: v, the right guesses.
      canaries: m, the canaries inserted.
      delta: the delta of the guarantee being tested.
      confidence: in (0, 1).

    Returns:
      float epsilon >= 0.

    Raises:
      ValueError: counts that are not ints with ``correct <= guesses <= canaries``, delta
        outside [0, 1), confidence outside (0, 1).

    Example:
      >>> round(epsilon_lower_bound(100, 100, 1000), 2)  # every guess right
      3.49
      >>> epsilon_lower_bound(100, 50, 1000)  # a coin toss proves nothing
      0.0
    """
    guesses, correct, canaries, delta, confidence = _check_audit_counts(
        guesses, correct, canaries, delta, confidence)
    beta = 1.0 - confidence
    if guesses == 0 or _p_value(0.0, guesses, correct, canaries, delta) >= beta:
        return 0.0
    # Bisection assumes the p-value grows with epsilon. The binomial tail does; with delta > 0
    # the second term can shrink a little as epsilon grows, which at 2 m delta ~ 0.02 moves
    # the bound negligibly (the paper's own code searches the same way).
    low, high = 0.0, 1.0  # p_value(low) < beta <= p_value(high)
    while _p_value(high, guesses, correct, canaries, delta) < beta:
        low, high = high, 2 * high
    for _ in range(60):
        middle = (low + high) / 2
        low, high = ((middle, high) if _p_value(middle, guesses, correct, canaries, delta)
                     < beta else (low, middle))
    return low


class _AuditResult(collections.namedtuple(
        "AuditResult", "epsilon canaries guesses correct delta confidence")):
    """What a one-run audit found: ``epsilon``, the lower bound, from ``correct`` right of
    ``guesses`` guesses on ``canaries`` canaries, at ``delta`` and ``confidence``."""

    def __str__(self):
        return (f"audited epsilon >= {self.epsilon:.2f} ({self.correct} of {self.guesses} "
                f"guesses right on {self.canaries} canaries; {self.confidence:.0%} confidence, "
                f"delta = {self.delta:g})")


def _check_canaries_and_guesses(canaries, guesses):
    """``(canaries, guesses)`` checked: at least ``MIN_CANARIES`` canaries, and a guess count
    (None: chosen later) between 2 and the canaries."""
    canaries = check_int(canaries, "canaries")
    if canaries < MIN_CANARIES:
        raise ValueError(f"{canaries} canaries are too few for a bound worth reporting: use at "
                         f"least {MIN_CANARIES} (about 1,000 is common)")
    if guesses is not None and not 2 <= check_int(guesses, "guesses") <= canaries:
        raise ValueError(f"guesses must be between 2 and the {canaries} canaries, got {guesses}")
    return canaries, guesses


def audit_from_scores(scores, included, delta, confidence=0.95, guesses=None):
    """Guess in/out from canary scores and bound epsilon: guess "in" for the ``guesses // 2``
    highest scores and "out" for the ``guesses - guesses // 2`` lowest, abstain on the rest,
    count the right guesses, and return :func:`epsilon_lower_bound`.

    Fix ``guesses`` before looking at the outcome: choosing it after seeing which guesses were
    right would void the confidence.

    Args:
      scores: ``[m]`` floats, higher meaning "more likely included".
      included: ``[m]`` bools, the truth (each drawn with probability 1/2).
      delta, confidence: as :func:`epsilon_lower_bound`.
      guesses: how many canaries to guess on; None guesses on a fifth of them.

    Returns:
      a named tuple ``(epsilon, canaries, guesses, correct, delta, confidence)``.

    Raises:
      ValueError: scores and included of different lengths or not 1-D, fewer than
        ``MIN_CANARIES`` canaries, non-finite scores, ``guesses`` outside [2, m], and as
        :func:`epsilon_lower_bound`.

    Example:
      >>> rng = np.random.default_rng(0)
      >>> included = rng.random(1000) < 0.5
      >>> str(audit_from_scores(included + rng.normal(size=1000), included,
      ...                       delta=1e-5))  # doctest: +NORMALIZE_WHITESPACE
      'audited epsilon >= 1.62 (176 of 200 guesses right on 1000 canaries; 95% confidence,
      delta = 1e-05)'
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included)
    if scores.ndim != 1 or included.shape != scores.shape:
        raise ValueError(f"scores and included must be 1-D and of the same length, got shapes "
                         f"{scores.shape} and {included.shape}: one score per canary")
    canaries, guesses = _check_canaries_and_guesses(len(scores), guesses)
    if not np.all(np.isfinite(scores)):
        raise ValueError("some canary scores are not finite (NaN or inf): the training run "
                         "diverged, or the scores were computed wrongly")
    guesses = max(2, canaries // 5) if guesses is None else guesses
    order = np.argsort(scores, kind="stable")
    out, inside = order[:guesses - guesses // 2], order[canaries - guesses // 2:]
    correct = int(np.sum(included[inside]) + np.sum(~included[out].astype(bool)))
    bound = epsilon_lower_bound(guesses, correct, canaries, delta, confidence)
    return _AuditResult(bound, canaries, guesses, correct, delta, confidence)


class _Canaries:
    """``count`` Dirac canaries over ``variables``: canary i is the gradient ``C e_k`` on one
    parameter k of its own (no two share one). Each is included with probability 1/2; an
    included canary joins a step's clipped sum with probability ``sample_rate``, like an
    example under Poisson sampling. ``observe`` scores every canary on the step's noisy sum with
    the log-likelihood ratio of "sampled at rate q" against "absent" for Gaussian noise of the
    *claimed* std ``sigma * C``: ``log(1 - q + q exp(mu x - mu^2 / 2))``, ``x`` the noisy
    coordinate over ``sigma * C`` and ``mu = 1 / sigma``."""

    def __init__(self, variables, count, sample_rate, clip, noise_multiplier, seed):
        rng = np.random.default_rng(seed)
        sizes = [int(np.prod(v.shape)) for v in variables]
        coordinates = np.sort(rng.choice(sum(sizes), size=count, replace=False))
        self.included = rng.random(count) < 0.5
        self.seed = tf.constant(rng.integers(2**31), tf.int64)
        ends = np.cumsum(sizes)
        owner = np.searchsorted(ends, coordinates, side="right")
        self.parts = []  # per variable: (which canaries, their flat index in it)
        for j, end in enumerate(ends):
            mine = np.nonzero(owner == j)[0]
            self.parts.append((tf.constant(mine[:, None], tf.int32),
                               tf.constant((coordinates[mine] - (end - sizes[j]))[:, None],
                                           tf.int64)))
        self.count, self.rate, self.clip = count, sample_rate, clip
        self.mu = 1.0 / noise_multiplier
        self.scores = tf.Variable(tf.zeros([count], tf.float32), trainable=False)

    def add(self, sums, step):
        draw = tf.random.stateless_uniform([self.count], tf.stack([self.seed, step]))
        sampled = tf.logical_and(draw < self.rate, tf.constant(self.included))
        out = []
        for s, (which, where) in zip(sums, self.parts, strict=True):
            values = tf.gather_nd(tf.cast(sampled, s.dtype), which) * self.clip
            flat = tf.tensor_scatter_nd_add(tf.reshape(s, [-1]), where, values)
            out.append(tf.reshape(flat, tf.shape(s)))
        return out

    def observe(self, noisy, data):
        """Score on ``noisy - data`` at each canary's parameter: what the step released, less
        the clipped sum of the real examples. DP assumes an adversary who knows every other
        example, so an auditor may subtract their part; without it, the data's own gradient
        on a canary's parameter would drown the canary."""
        x = tf.zeros([self.count], tf.float32)
        for s, d, (which, where) in zip(noisy, data, self.parts, strict=True):
            values = (tf.gather_nd(tf.reshape(s, [-1]), where)
                      - tf.gather_nd(tf.reshape(d, [-1]), where))
            x += tf.scatter_nd(which, tf.cast(values, tf.float32), [self.count])
        z = self.mu * (x * self.mu / self.clip) - self.mu**2 / 2  # x * mu / C = x / (sigma C)
        absent = tf.fill([self.count], float(np.log1p(-self.rate)) if self.rate < 1 else -np.inf)
        self.scores.assign_add(tf.reduce_logsumexp(
            tf.stack([absent, float(np.log(self.rate)) + z]), axis=0))


class CanaryAudit(keras.callbacks.Callback):
    """A one-run privacy audit of ``DPModel.fit`` (Steinke, Nasr and Jagielski 2023): insert
    ``canaries`` canary gradients, each included with probability 1/2, score them on every
    step's noisy gradient, and after training bound epsilon from below.

    White-box: the auditor sees every noisy step, as the accountant's guarantee allows. Canary i
    is a gradient of norm ``l2_norm_clip`` on one parameter of its own; an included canary
    joins each step's clipped sum with probability ``sample_rate``, exactly as an example does
    under Poisson sampling, so a correct DP-SGD run is (epsilon, delta)-DP for each canary with
    the accountant's epsilon, and the audited bound stays at or below it with probability
    ``confidence``. A bound **above** the accountant's epsilon means the run is not as private
    as claimed (noise missing or too small). The reverse does not hold: one-run audits are
    loose, and a bound far below epsilon is normal.

    The canaries move the model (each adds up to ``l2_norm_clip / expected_batch_size`` per
    step to its parameter's gradient, so the parameter moves by the learning rate times that
    with SGD): audit a run made for auditing, not the model you ship. One ``fit``
    is one audited run; the result is in ``audit.result`` (a named tuple
    ``(epsilon, canaries, guesses, correct, delta, confidence)``) after it.

    Args:
      canaries: how many (at least ``MIN_CANARIES``; at most the number of trainable
        parameters and the number of examples, ``expected_batch_size / sample_rate``).
      sample_rate: the Poisson sampling rate of the batches fed to ``fit``.
      delta: the delta of the guarantee being tested.
      confidence: in (0, 1).
      guesses: as :func:`audit_from_scores`.
      seed: int for repeatable canaries; None draws fresh ones.
      num_examples: the size of the private data set, if you want ``sample_rate`` checked
        against the model's ``expected_batch_size`` (as :class:`PrivacyBudget`); without it
        the data set's size is taken to be ``expected_batch_size / sample_rate``.

    Raises:
      ValueError: bad arguments, ``noise_multiplier`` 0 (it claims no privacy: nothing to
        audit), more canaries than parameters or examples, or more than one replica.
      TypeError: ``fit`` of a model that is not a :class:`DPModel`.

    Example:
      >>> audit = CanaryAudit(1000, sample_rate=64 / 1500, delta=1e-5, seed=0)
      >>> dp.fit(batches, callbacks=[audit])  # doctest: +SKIP
      >>> print(audit.result)  # doctest: +SKIP
    """

    def __init__(self, canaries, sample_rate, delta, confidence=0.95, guesses=None, seed=None,
                 *, num_examples=None):
        super().__init__()
        self.num_examples = None if num_examples is None else check_int(num_examples,
                                                                         "num_examples")
        self.canaries, self.guesses = _check_canaries_and_guesses(canaries, guesses)
        self.sample_rate = _check_sample_rate(sample_rate)
        _check_audit_counts(0, 0, self.canaries, delta, confidence)
        self.delta, self.confidence = float(delta), float(confidence)
        self.seed = check_seed(seed)
        self.result = None
        self._state = None

    def _check(self, model):
        _check_dp_model(model, "CanaryAudit")
        if not model.noise_multiplier > 0:
            raise ValueError("noise_multiplier is 0: the model claims no privacy (epsilon is "
                             "infinite), so there is nothing to audit")
        if tf.distribute.get_strategy().num_replicas_in_sync > 1:
            raise ValueError("CanaryAudit runs on one replica: fit the audit run outside a "
                             "distribution strategy's scope")
        _check_rate_matches(self.sample_rate, self.num_examples, model.expected_batch_size,
                            "The canaries would be sampled at another rate than the examples, "
                            "and the bound would not test the claimed epsilon")
        parameters = sum(int(np.prod(v.shape)) for v in model.model.trainable_variables)
        examples = self.num_examples or round(model.expected_batch_size / self.sample_rate)
        for limit, what in ((parameters, "trainable parameters"), (examples, "examples "
                            "(expected_batch_size / sample_rate)")):
            if self.canaries > limit:
                raise ValueError(f"{self.canaries} canaries but only {limit} {what}: use at "
                                 f"most {limit} canaries")

    def on_train_begin(self, logs=None):
        model = self.model
        self._check(model)
        self._state = _Canaries(model.model.trainable_variables, self.canaries,
                                self.sample_rate, model.l2_norm_clip, model.noise_multiplier,
                                self.seed)
        model._use_canaries(self._state)  # pylint: disable=protected-access
        self.result = None

    def on_train_end(self, logs=None):
        state = self._state
        self.result = audit_from_scores(state.scores.numpy(), state.included, self.delta,
                                        self.confidence, self.guesses)
        self.model._use_canaries(None)  # pylint: disable=protected-access
        self._state = None
