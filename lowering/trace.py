"""Traces a loss function to a jaxpr and cuts it into annotated regions."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from piper_jax.ir.graph import TensorSpec
from piper_jax.ir.model import ActivationRef, Gemm, ModelSpec, RegionSpec
from piper_jax.lowering.compat import Literal, Var, eval_eqns, name_stack
from piper_jax.lowering.scopes import parse_scope, reset_counters

__all__ = ["TracedLoss", "trace_loss", "path_name", "check_leaf"]


def path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def check_leaf(name: str, x, dtype, shape=None, traced_from: str = "the example") -> None:
  """Raises a ValueError naming leaf `name` when `x` is not of `dtype` (and `shape`, when
  given): a step runs one compiled program, and casting silently could change precision.

  Dtypes compare as jit sees them (numpy's int64 is int32 unless x64 is enabled).
  """
  got, want = jnp.dtype(jnp.result_type(x)), jnp.dtype(dtype)
  got_shape = tuple(np.shape(x))
  if shape is not None and got_shape != tuple(shape):
    raise ValueError(f"{name} has shape {got_shape}, but the step was compiled for "
                     f"{tuple(shape)} ({traced_from}); pass a leaf of that shape, or compile "
                     f"the step for this one")
  if got != want:
    raise ValueError(f"{name} has dtype {got.name}, but the step was compiled for {want.name} "
                     f"({traced_from}); cast it with `.astype(jnp.{want.name})`, or compile "
                     f"the step for this dtype")


def _spec(name: str, aval, names=None) -> TensorSpec:
  return TensorSpec(name, tuple(int(d) for d in aval.shape), str(np.dtype(aval.dtype)),
                    None if names is None else tuple(names))


def _partition_names(params) -> list:
  """Per parameter leaf, its Flax partitioning names (`nn.with_partitioning`) or None."""
  boxed = lambda x: hasattr(x, "names") and hasattr(x, "unbox")
  return [tuple(x.names) if boxed(x) else None
          for x in jax.tree_util.tree_leaves(params, is_leaf=boxed)]


def _is_float(aval) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.inexact)


def _sub_jaxprs(eqn):
  """`eqn`'s sub-jaxprs (a jit's, a checkpoint's, a scan's body)."""
  for p in eqn.params.values():
    sub = getattr(p, "jaxpr", p)
    if hasattr(sub, "eqns"):
      yield sub


def _sub_eqns(eqn):
  """The equations of `eqn`'s sub-jaxprs."""
  for sub in _sub_jaxprs(eqn):
    yield from sub.eqns


# cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`).
_FUSED_ATTENTION = "dot_product_attention_fwd_wrapper"


def _fused_attention_flops(eqn) -> float:
  """Score and value products of a fused attention over [batch, seq, heads, head_dim]."""
  b, t, n, h = eqn.invars[0].aval.shape
  return 4.0 * b * t * n * h * eqn.invars[1].aval.shape[1]


def _eqn_flops(eqn) -> float:
  """Matmul FLOPs of an equation (2*M*N*K per dot_general, attention's products in a
  fused kernel), recursing into sub-jaxprs."""
  if eqn.primitive.name == "dot_general":
    (lc, _), _ = eqn.params["dimension_numbers"]
    k = 1
    for d in lc:
      k *= eqn.invars[0].aval.shape[d]
    return 2.0 * float(np.prod(eqn.outvars[0].aval.shape)) * k
  if eqn.primitive.name == _FUSED_ATTENTION:
    return _fused_attention_flops(eqn)
  return sum(_eqn_flops(e) for e in _sub_eqns(eqn))


def _causal_mask_size(eqns) -> int | None:
  """The sequence length of a causal mask made among `eqns` (`jnp.tril`, as
  `jax.nn.dot_product_attention` makes it), else None."""
  for e in eqns:
    if e.params.get("name") == "tril" and len(e.outvars[0].aval.shape) == 2:
      return int(e.outvars[0].aval.shape[0])
  return None


