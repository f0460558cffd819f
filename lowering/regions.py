"""Forward-with-residuals and backward-from-residuals functions of one region.

F runs the region's vjp, traced once, and keeps its residuals as explicit arrays so
that B, running later (in another tick), can use them without recomputing the
forward. Residuals that are just an input or an output of the region are not stored
again (B reads them where they already live), and those that a few elementwise
equations make from what B has anyway are recomputed inside B's kernels.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from piper_jax.lowering.compat import ClosedJaxpr, Jaxpr, Literal, eval_eqns, read, wrapped_parts
from piper_jax.lowering.local import RegionRunner

__all__ = ["RegionAD", "analyze_region", "first_alike", "region_key", "relabel",
           "shared_analyses"]


# Equations cheap enough to redo in B instead of storing their result per microbatch:
# casts, layout changes, masks and elementwise arithmetic (a bf16 copy of a weight, a
# causal mask, GELU's intermediates, LayerNorm's normalized input, rotary tables). XLA fuses the redone
# equations into B's kernels, which then read one array where F stored several.
_CHEAP = frozenset({"convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze",
                    "expand_dims", "iota", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
                    "select_n", "copy", "slice", "neg", "add", "sub", "mul", "div", "max", "min",
                    "abs", "sign", "square", "sqrt", "rsqrt", "exp", "exp2", "log", "log1p", "expm1",
                    "tanh", "logistic", "erf", "erfc", "integer_pow", "pow", "clamp", "sin", "cos",
                    "floor", "ceil", "round", "is_finite", "reduce_precision",
                    "one_minus_square"})  # tanh's derivative, 1 - x^2, from jax 0.11
# At most this many equations are redone for one residual; longer chains are stored.
_MAX_CONE = 64


def _cheap(eqn) -> bool:
  if eqn.primitive.name in _CHEAP:
    return True
  if eqn.primitive.name in ("pjit", "jit", "closed_call"):
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    inner = getattr(inner, "jaxpr", inner)
    return inner is not None and all(_cheap(e) for e in inner.eqns)
  return False


def _cone(jaxpr, var, stop: set, defined: dict):
  """(equations, frontier): the cheap equations that compute `var` from values in `stop`
  and the frontier, the values they read that other equations make or that are inputs
  outside `stop`; None past _MAX_CONE equations."""
  cone, frontier, stack, seen = set(), [], [var], set()
  while stack:
    v = stack.pop()
    if isinstance(v, Literal) or v in seen or v in stop:
      continue
    seen.add(v)
    i = defined.get(v)
    if i is None or not _cheap(jaxpr.eqns[i]):
      frontier.append(v)
      continue
    cone.add(i)
    if len(cone) > _MAX_CONE:
      return None
    stack += list(jaxpr.eqns[i].invars)
  return cone, frontier


def _input(k: int, n_params: int, n_batch: int) -> tuple[str, int]:
  """("param"|"batch"|"act", index) of F's k-th input (params, then batch, then acts)."""
  if k < n_params:
    return "param", k
  if k < n_params + n_batch:
    return "batch", k - n_params
  return "act", k - n_params - n_batch


def _nbytes(v) -> int:
  return math.prod(v.aval.shape) * jnp.dtype(v.aval.dtype).itemsize


def _plan_recompute(jaxpr, values, stop: set, defined: dict, swap: bool):
  """Which of `values` a later pass recomputes from what it has (`stop`) and what is
  kept for it; with `swap`, also from a value kept in their place when that is no
  larger. Returns (kept values, equations to redo, recomputed values)."""
  # Values no cheap equation makes are kept whatever the order; others may be
  # recomputed from them.
  kept = list(dict.fromkeys(
      v for v in values if v not in stop
      and (v not in defined or not _cheap(jaxpr.eqns[defined[v]]))))
  stop = stop | set(kept)
  cones = {v: _cone(jaxpr, v, stop, defined) for v in values if v not in stop}
  # How many values' cones end at each value: one kept in place of one value of the
  # same size saves nothing, one that replaces several does.
  shared = collections.Counter(f for c in cones.values() if c for f in set(c[1]))
  redo, recomputed = set(), set()
  for v in values:
    if v in stop:
      continue
    found = _cone(jaxpr, v, stop, defined)
    new = [] if found is None else [f for f in found[1] if f not in stop]
    size = sum(map(_nbytes, new))
    if (found is None or v in found[1] or (new and not swap) or size > _nbytes(v)
        or (size == _nbytes(v) and any(shared[f] < 2 for f in new))):
      new = [v]
    else:
      redo |= found[0]
      recomputed.add(v)
    kept += new
    stop.update(new)
  return kept, redo, recomputed


