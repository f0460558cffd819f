"""The steady state of a ticked plan: ticks that repeat with shifted microbatches.

A pipeline schedule's middle repeats: in 1F1B every tick of the steady state runs the
previous tick's tasks one microbatch later. `find_window` finds the longest such run
that `Program` can lower as one `lax.fori_loop` over a body of `length` ticks (the
compiler then sees those ticks once instead of `iters` times):

* tick t + length runs tick t's tasks with microbatches shifted by `mb_shift`, in
  the same order, on every rank;
* it lays out what it keeps and sends at the same positions, reads its inputs from
  the same places `length` ticks later, and adds to the same gradient sums;
* no value is read more than one iteration after it is made, so the loop carries
  only the previous iteration's values (`carry`, named by where iteration 0 reads
  them) and hands the last iteration's to the ticks after the loop (`exits`).

Value locations are `Program.loc`'s: ("keep", tick, pos) or ("recv", tick, round, pos).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Window", "find_window", "shift_loc"]


@dataclasses.dataclass(frozen=True)
class Window:
  """Ticks [start, stop) run as `iters` iterations of ticks [start, start + length)."""

  start: int
  length: int
  iters: int
  mb_shift: int            # microbatch shift from one iteration to the next
  carry: tuple[tuple, ...]  # locations before `start` that iteration 0 reads
  exits: tuple[tuple, ...]  # other locations in iteration 0 whose last-iteration values are read later

  @property
  def stop(self) -> int:
    return self.start + self.length * self.iters


def shift_loc(loc: tuple, ticks: int) -> tuple:
  """A value location `ticks` ticks later."""
  return (loc[0], loc[1] + ticks) + tuple(loc[2:])


def _shift_key(key: tuple, mbs: int) -> tuple:
  kind, region, mb, k = key
  return (kind, region, mb + mbs, k)


def _shifted_where(where: dict, mbs: int) -> dict:
  return {(rank, _shift_key(key, mbs)): pos for (rank, key), pos in where.items()}


def _mb_shift(ticks, t: int, u: int) -> int | None:
  """The microbatch shift from tick t's first task to tick u's, if both have one."""
  a = next((x for ts in ticks[t] for x in ts), None)
  b = next((x for ts in ticks[u] for x in ts), None)
  return None if a is None or b is None else b.mb - a.mb


def _repeats(prog: Any, t: int, u: int, mbs: int) -> bool:
  """Whether tick u is tick t with microbatches shifted by `mbs` (see the module doc)."""
  ticks = prog.plan.ticks
  for rank, (xs, ys) in enumerate(zip(ticks[t], ticks[u])):
    if len(xs) != len(ys):
      return False
    for x, y in zip(xs, ys):
      if (x.region, x.pass_, x.mb + mbs) != (y.region, y.pass_, y.mb):
        return False
      for key in prog._reads(x):
        a, b = prog.loc.get((key, rank)), prog.loc.get((_shift_key(key, mbs), rank))
        if (a is None) != (b is None) or (a is not None and shift_loc(a, u - t) != b):
          return False
  ia, ib = prog.ticks[t], prog.ticks[u]
  if ia["grads"] != ib["grads"] or prog.buckets.get(t) or prog.buckets.get(u):
    return False
  if ia["keep"][0] != ib["keep"][0] or _shifted_where(ia["keep"][1], mbs) != ib["keep"][1]:
    return False
  if len(ia["rounds"]) != len(ib["rounds"]):
    return False
  return all(ra == rb and pa == pb and _shifted_where(wa, mbs) == wb
             for (ra, pa, wa), (rb, pb, wb) in zip(ia["rounds"], ib["rounds"]))


def _reads_by_tick(prog: Any) -> list[list[tuple]]:
  """Per tick, the locations of earlier ticks that its tasks read."""
  out = []
  for t, tick in enumerate(prog.plan.ticks):
    locs = {prog.loc[(key, rank)] for rank, ts in enumerate(tick) for x in ts
            for key in prog._reads(x) if (key, rank) in prog.loc}
    out.append(sorted((loc for loc in locs if loc[1] < t), key=str))
  return out


def _fit(prog: Any, reads: list, start: int, end: int, period: int, mbs: int,
         min_iters: int) -> Window | None:
  """The longest loop over periodic ticks [start, end) whose values cross one iteration."""
  far = max([t - loc[1] for t in range(start, end) for loc in reads[t]], default=1)
  length = period * -(-far // period)
  for iters in range((end - start) // length, min_iters - 1, -1):
    stop = start + iters * length
    later = {loc for t in range(stop, len(reads)) for loc in reads[t] if start <= loc[1] < stop}
    if any(loc[1] < stop - length for loc in later):
      continue  # a value of an earlier iteration is read after the loop
    first = range(start, start + length)
    carry = sorted({loc for t in first for loc in reads[t] if loc[1] < start}, key=str)
    back = (iters - 1) * length
    # The loop's carry already ends with the last iteration's values of carry + length.
    carried = {shift_loc(loc, length) for loc in carry}
    exits = sorted({shift_loc(loc, -back) for loc in later} - carried, key=str)
    return Window(start, length, iters, mbs * length // period, tuple(carry), tuple(exits))
  return None


def find_window(prog: Any, min_iters: int = 2, max_period: int = 4) -> Window | None:
  """The steady-state window that removes the most ticks from the unrolled program."""
  ticks = prog.plan.ticks
  reads = _reads_by_tick(prog)
  best = None
  for period in range(1, max_period + 1):
    t = 0
    while t + period < len(ticks):
      mbs = _mb_shift(ticks, t, t + period)
      if mbs is None or not _repeats(prog, t, t + period, mbs):
        t += 1
        continue
      e = t
      while e + 1 + period < len(ticks) and _repeats(prog, e + 1, e + 1 + period, mbs):
        e += 1
      w = _fit(prog, reads, t, e + period + 1, period, mbs, min_iters)
      if w and (best is None or (w.iters - 1) * w.length > (best.iters - 1) * best.length):
        best = w
      t = e + 1
  return best
