"""Whether an optax transformation may update packed buffers instead of the user's leaves.

piper-jax packs parameter leaves into flat per-rank buffers. An optimizer gives one
device's numbers on them only when it treats every element of every leaf alike: each
update element a function of the same element of the gradient, parameter and
per-leaf state, by the same equations for every leaf of a dtype, plus scalars
(counts, schedules, global norms summed alike over all leaves). Masks, per-leaf
labels or hyperparameters, per-leaf norms and factored or matrix updates (adafactor,
muon) are not. `packed_update_reason` reads the update's jaxpr, traced on the user's
tree, and says which of these it found; any doubt answers "not packed", and the step
then updates whole leaves, which is right for every optimizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from piper_jax.lowering.compat import ClosedJaxpr, Jaxpr, Literal

__all__ = ["packed_update_reason"]

# Primitives applied element by element (broadcasting scalars), the only ones a leaf's
# elements may pass through.
ELEMENTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj convert_element_type
copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow
is_finite le lgamma digamma log log1p logistic lt max min mul ne neg nextafter not or pow
real reduce_precision rem round rsqrt select_n sign sin sinh sqrt square stop_gradient sub
tan tanh xor
""".split())
# Parameters that hold shapes: dropped from signatures, so that leaves of different
# shapes that run the same equations compare equal.
SHAPE_PARAMS = frozenset({"shape", "broadcast_dimensions", "axes", "new_sizes", "dimensions",
                          "sharding", "out_sharding"})


@dataclasses.dataclass(frozen=True)
class _Value:
  """What the analysis knows of a jaxpr value.

  owners: the leaves it is computed from, element by element (one leaf) or through
    whole-leaf sums (`terms`); empty for values no leaf feeds.
  sig: a hash of the equations that made it, with the leaf's own inputs named by role
    and shapes left out.
  uniform: every element has the same value (a scalar or a broadcast scalar); only
    such values, or the leaf's own, may meet a leaf's elements.
  terms: for sums of whole leaves, the signature of each leaf's term.
  """

  owners: frozenset = frozenset()
  sig: int = 0
  uniform: bool = True
  terms: tuple = ()

  @property
  def free(self) -> bool:
    return not self.owners


class _NotPacked(Exception):
  pass


def _params_sig(eqn) -> tuple:
  return tuple(sorted((k, repr(v)) for k, v in eqn.params.items() if k not in SHAPE_PARAMS))


