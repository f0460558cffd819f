"""The plan as data: which task each pipeline rank runs in each tick, and where its values live.

`TickLoop` lowers a ticked plan as one loop over its ticks whose body holds each
region's F, B, BI and BW once, whatever the schedule or the number of microbatches.
What changes from tick to tick is data, built here (numpy, no JAX):

* per iteration (a sub-step of a tick: a rank may run several tasks in one tick) and
  rank, the task kind to run (an index into `kinds`, 0 for none) and its microbatch;
* every value a task makes or reads (an activation, a stored residual, a cotangent, a
  weight-gradient residual) lives in a `Store`, one per (shape, dtype): a buffer of
  `depth` rows plus one scratch row that values nobody reads are written to. Rows are
  given to values for the ticks they are live, so a store holds the values that are
  live at once, not one row per microbatch;
* the values ranks exchange travel in `Round`s, one `ppermute` each per iteration, at
  fixed positions; a rank with nothing to send sends its scratch row.

Value keys are whatever hashable keys the caller's `reads`, `produces` and `signature`
functions use; the table only needs that a task kind reads and makes values of the
same signatures, in the same order, for every microbatch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Sequence

import numpy as np

__all__ = ["TaskKind", "Store", "Round", "ScheduleTable", "build_table", "pair_rounds"]


@dataclasses.dataclass(frozen=True)
class TaskKind:
  """A branch of the loop's switch: one pass of one region, for any microbatch."""

  region: int
  pass_: Any
  reads: tuple[int, ...]     # the store of each value it reads, in `reads(task)`'s order
  writes: tuple[int, ...]    # the store of each value it makes, in `produces(task)`'s order


@dataclasses.dataclass(frozen=True)
class Store:
  """A buffer of `depth` rows of one (shape, dtype), and a scratch row at index `depth`."""

  shape: tuple[int, ...]
  dtype: str
  depth: int

  @property
  def scratch(self) -> int:
    return self.depth


@dataclasses.dataclass(frozen=True)
class Round:
  """One `ppermute` per iteration: pairs (source rank, destination rank), each rank at most
  once on each side, and the store of each value position it carries."""

  perm: tuple[tuple[int, int], ...]
  stores: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ScheduleTable:
  """A ticked plan as arrays indexed [iteration, rank, ...] (see the module docstring).

  The loop runs one iteration per sub-step of each tick (a tick has as many as its
  busiest rank has tasks); `tick[i]` / `sub[i]` say which, or -1 for an iteration
  added only to exchange values (see `overlap`).
  code[i, k]: 1 + the index in `kinds` of the task rank k runs in iteration i, or 0;
  mb: its microbatch; read_rows[i, k, n] / write_rows[i, k, n]: the rows of its n-th
  read and made value in their stores; send_rows[i, k, j, n]: the row rank k sends at
  position n of round j in iteration i (its scratch row if it sends nothing there);
  recv_rows[i, k, j, n]: the row rank k writes what it receives there into.

  overlap: False: an iteration's rounds send what its tasks made, after them. True:
  they send what the iteration before made, read as the iteration starts, so that the
  exchange runs beside the iteration's tasks; what is received is written after them.
  A value then reaches another rank two iterations after the one that makes it, and
  an empty iteration is added where a reader would otherwise wait for it.
  """

  kinds: tuple[TaskKind, ...]
  stores: tuple[Store, ...]
  rounds: tuple[Round, ...]
  tick: np.ndarray
  sub: np.ndarray
  code: np.ndarray
  mb: np.ndarray
  read_rows: np.ndarray
  write_rows: np.ndarray
  send_rows: np.ndarray
  recv_rows: np.ndarray
  overlap: bool = False

  @property
  def n_iterations(self) -> int:
    return self.code.shape[0]

  def kind_index(self, region: int, pass_) -> int:
    return next(i for i, k in enumerate(self.kinds) if (k.region, k.pass_) == (region, pass_))


@dataclasses.dataclass
class _Life:
  """Where one value lives on one rank: from the time it is written to its last use."""

  key: Hashable
  store: int
  start: int
  end: int
  row: int = -1


def pair_rounds(pairs: set[tuple[int, int]]) -> list[list[tuple[int, int]]]:
  """(source, destination) pairs in rounds where each rank sends and receives at most once."""
  rounds: list[list[tuple[int, int]]] = []
  for a, b in sorted(pairs):
    for rnd in rounds:
      if all(a != x and b != y for x, y in rnd):
        rnd.append((a, b))
        break
    else:
      rounds.append([(a, b)])
  return rounds


