"""The plan as data: which task each pipeline rank runs in each tick, and where its values live.

`TickLoop` lowers a ticked plan as one loop over its ticks whose body holds each
region's F, B, BI and BW once, whatever the schedule or the number of microbatches.
What changes from tick to tick is data, built here (numpy, no JAX):

* per tick (one iteration of the loop), rank and slot, the task kind to run and its
  microbatch: a tick runs its `n_slots` slots in order (a rank's tasks of the tick,
  then nothing), each through the same `lax.switch` over all kinds;
* every value a task makes or reads (an activation, a stored residual, a cotangent, a
  weight-gradient residual) lives in a `Store`, one per (shape, dtype): a buffer of
  `depth` rows plus one scratch row that values nobody reads are written to. Rows are
  given to values for the ticks they are live, so a store holds the values that are
  live at once, not one row per microbatch;
* the values ranks exchange travel in `Round`s, one `ppermute` each as a tick ends,
  written into the receiver's store; a rank with nothing to send in a round sends its
  scratch row. Ranks meet once per tick, not once per task, as in the per-tick lowering.

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
  """One `ppermute` as each tick ends: pairs (source rank, destination rank), each rank
  at most once on each side, and the store of each value position it carries."""

  perm: tuple[tuple[int, int], ...]
  stores: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ScheduleTable:
  """A ticked plan as arrays indexed [tick, rank, slot, ...] (see the module docstring).

  code[t, k, s]: 1 + the index in `kinds` of the task rank k runs in slot s of tick t,
  or 0 for none; mb: its microbatch; read_rows[t, k, s, n] /
  write_rows[t, k, s, n]: the rows of its n-th read and made value in their stores;
  send_rows[t, k, j, n]: the row rank k sends at position n of round j in tick t (its
  scratch row if it sends nothing there); recv_rows[t, k, j, n]: the row rank k writes
  what it receives there into, as the tick ends.
  """

  kinds: tuple[TaskKind, ...]
  stores: tuple[Store, ...]
  rounds: tuple[Round, ...]
  code: np.ndarray
  mb: np.ndarray
  read_rows: np.ndarray
  write_rows: np.ndarray
  send_rows: np.ndarray
  recv_rows: np.ndarray

  @property
  def n_iterations(self) -> int:
    return self.code.shape[0]

  @property
  def n_slots(self) -> int:
    return self.code.shape[2]

  def kind_index(self, region: int, pass_) -> int:
    return next(i for i, k in enumerate(self.kinds) if (k.region, k.pass_) == (region, pass_))

  def slot_of(self, tick: int, rank: int, slot: int) -> TaskKind | None:
    """The kind rank `rank` runs in `slot` of `tick`, or None."""
    c = int(self.code[tick, rank, slot])
    return self.kinds[c - 1] if c else None


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
                produces: Callable[[Any], list], signature: Callable[[Hashable], tuple]
                ) -> ScheduleTable:
  """The table of `ticks` ([tick][rank] -> tasks with `region`, `pass_`, `mb`).

  reads(task) / produces(task): the keys of the values a task reads / makes;
  signature(key): the value's (shape, dtype). Raises
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

  # Slots: each rank's tasks of a tick in order, then nothing.
  n_slots = max([len(ts) for tick in ticks for ts in tick] + [1])
  task = {(ti, r, s): t for ti, tick in enumerate(ticks) for r, ts in enumerate(tick)
          for s, t in enumerate(ts)}   # (tick, rank, slot) -> task

  # Times: slot s of tick t runs at 2 (t S + s); a tick's rounds read what they send and
  # write what they receive as it ends, at 2 (t S + S - 1) + 1.
  def at(ti: int, s: int) -> int:
    return 2 * (ti * n_slots + s)

  made: dict[Hashable, tuple[int, int, int]] = {}  # key -> (rank, tick, slot)
  used: dict[tuple[Hashable, int], int] = {}       # (key, rank) -> last read time
  first: dict[tuple[Hashable, int], int] = {}      # (key, rank) -> first read time
  for (ti, rank, s), t in sorted(task.items(), key=lambda x: x[0]):
    for k in reads(t):
      used[(k, rank)] = max(used.get((k, rank), at(ti, s)), at(ti, s))
      first[(k, rank)] = min(first.get((k, rank), at(ti, s)), at(ti, s))
    for k in produces(t):
      made[k] = (rank, ti, s)
  lives: dict[tuple[Hashable, int], _Life] = {}
  sends: dict[tuple[int, int, int], list] = {}  # (tick, src, dst) -> keys
  for k, (rank, ti, s) in made.items():
    lives[(k, rank)] = _Life(k, store_of(k), at(ti, s), used.get((k, rank), at(ti, s)))
  readers_of: dict[Hashable, list[int]] = {}
  for (k, r) in used:
    readers_of.setdefault(k, []).append(r)
  for k, rs in readers_of.items():
    if k not in made:
      raise ValueError(f"value {k} is read but no task makes it")
    src, ti, s = made[k]
    for r in sorted(set(rs)):
      if r == src:
        if first[(k, r)] <= at(ti, s):
          raise ValueError(f"value {k} is read on rank {r} before it is made")
        continue
      arrive = at(ti, n_slots - 1) + 1
      if first[(k, r)] <= arrive:
        raise ValueError(f"value {k} is read on rank {r} in the tick it is made on rank {src}"
                         if first[(k, r)] >= at(ti, 0) else
                         f"value {k} is read on rank {r} before it is made on rank {src}")
      sends.setdefault((ti, src, r), []).append(k)
      # The sender's row stays until its round reads it, as the tick ends.
      lives[(k, src)].end = max(lives[(k, src)].end, arrive)
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

  n_it = len(ticks)
  n_reads = max([len(k.reads) for k in kind_list] + [1])
  n_writes = max([len(k.writes) for k in kind_list] + [1])
  code = np.zeros((n_it, n_ranks, n_slots), np.int32)
  mb = np.zeros((n_it, n_ranks, n_slots), np.int32)
  read_rows = np.zeros((n_it, n_ranks, n_slots, n_reads), np.int32)
  write_rows = np.zeros((n_it, n_ranks, n_slots, n_writes), np.int32)
  for (ti, rank, s), t in task.items():
    code[ti, rank, s] = 1 + kind_id[(t.region, t.pass_)]
    mb[ti, rank, s] = t.mb
    for n, k in enumerate(reads(t)):
      read_rows[ti, rank, s, n] = row(k, rank)
    for n, k in enumerate(produces(t)):
      write_rows[ti, rank, s, n] = row(k, rank)

  rounds = []
  for perm in pair_rounds({(a, b) for (_, a, b) in sends}):
    per_sender = [[store_of(k) for k in keys] for (_, a, b), keys in sends.items()
                  if (a, b) in perm]
    rounds.append(Round(tuple(perm), tuple(_positions(per_sender))))
  n_pos = max([len(r.stores) for r in rounds] + [1])
  send_rows = np.zeros((n_it, n_ranks, max(len(rounds), 1), n_pos), np.int32)
  recv_rows = np.zeros_like(send_rows)
  for j, rnd in enumerate(rounds):
    for n, st in enumerate(rnd.stores):
      send_rows[:, :, j, n] = stores[st].scratch
      recv_rows[:, :, j, n] = stores[st].scratch
    for (ti, a, b), keys in sends.items():
      if (a, b) not in rnd.perm:
        continue
      taken: set[int] = set()
      for k in keys:
        n = next(n for n, st in enumerate(rnd.stores) if st == store_of(k) and n not in taken)
        taken.add(n)
        send_rows[ti, a, j, n] = row(k, a)
        recv_rows[ti, b, j, n] = row(k, b)
  return ScheduleTable(tuple(kind_list), stores, tuple(rounds), code, mb, read_rows,
                       write_rows, send_rows, recv_rows)
