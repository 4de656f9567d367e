"""Log axes of the study figures: a few plain tick labels, none overlapping another, whatever the
span of the data (fake rows; label boxes measured with matplotlib's renderer)."""
from typing import Any

import pytest

from hypic.evaluation.load import draw_load
from hypic.evaluation.studies import draw_pareto, log_tick_values, pyplot


def test_log_tick_values_take_the_densest_ladder_that_fits() -> None:
    assert log_tick_values(180, 620) == [200, 300, 400, 500, 600]  # 1-9 per decade: 5 ticks
    assert log_tick_values(30, 750) == [50, 100, 200, 500]  # 1-9 gives 14, 1-2-5 gives 4
    assert log_tick_values(0.11, 4.5) == [0.2, 0.5, 1, 2]
    assert log_tick_values(2, 3e4) == [10, 100, 1000, 10000]  # 1-2-5: 12, 1-3: 8, decades: 4
    assert log_tick_values(1, 1e12) == [1, 1e3, 1e6, 1e9, 1e12]  # 13 decades: every third
    assert log_tick_values(310, 390) == []  # nothing of the ladder inside (the locator then defers)


def _labels(figure: Any, axis: Any) -> list[tuple[str, float, Any]]:
    """(text, tick value, window box) of every drawn, non-empty tick label of ``axis``, major and minor."""
    figure.tight_layout()
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    low, high = sorted(axis.get_view_interval())
    return [(tick.label1.get_text(), tick.get_loc(), tick.label1.get_window_extent(renderer))
            for tick in axis.get_major_ticks() + axis.get_minor_ticks()
            if tick.label1.get_visible() and tick.label1.get_text() and low <= tick.get_loc() <= high]


def _check_axis(figure: Any, axis: Any) -> None:
    """At least two labels, each the plain number of its tick, no two boxes touching."""
    labels = _labels(figure, axis)
    assert len(labels) >= 2, labels
    for text, value, _ in labels:
        assert float(text) == pytest.approx(value)
    boxes = [box for _, _, box in labels]
    clashes = [(labels[i][0], labels[j][0]) for i in range(len(boxes)) for j in range(i + 1, len(boxes))
               if boxes[i].overlaps(boxes[j])]
    assert not clashes


SPANS = {"sub-decade": [180, 260, 410, 620], "1.4 decades": [30, 75, 240, 750], "4 decades": [3, 40, 900, 30000],
         "narrow": [310, 330, 350, 390]}


@pytest.mark.parametrize("span", SPANS)
def test_pareto_ttft_axis_labels_do_not_overlap(span: str) -> None:
    rows = [{"dataset": "synthetic", "method": m, "score": s, "ttft_p50_ms": x}
            for m, s, x in zip(["prefix", "naive", "hypic:8", "full"], [60, 55, 78, 80], SPANS[span])]
    figure = draw_pareto(rows)
    try:
        _check_axis(figure, figure.axes[0].xaxis)
    finally:
        pyplot().close(figure)


def test_load_axes_labels_do_not_overlap() -> None:
    """The load figure's QPS and TTFT log axes (recorded-like levels 0.125 .. 4 QPS, 0.3 .. 7 s)."""
    rows = [{"method": m, "qps": q, "ttft_p50_s": t * q ** 0.5, "prompt_tokens_per_s": 400 * q,
             "output_tokens_per_s": 2 * q}
            for m, t in (("hypic:8", 0.9), ("prefix", 3.5)) for q in (0.125, 0.25, 0.5, 1, 2, 4)]
    figure = draw_load(rows, slo=2.0)
    try:
        ttft, throughput = figure.axes
        for axis in (ttft.xaxis, ttft.yaxis, throughput.xaxis):
            _check_axis(figure, axis)
    finally:
        pyplot().close(figure)
