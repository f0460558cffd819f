"""A pipeline step as one loop over its ticks, the plan as data (`schedule_table`).

An iteration is one tick. It runs the table's slots in an inner loop around one
`lax.switch` whose branches are the task kinds (a region's F, B, BI or BW), each once;
the table says which branch each pipeline rank takes in each slot, on which microbatch,
and which rows of the value stores it reads and writes. Then come the table's rounds
of `ppermute`, each rank sending the rows the table names (its scratch rows when it
has nothing to send), and what the tick received is written into the stores. Ranks
meet once per tick; the slots' loop holds no collective of its own,
so on GPUs it runs as one CUDA graph. The compiled program's size does not grow with
the number of microbatches, ticks or tasks per tick: warm-up and cool-down are
iterations like the others.

After each slot's switch come the table's regroups: expert parallel's all-to-alls, on
every device, on rows of the stores (scratch rows where the slot made nothing to
regroup), so that no branch holds them. Tensor parallel's all-reduces, which sit
between a pass's equations, run between the phases of a switch cut at them (`Phases`).
One rank whose slots repeat one microbatch's kinds (gradient accumulation) has no
switch: its collectives sit in the loop's body.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from piper_jax.ir.graph import Pass
from piper_jax.lowering.buffers import StepParams
from piper_jax.lowering.layout import signature
from piper_jax.lowering.phases import Phases
from piper_jax.lowering.schedule_table import ScheduleTable, TaskKind, build_table

if TYPE_CHECKING:
  from piper_jax.lowering.program import Program

__all__ = ["TickLoop"]

_GRAD_PASSES = (Pass.B, Pass.BW)


@dataclasses.dataclass
class LoopCarry:
  """What one tick hands the next: the stores' buffers (`Pools`), gradient sums and
  the loss."""

  stores: list
  acc: dict       # (slot, dtype) -> the rank's gradient segment (`GradientSums.zero_sums`)
  split_acc: dict  # split leaves' gradient positions -> sum
  loss: jax.Array


jax.tree_util.register_dataclass(LoopCarry, data_fields=["stores", "acc", "split_acc", "loss"],
                                 meta_fields=[])


def _at(a: jax.Array, *index) -> jax.Array:
  """`a[index]` for traced indices the table makes non-negative: one dynamic slice,
  without the wrap-around of negative indices (and the `jit` around
  `lax.dynamic_index_in_dim`) that indexing traces for every lookup."""
  n = len(index)
  x = lax.dynamic_slice(a, tuple(index) + (0,) * (a.ndim - n), (1,) * n + a.shape[n:],
                        allow_negative_indices=False)
  return x.reshape(a.shape[n:])


def _written(stores: list, values) -> list:
  """`stores` with each (store, value, row) of `values` written into that row."""
  stores = list(stores)
  for st, x, row in values:
    buf = stores[st]
    stores[st] = lax.dynamic_update_slice(buf, x.reshape((1, -1)), (row, 0),
                                          allow_negative_indices=False)
  return stores


def _operands(c: LoopCarry, params, batch: list, mb, read_rows: list, write_rows: list,
              offsets: dict | None) -> dict:
  """A branch's operands: the carry, the step's weights and batch, the slot's
  microbatch and store rows, each row its own scalar operand (`_columns`), and in a
  switch the weights' offsets in their segments (`_offsets`)."""
  return {"stores": c.stores, "acc": c.acc, "split_acc": c.split_acc, "loss": c.loss,
          "params": params, "batch": batch, "mb": mb, "read_rows": read_rows,
          "write_rows": write_rows, "offsets": offsets}


def _offsets(layout) -> dict:
  """Each offset at which a parameter leaf lies in its segment -> that offset as a
  scalar XLA cannot fold: a branch slices its weights at these, so that regions which
  trace alike (a stage's blocks, whose weights lie at other offsets of one slot) make
  identical kernels, compiled once, as `_columns` does for store rows. Only where
  slots switch: without a switch (gradient accumulation) XLA's CPU program copied the
  weights it sliced at these (over 8 CPU devices 1.4x plain `lax.scan`'s memory, 1.2x
  at static offsets)."""
  offsets = sorted({h.offset for h in layout.home})
  return dict(zip(offsets, lax.optimization_barrier([jnp.int32(o) for o in offsets])))


