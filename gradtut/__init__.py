"""gradtut: tested reference implementations behind the gradtut notebooks.

Importing the package does not import TensorFlow, so the first notebook cell can run
``gradtut.setup(...)`` before TensorFlow starts. Import the topic modules after that:

    import gradtut
    gradtut.setup(seed=0)
    from gradtut.per_example import per_example_gradients
"""
from gradtut.session import RestartKernelError, captured_stderr, setup

__all__ = ["setup", "captured_stderr", "RestartKernelError"]
__version__ = "0.1.0"
