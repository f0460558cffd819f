"""Which precision a loss computes in, and the same loss computed in float32."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["precision_of", "widen"]


def _narrow(dtype) -> bool:
  """A floating dtype narrower than float32 (bfloat16, float16, float8)."""
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    return False
  return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4


def _shapes(tree):
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def precision_of(loss_fn: Callable, params: Any, batch: Any, platform: str) -> str:
  """"bf16" when a floating parameter or a value the loss computes is narrower than
  float32; "tf32" when a float32 matrix product runs at an accelerator's default
  precision; else "fp32"."""
  if any(_narrow(jnp.result_type(x)) for x in jax.tree_util.tree_leaves(params)):
    return "bf16"
  eqns = list(_all_eqns(jax.make_jaxpr(loss_fn)(_shapes(params), _shapes(batch)).jaxpr))
  if any(_narrow(v.aval.dtype) for e in eqns for v in e.outvars if hasattr(v.aval, "dtype")):
    return "bf16"
  if platform != "cpu" and any(e.primitive.name in ("dot_general", "conv_general_dilated")
                               and _reduced(e.params.get("precision")) for e in eqns):
    return "tf32"
  return "fp32"


def _reduced(precision) -> bool:
  """Whether a matrix product's precision lets an accelerator round float32 inputs."""
  if precision is None:
    return True
  if isinstance(precision, (tuple, list)):
    return any(p == jax.lax.Precision.DEFAULT for p in precision)
  name = getattr(precision, "name", str(precision))
  return name == "DEFAULT" or any(t in name for t in ("TF32", "BF16", "F16", "F8"))


def _all_eqns(jaxpr):
  """Every equation, inside jit, scan, remat and other sub-jaxprs too."""
  for eqn in jaxpr.eqns:
    yield eqn
    for p in eqn.params.values():
      for sub in p if isinstance(p, (list, tuple)) else (p,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds its Jaxpr
        if hasattr(sub, "eqns"):
          yield from _all_eqns(sub)


# -- the same function in float32 ---------------------------------------------------


def widen(fn: Callable) -> Callable:
  """`fn` with every bfloat16 / float16 value it computes computed in float32 instead.

  The function is traced to a jaxpr and evaluated with each cast to a narrow float, each
  narrow result type and each narrow constant made float32; `jit`, `remat`, `custom_jvp`
  and `custom_vjp` calls are followed into, `scan`, `while` and `cond` bodies rewritten.
  What it returns is differentiable as `fn` is. It is the reference a reduced-precision
  step is judged against: the model's own arithmetic, without its rounding.

  Raises:
    ValueError: naming the operation, when one only exists in a narrow type (a fused
      attention kernel for bfloat16): pass the same model built in float32 instead.
  """

  @functools.wraps(fn)
  def wide(*args):
    args = jax.tree_util.tree_map(_widen_value, args)
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    out = _eval(closed.jaxpr, closed.consts, jax.tree_util.tree_leaves(args))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), out)

  return wide


def _widen_value(x):
  dtype = getattr(x, "dtype", None)
  return x.astype(jnp.float32) if dtype is not None and _narrow(dtype) else x


def _widen_param(value):
  return jnp.dtype(jnp.float32) if not isinstance(value, (bool, int, float)) and \
      _is_dtype(value) and _narrow(value) else value


def _is_dtype(value) -> bool:
  return isinstance(value, (np.dtype, type)) or type(value).__name__.endswith("DType")


# Call-like operations whose body is evaluated in place of the call.
_INLINED = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
            "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
            "custom_vjp_call_jaxpr": "fun_jaxpr"}


def _eval(jaxpr, consts, args) -> list:
  env = {}

  def read(v):
    return _widen_value(v.val) if type(v).__name__ == "Literal" else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = _widen_value(x)
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for eqn in jaxpr.eqns:
    outs = _apply(eqn, [read(v) for v in eqn.invars])
    if not eqn.primitive.multiple_results:
      outs = [outs]
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _closed(closed, avals):
  """`closed` (a ClosedJaxpr) rewritten for float32 inputs shaped like `avals`."""
  return jax.make_jaxpr(lambda *a: _eval(closed.jaxpr, closed.consts, list(a)))(*avals)


def _apply(eqn, invals):
  name, params = eqn.primitive.name, eqn.params
  if name in _INLINED and _INLINED[name] in params:
    sub = params[_INLINED[name]]
    if hasattr(sub, "consts"):
      return _eval(sub.jaxpr, sub.consts, invals)
    return _eval(sub, (), invals)
  if name in ("checkpoint", "remat", "remat2"):
    body = lambda *a: _eval(params["jaxpr"], (), list(a))
    return jax.checkpoint(body, prevent_cse=params.get("prevent_cse", True),
                          policy=params.get("policy"))(*invals)
  if name == "reduce_precision":
    return invals[0]
  avals = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in invals]
  params = {k: _widen_param(v) for k, v in params.items()}
  if name == "scan":
    n_pre = params["num_consts"] + params["num_carry"]
    body = avals[:n_pre] + [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in avals[n_pre:]]
    params["jaxpr"] = _closed(params["jaxpr"], body)
  elif name == "cond":
    params["branches"] = tuple(_closed(b, avals[1:]) for b in params["branches"])
  elif name == "while":
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    carry = avals[nc + nb:]
    params["cond_jaxpr"] = _closed(params["cond_jaxpr"], avals[:nc] + carry)
    params["body_jaxpr"] = _closed(params["body_jaxpr"], avals[nc:nc + nb] + carry)
  try:
    return eqn.primitive.bind(*invals, **params)
  except Exception as e:  # an operation that exists only in a narrow type
    raise ValueError(
        f"cannot compute `{name}` in float32 ({type(e).__name__}: {e}); pass the same "
        f"loss built in float32 (e.g. the model with dtype=float32 and XLA attention) as "
        f"fp32_loss_fn=") from e
