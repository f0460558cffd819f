"""`annotate`: mark regions of a model for the compiler (PP stages, EP regions, ...)."""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Callable

import jax

from piper_jax.lowering import RESERVED, enter_scope, parse_scope, reset_counters

__all__ = ["annotate", "parse_scope", "reset_counters"]


class annotate(contextlib.ContextDecorator):
  """Marks a region of the model with `tag`; each entry of a tag gets the next index.

  Use as a context manager (``with pj.annotate("PP"): x = block(x)``) or as a
  decorator of a function or a Flax ``__call__``. Indices count per tag in trace
  order (PP=0, PP=1, ...), and tags nest (an EP region inside a PP region).

  Args:
    tag: the region's tag, e.g. "PP" or "EP". "MB" and "PASS" are reserved.
  """

  def __init__(self, tag: str):
    if not isinstance(tag, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", tag):
      raise ValueError(f"annotate tag must be an identifier like 'PP', got {tag!r}")
    if tag in RESERVED:
      raise ValueError(f"annotate tag {tag!r} is reserved for the compiler; use another name")
    self.tag = tag
    self._scopes: list[contextlib.AbstractContextManager] = []

  def __enter__(self):
    scope = jax.named_scope(enter_scope(self.tag))
    scope.__enter__()
    self._scopes.append(scope)
    return self

  def __exit__(self, *exc):
    return self._scopes.pop().__exit__(*exc)

  def __call__(self, fn: Callable) -> Callable:
    tag = self.tag

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
      with annotate(tag):
        return fn(*args, **kwargs)

    return wrapped
