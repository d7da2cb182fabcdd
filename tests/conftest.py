"""Start TensorFlow the way the notebooks do, before any test module imports it."""
import gradtut

gradtut.setup(seed=0)