def _gemms(eqns, recomputed: bool = False) -> list[Gemm]:
  """The GEMMs of `eqns` by shape, recursing into sub-jaxprs (`Gemm`). Attention's are the
  batched products beside a causal mask with that mask's length twice in an operand or
  their output ([.., T, .., T] scores), and fused attention's. `recomputed`: `eqns` run
  under a checkpoint."""
  causal = _causal_mask_size(eqns)
  out = []
  for e in eqns:
    if e.primitive.name == "dot_general":
      (lc, rc), (lb, rb) = e.params["dimension_numbers"]
      lhs, rhs = e.invars[0].aval.shape, e.invars[1].aval.shape
      size = lambda shape, dims: math.prod(shape[d] for d in dims)
      free = lambda shape, *used: math.prod(x for d, x in enumerate(shape)
                                            if d not in used[0] and d not in used[1])
      masked = causal is not None and bool(lb) and any(
          list(v.aval.shape).count(causal) >= 2 for v in (*e.invars, *e.outvars))
      out.append(Gemm(free(lhs, lc, lb), size(lhs, lc), free(rhs, rc, rb), size(lhs, lb),
                      attention=masked, causal=masked, recomputed=recomputed))
    elif e.primitive.name == _FUSED_ATTENTION:
      b, t, n, h = e.invars[0].aval.shape
      s = e.invars[1].aval.shape[1]
      causal_mask = str(e.params.get("mask_type", "")).endswith("CAUSAL")
      out += [Gemm(t, h, s, b * n, True, causal_mask, recomputed),
              Gemm(t, s, h, b * n, True, causal_mask, recomputed)]
    else:
      again = recomputed or e.primitive.name in _CHECKPOINT_PRIMITIVES
      for sub in _sub_jaxprs(e):
        out += _gemms(sub.eqns, again)
  return out


def _merged(gemms: list[Gemm]) -> tuple[Gemm, ...]:
  """Gemms of one size and kind as one entry, counted together."""
  counts: dict[Gemm, int] = {}
  for g in gemms:
    key = dataclasses.replace(g, count=1)
    counts[key] = counts.get(key, 0) + g.count
  return tuple(dataclasses.replace(g, count=n) for g, n in counts.items())


def _eqn_matmuls(eqn) -> int:
  """Matmuls of an equation, recursing into sub-jaxprs."""
  if eqn.primitive.name == "dot_general":
    return 1
  return sum(_eqn_matmuls(e) for e in _sub_eqns(eqn))


# The primitives of `jax.checkpoint` / `nn.remat`: the backward runs their forward again.
_CHECKPOINT_PRIMITIVES = ("checkpoint", "remat2")  # jax.checkpoint's names across versions


def _recompute_flops(eqn) -> float:
  """Matmul FLOPs of an equation that run under a checkpoint (recomputed in B)."""
  if eqn.primitive.name in _CHECKPOINT_PRIMITIVES:
    return _eqn_flops(eqn)
  return sum(_recompute_flops(e) for e in _sub_eqns(eqn))


def _inner_scope(eqn) -> tuple:
  """The first annotation scope found inside an equation's sub-jaxprs, if any."""
  for p in eqn.params.values():
    for sub in (p if isinstance(p, (tuple, list)) else (p,)):
      sub = getattr(sub, "jaxpr", sub)
      if hasattr(sub, "eqns"):
        for e in sub.eqns:
          found = parse_scope(name_stack(e)) or _inner_scope(e)
          if found:
            return found
  return ()


# Calls whose inner jaxpr takes the call's operands one to one and whose derivative is
# the inner jaxpr's (not a custom rule, which may read a weight in another dtype).
_PLAIN_CALLS = ("jit", "pjit", "closed_call", "remat2", "checkpoint")