@dataclasses.dataclass
class RegionAD:
  """What F stores for B.

  `alias[k]` is ("param"|"batch"|"act"|"out", index) for a residual that is an input
  or output of the region, ("recompute", var) for one that B recomputes from the
  inputs and the stored values, or None for one F stores. F stores the values `stored`
  (variables of `jaxpr`, F's traced vjp): the stored residuals and what B recomputes
  others from (a matmul's output, where GELU's backward would read four residuals).
  """

  region: int
  diff_params: list[int]    # positions (in the region's params) that get gradients
  diff_acts: list[int]      # positions (in the region's inputs) that get cotangents
  float_outs: list[int]     # outputs that receive cotangents
  other_outs: list[int]
  res_vars: list            # the vjp's residuals, as variables (or literals) of `jaxpr`
  alias: list[tuple[str, Any] | None]
  res_tree: Any
  jaxpr: Any = None         # F: (params, batch, acts) -> (float outs, other outs, residuals)
  consts: dict = dataclasses.field(default_factory=dict)
  stored: list = dataclasses.field(default_factory=list)
  recompute_eqns: list = dataclasses.field(default_factory=list)
  # Inputs and outputs of the region that recompute_eqns read: var -> (kind, index).
  recompute_inputs: dict = dataclasses.field(default_factory=dict)

  @property
  def res_avals(self) -> list[Any]:
    return [v.aval for v in self.res_vars]

  @property
  def stored_avals(self) -> list[Any]:
    return [v.aval for v in self.stored]

  @property
  def reads(self) -> list[tuple[str, int]]:
    """("act"|"out", index): the region's inputs and outputs B reads."""
    used = list(self.recompute_inputs.values()) + [a for a in self.alias if a]
    return sorted({a for a in used if a[0] in ("act", "out")})


def _fwd(runner: RegionRunner, r: int, diff_params, diff_acts, float_outs, params, batch, acts):
  def f(dp, da):
    p, a = list(params), list(acts)
    for k, i in enumerate(diff_params):
      p[i] = dp[k]
    for k, i in enumerate(diff_acts):
      a[i] = da[k]
    outs = runner.run(r, p, batch, a)
    return ([outs[k] for k in float_outs],
            [outs[k] for k in range(len(outs)) if k not in float_outs])

  dp = [params[i] for i in diff_params]
  da = [acts[i] for i in diff_acts]
  fl, vjp_fn, other = jax.vjp(f, dp, da, has_aux=True)
  res, tree = jax.tree_util.tree_flatten(vjp_fn)
  return fl, other, res, tree


