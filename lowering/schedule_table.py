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
  scratch row. Ranks meet once per tick, not once per task;
* a value made from another by a collective among the devices of one rank (expert
  parallel's all-to-all, `made_from`) is made by a `Regroup` after the switch of the
  slot that made its source, on the source's rank: every slot runs the same regroups,
  on its scratch rows where it has nothing to regroup, so no branch holds a collective.

Value keys are whatever hashable keys the caller's `reads`, `produces` and `signature`
functions use; the table only needs that a task kind reads and makes values of the
same signatures, in the same order, for every microbatch.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Hashable, Sequence

import numpy as np

__all__ = ["TaskKind", "Store", "Round", "Regroup", "ScheduleTable", "build_table",
           "pair_rounds"]


@dataclasses.dataclass(frozen=True)
class TaskKind:
  """A branch of the loop's switch: tasks that run back to back on one rank and
  microbatch, each after the first reading a value one before it made (a stage's F and
  B in one tick, a rank's consecutive stages), for any microbatch. Values passed
  between its steps stay in registers of the branch; only the others use the stores.

  steps: (region, pass) of each step, in order.
  read_at / write_at: (step, position in that step's `reads(task)` / `produces(task)`)
  of each value it reads from / writes to a store.
  reads / writes: the store of each of those values.
  """

  steps: tuple[tuple[int, Any], ...]
  read_at: tuple[tuple[int, int], ...]
  write_at: tuple[tuple[int, int], ...]
  reads: tuple[int, ...]
  writes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Store:
  """A buffer of `depth` rows of one (shape, dtype), and a scratch row at index `depth`.
  `regrouped`: it holds the values expert parallel's all-to-alls make, apart from those
  they read: written after a switch from rows of the same buffer, a value regrouped in
  place made XLA's GPU compiler copy that whole buffer in every branch of the switch."""

  shape: tuple[int, ...]
  dtype: str
  depth: int
  regrouped: bool = False

  @property
  def scratch(self) -> int:
    return self.depth

  @property
  def size(self) -> int:
    """Elements of one value (one row)."""
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def nbytes(self) -> int:
    """Bytes of the buffer, scratch row included (every device allocates it)."""
    return (self.depth + 1) * self.size * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Round:
  """One `ppermute` as each tick ends: pairs (source rank, destination rank), each rank
  at most once on each side, and the store of each value position it carries."""

  perm: tuple[tuple[int, int], ...]
  stores: tuple[int, ...]


@dataclasses.dataclass(frozen=True, order=True)
class Regroup:
  """A position of the regroups every slot runs after its switch: a value of store
  `source` made into one of store `target`. Positions run in order, so that a value
  regrouped from one regrouped in the same slot (`level` one more) sees it."""

  level: int
  source: int
  target: int


@dataclasses.dataclass(frozen=True)
class ScheduleTable:
  """A ticked plan as arrays indexed [tick, rank, slot, ...] (see the module docstring).

  code[t, k, s]: 1 + the index in `kinds` of the tasks rank k runs in slot s of tick t,
  or 0 for none; mb: their microbatch; first[j]: (tick, rank, index in that rank's
  tasks of the tick) of the first task of one occurrence of kind j; read_rows[t, k, s, n] /
  write_rows[t, k, s, n]: the rows of its n-th read and made value in their stores;
  send_rows[t, k, j, n]: the row rank k sends at position n of round j in tick t (its
  scratch row if it sends nothing there); recv_rows[t, k, j, n]: the row rank k writes
  what it receives there into, as the tick ends; regroup_rows[t, k, s, n]: (source row,
  target row) of regroup position n after slot s (scratch rows where there is none).
  """

  kinds: tuple[TaskKind, ...]
  first: tuple[tuple[int, int, int], ...]
  stores: tuple[Store, ...]
  rounds: tuple[Round, ...]
  code: np.ndarray
  mb: np.ndarray
  read_rows: np.ndarray
  write_rows: np.ndarray
  send_rows: np.ndarray
  recv_rows: np.ndarray
  regroups: tuple[Regroup, ...] = ()
  regroup_rows: np.ndarray | None = None

  @property
  def n_iterations(self) -> int:
    return self.code.shape[0]

  @property
  def n_slots(self) -> int:
    return self.code.shape[2]

  @property
  def store_bytes(self) -> int:
    """Bytes of all stores: the same on every device, since one program runs every rank."""
    return sum(st.nbytes for st in self.stores)

  @property
  def period(self) -> int | None:
    """For a table of one rank: the length of the shortest sequence of slots' kinds that
    its slots repeat, if they repeat it at least twice and no kind runs more than twice
    in it (one microbatch's F and B of each region: gradient accumulation), else None
    (stages sharing the device, whose warm-up and cool-down would be written out). The
    loop then runs that sequence with no switch."""
    if self.code.shape[1] != 1:
      return None
    seq = self.code[:, 0].reshape(-1)
    for p in range(1, min(len(seq) // 2, 2 * len(self.kinds) + self.n_slots) + 1):
      if len(seq) % p == 0 and (seq.reshape(-1, p) == seq[:p]).all():
        return p
    return None

  def kind_index(self, *steps: tuple[int, Any]) -> int:
    """The index of the kind whose steps are `steps` ((region, pass) pairs)."""
    return next(i for i, k in enumerate(self.kinds) if k.steps == steps)

  def slot_of(self, tick: int, rank: int, slot: int) -> TaskKind | None:
    """The kind rank `rank` runs in `slot` of `tick`, or None."""
    c = int(self.code[tick, rank, slot])
    return self.kinds[c - 1] if c else None


@dataclasses.dataclass(frozen=True)
class _Group:
  """A slot's tasks on one rank in one tick, as one task of `kind`: the keys of the
  values it reads from and writes to stores, and its microbatch."""

  kind: TaskKind
  reads: list
  writes: list
  mb: int


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


def _positions(per_sender: Sequence[list]) -> list:
  """Stores of a round's positions (or any hashable kinds of position): enough of each
  for any sender's values."""
  need: dict[int, int] = {}
  for stores in per_sender:
    for s in set(stores):
      need[s] = max(need.get(s, 0), stores.count(s))
  return [s for s in sorted(need) for _ in range(need[s])]


def _cached(keys: Callable[[Any], list]) -> Callable[[Any], list]:
  """`keys`, called once per task (tasks are looked up by identity)."""
  memo: dict[int, tuple[Any, list]] = {}

  def get(task):
    hit = memo.get(id(task))
    if hit is None or hit[0] is not task:
      hit = memo[id(task)] = (task, keys(task))
    return hit[1]

  return get


def build_table(ticks: Sequence[Sequence[Sequence[Any]]], reads: Callable[[Any], list],
                produces: Callable[[Any], list], signature: Callable[[Hashable], tuple],
                made_from: Callable[[Hashable], Hashable | None] = lambda key: None
                ) -> ScheduleTable:
  """The table of `ticks` ([tick][rank] -> tasks with `region`, `pass_`, `mb`).

  reads(task) / produces(task): the keys of the values a task reads / makes;
  signature(key): the value's (shape, dtype); made_from(key): the key a value no task
  makes is regrouped from (see `Regroup`), or None. Raises ValueError when a value is
  read before it is made (on another rank: in the tick it is made), or a task kind's
  values differ in signature between microbatches.
  """
  n_ranks = len(ticks[0]) if ticks else 0
  sigs: dict[tuple, int] = {}
  reads, produces = _cached(reads), _cached(produces)

  groups, first_task = _group_tasks(ticks, reads, produces)
  derived = _regrouped(groups, reads, made_from)

  store: dict[Hashable, int] = {}   # each key's store, looked up once (16k lookups at 32 microbatches)

  def store_of(key) -> int:
    st = store.get(key)
    if st is None:
      st = store[key] = sigs.setdefault((tuple(signature(key)), key in derived), len(sigs))
    return st

  kind_list, first, task = _task_kinds(groups, first_task, reads, produces, store_of,
                                       set(derived.values()))
  n_slots = max([g[2] + 1 for g in groups] + [1])
  lives, used, sends, regroups = _value_lives(task, n_slots, store_of, derived)
  depth = _assign_rows(lives, used, n_ranks, len(sigs))
  sig_list = sorted(sigs, key=sigs.get)
  stores = tuple(Store(tuple(shape), str(dt), depth[j], regrouped)
                 for j, ((shape, dt), regrouped) in enumerate(sig_list))

  def row(key, rank) -> int:
    life = lives.get((key, rank))
    return stores[store_of(key)].scratch if life is None or life.row < 0 else life.row

  kind_id = {k.steps: j for j, k in enumerate(kind_list)}
  code, mb, read_rows, write_rows = _slot_arrays(task, kind_id, len(ticks), n_ranks, n_slots,
                                                 row)
  rounds, send_rows, recv_rows = _exchange_rounds(sends, stores, len(ticks), n_ranks,
                                                  store_of, row)
  positions, regroup_rows = _regroup_arrays(regroups, stores, len(ticks), n_ranks, n_slots,
                                            store_of, row)
  return ScheduleTable(tuple(kind_list), tuple(first), stores, tuple(rounds), code, mb,
                       read_rows, write_rows, send_rows, recv_rows, positions, regroup_rows)


def _regrouped(groups: dict, reads, made_from) -> dict:
  """Every value read that is regrouped from another (and those it is regrouped from,
  in turn) -> the key it is regrouped from."""
  derived: dict = {}
  todo = [k for ts in groups.values() for t in ts for k in reads(t)]
  while todo:
    key = todo.pop()
    if key in derived:
      continue
    src = made_from(key)
    if src is not None:
      derived[key] = src
      todo.append(src)
  return derived


def _group_tasks(ticks, reads, produces) -> tuple[dict, dict]:
  """Groups: a rank's tasks of a tick, cut where a task reads nothing the group made on
  its microbatch. A chain becomes one kind only where it holds most of each of its steps'
  runs (1F1B's last stage, F and B every tick): a kind's code is compiled once per kind
  it is part of, for rare chains of warm-up and cool-down too, which are cut into the
  kept chains they hold and single tasks (`_kept_parts`). Returns ((tick, rank, slot) ->
  tasks, (tick, rank, slot) -> index of its first task in the rank's tick)."""
  chains: list[tuple[int, int, list]] = []   # (tick, rank, tasks)
  for ti, tick in enumerate(ticks):
    for r, ts in enumerate(tick):
      made_here: set = set()
      for t in ts:
        if chains and chains[-1][:2] == (ti, r) and t.mb == chains[-1][2][0].mb and (
            made_here & set(reads(t))):
          chains[-1][2].append(t)
        else:
          chains.append((ti, r, [t]))
          made_here = set()
        made_here |= set(produces(t))
  runs = collections.Counter((t.region, t.pass_) for _, _, ts in chains for t in ts)
  pattern = collections.Counter(tuple((t.region, t.pass_) for t in ts) for _, _, ts in chains)
  kept = {steps for steps in pattern if all(2 * pattern[steps] > runs[st] for st in steps)}
  groups: dict[tuple[int, int, int], list] = {}   # (tick, rank, slot) -> tasks
  first_task: dict[tuple[int, int, int], int] = {}
  placed: dict[tuple[int, int], tuple[int, int]] = {}   # (tick, rank) -> (slots, tasks)
  for ti, r, ts in chains:
    for part in _kept_parts(ts, kept):
      slot, n = placed.get((ti, r), (0, 0))
      placed[(ti, r)] = (slot + 1, n + len(part))
      groups[(ti, r, slot)] = part
      first_task[(ti, r, slot)] = n
  return groups, first_task


def _kept_parts(ts: list, kept: set) -> list[list]:
  """A chain cut into kept chains where its steps run as one (left to right, the longest
  first) and single tasks elsewhere: warm-up's chains reuse the steady state's kinds
  instead of adding single kinds beside them, which would compile their code twice."""
  steps = [(t.region, t.pass_) for t in ts]
  parts, i = [], 0
  while i < len(ts):
    n = next((n for n in range(len(ts) - i, 1, -1) if tuple(steps[i:i + n]) in kept), 1)
    parts.append(ts[i:i + n])
    i += n
  return parts


def _task_kinds(groups: dict, first_task: dict, reads, produces, store_of, regrouped: set
                ) -> tuple[list, list, dict]:
  """Kinds: per sequence of steps, the values read from stores (not made by a step
  before) and written to them (read by another group in some tick, or `regrouped`;
  values nobody reads are not written). Returns (kinds, per kind its first (tick, rank, task index), and
  per (tick, rank, slot) its `_Group`)."""
  readers: dict[Hashable, set] = {}   # key -> the groups that read it
  for g, ts in groups.items():
    for t in ts:
      for k in reads(t):
        readers.setdefault(k, set()).add(g)

  def positions(ts) -> tuple[tuple, tuple]:
    made = {k: (i, n) for i, t in enumerate(ts) for n, k in enumerate(produces(t))}
    read_at = tuple((j, n) for j, t in enumerate(ts) for n, k in enumerate(reads(t))
                    if k not in made or made[k][0] >= j)
    return read_at, tuple(sorted(made.values()))

  # steps -> (read_at, stores read, made positions, their stores)
  shapes: dict[tuple, tuple] = {}
  outside: dict[tuple, set] = {}     # steps -> made positions some other group reads
  for g, ts in groups.items():
    steps = tuple((t.region, t.pass_) for t in ts)
    read_at, made_at = positions(ts)
    sig = (read_at, tuple(store_of(reads(ts[j])[n]) for j, n in read_at), made_at,
           tuple(store_of(produces(ts[i])[n]) for i, n in made_at))
    old = shapes.setdefault(steps, sig)
    if old != sig:
      raise ValueError(f"tasks {steps} read or make values of other shapes for microbatch "
                       f"{ts[0].mb} than for another microbatch")
    out = outside.setdefault(steps, set())
    for i, t in enumerate(ts):
      for n, k in enumerate(produces(t)):
        if readers.get(k, set()) - {g} or k in regrouped:
          out.add((i, n))
  kind_list = []
  for steps in sorted(shapes, key=str):
    read_at, read_stores, made_at, made_stores = shapes[steps]
    write_at = tuple(sorted(outside[steps]))
    kind_list.append(TaskKind(steps, read_at, write_at, read_stores,
                              tuple(made_stores[made_at.index(p)] for p in write_at)))
  kind_id = {k.steps: j for j, k in enumerate(kind_list)}
  first = [None] * len(kind_list)
  task: dict[tuple[int, int, int], _Group] = {}   # (tick, rank, slot) -> its group
  for g, ts in groups.items():
    j = kind_id[tuple((t.region, t.pass_) for t in ts)]
    kind = kind_list[j]
    if first[j] is None:
      first[j] = (g[0], g[1], first_task[g])
    task[g] = _Group(kind, [reads(ts[a])[n] for a, n in kind.read_at],
                     [produces(ts[a])[n] for a, n in kind.write_at], ts[0].mb)
  return kind_list, first, task


# Times: slot s of tick t runs at _AT * (t S + s); the regroups after it at that time
# plus 1 + their level; a tick's rounds read what they send and write what they receive
# as it ends, at the time of its last slot plus _AT - 1.
_AT = 8


def _value_lives(task: dict, n_slots: int, store_of, derived: dict
                 ) -> tuple[dict, dict, dict, dict]:
  """When each value is made and last read on each rank that holds it, the sends between
  ranks and the regroups. Returns ((key, rank) -> `_Life`, (key, rank) -> last read
  time, (tick, src, dst) -> keys, (tick, rank, slot) -> [(level, source key, key)])."""
  def at(ti: int, s: int) -> int:
    return _AT * (ti * n_slots + s)

  made: dict[Hashable, tuple[int, int, int]] = {}  # key -> (rank, tick, time)
  used: dict[tuple[Hashable, int], int] = {}       # (key, rank) -> last read time
  first_read: dict[tuple[Hashable, int], int] = {} # (key, rank) -> first read time

  def read_at(k, rank, time):
    used[(k, rank)] = max(used.get((k, rank), time), time)
    first_read[(k, rank)] = min(first_read.get((k, rank), time), time)

  for (ti, rank, s), group in sorted(task.items(), key=lambda x: x[0]):
    for k in group.reads:
      read_at(k, rank, at(ti, s))
    for k in group.writes:
      made[k] = (rank, ti, at(ti, s))
  regroups: dict[tuple[int, int, int], list] = {}
  level: dict[Hashable, int] = {}

  def place(key):
    """Regroups `key` on its source's rank, right after the source is made."""
    if key in made:
      return
    src = derived.get(key)
    if src is None:
      raise ValueError(f"value {key} is read but no task makes it")
    place(src)
    rank, ti, t = made[src]
    lvl = level[src] + 1 if src in level else 0
    if lvl >= _AT - 2:
      raise ValueError(f"value {key} is regrouped {lvl + 1} times in one slot")
    slot_time = t - t % _AT
    made[key], level[key] = (rank, ti, slot_time + 1 + lvl), lvl
    read_at(src, rank, slot_time + 1 + lvl)
    regroups.setdefault((ti, rank, slot_time // _AT - ti * n_slots), []).append((lvl, src, key))

  for key in derived:
    place(key)
  lives: dict[tuple[Hashable, int], _Life] = {}
  sends: dict[tuple[int, int, int], list] = {}  # (tick, src, dst) -> keys
  for k, (rank, ti, t) in made.items():
    lives[(k, rank)] = _Life(k, store_of(k), t, used.get((k, rank), t))
  readers_of: dict[Hashable, list[int]] = {}
  for (k, r) in used:
    readers_of.setdefault(k, []).append(r)
  for k, rs in readers_of.items():
    if k not in made:
      raise ValueError(f"value {k} is read but no task makes it")
    src, ti, t = made[k]
    for r in sorted(set(rs)):
      if r == src:
        if first_read[(k, r)] <= t:
          raise ValueError(f"value {k} is read on rank {r} before it is made")
        continue
      arrive = at(ti, n_slots - 1) + _AT - 1
      if first_read[(k, r)] <= arrive:
        raise ValueError(f"value {k} is read on rank {r} in the tick it is made on rank {src}"
                         if first_read[(k, r)] >= at(ti, 0) else
                         f"value {k} is read on rank {r} before it is made on rank {src}")
      sends.setdefault((ti, src, r), []).append(k)
      # The sender's row stays until its round reads it, as the tick ends.
      lives[(k, src)].end = max(lives[(k, src)].end, arrive)
      lives[(k, r)] = _Life(k, store_of(k), arrive, used[(k, r)])
  return lives, used, sends, regroups


def _assign_rows(lives: dict, used: dict, n_ranks: int, n_stores: int) -> list[int]:
  """Rows: per rank and store, a value takes the lowest row free for its whole life
  (sets each `_Life.row`); returns each store's depth, the most rows any rank needs."""
  depth = [0] * n_stores
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
  return depth


def _slot_arrays(task: dict, kind_id: dict, n_it: int, n_ranks: int, n_slots: int, row
                 ) -> tuple[np.ndarray, ...]:
  """Per (tick, rank, slot): the kind's code (0: idle), its microbatch, and the rows it
  reads and writes."""
  n_reads = max([len(g.reads) for g in task.values()] + [1])
  n_writes = max([len(g.writes) for g in task.values()] + [1])
  code = np.zeros((n_it, n_ranks, n_slots), np.int32)
  mb = np.zeros((n_it, n_ranks, n_slots), np.int32)
  read_rows = np.zeros((n_it, n_ranks, n_slots, n_reads), np.int32)
  write_rows = np.zeros((n_it, n_ranks, n_slots, n_writes), np.int32)
  for (ti, rank, s), group in task.items():
    code[ti, rank, s] = 1 + kind_id[group.kind.steps]
    mb[ti, rank, s] = group.mb
    for n, k in enumerate(group.reads):
      read_rows[ti, rank, s, n] = row(k, rank)
    for n, k in enumerate(group.writes):
      write_rows[ti, rank, s, n] = row(k, rank)
  return code, mb, read_rows, write_rows


def _exchange_rounds(sends: dict, stores: tuple, n_it: int, n_ranks: int, store_of, row
                     ) -> tuple[list, np.ndarray, np.ndarray]:
  """The rounds of `ppermute` and, per (tick, rank, round, position), the rows each rank
  sends and writes what it receives into (the store's scratch row where it has none)."""
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
        n = _take(rnd.stores, store_of(k), taken)
        send_rows[ti, a, j, n] = row(k, a)
        recv_rows[ti, b, j, n] = row(k, b)
  return rounds, send_rows, recv_rows


def _regroup_arrays(regroups: dict, stores: tuple, n_it: int, n_ranks: int, n_slots: int,
                    store_of, row) -> tuple[tuple, np.ndarray]:
  """The regroup positions every slot runs (per level and pair of stores, as many as
  any slot needs, lower levels first) and per (tick, rank, slot, position) the rows
  they read and write (scratch rows where a slot has none there)."""
  kind = lambda lvl, src, key: Regroup(lvl, store_of(src), store_of(key))
  positions = tuple(_positions([[kind(*item) for item in items]
                                for items in regroups.values()]))
  rows = np.zeros((n_it, n_ranks, n_slots, max(len(positions), 1), 2), np.int32)
  for n, g in enumerate(positions):
    rows[:, :, :, n] = (stores[g.source].scratch, stores[g.target].scratch)
  for (ti, rank, s), items in regroups.items():
    taken: set[int] = set()
    for lvl, src, key in items:
      rows[ti, rank, s, _take(positions, kind(lvl, src, key), taken)] = (row(src, rank),
                                                                        row(key, rank))
  return positions, rows


def _take(positions: Sequence, want, taken: set[int]) -> int:
  """The first position of kind `want` not yet `taken` (and takes it)."""
  n = next(n for n, x in enumerate(positions) if x == want and n not in taken)
  taken.add(n)
  return n
