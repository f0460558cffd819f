"""Runs a region's equations on each device's piece of its split tensors.

Regions are traced once, at the shapes of the whole (unsplit) model. Under `shard`
(expert parallel) and `shard_tensor` (tensor parallel) a device holds only a piece of
some tensors: a dimension split `n` ways over a mesh axis. `eval_split` evaluates the
traced equations on such pieces: it follows which dimensions of every value are split,
re-binds equations whose parameters name shapes (broadcast_in_dim, reshape, slice)
with the local sizes, and inserts what a split needs:

* a replicated value meeting a split one is cut to this device's piece
  (`_to_local`: backward gathers the cotangent);
* tensor parallel only: a contraction or sum over a split dimension gives partial
  sums, all-reduced forward and passed through backward (Megatron's "g"); a
  replicated operand of an op with a split result gets its cotangent all-reduced
  backward (Megatron's "f").

Expert parallel values are split along the expert axis, whose experts never mix: a
contraction or reduction over it is an error.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from piper_jax.lowering.compat import Literal, bind, eval_eqns, read

__all__ = ["RegionRunner", "SplitAxis", "SplitError", "eval_split", "gather_split", "local_shape"]


class SplitError(ValueError):
  """A region cannot run on split tensors (names the primitive and what to change)."""


@dataclasses.dataclass(frozen=True)
class SplitAxis:
  """Tensors are split `size` ways over mesh axis `name`; `kind` is "ep" or "tp"."""

  name: str
  size: int
  kind: str

  @property
  def partial_sums(self) -> bool:
    """Whether contractions over a split dimension are allowed (and all-reduced)."""
    return self.kind == "tp"


def local_shape(shape: Sequence[int], dims, n: int) -> tuple[int, ...]:
  return tuple(d // n if i in dims else d for i, d in enumerate(shape))


# -- Megatron's f and g, and moving between replicated and split -----------------

@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _copy_to_split(x, axis: str):
  return x


def _copy_fwd(x, axis):
  return x, None


def _copy_bwd(axis, _, ct):
  return (lax.psum(ct, axis),)


_copy_to_split.defvjp(_copy_fwd, _copy_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _reduce_from_split(x, axis: str):
  return lax.psum(x, axis)


def _reduce_fwd(x, axis):
  return lax.psum(x, axis), None


def _reduce_bwd(axis, _, ct):
  return (ct,)


_reduce_from_split.defvjp(_reduce_fwd, _reduce_bwd)


def _slice_local(x, dim: int, axis: SplitAxis):
  size = x.shape[dim] // axis.size
  return lax.dynamic_slice_in_dim(x, lax.axis_index(axis.name) * size, size, dim)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _to_local(x, dim: int, axis: SplitAxis):
  return _slice_local(x, dim, axis)


def _to_local_fwd(x, dim, axis):
  return _slice_local(x, dim, axis), None


def _to_local_bwd(dim, axis, _, ct):
  return (lax.all_gather(ct, axis.name, axis=dim, tiled=True),)


_to_local.defvjp(_to_local_fwd, _to_local_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather_split(x, dim: int, axis: SplitAxis):
  """The whole tensor from every device's piece along `dim` (backward: this piece)."""
  return lax.all_gather(x, axis.name, axis=dim, tiled=True)


def _gather_fwd(x, dim, axis):
  return gather_split(x, dim, axis), None


def _gather_bwd(dim, axis, _, ct):
  return (_slice_local(ct, dim, axis),)


gather_split.defvjp(_gather_fwd, _gather_bwd)


# -- the interpreter -------------------------------------------------------------

_SUBJAXPR = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
             "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
             "custom_vjp_call_jaxpr": "fun_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr"}
# Same-shape primitives that act along one axis: that axis must not be split.
_ALONG_AXIS = {"cumsum": "axis", "cumprod": "axis", "cummax": "axis", "cummin": "axis",
               "cumlogsumexp": "axis", "sort": "dimension", "argsort": "dimension"}