def analyze_region(runner: RegionRunner, r: int, remat: bool = False) -> RegionAD:
  """Traces region `r`'s vjp once, abstractly, to learn its residuals: which are inputs
  or outputs of the region, which B can recompute, and what F must store.

  B recomputes a residual from the region's inputs and values F stores anyway; with
  `remat`, also from a value F stores in its place when that is no larger.

  Inputs and outputs in the all-to-all layout (expert parallel) are not read by B: the
  caller keeps them in the other layout.
  """
  spec = runner.spec.regions[r]
  p_avals, b_avals, a_avals = runner.avals(r)
  is_float = lambda a: jnp.issubdtype(a.dtype, jnp.inexact)
  diff_params = [i for i, a in enumerate(p_avals) if is_float(a)]
  diff_acts = [i for i, x in enumerate(spec.inputs) if x.differentiable]
  float_outs = [k for k, o in enumerate(spec.outputs) if jnp.issubdtype(jnp.dtype(o.dtype), jnp.inexact)]
  other_outs = [k for k in range(len(spec.outputs)) if k not in float_outs]
  box = {}

  def probe(params, batch, acts):
    fl, other, res, tree = _fwd(runner, r, diff_params, diff_acts, float_outs, params, batch, acts)
    box["tree"] = tree
    return fl, other, res

  closed = jax.make_jaxpr(probe, axis_env=runner.axis_env)(p_avals, b_avals, a_avals)
  jaxpr = closed.jaxpr
  n_p, n_b = len(p_avals), len(b_avals)
  io_local = runner.io_local(r)
  place = {}  # where B finds a value without F storing it
  for k, v in enumerate(jaxpr.invars):
    kind, i = _input(k, n_p, n_b)
    if not (io_local and kind == "act"):
      place.setdefault(v, (kind, i))
  n_out = len(float_outs) + len(other_outs)
  if not io_local:
    for k, v in zip(float_outs + other_outs, jaxpr.outvars[:n_out]):
      if not isinstance(v, Literal):
        place.setdefault(v, ("out", k))
  defined = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
  res_vars = jaxpr.outvars[n_out:]
  values = [v for v in res_vars if not isinstance(v, Literal) and v not in place]
  stored, recompute, recomputed = _plan_recompute(jaxpr, values, set(place) | set(jaxpr.constvars),
                                                  defined, remat)
  alias = [("recompute", v) if isinstance(v, Literal) or v in recomputed
           else place.get(v) for v in res_vars]
  eqns = [jaxpr.eqns[i] for i in sorted(recompute)]
  inputs = {v: place[v] for e in eqns for v in e.invars
            if not isinstance(v, Literal) and v in place}
  return RegionAD(r, diff_params, diff_acts, float_outs, other_outs, list(res_vars), alias,
                  box["tree"], jaxpr, dict(zip(jaxpr.constvars, closed.consts)), stored, eqns,
                  inputs)


# -- regions that trace alike ----------------------------------------------------

class _Ident:
  """A value compared by identity (jaxprs, functions, unhashable parameters)."""

  __slots__ = ("obj",)

  def __init__(self, obj):
    self.obj = obj

  def __eq__(self, other):
    return isinstance(other, _Ident) and other.obj is self.obj

  def __hash__(self):
    return id(self.obj)


_FUNCTION_DEPTH = 8  # closures nested deeper than this compare by identity


def _freeze(x, depth: int = 0):
  """A hashable stand-in for an equation parameter, equal only for values that trace alike."""
  if isinstance(x, ClosedJaxpr):
    return (ClosedJaxpr, _jaxpr_key(x.jaxpr, x.consts))
  if isinstance(x, Jaxpr):
    return (Jaxpr, _jaxpr_key(x, ()))
  if isinstance(x, (tuple, list)):
    return (type(x), tuple(_freeze(y, depth) for y in x))
  if isinstance(x, (set, frozenset)):
    return (frozenset, frozenset(_freeze(y, depth) for y in x))
  if isinstance(x, dict):
    return (dict, tuple((_freeze(k, depth), _freeze(v, depth))
                        for k, v in sorted(x.items(), key=lambda kv: repr(kv[0]))))
  if isinstance(x, np.ndarray):
    return (np.ndarray, x.dtype.str, x.shape, x.tobytes())
  if depth < _FUNCTION_DEPTH:
    # A custom derivative's rules are functions each trace wraps anew: the same code
    # over equal captured values computes the same thing.
    if isinstance(x, types.FunctionType) and x.__closure__:
      return (types.FunctionType, x.__code__, _Ident(x.__globals__),
              _freeze((x.__defaults__, x.__kwdefaults__), depth + 1),
              tuple(_freeze(_cell(c), depth + 1) for c in x.__closure__))
    if isinstance(x, functools.partial):
      return (functools.partial, _freeze((x.func, x.args, x.keywords), depth + 1))
    parts = wrapped_parts(x)
    if parts is not None:
      return (type(x), _freeze(parts, depth + 1))
  if type(x) is object:  # a sentinel holds nothing but its identity within its closure
    return (object,)
  try:
    hash(x)
  except TypeError:
    return _Ident(x)
  # Types are part of the key: 1, 1.0 and True are equal but may bind differently.
  return (type(x), x) if type(x).__eq__ is not object.__eq__ else _Ident(x)


def _cell(c):
  try:
    return c.cell_contents
  except ValueError:  # a variable not yet bound
    return _Ident(c)


def _array_key(x) -> tuple:
  a = np.asarray(x)
  return (type(x).__name__, a.dtype.str, a.shape, a.tobytes())


def _aval_key(a) -> tuple:
  return (tuple(a.shape), jnp.dtype(a.dtype).str)


