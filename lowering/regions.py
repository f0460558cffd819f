"""Forward-with-residuals and backward-from-residuals functions of one region.

F keeps jax.vjp's residuals as explicit arrays so that B, running later (in
another tick), can use them without recomputing the forward. Residuals that
are just an input or an output of the region are not stored again: they are
marked as aliases and read from where the input or output already lives.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from piper_jax.lowering.compat import Literal, eval_eqns, read
from piper_jax.lowering.local import RegionRunner

__all__ = ["RegionAD", "analyze_region"]


# Equations cheap enough to redo in B instead of storing their result per microbatch:
# casts, layout changes and masks (a bf16 copy of a weight, a causal mask).
_CHEAP = frozenset({"convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze",
                    "expand_dims", "iota", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
                    "select_n", "copy", "slice", "neg", "add", "sub", "mul"})


def _cheap(eqn) -> bool:
  if eqn.primitive.name in _CHEAP:
    return True
  if eqn.primitive.name in ("pjit", "jit", "closed_call"):
    inner = eqn.params.get("jaxpr")
    inner = getattr(inner, "jaxpr", inner)
    return inner is not None and all(_cheap(e) for e in inner.eqns)
  return False


def _param_only_cone(jaxpr, var, param_vars: set, defined: dict):
  """The equations that compute `var` from parameters and constants alone, if all are cheap."""
  cone, stack, seen = set(), [var], set()
  while stack:
    v = stack.pop()
    if isinstance(v, Literal) or v in seen or v in param_vars or v in jaxpr.constvars:
      continue
    seen.add(v)
    if v not in defined:
      return None  # a batch or activation input
    i = defined[v]
    if not _cheap(jaxpr.eqns[i]):
      return None
    cone.add(i)
    stack += list(jaxpr.eqns[i].invars)
  return cone


@dataclasses.dataclass
class RegionAD:
  """What F stores for B.

  `alias[k]` is ("param"|"batch"|"act"|"out", index) for a residual that is an
  input or output of the region, ("recompute", var) for one that B recomputes
  cheaply from the parameters, or None for one F stores.
  """

  region: int
  diff_params: list[int]    # positions (in the region's params) that get gradients
  diff_acts: list[int]      # positions (in the region's inputs) that get cotangents
  float_outs: list[int]     # outputs that receive cotangents
  other_outs: list[int]
  res_avals: list[Any]
  alias: list[tuple[str, Any] | None]
  res_tree: Any
  recompute_eqns: list = dataclasses.field(default_factory=list)
  recompute_consts: dict = dataclasses.field(default_factory=dict)
  param_vars: list = dataclasses.field(default_factory=list)

  @property
  def stored(self) -> list[int]:
    """Residuals F must keep (not aliases)."""
    return [k for k, a in enumerate(self.alias) if a is None]


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


def analyze_region(runner: RegionRunner, r: int) -> RegionAD:
  """Traces region `r`'s vjp once, abstractly, to learn its residuals and their aliases.

  Inputs and outputs in the all-to-all layout (expert parallel) are not aliased:
  the caller keeps them in the other layout.
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
  invar_pos = {}
  for k, v in enumerate(jaxpr.invars):
    kind = "param" if k < n_p else "batch" if k < n_p + n_b else "act"
    invar_pos.setdefault(v, (kind, k if k < n_p else k - n_p if k < n_p + n_b else k - n_p - n_b))
  n_out = len(float_outs) + len(other_outs)
  out_order = float_outs + other_outs
  out_pos = {}
  for k, v in enumerate(jaxpr.outvars[:n_out]):
    out_pos.setdefault(v, ("out", out_order[k]))
  param_vars = list(jaxpr.invars[:n_p])
  defined = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
  alias, res_avals, recompute = [], [], set()
  for v in jaxpr.outvars[n_out:]:
    res_avals.append(v.aval)
    if hasattr(v, "val"):  # a literal
      alias.append(None)
      continue
    a = invar_pos.get(v) or out_pos.get(v)
    if a is not None and runner.io_local(r) and a[0] in ("act", "out"):
      a = None
    if a is None:
      cone = _param_only_cone(jaxpr, v, set(param_vars), defined)
      if cone is not None:
        a = ("recompute", v)
        recompute |= cone
    alias.append(a)
  return RegionAD(r, diff_params, diff_acts, float_outs, other_outs, res_avals, alias, box["tree"],
                  [jaxpr.eqns[i] for i in sorted(recompute)],
                  dict(zip(jaxpr.constvars, closed.consts)), param_vars)