_REDUCE_PARTIAL = {"reduce_sum": lax.psum, "reduce_max": lax.pmax, "reduce_min": lax.pmin}
# Primitives whose result has the shape of an operand but mixes values along dimensions
# (so the elementwise rule would run them on each piece alone and be wrong).
_NOT_ELEMENTWISE = frozenset({
    "dynamic_update_slice", "fft", "reduce_window", "reduce_window_sum", "reduce_window_max",
    "reduce_window_min", "cholesky", "triangular_solve", "conv_general_dilated", "cond", "while",
    "scan", "custom_linear_solve", "select_and_scatter_add", "select_and_gather_add"})


class _Eval:
  """Evaluates equations, tracking per value the set of its split dimensions."""

  def __init__(self, axis: SplitAxis, where: str):
    self.axis, self.where = axis, where
    self.split: dict[Any, frozenset] = {}

  def error(self, eqn, msg: str, fix: str | None = None) -> SplitError:
    if fix is None:
      fix = ("experts must not mix inside an EP region: do this outside it, in the region "
             "around it" if self.axis.kind == "ep" else
             "apply it along a dimension that is not split, or move it out of the shard_tensor "
             "region")
    return SplitError(f"{self.where}: `{eqn.primitive.name}` {msg}; {fix}")

  def dims(self, v) -> frozenset:
    return frozenset() if isinstance(v, Literal) else self.split.get(v, frozenset())

  def run(self, eqns, env: dict) -> dict:
    for eqn in eqns:
      ins = [self.dims(v) for v in eqn.invars]
      if not any(ins):
        eval_eqns([eqn], env)  # whole values in, whole values out (custom rules kept)
      elif eqn.primitive.name in _SUBJAXPR and eqn.params.get(_SUBJAXPR[eqn.primitive.name]) is not None:
        self.inline(eqn, env)
      else:
        outs, out_dims = self.rule(eqn, [read(env, v) for v in eqn.invars], ins)
        # A piece split along two dimensions at once is a diagonal block: the rest is missing.
        many = next((d for d in out_dims if len(d) > 1), None)
        if many:
          raise self.error(eqn, f"would split dimensions {sorted(many)} of its result at once "
                                f"(its operands are split along different dimensions)",
                           "only one dimension of a value can be split: compute this from "
                           "whole operands, outside the region")
        for v, x, d in zip(eqn.outvars, outs, out_dims):
          env[v] = x
          if d:
            self.split[v] = frozenset(d)
    return env

  def inline(self, eqn, env):
    inner = eqn.params[_SUBJAXPR[eqn.primitive.name]]
    jaxpr = getattr(inner, "jaxpr", inner)
    sub = dict(zip(jaxpr.constvars, getattr(inner, "consts", ())))
    for v, x in zip(jaxpr.invars, eqn.invars):
      sub[v] = read(env, x)
      if self.dims(x):
        self.split[v] = self.dims(x)
    self.run(jaxpr.eqns, sub)
    for v, x in zip(eqn.outvars, jaxpr.outvars):
      env[v] = read(sub, x)
      if self.dims(x):
        self.split[v] = self.dims(x)

  def local(self, x, have: frozenset, want: frozenset):
    for d in sorted(want - have):
      x = _to_local(x, d, self.axis)
    return x

  def copy(self, x):
    """Megatron's f on a replicated float operand of an op whose result is split."""
    if self.axis.partial_sums and jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      return _copy_to_split(x, self.axis.name)
    return x

  def rule(self, eqn, vals, ins):
    name = eqn.primitive.name
    n = self.axis.size
    out_avals = [v.aval for v in eqn.outvars]
    if name == "broadcast_in_dim":
      bd = eqn.params["broadcast_dimensions"]
      out = frozenset(bd[d] for d in ins[0])
      shape = local_shape(eqn.params["shape"], out, n)
      return bind(eqn, vals, shape=shape), [out]
    if name == "reshape":
      return self.reshape(eqn, vals[0], ins[0])
    if name == "transpose":
      perm = eqn.params["permutation"]
      return bind(eqn, vals), [frozenset(k for k, p in enumerate(perm) if p in ins[0])]
    if name == "squeeze":
      gone = set(eqn.params["dimensions"])
      if gone & ins[0]:
        raise self.error(eqn, f"squeezes split dimension(s) {sorted(gone & ins[0])}")
      keep = [d for d in range(len(eqn.invars[0].aval.shape)) if d not in gone]
      return bind(eqn, vals), [frozenset(keep.index(d) for d in ins[0])]
    if name == "dot_general":
      return self.dot_general(eqn, vals, ins)
    if name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                "argmax", "argmin"):
      return self.reduce(eqn, vals, ins)
    if name == "slice":
      return self.slice(eqn, vals, ins)
    if name == "concatenate":
      dim = eqn.params["dimension"]
      want = frozenset().union(*ins)
      if dim in want:
        raise self.error(eqn, f"concatenates along split dimension {dim}")
      return bind(eqn, [self.local(x, d, want) for x, d in zip(vals, ins)]), [want]
    if name == "split":
      if eqn.params["axis"] in ins[0]:
        raise self.error(eqn, f"splits along split dimension {eqn.params['axis']}")
      return bind(eqn, vals), [ins[0]] * len(out_avals)
    if name in _ALONG_AXIS and eqn.params[_ALONG_AXIS[name]] in frozenset().union(*ins):
      raise self.error(eqn, f"works along dimension {eqn.params[_ALONG_AXIS[name]]}, which is split")
    if name == "rev" and set(eqn.params["dimensions"]) & ins[0]:
      raise self.error(eqn, f"reverses split dimension(s) "
                            f"{sorted(set(eqn.params['dimensions']) & ins[0])}")
    if name not in _NOT_ELEMENTWISE and self.elementwise(eqn):
      return self.pointwise(eqn, vals, ins)
    raise self.error(eqn, "is not supported on split tensors",
                     "write this part of the region with elementwise ops, einsum/dot, reshape, "
                     "transpose and sums, or move it out of the region")

  def elementwise(self, eqn) -> bool:
    out = [v.aval.shape for v in eqn.outvars]
    if any(s != out[0] for s in out):
      return False
    for v in eqn.invars:
      s = v.aval.shape
      if len(s) and (len(s) != len(out[0]) or any(a not in (b, 1) for a, b in zip(s, out[0]))):
        return False
    return True

  def pointwise(self, eqn, vals, ins):
    want = frozenset().union(*ins)
    shape = eqn.outvars[0].aval.shape
    args = []
    for v, x, d in zip(eqn.invars, vals, ins):
      s = v.aval.shape
      full = frozenset(i for i in want if len(s) and s[i] == shape[i] and shape[i] != 1)
      x = self.local(x, d, full)
      if not isinstance(v, Literal) and (full | d) != want:
        x = self.copy(x)  # broadcast along a split dimension: its cotangent is a partial sum
      args.append(x)
    outs = bind(eqn, args)
    return outs, [want] * len(outs)

  def reshape(self, eqn, x, dims):
    old, new = eqn.invars[0].aval.shape, tuple(eqn.params["new_sizes"])
    n, out = self.axis.size, set()
    for gi, gj in _reshape_groups(old, new):
      split = [d for d in gi if d in dims]
      if not split:
        continue
      outer_old = next(d for d in gi if old[d] > 1)
      outer_new = next((d for d in gj if new[d] > 1), None)
      if (len(split) == 1 and split[0] == outer_old and outer_new is not None
          and new[outer_new] % n):
        # E.g. a projection split over more devices than the model has heads.
        raise self.error(eqn, f"reshapes {old} to {new}: the split dimension {split[0]} "
                              f"becomes dimension {outer_new} of size {new[outer_new]}, which "
                              f"does not divide over {n} devices",
                         f"use a group of devices whose size divides {new[outer_new]} (e.g. "
                         f"the number of attention heads)")
      if len(split) > 1 or split[0] != outer_old or outer_new is None:
        raise self.error(eqn, f"reshapes {old} to {new} in a way that mixes the split dimension "
                              f"{split[0]} with others",
                         "keep it the outermost of the dimensions it is merged with or split into")
      out.add(outer_new)
    out = frozenset(out)
    return bind(eqn, [x], new_sizes=local_shape(new, out, n), dimensions=None), [out]

  def dot_general(self, eqn, vals, ins):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = vals
    ld, rd = set(ins[0]), set(ins[1])
    partial_sum = False
    for a, b, contracting in [(x, y, True) for x, y in zip(lc, rc)] + [(x, y, False) for x, y in zip(lb, rb)]:
      if a in ld or b in rd:
        if contracting:
          if not self.axis.partial_sums:
            raise self.error(eqn, f"contracts over the expert axis (dimension {a})")
          partial_sum = True
        ld.add(a)
        rd.add(b)
    lhs = self.local(lhs, ins[0], frozenset(ld))
    rhs = self.local(rhs, ins[1], frozenset(rd))
    nl, nr = len(eqn.invars[0].aval.shape), len(eqn.invars[1].aval.shape)
    lfree = [d for d in range(nl) if d not in lc and d not in lb]
    rfree = [d for d in range(nr) if d not in rc and d not in rb]
    out = {k for k, d in enumerate(lb) if d in ld}
    out |= {len(lb) + k for k, d in enumerate(lfree) if d in ld}
    out |= {len(lb) + len(lfree) + k for k, d in enumerate(rfree) if d in rd}
    if partial_sum and out:
      raise self.error(eqn, "contracts over a split dimension while keeping another split",
                       "split only one dimension of the product: after a column-parallel weight "
                       "comes a row-parallel one (split along its first dimension), as in "
                       "Megatron's MLP")
    if out:
      lhs = lhs if ld else self.copy(lhs)
      rhs = rhs if rd else self.copy(rhs)
    y = bind(eqn, [lhs, rhs])[0]
    if partial_sum:
      y = _reduce_from_split(y, self.axis.name)
    return [y], [frozenset(out)]

  def reduce(self, eqn, vals, ins):
    name = eqn.primitive.name
    axes = tuple(eqn.params.get("axes", ())) or (eqn.params.get("axis"),)
    keep = [d for d in range(len(eqn.invars[0].aval.shape)) if d not in axes]
    out = frozenset(keep.index(d) for d in ins[0] if d in keep)
    y = bind(eqn, vals)[0]
    if set(axes) & ins[0]:
      if not self.axis.partial_sums or name not in _REDUCE_PARTIAL or out:
        raise self.error(eqn, f"reduces over split dimension(s) {sorted(set(axes) & ins[0])}")
      try:
        y = (_reduce_from_split(y, self.axis.name) if name == "reduce_sum"
             else _REDUCE_PARTIAL[name](y, self.axis.name))
      except NotImplementedError:  # pmax/pmin under differentiation
        raise self.error(eqn, f"takes the {name[7:]}imum over split dimension(s) "
                              f"{sorted(set(axes) & ins[0])}, and its gradient across devices "
                              f"is not supported (a stop_gradient after it, as in softmax and "
                              f"logsumexp, comes too late)",
                         "keep that dimension whole here, or move this out of the "
                         "shard_tensor region") from None
    return [y], [out]

  def slice(self, eqn, vals, ins):
    shape = eqn.invars[0].aval.shape
    start, limit = list(eqn.params["start_indices"]), list(eqn.params["limit_indices"])
    strides = eqn.params.get("strides")
    for d in ins[0]:
      if start[d] != 0 or limit[d] != shape[d] or (strides and strides[d] != 1):
        raise self.error(eqn, f"slices split dimension {d}")
      limit[d] = shape[d] // self.axis.size
    return bind(eqn, vals, limit_indices=tuple(limit)), [ins[0]]