class _Analysis:
  def __init__(self, n_leaves: int):
    self.all = frozenset(range(n_leaves))

  def run(self, jaxpr, consts, ins: list[_Value]) -> list[_Value]:
    env: dict = {}
    for v, c in zip(jaxpr.constvars, consts):
      env[v] = self.const(c)
    for v, x in zip(jaxpr.invars, ins):
      env[v] = x
    for eqn in jaxpr.eqns:
      vals = [self.const(v.val) if isinstance(v, Literal) else env[v] for v in eqn.invars]
      for v, x in zip(eqn.outvars, self.eqn(eqn, vals)):
        env[v] = x
    return [self.const(v.val) if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]

  @staticmethod
  def const(c) -> _Value:
    arr = np.asarray(c)
    if arr.size == 1 or (arr.size and np.all(arr == arr.reshape(-1)[0])):
      return _Value(sig=hash(("const", repr(arr.reshape(-1)[0].item()), str(arr.dtype))))
    return _Value(sig=hash(("array", arr.tobytes(), str(arr.dtype))), uniform=False)

  def eqn(self, eqn, vals: list[_Value]) -> list[_Value]:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if all(v.free for v in vals):
      # Counts, schedules and constants: computed once, whatever the layout.
      uniform = all(v.uniform for v in vals) and (
          name in ELEMENTWISE or name == "broadcast_in_dim"
          or all(np.ndim(o.aval) == 0 for o in eqn.outvars if hasattr(o, "aval")))
      base = (name, _params_sig(eqn) if name in ELEMENTWISE or name == "broadcast_in_dim"
              else repr(sorted(eqn.params.items(), key=lambda kv: kv[0])),
              tuple(v.sig for v in vals))
      return [_Value(sig=hash(base + (i,)), uniform=uniform) for i in range(n_out)]
    sub = _subjaxpr(eqn)
    if sub is not None:
      return self.run(*sub, vals)
    leafy = [v for v in vals if not v.free]
    if name == "broadcast_in_dim" or name in ("squeeze", "reshape", "expand_dims"):
      (x,) = vals[:1]
      in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
      if tuple(in_shape) == tuple(out_shape) or (x.terms and int(np.prod(out_shape)) == 1):
        return [x]
      raise _NotPacked(f"`{name}` reshapes a leaf ({tuple(in_shape)} -> {tuple(out_shape)})")
    if name == "reduce_sum":
      (x,) = vals
      if len(x.owners) == 1 and not x.terms and np.ndim(eqn.outvars[0].aval) == 0:
        return [_Value(x.owners, hash(("sum", x.sig)), True, (x.sig,))]
      raise _NotPacked("`reduce_sum` over part of a leaf (a per-row or per-column statistic)")
    if any(v.terms for v in vals):
      return [self.sum_terms(name, eqn, vals)]
    if name not in ELEMENTWISE:
      raise _NotPacked(f"`{name}` on a leaf (an update that is not element by element)")
    owners = frozenset().union(*(v.owners for v in leafy))
    if len(owners) > 1:
      raise _NotPacked(f"`{name}` combines elements of different leaves")
    if not all(v.uniform for v in vals if v.free):
      raise _NotPacked(f"`{name}` combines a leaf with an array that differs element by element")
    sig = hash((name, _params_sig(eqn), tuple((v.sig, v.free) for v in vals)))
    return [_Value(owners, sig) for _ in range(n_out)]

  def sum_terms(self, name: str, eqn, vals: list[_Value]) -> _Value:
    """Whole-leaf sums may only be added up over all leaves alike (a global norm)."""
    if name in ("convert_element_type", "copy", "copy_p") and len(vals) == 1:
      return vals[0]
    zero = lambda v, var: v.free and isinstance(var, Literal) and np.all(np.asarray(var.val) == 0)
    if name == "add" and len(vals) == 2:
      a, b = vals
      if zero(a, eqn.invars[0]):
        return b
      if zero(b, eqn.invars[1]):
        return a
      if a.terms and b.terms and not (a.owners & b.owners):
        owners, terms = a.owners | b.owners, a.terms + b.terms
        if owners == self.all:
          if len(set(terms)) != 1:
            raise _NotPacked("a sum over all leaves whose terms differ from leaf to leaf")
          return _Value(sig=hash(("global", terms[0])))
        return _Value(owners, 0, True, terms)
    raise _NotPacked(f"`{name}` of a sum over some leaves only (a per-leaf norm or statistic)")


def _subjaxpr(eqn):
  """(jaxpr, consts) of a call-like equation (jit, custom_jvp/vjp, remat), else None."""
  if eqn.primitive.name in ("cond", "while", "scan"):
    return None
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    sub = eqn.params.get(key)
    if isinstance(sub, ClosedJaxpr) and len(sub.jaxpr.invars) == len(eqn.invars):
      return sub.jaxpr, sub.consts
    if isinstance(sub, Jaxpr) and len(sub.invars) == len(eqn.invars) and not sub.constvars:
      return sub, []
  return None


def packed_update_reason(optimizer, params: Any, buffers: Any = None) -> str | None:
  """Why `optimizer.update` may not run on packed buffers, or None when it may.

  Args:
    optimizer: an optax `GradientTransformation`.
    params: the parameters (or `jax.ShapeDtypeStruct`s) in the user's pytree.
    buffers: the packed buffers' shapes; when given, the update traced on them must
      run the same equations as on the user's leaves of each dtype. A mask or label
      function reads whatever tree it is given (paths, `ndim`), and on buffers it
      may choose otherwise than on the leaves.

  Returns:
    None when every update and per-leaf state element is computed from the same
    elements of the gradients, parameters and per-leaf state by the same equations
    for every leaf of a dtype (plus scalars that sum all leaves alike); otherwise a
    sentence naming what the optimizer does per leaf.
  """
  sigs = _signatures(optimizer, params)
  if isinstance(sigs, str) or buffers is None:
    return sigs if isinstance(sigs, str) else None
  on_buffers = _signatures(optimizer, buffers)
  if isinstance(on_buffers, str):
    return f"on the packed buffers, {on_buffers}"
  for key, sig in on_buffers.items():
    if key in sigs and sigs[key] != sig:
      return (f"its {key[0]} on the packed buffers differ from those on the leaves: a mask "
              f"or label function that reads the tree's paths or shapes")
  return None


