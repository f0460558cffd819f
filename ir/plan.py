"""Per-device ordered plans, cut into ticks, from a directive-rewritten DAG."""

from __future__ import annotations

import dataclasses
import heapq
import json
from typing import Mapping, Sequence

from piper_jax.ir.graph import Graph, Node, NodeKind, Pass
from piper_jax.ir.mesh import MeshSpec
from piper_jax.ir.model import ModelSpec
from piper_jax.ir.simulate import simulate as simulate_plan
from piper_jax.ir.timeline import timeline as draw_timeline

__all__ = ["Task", "Plan", "schedule_ticks", "delay_tasks"]

_PASS_RANK = {Pass.F: 0, Pass.B: 1, Pass.BI: 1, Pass.BW: 2}


@dataclasses.dataclass(frozen=True)
class Task:
  """A compute node as the lowering runs it: on `rank`, in `tick`."""

  node: str
  region: int
  pass_: Pass
  mb: int
  rank: int
  tick: int
  cost: float

  @property
  def label(self) -> str:
    return f"r{self.region}{self.pass_.value}{self.mb}"


def _compute_order(graph: Graph, by_microbatch: bool = False) -> list[Node]:
  """A topological order of all nodes; ready compute nodes go F before B, then by
  microbatch, or (`by_microbatch`) by microbatch first: one microbatch's F and B before
  the next one's, as gradient accumulation runs."""
  indeg = {i: len(graph.pred[i]) for i in graph.nodes}
  pos = {i: k for k, i in enumerate(graph.nodes)}

  def key(n: Node):
    if n.kind is not NodeKind.COMPUTE:
      return (-1, 0, 0, pos[n.id])
    first, second = _PASS_RANK[n.pass_], n.mb or 0
    if by_microbatch:
      first, second = second, first
    return (first, second, n.region, pos[n.id])

  heap = [(key(graph.nodes[i]), i) for i, d in indeg.items() if d == 0]
  heapq.heapify(heap)
  out = []
  while heap:
    _, i = heapq.heappop(heap)
    out.append(graph.nodes[i])
    for e in graph.succ[i]:
      indeg[e.dst] -= 1
      if indeg[e.dst] == 0:
        heapq.heappush(heap, (key(graph.nodes[e.dst]), e.dst))
  return [n for n in out if n.kind is NodeKind.COMPUTE]


def _compute_preds(graph: Graph, node: str) -> set[str]:
  """The compute nodes `node` depends on directly, looking through communication nodes."""
  out, stack, seen = set(), [e.src for e in graph.pred[node]], set()
  while stack:
    i = stack.pop()
    if i in seen:
      continue
    seen.add(i)
    if graph.nodes[i].kind is NodeKind.COMPUTE:
      out.add(i)
    elif graph.nodes[i].kind in (NodeKind.SEND, NodeKind.RECV, NodeKind.ALL_TO_ALL):
      stack += [e.src for e in graph.pred[i]]
  return out


def schedule_ticks(order: Sequence[Node], preds: Mapping[str, set[str]], rank: Mapping[str, int],
                   cost: Mapping[str, float], budget: float,
                   chain: Mapping[str, tuple] | None = None) -> dict[str, int]:
  """Assigns each compute node a tick.

  A node runs in the tick of a same-rank producer or later, and at least one tick
  after a producer on another rank (messages move between ticks). A rank's tick
  takes nodes while their cost fits `budget`, and always takes a member of an order
  group whose other member it already holds, or the next node of the `chain` (same
  key) its last node belongs to: the regions of one stage, microbatch and pass stay
  in one tick. Ticks never go back along a rank.
  """
  chain = chain or {}
  tick_of: dict[str, int] = {}
  cur: dict[int, int] = {}
  load: dict[tuple[int, int], float] = {}
  group_tick: dict[tuple[int, str], int] = {}
  last: dict[int, str] = {}
  for n in order:
    r = rank[n.id]
    t = cur.get(r, 0)
    for p in preds[n.id]:
      t = max(t, tick_of[p] + (rank[p] != r))
    together = n.group is not None and group_tick.get((r, n.group)) == t
    prev = last.get(r)
    together |= (prev is not None and chain.get(n.id) is not None
                 and chain.get(prev) == chain[n.id] and tick_of[prev] == t)
    last[r] = n.id
    if (not together and t == cur.get(r, 0) and load.get((r, t), 0) > 0
        and load[(r, t)] + cost[n.id] > budget):
      t += 1
    if n.group is not None:
      group_tick.setdefault((r, n.group), t)
    tick_of[n.id] = t
    load[(r, t)] = load.get((r, t), 0) + cost[n.id]
    cur[r] = t
  return tick_of


