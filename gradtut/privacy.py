"""DP-SGD a practitioner can ship: privacy accounting, Poisson batches, a training step and a
Keras model whose ``fit`` trains privately (notebook 01, section 9).

The guarantee is that of Abadi et al. (2016): each step samples every example independently
with probability ``sample_rate`` (Poisson sampling), clips each example's gradient to norm
``l2_norm_clip``, adds Gaussian noise of standard deviation ``noise_multiplier * l2_norm_clip``
to the sum, once, and divides by the *expected* batch size. :func:`epsilon` turns
``(noise_multiplier, sample_rate, steps, delta)`` into the epsilon of that guarantee, with
Google's ``dp_accounting`` library (the accountant TensorFlow Privacy and jax_privacy use).

Clipping uses :func:`gradtut.per_example.make_clipped_sum`: ghost norms and one reweighted sum
per layer, so layers with a rule never materialise per-example gradients.

Example:
  >>> sigma = noise_multiplier_for_epsilon(3.0, sample_rate=64 / 1500, steps=500, delta=1e-5)
  >>> round(sigma, 2)
  1.66
  >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
  >>> dp = DPModel(model, l2_norm_clip=1.0, noise_multiplier=sigma, expected_batch_size=64)
  >>> dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
  ...     from_logits=True, reduction=None))
"""
import contextlib
import functools
import logging
import math

import dp_accounting
import keras
import numpy as np
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
    generator with a fixed seed does exactly that; chain E passes with seeds ``seed + e``
    into one epoch instead, as notebook 01 does).

    Args:
      x, y: arrays with the same first dimension N.
      sample_rate: q in (0, 1].
      seed: int, for a repeatable sequence of batches; None draws fresh ones.

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
    if model.losses:
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


def _dp_gradients_fn(model, loss_fn, l2_norm_clip, noise_multiplier, expected_batch_size, seed):
    """``f(x, y, step) -> (gradients, per-example losses, predictions)`` for the calling
    replica (or the only one): the clipped sum plus this replica's share of the noise, over
    ``expected_batch_size``. The noise is drawn from ``(seed, step)``, identically on every
    replica, and each replica adds ``1/R`` of it; the optimizer's sum over replicas then holds
    the noise exactly once."""
    clipped_sum = per_example.make_clipped_sum(model, loss_fn, training=True, with_outputs=True)
    std = noise_multiplier * l2_norm_clip

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
        grads = []
        for i, s in enumerate(sums):
            if std:
                seed_i = tf.random.experimental.stateless_fold_in(tf.stack([seed, step]), i)
                s = s + tf.random.stateless_normal(tf.shape(s), seed=seed_i,
                                                   stddev=std / replicas, dtype=s.dtype)
            grads.append(s / tf.cast(expected_batch_size, s.dtype))
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
        not a positive int, a bad ``seed``, a loss given by name); BatchNormalization in the
        model; a reducing loss; and as :func:`gradtut.per_example.clipped_gradient` for layers
        the engine refuses. ``step(x, y)`` refuses ``x`` or ``y`` None.
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
    seed = _seed(seed)
    with strategy.scope():
        counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                              aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    gradients = _dp_gradients_fn(model, loss_fn, l2_norm_clip, noise_multiplier,
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


class DPModel(keras.Model):
    """A ``keras.Model`` whose ``fit`` trains ``model`` with DP-SGD.

    ``compile(optimizer, loss=...)`` with a per-example loss (``reduction=None``), then ``fit``,
    callbacks and ``evaluate`` as usual. Each ``train_step`` clips, sums, adds the noise once
    and divides by ``expected_batch_size``, as :func:`make_dp_train_step`; under
    ``MirroredStrategy.scope()`` the noise is still added once. Feed it Poisson batches
    (:func:`poisson_batches`, e.g. through ``tf.data.Dataset.from_generator``, a new seed per
    pass) for the guarantee that :func:`epsilon` computes. ``seed`` as in
    :func:`make_dp_train_step`: None for models you publish. The loss and metrics that
    ``fit`` reports are computed on the private batches and are not covered by epsilon.
    ``sample_weight``, ``class_weight`` and regularisation losses are refused.

    Raises:
      TypeError: ``model`` is not a Keras model.
      ValueError: ``l2_norm_clip``, ``noise_multiplier``, ``expected_batch_size`` or ``seed``
        as :func:`make_dp_train_step`; ``compile`` checks the loss and the model as it does,
        and ``fit`` refuses data without targets and ``sample_weight``.

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
        self._dp_gradients = None
        # The noise of step t is drawn from (seed, t). The counter is a weight of this model:
        # created once (compiling again does not restart it, which would replay the noise),
        # saved and restored with the weights, and, created under a strategy's scope, one
        # value shared by all replicas.
        self._dp_steps = self.add_weight(shape=(), dtype="int64", initializer="zeros",
                                         trainable=False, aggregation="only_first_replica",
                                         name="dp_steps")

    def call(self, inputs, training=False):
        return self.model(inputs, training=training)

    def compile(self, optimizer="rmsprop", loss=None, **kwargs):  # pylint: disable=arguments-differ
        _check_training(self.model, loss, self.l2_norm_clip, self.noise_multiplier,
                        self.expected_batch_size, loss_name="loss")
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        self._per_example_loss = loss
        self._dp_gradients = _dp_gradients_fn(
            self.model, loss, self.l2_norm_clip, self.noise_multiplier,
            self.expected_batch_size, tf.constant(self.seed, tf.int64))

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        _check_batch(x, y, "DPModel.fit")
        if sample_weight is not None:
            raise ValueError("DPModel does not take sample_weight or class_weight: a weight "
                             "above 1 would let one example move the model by more than the "
                             "clip norm. Resample the data instead.")
        self._dp_steps.assign_add(1)
        grads, losses, y_pred = self._dp_gradients(x, y, tf.identity(self._dp_steps.value))
        self.optimizer.apply(grads, self.model.trainable_variables)
        mean_loss = tf.math.divide_no_nan(tf.reduce_sum(losses),
                                          tf.cast(tf.size(losses), losses.dtype))
        for metric in self.metrics:  # metrics from the step's own forward pass, as Keras does
            if metric.name == "loss":  # batches vary in size: weight each by its examples
                metric.update_state(mean_loss, sample_weight=tf.cast(tf.size(losses), tf.float32))
        return self.compute_metrics(x, y, y_pred, None)
