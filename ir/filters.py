"""Filters select DAG nodes by their tags: `{TAG: index | "*"}`, keys ANDed, `{}` all."""

from __future__ import annotations

from piper_jax.ir.directives import Filter
from piper_jax.ir.graph import Graph, Node, NodeKind

__all__ = ["matches", "select"]


def matches(f: Filter, node: Node) -> bool:
  """Whether `node` carries every tag of `f` with the given value ("*" = any value)."""
  values = node.tag_values()
  for tag, want in f:
    if tag not in values:
      return False
    if want != "*" and values[tag] != want:
      return False
  return True


def select(graph: Graph, f: Filter, kinds=(NodeKind.COMPUTE, NodeKind.UPDATE)) -> list[Node]:
  """The nodes of `kinds` that `f` matches, in graph order."""
  return [n for n in graph.nodes.values() if n.kind in kinds and matches(f, n)]
