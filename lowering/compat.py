"""Everything that touches JAX internals, in one place (jax 0.10 - 0.12)."""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import jax

__all__ = ["shard_map", "bind", "eval_eqns", "name_stack", "read", "Literal", "Var"]

try:  # jax >= 0.7
  shard_map = jax.shard_map
except AttributeError:  # pragma: no cover
  from jax.experimental.shard_map import shard_map  # type: ignore

from jax.extend.core import Literal, Var  # noqa: E402


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
  with manager:
    ans = eqn.primitive.bind(*subfuns, *vals, **bind_params)
  return list(ans) if eqn.primitive.multiple_results else [ans]


def eval_eqns(eqns: Sequence[Any], env: dict) -> dict:
  """Evaluates jaxpr equations in order, reading and writing `env` (Var -> value)."""
  for eqn in eqns:
    for v, x in zip(eqn.outvars, bind(eqn, [read(env, v) for v in eqn.invars])):
      env[v] = x
  return env
