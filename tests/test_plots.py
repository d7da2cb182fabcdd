import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)

from gradtut.model_parallel import simulate_pipeline  # noqa: E402
from gradtut.plots import plot_method_vs_batch, plot_ratios, plot_timeline  # noqa: E402


def test_plot_draws_one_line_per_method():
    rows = [{"method": m, "batch_size": b, "median_ms": float(b * k)}
            for k, m in enumerate(["a", "b"], 1) for b in (32, 64)]
    ax = plot_method_vs_batch(rows)
    assert [line.get_label() for line in ax.get_lines()] == ["a", "b"]
    assert list(ax.get_lines()[1].get_ydata()) == [64.0, 128.0]
    assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
    plt.close(ax.figure)


def test_plot_timeline_draws_one_box_per_event():
    timeline = simulate_pipeline([1.0, 1.0, 1.0], 4)["timeline"]
    ax = plot_timeline(timeline, scale=1, xlabel="time (forward passes)")
    assert len(ax.collections) == len(timeline)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1", "stage 2"]
    assert ax.get_xlabel() == "time (forward passes)"
    plt.close(ax.figure)


def test_plot_ratios_draws_one_bar_per_row_and_saves(tmp_path):
    rows = [{"measurement": "fast", "ratio": 0.5}, {"measurement": "slow", "ratio": 2.0}]
    fig = plot_ratios(rows, "two rows")
    ax = fig.axes[0]
    assert [round(p.get_width(), 6) for p in ax.patches] == [0.5, 2.0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["fast", "slow"]
    assert ax.get_title() == "two rows" and ax.get_xlabel()
    plt.close(fig)
    plot_ratios(rows, "saved", tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 0


def test_plots_refuse_empty_or_malformed_rows():
    with pytest.raises(ValueError, match="at least one row"):
        plot_ratios([], "nothing")
    with pytest.raises(ValueError, match="each with a 'ratio'"):
        plot_ratios([{"measurement": "x"}], "no ratio")
    with pytest.raises(ValueError, match="no rows to plot"):
        plot_method_vs_batch([])
    with pytest.raises(ValueError, match="missing 'median_ms'"):
        plot_method_vs_batch([{"method": "a", "batch_size": 4}])
    with pytest.raises(ValueError, match="empty timeline"):
        plot_timeline([])