def _columns(rows: np.ndarray) -> list:
  """The table's rows of each read or write position (its last axis) as an array of
  their own: a kernel that reads a store row then takes the row as a parameter, not from
  a position of one vector fixed in its code, so that regions which trace alike (a
  model's middle blocks) make identical kernels, and the rows of every position are
  looked up by one kernel; XLA compiles each of those once."""
  return [jnp.asarray(rows[..., n]) for n in range(rows.shape[-1])]


# Bytes of a row up to which stores of one dtype may share a buffer whatever their size,
# and the padding that sharing may add, as a fraction of all the stores' bytes.
_SMALL_ROW = 16384
_SMALL_PADDING = 0.05


def _row(buf, row, store):
  """Store `store`'s value from `row` of its buffer (the row's first elements)."""
  x = lax.dynamic_slice(buf, (row, 0), (1, store.size), allow_negative_indices=False)
  return x.reshape(store.shape)


@dataclasses.dataclass(frozen=True)
class Pools:
  """The buffers the table's stores live in: stores whose values have one size and
  dtype share a buffer (those all-to-alls make apart from the others: `Store.regrouped`),
  each its own rows in it, and one scratch row for all (the last); so do those of one
  dtype whose rows are small (`_SMALL_ROW`), in rows as wide as the widest of them,
  where that pads the stores by little (`_SMALL_PADDING`: a model whose activations are
  all small keeps them apart).
  XLA compiles a kernel per buffer shape for its zero fill and its row writes, so fewer
  buffers compile faster (small stores, an MoE's router outputs and a layer norm's
  statistics, are many shapes of a few KiB); a value's rows hold it flat whatever its
  shape, from the row's first element.

  of[st]: store st's buffer; offset[st]: its first row there; rows[b]: buffer b's rows,
  scratch included; size[b], dtype[b]: its row's elements and dtype.
  """

  of: tuple[int, ...]
  offset: tuple[int, ...]
  rows: tuple[int, ...]
  size: tuple[int, ...]
  dtype: tuple[str, ...]

  @classmethod
  def of_stores(cls, stores) -> "Pools":
    index: dict[tuple, int] = {}
    of, offset, rows, size, dtype = [], [], [], [], []
    small = lambda st: st.size * np.dtype(st.dtype).itemsize <= _SMALL_ROW
    groups: dict[tuple, list] = {}
    for st in filter(small, stores):
      groups.setdefault((st.dtype, st.regrouped), []).append(st)
    budget = _SMALL_PADDING * sum(st.nbytes for st in stores)
    widest: dict[tuple, int] = {}
    for k, group in groups.items():
      width = max(st.size for st in group)
      padding = sum(st.depth * (width - st.size) for st in group) * np.dtype(k[0]).itemsize
      if len({st.size for st in group}) > 1 and padding <= budget:
        widest[k] = width
        budget -= padding
    for st in stores:
      n = widest.get((st.dtype, st.regrouped), st.size) if small(st) else st.size
      b = index.setdefault((n, st.dtype, st.regrouped), len(index))
      if b == len(rows):
        rows.append(1)
        size.append(n)
        dtype.append(st.dtype)
      of.append(b)
      offset.append(rows[b] - 1)
      rows[b] += st.depth
    return cls(tuple(of), tuple(offset), tuple(rows), tuple(size), tuple(dtype))

  def zeros(self) -> list:
    return [jnp.zeros((n, m), jnp.dtype(dt)) for n, m, dt in zip(self.rows, self.size, self.dtype)]

  def rows_of(self, stores, st: int, rows: np.ndarray) -> np.ndarray:
    """Store `st`'s `rows` (its scratch row among them) as rows of its buffer."""
    b = self.of[st]
    return np.where(rows >= stores[st].depth, self.rows[b] - 1, rows + self.offset[st])


