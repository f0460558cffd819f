"""How annotated regions appear in a traced jaxpr: name scopes `piper:TAG=INDEX`.

`piper_jax.annotate` writes them, numbering each tag's entries in trace order; the trace
reads them back. The format and the counters live here, below both.
"""

from __future__ import annotations

import re
import threading

__all__ = ["RESERVED", "enter_scope", "parse_scope", "reset_counters"]

_SCOPE_PREFIX = "piper:"
_SCOPE_RE = re.compile(r"piper:([A-Za-z_][A-Za-z0-9_]*)=(\d+)")
# Tags the compiler adds itself (microbatches, passes).
RESERVED = frozenset({"MB", "PASS"})


class _Counters(threading.local):
  def __init__(self):
    self.next_index: dict[str, int] = {}


_counters = _Counters()


def reset_counters() -> None:
  """Starts the per-tag indices at 0 again (the compiler calls it before tracing)."""
  _counters.next_index.clear()


def enter_scope(tag: str) -> str:
  """The name scope of `tag`'s next region: each entry of a tag gets the next index."""
  index = _counters.next_index.get(tag, 0)
  _counters.next_index[tag] = index + 1
  return f"{_SCOPE_PREFIX}{tag}={index}"


def parse_scope(name_stack: str) -> tuple[tuple[str, int], ...]:
  """The (tag, index) pairs of the annotations in a jaxpr equation's name stack."""
  return tuple((tag, int(index)) for tag, index in _SCOPE_RE.findall(name_stack))
