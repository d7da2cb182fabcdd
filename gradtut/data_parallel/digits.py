"""The digits task that sections 9 and 10 of notebook 03 train: scikit-learn's bundled 8x8
digits, a 64-32-10 MLP, and its loss."""
import keras


def _digits(split_at=1500):
    """scikit-learn's bundled 8x8 digits, scaled to [0, 1]: the first ``split_at`` for
    training, the rest held out."""
    from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype("float32"), y.astype("int32")
    return (x[:split_at], y[:split_at]), (x[split_at:], y[split_at:])


def _digits_mlp(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(10)])


_DIGITS_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