def _eqn_key(e, ref) -> tuple:
  """An equation up to its variables' names and its source information, its inputs as
  `ref` names them."""
  return (e.primitive, _freeze(e.params), tuple(ref(v) for v in e.invars),
          tuple(_aval_key(v.aval) for v in e.outvars), _freeze(e.ctx), _freeze(e.effects))


def _jaxpr_key(jaxpr, consts) -> tuple:
  """A sub-jaxpr (a checkpoint's, a custom derivative's primal) by its structure: each
  trace of a block makes its own jaxpr objects, which must still key alike."""
  refs = {v: ("in", k) for k, v in enumerate(jaxpr.invars)}
  refs.update((v, ("const", k)) for k, v in enumerate(jaxpr.constvars))

  def ref(v):
    if isinstance(v, Literal):
      return ("literal", _array_key(v.val), _aval_key(v.aval))
    return refs[v]

  eqns = []
  for e in jaxpr.eqns:
    eqns.append(_eqn_key(e, ref))
    refs.update((v, ("eqn", len(refs))) for v in e.outvars)
  return (tuple(map(_aval_key, (v.aval for v in jaxpr.invars))), tuple(map(_array_key, consts)),
          tuple(eqns), tuple(ref(v) for v in jaxpr.outvars), _freeze(jaxpr.effects))


def region_key(runner: RegionRunner, r: int, remat: bool = False) -> tuple:
  """What `analyze_region(runner, r, remat)` depends on, up to the names of variables and
  the equations' source information: regions with equal keys trace to the same jaxprs
  (a pipeline's middle stages of equal transformer blocks)."""
  spec, reg = runner.spec.regions[r], runner.traced.regions[r]
  kind = runner.kind.get(r)
  dims = runner.split_dims.get(r, {})
  p_avals, b_avals, a_avals = runner.avals(r)
  refs: dict = {}
  for tag, vs in (("param", reg.param_vars), ("batch", reg.batch_vars), ("act", reg.act_vars)):
    refs.update((v, (tag, k)) for k, v in enumerate(vs))
  consts: list = []  # the contents of the constants the region reads, in order of first use

  def ref(v):
    if isinstance(v, Literal):
      return ("literal", _array_key(v.val), _aval_key(v.aval))
    if v not in refs and v in runner.traced.consts:
      refs[v] = ("const", len(consts))
      consts.append(_array_key(runner.traced.consts[v]))
    return refs[v]

  eqns = []
  for e in reg.eqns:
    eqns.append(_eqn_key(e, ref))
    refs.update((v, ("eqn", len(refs))) for v in e.outvars)
  return (kind, runner.axes[kind] if kind else None, tuple(dims.get(p) for p in spec.params),
          tuple(map(_aval_key, p_avals)), tuple(map(_aval_key, b_avals)),
          tuple(map(_aval_key, a_avals)), tuple(x.differentiable for x in spec.inputs),
          tuple((o.shape, o.dtype) for o in spec.outputs), tuple(eqns),
          tuple(ref(v) for v in reg.out_vars), tuple(consts), bool(remat))


def first_alike(runner: RegionRunner, regions, remat: bool = False) -> dict[int, int]:
  """Each of `regions` -> the first of them that traces like it (`region_key`): itself
  when none before does. The full key reads every equation, so only regions that agree
  on a cheap outline (equation count and input and output shapes) compute it."""
  outline = lambda r: (len(runner.traced.regions[r].eqns),
                       tuple(tuple((tuple(a.shape), str(a.dtype)) for a in avals)
                             for avals in runner.avals(r)),
                       tuple((tuple(a.shape), str(a.dtype)) for a in runner.out_avals(r)))
  outlines: dict[tuple, list[int]] = {}
  for r in regions:
    outlines.setdefault(outline(r), []).append(r)
  first: dict[int, int] = {}
  for alike in outlines.values():
    keys: dict[tuple, int] = {}
    for r in alike:
      first[r] = r if len(alike) == 1 else keys.setdefault(region_key(runner, r, remat), r)
  return first


def shared_analyses(runner: RegionRunner, regions, remat: bool = False) -> dict[int, RegionAD]:
  """Each of `regions` -> its `analyze_region`, run once per group of regions that trace
  alike (`first_alike`): the others of a group share its first region's. For what reads
  only the analysis (stored bytes, timings); a lowering relabels it per region."""
  first = first_alike(runner, regions, remat)
  out: dict[int, RegionAD] = {}
  for r in regions:
    out[r] = out[first[r]] if first[r] != r else analyze_region(runner, r, remat)
  return out


