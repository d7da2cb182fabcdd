"""Start TensorFlow the way the notebooks do, before any test module imports it."""
import gradtut
from model_zoo import TEST_VIRTUAL_CPUS

gradtut.setup(seed=0, virtual_cpus=TEST_VIRTUAL_CPUS)