TICK_COST = 0.05


def delay_tasks(order: Sequence[Node], preds: Mapping[str, set[str]], rank: Mapping[str, int],
                cost: Mapping[str, float], tick_of: Mapping[str, int],
                chain: Mapping[str, tuple] | None = None) -> dict[str, int]:
  """Moves tasks to later ticks of their rank where that shortens the ticked step.

  A tick lasts as long as its busiest rank, so a task on a rank that waits anyway can
  run later for free: 1F1B's second warm-up F on the first rank goes from the first
  tick, where it ran alone, to the second, beside the last rank's F and B. A task
  stays before its rank's next task and its consumers (a tick before those on other
  ranks); members of order groups and chains stay where they are.
  """
  chain = chain or {}
  together: dict[tuple, int] = {}  # a stage cut into several regions moves as one: not here
  for i, key in chain.items():
    together[(rank[i], key)] = together.get((rank[i], key), 0) + 1
  tick_of = dict(tick_of)
  succs: dict[str, list[str]] = {n.id: [] for n in order}
  for n in order:
    for p in preds[n.id]:
      succs[p].append(n.id)
  nxt: dict[str, str] = {}
  last: dict[int, str] = {}
  for n in order:
    if rank[n.id] in last:
      nxt[last[rank[n.id]]] = n.id
    last[rank[n.id]] = n.id
  load: dict[tuple[int, int], float] = {}
  count: dict[int, int] = {}  # tasks per tick: a move that empties a tick saves TICK_COST
  for i, t in tick_of.items():
    load[(rank[i], t)] = load.get((rank[i], t), 0.0) + cost[i]
    count[t] = count.get(t, 0) + 1
  ranks = sorted(set(rank.values()))
  tick_len = lambda t: max(load.get((r, t), 0.0) for r in ranks)
  end = max(tick_of.values(), default=0)
  for n in reversed(order):
    i, r, t = n.id, rank[n.id], tick_of[n.id]
    if n.group is not None or together.get((r, chain.get(i)), 0) > 1:
      continue
    latest = tick_of[nxt[i]] if i in nxt else end
    for s in succs[i]:
      latest = min(latest, tick_of[s] - (rank[s] != r))
    best, gain = t, 0.0
    for u in range(t + 1, latest + 1):
      before = tick_len(t) + tick_len(u)
      load[(r, t)] -= cost[i]
      load[(r, u)] = load.get((r, u), 0.0) + cost[i]
      change = before - tick_len(t) - tick_len(u) + (TICK_COST if count[t] == 1 else 0.0)
      load[(r, u)] -= cost[i]
      load[(r, t)] += cost[i]
      if change > gain + 1e-9:
        best, gain = u, change
    if best != t:
      load[(r, t)] -= cost[i]
      load[(r, best)] = load.get((r, best), 0.0) + cost[i]
      count[t] -= 1
      count[best] = count.get(best, 0) + 1
      tick_of[i] = best
  used = sorted(set(tick_of.values()))
  return {i: used.index(t) for i, t in tick_of.items()}


