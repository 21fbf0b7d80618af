"""The rules every figure keeps, as checks on a matplotlib figure (used by tests/test_analysis_figures*.py),
and a way to catch the figures an exhibit draws before they are written and closed."""
from __future__ import annotations

import numpy as np
from matplotlib.container import BarContainer

MIN_LEGEND_PT = 8
MAX_SERIES = 5


def legends(fig) -> list:
    """Every legend of the figure: the axes' and the figure's own."""
    return [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)


def check_legends(fig) -> None:
    """Legends at MIN_LEGEND_PT or more, at most MAX_SERIES entries in an axes' legend, none over data."""
    fig.canvas.draw()
    for leg in legends(fig):
        for t in leg.get_texts():
            assert t.get_fontsize() >= MIN_LEGEND_PT, (t.get_text(), t.get_fontsize())
    for ax in fig.axes:
        leg = ax.get_legend()
        if leg is None:
            continue
        assert len(leg.get_texts()) <= MAX_SERIES, [t.get_text() for t in leg.get_texts()]
        box = leg.get_window_extent()
        for line in ax.get_lines():
            xy = line.get_xydata()
            if not len(xy):
                continue
            pts = ax.transData.transform(np.asarray(xy, dtype=float))
            inside = ((pts[:, 0] > box.x0) & (pts[:, 0] < box.x1) & (pts[:, 1] > box.y0) & (pts[:, 1] < box.y1))
            assert not inside.any(), f"legend over the points of {line.get_label()!r} in {ax.get_title()!r}"


REFERENCES = ("paper", "roof")   # labels of reference marks (the paper's values, a roofline), not series


def series(ax) -> list[str]:
    """The labelled series one axes draws (lines, error bars, scatters, bar groups), reference marks aside."""
    labels = [h for h in ax.get_legend_handles_labels()[1] if not h.startswith(REFERENCES)]
    return list(dict.fromkeys(labels))


def check_series(fig) -> None:
    for ax in fig.axes:
        assert len(series(ax)) <= MAX_SERIES, (ax.get_title(), series(ax))


def check_no_bars_on_log(fig) -> None:
    for ax in fig.axes:
        bars = [c for c in ax.containers if isinstance(c, BarContainer)]
        if bars:
            assert ax.get_yscale() == "linear" and ax.get_xscale() == "linear", ax.get_title()


def check_title_fits(fig) -> None:
    """The suptitle's box lies inside the figure (bbox_inches='tight' keeps it, but a line wider than the
    figure is cut off in the PDF and in a page's column)."""
    fig.canvas.draw()
    if fig._suptitle is None:
        return
    box = fig._suptitle.get_window_extent()
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width + 1, (box, fig.bbox.width)


def check_tick_labels(fig) -> None:
    """No two tick labels of one axis overlap."""
    fig.canvas.draw()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            boxes = [t.get_window_extent() for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]
            for i, b1 in enumerate(boxes):
                for b2 in boxes[i + 1:]:
                    assert not b1.overlaps(b2), (ax.get_title(), [t.get_text() for t in axis.get_ticklabels()])


def check_all(fig) -> None:
    check_legends(fig)
    check_tick_labels(fig)
    check_series(fig)
    check_no_bars_on_log(fig)
    check_title_fits(fig)


def shared_y(axes) -> bool:
    """Whether the (visible) axes all show one y range."""
    lims = {tuple(np.round(ax.get_ylim(), 9)) for ax in axes if ax.axison}
    return len(lims) == 1


class Caught:
    """``save_figure`` stand-in: keeps {name: figure} instead of writing and closing them."""

    def __init__(self):
        self.figs = {}

    def __call__(self, fig, name, out, data=None):
        self.figs[name] = fig
        self.data = getattr(self, "data", {})
        self.data[name] = data


def catch(monkeypatch, *modules) -> Caught:
    """Replace ``save_figure`` in the given modules (where each looks it up) with one Caught."""
    c = Caught()
    for m in modules:
        monkeypatch.setattr(m, "save_figure", c)
    return c