def _positions(per_sender: Sequence[list[int]]) -> list[int]:
  """Stores of a round's positions: enough of each store for any sender's values."""
  need: dict[int, int] = {}
  for stores in per_sender:
    for s in set(stores):
      need[s] = max(need.get(s, 0), stores.count(s))
  return [s for s in sorted(need) for _ in range(need[s])]


def build_table(ticks: Sequence[Sequence[Sequence[Any]]], reads: Callable[[Any], list],
                produces: Callable[[Any], list], signature: Callable[[Hashable], tuple],
                overlap: bool = False) -> ScheduleTable:
  """The table of `ticks` ([tick][rank] -> tasks with `region`, `pass_`, `mb`).

  reads(task) / produces(task): the keys of the values a task reads / makes;
  signature(key): the value's (shape, dtype); overlap: see `ScheduleTable`. Raises
  ValueError when a value is read before it is made (on another rank: in the tick it
  is made), or a task kind's values differ in signature between microbatches.
  """
  n_ranks = len(ticks[0]) if ticks else 0
  sigs: dict[tuple, int] = {}

  def store_of(key) -> int:
    return sigs.setdefault(tuple(signature(key)), len(sigs))

  # Task kinds and their stores, checked to be the same for every microbatch.
  kinds: dict[tuple, TaskKind] = {}
  for tick in ticks:
    for ts in tick:
      for t in ts:
        kind = TaskKind(t.region, t.pass_, tuple(store_of(k) for k in reads(t)),
                        tuple(store_of(k) for k in produces(t)))
        old = kinds.setdefault((t.region, t.pass_), kind)
        if old != kind:
          raise ValueError(f"region {t.region}'s {t.pass_} reads or makes values of other "
                           f"shapes for microbatch {t.mb} than for another microbatch")
  kind_list = sorted(kinds.values(), key=lambda k: (k.region, str(k.pass_)))
  kind_id = {(k.region, k.pass_): i for i, k in enumerate(kind_list)}

  # The iterations: a tick's sub-steps, in order.
  steps = [(ti, s) for ti, tick in enumerate(ticks)
           for s in range(max([len(ts) for ts in tick] + [1]))]
  made_at: dict[Hashable, tuple[int, int, int]] = {}   # key -> (rank, iteration, tick)
  for i, (ti, s) in enumerate(steps):
    for rank, ts in enumerate(ticks[ti]):
      if s < len(ts):
        for k in produces(ts[s]):
          made_at[k] = (rank, i, ti)
  if overlap:  # an empty iteration where another rank reads a value the iteration after
    late = set()
    for i, (ti, s) in enumerate(steps[1:]):
      for rank, ts in enumerate(ticks[ti]):
        if s < len(ts):
          late |= {made_at[k][1] for k in reads(ts[s])
                   if k in made_at and made_at[k][0] != rank and made_at[k][1] == i}
    steps = [x for i, st in enumerate(steps) for x in ([st, (-1, -1)] if i in late else [st])]
  task = {}   # (iteration, rank) -> task
  for i, (ti, s) in enumerate(steps):
    for rank, ts in enumerate(ticks[ti] if ti >= 0 else []):
      if s < len(ts):
        task[(i, rank)] = ts[s]

  # Times: iteration i's tasks run at 2i, its exchange lands at 2i + 1.
  made: dict[Hashable, tuple[int, int]] = {}       # key -> (rank, iteration)
  used: dict[tuple[Hashable, int], int] = {}       # (key, rank) -> last read time
  first: dict[tuple[Hashable, int], int] = {}      # (key, rank) -> first read time
  for (i, rank), t in sorted(task.items()):
    for k in reads(t):
      used[(k, rank)] = max(used.get((k, rank), 2 * i), 2 * i)
      first[(k, rank)] = min(first.get((k, rank), 2 * i), 2 * i)
    for k in produces(t):
      made[k] = (rank, i)
  lives: dict[tuple[Hashable, int], _Life] = {}
  sends: dict[tuple[int, int, int], list] = {}     # (iteration, src, dst) -> keys
  for k, (rank, i) in made.items():
    lives[(k, rank)] = _Life(k, store_of(k), 2 * i, used.get((k, rank), 2 * i))
  readers_of: dict[Hashable, list[int]] = {}
  for (k, r) in used:
    readers_of.setdefault(k, []).append(r)
  for k, rs in readers_of.items():
    if k not in made:
      raise ValueError(f"value {k} is read but no task makes it")
    src, i = made[k]
    for r in sorted(set(rs)):
      if r == src:
        if first[(k, r)] <= 2 * i:
          raise ValueError(f"value {k} is read on rank {r} before it is made")
        continue
      if steps[i][0] == steps[first[(k, r)] // 2][0]:
        raise ValueError(f"value {k} is read on rank {r} in the tick it is made on rank {src}")
      at = i + 1 if overlap else i     # the iteration whose rounds send it
      arrive = 2 * at + 1
      if first[(k, r)] <= arrive:
        raise ValueError(f"value {k} is read on rank {r} before it arrives from rank {src}")
      sends.setdefault((at, src, r), []).append(k)
      # The sender's row stays until the send reads it (overlap: as iteration `at` starts).
      lives[(k, src)].end = max(lives[(k, src)].end, 2 * at + (0 if overlap else 1))
      lives[(k, r)] = _Life(k, store_of(k), arrive, used[(k, r)])

  # Rows: per rank and store, a value takes the lowest row free for its whole life.
  stores_n = len(sigs)
  depth = [0] * stores_n
  for rank in range(n_ranks):
    free_at: dict[int, list[int]] = {}   # store -> per row, the time it is free after
    for life in sorted((x for (k, r), x in lives.items() if r == rank),
                       key=lambda x: (x.start, x.end)):
      if life.end == life.start and (life.key, rank) not in used:
        continue  # made and never read nor sent: written to the scratch row
      rows = free_at.setdefault(life.store, [])
      row = next((j for j, end in enumerate(rows) if end < life.start), None)
      if row is None:
        rows.append(life.end)
        row = len(rows) - 1
      rows[row] = life.end
      life.row = row
    for st, rows in free_at.items():
      depth[st] = max(depth[st], len(rows))
  sig_list = sorted(sigs, key=sigs.get)
  stores = tuple(Store(tuple(shape), str(dt), depth[j]) for j, (shape, dt) in enumerate(sig_list))

  def row(key, rank) -> int:
    life = lives.get((key, rank))
    return stores[store_of(key)].scratch if life is None or life.row < 0 else life.row

  n_it = len(steps)
  n_reads = max([len(k.reads) for k in kind_list] + [1])
  n_writes = max([len(k.writes) for k in kind_list] + [1])
  code = np.zeros((n_it, n_ranks), np.int32)
  mb = np.zeros((n_it, n_ranks), np.int32)
  read_rows = np.zeros((n_it, n_ranks, n_reads), np.int32)
  write_rows = np.zeros((n_it, n_ranks, n_writes), np.int32)
  for (i, rank), t in task.items():
    code[i, rank] = 1 + kind_id[(t.region, t.pass_)]
    mb[i, rank] = t.mb
    for n, k in enumerate(reads(t)):
      read_rows[i, rank, n] = row(k, rank)
    for n, k in enumerate(produces(t)):
      write_rows[i, rank, n] = row(k, rank)

  rounds = []
  for perm in pair_rounds({(a, b) for (_, a, b) in sends}):
    per_sender = [[store_of(k) for k in sends[(i, a, b)]]
                  for (i, a, b) in sends if (a, b) in perm]
    rounds.append(Round(tuple(perm), tuple(_positions(per_sender))))
  n_pos = max([len(r.stores) for r in rounds] + [1])
  send_rows = np.zeros((n_it, n_ranks, max(len(rounds), 1), n_pos), np.int32)
  recv_rows = np.zeros_like(send_rows)
  for j, rnd in enumerate(rounds):
    for n, st in enumerate(rnd.stores):
      send_rows[:, :, j, n] = stores[st].scratch
      recv_rows[:, :, j, n] = stores[st].scratch
    for (i, a, b), keys in sends.items():
      if (a, b) not in rnd.perm:
        continue
      taken: set[int] = set()
      for k in keys:
        n = next(n for n, st in enumerate(rnd.stores) if st == store_of(k) and n not in taken)
        taken.add(n)
        send_rows[i, a, j, n] = row(k, a)
        recv_rows[i, b, j, n] = row(k, b)
  tick = np.array([ti for ti, _ in steps], np.int32)
  sub = np.array([s for _, s in steps], np.int32)
  return ScheduleTable(tuple(kind_list), stores, tuple(rounds), tick, sub, code, mb, read_rows,
                       write_rows, send_rows, recv_rows, overlap)