class TickLoop:
  """Lowers `prog`'s plan as one `lax.fori_loop` over its ticks."""

  def __init__(self, prog: "Program"):
    self.prog = prog
    self.table: ScheduleTable = build_table(
        prog.plan.ticks, prog.task_reads, prog.task_produces,
        lambda key: signature(prog.value_aval(key)), prog.made_from)
    # Per kind: its tasks in one occurrence, with microbatch 0 (the branch finds a
    # value's position in the table's rows by its key).
    self._tasks: list[list] = []
    for kind, (ti, r, n) in zip(self.table.kinds, self.table.first):
      ts = prog.plan.ticks[ti][r][n:n + len(kind.steps)]
      self._tasks.append([dataclasses.replace(t, mb=0) for t in ts])
    self.period = self.table.period
    # Gradient accumulation proper: each repeat hands its values on directly (`_direct`).
    self.direct = self.period is not None and self._direct()
    self.pools = Pools.of_stores(self.table.stores)
    self._pool_rows()
    # Tensor parallel's all-reduces sit between a pass's equations: a switch over kinds
    # is cut at them (`Phases`, made when the loop is traced).
    self.cuts_at_collectives = "tp" in prog.plan.mesh.inner and self.period is None
    self.phases: Phases | None = None

  def _pool_rows(self):
    """The table's rows as rows of the stores' buffers (`Pools`)."""
    table, pools = self.table, self.pools
    stores = table.stores
    self.read_rows, self.write_rows = table.read_rows.copy(), table.write_rows.copy()
    for j, kind in enumerate(table.kinds):
      at = table.code == j + 1
      for rows, of in ((self.read_rows, kind.reads), (self.write_rows, kind.writes)):
        for n, st in enumerate(of):
          rows[..., n][at] = pools.rows_of(stores, st, rows[..., n][at])
    self.send_rows, self.recv_rows = table.send_rows.copy(), table.recv_rows.copy()
    for j, rnd in enumerate(table.rounds):
      for n, st in enumerate(rnd.stores):
        for rows in (self.send_rows, self.recv_rows):
          rows[:, :, j, n] = pools.rows_of(stores, st, rows[:, :, j, n])
    self.regroup_rows = table.regroup_rows.copy()
    for n, g in enumerate(table.regroups):
      for side, st in enumerate((g.source, g.target)):
        self.regroup_rows[..., n, side] = pools.rows_of(stores, st, self.regroup_rows[..., n, side])

  # -- the branches ---------------------------------------------------------

  def _branch(self, i: int, kind: TaskKind):
    prog = self.prog
    layout = prog.layout
    tasks = self._tasks[i]
    rank = prog.plan.mesh.region_rank[tasks[0].region]
    where = {prog.task_reads(tasks[j])[n]: x for x, (j, n) in enumerate(kind.read_at)}
    write_keys = [prog.task_produces(tasks[j])[n] for j, n in kind.write_at]
    reads_params = set().union(*(prog.model.regions[t.region].params for t in tasks))

    def run(ops, made: dict | None = None):
      """The kind's tasks on the slot's operands. With `made` (a repeat that holds one
      microbatch's values, `_direct`): values come from and go to `made`, regrouped
      where read, and no store is touched."""
      stores = ops["stores"]
      direct = made is not None
      made = {} if made is None else made   # what the steps made, read by the steps after

      def read(key):
        if key in made:
          return made[key]
        if direct:  # made earlier in the repeat, or regrouped from such a value
          made[key] = prog.regroup(read(prog.made_from(key)), prog.value_aval(key))
          return made[key]
        x = where[key]
        st = kind.reads[x]
        return _row(stores[self.pools.of[st]], ops["read_rows"][x], self.table.stores[st])

      step_params: StepParams = ops["params"]
      own = step_params.own
      gathered = layout.zero == 3
      if gathered:  # these regions' segments and pieces, whole for the task
        segs, cast = prog.gather_segments(reads_params, own)
        params = {"params": segs, "cast": cast, "leaves": [],
                  "split": prog.gather_split_pieces(own.split, reads_params)}
      else:
        params = {"params": own, "cast": step_params.cast, "split": own.split,
                  "leaves": step_params.leaves}
      params["offsets"] = ops["offsets"]
      param = prog.param_reader(params, gathered)
      grad_acc: dict = {}
      loss = ops["loss"]
      for t in tasks:
        batch = [lax.dynamic_slice_in_dim(ops["batch"][b], ops["mb"] * prog.mbs, prog.mbs, 0,
                                          allow_negative_indices=False)
                 for b in prog.model.regions[t.region].batch]
        loss = loss + prog.run_task(t.region, t.pass_, 0, read, param, batch, made, grad_acc)
      dtype = lambda st: jnp.dtype(self.table.stores[st].dtype)
      written = [] if direct else [
          (self.pools.of[kind.writes[j]], made[key].astype(dtype(kind.writes[j])),
           ops["write_rows"][j]) for j, key in enumerate(write_keys)]
      acc, split_acc = dict(ops["acc"]), dict(ops["split_acc"])
      if any(t.pass_ in _GRAD_PASSES for t in tasks):
        prog.grads.add_task(rank, grad_acc, acc, split_acc)
      return LoopCarry(_written(stores, written), acc, split_acc, loss)

    return run

  def _idle(self, ops):
    return LoopCarry(ops["stores"], ops["acc"], ops["split_acc"], ops["loss"])

  def _run_straight(self, branches, params, batch, carry: LoopCarry) -> LoopCarry:
    """One rank whose slots repeat a short sequence of kinds (gradient accumulation):
    a loop over the repeats whose body runs that sequence's branches one after the
    other, with no switch, so that collectives inside tasks (ZeRO 2/3's, tensor
    parallel's) sit in the loop's body."""
    table, p = self.table, self.period
    flat = lambda a: jnp.asarray(a[:, 0].reshape((-1,) + a.shape[3:]))  # [tick * slot, ...]
    mb, regroup_rows = flat(table.mb), flat(self.regroup_rows)
    read_rows, write_rows = (_columns(a[:, 0].reshape((-1, a.shape[-1])))
                             for a in (self.read_rows, self.write_rows))
    seq = table.code[:, 0].reshape(-1)

    def repeat(i, c: LoopCarry) -> LoopCarry:
      for j, code in enumerate(seq[:p]):
        f = i * p + j
        if code:
          c = branches[code](_operands(c, params, batch, _at(mb, f),
                                       [_at(a, f) for a in read_rows],
                                       [_at(a, f) for a in write_rows], None))
        c = self._regroup(c, _at(regroup_rows, f))
      return c

    return lax.fori_loop(0, len(seq) // p, repeat, carry)

  def _direct(self) -> bool:
    """Whether each repeat of the straight loop is one microbatch's passes and reads
    only values made earlier in it (gradient accumulation): its values then pass from
    task to task as `lax.scan`'s body passes them, through no store."""
    table, p, prog = self.table, self.period, self.prog
    mb = table.mb[:, 0].reshape(-1, p)
    seq = table.code[:, 0].reshape(-1)[:p]
    live = seq > 0
    if not (mb[:, live] == mb[:, live][:, :1]).all():
      return False
    made: set = set()
    for code in seq[live]:
      for t in self._tasks[code - 1]:
        if any(prog.root(key) not in made for key in prog.task_reads(t)):
          return False
        made.update(prog.task_produces(t))
    return True

  def _run_direct(self, branches, params, batch, carry: LoopCarry) -> LoopCarry:
    """The straight loop whose repeats hold their own values (`_direct`): one repeat
    per microbatch, its branches one after the other on the values the earlier ones
    made; expert parallel's all-to-alls run where a value is read in the other layout."""
    table, p = self.table, self.period
    seq = table.code[:, 0].reshape(-1)
    mbs = jnp.asarray(table.mb[:, 0].reshape(-1, p)[:, int(np.argmax(seq[:p] > 0))])

    def repeat(i, c: LoopCarry) -> LoopCarry:
      made: dict = {}
      mb = _at(mbs, i)
      for code in seq[:p]:
        if code:
          c = branches[code](_operands(c, params, batch, mb, [], [], None), made)
      return c

    return lax.fori_loop(0, len(seq) // p, repeat, carry)

  def _regroup(self, c: LoopCarry, rows) -> LoopCarry:
    """The table's regroups after a slot, on the stores' rows `rows` gives: level by
    level, the positions of one level and dtype in one all-to-all (none of them reads
    what another writes), so that a slot launches as few as it can."""
    stores, table, of = list(c.stores), self.table, self.pools.of
    together: dict[tuple[int, str], list[int]] = {}
    for n, g in enumerate(table.regroups):
      together.setdefault((g.level, table.stores[g.source].dtype), []).append(n)
    for key in sorted(together):
      ns = together[key]
      gs = [table.regroups[n] for n in ns]
      xs = [_row(stores[of[g.source]], rows[n, 0], table.stores[g.source])
            for n, g in zip(ns, gs)]
      avals = [jax.ShapeDtypeStruct(table.stores[g.target].shape,
                                    jnp.dtype(table.stores[g.target].dtype)) for g in gs]
      ys = self.prog.regroup_together(xs, avals)
      stores = _written(stores, [(of[g.target], y, rows[n, 1]) for n, g, y in zip(ns, gs, ys)])
    return LoopCarry(stores, c.acc, c.split_acc, c.loss)

  def _switch(self, index, branches, ops):
    """`lax.switch` over the kinds; where tasks hold collectives (tensor parallel's),
    run phase by phase with the collectives between the phases (`Phases`)."""
    if not self.cuts_at_collectives:
      return lax.switch(index, branches, ops)
    if self.phases is None:
      self.phases = Phases(branches, ops)
    return self.phases.switch(index, ops)

  # -- the loop -------------------------------------------------------------

  def run(self, params: StepParams, batch: list, acc: dict, split_acc: dict,
          loss: jax.Array) -> LoopCarry:
    """All ticks of the plan from the given gradient sums and loss (sums of every
    position the step adds to must be present)."""
    table = self.table
    branches = [self._idle] + [self._branch(i, k) for i, k in enumerate(table.kinds)]
    # Each value lies flat in its row, [rows, size]: a row's reads and writes are then
    # two-dimensional whatever the value's rank, which XLA compiles into smaller kernels.
    if self.direct:
      return self._run_direct(branches, params, batch, LoopCarry([], acc, split_acc, loss))
    stores = self.pools.zeros()
    if self.period is not None:
      return self._run_straight(branches, params, batch, LoopCarry(stores, acc, split_acc, loss))
    code, mb, send_rows, recv_rows, regroup_rows = (
        jnp.asarray(x) for x in (table.code, table.mb, self.send_rows, self.recv_rows,
                                 self.regroup_rows))
    read_rows, write_rows = _columns(self.read_rows), _columns(self.write_rows)
    rank = lax.axis_index("pp")
    offsets = _offsets(self.prog.layout)

    def tick(i, c: LoopCarry) -> LoopCarry:
      def slot(s, c: LoopCarry) -> LoopCarry:
        at = lambda a: _at(a, i, rank, s)
        ops = _operands(c, params, batch, at(mb), [at(a) for a in read_rows],
                        [at(a) for a in write_rows], offsets)
        return self._regroup(self._switch(at(code), branches, ops), at(regroup_rows))

      c = lax.fori_loop(0, table.n_slots, slot, c) if table.n_slots > 1 else slot(0, c)
      of = self.pools.of
      got = [lax.ppermute([_at(c.stores[of[st]], _at(send_rows, i, rank, j, n))
                           for n, st in enumerate(rnd.stores)], "pp", perm=list(rnd.perm))
             for j, rnd in enumerate(table.rounds)]
      stores = _written(c.stores, [(of[st], got[j][n], _at(recv_rows, i, rank, j, n))
                                   for j, rnd in enumerate(table.rounds)
                                   for n, st in enumerate(rnd.stores)])
      return LoopCarry(stores, c.acc, c.split_acc, c.loss)

    return lax.fori_loop(0, table.n_iterations, tick,
                         LoopCarry(stores, acc, split_acc, loss))
