"""The steady state of a ticked plan: ticks that repeat with shifted microbatches.

A pipeline schedule's middle repeats: in 1F1B every tick of the steady state runs the
previous tick's tasks one microbatch later. `find_window` finds the run of ticks that
`Program` can lower as one `lax.fori_loop` over a body of `length` ticks (the compiler
then sees those ticks once instead of `iters` times):

* tick t + period runs tick t's tasks with microbatches shifted, in the same order on
  every rank, keeps and sends its values at the same positions, and adds to the same
  gradient sums;
* from the second iteration on, every read comes from the place the previous
  iteration's read came from, `length` ticks later, and every value is read less than
  `length` ticks after it is made: a carried value is read before the tick that makes
  its successor, so XLA writes the successor into the carried buffer with no copy.
  The body reads where the second iteration reads (shifted back, `Window.reads`), so
  the loop carries only the previous iteration's values (`carry`); the first
  iteration reads the ticks before the loop, which may lay their values out
  differently, through `entry`;
* the ticks after the loop read only the last iteration's values (`carry` shifted,
  and `exits`).

Where no such window exists, one whose values are read up to `LoweringOptions.max_carry_depth`
iterations after they are made may be: the carry then holds a value for each iteration
back, passed one slot deeper each iteration, and the ticks after the loop may read
the values of as many last iterations.

Value locations are `Program.loc`'s: `Kept` or `Received` (`lowering/values.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Window", "find_window"]


@dataclasses.dataclass(frozen=True)
class Window:
  """Ticks [start, stop) run as `iters` iterations of the code of ticks [start, start + length)."""

  start: int
  length: int
  iters: int
  mb_shift: int                 # microbatch shift from one iteration to the next
  reads: tuple[tuple, ...]      # ((value key, rank), location) of the body's reads
  carry: tuple[tuple, ...]      # body read locations before `start`: earlier iterations' values
                                # (k lengths before the tick that makes one: k iterations back)
  entry: tuple[tuple, ...]      # per carry location, ((rank, location), ...) of the first
                                # iteration's reads (ranks may find it in different places)
  exits: tuple[tuple, ...]      # more body locations whose last values the later ticks read

  @property
  def stop(self) -> int:
    return self.start + self.length * self.iters


def _shifted_where(where: dict, mbs: int) -> dict:
  return {(rank, key.shifted(mbs)): pos for (rank, key), pos in where.items()}


def _mb_shift(ticks, t: int, u: int) -> int | None:
  """The microbatch shift from tick t's first task to tick u's, if both have one."""
  a = next((x for ts in ticks[t] for x in ts), None)
  b = next((x for ts in ticks[u] for x in ts), None)
  return None if a is None or b is None else b.mb - a.mb


def _same_shape(prog: Any, t: int, u: int, mbs: int) -> bool:
  """Whether tick u runs tick t's tasks `mbs` microbatches later and lays out its values,
  messages and gradient sums the same way."""
  ticks = prog.plan.ticks
  for xs, ys in zip(ticks[t], ticks[u]):
    if [(x.region, x.pass_, x.mb + mbs) for x in xs] != [(y.region, y.pass_, y.mb) for y in ys]:
      return False
  ia, ib = prog.ticks[t], prog.ticks[u]
  if ia.grads != ib.grads or prog.buckets.get(t) or prog.buckets.get(u):
    return False
  if (ia.keep_positions != ib.keep_positions
      or _shifted_where(ia.keep_where, mbs) != ib.keep_where):
    return False
  if len(ia.rounds) != len(ib.rounds):
    return False
  return all(a.perm == b.perm and a.positions == b.positions
             and _shifted_where(a.where, mbs) == b.where for a, b in zip(ia.rounds, ib.rounds))


def _reads(prog: Any, t: int) -> list[tuple]:
  """(value key, rank, location or None) of every read by tick t's tasks."""
  return [(key, rank, prog.loc.get((key, rank))) for rank, xs in enumerate(prog.plan.ticks[t])
          for x in xs for key in prog.task_reads(x)]


def _farthest(reads: list[tuple], t: int) -> int:
  """How many ticks back tick t (with `reads`) reads its oldest value; 0 if none."""
  return max((t - loc.tick for _, _, loc in reads if loc is not None and loc.tick < t), default=0)


def _same_reads(prog: Any, reads: list, t: int, u: int, mbs: int) -> bool:
  """Whether tick u reads each value from where tick t read its counterpart, u - t later."""
  for key, rank, a in reads[t]:
    b = prog.loc.get((key.shifted(mbs), rank))
    if (a is None) != (b is None) or (a is not None and a.shifted(u - t) != b):
      return False
  return True


