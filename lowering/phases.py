"""A slot's branches cut at their collectives, so that no conditional holds one.

Tensor parallel's all-reduces and gathers sit between the equations of a region's
pass (`local.eval_split` puts them there). In a loop whose slots switch between task
kinds, a branch that holds a collective keeps the conditional out of CUDA graphs (XLA
runs it from the host). `Phases` traces each branch once, inlines the calls that hold
its collectives, and cuts its equations at them into segments. A slot then runs as
phases: each phase one `lax.switch` over the kinds' segments, then the collectives of
that cut, outside the switch, on every device. What a segment made and a later one
reads is handed on as the switch's outputs, in positions per (shape, dtype), as many
as any kind needs at any cut and the same at every cut: a kind that does not run in a
phase passes them through untouched (positions made per cut, zero-filled by every
other kind, compiled 2x slower and took more memory on a GPU). A kind with fewer cuts
starts later (its first phases are empty), so that every kind ends in the last phase
and returns what its whole branch returns. A collective runs on zeros where a slot's
kind has nothing to send there: the devices of one collective share a pipeline rank and
take the same branch, and the others' results are not read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from piper_jax.lowering.collectives import KINDS
from piper_jax.lowering.compat import ClosedJaxpr, Jaxpr, Literal, bind

__all__ = ["Phases", "COLLECTIVES"]

# Primitives that make devices meet; a cut falls at each.
COLLECTIVES = frozenset(KINDS)
# Calls whose body is inlined when it holds a collective (its equations run as ours).
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call", "checkpoint", "remat"})


def _jaxprs(params: dict):
  """The jaxprs among an equation's parameters (cond's branches included)."""
  for v in params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      if isinstance(x, ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, Jaxpr):
        yield x


def _holds_collective(jaxpr) -> bool:
  return any(e.primitive.name in COLLECTIVES or any(_holds_collective(j) for j in _jaxprs(e.params))
             for e in jaxpr.eqns)


def _call_body(eqn) -> tuple[Any, Sequence[Any]] | None:
  """(jaxpr, consts) a call-like equation runs, if it holds a collective."""
  if eqn.primitive.name not in _CALLS:
    return None
  for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    j = eqn.params.get(name)
    body, consts = (j.jaxpr, j.consts) if isinstance(j, ClosedJaxpr) else (j, ())
    if (isinstance(body, Jaxpr) and len(body.invars) == len(eqn.invars)
        and len(body.constvars) == len(consts) and _holds_collective(body)):
      return body, consts
  return None


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One equation of the flattened branch: the keys (or literals) it reads and makes."""

  eqn: Any
  ins: tuple
  outs: tuple

  @property
  def collective(self) -> bool:
    return self.eqn.primitive.name in COLLECTIVES


class _Flat:
  """A closed jaxpr with the calls that hold collectives inlined: a list of entries over
  keys (frame, var); `inputs` and `outputs` are the top jaxpr's, `consts` every frame's."""

  def __init__(self, closed):
    self.entries: list[_Entry] = []
    self.consts: dict[Hashable, Any] = {}
    self._frames = 0
    self.inputs = [(0, v) for v in closed.jaxpr.invars]
    self.outputs = self._add(closed.jaxpr, closed.consts, None)

  def _add(self, jaxpr, consts, ins) -> list:
    f, self._frames = self._frames, self._frames + 1
    alias: dict = {} if ins is None else dict(zip(jaxpr.invars, ins))
    key = lambda v: v if isinstance(v, Literal) else alias.get(v, (f, v))
    for v, c in zip(jaxpr.constvars, consts):
      self.consts[(f, v)] = c
    for eqn in jaxpr.eqns:
      body = _call_body(eqn)
      if body is None:
        self.entries.append(_Entry(eqn, tuple(key(v) for v in eqn.invars),
                                   tuple((f, v) for v in eqn.outvars)))
        continue
      outs = self._add(body[0], body[1], [key(v) for v in eqn.invars])
      alias.update(zip(eqn.outvars, outs))
    return [key(v) for v in jaxpr.outvars]


def _aval_key(x) -> tuple:
  return (tuple(x.shape), jnp.dtype(x.dtype).name)


def _coll_key(entry: _Entry) -> tuple:
  """Collectives that can share a position: one primitive, parameters and operand shapes."""
  params = tuple(sorted((k, repr(v)) for k, v in entry.eqn.params.items()))
  return (entry.eqn.primitive.name, params,
          tuple(_aval_key(v.aval) for v in entry.eqn.invars))


@dataclasses.dataclass
class _Cut:
  """A kind's branch as segments: `segments[s]` entries run in its s-th phase, then the
  collectives `cuts[s]`; `carry[s]` the keys made up to cut s that later segments read."""

  flat: _Flat
  segments: list[list[_Entry]]
  cuts: list[list[_Entry]]
  carry: list[list[Hashable]]