def _makespan(tick_of, rank, cost) -> float:
  load: dict[tuple[int, int], float] = {}
  for i, t in tick_of.items():
    load[(rank[i], t)] = load.get((rank[i], t), 0) + cost[i]
  ticks: dict[int, float] = {}
  for (r, t), c in load.items():
    ticks[t] = max(ticks.get(t, 0), c)
  return sum(ticks.values())


class Plan:
  """The DAG after directives, its mesh, and each pipeline rank's ordered, ticked tasks.

  `ticks[t][rank]` lists the tasks rank `rank` runs in tick `t`, in order.
  `bucket_mb` (from replicate) asks for data-parallel gradient reductions in buckets
  of that size, issued as soon as their gradients are final; `reduce_dtype` for
  those reductions in that dtype.
  """

  def __init__(self, graph: Graph, model: ModelSpec, mesh: MeshSpec, n_microbatches: int,
               pass_costs: Mapping[str, float] | None = None, bucket_mb: float | None = None,
               reduce_dtype: str | None = None):
    self.graph, self.model, self.mesh = graph, model, mesh
    self.n_microbatches = n_microbatches
    self.bucket_mb = bucket_mb
    self.reduce_dtype = reduce_dtype
    pass_costs = dict(pass_costs or {"F": 1.0, "B": 2.0, "BI": 1.0, "BW": 1.0})
    # Without a pipeline, microbatches are gradient accumulation: each one's F and B
    # run before the next one's, so only one microbatch's activations are alive.
    order = _compute_order(graph, by_microbatch=mesh.n_pp == 1)
    rank = {n.id: mesh.region_rank[n.region] for n in order}
    flops = {r.index: r.flops for r in model.regions}
    scale = max(flops.values()) if flops and max(flops.values()) > 0 else 0
    cost = {n.id: pass_costs[n.pass_.value] * (max(flops[n.region] / scale, 0.05) if scale else 1)
            for n in order}
    preds = {n.id: _compute_preds(graph, n.id) for n in order}
    # Tick budgets to try: one task a tick (0: GPipe's forwards one at a time, so
    # that the next rank starts a task earlier); the largest task's cost; a
    # microbatch's F with one of its backward passes; its F with all of them (ZB's
    # BI and BW beside the next F, as 1F1B's B).
    work: dict[tuple[int, int], dict[Pass, float]] = {}
    for n in order:
      work.setdefault((n.region, n.mb), {})[n.pass_] = cost[n.id]
    candidates = sorted({0.0, max(cost.values())} | {
        c[Pass.F] + extra for c in work.values() if Pass.F in c
        for extra in [v for p, v in c.items() if p is not Pass.F]
        + [sum(v for p, v in c.items() if p is not Pass.F)]})
    if mesh.n_pp == 1:  # no messages between ranks: one tick holds everything, except
      # under ZeRO 2/3, which reduce-scatter gradients and gather parameters per tick:
      # one task a tick, so each region's are reduced, or gathered, on their own.
      candidates = [0.0 if mesh.zero >= 2 else float("inf")]
    # A stage cut into several regions (EP regions inside a PP region) runs a
    # microbatch's pass in one tick: the regions that share an outermost annotation.
    chain = {n.id: (n.tags[0], n.mb, n.pass_ is Pass.F) for n in order if n.tags}
    best = None
    for budget in candidates:
      tick_of = schedule_ticks(order, preds, rank, cost, budget, chain)
      if mesh.n_pp > 1:  # one rank's ticks are as the budget cut them (ZeRO 2/3: a task each)
        tick_of = delay_tasks(order, preds, rank, cost, tick_of, chain)
      # Each tick also costs a message round and a launch (TICK_COST, in units of
      # the largest region's forward): fewer ticks win a near tie, and compile less.
      span = _makespan(tick_of, rank, cost) + TICK_COST * (1 + max(tick_of.values(), default=-1))
      if best is None or span < best[0] - 1e-9:
        best = (span, tick_of)
    tick_of = best[1]
    self.order = order
    self.preds = preds
    self.tasks = {n.id: Task(n.id, n.region, n.pass_, n.mb, rank[n.id], tick_of[n.id], cost[n.id])
                  for n in order}
    n_ticks = 1 + max(tick_of.values()) if tick_of else 0
    self.ticks: list[list[list[Task]]] = [[[] for _ in range(mesh.n_pp)] for _ in range(n_ticks)]
    for n in order:
      t = self.tasks[n.id]
      self.ticks[t.tick][t.rank].append(t)

  @property
  def n_ranks(self) -> int:
    return self.mesh.n_pp

  def rank_regions(self, rank: int) -> list[int]:
    return [r for r, k in sorted(self.mesh.region_rank.items()) if k == rank]

  def table(self) -> str:
    """A rank x tick grid of task labels ('r1F3' = region 1, forward, microbatch 3), and
    each tick's length: its busiest rank's planned cost (the largest region's F = 1)."""
    rows = []
    head = ["rank (devices)"] + [f"t{t}" for t in range(len(self.ticks))]
    for r in range(self.n_ranks):
      cells = [f"{r} {list(self.mesh.groups[r])}"]
      for tick in self.ticks:
        cells.append(" ".join(t.label for t in tick[r]) or ".")
      rows.append(cells)
    if self.n_ranks > 1:
      rows.append(["tick length"] + [f"{max(sum(t.cost for t in ts) for ts in tick):.2f}"
                                     for tick in self.ticks])
    widths = [max(len(row[c]) for row in [head] + rows) for c in range(len(head))]
    fmt = lambda row: " | ".join(x.ljust(w) for x, w in zip(row, widths))
    return "\n".join([fmt(head), "-+-".join("-" * w for w in widths)] + [fmt(r) for r in rows])

  def __str__(self) -> str:
    comm = {}
    for n in self.graph.nodes.values():
      if n.kind not in (NodeKind.COMPUTE, NodeKind.UPDATE):
        comm[n.kind.value] = comm.get(n.kind.value, 0) + 1
    regions = ", ".join(f"{r.index}:{r.name}->rank {self.mesh.region_rank[r.index]}"
                        for r in self.model.regions)
    m = self.mesh
    inner = "".join(f" ({k}={v} inside)" for k, v in m.inner.items())
    lines = [
        f"Plan: {len(self.model.regions)} regions, {self.n_microbatches} microbatches, "
        f"mesh dp={m.n_dp}{inner} x pp={m.n_pp}, zero={m.zero}",
        f"regions: {regions}",
        "communication nodes: " + (", ".join(f"{k} x{v}" for k, v in sorted(comm.items())) or "none"),
        self.table(),
    ]
    return "\n".join(lines)

  __repr__ = __str__

  def to_json(self) -> dict:
    return {
        "mesh": {"groups": [list(g) for g in self.mesh.groups], "zero": self.mesh.zero,
                 **({"inner": dict(self.mesh.inner),
                     "sharded": {str(r): k for r, k in sorted(self.mesh.sharded.items())}}
                    if self.mesh.inner else {})},
        "n_microbatches": self.n_microbatches,
        "ticks": [[[t.label for t in ts] for ts in tick] for tick in self.ticks],
        "graph": self.graph.to_json(),
    }

  def to_json_str(self) -> str:
    return json.dumps(self.to_json(), indent=1)

  def to_dot(self) -> str:
    return self.graph.to_dot()

  def timeline(self, path, costs=None, ticks: bool = False):
    """Writes a per-device Gantt chart (.svg, .png or .html); see `piper_jax.viz.timeline`."""
    return draw_timeline(self, path, costs, ticks)

  def simulate(self, costs):
    """Simulated makespan, bubble fraction and peak activations; see `ir.simulate`."""
    return simulate_plan(self, costs)
