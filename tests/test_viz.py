"""`Plan.timeline`: the chart says what its numbers are, and its legend covers no task."""

import pytest

import piper_jax as pj
from piper_jax import ir, viz
from ir.test_passes import chain_model


def _plan():
  return ir.make_plan(chain_model(2, batch=64), pj.strategies.pipeline(2, 2, "1f1b"), n_devices=2)


def test_title_and_axis_say_what_the_numbers_count(tmp_path):
  plan = _plan()  # 2 ranks x 2 microbatches x (F, B): 8 tasks, makespan 9 in F units
  text = open(plan.timeline(tmp_path / "plan.svg")).read()
  assert "8 tasks of 2 microbatch(es) on 2 pipeline rank(s)" in text
  assert "makespan 9 time units (one F = 1), bubble 33.3% idle" in text
  ticked = open(plan.timeline(tmp_path / "ticks.svg", ticks=True)).read()
  span = plan.simulate(viz.DEFAULT_COSTS).tick_makespan
  assert f"{len(plan.ticks)} ticks, makespan {span:g} time units (one F = 1)" in ticked
  flops = open(plan.timeline(tmp_path / "flops.svg", costs="flops")).read()
  assert "time units (the largest region's F = 1)" in flops


@pytest.mark.parametrize("ticks", [False, True])
def test_legend_is_outside_the_plot(ticks):
  import matplotlib.pyplot as plt
  fig = viz.figure(_plan(), ticks=ticks)
  try:
    fig.canvas.draw()
    (ax,), (legend,) = fig.axes, fig.legends
    renderer = fig.canvas.get_renderer()
    box = legend.get_window_extent(renderer)
    assert not box.overlaps(ax.get_window_extent(renderer))
    assert not box.overlaps(ax.xaxis.label.get_window_extent(renderer))
    assert box.y1 <= fig.bbox.y1 and box.y0 >= fig.bbox.y0  # in the figure
  finally:
    plt.close(fig)