# Equations a later phase redoes rather than receive their result, when they read only
# the branch's operands: reads of store rows and weights, layout changes, casts.
_REDO = frozenset({"slice", "dynamic_slice", "squeeze", "reshape", "expand_dims",
                   "broadcast_in_dim", "convert_element_type", "iota", "transpose"})
_SMALL = 1024  # elements: what any equation on the operands alone makes cheaply


def _redoable(flat: _Flat) -> dict[Hashable, _Entry]:
  """Keys made from the branch's operands alone by cheap equations -> their entry."""
  have = set(flat.inputs) | set(flat.consts)
  out: dict[Hashable, _Entry] = {}
  for e in flat.entries:
    small = all(math.prod(k[1].aval.shape) <= _SMALL for k in e.outs)
    if (e.collective or e.eqn.effects or not (e.eqn.primitive.name in _REDO or small)
        or any(_jaxprs(e.eqn.params)) and not small):
      continue
    if all(isinstance(k, Literal) or k in have or k in out for k in e.ins):
      out.update((k, e) for k in e.outs)
  return out


def _cut(flat: _Flat) -> _Cut | None:
  """Segments between collectives (consecutive collectives that do not read each other
  share a cut), or None where a collective sits inside a loop or conditional."""
  segments: list[list[_Entry]] = [[]]
  cuts: list[list[_Entry]] = []
  for e in flat.entries:
    if not e.collective:
      if any(_holds_collective(j) for j in _jaxprs(e.eqn.params)):
        return None
      segments[-1].append(e)
      continue
    made_at_cut = {k for c in cuts[-1] for k in c.outs} if cuts else set()
    if cuts and not segments[-1] and not any(k in made_at_cut for k in e.ins
                                             if not isinstance(k, Literal)):
      cuts[-1].append(e)
    else:
      cuts.append([e])
      segments.append([])
  redo = _redoable(flat)
  reads = lambda e: [k for k in e.ins if not isinstance(k, Literal)]
  order = {id(e): n for n, e in enumerate(flat.entries)}
  # Each later segment first redoes the operands-only values it reads but did not make.
  for s in range(1, len(segments)):
    made = {k for e in segments[s] for k in e.outs}
    want = [k for e in segments[s] + (cuts[s] if s < len(cuts) else []) for k in reads(e)]
    if s == len(segments) - 1:
      want += [k for k in flat.outputs if not isinstance(k, Literal)]
    need: dict[int, _Entry] = {}   # by position in the flattened branch
    todo = [k for k in want if k in redo and k not in made]
    while todo:
      e = redo[todo.pop()]
      if order[id(e)] not in need:
        need[order[id(e)]] = e
        todo += [k for k in reads(e) if k in redo]
    segments[s] = [need[n] for n in sorted(need)] + segments[s]
  # Times: segment s at 2s, cut s at 2s + 1; the branch's outputs are read at the end.
  made: dict[Hashable, int] = {}
  last: dict[Hashable, int] = {}
  for s, seg in enumerate(segments):
    for e in seg:
      for k in reads(e):
        last[k] = 2 * s
      for k in e.outs:
        made.setdefault(k, 2 * s)
    for c in (cuts[s] if s < len(cuts) else ()):
      for k in reads(c):
        last[k] = max(last.get(k, 0), 2 * s + 1)
      made.update((k, 2 * s + 1) for k in c.outs)
  end = 2 * len(segments)
  for k in flat.outputs:
    if not isinstance(k, Literal):
      last[k] = end
  # Every reader of a redoable value after its segment redoes it: it is never carried.
  carry = [[k for k in made if k not in redo and made[k] <= 2 * s and last.get(k, -1) > 2 * s + 1]
           for s in range(len(cuts))]
  return _Cut(flat, segments, cuts, carry)


def _positions(per_kind: Sequence[list]) -> list:
  """Position kinds: enough of each for any kind's items (in the order first seen)."""
  need: dict = {}
  for items in per_kind:
    counts: dict = {}
    for x in items:
      counts[x] = counts.get(x, 0) + 1
    for x, n in counts.items():
      need[x] = max(need.get(x, 0), n)
  return [x for x in need for _ in range(need[x])]


def _place(positions: list, items: list) -> list[int]:
  """The position of each item (the first free one of its kind)."""
  taken: set[int] = set()
  out = []
  for x in items:
    n = next(i for i, p in enumerate(positions) if p == x and i not in taken)
    taken.add(n)
    out.append(n)
  return out