def _signatures(optimizer, params: Any) -> dict | str:
  """Per (output, dtype[, state part]): the one signature of the equations every leaf
  of that dtype runs; or why there is no such signature."""
  leaves, ptree = jax.tree_util.tree_flatten(params)
  shapes = [jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)) for x in leaves]
  abstract = jax.tree_util.tree_unflatten(ptree, shapes)
  try:
    state = jax.eval_shape(optimizer.init, abstract)
    closed = jax.make_jaxpr(lambda g, s, p: optimizer.update(g, s, p))(abstract, state, abstract)
  except Exception as e:  # noqa: BLE001 - whatever fails here, the leaf path is right
    return f"its update could not be traced on the parameters ({type(e).__name__}: {e})"
  per_leaf = lambda x: jax.tree_util.tree_structure(x) == ptree
  state_parts, _ = jax.tree_util.tree_flatten(state, is_leaf=per_leaf)
  ins: list[_Value] = [_Value(frozenset({k}), hash("grad")) for k in range(len(leaves))]
  roles: list[tuple] = []   # per state leaf: ("leaf", part, k) or ("other", j)
  for i, part in enumerate(state_parts):
    if per_leaf(part) and len(leaves) > 0:
      for k, x in enumerate(jax.tree_util.tree_leaves(part)):
        same = np.shape(x) == shapes[k].shape
        roles.append(("leaf", i, k) if same else ("other", len(roles)))
    else:
      roles += [("other", len(roles)) for _ in jax.tree_util.tree_leaves(part)]
  flat_state = jax.tree_util.tree_leaves(state)
  for role, x in zip(roles, flat_state):
    if role[0] == "leaf":
      ins.append(_Value(frozenset({role[2]}), hash(("state", role[1]))))
    else:
      ins.append(_Value(sig=hash(("state", role[1])), uniform=np.ndim(x) == 0))
  ins += [_Value(frozenset({k}), hash("param")) for k in range(len(leaves))]
  analysis = _Analysis(len(leaves))
  try:
    outs = analysis.run(closed.jaxpr, closed.consts, ins)
  except _NotPacked as e:
    return str(e)
  updates, new_state = outs[:len(leaves)], outs[len(leaves):]
  if len(new_state) != len(roles):
    return "its state changes structure in the update"
  groups: dict[tuple, dict] = {}   # (output, dtype) -> signature -> the first leaf with it
  for k, v in enumerate(updates):
    groups.setdefault(("updates", shapes[k].dtype), {}).setdefault(_leaf_sig(v, k), k)
  for role, v in zip(roles, new_state):
    if role[0] == "leaf":
      groups.setdefault(("state", shapes[role[2]].dtype, role[1]), {}).setdefault(
          _leaf_sig(v, role[2]), role[2])
    elif not v.free or not v.uniform:
      return "it keeps state that is neither per leaf nor a scalar"
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  for (what, *_), sigs in groups.items():
    if None in sigs:
      return f"its {what} of leaf {paths[sigs[None]]} read other leaves than its own"
    if len(sigs) > 1:
      a, b = sorted(sigs.values())[:2]
      return (f"its {what} differ from leaf to leaf ({paths[a]} and {paths[b]}): a mask, "
              f"per-leaf labels or hyperparameters, or a shape-dependent rule")
  return {key: next(iter(sigs)) for key, sigs in groups.items()}


def _leaf_sig(v: _Value, k: int):
  """The signature of leaf `k`'s output, or None when it reads another leaf."""
  if v.free:
    return ("free", v.sig) if v.uniform else None
  return ("leaf", v.sig) if v.owners == {k} and not v.terms else None
