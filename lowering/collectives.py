"""The collectives a compiled step runs, read from its traced program.

The IR's passes say which communication a strategy needs (a region's gradients
all-reduced, ZeRO-3's gathers, ...); the lowering decides how it runs: gradients
in buckets or per slot, ZeRO-1/2's fp32 masters gathered in bf16 as the step
starts, a pipeline's exchanges as rounds of `ppermute`. This module reads what it
decided from the jaxpr of the step itself, so the report cannot drift from the
program: every collective equation, how many times a step runs it (loops with a
static trip count multiply it), and where (the `jax.named_scope`s the lowering
opens: the tick, the loop, the step's start or end). What XLA compiled of it is read
in `lowering/compiled.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from piper_jax.lowering.compat import ClosedJaxpr, Jaxpr, name_stack

__all__ = ["StepCollective", "step_collectives", "collectives_table"]

# Primitive names (jax 0.10-0.12) -> what the report calls them.
KINDS = {
    "psum": "all-reduce", "psum2": "all-reduce", "psum_invariant": "all-reduce",
    "pmax": "all-reduce (max)", "pmin": "all-reduce (min)",
    "reduce_scatter": "reduce-scatter", "psum_scatter": "reduce-scatter",
    "all_gather": "all-gather", "all_gather_invariant": "all-gather",
    "ppermute": "send/recv", "all_to_all": "all-to-all",
}
# Scopes the lowering opens; a collective's `where` keeps only these, outermost first.
SCOPE_PREFIX = "pj:"


@dataclasses.dataclass(frozen=True)
class StepCollective:
  """One collective equation of a compiled step.

  kind: "all-reduce", "reduce-scatter", "all-gather", "send/recv" or "all-to-all".
  axes: the mesh axes it runs over. nbytes: bytes of its operands on one device.
  count: how many times one step runs it (None inside a loop whose trip count is not
    static). where: the lowering's scopes around it ("tick 3", "tick loop", "step
    end", ...) and "one branch of a switch" when only the devices taking that branch
    run it.
  """

  kind: str
  axes: tuple[str, ...]
  nbytes: int
  count: int | None
  where: tuple[str, ...]


def _axes(params: dict) -> tuple[str, ...]:
  axes = params.get("axes", params.get("axis_name", ()))
  axes = axes if isinstance(axes, (tuple, list)) else (axes,)
  return tuple(str(a) for a in axes)


def _subjaxprs(eqn) -> Iterator[tuple[Jaxpr, int | None, str | None]]:
  """(jaxpr, trip count multiplier or None when unknown, label) of an equation's bodies."""
  name = eqn.primitive.name
  for key, val in eqn.params.items():
    vals = val if isinstance(val, (tuple, list)) else (val,)
    for v in vals:
      j = v.jaxpr if isinstance(v, ClosedJaxpr) else v if isinstance(v, Jaxpr) else None
      if j is None:
        continue
      if name == "scan":
        yield j, int(eqn.params["length"]), None
      elif name == "while":
        yield j, (None if key == "body_jaxpr" else 1), None
      elif name == "cond":
        yield j, 1, "one branch of a switch" if len(vals) > 1 else None
      else:
        yield j, 1, None


def _scopes(eqn) -> tuple[str, ...]:
  parts = name_stack(eqn).split("/")
  return tuple(p[len(SCOPE_PREFIX):] for p in parts if p.startswith(SCOPE_PREFIX))


def step_collectives(jaxpr) -> list[StepCollective]:
  """Every collective of a (closed) jaxpr, recursively through calls, loops and switches."""
  out: list[StepCollective] = []

  def walk(j: Jaxpr, count: int | None, outer: tuple[str, ...]):
    for eqn in j.eqns:
      kind = KINDS.get(eqn.primitive.name)
      if kind is not None:
        nbytes = sum(int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize
                     for v in eqn.invars if hasattr(v.aval, "shape"))
        where = outer + tuple(s for s in _scopes(eqn) if s not in outer)
        out.append(StepCollective(kind, _axes(eqn.params), nbytes, count, where))
        continue
      for sub, times, label in _subjaxprs(eqn):
        inner = outer + tuple(s for s in _scopes(eqn) if s not in outer)
        if label:
          inner = inner + (label,)
        walk(sub, None if count is None or times is None else count * times, inner)

  walk(jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr, 1, ())
  return out


def collectives_table(collectives: list[StepCollective]) -> str:
  """A step's collectives grouped by kind, axes and place: how many run per step and
  how many bytes each device sends into them."""
  groups: dict[tuple, list[StepCollective]] = {}
  for c in collectives:
    groups.setdefault((c.where, c.kind, c.axes), []).append(c)
  rows = [("where", "collective", "axes", "per step", "MB per device")]
  for (where, kind, axes), cs in groups.items():
    known = all(c.count is not None for c in cs)
    n = sum(c.count for c in cs) if known else None
    mb = sum(c.count * c.nbytes for c in cs) / 2**20 if known else None
    rows.append((" / ".join(where) or "step", kind, ",".join(axes),
                 "?" if n is None else str(n), "?" if mb is None else f"{mb:.2f}"))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  fmt = lambda r: " | ".join(x.ljust(w) for x, w in zip(r, widths))
  return "\n".join([fmt(rows[0]), "-+-".join("-" * w for w in widths)] + [fmt(r) for r in rows[1:]])
