"""Simulates a plan with per-pass costs: makespan, bubble fraction, live activations."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from piper_jax.ir.graph import Pass

__all__ = ["SimReport", "simulate"]


@dataclasses.dataclass(frozen=True)
class SimReport:
  """What a simulated step costs.

  Attributes:
    makespan: time from the first task's start to the last task's end.
    bubble_fraction: idle time over (devices that hold work x makespan).
    peak_activations: per pipeline rank, the most (region, microbatch) activations
      alive at once (from the end of F until the end of the last backward pass
      that reads them).
    start, end: per task label (e.g. "r1F3"), its simulated start and end time.
    tick_makespan: the step as the lowering runs it: tick by tick, each tick as long
      as its busiest rank (every rank waits for the tick's messages), plus "comm"
      for each tick that sends any. At least `makespan`.
    tick_start, tick_end: per task label, its start and end when run tick by tick.
  """

  makespan: float
  bubble_fraction: float
  peak_activations: dict[int, int]
  start: dict[str, float]
  end: dict[str, float]
  tick_makespan: float = 0.0
  tick_start: dict[str, float] = dataclasses.field(default_factory=dict)
  tick_end: dict[str, float] = dataclasses.field(default_factory=dict)

  def __str__(self):
    return (f"makespan {self.makespan:g} ({self.tick_makespan:g} in ticks), bubble "
            f"{100 * self.bubble_fraction:.1f}%, peak activations per rank {self.peak_activations}")


def simulate(plan, costs: Mapping[str, float]) -> SimReport:
  """Runs each rank's tasks in plan order, each as soon as its inputs exist.

  Args:
    plan: a `Plan`.
    costs: time per pass, e.g. `{"F": 1, "B": 2}` or `{"F": 1, "BI": 1, "BW": 1}`,
      optionally `"comm"`: the latency of a message between ranks (default 0).
      A missing "B" is BI + BW; a missing "BI"/"BW" is half of "B". Per region, keys
      (region index, pass) instead, e.g. `{(0, "F"): 1.2, (0, "B"): 2.5, ...}` for
      every region (measured times: `pj.calibrate`). Or "flops": each task costs its
      region's matmul FLOPs from the jaxpr (B twice F, plus the forward FLOPs it
      recomputes under a checkpoint), in units of the largest region's forward.

  Returns:
    A `SimReport`.
  """
  if isinstance(costs, str):
    if costs != "flops":
      raise ValueError(f"costs is a dict of per-pass times or 'flops', got {costs!r}")
    return _simulate(plan, _flop_costs(plan), 0.0)
  costs = dict(costs)
  if any(isinstance(k, tuple) for k in costs):
    return _simulate(plan, _region_costs(plan, costs), float(costs.get("comm", 0.0)))
  if "F" not in costs:
    raise ValueError(f"costs need an 'F' entry, got {costs}")
  if "B" not in costs:
    if "BI" not in costs or "BW" not in costs:
      raise ValueError("costs need 'B', or both 'BI' and 'BW'")
    costs["B"] = costs["BI"] + costs["BW"]
  costs.setdefault("BI", costs["B"] / 2)
  costs.setdefault("BW", costs["B"] / 2)
  comm = float(costs.get("comm", 0.0))
  return _simulate(plan, {i: float(costs[t.pass_.value]) for i, t in plan.tasks.items()}, comm)


def _region_costs(plan, costs: dict) -> dict[str, float]:
  """Task costs from {(region, pass): time}: B from BI + BW when missing, BI and BW half
  of B when missing."""
  def cost(region: int, pass_: str) -> float:
    if (region, pass_) in costs:
      return float(costs[(region, pass_)])
    if pass_ == "B" and (region, "BI") in costs and (region, "BW") in costs:
      return float(costs[(region, "BI")]) + float(costs[(region, "BW")])
    if pass_ in ("BI", "BW") and (region, "B") in costs:
      return float(costs[(region, "B")]) / 2
    raise ValueError(f"costs have no {pass_!r} time for region {region} (nor what it is "
                     f"made of); give (region, pass) times for every region the plan runs")
  return {i: cost(t.region, t.pass_.value) for i, t in plan.tasks.items()}


def _flop_costs(plan) -> dict[str, float]:
  """Task costs from the jaxpr: a region's forward FLOPs for F, twice that for B, once for
  BI/BW; B and BI also run again what the forward checkpointed (`recompute_flops`)."""
  scale = {"F": 1.0, "B": 2.0, "BI": 1.0, "BW": 1.0}
  again = {"F": 0.0, "B": 1.0, "BI": 1.0, "BW": 0.0}
  regions = {r.index: r for r in plan.model.regions}
  top = max(r.flops for r in regions.values()) or 1.0
  return {i: (scale[t.pass_.value] * max(regions[t.region].flops, 1e-3 * top)
              + again[t.pass_.value] * regions[t.region].recompute_flops) / top
          for i, t in plan.tasks.items()}


def _simulate(plan, cost: dict[str, float], comm: float) -> SimReport:
  tasks = plan.tasks
  seq: dict[int, list] = {}
  for tick in plan.ticks:
    for rank, ts in enumerate(tick):
      seq.setdefault(rank, []).extend(ts)
  end: dict[str, float] = {}
  start: dict[str, float] = {}
  free = {rank: 0.0 for rank in seq}
  pos = {rank: 0 for rank in seq}
  remaining = sum(len(v) for v in seq.values())
  while remaining:
    progressed = False
    for rank, ts in seq.items():
      while pos[rank] < len(ts):
        t = ts[pos[rank]]
        preds = plan.preds[t.node]
        if any(p not in end for p in preds):
          break
        ready = max([free[rank]] + [end[p] + (comm if tasks[p].rank != rank else 0.0)
                                    for p in preds])
        start[t.node] = ready
        end[t.node] = ready + cost[t.node]
        free[rank] = end[t.node]
        pos[rank] += 1
        remaining -= 1
        progressed = True
    if not progressed:  # cannot happen for a plan built by make_plan (it is acyclic)
      raise RuntimeError("simulation deadlocked")
  t0 = min(start.values()) if start else 0.0
  makespan = (max(end.values()) - t0) if end else 0.0
  busy = {rank: sum(end[t.node] - start[t.node] for t in ts) for rank, ts in seq.items()}
  working = [r for r in seq if seq[r]]
  idle = sum(makespan - busy[r] for r in working)
  bubble = idle / (len(working) * makespan) if makespan else 0.0
  peak = {}
  for rank, ts in seq.items():
    events = []
    for t in ts:
      if t.pass_ is Pass.F:
        events.append((end[t.node], 1))
      last_b = [x for x in ts if x.region == t.region and x.mb == t.mb and x.pass_ is not Pass.F]
      if t.pass_ is Pass.F and last_b:
        events.append((max(end[x.node] for x in last_b), -1))
    live = best = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
      live += d
      best = max(best, live)
    peak[rank] = best
  label = lambda i: tasks[i].label
  ticked, tick_start, tick_end = _ticked(plan, cost, comm)
  return SimReport(makespan, bubble, peak, {label(i): v for i, v in start.items()},
                   {label(i): v for i, v in end.items()}, ticked,
                   {label(i): v for i, v in tick_start.items()},
                   {label(i): v for i, v in tick_end.items()})


def _ticked(plan, cost: dict[str, float], comm: float):
  """(makespan, start, end by node) of the plan run tick by tick: each tick starts when
  the previous one's busiest rank is done (and its messages, `comm`, have arrived)."""
  tasks = plan.tasks
  senders = {p for n, ps in plan.preds.items() for p in ps if tasks[p].rank != tasks[n].rank}
  start, end, now = {}, {}, 0.0
  for tick in plan.ticks:
    length = 0.0
    for ts in tick:
      at = now
      for t in ts:
        start[t.node], at = at, at + cost[t.node]
        end[t.node] = at
      length = max(length, at - now)
    sends = comm and any(t.node in senders for ts in tick for t in ts)
    now += length + (comm if sends else 0.0)
  return now, start, end