class _Relabel:
  """Gives the equations a trace of region `src` made the source information (name
  scopes, traceback) they have in a trace of region `dst`, whose key is the same.

  An equation made while the trace ran region equation i has that equation's traceback
  and its name stack after the trace's own (a `jvp` or `transpose` transform); it
  gets equation i of `dst`'s. Equations made by the analysis itself stay as they are.
  """

  def __init__(self, src_eqns, dst_eqns):
    self.by_tb: dict = {}
    for a, b in zip(src_eqns, dst_eqns):
      self.by_tb.setdefault(id(a.source_info.traceback), []).append((a.source_info, b.source_info))

  def info(self, si):
    found = self.by_tb.get(id(si.traceback))
    if not found:
      return si
    stack = si.name_stack.stack
    best, new = -1, set()
    for a, b in found:
      n = len(a.name_stack.stack)
      if n <= len(stack) and stack[len(stack) - n:] == a.name_stack.stack and n >= best:
        if n > best:
          best, new = n, set()
        new.add((id(b.traceback), b.name_stack.stack))
        out = si.replace(traceback=b.traceback, name_stack=si.name_stack[:len(stack) - n] + b.name_stack)
    if len(new) != 1:
      raise _NoRelabel
    return out

  def jaxpr(self, jaxpr):
    """`jaxpr` with its equations (and those of the jaxprs in their parameters)
    relabelled, and {id(old equation): new equation} of its own."""
    eqns, changed = [], False
    for e in jaxpr.eqns:
      params = {k: self._sub(v) for k, v in e.params.items()}
      si = self.info(e.source_info)
      if si is not e.source_info or any(params[k] is not v for k, v in e.params.items()):
        e = e.replace(source_info=si, params=params)
        changed = True
      eqns.append(e)
    mapping = {id(a): b for a, b in zip(jaxpr.eqns, eqns)}
    return (jaxpr.replace(eqns=eqns) if changed else jaxpr), mapping

  def _sub(self, v):
    if isinstance(v, ClosedJaxpr):
      j, _ = self.jaxpr(v.jaxpr)
      return v if j is v.jaxpr else v.replace(jaxpr=j)
    if isinstance(v, Jaxpr):
      return self.jaxpr(v)[0]
    if isinstance(v, tuple) and any(isinstance(x, (ClosedJaxpr, Jaxpr)) for x in v):
      new = tuple(self._sub(x) for x in v)
      return v if all(a is b for a, b in zip(new, v)) else new
    return v


class _NoRelabel(Exception):
  pass


def relabel(runner: RegionRunner, src: int, dst: int, ad: RegionAD,
            split: BackwardSplit | None = None) -> tuple[RegionAD, BackwardSplit | None] | None:
  """Region `dst`'s analysis (and backward split) from region `src`'s, whose
  `region_key` is the same: the same jaxprs with `dst`'s source information; None when
  an equation's could not be told apart (then `dst` is traced itself).

  The copy shares `ad`'s variables and its `res_tree` (which only `split_backward`
  reads: `split` is that of `dst`).
  """
  rl = _Relabel(runner.traced.regions[src].eqns, runner.traced.regions[dst].eqns)
  try:
    jaxpr, eqn_of = rl.jaxpr(ad.jaxpr)
    new_ad = dataclasses.replace(ad, region=dst, jaxpr=jaxpr,
                                 recompute_eqns=[eqn_of[id(e)] for e in ad.recompute_eqns])
    if split is None:
      return new_ad, None
    j, eqn_of = rl.jaxpr(split.jaxpr)
    return new_ad, dataclasses.replace(split, jaxpr=j,
                                       bi_eqns=[eqn_of[id(e)] for e in split.bi_eqns],
                                       bw_eqns=[eqn_of[id(e)] for e in split.bw_eqns])
  except _NoRelabel:
    return None