class Phases:
  """The branches of one `lax.switch` as phases (see the module docstring).

  branches: the switch's branches (index 0 the idle one, never cut); ops: the operands
  one slot passes them (tracers of the step), from which each branch is traced once.
  """

  def __init__(self, branches: Sequence[Callable], ops):
    self.branches = list(branches)
    self.cut: dict[int, _Cut] = {}
    self.out_tree = None
    for i, fn in enumerate(self.branches[1:], 1):
      closed, shape = jax.make_jaxpr(fn, return_shape=True)(ops)
      self.out_tree = jax.tree_util.tree_structure(shape)
      flat = _Flat(closed)
      if any(e.collective for e in flat.entries) and (cut := _cut(flat)) is not None:
        self.cut[i] = cut
    self.n = 1 + max([len(c.cuts) for c in self.cut.values()] + [0])
    # Per cut of the slot (n - 1 of them): the collective positions and, per position,
    # a representative equation.
    self._coll_pos: list[list[tuple]] = []
    self._rep: list[list[Any]] = []
    for g in range(self.n - 1):
      colls = {i: [_coll_key(e) for e in self._at(i, g, "cuts")] for i in self.cut}
      self._coll_pos.append(_positions(list(colls.values())))
      rep = [None] * len(self._coll_pos[-1])
      for i in self.cut:
        for e, p in zip(self._at(i, g, "cuts"), _place(self._coll_pos[-1], colls[i])):
          rep[p] = e
      self._rep.append(rep)
    # What a kind hands on at a cut travels in positions per (shape, dtype), the same at
    # every cut, so that a kind not running in a phase passes them through untouched.
    self._carry_pos = _positions([[_aval_key(k[1].aval) for k in keys]
                                  for cut in self.cut.values() for keys in cut.carry])

  @property
  def cut_kinds(self) -> list[int]:
    """The branches that are cut (hold collectives)."""
    return sorted(self.cut)

  def _segment(self, i: int, phase: int) -> int:
    """Kind i's segment in `phase` (negative: it has not started)."""
    return phase - (self.n - 1 - len(self.cut[i].cuts))

  def _at(self, i: int, g: int, what: str) -> list:
    s = self._segment(i, g)
    return getattr(self.cut[i], what)[s] if s >= 0 else []

  def _empty_carry(self) -> list:
    return [jnp.zeros(shape, dtype) for shape, dtype in self._carry_pos]

  def _coll_zeros(self, g: int) -> list:
    return [[jnp.zeros(v.aval.shape, v.aval.dtype) for v in e.eqn.invars] for e in self._rep[g]]

  def _places(self, keys: list) -> list[int]:
    return _place(self._carry_pos, [_aval_key(k[1].aval) for k in keys])

  def _phase_fn(self, i: int, phase: int):
    """Kind i's branch in `phase`: (collective operands, carried values) at the cut
    after it, or in the last phase what the whole branch returns."""
    last = phase == self.n - 1
    if i not in self.cut or self._segment(i, phase) < 0:
      if last:
        return lambda x: self.branches[i](x[0])
      return lambda x: (self._coll_zeros(phase), x[1])
    cut = self.cut[i]

    def run(x):
      ops, carried, colls = x
      s = self._segment(i, phase)
      env = dict(cut.flat.consts)
      env.update(zip(cut.flat.inputs, jax.tree_util.tree_leaves(ops)))
      if s > 0:
        keys = cut.carry[s - 1]
        env.update((k, carried[p]) for k, p in zip(keys, self._places(keys)))
        entries = cut.cuts[s - 1]
        pos = _place(self._coll_pos[phase - 1], [_coll_key(e) for e in entries])
        for e, p in zip(entries, pos):
          env.update(zip(e.outs, colls[p]))
      read = lambda k: k.val if isinstance(k, Literal) else env[k]
      for e in cut.segments[s]:
        env.update(zip(e.outs, bind(e.eqn, [read(k) for k in e.ins])))
      if last:
        return jax.tree_util.tree_unflatten(self.out_tree, [read(k) for k in cut.flat.outputs])
      coll = self._coll_zeros(phase)
      entries = cut.cuts[s]
      for e, p in zip(entries, _place(self._coll_pos[phase], [_coll_key(e) for e in entries])):
        coll[p] = [read(k) for k in e.ins]
      out = list(carried)
      for k, p in zip(cut.carry[s], self._places(cut.carry[s])):
        out[p] = read(k)
      return coll, out

    return run

  def switch(self, index, ops):
    """What `lax.switch(index, branches, ops)` returns, run phase by phase with the
    collectives between the phases' switches."""
    carried, colls = self._empty_carry(), []
    for phase in range(self.n - 1):
      fns = [self._phase_fn(i, phase) for i in range(len(self.branches))]
      coll, carried = lax.switch(index, fns, (ops, carried, colls))
      colls = [bind(e.eqn, vals) for e, vals in zip(self._rep[phase], coll)]
    fns = [self._phase_fn(i, self.n - 1) for i in range(len(self.branches))]
    return lax.switch(index, fns, (ops, carried, colls))
