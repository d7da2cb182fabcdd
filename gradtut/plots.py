"""Every plot the package draws, in one place (matplotlib is imported only when one is drawn).

- :func:`plot_method_vs_batch`: time (or memory) against batch size, one line per method
  (notebooks 01, 02);
- :func:`plot_timeline`: a pipeline's forward and backward boxes per stage (notebook 04);
- :func:`plot_ratios`: ratios to a reference as bars (``python -m gradtut bench``).
"""


def plot_method_vs_batch(rows, value="median_ms", title="Time per call by batch size",
                         ylabel="median time per call (ms)", ax=None):
    """Log-log plot of ``value`` against ``batch_size``, one line per ``method``.

    Args:
      rows: iterable of dicts with keys ``"method"``, ``"batch_size"`` and ``value``.
      ax: a matplotlib Axes to draw on, or None for a new figure.

    Returns:
      the matplotlib Axes.

    Raises:
      ValueError: no rows, or a row without one of the keys.
    """
    import matplotlib.pyplot as plt

    rows = list(rows)
    if not rows:
        raise ValueError("no rows to plot: pass dicts with 'method', 'batch_size' and "
                         f"{value!r}")
    for key in ("method", "batch_size", value):
        if any(key not in r for r in rows):
            raise ValueError(f"a row is missing {key!r}; each needs 'method', 'batch_size' and "
                             f"{value!r}")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for method in methods:
        points = sorted((r["batch_size"], r[value]) for r in rows if r["method"] == method)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (examples)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    return ax


def plot_timeline(timeline, ax=None, title="Pipeline timeline", scale=1e3, xlabel="time (ms)"):
    """Gantt chart of a timeline: one row per stage, forward and backward boxes labelled with
    their micro-batch. Times are multiplied by ``scale`` (1e3: seconds to ms; use 1 and your
    own ``xlabel`` for a simulated timeline). Returns the matplotlib axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not timeline:
        raise ValueError("empty timeline: pass the 'timeline' of pipeline_gradients(...) or "
                         "simulate_pipeline(...)")
    stages = len({e["stage"] for e in timeline})
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.8 + 0.55 * stages))
    colors = {"forward": "tab:blue", "backward": "tab:orange"}
    width = max(e["end"] for e in timeline) * scale
    for e in timeline:
        start, length = e["start"] * scale, (e["end"] - e["start"]) * scale
        ax.broken_barh([(start, length)], (e["stage"] - 0.4, 0.8),
                       facecolors=colors[e["phase"]], edgecolor="white")
        if length > 0.025 * width:
            ax.text(start + length / 2, e["stage"], str(e["microbatch"]), ha="center",
                    va="center", color="white", fontsize=8)
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=p) for p, c in colors.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax


def plot_ratios(rows, title, path=None):
    """Horizontal bars of each row's ``"ratio"``, labelled by its ``"measurement"``, with a line
    at 1 (as fast or as large as the reference). ``python -m gradtut bench`` draws one per
    section. Saved to ``path`` (and the figure closed) when given; returns the figure.

    Raises:
      ValueError: no rows, or a row without a ratio.
    """
    import matplotlib.pyplot as plt

    if not rows or any(r.get("ratio") is None for r in rows):
        raise ValueError("plot_ratios needs at least one row, each with a 'ratio' and a "
                         "'measurement'")
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.45 * len(rows)))
    ax.barh([r["measurement"] for r in rows], [r["ratio"] for r in rows], color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.invert_yaxis()
    ax.set_xlabel("ratio to the reference (1 = as fast / as large)")
    ax.set_title(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
        plt.close(fig)
    return fig