def region_forward(ad: RegionAD, params, batch, acts):
  """Runs F, the region's traced vjp: returns (outputs in spec order, stored values)."""
  j = ad.jaxpr
  n_out = len(ad.float_outs) + len(ad.other_outs)
  wanted = list(j.outvars[:n_out]) + ad.stored
  keep = _needed(j.eqns, wanted)
  env = dict(ad.consts)
  env.update(zip(j.invars, list(params) + list(batch) + list(acts)))
  env = eval_eqns([e for e, k in zip(j.eqns, keep) if k], env)
  outs = [None] * n_out
  for k, v in zip(ad.float_outs + ad.other_outs, j.outvars[:n_out]):
    outs[k] = read(env, v)
  return outs, [env[v] for v in ad.stored]


# A bias gradient summed over at most this many rows gets its own kernel: fused into
# LayerNorm's backward (which reads the same cotangent) it ran several times slower.
COLUMN_SUM_ROWS = 4096


def _column_sum(eqn, max_rows: int) -> bool:
  if eqn.primitive.name != "reduce_sum":
    return False
  x, axes = eqn.invars[0].aval, eqn.params["axes"]
  rows = math.prod(x.shape[a] for a in axes)
  return len(x.shape) >= 2 and len(x.shape) - 1 not in axes and 1 < rows <= max_rows


def _weight_grad_dots(eqns, outvars, grads) -> frozenset:
  """The bf16 dot_generals whose result only becomes, through transposes and reshapes,
  one of `grads` by a convert to fp32."""
  producer = {v: e for e in eqns for v in e.outvars}
  uses = collections.Counter(v for e in eqns for v in e.invars if not isinstance(v, Literal))
  uses.update(v for v in outvars if not isinstance(v, Literal))
  found = set()
  for g in grads:
    e = producer.get(g)
    if e is None or e.primitive.name != "convert_element_type" or g.aval.dtype != jnp.float32:
      continue
    x = e.invars[0]
    while not isinstance(x, Literal) and uses[x] == 1 and x in producer:
      p = producer[x]
      if p.primitive.name in ("transpose", "reshape"):
        x = p.invars[0]
        continue
      if p.primitive.name == "dot_general" and x.aval.dtype == jnp.bfloat16:
        found.add(x)
      break
  return frozenset(found)


@dataclasses.dataclass(frozen=True)
class _Rewrite:
  """`eval_eqns`'s hook for B, BI and BW: column sums over at most `sum_rows` rows read
  their operand through a barrier; the dots in `wide` write fp32 (from operands widened
  first with `widen_operands`: XLA's CPU runtime has no bf16 x bf16 -> f32 dot)."""

  sum_rows: int
  wide: frozenset
  widen_operands: bool = False

  def __call__(self, eqn, vals):
    if _column_sum(eqn, self.sum_rows):
      return [jax.lax.optimization_barrier(vals[0])], {}
    if eqn.primitive.name == "dot_general" and eqn.outvars[0] in self.wide:
      if self.widen_operands:
        vals = [v.astype(jnp.float32) for v in vals]
      return vals, {"preferred_element_type": jnp.float32}
    return vals, {}


@dataclasses.dataclass
class BackwardSplit:
  """Region B as a jaxpr, and its cut into BI (activation cotangents) and BW (parameter
  gradients).

  BI runs the equations the activation cotangents need and hands BW the values
  (`carry`) that the weight-gradient equations read from them, so BW recomputes
  nothing.
  """

  jaxpr: Any
  consts: list
  bi_eqns: list
  bw_eqns: list
  carry: list           # jaxpr vars BI computes and BW reads
  n_res: int
  n_params: int
  prepare: Any = None   # eval_eqns's hook (a `_Rewrite`)

  @property
  def carry_avals(self):
    return [v.aval for v in self.carry]


def _needed(eqns, outvars) -> list[bool]:
  """Which equations `outvars` depend on; equations with effects (a debug print) and
  what they read are always kept."""
  live = {v for v in outvars if not isinstance(v, Literal)}
  keep = [False] * len(eqns)
  for i in range(len(eqns) - 1, -1, -1):
    e = eqns[i]
    if e.effects or any(v in live for v in e.outvars):
      keep[i] = True
      live.update(v for v in e.invars if not isinstance(v, Literal))
  return keep