def _fit(prog: Any, reads: list, far: list, start: int, end: int, period: int, mbs: int,
         regular: int, min_iters: int, depth: int = 1, floor: int = 0) -> Window | None:
  """The loop over ticks [start, end) that removes the most ticks, more than `floor`;
  they repeat every `period` ticks with `mbs` microbatches' shift and read regularly
  from tick `regular`. `reads[t]` and `far[t]` are `_reads` and `_farthest` of tick t."""
  best = None
  for length in range(period, (end - start) // min_iters + 1, period):
    if start + length < regular:
      continue  # the second iteration's reads would not repeat
    if ((end - start) // length - 1) * length <= max(floor, _saved(best) if best else 0):
      continue  # even every iteration that fits would not remove more ticks
    if max(far[start + length:end], default=0) >= length * depth:
      # A value read `length` ticks after it is made would be read by the tick that
      # makes its successor, one switch reading the carried buffer and writing the
      # new value, which XLA then copies into it every iteration; farther, it would
      # cross more than one iteration (`depth` > 1 allows that, a copy per iteration
      # and slot).
      continue
    w = _loop_of(prog, reads, start, end, length, mbs * length // period, min_iters, depth)
    if w and (best is None or _saved(w) > _saved(best)):
      best = w
  return best


def _saved(w: Window) -> int:
  return (w.iters - 1) * w.length


def _carried(prog: Any, reads: list, start: int, length: int, shift: int, iters: int,
             depth: int) -> tuple[dict, dict] | None:
  """(body, entry) of a loop of `iters` iterations over ticks [start, start + length):
  where the body reads each value, and per carried location what each rank's first
  iteration finds there; None if the reads do not repeat or reach more than `depth`
  iterations back."""
  body, entry = {}, {}
  for t in range(start, start + length):
    for key, rank, real in reads[t]:
      nxt = prog.loc.get((key.shifted(shift), rank))
      if (real is None) != (nxt is None):
        return None
      if real is None:
        continue
      loc = body[(key, rank)] = nxt.shifted(-length)
      if loc.tick >= start:
        if loc != real:  # made inside the first iteration, so where the body makes it
          return None
        continue
      back = -((loc.tick - start) // length)  # made `back` iterations before
      made = loc.shifted(back * length)  # where the body makes it
      if back > min(depth, iters) or prog.loc.get((key.shifted(back * shift), rank)) != made:
        # The value `back` iterations later must be the one made here; and a slot
        # deeper than the loop's iterations would come out of it as a value of a tick
        # before the loop.
        return None
      for k in range(1, back + 1):
        # The carry holds the values of the last `back` iterations, one slot deeper each
        # iteration; in the first, slot k holds what iteration back - k reads here.
        first = prog.loc.get((key.shifted((back - k) * shift), rank))
        if (first is None or first.tick >= start
            or prog.loc_signature(first) != prog.loc_signature(made)):
          return None
        if entry.setdefault(made.shifted(-k * length), {}).setdefault(rank, first) != first:
          return None
  return body, entry


def _loop_of(prog: Any, reads: list, start: int, end: int, length: int, shift: int,
             min_iters: int, depth: int = 1) -> Window | None:
  """The most iterations of ticks [start, start + length) within [start, end)."""
  for iters in range((end - start) // length, min_iters - 1, -1):
    stop = start + iters * length
    found = _carried(prog, reads, start, length, shift, iters, depth)
    if found is None:
      continue
    body, entry = found
    carry = sorted(entry, key=str)
    after = {loc.shifted(iters * length) for loc in carry}  # the carry's last values
    later = {loc for t in range(stop, len(reads)) for _, _, loc in reads[t]
             if loc is not None and start <= loc.tick < stop}
    if any(loc.tick < stop - length and loc not in after for loc in later):
      continue  # a value of an earlier iteration is read after the loop
    carried = {loc.shifted(length) for loc in carry}
    exits = sorted({loc.shifted(-(iters - 1) * length) for loc in later
                    if loc.tick >= stop - length} - carried, key=str)
    return Window(start, length, iters, shift, tuple(sorted(body.items(), key=str)),
                  tuple(carry), tuple(tuple(sorted(entry[loc].items())) for loc in carry),
                  tuple(exits))
  return None


def find_window(prog: Any, min_iters: int = 2, max_period: int = 4,
                max_depth: int = 1) -> Window | None:
  """The steady-state window that removes the most ticks from the unrolled program: one
  whose values live less than an iteration if there is one, else one that carries
  values up to `max_depth` iterations, copied one slot deeper each iteration (from 2
  on, a body may also read a carried value in the tick that makes its successor:
  another copy)."""
  n = len(prog.plan.ticks)
  reads = [_reads(prog, t) for t in range(n)]
  far = [_farthest(r, t) for t, r in enumerate(reads)]
  for depth in range(1, max_depth + 1):
    w = _find_window(prog, reads, far, min_iters, max_period, depth)
    if w is not None:
      return w
  return None


def _find_window(prog: Any, reads: list, far: list, min_iters: int, max_period: int,
                 depth: int) -> Window | None:
  n = len(reads)
  best = None
  for period in range(1, max_period + 1):
    t = 0
    while t + period < n:
      mbs = _mb_shift(prog.plan.ticks, t, t + period)
      if mbs is None or not _same_shape(prog, t, t + period, mbs):
        t += 1
        continue
      e = t  # ticks t..e + period repeat
      while e + 1 + period < n and _same_shape(prog, e + 1, e + 1 + period, mbs):
        e += 1
      regular = e + 1  # reads repeat from tick `regular` on
      while regular > t and _same_reads(prog, reads, regular - 1, regular - 1 + period, mbs):
        regular -= 1
      for start in range(t, regular + 1):
        w = _fit(prog, reads, far, start, e + period + 1, period, mbs, regular, min_iters,
                 depth, _saved(best) if best else 0)
        if w and (best is None or _saved(w) > _saved(best)):
          best = w
      t = e + 1
  return best