def _reshape_groups(old, new) -> list[tuple[list[int], list[int]]]:
  """Dimensions of `old` and `new` in groups of equal size (a reshape merges or splits within one)."""
  groups, i, j = [], 0, 0
  while i < len(old) or j < len(new):
    gi, gj, po, pn = [], [], 1, 1
    while True:
      if (po < pn or not gi) and i < len(old):
        gi.append(i)
        po, i = po * old[i], i + 1
      elif (pn < po or not gj) and j < len(new):
        gj.append(j)
        pn, j = pn * new[j], j + 1
      else:
        break
      if po == pn and gi and gj:
        break
    groups.append((gi, gj))
  return groups


def eval_split(jaxpr_eqns, env: dict, split: dict, axis: SplitAxis, where: str) -> tuple[dict, dict]:
  """Evaluates `jaxpr_eqns` on local pieces.

  `env` maps input vars to local values, `split` maps input vars to the set of
  their split dimensions. Returns the environment and the split dimensions of every
  value, so the caller can gather or check the outputs.
  """
  ev = _Eval(axis, where)
  ev.split.update({v: frozenset(d) for v, d in split.items() if d})
  ev.run(jaxpr_eqns, env)
  return env, ev.split


class RegionRunner:
  """Runs the traced regions: on whole tensors, or on this device's pieces.

  Regions that shard_tensor matches run on their parameters' pieces; split results
  are gathered at the region's end, so activations between regions stay whole.
  Regions that shard matches run on the local experts' pieces of their parameters,
  on tokens that an all-to-all (done by the caller, see `io_local`) brought in as
  [devices, local experts, ...]: the region is vmapped over the source device.
  """

  def __init__(self, traced, sharded: dict[int, str] | None = None,
               axes: dict[str, SplitAxis] | None = None,
               split_dims: dict[int, dict[int, int]] | None = None):
    self.traced, self.spec = traced, traced.spec
    self.kind = dict(sharded or {})
    self.axes = dict(axes or {})
    self.split_dims = split_dims or {}
    self.axis_env = [(a.name, a.size) for a in self.axes.values()]

  def io_local(self, r: int) -> bool:
    """Whether region `r`'s inputs and outputs are in the all-to-all layout (expert parallel)."""
    return self.kind.get(r) == "ep"

  def _io_aval(self, spec):
    n = self.axes["ep"].size
    shape = (n, spec.shape[0] // n) + tuple(spec.shape[1:])
    return jax.ShapeDtypeStruct(shape, jnp.dtype(spec.dtype))

  def avals(self, r: int) -> tuple[list, list, list]:
    """Abstract (params, batch, activations) as `run(r, ...)` takes them on one device."""
    spec, model = self.spec.regions[r], self.spec
    dims = self.split_dims.get(r, {})
    n = self.axes[self.kind[r]].size if r in self.kind else 1
    sds = lambda s, d=None: jax.ShapeDtypeStruct(
        s.shape if d is None else local_shape(s.shape, {d}, n), jnp.dtype(s.dtype))
    params = [sds(model.params[p], dims.get(p)) for p in spec.params]
    batch = [sds(model.batch[i]) for i in spec.batch]
    acts = [self._io_aval(x.spec) if self.io_local(r) else sds(x.spec) for x in spec.inputs]
    return params, batch, acts

  def out_avals(self, r: int) -> list:
    outs = self.spec.regions[r].outputs
    return [self._io_aval(o) if self.io_local(r) else
            jax.ShapeDtypeStruct(o.shape, jnp.dtype(o.dtype)) for o in outs]

  def run(self, r: int, params: list, batch: list, acts: list) -> list:
    """Region `r`'s outputs from its inputs (in the order of its spec)."""
    kind = self.kind.get(r)
    if kind is None:
      return self.traced.run_region(r, params, batch, acts)
    traced, spec, axis = self.traced, self.spec.regions[r], self.axes[kind]
    reg, dims = traced.regions[r], self.split_dims.get(r, {})
    where = f"region {r} ({spec.name}) under {'shard' if kind == 'ep' else 'shard_tensor'}"

    def local(params, acts):
      env = dict(traced.consts)
      env.update(zip(reg.param_vars, params))
      env.update(zip(reg.batch_vars, batch))
      env.update(zip(reg.act_vars, acts))
      split = {v: {dims[p]} for v, p in zip(reg.param_vars, spec.params) if p in dims}
      if kind == "ep":
        split.update({v: {0} for v in reg.act_vars})
      env, out_dims = eval_split(reg.eqns, env, split, axis, where)
      outs = []
      for k, v in enumerate(reg.out_vars):
        x, d = env[v], out_dims.get(v, frozenset())
        if kind == "ep" and d != {0}:
          raise SplitError(f"{where}: output {k} {list(v.aval.shape)} does not keep the expert "
                           f"axis first; an EP region must return [experts, capacity, ...]")
        for dim in sorted(d) if kind == "tp" else ():
          x = gather_split(x, dim, axis)
        outs.append(x)
      return outs

    if kind == "ep":
      return jax.vmap(local, in_axes=(None, 0))(list(params), list(acts))
    return local(params, acts)
