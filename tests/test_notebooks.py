"""Every stored notebook is canonical, fully executed in order, clean, and honest about timing."""
import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_notebook_format():
    """``.ci/notebook_format.py``: repository tooling, imported from its path (not a package)."""
    spec = importlib.util.spec_from_file_location("notebook_format",
                                                  ROOT / ".ci" / "notebook_format.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


canonical = _load_notebook_format().canonical
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# Calls whose output varies from run to run: such cells must be marked, and only such cells.
# What marks a measurement: timers, allocator statistics, measured pipeline timelines, and
# asynchronous parameter-server training (its batches and updates interleave differently).
TIMING = re.compile(r"\b(\w*_timings|time_callable|\w*benchmark\w*|peak_memory\w*|"
                    r"run_in_subprocess|perf_counter|reset_memory_stats|makespan|"
                    r"bubble_fraction|stage_times|"
                    r"train_with_parameter_servers)\(|\bmedian_\w*ms\b|\.ratio\b")
IGNORE = "# NBVAL_IGNORE_OUTPUT"
MACHINE = "# output depends on the CPU"
LOG_NOISE = re.compile(r"^[IWEF]0000 |oneDNN custom operations|cpu_feature_guard|INFO:tensorflow|"
                       r"WARNING:tensorflow|ms/step|absl::InitializeLog", re.M)


def code_cells(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def source(cell):
    return "".join(cell["source"])


def text_of(output):
    data = output.get("text", output.get("data", {}).get("text/plain", ""))
    return "".join(data)


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:1] == ["01_per_example_gradients.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_json_is_canonical(path):
    text = path.read_text(encoding="utf-8")
    assert text == canonical(json.loads(text)), \
        f"run: python .ci/notebook_format.py {path.relative_to(ROOT)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_executed_once_top_to_bottom(path):
    cells = code_cells(path)
    assert [c["execution_count"] for c in cells] == list(range(1, len(cells) + 1))
    assert sum(bool(c["outputs"]) for c in cells) >= len(cells) // 2, "most cells show something"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_errors_stderr_or_log_noise(path):
    for i, cell in enumerate(code_cells(path), 1):
        for out in cell["outputs"]:
            where = f"code cell {i}"
            if out["output_type"] == "error":
                assert "NBVAL_RAISES_EXCEPTION" in source(cell), f"{where} stores an error"
            assert not (out["output_type"] == "stream" and out["name"] == "stderr"), \
                f"{where} writes to stderr: {text_of(out)[:200]!r}"
            assert not LOG_NOISE.search(text_of(out)), f"{where} has log noise"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_timing_cells_and_only_they_ignore_output(path):
    cells = code_cells(path)
    for i, cell in enumerate(cells, 1):
        # A cell may also differ between machines, never between runs on one: it says so.
        timed = bool(TIMING.search(source(cell))) or MACHINE in source(cell)
        ignored = IGNORE in source(cell)
        assert timed == ignored, (f"code cell {i}: " + (
            f"times something but lacks {IGNORE}" if timed else
            f"has {IGNORE} but times nothing: print stable values instead"))
    assert sum(IGNORE in source(c) for c in cells) <= 0.4 * len(cells)


# What a reader would try to open: a name with a file extension, a relative path (./, ../),
# or a path under a directory such as notebooks/ or seeds/. URLs are removed first; prose like
# "1/B" or "inf/nan" is not a path.
PATH_LIKE = re.compile(
    r"(?<![\w/.:#-])((?:\.\.?/)*\w[\w.-]*(?:/[\w.-]+)*/?)(?:#[\w.-]*)?(?![\w/#])")
URL = re.compile(r"https?://\S+")
EXTENSION = re.compile(r"\.(ipynb|py|md|txt|toml|cfg|json|yml|yaml|csv|sh)$")
DIRECTORIES = re.compile(r"^(\.\.?/|(notebooks|gradtut|tests|binder|shared|seeds|docs|data)/)")


def mentioned_paths(text):
    candidates = (m.group(1).rstrip(".") for m in PATH_LIKE.finditer(URL.sub(" ", text)))
    return [c for c in candidates if EXTENSION.search(c) or DIRECTORIES.match(c)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_file_a_notebook_mentions_is_in_the_repository(path):
    """Readers have only this repository: a notebook may not point at notes kept elsewhere."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    missing = set()
    for cell in nb["cells"]:
        text = source(cell)
        assert not re.search(r"FIELD_NOTES|\bseeds/|\.\./shared", text), text[:200]
        for name in mentioned_paths(text):
            if not any((base / name.rstrip("/")).exists() for base in (ROOT, path.parent)):
                missing.add(name)
    assert not missing, (f"{path.name} mentions files that are not in the repository: "
                         f"{sorted(missing)}")


def test_the_path_check_finds_paths_and_skips_urls():
    text = ("see FIELD_NOTES.md, notebooks/02_x.ipynb and [05](05_y.ipynb), not "
            "https://github.com/a/b/issues/1; e.g. gradtut/per_example.py, ../shared/seeds/003, "
            "[the README](../README.md#set-up). Not 1/B, inf/nan or tensorflow/tensorflow#1.")
    assert mentioned_paths(text) == ["FIELD_NOTES.md", "notebooks/02_x.ipynb", "05_y.ipynb",
                                     "gradtut/per_example.py", "../shared/seeds/003",
                                     "../README.md"]


def test_binder_installs_what_requirements_txt_installs():
    def requirements(path):
        lines = (ROOT / path).read_text().splitlines()
        return sorted(line.strip() for line in lines
                      if line.strip() and not line.startswith(("#", "-e")))

    assert requirements("binder/requirements.txt") == requirements("requirements.txt")
    assert "pip install --no-deps -e ." in (ROOT / "binder/postBuild").read_text()
    assert (ROOT / "binder/runtime.txt").read_text().strip() == "python-3.11"
