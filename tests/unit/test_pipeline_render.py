"""The schedule picture: every bar keeps its label, and the legend's chunk swatches are drawn
in the colours the chunks' bars are drawn in."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from axondist.pipeline import render
from axondist.pipeline.schedules import ActionKind, build_schedule


@given(length=st.integers(1, 6), box=st.floats(1e-4, 3.0))
def test_a_label_is_drawn_at_a_readable_size_and_fits_across_when_it_runs_across(length, box):
    style = render._label_style("x" * length, box)
    assert render._MIN_UP_PT <= style["fontsize"] <= render._LABEL_PT
    if style["rotation"] == 0:
        assert style["fontsize"] >= render._MIN_ACROSS_PT
        assert style["fontsize"] * render._INCH_PER_CHAR_PT * length <= box
    else:
        assert style["rotation"] == 90


def test_pale_chunks_get_dark_labels():
    assert render._text_colour(render._shade(0, 2)) == "white"
    assert render._text_colour(render._shade(1, 2)) == "black"


def _drawn(schedule):
    """The figure render_image draws, kept instead of written."""
    figure_cls, patch_cls, tuple_handler = render._matplotlib()
    kept = []

    class Kept(figure_cls):
        def savefig(self, *args, **kwargs):
            kept.append(self)

    real = render._matplotlib
    render._matplotlib = lambda: (Kept, patch_cls, tuple_handler)
    try:
        render.render_image(schedule, "unused.png")
    finally:
        render._matplotlib = real
    return kept[0]


@pytest.mark.parametrize("microbatches", [4, 32])
def test_every_bar_is_labelled_and_chunk_swatches_use_the_kinds_colours(microbatches):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_rgba

    schedule = build_schedule("interleaved_1f1b", 4, microbatches, 2)
    ax = _drawn(schedule).axes[0]
    assert len(ax.texts) == sum(len(row) for row in schedule.actions)  # none left out
    legend = ax.get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts == ["F: forward", "B: backward", "chunk 0", "chunk 1"]
    for handle, chunk in zip(legend.legend_handles[2:], (0, 1)):
        colour = to_rgba(render._COLORS[ActionKind.F], render._shade(chunk, 2))
        assert handle.get_facecolor() == pytest.approx(colour)