def _read_dtypes(eqns, uses: dict) -> None:
  """Adds to `uses[v]`, for the variables `v` it holds, the dtype each equation reads
  `v` as: the target of a `convert_element_type`, None for any other use; looks inside
  jit and remat calls."""
  for e in eqns:
    read = [v for v in e.invars if not isinstance(v, Literal) and v in uses]
    if not read:
      continue
    if e.primitive.name == "convert_element_type":
      for v in read:
        uses[v].add(jnp.dtype(e.params["new_dtype"]))
      continue
    inner = e.params.get("jaxpr", e.params.get("call_jaxpr"))
    inner = getattr(inner, "jaxpr", inner)
    if e.primitive.name not in _PLAIN_CALLS or inner is None or len(inner.invars) != len(e.invars):
      for v in read:
        uses[v].add(None)
      continue
    sub = {iv: set() for v, iv in zip(e.invars, inner.invars)
           if not isinstance(v, Literal) and v in uses}
    _read_dtypes(inner.eqns, sub)
    for iv in sub:
      if iv in inner.outvars:  # returned as it is: read in full precision outside
        sub[iv].add(None)
    for v, iv in zip(e.invars, inner.invars):
      if iv in sub:
        uses[v] |= sub[iv]


@dataclasses.dataclass
class _Region:
  eqns: list
  tags: tuple
  param_vars: list = dataclasses.field(default_factory=list)
  batch_vars: list = dataclasses.field(default_factory=list)
  act_vars: list = dataclasses.field(default_factory=list)
  out_vars: list = dataclasses.field(default_factory=list)


