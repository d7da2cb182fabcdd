"""Canonical JSON for stored notebooks, so diffs show content changes only.

Repository tooling, not part of the package. Usage: ``python .ci/notebook_format.py
notebooks/*.ipynb`` rewrites each file in place (``.ci/execute-notebooks`` runs it after
executing); ``tests/test_notebooks.py`` checks that every stored notebook already is in this form.
"""
import json
import sys

_KEEP_CELL_METADATA = ("tags",)


def canonical(nb):
    """Return the canonical text of a notebook dict: volatile metadata dropped, keys sorted.

    Drops per-cell execution timestamps, collapse/scroll state and widget state, keeps only the
    kernel name and language of the notebook metadata, and writes JSON the way nbformat does
    (indent 1, sorted keys, UTF-8, trailing newline).
    """
    nb = json.loads(json.dumps(nb))
    nb["metadata"] = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for cell in nb["cells"]:
        cell["metadata"] = {k: v for k, v in cell.get("metadata", {}).items()
                            if k in _KEEP_CELL_METADATA}
        for out in cell.get("outputs", []):
            out.get("metadata", {}).pop("execution", None)
    return json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def main(paths):
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = canonical(json.load(f))
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