def region_forward(runner: RegionRunner, ad: RegionAD, params, batch, acts):
  """Runs F: returns (outputs in spec order, stored residuals)."""
  fl, other, res, _ = _fwd(runner, ad.region, ad.diff_params, ad.diff_acts, ad.float_outs,
                           params, batch, acts)
  outs = [None] * (len(fl) + len(other))
  for k, x in zip(ad.float_outs, fl):
    outs[k] = x
  for k, x in zip(ad.other_outs, other):
    outs[k] = x
  if len(res) != len(ad.alias):
    raise RuntimeError(f"region {ad.region}: residuals changed between traces")
  return outs, [res[k] for k in ad.stored]


# A bias's gradient is a sum over the rows of an output's cotangent. XLA fuses that
# column sum into the fusion of another reader of the cotangent (LayerNorm's backward):
# at a pipeline microbatch's 2048 rows x 1024 that fusion took 79 us a call on an H200,
# many times what the two kernels take apart. Summing a copy that has passed an
# optimization barrier gives the sum its own kernel: 268M 1F1B ran 15% faster. At
# 8192 rows (data parallel, 8 sequences a device) the fused kernel is fast and the
# separate sum cost 1-6%, so only sums over at most this many rows are isolated.
COLUMN_SUM_ROWS = 4096

# A weight gradient of a bf16 matmul is a bf16 GEMM, then a convert to the fp32
# parameter's dtype, then (per microbatch) an add to the fp32 sum. With this on, the
# GEMM writes fp32 itself (Megatron accumulates so, into `main_grad`), which drops the
# bf16 rounding and the convert and lets XLA fold the add into the GEMM's output.
# Not yet measured on a GPU, so off.
WIDE_WEIGHT_GRADS = False


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
  their operand through a barrier; the dots in `wide` write fp32."""

  sum_rows: int
  wide: frozenset

  def __call__(self, eqn, vals):
    if _column_sum(eqn, self.sum_rows):
      return [jax.lax.optimization_barrier(vals[0])], {}
    if eqn.primitive.name == "dot_general" and eqn.outvars[0] in self.wide:
      if jax.default_backend() == "cpu":  # XLA's CPU runtime has no bf16 x bf16 -> f32 dot
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
  live = {v for v in outvars if not isinstance(v, Literal)}
  keep = [False] * len(eqns)
  for i in range(len(eqns) - 1, -1, -1):
    e = eqns[i]
    if any(v in live for v in e.outvars):
      keep[i] = True
      live.update(v for v in e.invars if not isinstance(v, Literal))
  return keep


def split_backward(ad: RegionAD, ct_avals, axis_env=()) -> BackwardSplit:
  """Traces region B once and partitions its equations into BI and BW (B runs them all)."""
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
  wide = _weight_grad_dots(j.eqns, j.outvars, j.outvars[:n_p]) if WIDE_WEIGHT_GRADS else frozenset()
  return BackwardSplit(j, list(closed.consts), bi_eqns, bw_eqns, carry, len(ad.res_avals), n_p,
                       _Rewrite(COLUMN_SUM_ROWS, wide))


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
  """The residual list vjp expects, from the stored ones and the aliased inputs/outputs."""
  res, it = [], iter(stored)
  src = {"param": params, "batch": batch, "act": acts, "out": outs}
  if ad.recompute_eqns:
    env = dict(ad.recompute_consts)
    env.update(zip(ad.param_vars, params))
    src["recompute"] = eval_eqns(ad.recompute_eqns, env)
  for a in ad.alias:
    res.append(next(it) if a is None else src[a[0]][a[1]])
  return res