class TracedLoss:
  """A loss jaxpr cut into regions, with a function that runs one region.

  `spec` is the abstract `ModelSpec` the IR plans with; `run_region` evaluates
  region `r` on (params, batch leaves, activations) in the order of its spec.
  """

  def __init__(self, loss_fn: Callable, params: Any, batch: Any, has_aux: bool = False):
    aval = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
    # Shapes only: holding the example arrays would keep a copy of the model alive.
    self.param_leaves = [(path, aval(x)) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]]
    self.param_tree = jax.tree_util.tree_structure(params)
    batch_leaves, self.batch_tree = jax.tree_util.tree_flatten_with_path(batch)
    self.batch_tree = jax.tree_util.tree_structure(batch)
    p_names = [path_name(p) for p, _ in self.param_leaves]
    b_names = [path_name(p) for p, _ in batch_leaves]
    p_avals = [x for _, x in self.param_leaves]
    b_avals = [aval(x) for _, x in batch_leaves]
    if not b_avals or any(len(a.shape) == 0 for a in b_avals):
      raise ValueError("the batch must be a pytree of arrays with a leading batch axis")
    batch_size = b_avals[0].shape[0]
    if any(a.shape[0] != batch_size for a in b_avals):
      raise ValueError(f"batch leaves disagree on the batch size: {[a.shape for a in b_avals]}")
    n_p = len(p_avals)
    param_tree, batch_tree = self.param_tree, self.batch_tree

    aux_paths: list = []

    def flat_loss(*leaves):
      p = jax.tree_util.tree_unflatten(param_tree, leaves[:n_p])
      b = jax.tree_util.tree_unflatten(batch_tree, leaves[n_p:])
      out = loss_fn(p, b)
      if not has_aux:
        return out
      if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError("with has_aux=True, loss_fn(params, batch) must return (loss, aux), "
                         "as for jax.value_and_grad(has_aux=True)")
      loss, aux = out
      found, tree = jax.tree_util.tree_flatten_with_path(aux)
      aux_paths.extend(path for path, _ in found)
      self.aux_tree = tree
      return (loss, *[x for _, x in found])

    reset_counters()
    self.aux_tree = None
    closed = jax.make_jaxpr(flat_loss)(*p_avals, *b_avals)
    jaxpr = closed.jaxpr
    if not has_aux and len(jaxpr.outvars) != 1:
      raise ValueError("loss_fn(params, batch) must return one scalar (the mean loss); one that "
                       "returns (loss, aux) is compiled with pj.compile(..., has_aux=True)")
    if jaxpr.outvars[0].aval.shape != ():
      raise ValueError(f"loss_fn(params, batch) must return one scalar (the mean loss), got "
                       f"shape {tuple(jaxpr.outvars[0].aval.shape)}")
    self.aux_names = [f"aux{jax.tree_util.keystr(path)}" for path in aux_paths]
    for name, v in zip(self.aux_names, jaxpr.outvars[1:]):
      if v.aval.shape != () or not jnp.issubdtype(v.aval.dtype, jnp.inexact):
        raise ValueError(f"{name} has shape {tuple(v.aval.shape)} and dtype {v.aval.dtype}: aux "
                         f"holds float scalars, per-batch means (combined over microbatches "
                         f"and replicas as the loss is); reduce it to a mean inside loss_fn")
    self.consts = dict(zip(jaxpr.constvars, closed.consts))
    self.param_vars = list(jaxpr.invars[:n_p])
    self.batch_vars = list(jaxpr.invars[n_p:])
    self.loss_var = jaxpr.outvars[0]
    self.aux_vars = list(jaxpr.outvars[1:])
    self.regions = self._cut(jaxpr)
    self.partition_names = _partition_names(params)
    self.spec = self._spec(p_names, p_avals, b_names, b_avals, batch_size)

  def _cut(self, jaxpr) -> list[_Region]:
    for e in jaxpr.eqns:
      inner = _inner_scope(e)
      if inner:
        raise ValueError(
            f"pj.annotate({inner[0][0]!r}) is used inside a `{e.primitive.name}` (a jit, "
            f"scan, remat or other transformed function), where regions cannot be cut; "
            f"annotate at the top level of the loss, around the transformed call")
    keys = [parse_scope(name_stack(e)) for e in jaxpr.eqns]
    # Unannotated equations join the region before them (the first region if none).
    first = next((k for k in keys if k), ())
    filled, prev = [], first
    for k in keys:
      prev = k or prev
      filled.append(prev)
    regions: list[_Region] = []
    for eqn, key in zip(jaxpr.eqns, filled):
      if not regions or regions[-1].tags != key:
        regions.append(_Region([], key))
      regions[-1].eqns.append(eqn)
    if not regions:
      raise ValueError("loss_fn has no computation to distribute")
    defined_in = {}
    for i, r in enumerate(regions):
      for e in r.eqns:
        for v in e.outvars:
          defined_in[v] = i
    param_set = {v: i for i, v in enumerate(self.param_vars)}
    batch_set = {v: i for i, v in enumerate(self.batch_vars)}
    needed_later: dict[Var, set] = {}
    for i, r in enumerate(regions):
      seen = set()
      for e in r.eqns:
        for v in e.invars:
          if isinstance(v, Literal) or v in seen or v in self.consts:
            continue
          if v in param_set:
            r.param_vars.append(v)
          elif v in batch_set:
            r.batch_vars.append(v)
          elif defined_in.get(v, i) != i:
            r.act_vars.append(v)
            needed_later.setdefault(v, set()).add(i)
          seen.add(v)
        seen.update(e.outvars)
    if isinstance(self.loss_var, Literal) or self.loss_var not in defined_in:
      raise ValueError("the loss does not depend on any computation of the model")
    needed_later.setdefault(self.loss_var, set()).add(-1)
    for name, v in zip(self.aux_names, self.aux_vars):
      if isinstance(v, Literal) or v not in defined_in:
        raise ValueError(f"{name} is a constant or an input of loss_fn, not computed from the "
                         f"batch: return only values the model computes in aux")
      needed_later.setdefault(v, set()).add(-1)
    for i, r in enumerate(regions):
      r.out_vars = [v for e in r.eqns for v in e.outvars if v in needed_later]
    self.loss_region = defined_in[self.loss_var]
    # Where each aux leaf is made: (region, output index).
    self.aux_outputs = [(defined_in[v], regions[defined_in[v]].out_vars.index(v))
                        for v in self.aux_vars]
    self.defined_in = defined_in
    return regions

  def _spec(self, p_names, p_avals, b_names, b_avals, batch_size) -> ModelSpec:
    param_idx = {v: i for i, v in enumerate(self.param_vars)}
    batch_idx = {v: i for i, v in enumerate(self.batch_vars)}
    specs = []
    for i, r in enumerate(self.regions):
      inputs = []
      for v in r.act_vars:
        src = self.defined_in[v]
        k = self.regions[src].out_vars.index(v)
        inputs.append(ActivationRef(src, k, _spec(f"r{src}.out{k}", v.aval), _is_float(v.aval)))
      outs = tuple(_spec(f"r{i}.out{k}", v.aval) for k, v in enumerate(r.out_vars))
      specs.append(RegionSpec(
          index=i, tags=r.tags, params=tuple(param_idx[v] for v in r.param_vars),
          batch=tuple(batch_idx[v] for v in r.batch_vars), inputs=tuple(inputs), outputs=outs,
          produces_loss=(i == self.loss_region), flops=sum(_eqn_flops(e) for e in r.eqns),
          recompute_flops=sum(_recompute_flops(e) for e in r.eqns),
          matmuls=sum(_eqn_matmuls(e) for e in r.eqns), gemms=_merged(_gemms(r.eqns))))
    return ModelSpec(
        regions=tuple(specs),
        params=tuple(_spec(n, a, names)
                     for n, a, names in zip(p_names, p_avals, self.partition_names)),
        batch=tuple(_spec(n, a) for n, a in zip(b_names, b_avals)),
        batch_size=batch_size)

  def run_region(self, r: int, params: list, batch: list, acts: list) -> list:
    """Runs region `r`: inputs in the order of its spec; returns its outputs (loss included)."""
    reg = self.regions[r]
    env = dict(self.consts)
    env.update(zip(reg.param_vars, params))
    env.update(zip(reg.batch_vars, batch))
    env.update(zip(reg.act_vars, acts))
    eval_eqns(reg.eqns, env)
    return [env[v] for v in reg.out_vars]

  def param_casts(self) -> dict[int, str]:
    """Parameters the loss only ever reads as one narrower float dtype, e.g. fp32 master
    weights that every use casts to bf16: {parameter index: that dtype's name}.

    Such a parameter may be cast once per step and read as `x.astype(bf16).astype(fp32)`
    everywhere, which the model's own cast turns back into exactly `x.astype(bf16)`.
    Reads inside jit and remat (`nn.remat`) calls count; a read inside any other
    higher-order primitive (scan, while, custom_jvp/vjp) counts as a full-precision one.
    """
    uses: dict[Var, set] = {v: set() for v in self.param_vars}
    for r in self.regions:
      _read_dtypes(r.eqns, uses)
    out = {}
    for i, v in enumerate(self.param_vars):
      dt = jnp.dtype(v.aval.dtype)
      if len(uses[v]) == 1 and None not in uses[v]:
        to = next(iter(uses[v]))
        if (jnp.issubdtype(dt, jnp.floating) and jnp.issubdtype(to, jnp.floating)
            and to.itemsize < dt.itemsize):
          out[i] = to.name
    return out

  def check_params(self, leaves: list) -> None:
    """Raises a ValueError naming the first parameter leaf whose shape or dtype is not
    the traced one."""
    for (path, want), x in zip(self.param_leaves, leaves):
      check_leaf(f"params{jax.tree_util.keystr(path)}", x, want.dtype, want.shape,
                 "the params given to pj.compile")

  def loss_output(self) -> int:
    """Which output of the loss region is the loss."""
    return self.regions[self.loss_region].out_vars.index(self.loss_var)


def trace_loss(loss_fn: Callable, params: Any, batch: Any, has_aux: bool = False) -> TracedLoss:
  """Traces `loss_fn(params, batch)` and cuts it into `pj.annotate` regions; with
  `has_aux` it returns (loss, aux), aux a pytree of float scalars."""
  return TracedLoss(loss_fn, params, batch, has_aux)
