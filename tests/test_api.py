"""The package's public surface: every public function and class has a bad-input test, and the
layout holds (one timing module, one plotting module, one subprocess runner)."""
import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import gradtut

TESTS = Path(__file__).resolve().parent


# Classes that hold results rather than take input (so there is no bad input to give them):
RESULT_TYPES = {"Timing", "CapturedText", "VectorizationReport", "Plan"}


def public_names():
    """``{(module, name)}`` for every public function that takes arguments and every public
    class (exceptions and result records aside) defined in a gradtut module."""
    names = set()
    for info in pkgutil.walk_packages(gradtut.__path__, "gradtut."):
        if info.name == "gradtut.__main__":
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != info.name:
                continue
            if inspect.isfunction(obj) and inspect.signature(obj).parameters:
                names.add((info.name, name))
            elif (inspect.isclass(obj) and not issubclass(obj, BaseException)
                  and name not in RESULT_TYPES):
                names.add((info.name, name))
    return names


def _referenced(node):
    """Names a piece of code calls or refers to (``f``, ``m.f``)."""
    found = set()
    for inner in ast.walk(node):
        if isinstance(inner, ast.Name):
            found.add(inner.id)
        elif isinstance(inner, ast.Attribute):
            found.add(inner.attr)
    return found


def _is_raises(item):
    return (isinstance(item.context_expr, ast.Call)
            and ast.unparse(item.context_expr.func) == "pytest.raises")


def names_called_in_raises_blocks():
    """Every name referred to inside a ``with pytest.raises(...)`` block of a test file, or in
    the ``parametrize`` decorators of a test that has such a block (cases given as lambdas or
    functions)."""
    called = set()
    for path in TESTS.glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.With) and any(_is_raises(i) for i in node.items):
                for statement in node.body:
                    called |= _referenced(statement)
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(n, ast.With) and any(_is_raises(i) for i in n.items)
                    for n in ast.walk(node)):
                for decorator in node.decorator_list:
                    called |= _referenced(decorator)
    return called


def test_every_public_function_and_class_has_a_bad_input_test():
    called = names_called_in_raises_blocks()
    missing = sorted(f"{module}.{name}" for module, name in public_names() if name not in called)
    assert not missing, ("no test calls these inside `with pytest.raises(...)`; add a "
                         f"bad-input test for each: {missing}")


def test_this_check_can_fail():
    assert ("gradtut.session", "setup") in public_names()
    assert "a_function_nobody_tests" not in names_called_in_raises_blocks()


@pytest.mark.parametrize("old", ["gradtut.benchmark", "gradtut.bench_per_example",
                                 "gradtut.bench_vectorize", "gradtut.notebook_format"])
def test_the_old_module_names_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


# Shared modules serve every notebook; topics are ordered by the notebook that teaches them.
SHARED = {"session", "checks", "measure", "plots", "models", "cluster", "layer_rules"}
TOPIC_NOTEBOOK = {"per_example": 1, "privacy": 1, "vectorize": 2, "data_parallel": 3,
                  "model_parallel": 4, "efficiency": 5}
PACKAGE = Path(gradtut.__file__).resolve().parent


def gradtut_imports(path, package=("gradtut",)):
    """The top-level gradtut modules a file imports (``gradtut.data_parallel`` -> ``data_parallel``;
    the bare ``import gradtut``, the package root, counts as ``""``). ``package`` is the dotted
    package the file is in, for relative imports (``from ..bench import x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[:len(package) - node.level + 1])
            parts = base + (node.module.split(".") if node.module else [])
            found |= ({parts[1]} if len(parts) > 1 else {alias.name for alias in node.names})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gradtut":
            parts = node.module.split(".")
            if len(parts) > 1:
                found.add(parts[1])
            else:
                found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "gradtut":
                    found.add(parts[1] if len(parts) > 1 else "")
    return found


def upward_imports(package=PACKAGE):
    """``[(file, imported module)]`` for every import that runs against the layering: anything
    but the command line importing ``bench``, a shared module importing a topic, or a topic
    importing the topic of a later notebook."""
    wrong = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        own = parts[0]
        if own in ("__init__", "__main__", "bench"):
            continue
        for imported in gradtut_imports(path, ("gradtut", *parts[:-1])) - {own, ""}:
            if imported == "bench":
                wrong.append((str(path.relative_to(package)), imported))
            elif own in SHARED and imported in TOPIC_NOTEBOOK:
                wrong.append((str(path.relative_to(package)), imported))
            elif (own in TOPIC_NOTEBOOK and imported in TOPIC_NOTEBOOK
                  and TOPIC_NOTEBOOK[imported] > TOPIC_NOTEBOOK[own]):
                wrong.append((str(path.relative_to(package)), imported))
    return wrong


def test_no_module_imports_one_above_it():
    names = {p.relative_to(PACKAGE).with_suffix("").parts[0] for p in PACKAGE.rglob("*.py")}
    assert names - {"__init__", "__main__", "bench"} == SHARED | set(TOPIC_NOTEBOOK), (
        "a module is neither shared nor a topic: add it to SHARED or TOPIC_NOTEBOOK")
    assert upward_imports() == []


def test_the_layering_check_can_fail(tmp_path):
    (tmp_path / "models.py").write_text("from gradtut.bench.per_example import benchmark_dp_step\n"
                                        "import gradtut.efficiency\n")
    (tmp_path / "vectorize.py").write_text("from gradtut import data_parallel, checks\n")
    (tmp_path / "layer_rules").mkdir()
    (tmp_path / "layer_rules" / "dense.py").write_text("from ..bench import per_example\n"
                                                      "from . import common\n")
    assert sorted(upward_imports(tmp_path)) == [
        ("layer_rules/dense.py", "bench"), ("models.py", "bench"), ("models.py", "efficiency"),
        ("vectorize.py", "data_parallel")]
