"""Pictures of plans: a per-device Gantt chart of the simulated schedule."""

from __future__ import annotations

import io
import os
from typing import Mapping

__all__ = ["timeline", "figure"]

COLORS = {"F": "#4C8BF5", "B": "#F2A03D", "BI": "#F2A03D", "BW": "#9B6ADE", "comm": "#9AA0A6"}
DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "BI": 1.0, "BW": 1.0}
_LEGEND_IN = 0.4  # inches of figure height below the axes that hold the legend


def timeline(plan, path: str | os.PathLike, costs: Mapping[str, float] | None = None,
             ticks: bool = False) -> str:
  """Writes the plan's per-device Gantt chart to `path` (.svg, .png or .html).

  Rows are pipeline ranks (with their devices), boxes are F/B/BI/BW tasks coloured
  by pass and labelled with region and microbatch, placed by `plan.simulate(costs)`
  (default F=1, B=2, BI=BW=1): each task as soon as its inputs exist, or with
  `ticks=True` tick by tick, as the lowering runs them (dotted lines between ticks).

  Returns:
    The path written.
  """
  import matplotlib.pyplot as plt

  path = os.fspath(path)
  ext = os.path.splitext(path)[1].lower()
  if ext not in (".svg", ".png", ".html"):
    raise ValueError(f"timeline writes .svg, .png or .html, got {path!r}")
  fig = figure(plan, costs, ticks)
  try:
    _save(fig, path, ext)
  finally:
    plt.close(fig)
  return path


def figure(plan, costs: Mapping[str, float] | None = None, ticks: bool = False):
  """The chart `timeline` writes, as a matplotlib Figure (close it when done)."""
  import matplotlib
  matplotlib.use("Agg", force=False)
  import matplotlib.pyplot as plt

  report = plan.simulate(costs or DEFAULT_COSTS)
  starts, ends = (report.tick_start, report.tick_end) if ticks else (report.start, report.end)
  span = report.tick_makespan if ticks else report.makespan
  n = plan.n_ranks
  height = 0.6 * n + 1.5 + _LEGEND_IN
  fig, ax = plt.subplots(figsize=(max(6.0, span * 0.35), height))
  if ticks:
    for x in sorted({starts[ts[0].label] for tick in plan.ticks for ts in tick if ts})[1:]:
      ax.axvline(x, color="#BBBBBB", linestyle=":", linewidth=0.8)
  _draw_tasks(ax, plan, starts, ends)
  ax.set_yticks(range(n))
  ax.set_yticklabels([f"rank {r} {list(plan.mesh.groups[r])}" for r in reversed(range(n))])
  ax.set_xlim(0, span)
  ax.set_title(f"{len(plan.tasks)} tasks of {plan.n_microbatches} microbatch(es) on {n} "
               f"pipeline rank(s)", fontsize=9)
  ax.set_xlabel(_time_label(plan, report, span, costs, ticks))
  _legend(fig, plan)
  # The strip below the axes is the legend's, so that it covers no task.
  fig.tight_layout(rect=(0, _LEGEND_IN / height, 1, 1))
  return fig


def _draw_tasks(ax, plan, starts, ends) -> None:
  n = plan.n_ranks
  for task in plan.tasks.values():
    start, end = starts[task.label], ends[task.label]
    y = n - 1 - task.rank
    ax.broken_barh([(start, end - start)], (y - 0.4, 0.8),
                   facecolors=COLORS[task.pass_.value], edgecolors="white", linewidth=0.8)
    text = f"{task.mb}" if len(plan.rank_regions(task.rank)) == 1 else f"{task.region}:{task.mb}"
    ax.text((start + end) / 2, y, text, ha="center", va="center", fontsize=7, color="white")


def _time_label(plan, report, span: float, costs, ticks: bool) -> str:
  """The x axis's label: what the makespan counts and in which unit."""
  unit = ("time units (one F = 1)" if costs is None else
          "time units (the largest region's F = 1)" if costs == "flops" else
          "in the units of the costs given")
  if ticks:
    return f"time, tick by tick: {len(plan.ticks)} ticks, makespan {span:g} {unit}"
  return f"time: makespan {span:g} {unit}, bubble {100 * report.bubble_fraction:.1f}% idle"


def _legend(fig, plan) -> None:
  from matplotlib.patches import Patch
  passes = sorted({t.pass_.value for t in plan.tasks.values()}, key="F B BI BW".split().index)
  fig.legend(handles=[Patch(color=COLORS[p], label=p) for p in passes], loc="lower left",
             fontsize=7, ncol=len(passes), frameon=False)


def _save(fig, path: str, ext: str) -> None:
  if ext != ".html":
    fig.savefig(path)
    return
  buf = io.StringIO()
  fig.savefig(buf, format="svg")
  with open(path, "w") as f:
    f.write("<!doctype html><html><head><meta charset='utf-8'><title>piper-jax plan</title>"
            "</head><body>\n" + buf.getvalue() + "\n</body></html>\n")
