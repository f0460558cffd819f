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
  """The nodes of `kinds` that `f` matches, in graph order: those `matches` accepts.

  The nodes come from the graph's tag index, one set per (tag, value) of `f`
  intersected, so a plan of thousands of order filters does not scan every node
  for each of them.
  """
  if not f:
    return [n for n in graph.nodes.values() if n.kind in kinds]
  sets = sorted((graph.tagged(tag, want) for tag, want in f), key=len)
  ids = sets[0].intersection(*sets[1:])
  nodes = (graph.nodes[i] for i in sorted(ids, key=graph.position.__getitem__))
  return [n for n in nodes if n.kind in kinds]