def split_backward(ad: RegionAD, ct_avals, axis_env=(), wide: bool = False,
                   widen_operands: bool = False) -> BackwardSplit:
  """Traces region B once and partitions its equations into BI and BW (B runs them all).

  BI hands BW the smallest values BW can remake what it reads from with cheap
  equations (ZB's handover: the bf16 values, not the fp32 casts BW reads); a bias
  gradient summed over at most `COLUMN_SUM_ROWS` rows reads its cotangent through a
  barrier (its own kernel, not fused into another reader of the cotangent). `wide`:
  bf16 weight-gradient GEMMs write fp32 (for gradients summed over microbatches: no
  bf16 rounding before the sum), reading fp32 copies of their operands with
  `widen_operands` (on CPU).
  """
  def bwd(res, cts):
    d_params, d_acts = jax.tree_util.tree_unflatten(ad.res_tree, res)(list(cts))
    return list(d_params) + list(d_acts)

  closed = jax.make_jaxpr(bwd, axis_env=list(axis_env))(list(ad.res_avals), list(ct_avals))
  j = closed.jaxpr
  n_p = len(ad.diff_params)
  bi_keep = _needed(j.eqns, j.outvars[n_p:])
  bw_keep = _needed(j.eqns, j.outvars[:n_p])
  bi_eqns = [e for e, k in zip(j.eqns, bi_keep) if k]
  bw_eqns = [e for e, k, b in zip(j.eqns, bw_keep, bi_keep) if k and not b]
  bi_defined = {v for e in bi_eqns for v in e.outvars}
  carry = []
  for v in [v for e in bw_eqns for v in e.invars] + list(j.outvars[:n_p]):
    if not isinstance(v, Literal) and v in bi_defined and v not in carry:
      carry.append(v)
  if carry:
    defined = {v: i for i, e in enumerate(j.eqns) for v in e.outvars}
    carry, redo, _ = _plan_recompute(j, carry, set(j.invars) | set(j.constvars), defined, True)
    bw_idx = {i for i, (k, b) in enumerate(zip(bw_keep, bi_keep)) if k and not b} | redo
    bw_eqns = [j.eqns[i] for i in sorted(bw_idx)]
  wide = _weight_grad_dots(j.eqns, j.outvars, j.outvars[:n_p]) if wide else frozenset()
  return BackwardSplit(j, list(closed.consts), bi_eqns, bw_eqns, carry, len(ad.res_avals), n_p,
                       _Rewrite(COLUMN_SUM_ROWS, wide, widen_operands))


def _env(split: BackwardSplit, res, cts) -> dict:
  j = split.jaxpr
  env = dict(zip(j.constvars, split.consts))
  env.update(zip(j.invars, list(res) + list(cts)))
  return env


def region_backward(split: BackwardSplit, res, cts):
  """B: cotangents of the float outputs -> (param grads, activation cotangents)."""
  env = eval_eqns(split.jaxpr.eqns, _env(split, res, cts), split.prepare)
  grads = [read(env, v) for v in split.jaxpr.outvars]
  return grads[:split.n_params], grads[split.n_params:]


def backward_input(split: BackwardSplit, res, cts):
  """BI: -> (activation cotangents, carry for BW)."""
  env = eval_eqns(split.bi_eqns, _env(split, res, cts), split.prepare)
  return ([read(env, v) for v in split.jaxpr.outvars[split.n_params:]],
          [env[v] for v in split.carry])


def backward_weight(split: BackwardSplit, res, cts, carry):
  """BW: -> parameter gradients."""
  env = _env(split, res, cts)
  env.update(zip(split.carry, carry))
  env = eval_eqns(split.bw_eqns, env, split.prepare)
  return [read(env, v) for v in split.jaxpr.outvars[:split.n_params]]


def full_residuals(ad: RegionAD, stored, params, batch, acts, outs) -> list:
  """The residual list vjp expects: aliased inputs and outputs, the stored values, and
  the residuals B recomputes from them."""
  src = {"param": params, "batch": batch, "act": acts, "out": outs}
  env = dict(ad.consts)
  env.update((v, src[kind][i]) for v, (kind, i) in ad.recompute_inputs.items())
  env.update(zip(ad.stored, stored))
  env = eval_eqns(ad.recompute_eqns, env)
  res = []
  for v, a, aval in zip(ad.res_vars, ad.alias, ad.res_avals):
    if a is None or a[0] == "recompute":
      res.append(jnp.asarray(v.val, aval.dtype) if isinstance(v, Literal) else env[v])
    else:
      res.append(src[a[0]][a[1]])
  return res
