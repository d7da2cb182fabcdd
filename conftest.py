"""Start TensorFlow the way the notebooks do, before any test or docstring example imports it:
four virtual CPUs (the data- and model-parallel examples need several devices). The package's
docstring examples run as tests too (``--doctest-modules`` in pyproject.toml)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))

import gradtut  # noqa: E402
from model_zoo import TEST_VIRTUAL_CPUS  # noqa: E402

gradtut.setup(seed=0, virtual_cpus=TEST_VIRTUAL_CPUS)
