"""Everything that touches JAX internals, in one place (jax 0.10 - 0.12)."""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import jax

__all__ = ["shard_map", "shard_map_unchecked", "bind", "eval_eqns", "name_stack", "read",
           "wrapped_parts", "ClosedJaxpr", "Jaxpr", "Literal", "Var"]

try:  # jax >= 0.7
  shard_map = jax.shard_map
except AttributeError:  # pragma: no cover
  from jax.experimental.shard_map import shard_map  # type: ignore

from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var  # noqa: E402


def shard_map_unchecked(fn, mesh, in_specs, out_specs):
  """`shard_map` without its replication checks (piper-jax places its collectives
  itself): `check_vma=False`, or `check_rep=False` on older jax."""
  try:
    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  except TypeError:  # older jax
    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)

try:
  from jax._src import source_info_util as _source_info
except ImportError:  # pragma: no cover
  _source_info = None

try:
  from jax._src import linear_util as _lu
  from jax._src.util import Unhashable as _Unhashable
except ImportError:  # pragma: no cover
  _lu = _Unhashable = None


def wrapped_parts(x) -> tuple | None:
  """What one of JAX's function wrappers computes with, or None for other values: a
  `WrappedFun`'s function, transformations and parameters (a custom derivative's
  backward, made anew by each trace), a store's value, an unhashable's value."""
  if _lu is None:  # pragma: no cover
    return None
  if isinstance(x, _lu.WrappedFun):
    return (x.f, x.transforms, x.params)
  if isinstance(x, _lu.Store):
    return (x._val,)
  if isinstance(x, _lu.EqualStore):
    return (x._store._val,)
  if isinstance(x, _Unhashable):
    return (x.val,)
  return None


def name_stack(eqn) -> str:
  """The equation's name stack (the `jax.named_scope`s it was traced under), as text."""
  return str(eqn.source_info.name_stack)


def read(env: dict, v) -> Any:
  """The value of a jaxpr variable (or literal) in `env`."""
  return v.val if isinstance(v, Literal) else env[v]


def bind(eqn, vals: Sequence[Any], **params) -> list:
  """Binds the equation's primitive on `vals` (with `params` overriding its own); a list."""
  bind_params = eqn.primitive.get_bind_params({**eqn.params, **params})
  subfuns = []
  if isinstance(bind_params, tuple):  # older jax: (subfuns, params)
    subfuns, bind_params = bind_params
  ctx = getattr(eqn, "ctx", None)
  manager = getattr(ctx, "manager", None) or contextlib.nullcontext()
  with manager, _user_context(eqn):
    ans = eqn.primitive.bind(*subfuns, *vals, **bind_params)
  return list(ans) if eqn.primitive.multiple_results else [ans]


def _user_context(eqn):
  """Re-binds under the equation's own name scopes and traceback (as `jax.core.eval_jaxpr`
  does), so the compiled program's ops keep the model's names ("GPT/block_3/ln1/mul")
  in HLO metadata, profiles and dumps."""
  if _source_info is None:  # pragma: no cover
    return contextlib.nullcontext()
  info = eqn.source_info
  return _source_info.user_context(
      info.traceback, name_stack=_source_info.current_name_stack() + info.name_stack)


def eval_eqns(eqns: Sequence[Any], env: dict, prepare=None) -> dict:
  """Evaluates jaxpr equations in order, reading and writing `env` (Var -> value).

  `prepare(eqn, vals)`, if given, returns the values an equation is bound on and the
  parameters that override its own.
  """
  for eqn in eqns:
    vals, params = [read(env, v) for v in eqn.invars], {}
    if prepare is not None:
      vals, params = prepare(eqn, vals)
    for v, x in zip(eqn.outvars, bind(eqn, vals, **params)):
      env[v] = x
  return env
